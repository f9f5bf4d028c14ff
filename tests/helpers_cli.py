"""The command line of a tiny ``grpo-lens train`` run, shared by the CLI tests: the tiny model, R = 2, one prompt, two
new tokens, no lens, no final model; a second if the input is fine. Tests add ``--rewards``, ``--out`` and the flag
under test."""

from __future__ import annotations


def tiny_train_args(max_steps: int = 1) -> list[str]:
    """argv for :func:`grpo_lens.cli.main` (``train`` first), ``max_steps`` steps, no ``--rewards`` or ``--out``."""
    return [
        "train",
        "--model",
        "tiny",
        "--group-size",
        "2",
        "--prompts-per-step",
        "1",
        "--max-new-tokens",
        "2",
        "--max-steps",
        str(max_steps),
        "--lens-every",
        "0",
        "--no-progress",
        "--device",
        "cpu",
        "--no-save-final-model",
    ]
