"""GRPO training: the loop (:func:`grpo_lens.train.loop.train`) and what it calls; the lens it runs is
:mod:`grpo_lens.lens`, processes, sharding and memory :mod:`grpo_lens.runtime`.

loop              the training loop, read top to bottom
checks            the start-up checks: every input refused before --out is written
state             what the loop carries from step to step, and the Lens protocol
step_logs         each step's record, its one-line summary, completions and progress
update            the policy update: mu passes over mini- and micro-batches, AdamW, gradient clipping
step_metrics      rewards, accuracy and the per-step metric records
dynamic_sampling  DAPO's dynamic sampling: extra rounds until enough groups have reward contrast
"""
