"""The TRL lens on several processes: ``accelerate launch --cpu --num_processes 2`` runs LensGRPOTrainer on the tiny
model (2 steps, the lens on both), then checks the run directory: one metrics.jsonl record per step, the lens's groups
counted over both processes' shares of the batch, and ``grpo-lens report`` reads it.

    python benchmarks/trl_processes.py --out /tmp/trl_mp       # launches the two processes itself

Issue 44 asked for the multi-process TRL lens to be run at all (DDP on CPU here; ZeRO and FSDP need GPUs). It prints
the seconds and the lens's group counts; equality with one process is not checked (each process samples its own
completions, so the batches differ).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

R = 4


def parity(completions, **kwargs):
    """1 when the completion's UTF-8 byte sum is odd: a coin flip per rollout on the random tiny model."""
    return [float(sum(c.encode()) % 2) for c in completions]


def child(out: Path) -> None:
    from datasets import Dataset
    from trl import GRPOConfig

    from grpo_lens.integrations.trl import LensGRPOTrainer
    from grpo_lens.models import build_tiny_model

    model, tok = build_tiny_model(seed=0)
    data = Dataset.from_dict({"prompt": [f"What is {a} + {a + 1}?" for a in range(16)]})
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=2 * R,  # two groups per process, four in all
        num_generations=R,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-2,
        beta=0.0,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        bf16=False,
        disable_tqdm=True,
    )
    trainer = LensGRPOTrainer(
        model=model, reward_funcs=parity, args=args, train_dataset=data, processing_class=tok, lens_every=1
    )
    trainer.train()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        child(a.out)
        return 0
    run = a.out / "run"
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", __file__, "--child", "--out", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        print(done.stderr[-4000:])
        print(f"accelerate launch failed (exit {done.returncode}) after {seconds:.0f} s")
        return 1
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    groups = [r.get("rank/mixed_groups") for r in records]
    print(f"2 processes: {seconds:.0f} s; records at steps {[r['step'] for r in records]}; mixed groups {groups}")
    from grpo_lens.cli import main as cli

    print("grpo-lens report:", cli(["report", str(run)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
