"""The formulas of docs/theory.md as small pure functions: tensors (or numbers) in, tensors or numbers out.

One module per topic of docs/theory.md; each formula has exactly one body, here. Nothing in this package imports the
trainer, the probe, the report or a model: it needs only torch, the standard library, :mod:`grpo_lens.registry` and,
for the keys of the dicts some formulas return, the metric vocabulary :mod:`grpo_lens.metrics` (standard library
only).

advantages      advantage estimators (grpo, dr_grpo, rloo, reinforce, optimal), the leave-one-out baselines they
                subtract, and groups without reward contrast (constant_groups)
baselines       the variance-optimal constant baseline b*, m_C / m_W, baseline variances, the study at matched
                expectation
losses          the clipped surrogate, KL estimators, loss aggregations and the per-rollout gradient weights
overlong        overlong completions: masks, filters and DAPO's soft penalty
identity        the rank-2 identity's constants c(k, R) and its residual
spectrum        singular values, rank measures (erank, stable rank, ...), G1 and its controls, the orthogonal null,
                G2's rank bound, G3
zero_sum        the label-permutation test with k fixed, span energy, cosine gap, the row weightings
stats           intervals (bootstrap, Wilson), summaries over groups, the Spearman trend test
sparsity        S1 predicted (without bias, from rollouts outside the group), Hoyer, top-1% energy, bf16 rounding
                controls, parameter layer types
credit          token credit: advantages per token, position profiles, answer spans, Monte Carlo segments
sketch_error    the Kronecker sketch's variance and its Gram error bound
"""
