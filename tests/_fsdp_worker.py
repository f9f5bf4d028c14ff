"""Worker of tests/train/test_fsdp.py: 3 policy updates and the lens under FSDP2 (``fully_shard``), and the real loop
with ``--parallelism fsdp2`` killed-free and resumed.

Run as ``torchrun --nproc_per_node 2 tests/_fsdp_worker.py OUT``. Every rank builds the same tiny Llama in float64
(so that float reassociation between 1 and 2 processes stays near 1e-16 and a 1e-6 tolerance tests the arithmetic,
not the rounding), shards it with :func:`grpo_lens.runtime.sharding.shard_fsdp2` and runs :func:`run_fixed` on its
share of three fixed batches (tests/_distributed_worker.py's, B = 4 groups of R = 2); the test runs the same function
in one process on the whole batches. Then the ranks train through ``grpo-lens train --parallelism fsdp2``: 3 steps
in one go (OUT/straight) and 2 steps resumed to 3 (OUT/resumed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import helpers_rewards  # noqa: F401 - registers test_alternating
import torch
from _distributed_worker import TEMPERATURE, B, R, T, build_batch

from grpo_lens import cli
from grpo_lens.config import TrainConfig
from grpo_lens.gradients.gram import exact_rollout_gram
from grpo_lens.lens.step_batch import StepBatch
from grpo_lens.lens.trainer_lens import TrainerLens
from grpo_lens.models import build_tiny_model
from grpo_lens.runtime.processes import Processes, setup_processes
from grpo_lens.runtime.sharding import local_part, shard_fsdp2
from grpo_lens.train.update import policy_update

STEPS = 3


def config() -> TrainConfig:
    """AdamW's settings of the trainer, a binding clip (the tiny model's gradient norm is above 1), KL term, clipped
    ratios and the exact Gram lens."""
    return TrainConfig(
        model="tiny",
        group_size=R,
        prompts_per_step=B,
        max_new_tokens=T,
        temperature=TEMPERATURE,
        loss_aggregation="token-mean",
        mu=1,
        micro_batch_size=2,
        beta=0.05,
        eps_low=0.2,
        eps_high=0.28,
        max_grad_norm=1.0,
        learning_rate=1e-3,
        lens_every=1,
        progress=False,
    )


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter or gradient (gathered from the shards), detached, on the CPU."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone().cpu()


def rewards_for(step: int) -> torch.Tensor:
    """[B R] rewards: every group mixed on steps 0 and 2; on step 1 groups 2 and 3 (rank 1's share) constant, so rank
    1 has no mixed group and must still join the lens's collective pass."""
    r = torch.tensor([1.0, 0.0] * B, dtype=torch.float64)
    if step == 1:
        r[2 * R :] = 1.0
    return r


def run_fixed(procs: Processes) -> dict:
    """STEPS policy updates of this process's share of fixed batches (seeds 0, 1, 2), with the lens measuring each
    step before its update and S4/sparsity around it.

    Returns:
        {"params": {name: full tensor} after the last step, "grad": {name: full first-step gradient},
         "metrics": [update metrics per step], "lens": [lens metrics per step], "after": [after_step metrics],
         "gram": [Gram [n, n] of this process's share at each step's start (exact_rollout_gram)], "rows": row ids}.
    """
    torch.manual_seed(0)
    model = build_tiny_model(seed=0)[0].double()
    batches = [build_batch(model, seed=s) for s in range(STEPS)]  # at the start weights, the same on every rank
    if procs.world > 1:
        model = shard_fsdp2(model, procs.world)
        procs.sharded = True
    share = B // procs.world
    rows = torch.arange(procs.rank * share * R, (procs.rank + 1) * share * R)
    cfg = config()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2))
    lens = TrainerLens(model, cfg)
    out: dict = {"grad": {}, "metrics": [], "lens": [], "after": [], "gram": [], "rows": rows}
    for step in range(STEPS):
        batch, adv, ref = batches[step]
        sub, a, rf = batch.select(rows), adv[rows].double(), ref[rows].double()
        rewards, valid = rewards_for(step)[rows], torch.ones(len(rows), dtype=torch.bool)
        out["gram"].append(exact_rollout_gram(model, sub, temperature=TEMPERATURE)[0])
        out["lens"].append(lens.measure(StepBatch(step + 1, model, sub, rewards, valid, a)))

        def before(step=step):
            if step == 0:
                out["grad"] = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            lens.before_step(model)

        out["metrics"].append(
            policy_update(model, optimizer, sub, a, rf, cfg, procs, params, before_step=before, step=step + 1)
        )
        out["after"].append(lens.after_step(step + 1, model, True))
    out["params"] = {n: full(p) for n, p in model.named_parameters()}
    out["local_numel"] = sum(local_part(p).numel() for p in params)
    return out


#: The real loop, 2 processes, FSDP2: B = 2 prompts (one per process), R = 2, test_alternating (1, 0 per group).
CLI_ARGS = [
    "train",
    "--model",
    "tiny",
    "--parallelism",
    "fsdp2",
    "--rewards",
    "test_alternating",
    "--group-size",
    "2",
    "--prompts-per-step",
    "2",
    "--max-new-tokens",
    "6",
    "--lens-every",
    "1",
    "--checkpoint-every",
    "1",
    "--beta",
    "0.05",
    "--device",
    "cpu",
    "--no-progress",
]


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    procs = setup_processes("cpu")
    results = run_fixed(procs)
    torch.save({"rank": procs.rank, "world": procs.world, "results": results}, out / f"rank{procs.rank}.pt")
    procs.barrier()
    rcs = [
        cli.main(CLI_ARGS + ["--max-steps", "3", "--out", str(out / "straight")]),
        cli.main(CLI_ARGS + ["--max-steps", "2", "--out", str(out / "resumed")]),
        cli.main(CLI_ARGS + ["--max-steps", "3", "--out", str(out / "resumed"), "--resume"]),
    ]
    (out / f"cli_rc{procs.rank}").write_text(" ".join(map(str, rcs)))


if __name__ == "__main__":
    main(sys.argv[1])
