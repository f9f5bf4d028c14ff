"""The default ``grpo-lens probe`` against its targets: wall time <= 8 min on a 2-core CPU, >= 16 mixed groups per R.

Runs ``grpo-lens probe --out DIR`` with no other settings (the default model, task, group sizes and prompt counts) in
this process and prints, per R, the prompts sampled, the mixed groups and their ratio to the 16 the analysis wants,
generation and gradient seconds; then the studies' seconds and the total wall time with its ratio to the 480 s
target. The machine's load average is printed before and after: timings from a loaded machine say little.

    python benchmarks/bench_probe.py [--out DIR] [--threads N] [-- extra probe flags, e.g. --prompts 8]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

TARGET_SECONDS = 480.0
TARGET_MIXED = 16


def main() -> None:
    """Run the default probe once in this process and print its counts and timings against the targets."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="probe output directory (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]

    importlib.import_module("grpo_lens")  # first: it sets OMP_WAIT_POLICY before torch loads OpenMP
    import torch

    from grpo_lens.cli import build_parser
    from grpo_lens.config import config_from_args
    from grpo_lens.probe.config import ProbeConfig
    from grpo_lens.probe.run import run_probe

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_probe_"))
    probe_args = build_parser().parse_args(["probe", "--out", str(out), "--overwrite", "--no-progress", *extra])
    config = config_from_args(probe_args, ProbeConfig, probe_args.config)
    print(f"load average before: {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}; "
          f"settings beyond the defaults: {extra or 'none'}")
    t0 = time.perf_counter()
    run_probe(config)
    wall = time.perf_counter() - t0
    data = json.loads((out / "probe.json").read_text())
    print(f"{'R':>3} {'prompts':>8} {'mixed':>6} {'mixed/16':>9} {'S1':>6} {'gen s':>7} {'grad s':>7} {'R s':>6}")
    for R, d in data["per_group_size"].items():
        t = d["timing"]
        print(f"{R:>3} {d['prompts_sampled']:>8} {d['groups_mixed']:>6} {d['groups_mixed'] / TARGET_MIXED:>9.2f} "
              f"{d['s1_measured']:>6.3f} {t['generation_seconds']:>7.0f} {t['gradient_seconds']:>7.0f} "
              f"{t['seconds']:>6.0f}")
    print(f"studies {data['meta']['studies_seconds']:.0f} s; wall {wall:.0f} s = {wall / TARGET_SECONDS:.2f} x the "
          f"{TARGET_SECONDS:.0f} s target (model load and report included); load average after: "
          f"{os.getloadavg()[0]:.2f}")
    print(f"written to {out}")


if __name__ == "__main__":
    sys.exit(main())
