"""The policy update of one step: mu passes over the step's rollouts, mini-batches (one AdamW step each) of
micro-batches (one forward + backward each), GRPO's clipped surrogate with optional KL term and importance weights.

:func:`policy_update` reads as its four parts: :func:`plan_update` (the mini- and micro-batches and, when later
optimizer steps need it, pi_old), :func:`backward_mini_batch` (one pass over one mini-batch: forward, loss,
backward, metric sums), :func:`optimizer_step` (gradient all-reduce, clipping, the non-finite guard, AdamW) and
:func:`update_metrics` (the sums reduced over processes into the step's metrics). The lens's gradient capture, when
the trainer passes one, is opened and closed by :func:`policy_update` around exactly the first pass over the first
mini-batch. :func:`lens_reads_update` says when that capture can serve the lens (one answer for all processes);
:func:`grpo_lens.rollout.forward_precision` is the context of every model forward of a step (bf16 autocast for
``bf16-mixed``).

Several processes: every process holds its share of the step's groups; each loss is divided by the normaliser summed
over processes and the gradients are summed with an all-reduce, so the update equals a single process's on the whole
batch. With num_mini_batches M, each process splits its share into M chunks and optimizer step k sums chunk k of
every process.

Shapes: N rollouts on this process, T completion tokens, Lp prompt tokens.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_lens import metrics as mk
from grpo_lens.config import TrainConfig
from grpo_lens.formulas.losses import (
    ZERO_AT_ZERO_ADVANTAGE,
    grpo_loss,
    loss_normalizer,
    mismatch_sums,
    truncated_is_weights,
)
from grpo_lens.formulas.overlong import overlong_loss_mask
from grpo_lens.lens.step_batch import StepBatch
from grpo_lens.rollout import RolloutBatch, batch_logprobs, forward_precision, group_logprobs
from grpo_lens.rundir import crash_point
from grpo_lens.runtime.memory import auto_micro_batch_size, total_memory_bytes
from grpo_lens.runtime.processes import Processes
from grpo_lens.train.state import Lens

logger = logging.getLogger(__name__)


def policy_update(
    policy,
    optimizer,
    batch: RolloutBatch,
    advantages: torch.Tensor,
    ref_logp: torch.Tensor | None,
    config: TrainConfig,
    procs: Processes,
    params: list[torch.nn.Parameter],
    before_step: Callable[[], None] | None = None,
    step: int = 0,
    capture: Any = None,
    per_rollout: bool = False,
) -> dict[str, float]:
    """mu passes over the step's rollouts, each split into mini-batches (one optimizer step each) and micro-batches.

    pi_old is the trainer's own forward, detached (docs/theory.md §Log-probabilities): on the first pass over the
    first mini-batch it is the very logp being differentiated, so the ratio is exactly 1 in any dtype; when later
    optimizer steps need it (mu > 1 or several mini-batches) it is computed once, without gradient, before the first
    update. The sampler's recorded log-probs enter only the ``mismatch/*`` metrics and, with ``tis_cap``, the
    truncated importance weights.

    Args:
        batch: this process's N rollouts.   advantages: [N].   ref_logp: [N, T] or None (beta = 0).
        before_step: called after the last backward, before the first optimizer step (the lens snapshots there).
        step: the trainer step (for the crash-test hook and the guard's warning only).
        capture: a context manager (the lens's :class:`grpo_lens.gradients.sketch.GradientCapture`, or its
            :class:`grpo_lens.gradients.gram.MicroBatchGrams`, whose ``micro_batch(idx)`` is also entered around each
            micro-batch's forward + backward) entered around every forward + backward of the first pass over the
            first mini-batch, and left right after it; None for none.
        per_rollout: every rollout runs its own prompt in every forward of the step (:func:`update_logprobs`); the
            trainer sets it on lens steps on the cadence (:func:`grpo_lens.train.loop.on_lens_cadence`), so that a
            step's numbers do not depend on whether the lens read the update or ran its own pass; not on a run's last
            step off the cadence, whose update must be a lens-off step's (a longer resumed run does not measure it).
            The pass a capture covers runs every rollout's own prompt either way.
    Returns:
        token-weighted means of the loss metrics over every micro-batch of every pass and every process (the same
        numbers on every process), ``policy/entropy`` (token mean over the first pass's completion tokens of the
        entropy of the temperature-scaled policy, from the logits that pass computes anyway), plus ``grad/norm``
        (the pre-clipping norm of the first optimizer step, the on-policy gradient), ``grad/norm_last``,
        ``grad/optimizer_steps``, ``guard/skipped_optimizer_steps`` and the ``mismatch/*`` metrics (first pass,
        sampler vs pi_old); see :func:`update_metrics`.
    """
    plan = plan_update(policy, batch, config, procs, per_rollout)
    still = still_rows(advantages, batch.group_size, config, procs)
    sums = UpdateSums()
    for pass_ in range(config.mu):
        for mb in range(len(plan.mini_batches)):
            # the lens's capture covers exactly the first pass over the first mini-batch: the on-policy gradient
            first = capture is not None and pass_ == 0 and mb == 0
            around = capture if first else contextlib.nullcontext()
            with around:  # a capture with ``micro_batch`` (the fused exact Gram) is also entered per micro-batch
                nonfinite_loss = backward_mini_batch(
                    policy,
                    batch,
                    advantages,
                    ref_logp,
                    plan,
                    mb,
                    pass_,
                    config,
                    procs,
                    sums,
                    getattr(capture, "micro_batch", None) if first else None,
                    per_rollout=per_rollout or first,  # a capture needs every rollout's own prompt positions
                    # a sketch's capture reads every row's gradient; the fused Gram's wants the mixed groups only
                    still=still if not first or hasattr(capture, "micro_batch") else None,
                )
            norm, skipped = optimizer_step(
                optimizer, params, config, procs, nonfinite_loss, step, before_step if not sums.grad_norms else None
            )
            sums.grad_norms.append(norm)
            sums.skipped += int(skipped)
    return update_metrics(sums, config, procs)


@dataclass
class UpdatePlan:
    """How one step's update walks its rollouts.

    mini_batches: row indices of each mini-batch (whole groups; one optimizer step each).   micro_batches: for each
    mini-batch, the row indices of its micro-batches (one forward + backward each).   old_logp: [N, T] pi_old of
    every rollout, computed before the first optimizer step when the policy moves within the step (mu > 1 or several
    mini-batches), else None.   loss_mask: [N, T] the tokens in the loss (:func:`overlong_loss_mask`).
    """

    mini_batches: list[torch.Tensor]
    micro_batches: list[list[torch.Tensor]]
    old_logp: torch.Tensor | None
    loss_mask: torch.Tensor


def mini_batch_rows(groups: int, group_size: int, M: int) -> list[torch.Tensor]:
    """The row indices of the M mini-batches (one optimizer step each) of G = ``groups`` groups of R rollouts.

    Whole groups, as evenly as possible (sizes differ by at most one group) when G >= M; with fewer groups than
    mini-batches (dynamic sampling kept few) the N = G R rollouts themselves are split as evenly as possible, since
    their advantages are fixed before the update. So a step takes M optimizer steps whatever number of groups it
    kept (fewer only when N < M, never an empty mini-batch). Chunk k of every process is optimizer step k's share.

    Returns:
        min(M, max(G, G R)) index tensors into the N rows, in order.
    """
    if groups >= M:
        return [
            torch.cat([torch.arange(g * group_size, (g + 1) * group_size) for g in chunk.tolist()])
            for chunk in torch.tensor_split(torch.arange(groups), M)
        ]
    return [rows for rows in torch.tensor_split(torch.arange(groups * group_size), M) if len(rows)]


def plan_update(
    policy: torch.nn.Module, batch: RolloutBatch, config: TrainConfig, procs: Processes, per_rollout: bool = False
) -> UpdatePlan:
    """Split the N = G R rollouts into ``num_mini_batches`` mini-batches (:func:`mini_batch_rows`) and each into
    micro-batches of ``micro_batch_size`` rollouts (or :func:`auto_micro_batch_size`'s choice, the smallest over
    processes for an FSDP2-sharded policy, so that every process runs as many forwards), and compute pi_old when
    needed (``per_rollout``: every rollout's own prompt, :func:`update_logprobs`)."""
    mini_batches, micro_batches = batch_rows(policy, batch, config, procs)
    old_logp = None  # [N, T] pi_old of every rollout, needed once the policy has moved within this step
    if config.mu > 1 or len(mini_batches) > 1:
        logprobs = update_logprobs(config, procs, per_rollout)
        with torch.no_grad():
            for micros in micro_batches:
                for idx in micros:
                    with forward_precision(procs.device, config.dtype):
                        logp = logprobs(policy, batch.select(idx), config.temperature)
                    if old_logp is None:  # the forward's dtype (float64 for a float64 model)
                        old_logp = batch.sampler_logprobs.new_zeros(batch.sampler_logprobs.shape, dtype=logp.dtype)
                    old_logp[idx] = logp
    loss_mask = overlong_loss_mask(batch.completion_mask, batch.truncated, config.overlong)  # [N, T]
    return UpdatePlan(mini_batches, micro_batches, old_logp, loss_mask)


def still_rows(advantages: torch.Tensor, group_size: int, config: TrainConfig, procs: Processes) -> torch.Tensor | None:
    """[N] bool: the rows of groups whose every advantage is exactly 0 (no reward contrast: S1's groups), where the
    update's loss has no gradient; None when there is none, or when the loss could have one there (docs/theory.md
    §Groups without reward contrast).

    The clipped surrogate (``vanilla``) is -min(rho A, clip(rho) A) per token: 0 for any ratio rho at A = 0, and so
    is its gradient, with any token weight (TIS) or dual clip; so are the other losses of
    :data:`grpo_lens.formulas.losses.ZERO_AT_ZERO_ADVANTAGE` (gspo, cispo, sapo, gpg); a KL term in the loss
    (beta > 0, KL not folded into the reward) is not. An FSDP2-sharded policy gets None too: every forward there is
    a collective, run alike on every process. The update forwards these rows without gradient
    (:func:`backward_mini_batch`), for their metrics.

    Args:
        advantages: [N] (NaN rows are never still).   group_size: R; N = G R.
    """
    if (
        procs.sharded
        or config.policy_loss not in ZERO_AT_ZERO_ADVANTAGE
        or (config.beta > 0 and not config.kl_in_reward)
    ):
        return None
    zero = (advantages.detach() == 0).reshape(-1, group_size).all(dim=1)  # [G]
    return zero.repeat_interleave(group_size).cpu() if bool(zero.any()) else None


def update_logprobs(config: TrainConfig, procs: Processes, per_rollout: bool = False) -> Callable[..., Any]:
    """The log-prob function of the update's (and the reference model's) forwards: :func:`group_logprobs`, each
    group's prompt run once, with ``shared_prompt_forward`` on; :func:`batch_logprobs`, every rollout's own prompt,
    with it off, on a lens step (``per_rollout``: the lens's hooks need each rollout's prompt positions, and a lens
    step runs alike whichever pass the lens reads), or on an FSDP2-sharded policy (every forward is a collective,
    and group_logprobs' count of forwards depends on the batch). Both take (model, batch, temperature,
    return_entropy=False) and agree up to float rounding."""
    if config.shared_prompt_forward and not per_rollout and not procs.sharded:
        return group_logprobs
    return batch_logprobs


def batch_rows(
    policy: torch.nn.Module, batch: RolloutBatch, config: TrainConfig, procs: Processes
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """(the row indices of each mini-batch, of each mini-batch's micro-batches) of :func:`plan_update`; no forward
    (the lens asks before the update whether its groups lie within one micro-batch each, :func:`lens_fuses_gram`)."""
    mini_batches = mini_batch_rows(batch.num_groups, config.group_size, config.num_mini_batches)
    L, T = batch.prompt_ids.shape[1] + batch.completion_ids.shape[1], batch.completion_ids.shape[1]
    sizes = [
        config.micro_batch_size or auto_micro_batch_size(policy, len(mini), L, T, total_memory_bytes(procs.device))
        for mini in mini_batches
    ]
    if procs.sharded and not config.micro_batch_size:  # FSDP2: as many forwards on every process (each a collective)
        sizes = [max(1, int(-procs.max_float(-size))) for size in sizes]
    micro_batches = [[mini[s : s + size] for s in range(0, len(mini), size)] for mini, size in zip(mini_batches, sizes)]
    return mini_batches, micro_batches


@dataclass
class UpdateSums:
    """This process's running sums over one step's update, in the order the micro-batches ran.

    totals: loss metrics (``loss/policy``, ``loss/kl``: normalised shares averaged over optimizer steps;
    ``ratio/max``: a maximum; the rest token-weighted sums).   tokens: the tokens those sums weigh.
    entropy_sum, entropy_tokens: the first pass's policy entropy summed over its completion tokens, and their count.
    mismatch, tis: the first pass's :func:`mismatch_sums` and truncated-importance-weight sums.   grad_norms: the
    pre-clipping gradient norm of every optimizer step.   skipped: optimizer steps skipped by the non-finite guard.
    """

    totals: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0
    entropy_sum: float = 0.0
    entropy_tokens: float = 0.0
    mismatch: dict[str, float] = field(
        default_factory=lambda: {"abs_diff_sum": 0.0, "abs_diff_max": 0.0, "k3_sum": 0.0, "tokens": 0.0}
    )
    tis: dict[str, float] = field(default_factory=lambda: {"weight_sum": 0.0, "capped": 0.0, "tokens": 0.0})
    grad_norms: list[float] = field(default_factory=list)
    skipped: int = 0

    def add_first_pass(self, entropy: torch.Tensor, old: torch.Tensor, micro: RolloutBatch) -> None:
        """The first pass's entropy [n, T] and sampler-vs-pi_old mismatch of micro-batch ``micro``."""
        self.entropy_sum += float((entropy * micro.completion_mask).sum())
        self.entropy_tokens += float(micro.completion_mask.sum())
        part = mismatch_sums(old, micro.sampler_logprobs, micro.completion_mask)
        for k in ("abs_diff_sum", "k3_sum", "tokens"):
            self.mismatch[k] += part[k]
        self.mismatch["abs_diff_max"] = max(self.mismatch["abs_diff_max"], part["abs_diff_max"])

    def add_tis(self, weights: torch.Tensor, completion_mask: torch.Tensor, cap: float) -> None:
        """The first pass's truncated importance weights [n, T] over the completion tokens: sum, capped count."""
        w = weights[completion_mask]
        self.tis["weight_sum"] += float(w.sum())
        self.tis["capped"] += float((w >= cap).sum())
        self.tis["tokens"] += float(w.numel())

    def add_loss_metrics(self, metrics: dict[str, float], optimizer_steps: int) -> None:
        """One micro-batch's :func:`grpo_loss` metrics (``tokens`` popped from ``metrics``); ``optimizer_steps`` =
        mu M, over which the normalised ``loss/*`` shares are averaged."""
        tok = metrics.pop("tokens")
        self.tokens += tok
        for k, v in metrics.items():
            if k in (mk.LOSS_POLICY, mk.LOSS_KL):  # already normalised shares: they add up
                self.totals[k] = self.totals.get(k, 0.0) + v / (optimizer_steps / 1.0)
            elif k == mk.RATIO_MAX:
                self.totals[k] = max(self.totals.get(k, 0.0), v)
            else:
                self.totals[k] = self.totals.get(k, 0.0) + v * tok


def backward_mini_batch(
    policy: torch.nn.Module,
    batch: RolloutBatch,
    advantages: torch.Tensor,
    ref_logp: torch.Tensor | None,
    plan: UpdatePlan,
    mb: int,
    pass_: int,
    config: TrainConfig,
    procs: Processes,
    sums: UpdateSums,
    micro_capture: Callable[[torch.Tensor], Any] | None = None,
    per_rollout: bool = False,
    still: torch.Tensor | None = None,
) -> bool:
    """Pass ``pass_`` over mini-batch ``mb``: forward, :func:`grpo_loss` and backward of each micro-batch, the
    gradients accumulating in ``.grad``, the metrics in ``sums``. Returns whether any micro-batch's loss was
    non-finite. ``still``: [N] bool, rows without a loss gradient (:func:`still_rows`): forwarded without gradient,
    each group's prompt once where ``shared_prompt_forward`` allows, outside the capture, and left out of the backward.

    pi_old is the forward's own detached log-prob on the first pass over the first mini-batch (ratio exactly 1),
    else ``plan.old_logp``. The loss is normalised by the mini-batch's :func:`loss_normalizer` summed over processes
    (with ``--overlong filter`` truncated rollouts leave it too). ``micro_capture(idx)``, when given, is a context
    entered around each micro-batch's forward and backward (the fused lens's hooks, :func:`policy_update`);
    ``per_rollout``: every rollout runs its own prompt (a pass the lens captures, :func:`update_logprobs`).
    """
    per_rollout = per_rollout or micro_capture is not None  # the fused Gram's hooks read every rollout's own rows
    mask = plan.loss_mask[plan.mini_batches[mb]]
    (normalizer,) = procs.sum_floats([loss_normalizer(mask, config.loss_aggregation, config.max_new_tokens)])
    nonfinite_loss = False
    for idx in plan.micro_batches[mb]:
        nonfinite_loss |= _backward_micro_batch(
            policy,
            batch,
            idx,
            advantages,
            ref_logp,
            plan,
            mb,
            pass_,
            normalizer,
            config,
            procs,
            sums,
            per_rollout,
            micro_capture,
            None if still is None else still[idx],
        )
    return nonfinite_loss


def _backward_micro_batch(
    policy: torch.nn.Module,
    batch: RolloutBatch,
    idx: torch.Tensor,
    advantages: torch.Tensor,
    ref_logp: torch.Tensor | None,
    plan: UpdatePlan,
    mb: int,
    pass_: int,
    normalizer: float,
    config: TrainConfig,
    procs: Processes,
    sums: UpdateSums,
    per_rollout: bool = False,
    micro_capture: Callable[[torch.Tensor], Any] | None = None,
    still: torch.Tensor | None = None,
) -> bool:
    """Forward, :func:`grpo_loss` and backward of the micro-batch of rows ``idx`` (see :func:`backward_mini_batch`);
    returns whether its loss was non-finite. ``still``: [n] bool, the rows to forward without gradient."""
    micro = batch.select(idx)
    moving = torch.arange(len(idx)) if still is None else (~still).nonzero().squeeze(1)  # rows with a gradient
    parts = []  # (rows of the micro-batch, their log-probs [r, T], entropy [r, T])
    if moving.numel() < len(idx):
        # moving.numel() < len(idx) only when still is given
        quiet = still.nonzero().squeeze(1)  # type: ignore[union-attr]
        with torch.no_grad(), forward_precision(procs.device, config.dtype):
            logp, entropy = update_logprobs(config, procs)(
                policy, micro.select(quiet), config.temperature, return_entropy=True
            )
        parts.append((quiet, logp, entropy))
    capture = micro_capture(idx[moving]) if micro_capture is not None and moving.numel() else contextlib.nullcontext()
    with capture:  # around the forward and the backward of the rows with a gradient
        if moving.numel():
            part = micro if moving.numel() == len(idx) else micro.select(moving)
            with forward_precision(procs.device, config.dtype):
                logprobs = update_logprobs(config, procs, per_rollout)
                logp, entropy = logprobs(policy, part, config.temperature, return_entropy=True)
            parts.append((moving, logp, entropy))
        logp, entropy = _in_row_order(parts)
        # the first pass records old_logp for the later ones
        old = logp.detach() if pass_ == 0 and mb == 0 else plan.old_logp[idx]  # type: ignore[index]
        if pass_ == 0:
            sums.add_first_pass(entropy, old, micro)
        weights = None
        if config.tis_cap is not None:
            weights = truncated_is_weights(old, micro.sampler_logprobs, config.tis_cap)
            if pass_ == 0:
                sums.add_tis(weights, micro.completion_mask, config.tis_cap)
        loss, m = grpo_loss(
            logp,
            old,
            advantages[idx],
            plan.loss_mask[idx],
            normalizer=normalizer,
            aggregation=config.loss_aggregation,
            eps_low=config.eps_low,
            eps_high=config.eps_high,
            dual_clip=config.dual_clip,
            beta=0.0 if config.kl_in_reward else config.beta,
            ref_logp=None if ref_logp is None else ref_logp[idx],
            kl_estimator=config.kl_estimator,
            token_weights=weights,
            policy_loss=config.policy_loss,
            sapo_tau_pos=config.sapo_tau_pos,
            sapo_tau_neg=config.sapo_tau_neg,
        )
        if moving.numel():  # a micro-batch of still rows only has no gradient to add
            loss.backward()
    sums.add_loss_metrics(m, config.mu * len(plan.mini_batches))
    return not bool(torch.isfinite(loss.detach()))


def _in_row_order(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [n, T], entropy [n, T]) of a micro-batch from its forwards' parts (its rows [r], their log-probs
    [r, T], entropy [r, T]), the rows back in the micro-batch's order."""
    if len(parts) == 1:
        return parts[0][1], parts[0][2]
    order = torch.argsort(torch.cat([rows for rows, _, _ in parts]))
    return torch.cat([lp for _, lp, _ in parts])[order], torch.cat([ent for _, _, ent in parts])[order]


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    config: TrainConfig,
    procs: Processes,
    nonfinite_loss: bool,
    step: int,
    before_step: Callable[[], None] | None,
) -> tuple[float, bool]:
    """One optimizer step on the accumulated gradients, guarded (docs/theory.md §Numerical guards).

    Sums the gradients over processes, calls ``before_step`` (None: nothing), clips to ``max_grad_norm`` (0: no
    clipping), and steps AdamW unless the loss or the gradient norm was non-finite on any process; in that case
    every process skips together and the weights and AdamW's moments stay as they were. Gradients are zeroed either
    way. Returns (the pre-clipping gradient norm, whether the step was skipped).
    """
    procs.sum_grads(params)  # each process's loss already carries the global normaliser
    if before_step is not None:
        before_step()
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    skipped = procs.any(nonfinite_loss or not math.isfinite(norm))  # every process skips together
    if skipped:  # no optimizer (or scheduler) change
        logger.warning("step %d: non-finite loss or gradient (norm %s); optimizer step skipped", step, norm)
    else:
        crash_point("before_optimizer_step", step)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, skipped


def update_metrics(sums: UpdateSums, config: TrainConfig, procs: Processes) -> dict[str, float]:
    """The step's update metrics from ``sums``, reduced over processes: the whole batch's numbers, the same on every
    process (see :func:`policy_update` for the keys)."""
    keys = sorted(k for k in sums.totals if k != mk.RATIO_MAX)  # the same keys, in the same order, on every process
    *summed, tokens_total = procs.sum_floats([sums.totals[k] for k in keys] + [sums.tokens])
    totals = dict(sums.totals)
    totals.update(zip(keys, summed))
    entropy_sum, entropy_tokens = procs.sum_floats([sums.entropy_sum, sums.entropy_tokens])
    if mk.RATIO_MAX in totals:
        totals[mk.RATIO_MAX] = procs.max_float(totals[mk.RATIO_MAX])
    out = {
        k: (v if k in (mk.LOSS_POLICY, mk.LOSS_KL, mk.RATIO_MAX) else v / max(tokens_total, 1.0))
        for k, v in totals.items()
    }
    out[mk.POLICY_ENTROPY] = entropy_sum / max(entropy_tokens, 1.0)
    out.update(_mismatch_metrics(sums.mismatch, sums.tis if config.tis_cap is not None else None, procs))
    out[mk.GRAD_NORM] = sums.grad_norms[0]
    out[mk.GRAD_NORM_LAST] = sums.grad_norms[-1]
    out[mk.GRAD_OPTIMIZER_STEPS] = len(sums.grad_norms) - sums.skipped
    out[mk.GUARD_SKIPPED_OPTIMIZER_STEPS] = sums.skipped
    return out


def lens_reads_update(
    config: TrainConfig,
    lens: Lens,
    rewards: torch.Tensor,
    valid: torch.Tensor,
    advantages: torch.Tensor,
    procs: Processes | None = None,
) -> bool:
    """Whether the lens can take its g_i from the update's first pass
    (:func:`grpo_lens.lens.trainer_lens.scores_from_update_rows`).

    True when ``lens_from_update`` is on, ``gram_source`` is sketch, the lens offers ``update_capture``, and the first
    pass's loss gradient is
    -(A_i / N) grad(omega_i sum_t log pi) per rollout: no KL term (beta 0), no importance weights (tis_cap unset),
    both clip ranges > 0 (ratio 1 lies inside them), one mini-batch (the first pass covers every rollout before any
    optimizer step), and every advantage of the groups the lens analyses finite and nonzero; never with LoRA
    (``lora_rank`` > 0).

    The config conditions are the same on every process; the advantage condition is on this process's groups, so
    with ``procs`` every process answers True only when all of them would (one all-reduce): a process that opens
    the capture while another runs the lens's own pass would wait in different collectives.

    Args:
        rewards: [N] (NaN where invalid).   valid: [N] bool.   advantages: [N].   procs: the processes (None: this
            process alone decides).
    """
    if not (config.lens_from_update and hasattr(lens, "update_capture") and hasattr(lens, "mixed_groups")):
        return False
    if config.beta > 0 or config.tis_cap is not None or config.eps_low <= 0 or config.eps_high <= 0:
        return False
    if config.lora_rank > 0:  # the lens measures the adapter exactly, or the frozen base weights, on its own pass
        return False
    if config.gram_source != "sketch":  # the exact Gram needs every rollout in one backward: the lens's own pass
        return False
    if config.num_mini_batches != 1:
        return False
    R = config.group_size
    mixed = lens.mixed_groups(rewards, valid, R)
    a = advantages.detach().view(-1, R)[mixed] if mixed else None
    here = a is not None and bool(torch.isfinite(a).all() and (a != 0).all())  # no mixed group: own path, no cost
    return here if procs is None else not procs.any(not here)


def lens_fuses_gram(config: TrainConfig, lens: Lens, step_batch: StepBatch, procs: Processes) -> str | None:
    """None when the lens's exact Gram can be captured in the update's own first backward and the rollout weights
    divided out (:class:`grpo_lens.gradients.gram.MicroBatchGrams`,
    :func:`grpo_lens.lens.trainer_lens.score_gram_from_update`,
    docs/theory.md §Lens inside the update's backward); else why not, in words (the lens then runs its own pass).

    The first pass's per-token loss weights factor as one scalar per rollout times its score, grad L_i =
    -(A_i / N) g_i with g_i = grad(omega_i sum_t log pi), when: the loss has no per-token KL term (beta 0, or
    ``kl_in_reward``), no importance weights (tis_cap unset), both clip ranges > 0 (ratio 1 lies inside them), one
    mini-batch (the first pass covers every rollout before any optimizer step); and, for the groups the lens
    analyses, every A_i finite and nonzero (A_i = 0 leaves nothing of g_i to divide: such a step keeps the own pass),
    the loss mask their whole completion (not ``--overlong`` masking or filtering them), and each group within one
    micro-batch (entries of two micro-batches share no backward). Not with ``--estimator optimal`` (its weights need
    the norms before the advantages), LoRA or sketched Grams (their own paths), an FSDP2-sharded
    policy, or ``bf16-mixed`` (the lens's own pass runs without autocast). With several processes all answer alike
    (one all-reduce).

    Args:
        step_batch: the step's policy, this process's N rollouts, their rewards [N] (NaN where invalid), valid [N]
            bool and advantages [N].
    """
    reason = None
    if not (config.lens_from_update and hasattr(lens, "update_gram_capture") and hasattr(lens, "mixed_groups")):
        reason = "lens_from_update off"
    elif config.gram_source != "exact" or config.lora_rank > 0:
        reason = "not the exact Gram (sketch or LoRA)"
    elif config.beta > 0 and not config.kl_in_reward:
        reason = "beta > 0 with a per-token KL term in the loss"
    elif config.estimator == "optimal":
        reason = "--estimator optimal"
    elif config.tis_cap is not None or config.eps_low <= 0 or config.eps_high <= 0:
        reason = "importance weights or a zero clip range"
    elif config.num_mini_batches != 1:
        reason = "several mini-batches"
    elif procs.sharded or config.dtype == "bf16-mixed":
        reason = "FSDP2 or bf16-mixed"
    else:
        reason = _groups_fuse(config, lens, step_batch, procs)
    return reason if not procs.any(reason is not None) else (reason or "another process's groups")


def _groups_fuse(config: TrainConfig, lens: Lens, step_batch: StepBatch, procs: Processes) -> str | None:
    """The per-step conditions of :func:`lens_fuses_gram` on this process's mixed groups (None: they hold)."""
    R, batch = config.group_size, step_batch.batch
    # an optional lens method, looked up with hasattr (Lens's docstring)
    mixed = lens.mixed_groups(step_batch.rewards, step_batch.valid, R)  # type: ignore[attr-defined]
    if not mixed:
        return "no mixed group"
    a = step_batch.advantages.detach().view(-1, R)[mixed]
    if not bool(torch.isfinite(a).all() and (a != 0).all()):
        return "a rollout of a mixed group has advantage 0"
    T = batch.completion_mask.shape[1]
    loss_mask = overlong_loss_mask(batch.completion_mask, batch.truncated, config.overlong).view(-1, R, T)
    if not bool((loss_mask[mixed] == batch.completion_mask.bool().view(-1, R, T)[mixed]).all()):
        return "--overlong masks a rollout of a mixed group"
    _, micro_batches = batch_rows(step_batch.policy, batch, config, procs)
    where = torch.empty(batch.num_rollouts, dtype=torch.long)
    for k, idx in enumerate(micro_batches[0]):
        where[idx] = k
    if not bool((where.view(-1, R)[mixed] == where.view(-1, R)[mixed][:, :1]).all()):
        return "a mixed group spans two micro-batches"
    return None


def _mismatch_metrics(mismatch: dict[str, float], tis: dict[str, float] | None, procs: Processes) -> dict[str, float]:
    """``mismatch/*`` metrics of all processes' first-pass tokens from the sums of :func:`mismatch_sums`."""
    keys = ("abs_diff_sum", "k3_sum", "tokens")
    tis_sums = [tis["weight_sum"], tis["capped"], tis["tokens"]] if tis is not None else []
    sums = procs.sum_floats([mismatch[k] for k in keys] + tis_sums)
    top = procs.max_float(mismatch["abs_diff_max"])
    n = max(sums[2], 1.0)
    out = {
        mk.MISMATCH_LOGPROB_ABS_DIFF_MEAN: sums[0] / n,
        mk.MISMATCH_LOGPROB_ABS_DIFF_MAX: top,
        mk.MISMATCH_KL_K3: sums[1] / n,
    }
    if tis is not None:
        out[mk.MISMATCH_TIS_WEIGHT_MEAN] = sums[3] / max(sums[5], 1.0)
        out[mk.MISMATCH_TIS_CAPPED_FRAC] = sums[4] / max(sums[5], 1.0)
    return out
