"""Uncertainty over groups: bootstrap intervals, per-key summaries and strata of per-group rows (docs/theory.md §7).

A "row" is the dict of canonical keys that :func:`grpo_lens.diagnostics.group.analyse_group` returns for one group
(float values; a missing key means "not measured for this group"). The probe and the lens only aggregate rows.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch


def _finite(values: Iterable[Any]) -> list[float]:
    out = []
    for v in values:
        if v is None:
            continue
        v = float(v)
        if math.isfinite(v):
            out.append(v)
    return out


def bootstrap_ci(values: Sequence[float], *, level: float = 0.95, num_resamples: int = 2000,
                 seed: int = 0) -> dict[str, float | int | None]:
    """Mean of ``values`` with a studentized (bootstrap-t) interval over them (Efron & Tibshirani 1993, ch. 12.5).

    Resamples the n values with replacement ``num_resamples`` times and forms t* = (mean* - mean) / (sd*/sqrt n);
    with q_lo, q_hi the (1-level)/2 and (1+level)/2 quantiles of t*, the interval is
    [mean - q_hi sd/sqrt n, mean - q_lo sd/sqrt n]. Unlike the plain percentile interval (which under-covers at the
    n = 10-30 groups a probe has: 0.89 at n = 24 for a nominal 0.95), it is second-order accurate for a mean.
    Resamples with sd* = 0 are dropped; when every value is equal the interval is [mean, mean]. Non-finite values
    and None are dropped first.

    Args:
        values: [n] per-group numbers.
        level: coverage in (0, 1).
        num_resamples: bootstrap draws (>= 100).
        seed: resampling seed (results are deterministic).

    Returns:
        {"mean", "lo", "hi", "n"}: mean None for n = 0; lo = hi = None for n < 2 (one group has no spread).

    Raises:
        ValueError: level outside (0, 1) or num_resamples < 100.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if num_resamples < 100:
        raise ValueError(f"num_resamples must be >= 100, got {num_resamples}")
    xs = _finite(values)
    n = len(xs)
    if n == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    x = torch.tensor(xs, dtype=torch.float64)
    mean = float(x.mean())
    if n < 2:
        return {"mean": mean, "lo": None, "hi": None, "n": 1}
    se = float(x.std(correction=1)) / math.sqrt(n)
    if se == 0:
        return {"mean": mean, "lo": mean, "hi": mean, "n": n}
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (num_resamples, n), generator=gen)
    xs_b = x[idx]  # [S, n]
    se_b = xs_b.std(dim=1, correction=1) / math.sqrt(n)
    keep = se_b > 0
    t = (xs_b.mean(1)[keep] - mean) / se_b[keep]
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    q_lo, q_hi = torch.quantile(t, q).tolist()
    return {"mean": mean, "lo": mean - q_hi * se, "hi": mean - q_lo * se, "n": n}


def summarise_rows(rows: Sequence[dict[str, float]], *, keys: Sequence[str] | None = None, level: float = 0.95,
                   num_resamples: int = 2000, seed: int = 0) -> dict[str, dict[str, float | int | None]]:
    """{key: bootstrap_ci(values of key over the rows that have it)} for every key (or the given ones).

    Args:
        rows: per-group rows of canonical keys.
        keys: the keys to summarise; None = every key that any row has (sorted).
    """
    if keys is None:
        keys = sorted({k for row in rows for k in row})
    return {k: bootstrap_ci([row.get(k) for row in rows], level=level, num_resamples=num_resamples, seed=seed)
            for k in keys}


def stratify_rows(rows: Sequence[dict[str, float]], by: str, **summary_kwargs: Any
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
