"""The claims over training pooled over seeds and within one run: closed-form slopes, the warm-up dropped,
"rank stays" by the t over seeds of each seed's lowest E₂."""

from __future__ import annotations

import math

import pytest

from grpo_lens import metrics as mk
from grpo_lens.claims.base import CLAIMS, DOES_NOT_HOLD, HOLDS, INCONCLUSIVE
from grpo_lens.claims.rank import STAYS_SEEDS_RULE_ID
from grpo_lens.claims.sparsity import S1_RULE_ID, S1_SEEDS_RULE_ID, after_warmup, trend_verdict

S1 = CLAIMS.get("zero_variance_share_rises")
STAYS = CLAIMS.get("rank_stays_near_two")


def _s1_run(slope: float, steps: int = 12, lr_warmup: int = 0, warm_s1: float | None = None) -> list[dict]:
    """S1 = 0.3 + slope·step + a zig-zag of ±0.01 (mean zero, no trend in it: the same at every seed), LR rising over
    ``lr_warmup`` steps; ``warm_s1`` replaces S1 during the warm-up."""
    recs = []
    for step in range(1, steps + 1):
        s1 = 0.3 + slope * step + (0.01 if step % 2 else -0.01)
        if warm_s1 is not None and step < lr_warmup:
            s1 = warm_s1
        recs.append(
            {mk.STEP: step, mk.LR: min(1.0, step / lr_warmup) if lr_warmup else 1.0, mk.REWARD_FRAC_ZERO_STD_GROUPS: s1}
        )
    return recs


def test_after_warmup_drops_the_steps_before_the_lr_peak():
    recs = [{mk.STEP: s, mk.LR: v} for s, v in enumerate([0.25, 0.5, 0.75, 1.0, 1.0, 0.9], start=1)]
    assert [r[mk.STEP] for r in after_warmup(recs)] == [4, 5, 6]
    assert after_warmup([{mk.STEP: 1}, {mk.STEP: 2}]) == [{mk.STEP: 1}, {mk.STEP: 2}]  # no LR logged: all kept


def test_s1_pooled_over_seeds_by_hand():
    # Each seed's OLS slope is its planted slope + d, d the zig-zag's own OLS slope (the same at every seed):
    # 0.01, 0.012, 0.014 (+ d) have s = 0.002 and t = (0.012 + d)·√3/0.002 > 8 (|d| < 0.002 over 12 steps), p < 0.01
    runs = [_s1_run(b) for b in (0.01, 0.012, 0.014)]
    (c,) = S1({"records": runs[0], "seed_runs": runs})
    assert c.rule_id == S1_SEEDS_RULE_ID and c.n == 3
    assert c.verdict == HOLDS
    # slopes 0.01, 0.02, 0.03 (+ d): s = 0.01 (d cancels), t = mean·√3/0.01 with 2 df, p = 0.5 − t/(2√(2 + t²))
    _, _, nums = trend_verdict([tuple(_series(r)) for r in (_s1_run(b) for b in (0.01, 0.02, 0.03))], 8, "hac")
    mean, sd = nums["slope"], math.sqrt(sum((b - nums["slope"]) ** 2 for b in nums["per_seed"]) / 2)
    assert sd == pytest.approx(0.01, abs=1e-9)  # the shift d cancels in the spread
    t = mean / (sd / math.sqrt(3))
    assert nums["t"] == pytest.approx(t, abs=1e-9)
    assert nums["p_up"] == pytest.approx(0.5 - t / (2 * math.sqrt(2 + t * t)), abs=1e-9)


def _series(recs):
    return [float(r[mk.STEP]) for r in recs], [float(r[mk.REWARD_FRAC_ZERO_STD_GROUPS]) for r in recs], None


def test_a_warm_up_transient_is_not_a_rise():
    # S1 low (0.0) while the LR warms up over 4 steps, then flat with a seed-specific tilt of either sign: with the
    # warm-up steps the slopes all read a rise; without them (the rule) the seeds disagree and nothing is decided
    runs = [_s1_run(b, steps=16, lr_warmup=4, warm_s1=0.0) for b in (0.002, -0.002, 0.0005)]
    (c,) = S1({"records": runs[0], "seed_runs": runs})
    assert c.verdict == INCONCLUSIVE
    no_lr = [[{k: v for k, v in r.items() if k != mk.LR} for r in run] for run in runs]
    assert S1({"records": no_lr[0], "seed_runs": no_lr})[0].verdict == HOLDS  # what the warm-up alone would say


def test_one_run_uses_the_hac_route():
    (c,) = S1({"records": _s1_run(0.03, steps=30)})
    assert c.rule_id == S1_RULE_ID and c.n == 30
    assert c.verdict == HOLDS  # slope 0.03 per step against a ±0.01 zig-zag: HAC t far in the tail (p = 1/4001)
    assert c.p_holds == pytest.approx(1 / 4001, abs=1e-12)


def _stays_run(e2s: list[float]) -> list[dict]:
    return [
        {mk.STEP: s, mk.RANK_G1.format(m="top2_share"): e2, mk.RANK_G1.format(m="top1_share"): 0.5}
        for s, e2 in zip((1, 5, 10, 15, 20), e2s)
    ]


def test_rank_stays_pooled_by_hand():
    # lowest E₂ per seed 0.95, 0.97, 0.99: t over seeds of the minima against 0.9 is the 6.062 of
    # test_seed_mean_test_by_hand (p = 0.013074); the E₁ side (0.5 < 0.9, no spread) gives p 0
    runs = [_stays_run([m + 0.02, m, m + 0.01, m + 0.03, m + 0.02]) for m in (0.95, 0.97, 0.99)]
    (c,) = STAYS({"records": runs[0], "seed_runs": runs})
    assert c.rule_id == STAYS_SEEDS_RULE_ID and c.n == 3
    assert c.p_holds == pytest.approx(0.013074, abs=2e-6)
    assert c.verdict == HOLDS
    # one lens step at E₂ ≈ 0.7 in every seed: the minima fall below 0.9 and that step's mean lies below it
    bad = [_stays_run([0.97, 0.97, 0.7 + d, 0.97, 0.97]) for d in (0.0, 0.01, 0.02)]
    (c,) = STAYS({"records": bad[0], "seed_runs": bad})
    assert c.verdict == DOES_NOT_HOLD
