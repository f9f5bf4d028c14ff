"""What the trainer writes of each step: the step's record for metrics.jsonl (:func:`step_record`), its one-line
summary (:func:`step_line`), sampled completions, the progress bar and the lens's cost at the end of a run.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from grpo_lens import metrics as mk
from grpo_lens.config import TrainConfig
from grpo_lens.formulas.overlong import overlong_loss_mask
from grpo_lens.rollout import RolloutBatch
from grpo_lens.rundir import (
    RunDir,
    lens_overhead,
)
from grpo_lens.runtime.memory import _peak_memory_mb
from grpo_lens.runtime.processes import Processes, gather_objects
from grpo_lens.train.state import Rollouts
from grpo_lens.train.step_metrics import (
    _pad_to,
    accuracy_metrics,
    custom_reward_names,
    dead_group_metrics,
    merge_reward_infos,
    rollout_metrics,
    sampled_vs_kept,
)

logger = logging.getLogger("grpo_lens.train.loop")  # the trainer's one log, as before the split


def step_record(
    step: int,
    config: TrainConfig,
    procs: Processes,
    rollouts: Rollouts,
    advantages: torch.Tensor,
    parts: list[dict[str, float]],
    t0: float,
) -> dict[str, Any]:
    """The step's metrics.jsonl record, the same on every process: the reward-call metrics of all processes
    (:func:`grpo_lens.train.step_metrics.merge_reward_infos`), then the statistics of all processes' rollouts
    (which win over them), ``parts`` in order, then ``perf/*`` (``t0``: the
    step's start, ``time.perf_counter()``). With dynamic sampling the reward/accuracy/S1 keys cover every sampled
    group and the kept groups' values are ``dynamic/kept_*`` (:func:`grpo_lens.train.step_metrics.sampled_vs_kept`;
    one process only, so no gather)."""
    R = config.group_size
    rewards, valid, adv, mask, truncated = procs.gather_all(
        rollouts.rewards,
        rollouts.valid,
        advantages,
        _pad_to(rollouts.batch.completion_mask, config.max_new_tokens),
        rollouts.batch.truncated,
    )
    infos = (
        gather_objects((rollouts.reward_info, int(rollouts.valid.numel())))
        if procs.world > 1
        else [(rollouts.reward_info, int(rollouts.valid.numel()))]
    )
    seconds = time.perf_counter() - t0
    record = {
        mk.STEP: step,
        **merge_reward_infos([i for i, _ in infos], [n for _, n in infos]),
        **rollouts.dynamic,
        **rollout_metrics(rewards, valid, adv, mask, truncated, R),
        **accuracy_metrics(procs.gather(rollouts.correct)),
        **dead_group_metrics(
            rewards,
            valid,
            adv,
            overlong_loss_mask(mask, truncated, config.overlong),
            config.loss_aggregation,
            config.max_new_tokens,
            R,
        ),
    }
    for part in parts:
        record.update(part)
    record.update(
        {
            mk.PERF_STEP_SECONDS: seconds,
            mk.PERF_GENERATION_SECONDS: rollouts.generation_seconds,
            mk.PERF_TOKENS_PER_SECOND: float(mask.sum()) / max(seconds, 1e-9),
            mk.PERF_PEAK_MEMORY_MB: _peak_memory_mb(procs.device),
        }
    )
    if config.dynamic_sampling:
        # three tensors: rewards, valid, correct
        record.update(sampled_vs_kept(record, *(torch.cat([s[i] for s in rollouts.sampled]) for i in range(3)), R))  # type: ignore[call-arg, arg-type]
    return record


def step_line(record: dict[str, Any], max_steps: int, rewards: list[str] | None = None) -> str:
    """One compact line of a step's record for logs without a progress bar (``--no-progress``): step, reward,
    accuracy, S1, LR, seconds, and the held-out accuracy on evaluated steps. With a custom reward among ``rewards``
    (specs; :func:`grpo_lens.train.step_metrics.custom_reward_names`) the reward names it and "accuracy" reads "task
    accuracy" (the task's correctness check, not the reward)."""
    custom = custom_reward_names(rewards or [])
    parts = [f"step {record[mk.STEP]}/{max_steps}"]
    for key, name, spec in (
        (mk.REWARD_MEAN, f"reward ({'+'.join(custom)})" if custom else "reward", ".3f"),
        (mk.REWARD_ACCURACY, "task accuracy" if custom else "accuracy", ".3f"),
        (mk.REWARD_FRAC_ZERO_STD_GROUPS, "S1", ".2f"),
        (mk.LR, "lr", ".2e"),
        (mk.EVAL_GREEDY_ACCURACY, "eval greedy", ".3f"),
        (mk.PERF_STEP_SECONDS, "s", ".1f"),
    ):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{name} {record[key]:{spec}}")
        if key == mk.REWARD_MEAN and custom and len(rewards or []) > 1:  # each function's mean, TRL's name
            # len(rewards or []) > 1 above
            for n in (str(r).split(":", 1)[0] for r in rewards):  # type: ignore[union-attr]
                if isinstance(v := record.get(mk.REWARD_FUNCTION.format(name=n)), (int, float)):
                    parts.append(f"rewards/{n}/mean {v:.3f}")
    return "  ".join(parts)


def _log_lens_cost(run: RunDir) -> None:
    """Log what the lens cost the whole run (resumed parts included), from metrics.jsonl."""
    cost = lens_overhead([r for r in run.read_metrics() if mk.STEP in r])
    if cost and cost["lens_steps"]:
        logger.info(
            "lens: %d of %d steps measured, %.1f s of its own, %.1f%% of the %.1f s the steps took "
            "without it (a gradient capture inside the update's first pass is not in this count)",
            cost["lens_steps"],
            cost["steps"],
            cost["lens_seconds"],
            100 * cost["overhead"],
            cost["train_seconds"],
        )


def _log_completions(
    run: RunDir, step: int, batch: RolloutBatch, rewards: torch.Tensor, advantages: torch.Tensor, n: int
) -> list[dict[str, Any]]:
    """Append the first ``n`` rollouts' prompt, completion, reward [N], advantage [N] and truncation to
    completions.jsonl; returns the rows."""
    R = batch.group_size
    rows = []
    for i in range(min(n, batch.num_rollouts)):
        prompt = batch.prompts[i // R]
        text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
        rows.append(
            {
                mk.STEP: step,
                "prompt": text,
                "completion": batch.completions[i],
                "reward": float(rewards[i]),
                "advantage": float(advantages[i]),
                "truncated": bool(batch.truncated[i]),
            }
        )
        run.append_metrics(rows[-1], path=run.completions_path)
    return rows


def _progress(config: TrainConfig, start: int, procs: Processes):
    """The progress bar of the main process from step ``start`` (None without ``progress`` or on other processes)."""
    if not (config.progress and procs.is_main):
        return None
    return tqdm(total=config.max_steps, initial=start, desc="GRPO", unit="step", dynamic_ncols=True)
