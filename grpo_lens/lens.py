"""The lens inside the trainer: a cheap subset of the diagnostics every ``lens_every`` steps.

On a lens step, before the update, one extra batched backward gives sketched per-rollout gradients g_i of every linear
layer (LoGra-style, :func:`grpo_lens.diagnostics.sketch_rollout_grads`). From them, per mixed group: G1's entropy
effective rank and stable rank (with the random zero-sum control), the rank-2 identity residual, m_C / m_W and b*.
Around the optimizer step, bf16 snapshots give S4 (update sparsity for the step and since the start).

All math is in :mod:`grpo_lens.diagnostics`; this class only picks groups, averages and names metrics.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from grpo_lens import diagnostics as dg
from grpo_lens.rollout import RolloutBatch


def _nanmean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def is_binary(rewards: torch.Tensor) -> bool:
    """True when every reward is 0 or 1 (what the rank-2 identity and m_C / m_W need)."""
    return bool(torch.all((rewards == 0) | (rewards == 1)))


class TrainerLens:
    """Measures GRPO's gradient structure on the trainer's own rollouts.

    Args:
        policy: the model being trained.
        config: a :class:`grpo_lens.config.TrainConfig` (uses lens_sketch_dim, seed, std, eps, temperature, top_k,
            top_p).

    Metric keys written (see docs/metrics.md): ``sparsity/zero_var_groups_predicted``, ``sparsity/update_step``,
    ``sparsity/update_total``, ``rank/g1_erank``, ``rank/g1_stable_rank``, ``rank/g1_random_erank``,
    ``rank/mixed_groups``, ``grad/identity_residual``, ``baseline/m_correct``, ``baseline/m_wrong``,
    ``baseline/b_star``, ``baseline/group_mean``, ``perf/lens_seconds``.
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
        """Lens metrics of one step's rollouts, before the update.

        Args:
            batch: N = B*R rollouts.  rewards: [N] (NaN where invalid).  valid: [N] bool.  advantages: [N].
        """
        import time

        t0 = time.perf_counter()
        c = self.config
        R = batch.group_size
        r = torch.where(valid, rewards, torch.zeros_like(rewards)).view(-1, R)
        out: dict[str, float] = {}
        s1 = dg.s1_metrics(r, mask=valid.view(-1, R))
        out["sparsity/zero_var_groups_predicted"] = s1["sparsity/zero_var_pred"]

        mixed = [b for b in range(r.shape[0]) if not bool(dg.zero_variance_groups(r[b:b + 1],
                                                                                  valid[b * R:(b + 1) * R].view(1, R)))]
        out["rank/mixed_groups"] = float(len(mixed))
        if mixed:
            idx = torch.cat([torch.arange(b * R, (b + 1) * R) for b in mixed])
            sub = batch.select(idx)
            grads = self.rollout_grads(policy, sub)  # [n_mixed * R, K]
            eranks, stables, randoms, residuals, m_c, m_w, b_star, g_mean = [], [], [], [], [], [], [], []
            for j, b in enumerate(mixed):
                g = grads[j * R:(j + 1) * R]
                a = advantages[b * R:(b + 1) * R].double()
                rr = r[b]
                spectra = dg.g1_spectra(g, a, num_random=4, seed=c.seed + step)
                eranks.append(spectra["policy"]["erank"])
                stables.append(spectra["policy"]["stable_rank"])
                randoms.append(spectra["random"].get("erank"))
                if is_binary(rr) and bool(valid[b * R:(b + 1) * R].all()):
                    residuals.append(dg.rank2_residual(g, rr.double(), std=c.std, eps=c.eps, advantages=a))
                    bm = dg.baseline_metrics(g, rr.double())
                    m_c.append(bm["baseline/m_correct"])
                    m_w.append(bm["baseline/m_wrong"])
                    b_star.append(bm["baseline/b_star"])
                    g_mean.append(bm["baseline/mean"])
            out.update({
                "rank/g1_erank": _nanmean(eranks), "rank/g1_stable_rank": _nanmean(stables),
                "rank/g1_random_erank": _nanmean(randoms),
                "grad/identity_residual": max(residuals) if residuals else None,
                "baseline/m_correct": _nanmean(m_c), "baseline/m_wrong": _nanmean(m_w),
                "baseline/b_star": _nanmean(b_star), "baseline/group_mean": _nanmean(g_mean),
            })
        self._pending = True
        out["perf/lens_seconds"] = time.perf_counter() - t0
        return {k: v for k, v in out.items() if v is not None}

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
