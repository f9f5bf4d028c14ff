"""Held-out accuracy during training (``--eval-every``): greedy and sampled, with Wilson intervals.

Every ``eval_every`` steps and at the last step, after the step's update, the policy answers the same
``eval_prompts`` prompts of the task's ``eval_split`` (gsm8k: the vendored test split; arithmetic: the test stream,
which never meets the training stream; jsonl: a split of the user's dataset). Greedy: one completion per prompt with
top-k = 1 (the argmax token at every position). Sampled: ``eval_samples`` completions per prompt at the training
temperature, top-p and top-k. Correctness is the task's own verdict (:func:`grpo_lens.train.step_metrics.
rollout_correctness`, the one ``reward/accuracy`` uses). Intervals: 95% Wilson
(:func:`grpo_lens.formulas.stats.wilson_interval`), over prompts for greedy and over completions for sampled (those
share prompts, so the sampled interval is optimistic about prompt-to-prompt variation).

Every process evaluates the same prompts (the numbers are equal on all; the main process writes them).
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from grpo_lens import metrics as mk
from grpo_lens.formulas.stats import wilson_interval
from grpo_lens.rollout import forward_precision, sample_groups
from grpo_lens.train.step_metrics import rollout_correctness

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from grpo_lens.config import TrainConfig
    from grpo_lens.tasks import Task

logger = logging.getLogger(__name__)

#: Rollouts per ``generate`` call of the evaluation.
EVAL_BATCH = 64


def accuracy_with_interval(correct: torch.Tensor) -> tuple[float, float, float, int]:
    """(share, Wilson lo, Wilson hi, n) of the 0/1 verdicts ``correct`` [n] float (NaN: no verdict, left out)."""
    known = correct[~torch.isnan(correct)]
    n = int(known.numel())
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    k = int(known.sum())
    lo, hi = wilson_interval(k, n)
    return k / n, lo, hi, n


class Evaluation:
    """The held-out prompts of a run and how to score the policy on them.

    Args:
        config: a :class:`grpo_lens.config.TrainConfig` (eval_every, eval_split, eval_prompts, eval_samples, seed,
            max_steps, sampling settings, reward_timeout, dtype).
        task: the run's task.

    Raises:
        ValueError: the task has no ``eval_split`` (naming its splits), or the split is empty.
    """

    def __init__(self, config: TrainConfig, task: Task):
        self.config = config
        self.task = task
        self.examples = task.sample(config.eval_prompts, seed=config.seed, split=config.eval_split)

    @classmethod
    def start(cls, config: TrainConfig, task: Task) -> Evaluation | None:
        """The run's evaluation, or None without ``eval_every``."""
        return cls(config, task) if config.eval_every > 0 else None

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is evaluated: every ``eval_every``-th and the last."""
        return step % self.config.eval_every == 0 or step == self.config.max_steps

    def __call__(
        self, step: int, policy: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> dict[str, float]:
        """The ``eval/*`` metrics of the policy now, on step ``step`` (empty when the step is not due)."""
        if not self.due(step):
            return {}
        c = self.config
        t0 = time.perf_counter()
        logger.info(
            "step %d: evaluating the policy on %d held-out prompts (%s split: greedy%s)",
            step,
            len(self.examples),
            c.eval_split,
            f", {c.eval_samples} samples each" if c.eval_samples else "",
        )
        was_training = policy.training
        policy.eval()
        out: dict[str, float] = {mk.EVAL_PROMPTS: float(len(self.examples))}
        with torch.no_grad(), forward_precision(device, c.dtype):
            greedy = sample_groups(
                policy,
                tokenizer,
                self.examples,
                1,
                max_new_tokens=c.max_new_tokens,
                temperature=1.0,
                top_k=1,
                generator_seed=c.seed,
                batch_size=EVAL_BATCH,
            )
            keys = (mk.EVAL_GREEDY_ACCURACY, mk.EVAL_GREEDY_ACCURACY_LO, mk.EVAL_GREEDY_ACCURACY_HI)
            out.update(zip(keys, accuracy_with_interval(rollout_correctness(self.task, greedy, c.reward_timeout))))
            if c.eval_samples > 0:
                sampled = sample_groups(
                    policy,
                    tokenizer,
                    self.examples,
                    c.eval_samples,
                    max_new_tokens=c.max_new_tokens,
                    temperature=c.temperature,
                    top_p=c.top_p,
                    top_k=c.top_k,
                    generator_seed=c.seed * 7_919 + step,
                    batch_size=EVAL_BATCH,
                )
                keys = (mk.EVAL_SAMPLED_ACCURACY, mk.EVAL_SAMPLED_ACCURACY_LO, mk.EVAL_SAMPLED_ACCURACY_HI)
                out.update(zip(keys, accuracy_with_interval(rollout_correctness(self.task, sampled, c.reward_timeout))))
        if was_training:
            policy.train()
        out[mk.EVAL_SECONDS] = time.perf_counter() - t0
        logger.info("step %d: %s", step, eval_line(out))
        return out


def eval_line(metrics: dict[str, float]) -> str:
    """The console line of one evaluation's ``eval/*`` metrics: greedy (and sampled) accuracy with its Wilson
    interval, the prompts and the seconds."""

    def acc(mean_key: str, lo_key: str, hi_key: str) -> str:
        return f"{metrics[mean_key]:.3f} [{metrics[lo_key]:.3f}, {metrics[hi_key]:.3f}]"

    greedy = acc(mk.EVAL_GREEDY_ACCURACY, mk.EVAL_GREEDY_ACCURACY_LO, mk.EVAL_GREEDY_ACCURACY_HI)
    parts = [f"held-out greedy accuracy {greedy}"]
    if mk.EVAL_SAMPLED_ACCURACY in metrics:
        parts.append(
            f"sampled {acc(mk.EVAL_SAMPLED_ACCURACY, mk.EVAL_SAMPLED_ACCURACY_LO, mk.EVAL_SAMPLED_ACCURACY_HI)}"
        )
    parts.append(f"over {int(metrics[mk.EVAL_PROMPTS])} prompts, {metrics[mk.EVAL_SECONDS]:.0f} s")
    return ", ".join(parts)
