"""Worker of tests/train/test_distributed.py: trainer.policy_update on a fixed batch, split across processes.

Run as ``torchrun --nproc_per_node W tests/_distributed_worker.py OUT``: every rank builds the same tiny model and the
same fixed RolloutBatch (B = 4 groups of R = 2, completions of varied lengths, off-policy sampler log-probs so that the
clip binds, a reference model's log-probs for the KL term), takes its own B / W whole groups as the trainer does, and
calls :func:`grpo_lens.trainer.policy_update` for every loss aggregation and num_mini_batches in (1, 2). Each rank saves
the all-reduced gradient of the first optimizer step, the parameters after the update, and the returned metrics to
OUT/rank{r}.pt. The test compares them with :func:`run_updates` in one process on the whole batch. Then the same
processes run ``grpo-lens train`` (:data:`CLI_ARGS`) into OUT/run.

The optimizer is SGD (lr 0.1), whose step is linear in the gradient, so parameter differences are lr times gradient
differences (float reassociation, ~1e-7). AdamW divides by sqrt(v) and on its first step moves every weight by about
lr * sign(g), so a weight whose gradient is a cancellation near 0 could flip sign under reassociation: that tests
float noise, not the all-reduce.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from grpo_lens.config import TrainConfig
from grpo_lens.formulas.losses import LOSS_AGGREGATIONS
from grpo_lens.rollout import RolloutBatch, batch_logprobs
from grpo_lens.train.processes import Processes
from grpo_lens.train.update import policy_update

B, R, LP, T = 4, 2, 5, 6
TEMPERATURE = 0.7
MINI_BATCHES = (1, 2)
LENGTHS = [6, 2, 4, 6, 1, 5, 3, 6]  # completion lengths [N]: varied, so the aggregations differ


def build_model():
    from grpo_lens.models import build_tiny_model

    model, _ = build_tiny_model(seed=0)
    return model.train()


def build_batch(model, seed: int = 0):
    """The fixed batch (every rank builds the same one): RolloutBatch, advantages [N], ref_logp [N, T]."""
    g = torch.Generator().manual_seed(seed)
    N = B * R
    pad = 258  # <|pad|> of the tiny tokenizer
    prompt_ids = torch.randint(0, 256, (N, LP), generator=g)
    prompt_mask = torch.ones(N, LP, dtype=torch.long)
    for n in range(N):  # left padding: group b has b % 3 pad tokens
        k = (n // R) % 3
        prompt_ids[n, :k] = pad
        prompt_mask[n, :k] = 0
    lengths = torch.tensor(LENGTHS)
    completion_mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)  # [N, T]
    completion_ids = torch.randint(0, 256, (N, T), generator=g).masked_fill(~completion_mask, pad)
    batch = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        sampler_logprobs=torch.zeros(N, T),
        truncated=lengths == T,
        group_size=R,
        prompts=[f"p{b}" for b in range(B)],
        completions=[""] * N,
    )
    with torch.no_grad():
        logp = batch_logprobs(model, batch, temperature=TEMPERATURE)
    # pi_old != pi_theta: ratios spread around 1 so that both clip bounds bind on some tokens
    batch.sampler_logprobs = ((logp + 0.3 * torch.randn(N, T, generator=g)) * completion_mask).float()
    ref_logp = (logp + 0.2 * torch.randn(N, T, generator=g)).float()
    advantages = torch.randn(N, generator=g)
    advantages = advantages - advantages.view(B, R).mean(1).repeat_interleave(R)  # zero sum per group
    return batch, advantages, ref_logp


def config_for(mode: str, mini_batches: int) -> TrainConfig:
    return TrainConfig(
        model="tiny",
        group_size=R,
        prompts_per_step=B,
        max_new_tokens=T,
        temperature=TEMPERATURE,
        loss_aggregation=mode,
        num_mini_batches=mini_batches,
        mu=2,
        micro_batch_size=3,
        beta=0.05,
        eps_low=0.2,
        eps_high=0.28,
        dual_clip=3.0,
        max_grad_norm=1.0,
        progress=False,
    )


def group_order(world: int, mini_batches: int) -> list[int]:
    """The order of the B groups that makes one process's mini-batches equal the W processes' together.

    Rank r holds groups [r*B/W, (r+1)*B/W) and splits them into ``mini_batches`` contiguous chunks; optimizer step k
    of W processes sums chunk k of every rank. One process on the groups in this order takes the same steps.
    """
    share = B // world
    per_mini = share // mini_batches
    return [r * share + k * per_mini + j for k in range(mini_batches) for r in range(world) for j in range(per_mini)]


def run_updates(procs: Processes, as_world: int | None = None) -> dict:
    """policy_update of this process's share, for every aggregation and num_mini_batches.

    Args:
        procs: this process (rank, world).
        as_world: in one process, order the groups as ``as_world`` processes would split them (see group_order).
    Returns:
        {(mode, mini_batches): {"grad": {name: tensor}, "params": {name: tensor}, "metrics": dict}}.
    """
    torch.manual_seed(0)
    base = build_model()
    batch, advantages, ref_logp = build_batch(base)
    out = {}
    for mode in LOSS_AGGREGATIONS.names():
        for mini_batches in MINI_BATCHES:
            if procs.world > 1:
                share = B // procs.world
                groups = list(range(procs.rank * share, (procs.rank + 1) * share))
            else:
                groups = group_order(as_world or 1, mini_batches)
            rows = torch.tensor([g * R + i for g in groups for i in range(R)])
            model = build_model()
            model.load_state_dict(base.state_dict())
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.SGD(params, lr=0.1)
            first_grad: dict[str, torch.Tensor] = {}

            def snapshot(model=model, first_grad=first_grad):
                first_grad.update(
                    {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
                )

            metrics = policy_update(
                model,
                optimizer,
                batch.select(rows),
                advantages[rows],
                ref_logp[rows],
                config_for(mode, mini_batches),
                procs,
                params,
                before_step=snapshot,
            )
            out[(mode, mini_batches)] = {
                "grad": first_grad,
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "metrics": metrics,
            }
    return out


#: The real loop through the CLI in the same processes (saves a second torchrun start): B = 2 prompts, one per
#: process, R = 2, reward test_alternating (tests/helpers_rewards.py: 1, 0 in every group).
CLI_ARGS = [
    "train",
    "--model",
    "tiny",
    "--rewards",
    "test_alternating",
    "--group-size",
    "2",
    "--prompts-per-step",
    "2",
    "--max-new-tokens",
    "6",
    "--max-steps",
    "2",
    "--lens-every",
    "1",
    "--device",
    "cpu",
    "--no-progress",
]


def main(out_dir: str) -> None:
    import helpers_rewards  # noqa: F401 - registers test_alternating

    from grpo_lens import cli
    from grpo_lens.train.processes import setup_processes

    torch.set_num_threads(1)
    procs = setup_processes("cpu")
    results = run_updates(procs)
    torch.save({"rank": procs.rank, "world": procs.world, "results": results}, Path(out_dir) / f"rank{procs.rank}.pt")
    procs.barrier()
    rc = cli.main(CLI_ARGS + ["--out", str(Path(out_dir) / "run")])
    (Path(out_dir) / f"cli_rc{procs.rank}").write_text(str(rc))


if __name__ == "__main__":
    main(sys.argv[1])
