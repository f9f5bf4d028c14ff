"""`grpo-lens calibrate`: planted groups with one truth each, through the product's path; `--planted`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from grpo_lens.calibrate import (
    CalibrationConfig,
    PlantedFileError,
    analysed_pool,
    boundary_noise,
    planted_group,
    population_shares,
    probe_of,
    render,
    rule_levels,
    run_calibration,
    run_planted,
)
from grpo_lens.claims.base import CLAIMS, DOES_NOT_HOLD, HOLDS, INCONCLUSIVE
from grpo_lens.formulas.spectrum import gram_singular_values, top2_share


def test_planted_groups_have_their_structure():
    gen = torch.Generator().manual_seed(0)
    # a0.001: exact rank 2 plus 0.1% noise: the Gram's top two eigen-directions hold > 0.99 of its energy
    gram, rewards = planted_group("a0.001", 8, 2048, gen)
    assert gram.shape == (8, 8) and 1 <= int(rewards.sum()) <= 7
    assert top2_share(gram_singular_values(gram)) > 0.99
    # b0: random directions in R^2048, unit expected norms: off-diagonal cosines ~ N(0, 1/2048), |cos| < 0.15
    gram, _ = planted_group("b0", 8, 2048, gen)
    d = gram.diagonal().sqrt()
    cos = gram / torch.outer(d, d) - torch.eye(8, dtype=torch.float64)
    assert float(cos.abs().max()) < 0.15 and float(d.square().mean()) == pytest.approx(1.0, abs=0.15)
    # c_shared: pairwise cosine 0.5 (half of each row's energy in the shared direction)
    gram, _ = planted_group("c_shared", 8, 2048, gen)
    d = gram.diagonal().sqrt()
    off = (gram / torch.outer(d, d))[~torch.eye(8, dtype=torch.bool)]
    assert float(off.mean()) == pytest.approx(0.5, abs=0.05)
    # d0.5_0.001: a correct and a wrong rollout's gradients at cosine 0.5 (noise 0.1% of the energy: +-0.05)
    gram, rewards = planted_group("d0.5_0.001", 4, 2048, gen)
    i, j = int(rewards.argmax()), int(rewards.argmin())
    assert float(gram[i, j] / (gram[i, i] * gram[j, j]).sqrt()) == pytest.approx(0.5, abs=0.05)
    # n2_0.001: wrong rollouts' gradients 2x longer: squared norms 4 against 1 (noise +-0.01 of each)
    assert float(gram.diagonal()[j] / gram.diagonal()[i]) == pytest.approx(1.0, abs=0.05)
    gram, rewards = planted_group("n2_0.001", 4, 2048, gen)
    sq = gram.diagonal()
    assert float(sq[rewards == 0].mean() / sq[rewards == 1].mean()) == pytest.approx(4.0, rel=0.02)
    with pytest.raises(ValueError, match="valid"):
        planted_group("zz", 4, 64, gen)


def test_population_truths_and_the_boundary():
    # rank 2 + 1% noise at R = 8: E2 ~ 0.99 > 0.9 > E1 ~ 0.71 (the class sizes set E1: k ~ U{1..7}); one shared
    # direction with 95% of the energy: E1 ~ 0.97 > 0.9 (rank 1, not 2); the tuned boundary family has E2 = 0.9
    e2, e1 = population_shares("a0.01", 8, size=400)
    assert e2 > 0.98 and 0.6 < e1 < 0.8
    e2, e1 = population_shares("r1_0.05", 4, size=400)
    assert e1 > 0.95
    f = boundary_noise(4, size=400)
    assert population_shares("boundary", 4, f, size=400)[0] == pytest.approx(0.9, abs=0.002)


def test_rank_rule_counts_rank_two_with_noise_as_rank_two():
    # the 0.2 calibration labelled rank 2 + 1% noise "false" for erank (its mean 2.9 at R = 8 lies outside [1.5,
    # 2.5]) and counted erank's "does not hold" there as power; under one truth that verdict is wrong. The primary
    # rule (E2 > 0.9 > E1 with structure) holds on it at n = 16 per R, and erank is printed, not decided
    pools = {r: analysed_pool("a0.01", r, 40, 2048, seed=r) for r in (4, 8)}
    (c,) = CLAIMS.get("rank_two_top2_share")(probe_of({r: pools[r][:16] for r in (4, 8)}, 2048))
    assert c.verdict == HOLDS and c.n == 16 and c.p_holds < 0.025
    assert "erank 2.9" in c.measurement or "erank 3.0" in c.measurement or "erank 2.8" in c.measurement
    # 8 groups per R: below MIN_RANK_GROUPS (a sample of 8 can miss a k stratum) -> inconclusive, with the flag
    (c,) = CLAIMS.get("rank_two_top2_share")(probe_of({r: pools[r][:8] for r in (4, 8)}, 2048))
    assert c.verdict == "inconclusive" and "--prompts" in c.advice
    # isotropic rows with log-normal norms (no structure: G1 is a draw of its simulated null, d = 0 exactly in
    # population): never holds (p of d > 0 near 0.5 and above); E2 0.91 [0.88, 0.94] at R = 4 straddles 0.9 and d sits
    # on the one structure boundary, so nothing shows *does not hold* either: inconclusive
    iso = {r: analysed_pool("b1", r, 16, 2048, seed=r) for r in (4, 8)}
    (c,) = CLAIMS.get("rank_two_top2_share")(probe_of(iso, 2048))
    assert c.verdict == INCONCLUSIVE and c.p_holds > 0.3
    # equal norms, isotropic: E2 = top 2 of the A_i²-weighted near-orthogonal rows, 0.83 / 0.5 / 0.83 at k = 1 / 2 /
    # 3 for R = 4: below 0.9 -> does not hold
    iso = {r: analysed_pool("b0", r, 16, 2048, seed=r) for r in (4, 8)}
    (c,) = CLAIMS.get("rank_two_top2_share")(probe_of(iso, 2048))
    assert c.verdict == DOES_NOT_HOLD and "E2 below 0.9" in c.rule


def test_mechanism_reads_directions_not_norms():
    # isotropic rows whose wrong rollouts are 2x longer: the labels change the norms only; on the cosine Gram theta
    # is ~0, so the mechanism row reads does not hold (the 0.2 span energy on the raw Gram had an excess > 0)
    pools = {r: analysed_pool("bn2", r, 16, 2048, seed=3 + r) for r in (4, 8)}
    (c,) = CLAIMS.get("zero_sum_rank_two")(probe_of(pools, 2048))
    assert c.verdict == DOES_NOT_HOLD
    pools = {r: analysed_pool("a0.01", r, 16, 2048, seed=5 + r) for r in (4, 8)}
    (c,) = CLAIMS.get("zero_sum_rank_two")(probe_of(pools, 2048))
    assert c.verdict == HOLDS


def test_label_families_plant_duplicates_and_rare_information():
    from grpo_lens.formulas.zero_sum import distinct_rows

    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        # dupC: the k correct rollouts share one gradient (one string), the wrong ones are distinct: k' = 1 remains
        gram, rewards = planted_group("dupC", 8, 2048, gen)
        keep = distinct_rows(gram, rewards)
        assert int(rewards[keep].sum()) == 1 and len(keep) == 8 - int(rewards.sum()) + 1
        # dupW: the wrong rollouts share one gradient
        gram, rewards = planted_group("dupW", 8, 2048, gen)
        keep = distinct_rows(gram, rewards)
        assert int((rewards[keep] == 0).sum()) == 1 and len(keep) == int(rewards.sum()) + 1
        # e2: exact rank 2, cosine 1 within a class, 0 across, norms distinct (no rollout merged)
        gram, rewards = planted_group("e2", 4, 2048, gen)
        d = gram.diagonal().sqrt()
        cos = gram / torch.outer(d, d)
        same = rewards[:, None] == rewards[None, :]
        assert torch.allclose(cos[same], torch.ones(()).double()) and float(cos[~same].abs().max()) < 1e-12
        assert len(distinct_rows(gram, rewards)) == 4
    # mix0.01: per group a coin: rank 2 + 1% noise (top-2 share > 0.97) or isotropic (< 0.8 at R = 8)
    shares = [top2_share(gram_singular_values(planted_group("mix0.01", 8, 2048, gen)[0])) for _ in range(40)]
    assert all(s > 0.97 or s < 0.8 for s in shares) and 10 <= sum(s > 0.97 for s in shares) <= 30


def test_duplicate_completions_do_not_read_as_label_structure():
    # every correct rollout one string, wrong rollouts isotropic: the relabelling test once split the
    # duplicates and read *holds* in 0.80 of trials at R = 4; merged, θ ≈ 0 and the row reads does not hold
    pools = {r: analysed_pool("dupC", r, 16, 2048, seed=11 + r) for r in (4, 8)}
    (c,) = CLAIMS.get("zero_sum_rank_two")(probe_of(pools, 2048))
    assert c.verdict == DOES_NOT_HOLD


def test_tiny_calibration_writes_its_table_and_levels(tmp_path):
    cfg = CalibrationConfig(
        trials=6,
        pool=30,
        coverage_trials=50,
        families=("a0.01", "bn2"),
        group_cells=(16,),
        s4_families=(),
        mc_families={},
        baseline_families={},
        training=False,
        workers=1,
    )
    res = run_calibration(cfg, tmp_path, mode="quick", log=lambda s: None)
    assert (tmp_path / "calibration.md").read_text() == render(res)
    levels = json.loads((tmp_path / "levels.json").read_text())
    assert levels == json.loads(json.dumps(rule_levels(res)))
    rank = levels["rank ≈ 2 (E2, across R)"]["16"]
    # two families, one true (a0.01): the level is the worst wrong share of both, the power a0.01's holds share
    rows = [r for r in res["group_rules"] if r["rule"] == "rank ≈ 2 (E2, across R)"]
    assert rank["families"] == 2 and rank["power"] == next(r["holds"] for r in rows if r["family"] == "a0.01")
    # the does-not-hold branch's power: its share on the one false family (bn2), named
    assert rank["power_dnh"] == next(r["does_not_hold"] for r in rows if r["family"] == "bn2")
    assert rank["power_dnh_family"] == "bn2"
    assert rank["level"] == max(r["holds"] if r["truth"] == "false" else r["does_not_hold"] for r in rows)
    assert "Worst level over every rule and family" in render(res)


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


def test_planted_file_runs_the_probe_path(tmp_path):
    gen = torch.Generator().manual_seed(0)
    grams, rewards = zip(*(planted_group("a0.01", 4, 2048, gen) for _ in range(2 * 16)))
    path = _npz(
        tmp_path / "p.npz",
        gram=torch.stack(grams).view(2, 16, 4, 4).numpy(),
        rewards=torch.stack(rewards).view(2, 16, 4).numpy(),
        dim=np.array(2048),
    )
    res = run_planted(path, tmp_path / "out", log=lambda s: None)
    got = json.loads((tmp_path / "out" / "planted.json").read_text())
    assert got == res and {r["claim"] for r in res} == {"rank_two_top2_share", "zero_sum_rank_two"}
    for r in res:
        assert (
            r["R"] == 4 and r["trials"] == 2 and math.isclose(r["holds"] + r["does_not_hold"] + r["inconclusive"], 1.0)
        )
    assert next(r for r in res if r["claim"] == "rank_two_top2_share")["holds"] == 1.0


@pytest.mark.parametrize(
    "arrays, name",
    [
        ({"rewards": np.zeros((2, 3, 4))}, "'gram' is missing"),
        ({"gram": np.zeros((2, 3, 4)), "rewards": np.zeros((2, 3, 4))}, "'gram' has shape [2, 3, 4]"),
        ({"gram": np.zeros((2, 3, 4, 4), dtype=np.float32), "rewards": np.zeros((2, 3, 4))}, "'gram' has dtype"),
        ({"gram": np.zeros((2, 3, 4, 4)), "rewards": np.zeros((2, 3))}, "'rewards' has shape [2, 3]; expected"),
        ({"gram": np.zeros((2, 3, 4, 4)), "rewards": np.zeros((2, 3, 4)), "dim": np.array(2)}, "'dim'"),
    ],
)
def test_malformed_planted_file_is_one_line_and_writes_nothing(tmp_path, arrays, name):
    path = _npz(tmp_path / "bad.npz", **arrays)
    with pytest.raises(PlantedFileError) as e:
        run_planted(path, tmp_path / "out", log=lambda s: None)
    assert name in str(e.value) and "\n" not in str(e.value) and "expected" in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_calibrate_command_planted_error(tmp_path, capsys):
    from grpo_lens.cli import main

    path = _npz(tmp_path / "bad.npz", rewards=np.zeros((1, 2, 4)))
    assert main(["calibrate", "--planted", str(path), "--out", str(tmp_path / "cal")]) == 2
    assert "'gram' is missing" in capsys.readouterr().err and not (tmp_path / "cal").exists()


def test_report_reads_the_calibrated_cell_at_the_rows_n():
    from grpo_lens.claims.base import Claim
    from grpo_lens.report import _calibrated, level_at

    levels = {
        "rule": {
            "8": {"level": 0.01, "power": 0.3, "unit": "groups per R"},
            "16": {"level": 0.02, "power": 0.85, "power_dnh": 0.4, "unit": "groups per R"},
            "22": {"level": 0.0, "power": 0.97, "unit": "groups per R"},
        }
    }
    # the largest calibrated n <= the row's n: 20 -> 16, 30 -> 22; below every cell -> the smallest, flagged
    assert level_at(levels, "rule", 20)["n"] == "16" and level_at(levels, "rule", 30)["n"] == "22"
    assert level_at(levels, "rule", 5) == {**levels["rule"]["8"], "n": "8", "below": True}
    assert level_at(levels, "other", 16) is None
    row = Claim("c", "s", "m", "n", "holds", "r", "src", n=20, p_holds=0.001, p_dnh=1.0, rule_id="rule")
    assert _calibrated(row, levels) == "level 0.020, power of *holds* 0.85 (n = 16 groups per R)"
    # a *does not hold* row prints its own branch's power (0.4), not the holds branch's (0.85)
    dnh = Claim("c", "s", "m", "n", "does not hold", "r", "src", n=20, p_holds=1.0, p_dnh=0.001, rule_id="rule")
    assert _calibrated(dnh, levels) == "level 0.020, power of *does not hold* 0.40 (n = 16 groups per R)"
    und = Claim("c", "s", "m", "n", "inconclusive", "r", "src", n=30, p_holds=0.5, p_dnh=0.5, rule_id="rule")
    assert _calibrated(und, levels) == "level 0.000, power holds 0.97, does not hold – (n = 22 groups per R)"
    assert _calibrated(Claim("c", "s", "m", "n", "holds", "r", "src", rule_id="x"), levels) == "not calibrated"


# --- the baseline's false families, budgets, Holm over the primaries ----------------------
def test_baseline_families_plant_their_norm_ratio():
    from grpo_lens.calibrate import BASELINE_FAMILIES, baseline_noise_scale, planted_norm_ratio, planted_prompt

    # m_C = 1/4 + s², m_W = 1/4 + 1: s² = 1.25 r − 1/4, so r = 0.5 -> s² = 0.375, r = 0.7 -> s² = 0.625
    assert baseline_noise_scale(0.5) ** 2 == pytest.approx(0.375) and baseline_noise_scale(0.7) ** 2 == pytest.approx(
        0.625
    )
    with pytest.raises(ValueError, match="must be above 0.2"):
        baseline_noise_scale(0.2)
    assert planted_norm_ratio("m_C = 1.25 m_W on every prompt (the margin: not inside it)") == pytest.approx(1.25)
    assert planted_norm_ratio("correct rollouts' noise 2× (m_C = 3.4 m_W)") == pytest.approx(3.4)
    gen = torch.Generator().manual_seed(0)
    mu = torch.randn(64, generator=gen, dtype=torch.float64)
    mu = mu / mu.norm()
    for fam, ratio in (
        ("m_C = 0.5 m_W (equal spreads)", 0.5),
        ("m_C = 0.7 m_W, the correct rollouts' norms spread wider", 0.7),
        ("m_C = m_W, the correct rollouts' norms spread wider (equal means)", 1.0),
    ):
        assert planted_norm_ratio(fam) == pytest.approx(ratio)
        # the population m_C / m_W of planted prompts (means of ‖g‖² over 300 prompts × 16 rollouts, about 2400 per
        # class): the ratio's SE is about 0.03 under the spread's Exponential(1) scales; 0.5 against 0.7 is 7 SEs
        sq = {1.0: [], 0.0: []}
        for _ in range(300):
            g, r = planted_prompt(fam, mu, gen)
            for cls in sq:
                sq[cls] += g[r == cls].square().sum(-1).tolist()
        m_c, m_w = (sum(v) / len(v) for v in (sq[1.0], sq[0.0]))
        assert m_w == pytest.approx(1.25, rel=0.05) and m_c / m_w == pytest.approx(ratio, abs=0.08)
        assert BASELINE_FAMILIES[fam][0] is (abs(math.log(ratio)) < math.log(1.25))


def _row(rule, fam, n, truth, holds, dnh, p=None):
    return {
        "rule": rule,
        "family": fam,
        "n": n,
        "unit": "u",
        "truth": truth,
        "holds": holds,
        "does_not_hold": dnh,
        "p": p,
    }


def test_power_dnh_skips_families_on_the_margin_and_budgets_find_the_first_n():
    from grpo_lens.calibrate import budget, rule_budgets

    rows = [
        _row("r", "true fam", 8, "true", 0.5, 0.0),
        _row("r", "true fam", 16, "true", 0.85, 0.0),
        _row("r", "false fam", 8, "false", 0.01, 0.9),
        _row("r", "m = 1.25 (the margin: not inside it)", 8, "false", 0.04, 0.02),
        _row("r", "false fam", 16, "false", 0.0, 0.6),
        _row("r", "boundary", 16, "false", 0.03, 0.01),
    ]
    levels = rule_levels({"baseline_rules": rows})["r"]
    # *does not hold* power: the false families off the margin only (0.9 at 8, 0.6 at 16); level over every family
    assert levels["8"]["power_dnh"] == 0.9 and levels["8"]["power_dnh_family"] == "false fam"
    assert levels["16"]["power_dnh"] == 0.6 and levels["8"]["level"] == 0.04 and levels["16"]["level"] == 0.03
    assert budget(levels, "power") == "16" and budget(levels, "power_dnh") == "8"
    b = rule_budgets({"r": levels})["r"]
    assert b["holds"] == "16" and b["does_not_hold"] == "8" and b["level"] == 0.03 and b["largest"] == "16"
    assert budget({"8": {"power": 0.79}}, "power") is None


def test_holm_verdicts_step_down():
    from grpo_lens.calibrate import holm_verdicts

    # 6 one-sided hypotheses at 0.05: sorted, p_(1) = 0.001 <= 0.05/6, p_(2) = 0.009 <= 0.05/5 = 0.01 (Holm rejects;
    # Bonferroni's 0.05/6 = 0.0083 would not), p_(3) = 0.3 > 0.05/4 stops
    pairs = [(0.001, 0.9), (0.5, 0.009), (0.3, 0.5)]
    assert holm_verdicts(pairs) == [HOLDS, DOES_NOT_HOLD, INCONCLUSIVE]
    assert holm_verdicts([(0.001, 0.9), (0.5, 0.0095), (0.011, 0.5)]) == [HOLDS, DOES_NOT_HOLD, HOLDS]
    assert holm_verdicts([(0.02, 0.9)]) == [HOLDS]  # one rule: 2 hypotheses, 0.02 <= 0.05/2


def test_holm_summary_counts_joint_wrong_verdicts():
    from grpo_lens.calibrate import holm_summary
    from grpo_lens.claims.rank import RULE_ID as RANK
    from grpo_lens.claims.zero_sum import RULE_ID as LABELS

    # two primaries, 4 joint trials. rank: its false family reads holds in trial 0 only (p 0.001 <= 0.05/4);
    # labels: its false family in trial 1 only; any wrong verdict in 2 of 4 tables -> family-wise level 0.5
    ok, wrong = [0.9, 0.001], [0.001, 0.9]
    rows = [
        _row(RANK, "t", 16, "true", 1.0, 0.0, [wrong] * 4),
        _row(RANK, "f", 16, "false", 0.25, 0.75, [wrong, ok, ok, ok]),
        _row(LABELS, "t", 16, "true", 0.75, 0.0, [wrong, wrong, wrong, [0.5, 0.5]]),
        _row(LABELS, "f", 16, "false", 0.25, 0.75, [ok, wrong, ok, ok]),
    ]
    result = {"group_rules": rows}
    hs = holm_summary({**result, "levels": rule_levels(result)}, rows)
    assert hs["level"] == 0.5 and set(hs["primaries"]) == {"rank ≈ 2", "labels structure G1"}
    # power under Holm, each on its true family: rank holds in 4 of 4; labels 3 of 4 (its last trial has p 0.5)
    assert hs["primaries"]["rank ≈ 2"]["power"] == 1.0 and hs["primaries"]["labels structure G1"]["power"] == 0.75
    assert hs["primaries"]["rank ≈ 2"]["n"] == "16" and hs["primaries"]["rank ≈ 2"]["worst_false"] == "f"


def test_shipped_levels_give_both_branches_power_for_every_primary_group_rule():
    # the shipped levels.json (a copy of a full run's) carries power_dnh for the labels and baseline
    # rules, not only rank, so a *does not hold* row prints its branch's power and the family where it is lowest
    # instead of "–"; every power is a share of 200 trials (a multiple of 0.005 in [0, 1])
    from grpo_lens.claims.base import Claim
    from grpo_lens.claims.baselines import RULE_ID as BASELINE
    from grpo_lens.claims.rank import RULE_ID as RANK
    from grpo_lens.claims.zero_sum import RULE_ID as LABELS
    from grpo_lens.report import _calibrated, load_levels

    levels = load_levels()
    for rule in (RANK, LABELS, BASELINE):
        cells = levels[rule]
        assert len(cells) >= 4, rule  # the wider grid: at least 4 calibrated n
        for n, cell in cells.items():
            for key in ("power", "power_dnh", "level"):
                assert 0.0 <= cell[key] <= 1.0 and round(cell[key] * 200, 6) % 1 == 0, (rule, n, key)
            assert cell["power_dnh_family"], (rule, n)
        n = max(cells, key=int)
        dnh = Claim("c", "s", "m", "n", "does not hold", "r", "src", n=int(n), p_holds=1.0, p_dnh=0.001, rule_id=rule)
        text = _calibrated(dnh, levels)
        assert f"power of *does not hold* {cells[n]['power_dnh']:.2f} (lowest at " in text and "–" not in text
