"""``grpo-lens calibrate``: the level and power of every primary verdict rule on planted cases, each case with ONE
truth, what was planted (docs/calibration.md, issue 29).

Every planted group goes through the path a real group takes: its Gram matrix [R, R], rewards [R] and GRPO
advantages [R] into :func:`grpo_lens.analysis.group.analyse_group` (``null_dim`` = the planted dimension P), the rows
into a probe-shaped dict and that into the registered claim (:data:`grpo_lens.claims.base.CLAIMS`). Training-run
rules get metrics.jsonl-shaped records. Per (family, R) a pool of planted groups is analysed once; each trial draws
n groups per R from the pools without replacement and the claim decides once across R, as the probe's table does.

Truth, per family and claim, from what was planted (never from where one measure's mean falls):

- rank ≈ 2: a planted rank-2 signal (two class means, or a label-free rank-2 signal) whose population E₂ > 0.9 > E₁
  (the mean over 1500 planted groups of G1's top-2 / top-1 energy shares); every other family is "not rank 2",
  including the boundary family whose population E₂ is tuned to 0.9 (not above it);
- the labels structure G1: directions that depend on the labels (class means) with population θ of the cosine Gram
  >= 0.1; label-free families (including label effects on norms alone) are false;
- trends: rising cases true; flat cases (with autocorrelated steps, or a falling count of mixed groups) false.

Level = the share of the wrong verdict under that truth (*holds* where false, *does not hold* where true); power =
the share of the right one. :func:`rule_levels` reduces the rows to {rule: {n: worst level, lowest power}}, which
``--out`` writes as levels.json; the package ships a copy (grpo_lens/data/calibration_levels.json) that the report
reads for each row's calibrated level and power. ``--planted FILE.npz`` runs your own Gram matrices through the same
path (:func:`run_planted`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from grpo_lens.analysis.group import (
    analyse_group,
    lens_rank_intervals,
    mean_over_groups,
)
from grpo_lens.claims.base import CLAIMS, DOES_NOT_HOLD, HOLDS
from grpo_lens.claims.baselines import RULE_ID as BASELINE_RULE_ID
from grpo_lens.claims.credit import MC_RULE_ID
from grpo_lens.claims.rank import RULE_ID as RANK_RULE_ID
from grpo_lens.claims.rank import STAYS_RULE_ID, STAYS_SEEDS_RULE_ID
from grpo_lens.claims.sparsity import (
    S1_RULE_ID,
    S1_SEEDS_RULE_ID,
    S4_RULE_ID,
    SPARSITY_RULE_ID,
    SPARSITY_SEEDS_RULE_ID,
)
from grpo_lens.claims.zero_sum import NEGLIGIBLE_SHARE
from grpo_lens.claims.zero_sum import RULE_ID as ZERO_SUM_RULE_ID
from grpo_lens.formulas.advantages import grpo_advantages
from grpo_lens.formulas.baselines import baseline_prompt, summarise_baseline_prompts
from grpo_lens.formulas.credit import segment_advantages, segment_counts
from grpo_lens.formulas.sparsity import weighted_hoyer
from grpo_lens.formulas.spectrum import wishart
from grpo_lens.formulas.stats import mean_interval, summarise_rows
from grpo_lens.metrics import (
    LR,
    PERF_LENS_SECONDS,
    PROBE_GROUPS,
    PROBE_SUMMARY,
    RANK_MIXED_GROUPS,
    REWARD_FRAC_ZERO_STD_GROUPS,
    SPARSITY_GRAD_HOYER,
    SPARSITY_UPDATE_TOTAL_BF16_DENSE,
    SPARSITY_UPDATE_TOTAL_BF16_PERMUTED,
    SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED,
    SPARSITY_UPDATE_TOTAL_F32_UNCHANGED,
    SPARSITY_UPDATE_TOTAL_F32_UNCHANGED_SE,
    STEP,
    ZERO_SUM_COS_GAP_EXCESS,
    ZERO_SUM_SPAN_ENERGY,
    ZERO_SUM_UNIT_SPAN_ENERGY_EXCESS,
    ZERO_SUM_UNIT_SPAN_ENERGY_NULL,
)
from grpo_lens.registry import renamed_keywords
from grpo_lens.rundir import write_file, writes_confined_to

#: the default probe's mixed groups per R (README: 28 and 22 of the 32 and 24 prompts for R = 4 and 8)
DEFAULT_GROUP_COUNTS = {4: 28, 8: 22}

#: groups per R of the probe-rule cells: the fewest with an interval, the rank rule's minimum, the default probe's,
#: and 28 per R (issue 43's target n)
GROUP_CELLS = {8: {4: 8, 8: 8}, 16: {4: 16, 8: 16}, 22: dict(DEFAULT_GROUP_COUNTS), 28: {4: 28, 8: 28}}

#: the dimension of the planted gradients
PLANTED_DIM = 2048

#: the planted families of the per-group rules, with what each plants (docs/calibration.md)
FAMILIES = {
    "a0.001": "rank 2 (orthonormal class means) + 0.1% noise",
    "a0.01": "rank 2 + 1% noise",
    "d0.5_0.01": "class means at cosine 0.5, + 1% noise",
    "n2_0.01": "reward-dependent norms: rank 2 + 1% noise, wrong rollouts' gradients 2× longer",
    "c_lr2": "label-independent rank 2 (+ 1% noise)",
    "d0.95_0.01": "class means at cosine 0.95 (+ 1% noise): one direction dominates",
    "r1_0.05": "one shared direction with 95% of the energy",
    "c_shared": "one shared direction, pairwise cosine 0.5",
    "a0.25": "rank 2 + 25% noise (E₂ ≈ 0.75-0.8: not rank 2)",
    "boundary": "the boundary: rank 2 + noise tuned so that the population E₂ = 0.9",
    "b0": "isotropic rows, equal norms",
    "b1": "isotropic rows, log-normal norms (log-SD 1)",
    "b2": "isotropic rows, log-normal norms (log-SD 2)",
    "bn2": "isotropic rows, wrong rollouts' gradients 2× longer (a label effect on norms alone)",
}

#: issue 43: families of the labels rule where groups differ in the label information they carry, and duplicate
#: completions (identical gradients, as identical completions give): merged into :data:`FAMILIES`
LABEL_FAMILIES = {
    "a0": "exact rank 2 (orthonormal class means, no noise): groups with k = 1 or R − 1 carry no label information",
    "e2": "exact rank 2, log-normal norms (σ = 0.5): distinct completions whose directions are the class means",
    "mix0.01": "half the groups rank 2 + 1% noise, half isotropic (informative groups rare)",
    "mix0.25": "half the groups rank 2 + 25% noise, half isotropic",
    "dupC": "every correct rollout one string (identical gradients), wrong rollouts isotropic",
    "dupW": "every wrong rollout one string, correct rollouts isotropic",
}
FAMILIES.update(LABEL_FAMILIES)


def _duplicated_group(family: str, group_size: int, dim: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """The Gram [R, R] of ``dupC`` / ``dupW``: the duplicated class's rollouts share one isotropic g, the others are
    isotropic and distinct (R − m + 1 iid N(0, I/dim) vectors, the first repeated m times)."""
    m = k if family == "dupC" else group_size - k
    w = wishart(group_size - m + 1, dim, 1, gen)[0] / dim  # [R − m + 1]: the shared g first
    src = torch.tensor([0] * m + list(range(1, group_size - m + 1)))
    if family == "dupW":  # the correct rollouts come first: the distinct ones, then the shared g
        src = torch.tensor(list(range(1, k + 1)) + [0] * m)
    return w[src][:, src]


def has_rank2_signal(family: str) -> bool:
    """Whether ``family`` plants a rank-2 signal (rank 2 where also the population E₂ > 0.9 > E₁)."""
    return family in ("boundary", "c_lr2", "e2") or bool(re.match(r"[adn]\d", family))


def label_directions(family: str) -> bool:
    """Whether ``family``'s directions depend on the labels (the mechanism claim true where also θ >= 0.1)."""
    return family in ("boundary", "e2") or bool(re.match(r"[adn]\d|mix\d", family))


#: the planted updates of "most parameters unchanged": (name, share of update entries exactly zero, scale of the rest,
#: log-SD of a log-normal per-entry scale); the truth is whether the whole model's float32-unchanged share exceeds 0.5
S4_FAMILIES = (
    ("dense, log-normal scale (σ = 2)", 0.0, 3e-6, 2.0),
    ("dense Gaussian, below bf16 spacing", 0.0, 2e-5, 0.0),
    ("40% zeros, the rest below bf16 spacing", 0.4, 2e-6, 0.0),
    ("45% zeros, the rest moving bf16", 0.45, 1e-3, 0.0),
    ("55% zeros, the rest moving bf16", 0.55, 1e-3, 0.0),
    ("60% zeros, the rest log-normal (σ = 2)", 0.6, 3e-6, 2.0),
    ("90% zeros, the rest moving bf16", 0.9, 1e-3, 0.0),
)

#: the planted Monte Carlo credit cases: per rollout pair (a correct rollout, A_i > 0, and a wrong one, A_i < 0), the
#: true success probabilities p(b_0..b_3) at the four prefixes of the credit study; the last segment ends at r. Truth:
#: some segment position's mean shift against A_i exceeds the rule's margin 0.1 (issue 43: one boundary)
MC_FAMILIES = {
    "no token opposes A_i (p flat until the end)": (False, (0.5, 0.5, 0.5, 0.5), (0.5, 0.5, 0.5, 0.5)),
    "every segment agrees (p moves towards r)": (False, (0.3, 0.5, 0.7, 0.9), (0.7, 0.5, 0.3, 0.1)),
    "one segment in four opposes A_i by 0.05 (real, below the margin)": (
        False,
        (0.55, 0.5, 0.7, 0.9),
        (0.45, 0.5, 0.3, 0.1),
    ),
    "one segment in four opposes A_i by 0.1 (the margin: not above it)": (
        False,
        (0.6, 0.5, 0.7, 0.9),
        (0.4, 0.5, 0.3, 0.1),
    ),
    "one segment in four opposes A_i by 0.6": (True, (0.8, 0.2, 0.4, 0.6), (0.2, 0.8, 0.6, 0.4)),
    "one segment in four opposes A_i by 0.3": (True, (0.6, 0.3, 0.5, 0.7), (0.4, 0.7, 0.5, 0.3)),
}

#: rollouts per Monte Carlo cell: the fewest with a verdict (--mc-groups 4) and larger studies
MC_ROLLOUTS = (8, 32, 100)

#: the planted baseline-study prompts: name -> (RMS of log(m_C / m_W) below log 1.25 truly, noise scale of the correct
#: rollouts' gradients, how the correct rollouts' noise is drawn: "equal" as the wrong ones', "spread" with a spread
#: of its own at the same mean square, "one string" every correct rollout the same gradient with ‖g‖² = m_W exactly)
BASELINE_FAMILIES = {
    "m_C = m_W (equal noise in both classes)": (True, 1.0, "equal"),
    "m_C = m_W, the correct rollouts' norms spread wider (equal means)": (True, 1.0, "spread"),
    "m_C = m_W, every correct rollout one string": (True, 1.0, "one string"),
    "m_C = 1.25 m_W on every prompt (the margin: not inside it)": (False, math.sqrt(1.3125), "equal"),
    "correct rollouts' noise 2× (m_C = 3.4 m_W)": (False, 2.0, "equal"),
}

#: prompts per baseline cell: the fewest with an interval, the probe's default --baseline-study-prompts (16), larger
BASELINE_PROMPTS = (8, 16, 24, 32)

#: the trend cases: name -> (truth, kind, parameter: the lens-to-lens correlation at 5 steps apart, issue 29's 0.59)
SPARSITY_TRENDS = {
    "flat Hoyer, i.i.d. lens steps": (False, "ar", 0.0),
    "flat Hoyer, lens-to-lens correlation 0.59": (False, "ar", 0.59),
    "flat Hoyer, lens-to-lens correlation 0.9": (False, "ar", 0.9),
    "flat Hoyer, a random walk": (False, "ar", 1.0),
    "constant per-group sparsity, mixed groups fall 8 -> 1": (False, "groups", 0.0),
    "flat Hoyer after a warm-up transient (+0.1 over the 5 LR warm-up steps)": (False, "warmup", 0.59),
    "Hoyer rises 0.30 -> 0.45 (lens-to-lens correlation 0.59)": (True, "rising", 0.59),
}
#: S1 cases: name -> (truth, kind, step-to-step correlation φ of the success rates' drift)
S1_TRENDS = {
    "stationary success rates": (False, "ar", 0.0),
    "success rates AR(1), φ = 0.8": (False, "ar", 0.8),
    "success rates AR(1), φ = 0.95": (False, "ar", 0.95),
    "S1 high over the 5 LR warm-up steps, then stationary": (False, "warmup", 0.0),
    "S1 rises 0.35 -> 0.85": (True, "rising", 0.0),
}
#: the trend budgets calibrated, (seeds, steps, lens every): the gradient-sparsity trend in one run at the defaults
#: and with the lens on every step, S1 in one run of 30 and 60 steps, both pooled over 3 and 5 seeds of the defaults
#: (`train --seeds`); 4 prompts per step throughout (the default)
TREND_BUDGETS = {
    "sparsity": ((1, 30, 5), (1, 30, 1), (3, 30, 5), (5, 30, 5)),
    "s1": ((1, 30, 5), (1, 60, 5), (3, 30, 5), (5, 30, 5)),
}
#: LR warm-up steps of the planted "warmup" runs (the LR rises linearly over them, then is constant)
PLANTED_WARMUP = 5

#: the planted lens runs of "rank stays ≈ 2": name -> (truth, mixed groups per lens step, a bad step's family)
STAYS_FAMILIES = {
    "rank 2 + 1% noise at every lens step, 4 mixed groups (demo default)": (True, 4, None),
    "rank 2 + 1% noise at every lens step, 12 mixed groups": (True, 12, None),
    "one lens step of 7 not rank 2 (E₂ ≈ 0.75), 12 mixed groups": (False, 12, "a0.25"),
    "every lens step not rank 2 (E₂ ≈ 0.75), 12 mixed groups": (False, 12, "all"),
}


#: the planted `train --seeds` runs of "rank stays ≈ 2" (pooled route): name -> (truth, seeds, mixed groups per lens
#: step, a bad step's family); 7 lens steps (30 steps, lens every 5), the bad step the 4th in every seed
STAYS_SEEDS_FAMILIES = {
    "rank 2 + 1% noise at every lens step, 3 seeds × 4 mixed groups": (True, 3, 4, None),
    "rank 2 + 1% noise at every lens step, 5 seeds × 4 mixed groups": (True, 5, 4, None),
    "one lens step of 7 not rank 2 (E₂ ≈ 0.75), 3 seeds × 4 mixed groups": (False, 3, 4, "a0.25"),
    "one lens step of 7 not rank 2 (E₂ ≈ 0.75), 5 seeds × 4 mixed groups": (False, 5, 4, "a0.25"),
    "every lens step not rank 2 (E₂ ≈ 0.75), 3 seeds × 4 mixed groups": (False, 3, 4, "all"),
}


@dataclass(frozen=True)
class CalibrationConfig:
    """What `grpo-lens calibrate` runs: trials per cell, pool of planted groups per (family, R), seed."""

    trials: int = 200
    pool: int = 200
    coverage_trials: int = 2000
    seed: int = 0
    families: tuple[str, ...] = tuple(FAMILIES)
    group_sizes: tuple[int, ...] = (4, 8)
    group_cells: tuple[int, ...] = tuple(GROUP_CELLS)
    s4_families: tuple[tuple[str, float, float, float], ...] = S4_FAMILIES
    mc_families: dict[str, tuple[bool, tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=lambda: dict(MC_FAMILIES)
    )
    mc_rollouts: tuple[int, ...] = MC_ROLLOUTS
    baseline_families: dict[str, tuple[bool, float, str]] = field(default_factory=lambda: dict(BASELINE_FAMILIES))
    baseline_prompts: tuple[int, ...] = BASELINE_PROMPTS
    training: bool = True
    workers: int = field(default_factory=lambda: min(2, os.cpu_count() or 1))

    @classmethod
    def quick(cls) -> CalibrationConfig:
        """A small run for tests (seconds): few trials and families; its numbers are not the calibration."""
        return cls(
            trials=20,
            pool=40,
            coverage_trials=200,
            families=("a0.01", "b2", "r1_0.05", "bn2"),
            group_cells=(22,),
            s4_families=(S4_FAMILIES[0], S4_FAMILIES[-1]),
            mc_families={k: MC_FAMILIES[k] for k in list(MC_FAMILIES)[::2]},
            mc_rollouts=(8, 100),
            baseline_prompts=(32,),
        )


# ---------------------------------------------------------------------------------------------------------------------
# planted groups
# ---------------------------------------------------------------------------------------------------------------------
@renamed_keywords(r="group_size")
def planted_group(
    family: str, group_size: int, dim: int, gen: torch.Generator, noise: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One group of ``family`` (:data:`FAMILIES`): (Gram matrix [R, R] of its g_i in R^dim, rewards [R]),
    k ~ U{1..R-1} correct first; ``noise`` overrides the noise share (the boundary family's tuned share).

    g_i = n_i (Σ_j B_ij v_j + σ e_i) with v_1..v_q orthonormal and e_i iid N(0, I/dim) gives
    G = N (B Bᵀ + σ(B Yᵀ + Y Bᵀ) + σ²(Y Yᵀ + W/dim)) N, Y [R, q] iid N(0, 1/dim), W ~ Wishart(dim − q, I_R)
    (rotation invariance), so the cost does not depend on dim; n_i = 2 for wrong rollouts in ``n<w>`` / ``bn<w>``.

    Raises:
        ValueError: an unknown family.
    """
    k = int(torch.randint(1, group_size, (1,), generator=gen))
    rewards = (torch.arange(group_size) < k).double()
    labels = rewards == 1
    if family in ("dupC", "dupW"):
        return _duplicated_group(family, group_size, dim, k, gen), rewards
    if re.fullmatch(r"mix\d+(\.\d+)?", family):  # a coin per group: rank 2 + noise, or isotropic
        half = bool(torch.rand(1, generator=gen) < 0.5)
        return planted_group(f"a{family[3:]}" if half else "b0", group_size, dim, gen, noise)
    if re.fullmatch(r"bn?\d+(\.\d+)?", family):
        if family.startswith("bn"):
            norms = torch.where(labels, 1.0, float(family[2:])).double()
        else:
            norms = torch.exp(float(family[1:]) * torch.randn(group_size, generator=gen, dtype=torch.float64))
        return wishart(group_size, dim, 1, gen)[0] / dim * torch.outer(norms, norms), rewards
    scale = torch.ones(group_size, dtype=torch.float64)
    if family == "boundary":
        if noise is None:
            raise ValueError("the boundary family needs its tuned noise share (boundary_noise)")
        f, c = noise, 0.0
    elif family == "e2":  # exact rank 2; the norms keep the completions distinct
        f, c = 0.0, 0.0
        scale = torch.exp(0.5 * torch.randn(group_size, generator=gen, dtype=torch.float64))
    elif re.fullmatch(r"a\d+(\.\d+)?", family):
        f, c = float(family[1:]), 0.0
    elif re.fullmatch(r"d\d+(\.\d+)?_\d+(\.\d+)?", family):
        c, f = (float(x) for x in family[1:].split("_"))
    elif re.fullmatch(r"n\d+(\.\d+)?_\d+(\.\d+)?", family):
        w, f = (float(x) for x in family[1:].split("_"))
        c, scale = 0.0, torch.where(labels, 1.0, w).double()
    elif re.fullmatch(r"r1_\d+(\.\d+)?", family):
        f, c = float(family[3:]), None
    elif family in ("c_lr2", "c_shared"):
        f, c = (0.01, 0.0) if family == "c_lr2" else (0.5, None)
    else:
        raise ValueError(
            f"unknown planted family {family!r}; valid: {', '.join(FAMILIES)} (and a<f>, d<c>_<f>, "
            f"n<w>_<f>, r1_<f>, b<s>, bn<w>)"
        )
    if family == "c_lr2":
        b = torch.randn(group_size, 2, generator=gen, dtype=torch.float64) / math.sqrt(2)
    elif c is None:  # one shared direction
        b = torch.ones(group_size, 1, dtype=torch.float64)
    else:
        b = torch.where(
            labels[:, None],
            torch.tensor([1.0, 0.0], dtype=torch.float64),
            torch.tensor([c, math.sqrt(1 - c * c)], dtype=torch.float64),
        )
    sigma = math.sqrt(f / (1 - f))
    q = b.shape[1]
    y = torch.randn(group_size, q, generator=gen, dtype=torch.float64) / math.sqrt(dim)
    wn = wishart(group_size, dim - q, 1, gen)[0] / dim
    by = b @ y.T
    gram = b @ b.T + sigma * (by + by.T) + sigma**2 * (y @ y.T + wn)
    return gram * torch.outer(scale, scale), rewards


def _advantages(rewards: torch.Tensor) -> torch.Tensor:
    R = rewards.shape[0]
    return grpo_advantages(rewards[None], torch.ones(1, R, dtype=torch.bool))[0]


@renamed_keywords(r="group_size")
def population_shares(
    family: str, group_size: int, noise: float | None = None, size: int = 1500, seed: int = 99
) -> tuple[float, float]:
    """(E₂, E₁): the population means over ``size`` planted groups of G1's top-2 and top-1 energy shares."""
    gen = torch.Generator().manual_seed(seed)
    grams, advs = zip(
        *(
            (g, _advantages(rw))
            for g, rw in (planted_group(family, group_size, PLANTED_DIM, gen, noise) for _ in range(size))
        )
    )
    a = torch.stack(advs)  # [size, R]
    lam = torch.linalg.eigvalsh(torch.stack(grams) * a[:, :, None] * a[:, None, :]).clamp(min=0).flip(-1)
    total = lam.sum(-1).clamp(min=1e-300)  # G1 G1ᵀ's eigenvalues are the energies: E_k = Σ_{j<=k} λ_j / Σ λ
    return float(((lam[:, 0] + lam[:, 1]) / total).mean()), float((lam[:, 0] / total).mean())


@renamed_keywords(r="group_size")
def boundary_noise(group_size: int, target: float = 0.9, size: int = 1000) -> float:
    """The noise share f of rank 2 + noise whose population E₂ is ``target`` (bisection, common random numbers)."""
    lo, hi = 0.0, 0.6
    for _ in range(11):
        mid = 0.5 * (lo + hi)
        if population_shares("boundary", group_size, mid, size=size)[0] > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@renamed_keywords(r="group_size")
def analysed_pool(
    family: str, group_size: int, size: int, dim: int, seed: int, noise: float | None = None
) -> list[dict[str, float]]:
    """``size`` planted groups of ``family`` through :func:`grpo_lens.analysis.group.analyse_group` (the product's
    per-group path; GRPO advantages with the trainer's defaults; ``null_dim`` = dim)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        analyse_group(g, rw, _advantages(rw), null_dim=dim, num_random=1, seed=seed + i)
        for i, (g, rw) in enumerate(planted_group(family, group_size, dim, gen, noise) for _ in range(size))
    ]


#: the summary keys the per-group claims print (the rest of a probe's summary is not read by them)
_SUMMARY_KEYS = (ZERO_SUM_SPAN_ENERGY, ZERO_SUM_COS_GAP_EXCESS)


@renamed_keywords(groups_by_r="groups_by_size")
def probe_of(groups_by_size: dict[int, list[dict[str, float]]], dim: int | None = None) -> dict[str, Any]:
    """A probe.json-shaped dict of per-group rows (exact gradients), as :func:`grpo_lens.probe.run` writes it."""
    return {
        "meta": {"gradients": "exact", "parameters": dim},
        "per_group_size": {
            str(R): {PROBE_GROUPS: rows, PROBE_SUMMARY: summarise_rows(rows, keys=_SUMMARY_KEYS)}
            for R, rows in groups_by_size.items()
        },
    }


def _draw(pool: list[Any], n: int, gen: torch.Generator) -> list[Any]:
    return [pool[int(i)] for i in torch.randperm(len(pool), generator=gen)[:n]]


def _shares(verdicts: list[str]) -> dict[str, float]:
    t = max(len(verdicts), 1)
    return {
        "holds": sum(v == HOLDS for v in verdicts) / t,
        "does_not_hold": sum(v == DOES_NOT_HOLD for v in verdicts) / t,
    }


def _theta(pool: list[dict[str, float]]) -> float:
    """θ of the cosine Gram over a pool (its population value): Σ excess / Σ (1 − relabelling mean)."""
    rows = [g for g in pool if g.get(ZERO_SUM_UNIT_SPAN_ENERGY_EXCESS) is not None]
    room = sum(1 - g[ZERO_SUM_UNIT_SPAN_ENERGY_NULL] for g in rows)
    return sum(g[ZERO_SUM_UNIT_SPAN_ENERGY_EXCESS] for g in rows) / room if room > 0 else 0.0


# ---------------------------------------------------------------------------------------------------------------------
# the per-group rules (probe)
# ---------------------------------------------------------------------------------------------------------------------
def _family_rows(fam: str, config: CalibrationConfig, noise: dict[int, float]) -> tuple[list[dict[str, Any]], str]:
    """One family's rows of the rank and mechanism rules (a worker's unit: its own seeds, so the rows do not depend on
    which worker ran it or in which order)."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    index = list(FAMILIES).index(fam) if fam in FAMILIES else len(FAMILIES)
    gen = torch.Generator().manual_seed(config.seed + 7919 * (index + 1))
    pools, shares, thetas = {}, {}, {}
    for R in config.group_sizes:
        pools[R] = analysed_pool(fam, R, config.pool, PLANTED_DIM, config.seed + 1000 * R, noise.get(R))
        shares[R] = population_shares(fam, R, noise.get(R))
        thetas[R] = _theta(pools[R])
    # the boundary's E₂ = 0.9 is not above 0.9: not rank 2 by definition
    rank2 = has_rank2_signal(fam) and fam != "boundary" and all(e2 > 0.9 > e1 for e2, e1 in shares.values())
    labels = label_directions(fam) and all(th >= NEGLIGIBLE_SHARE for th in thetas.values())
    pop = "; ".join(f"R = {R}: E₂ {e2:.3f}, E₁ {e1:.3f}, θ {thetas[R]:.3f}" for R, (e2, e1) in shares.items())
    if fam == "boundary":
        pop += "; noise shares " + ", ".join(f"{noise[R]:.3f} (R = {R})" for R in config.group_sizes)
    out = []
    for cell in config.group_cells:
        ns = {R: GROUP_CELLS[cell].get(R, cell) for R in config.group_sizes}
        rank_v, zs_v = [], []
        for _ in range(config.trials):
            p = probe_of({R: _draw(pools[R], ns[R], gen) for R in config.group_sizes}, PLANTED_DIM)
            rank_v += [c.verdict for c in CLAIMS.get("rank_two_top2_share")(p)]
            zs_v += [c.verdict for c in CLAIMS.get("zero_sum_rank_two")(p)]
        base = {
            "family": fam,
            "R": "/".join(map(str, config.group_sizes)),
            "n": cell,
            "groups": " / ".join(str(ns[R]) for R in config.group_sizes),
            "unit": "groups per R",
            "population": pop,
        }
        out.append({**base, "rule": RANK_RULE_ID, "truth": "true" if rank2 else "false", **_shares(rank_v)})
        out.append({**base, "rule": ZERO_SUM_RULE_ID, "truth": "true" if labels else "false", **_shares(zs_v)})
    return out, f"calibrate: {fam}: {time.perf_counter() - t0:.1f} s ({pop})"


def calibrate_group_rules(config: CalibrationConfig, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Rows of the rank rule and the mechanism rule over the planted families: one truth per family and claim; the
    families run on ``config.workers`` processes."""
    noise = {R: boundary_noise(R) for R in config.group_sizes} if "boundary" in config.families else {}
    out: list[dict[str, Any]] = []
    if config.workers > 1 and len(config.families) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(config.workers, mp_context=multiprocessing.get_context("fork")) as ex:
            results = list(
                ex.map(_family_rows, config.families, [config] * len(config.families), [noise] * len(config.families))
            )
    else:
        results = [_family_rows(fam, config, noise) for fam in config.families]
    for rows, line in results:
        log(line)
        out += rows
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the training-run rules
# ---------------------------------------------------------------------------------------------------------------------
def _ar(n: int, phi: float, gen: torch.Generator) -> list[float]:
    """n values of a stationary AR(1) with unit marginal variance (φ < 1) or a random walk of unit steps (φ = 1)."""
    z = torch.randn(n, generator=gen, dtype=torch.float64).tolist()
    out = [z[0]]
    for e in z[1:]:
        out.append(out[-1] + e if phi >= 1 else phi * out[-1] + math.sqrt(1 - phi * phi) * e)
    return out


#: the default schedule's lens steps (30 steps, lens every 5: the first, every 5th and the last)
LENS_STEPS = (1, 5, 10, 15, 20, 25, 30)


def lens_steps(steps: int, every: int) -> list[int]:
    """The steps the lens measures at: the first, every ``every``-th and the last (:data:`LENS_STEPS` at 30, 5)."""
    return sorted({1, steps, *range(every, steps + 1, every)})


def _planted_lr(step: int, kind: str) -> float:
    """The planted runs' learning rate: rising linearly over :data:`PLANTED_WARMUP` steps in the "warmup" kind,
    constant otherwise (what ``perf/lr`` logs)."""
    return 1e-6 * min(1.0, step / PLANTED_WARMUP) if kind == "warmup" else 1e-6


def _sparsity_records(
    kind: str, phi: float, gen: torch.Generator, size: int = 4096, steps: int = 30, every: int = 5
) -> list[dict[str, float]]:
    """metrics.jsonl-shaped lens records of a planted gradient-Hoyer sequence at :func:`lens_steps`: "ar" a flat
    Hoyer 0.3 plus AR(1) noise (SD 0.02) over every step with correlation φ^(1/5) per step (φ between lens steps 5
    apart; φ = 1 a random walk); "rising" 0.30 -> 0.45 over the run plus that noise; "warmup" that noise plus 0.1
    over the LR warm-up's steps; "groups" the Hoyer of a sum of m per-group gradients (each 70% zeros on a random
    support; m falls 8 -> 1 over the lens steps), whose per-group sparsity is constant."""
    at = lens_steps(steps, every)
    n = len(at)
    if kind == "groups":
        recs = []
        for i, step in enumerate(at):
            m = round(8 - 7 * i / (n - 1))
            g = sum(
                torch.randn(size, generator=gen, dtype=torch.float64) * (torch.rand(size, generator=gen) < 0.3)
                for _ in range(m)
            )
            recs.append(
                {
                    STEP: float(step),
                    PERF_LENS_SECONDS: 0.0,
                    LR: _planted_lr(step, kind),
                    RANK_MIXED_GROUPS: float(m),
                    SPARSITY_GRAD_HOYER: weighted_hoyer(g),
                }
            )
        return recs
    noise = _ar(steps, phi if phi >= 1 else phi ** (1 / 5), gen)
    rw = 1 / math.sqrt(5) if phi >= 1 else 1.0  # a random walk's lens-to-lens step of SD 1, as before
    out = []
    for step in at:
        base = 0.3 + (0.15 * (step - 1) / (steps - 1) if kind == "rising" else 0.0)
        base += 0.1 * (1 - (step - 1) / PLANTED_WARMUP) if kind == "warmup" and step <= PLANTED_WARMUP else 0.0
        out.append(
            {
                STEP: float(step),
                PERF_LENS_SECONDS: 0.0,
                LR: _planted_lr(step, kind),
                RANK_MIXED_GROUPS: 4.0,
                SPARSITY_GRAD_HOYER: base + 0.02 * rw * noise[step - 1],
            }
        )
    return out


def _s1_records(
    kind: str, phi: float, gen: torch.Generator, steps: int = 30, groups: int = 4, group_size: int = 8
) -> list[dict[str, float]]:
    """Records of S1 per step: ``groups`` prompts per step with success rates p = Φ(mean + 0.8 z_t + 0.6 e) over an
    AR(1) z_t of correlation φ between steps (the model's accuracy drifting; φ = 1 a random walk of steps 0.3) and a
    per-prompt e; "rising" pushes the mean up so that S1 goes from about 0.35 to 0.85 (R = 8); "warmup" adds 1.5 to
    the mean over the LR warm-up's steps (S1 high while the LR rises), then stationary."""
    z = _ar(steps, phi, gen)
    recs = []
    for step in range(1, steps + 1):
        mu = 2.2 * (step - 1) / (steps - 1) if kind == "rising" else 0.0
        mu += 1.5 if kind == "warmup" and step < PLANTED_WARMUP else 0.0
        drift = 0.8 * z[step - 1] * (0.3 if phi >= 1 else 1.0)
        e = torch.randn(groups, generator=gen, dtype=torch.float64)
        lat = mu + (drift if kind in ("ar", "warmup") else 0.0) + (0.6 if kind in ("ar", "warmup") else 1.0) * e
        p = torch.special.ndtr(lat)
        correct = (torch.rand(groups, group_size, generator=gen, dtype=torch.float64) < p[:, None]).sum(1)
        recs.append(
            {
                STEP: float(step),
                LR: _planted_lr(step, kind),
                REWARD_FRAC_ZERO_STD_GROUPS: float(((correct == 0) | (correct == group_size)).double().mean()),
            }
        )
    return recs


def _trend_data(runs: list[list[dict[str, float]]]) -> dict[str, Any]:
    """What a training claim reads: one run's records, or several seeds' (as the report of `train --seeds` passes)."""
    return {"records": runs[0], **({"seed_runs": runs} if len(runs) > 1 else {})}


def calibrate_training_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of the gradient-sparsity trend and the S1 trend, in one run (fixed-b HAC) at the default schedule (30
    steps, lens every 5) and with the lens on every step, and pooled over 3 and 5 seeds (t over seeds' OLS slopes):
    flat cases with autocorrelated steps, a warm-up transient and (pooled) a random walk as nulls, planted rises as
    alternatives (:data:`TREND_BUDGETS`)."""
    out = []
    gen = torch.Generator().manual_seed(config.seed + 7)
    claims = {"sparsity": CLAIMS.get("sparsity_intensifies"), "s1": CLAIMS.get("zero_variance_share_rises")}
    ids = {
        ("sparsity", False): SPARSITY_RULE_ID,
        ("sparsity", True): SPARSITY_SEEDS_RULE_ID,
        ("s1", False): S1_RULE_ID,
        ("s1", True): S1_SEEDS_RULE_ID,
    }
    for name, budgets in TREND_BUDGETS.items():
        families = SPARSITY_TRENDS if name == "sparsity" else S1_TRENDS
        for seeds, steps, every in budgets:
            pooled = seeds > 1
            tested = len(lens_steps(steps, every)) - 1 if name == "sparsity" else steps
            for fam, (truth, kind, phi) in families.items():
                vs = []
                for _ in range(config.trials):
                    if name == "sparsity":
                        runs = [_sparsity_records(kind, phi, gen, steps=steps, every=every) for _ in range(seeds)]
                    else:
                        runs = [_s1_records(kind, phi, gen, steps=steps) for _ in range(seeds)]
                    vs.append(claims[name](_trend_data(runs))[0].verdict)
                what = f"lens steps (every {every})" if name == "sparsity" else "steps × 4 prompts"
                out.append(
                    {
                        "rule": ids[name, pooled],
                        "family": fam,
                        "R": "–" if name == "sparsity" else 8,
                        "n": seeds if pooled else tested,
                        "unit": f"seeds × {tested} {what}" if pooled else what,
                        "truth": "true" if truth else "false",
                        **_shares(vs),
                    }
                )
    return out


def calibrate_stays_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of "rank stays ≈ 2": planted lens runs of 7 lens steps at R = 8, each step's rows drawn from a planted
    pool and aggregated as the lens does (:func:`grpo_lens.analysis.group.mean_over_groups`,
    :func:`grpo_lens.analysis.group.lens_rank_intervals`)."""
    gen = torch.Generator().manual_seed(config.seed + 29)
    good = analysed_pool("a0.01", 8, config.pool, PLANTED_DIM, config.seed + 31)
    bad = analysed_pool("a0.25", 8, config.pool, PLANTED_DIM, config.seed + 37)
    rule = CLAIMS.get("rank_stays_near_two")
    out = []

    def run(m: int, bad_step: str | None) -> list[dict[str, float]]:
        recs = []
        for i, step in enumerate(LENS_STEPS):
            pool = bad if bad_step == "all" or (bad_step and i == 3) else good
            rows = _draw(pool, m, gen)
            recs.append(
                {STEP: float(step), RANK_MIXED_GROUPS: float(m), **mean_over_groups(rows), **lens_rank_intervals(rows)}
            )
        return recs

    for fam, (truth, m, bad_step) in STAYS_FAMILIES.items():
        vs = [rule({"records": run(m, bad_step)})[0].verdict for _ in range(config.trials)]
        out.append(
            {
                "rule": STAYS_RULE_ID,
                "family": fam,
                "R": 8,
                "n": m,
                "unit": "mixed groups per lens step",
                "truth": "true" if truth else "false",
                **_shares(vs),
            }
        )
    for fam, (truth, seeds, m, bad_step) in STAYS_SEEDS_FAMILIES.items():
        vs = [rule(_trend_data([run(m, bad_step) for _ in range(seeds)]))[0].verdict for _ in range(config.trials)]
        out.append(
            {
                "rule": STAYS_SEEDS_RULE_ID,
                "family": fam,
                "R": 8,
                "n": seeds,
                "unit": f"seeds × 7 lens steps × {m} mixed groups",
                "truth": "true" if truth else "false",
                **_shares(vs),
            }
        )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# studies and the lens's S4 sampler
# ---------------------------------------------------------------------------------------------------------------------
#: per-tensor offsets of the zero share around a family's share (the tensors differ, as layers do: the stratified SE
#: matters); norms get no update at all
_S4_TENSOR_OFFSETS = {"embed_tokens": 0.05, "q_proj": -0.2, "up_proj": 0.1, "down_proj": -0.1}

#: weights of :func:`planted_update_model`
PLANTED_UPDATE_WEIGHTS = 256 * 64 + 64 * 64 + 2 * 128 * 64 + 2 * 64

#: weights the S4 calibration's lens samples (the default lens samples 2^19 of a real model: wider intervals here)
S4_SAMPLE = 4000


def planted_update_model(gen: torch.Generator) -> torch.nn.Module:
    """A small model with the parameter names of a decoder (embedding, q_proj, up/down_proj, a norm; 36,992 weights),
    weights N(0, 0.02²) like an initialised LM (norm weight 1, bias 0), for the S4 calibration."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.embed_tokens = torch.nn.Embedding(256, 64)
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.q_proj = torch.nn.Linear(64, 64, bias=False)
    layer.mlp = torch.nn.Module()
    layer.mlp.up_proj = torch.nn.Linear(64, 128, bias=False)
    layer.mlp.down_proj = torch.nn.Linear(128, 64, bias=False)
    root.model.layers = torch.nn.ModuleList([layer])
    root.model.norm = torch.nn.LayerNorm(64)
    with torch.no_grad():
        for name, p in root.named_parameters():
            if ".norm." not in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return root


def _s4_trial(
    family: tuple[str, float, float, float], gen: torch.Generator, seed: int
) -> tuple[dict[str, float], float]:
    """(the lens record after one planted update since the start, the whole model's float32-unchanged share): the
    update goes through :class:`grpo_lens.lens.sparsity.SparsityOverTraining` as the trainer's optimizer step does."""
    from grpo_lens.lens.sparsity import (
        SparsityOverTraining,  # the lens's own sampler: the path under test
    )

    _, zero, scale, sigma = family
    model = planted_update_model(gen)
    lens = SparsityOverTraining(model, size=S4_SAMPLE, min_per_tensor=128, seed=seed)
    lens.before_step()
    unchanged = total = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind = next((k for k in _S4_TENSOR_OFFSETS if k in name), None)
            if kind is None:  # the norm: no update
                share = 1.0
            else:
                share = min(max(zero + _S4_TENSOR_OFFSETS[kind], 0.0), 1.0) if zero else 0.0
            d = scale * torch.randn(p.shape, generator=gen) * torch.exp(sigma * torch.randn(p.shape, generator=gen))
            d = d * (torch.rand(p.shape, generator=gen) >= share)
            new = p + d
            unchanged += int((new == p).sum())
            total += p.numel()
            p.copy_(new)
    return {STEP: 30.0, PERF_LENS_SECONDS: 0.0, **lens.after_step()}, unchanged / total


def calibrate_update_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of "most parameters unchanged" (S4): planted updates of a small model (:data:`S4_FAMILIES`) through the
    lens's sample and :func:`grpo_lens.claims.sparsity.most_parameters_unchanged`; each trial draws a new model,
    update and sample. Truth per trial: the whole model's float32-unchanged share > 0.5 (exact, every weight); also
    the coverage of the rule's 95% interval of that share (stratified SE)."""
    rule = CLAIMS.get("most_parameters_unchanged")
    gen = torch.Generator().manual_seed(config.seed + 13)
    out = []
    for i, fam in enumerate(config.s4_families):
        verdicts, truths, covered, bf16, perm, dense, zs = [], [], 0, [], [], [], []
        for t in range(config.trials):
            rec, z = _s4_trial(fam, gen, seed=config.seed + 1000 * i + t)
            verdicts.append(rule({"records": [rec]})[0].verdict)
            truths.append(z > 0.5)
            zs.append(z)
            est, se = rec[SPARSITY_UPDATE_TOTAL_F32_UNCHANGED], rec[SPARSITY_UPDATE_TOTAL_F32_UNCHANGED_SE]
            covered += abs(est - z) <= 1.96 * se
            bf16.append(rec[SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED])
            perm.append(rec[SPARSITY_UPDATE_TOTAL_BF16_PERMUTED])
            dense.append(rec[SPARSITY_UPDATE_TOTAL_BF16_DENSE])
        if len(set(truths)) > 1:
            raise RuntimeError(f"S4 family {fam[0]!r}: the truth differs between trials; move it off 0.5")
        mean = lambda v: sum(v) / len(v)  # noqa: E731
        out.append(
            {
                "rule": S4_RULE_ID,
                "family": fam[0],
                "R": "–",
                "n": S4_SAMPLE,
                "unit": "sampled weights",
                "truth": "true" if truths[0] else "false",
                "bf16_unchanged": mean(bf16),
                "bf16_permuted": mean(perm),
                "bf16_dense": mean(dense),
                "f32_unchanged": mean(zs),
                "f32_coverage": covered / config.trials,
                **_shares(verdicts),
            }
        )
    return out


def _mc_rollout(
    p: tuple[float, ...], reward: float, adv: float, mc_samples: int, gen: torch.Generator
) -> dict[str, Any]:
    """One rollout's Monte Carlo row as :func:`grpo_lens.probe.studies.run_credit_study` writes it: each prefix's
    value from K_mc = ``mc_samples`` Bernoulli(p) continuations (mean, sample std / √K_mc, as
    :func:`grpo_lens.gradients.token_credit.prefix_values`), then
    :func:`grpo_lens.formulas.credit.segment_advantages`."""
    draws = (torch.rand(len(p), mc_samples, generator=gen, dtype=torch.float64) < torch.tensor(p)[:, None]).double()
    values, errors = draws.mean(1), draws.std(1, unbiased=True) / math.sqrt(mc_samples)
    seg_adv, seg_err = segment_advantages(values, errors, reward)
    return {
        "reward": reward,
        "grpo_advantage": adv,
        "values": values.tolist(),
        "errors": errors.tolist(),
        "advantages": seg_adv.tolist(),
        "adv_errors": seg_err.tolist(),
    }


def calibrate_credit_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of the Monte Carlo credit rule (:func:`grpo_lens.claims.credit.monte_carlo_credit`): planted true values
    at the prefixes (:data:`MC_FAMILIES`), K_mc = 8 continuations per prefix (the probe's default), the study's own
    segment counting (``grpo_lens.formulas.credit.segment_counts``) and the registered claim. Truth (one boundary,
    the rule's margin): some segment position's planted mean shift against A_i exceeds
    :data:`grpo_lens.claims.credit.MC_MARGIN` (a real opposition of 0.05, or of exactly 0.1, is false)."""
    rule = CLAIMS.get("monte_carlo_credit")
    gen = torch.Generator().manual_seed(config.seed + 17)
    mc_samples = 8
    out = []
    for fam, (truth, p_correct, p_wrong) in config.mc_families.items():
        for n in config.mc_rollouts:
            verdicts = []
            for _ in range(config.trials):
                rows = []
                for i in range(n):
                    rows.append(
                        _mc_rollout(p_correct, 1.0, 1.0, mc_samples, gen)
                        if i % 2 == 0
                        else _mc_rollout(p_wrong, 0.0, -1.0, mc_samples, gen)
                    )
                credit = {
                    "monte_carlo": {
                        "rollouts": rows,
                        "samples_per_prefix": mc_samples,
                        "segments": segment_counts(rows),
                    }
                }
                verdicts.append(rule({"studies": {"credit": credit}})[0].verdict)
            out.append(
                {
                    "rule": MC_RULE_ID,
                    "family": fam,
                    "R": "–",
                    "n": n,
                    "unit": "rollouts",
                    "truth": "true" if truth else "false",
                    **_shares(verdicts),
                }
            )
    return out


def _baseline_pool(family: str, size: int, seed: int, group_size: int = 4, dim: int = 64) -> list[dict[str, Any]]:
    """``size`` planted prompts through :func:`grpo_lens.formulas.baselines.baseline_prompt` (M = 4R rollouts,
    rewards Bernoulli(0.5), gradient terms g = ±μ/2 + noise in R^k: the score's mean direction μ (‖μ‖ = 1) splits
    by class so E[g] = 0, noise N(0, I/k) scaled by the family's factor for correct rollouts, so m_W = 1.25 and
    m_C = 0.25 + scale²; the probe's 256 resampled groups)."""
    _, scale, kind = BASELINE_FAMILIES[family]
    gen = torch.Generator().manual_seed(seed)
    mu = torch.randn(dim, generator=gen, dtype=torch.float64)
    mu = mu / mu.norm()
    m = 4 * group_size
    out = []
    for j in range(size):
        rewards = (torch.rand(m, generator=gen) < 0.5).double()
        noise = torch.randn(m, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)
        if kind == "spread":  # correct rollouts' noise scaled by s_i, s_i² ~ Exponential(1): E s_i² = 1, equal means
            noise = noise * torch.where(
                rewards[:, None] == 1,
                torch.empty(m, 1, dtype=torch.float64).exponential_(generator=gen).sqrt(),
                torch.ones(m, 1, dtype=torch.float64),
            )
        g = torch.where(rewards[:, None] == 1, 0.5 * mu + scale * noise, -0.5 * mu + noise)
        if kind == "one string":  # one gradient for every correct rollout, ‖μ/2 + a z‖² = 1.25 = m_W exactly
            z = noise[0] - (noise[0] @ mu) * mu  # orthogonal to μ: ‖μ/2 + a z‖² = 0.25 + a² ‖z‖²
            g = torch.where(rewards[:, None] == 1, (0.5 * mu + z / z.norm())[None], g)
        res = baseline_prompt(g, rewards, group_size, num_resamples=256, seed=seed + j)
        if res is not None:
            out.append(res)
    return out


def calibrate_baseline_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of :func:`grpo_lens.claims.baselines.group_mean_optimal`: a pool of planted prompts per family analysed
    once by the study's per-prompt body; each trial draws n prompts, summarises them with the study's own summary
    (:func:`grpo_lens.formulas.baselines.summarise_baseline_prompts`) and applies the registered claim."""
    rule = CLAIMS.get("group_mean_optimal")
    gen = torch.Generator().manual_seed(config.seed + 19)
    out = []
    for i, (fam, (truth, _, _)) in enumerate(config.baseline_families.items()):
        pool = _baseline_pool(fam, config.pool, config.seed + 100 * i)
        for n in config.baseline_prompts:
            verdicts = []
            for _ in range(config.trials):
                study = summarise_baseline_prompts(_draw(pool, n, gen))
                probe = {"studies": {"baselines": {"baselines": study, "meta": {"group_size": 4}}}}
                verdicts.append(rule(probe)[0].verdict)
            out.append(
                {
                    "rule": BASELINE_RULE_ID,
                    "family": fam,
                    "R": 4,
                    "n": n,
                    "unit": "prompts",
                    "truth": "true" if truth else "false",
                    **_shares(verdicts),
                }
            )
    return out


def interval_coverage(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Coverage of :func:`grpo_lens.formulas.stats.mean_interval` (nominal 0.95) at n = 8, 22, 34 on normal,
    log-normal (σ = 1) and zero-inflated data (60% zeros, log-normal otherwise), with its one-sided misses."""
    gen = torch.Generator().manual_seed(config.seed + 11)
    samplers = {
        "normal": (lambda n: torch.randn(n, generator=gen, dtype=torch.float64), 0.0),
        "log-normal": (lambda n: torch.exp(torch.randn(n, generator=gen, dtype=torch.float64)), math.exp(0.5)),
        "zero-inflated": (
            lambda n: (
                (torch.rand(n, generator=gen) < 0.4).double()
                * torch.exp(torch.randn(n, generator=gen, dtype=torch.float64))
            ),
            0.4 * math.exp(0.5),
        ),
    }
    out = []
    for name, (draw, mu) in samplers.items():
        for n in (8, 22, 34):
            lo_miss = hi_miss = 0
            for _ in range(config.coverage_trials):
                ci = mean_interval(draw(n).tolist())
                lo_miss += ci["lo"] > mu
                hi_miss += ci["hi"] < mu
            t = config.coverage_trials
            out.append(
                {
                    "data": name,
                    "n": n,
                    "coverage": 1 - (lo_miss + hi_miss) / t,
                    "miss_below": hi_miss / t,
                    "miss_above": lo_miss / t,
                }
            )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------------


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------------------------------------------------
# levels, the table, the run
# ---------------------------------------------------------------------------------------------------------------------
def _level_power(row: dict[str, Any]) -> tuple[float, float]:
    """(level, power) of one row under its truth: the wrong verdict's share and the right one's."""
    if row["truth"] == "true":
        return row["does_not_hold"], row["holds"]
    return row["holds"], row["does_not_hold"]


def _rule_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        row
        for key in ("group_rules", "training_rules", "stays_rules", "update_rules", "credit_rules", "baseline_rules")
        for row in result.get(key, [])
    ]


def rule_levels(result: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """{rule id: {n: {"level": the worst level over its families at n, "power": the lowest power of the *holds*
    branch over its true families at n (None without one), "power_dnh": the lowest power of the *does not hold*
    branch over its false families at n but the one tuned to the rule's boundary (``boundary``: no branch has power
    there by construction; None without one) and "power_dnh_family" where it is lowest, "unit",
    "families"}}}: what the report prints beside each row, each verdict with its own branch's power (issue 43: a
    *does not hold* row printed the *holds* branch's power)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for row in _rule_rows(result):
        level, power = _level_power(row)
        cell = out.setdefault(row["rule"], {}).setdefault(
            str(row["n"]),
            {"level": 0.0, "power": None, "power_dnh": None, "unit": row.get("unit", ""), "families": 0},
        )
        cell["level"] = max(cell["level"], level)
        cell["families"] += 1
        if row["truth"] == "true":
            cell["power"] = power if cell["power"] is None else min(cell["power"], power)
        elif row["family"] != "boundary" and (cell["power_dnh"] is None or power < cell["power_dnh"]):
            cell["power_dnh"], cell["power_dnh_family"] = power, row["family"]
    return out


def _worst(result: dict[str, Any]) -> dict[str, Any]:
    """The summary: the worst level over every rule and family (and where), the power of each rule at the probe's
    default n (its largest calibrated n for the training and study rules), the lowest interval coverage."""
    rows = _rule_rows(result)
    worst = max(rows, key=lambda r: _level_power(r)[0], default=None)
    levels = rule_levels(result)
    power = {}
    for rule, cells in levels.items():
        n = "22" if "22" in cells else max(cells, key=lambda k: float(k))
        power[rule] = (
            n,
            cells[n]["power"],
            cells[n]["unit"],
            cells[n].get("power_dnh"),
            cells[n].get("power_dnh_family"),
        )
    return {
        "level": _level_power(worst)[0] if worst else 0.0,
        "where": f"{worst['rule']}, {worst['family']}, n = {worst['n']}" if worst else "",
        "power": power,
        "coverage": min([r["coverage"] for r in result.get("coverage", [])], default=1.0),
    }


def _cells(row: dict[str, Any]) -> tuple[str, str]:
    level, power = _level_power(row)
    wrong, right = ("does not hold", "holds") if row["truth"] == "true" else ("holds", "does not hold")
    return f"{wrong} {level:.3f}", f"{right} {power:.3f}"


def render(result: dict[str, Any]) -> str:
    """The markdown of a calibration result (what docs/calibration.md holds)."""
    meta = result["meta"]
    worst = _worst(result)
    lines = [
        "# Calibration of the verdict rules",
        "",
        f"Written by `grpo-lens calibrate` ({meta['mode']}) on {meta['date']}, machine {meta['machine']}, "
        f"{meta['cpus']} CPUs ({meta.get('workers', 1)} worker processes of one thread each), load average "
        f"{meta['load_before']} before and {meta['load_after']} after (a shared machine); "
        f"{meta['seconds']:.0f} s wall, "
        f"{meta.get('cpu_seconds', float('nan')):.0f} s CPU over all processes. {meta['trials']} trials per cell; "
        f"each trial draws n "
        f"groups per R from a pool of {meta['pool']} planted groups per (family, R) analysed by `analyse_group` "
        f"(P = {PLANTED_DIM}), then the registered claim decides once across R. One truth per family and claim, "
        f"from what was planted (module docstring of `grpo_lens.calibrate`): level = the wrong verdict's share "
        f"under it (target <= 0.05, <= 0.08 allowing binomial noise at 200 trials), power = the right one's "
        f"(target >= 0.80). Each rule decides at 0.025 per branch on its own; the report's table is decided under "
        f"Holm at a family-wise 0.05 on top (docs/theory.md §11).",
        "",
        "Regenerate: `grpo-lens calibrate --out runs/calibration` writes this file as runs/calibration/calibration.md "
        "(copy it to docs/calibration.md) and levels.json (copy it to grpo_lens/data/calibration_levels.json, which "
        "the report reads); `--quick` is a seconds-long smoke run; `--planted FILE.npz` runs your own cases.",
        "",
        "## Summary",
        "",
        f"Worst level over every rule and family: {worst['level']:.3f} ({worst['where']}); lowest interval coverage "
        f"{worst['coverage']:.3f}.",
        "",
        "| rule | n | power of *holds* (lowest over its true families) | power of *does not hold* (lowest over its "
        "false families, where) |",
        "|---|---|---|---|",
    ]
    for rule, (n, p, unit, pd, fam) in worst["power"].items():
        dnh = "–" if pd is None else f"{pd:.3f} ({fam})"
        lines.append(f"| {rule} | {n} {unit} | {'–' if p is None else f'{p:.3f}'} | {dnh} |")
    lines += [
        "",
        "## Rules on per-group rows (probe): rank ≈ 2 and the labels structure G1",
        "",
        "Families: "
        + "; ".join(f"`{k}` {v}" for k, v in FAMILIES.items() if k in meta.get("families", FAMILIES))
        + ". Population values (E₂, E₁ over 1500 planted groups; θ of the cosine Gram over the pool) after "
        "each family's rows.",
        "",
        "| rule | family | groups (R = 4 / 8) | truth | level (wrong verdict) | power (right verdict) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["group_rules"]:
        level, power = _cells(row)
        lines.append(f"| {row['rule']} | {row['family']} | {row['groups']} | {row['truth']} | {level} | {power} |")
    lines += [""] + [
        f"- `{fam}`: {pop}" for fam, pop in dict.fromkeys((r["family"], r["population"]) for r in result["group_rules"])
    ]
    sections = [
        (
            "training_rules",
            "Trends over training: one run (Hoyer: first differences; S1: OLS with a fixed-b HAC t) and seeds pooled "
            "(t over the seeds' OLS slopes), LR warm-up dropped",
        ),
        ("stays_rules", "Rank stays ≈ 2 at every lens step (planted lens runs, R = 8, 7 lens steps; one run or seeds)"),
        ("update_rules", "Most parameters unchanged (S4), on a planted update through the lens's sampler"),
        (
            "credit_rules",
            "Uniform credit disagrees with Monte Carlo credit (opposing shift by position, margin 0.1, K_mc = 8)",
        ),
        (
            "baseline_rules",
            "The group mean is the variance-optimal baseline (RMS of log m_C / m_W, margin log 1.25; M = 16, R = 4)",
        ),
    ]
    for key, title in sections:
        if not result.get(key):
            continue
        lines += [
            "",
            f"## {title}",
            "",
            "| rule | planted case | n | truth | level (wrong verdict) | power |",
            "|---|---|---|---|---|---|",
        ]
        for row in result[key]:
            level, power = _cells(row)
            lines.append(
                f"| {row['rule']} | {row['family']} | {row['n']} {row.get('unit', '')} | {row['truth']} | "
                f"{level} | {power} |"
            )
    lines += [
        "",
        "## Rows without a verdict (descriptive) and checks",
        "",
        "- `zero_sum_g2_weighting` (G2 stable rank under A against weightings that are not zero-sum): "
        "descriptive; its 0.2 rule said *does not hold* whether the zero-sum constraint was irrelevant or "
        "decisive, so it has no calibrated verdict.",
        "- `uniform_token_credit` (update shares against NLL weights): descriptive; its NLL control is not "
        "zero-sum and the paper does not make this claim.",
        "- Erank, stable rank, participation ratio, k90, k99: printed beside E₂, without verdicts.",
        "- `identity`, `identical_token_advantage`: checks (algebra with a control), not tests.",
        "",
        "## Interval coverage (`mean_interval`, nominal 0.95)",
        "",
        "| data | n | coverage | upper end below the mean | lower end above the mean |",
        "|---|---|---|---|---|",
    ]
    for row in result.get("coverage", []):
        lines.append(
            f"| {row['data']} | {row['n']} | {row['coverage']:.3f} | {row['miss_below']:.3f} | "
            f"{row['miss_above']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def run_calibration(
    config: CalibrationConfig, out: Path | None = None, mode: str = "full", log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run every calibration and return {meta, group_rules, training_rules, stays_rules, update_rules,
    credit_rules, baseline_rules, coverage, levels}; with ``out``, also write OUT/calibration.json,
    OUT/calibration.md (the table) and OUT/levels.json (:func:`rule_levels`)."""
    t0, load0 = time.perf_counter(), _load()
    cpu0 = sum(
        resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # [R, R] matrices: one thread is ~3x faster than several (thread start-up per op)
    try:
        result: dict[str, Any] = {"group_rules": calibrate_group_rules(config, log)}
        if config.training:
            result["training_rules"] = calibrate_training_rules(config)
            result["stays_rules"] = calibrate_stays_rules(config)
        result.update(
            update_rules=calibrate_update_rules(config),
            credit_rules=calibrate_credit_rules(config),
            baseline_rules=calibrate_baseline_rules(config),
            coverage=interval_coverage(config),
        )
    finally:
        torch.set_num_threads(threads)
    cpu = (
        sum(
            resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
            for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        - cpu0
    )
    result["meta"] = {
        "mode": mode,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_seconds": cpu,
        "workers": config.workers,
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
        "cpus": os.cpu_count(),
        "load_before": load0,
        "load_after": _load(),
        "seconds": time.perf_counter() - t0,
        "trials": config.trials,
        "pool": config.pool,
        "coverage_trials": config.coverage_trials,
        "seed": config.seed,
        "families": list(config.families),
    }
    result["levels"] = rule_levels(result)
    if out is not None:
        write_outputs(
            out,
            {
                "calibration.json": json.dumps(result, indent=1),
                "calibration.md": render(result),
                "levels.json": json.dumps(result["levels"], indent=1, sort_keys=True),
            },
        )
    return result


def write_outputs(out: Path, files: dict[str, str]) -> None:
    """Write {name: text} into ``out`` (made if missing) through :func:`grpo_lens.rundir.write_file`, confined to
    ``out`` (:func:`grpo_lens.rundir.writes_confined_to`): a file planted there as a link is replaced, the file it
    points to unchanged.

    Raises:
        UnsafeWriteError: ``out`` is not writable or a name in it is a folder (one line naming it).
    """
    out.mkdir(parents=True, exist_ok=True)
    with writes_confined_to(out):
        for name, text in files.items():
            write_file(out / name, text)


# ---------------------------------------------------------------------------------------------------------------------
# bring your own planted cases
# ---------------------------------------------------------------------------------------------------------------------
class PlantedFileError(ValueError):
    """A ``--planted`` file whose arrays are missing or malformed (one line, naming the array and the shape)."""


#: The most bytes a ``--planted`` file's arrays may hold, as their headers declare and as the zip stores them
#: (a calibration file of 200 trials x 64 groups of R = 8 holds 6.6 MB).
MAX_PLANTED_BYTES = 1 << 30


def check_npz_sizes(path: Path, limit: int = MAX_PLANTED_BYTES) -> None:
    """Refuse a ``.npz`` whose arrays would not fit in ``limit`` bytes before any is read: each member's uncompressed
    size in the zip directory and each array's shape x itemsize from its .npy header (only the header is
    decompressed), so a 2 MB zip bomb or a header claiming 10^12 entries costs nothing.

    Raises:
        PlantedFileError: not a zip archive (a bare .npy, any other file), an unreadable member or header, or over
            ``limit`` (naming the array and its size).
    """
    import zipfile

    import numpy as np

    fmt = np.lib.format
    if not Path(path).is_file():
        raise PlantedFileError(f"{path}: no such file; pass the .npz that numpy.savez wrote")
    if not zipfile.is_zipfile(path):
        raise PlantedFileError(
            f"{path}: not a .npz archive (a zip of .npy arrays, as numpy.savez writes); a bare .npy holds one array, "
            f"and --planted needs gram and rewards: np.savez(FILE, gram=..., rewards=...)"
        )
    total = 0
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                name = info.filename.removesuffix(".npy")
                if info.file_size > limit:
                    raise PlantedFileError(
                        f"{path}: array '{name}' unpacks to {info.file_size:,} bytes, more than the {limit:,} a "
                        f"planted file may hold"
                    )
                with archive.open(info) as f:
                    version = fmt.read_magic(f)
                    if version not in ((1, 0), (2, 0)):
                        raise ValueError(f".npy format version {version} (numpy.savez writes 1.0 or 2.0)")
                    read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
                    shape, _, dtype = read(f)
                declared = math.prod(shape) * dtype.itemsize
                total += declared
                if declared > limit or total > limit:
                    raise PlantedFileError(
                        f"{path}: array '{name}' declares shape {list(shape)} of {dtype} ({declared:,} bytes), more "
                        f"than the {limit:,} a planted file may hold"
                    )
    except PlantedFileError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        why = " ".join(str(e).split())[:160]
        raise PlantedFileError(f"{path}: not a readable .npz file ({type(e).__name__}: {why})") from None


def read_planted(path: Path) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(gram [trials, n, R, R] float64, rewards [trials, n, R], dim or None) from a ``.npz`` file, checked.

    Raises:
        PlantedFileError: a missing or unreadable file, a missing array, or a shape or value that is not the one
            expected (the message names the array and the expected shape).
    """
    import numpy as np  # optional at import time: only this command reads .npz files

    check_npz_sizes(path)
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise PlantedFileError(f"{path}: not a readable .npz file ({e})") from None
    for name in ("gram", "rewards"):
        if name not in data.files:
            raise PlantedFileError(
                f"{path}: array '{name}' is missing; expected gram [trials, n, R, R] float64 and "
                f"rewards [trials, n, R] (optional dim)"
            )
    gram, rewards = data["gram"], data["rewards"]
    if gram.ndim != 4 or gram.shape[2] != gram.shape[3] or gram.shape[2] < 2:
        raise PlantedFileError(
            f"{path}: array 'gram' has shape {list(gram.shape)}; expected [trials, n, R, R] float64 with R >= 2"
        )
    if gram.dtype != np.float64:
        raise PlantedFileError(f"{path}: array 'gram' has dtype {gram.dtype}; expected [trials, n, R, R] float64")
    t, n, R, _ = gram.shape
    if tuple(rewards.shape) != (t, n, R):
        raise PlantedFileError(
            f"{path}: array 'rewards' has shape {list(rewards.shape)}; expected [trials, n, R] = "
            f"[{t}, {n}, {R}] (as gram)"
        )
    if not (np.isfinite(gram).all() and np.isfinite(rewards).all()):
        raise PlantedFileError(f"{path}: arrays 'gram' and 'rewards' must be finite")
    if not np.allclose(gram, gram.transpose(0, 1, 3, 2), rtol=1e-8, atol=1e-12):
        raise PlantedFileError(
            f"{path}: array 'gram' is not symmetric in its last two axes; expected "
            f"[trials, n, R, R] Gram matrices <g_i, g_j>"
        )
    dim = None
    if "dim" in data.files:
        d = data["dim"]
        if d.ndim != 0 or not float(d).is_integer() or int(d) < R:
            raise PlantedFileError(f"{path}: array 'dim' is {d.tolist()!r}; expected a scalar integer P >= R = {R}")
        dim = int(d)
    return torch.from_numpy(gram), torch.from_numpy(rewards).double(), dim


def run_planted(path: Path, out: Path, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """``grpo-lens calibrate --planted FILE.npz --out DIR``: each trial's groups through ``analyse_group`` (GRPO
    advantages, ``null_dim`` = dim) and the per-group claims (rank, its mechanism), as the probe does; writes
    DIR/planted.json, [{"claim", "R", "holds", "does_not_hold", "inconclusive", "trials", "groups"}]. The file is
    checked before anything is written (:func:`read_planted`)."""
    gram, rewards, dim = read_planted(path)
    t, n, R, _ = gram.shape
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    verdicts: dict[str, list[str]] = {"rank_two_top2_share": [], "zero_sum_rank_two": []}
    try:
        for i in range(t):
            rows = [
                analyse_group(gram[i, j], rewards[i, j], _advantages(rewards[i, j]), null_dim=dim, seed=j)
                for j in range(n)
            ]
            p = probe_of({R: rows}, dim)
            for name in verdicts:
                claims = CLAIMS.get(name)(p)
                verdicts[name].append(claims[0].verdict if claims else "inconclusive")
    finally:
        torch.set_num_threads(threads)
    res = [
        {"claim": name, "R": R, **_shares(vs), "inconclusive": 1 - sum(_shares(vs).values()), "trials": t, "groups": n}
        for name, vs in verdicts.items()
    ]
    write_outputs(out, {"planted.json": json.dumps(res, indent=1)})
    log(f"planted: {t} trials of {n} groups at R = {R} (P = {dim or 'orthogonal null'}) -> {out / 'planted.json'}")
    return res
