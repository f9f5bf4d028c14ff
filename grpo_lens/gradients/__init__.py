"""Per-rollout gradients of a model: exact (one backward per rollout) and sketched (hooks on one batched backward).

params          which parameters and linear layers are measured
scores          the differentiated quantity s_i (the weighted log-prob sum of rollout i) and its weights
exact           exact per-rollout gradients, the oracle
sketch          LoGra sketches of every nn.Linear weight from one backward (GradientCapture), sketched norms
gram            the exact per-rollout Gram of every parameter from one backward (GramCapture)
g2              G2 of every linear layer under several row weightings from one backward
token_credit    per-token directional derivatives and Monte Carlo prefix values (model calls)
lora_spaces     the gradient spaces of a LoRA policy (the adapter, or the frozen base weights)

The math these use lives in :mod:`grpo_lens.formulas`.
"""
