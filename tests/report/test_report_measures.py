"""Report sections and claims for sparsity, entropy, S1, baselines and credit: verdicts computed from the numbers."""

from __future__ import annotations

import json
import math

import pytest

from grpo_lens.claims.base import CLAIMS, evaluate_claims, verdict_from_interval
from grpo_lens.claims.sparsity import TRAINING_CLAIMS
from grpo_lens.formulas.stats import spearman_trend
from grpo_lens.report import write_report
from grpo_lens.rundir import lens_overhead


def sparsity_claims(records):
    return evaluate_claims({"records": records}, list(TRAINING_CLAIMS))


def study_claims(label, studies):
    return [
        c
        for name in ("uniform_token_credit", "monte_carlo_credit", "group_mean_optimal")
        for c in CLAIMS.get(name)({"studies": studies})
    ]


def test_verdict_rules():
    assert verdict_from_interval(0.1, 0.3, 0.0, "above") == "holds"
    assert verdict_from_interval(-0.3, -0.1, 0.0, "above") == "does not hold"
    assert verdict_from_interval(-0.1, 0.1, 0.0, "above") == "inconclusive"
    assert verdict_from_interval(0.9, 1.2, 1.0, "contains") == "holds"
    assert verdict_from_interval(1.1, 1.2, 1.0, "contains") == "does not hold"
    assert verdict_from_interval(None, 1.2, 1.0, "contains") == "inconclusive"
    assert verdict_from_interval(0.0, 0.01, 0.023, "below") == "holds"
    with pytest.raises(ValueError, match="above, below, contains"):
        verdict_from_interval(0, 1, 0, "sideways")


def test_spearman_trend_exact_permutation():
    # 5 increasing points: rho = 1; exactly 2 of the 5! = 120 orders reach |rho| = 1: p = 2/120
    rho, p = spearman_trend([1, 2, 3, 4, 5], [0.1, 0.2, 0.3, 0.4, 0.5])
    assert rho == pytest.approx(1.0) and p == pytest.approx(2 / 120)
    rho, p = spearman_trend([1, 2, 3, 4], [0.4, 0.3, 0.2, 0.1])
    assert rho == pytest.approx(-1.0) and p == pytest.approx(2 / 24)
    assert math.isnan(spearman_trend([1, 2], [1, 2])[0])


def _records(hoyers, bf16, dense, n=2**21, update_hoyer=0.2, s1=0.5, f32=0.8):
    # one lens record every 5 steps; the first lens step (step 1) is excluded from the gradient trend
    recs = []
    for i, (h, b, d) in enumerate(zip(hoyers, bf16, dense)):
        recs.append(
            {
                "step": max(5 * i, 1),
                "perf/step_seconds": 10.0,
                "perf/lens_seconds": 0.6,
                "perf/lens_sparsity_seconds": 0.4,
                "reward/frac_zero_std_groups": s1,
                "policy/entropy": 1.0 / (i + 1),
                "sparsity/update_step_hoyer": update_hoyer,
                "sparsity/update_step_top1_energy": 0.11,
                "sparsity/update_total_bf16_unchanged": b,
                "sparsity/update_total_bf16_dense": d,
                "sparsity/update_total_f32_unchanged": f32,
                "sparsity/grad_zero": 0.01,
                "sparsity/grad_hoyer": h,
                "sparsity/grad_top1_energy": 0.2,
                "sparsity/sample_entries": n,
                "sparsity/mlp/update_total_hoyer": 0.2,
                "sparsity/mlp/update_total_bf16_unchanged": b,
                "sparsity/mlp/update_total_bf16_dense": d,
            }
        )
    return recs


def test_sparsity_claims_follow_the_numbers():
    names = ("sparsity_intensifies", "zero_variance_share_rises", "most_parameters_unchanged")
    # gradient Hoyer rising over lens steps 5..25 (step 1 excluded): 5 points, rho = 1, exact p = 2/120 = 0.017 ->
    # holds; bf16 share 0.90 but float32-unchanged 0.002 (a dense log-normal update), SE (older records, no
    # logged SE) sqrt(0.002 * 0.998 / 2^21) = 3e-5: interval below 0.5 -> does not hold; S1 constant over 6 steps
    # (< 8 steps): inconclusive
    rising = sparsity_claims(_records([0.9, 0.2, 0.21, 0.22, 0.23, 0.24], [0.9] * 6, [0.89] * 6, f32=0.002))
    assert dict(zip(names, [c.verdict for c in rising])) == {
        "sparsity_intensifies": "holds",
        "zero_variance_share_rises": "inconclusive",
        "most_parameters_unchanged": "does not hold",
    }
    # the first lens step is excluded: a high first value does not make a falling trend; only the later steps count.
    # float32-unchanged 0.8 (SE 3e-4): most weights did not move -> holds
    falling = sparsity_claims(_records([0.1, 0.5, 0.4, 0.3, 0.25, 0.2], [0.9] * 6, [0.5] * 6))
    assert [c.verdict for c in falling] == ["does not hold", "inconclusive", "holds"]
    # the update's Hoyer is not what is tested: rising update Hoyer with a constant gradient Hoyer is inconclusive
    assert sparsity_claims(_records([0.3] * 6, [0.9] * 6, [0.5] * 6, update_hoyer=0.5))[0].verdict == "inconclusive"
    # bf16 share far above its dense control, but only 0.05 of the weights are unchanged in float32: does not hold
    f32_changed = sparsity_claims(_records([0.5] * 6, [0.9] * 6, [0.5] * 6, f32=0.05))
    assert f32_changed[2].verdict == "does not hold" and "float32" in f32_changed[2].rule
    # well above the dense control but most weights changed (0.095 unchanged): does not hold
    few = sparsity_claims(_records([0.5, 0.5, 0.4, 0.3, 0.25, 0.2], [0.095] * 6, [0.014] * 6))
    assert few[2].verdict == "does not hold"
    # four tested lens steps cannot decide a trend (smallest exact p = 2/24 = 0.083)
    assert sparsity_claims(_records([0.2, 0.3, 0.4, 0.5, 0.6], [0.9] * 5, [0.5] * 5))[0].verdict == "inconclusive"
    # S1 rising over 12 steps: rho = 1 -> holds
    recs = [{"step": i, "reward/frac_zero_std_groups": i / 12} for i in range(1, 13)]
    (s1,) = CLAIMS.get("zero_variance_share_rises")({"records": recs})
    assert s1.verdict == "holds" and "last third" in s1.measurement
    # lens cost: 5 x 1.0 s against 5 x 10 - 5 = 45 s
    assert lens_overhead(_records([0.2] * 5, [0.9] * 5, [0.5] * 5))["overhead"] == pytest.approx(5 / 45)


def _ci(m, lo, hi, n=8):
    return {"mean": m, "lo": lo, "hi": hi, "n": n}


def _mc_rollout(counts, adv, k=8):
    """A Monte Carlo row as the credit study writes it, from each prefix's successes among K 0/1 continuations."""
    return {
        "reward": 1.0 if adv > 0 else 0.0,
        "grpo_advantage": adv,
        "boundaries": [0, 3, 6, 9, 12],
        "values": [x / k for x in counts],
        "errors": [math.sqrt(x * (k - x) / (k * k * (k - 1))) for x in counts],
        "advantages": [0.1] * 4,
        "adv_errors": [0.1] * 4,
    }


def _studies(
    ratio,
    mse,
    answer_ratio,
    disagree,
    rejected=0.75,
    opposing=4,
    rollouts=8,
    testable=8,
    other=(6, 4, 5, 6),
    log_ratios=(-0.6931471805599453,),  # log 0.5
    log_ratio_var=0.01,
):
    # opposing rollouts: successes 8 -> 2 of 8 against A_i > 0 (difference 6 >= the count rule's d = 5, opposing
    # shift 0.75); the others ``other`` (by default 6 -> 4: shift 0.25, not flagged). Per prompt, log(m_C / m_W)
    # cycles through ``log_ratios`` with variance ``log_ratio_var`` (``testable`` prompts, 8 of 16 correct each)
    mc_rows = [_mc_rollout((8, 2, 4, 6), 0.8) if i < opposing else _mc_rollout(other, 0.8) for i in range(rollouts)]
    prompt = {
        "p": 0.5,
        "n_correct": 8,
        "n_wrong": 8,
        "m_correct": 0.02,
        "m_wrong": 0.04,
        "b_star_pop": 0.33,
        "b_star_exact": 0.34,
        "equal_norms": {"ratio": 0.5, "lo": 0.4, "hi": 0.6, "verdict": "m_C < m_W"},
    }
    summary = {
        name: {
            "mse_ratio_to_rloo": _ci(1.0, 1.0, 1.0),
            "cosine": _ci(0.3, 0.2, 0.4),
            "bias2_share": _ci(0.1, 0.05, 0.15),
        }
        for name in ("none", "mean_rescaled", "rloo", "optimal_loo")
    }
    summary["optimal_loo"] = summary["optimal_pop"] = {
        "mse_ratio_to_rloo": mse,
        "cosine": _ci(0.3, 0.2, 0.4),
        "bias2_share": _ci(0.1, 0, 0.2),
    }
    classes = {
        c: {"update_share": _ci(0.3, 0.2, 0.4), "token_share": _ci(0.2, 0.15, 0.25), "ratio": answer_ratio}
        for c in ("answer", "format", "reasoning")
    }
    return {
        "baselines": {
            "baselines": {
                "per_prompt": [
                    {**prompt, "log_ratio": log_ratios[j % len(log_ratios)], "log_ratio_var": log_ratio_var}
                    for j in range(testable)
                ],
                "summary": summary,
                "prompts": 8,
                "prompts_constant": 2,
                "b_star_shift": _ci(0.01, 0.0, 0.02),
                "b_star_minus_p": _ci(-0.1, -0.2, 0.0),
                "norm_ratio": ratio,
                "mean_score_ratio": _ci(30.0, 20.0, 40.0),
                "equal_norms_rejected": rejected,
                "equal_norms_testable": testable,
            },
            "s1": {
                "measured": _ci(0.4, 0.3, 0.5),
                "predicted": _ci(0.42, 0.35, 0.5),
                "difference": _ci(-0.02, -0.1, 0.06),
                "prompts": 10,
                "rollouts_per_prompt": 16,
            },
            "meta": {"group_size": 4, "rollouts_per_prompt": 16, "gradients": "sketch", "sketch_dim": 16},
        },
        "credit": {
            "contributions": {
                "position_profile": [_ci(0.5, 0.4, 0.6), _ci(0.5, 0.4, 0.6)],
                "classes": classes,
                "closure": 1e-4,
                "groups": 4,
            },
            "monte_carlo": {
                "rollouts": mc_rows,
                "samples_per_prefix": 8,
                "disagree": disagree,
                "agree": _ci(0.5, 0.3, 0.7),
                "segments": {"disagree": 0, "agree": 0, "total": 4 * rollouts},
                "neutral": _ci(0.4, 0.2, 0.6),
                "top_segment_share": _ci(0.7, 0.6, 0.8),
            },
            "meta": {"group_size": 4},
        },
    }


def test_study_claims_follow_the_numbers():
    # baseline: log(m_C / m_W) = log 0.5 on 8 prompts with variance 0.01: y = 0.4805 - 0.01 = 0.4705 on every prompt,
    # above (log 1.25)² = 0.0498 with no spread -> does not hold; answer ratio [1.3, 1.8] outside 1 ± 0.25 -> does
    # not hold; Monte Carlo: opposing shift at segment 1 = 0.75 on 4 rollouts, 0.25 on 4: mean 0.5, SD 0.267, t =
    # (0.5 - 0.1) / (0.267/√8) = 4.2 on 7 df (Hall's p ≈ 0.002, × 3 positions <= 0.025) -> the predicted
    # disagreement holds
    c = study_claims("before", _studies(_ci(0.5, 0.4, 0.6), _ci(0.8, 0.7, 0.9), _ci(1.5, 1.3, 1.8), _ci(0.2, 0.1, 0.3)))
    # (the token-credit row is descriptive since 0.3: no verdict, its 0.2 reading kept in the rule)
    assert [x.verdict for x in c] == ["inconclusive", "holds", "does not hold"]
    assert c[0].kind == "descriptive" and "the 0.2 rule reads: does not hold" in c[0].rule
    # log ratio 0 on 16 prompts with variance 0.01: y = -0.01 everywhere, below 0.0498 -> holds (equivalence);
    # answer ratio inside 1 ± 0.25 -> holds; 120 rollouts 4 -> 4 -> 5 -> 6 of 8: shifts 0, -1/8, -1/8 at the three
    # positions, every one below the margin 0.1 with no spread -> the paper's prediction does not hold
    c = study_claims(
        "after",
        _studies(
            _ci(1.0, 0.8, 1.2),
            _ci(1.0, 0.95, 1.1),
            _ci(1.0, 0.8, 1.2),
            _ci(0.0, 0.0, 0.01),
            rejected=0.0,
            opposing=0,
            rollouts=120,
            testable=16,
            other=(4, 4, 5, 6),
            log_ratios=(0.0,),
        ),
    )
    assert [x.verdict for x in c] == ["inconclusive", "does not hold", "holds"]
    (lit,) = CLAIMS.get("identical_token_advantage")(
        {"studies": _studies(_ci(1.0, 0.8, 1.2), _ci(1.0, 0.95, 1.1), _ci(1.0, 0.8, 1.2), _ci(0.0, 0.0, 0.01))}
    )
    assert lit.verdict == "holds" and "not a test" in lit.rule and lit.kind == "check"
    # too small to show equivalence: log ratios 0 and 0.3 alternating (variance 0): y = 0, 0.09, mean 0.045 with SD
    # 0.048 on 8 prompts, an interval reaching (log 1.25)² = 0.0498 -> inconclusive; 7 prompts -> inconclusive
    for n in (8, 7):
        c = study_claims(
            "x",
            _studies(
                _ci(1.0, 0.8, 1.2),
                _ci(1.0, 0.95, 1.1),
                _ci(1.0, 0.8, 1.2),
                _ci(0.0, 0.0, 0.01),
                testable=n,
                log_ratios=(0.0, 0.3),
                log_ratio_var=0.0,
            ),
        )
        assert c[-1].verdict == "inconclusive"


def test_baseline_row_shows_its_rms_whole_with_two_prompts():
    from grpo_lens.claims.base import primary_text

    # 2 prompts with log ratio log 0.5 and variance 0.01 (8 of 16 correct each): y = 0.4805 - 0.01 = 0.4705, RMS
    # √0.4705 = 0.686, too few prompts for an interval; the first screen keeps the whole number and its reason
    c = study_claims(
        "x", _studies(_ci(1.0, 0.8, 1.2), _ci(1.0, 0.95, 1.1), _ci(1.0, 0.8, 1.2), _ci(0.0, 0.0, 0.01), testable=2)
    )
    text = primary_text(c[-1])
    assert c[-1].verdict == "inconclusive" and not text.endswith("…")
    assert text == "weighted RMS of log(m_C / m_W) less noise: 0.686 (n = 2 prompts, too few for an interval)"


def test_token_credit_checks_every_class_and_too_few_prompts_give_no_interval():
    # answer tokens inside 1 ± 0.25 but format tokens at [0.17, 0.38], wholly below the band: the claim is about every
    # token, so it does not hold, and the rule names the class that decided it
    st = _studies(_ci(1.0, 0.8, 1.2), _ci(1.0, 0.95, 1.1), _ci(1.0, 0.9, 1.1), _ci(0.0, 0.0, 0.01), testable=7)
    st["credit"]["contributions"]["classes"]["format"]["ratio"] = _ci(0.27, 0.17, 0.38)
    # (descriptive since 0.3: the verdict is inconclusive and the 0.2 rule's reading is in the text)
    credit = study_claims("x", st)[0]
    assert credit.verdict == "inconclusive" and "reads: does not hold" in credit.rule and "format" in credit.rule
    assert "reasoning" not in credit.rule.split("reads:")[1]
    # every class inside the band -> reads holds; one class overlapping the edge -> reads inconclusive
    st["credit"]["contributions"]["classes"]["format"]["ratio"] = _ci(1.0, 0.8, 1.2)
    assert "reads: holds" in study_claims("x", st)[0].rule
    st["credit"]["contributions"]["classes"]["reasoning"]["ratio"] = _ci(1.0, 0.6, 1.2)
    assert "reads: inconclusive" in study_claims("x", st)[0].rule
    # 7 testable prompts: no Wilson interval is printed for the rejection share (intervals need >= 8 units)
    group_mean = study_claims("x", st)[-1]
    assert group_mean.verdict == "inconclusive" and "too few for an interval" in group_mean.measurement
    assert "Wilson" not in group_mean.measurement


def _report_with_studies(run_dir) -> str:
    """report.md of ``run_dir`` holding a probe.json whose studies are :func:`_studies` (does-not-hold numbers)."""
    probe = {
        "meta": {"model": "tiny"},
        "per_group_size": {},
        "studies": _studies(_ci(0.5, 0.4, 0.6), _ci(0.8, 0.7, 0.9), _ci(1.5, 1.2, 1.8), _ci(0.2, 0.1, 0.3)),
    }
    (run_dir / "probe.json").write_text(json.dumps(probe))
    return write_report(run_dir).read_text()


@pytest.mark.e2e
def test_probe_only_report_does_not_promise_sparsity_claims(tmp_path):
    report = _report_with_studies(tmp_path)
    assert "## Claims: effective rank, zero-sum structure, the identity, credit, baselines" in report
    assert "sparsity over training come from a training run" in report


def test_wilson_interval_closed_form():
    from grpo_lens.formulas.stats import wilson_interval

    # 0 of 8: [0, z^2/(n + z^2)] = [0, 3.8416/11.8416] = [0, 0.3244]
    lo, hi = wilson_interval(0, 8)
    assert lo == 0.0 and hi == pytest.approx(3.8416 / 11.8416, abs=1e-4)
    lo, hi = wilson_interval(4, 8)  # symmetric around 1/2
    assert lo + hi == pytest.approx(1.0)


@pytest.mark.e2e
def test_report_has_the_new_sections_and_claims(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in _records([0.2, 0.21, 0.22, 0.23, 0.24], [0.9] * 5, [0.89] * 5)) + "\n"
    )
    report = _report_with_studies(tmp_path)
    assert "## Claims: effective rank, zero-sum structure, the identity, sparsity, credit, baselines" in report
    # one table: the training run's claims and the probe's (labelled by source)
    assert "| training | gradient sparsity intensifies over training |" in report
    assert "| probe | the group mean is the variance-optimal baseline (m_C = m_W) |" in report
    for head in (
        "### Policy entropy",
        "### Sparsity over training",
        "### S1 predicted from rollouts outside",
        "### Baselines at matched expectation",
        "### Token credit",
    ):
        assert head in report, head
    # entropy 1/i over 5 steps: non-overlapping windows of min(5, 5 // 2) = 2 steps, as for the reward: first
    # (1 + 1/2) / 2 = 0.750, last (1/4 + 1/5) / 2 = 0.225
    assert "1.000 nats over the first" not in report
    assert "0.750 nats over the first 2 steps -> 0.225 over the last 2" in report
    assert "| optimal_pop | 0.800 [0.700, 0.900] |" in report
    assert (tmp_path / "sparsity_measures.png").is_file() and (tmp_path / "credit_position_probe.png").is_file()


def test_no_interval_from_fewer_than_eight_units():
    from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS as MIN_UNITS
    from grpo_lens.formulas.stats import mean_interval

    # over 2 values every resample with a spread is the pair itself (the interval would be the data's range), and a
    # handful gives quantiles of a few distinct means: no interval below MIN_UNITS = 8 (docs/theory.md §7)
    assert MIN_UNITS == 8
    assert mean_interval([0.1, 0.3])["lo"] is None and mean_interval([0.1, 0.3, 0.2, 0.4])["hi"] is None
    eight = mean_interval([0.1, 0.3, 0.2, 0.4, 0.15, 0.25, 0.35, 0.3])
    assert eight["lo"] < 0.26 < eight["hi"]
    # a share's interval stays inside [0, 1]
    clipped = mean_interval([0.0] * 7 + [1.0], bounds=(0.0, 1.0))
    assert 0.0 <= clipped["lo"] <= clipped["hi"] <= 1.0


def test_credit_claims_need_power_not_absence_of_data():
    def credit(**kw):
        return [
            CLAIMS.get(n)({"studies": _studies(_ci(1.0, 0.9, 1.1), _ci(1.0, 0.9, 1.1), **kw)})[0]
            for n in ("uniform_token_credit", "monte_carlo_credit")
        ]

    # the new-user report: 4 rollouts, 0 disagreeing segments, most within noise of 0. The old rule (disagreeing
    # share's interval below 0.023) said holds on 200 such segments; now: too few rollouts -> inconclusive
    u, mc = credit(answer_ratio=_ci(1.0, 0.3, 2.5), disagree=_ci(0.0, 0.0, 0.0), opposing=0, rollouts=4)
    assert mc.verdict == "inconclusive" and "4 rollouts < 8" in mc.rule
    # the old "interval contains 1" said holds on the wide [0.3, 2.5]; it overlaps the edge of 1 ± 0.25
    assert u.verdict == "inconclusive"
    # 8 rollouts, segment 1's shifts 0.75 once and 0 seven times: mean 0.094, SD 0.265, t = (0.094 - 0.1)/0.094
    # ≈ -0.07 -> neither branch -> inconclusive
    u, mc = credit(answer_ratio=_ci(1.0, None, None), disagree=_ci(0.0, 0.0, 0.0), opposing=1, other=(4, 4, 5, 6))
    assert mc.verdict == "inconclusive" and "neither" in mc.rule and "--mc-groups" in mc.advice
    assert u.verdict == "inconclusive"  # no interval (fewer than 8 groups)
    # planted: 120 rollouts 4 -> 4 -> 5 -> 6, shifts 0, -1/8, -1/8 below 0.1 -> does not hold; 3 of 8 at 0.75, 5 at
    # 0.25: mean 0.4375, SD 0.259, t = 3.7 on 7 df (× 3 positions <= 0.025) -> the predicted disagreement holds;
    # answer ratio [1.3, 1.6] wholly above 1.25 -> does not hold
    _, mc = credit(
        answer_ratio=_ci(1.0, 0.9, 1.1), disagree=_ci(0.0, 0.0, 0.0), opposing=0, rollouts=120, other=(4, 4, 5, 6)
    )
    assert mc.verdict == "does not hold"
    u, mc = credit(answer_ratio=_ci(1.45, 1.3, 1.6), disagree=_ci(0.15, 0.1, 0.2), opposing=3)
    assert (u.kind, mc.verdict) == ("descriptive", "holds") and "reads: does not hold" in u.rule


def test_band_verdict():
    from grpo_lens.claims.base import band_verdict

    assert band_verdict(0.8, 1.2, 0.75, 1.25) == "holds"
    assert band_verdict(0.5, 1.5, 0.75, 1.25) == "inconclusive"  # contains 1, but too wide
    assert band_verdict(1.3, 1.4, 0.75, 1.25) == "does not hold"
    assert band_verdict(0.1, 0.7, 0.75, 1.25) == "does not hold"
    assert band_verdict(None, None, 0.75, 1.25) == "inconclusive"
    assert band_verdict(float("nan"), 1.0, 0.75, 1.25) == "inconclusive"  # a non-finite end is no interval


def test_s4_claim_is_not_judged_on_a_zero_update():
    from grpo_lens.claims.sparsity import most_parameters_unchanged

    # every sampled weight unchanged in float32 (a user's TRL run measured at a warm-up step with lr 0; a GSM8K run
    # with every advantage 0): no evidence about what training changes. One moved weight in 2^21 (z = 1 - 2^-21)
    # is a real update: its interval lies above 0.5 -> holds
    zero = most_parameters_unchanged({"records": _records([0.2] * 5, [1.0] * 5, [0.3] * 5, f32=1.0)})[0]
    assert zero.verdict == "inconclusive" and zero.rule.startswith("no sampled weight changed")
    moved = most_parameters_unchanged({"records": _records([0.2] * 5, [1.0] * 5, [0.3] * 5, f32=1 - 2**-21)})[0]
    assert moved.verdict == "holds"


@pytest.mark.e2e
def test_s4_claim_is_not_judged_on_lora_adapter_weights(tmp_path):
    from grpo_lens.claims.sparsity import most_parameters_unchanged
    from grpo_lens.report import write_report

    # the step-1 LoRA case of the user test: B = 0 at init, so A gets no gradient and 0.500 of the adapter weights
    # are unchanged; a full-model run with these numbers "does not hold" (0.484 < 0.5), a LoRA run is not judged
    recs = _records([0.2] * 5, [0.484] * 5, [0.01] * 5)
    assert most_parameters_unchanged({"records": recs})[0].verdict == "does not hold"
    lora = most_parameters_unchanged({"records": recs, "lora_rank": 8})[0]
    assert lora.verdict == "inconclusive" and lora.rule.startswith("not applicable to adapter parameters")
    assert "LoRA rank 8" in lora.scope and "adapter" in lora.measurement
    # the report names the parameter space
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    (tmp_path / "config.yaml").write_text("task: arithmetic\nlora_rank: 8\n")
    text = write_report(tmp_path).read_text()
    assert "Parameter space: this is a LoRA run (rank 8)" in text
    assert "of the LoRA adapter's weights (not the full model's) kept their bf16 value" in text
    assert "**does not hold** | only 0.484" not in text


@pytest.mark.e2e
def test_claims_say_where_their_rules_and_intervals_come_from(tmp_path):
    # a training-only run: its heading promises only what it shows (two sparsity claims) and sends the rest to probe
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in _records([0.2, 0.21, 0.22, 0.23, 0.24], [0.9] * 5, [0.89] * 5)) + "\n"
    )
    report = write_report(tmp_path).read_text()
    assert "## Claims: sparsity over training" in report and "come from `grpo-lens probe`" in report
    assert "## Claims: effective rank" not in report
    assert "§11 for the rank claims and the identity, §12 for sparsity, credit and baselines" in report
    # every row names what its interval is over
    assert "95% intervals over 2097152 sampled weights" in report
    c = study_claims("x", _studies(_ci(0.5, 0.4, 0.6), _ci(0.8, 0.7, 0.9), _ci(1.5, 1.3, 1.8), _ci(0.2, 0.1, 0.3)))
    assert "(n = 8 groups)" in c[0].measurement
    assert "(n = 8 rollouts)" in c[1].measurement
    assert "(n = 8 prompts)" in c[2].measurement


def test_s4_claim_reads_the_float32_share_and_the_permutation_control():
    from grpo_lens.claims.sparsity import most_parameters_unchanged

    def rec(f32, bf16, perm, se):
        return {
            "step": 30,
            "perf/lens_seconds": 0.1,
            "sparsity/sample_entries": 4000.0,
            "sparsity/update_total_f32_unchanged": f32,
            "sparsity/update_total_bf16_unchanged": bf16,
            "sparsity/update_total_bf16_permuted": perm,
            "sparsity/update_total_bf16_dense": 0.3,
            "sparsity/update_total_f32_unchanged_se": se,
            "sparsity/update_total_bf16_unchanged_se": se,
            "sparsity/update_total_bf16_excess_se": se,
        }

    # a sparse update: f32 0.60 +- 1.96 * 0.02 = [0.561, 0.639] > 0.5 -> holds, although its excess over the
    # permutation control is 0 (a permuted sparse update keeps its zeros)
    c = most_parameters_unchanged({"records": [rec(0.6, 0.62, 0.62, 0.02)]})[0]
    assert c.verdict == "holds" and "stratified by tensor" in c.measurement and "permuted" in c.control
    # the logged stratified SE is what the interval uses: SE 0.06 gives [0.482, 0.718], which contains 0.5 (the
    # simple-random-sample SE sqrt(0.24/4000) = 0.008 would have said holds)
    assert most_parameters_unchanged({"records": [rec(0.6, 0.62, 0.62, 0.06)]})[0].verdict == "inconclusive"
    # dense heavy-tailed update: f32 0.002, bf16 0.9 equal to its permutation control -> does not hold, rounding
    c = most_parameters_unchanged({"records": [rec(0.002, 0.9, 0.9, 0.005)]})[0]
    assert c.verdict == "does not hold" and "rounding" in c.rule
    # bf16 share far above the permutation control (0.9 vs 0.6, excess [0.29, 0.31] > 0.05): placement matters, yet
    # most weights moved in float32 -> still does not hold, and the rule says where the bf16 share comes from
    c = most_parameters_unchanged({"records": [rec(0.002, 0.9, 0.6, 0.005)]})[0]
    assert c.verdict == "does not hold" and "where the changes land" in c.rule


def test_monte_carlo_study_text_reports_the_count_test(tmp_path):
    from grpo_lens.report.studies import studies_section

    # 4 of 8 rollouts oppose A_i by 8 - 2 = 6 >= d = 5 of K = 8 (3 interior segments tested per rollout, α_r =
    # 3 · 0.01063 = 0.0319 at level 0.05): the text gives that count, its bound and P(Binomial(8, 0.0319) >= 4) =
    # C(8,4) 0.0319^4 (1 - 0.0319)^4 + ... = 6.5e-5, the numbers the
    # claim decides on, not the old "opposite sign beyond 2 SE" share
    studies = _studies(_ci(0.5, 0.4, 0.6), _ci(0.8, 0.7, 0.9), _ci(1.5, 1.3, 1.8), _ci(0.2, 0.1, 0.3))
    text = "\n".join(studies_section("probe", {"credit": studies["credit"]}, tmp_path, []))
    assert "beyond 2 SE" not in text
    # what the claim decides on first: segment 1's opposing shifts 0.75 (4 rollouts) and 0.25 (4): mean 0.500
    assert "by segment position (what the claim decides on, margin 0.1): segment 1: 0.500 [" in text
    assert "by >= 5 of 8 continuations (opposing): 4 of 8" in text
    assert "probability <= 0.0319 (3 segments tested per rollout, level 0.05)" in text
    assert "P(Binomial(8, 0.0319) >= 4) = 6.5e-05" in text
    (claim,) = CLAIMS.get("monte_carlo_credit")({"studies": {"credit": studies["credit"]}})
    assert "4 of 8" in claim.measurement and claim.verdict == "holds"


def test_token_credit_against_the_nll_control_with_the_same_geometry():
    # format tokens at 0.27 [0.17, 0.38] of their token share fail the 0.2 rule (wholly below 1 ± 0.25), but the same
    # tokens under NLL weights give 0.25: the paired difference 0.02 [-0.03, 0.05] lies inside ±0.25 × 0.25 = ±0.0625,
    # answer's 0.2 [-0.3, 0.5] inside ±0.25 × 3.0 = ±0.75 and reasoning's 0.0 [-0.1, 0.1] inside ±0.25 -> holds: the
    # small format share is the tokens' geometry, not GRPO's credit
    st = _studies(_ci(1.0, 0.8, 1.2), _ci(1.0, 0.95, 1.1), _ci(1.0, 0.9, 1.1), _ci(0.0, 0.0, 0.01))
    st["credit"]["contributions"]["classes"]["format"]["ratio"] = _ci(0.27, 0.17, 0.38)
    nll = {
        "answer": (3.0, _ci(0.2, -0.3, 0.5)),
        "format": (0.25, _ci(0.02, -0.03, 0.05)),
        "reasoning": (1.0, _ci(0.0, -0.1, 0.1)),
    }
    st["credit"]["contributions"]["classes_nll"] = {
        c: {"ratio": _ci(r, r - 0.1, r + 0.1), "ratio_minus_nll": d} for c, (r, d) in nll.items()
    }
    # (descriptive since 0.3: no verdict; the 0.2 rule's reading stays in the rule text)
    credit = study_claims("x", st)[0]
    assert credit.verdict == "inconclusive" and "reads: holds" in credit.rule
    assert "NLL weights" in credit.claim and "NLL weights" in credit.control
    assert "format 0.02 [-0.03, 0.05]" in credit.measurement and "band ±0.06" in credit.measurement
    # answer tokens credited 1.0-1.5 above what NLL gives them, beyond ±0.75: does not hold, naming the class
    st["credit"]["contributions"]["classes_nll"]["answer"]["ratio_minus_nll"] = _ci(1.25, 1.0, 1.5)
    credit = study_claims("x", st)[0]
    assert "reads: does not hold, interval of answer tokens wholly outside" in credit.rule
    # a class without an NLL mean has no band scale (it would be ±0, so any interval not exactly 0 'does not hold'):
    # it is not judged; here the format class, whose difference [-0.03, 0.05] would otherwise decide
    st["credit"]["contributions"]["classes_nll"]["answer"]["ratio_minus_nll"] = _ci(0.2, -0.3, 0.5)
    st["credit"]["contributions"]["classes_nll"]["format"]["ratio"] = {"mean": None, "lo": None, "hi": None, "n": 0}
    assert "reads: holds" in study_claims("x", st)[0].rule
