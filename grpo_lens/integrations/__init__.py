"""The lens inside other trainers (optional dependencies: each integration imports its library only when used).

- :mod:`grpo_lens.integrations.trl`: TRL's ``GRPOTrainer`` (``pip install '.[trl]'`` in the grpo-lens folder).
"""
