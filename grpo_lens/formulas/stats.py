"""Uncertainty over groups and prompts: intervals, per-key summaries, strata and trend tests (docs/theory.md §7).

A "row" is the dict of canonical keys that :func:`grpo_lens.analysis.group.analyse_group` returns for one group
(float values; a missing key means "not measured for this group"). The probe and the lens only aggregate rows:

- :func:`mean_interval`: the mean with Hall's transformed-t interval (Hall 1992), none below
  :data:`MIN_INTERVAL_UNITS` units, optionally clipped to bounds.
- :func:`summarise_rows`, :func:`stratify_rows`: {key: interval} over rows, and per stratum (k, distinct completions).
- :func:`spearman_trend` (permutation test of a monotone trend), :func:`wilson_interval` (a binomial share),
  :func:`binomial_pmf`, :func:`binomial_upper_tail` (the exact p-value of a count),
  :func:`stratified_mean_se` (a weighted mean from a stratified sample), :func:`student_t_quantile`;
  :func:`trend_windows`: the first and last thirds a trend's measurement compares.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch


def finite_values(values: Iterable[Any]) -> list[float]:
    """The values as floats, None and non-finite ones (NaN, +-inf) dropped, order kept: [n] -> [m], m <= n."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def student_t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t with ``df`` degrees of freedom: exact for df = 1, 2; otherwise the Cornish-Fisher
    expansion in 1/df (Abramowitz & Stegun 26.7.5; error < 1e-3 for df >= 3 at p = 0.975)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = float(torch.special.ndtri(torch.tensor(p, dtype=torch.float64)))
    v = float(df)
    return (
        z
        + (z**3 + z) / (4 * v)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4)
    )


#: fewest units (groups, prompts, rollouts) any reported interval is computed from -- the one rule every interval in
#: probe.json and the reports follows (docs/theory.md §7). With 2 values every resample with a spread is the pair
#: itself and the interval collapses to the data's range; with a handful the quantiles come from a few distinct means.
MIN_INTERVAL_UNITS = 8


def trend_windows(n: int) -> tuple[slice, slice]:
    """The first and the last third of ``n`` ordered values (steps), at least one value each: the windows whose means
    a trend's measurement prints beside its test (S1 over training: the claim ``zero_variance_share_rises`` and the
    report's finding read these same slices, so the two cannot disagree).

    Returns:
        (first, last): slices of length max(n // 3, 1); they overlap only when n < 2.

    Raises:
        ValueError: n < 1.
    """
    if n < 1:
        raise ValueError(f"trend_windows needs at least one value, got n = {n}")
    third = max(n // 3, 1)
    return slice(0, third), slice(n - third, n)


def has_interval(n: int) -> bool:
    """Whether ``n`` units are enough for an interval (n >= :data:`MIN_INTERVAL_UNITS`)."""
    return n >= MIN_INTERVAL_UNITS


def mean_interval(
    values: Sequence[float | None], *, level: float = 0.95, bounds: tuple[float, float] | None = None
) -> dict[str, float | int | None]:
    """Mean of ``values`` with Hall's transformed-t interval (docs/theory.md §7): the one interval body of the product.

    With n values, mean x̄, s their ddof-1 SD, m_k = mean((x - x̄)^k), γ = m_3 / m_2^(3/2) · √(n(n-1)) / (n-2) (G1,
    the adjusted sample skewness: Joanes & Gill, *The Statistician* 47, 1998), a = γ / (3√n), b = γ / (6√n) and
    t = t_{n-1}(1 - (1 - level)/2), the interval is

        [x̄ - h⁻¹(t) s/√n,  x̄ - h⁻¹(-t) s/√n],   h⁻¹(y) = ((1 + 3a(y - b))^(1/3) - 1) / a   (y - b when a = 0)

    (Hall, "On the removal of skewness by transformation", JRSS B 54, 1992, eq. 2.3; recommended for skewed means by
    Zhou & Dinh, Biostatistics 6, 2005). h(T) = T + a T² + a² T³/3 + b removes the skewness term of the Edgeworth
    expansion of the studentized mean, so the interval widens on the side of the longer tail. Closed form: no
    resamples, deterministic; equal to the Student t interval on symmetric data (γ = 0). Chosen by coverage at
    nominal 0.95 over the nine cells of `grpo-lens calibrate` (normal, log-normal σ = 1, 60%-zero data at n = 8, 22,
    34; 2000 trials each): the lowest cell 0.909 (log-normal, n = 8; none of the methods tried reaches
    0.93 there), against 0.892 with the plain sample skewness m_3 / s³, 0.841 Student t, 0.798 bootstrap-t, 0.775
    percentile bootstrap, 0.757 BCa (999 resamples). Its price on normal data: 21% wider than Student t at n = 8
    (mean width 1.97 against 1.63 SD), 1% at n = 22 and 34. docs/calibration.md reprints the coverage. Non-finite
    values and None are dropped first.

    .. warning:: a constant sample (s = 0) gives the zero-width interval [x̄, x̄]: there is no spread to estimate.

    Args:
        values: [n] per-unit numbers (groups, prompts, steps).
        level: two-sided coverage in (0, 1).
        bounds: the range the mean cannot leave (e.g. (0, 1) for a share); the interval is clipped to it.

    Returns:
        {"mean", "lo", "hi", "n"}: mean None for n = 0; lo = hi = None for n < :data:`MIN_INTERVAL_UNITS`.

    Raises:
        ValueError: level outside (0, 1).
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    xs = finite_values(values)
    n = len(xs)
    if n == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    mean = math.fsum(xs) / n
    if not has_interval(n):
        return {"mean": mean, "lo": None, "hi": None, "n": n}
    d = [x - mean for x in xs]
    sd = math.sqrt(math.fsum(v * v for v in d) / (n - 1))
    se = sd / math.sqrt(n)
    m2 = math.fsum(v * v for v in d) / n
    g1 = math.fsum(v**3 for v in d) / n / m2**1.5 if m2 > 0 else 0.0
    gamma = g1 * math.sqrt(n * (n - 1)) / (n - 2)  # G1, the adjusted sample skewness (Joanes & Gill 1998)
    a, b = gamma / (3 * math.sqrt(n)), gamma / (6 * math.sqrt(n))
    t = student_t_quantile(1 - (1 - level) / 2, n - 1)

    def h_inv(y: float) -> float:
        if abs(a) < 1e-12:
            return y - b
        u = 1 + 3 * a * (y - b)
        return (math.copysign(abs(u) ** (1 / 3), u) - 1) / a

    lo, hi = mean - h_inv(t) * se, mean - h_inv(-t) * se
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return {"mean": mean, "lo": min(lo, mean), "hi": max(hi, mean), "n": n}


def summarise_rows(
    rows: Sequence[dict[str, float]],
    *,
    keys: Sequence[str] | None = None,
    level: float = 0.95,
    num_resamples: int = 2000,
    seed: int = 0,
) -> dict[str, dict[str, float | int | None]]:
    """{key: mean_interval(values of key over the rows that have it)} for every key (or the given ones).

    Args:
        rows: per-group rows of canonical keys.
        keys: the keys to summarise; None = every key that any row has (sorted).
        level: the interval's coverage, in (0, 1).
        num_resamples: checked (>= 100) and otherwise unused: the interval is closed form.
        seed: unused: the interval is closed form.

    Raises:
        ValueError: level outside (0, 1) or num_resamples < 100.
    """
    if num_resamples < 100:
        raise ValueError(f"num_resamples must be >= 100, got {num_resamples}")
    if keys is None:
        keys = sorted({k for row in rows for k in row})
    return {k: mean_interval([row.get(k) for row in rows], level=level) for k in keys}


def stratify_rows(
    rows: Sequence[dict[str, float]], by: str, **summary_kwargs: Any
) -> dict[str, dict[str, dict[str, float | int | None]]]:
    """Summaries per stratum: {str(int(row[by])): summarise_rows(rows of that stratum)}; rows without ``by`` are left
    out. Used with ``by="group/correct"`` (k) and ``by="group/distinct_completions"``.
    """
    strata: dict[str, list[dict[str, float]]] = {}
    for row in rows:
        v = row.get(by)
        if v is None or not math.isfinite(float(v)):
            continue
        strata.setdefault(str(int(v)), []).append(row)
    return {s: summarise_rows(strata[s], **summary_kwargs) for s in sorted(strata, key=int)}


def spearman_trend(
    xs: Sequence[float], ys: Sequence[float], num_perm: int = 5000, seed: int = 0
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
    gen = torch.Generator().manual_seed(seed)
    a = torch.tensor(rx, dtype=torch.float64)
    a = a - a.mean()
    b = torch.tensor(ry, dtype=torch.float64)[torch.rand(num_perm, n, generator=gen).argsort(1)]  # [num_perm, n]
    b = b - b.mean(1, keepdim=True)
    den = (a.square().sum() * b.square().sum(1)).sqrt()
    rhos = torch.where(den > 0, (b @ a) / den.clamp(min=1e-300), torch.zeros_like(den))
    hits = int((rhos.abs() >= abs(r0) - 1e-12).sum())
    return r0, (1 + hits) / (1 + num_perm)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial share (Wilson, JASA 22 (1927)); (nan, nan) for n = 0."""
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def binomial_pmf(n: int, p: float) -> list[float]:
    """[P(Binomial(n, p) = x) for x = 0..n], exactly (n + 1 terms)."""
    return [math.comb(n, x) * p**x * (1 - p) ** (n - x) for x in range(n + 1)]


def binomial_upper_tail(c: int, n: int, p: float) -> float:
    """P(Binomial(n, p) >= c), exactly (a sum of n - c + 1 terms); 1 for c <= 0. A count of n independent events, each
    with probability at most p, exceeds c with at most this probability (stochastic order), so it is the exact one-sided
    p-value of the count c against the bound p.

    Raises:
        ValueError: n < 0 or p outside [0, 1].
    """
    if n < 0 or not 0 <= p <= 1:
        raise ValueError(f"need n >= 0 and p in [0, 1], got n = {n}, p = {p}")
    if c <= 0:
        return 1.0
    return min(1.0, math.fsum(binomial_pmf(n, p)[c:]))


def stratified_mean_se(values: torch.Tensor, weights: torch.Tensor, strata: torch.Tensor) -> float:
    """Standard error of the weighted mean Σ w x / Σ w of a stratified sample (Cochran, *Sampling Techniques*, 3rd ed.
    1977, §5.3, eq. 5.6 without the finite-population factor, i.e. draws with replacement).

    Stratum h has s_h sampled entries, each with the same weight w_h = n_h / s_h (n_h entries in the stratum), so the
    mean is Σ_h (n_h / N) x̄_h with N = Σ_h n_h, and

        SE² = Σ_h (n_h / N)² · var_h(x) / s_h,

    var_h the sample variance (ddof 1) of the stratum's x. A stratum with weight 1 was enumerated whole (s_h = n_h):
    it adds no sampling variance. This is what a simple-random-sample SE √(q(1−q)/s) gets wrong when strata differ:
    strata that are all 0 or all 1 add nothing, and a small stratum sampled at a high rate counts less than its s_h.

    Args:
        values: [S] float, the sampled values (0/1 indicators for a share).
        weights: [S] > 0, entries each sample stands for (constant within a stratum).
        strata: [S] long, the stratum (e.g. tensor) of each sample.

    Returns:
        float >= 0 (0 for an empty sample).

    Raises:
        ValueError: mismatched shapes, or weights that vary within a stratum.
    """
    x, w, h = values.detach().double().reshape(-1), weights.detach().double().reshape(-1), strata.reshape(-1).long()
    if not (x.shape == w.shape == h.shape):
        raise ValueError(f"values, weights and strata must have one shape, got {x.shape}, {w.shape}, {h.shape}")
    if x.numel() == 0:
        return 0.0
    # compact stratum ids 0..k-1 in ascending order; strata already sorted (a flattened sample, tensor by tensor)
    # need no sort: unique_consecutive gives the same ids
    ordered = bool((h[1:] >= h[:-1]).all())
    _, h = torch.unique_consecutive(h, return_inverse=True) if ordered else torch.unique(h, return_inverse=True)
    k = int(h.max()) + 1
    s = torch.bincount(h, minlength=k).double()
    wh = torch.zeros(k, dtype=torch.float64).scatter_reduce(0, h, w, "amax", include_self=False)
    if not torch.allclose(wh[h], w, rtol=1e-9, atol=0.0):
        raise ValueError("weights must be constant within a stratum (n_h / s_h)")
    sx = torch.bincount(h, x, minlength=k)
    sxx = torch.bincount(h, x * x, minlength=k)
    mean = sx / s
    var = ((sxx - s * mean.square()) / (s - 1).clamp(min=1)).clamp(min=0)
    n_h = wh * s
    sampled = wh > 1 + 1e-12  # weight 1: the stratum was taken whole
    var2 = torch.where(sampled, (n_h / n_h.sum()).square() * var / s, torch.zeros_like(var))
    return math.sqrt(float(var2.sum()))


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz; Press et al., Numerical
    Recipes, 3rd ed. 2007, §6.4)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for x in [0, 1] and a, b > 0 (Numerical Recipes §6.4:
    the continued fraction on the side where it converges fast)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom, exactly: P(|T| > |x|) = I_{df/(df + x²)}(df/2, 1/2)
    (Abramowitz & Stegun 26.7.1 with 26.5.27), by :func:`regularized_beta`. 0.5 at x = 0.

    Raises:
        ValueError: df < 1.
    """
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if math.isnan(x):
        return math.nan
    if math.isinf(x):
        return 0.0 if x < 0 else 1.0
    tail = 0.5 * regularized_beta(df / (df + x * x), df / 2.0, 0.5)
    return tail if x < 0 else 1.0 - tail


def normal_upper_tail(z: float) -> float:
    """P(Z >= z) for a standard normal Z (erfc form, exact to float precision)."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def check_side(side: str) -> None:
    """The one-sided tests' ``side`` check: "above" or "below".

    Raises:
        ValueError: an unknown side, listing the valid ones.
    """
    if side not in ("above", "below"):
        raise ValueError(f"unknown side {side!r}; valid: above, below")


def interval_t_p(
    mean: float | None, lo: float | None, hi: float | None, n: int, control: float, side: str, level: float = 0.95
) -> float:
    """One-sided p of a mean against ``control`` from its t-based interval at ``level`` over ``n`` units, by the t
    distribution the interval was built with (not the normal): se = (half-width on ``side``) / t_{n−1}(1 − (1 −
    level)/2), T = (mean − control)/se, p_above = P(t_{n−1} >= T), p_below = P(t_{n−1} <= T). On a Student-t
    interval this is the one-sample t-test's p exactly (up to :func:`student_t_quantile`'s 1e-3); the normal reading
    of the same interval (se = half / 1.96, p = P(Z >= T)) is too small at small n (n = 12, T = 2√3 = 3.46: 0.00027
    against the t-test's 0.0026). On a Hall interval (:func:`mean_interval`) the half-width on ``side``
    carries its skewness.

    Args:
        mean: the mean.
        lo: its interval's lower end (None: no interval).
        hi: its interval's upper end (None: no interval).
        n: units, >= 2.
        control: c.
        side: "above" (p of mean > c) or "below".  level: the interval's two-sided coverage.

    Returns:
        p in [0, 1]; 1.0 without an interval or with n < 2; a zero-width interval gives 0 on the side its mean lies
        on, 1 otherwise.

    Raises:
        ValueError: an unknown side.
    """
    check_side(side)
    if mean is None or lo is None or hi is None or n < 2:
        return 1.0
    if not all(math.isfinite(v) for v in (mean, lo, hi)):
        return 1.0
    half = (mean - lo) if side == "above" else (hi - mean)
    if half <= 0:
        return 0.0 if (mean > control if side == "above" else mean < control) else 1.0
    se = half / student_t_quantile(1 - (1 - level) / 2, n - 1)
    upper = 1 - student_t_cdf((mean - control) / se, n - 1)
    return upper if side == "above" else 1 - upper


def mean_test_p(values: Sequence[float], control: float, side: str) -> float:
    """One-sided p-value of Hall's transformed t-statistic for the mean of ``values`` against ``control``: the test
    whose rejection at level α is exactly "the :func:`mean_interval` at level 1 − 2α lies above (``side="above"``) or
    below (``"below"``) the control" (docs/theory.md §7, §11).

    With T = (x̄ − c)/(s/√n) and h(T) = T + aT² + a²T³/3 + b (Hall 1992, eq. 2.3; a, b as in :func:`mean_interval`),
    h is non-decreasing (h' = (1 + aT)² >= 0), so lo > c ⟺ h(T) > t_{1−α} and p_above = P(t_{n−1} >= h(T)),
    p_below = P(t_{n−1} <= h(T)). A constant sample (s = 0) gives p = 0 on the side its mean lies on, 1 otherwise.

    Args:
        values: [n] per-unit numbers; None and non-finite dropped.  control: c.  side: "above" or "below".

    Returns:
        p in [0, 1]; 1.0 with fewer than :data:`MIN_INTERVAL_UNITS` values (no interval, no test).

    Raises:
        ValueError: an unknown side.
    """
    check_side(side)
    xs = finite_values(values)
    n = len(xs)
    if not has_interval(n):
        return 1.0
    mean = math.fsum(xs) / n
    d = [x - mean for x in xs]
    m2 = math.fsum(v * v for v in d) / n
    sd = math.sqrt(math.fsum(v * v for v in d) / (n - 1))
    if sd == 0:
        return 0.0 if (mean > control if side == "above" else mean < control) else 1.0
    g1 = math.fsum(v**3 for v in d) / n / m2**1.5
    gamma = g1 * math.sqrt(n * (n - 1)) / (n - 2)
    a, b = gamma / (3 * math.sqrt(n)), gamma / (6 * math.sqrt(n))
    t = (mean - control) / (sd / math.sqrt(n))
    h = t + a * t * t + a * a * t**3 / 3 + b
    upper = 1 - student_t_cdf(h, n - 1)
    return upper if side == "above" else 1 - upper


def difference_trend_test(
    xs: Sequence[float], ys: Sequence[float], covariate: Sequence[float] | None = None
) -> dict[str, float | int | None]:
    """A trend test that keeps its level when consecutive points are correlated: the slope of ys over xs estimated
    from first differences (docs/theory.md §12).

    Model y_t = α + β x_t + γ c_t + u_t with u_t stationary and positively autocorrelated (AR(1), φ in [0, 1)) or a
    random walk. Differencing, Δy_t = β Δx_t + γ Δc_t + Δu_t, and OLS of Δy on Δx (and Δc, when given and not
    constant) without intercept; the t-statistic of β with df = (points − 1) − regressors. For AR(1) errors the
    differences have autocorrelations −(1 − φ)φ^(j−1)/2 <= 0 at every lag j (a random walk: 0), so the OLS variance
    over-states the estimate's variance and the test is conservative at every φ in [0, 1]; the price is power under
    independent noise (the differences double the noise). This is the first-difference estimator of Granger &
    Newbold (J. Econometrics 2, 1974) used as a test; a Spearman or OLS trend test with i.i.d. errors rejects at
    0.12–0.26 when lens steps are correlated 0.6–1. ``covariate`` (e.g. the log of the mixed-group count)
    is partialled out, so a trend it produces is not read as one in y.

    Args:
        xs: [n] positions (steps), strictly increasing.  ys: [n] values.  covariate: [n] or None.

    Returns:
        {"slope", "t", "df", "p_up" (one-sided p of β > 0), "p_down" (β < 0), "n"}; slope/t None and p 1.0 when
        df < 1 or the differences carry no variation.
    """
    n = len(xs)
    out: dict[str, float | int | None] = {"slope": None, "t": None, "df": 0, "p_up": 1.0, "p_down": 1.0, "n": n}
    if n < 3 or len(ys) != n:
        return out
    dx = [xs[i + 1] - xs[i] for i in range(n - 1)]
    dy = [ys[i + 1] - ys[i] for i in range(n - 1)]
    cols = [dx]
    if covariate is not None:
        dc = [covariate[i + 1] - covariate[i] for i in range(n - 1)]
        if any(abs(v) > 1e-12 for v in dc):
            cols.append(dc)
    x = torch.tensor(cols, dtype=torch.float64).T  # [n - 1, q]
    y = torch.tensor(dy, dtype=torch.float64)
    df = (n - 1) - x.shape[1]
    if df < 1:
        return out
    xtx = x.T @ x
    if float(torch.linalg.det(xtx)) <= 1e-12 * float(xtx.diagonal().prod()):
        return out
    inv = torch.linalg.inv(xtx)
    beta = inv @ (x.T @ y)
    resid = y - x @ beta
    s2 = float(resid.square().sum()) / df
    se = math.sqrt(max(s2 * float(inv[0, 0]), 0.0))
    slope = float(beta[0])
    if se == 0:
        return {**out, "slope": slope, "df": df, "p_up": 0.0 if slope > 0 else 1.0, "p_down": 0.0 if slope < 0 else 1.0}
    t = slope / se
    p_up = 1 - student_t_cdf(t, df)
    return {**out, "slope": slope, "t": t, "df": df, "p_up": p_up, "p_down": 1 - p_up}


def holm(p_values: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down procedure (Holm, Scand. J. Statist. 6, 1979): which of the m hypotheses are rejected with
    family-wise error at most ``alpha`` under any dependence. Sorted ascending, p_(i) is rejected while
    p_(j) <= alpha / (m − j + 1) for every j <= i.

    Args:
        p_values: [m] p-values (NaN counts as 1).

    Returns:
        [m] bool in the input's order.
    """
    ps = [p if isinstance(p, (int, float)) and math.isfinite(p) else 1.0 for p in p_values]
    m = len(ps)
    out = [False] * m
    for rank, i in enumerate(sorted(range(m), key=lambda j: ps[j])):
        if ps[i] > alpha / (m - rank):
            break
        out[i] = True
    return out


# ---------------------------------------------------------------------------------------------------------------------
# trends over training: the OLS slope, its fixed-b HAC test within one run
# ---------------------------------------------------------------------------------------------------------------------
def _trend_design(xs: Sequence[float], covariate: Sequence[float] | None) -> torch.Tensor:
    """[n, q] the regressors of a trend: 1, x and (when given and not constant) the covariate."""
    cols = [[1.0] * len(xs), [float(x) for x in xs]]
    if covariate is not None and max(covariate) - min(covariate) > 1e-12:
        cols.append([float(c) for c in covariate])
    return torch.tensor(cols, dtype=torch.float64).T


def ols_trend(
    xs: Sequence[float], ys: Sequence[float], covariate: Sequence[float] | None = None
) -> dict[str, float | int | None]:
    """The OLS slope of ys over xs with an intercept (and ``covariate`` partialled out): the trend each run
    contributes to the trend over seeds (:func:`grpo_lens.formulas.pooling.seed_slope_test`) and that the fixed-b
    test reads within one run (:func:`hac_trend_test`).

    Model y_t = α + β x_t + γ c_t + u_t; β̂ = Σ x̃_t y_t / Σ x̃_t², x̃ the residual of x on (1, c) (Frisch-Waugh).

    Args:
        xs: [n] positions (steps).  ys: [n] values.  covariate: [n] or None.

    Returns:
        {"slope", "se_iid" (the textbook SE, valid only for i.i.d. errors; descriptive), "df" (n − regressors), "n"};
        slope None when n < 3, the lengths differ or x has no variation after the covariate.
    """
    n = len(xs)
    out: dict[str, float | int | None] = {"slope": None, "se_iid": None, "df": 0, "n": n}
    if n < 3 or len(ys) != n:
        return out
    x = _trend_design(xs, covariate)  # [n, q]
    df = n - x.shape[1]
    xtx = x.T @ x
    if df < 1 or float(torch.linalg.det(xtx)) <= 1e-12 * float(xtx.diagonal().prod()):
        return out
    inv = torch.linalg.inv(xtx)
    y = torch.tensor([float(v) for v in ys], dtype=torch.float64)
    beta = inv @ (x.T @ y)
    resid = y - x @ beta
    s2 = float(resid.square().sum()) / df
    return {**out, "slope": float(beta[1]), "se_iid": math.sqrt(max(s2 * float(inv[1, 1]), 0.0)), "df": df}


#: draws of the fixed-b reference distribution (i.i.d. Gaussian errors at the run's own design): p resolves to 1/4001
HAC_DRAWS = 4000

_HAC_NULL: dict[tuple[Any, ...], torch.Tensor] = {}


def _hac_t(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[D] the slope's t-statistic with the Bartlett-kernel HAC variance at bandwidth M = n (fixed-b, b = 1).

    x: [n, q] design (column 1 the slope's); y: [D, n] series. With x̃ the slope column's residual on the other
    columns and û the OLS residuals, v_t = x̃_t û_t, Ω̂ = Σ_{t,s} (1 − |t − s|/n) v_t v_s / n and
    Var(β̂) = n Ω̂ / (Σ x̃²)² (Kiefer & Vogelsang, Econometric Theory 21, 2005, eq. 3 with k = Bartlett, b = 1).
    """
    n = x.shape[0]
    inv = torch.linalg.inv(x.T @ x)
    beta = y @ x @ inv  # [D, q]
    resid = y - beta @ x.T  # [D, n]
    others = x[:, [j for j in range(x.shape[1]) if j != 1]]
    xt = x[:, 1] - others @ torch.linalg.lstsq(others, x[:, 1:2]).solution[:, 0]  # [n] x̃
    v = resid * xt  # [D, n]
    idx = torch.arange(n, dtype=torch.float64)
    kernel = (1 - (idx[:, None] - idx[None, :]).abs() / n).clamp_min(0)  # [n, n] Bartlett weights at M = n
    omega = ((v @ kernel) * v).sum(1) / n
    var = n * omega / float(xt.square().sum()) ** 2
    return beta[:, 1] / var.clamp_min(1e-300).sqrt()


def hac_trend_test(
    xs: Sequence[float], ys: Sequence[float], covariate: Sequence[float] | None = None
) -> dict[str, float | int | None]:
    """A trend test within one run that keeps its level when steps are autocorrelated: the OLS slope
    (:func:`ols_trend`) with a Bartlett-kernel HAC standard error at bandwidth equal to the sample size, read against
    its fixed-b reference distribution (Kiefer & Vogelsang, Econometric Theory 21, 2005; Kiefer, Vogelsang & Bunzel,
    Econometrica 68, 2000) (docs/theory.md §12).

    The fixed-b statistic is asymptotically pivotal under any weakly dependent stationary error; its law depends on
    the kernel, b and the design only, so this function tabulates it at the run's own design (x, covariate) from
    :data:`HAC_DRAWS` series of i.i.d. N(0, 1) errors (a fixed seed: the same data give the same p, cached per
    design) and returns the Monte Carlo p-values (1 + #{t* >= t}) / (D + 1). Against the first-difference test
    (:func:`difference_trend_test`) the slope uses every point, not only the two ends: under stationary noise its SE
    falls as n^(−3/2) rather than n^(−1).

    Args:
        xs: [n] positions (steps), strictly increasing.  ys: [n] values.  covariate: [n] or None.

    Returns:
        {"slope", "t" (the HAC t), "df" (n − regressors), "p_up" (one-sided p of β > 0), "p_down" (β < 0), "n"};
        slope/t None and p 1.0 when the OLS slope is undefined (:func:`ols_trend`).
    """
    ols = ols_trend(xs, ys, covariate)
    out: dict[str, float | int | None] = {"slope": ols["slope"], "t": None, "df": ols["df"], "p_up": 1.0}
    out.update(p_down=1.0, n=len(xs))
    if ols["slope"] is None:
        return out
    x = _trend_design(xs, covariate)
    y = torch.tensor([float(v) for v in ys], dtype=torch.float64)
    t = float(_hac_t(x, y[None, :])[0])
    key = tuple(round(float(v), 9) for v in x.flatten().tolist()) + tuple(x.shape)
    if key not in _HAC_NULL:
        if len(_HAC_NULL) >= 256:  # designs with a covariate differ per run: keep the cache bounded
            _HAC_NULL.clear()
        gen = torch.Generator().manual_seed(20050101)
        _HAC_NULL[key] = _hac_t(x, torch.randn(HAC_DRAWS, x.shape[0], generator=gen, dtype=torch.float64))
    null = _HAC_NULL[key]
    if not math.isfinite(t):  # no residual variation: the fitted slope is exact
        return {**out, "t": t, "p_up": float(ols["slope"] <= 0), "p_down": float(ols["slope"] >= 0)}
    p_up = (1 + int((null >= t).sum())) / (HAC_DRAWS + 1)
    p_down = (1 + int((null <= t).sum())) / (HAC_DRAWS + 1)
    return {**out, "t": t, "p_up": p_up, "p_down": p_down}
