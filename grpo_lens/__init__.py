"""grpo-lens: train language models with GRPO and measure what GRPO's gradient is.

The math lives in small pure modules (:mod:`grpo_lens.advantages`, :mod:`grpo_lens.losses`,
:mod:`grpo_lens.diagnostics`); :mod:`grpo_lens.trainer` is the loop that calls them.
Shape letters used in every docstring: B prompts, R group size, N = B*R rollouts, T completion tokens,
P parameters.
"""

__version__ = "0.1.0"
