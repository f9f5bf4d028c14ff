"""The formulas of docs/theory.md as small pure functions: tensors (or numbers) in, tensors or numbers out.

One module per topic of docs/theory.md; each formula has exactly one body, here. Nothing in this package imports the
trainer, the probe, the report or a model: it needs only torch and the standard library.

advantages      advantage estimators (grpo, dr_grpo, rloo, reinforce, optimal) and groups without reward contrast
baselines       the variance-optimal constant baseline b*, m_C / m_W, baselines at matched expectation
losses          the clipped surrogate, KL estimators, loss aggregations and the per-rollout gradient weights
overlong        overlong completions: masks, filters and DAPO's soft penalty
identity        the rank-2 identity's constants c(k, R)
spectrum        singular values, rank measures (erank, stable rank, ...), the orthogonal null, G1 / G2 / G3
zero_sum        the label-permutation test with k fixed, span energy, cosine gap, the row weightings
stats           intervals (bootstrap, Wilson), summaries over groups, the Spearman trend test
sparsity        S1 (groups without reward contrast, predicted without bias), Hoyer, bf16 rounding controls
credit          token credit: advantages per token, position profiles, answer spans, Monte Carlo segments
sketch_error    the Kronecker sketch's variance and its Gram error bound
"""
