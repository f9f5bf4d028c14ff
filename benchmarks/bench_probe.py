"""The default ``grpo-lens probe`` against its targets: wall time <= 8 min on a 2-core CPU, >= 16 mixed groups per R,
and its ratio to the probe's FLOP floor.

Runs ``grpo-lens probe --out DIR`` with no other settings (the default model, task, group sizes and prompt counts) in
this process and prints, per R, the prompts sampled, the mixed groups and their ratio to the 16 the analysis wants,
generation and gradient seconds; then the studies' seconds and the total wall time with its ratio to the 480 s
target and to the FLOP floor. The machine's load average is printed before and after: timings from a loaded machine
say little.

The FLOP floor counts the dense work the probe cannot avoid, at the machine's float32 matmul throughput measured in
the same run (the best square product before and after the probe, :func:`common.gemm_flops_per_s`): 2 P FLOPs per
generated token (completions, and each distinct prompt once) and 6 P per position of a forward + backward (P: the
model's parameters; Kaplan et al. 2020, arXiv 2001.08361, §2.1). Backward rows: every analysed group's R rollouts
and each baseline prompt's M (R phases), the baseline study's M = 4R rollouts per prompt with contrast, the credit
study's 2 backward + 4 forward passes per group (~ 2 x 10 P per position, over the group's prompt once and its R
completions), and the Monte Carlo continuations (generation). Positions per rollout and tokens per generated
rollout are the probe's own means (probe.json meta.timing; a prompt's positions: the first minus the second).

    python benchmarks/bench_probe.py [--out DIR] [--threads N] [-- extra probe flags, e.g. --prompts 8]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TARGET_SECONDS = 480.0
TARGET_MIXED = 16


def flop_floor(data: dict) -> dict[str, float]:
    """FLOPs of the probe's unavoidable dense work, by part (module doc), from its probe.json."""
    meta, studies = data["meta"], data.get("studies", {})
    P = float(meta["parameters"])
    t = meta.get("timing", {})
    rollouts = max(1, t.get("generation_rollouts", 0))
    gen_tokens_per = t.get("generation_tokens", 0) / rollouts  # per generated rollout
    positions_per = t.get("rollout_positions", 0) / rollouts  # per rollout in a backward
    rows = 0
    for R, d in data["per_group_size"].items():
        rows += d["groups_mixed"] * int(R) + d["baselines"]["prompts"] * d["rollouts_per_prompt"]
    out = {"generation": 2 * P * t.get("generation_tokens", 0), "R phases backward": 6 * P * positions_per * rows}
    base = studies.get("baselines")
    if base:
        m = base["meta"]
        out["baseline study"] = (
            6 * P * positions_per * m["prompts_with_contrast"] * m["rollouts_per_prompt"]
            + 2
            * P
            * gen_tokens_per
            * (m["prompts_sampled"] - m.get("presampled_prompts", 0))
            * m["rollouts_per_prompt"]
        )
    credit = studies.get("credit")
    if credit:
        m, rs = credit["meta"], credit["meta"]["group_size"]
        mc = credit["monte_carlo"]
        continuations = len(mc["rollouts"]) * 3 * mc["samples_per_prefix"]
        # each pass runs the group's prompt once and its rs completions (grpo_lens.rollout.group_logprobs)
        group_positions = max(0.0, positions_per - gen_tokens_per) + rs * gen_tokens_per
        out["credit study"] = 20 * P * group_positions * credit["contributions"]["groups"] + 2 * P * gen_tokens_per * (
            m["groups_sampled"] * rs + continuations
        )
    return out


def main() -> None:
    """Run the default probe once in this process and print its counts and timings against the targets."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="probe output directory (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]

    importlib.import_module("grpo_lens")  # first: it sets OMP_WAIT_POLICY before torch loads OpenMP
    import logging

    import torch
    from common import gemm_flops_per_s, load_avg

    from grpo_lens.cli import build_parser
    from grpo_lens.config import config_from_args
    from grpo_lens.probe.config import ProbeConfig
    from grpo_lens.probe.run import run_probe

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the probe's estimate and phases
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_probe_"))
    probe_args = build_parser().parse_args(["probe", "--out", str(out), "--overwrite", "--no-progress", *extra])
    config = config_from_args(probe_args, ProbeConfig, probe_args.config)
    flops_before = gemm_flops_per_s()
    print(
        f"load average before: {load_avg()}; torch threads {torch.get_num_threads()}; float32 matmul "
        f"{flops_before / 1e9:.1f} GFLOP/s; settings beyond the defaults: {extra or 'none'}",
        flush=True,
    )
    t0 = time.perf_counter()
    run_probe(config)
    wall = time.perf_counter() - t0
    load_after = load_avg()
    flops_after = gemm_flops_per_s()
    data = json.loads((out / "probe.json").read_text())
    print(f"{'R':>3} {'prompts':>8} {'mixed':>6} {'mixed/16':>9} {'S1':>6} {'gen s':>7} {'grad s':>7} {'R s':>6}")
    for R, d in data["per_group_size"].items():
        t = d["timing"]
        print(
            f"{R:>3} {d['prompts_sampled']:>8} {d['groups_mixed']:>6} {d['groups_mixed'] / TARGET_MIXED:>9.2f} "
            f"{d['s1_measured']:>6.3f} {t['generation_seconds']:>7.0f} {t['gradient_seconds']:>7.0f} "
            f"{t['seconds']:>6.0f}"
        )
    studies = {k: v["meta"]["seconds"] for k, v in data.get("studies", {}).items()}
    print(
        f"studies {data['meta']['studies_seconds']:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in studies.items())})"
        f"; draws {data['meta'].get('draws')}, prompts per generate call {data['meta'].get('prompts_per_batch')}"
    )
    est = data["meta"].get("timing", {}).get("estimate_seconds") or {}
    if est:
        print(f"the probe's own estimate after its first batch: {sum(est.values()):.0f} s")
    rate = max(flops_before, flops_after)  # the less loaded moment: the floor is what the machine can do
    floor = flop_floor(data)
    floor_s = sum(floor.values()) / rate
    print(
        "FLOP floor at {:.1f} GFLOP/s (best of before {:.1f} / after {:.1f}): {} = {:.0f} s".format(
            rate / 1e9,
            flops_before / 1e9,
            flops_after / 1e9,
            ", ".join(f"{k} {v / rate:.0f} s" for k, v in floor.items()),
            floor_s,
        )
    )
    print(
        f"wall {wall:.0f} s = {wall / TARGET_SECONDS:.2f} x the {TARGET_SECONDS:.0f} s target, "
        f"{wall / floor_s:.1f} x the FLOP floor (model load and report included); load average after: {load_after}"
    )
    print(f"written to {out}")


if __name__ == "__main__":
    sys.exit(main())
