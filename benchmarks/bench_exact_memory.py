"""Peak memory of exact per-rollout gradients ([N, P], the probe's sketch check) filled in place vs stacked from rows.

Each variant runs in its own process (peak resident memory is a per-process maximum) on the same rollouts: ``inplace``
is :func:`grpo_lens.diagnostics.exact_rollout_grads`; ``stack`` is the same loop collecting rows in a list and calling
``torch.stack`` (the previous implementation, which holds the matrix twice at the end). Prints each peak, the [N, P]
matrix's own size and the ratio of the peaks.

    python benchmarks/bench_exact_memory.py [--model smollm2-135m-instruct --rollouts 8 --max-new-tokens 24]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys


def child(variant: str, model_name: str, rollouts: int, max_new_tokens: int) -> None:
    """One variant in this process: print its peak resident memory, the peak before the gradients (GiB) and the
    [N, P] matrix's size (GiB), N = ``rollouts`` of one arithmetic prompt."""
    import torch

    from grpo_lens.gradients.exact import _flat_grad, exact_rollout_grads
    from grpo_lens.gradients.params import select_parameters
    from grpo_lens.gradients.scores import rollout_scores
    from grpo_lens.models import load_model
    from grpo_lens.rollout import batch_logprobs, sample_groups
    from grpo_lens.tasks import get_task

    policy, tokenizer = load_model(model_name, dtype=torch.float32, device="cpu")
    policy.eval()
    batch = sample_groups(
        policy,
        tokenizer,
        get_task("arithmetic").sample(1, seed=0),
        rollouts,
        max_new_tokens=max_new_tokens,
        temperature=0.7,
        generator_seed=0,
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if variant == "inplace":
        grads = exact_rollout_grads(policy, batch, temperature=0.7)
    else:
        chosen = [p for _, p in select_parameters(policy, None)]
        rows = []
        for i in range(batch.num_rollouts):
            sub = batch.select([i])
            rows.append(_flat_grad(rollout_scores(batch_logprobs(policy, sub, 0.7), sub.completion_mask)[0], chosen))
        grads = torch.stack(rows)
        del rows
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{peak:.2f} {before:.2f} {grads.numel() * grads.element_size() / 2**30:.2f}")


def main() -> None:
    """Run both variants, each in a child process, and print their peaks and the ratio."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.model, args.rollouts, args.max_new_tokens)
    peaks = {}
    for variant in ("stack", "inplace"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                variant,
                "--model",
                args.model,
                "--rollouts",
                str(args.rollouts),
                "--max-new-tokens",
                str(args.max_new_tokens),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        peak, before, matrix = map(float, out[-3:])
        peaks[variant] = peak
        print(
            f"{variant:>8}: peak {peak:.2f} GiB (before the gradients {before:.2f} GiB; the [N, P] matrix "
            f"{matrix:.2f} GiB)"
        )
    print(f"peak inplace / stack = {peaks['inplace'] / peaks['stack']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
