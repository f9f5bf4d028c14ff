"""The report opens with one entry per primary claim (verdict, primary number, n, the power of that verdict's branch
at n), the checks, and the rank claim's readings side by side."""

from __future__ import annotations

from grpo_lens.claims.base import DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, Claim
from grpo_lens.report.answers import LINE_WIDTH, answer_lines, answers_section, claim_sources

LEVELS = {
    "rule": {
        "8": {"level": 0.0, "power": 0.0, "power_dnh": 0.0, "unit": "groups per R"},
        "16": {"level": 0.01, "power": 0.5, "power_dnh": 0.12, "unit": "groups per R"},
        "28": {"level": 0.02, "power": 0.9, "power_dnh": 0.7, "unit": "groups per R"},
    }
}


def claim(name, scope, verdict, n, kind="claim", advice=""):
    return Claim(
        claim=name,
        scope=scope,
        measurement="E 0.5 [0.4, 0.6] (n = 9 groups); more",
        control="c",
        verdict=verdict,
        rule="r",
        source="s",
        kind=kind,
        n=n,
        p_holds=None if kind == "check" else 0.5,
        p_dnh=None if kind == "check" else 0.5,
        rule_id="rule",
        advice=advice,
    )


def test_each_primary_claim_prints_the_power_of_its_own_verdicts_branch():
    sources = {
        "before": [
            claim("rank 2", "R = 4, 8", DOES_NOT_HOLD, 20),
            claim("identity", "all R", HOLDS, None, kind="check"),
        ],
        "after": [
            claim("rank 2", "R = 4, 8", HOLDS, 30),
            claim("theta", "R = 4, 8", INCONCLUSIVE, 8, advice="raise x"),
        ],
    }
    lines = answer_lines(sources, LEVELS)
    assert lines[0] == "## Answers"
    i = lines.index("- **does not hold**: rank 2 (before, R = 4, 8)")
    # the primary number is the measurement's first clause; n is the row's; the power is *does not hold*'s (0.12 at
    # the largest calibrated n <= 20, i.e. 16), not the holds branch's 0.5
    assert lines[i + 1] == "  E 0.5 [0.4, 0.6] (n = 9 groups); n = 20"
    assert lines[i + 2] == "  power of *does not hold* at n = 16 groups per R: 0.12 (planted cases)"
    j = lines.index("- **holds**: rank 2 (after, R = 4, 8)")
    assert lines[j + 2] == "  power of *holds* at n = 28 groups per R: 0.90 (planted cases)"
    # inconclusive with both powers 0 at its n: certain, with the n that decides it (holds power 0.9 >= 0.8 at 28)
    k = lines.index("- **inconclusive**: theta (after, R = 4, 8)")
    # (the line is longer than 160 characters: wrapped, the rest indented)
    assert lines[k + 2] + " " + lines[k + 3].strip() == (
        "  power at n = 8 groups per R: holds 0.00, does not hold 0.00; inconclusive was certain at this n; holds "
        "reaches power 0.8 at n = 28 groups per R; to decide: raise x"
    )
    assert lines[k + 3].startswith("    ")
    assert "- **holds** (check, not a test): identity (before, all R)" in lines
    assert lines.index("Checks (algebra with a control, not tests):") > k
    assert all(len(x) <= LINE_WIDTH for x in lines)


def test_the_probes_claims_open_the_answers_before_trainings():
    # a new user looked for "is the gradient rank 2?" and found the S4 sparsity line first: the probes' claims
    # (rank, zero-sum, identity) now come before the training run's (sparsity over training)
    sources = claim_sources({"before": {"meta": {}, "per_group_size": {}}}, [{"step": 1, "reward/mean": 0.5}])
    assert list(sources) == ["before", "training"]


def _probe(n=20, g2=2.0, g2_control=2.6):
    # 20 groups per R = 4, 8: G1's E2 0.95 +- 0.019 (0.002 steps), erank 3.0 +- 0.19, G2 q_proj stable rank under A
    # g2 +- 0.19 and under every other weighting g2_control +- 0.19; G3 one matrix
    per = {}
    for R in ("4", "8"):
        groups, g2w = [], []
        for i in range(n):
            e = 0.002 * (i - (n - 1) / 2)
            groups.append(
                {
                    "rank/g1_top2_share": 0.95 + e,
                    "rank/g1_top1_share": 0.6 + e,
                    "rank/g1_simnull_top2_share": 0.7,
                    "rank/g1_erank": 3.0 + 10 * e,
                    "rank/g1_stable_rank": 1.7 + 10 * e,
                    "rank/g1_no_adv_stable_rank": 1.6,
                }
            )
            g2w.append(
                {
                    f"rank/g2_{w}_q_proj_stable_rank": (g2 if w == "adv" else g2_control) + 10 * e
                    for w in ("adv", "abs", "shift", "reward", "uniform", "single")
                }
            )
        g3 = {"groups": n, "rank/g3_stable_rank": 4.2, **{f"rank/g3_{w}_stable_rank": 4.0 for w in ("abs", "uniform")}}
        per[R] = {"groups": groups, "summary": {}, "g2_weightings": {"groups": g2w, "summary": {}}, "g3": g3}
    return {"meta": {"gradients": "exact", "config": {"prompts": 32}}, "per_group_size": per}


def test_the_first_screen_shows_every_rank_reading_with_its_non_zero_sum_control():
    lines = answers_section({"probe": _probe()}, None)
    assert all(len(x) <= LINE_WIDTH for x in lines)
    table = lines[lines.index("### Rank ≈ 2: every reading side by side") :]
    # G1's E2: symmetric 20 values, sd = 0.002 * sqrt(35) = 0.01183, t_.975,19 = 2.093: half-width 0.0055 -> the
    # interval [0.94, 0.96] above 0.9 at both R: "yes"
    assert "| G1 (rows A_i g_i), E₂ (primary) | 0.95 [0.94, 0.96] (n 20) | 0.95 [0.94, 0.96] (n 20) | yes |" in table
    # erank 3.0 +- 0.028: outside [1.5, 2.5] at both R (the Bonferroni 97.5% interval too): "no at R = 4, 8"
    assert any(x.startswith("| G1 (rows A_i g_i), erank |") and x.endswith("| no at R = 4, 8 |") for x in table)
    assert any(x.startswith("| G2 q_proj (every layer), stable rank | 2.00 [1.94, 2.06]") for x in table)
    assert any(x.startswith("| G3 (rows = groups' updates), stable rank | 4.20 (n 20)") for x in table)
    # the control: A 2.00 against 2.60 under |A|, A + mean|A|, r, 1, one rollout; G3's missing weightings print –
    assert "| 4 | G2 q_proj (every layer) | 2.00 | 2.60 | 2.60 | 2.60 | 2.60 | 2.60 |" in table
    assert "| 8 | G3 (rows = groups' updates) | 4.20 | 4.00 | – | – | 4.00 | – |" in table
    assert "| 4 | G1 (rows A_i g_i) | 1.70 | – | – | – | 1.60 | – |" in table


def test_the_rank_figure_draws_what_the_verdict_tests():
    from grpo_lens.report.plots import MEASURE_ALT, verdict_measure

    # a probe whose summary has G1's E2 gets the E2 figure (the rank verdict's measure, boundary 0.9); an older
    # probe.json with erank only keeps the erank figure; one probe without E2 among several -> erank for all
    with_e2 = {"per_group_size": {"4": {"summary": {"rank/g1_top2_share": {"mean": 0.9}}}}}
    erank_only = {"per_group_size": {"4": {"summary": {"rank/g1_erank": {"mean": 2.0}}}}}
    assert verdict_measure({"p": with_e2}) == "top2_share" and "E2" in MEASURE_ALT["top2_share"]
    assert verdict_measure({"p": erank_only}) == "erank" == verdict_measure({"a": with_e2, "b": erank_only})
