"""The probe's draws: which prompts each group size R samples, with which seed, how many per ``generate`` call
(:func:`draw_plan`, docs/theory.md §Shared draws), and the pool of prompts the draws and the studies share
(:class:`PromptPool`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from grpo_lens.formulas.advantages import constant_groups
from grpo_lens.formulas.sparsity import s1_predicted_outside_group
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.rewards import score_batch
from grpo_lens.rollout import (
    RolloutBatch,
    sample_groups,
)
from grpo_lens.runtime.memory import total_memory_bytes
from grpo_lens.seeding import derive_seed


def batch_seed(seed: int, group_size: int, draw: int) -> int:
    """The seed of the ``draw``-th batch of prompts (1-based) of group size R: the prompts' sampling, their
    completions' sampling and every random number of their analysis derive from it, so a batch is the same whenever
    it is drawn (what ``--resume`` relies on)."""
    return derive_seed(seed, group_size=group_size, draw=draw)


def rollouts_per_prompt(group_size: int) -> int:
    """M = max(2R, 8): the rollouts sampled per prompt for group size R (the first R form the group; all M give the
    prompt's success rate, S1 predicted from the M - R others and the baseline-variance resampling)."""
    R = group_size
    return max(2 * R, 8)


def generation_prompts_per_call(policy, M: int, config: ProbeConfig) -> int:
    """Prompts per ``generate`` call: ``prompts_per_batch``, or with 0 as many as a tenth of the memory holds (as
    ``--micro-batch-size`` is chosen from :func:`grpo_lens.runtime.memory.total_memory_bytes`: total memory, so the
    choice, and so the draws, are the same whenever the probe runs on this machine), at most 16. A rollout's
    ``generate`` keeps two float32 vocabulary rows (raw logits and scores) per new token, which dominates its
    memory: M T V 8 bytes per prompt."""
    if config.prompts_per_batch:
        return config.prompts_per_batch
    total = total_memory_bytes(next(policy.parameters()).device)
    vocab = int(getattr(getattr(policy, "config", None), "vocab_size", 50_000) or 50_000)
    per_prompt = M * config.max_new_tokens * vocab * 8
    return 4 if total is None else int(max(1, min(16, (0.1 * total) // max(per_prompt, 1))))


@dataclass(frozen=True)
class DrawBatch:
    """One ``generate`` call of the probe: ``n`` prompts drawn with ``seed``, M rollouts each; they are prompts
    first .. first + n - 1 of the draws they belong to (``key``: ("pool", draw) shared by every R, or ("R", R,
    draw) for one R's independent draws)."""

    key: tuple
    seed: int
    n: int
    M: int
    first: int


def draw_plan(config: ProbeConfig, policy, group_size: int | None = None) -> list[DrawBatch]:
    """The generate calls behind the probe's prompts, in order (docs/theory.md §Shared draws).

    Shared draws (R None; the default): one pool of max_R prompts_for(R) prompts; prompt p gets M_p = the largest
    M_R of the group sizes that use it (R uses prompts 0 .. prompts_for(R) - 1), so its rollouts serve every R as
    nested prefixes. Consecutive prompts with the same M_p are drawn together, :func:`generation_prompts_per_call`
    at a time, batch ``d`` (1-based) seeded by ``batch_seed(seed, 0, d)``. Independent draws (R given): R's
    prompts_for(R) prompts with M_R rollouts, batch ``d`` seeded by ``batch_seed(seed, R, d)``."""
    R = group_size
    if R is not None:
        M, n_r = rollouts_per_prompt(R), config.prompts_for(R)
        per = generation_prompts_per_call(policy, M, config)
        return [
            DrawBatch(("R", R, d + 1), batch_seed(config.seed, R, d + 1), min(per, n_r - a), M, a)
            for d, a in enumerate(range(0, n_r, per))
        ]
    sizes = sorted(config.group_sizes)
    total = max(config.prompts_for(R) for R in sizes)
    m_of = [max(rollouts_per_prompt(R) for R in sizes if p < config.prompts_for(R)) for p in range(total)]
    plan: list[DrawBatch] = []
    p = 0
    while p < total:
        M = m_of[p]
        run_end = p
        while run_end < total and m_of[run_end] == M:
            run_end += 1
        per = generation_prompts_per_call(policy, M, config)
        for a in range(p, run_end, per):
            d = len(plan) + 1
            plan.append(DrawBatch(("pool", d), batch_seed(config.seed, 0, d), min(per, run_end - a), M, a))
        p = run_end
    return plan


class PromptPool:
    """The probe's sampled prompts and rollouts, each :class:`DrawBatch` generated once and kept (tokens and rewards
    only), so every R, and the baseline study, read the same draws (docs/theory.md §Shared draws)."""

    def __init__(self, policy, tokenizer, task, reward_fns, config: ProbeConfig):
        self.policy, self.tokenizer, self.task, self.reward_fns, self.config = (
            policy,
            tokenizer,
            task,
            reward_fns,
            config,
        )
        self.kept: dict[tuple, tuple[RolloutBatch, torch.Tensor, torch.Tensor]] = {}
        self.generation_seconds = 0.0
        self.rollouts = 0  # sampled (the FLOP count of generation: bench_probe)
        self.tokens = 0  # completion tokens plus each distinct prompt's tokens once (what generate runs)
        self.positions = 0  # prompt + completion positions of the rollouts (what a backward over them runs)

    def get(self, spec: DrawBatch) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor, float]:
        """(batch, rewards [n, M], valid [n, M], seconds per prompt of its generation if it ran now, else 0)."""
        if spec.key in self.kept:
            return (*self.kept[spec.key], 0.0)
        c = self.config
        examples = self.task.sample(spec.n, seed=spec.seed)
        t0 = time.perf_counter()
        batch = sample_groups(
            self.policy,
            self.tokenizer,
            examples,
            spec.M,
            max_new_tokens=c.max_new_tokens,
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k,
            generator_seed=spec.seed,
        )
        seconds = time.perf_counter() - t0
        rewards, valid, _ = score_batch(batch, self.reward_fns)  # [n, M]
        self.kept[spec.key] = (batch, rewards, valid)
        self.generation_seconds += seconds
        self.rollouts += batch.num_rollouts
        self.tokens += int(batch.completion_mask.sum()) + int(batch.prompt_mask[:: spec.M].sum())
        self.positions += int(batch.attention_mask().sum())
        return batch, rewards, valid, seconds / spec.n


@dataclass(frozen=True)
class DrawnPrompts:
    """Group size R's prompts of one drawn batch, as its analysis reads them
    (:func:`grpo_lens.probe.estimate.analyse_prompts`, :func:`grpo_lens.probe.groups.analyse_prompt`)."""

    batch: RolloutBatch
    """B prompts' M rollouts each, prompt j's in rows j M .. (j + 1) M - 1."""
    rewards: torch.Tensor
    """[B, M] rewards."""
    valid: torch.Tensor
    """[B, M] bool, the rewards that could be computed."""
    group_size: int
    """R: the first R rollouts of a prompt form its group."""
    seed: int
    """The batch's seed (:func:`batch_seed`); prompt j's group analysis uses seed + j."""


def prompt_view(
    batch: RolloutBatch, rewards: torch.Tensor, valid: torch.Tensor, lo: int, hi: int, M: int
) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor]:
    """Prompts lo .. hi - 1 of a drawn batch with the first M of their rollouts (nested draws: R's group and its
    M_R rollouts are a prefix of the prompt's M_p): (batch of (hi - lo) M rollouts, rewards [hi - lo, M], valid)."""
    mp = rewards.shape[1]
    if lo == 0 and hi == rewards.shape[0] and M == mp:
        return batch, rewards, valid
    rows = torch.cat([torch.arange(j * mp, j * mp + M) for j in range(lo, hi)])
    view = replace(
        batch.select(rows),
        group_size=M,
        prompts=batch.prompts[lo:hi],
        extras={k: v[lo:hi] for k, v in batch.extras.items()},
    )
    return view, rewards[lo:hi, :M], valid[lo:hi, :M]


def prompt_status(rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> tuple[str, float | None]:
    """(status, S1 prediction) of a prompt's M rollouts (rewards [M], valid [M]; the first R its group): "invalid",
    "all_equal" or "mixed", and S1 predicted from the M - R others when all M are valid (docs/theory.md §S1)."""
    R = group_size
    M = rewards.shape[0]
    s1 = float(s1_predicted_outside_group(rewards.view(1, M) >= 1.0, R)[0]) if bool(valid.all()) else None
    r_g, v_g = rewards[:R], valid[:R]
    if not bool(v_g.all()):
        return "invalid", s1
    if bool(constant_groups(r_g.view(1, R), v_g.view(1, R))):
        return "all_equal", s1
    return "mixed", s1
