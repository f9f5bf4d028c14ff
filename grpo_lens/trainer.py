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
import copy
import importlib.util
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from grpo_lens.advantages import compute_advantages, constant_groups
from grpo_lens.config import TrainConfig
from grpo_lens.diagnostics.baselines import optimal_vs_rloo, sketched_rollout_sq_norms
from grpo_lens.dynamic_sampling import collect_mixed_groups
from grpo_lens.losses import grpo_loss, loss_normalizer, mismatch_sums, truncated_is_weights
from grpo_lens.overlong import overlong_advantages, overlong_loss_mask, soft_overlong_penalty
from grpo_lens.rollout import RolloutBatch, batch_logprobs, sample_groups
from grpo_lens.rundir import RunDir, crash_point
from grpo_lens.seeding import seed_everything

logger = logging.getLogger(__name__)

class NonFiniteUpdateError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient; the run stopped with its last checkpoint intact."""


#: Config fields that may change when a run is resumed (they do not change any step already taken).
RESUMABLE_KEYS = ("max_steps", "progress", "save_final_model", "checkpoint_every", "keep_checkpoints",
                  "log_completions", "device", "report_to",
                  "reward_timeout", "max_consecutive_skips")


# ---------------------------------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Processes:
    """Where this process stands among the training processes (one when not launched by torchrun/accelerate)."""

    rank: int
    world: int
    device: torch.device
    accelerator: Any = None

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that writes the run directory."""
        return self.rank == 0

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """All-reduce sum across processes (identity for one process)."""
        if self.world > 1:
            value = value.clone()
            torch.distributed.all_reduce(value)
        return value

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        """Concatenate a [n, ...] tensor from every process along dim 0, in rank order."""
        if self.world == 1:
            return value
        parts = [torch.empty_like(value) for _ in range(self.world)]
        torch.distributed.all_gather(parts, value.contiguous())
        return torch.cat(parts, dim=0)

    def barrier(self) -> None:
        """Wait for every process (no-op for one process)."""
        if self.world > 1:
            torch.distributed.barrier()


def setup_processes(device: str) -> Processes:
    """Start accelerate's process state (reads torchrun/accelerate env vars; gloo on CPU)."""
    from accelerate import Accelerator

    from grpo_lens.config import resolve_device

    use_cpu = resolve_device(device) == "cpu"  # ConfigError for a CUDA device torch cannot see
    accelerator = Accelerator(cpu=use_cpu)
    dev = accelerator.device if device in ("auto", "cpu", "cuda") else torch.device(device)
    return Processes(accelerator.process_index, accelerator.num_processes, dev, accelerator)


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step``: every step's randomness derives from (seed, step), so a resumed run repeats it."""
    return (seed * 1_000_003 + step * 7_919) % (2**31 - 1)


def is_lens_step(step: int, lens_every: int, max_steps: int) -> bool:
    """Whether the lens measures step ``step`` (1-based): the first step, every ``lens_every``-th and the last.

    So every run with the lens on (``lens_every`` > 0) is measured at least at its start and end, even one shorter
    than ``lens_every`` steps. ``lens_every`` = 0 turns the lens off.
    """
    if lens_every <= 0:
        return False
    return step == 1 or step % lens_every == 0 or step == max_steps


# ---------------------------------------------------------------------------------------------------------------------
# One step's pieces
# ---------------------------------------------------------------------------------------------------------------------
def rollout_rewards(reward_fns, batch: RolloutBatch, timeout: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Score every rollout: rewards [N] (NaN where invalid), valid [N] bool, reward metrics."""
    from grpo_lens.rewards import combine_rewards

    R = batch.group_size
    prompts = [p for p in batch.prompts for _ in range(R)]
    extras = {k: [v for v in vals for _ in range(R)] for k, vals in batch.extras.items()}
    return combine_rewards(reward_fns, prompts, batch.completions, timeout_s=timeout, **extras)


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
    import contextlib

    if dtype == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def total_memory_bytes(device: torch.device) -> int | None:
    """The memory a training process may plan with: a CUDA device's total memory, else the machine's RAM (Linux
    ``MemTotal``); None when unknown. Total rather than free memory, so the choice it feeds is the same in a
    resumed run on the same machine (the micro-batch size changes float rounding, never the gradient)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def activation_bytes_per_rollout(model: torch.nn.Module, seq_len: int, scored_len: int) -> int:
    """Estimated memory one rollout's forward keeps for its backward, in bytes (an upper-side estimate).

    Per position and decoder layer about 10 H + 4 I saved values (norm inputs and outputs, q/k/v, attention output,
    the MLP's gate, up, activation and down inputs) plus n_heads * L attention probabilities; per scored position
    three float32 vocabulary rows (logits, their float copy divided by the temperature, the log-softmax saved for
    backward). H hidden size, I MLP width, L = seq_len.

    Args:
        model: a transformers causal LM (its ``config`` gives the sizes; missing fields fall back to H = 1024,
            I = 4 H, 24 layers, 16 heads, V = 50,000).
        seq_len: L = Lp + T positions per rollout.   scored_len: T completion positions that get logits.
    """
    cfg = getattr(model, "config", None)
    hidden = int(getattr(cfg, "hidden_size", 1024) or 1024)
    inter = int(getattr(cfg, "intermediate_size", 4 * hidden) or 4 * hidden)
    layers = int(getattr(cfg, "num_hidden_layers", 24) or 24)
    heads = int(getattr(cfg, "num_attention_heads", 16) or 16)
    vocab = int(getattr(cfg, "vocab_size", 50_000) or 50_000)
    elem = next(model.parameters()).element_size()
    per_layer = seq_len * (10 * hidden + 4 * inter + heads * seq_len) * elem
    return layers * per_layer + 3 * scored_len * vocab * 4


def auto_micro_batch_size(model: torch.nn.Module, n_rollouts: int, seq_len: int, scored_len: int,
                          total_bytes: int | None, share: float = 0.25) -> int:
    """Rollouts per forward/backward when ``micro_batch_size`` is unset: as many as fit, up to all ``n_rollouts``.

    The budget is ``share`` of what ``total_bytes`` leaves after the weights, gradients and AdamW's two moments (4
    copies of the parameters); each rollout takes :func:`activation_bytes_per_rollout`. One pass over the whole mini-batch is
    fastest (larger matrix products, one LM-head call); smaller micro-batches only save memory.

    Args:
        n_rollouts: rollouts in the mini-batch.   seq_len: L.   scored_len: T.
        total_bytes: :func:`total_memory_bytes`; None (unknown) gives 8 rollouts, the former fixed default.
        share: the fraction of total memory the activations may use.

    Returns:
        an int in [1, n_rollouts].
    """
    if total_bytes is None:
        return max(1, min(8, n_rollouts))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = share * (total_bytes - 4 * params)
    per_rollout = max(activation_bytes_per_rollout(model, seq_len, scored_len), 1)
    return int(max(1, min(n_rollouts, budget // per_rollout)))


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


def rollout_correctness(task: Any, batch: RolloutBatch, timeout: float) -> torch.Tensor:
    """The task's own 0/1 correctness verdict of every rollout (:func:`grpo_lens.tasks.correctness_verdict`): [N]
    float64, NaN where there is none (no reference answer, or the check failed or ran past ``timeout`` seconds).
    Independent of the configured reward functions and their weights; ``reward/accuracy`` is its mean."""
    from grpo_lens.rewards import RewardTimeout, _call_with_timeout
    from grpo_lens.tasks import correctness_verdict

    R = batch.group_size
    answers = [a for a in batch.extras.get("answer", [None] * batch.num_groups) for _ in range(R)]
    try:
        verdict = _call_with_timeout(correctness_verdict, timeout, (task, batch.completions, answers), {})
    except RewardTimeout:
        logger.error("the task's correctness check ran past %s s: no accuracy this step", timeout)
        verdict = [None] * len(answers)
    except Exception:  # noqa: BLE001 - a failing check must not stop the run
        logger.exception("the task's correctness check raised: no accuracy this step")
        verdict = [None] * len(answers)
    return torch.tensor([math.nan if v is None else float(v) for v in verdict], dtype=torch.float64)


def accuracy_metrics(correct: torch.Tensor) -> dict[str, float]:
    """``reward/accuracy``: the mean of the 0/1 verdicts [N] over rollouts that have one (NaN = none); absent when
    no rollout has one."""
    has = ~torch.isnan(correct)
    return {"reward/accuracy": float(correct[has].mean())} if has.any() else {}


def reward_metrics(rewards: torch.Tensor, valid: torch.Tensor, R: int) -> dict[str, float]:
    """``reward/mean``, ``reward/std`` (population, over valid rollouts), ``reward/frac_zero_std_groups`` (S1: share
    of the N / R groups whose valid rewards are all equal) and ``reward/invalid_frac``.

    Args:
        rewards: [N] float (NaN invalid).  valid: [N] bool.  R: group size.
    """
    r = torch.where(valid, rewards, torch.zeros_like(rewards)).view(-1, R)
    v = valid.view(-1, R)
    n_valid = v.sum().clamp(min=1)
    mean = float(r.sum() / n_valid)
    std = float(((r - mean) ** 2 * v).sum().div(n_valid).sqrt())
    zero_std = constant_groups(r, v).float().mean()  # S1: groups without reward contrast carry no gradient
    return {"reward/mean": mean, "reward/std": std, "reward/frac_zero_std_groups": float(zero_std),
            "reward/invalid_frac": float((~valid).float().mean())}


#: The keys that, with dynamic sampling, describe all sampled groups; the kept groups' values go to ``dynamic/kept_*``.
SAMPLED_KEYS = {"reward/mean": "dynamic/kept_reward_mean", "reward/std": "dynamic/kept_reward_std",
                "reward/frac_zero_std_groups": "dynamic/kept_frac_zero_std_groups",
                "reward/invalid_frac": "dynamic/kept_invalid_frac", "reward/accuracy": "dynamic/kept_accuracy"}


def sampled_vs_kept(kept: dict[str, float], rewards: torch.Tensor, valid: torch.Tensor, correct: torch.Tensor,
                    R: int) -> dict[str, float]:
    """With dynamic sampling: the reward/accuracy/S1 keys over ALL sampled groups (the policy's behaviour), the kept
    (trained-on) groups' values of the same keys renamed to ``dynamic/kept_*`` (:data:`SAMPLED_KEYS`).

    Args:
        kept: the step's metrics over the kept groups.  rewards: [M] every sampled rollout's reward (NaN invalid).
        valid: [M] bool.  correct: [M] 0/1 verdicts (NaN none).  R: group size.
    """
    out = {new: kept[old] for old, new in SAMPLED_KEYS.items() if old in kept}
    out.update(reward_metrics(rewards, valid, R))
    out.update(accuracy_metrics(correct))
    return out


def rollout_metrics(rewards: torch.Tensor, valid: torch.Tensor, advantages: torch.Tensor,
                    batch_mask: torch.Tensor, truncated: torch.Tensor, R: int) -> dict[str, float]:
    """Reward, advantage and completion statistics of a step (all processes' rollouts).

    Args:
        rewards: [N] float (NaN invalid).  valid: [N] bool.  advantages: [N].  batch_mask: [N, T] bool.
        truncated: [N] bool.  R: group size.
    """
    lengths = batch_mask.sum(dim=1).float()
    return {
        **reward_metrics(rewards, valid, R),
        "adv/mean": float(advantages.mean()),
        "adv/abs_mean": float(advantages.abs().mean()),
        "adv/max": float(advantages.max()),
        "adv/min": float(advantages.min()),
        "completions/mean_length": float(lengths.mean()),
        "completions/max_length": float(lengths.max()),
        "completions/truncated_frac": float(truncated.float().mean()),
    }


# ---------------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------------
def check_inputs(config: TrainConfig, procs: Processes) -> tuple[Any, list[tuple[str, float]]]:
    """Everything about the inputs that can be checked without loading a model; returns (task, reward specs).

    Builds the task (which validates every data row), parses the reward specs and resolves the model name, so that
    a bad input fails before the run directory is written or a model loads.

    Raises:
        ValueError: prompts_per_step not divisible by the number of processes (or its per-process share by
            num_mini_batches), an unknown task or reward (listing the valid names), bad task options, a malformed
            data row (naming file and row).
        ModelNotFoundError: the model path does not exist.
    """
    from grpo_lens.models import resolve_model
    from grpo_lens.rewards import parse_reward_specs
    from grpo_lens.tasks import get_task

    if config.prompts_per_step % procs.world:
        raise ValueError(f"config field 'prompts_per_step' = {config.prompts_per_step} must be divisible by the "
                         f"number of processes ({procs.world}) so that each process samples whole groups")
    share = config.prompts_per_step // procs.world
    if share % config.num_mini_batches:  # optimizer step k takes the k-th chunk of every process's prompts
        raise ValueError(f"config field 'num_mini_batches' = {config.num_mini_batches} must divide the prompts each "
                         f"of the {procs.world} processes holds (prompts_per_step / processes = {share})")
    task = get_task(config.task, dataset=config.dataset, **config.task_options)
    reward_fns = parse_reward_specs(config.rewards)
    if config.dynamic_sampling and procs.world > 1:
        raise ValueError("--dynamic-sampling runs in one process only for now (processes would keep different "
                         "numbers of groups); drop it or run one process")
    if config.lora_rank > 0 and importlib.util.find_spec("peft") is None:
        raise ValueError("--lora-rank needs the peft package: pip install 'grpo-lens[lora]' (or pip install peft)")
    if procs.is_main:
        from grpo_lens.trackers import check_trackers

        check_trackers(config.report_to)  # a missing tracker library fails before --out is touched
    resolve_model(config.model)
    return task, reward_fns


def check_model(config: TrainConfig, policy: torch.nn.Module) -> None:
    """Checks that need the loaded model; the trainer runs them before the run directory is written.

    Raises:
        ValueError: ``--estimator optimal`` with a model that has no ``nn.Linear`` layer (its b* weights are the
            sketched squared gradient norms of the linear layers).
    """
    from grpo_lens.diagnostics.gradients import linear_layer_names

    if config.estimator == "optimal" and not linear_layer_names(policy):
        raise ValueError(f"--estimator optimal needs per-rollout gradient norms of the model's nn.Linear layers, and "
                         f"{config.model} has none; pick another --estimator (grpo, rloo, dr_grpo)")


def train(config: TrainConfig, lens: Any = None) -> RunDir:
    """Run GRPO as ``config`` says and return the run directory.

    Args:
        config: a validated :class:`TrainConfig`; ``config.out`` is required.
        lens: an object with ``before_step(step, policy)`` and ``measure(step, ...) -> dict`` (see
            :class:`grpo_lens.lens.TrainerLens`); built from the config when None and lens_every > 0.

    Every input is checked before anything is written; a new run's directory is created (or a run replaced with
    ``overwrite``) only once the model has loaded, and a resumed run's files change only once its checkpoint has
    loaded, so a failed start leaves --out as it was.

    Raises:
        ConfigError / RunDirError / ModelNotFoundError / ValueError: bad settings, an unusable --out, a missing model,
            an unknown task or reward, a malformed data row, a missing or corrupt checkpoint.
    """
    from grpo_lens.models import load_model

    if not config.out:
        raise ValueError("config field 'out' (flag --out) is required: the run directory to write")
    procs = setup_processes(config.device)
    run = RunDir(config.out)

    # --- every input is checked, read-only, before the run directory is touched or a model loads ---------------------
    config = TrainConfig.from_dict(run.resolve(config.to_dict(), resume=config.resume, overwrite=config.overwrite,
                                               resumable_keys=RESUMABLE_KEYS))
    task, reward_fns = check_inputs(config, procs)
    ckpt = run.latest_checkpoint() if config.resume else None  # a bad pointer fails before the model loads
    procs.barrier()  # every process has read --out before the main one changes it
    B, R = config.prompts_per_step, config.group_size

    # --- model, reference, optimizer ---------------------------------------------------------------------------------
    if not config.progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # --no-progress silences transformers' loading bars too
    seed_everything(config.seed)
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32  # bf16-mixed: float32 weights
    policy, tokenizer = load_model(config.model, dtype=dtype, device=procs.device)
    policy.train()
    check_model(config, policy)  # before --out is written
    reference = None
    if config.beta > 0:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if config.lora_rank > 0:  # the reference above stays the plain base model
        from grpo_lens.lora import apply_lora

        policy = apply_lora(policy, config.lora_rank, config.lora_alpha, config.lora_target_modules)
        policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                  weight_decay=config.weight_decay)
    if lens is None and config.lens_every > 0:
        from grpo_lens.lens import TrainerLens

        lens = TrainerLens(policy, config)

    # --- the run directory: written only once the model (and, to resume, the checkpoint) has loaded ------------------
    start_step = 0
    guard = {"consecutive": 0, "total": 0}  # trainer steps skipped for a non-finite loss or gradient
    if config.resume:
        if ckpt is not None:
            state = run.load_checkpoint(ckpt, policy, optimizer)
            start_step = int(state["step"])
            guard.update(state.get("guard") or {})
            if state.get("rng"):
                _set_rng_state(state["rng"])
            if lens is not None and state.get("lens") is not None:
                lens.load_state_dict(state["lens"])
        if procs.is_main:
            run.write_config(config.to_dict())
            run.prune_checkpoints(start_step, config.keep_checkpoints)
            run.truncate_metrics(start_step)
            logger.info("resuming %s from step %d", run.path, start_step)
    elif procs.is_main:
        run.prepare(config.to_dict(), resume=False, overwrite=config.overwrite)  # replaces a run only with overwrite
        run.write_config(config.to_dict())
    procs.barrier()
    if lens is not None and start_step == 0:
        lens.start(policy)

    if procs.is_main and start_step < config.max_steps and (run.path / "final_model").exists():
        import shutil

        shutil.rmtree(run.path / "final_model")  # it would be stale once training continues
    if procs.is_main and start_step >= config.max_steps:
        logger.warning("%s is already at step %d >= max_steps %d: nothing to train (raise --max-steps to continue)",
                       run.path, start_step, config.max_steps)
    progress = _progress(config, start_step, procs)
    trackers = None
    if procs.is_main and start_step < config.max_steps:
        from grpo_lens.trackers import Trackers

        trackers = Trackers(config.report_to, run.path, config.to_dict(), start_step)
    share = B // procs.world
    for step in range(start_step + 1, config.max_steps + 1):
        t0 = time.perf_counter()
        seed = step_seed(config.seed, step)

        gen_seconds: list[float] = []

        def sample_round(rnd: int):
            """Round ``rnd`` of this step (0: the ordinary batch; > 0: dynamic sampling's extra rounds)."""
            rseed = seed if rnd == 0 else step_seed(seed, rnd)
            # 1. prompts: every process draws the same B, samples its own share of them
            examples = task.sample(B, seed=rseed)[procs.rank * share:(procs.rank + 1) * share]
            # 2. rollouts: R completions per prompt, with the sampler's log-probs
            t_start = time.perf_counter()
            policy.eval()
            crash_point("during_generation", step, module=policy)
            with forward_precision(procs.device, config.dtype):
                batch = sample_groups(policy, tokenizer, examples, R, max_new_tokens=config.max_new_tokens,
                                      temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                                      generator_seed=rseed + 104_729 * procs.rank)
            policy.train()
            gen_seconds.append(time.perf_counter() - t_start)
            # 3. rewards (invalid rollouts are masked out of the group statistics)
            rewards, valid, reward_info = rollout_rewards(reward_fns, batch, config.reward_timeout)
            rewards, valid = rewards.to(procs.device), valid.to(procs.device)
            correct = rollout_correctness(task, batch, config.reward_timeout).to(procs.device)
            if config.overlong == "soft-punish":  # DAPO eq. 13 added to every valid rollout's reward
                penalty = soft_overlong_penalty(batch.completion_mask.sum(dim=1), config.overlong_length(),
                                                config.overlong_cache()).to(rewards.device)
                rewards = rewards + penalty.to(rewards.dtype)  # NaN (invalid) stays NaN
                reward_info["reward/overlong_penalty"] = float(procs.gather(penalty).mean())
            sampled.append((rewards, valid, correct))
            return batch, rewards, valid, reward_info, correct

        dynamic: dict[str, float] = {}
        sampled: list[tuple] = []  # every round's (rewards, valid, correct): dynamic sampling's all-groups view
        if config.dynamic_sampling:  # DAPO: extra rounds until B mixed groups (docs/theory.md §Dynamic sampling)
            batch, rewards, valid, reward_info, dynamic, (correct,) = collect_mixed_groups(
                sample_round, share, config.dynamic_sampling_max_rounds, tokenizer.pad_token_id)
        else:
            batch, rewards, valid, reward_info, correct = sample_round(0)
        t_gen = sum(gen_seconds)

        # 4. advantages: one scalar per rollout, shared by all its tokens; truncated completions count in their
        #    group's statistics and, with --overlong mask or filter, get zero advantage (no policy gradient)
        grad_sq_norms, baseline_metrics = None, {}
        if config.estimator == "optimal":  # b*_{-i} weights: sketched ||c_i g_i||^2 of the rollouts that need them
            t_b = time.perf_counter()
            contrast = ~constant_groups(rewards.view(-1, R), valid.view(-1, R))  # [B] groups with a gradient
            need = (valid.view(-1, R) & contrast.unsqueeze(1)).view(-1)
            with forward_precision(procs.device, config.dtype):
                grad_sq_norms = sketched_rollout_sq_norms(
                    policy, batch, need.cpu(), aggregation=config.loss_aggregation, sketch_dim=config.lens_sketch_dim,
                    seed=config.seed, temperature=config.temperature,
                ).view(-1, R).to(procs.device)
            baseline_metrics["perf/optimal_baseline_seconds"] = time.perf_counter() - t_b
        advantages = compute_advantages(rewards.view(-1, R).float(), config.estimator, std=config.std,
                                        eps=config.eps, mask=valid.view(-1, R), grad_sq_norms=grad_sq_norms).view(-1)
        if config.estimator == "optimal":
            sums = procs.sum(torch.tensor(optimal_vs_rloo(rewards.view(-1, R), valid.view(-1, R),
                                                          advantages.view(-1, R)), dtype=torch.float64,
                                          device=procs.device)).tolist()
            if sums[2] > 0:
                baseline_metrics["adv/optimal_baseline"] = sums[0] / sums[2]
                baseline_metrics["adv/optimal_minus_rloo"] = sums[1] / sums[2]
        advantages = overlong_advantages(advantages, batch.truncated, config.overlong)  # mask / filter: A = 0

        # 5. reference log-probs for the KL term
        ref_logp = None
        if reference is not None:
            with torch.no_grad():
                with forward_precision(procs.device, config.dtype):
                    ref_logp = batch_logprobs(reference, batch, config.temperature)  # never top-k/top-p filtered

        # 6. the lens reads this step's rollouts before the update changes the policy
        lens_metrics: dict[str, float] = {}
        measure = lens is not None and is_lens_step(step, config.lens_every, config.max_steps)
        capture = None  # the lens's gradient capture inside the update's first pass, when that pass can serve it
        if measure and lens_reads_update(config, lens, rewards, valid, advantages):
            capture = lens.update_capture(policy)
        elif measure:
            with forward_precision(procs.device, config.dtype):
                lens_metrics = lens.measure(step, policy, batch, rewards, valid, advantages)

        # 7. policy update: mu passes, mini-batches, micro-batches, AdamW with gradient clipping
        try:
            loss_metrics = policy_update(policy, optimizer, batch, advantages, ref_logp, config, procs, params,
                                         before_step=(lambda: lens.before_step(policy)) if lens is not None else None,
                                         step=step, capture=capture)
        finally:
            if capture is not None:
                capture.__exit__(None, None, None)  # idempotent: hooks are gone whatever happened
        if capture is not None:  # g_i at the step's starting weights, read off the first pass's loss gradient rows
            from grpo_lens.lens import scores_from_update_rows

            n_total = float(procs.sum(batch.completion_mask.any(dim=1).sum().to(torch.float64)))
            sketch = scores_from_update_rows(capture.result().sketch, advantages, n_total)
            lens_metrics = lens.measure(step, policy, batch, rewards, valid, advantages, sketch=sketch)
        if lens is not None:
            lens_metrics.update(lens.after_step(step, policy, measure))
        step_skipped = loss_metrics["guard/skipped_optimizer_steps"] > 0
        guard["consecutive"] = guard["consecutive"] + 1 if step_skipped else 0
        guard["total"] += int(step_skipped)
        loss_metrics.update({"guard/step_skipped": int(step_skipped), "guard/skipped_steps": guard["total"],
                             "guard/consecutive_skipped": guard["consecutive"]})

        # 8. metrics over all processes' rollouts, one JSON line per step
        all_rewards, all_valid = procs.gather(rewards), procs.gather(valid)
        all_adv, all_mask = procs.gather(advantages), procs.gather(_pad_to(batch.completion_mask,
                                                                           config.max_new_tokens))
        all_trunc = procs.gather(batch.truncated)
        seconds = time.perf_counter() - t0
        tokens = float(all_mask.sum())
        record = {"step": step, **reward_info, **dynamic,  # this process's reward calls; all-process statistics win:
                  **rollout_metrics(all_rewards, all_valid, all_adv, all_mask, all_trunc, R),
                  **accuracy_metrics(procs.gather(correct)), **loss_metrics, **lens_metrics, **baseline_metrics,
                  "lr": optimizer.param_groups[0]["lr"],
                  "perf/step_seconds": seconds, "perf/generation_seconds": t_gen,
                  "perf/tokens_per_second": tokens / max(seconds, 1e-9),
                  "perf/peak_memory_mb": _peak_memory_mb(procs.device)}
        if config.dynamic_sampling:  # one process only (check_inputs), so no gather
            record.update(sampled_vs_kept(record, *(torch.cat([s[i] for s in sampled]) for i in range(3)), R))
        if procs.is_main:
            run.append_metrics(record)
            if trackers is not None:
                trackers.log(record, step)
            _log_completions(run, step, batch, rewards, advantages, config.log_completions)
            crash_point("after_metrics_write", step)
            if progress is not None:
                progress.set_postfix(reward=f"{record['reward/mean']:.3f}", sec=f"{seconds:.1f}")
                progress.update(1)

        if guard["consecutive"] >= config.max_consecutive_skips:  # before any checkpoint of this step
            procs.barrier()
            raise NonFiniteUpdateError(
                f"step {step}: the loss or gradient was non-finite for {guard['consecutive']} consecutive steps "
                f"(--max-consecutive-skips {config.max_consecutive_skips}), so training stopped; the last checkpoint "
                f"in {run.path / 'checkpoints'} is intact: lower --learning-rate or --beta, or check the rewards")

        # 9. checkpoint (atomic): model, optimizer, step; every step's randomness derives from (seed, step)
        if step % config.checkpoint_every == 0 or step == config.max_steps:
            if procs.is_main:
                state = {"rng": _rng_state(), "lens": lens.state_dict() if lens is not None else None,
                         "guard": dict(guard)}
                run.save_checkpoint(step, policy, optimizer, state, keep=config.keep_checkpoints)
            procs.barrier()

    if progress is not None:
        progress.close()
    if trackers is not None:
        trackers.finish()
    if lens is not None and procs.is_main:  # what the lens cost this run (the whole run, resumed parts included)
        from grpo_lens.lens import lens_overhead

        cost = lens_overhead([r for r in run.read_metrics() if "step" in r])
        if cost and cost["lens_steps"]:
            logger.info("lens: %d of %d steps measured, %.1f s of its own, %.1f%% of the %.1f s the steps took "
                        "without it (a gradient capture inside the update's first pass is not in this count)",
                        cost["lens_steps"], cost["steps"], cost["lens_seconds"], 100 * cost["overhead"],
                        cost["train_seconds"])
    if config.save_final_model and procs.is_main and not (run.path / "final_model").exists():
        save_final_model(policy, tokenizer, run.path / "final_model")
    procs.barrier()
    return run


def save_final_model(policy: torch.nn.Module, tokenizer: Any, path: Path) -> Path:
    """Save policy and tokenizer with ``save_pretrained`` into ``path`` atomically (temp folder + rename); a LoRA
    policy is saved merged, with its adapter alone in ``path/adapter`` (:func:`grpo_lens.lora.save_lora_model`)."""
    import os
    import shutil

    for stray in path.parent.glob(f".{path.name}.tmp-*"):  # left by a run killed while saving
        shutil.rmtree(stray, ignore_errors=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    from grpo_lens.lora import is_lora, save_lora_model

    if is_lora(policy):  # merged model in path/, the adapter alone in path/adapter/
        save_lora_model(policy, tokenizer, tmp)
    else:
        policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    crash_point("mid_final_model", 0)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------------------------
def _pad_to(mask: torch.Tensor, T: int) -> torch.Tensor:
    """Right-pad a [N, t] mask to [N, T] so processes can gather it."""
    return torch.nn.functional.pad(mask, (0, T - mask.shape[1])) if mask.shape[1] < T else mask


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    except (ImportError, AttributeError):
        return math.nan


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`_rng_state` saved, so a resumed run draws what the uninterrupted one would."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _log_completions(run: RunDir, step: int, batch: RolloutBatch, rewards: torch.Tensor, advantages: torch.Tensor,
                     n: int) -> None:
    R = batch.group_size
    for i in range(min(n, batch.num_rollouts)):
        prompt = batch.prompts[i // R]
        text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
        run.append_metrics({"step": step, "prompt": text, "completion": batch.completions[i],
                            "reward": float(rewards[i]), "advantage": float(advantages[i]),
                            "truncated": bool(batch.truncated[i])},
                           path=run.completions_path)


def _progress(config: TrainConfig, start: int, procs: Processes):
    if not (config.progress and procs.is_main):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=config.max_steps, initial=start, desc="GRPO", unit="step", dynamic_ncols=True)
