"""``grpo-lens calibrate``: the level and power of every verdict rule, measured on planted cases (docs/calibration.md).

Every planted group goes through the path a real group takes: its Gram matrix [R, R], rewards [R] and GRPO
advantages [R] into :func:`grpo_lens.analysis.group.analyse_group` (with ``null_dim`` = the planted dimension P),
the rows into a probe-shaped dict with :func:`grpo_lens.formulas.stats.summarise_rows`, and that dict into the
registered claim function (:data:`grpo_lens.claims.base.CLAIMS`). The training-run rules get metrics.jsonl-shaped
records built with the product's own measures (:func:`grpo_lens.formulas.sparsity.weighted_hoyer` of gradients and of
``torch.optim.AdamW`` updates). The intervals of :func:`grpo_lens.formulas.stats.mean_interval` are checked for
coverage on the skewed data of issue 18.

Design. Per (family, R) a pool of planted groups is analysed once; each trial draws n groups from the pool without
replacement and decides the rule, so the pool stands in for the population (its mean sets the cell's truth, e.g.
whether a measure's population value lies in the band). n = 8 (the fewest groups with an interval) and the default
probe's mixed-group counts (:data:`DEFAULT_GROUP_COUNTS`). Level = the share of *holds* in cells where the claim is
false and of *does not hold* where it is true; power = the share of the right verdict.

Planted families (Gram matrices sampled exactly for gradients in R^P, docs/calibration.md):

- ``a<f>``: exact rank 2 (orthonormal class means) plus isotropic noise, share f of G1's energy;
- ``b<s>``: no shared structure, random directions with log-normal norms (log-SD s; ``b0`` equal norms);
- ``c_lr2``: label-independent rank 2 (+1% noise); ``c_shared``: a shared direction, pairwise cosine 0.5;
- ``d<c>_<f>``: two classes with near-collinear class means (cosine c), noise share f;
- ``<family>_s<σ>``: any family with its rows rescaled by log-normal norms (log-SD σ).

The token-credit rule (``uniform_token_credit``) gets planted per-token gradients g_{i,t} in R^P
(:func:`planted_credit_group`, :data:`CREDIT_TOKEN_FAMILIES`; R = 4, completions of 10-24 tokens with 1-3 answer
tokens) through the study's per-group body (:func:`grpo_lens.formulas.credit.paired_class_shares` of
:func:`grpo_lens.formulas.credit.signed_contributions`, the directional derivatives exact,
:func:`grpo_lens.formulas.credit.exact_directional_derivatives`) and summary
(:func:`grpo_lens.formulas.credit.summarise_class_shares`), n = 8 and 28 groups:

- "geometry only" (truth: holds): random directions, class-dependent norms (equal; format tokens 10× smaller;
  format 10× smaller and answer tokens 3× larger), no class × advantage interaction;
- "credit concentrates on answers, e = ..." (e = 0.5, 1: does not hold; e = 0.25 the near-null case, within the
  band on the pool's means): the answer tokens of a correct rollout add e v, of a wrong one −e v (v a unit vector per
  group), so under A they add up and under NLL weights they cancel.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from grpo_lens.analysis.group import analyse_group
from grpo_lens.claims.base import CLAIMS, DOES_NOT_HOLD, HOLDS
from grpo_lens.claims.credit import CREDIT_EQUIVALENCE
from grpo_lens.claims.rank import (
    RANK_BAND,
    RANK_CLAIM_MEASURES,
    TOP_SHARE,
)
from grpo_lens.claims.zero_sum import NEGLIGIBLE_SHARE
from grpo_lens.formulas.advantages import compute_advantages, grpo_advantages
from grpo_lens.formulas.baselines import baseline_prompt, summarise_baseline_prompts
from grpo_lens.formulas.credit import (
    TOKEN_CLASSES,
    exact_directional_derivatives,
    paired_class_shares,
    segment_advantages,
    signed_contributions,
    summarise_class_shares,
    token_weights,
)
from grpo_lens.formulas.sparsity import weighted_hoyer
from grpo_lens.formulas.spectrum import wishart
from grpo_lens.formulas.stats import mean_interval, summarise_rows
from grpo_lens.metrics import (
    PERF_LENS_SECONDS,
    PROBE_GROUPS,
    PROBE_SUMMARY,
    RANK_G1,
    RANK_MIXED_GROUPS,
    REWARD_FRAC_ZERO_STD_GROUPS,
    SPARSITY_GRAD_HOYER,
    SPARSITY_UPDATE_STEP_HOYER,
    SPARSITY_UPDATE_TOTAL_BF16_DENSE,
    SPARSITY_UPDATE_TOTAL_BF16_PERMUTED,
    SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED,
    SPARSITY_UPDATE_TOTAL_F32_UNCHANGED,
    SPARSITY_UPDATE_TOTAL_F32_UNCHANGED_SE,
    STEP,
    ZERO_SUM_SPAN_ENERGY_EXCESS,
    ZERO_SUM_SPAN_ENERGY_NULL,
)
from grpo_lens.probe.studies import _segment_counts
from grpo_lens.train.sparsity import SparsityOverTraining

#: the default probe's mixed groups per R (README: 28 and 22 of the 32 and 24 prompts for R = 4 and 8)
DEFAULT_GROUP_COUNTS = {4: 28, 8: 22}

#: the dimension of the planted gradients
PLANTED_DIM = 2048

#: the families of the rank rules (planted structure: all but b*) and of the zero-sum rule (label-dependent: a*, d*)
RANK_FAMILIES = ("a0.001", "a0.01", "a0.05", "b0", "b1", "b2", "c_lr2", "c_shared", "d0.95_0.01")
ZERO_SUM_FAMILIES = ("b0", "b1", "c_lr2", "c_shared", "c_lr2_s1", "a0.01", "d0.95_0.05", "d0.95_0.05_s1")


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
#: true success probabilities p(b_0..b_3) at the four prefixes of the credit study; the last segment ends at r
MC_FAMILIES = {
    "no token opposes A_i (p flat until the end)": (False, (0.5, 0.5, 0.5, 0.5), (0.5, 0.5, 0.5, 0.5)),
    "every segment agrees (p moves towards r)": (False, (0.3, 0.5, 0.7, 0.9), (0.7, 0.5, 0.3, 0.1)),
    "one segment in four opposes A_i by 0.6": (True, (0.8, 0.2, 0.4, 0.6), (0.2, 0.8, 0.6, 0.4)),
    "one segment in four opposes A_i by 0.3": (True, (0.6, 0.3, 0.5, 0.7), (0.4, 0.7, 0.5, 0.3)),
}

#: rollouts per Monte Carlo cell: the fewest with a verdict (--mc-groups 4) and larger studies
MC_ROLLOUTS = (8, 32, 100)


#: the planted token-credit groups (per-token gradients g_{i,t} in R^P, :func:`planted_credit_group`): name ->
#: (answer tokens' norm, format tokens' norm, effect e); reasoning tokens have norm 1, every token's direction is
#: random, and the answer tokens of rollout i add e σ_i v (σ_i = +1 correct, −1 wrong; v a unit vector per group)
CREDIT_TOKEN_FAMILIES = {
    "geometry only: equal norms": (1.0, 1.0, 0.0),
    "geometry only: format 10× smaller": (1.0, 0.1, 0.0),
    "geometry only: format 10× smaller, answer 3× larger": (3.0, 0.1, 0.0),
    "credit concentrates on answers, e = 0.25": (1.0, 0.1, 0.25),
    "credit concentrates on answers, e = 0.5": (1.0, 0.1, 0.5),
    "credit concentrates on answers, e = 1": (1.0, 0.1, 1.0),
}

#: groups per token-credit cell: the probe's default --credit-groups and the default probe's mixed groups at R = 4
CREDIT_GROUPS = (8, 28)

#: the dimension of the planted per-token gradients
CREDIT_DIM = 512

#: planted groups per token-credit family (its mean is the truth: a format class 10× smaller has a band of ±0.0015
#: against a per-group SD of its Δ near 0.01, so a pool of 200 can put its mean outside by chance)
CREDIT_POOL = 1000

#: truth "edge" for the token-credit rule: some class's pool |Δ| within this share of its band's half-width of the edge
CREDIT_EDGE = 0.1


#: the planted baseline-study prompts: name -> (m_C = m_W truly, noise scale of the correct rollouts' gradients)
BASELINE_FAMILIES = {
    "m_C = m_W (equal noise in both classes)": (True, 1.0),
    "correct rollouts' noise 2× (m_C = 3.4 m_W)": (False, 2.0),
}

#: prompts per baseline cell: the fewest with an interval, the probe's default --baseline-study-prompts (16), larger
BASELINE_PROMPTS = (8, 16, 24, 32)


@dataclass(frozen=True)
class CalibrationConfig:
    """What `grpo-lens calibrate` runs: trials per cell, pool of planted groups per (family, R), seed."""

    trials: int = 200
    pool: int = 200
    coverage_trials: int = 2000
    seed: int = 0
    families: tuple[str, ...] = RANK_FAMILIES
    zero_sum_families: tuple[str, ...] = ZERO_SUM_FAMILIES
    group_sizes: tuple[int, ...] = (4, 8)
    s4_families: tuple[tuple[str, float, float, float], ...] = S4_FAMILIES
    mc_families: dict[str, tuple[bool, tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=lambda: dict(MC_FAMILIES))
    mc_rollouts: tuple[int, ...] = MC_ROLLOUTS
    baseline_families: dict[str, tuple[bool, float]] = field(default_factory=lambda: dict(BASELINE_FAMILIES))
    baseline_prompts: tuple[int, ...] = BASELINE_PROMPTS
    credit_token_families: tuple[str, ...] = tuple(CREDIT_TOKEN_FAMILIES)
    credit_groups: tuple[int, ...] = CREDIT_GROUPS
    credit_pool: int = CREDIT_POOL

    @classmethod
    def quick(cls) -> CalibrationConfig:
        """A small run for tests (seconds): few trials and families; its numbers are not the calibration."""
        return cls(trials=20, pool=40, coverage_trials=200, families=("a0.01", "b2", "d0.95_0.01"),
                   zero_sum_families=("b1", "a0.01"), group_sizes=(4,),
                   s4_families=(S4_FAMILIES[0], S4_FAMILIES[-1]),
                   mc_families={k: MC_FAMILIES[k] for k in list(MC_FAMILIES)[::2]}, mc_rollouts=(8, 100),
                   baseline_prompts=(32,), credit_token_families=tuple(CREDIT_TOKEN_FAMILIES)[1::4],
                   credit_groups=(8,), credit_pool=40)


# ---------------------------------------------------------------------------------------------------------------------
# planted groups
# ---------------------------------------------------------------------------------------------------------------------
def has_structure(family: str) -> bool:
    """Whether the rows share directions beyond random ones (the rank claim's structure condition is true)."""
    return not family.startswith("b")


def label_dependent(family: str) -> bool:
    """Whether the gradients depend on the reward labels (the zero-sum row's claim is true)."""
    return family.startswith(("a", "d"))


def planted_group(family: str, r: int, dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One group of ``family``: (Gram matrix [R, R] of its g_i in R^dim, rewards [R]), k ~ U{1..R-1} correct first.

    g_i = Σ_j B_ij v_j + σ e_i with v_1..v_q orthonormal and e_i iid N(0, I/dim) gives
    G = B Bᵀ + σ(B Yᵀ + Y Bᵀ) + σ²(Y Yᵀ + W/dim), Y [R, q] iid N(0, 1/dim), W ~ Wishart(dim − q, I_R) (rotation
    invariance), so the cost does not depend on dim.

    Raises:
        ValueError: an unknown family.
    """
    spread = re.fullmatch(r"(.+)_s(\d+(?:\.\d+)?)", family)
    if spread:
        gram, rewards = planted_group(spread.group(1), r, dim, gen)
        norms = torch.exp(float(spread.group(2)) * torch.randn(r, generator=gen, dtype=torch.float64))
        return gram * torch.outer(norms, norms), rewards
    k = int(torch.randint(1, r, (1,), generator=gen))
    rewards = (torch.arange(r) < k).double()
    labels = rewards == 1
    if family.startswith("b"):
        norms = torch.exp(float(family[1:]) * torch.randn(r, generator=gen, dtype=torch.float64))
        return wishart(r, dim, 1, gen)[0] / dim * torch.outer(norms, norms), rewards
    if family.startswith("a"):
        f, c = float(family[1:]), 0.0
    elif family.startswith("d"):
        c, f = (float(x) for x in family[1:].split("_"))
    elif family in ("c_lr2", "c_shared"):
        f, c = (0.01, 0.0) if family == "c_lr2" else (0.5, 0.0)
    else:
        raise ValueError(f"unknown planted family {family!r}; valid: a<f>, b<s>, c_lr2, c_shared, d<c>_<f>, "
                         f"<family>_s<sigma>")
    if family.startswith(("a", "d")):
        b = torch.where(labels[:, None], torch.tensor([1.0, 0.0], dtype=torch.float64),
                        torch.tensor([c, math.sqrt(1 - c * c)], dtype=torch.float64))
    elif family == "c_lr2":
        b = torch.randn(r, 2, generator=gen, dtype=torch.float64) / math.sqrt(2)
    else:
        b = torch.full((r, 1), math.sqrt(0.5), dtype=torch.float64)
    sigma = math.sqrt(0.5) if family == "c_shared" else math.sqrt(f / (1 - f))
    q = b.shape[1]
    y = torch.randn(r, q, generator=gen, dtype=torch.float64) / math.sqrt(dim)
    w = wishart(r, dim - q, 1, gen)[0] / dim
    by = b @ y.T
    return b @ b.T + sigma * (by + by.T) + sigma**2 * (y @ y.T + w), rewards


def analysed_pool(family: str, r: int, size: int, dim: int, seed: int) -> list[dict[str, float]]:
    """``size`` planted groups of ``family`` through :func:`grpo_lens.analysis.group.analyse_group` (the product's
    per-group path; GRPO advantages with the trainer's defaults)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(size):
        gram, rewards = planted_group(family, r, dim, gen)
        adv = grpo_advantages(rewards[None], torch.ones(1, r, dtype=torch.bool))[0]
        rows.append(analyse_group(gram, rewards, adv, null_dim=dim, seed=seed + i))
    return rows


def probe_of(groups_by_r: dict[int, list[dict[str, float]]]) -> dict[str, Any]:
    """A probe.json-shaped dict of per-group rows (exact gradients), as :func:`grpo_lens.probe.run` writes it."""
    return {"meta": {"gradients": "exact"},
            "per_group_size": {str(r): {PROBE_GROUPS: rows, PROBE_SUMMARY: summarise_rows(rows)}
                               for r, rows in groups_by_r.items()}}


def _draw(pool: list[Any], n: int, gen: torch.Generator) -> list[Any]:
    return [pool[int(i)] for i in torch.randperm(len(pool), generator=gen)[:n]]


def _shares(verdicts: list[str]) -> dict[str, float]:
    t = len(verdicts)
    return {"holds": sum(v == HOLDS for v in verdicts) / t,
            "does_not_hold": sum(v == DOES_NOT_HOLD for v in verdicts) / t}


# ---------------------------------------------------------------------------------------------------------------------
# the rules
# ---------------------------------------------------------------------------------------------------------------------
def _rank_truth(pool: list[dict[str, float]], family: str, measure: str) -> str:
    """'true', 'false' or 'edge' (the pool's mean within a rounding distance of the band's edge)."""
    def mean(m: str) -> float:
        return sum(g[RANK_G1.format(m=m)] for g in pool) / len(pool)

    if measure == "top2_share":
        t2, t1 = mean("top2_share"), mean("top1_share")
        band, edge = t2 > TOP_SHARE > t1, min(abs(t2 - TOP_SHARE), abs(t1 - TOP_SHARE)) < 0.01
    else:
        v = mean(measure)
        band, edge = RANK_BAND[0] <= v <= RANK_BAND[1], min(abs(v - RANK_BAND[0]), abs(v - RANK_BAND[1])) < 0.05
    if not has_structure(family):
        return "false"
    return "edge" if edge else ("true" if band else "false")


def _measure_row(c: Any) -> str:
    return next(m for m in RANK_CLAIM_MEASURES if c.claim.endswith(f"({_MEASURE_TITLE[m]})"))


_MEASURE_TITLE = {"top2_share": "top-2 energy share (k90 = 2)", "erank": "entropy effective rank",
                  "stable_rank": "stable rank"}


def calibrate_group_rules(config: CalibrationConfig, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Rows of the rank rules (one per measure) and the zero-sum G1 rule over the planted families."""
    out = []
    gen = torch.Generator().manual_seed(config.seed)
    families = list(dict.fromkeys(config.families + config.zero_sum_families))
    for r in config.group_sizes:
        for fam in families:
            t0 = time.perf_counter()
            pool = analysed_pool(fam, r, config.pool, PLANTED_DIM, config.seed + 1000 * r)
            log(f"calibrate: R = {r} {fam}: pool of {len(pool)} groups analysed in {time.perf_counter() - t0:.1f} s")
            ns = sorted({8, DEFAULT_GROUP_COUNTS.get(r, 8)})
            for n in ns:
                trials = [probe_of({r: _draw(pool, n, gen)}) for _ in range(config.trials)]
                if fam in config.families:
                    per_measure: dict[str, list[str]] = {m: [] for m in RANK_CLAIM_MEASURES}
                    for p in trials:
                        for c in CLAIMS.get("erank_near_two")(p):
                            per_measure[_measure_row(c)].append(c.verdict)
                    for m, vs in per_measure.items():
                        out.append({"rule": f"rank ≈ 2 ({m})", "family": fam, "R": r, "n": n,
                                    "truth": _rank_truth(pool, fam, m), **_shares(vs)})
                if fam in config.zero_sum_families:
                    vs = [c.verdict for p in trials for c in CLAIMS.get("zero_sum_rank_two")(p)]
                    room = sum(1 - g[ZERO_SUM_SPAN_ENERGY_NULL] for g in pool)
                    theta = sum(g[ZERO_SUM_SPAN_ENERGY_EXCESS] for g in pool) / room
                    truth = "false" if not label_dependent(fam) else ("true" if theta >= NEGLIGIBLE_SHARE else "edge")
                    out.append({"rule": "labels structure G1 (zero-sum, G1)", "family": fam, "R": r, "n": n,
                                "truth": truth, "theta": theta, **_shares(vs)})
    return out


def _sparsity_records(kind: str, steps: int, lens_every: int, gen: torch.Generator, size: int = 4096
                      ) -> list[dict[str, float]]:
    """metrics.jsonl-shaped lens records of a planted gradient sequence under AdamW (the trainer's betas)."""
    param = torch.nn.Parameter(torch.zeros(size, dtype=torch.float64))
    opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    recs = []
    for step in range(1, steps + 1):
        g = torch.randn(size, generator=gen, dtype=torch.float64)
        if kind == "sparse90":
            g = g * (torch.rand(size, generator=gen) < 0.1)
        elif kind == "rising":  # the share of zero entries rises linearly from 0.2 to 0.9
            zero = 0.2 + 0.7 * (step - 1) / (steps - 1)
            g = g * (torch.rand(size, generator=gen) >= zero)
        before = param.detach().clone()
        param.grad = g
        opt.step()
        if step == 1 or step % lens_every == 0:
            recs.append({STEP: float(step), PERF_LENS_SECONDS: 0.0, RANK_MIXED_GROUPS: 1.0,
                         SPARSITY_GRAD_HOYER: weighted_hoyer(g),
                         SPARSITY_UPDATE_STEP_HOYER: weighted_hoyer(param.detach() - before)})
    return recs


def _s1_records(kind: str, steps: int, groups: int, r: int, gen: torch.Generator) -> list[dict[str, float]]:
    """Records of S1 per step: ``groups`` prompts per step with success rates p ~ Beta; stationary p ~ U(0, 1), or a
    mean rising so that S1 goes from about 0.35 to 0.85 (R = 8)."""
    recs = []
    for step in range(1, steps + 1):
        p = torch.rand(groups, generator=gen, dtype=torch.float64)
        if kind == "rising":
            p = p ** (1 - 0.9 * (step - 1) / (steps - 1))  # pushes p towards 1
        correct = (torch.rand(groups, r, generator=gen, dtype=torch.float64) < p[:, None]).sum(1)
        s1 = float(((correct == 0) | (correct == r)).double().mean())
        recs.append({STEP: float(step), REWARD_FRAC_ZERO_STD_GROUPS: s1})
    return recs


def calibrate_training_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of the gradient-sparsity trend (and the update-Hoyer trend the 0.1 rule tested, for comparison) and the
    S1 trend, on the default training schedule (30 steps, lens every 5)."""
    out = []
    gen = torch.Generator().manual_seed(config.seed + 7)
    trend = CLAIMS.get("sparsity_intensifies")
    for kind, truth in (("gaussian", "false"), ("sparse90", "false"), ("rising", "true")):
        grad_v, upd_v = [], []
        for _ in range(config.trials):
            recs = _sparsity_records(kind, 30, 5, gen)
            grad_v.append(trend({"records": recs})[0].verdict)
            as_update = [dict(r, **{SPARSITY_GRAD_HOYER: r[SPARSITY_UPDATE_STEP_HOYER]}) for r in recs]
            upd_v.append(trend({"records": [dict(r, **{RANK_MIXED_GROUPS: 1.0}) for r in as_update]})[0].verdict)
        out.append({"rule": "gradient sparsity intensifies", "family": f"{kind} gradients under AdamW",
                    "R": "–", "n": "6 lens steps", "truth": truth, **_shares(grad_v)})
        out.append({"rule": "0.1 rule: trend of the update's Hoyer (for comparison)",
                    "family": f"{kind} gradients under AdamW", "R": "–", "n": "6 lens steps", "truth": truth,
                    **_shares(upd_v)})
    s1 = CLAIMS.get("zero_variance_share_rises")
    for kind, truth in (("stationary", "false"), ("rising", "true")):
        vs = [s1({"records": _s1_records(kind, 30, 4, 8, gen)})[0].verdict for _ in range(config.trials)]
        out.append({"rule": "S1 rises over training", "family": f"{kind} success rates, 4 groups of 8 per step",
                    "R": 8, "n": "30 steps", "truth": truth, **_shares(vs)})
    return out


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


def _s4_trial(family: tuple[str, float, float, float], gen: torch.Generator, seed: int) -> tuple[dict[str, float],
                                                                                                   float]:
    """(the lens record after one planted update since the start, the whole model's float32-unchanged share): the
    update goes through :class:`grpo_lens.train.sparsity.SparsityOverTraining` as the trainer's optimizer step does."""
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
        out.append({"rule": "most parameters unchanged (S4)", "family": fam[0], "R": "–",
                    "n": f"{S4_SAMPLE} sampled weights", "truth": "true" if truths[0] else "false",
                    "bf16_unchanged": mean(bf16), "bf16_permuted": mean(perm), "bf16_dense": mean(dense),
                    "f32_unchanged": mean(zs), "f32_coverage": covered / config.trials, **_shares(verdicts)})
    return out


def _mc_rollout(p: tuple[float, ...], reward: float, adv: float, k: int, gen: torch.Generator) -> dict[str, Any]:
    """One rollout's Monte Carlo row as :func:`grpo_lens.probe.studies.run_credit_study` writes it: each prefix's
    value from K Bernoulli(p) continuations (mean, sample std / √K, as
    :func:`grpo_lens.gradients.token_credit.prefix_values`), then
    :func:`grpo_lens.formulas.credit.segment_advantages`."""
    draws = (torch.rand(len(p), k, generator=gen, dtype=torch.float64) < torch.tensor(p)[:, None]).double()
    values, errors = draws.mean(1), draws.std(1, unbiased=True) / math.sqrt(k)
    seg_adv, seg_err = segment_advantages(values, errors, reward)
    return {"reward": reward, "grpo_advantage": adv, "values": values.tolist(), "errors": errors.tolist(),
            "advantages": seg_adv.tolist(), "adv_errors": seg_err.tolist()}


def calibrate_credit_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of the Monte Carlo credit rule (:func:`grpo_lens.claims.credit.monte_carlo_credit`): planted true values
    at the prefixes (:data:`MC_FAMILIES`), K = 8 continuations per prefix (the probe's default), the study's own segment
    counting (``grpo_lens.probe.studies._segment_counts``) and the registered claim. Truth: the paper's prediction
    (some segments oppose A_i) is true only where the planted values make a segment oppose A_i's sign."""
    rule = CLAIMS.get("monte_carlo_credit")
    gen = torch.Generator().manual_seed(config.seed + 17)
    k = 8
    out = []
    for fam, (truth, p_correct, p_wrong) in config.mc_families.items():
        for n in config.mc_rollouts:
            verdicts = []
            for _ in range(config.trials):
                rows = []
                for i in range(n):
                    rows.append(_mc_rollout(p_correct, 1.0, 1.0, k, gen) if i % 2 == 0
                                else _mc_rollout(p_wrong, 0.0, -1.0, k, gen))
                credit = {"monte_carlo": {"rollouts": rows, "samples_per_prefix": k,
                                          "segments": _segment_counts(rows)}}
                verdicts.append(rule({"studies": {"credit": credit}})[0].verdict)
            out.append({"rule": "uniform credit disagrees with Monte Carlo credit", "family": fam, "R": "–",
                        "n": f"{n} rollouts ({4 * n} segments)", "truth": "true" if truth else "false",
                        **_shares(verdicts)})
    return out


def planted_credit_group(family: str, r: int, dim: int, gen: torch.Generator
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One planted group of :data:`CREDIT_TOKEN_FAMILIES`: k ~ U{1..R-1} correct rollouts first, lengths
    ~ U{10..24} tokens; each completion ends in a format token (EOS) after 1-3 answer tokens, every earlier token is
    format with probability 0.2 (spaces, punctuation) and reasoning otherwise. g_{i,t} = n_c (z_{i,t} + e σ_i v
    [answer tokens only]), z_{i,t} iid N(0, I/dim) (norm ≈ 1, random direction), n_c the class's norm.

    Returns:
        (token_grads [R, T, dim] float64 (0 off the completion), classes [R, T] (0 answer, 1 format, 2 reasoning, −1
        off; :data:`grpo_lens.formulas.credit.TOKEN_CLASSES`), rewards [R], completion_mask [R, T] bool), T = 24.

    Raises:
        ValueError: an unknown family.
    """
    if family not in CREDIT_TOKEN_FAMILIES:
        raise ValueError(f"unknown planted token-credit family {family!r}; valid: {sorted(CREDIT_TOKEN_FAMILIES)}")
    ans_norm, fmt_norm, effect = CREDIT_TOKEN_FAMILIES[family]
    t_max = 24
    k = int(torch.randint(1, r, (1,), generator=gen))
    rewards = (torch.arange(r) < k).double()
    lengths = torch.randint(10, t_max + 1, (r,), generator=gen)
    n_answer = torch.randint(1, 4, (r,), generator=gen)
    pos = torch.arange(t_max).unsqueeze(0)  # [1, T]
    mask = pos < lengths[:, None]
    answer = (pos >= (lengths - 1 - n_answer)[:, None]) & (pos < (lengths - 1)[:, None])
    fmt = (pos == (lengths - 1)[:, None]) | ((torch.rand(r, t_max, generator=gen) < 0.2) & ~answer)
    classes = torch.where(answer, 0, torch.where(fmt, 1, 2)).masked_fill(~mask, -1)
    norms = torch.tensor([ans_norm, fmt_norm, 1.0], dtype=torch.float64)[classes.clamp(min=0)]  # [R, T]
    v = torch.randn(dim, generator=gen, dtype=torch.float64)
    shared = effect * (2 * rewards - 1)[:, None, None] * (v / v.norm()) * answer[..., None]  # [R, T, dim]
    z = torch.randn(r, t_max, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)
    grads = norms[..., None] * (z + shared) * mask[..., None]
    return grads, classes, rewards, mask


def credit_token_pool(family: str, r: int, size: int, dim: int, seed: int) -> list[tuple[dict, dict]]:
    """``size`` planted groups through the credit study's per-group body
    (:func:`grpo_lens.formulas.credit.paired_class_shares`, GRPO advantages as the study computes them), with the
    shares from :func:`grpo_lens.formulas.credit.signed_contributions` of the planted gradients' exact directional
    derivatives: [(class shares under A, under NLL weights)]."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(size):
        grads, classes, rewards, mask = planted_credit_group(family, r, dim, gen)
        adv = compute_advantages(rewards.view(1, r), "grpo", std="sample", eps=1e-4)[0]

        def contribute(a: torch.Tensor) -> dict:
            w = token_weights(a, mask, "seq-mean-token-mean")
            return signed_contributions(w, *exact_directional_derivatives(grads, w))

        _, sh, sh_nll = paired_class_shares(contribute, adv, classes)
        out.append((sh, sh_nll))
    return out


def _credit_token_truth(pool: list[tuple[dict, dict]]) -> tuple[str, str]:
    """('true' / 'false' / 'edge', the pool's numbers): per class the pool's mean paired difference Δ against its
    band ± CREDIT_EQUIVALENCE × the pool's mean NLL ratio; true when every |Δ| is inside, false when any is outside,
    edge when some |Δ| lies within :data:`CREDIT_EDGE` of the band's half-width of the edge."""
    verdicts, parts = [], []
    for c in TOKEN_CLASSES:
        delta = sum(a[c]["ratio"] - b[c]["ratio"] for a, b in pool) / len(pool)
        half = CREDIT_EQUIVALENCE * abs(sum(b[c]["ratio"] for _, b in pool) / len(pool))
        verdicts.append("edge" if abs(abs(delta) - half) < CREDIT_EDGE * half else
                        ("true" if abs(delta) <= half else "false"))
        parts.append(f"{c} Δ = {delta:+.3f} (band ±{half:.3f})")
    truth = "false" if "false" in verdicts else ("edge" if "edge" in verdicts else "true")
    return truth, "; ".join(parts)


def calibrate_credit_token_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of :func:`grpo_lens.claims.credit.uniform_token_credit`: a pool of planted groups per family
    (:func:`credit_token_pool`, R = 4); each trial draws n groups, summarises them with the study's own summary
    (:func:`grpo_lens.formulas.credit.summarise_class_shares`: the ``classes`` / ``classes_nll`` dicts of
    :func:`grpo_lens.probe.studies.run_credit_study`) and applies the registered claim. Truth: the pool's means
    (:func:`_credit_token_truth`)."""
    rule = CLAIMS.get("uniform_token_credit")
    gen = torch.Generator().manual_seed(config.seed + 23)
    r, out = 4, []
    for i, fam in enumerate(config.credit_token_families):
        pool = credit_token_pool(fam, r, config.credit_pool, CREDIT_DIM, config.seed + 200 * i)
        truth, numbers = _credit_token_truth(pool)
        for n in config.credit_groups:
            verdicts = []
            for _ in range(config.trials):
                draw = _draw(pool, n, gen)
                classes, classes_nll = summarise_class_shares([a for a, _ in draw], [b for _, b in draw])
                credit = {"contributions": {"classes": classes, "classes_nll": classes_nll, "groups": n},
                          "meta": {"group_size": r}}
                verdicts.append(rule({"studies": {"credit": credit}})[0].verdict)
            out.append({"rule": "uniform token credit (A against NLL weights)", "family": fam, "R": r,
                        "n": f"{n} groups", "truth": truth, "pool": numbers, **_shares(verdicts)})
    return out


def _baseline_pool(family: str, size: int, seed: int, r: int = 4, k: int = 64) -> list[dict[str, Any]]:
    """``size`` planted prompts through :func:`grpo_lens.formulas.baselines.baseline_prompt` (M = 4R rollouts,
    rewards Bernoulli(0.5), gradient terms g = ±μ/2 + noise in R^k: the score's mean direction μ (‖μ‖ = 1) splits
    by class so E[g] = 0, noise N(0, I/k) scaled by the family's factor for correct rollouts; the probe's 256
    resampled groups)."""
    _, scale = BASELINE_FAMILIES[family]
    gen = torch.Generator().manual_seed(seed)
    mu = torch.randn(k, generator=gen, dtype=torch.float64)
    mu = mu / mu.norm()
    out = []
    for j in range(size):
        rewards = (torch.rand(4 * r, generator=gen) < 0.5).double()
        noise = torch.randn(4 * r, k, generator=gen, dtype=torch.float64) / math.sqrt(k)
        g = torch.where(rewards[:, None] == 1, 0.5 * mu + scale * noise, -0.5 * mu + noise)
        res = baseline_prompt(g, rewards, r, num_resamples=256, seed=seed + j)
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
    for i, (fam, (truth, _)) in enumerate(config.baseline_families.items()):
        pool = _baseline_pool(fam, config.pool, config.seed + 100 * i)
        for n in config.baseline_prompts:
            verdicts = []
            for _ in range(config.trials):
                study = summarise_baseline_prompts(_draw(pool, n, gen))
                probe = {"studies": {"baselines": {"baselines": study, "meta": {"group_size": 4}}}}
                verdicts.append(rule(probe)[0].verdict)
            out.append({"rule": "group mean optimal (m_C = m_W)", "family": fam, "R": 4, "n": f"{n} prompts",
                        "truth": "true" if truth else "false", **_shares(verdicts)})
    return out


def interval_coverage(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Coverage of :func:`grpo_lens.formulas.stats.mean_interval` (nominal 0.95) at n = 8, 22, 34 on normal,
    log-normal (σ = 1) and zero-inflated data (60% zeros, log-normal otherwise), with its one-sided misses."""
    gen = torch.Generator().manual_seed(config.seed + 11)
    samplers = {
        "normal": (lambda n: torch.randn(n, generator=gen, dtype=torch.float64), 0.0),
        "log-normal": (lambda n: torch.exp(torch.randn(n, generator=gen, dtype=torch.float64)), math.exp(0.5)),
        "zero-inflated": (lambda n: (torch.rand(n, generator=gen) < 0.4).double()
                          * torch.exp(torch.randn(n, generator=gen, dtype=torch.float64)), 0.4 * math.exp(0.5)),
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
            out.append({"data": name, "n": n, "coverage": 1 - (lo_miss + hi_miss) / t, "miss_below": hi_miss / t,
                        "miss_above": lo_miss / t})
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------------
def _verdict_cells(row: dict[str, Any]) -> tuple[str, str]:
    """(level cell, power cell): the wrong-verdict share the level bounds and the right-verdict share."""
    if row["truth"] == "false":
        return f"false holds {row['holds']:.3f}", f"does not hold {row['does_not_hold']:.3f}"
    if row["truth"] == "true":
        return f"false does not hold {row['does_not_hold']:.3f}", f"holds {row['holds']:.3f}"
    return f"(edge) holds {row['holds']:.3f}", f"does not hold {row['does_not_hold']:.3f}"


def render(result: dict[str, Any]) -> str:
    """The markdown of a calibration result (what docs/calibration.md holds)."""
    meta = result["meta"]
    lines = [
        "# Calibration of the verdict rules",
        "",
        f"Written by `grpo-lens calibrate` ({meta['mode']}) on {meta['date']}, machine {meta['machine']}, "
        f"{meta['cpus']} CPUs, load average {meta['load_before']} before and {meta['load_after']} after; "
        f"{meta['seconds']:.0f} s. {meta['trials']} trials per cell; each trial draws n groups from a pool of "
        f"{meta['pool']} planted groups per (family, R) analysed by `analyse_group` (P = {PLANTED_DIM}), then the "
        f"registered claim decides. Level = wrong-verdict share (target <= 0.05); power = right-verdict share "
        f"(target >= 0.80). 'edge' cells have a population value within rounding of the band's edge: no side is "
        f"wrong there. Rules and families: docs/theory.md §11 and the module docstring of "
        f"`grpo_lens.claims.calibrate`.",
        "",
        "Families (exact Gram matrices of gradients in R^P): `a<f>` exact rank 2 (orthonormal class means) plus "
        "isotropic noise holding the share f of G1's energy; `b<s>` no shared structure (random directions, "
        "log-normal norms with log-SD s); `c_lr2` label-independent rank 2; `c_shared` one shared direction "
        "(pairwise cosine 0.5); `d<c>_<f>` two classes whose means have cosine c, noise share f; `_s<σ>` rows "
        "rescaled by log-normal norms. Truth: the rank rows are true where the family has structure and the pool's "
        "mean lies in the measure's band; the zero-sum row is true for label-dependent families (a, d) whose "
        "normalised effect θ is at least 0.1; a trend is true for the rising cases.",
        "",
        "Regenerate: `grpo-lens calibrate --out runs/calibration` writes this file as "
        "runs/calibration/calibration.md (copy it to docs/calibration.md); `--quick` is a seconds-long smoke run.",
        "",
        "## Rules on per-group rows (probe)",
        "",
        "| rule | family | R | n | truth | level (wrong verdict) | power (right verdict) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["group_rules"]:
        level, power = _verdict_cells(row)
        fam = row["family"] + (f" (θ = {row['theta']:.3f})" if "theta" in row else "")
        lines.append(f"| {row['rule']} | {fam} | {row['R']} | {row['n']} | {row['truth']} | {level} | {power} |")
    lines += ["", "## Rules on a training run's records", "",
              "| rule | planted case | R | points | truth | level (wrong verdict) | power (right verdict) |",
              "|---|---|---|---|---|---|---|"]
    for row in result["training_rules"]:
        level, power = _verdict_cells(row)
        if row["truth"] == "false":  # a trend claim under no trend: both verdicts are wrong
            level = f"holds {row['holds']:.3f}, does not hold {row['does_not_hold']:.3f}"
            power = f"inconclusive {1 - row['holds'] - row['does_not_hold']:.3f}"
        lines.append(f"| {row['rule']} | {row['family']} | {row['R']} | {row['n']} | {row['truth']} | {level} | "
                     f"{power} |")
    lines += ["", "## Most parameters unchanged (S4), on a training run's update", "",
              f"Each trial: a fresh {PLANTED_UPDATE_WEIGHTS}-weight model with decoder parameter names, one planted "
              f"update since the start (zero shares differ by tensor: embedding +0.05, q_proj −0.20, up_proj +0.10, "
              f"down_proj −0.10 around the family's; the norm is not updated), the lens's `SparsityOverTraining` on a "
              f"fresh sample of about {S4_SAMPLE} weights, then the registered claim. Truth: the whole model's "
              f"float32-unchanged share (every weight) above 0.5. Shares are means over trials; the dense control is "
              f"the 0.1 rule's (shown, not used); coverage: the rule's 95% interval of the float32-unchanged share "
              f"(stratified SE) around the whole model's share, shown where that share lies in [0.05, 0.95] (near 0 "
              f"a sample without an unchanged weight has SE 0, so a Wald interval misses; the rule compares with 0.5 "
              f"and is not affected).", "",
              "| planted update | truth | float32 unchanged | bf16 unchanged | permutation control | dense control | "
              "level (wrong verdict) | power (right verdict) | interval coverage |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in result.get("update_rules", []):
        level, power = _verdict_cells(row)
        lines.append(f"| {row['family']} | {row['truth']} | {row['f32_unchanged']:.3f} | {row['bf16_unchanged']:.3f} | "
                     f"{row['bf16_permuted']:.3f} "
                     f"| {row['bf16_dense']:.3f} | {level} | {power} | {_s4_coverage(row)} |")
    lines += ["", "## Uniform credit disagrees with Monte Carlo credit (credit study)", "",
              "Each trial: n rollouts, half correct (A_i > 0) and half wrong (A_i < 0), each with four prefixes whose "
              "true success probabilities are planted; every prefix's value from K = 8 Bernoulli continuations (mean, "
              "sample std / √K, as the study writes them), then the registered claim (an exact count test: a rollout "
              "is flagged when a segment's success count falls against A_i by d = 5 of 8, at most 0.032 per rollout "
              "under no opposition; the count of flagged rollouts against Binomial(n, 0.032)). Truth: "
              "the paper's prediction (some segment opposes A_i) holds where a planted segment opposes A_i's sign.",
              "", "| planted values | rollouts | truth | level (wrong verdict) | power (right verdict) |",
              "|---|---|---|---|---|"]
    for row in result.get("credit_rules", []):
        level, power = _verdict_cells(row)
        lines.append(f"| {row['family']} | {row['n']} | {row['truth']} | {level} | {power} |")
    lines += ["", "## Every token class gets the update in proportion to NLL weights (credit study)", "",
              f"A pool of {meta.get('credit_pool', CREDIT_POOL)} planted groups per family (R = 4, k ~ U{{1..3}} "
              "correct; completions of 10–24 tokens: 1–3 answer tokens before a closing format token (EOS), each "
              "earlier token format with probability 0.2 and reasoning otherwise; per-token gradients g_{i,t} in "
              f"R^{CREDIT_DIM}: a random direction z ~ N(0, I/P) times the class's norm, reasoning 1; the answer "
              "tokens of rollout i add e σ_i v, σ_i = +1 correct and −1 wrong, v one unit vector per group) analysed "
              "once by the study's per-group body (`paired_class_shares`: `signed_contributions` of the exact "
              "directional derivatives ⟨g_{i,t}, u⟩ under A and under NLL weights, then `class_shares`); each trial "
              "draws n groups, summarises them with the study's `summarise_class_shares` and the registered claim "
              "decides. Geometry-only families have no class × advantage interaction (the claim is true by design); "
              "with e > 0 the answer tokens' shared direction adds up under A and cancels under NLL weights. Truth "
              "from the pool's means: true when every class's mean paired difference Δ = ratio_A − ratio_NLL lies "
              f"inside ± {CREDIT_EQUIVALENCE:g} × its mean NLL ratio (the rule's band), edge within "
              f"{CREDIT_EDGE:g} of the band's half-width of its edge; the pool's numbers are printed under the "
              "table. 8 groups is the probe's default `--credit-groups`.", "",
              "| planted per-token gradients | R | groups | truth | level (wrong verdict) | power (right verdict) |",
              "|---|---|---|---|---|---|"]
    for row in result.get("credit_token_rules", []):
        level, power = _verdict_cells(row)
        lines.append(f"| {row['family']} | {row['R']} | {row['n']} | {row['truth']} | {level} | {power} |")
    pools = dict.fromkeys((row["family"], row["pool"]) for row in result.get("credit_token_rules", []))
    lines += [""] + [f"- {fam}: {numbers}" for fam, numbers in pools]
    lines += ["", "## The group mean is the variance-optimal baseline (baseline study)", "",
              f"A pool of {meta['pool']} planted prompts per family (M = 16 rollouts, R = 4, rewards Bernoulli(0.5), "
              "gradient terms in R^64: a mean direction split by class plus noise) analysed once by the study's "
              "per-prompt body (`baseline_prompt`: the MSE of every baseline on 256 resampled groups and the "
              "m_C = m_W permutation test); each trial draws n prompts, summarises them "
              "(`summarise_baseline_prompts`) and the registered claim decides. 8 prompts can reach *does not hold* "
              "but not *holds* (with no rejection among 8 prompts the Wilson interval still reaches 0.32, above the "
              "0.25 margin); the probe's default `--baseline-study-prompts` is 16, the fewest rows below that reach "
              "both verdicts.", "",
              "| planted prompts | prompts | truth | level (wrong verdict) | power (right verdict) |",
              "|---|---|---|---|---|"]
    for row in result.get("baseline_rules", []):
        level, power = _verdict_cells(row)
        lines.append(f"| {row['family']} | {row['n']} | {row['truth']} | {level} | {power} |")
    lines += ["", "## Rules not calibrated here", "",
              "- `uniform_token_credit`, the parts upstream of the planted per-token gradients above: the "
              "finite-difference directional derivatives of a model (their error is the study's closure, sum s − 1, "
              "and tests/gradients checks them against per-token autograd) and the token classifier "
              "(`token_classes` on decoded text); the planted geometry is random directions, not a model's.",
              "- `zero_sum_g2_weighting` (G2 stable ranks under weightings) and `identity`: their inputs are per-layer "
              "G2 spectra and residuals of a model's backward; planted Gram matrices do not reach them.",
              "- `rank_stays_near_two`: a trend over lens steps of the rank reading calibrated above; not planted.",
              "- `identical_token_advantage`: algebra that holds by construction; no test, no error rate."]
    lines += ["", "## Interval coverage (`mean_interval`, nominal 0.95)", "",
              "| data | n | coverage | upper end below the mean | lower end above the mean |", "|---|---|---|---|---|"]
    for row in result["coverage"]:
        lines.append(f"| {row['data']} | {row['n']} | {row['coverage']:.3f} | {row['miss_below']:.3f} | "
                     f"{row['miss_above']:.3f} |")
    worst = _worst(result)
    lines += ["", "## Summary", "",
              f"Worst false holds over false cells: {worst['false_holds']:.3f}; worst false does-not-hold over true "
              f"cells: {worst['false_dnh']:.3f}; lowest power over decided cells at the default probe's n: "
              f"{worst['power']:.3f}; lowest coverage: {worst['coverage']:.3f}.", ""]
    return "\n".join(lines)


def _s4_coverage(row: dict[str, Any]) -> str:
    return f"{row['f32_coverage']:.3f}" if 0.05 <= row["f32_unchanged"] <= 0.95 else "–"


def _worst(result: dict[str, Any]) -> dict[str, float]:
    """The summary: worst level on each side, lowest power at the default probe's n, lowest coverage. A trend rule
    under no trend is wrong on either side (both count as false holds); its right verdict is inconclusive."""
    update = (result.get("update_rules", []) + result.get("credit_rules", []) + result.get("credit_token_rules", [])
              + result.get("baseline_rules", []))
    rows = [r for r in result["group_rules"] + result["training_rules"] if not r["rule"].startswith("0.1 rule")]
    trend = [r for r in rows if not isinstance(r["R"], int) or str(r["n"]).endswith(("steps",))]
    group = [r for r in rows if r not in trend]
    rows, group = rows + update, group + update
    default_n = set(DEFAULT_GROUP_COUNTS.values()) | {r["n"] for r in update}
    false_holds = [r["holds"] for r in group if r["truth"] == "false"]
    false_holds += [max(r["holds"], r["does_not_hold"]) for r in trend if r["truth"] == "false"]
    power = [r["holds"] if r["truth"] == "true" else r["does_not_hold"] for r in group
             if r["truth"] in ("true", "false") and r["n"] in default_n]
    power += [r["holds"] for r in trend if r["truth"] == "true"]
    return {"false_holds": max(false_holds, default=0.0),
            "false_dnh": max([r["does_not_hold"] for r in rows if r["truth"] == "true"], default=0.0),
            "power": min(power, default=1.0),
            "coverage": min([r["coverage"] for r in result["coverage"]], default=1.0)}


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def run_calibration(config: CalibrationConfig, out: Path | None = None, mode: str = "full",
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every calibration and return {meta, group_rules, training_rules, update_rules, credit_rules,
    credit_token_rules, baseline_rules, coverage}; with ``out``, also write OUT/calibration.json and
    OUT/calibration.md (the table)."""
    t0, load0 = time.perf_counter(), _load()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # [R, R] matrices: one thread is ~3x faster than several (thread start-up per op)
    try:
        result: dict[str, Any] = {"group_rules": calibrate_group_rules(config, log),
                                  "training_rules": calibrate_training_rules(config),
                                  "update_rules": calibrate_update_rules(config),
                                  "credit_rules": calibrate_credit_rules(config),
                                  "credit_token_rules": calibrate_credit_token_rules(config),
                                  "baseline_rules": calibrate_baseline_rules(config),
                                  "coverage": interval_coverage(config)}
    finally:
        torch.set_num_threads(threads)
    result["meta"] = {"mode": mode, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                      "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
                      "cpus": os.cpu_count(), "load_before": load0, "load_after": _load(),
                      "seconds": time.perf_counter() - t0, "trials": config.trials, "pool": config.pool,
                      "coverage_trials": config.coverage_trials, "credit_pool": config.credit_pool,
                      "seed": config.seed}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration.json").write_text(json.dumps(result, indent=1))
        (out / "calibration.md").write_text(render(result))
    return result
