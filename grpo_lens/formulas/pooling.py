"""Pooling units (groups, prompts, rollouts) measured in several runs that differ only in their seed
(docs/seeds.md; intervals as in docs/theory.md §7): the run (seed) is a stratum, its units a sample drawn
within it.

- :func:`stratified_interval`: the stratified mean and its interval from per-stratum values (Cochran 1977, §5.3 with
  Satterthwaite's degrees of freedom, §5.4).
- :func:`combine_summaries`: the same from per-stratum summaries {mean, lo, hi, n} alone, when the units were not kept.
- :func:`between_seed_spread`: the per-seed means, their SD and range, and Cochran's Q test of "the seeds measure one
  mean" (Cochran, Biometrics 10, 1954).

Symbols: H strata (seeds), n_h units in stratum h, N = Σ_h n_h, x̄_h and s_h² the stratum's mean and sample variance
(ddof 1). Pure functions of numbers: no file, no model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS, check_side, finite_values, student_t_cdf, student_t_quantile


def _no_interval(mean: float | None, n: int, strata: int) -> dict[str, Any]:
    return {"mean": mean, "lo": None, "hi": None, "n": n, "strata": strata}


def stratified_interval(values_by_stratum: Sequence[Sequence[float | None]], *, level: float = 0.95) -> dict[str, Any]:
    """Mean of a stratified sample with its t interval, each stratum weighted by its share of the units.

    With proportional weights W_h = n_h / N the stratified mean Σ_h W_h x̄_h equals the pooled mean, and (Cochran,
    *Sampling Techniques*, 3rd ed. 1977, eq. 5.6, draws with replacement)

        SE² = Σ_h W_h² s_h² / n_h,   df = (Σ_h a_h)² / Σ_h a_h² / (n_h − 1),   a_h = W_h² s_h² / n_h

    (Satterthwaite's effective degrees of freedom, Cochran §5.4 eq. 5.16; df = N − H when the s_h are equal and the
    n_h too), interval x̄ ± t_df(1 − (1 − level)/2) SE. Unlike the interval over the pooled units, the spread between
    the strata's means does not enter SE: the seed is a stratum of the design, not a source of noise in the mean.
    Non-finite values and None are dropped first.

    Args:
        values_by_stratum: H lists of per-unit values (one per seed).
        level: two-sided coverage in (0, 1).

    Returns:
        {"mean", "lo", "hi", "n": N, "strata": H non-empty strata}: mean None for N = 0; lo = hi = None when
        N < :data:`grpo_lens.formulas.stats.MIN_INTERVAL_UNITS` or a non-empty stratum has fewer than 2 values (no
        variance to estimate in it).

    Raises:
        ValueError: level outside (0, 1).
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    strata = [xs for xs in (finite_values(v) for v in values_by_stratum) if xs]
    N = sum(len(xs) for xs in strata)
    if N == 0:
        return _no_interval(None, 0, 0)
    mean = math.fsum(math.fsum(xs) for xs in strata) / N  # = Σ_h W_h x̄_h
    if N < MIN_INTERVAL_UNITS or any(len(xs) < 2 for xs in strata):
        return _no_interval(mean, N, len(strata))
    a = []
    for xs in strata:
        n_h = len(xs)
        m_h = math.fsum(xs) / n_h
        s2 = math.fsum((x - m_h) ** 2 for x in xs) / (n_h - 1)
        a.append((n_h / N) ** 2 * s2 / n_h)
    se2 = math.fsum(a)
    if se2 == 0:
        return {"mean": mean, "lo": mean, "hi": mean, "n": N, "strata": len(strata)}
    df = se2**2 / math.fsum(a_h**2 / (len(xs) - 1) for a_h, xs in zip(a, strata))
    df_used = max(1, math.floor(df + 1e-9))  # the floor is conservative; 1e-9 absorbs rounding (14 - 1e-15)
    half = student_t_quantile(1 - (1 - level) / 2, df_used) * math.sqrt(se2)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": N, "strata": len(strata)}


def combine_summaries(
    summaries: Sequence[dict[str, Any] | None], *, level: float = 0.95, bounds: tuple[float, float] | None = None
) -> dict[str, Any]:
    """The stratified mean and interval from per-stratum summaries {mean, lo, hi, n} when the units themselves were
    not kept (:func:`stratified_interval` needs them): W_h = n_h / N, SE_h read back from the stratum's 95% interval
    as (hi − lo) / (2 t_{n_h − 1}) (exact for a symmetric t interval; Hall's interval is widened on its skewed side,
    so this is its mean half-width), SE² = Σ W_h² SE_h², df = N − H.

    Args:
        summaries: one per stratum; None or an entry without a mean is left out.
        bounds: the range the mean cannot leave (e.g. (0, 1) for a share); the interval is clipped to it.

    Returns:
        {"mean", "lo", "hi", "n": N, "strata": H}: lo = hi = None when a stratum has no interval or N <
        :data:`grpo_lens.formulas.stats.MIN_INTERVAL_UNITS`.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    used = [s for s in summaries if s and s.get("mean") is not None and int(s.get("n") or 0) > 0]
    N = sum(int(s["n"]) for s in used)
    if N == 0:
        return _no_interval(None, 0, 0)
    mean = math.fsum(int(s["n"]) * float(s["mean"]) for s in used) / N
    if N < MIN_INTERVAL_UNITS or any(s.get("lo") is None or s.get("hi") is None or int(s["n"]) < 2 for s in used):
        return _no_interval(mean, N, len(used))
    q = 1 - (1 - level) / 2
    se2 = math.fsum(
        (int(s["n"]) / N) ** 2 * ((float(s["hi"]) - float(s["lo"])) / (2 * student_t_quantile(q, int(s["n"]) - 1))) ** 2
        for s in used
    )
    half = student_t_quantile(q, max(1, N - len(used))) * math.sqrt(se2)
    lo, hi = mean - half, mean + half
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return {"mean": mean, "lo": lo, "hi": hi, "n": N, "strata": len(used)}


def chi2_sf(x: float, df: int) -> float:
    """P(χ²_df >= x): the regularised upper incomplete gamma Q(df/2, x/2) (torch.special.gammaincc)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if x <= 0:
        return 1.0
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64))
    )


def between_seed_spread(values_by_seed: Sequence[Sequence[float | None]]) -> dict[str, Any]:
    """How far apart the seeds' means of one key are, against what their within-run noise alone gives.

    Per seed h: x̄_h and SE_h = s_h / √n_h. Between seeds: the SD of the x̄_h (ddof 1), their range, and Cochran's Q
    (Biometrics 10, 1954) Q = Σ_h w_h (x̄_h − x̄_w)², w_h = 1 / SE_h², x̄_w = Σ w_h x̄_h / Σ w_h, with its p-value
    P(χ²_{H−1} >= Q): small p = the seeds differ by more than their within-run intervals allow (the pooled interval
    then understates the uncertainty of a rerun).

    Args:
        values_by_seed: H lists of per-unit values, one per seed (empty for a seed without the key).

    Returns:
        {"per_seed": [x̄_h or None], "n": [n_h], "se": [SE_h or None], "sd": SD of the x̄_h (None below two seeds),
        "min", "max", "q", "p"}: q and p None below two seeds with n_h >= 2 or when an SE_h is 0.
    """
    means, ns, ses = [], [], []
    for v in values_by_seed:
        xs = finite_values(v)
        n = len(xs)
        m = math.fsum(xs) / n if n else None
        # n >= 2: m is a float
        se = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1) / n) if n >= 2 else None  # type: ignore[operator]
        means.append(m)
        ns.append(n)
        ses.append(se)
    have = [m for m in means if m is not None]
    out: dict[str, Any] = {
        "per_seed": means,
        "n": ns,
        "se": ses,
        "sd": None,
        "min": min(have, default=None),
        "max": max(have, default=None),
        "q": None,
        "p": None,
    }
    if len(have) >= 2:
        mu = math.fsum(have) / len(have)
        out["sd"] = math.sqrt(math.fsum((m - mu) ** 2 for m in have) / (len(have) - 1))
    pairs = [(m, se) for m, se in zip(means, ses) if m is not None and se is not None]
    if len(pairs) >= 2 and all(se > 0 for _, se in pairs):
        w = [1 / se**2 for _, se in pairs]
        mw = math.fsum(wi * m for wi, (m, _) in zip(w, pairs)) / math.fsum(w)
        out["q"] = math.fsum(wi * (m - mw) ** 2 for wi, (m, _) in zip(w, pairs))
        out["p"] = chi2_sf(out["q"], len(pairs) - 1)
    return out


def _mean_and_se(b: list[float]) -> tuple[float, float]:
    """The mean over k >= 2 seeds of a per-seed number and its standard error s_b / √k (s_b with k − 1 degrees of
    freedom). b: [k] -> (mean, se)."""
    k = len(b)
    mean = math.fsum(b) / k
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in b) / (k - 1) / k)


def seed_slope_test(slopes: Sequence[float | None]) -> dict[str, Any]:
    """A trend over training pooled over seeds: each seed's OLS slope (:func:`grpo_lens.formulas.stats.ols_trend`)
    is one independent unit, and the one-sample t-test over seeds asks whether their mean is above or below 0.

    Seeds are independent runs, so whatever the within-run autocorrelation (AR(1) steps, a random walk) each slope is
    unbiased for the run's trend and the slopes are i.i.d. across seeds; their t over seeds, t = b̄ / (s_b/√k) with
    k − 1 degrees of freedom, is exact for normal slopes (a slope is a weighted sum of many steps: close to normal)
    and needs no model of the noise. A transient common to every seed (LR warm-up) is a trend to this test: the
    claims drop the warm-up steps before the slopes are taken.

    Args:
        slopes: [k] one slope per seed; None (no slope) and non-finite dropped.

    Returns:
        {"slope" (mean slope), "se", "t", "df" (k − 1), "p_up" (one-sided p of mean slope > 0), "p_down", "k",
        "per_seed" (the slopes used)}; t/se None and p 1.0 below two slopes; a zero spread gives p 0 on the side the
        mean lies on.
    """
    b = finite_values(slopes)
    k = len(b)
    out: dict[str, Any] = {"slope": None, "se": None, "t": None, "df": max(k - 1, 0), "p_up": 1.0, "p_down": 1.0}
    out.update(k=k, per_seed=b)
    if k < 2:
        return out
    mean, se = _mean_and_se(b)
    if se == 0:
        return {**out, "slope": mean, "se": 0.0, "p_up": float(mean <= 0), "p_down": float(mean >= 0)}
    t = mean / se
    p_up = 1 - student_t_cdf(t, k - 1)
    return {**out, "slope": mean, "se": se, "t": t, "p_up": p_up, "p_down": 1 - p_up}


def seed_mean_test(values: Sequence[float | None], control: float, side: str) -> float:
    """One-sided p of "the mean over seeds of a per-seed number lies ``side`` ("above" / "below") ``control``": the
    one-sample t over seeds (k − 1 degrees of freedom), each seed one independent unit. 1.0 below two values; a zero
    spread gives 0 on the side the mean lies on, 1 otherwise.

    Raises:
        ValueError: an unknown side.
    """
    check_side(side)
    b = finite_values(values)
    k = len(b)
    if k < 2:
        return 1.0
    mean, se = _mean_and_se(b)
    d = mean - control if side == "above" else control - mean
    if se == 0:
        return 0.0 if d > 0 else 1.0
    return 1 - student_t_cdf(d / se, k - 1)
