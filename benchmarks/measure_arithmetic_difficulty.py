"""Measure how hard the arithmetic task is for the default model, to pick its default difficulty.

For each setting (operand range, operand count, operators, prompt template) this samples B prompts, R = 8 rollouts
each, at temperature 0.7, top_p 1, top_k 0 (the trainer's defaults), scores them with the ``correctness`` reward and
prints side by side:

- acc: share of correct rollouts (target for the default: 20%-60%);
- mixed: share of groups with both right and wrong rollouts (the groups with a policy gradient);
- mixed_pred: E[1 - p^R - (1-p)^R] over the prompts' measured success rates p (docs/theory.md §9, S1);
- trunc: share of completions cut at max_new_tokens.

Usage: python benchmarks/measure_arithmetic_difficulty.py [--prompts 48] [--model smollm2-135m-instruct]
(about a minute per setting on two CPU cores).
"""

from __future__ import annotations

import argparse
import time

import torch

from grpo_lens.models import load_model
from grpo_lens.rewards import score_batch
from grpo_lens.rollout import sample_groups
from grpo_lens.tasks import ArithmeticTask

TEMPLATES = {
    "just_number": "What is {expression}? Reply with just the number.",
    "compute": "Compute {expression}. Give only the final number.",
    "equation": "{expression} =",
}

# (label, task options)
SETTINGS = [
    ("a+b, [2,60] (reference)", dict(min_operand=2, max_operand=60)),
    ("a+b, [2,30]", dict(min_operand=2, max_operand=30)),
    ("a+b, [2,20]", dict(min_operand=2, max_operand=20)),
    ("a+b, [0,9]", dict(min_operand=0, max_operand=9)),
    ("a+b, [0,9], compute", dict(min_operand=0, max_operand=9, template=TEMPLATES["compute"])),
    ("a+b, [0,9], equation", dict(min_operand=0, max_operand=9, template=TEMPLATES["equation"])),
    ("a+b+c, [0,9]", dict(min_operand=0, max_operand=9, num_operands=3)),
    ("a*b, [0,9]", dict(min_operand=0, max_operand=9, ops="*")),
]


def measure(
    model, tokenizer, task, prompts: int, group_size: int, max_new_tokens: int, seed: int, batch_prompts: int = 8
) -> dict:
    correct, mixed, mixed_pred, truncated, rollouts = 0.0, 0, 0.0, 0, 0
    examples = task.sample(prompts, seed, split="test")
    for start in range(0, prompts, batch_prompts):
        batch = sample_groups(
            model,
            tokenizer,
            examples[start : start + batch_prompts],
            group_size,
            max_new_tokens=max_new_tokens,
            temperature=0.7,
            top_p=1.0,
            top_k=0,
            generator_seed=seed + start,
        )
        rewards, valid, _ = score_batch(batch, {"correctness": 1.0})  # [B, R]
        p = rewards.nan_to_num(0.0).mean(dim=1)  # [B] per-prompt success rate
        correct += float(rewards.nan_to_num(0.0).sum())
        mixed += int(((p > 0) & (p < 1)).sum())
        mixed_pred += float((1 - p**group_size - (1 - p) ** group_size).sum())
        truncated += int(batch.truncated.sum())
        rollouts += batch.num_rollouts
    return dict(
        acc=correct / rollouts,
        mixed=mixed / prompts,
        mixed_pred=mixed_pred / prompts,
        trunc=truncated / rollouts,
        example=batch.completions[0],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=str, default=None, help="comma-separated indices of SETTINGS to run")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    print(
        f"model={args.model} prompts={args.prompts} R={args.group_size} max_new_tokens={args.max_new_tokens} "
        "temperature=0.7 top_p=1 top_k=0"
    )
    print(f"{'setting':32s} {'acc':>6s} {'mixed':>6s} {'mixed_pred':>10s} {'trunc':>6s} {'time_s':>6s}  example")
    chosen = range(len(SETTINGS)) if args.only is None else [int(i) for i in args.only.split(",")]
    for i in chosen:
        label, options = SETTINGS[i]
        start = time.perf_counter()
        m = measure(
            model, tokenizer, ArithmeticTask(**options), args.prompts, args.group_size, args.max_new_tokens, args.seed
        )
        print(
            f"{label:32s} {m['acc']:6.3f} {m['mixed']:6.3f} {m['mixed_pred']:10.3f} {m['trunc']:6.3f} "
            f"{time.perf_counter() - start:6.1f}  {m['example']!r}",
            flush=True,
        )
    print(f"default ArithmeticTask(): {ArithmeticTask()}")


if __name__ == "__main__":
    main()
