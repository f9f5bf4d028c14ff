"""The lens inside the trainer: a cheap subset of the measurements every ``lens_every`` steps.

On a lens step, before the update, one extra batched backward gives the exact Gram matrix <g_i, g_j> of the
per-rollout gradients of every parameter (:func:`grpo_lens.gradients.gram.exact_rollout_gram`,
docs/theory.md §Exact Gram; ``gram_source: sketch``: sketched g_i of every linear layer instead, LoGra-style,
:func:`grpo_lens.gradients.sketch.sketch_rollout_grads`, which can also be read off the update's first pass), each g_i
the term that the configured loss aggregation weights in the update
(:func:`grpo_lens.formulas.losses.rollout_gradient_weights`, docs/theory.md §3);
with LoRA, exact gradients of the adapter's parameters or sketches of the frozen base weights (``lens_space``,
:meth:`TrainerLens.rollout_grads`). Each mixed group goes through the one per-group analysis path,
:func:`grpo_lens.analysis.group.analyse_group` (the same function ``grpo-lens probe`` calls), and the lens writes the
mean over the step's mixed groups of every key it returns (the identity residual: the max).
With several processes every process's groups are gathered first, so the numbers cover the whole batch; with an
FSDP2-sharded policy (``--parallelism fsdp2``) every forward is a collective, so a process without a mixed group
joins the others' exact-Gram pass with one group of its own and drops the result (docs/theory.md §21).
Around the optimizer step, bf16 snapshots give S4 (update sparsity for the step and since the start), and a fixed
sample of the weights gives the sparsity of the step's update, of the update since the start and of the step's
gradient, each bf16 share beside its dense-update control (:class:`grpo_lens.lens.sparsity.SparsityOverTraining`,
docs/theory.md §Sparsity over training). S1 is measured by the trainer on every step; the lens prints no S1
prediction, because no rollouts other than the step's own exist for the step's prompts (docs/theory.md §S1).

From the same exact Gram the lens writes the step's gradient noise scale, the group the example (``noise/*``,
:meth:`TrainerLens.noise_metrics`, docs/theory.md §Noise scale and dead groups): B_simple and SNR with jackknife
intervals and a sign-flip null from the own pass's full Gram, or point values with the update's own gradient norm
when the Gram is read off the update's backward; with ``lens_noise_proxy`` verl's logit-space proxy beside it.

All math is in :mod:`grpo_lens.formulas` (composed per group by :mod:`grpo_lens.analysis`); this class only picks
groups, gathers and averages.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from grpo_lens import metrics as mk
from grpo_lens.analysis.group import (
    analyse_group,
    lens_rank_intervals,
    mean_over_groups,
)
from grpo_lens.formulas.advantages import constant_groups
from grpo_lens.formulas.credit import TOKEN_CLASSES, signed_contributions, token_classes
from grpo_lens.formulas.landing import gradient_norm_ratio, landing_shares, token_update_weights
from grpo_lens.formulas.losses import grpo_loss, loss_normalizer, rollout_gradient_weights
from grpo_lens.formulas.noise import (
    group_gradient_gram,
    noise_scale,
    noise_scale_from_sums,
    noise_scale_jackknife,
    rank_correlation,
    score_norm_proxy,
    signal_sign_flip_p,
)
from grpo_lens.formulas.overlong import overlong_loss_mask
from grpo_lens.gradients.gram import MicroBatchGrams, exact_rollout_gram
from grpo_lens.gradients.lora_spaces import lora_rollout_grads
from grpo_lens.gradients.params import trainable_count
from grpo_lens.gradients.sketch import GradientCapture, sketch_rollout_grads, square_sketch
from grpo_lens.gradients.token_credit import squared_norm, token_directional_derivatives
from grpo_lens.lens.settings import LensSettings, as_lens_settings
from grpo_lens.lens.sparsity import Bf16UpdateTracker, SparsityOverTraining
from grpo_lens.lens.step_batch import StepBatch
from grpo_lens.lora import is_lora
from grpo_lens.rollout import RolloutBatch, batch_logprobs, scored_logits
from grpo_lens.runtime.processes import gather_objects
from grpo_lens.runtime.sharding import is_sharded

if TYPE_CHECKING:
    from grpo_lens.config import TrainConfig


def scores_from_update_rows(rows: torch.Tensor, advantages: torch.Tensor, num_rollouts: float) -> torch.Tensor:
    """The lens's sketched rows grad(omega_i sum_t log pi(o_it)) read off the update's first on-policy loss gradient.

    On the first pass pi_old is the forward's own detached log-prob, so every ratio is 1, the clip is inactive
    (eps_low, eps_high > 0) and, without KL term or importance weights, rollout i's share of the loss has gradient
    grad L_i = -(A_i / N) grad(omega_i sum_t log pi(o_it)),
    omega_i = :func:`grpo_lens.formulas.losses.rollout_gradient_weights` (docs/theory.md §3, §Lens sketch from the
    update). The sketch is linear, so the same holds row by row.

    Args:
        rows: [N_local, P_s] sketched rows of grad L_i (a :class:`GradientCapture` around the first pass).
        advantages: [N_local] A_i.   num_rollouts: N, the rollouts in the loss summed over processes.

    Returns:
        [N_local, P_s] float64: -N row_i / A_i; rows with A_i = 0 are 0 (their gradient cannot be read off; the trainer
        uses this only when every analysed group's advantages are nonzero).
    """
    a = advantages.to(device=rows.device, dtype=torch.float64)
    safe = torch.where(a != 0, a, torch.ones_like(a))
    out = -float(num_rollouts) * rows.double() / safe.unsqueeze(1)
    return torch.where((a != 0).unsqueeze(1), out, torch.zeros_like(out))


def score_gram_from_update(gram: torch.Tensor, advantages: torch.Tensor, num_rollouts: float) -> torch.Tensor:
    """The lens's exact score Gram <g_i, g_j> read off the Gram of the update's first-pass loss-gradient rows.

    On the first pass (ratio 1 inside both clip ranges, no per-token KL, no importance weights) rollout i's share of
    the loss has gradient h_i = -(A_i / N) g_i, g_i = grad(omega_i sum_t log pi(o_it)) with omega_i =
    :func:`grpo_lens.formulas.losses.rollout_gradient_weights` (docs/theory.md §3, §Lens inside the update's
    backward), so <g_i, g_j> = <h_i, h_j> N^2 / (A_i A_j). A rollout with A_i = 0 has h_i = 0: nothing of g_i is left
    to divide, so its row and column are NaN (the trainer fuses only steps whose analysed groups have every A_i != 0;
    the Gram of the rows A_i g_i themselves, G1's, needs no division: <h_i, h_j> N^2).

    Args:
        gram: [n, n] float64 <h_i, h_j> (:class:`grpo_lens.gradients.gram.MicroBatchGrams`).
        advantages: [n] A_i.   num_rollouts: N, the rollouts in the loss summed over processes.

    Returns:
        [n, n] float64.
    """
    a = advantages.detach().to(device=gram.device, dtype=torch.float64)
    assert gram.shape == (a.numel(), a.numel()), (tuple(gram.shape), a.numel())
    c = torch.where(a != 0, -a / float(num_rollouts), torch.full_like(a, float("nan")))  # h_i = c_i g_i
    return gram.double() / (c[:, None] * c[None, :])


class TrainerLens:
    """Measures GRPO's gradient structure on the trainer's own rollouts.

    Args:
        policy: the model being trained.
        config: the lens's :class:`grpo_lens.lens.settings.LensSettings` (a
            :class:`grpo_lens.config.TrainConfig` is converted with
            :meth:`~grpo_lens.lens.settings.LensSettings.from_train_config`); kept as ``self.settings``.

    Raises:
        TypeError: ``config`` is neither (:func:`grpo_lens.lens.settings.as_lens_settings`).

    Metric keys written (named in :mod:`grpo_lens.metrics`, documented in docs/metrics.md):
    ``sparsity/update_step``, ``sparsity/update_total``, ``sparsity/update_step_*``, ``sparsity/update_total_*``,
    ``sparsity/grad_*`` (and per layer type ``sparsity/<type>/...``), ``sparsity/sample_entries``,
    ``rank/mixed_groups``, ``grad/gram_coverage`` (exact Gram), ``perf/lens_seconds``, ``perf/lens_sparsity_seconds``,
    ``noise/*`` (the exact Gram's gradient noise scale, :meth:`noise_metrics`), with ``lens_landing`` /
    ``lens_dead_kl`` ``landing/*``, ``dead/kl_grad_*`` and ``perf/lens_landing_seconds`` (:meth:`before_update`,
    :meth:`landing_metrics`, written by :meth:`after_step`), and the mean over mixed groups of
    every key of :func:`grpo_lens.analysis.group.analyse_group` except ``group/size`` (``rank/g1_*``,
    ``grad/identity_*``, ``baseline/*``, ``zero_sum/*``, ``group/*``).
    """

    def __init__(self, policy: torch.nn.Module, config: LensSettings | TrainConfig, tokenizer: Any = None):
        self.settings = as_lens_settings(config)
        self.tokenizer = tokenizer  # the token classes of ``landing/*`` (None: those keys are not written)
        self._landing: tuple[RolloutBatch, torch.Tensor, torch.Tensor] | None = None  # rows, w_it, A_i (before_step)
        self._extra: dict[str, float] = {}  # landing/* and dead/kl_grad_* of the step, written by after_step
        self._dead_kl_sq: float | None = None
        self._landing_seconds = 0.0
        self.tracker = Bf16UpdateTracker(policy, device="cpu")  # start = the weights before any step
        # a fixed sample; start = the same weights
        self.sparsity = SparsityOverTraining(policy, seed=self.settings.seed)
        self._pending = False
        self._sparsity_seconds = 0.0
        # |sum_i h_i|^2 of the update's first gradient, taken in before_step when the Gram comes from the update
        self._want_grad_sq = False
        self._grad_sq: float | None = None
        self._proxy_w: torch.Tensor | None = None  # [N] verl's W_i at the step's weights (fused path), NaN unmeasured

    def start(self, policy: torch.nn.Module) -> None:
        """Nothing to do: the start snapshot is taken at construction, from the freshly loaded weights."""

    def state_dict(self) -> dict[str, Any]:
        """The sampled gradient summed since the start (everything else is rebuilt from the start weights)."""
        return {"grad_sum": self.sparsity.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See :meth:`state_dict` (an empty state, from a checkpoint of an older run, leaves the sum at 0)."""
        if state.get("grad_sum") is not None:
            self.sparsity.load_state_dict(state["grad_sum"])

    @staticmethod
    def mixed_groups(rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> list[int]:
        """Indices of the groups the lens analyses: every rollout valid and reward contrast (not
        :func:`grpo_lens.formulas.advantages.constant_groups`).

        Args:
            rewards: [N] (NaN where invalid).   valid: [N] bool.   group_size: R, rollouts per group.
        """
        r = torch.where(valid, rewards, torch.zeros_like(rewards)).view(-1, group_size).cpu()
        v = valid.view(-1, group_size).cpu()
        return (v.all(dim=1) & ~constant_groups(r, v)).nonzero().flatten().tolist()

    def update_capture(self, policy: torch.nn.Module) -> GradientCapture:
        """The :class:`GradientCapture` (the lens's own projections) for the trainer to open around the first
        on-policy pass of the update, whose sketched loss-gradient rows then give the g_i without a pass of the
        lens's own (:func:`scores_from_update_rows`). Marks the step as measured for the S4 snapshots."""
        self._pending = True
        return GradientCapture(policy, self.settings.sketch_dim, self.settings.sketch_dim, seed=self.settings.seed)

    def update_gram_capture(
        self,
        policy: torch.nn.Module,
        rewards: torch.Tensor,
        valid: torch.Tensor,
        group_size: int,
        batch: RolloutBatch | None = None,
    ) -> MicroBatchGrams:
        """The :class:`MicroBatchGrams` for the trainer to open around the update's first pass (each micro-batch),
        whose exact Gram of the mixed groups' loss-gradient rows then gives the lens's Gram without a pass of its
        own (:func:`score_gram_from_update`; when, :func:`grpo_lens.train.update.lens_fuses_gram`). Marks the step as
        measured for the S4 snapshots.

        Args:
            rewards: [N] (NaN where invalid).   valid: [N] bool.   group_size: R, rollouts per group.
            batch: the step's rollouts; with ``lens_noise_proxy`` verl's W_i of the mixed groups are taken now, at the
                step's weights (:meth:`proxy_score_norms`), since the lens's metrics come after the update.
        """
        self._pending = True
        self._want_grad_sq, self._grad_sq = True, None  # the noise scale's S (:meth:`noise_metrics`)
        rows = torch.zeros(rewards.numel(), dtype=torch.bool)
        for b in self.mixed_groups(rewards, valid, group_size):
            rows[b * group_size : (b + 1) * group_size] = True
        self._proxy_w = None
        if self.settings.lens_noise_proxy and batch is not None and bool(rows.any()):
            idx = rows.nonzero().flatten()
            self._proxy_w = torch.full((rewards.numel(),), float("nan"), dtype=torch.float64)
            self._proxy_w[idx] = self.proxy_score_norms(policy, batch.select(idx))
        return MicroBatchGrams(policy, rewards.numel(), rows=rows, group_size=group_size)

    def measure_from_update(
        self, step_batch: StepBatch, capture: MicroBatchGrams | GradientCapture
    ) -> dict[str, float]:
        """:meth:`measure` from what ``capture`` took in the update's first pass: the exact Gram
        (:class:`MicroBatchGrams`, :func:`score_gram_from_update`) or the sketched rows (:class:`GradientCapture`,
        :func:`scores_from_update_rows`); N, the rollouts in the loss, summed over processes."""
        batch, advantages = step_batch.batch, step_batch.advantages
        loss_mask = overlong_loss_mask(batch.completion_mask, batch.truncated, self.settings.overlong)
        n_total = sum(gather_objects(float(loss_mask.any(dim=1).sum())))
        if isinstance(capture, MicroBatchGrams):
            gram, info = capture.gram()
            return self.measure(step_batch, gram=(score_gram_from_update(gram, advantages, n_total), info))
        n_total = sum(gather_objects(float(batch.completion_mask.any(dim=1).sum())))  # the sketch's N, as before
        return self.measure(step_batch, sketch=scores_from_update_rows(capture.result().sketch, advantages, n_total))

    def measure(
        self,
        step_batch: StepBatch,
        sketch: torch.Tensor | None = None,
        gram: tuple[torch.Tensor, dict[str, Any]] | None = None,
    ) -> dict[str, float]:
        """Lens metrics of one step's rollouts (every process's), before the update.

        Args:
            step_batch: the step, the policy at its starting weights, this process's N = B*R rollouts, their
                rewards [N] (NaN where invalid), valid [N] bool and the advantages [N] the update uses.
            sketch: [N, P_s] sketched g_i of every rollout, already computed at the step's starting weights (from the
                update's first pass, :func:`scores_from_update_rows`); None runs the lens's own batched
                forward + backward over the mixed groups, which must then happen before the update.
            gram: ([N, N] exact score Gram of this process's rollouts, its info with ``coverage`` and
                ``hook_seconds``), read off the update's own backward (:meth:`measure_from_update`); entries
                outside the mixed groups' blocks may be NaN. Its hooks' seconds count as the lens's.

        Returns:
            {key: float}; the same numbers on every process.
        """
        t0 = time.perf_counter()
        # 1. this process's groups, the mixed ones, the loss's normaliser and the first group's index in the batch
        s, R = step_batch, step_batch.batch.group_size
        r = torch.where(s.valid, s.rewards, torch.zeros_like(s.rewards)).view(-1, R).cpu()
        v = s.valid.view(-1, R).cpu()
        mixed = self.mixed_groups(s.rewards, s.valid, R)
        loss_mask, z_total, n_total = self._loss_normalizer(s.batch)
        shares = gather_objects(r.shape[0])  # each group's seed follows its index in the whole batch
        first_group = sum(shares[: torch.distributed.get_rank() if len(shares) > 1 else 0])
        # 2. the mixed groups' Gram and its analysis, group by group
        noise_part: dict[str, Any] = {"groups": int(r.shape[0]), "sum_sq": 0.0, "m": None, "exact": False}
        if sketch is None and gram is None and is_sharded(s.policy) and any(gather_objects(bool(mixed))) and not mixed:
            # FSDP2: each forward is a collective, so a process without a mixed group joins the others' pass with
            # one group of its own and drops the result
            self.rollout_gram(s.policy, s.batch.select(torch.arange(R)), torch.ones(R, device=loss_mask.device))
        rows: list[dict[str, float]] = []
        coverage: list[float] = []
        if mixed:
            idx = torch.cat([torch.arange(b * R, (b + 1) * R) for b in mixed])
            mixed_gram, dim, cov, hook_seconds = self._mixed_gram(s, idx, loss_mask, z_total, n_total, sketch, gram)
            t0 -= hook_seconds  # the hooks ran inside the update's backward: the lens's time
            coverage += cov
            adv = s.advantages.detach().cpu().double()
            if coverage:  # the exact Gram: the update's rows h_i = -(A_i / N) g_i summed per group
                m = group_gradient_gram(mixed_gram, -adv[idx] / n_total, R)  # [n_mixed, n_mixed]; NaN between groups
                noise_part.update(sum_sq=float(m.diagonal().sum()), m=m if bool(m.isfinite().all()) else None)
                noise_part["exact"] = True
                if self.settings.lens_noise_proxy:
                    noise_part["proxy"] = self.proxy_powers(
                        s.policy, s.batch.select(idx), loss_mask, idx, mixed_gram, adv[idx], z_total, n_total
                    )
            rows = self._analyse_mixed(s, mixed, idx, mixed_gram, r, adv, dim, first_group)
        # 3. the noise scale counts every group: one outside the Gram must carry no policy gradient (all A_i = 0)
        rest = torch.ones(r.shape[0], dtype=torch.bool)
        rest[mixed] = False
        noise_part["zero_rest"] = bool((s.advantages.detach().cpu().view(-1, R)[rest] == 0).all())
        # 4. every process's groups: the lens describes the whole batch, not rank 0's share
        parts = gather_objects({"rows": rows, "rewards": r, "valid": v, "coverage": coverage, "noise": noise_part})
        out = self._batch_metrics(parts, from_update=gram is not None, n_total=n_total, step=s.step)
        self._want_grad_sq, self._grad_sq, self._proxy_w = False, None, None
        self._pending = True
        out[mk.PERF_LENS_SECONDS] = time.perf_counter() - t0
        return out

    def _loss_normalizer(self, batch: RolloutBatch) -> tuple[torch.Tensor, float, float]:
        """(the loss's token mask [N, T], its normaliser Z and its rollouts N, both summed over processes as the
        trainer does): the per-rollout term the update weights is omega_i = (N/Z) v_i (docs/theory.md §3)."""
        c = self.settings
        loss_mask = overlong_loss_mask(batch.completion_mask, batch.truncated, c.overlong)  # the tokens it sums
        norm = gather_objects(
            (loss_normalizer(loss_mask, c.loss_aggregation, c.max_new_tokens), float(loss_mask.any(dim=1).sum()))
        )
        return loss_mask, sum(z for z, _ in norm), sum(n for _, n in norm)

    def _mixed_gram(
        self,
        step_batch: StepBatch,
        idx: torch.Tensor,
        loss_mask: torch.Tensor,
        z_total: float,
        n_total: float,
        sketch: torch.Tensor | None,
        gram: tuple[torch.Tensor, dict[str, Any]] | None,
    ) -> tuple[torch.Tensor, int, list[float], float]:
        """(the Gram [n, n] of the mixed groups' rows ``idx`` [n], the dimension P of the space its gradients live
        in (for the claims' simulated null), the exact Gram's coverage as a list of 0 or 1 values, the seconds its
        hooks spent inside the update's backward): read off the update's backward (``gram``: NaN between groups),
        from its sketched rows (``sketch``) or from the lens's own pass (:meth:`rollout_gram`)."""
        policy = step_batch.policy
        if gram is not None:
            g = gram[0][idx.unsqueeze(1), idx.unsqueeze(0)]  # [n_mixed * R, n_mixed * R]; NaN between groups
            return g, trainable_count(policy), [gram[1]["coverage"]], gram[1]["hook_seconds"]
        if sketch is None:
            c = self.settings
            omega = rollout_gradient_weights(loss_mask[idx.to(loss_mask.device)], c.loss_aggregation, z_total, n_total)
            own, cov, dim = self.rollout_gram(policy, step_batch.batch.select(idx), omega)  # on the CPU
            return own, dim, [cov] if cov is not None else [], 0.0
        grads = sketch[idx.to(sketch.device)].double().cpu()  # [n_mixed * R, P_s]
        return grads @ grads.T, grads.shape[1], [], 0.0

    def _analyse_mixed(
        self,
        step_batch: StepBatch,
        mixed: list[int],
        idx: torch.Tensor,
        gram: torch.Tensor,
        r: torch.Tensor,
        adv: torch.Tensor,
        dim: int,
        first_group: int,
    ) -> list[dict[str, float]]:
        """:func:`grpo_lens.analysis.group.analyse_group` of each mixed group ``mixed`` (rows ``idx``, Gram ``gram``
        [n, n] in that order), rewards ``r`` [B, R], advantages ``adv`` [N] float64, the null's dimension ``dim``;
        group b's seed follows the step and its index ``first_group + b`` in the whole batch."""
        c, R = self.settings, step_batch.batch.group_size
        sub = step_batch.batch.select(idx)
        return [
            analyse_group(
                gram[j * R : (j + 1) * R, j * R : (j + 1) * R],
                r[b].double(),
                adv[b * R : (b + 1) * R],
                estimator=c.estimator,
                std=c.std,
                std_eps=c.std_eps,
                completion_mask=sub.completion_mask[j * R : (j + 1) * R].cpu(),
                completion_ids=sub.completion_ids[j * R : (j + 1) * R].cpu(),
                num_random=4,
                null_dim=dim,
                seed=c.seed + step_batch.step * 1009 + first_group + b,
            )
            for j, b in enumerate(mixed)
        ]

    def _batch_metrics(
        self, parts: list[dict[str, Any]], from_update: bool, n_total: float, step: int
    ) -> dict[str, float]:
        """The step's lens metrics from every process's ``parts`` (rows, coverage, noise): the mean over mixed groups,
        the rank intervals, the exact Gram's coverage, the noise scale and verl's proxy beside it."""
        all_rows = [row for part in parts for row in part["rows"]]
        out: dict[str, float] = {}
        out[mk.RANK_MIXED_GROUPS] = float(len(all_rows))
        all_coverage = [x for part in parts for x in part["coverage"]]
        if all_coverage:
            out[mk.GRAD_GRAM_COVERAGE] = min(all_coverage)
        out.update({k: val for k, val in mean_over_groups(all_rows).items() if k != mk.GROUP_SIZE})
        out.update(lens_rank_intervals(all_rows))
        # S from the update covers every parameter, so D must too: the fused noise scale needs coverage 1
        if not (from_update and all_coverage and min(all_coverage) < 1.0) and all_rows:
            seed = self.settings.seed + step * 1009
            out.update(self.noise_metrics([part["noise"] for part in parts], from_update, seed=seed))
            proxies = [part["noise"]["proxy"] for part in parts if part["noise"].get("proxy") is not None]
            if proxies:  # verl's proxy beside the exact power, over the step's N rollouts in the loss
                proxy, exact = torch.cat([p for p, _ in proxies]), torch.cat([e for _, e in proxies])
                ok = proxy.isfinite() & exact.isfinite()
                out[mk.NOISE_PROXY_TOTAL_POWER] = float(proxy[ok].sum()) / n_total
                out[mk.NOISE_EXACT_TOTAL_POWER] = float(exact[ok].sum()) / n_total
                out[mk.NOISE_PROXY_RANK_CORR] = rank_correlation(proxy[ok], exact[ok])
        return out

    def noise_metrics(self, parts: list[dict[str, Any]], from_update: bool, seed: int) -> dict[str, float]:
        """``noise/*``: the exact gradient noise scale of the step (docs/theory.md §Noise scale and dead groups;
        :mod:`grpo_lens.formulas.noise`), the group the example, every group of every process counted (B).

        With one process and the full Gram of the analysed groups (the lens's own exact pass), S and D are sums of
        the group Gram M, with jackknife intervals and the sign-flip null. With the Gram read off the update's
        backward (each group's block alone), D comes from the blocks and S = |sum_b G_b|^2 is the update's first
        gradient norm squared (:meth:`before_step`): on that pass grad L = sum_i h_i exactly (lens_fuses_gram's
        conditions), so the point values are the same, without interval or null. Empty when the Gram is sketched, a
        group outside it has a nonzero advantage (its G_b is unknown), several processes ran the own pass (their
        cross blocks are unmeasured), or B < 2.

        Args:
            parts: each process's {"groups": its B_p, "sum_sq": its D_p, "m": its [B_a, B_a] group Gram when finite,
                "exact": bool, "zero_rest": bool}.   from_update: the Gram came from the update's backward.
            seed: the sign flips' seed.
        """
        B = sum(p["groups"] for p in parts)
        # a process without an analysed group has D_p = 0 and no Gram to be exact or not
        if B < 2 or not all((p["exact"] or p["m"] is None and p["sum_sq"] == 0) and p["zero_rest"] for p in parts):
            return {}
        if from_update:
            if self._grad_sq is None:
                return {}
            est = noise_scale_from_sums(sum(p["sum_sq"] for p in parts), self._grad_sq, B)
            extra: dict[str, float] = {mk.NOISE_FROM_UPDATE: 1.0}
        elif len(parts) == 1:
            m = parts[0]["m"] if parts[0]["m"] is not None else torch.zeros(0, 0, dtype=torch.float64)
            est = noise_scale(m, B)
            ci = noise_scale_jackknife(m, B)
            extra = {mk.NOISE_FROM_UPDATE: 0.0, mk.NOISE_GRAD_SQ_P: signal_sign_flip_p(m, seed=seed)}
            names = {
                "grad_sq_lo": mk.NOISE_GRAD_SQ_LO,
                "grad_sq_hi": mk.NOISE_GRAD_SQ_HI,
                "trace_sigma_lo": mk.NOISE_TRACE_SIGMA_LO,
                "trace_sigma_hi": mk.NOISE_TRACE_SIGMA_HI,
                "b_simple_lo": mk.NOISE_B_SIMPLE_LO,
                "b_simple_hi": mk.NOISE_B_SIMPLE_HI,
            }
            extra.update({names[k]: val for k, val in ci.items()})
        else:
            return {}
        return {
            mk.NOISE_GROUPS: float(B),
            mk.NOISE_GRAD_SQ: est["grad_sq"],
            mk.NOISE_TRACE_SIGMA: est["trace_sigma"],
            mk.NOISE_B_SIMPLE: est["b_simple"],
            mk.NOISE_SNR: est["snr"],
            **extra,
        }

    @torch.no_grad()
    def proxy_score_norms(self, policy: torch.nn.Module, sub: RolloutBatch, chunk: int = 8) -> torch.Tensor:
        """verl's W_i = sum_t |e_{o_t} - pi_t|^2 (:func:`grpo_lens.formulas.noise.score_norm_proxy`) of ``sub``'s n
        rollouts over the tokens the loss sums, pi the temperature-scaled policy (docs/theory.md §14): [n] float64 on
        the CPU, from no-grad forwards of ``chunk`` rollouts at a time."""
        c = self.settings
        mask = overlong_loss_mask(sub.completion_mask, sub.truncated, c.overlong)
        out = []
        for s in range(0, sub.num_rollouts, chunk):
            part = sub.select(torch.arange(s, min(s + chunk, sub.num_rollouts)))
            T = part.completion_ids.shape[1]
            logits = scored_logits(policy, part.input_ids(), part.attention_mask(), T)  # [n_c, T, V]
            logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / c.temperature, -1)
            p_tok = logp.gather(-1, part.completion_ids.unsqueeze(-1)).squeeze(-1).exp()  # [n_c, T]
            sum_sq = (2 * logp).exp().sum(-1)  # [n_c, T] sum_v pi_v^2
            out.append(score_norm_proxy(p_tok, sum_sq, mask[s : s + part.num_rollouts].to(p_tok.device)).cpu())
        return torch.cat(out)

    def proxy_powers(
        self,
        policy: torch.nn.Module,
        sub: RolloutBatch,
        loss_mask: torch.Tensor,
        idx: torch.Tensor,
        gram: torch.Tensor,
        adv: torch.Tensor,
        z_total: float,
        n_total: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(verl's A_i^2 W_i, the exact A_i^2 |sum_t grad log pi(o_it)|^2 = A_i^2 Gram_ii / omega_i^2) of the analysed
        rollouts ``idx`` [n] (docs/theory.md §Noise scale and dead groups): W_i from the stash taken before the update
        (the Gram read off the update) or from a forward now (the lens's own pass, before the update)."""
        c = self.settings
        omega = rollout_gradient_weights(loss_mask[idx.to(loss_mask.device)], c.loss_aggregation, z_total, n_total)
        exact = adv.square() * gram.diagonal().double() / omega.detach().cpu().double().square()
        w = self._proxy_w[idx] if self._proxy_w is not None else self.proxy_score_norms(policy, sub)
        return adv.square() * w.clamp(min=0), exact

    def rollout_gram(
        self, policy: torch.nn.Module, sub: RolloutBatch, omega: torch.Tensor
    ) -> tuple[torch.Tensor, float | None, int]:
        """(Gram [n, n] float64 on the CPU of ``sub``'s per-rollout gradients, its parameter coverage or None, the
        dimension P of the space the gradients live in: every trainable parameter, or the sketch's P_s).

        ``gram_source: exact`` without LoRA: the exact Gram of every parameter from one batched backward
        (:func:`grpo_lens.gradients.gram.exact_rollout_gram`; coverage = its share of the trainable parameters).
        Otherwise G G^T of :meth:`rollout_grads` (coverage None: the sketch's share is measured by the probe)."""
        c = self.settings
        if c.gram_source == "exact" and not is_lora(policy):
            gram, info = exact_rollout_gram(policy, sub, score_weights=omega, temperature=c.temperature)
            return gram, info["coverage"], trainable_count(policy)
        grads = self.rollout_grads(policy, sub, omega).cpu()
        return grads @ grads.T, None, grads.shape[1]

    def rollout_grads(self, policy: torch.nn.Module, sub: RolloutBatch, omega: torch.Tensor) -> torch.Tensor:
        """Per-rollout gradients g_i [n, P_s] (or [n, P_adapter]) float64 of ``sub``'s rollouts in the space
        ``settings.lens_space`` names.

        ``omega`` [n]: the loss aggregation's weights of each rollout's log-prob sum (docs/theory.md §3). Without LoRA:
        sketched gradients of every linear layer (P_s = layers * d_s^2, d_s = ``sketch_dim``). With LoRA see
        :func:`grpo_lens.gradients.lora_spaces.lora_rollout_grads` (``trainable``: the adapter's parameters, exact;
        ``full``: the frozen base linear weights, sketched).
        """
        c = self.settings
        if is_lora(policy):
            return lora_rollout_grads(
                policy,
                sub,
                c.lens_space,
                sketch_dim=c.sketch_dim,
                seed=c.seed,
                score_weights=omega,
                temperature=c.temperature,
            ).double()
        return sketch_rollout_grads(
            policy,
            sub,
            **square_sketch(c.sketch_dim),
            seed=c.seed,
            score_weights=omega,
            temperature=c.temperature,
        ).sketch.double()

    def before_update(
        self,
        policy: torch.nn.Module,
        batch: RolloutBatch,
        advantages: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
        beta: float = 0.0,
        kl_estimator: str = "k3",
        first: torch.Tensor | None = None,
    ) -> None:
        """At a lens step, before the policy update: with ``lens_landing`` keep the rows with A_i != 0 and their token
        weights w_it (:func:`grpo_lens.formulas.landing.token_update_weights`) for :meth:`landing_metrics` at the first
        optimizer step; with ``lens_dead_kl`` and beta > 0 take |grad L_dead|^2 now, L_dead the update's loss over the
        rows of groups whose advantages are all 0 (:meth:`dead_kl_sq_norm`). Both over the rows of the update's first
        mini-batch, whose gradient the first optimizer step takes, with its normaliser. Nothing with an FSDP2-sharded
        policy; the dead groups' norm with one process only (the update's gradient is summed over processes).

        Args:
            batch: this process's N rollouts.   advantages: [N].   ref_logp: [N, T] reference log-probs (None: beta 0
                or the KL folded into the reward).   beta, kl_estimator: the loss's KL term.
            first: [n] the rows of the update's first mini-batch
                (:func:`grpo_lens.train.update.mini_batch_rows`); None: all N.
        """
        self._landing, self._dead_kl_sq, self._extra, self._landing_seconds = None, None, {}, 0.0
        c = self.settings
        if not (c.lens_landing or c.lens_dead_kl) or is_sharded(policy):
            return
        t0 = time.perf_counter()
        R = batch.group_size
        adv_all = advantages.detach().cpu()
        dead_all = (adv_all.view(-1, R) == 0).all(dim=1).repeat_interleave(R)  # [N] rows of groups without A
        sel = torch.arange(batch.num_rollouts) if first is None else first.detach().to("cpu", torch.long)
        loss_mask = overlong_loss_mask(batch.completion_mask, batch.truncated, c.overlong)
        loss_mask = loss_mask[sel.to(loss_mask.device)]
        norm = gather_objects(
            (loss_normalizer(loss_mask, c.loss_aggregation, c.max_new_tokens), float(loss_mask.any(dim=1).sum()))
        )
        z_total, n_total = sum(z for z, _ in norm), sum(n for _, n in norm)
        adv, has_tokens = adv_all[sel], loss_mask.any(dim=1).cpu()
        if c.lens_landing and n_total > 0:
            rows = ((adv != 0) & has_tokens).nonzero().flatten()  # into sel
            if rows.numel():
                mask = loss_mask[rows.to(loss_mask.device)]
                omega = rollout_gradient_weights(mask, c.loss_aggregation, z_total, n_total)
                w = token_update_weights(adv[rows], omega, mask, n_total)
                self._landing = (batch.select(sel[rows]), w, adv[rows])
        dead = (dead_all[sel] & has_tokens).nonzero().flatten()  # into sel
        if c.lens_dead_kl and beta > 0 and ref_logp is not None and len(norm) == 1 and z_total > 0:
            self._dead_kl_sq = 0.0
            if dead.numel():
                sub_ref = ref_logp[sel[dead].to(ref_logp.device)]
                self._dead_kl_sq = self.dead_kl_sq_norm(
                    policy,
                    batch.select(sel[dead]),
                    loss_mask[dead.to(loss_mask.device)],
                    sub_ref,
                    beta,
                    kl_estimator,
                    z_total,
                )
        self._landing_seconds = time.perf_counter() - t0

    def dead_kl_sq_norm(
        self,
        policy: torch.nn.Module,
        sub: RolloutBatch,
        loss_mask: torch.Tensor,
        ref_logp: torch.Tensor,
        beta: float,
        kl_estimator: str,
        normalizer: float,
    ) -> float:
        """|grad L_dead|^2 over every trainable parameter, L_dead = :func:`grpo_lens.formulas.losses.grpo_loss` of the
        n rollouts ``sub`` (all with A_i = 0: the policy term has no gradient, what is left is beta grad KL) with their
        loss mask [n, T] and reference log-probs [n, T], the update's aggregation and its mini-batch's ``normalizer``
        Z, on-policy (pi_old = pi); one forward + backward of those rows (``.grad`` untouched), a float64 sum of
        squares."""
        c = self.settings
        params = [p for p in policy.parameters() if p.requires_grad]
        logp = batch_logprobs(policy, sub, c.temperature)
        loss, _ = grpo_loss(
            logp,
            logp.detach(),
            torch.zeros(sub.num_rollouts, dtype=logp.dtype, device=logp.device),
            loss_mask.to(logp.device),
            normalizer=normalizer,
            aggregation=c.loss_aggregation,
            beta=beta,
            ref_logp=ref_logp.to(logp.device),
            kl_estimator=kl_estimator,
        )
        if not loss.requires_grad:
            return 0.0
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return squared_norm([g for g in grads if g is not None])

    def landing_metrics(self, policy: torch.nn.Module) -> dict[str, float]:
        """``landing/*`` and ``dead/kl_grad_*`` at the update's first optimizer step, from ``.grad`` = grad L (summed
        over processes, before clipping): u = -grad L, the directional derivatives <grad log pi(o_it), u> of the kept
        rows' tokens by four no-grad forwards (:func:`grpo_lens.gradients.token_credit.token_directional_derivatives`,
        Richardson-extrapolated central differences, the weights restored bit for bit), s_it =
        :func:`grpo_lens.formulas.credit.signed_contributions`, summed per label by
        :func:`grpo_lens.formulas.landing.landing_shares` (docs/theory.md §Landing shares and the dead groups' KL
        gradient)."""
        t0 = time.perf_counter()
        landing, self._landing = self._landing, None
        dead_sq, self._dead_kl_sq = self._dead_kl_sq, None
        params = [p for p in policy.parameters() if p.requires_grad and p.grad is not None]
        u = [-p.grad.detach() for p in params]  # type: ignore[union-attr]  # params: those with a .grad
        u_sq = squared_norm(u)
        out: dict[str, float] = {}
        if dead_sq is not None:
            out[mk.DEAD_KL_GRAD_NORM] = math.sqrt(dead_sq)
            out[mk.DEAD_KL_GRAD_RATIO] = gradient_norm_ratio(dead_sq, u_sq)
        if landing is not None and u_sq > 0:
            sub, w, adv = landing
            d = token_directional_derivatives(
                policy, sub, u, params, temperature=self.settings.temperature, norm=math.sqrt(u_sq)
            )
            s = signed_contributions(w, d, u_sq)["contributions"]  # [n, T]
            measured = w != 0
            sign = torch.where(adv > 0, 0, 1).unsqueeze(1).expand_as(w)
            shares, closure = landing_shares(s, torch.where(measured, sign, -1), 2)
            out.update({mk.LANDING_POSITIVE_SHARE: float(shares[0]), mk.LANDING_CLOSURE: closure})
            out[mk.LANDING_TOKENS] = float(measured.sum())
            if self.tokenizer is not None:
                classes = token_classes(self.tokenizer, sub.completion_ids.cpu(), measured)
                shares, _ = landing_shares(s, classes, len(TOKEN_CLASSES))
                counts = torch.bincount(classes[classes >= 0], minlength=len(TOKEN_CLASSES)).double()
                tokens = counts / counts.sum().clamp(min=1)
                names = dict(
                    zip(
                        TOKEN_CLASSES,
                        zip(
                            (mk.LANDING_ANSWER_SHARE, mk.LANDING_FORMAT_SHARE, mk.LANDING_REASONING_SHARE),
                            (
                                mk.LANDING_ANSWER_TOKEN_SHARE,
                                mk.LANDING_FORMAT_TOKEN_SHARE,
                                mk.LANDING_REASONING_TOKEN_SHARE,
                            ),
                        ),
                    )
                )
                for k, name in enumerate(TOKEN_CLASSES):
                    out[names[name][0]] = float(shares[k])
                    out[names[name][1]] = float(tokens[k])
        out[mk.PERF_LENS_LANDING_SECONDS] = self._landing_seconds + time.perf_counter() - t0
        return out

    def before_step(self, policy: torch.nn.Module) -> None:
        """Snapshot the weights (bf16, and the fixed sample with the step's gradient) just before the first optimizer
        step of a lens step; on every step, add the sampled gradient to the sum since the start."""
        self.sparsity.accumulate_grad()
        if self._landing is not None or self._dead_kl_sq is not None:
            self._extra.update(self.landing_metrics(policy))
        if self._want_grad_sq and not is_sharded(policy):  # S of the noise scale: the update's first gradient
            sq = [
                torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2
                for p in policy.parameters()
                if p.requires_grad and p.grad is not None
            ]
            self._grad_sq = float(sum(sq)) if sq else 0.0
            self._want_grad_sq = False
        if self._pending:
            t0 = time.perf_counter()
            self.tracker.mark()  # the 'previous' snapshot now (comparing it would cost two full-model passes)
            self.sparsity.before_step()
            self._sparsity_seconds = time.perf_counter() - t0

    def after_step(self, step: int, policy: torch.nn.Module, lens_step: bool) -> dict[str, float]:
        """S4 after the step's optimizer steps: shares of parameters whose bf16 value did not change."""
        extra, self._extra = self._extra, {}
        if not (lens_step and self._pending):
            return extra

        t0 = time.perf_counter()
        self._pending = False
        out = self.tracker.update()
        out.update(extra)
        out.update(self.sparsity.after_step())
        out[mk.PERF_LENS_SPARSITY_SECONDS] = self._sparsity_seconds + time.perf_counter() - t0
        return out
