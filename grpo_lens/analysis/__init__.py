"""The one per-group analysis path shared by the trainer's lens and the probe (:func:`group.analyse_group`).

It composes :mod:`grpo_lens.formulas` into the per-group keys of :mod:`grpo_lens.metrics` (docs/metrics.md); callers
only aggregate the rows it returns.
"""
