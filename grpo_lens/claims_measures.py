"""The paper's claims on sparsity, token credit and baseline optimality (arXiv 2606.29238), registered in
:data:`grpo_lens.claims.CLAIMS` beside the rank claims, each with a verdict computed by a rule (docs/theory.md §12).

The credit and baseline claims read a probe's ``studies`` (:mod:`grpo_lens.studies`); the sparsity claims read a
training run's records, passed as ``{"records": [metrics.jsonl records]}`` (the report evaluates
:data:`TRAINING_CLAIMS` on that). Every function returns [] when its inputs are absent. Pure functions only.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any, Sequence

from grpo_lens.claims import CLAIMS, DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, Claim, band_verdict
from grpo_lens.diagnostics.baseline_study import MIN_UNITS

#: the false "disagree" rate of a segment whose true advantage has A_i's sign, at |A| > 2 SE: Phi(-2) = 0.023
MC_NOISE_DISAGREE = 0.023
#: "every token the same credit" read as: the answer tokens' update share / token share within 1 ± this (the paper
#: gives no tolerance; an interval that merely contains 1 is no evidence when it is wide)
CREDIT_EQUIVALENCE = 0.25
#: "holds" on Monte Carlo credit needs the 2-SE test to have signed (agree or disagree) more than this share of the
#: segments: a segment within noise of 0 is no evidence of agreement
MC_MIN_RESOLVED = 0.5
#: bf16-unchanged share above its dense control by at least this counts as sparsity beyond rounding
BF16_MARGIN = 0.05
#: fewest lens steps a trend is tested on (with 3, no order reaches p < 0.05 two-sided: p >= 2/6)
MIN_LENS_STEPS = 4
#: the claims evaluated on a training run's records
TRAINING_CLAIMS = ("sparsity_intensifies", "most_parameters_unchanged")


def _fmt(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{nd}f}"


def _ci(s: dict[str, Any] | None, nd: int = 2, unit: str = "groups") -> str:
    if not s or s.get("mean") is None:
        return "not measured"
    if s.get("lo") is None:
        return f"{_fmt(s['mean'], nd)} (n = {s.get('n')} {unit}, too few for an interval)"
    return f"{_fmt(s['mean'], nd)} [{_fmt(s['lo'], nd)}, {_fmt(s['hi'], nd)}] (n = {s.get('n')} {unit})"


def verdict_from_interval(lo: float | None, hi: float | None, control: float, holds_if: str) -> str:
    """holds / does not hold / inconclusive from an interval [lo, hi] and a control value.

    Args:
        holds_if: "above" (holds when the interval lies above the control, fails when it lies below), "below" (the
            reverse), or "contains" (holds when the interval contains the control, fails when it excludes it).

    Returns:
        one of :data:`grpo_lens.claims.VERDICTS`; inconclusive without an interval, or when it straddles the control
        for above / below.

    Raises:
        ValueError: an unknown ``holds_if``.
    """
    if holds_if not in ("above", "below", "contains"):
        raise ValueError(f"unknown holds_if {holds_if!r}; valid: above, below, contains")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return INCONCLUSIVE
    if holds_if == "contains":
        return HOLDS if lo <= control <= hi else DOES_NOT_HOLD
    above, below = lo > control, hi < control
    if holds_if == "above":
        return HOLDS if above else (DOES_NOT_HOLD if below else INCONCLUSIVE)
    return HOLDS if below else (DOES_NOT_HOLD if above else INCONCLUSIVE)


def spearman_trend(xs: Sequence[float], ys: Sequence[float], num_perm: int = 5000, seed: int = 0
                   ) -> tuple[float, float]:
    """(Spearman's rho of ys against xs, two-sided permutation p-value) (Spearman 1904; Pitman 1937).

    Exact over all n! orders for n <= 7, else ``num_perm`` random permutations (p = (1 + #{|rho*| >= |rho|}) /
    (1 + num_perm)). (NaN, NaN) for n < 3.
    """
    n = len(xs)
    if n < 3:
        return math.nan, math.nan

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2  # ties share their mean rank
            i = j + 1
        return r

    def rho(a: list[float], b: list[float]) -> float:
        ma, mb = sum(a) / n, sum(b) / n
        num = sum((x - ma) * (y - mb) for x, y in zip(a, b))
        den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
        return num / den if den > 0 else 0.0

    rx, ry = ranks(xs), ranks(ys)
    r0 = rho(rx, ry)
    if n <= 7:
        perms = list(itertools.permutations(ry))
        return r0, sum(abs(rho(rx, list(p))) >= abs(r0) - 1e-12 for p in perms) / len(perms)
    rng = random.Random(seed)
    hits = 0
    for _ in range(num_perm):
        p = ry[:]
        rng.shuffle(p)
        hits += abs(rho(rx, p)) >= abs(r0) - 1e-12
    return r0, (1 + hits) / (1 + num_perm)


def _lens_rows(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("perf/lens_seconds") is not None and r.get(key) is not None]


# ---------------------------------------------------------------------------------------------------------------------
# Sparsity (a training run's records)
# ---------------------------------------------------------------------------------------------------------------------
@CLAIMS.register("sparsity_intensifies")
def sparsity_intensifies(data: dict[str, Any]) -> list[Claim]:
    """"Gradient sparsity intensifies over training": the Hoyer sparsity of each lens step's update against the step.

    Rule: Spearman's rho between step and Hoyer over the lens steps, two-sided permutation p-value; holds when
    rho > 0 and p < 0.05, does not hold when rho < 0 and p < 0.05, inconclusive otherwise or with fewer than
    :data:`MIN_LENS_STEPS` lens steps.
    """
    rows = _lens_rows(data.get("records") or [], "sparsity/update_step_hoyer")
    if not rows:
        return []
    xs = [float(r["step"]) for r in rows]
    ys = [float(r["sparsity/update_step_hoyer"]) for r in rows]
    rho, p = spearman_trend(xs, ys)
    if len(rows) < MIN_LENS_STEPS or not math.isfinite(p):
        verdict, why = INCONCLUSIVE, f"{len(rows)} lens steps < {MIN_LENS_STEPS}: no order reaches p < 0.05"
    elif p < 0.05:
        verdict = HOLDS if rho > 0 else DOES_NOT_HOLD
        why = f"rho {_fmt(rho, 2)}, permutation p {_fmt(p)} < 0.05"
    else:
        verdict, why = INCONCLUSIVE, f"permutation p {_fmt(p)} >= 0.05"
    grad = [r.get("sparsity/grad_hoyer") for r in rows]
    space = f", LoRA adapter weights (rank {data['lora_rank']}) only" if data.get("lora_rank") else ""
    return [Claim(claim="gradient (update) sparsity intensifies over training",
                  scope=f"training, {len(rows)} lens steps{space}",
                  measurement=(f"Hoyer of the step's update {_fmt(ys[0])} (step {rows[0]['step']}) -> {_fmt(ys[-1])} "
                               f"(step {rows[-1]['step']}), Spearman rho {_fmt(rho, 2)}; gradient Hoyer "
                               f"{_fmt(grad[0])} -> {_fmt(grad[-1])}"),
                  control="no trend (rho = 0); a Gaussian vector has Hoyer 0.20",
                  verdict=verdict, rule=why, source=f"lens, fixed sample of {_sample_size(rows)} weights")]


def _sample_size(rows: list[dict[str, Any]]) -> str:
    n = rows[-1].get("sparsity/sample_entries")
    return str(int(n)) if n else "?"


@CLAIMS.register("most_parameters_unchanged")
def most_parameters_unchanged(data: dict[str, Any]) -> list[Claim]:
    """"RL leaves most parameters unchanged" (S4), tested against bf16 rounding.

    Rule: excess = bf16-unchanged share since the start minus its dense-update control (a dense Gaussian update of the
    same per-tensor RMS), 95% binomial interval from the sample; holds when the excess interval lies above
    :data:`BF16_MARGIN` and the share above 0.5; does not hold when the excess lies below BF16_MARGIN (rounding
    explains the share) or the share below 0.5; inconclusive otherwise.
    """
    rows = _lens_rows(data.get("records") or [], "sparsity/update_total_bf16_dense")
    if not rows:
        return []
    last = rows[-1]
    if data.get("lora_rank"):  # the lens samples the trainable (adapter) weights; the frozen base never changes
        return [Claim(claim="RL leaves most parameters unchanged (S4), beyond bf16 rounding",
                      scope=f"training, step {last['step']}, LoRA rank {data['lora_rank']}",
                      measurement=(f"over the adapter's A and B only: bf16 unchanged since start "
                                   f"{_fmt(last['sparsity/update_total_bf16_unchanged'])}"),
                      control="none: the claim is about the model's weights, not the adapter's",
                      verdict=INCONCLUSIVE,
                      rule=("not applicable to adapter parameters: the frozen base weights never change and the "
                            "adapter is a different parameter space (B starts at 0, so A gets no gradient on step 1); "
                            "the merged weights W + (alpha/r) B A are not measured"),
                      source=f"lens, fixed sample of {_sample_size(rows)} adapter weights")]
    n = float(last.get("sparsity/sample_entries") or 0)
    share, dense = last["sparsity/update_total_bf16_unchanged"], last["sparsity/update_total_bf16_dense"]
    se = math.sqrt(max(share * (1 - share), 1e-12) / n) if n else math.nan
    gap = share - dense
    lo, hi = gap - 1.96 * se, gap + 1.96 * se
    verdict = verdict_from_interval(lo, hi, BF16_MARGIN, "above")
    why = f"excess [{_fmt(lo)}, {_fmt(hi)}] vs {BF16_MARGIN}"
    if share + 1.96 * se < 0.5:
        verdict, why = DOES_NOT_HOLD, f"only {_fmt(share)} of weights kept their bf16 value (< 0.5)"
    elif verdict == HOLDS and share - 1.96 * se <= 0.5:
        verdict, why = INCONCLUSIVE, f"excess above {BF16_MARGIN} but the share {_fmt(share)} is not clearly > 0.5"
    return [Claim(claim="RL leaves most parameters unchanged (S4), beyond bf16 rounding",
                  scope=f"training, step {last['step']}",
                  measurement=(f"bf16 unchanged since start {_fmt(share)}; excess over the dense control {_fmt(gap)} "
                               f"[{_fmt(lo)}, {_fmt(hi)}] (binomial interval over {int(n)} sampled weights); "
                               f"float32 unchanged "
                               f"{_fmt(last.get('sparsity/update_total_f32_unchanged'), 4)}"),
                  control=f"a dense update of the same per-tensor RMS leaves {_fmt(dense)} unchanged in bf16",
                  verdict=verdict, rule=why, source=f"lens, fixed sample of {_sample_size(rows)} weights")]


# ---------------------------------------------------------------------------------------------------------------------
# Credit and baselines (a probe's studies)
# ---------------------------------------------------------------------------------------------------------------------
@CLAIMS.register("uniform_token_credit")
def uniform_token_credit(probe: dict[str, Any]) -> list[Claim]:
    """"Output-only reward gives every token the same credit", read as: every token class (answer, format, reasoning)
    gets the group update in proportion to its size.

    Rule (docs/theory.md §12): per class, its share of the group update over its share of the tokens, 95% interval
    over groups (none from fewer than MIN_UNITS groups). Holds when every measured class's interval lies inside
    1 ± :data:`CREDIT_EQUIVALENCE` (narrow enough to exclude a credit 25% off proportional); does not hold when any
    class's interval lies wholly outside that band; inconclusive otherwise, or when the answer class has no interval.
    """
    credit = (probe.get("studies") or {}).get("credit")
    if not credit:
        return []
    classes = credit["contributions"]["classes"]
    lo_b, hi_b = 1.0 - CREDIT_EQUIVALENCE, 1.0 + CREDIT_EQUIVALENCE
    band = f"[{lo_b:g}, {hi_b:g}]"
    ratios = {c: (classes.get(c) or {}).get("ratio") or {} for c in ("answer", "format", "reasoning")}
    per_class = {c: band_verdict(r.get("lo"), r.get("hi"), lo_b, hi_b) for c, r in ratios.items()
                 if r.get("lo") is not None}
    outside = [c for c, v in per_class.items() if v == DOES_NOT_HOLD]
    if outside:
        verdict, rule = DOES_NOT_HOLD, f"interval of {', '.join(outside)} tokens wholly outside {band}"
    elif "answer" not in per_class:
        verdict, rule = INCONCLUSIVE, f"no interval for answer tokens (fewer than {MIN_UNITS} groups with them)"
    elif all(v == HOLDS for v in per_class.values()):
        verdict, rule = HOLDS, f"every measured class's interval inside {band} ({', '.join(per_class)})"
    else:
        wide = [c for c, v in per_class.items() if v != HOLDS]
        verdict, rule = INCONCLUSIVE, (f"interval of {', '.join(wide)} tokens overlaps the edge of {band}: too wide "
                                       f"to tell")
    measured = "; ".join(f"{c} tokens {_ci(r)}" for c, r in ratios.items() if r.get("mean") is not None)
    return [Claim(claim="output-only reward gives every token the same credit",
                  scope=f"R = {credit['meta']['group_size']}, {credit['contributions']['groups']} groups",
                  measurement=f"each class's share of the update / share of tokens: {measured}",
                  control=f"1 (every class credited in proportion to its token count); equivalence band {band}",
                  verdict=verdict, rule=rule,
                  source="exact update direction over every parameter, finite differences")]


@CLAIMS.register("monte_carlo_credit")
def monte_carlo_credit(probe: dict[str, Any]) -> list[Claim]:
    """"GRPO's uniform A_i is the credit each token earns", against Monte Carlo token advantages (VinePPO).

    Rule: d = share of Monte Carlo segments (pooled over rollouts) whose advantage opposes A_i beyond 2 standard
    errors, with its Wilson interval; control :data:`MC_NOISE_DISAGREE`, that test's false rate when every segment
    truly has A_i's sign or 0. Holds when the interval lies below the control *and* the Wilson interval of the share
    of segments the test signed (agree or disagree beyond 2 SE) lies above :data:`MC_MIN_RESOLVED` (segments within
    noise of 0 are no evidence of agreement); does not hold when the disagreeing share's interval lies above the
    control; inconclusive otherwise, or from fewer than MIN_UNITS rollouts (segments of one rollout are not
    independent).
    """
    credit = (probe.get("studies") or {}).get("credit")
    if not credit:
        return []
    if not credit["monte_carlo"]["rollouts"]:  # the credit study ran without its Monte Carlo part: say so
        return [Claim(claim="GRPO's uniform credit matches Monte Carlo token credit", scope="not measured",
                      measurement="no Monte Carlo rollouts (--mc-groups 0, the probe's default)",
                      control=f"{MC_NOISE_DISAGREE} (false-disagreement rate of the 2-SE test)",
                      verdict=INCONCLUSIVE, rule=f"not run: --mc-groups 4 gives the {MIN_UNITS} rollouts a verdict "
                                                 f"needs", source="Monte Carlo continuations from prefixes")]
    mc = credit["monte_carlo"]
    seg = mc.get("segments") or {}
    k, n = int(seg.get("disagree", 0)), int(seg.get("total", 0))
    lo, hi = wilson_interval(k, n)
    resolved = k + int(seg.get("agree", 0))
    r_lo, _ = wilson_interval(resolved, n)
    rollouts = len(mc["rollouts"])
    verdict = verdict_from_interval(lo, hi, MC_NOISE_DISAGREE, "below") if n else INCONCLUSIVE
    why = f"Wilson interval of the disagreeing share vs {MC_NOISE_DISAGREE}"
    if rollouts < MIN_UNITS:
        verdict, why = INCONCLUSIVE, f"{rollouts} rollouts < {MIN_UNITS}"
    elif verdict == HOLDS and not r_lo > MC_MIN_RESOLVED:
        verdict, why = INCONCLUSIVE, (f"no disagreement, but only {resolved} of {n} segments signed beyond 2 SE "
                                      f"(interval not above {MC_MIN_RESOLVED}): the test had no power")
    return [Claim(claim="GRPO's uniform credit matches Monte Carlo token credit",
                  scope=f"{len(mc['rollouts'])} rollouts, {n} segments, K = {mc['samples_per_prefix']}",
                  measurement=(f"segments opposing A_i beyond 2 SE: {k} of {n} ({_fmt(k / n if n else None)} "
                               f"[{_fmt(lo)}, {_fmt(hi)}], Wilson interval over segments); "
                               f"agreeing beyond 2 SE: {seg.get('agree', 0)} of {n}"),
                  control=f"{MC_NOISE_DISAGREE} (false-disagreement rate of the 2-SE test)", verdict=verdict,
                  rule=why, source="Monte Carlo continuations from prefixes")]


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial share (Wilson, JASA 22 (1927)); (nan, nan) for n = 0."""
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


#: the level of each prompt's m_C = m_W permutation test: the most it rejects when m_C = m_W everywhere
EQUAL_NORMS_LEVEL = 0.05
#: equivalence margins of "the group mean is optimal" (set before any measurement, docs/theory.md §12): at most this
#: share of prompts with m_C != m_W ...
EQUAL_NORMS_MAX_SHARE = 0.25
#: ... and population b* at most this much below RLOO's MSE (relative)
MSE_GAIN_MARGIN = 0.10


@CLAIMS.register("group_mean_optimal")
def group_mean_optimal(probe: dict[str, Any]) -> list[Claim]:
    """"The group mean is the variance-optimal baseline when m_C = m_W": does m_C = m_W hold prompt by prompt, and
    does b* measurably beat the group mean (as RLOO) where it does not?

    Rule (docs/theory.md §12): q = share of testable prompts whose permutation test rejects m_C = m_W at 0.05
    (:func:`grpo_lens.diagnostics.baseline_study.equal_norms_test`), with its Wilson interval; control
    :data:`EQUAL_NORMS_LEVEL` (the most the tests reject when m_C = m_W everywhere). An equivalence rule, so that a
    study too small to see a difference cannot make the claim hold: holds when q's interval lies below
    :data:`EQUAL_NORMS_MAX_SHARE` and the population b*'s MSE ratio to RLOO has its interval above 1 -
    :data:`MSE_GAIN_MARGIN` (b* gains less than that); does not hold when q's interval lies above the control and
    the MSE ratio's interval lies below 1 (b* measurably helps); inconclusive otherwise, and with fewer than MIN_UNITS
    testable prompts. The mean m_C / m_W over prompts is reported, not used: prompts with m_C > m_W and m_C < m_W
    cancel in it.
    """
    study = ((probe.get("studies") or {}).get("baselines") or {}).get("baselines")
    if not study:
        return []
    ratio = study.get("norm_ratio") or {}
    mse = study["summary"].get("optimal_pop", {}).get("mse_ratio_to_rloo", {})
    n = int(study.get("equal_norms_testable") or 0)
    q = study.get("equal_norms_rejected")
    k = round(q * n) if q is not None and math.isfinite(q) else 0
    q_lo, q_hi = wilson_interval(k, n)
    mse_v = verdict_from_interval(mse.get("lo"), mse.get("hi"), 1.0, "below")
    if n < MIN_UNITS or not math.isfinite(q_lo):
        verdict, why = INCONCLUSIVE, f"{n} testable prompts < {MIN_UNITS}"
    elif q_hi < EQUAL_NORMS_MAX_SHARE and mse.get("lo") is not None and mse["lo"] > 1 - MSE_GAIN_MARGIN:
        verdict, why = HOLDS, (f"rejection share below {EQUAL_NORMS_MAX_SHARE} and b*'s MSE gain below "
                               f"{MSE_GAIN_MARGIN:.0%} (equivalence)")
    elif q_lo > EQUAL_NORMS_LEVEL and mse_v == HOLDS:
        verdict, why = DOES_NOT_HOLD, ("m_C != m_W in more prompts than the tests' level and b*'s MSE interval lies "
                                       "below RLOO's")
    else:
        verdict, why = INCONCLUSIVE, "the rejection share and the MSE gain do not agree on a verdict"
    meta = probe["studies"]["baselines"].get("meta", {})
    share = (f"{_fmt(q, 2)} [{_fmt(q_lo, 2)}, {_fmt(q_hi, 2)}], Wilson interval over prompts" if n >= MIN_UNITS else
             "too few prompts for an interval")
    return [Claim(claim="the group mean is the variance-optimal baseline (m_C = m_W)",
                  scope=f"R = {meta.get('group_size')}, {study['prompts']} prompts",
                  measurement=(f"m_C = m_W rejected (permutation test, 0.05) on {k} of {n} prompts ({share}); "
                               f"mean m_C / m_W {_ci(ratio, unit='prompts')}; "
                               f"population b* MSE / RLOO's {_ci(mse, unit='prompts')}"),
                  control=(f"rejection share <= {EQUAL_NORMS_LEVEL} (m_C = m_W everywhere; equivalence below "
                           f"{EQUAL_NORMS_MAX_SHARE}); MSE ratio 1 (equivalence above {1 - MSE_GAIN_MARGIN:g})"),
                  verdict=verdict, rule=why,
                  source=f"{meta.get('gradients', 'sketch')}, k = {meta.get('sketch_dim')}, held-out reference")]
