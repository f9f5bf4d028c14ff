"""One training step's rewards and the metrics that describe its rollouts (``reward/*``, ``adv/*``, ``completions/*``).

:func:`rollout_rewards` scores a step's rollouts (:func:`grpo_lens.rewards.score_batch`, flattened to [N]);
:func:`rollout_correctness` gives the task's own 0/1 verdicts; :func:`reward_metrics`, :func:`accuracy_metrics`,
:func:`rollout_metrics` and, with dynamic sampling, :func:`sampled_vs_kept` turn them into the step's metric keys
(:mod:`grpo_lens.metrics`, docs/metrics.md). S1 (``reward/frac_zero_std_groups``) is
:func:`grpo_lens.formulas.advantages.constant_groups`, the test the advantages use. Shapes: N = B*R rollouts, R group
size, T completion tokens.
"""

from __future__ import annotations

import logging
import math

import torch

from grpo_lens import metrics as mk
from grpo_lens.formulas.advantages import constant_groups
from grpo_lens.formulas.losses import LOSS_AGGREGATIONS
from grpo_lens.formulas.noise import dead_group_counts, normalizer_dilution, zero_advantage_groups
from grpo_lens.rewards import (
    RewardState,
    RewardTimeout,
    _call_with_timeout,
    score_batch,
)
from grpo_lens.rollout import RolloutBatch
from grpo_lens.tasks import Task, correctness_verdict

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# One step's pieces
# ---------------------------------------------------------------------------------------------------------------------
def rollout_rewards(
    reward_fns, batch: RolloutBatch, timeout: float, state: RewardState | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Score every rollout with :func:`grpo_lens.rewards.score_batch`, flattened for the trainer: rewards [N] float32
    (NaN where invalid), valid [N] bool, reward metrics; each reward function call limited to ``timeout`` seconds and
    given ``state`` as TRL's ``trainer_state``."""
    rewards, valid, metrics = score_batch(batch, reward_fns, timeout, trainer_state=state)
    return rewards.reshape(-1), valid.reshape(-1), metrics


def merge_reward_infos(infos: list[dict[str, float]], counts: list[int]) -> dict[str, float]:
    """The reward-call metrics of several processes as one step's: counts add up, ``perf/*_seconds`` take the
    slowest process (they ran side by side), a function's mean ``reward/<name>`` is weighted by the rollouts it
    scored on each process (``counts[p]`` rollouts minus its ``reward/<name>/invalid_count``), anything else is the
    mean over the processes that have it. NaN (no valid value on a process) counts as no value.

    Args:
        infos: one dict per process (:func:`rollout_rewards`' metrics).   counts: each process's rollouts N_p.
    """
    if len(infos) == 1:
        return dict(infos[0])
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for info in infos for k in info):
        have = [(info[key], n, info) for info, n in zip(infos, counts) if key in info]
        if key.endswith("_count"):
            out[key] = sum(v for v, _, _ in have)
        elif key.endswith("_seconds"):
            out[key] = max(v for v, _, _ in have)
        else:
            weights = [
                n - info.get(f"{key}/invalid_count", 0) if f"{key}/invalid_count" in info else 1 for _, n, info in have
            ]
            pairs = [(v, w) for (v, _, _), w in zip(have, weights) if v == v and w > 0]  # v == v: not NaN
            total = sum(w for _, w in pairs)
            out[key] = sum(v * w for v, w in pairs) / total if total else math.nan
    return out


def rollout_correctness(task: Task, batch: RolloutBatch, timeout: float) -> torch.Tensor:
    """The task's own 0/1 correctness verdict of every rollout (:func:`grpo_lens.tasks.correctness_verdict`): [N]
    float64, NaN where there is none (no reference answer, or the check failed or ran past ``timeout`` seconds).
    Independent of the configured reward functions and their weights; ``reward/accuracy`` is its mean."""
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


#: reward functions that score the task's own correctness check (or its answer format): with only these, the step
#: line's "accuracy" reads as what the reward measures
CORRECTNESS_REWARDS = ("correctness", "math_verify", "format")


def custom_reward_names(specs: list[str]) -> list[str]:
    """The reward functions of ``specs`` (NAME or NAME:WEIGHT) other than :data:`CORRECTNESS_REWARDS`: when there is
    one, ``reward/accuracy`` (the task's correctness check) and the reward measure different things."""
    names = [str(s).split(":", 1)[0].strip() for s in specs]
    return [n for n in names if n not in CORRECTNESS_REWARDS]


def accuracy_note(specs: list[str]) -> str | None:
    """The one log line that says what "accuracy" is when a custom reward runs (None otherwise)."""
    custom = custom_reward_names(specs)
    if not custom:
        return None
    return (
        f"the reward is {', '.join(custom)} (a custom reward; per function: reward/<name>, TRL's "
        f"rewards/<name>/mean); 'task accuracy' in the step lines is reward/accuracy, the task's own "
        f"correctness check of the final answer, not the reward (docs/metrics.md)"
    )


def accuracy_metrics(correct: torch.Tensor) -> dict[str, float]:
    """``reward/accuracy``: the mean of the 0/1 verdicts [N] over rollouts that have one (NaN = none); absent when
    no rollout has one."""
    has = ~torch.isnan(correct)
    return {mk.REWARD_ACCURACY: float(correct[has].mean())} if has.any() else {}


def reward_metrics(rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> dict[str, float]:
    """``reward/mean``, ``reward/std`` (population, over valid rollouts), ``reward/frac_zero_std_groups`` (S1: share
    of the N / R groups whose valid rewards are all equal) and ``reward/invalid_frac``. With no valid rollout the
    first three are NaN (null in metrics.jsonl): a statistic over nothing is not 0.

    Args:
        rewards: [N] float (NaN invalid).  valid: [N] bool.  group_size: R, rollouts per group.
    """
    r = torch.where(valid, rewards, torch.zeros_like(rewards)).view(-1, group_size)
    v = valid.view(-1, group_size)
    n_valid = v.sum().clamp(min=1)
    mean = float(r.sum() / n_valid)
    std = float(((r - mean) ** 2 * v).sum().div(n_valid).sqrt())
    zero_std = constant_groups(r, v).float().mean()  # S1: groups without reward contrast carry no gradient
    if not bool(valid.any()):
        mean = std = zero_std = math.nan
    return {
        mk.REWARD_MEAN: mean,
        mk.REWARD_STD: std,
        mk.REWARD_FRAC_ZERO_STD_GROUPS: float(zero_std),
        mk.REWARD_INVALID_FRAC: float((~valid).float().mean()),
    }


#: The keys that, with dynamic sampling, describe all sampled groups; the kept groups' values go to ``dynamic/kept_*``
#: (:data:`grpo_lens.metrics.KEPT_KEYS`).
SAMPLED_KEYS = mk.KEPT_KEYS


def sampled_vs_kept(
    kept: dict[str, float], rewards: torch.Tensor, valid: torch.Tensor, correct: torch.Tensor, group_size: int
) -> dict[str, float]:
    """With dynamic sampling: the reward/accuracy/S1 keys over ALL sampled groups (the policy's behaviour), the kept
    (trained-on) groups' values of the same keys renamed to ``dynamic/kept_*`` (:data:`SAMPLED_KEYS`).

    Args:
        kept: the step's metrics over the kept groups.  rewards: [M] every sampled rollout's reward (NaN invalid).
        valid: [M] bool.  correct: [M] 0/1 verdicts (NaN none).  group_size: R, rollouts per group.
    """
    out = {new: kept[old] for old, new in SAMPLED_KEYS.items() if old in kept}
    out.update(reward_metrics(rewards, valid, group_size))
    out.update(accuracy_metrics(correct))
    return out


def rollout_metrics(
    rewards: torch.Tensor,
    valid: torch.Tensor,
    advantages: torch.Tensor,
    batch_mask: torch.Tensor,
    truncated: torch.Tensor,
    group_size: int,
) -> dict[str, float]:
    """Reward, advantage and completion statistics of a step (all processes' rollouts).

    Args:
        rewards: [N] float (NaN invalid).  valid: [N] bool.  advantages: [N].  batch_mask: [N, T] bool.
        truncated: [N] bool.  group_size: R, rollouts per group.
    """
    lengths = batch_mask.sum(dim=1).float()
    return {
        **reward_metrics(rewards, valid, group_size),
        mk.ADV_MEAN: float(advantages.mean()),
        mk.ADV_ABS_MEAN: float(advantages.abs().mean()),
        mk.ADV_MAX: float(advantages.max()),
        mk.ADV_MIN: float(advantages.min()),
        mk.COMPLETIONS_MEAN_LENGTH: float(lengths.mean()),
        mk.COMPLETIONS_MAX_LENGTH: float(lengths.max()),
        mk.COMPLETIONS_TRUNCATED_FRAC: float(truncated.float().mean()),
    }


def dead_group_metrics(
    rewards: torch.Tensor,
    valid: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    aggregation: str,
    max_new_tokens: int,
    group_size: int,
) -> dict[str, float]:
    """``dead/*`` of a step (all processes' rollouts; docs/theory.md §Noise scale and dead groups): groups without
    reward contrast split into all at 1 (all correct under the 0/1 correctness reward), all at 0 (all wrong) and all
    equal elsewhere (:func:`grpo_lens.formulas.noise.dead_group_counts`), the mixed groups, and the share of the loss
    normaliser held by groups whose advantages are all 0 (:func:`grpo_lens.formulas.noise.normalizer_dilution`; each
    rollout's units are its share of the aggregation's normaliser, :data:`grpo_lens.formulas.losses.LOSS_AGGREGATIONS`).

    Args:
        rewards: [N] float (NaN invalid).
        valid: [N] bool.
        advantages: [N].
        loss_mask: [N, T] bool, the tokens the loss sums.
        aggregation: a loss aggregation's name.
        max_new_tokens: T_max.
        group_size: R.
    """
    R = group_size
    counts = dead_group_counts(rewards.view(-1, R).cpu(), valid.view(-1, R).cpu(), best=1.0, worst=0.0)
    normalizer = LOSS_AGGREGATIONS.get(aggregation).normalizer
    mask = loss_mask.cpu()
    units = torch.tensor([float(normalizer(mask[i : i + 1], max_new_tokens)) for i in range(mask.shape[0])])
    dead = zero_advantage_groups(advantages.detach().view(-1, R).cpu())
    return {
        mk.DEAD_ALL_CORRECT_GROUPS: counts["all_best"],
        mk.DEAD_ALL_WRONG_GROUPS: counts["all_worst"],
        mk.DEAD_ALL_EQUAL_OTHER_GROUPS: counts["all_other"],
        mk.DEAD_MIXED_GROUPS: counts["mixed"],
        mk.DEAD_NORMALIZER_SHARE: normalizer_dilution(units.view(-1, R), dead),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------------------------
def _pad_to(mask: torch.Tensor, T: int) -> torch.Tensor:
    """Right-pad a [N, t] mask to [N, T] so processes can gather it."""
    return torch.nn.functional.pad(mask, (0, T - mask.shape[1])) if mask.shape[1] < T else mask
