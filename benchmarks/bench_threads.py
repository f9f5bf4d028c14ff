"""OpenMP's wait policy on a shared CPU: one probe group's gradient passes with threads that spin while they wait
(``OMP_WAIT_POLICY=ACTIVE``) against threads that sleep (``PASSIVE``, what ``import grpo_lens`` sets unless the user
set a value), side by side in one run, each in a fresh child process (the policy is read when torch loads OpenMP).

Per policy: the best of ``--repeats`` timings of a plain forward + backward of the group's scores and of the exact
Gram pass (:func:`grpo_lens.gradients.gram.exact_rollout_gram`) on one sampled group of R rollouts; then the ratio
ACTIVE / PASSIVE. The load average is printed before and after: the gap grows with the other work on the machine
(on an idle machine the two policies are expected to be close; a loaded one is where spinning threads lose).

    python benchmarks/bench_threads.py [--model tiny] [--group-size 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

POLICIES = ("ACTIVE", "PASSIVE")  # and "unset": OpenMP's own default (libgomp: spin a while, then sleep)


def worker(model_name: str, group_size: int, repeats: int) -> dict[str, float]:
    """Time the two passes in this process (its OMP_WAIT_POLICY already set); returns {pass: best seconds}."""
    import time

    import torch  # before grpo_lens, whose import would set PASSIVE where the variable is unset

    from grpo_lens.gradients.gram import exact_rollout_gram
    from grpo_lens.gradients.scores import rollout_scores
    from grpo_lens.models import load_model
    from grpo_lens.probe.config import ProbeConfig
    from grpo_lens.rollout import batch_logprobs, sample_groups
    from grpo_lens.tasks import get_task

    cfg = ProbeConfig(out="unused", model=model_name)
    policy, tokenizer = load_model(cfg.model, dtype=torch.float32, device="cpu")
    policy.eval()
    batch = sample_groups(
        policy,
        tokenizer,
        get_task(cfg.task).sample(1, seed=1),
        group_size,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        generator_seed=1,
    )

    def plain() -> None:
        rollout_scores(batch_logprobs(policy, batch, cfg.temperature), batch.completion_mask).sum().backward()
        policy.zero_grad(set_to_none=True)

    def gram() -> None:
        exact_rollout_gram(policy, batch, temperature=cfg.temperature)

    out = {}
    for name, fn in (("plain forward + backward", plain), ("exact Gram pass", gram)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = min(times)
    out["threads"] = torch.get_num_threads()
    return out


def main() -> None:
    """Run one child per policy and print the seconds and the ACTIVE / PASSIVE ratio per pass."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the default model)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        choices=[*POLICIES, "unset"],
        help="policies to time, the first is the numerator of each ratio (default: ACTIVE PASSIVE)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        from grpo_lens.probe.config import ProbeConfig

        print(json.dumps(worker(args.model or ProbeConfig().model, args.group_size, args.repeats)))
        return
    print(f"load average before: {'{:.2f} {:.2f} {:.2f}'.format(*os.getloadavg())}")
    results = {}
    for policy in args.policies:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--group-size",
            str(args.group_size),
            "--repeats",
            str(args.repeats),
        ] + (["--model", args.model] if args.model else [])
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if policy != "unset":  # the worker imports torch before grpo_lens: OpenMP reads the environment as given
            env["OMP_WAIT_POLICY"] = policy
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        results[policy] = json.loads(done.stdout.strip().splitlines()[-1])
    first, others = args.policies[0], args.policies[1:]
    print(f"R = {args.group_size}, torch threads {results[first]['threads']}, best of {args.repeats}")
    print(
        f"{'pass':<26}"
        + "".join(f" {p + ' s':>11}" for p in args.policies)
        + "".join(f" {first + ' / ' + p:>18}" for p in others)
    )
    for name in ("plain forward + backward", "exact Gram pass"):
        secs = [results[p][name] for p in args.policies]
        print(
            f"{name:<26}" + "".join(f" {t:>11.2f}" for t in secs) + "".join(f" {secs[0] / t:>18.2f}" for t in secs[1:])
        )
    print(f"load average after: {'{:.2f} {:.2f} {:.2f}'.format(*os.getloadavg())}")


if __name__ == "__main__":
    main()
