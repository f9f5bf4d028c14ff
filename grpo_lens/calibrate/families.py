"""The planted families of `grpo-lens calibrate` and the pools they feed: each family's one truth, planted
groups through the product's per-group path, the helpers every cell shares."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_lens import metrics as mk
from grpo_lens.analysis.group import (
    analyse_group,
)
from grpo_lens.claims.base import DOES_NOT_HOLD, HOLDS
from grpo_lens.claims.zero_sum import label_shares
from grpo_lens.formulas.advantages import grpo_advantages
from grpo_lens.formulas.spectrum import wishart
from grpo_lens.formulas.stats import summarise_rows

#: the default probe's mixed groups per R (README: 28 and 22 of the 32 and 24 prompts for R = 4 and 8)
DEFAULT_GROUP_COUNTS = {4: 28, 8: 22}

#: groups per R of the probe-rule cells: the fewest with an interval, the rank rule's minimum, the default probe's,
#: 28 per R (the target n of the rank rule), then 48 to 128 per R (the labels rule reaches 0.8 at 64, on the groups
#: that carry label information)
GROUP_CELLS = {
    8: {4: 8, 8: 8},
    16: {4: 16, 8: 16},
    22: dict(DEFAULT_GROUP_COUNTS),
    28: {4: 28, 8: 28},
    **{n: {4: n, 8: n} for n in (48, 64, 96, 128)},  # the wider grid: the budget where power reaches 0.8
}

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

#: families of the labels rule where groups differ in the label information they carry, and duplicate
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
    """Whether ``family``'s directions depend on the labels (the labels claim true where also population θ̄ >= 0.1)."""
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
#: some segment position's mean shift against A_i exceeds the rule's margin 0.1 (one boundary for both branches)
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

#: m_W of the planted baseline prompts: E‖−μ/2 + e‖² = 1/4 + 1 (‖μ‖ = 1, e ~ N(0, I/k))
BASELINE_M_WRONG = 1.25


def baseline_noise_scale(ratio: float) -> float:
    """The correct rollouts' noise scale s whose planted m_C = 1/4 + s² is ``ratio`` × m_W (:data:`BASELINE_M_WRONG`).

    Raises:
        ValueError: ``ratio`` <= 0.2 (m_C >= 1/4: the mean direction's share alone).
    """
    if not ratio > 0.25 / BASELINE_M_WRONG:
        raise ValueError(f"m_C / m_W = {ratio}: must be above {0.25 / BASELINE_M_WRONG} (m_C >= 1/4 here)")
    return math.sqrt(ratio * BASELINE_M_WRONG - 0.25)


#: the planted baseline-study prompts: name -> (RMS of log(m_C / m_W) below log 1.25 truly, noise scale of the correct
#: rollouts' gradients, how the correct rollouts' noise is drawn: "equal" as the wrong ones', "spread" with a spread
#: of its own at the same mean square, "one string" every correct rollout the same gradient with ‖g‖² = m_W exactly).
#: The false families with m_C < m_W (0.5 and 0.7 m_W, |log| 0.69 and 0.36 > log 1.25 = 0.22) give the *does not hold*
#: branch its power at equal and unequal spreads
BASELINE_FAMILIES = {
    "m_C = m_W (equal noise in both classes)": (True, 1.0, "equal"),
    "m_C = m_W, the correct rollouts' norms spread wider (equal means)": (True, 1.0, "spread"),
    "m_C = m_W, every correct rollout one string": (True, 1.0, "one string"),
    "m_C = 1.25 m_W on every prompt (the margin: not inside it)": (False, math.sqrt(1.3125), "equal"),
    "correct rollouts' noise 2× (m_C = 3.4 m_W)": (False, 2.0, "equal"),
    "m_C = 0.5 m_W (equal spreads)": (False, baseline_noise_scale(0.5), "equal"),
    "m_C = 0.7 m_W (equal spreads)": (False, baseline_noise_scale(0.7), "equal"),
    "m_C = 0.5 m_W, the correct rollouts' norms spread wider": (False, baseline_noise_scale(0.5), "spread"),
    "m_C = 0.7 m_W, the correct rollouts' norms spread wider": (False, baseline_noise_scale(0.7), "spread"),
}


def planted_norm_ratio(family: str) -> float:
    """The population m_C / m_W of a baseline family (:data:`BASELINE_FAMILIES`): (1/4 + s²) / (1/4 + 1); 1 for
    "one string" (its one gradient has ‖g‖² = m_W exactly)."""
    _, scale, kind = BASELINE_FAMILIES[family]
    return 1.0 if kind == "one string" else (0.25 + scale * scale) / BASELINE_M_WRONG


def at_margin(family: str) -> bool:
    """Whether a false family sits on its rule's boundary (the rank rule's ``boundary``, a family planted at the
    margin) or carries no information for it (``a0``: every group has two distinct directions, so every labelling
    spans them and no group carries label information; false for the labels rule, true for rank): no branch has
    power there by construction, so it sets no *does not hold* power (:func:`rule_levels`)."""
    return family in ("boundary", "a0") or "(the margin" in family


#: prompts per baseline cell: the fewest with an interval, the probe's default --baseline-study-prompts (16), larger
#: up to 256 (the unequal-spread family's budget); each family's pool holds 4× the largest draw
BASELINE_PROMPTS = (8, 16, 32, 48, 64, 96, 128, 192, 256)

#: the trend cases: name -> (truth, kind, parameter: the lens-to-lens
#: correlation at 5 steps apart; 0.59 measured on the default model)
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
    pool: int = 256
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
_SUMMARY_KEYS = (mk.ZERO_SUM_SPAN_ENERGY, mk.ZERO_SUM_COS_GAP_EXCESS)


def probe_of(groups_by_size: dict[int, list[dict[str, float]]], dim: int | None = None) -> dict[str, Any]:
    """A probe.json-shaped dict of per-group rows (exact gradients), as :func:`grpo_lens.probe.run` writes it."""
    return {
        "meta": {"gradients": "exact", "parameters": dim},
        "per_group_size": {
            str(R): {mk.PROBE_GROUPS: rows, mk.PROBE_SUMMARY: summarise_rows(rows, keys=_SUMMARY_KEYS)}
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


def parallel_map(fn: Callable[..., Any], items: list[Any], workers: int, *args: Any) -> list[Any]:
    """[fn(item, *args) for item in items], on ``workers`` forked processes when more than one (each item carries its
    own seeds, so the result does not depend on which worker ran it or in which order)."""
    if workers > 1 and len(items) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as ex:
            return list(ex.map(fn, items, *([a] * len(items) for a in args)))
    return [fn(item, *args) for item in items]


def _p(x: float | None) -> float:
    return 1.0 if x is None or not math.isfinite(x) else float(f"{x:.4g}")


def _outcomes(claims: list[Any]) -> dict[str, Any]:
    """:func:`_shares` of the claims' verdicts and their branch p-values per trial, "p": [[p_holds, p_does_not_hold],
    ...] (1 where a rule gave none): what the joint Holm simulation over the primaries reads (:func:`holm_summary`)."""
    return {**_shares([c.verdict for c in claims]), "p": [[_p(c.p_holds), _p(c.p_dnh)] for c in claims]}


def _theta(pool: list[dict[str, float]]) -> float:
    """θ̄ of the cosine Gram over a pool (its population value): the mean of
    :func:`grpo_lens.claims.zero_sum.label_shares` over the pool's informative groups; NaN where none carries label
    information (``a0``)."""
    shares = label_shares(pool)
    return sum(shares) / len(shares) if shares else math.nan
