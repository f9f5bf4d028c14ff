"""The TRL lens on several processes: ``torchrun --nproc_per_node 2`` (accelerate's MULTI_CPU) runs LensGRPOTrainer on
the tiny model (2 steps, the lens on both), then checks the run directory: one metrics.jsonl record per step, the
lens's groups counted over both processes' shares of the batch, and ``grpo-lens report`` reads it. Each process saves
its share of each lens batch; one process then measures the two shares joined, with grpo-lens' own lens at the same
weights, and the lens keys must agree (rel 1e-5): the multi-process lens equals one process on the same batch.

    python benchmarks/trl_processes.py --out /tmp/trl_mp       # launches the two processes itself

It runs the multi-process TRL lens at all (DDP on CPU here; ZeRO and FSDP need GPUs), and prints
the seconds, the lens's group counts and the largest relative gap to one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

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

    class Saving(LensGRPOTrainer):
        def measure_lens(self, output):
            # this process's share of the batch, the all-process rewards, the weights (before the batch's update)
            # and what the multi-process lens measured
            result = super().measure_lens(output)
            batch, rows = self._local_rows(output)
            step = int(self.state.global_step)
            state = {k: v.detach().clone() for k, v in self.accelerator.unwrap_model(self.model).state_dict().items()}
            torch.save(
                {
                    "prompt_ids": batch.prompt_ids,
                    "prompt_mask": batch.prompt_mask,
                    "completion_ids": batch.completion_ids,
                    "completion_mask": batch.completion_mask,
                    "truncated": batch.truncated,
                    "rewards": self._lens_rewards[rows].clone(),
                    "advantages": output["advantages"].reshape(-1).clone(),
                    "weights": state,
                    "result": {k: float(v) for k, v in result.items() if k != "perf/lens_seconds"},
                    "settings": dataclasses.asdict(self.lens_settings),
                },
                out / f"share-{self.accelerator.process_index}-step-{step}.pt",
            )
            return result

    trainer = Saving(
        model=model, reward_funcs=parity, args=args, train_dataset=data, processing_class=tok, lens_every=1
    )
    trainer.train()


def pad_left(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (width - x.shape[1], 0))


def pad_right(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def one_process_gap(shares: list[dict], step: int) -> float:
    """The largest relative gap between the lens keys the processes measured and grpo-lens' own lens on the joined
    batch (prompts left padded, completions right padded to a common width) at the same weights, one process."""
    from grpo_lens.lens.settings import LensSettings
    from grpo_lens.lens.step_batch import StepBatch
    from grpo_lens.lens.trainer_lens import TrainerLens
    from grpo_lens.models import build_tiny_model
    from grpo_lens.rollout import RolloutBatch

    lp = max(s["prompt_ids"].shape[1] for s in shares)
    t = max(s["completion_ids"].shape[1] for s in shares)
    batch = RolloutBatch(
        prompt_ids=torch.cat([pad_left(s["prompt_ids"], lp) for s in shares]),
        prompt_mask=torch.cat([pad_left(s["prompt_mask"], lp) for s in shares]),
        completion_ids=torch.cat([pad_right(s["completion_ids"], t) for s in shares]),
        completion_mask=torch.cat([pad_right(s["completion_mask"].long(), t) for s in shares]).bool(),
        sampler_logprobs=torch.zeros(sum(s["completion_ids"].shape[0] for s in shares), t),
        truncated=torch.cat([s["truncated"] for s in shares]),
        group_size=R,
    )
    policy, _ = build_tiny_model(seed=0)
    policy.load_state_dict(shares[0]["weights"])
    policy.train()
    rewards = torch.cat([s["rewards"] for s in shares])
    ours = TrainerLens(policy, LensSettings(**shares[0]["settings"])).measure(
        StepBatch(step, policy, batch, rewards, ~torch.isnan(rewards), torch.cat([s["advantages"] for s in shares]))
    )
    theirs = shares[0]["result"]
    keys = [k for k in theirs if k in ours and k != "perf/lens_seconds"]
    gaps = [abs(theirs[k] - ours[k]) / max(abs(ours[k]), 1e-7) for k in keys]
    missing = sorted(set(theirs) ^ {k for k in ours if k != "perf/lens_seconds"})
    if missing:
        print("keys in one only:", missing[:10])
    return max(gaps) if gaps else float("nan")


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
    # accelerate launch --cpu --num_processes 2 starts ONE process (its simple launcher; several CPU processes need
    # mpirun there): torchrun starts two, and accelerate's Accelerator reads their environment (MULTI_CPU, gloo)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"]
    cmd += [__file__, "--child", "--out", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        print(done.stderr[-4000:])
        print(f"torchrun failed (exit {done.returncode}) after {seconds:.0f} s")
        return 1
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    groups = [r.get("rank/mixed_groups") for r in records]
    print(f"2 processes: {seconds:.0f} s; records at steps {[r['step'] for r in records]}; mixed groups {groups}")
    for step in sorted({int(p.stem.rsplit("-", 1)[1]) for p in run.glob("share-*-step-*.pt")}):
        shares = [torch.load(run / f"share-{r}-step-{step}.pt", weights_only=True) for r in (0, 1)]
        gap = one_process_gap(shares, step)
        print(f"global step {step}: largest relative gap to one process {gap:.2e}")
        if not gap < 1e-5:  # float32 model, prompts padded to another width: rounding only
            print("the two-process lens differs from one process on the same batch")
            return 1
    from grpo_lens.cli import main as cli

    print("grpo-lens report:", cli(["report", str(run)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
