"""GRPO training: the loop (:func:`grpo_lens.train.loop.train`) and what it calls.

loop              the training loop, read top to bottom, and the start-up checks
update            the policy update: mu passes over mini- and micro-batches, AdamW, gradient clipping
step_metrics      rewards, accuracy and the per-step metric records
processes         several processes (torchrun / accelerate): sums and gathers
sharding          --parallelism: the policy replicated (ddp) or sharded with FSDP2 (fsdp2), full-state checkpoints
memory            micro-batch sizing from the model's activation memory
lens              the lens inside the trainer (per-group analysis of the step's own rollouts, update sparsity)
lens_settings     LensSettings, the typed settings the lens reads (from a TrainConfig or a TRL GRPOConfig)
sparsity          the update's and the gradient's sparsity on a fixed sample of the weights
dynamic_sampling  DAPO's dynamic sampling: extra rounds until enough groups have reward contrast
"""
