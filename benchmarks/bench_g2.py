"""The probe's G2 weightings on one mixed group, side by side: the pieces, the eigen-solver batched or one at a time.

The probe's zero-sum row on G2 needs, per analysed group, the stable rank of every nn.Linear layer's G2 under six
weightings (:class:`grpo_lens.gradients.g2.G2WeightingCapture`). This script samples one mixed group of R rollouts of
the default model (arithmetic task, the probe's sampling settings) and prints, in one run:

    exact Gram pass      ``exact_rollout_gram`` alone (the group's analysis pass, the probe's default source)
    exact Gram + G2      the same pass with the probe's G2 capture inside it (``captures=[...]``: one forward and
                         backward; the group's prompt folded as its shared prefix), as the probe runs it
    G2 pass alone        ``grpo_lens.probe.gradient_sources.g2_weightings`` (its own forward and backward to the
                         embeddings)
    G2 pass, unfolded    the same with one row per rollout and position (no shared prefix: the earlier capture's
                         row count)
    eigen, batched       every lambda_max problem of the folded capture as it solves them (all layers and weightings
                         of one row count in one batch,
                         :func:`grpo_lens.formulas.spectrum.top_eigenvalues_psd_products`)
    eigen, one at a time the same problems one at a time (the capture's earlier loop)

and the largest relative differences: batched vs one-at-a-time eigenvalues, fused vs separate and folded vs unfolded
stable ranks. Medians over ``--repeats``; the machine's
load average before and after (a shared machine: only the side-by-side ratios mean much).

    python benchmarks/bench_g2.py [--group-size 8] [--repeats 3] [--model tiny]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

importlib.import_module("grpo_lens")  # first: it sets OMP_WAIT_POLICY before torch loads OpenMP
import torch  # noqa: E402
from common import load_avg  # noqa: E402

import grpo_lens.gradients.g2 as g2_module  # noqa: E402
from grpo_lens.formulas.advantages import compute_advantages, constant_groups  # noqa: E402
from grpo_lens.formulas.spectrum import (  # noqa: E402
    top_eigenvalue_psd_product,
    top_eigenvalues_psd_products,
)
from grpo_lens.formulas.zero_sum import weightings  # noqa: E402
from grpo_lens.gradients.g2 import G2WeightingCapture  # noqa: E402
from grpo_lens.gradients.gram import exact_rollout_gram  # noqa: E402
from grpo_lens.gradients.scores import rollout_scores  # noqa: E402
from grpo_lens.models import load_model  # noqa: E402
from grpo_lens.probe.config import ProbeConfig  # noqa: E402
from grpo_lens.probe.gradient_sources import g2_capture, g2_weightings, score_weights  # noqa: E402
from grpo_lens.rewards import parse_reward_specs, score_batch  # noqa: E402
from grpo_lens.rollout import batch_logprobs, sample_groups  # noqa: E402
from grpo_lens.tasks import get_task  # noqa: E402


def mixed_group(policy, tokenizer, config: ProbeConfig, R: int, seed: int = 0):
    """The first mixed group of R rollouts (seeds seed, seed + 1, ...): (RolloutBatch, rewards [R])."""
    task, fns = get_task(config.task, **config.task_options), parse_reward_specs(config.rewards)
    for s in range(seed, seed + 50):
        batch = sample_groups(
            policy,
            tokenizer,
            task.sample(1, seed=s),
            R,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            generator_seed=s,
        )
        rewards, valid, _ = score_batch(batch, fns)
        if bool(valid.all()) and not bool(constant_groups(rewards, valid)[0]):
            return batch, rewards[0]
    raise RuntimeError("no mixed group in 50 draws")


def timed(fn, repeats: int) -> tuple[float, object]:
    """(median seconds over ``repeats`` calls, the last call's result)."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    """Print the side-by-side table for one group."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="model alias or path (default: the probe's default model)")
    args = ap.parse_args()
    config = ProbeConfig(**({"model": args.model} if args.model else {}))
    print(f"load average before: {load_avg()}; torch threads {torch.get_num_threads()}")
    policy, tokenizer = load_model(config.model, dtype=torch.float32, device="cpu")
    policy.eval()  # as the probe: no dropout
    sub, rewards = mixed_group(policy, tokenizer, config, args.group_size)
    adv = compute_advantages(rewards.view(1, -1).double(), "grpo")[0]
    proc = dict(temperature=config.temperature, score_weights=score_weights(sub, config))
    extra = {"advantages": adv}

    problems: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording(kx, kds, **kw):
        problems.append((kx, kds))
        return top_eigenvalues_psd_products(kx, kds, **kw)

    def fused():
        capture = g2_capture(policy, sub, adv, rewards)
        exact_rollout_gram(policy, sub, captures=[capture], **proc)
        return capture.result()

    def unfolded():
        capture = G2WeightingCapture(policy, weightings(adv, rewards))
        with capture:
            torch.autograd.grad(
                rollout_scores(
                    batch_logprobs(policy, sub, config.temperature), sub.completion_mask, proc["score_weights"]
                ).sum(),
                list(policy.parameters()),
                allow_unused=True,
            )
        return capture.result()

    t_gram, _ = timed(lambda: exact_rollout_gram(policy, sub, **proc), args.repeats)
    t_fused, fused_out = timed(fused, args.repeats)
    t_alone, alone_out = timed(lambda: g2_weightings(policy, sub, extra, rewards, config), args.repeats)
    t_unfolded, unfolded_out = timed(unfolded, args.repeats)
    g2_module.top_eigenvalues_psd_products = recording
    try:
        g2_weightings(policy, sub, extra, rewards, config)
    finally:
        g2_module.top_eigenvalues_psd_products = top_eigenvalues_psd_products
    t_batched, batched = timed(lambda: [top_eigenvalues_psd_products(kx, kds)[0] for kx, kds in problems], args.repeats)
    t_single, single = timed(
        lambda: [
            torch.tensor([top_eigenvalue_psd_product(kx[j], kds[j])[0] for j in range(kds.shape[0])])
            for kx, kds in problems
        ],
        args.repeats,
    )
    diff = max(float(((b - s).abs() / s.abs().clamp(min=1e-300)).max()) for b, s in zip(batched, single))

    def rel(a, b):
        return max(abs(a[k] - b[k]) / abs(b[k]) for k in b if b[k])

    n = sum(kds.shape[0] for _, kds in problems)
    print(
        f"model {config.model}, R = {args.group_size}, completion tokens {int(sub.completion_mask.sum())}, "
        f"{n} lambda_max problems (layers x weightings) in {len(problems)} batches, median of {args.repeats}"
    )
    print("| piece | seconds | ratio |\n|---|---|---|")
    for name, t, base in (
        ("exact Gram pass", t_gram, t_gram),
        ("exact Gram + G2 in one pass", t_fused, t_gram),
        ("G2 pass alone", t_alone, t_gram),
        ("G2 pass, unfolded", t_unfolded, t_gram),
        ("eigen, batched", t_batched, t_single),
        ("eigen, one at a time", t_single, t_single),
    ):
        print(f"| {name} | {t:.2f} | {t / base:.2f}x |")
    print(
        f"max relative differences: eigenvalues batched vs one at a time {diff:.1e}; G2 stable ranks fused vs "
        f"separate {rel(fused_out, alone_out):.1e}, folded vs unfolded {rel(alone_out, unfolded_out):.1e}"
    )
    print(f"load average after: {load_avg()}")


if __name__ == "__main__":
    main()
