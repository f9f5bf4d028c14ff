"""The lens inside the trainer: a cheap subset of the diagnostics every ``lens_every`` steps.

On a lens step, before the update, one extra batched backward gives sketched per-rollout gradients g_i of every linear
layer (LoGra-style, :func:`grpo_lens.diagnostics.sketch_rollout_grads`); with LoRA, exact gradients of the adapter's
parameters or sketches of the frozen base weights (``lens_space``, :meth:`TrainerLens.rollout_grads`). Each mixed group goes through the one
per-group analysis path, :func:`grpo_lens.diagnostics.analyse_group` (the same function ``grpo-lens probe`` calls),
and the lens writes the mean over the step's mixed groups of every key it returns (the identity residual: the max).
With several processes every process's groups are gathered first, so the numbers cover the whole batch.
Around the optimizer step, bf16 snapshots give S4 (update sparsity for the step and since the start).

All math is in :mod:`grpo_lens.diagnostics`; this class only picks groups, gathers and averages.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_lens import diagnostics as dg
from grpo_lens.rollout import RolloutBatch


def is_binary(rewards: torch.Tensor) -> bool:
    """True when every reward is 0 or 1 (what the rank-2 identity and m_C / m_W need)."""
    return bool(torch.all((rewards == 0) | (rewards == 1)))


def gather_objects(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] across processes (torch.distributed), or [obj] for one process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            parts: list[Any] = [None] * world
            torch.distributed.all_gather_object(parts, obj)
            return parts
    return [obj]


class TrainerLens:
    """Measures GRPO's gradient structure on the trainer's own rollouts.

    Args:
        policy: the model being trained.
        config: a :class:`grpo_lens.config.TrainConfig` (uses lens_sketch_dim, seed, std, eps, temperature, top_k,
            top_p).

    Metric keys written (see docs/metrics.md): ``sparsity/zero_var_groups_predicted``, ``sparsity/update_step``,
    ``sparsity/update_total``, ``rank/mixed_groups``, ``perf/lens_seconds``, and the mean over mixed groups of every
    key of :func:`grpo_lens.diagnostics.analyse_group` except ``group/size`` (``rank/g1_*``, ``grad/identity_*``,
    ``baseline/*``, ``zero_sum/*``, ``group/*``).
    """

    def __init__(self, policy: torch.nn.Module, config: Any):
        self.config = config
        self.tracker = dg.Bf16UpdateTracker(policy, device="cpu")  # start = the weights before any step
        self._pending = False

    def start(self, policy: torch.nn.Module) -> None:
        """Nothing to do: the start snapshot is taken at construction, from the freshly loaded weights."""

    def state_dict(self) -> dict[str, Any]:
        """The lens keeps no state that the start weights and the checkpoint do not restore."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See :meth:`state_dict`."""

    def measure(self, step: int, policy: torch.nn.Module, batch: RolloutBatch, rewards: torch.Tensor,
                valid: torch.Tensor, advantages: torch.Tensor) -> dict[str, float]:
        """Lens metrics of one step's rollouts (every process's), before the update.

        Args:
            batch: this process's N = B*R rollouts.  rewards: [N] (NaN where invalid).  valid: [N] bool.
            advantages: [N], the advantages the update uses.

        Returns:
            {key: float}; the same numbers on every process.
        """
        import time

        t0 = time.perf_counter()
        c = self.config
        R = batch.group_size
        r = torch.where(valid, rewards, torch.zeros_like(rewards)).view(-1, R).cpu()
        v = valid.view(-1, R).cpu()
        mixed = [b for b in range(r.shape[0]) if bool(v[b].all()) and not bool(dg.zero_variance_groups(r[b:b + 1]))]
        rows: list[dict[str, float]] = []
        if mixed:
            idx = torch.cat([torch.arange(b * R, (b + 1) * R) for b in mixed])
            sub = batch.select(idx)
            grads = self.rollout_grads(policy, sub)  # [n_mixed * R, K]
            adv = advantages.detach().cpu().double()
            for j, b in enumerate(mixed):
                rows.append(dg.analyse_group(
                    grads[j * R:(j + 1) * R], r[b].double(), adv[b * R:(b + 1) * R], estimator=c.estimator,
                    std=c.std, eps=c.eps, completion_mask=sub.completion_mask[j * R:(j + 1) * R],
                    completion_ids=sub.completion_ids[j * R:(j + 1) * R], num_random=4,
                    seed=c.seed + step * 1009 + b))
        # every process's groups: the lens describes the whole batch, not rank 0's share
        parts = gather_objects({"rows": rows, "rewards": r, "valid": v})
        all_rows = [row for part in parts for row in part["rows"]]
        all_r = torch.cat([part["rewards"] for part in parts])
        all_v = torch.cat([part["valid"] for part in parts])
        out: dict[str, float] = {}
        out["sparsity/zero_var_groups_predicted"] = dg.s1_metrics(all_r, mask=all_v)["sparsity/zero_var_pred"]
        out["rank/mixed_groups"] = float(len(all_rows))
        out.update({k: val for k, val in dg.mean_over_groups(all_rows).items() if k != "group/size"})
        self._pending = True
        out["perf/lens_seconds"] = time.perf_counter() - t0
        return out

    def rollout_grads(self, policy: torch.nn.Module, sub: RolloutBatch) -> torch.Tensor:
        """Per-rollout gradients g_i [n, K] float64 of ``sub``'s rollouts in the space ``config.lens_space`` names.

        Without LoRA: sketched gradients of every linear layer (K = layers * lens_sketch_dim^2). With LoRA see
        :func:`grpo_lens.lora.lora_rollout_grads` (``trainable``: the adapter's parameters, exact; ``full``: the
        frozen base linear weights, sketched).
        """
        from grpo_lens.lora import is_lora, lora_rollout_grads

        c = self.config
        processing = dict(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p)
        if is_lora(policy):
            return lora_rollout_grads(policy, sub, c.lens_space, k=c.lens_sketch_dim, seed=c.seed,
                                      **processing).double()
        return dg.sketch_rollout_grads(policy, sub, k_in=c.lens_sketch_dim, k_out=c.lens_sketch_dim, seed=c.seed,
                                       **processing).sketch.double()

    def before_step(self, policy: torch.nn.Module) -> None:
        """Snapshot the weights (bf16) just before the first optimizer step of a lens step."""
        if self._pending:
            self.tracker.update()  # moves the 'previous' snapshot to now; its numbers are not needed

    def after_step(self, step: int, policy: torch.nn.Module, measured: bool) -> dict[str, float]:
        """S4 after the step's optimizer steps: shares of parameters whose bf16 value did not change."""
        if not (measured and self._pending):
            return {}
        self._pending = False
        return self.tracker.update()
