"""The lens: grpo-lens' per-step measurement of GRPO's gradient inside a trainer, called by the trainer
(:mod:`grpo_lens.train`), the TRL integration (:mod:`grpo_lens.integrations.trl`) and nothing below them.

trainer_lens      TrainerLens: the per-group analysis of the step's own rollouts (exact or sketched Gram, the
                  analysis in :mod:`grpo_lens.analysis.group`), the noise scale, the Gram read off the update
settings          LensSettings, the typed settings the lens reads (from a TrainConfig or a TRL GRPOConfig)
sparsity          the update's and the gradient's sparsity over training on a fixed sample of the weights
"""
