"""Worker of tests/train/test_distributed.py: trainer.policy_update on a fixed batch, split across processes.

Run as ``torchrun --nproc_per_node W tests/_distributed_worker.py OUT``: every rank builds the same tiny model and the
same fixed RolloutBatch (B = 4 groups of R = 2, completions of varied lengths, off-policy sampler log-probs so that the
clip binds, a reference model's log-probs for the KL term), takes its own B / W whole groups as the trainer does, and
calls :func:`grpo_lens.trainer.policy_update` for every loss aggregation and num_mini_batches in (1, 2). Each rank saves
the all-reduced gradient of the first optimizer step, the parameters after the update, and the returned metrics to
OUT/rank{r}.pt. The test compares them with :func:`run_updates` in one process on the whole batch. Then the same
processes run ``grpo-lens train`` (:data:`CLI_ARGS`) into OUT/run, and the runs of :data:`FLAT_RUNS`, where process
0's groups have no reward contrast, into OUT/<name>.

The optimizer is SGD (lr 0.1), whose step is linear in the gradient, so parameter differences are lr times gradient
differences (float reassociation, ~1e-7). AdamW divides by sqrt(v) and on its first step moves every weight by about
lr * sign(g), so a weight whose gradient is a cancellation near 0 could flip sign under reassociation: that tests
float noise, not the all-reduce.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from grpo_lens.config import TrainConfig
from grpo_lens.formulas.losses import LOSS_AGGREGATIONS
from grpo_lens.rollout import RolloutBatch, batch_logprobs
from grpo_lens.runtime.processes import Processes
from grpo_lens.train.update import policy_update

B, R, LP, T = 4, 2, 5, 6
TEMPERATURE = 0.7
MINI_BATCHES = (1, 2)
LENGTHS = [6, 2, 4, 6, 1, 5, 3, 6]  # completion lengths [N]: varied, so the aggregations differ
#: The case whose groups 0 and 1 (process 0's share of 2) have no reward contrast: their advantages are exactly 0 and
#: with beta 0 the update forwards them without gradient (update.still_rows), so process 0 runs no backward at all and
#: holds no gradient, while process 1 does (the all-reduce of only the gradients that exist aborted).
STILL = ("still", 1)


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


def config_for(mode: str, mini_batches: int, **changes) -> TrainConfig:
    config = TrainConfig(
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
    return dataclasses.replace(config, **changes)


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
        {(mode, mini_batches) or STILL: {"grad": {name: tensor}, "params": {name: tensor}, "metrics": dict}}.
    """
    torch.manual_seed(0)
    base = build_model()
    batch, advantages, ref_logp = build_batch(base)
    still = advantages.clone()
    still[: B // 2 * R] = 0.0  # groups 0 .. B/2 - 1, process 0's share of 2: no reward contrast
    cases = [((m, k), config_for(m, k), advantages) for m in LOSS_AGGREGATIONS.names() for k in MINI_BATCHES]
    cases.append((STILL, config_for("token-mean", 1, beta=0.0), still))
    out = {}
    for key, config, adv in cases:
        mini_batches = config.num_mini_batches
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
            first_grad.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

        metrics = policy_update(
            model,
            optimizer,
            batch.select(rows),
            adv[rows],
            ref_logp[rows],
            config,
            procs,
            params,
            before_step=snapshot,
        )
        out[key] = {
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


#: Runs where process 0's groups never have reward contrast (test_rank0_flat) and process 1's always do: process 0
#: forwards its rollouts without gradient and runs no backward, without the lens, with it every step, and
#: with it on a LoRA adapter. Each adds its flags to :data:`FLAT_ARGS` and writes OUT/<name>.
FLAT_ARGS = [
    "train",
    "--model",
    "tiny",
    "--rewards",
    "test_rank0_flat",
    "--group-size",
    "2",
    "--prompts-per-step",
    "2",
    "--max-new-tokens",
    "6",
    "--max-steps",
    "2",
    "--device",
    "cpu",
    "--no-progress",
]
FLAT_RUNS = {
    "flat": ["--lens-every", "0"],
    "flat_lens": ["--lens-every", "1"],
    "flat_lora": ["--lens-every", "1", "--lora-rank", "2"],
}


def rank0_flat(prompts, completions, **kwargs):
    """0 for every rollout on process 0 (torchrun's RANK): no group there has reward contrast; 1, 0, 1, 0, ... on the
    others, where every group of an even size mixes right and wrong."""
    flat = os.environ.get("RANK", "0") == "0"
    return [0.0 if flat else float(n % 2) for n in range(len(completions))]


def keep_final_weights(path_of: Callable[[], Path]) -> None:
    """Make the trainer save this process's policy weights to ``path_of()`` when it finishes (before rank 0 writes
    the final model), so the test can compare the processes' weights: a :func:`grpo_lens.train.loop.finish_run`
    wrapper."""
    from grpo_lens.train import loop

    finish_run = loop.finish_run

    def finish_and_keep(run, config, procs, models, lens):
        torch.save({n: p.detach().clone() for n, p in models.policy.named_parameters()}, path_of())
        return finish_run(run, config, procs, models, lens)

    loop.finish_run = finish_and_keep


def main(out_dir: str) -> None:
    import helpers_rewards  # noqa: F401 - registers test_alternating

    from grpo_lens import cli
    from grpo_lens.rewards import REWARDS
    from grpo_lens.runtime.processes import setup_processes

    torch.set_num_threads(1)
    out = Path(out_dir)
    procs = setup_processes("cpu")
    results = run_updates(procs)
    torch.save({"rank": procs.rank, "world": procs.world, "results": results}, out / f"rank{procs.rank}.pt")
    procs.barrier()
    rc = cli.main(CLI_ARGS + ["--out", str(out / "run")])
    (out / f"cli_rc{procs.rank}").write_text(str(rc))
    REWARDS.register("test_rank0_flat")(rank0_flat)
    name = ""
    keep_final_weights(lambda: out / f"{name}_weights{procs.rank}.pt")
    for name, flags in FLAT_RUNS.items():  # noqa: B007 - keep_final_weights reads name
        rc = cli.main(FLAT_ARGS + flags + ["--out", str(out / name)])
        (out / f"{name}_rc{procs.rank}").write_text(str(rc))


if __name__ == "__main__":
    main(sys.argv[1])
