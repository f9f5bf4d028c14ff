"""The GRPO training loop: sample -> reward -> advantages -> clipped-surrogate passes -> AdamW step, with the lens.

Read :func:`train` top to bottom: every formula it uses lives in a pure module (advantages, losses, diagnostics);
this file only moves tensors between them, writes the run directory and keeps the run resumable.

Several processes (``torchrun --nproc_per_node 2 -m grpo_lens.cli train ...``, or ``accelerate launch``): every
process draws the same B prompts for a step and samples the groups of its own share of them; losses are divided by a
normaliser summed over processes and the gradients are summed with an all-reduce, so the update equals a single
process's on the whole batch. With num_mini_batches M, each process splits its share into M chunks and optimizer step
k sums chunk k of every process.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Callable

import torch

from grpo_lens.config import TrainConfig
from grpo_lens.formulas.losses import (
    grpo_loss,
    loss_normalizer,
    mismatch_sums,
    truncated_is_weights,
)
from grpo_lens.formulas.overlong import overlong_loss_mask
from grpo_lens.rollout import RolloutBatch, batch_logprobs
from grpo_lens.rundir import crash_point
from grpo_lens.train.memory import auto_micro_batch_size, total_memory_bytes
from grpo_lens.train.processes import Processes

logger = logging.getLogger(__name__)


def policy_update(policy, optimizer, batch: RolloutBatch, advantages: torch.Tensor, ref_logp: torch.Tensor | None,
                  config: TrainConfig, procs: Processes, params: list[torch.nn.Parameter],
                  before_step: Callable[[], None] | None = None, step: int = 0,
                  capture: Any = None) -> dict[str, float]:
    """mu passes over the step's rollouts, each split into mini-batches (one optimizer step each) and micro-batches.

    pi_old is the trainer's own forward, detached (docs/theory.md §Log-probabilities): on the first pass over the
    first mini-batch it is the very logp being differentiated, so the ratio is exactly 1 in any dtype; when later
    optimizer steps need it (mu > 1 or several mini-batches) it is computed once, without gradient, before the first
    update. The sampler's recorded log-probs enter only the ``mismatch/*`` metrics and, with ``tis_cap``, the
    truncated importance weights.

    Args:
        batch: this process's N rollouts.   advantages: [N].   ref_logp: [N, T] or None (beta = 0).
        before_step: called after the last backward, before the first optimizer step (the lens snapshots there).
        step: the trainer step (for the crash-test hook only).
        capture: a context manager (the lens's :class:`grpo_lens.diagnostics.GradientCapture`) entered around
            every forward + backward of the first pass over the first mini-batch; None for none.
    Returns:
        token-weighted means of the loss metrics over every micro-batch of every pass and every process (the same
        numbers on every process), ``policy/entropy`` (token mean over the first pass's completion tokens of the
        entropy of the temperature-scaled policy, from the logits that pass computes anyway), plus ``grad/norm``
        (the pre-clipping norm of the first optimizer step, the on-policy gradient), ``grad/norm_last`` and the
        ``mismatch/*`` metrics (first pass, sampler vs pi_old).
    """
    R = config.group_size
    groups = batch.num_groups
    per_mini = groups // config.num_mini_batches if groups >= config.num_mini_batches else groups
    mini_batches = [torch.arange(g * R, min(groups, g + per_mini) * R) for g in range(0, groups, max(per_mini, 1))]
    L, T = batch.prompt_ids.shape[1] + batch.completion_ids.shape[1], batch.completion_ids.shape[1]
    sizes = [config.micro_batch_size or auto_micro_batch_size(policy, len(mini), L, T, total_memory_bytes(procs.device))
             for mini in mini_batches]
    micro_batches = [[mini[s:s + size] for s in range(0, len(mini), size)] for mini, size in zip(mini_batches, sizes)]
    old_logp = None  # [N, T] pi_old of every rollout, needed once the policy has moved within this step
    if config.mu > 1 or len(mini_batches) > 1:
        old_logp = torch.zeros_like(batch.sampler_logprobs)
        with torch.no_grad():
            for micros in micro_batches:
                for idx in micros:
                    with forward_precision(procs.device, config.dtype):
                        old_logp[idx] = batch_logprobs(policy, batch.select(idx), config.temperature)
    totals: dict[str, float] = {}
    tokens_total = 0.0
    entropy_sum = entropy_tokens = 0.0  # the first pass's token-mean policy entropy (from its own logits)
    grad_norms: list[float] = []
    loss_mask = overlong_loss_mask(batch.completion_mask, batch.truncated, config.overlong)  # [N, T]
    mismatch = {"abs_diff_sum": 0.0, "abs_diff_max": 0.0, "k3_sum": 0.0, "tokens": 0.0}
    tis = {"weight_sum": 0.0, "capped": 0.0, "tokens": 0.0}
    skipped = 0  # optimizer steps skipped for a non-finite loss or gradient (docs/theory.md §Numerical guards)
    stack = contextlib.ExitStack()
    if capture is not None:
        stack.enter_context(capture)
    for pass_ in range(config.mu):
        for mb, mini in enumerate(mini_batches):
            nonfinite_loss = False
            mask = loss_mask[mini]  # with --overlong filter, truncated rollouts leave the normaliser too
            normalizer = float(procs.sum(torch.tensor(loss_normalizer(mask, config.loss_aggregation,
                                                                       config.max_new_tokens),
                                                      dtype=torch.float64, device=procs.device)))
            for idx in micro_batches[mb]:
                micro = batch.select(idx)
                with forward_precision(procs.device, config.dtype):
                    logp, entropy = batch_logprobs(policy, micro, config.temperature, return_entropy=True)
                # pi_old: this very forward on the first pass over the first mini-batch (ratio exactly 1)
                old = logp.detach() if pass_ == 0 and mb == 0 else old_logp[idx]
                if pass_ == 0:
                    entropy_sum += float((entropy * micro.completion_mask).sum())
                    entropy_tokens += float(micro.completion_mask.sum())
                    part = mismatch_sums(old, micro.sampler_logprobs, micro.completion_mask)
                    for k in ("abs_diff_sum", "k3_sum", "tokens"):
                        mismatch[k] += part[k]
                    mismatch["abs_diff_max"] = max(mismatch["abs_diff_max"], part["abs_diff_max"])
                weights = None
                if config.tis_cap is not None:
                    weights = truncated_is_weights(old, micro.sampler_logprobs, config.tis_cap)
                    if pass_ == 0:
                        w = weights[micro.completion_mask]
                        tis["weight_sum"] += float(w.sum())
                        tis["capped"] += float((w >= config.tis_cap).sum())
                        tis["tokens"] += float(w.numel())
                loss, m = grpo_loss(
                    logp, old, advantages[idx], loss_mask[idx],
                    normalizer=normalizer, aggregation=config.loss_aggregation, eps_low=config.eps_low,
                    eps_high=config.eps_high, dual_clip=config.dual_clip, beta=config.beta,
                    ref_logp=None if ref_logp is None else ref_logp[idx], kl_estimator=config.kl_estimator,
                    token_weights=weights)
                loss.backward()
                nonfinite_loss |= not bool(torch.isfinite(loss.detach()))
                tok = m.pop("tokens")
                tokens_total += tok
                for k, v in m.items():
                    if k in ("loss/policy", "loss/kl"):  # already normalised shares: they add up
                        totals[k] = totals.get(k, 0.0) + v / (config.mu * len(mini_batches) / 1.0)
                    elif k == "ratio/max":
                        totals[k] = max(totals.get(k, 0.0), v)
                    else:
                        totals[k] = totals.get(k, 0.0) + v * tok
            stack.close()  # the lens's capture covers the first pass over the first mini-batch only
            if procs.world > 1:  # sum gradients: each process's loss already carries the global normaliser
                for p in params:
                    if p.grad is not None:
                        torch.distributed.all_reduce(p.grad)
            if before_step is not None and not grad_norms:
                before_step()
            max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
            bad = float(nonfinite_loss or not math.isfinite(grad_norms[-1]))
            if procs.world > 1:  # every process skips together
                bad = float(procs.sum(torch.tensor([bad], dtype=torch.float64, device=procs.device)))
            if bad:  # no optimizer (or scheduler) change: the weights and AdamW's moments stay as they were
                skipped += 1
                logger.warning("step %d: non-finite loss or gradient (norm %s); optimizer step skipped", step,
                               grad_norms[-1])
            else:
                crash_point("before_optimizer_step", step)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if procs.world > 1:  # the whole batch's numbers, not this process's share
        keys = sorted(k for k in totals if k != "ratio/max")  # the same keys, in the same order, on every process
        summed = procs.sum(torch.tensor([totals[k] for k in keys] + [tokens_total], dtype=torch.float64,
                                        device=procs.device)).tolist()
        totals.update(zip(keys, summed[:-1]))
        tokens_total = summed[-1]
        entropy_sum, entropy_tokens = procs.sum(torch.tensor([entropy_sum, entropy_tokens], dtype=torch.float64,
                                                             device=procs.device)).tolist()
        if "ratio/max" in totals:
            totals["ratio/max"] = float(procs.gather(torch.tensor([totals["ratio/max"]], dtype=torch.float64,
                                                                  device=procs.device)).max())
    out = {k: (v if k in ("loss/policy", "loss/kl", "ratio/max") else v / max(tokens_total, 1.0))
           for k, v in totals.items()}
    out["policy/entropy"] = entropy_sum / max(entropy_tokens, 1.0)
    out.update(_mismatch_metrics(mismatch, tis if config.tis_cap is not None else None, procs))
    out["grad/norm"] = grad_norms[0]
    out["grad/norm_last"] = grad_norms[-1]
    out["grad/optimizer_steps"] = len(grad_norms) - skipped
    out["guard/skipped_optimizer_steps"] = skipped
    return out


def lens_reads_update(config: TrainConfig, lens: Any, rewards: torch.Tensor, valid: torch.Tensor,
                      advantages: torch.Tensor) -> bool:
    """Whether the lens can take its g_i from the update's first pass (:func:`grpo_lens.lens.scores_from_update_rows`).

    True when ``lens_from_update`` is on, the lens offers ``update_capture``, and the first pass's loss gradient is
    -(A_i / N) grad(omega_i sum_t log pi) per rollout: no KL term (beta 0), no importance weights (tis_cap unset), both clip ranges
    > 0 (ratio 1 lies inside them), one mini-batch (the first pass covers every rollout before any optimizer step),
    and every advantage of the groups the lens analyses finite and nonzero; never with LoRA (``lora_rank`` > 0).

    Args:
        rewards: [N] (NaN where invalid).   valid: [N] bool.   advantages: [N].
    """
    if not (config.lens_from_update and hasattr(lens, "update_capture") and hasattr(lens, "mixed_groups")):
        return False
    if config.beta > 0 or config.tis_cap is not None or config.eps_low <= 0 or config.eps_high <= 0:
        return False
    if config.lora_rank > 0:  # the lens measures the adapter exactly, or the frozen base weights, on its own pass
        return False
    if config.num_mini_batches != 1:
        return False
    R = config.group_size
    mixed = lens.mixed_groups(rewards, valid, R)
    if not mixed:  # nothing to sketch: the lens's own path costs nothing then
        return False
    a = advantages.detach().view(-1, R)[mixed]
    return bool(torch.isfinite(a).all() and (a != 0).all())


def forward_precision(device: torch.device, dtype: str):
    """The context every model forward of a step runs in: bf16 autocast for ``dtype == "bf16-mixed"`` (float32
    weights, gradients and AdamW state; matrix products in bfloat16), else nothing. Works on CPU and CUDA.

    Log-probs stay float32 under it (``completion_logprobs`` upcasts the logits before the log-softmax), and pi_old
    is the same forward's detached log-prob, so the first pass's ratio is exactly 1 here too.

    Args:
        device: where the model runs.   dtype: the config's ``dtype`` (float32, bfloat16, bf16-mixed).
    """
    if dtype == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _mismatch_metrics(mismatch: dict[str, float], tis: dict[str, float] | None, procs: Processes) -> dict[str, float]:
    """``mismatch/*`` metrics of all processes' first-pass tokens from the sums of :func:`mismatch_sums`."""
    keys = ("abs_diff_sum", "k3_sum", "tokens")
    sums = procs.sum(torch.tensor([mismatch[k] for k in keys] + ([tis["weight_sum"], tis["capped"], tis["tokens"]]
                                                                  if tis is not None else []),
                                  dtype=torch.float64, device=procs.device)).tolist()
    top = float(procs.gather(torch.tensor([mismatch["abs_diff_max"]], dtype=torch.float64, device=procs.device)).max())
    n = max(sums[2], 1.0)
    out = {"mismatch/logprob_abs_diff_mean": sums[0] / n, "mismatch/logprob_abs_diff_max": top,
           "mismatch/kl_k3": sums[1] / n}
    if tis is not None:
        out["mismatch/tis_weight_mean"] = sums[3] / max(sums[5], 1.0)
        out["mismatch/tis_capped_frac"] = sums[4] / max(sums[5], 1.0)
    return out
