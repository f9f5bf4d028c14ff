"""``probe --seeds``: one probe run directory per seed, the pooled probe.json over their groups, its report, resume.

Two seeds of the tiny model with the ``test_parity`` reward (tests/probe/test_probe.py's settings, R = 4 only)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
from test_probe import probe_config

from grpo_lens import metrics as mk
from grpo_lens.claims import evaluate_claims
from grpo_lens.config import ConfigError
from grpo_lens.probe.seeds import PoolingError, pool_probes, run_seeds, seed_dir

SEEDS = [0, 1]
ERANK = mk.RANK_G1.format(m="erank")


@pytest.fixture(scope="module")
def pooled_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("seeds") / "pooled"
    run_seeds(probe_config(out, group_sizes=[4], progress=False), SEEDS)
    return out


def _read(path):
    return json.loads(path.read_text())


@pytest.mark.e2e
def test_each_seed_is_a_probe_run_directory_and_the_groups_pool(pooled_dir):
    pooled = _read(pooled_dir / "probe.json")
    seeds = {s: _read(seed_dir(pooled_dir, s) / "probe.json") for s in SEEDS}
    for s, probe in seeds.items():
        assert probe["meta"]["config"]["seed"] == s and (seed_dir(pooled_dir, s) / "report.md").is_file()
    a, b = (seeds[s]["per_group_size"]["4"] for s in SEEDS)
    assert a[mk.PROBE_GROUPS] != b[mk.PROBE_GROUPS]  # the seeds drew other prompts and completions
    p = pooled["per_group_size"]["4"]
    # the pooled rows are seed 0's then seed 1's, unchanged; counts are sums
    assert p[mk.PROBE_GROUPS] == a[mk.PROBE_GROUPS] + b[mk.PROBE_GROUPS]
    assert p[mk.PROMPTS_SAMPLED] == a[mk.PROMPTS_SAMPLED] + b[mk.PROMPTS_SAMPLED] == 16
    assert p[mk.GROUPS_MIXED] == a[mk.GROUPS_MIXED] + b[mk.GROUPS_MIXED]
    assert pooled["seeds"]["per_group_size"]["4"]["group_seeds"] == [0] * a[mk.GROUPS_MIXED] + [1] * b[mk.GROUPS_MIXED]
    # the pooled mean is the groups-weighted mean of the seeds' means: (n_a m_a + n_b m_b) / (n_a + n_b)
    ma, mb = a[mk.PROBE_SUMMARY][ERANK], b[mk.PROBE_SUMMARY][ERANK]
    expected = (ma["n"] * ma["mean"] + mb["n"] * mb["mean"]) / (ma["n"] + mb["n"])
    assert p[mk.PROBE_SUMMARY][ERANK]["mean"] == pytest.approx(expected, rel=1e-12)
    assert p[mk.PROBE_SUMMARY][ERANK]["n"] == ma["n"] + mb["n"]
    spread = pooled["seeds"]["per_group_size"]["4"]["keys"][ERANK]
    assert spread["within"] == [ma, mb]
    assert spread["spread"]["per_seed"] == pytest.approx([ma["mean"], mb["mean"]], rel=1e-12)
    assert spread["spread"]["sd"] == pytest.approx(abs(ma["mean"] - mb["mean"]) / math.sqrt(2), rel=1e-9)
    assert spread["stratified"]["mean"] == pytest.approx(expected, rel=1e-12)
    # the studies pool their units: Monte Carlo rollouts and baseline prompts of both seeds
    mc = [len(seeds[s]["studies"]["credit"]["monte_carlo"]["rollouts"]) for s in SEEDS]
    assert len(pooled["studies"]["credit"]["monte_carlo"]["rollouts"]) == sum(mc)
    groups = [seeds[s]["studies"]["credit"]["contributions"]["groups"] for s in SEEDS]
    assert pooled["studies"]["credit"]["contributions"]["groups"] == sum(groups)
    prompts = [
        seeds[s]["studies"]["baselines"]["baselines"]["prompts"]
        for s in SEEDS
        if seeds[s]["studies"]["baselines"]["baselines"]
    ]
    if prompts:
        assert pooled["studies"]["baselines"]["baselines"]["prompts"] == sum(prompts)


@pytest.mark.e2e
def test_pooled_claims_and_report(pooled_dir):
    pooled = _read(pooled_dir / "probe.json")
    claims = evaluate_claims(pooled)  # the claims' public entry point decides on the pooled groups
    assert claims and all(c.scope for c in claims)
    report = (pooled_dir / "report.md").read_text()
    assert "## Seeds pooled" in report and "| seed 0 | seed 1 | seeds agreeing |" in report
    assert "seed as stratum" in report and f"`{ERANK}`" in report
    first = next(c for c in claims if c.scope == "R = 4")
    assert first.claim in report


@pytest.mark.e2e
def test_seeds_table_shows_the_verdicts_holm_decided(pooled_dir, monkeypatch):
    """The "Seeds pooled" table's pooled and per-seed verdicts are the claims table's, under Holm. Two tested rows:
    p does not hold 1e-4 and 0.02 (each below the 0.025 per branch alone: both read *does not hold* raw). Holm over
    their 4 hypotheses (the holds p are 1): 1e-4 <= 0.05/4 is rejected, then 0.02 > 0.05/3 = 0.0167 stops, so the
    second row is inconclusive. Before, the table printed the raw *does not hold* beside the claims table's
    inconclusive."""
    import grpo_lens.report.seeds as seeds_report
    from grpo_lens.claims.base import DOES_NOT_HOLD, INCONCLUSIVE

    template = next(c for c in evaluate_claims(_read(pooled_dir / "probe.json")) if c.kind == "claim")
    rows = [
        dataclasses.replace(template, claim=f"planted claim {i}", verdict=DOES_NOT_HOLD, p_holds=1.0, p_dnh=p)
        for i, p in enumerate((1e-4, 0.02))
    ]
    monkeypatch.setattr(seeds_report, "evaluate_claims", lambda probe: list(rows))
    table = [
        line for line in seeds_report.seeds_section(_read(pooled_dir / "probe.json"), pooled_dir) if "planted" in line
    ]
    assert [line.split(" | ")[2:5] for line in table] == [
        [f"**{DOES_NOT_HOLD}**", DOES_NOT_HOLD, DOES_NOT_HOLD],
        [f"**{INCONCLUSIVE}**", INCONCLUSIVE, INCONCLUSIVE],
    ]


@pytest.mark.e2e
def test_resume_keeps_finished_seeds_and_refuses_a_full_dir(pooled_dir):
    before = (pooled_dir / "probe.json").read_text()
    ran = []
    config = probe_config(pooled_dir, group_sizes=[4], progress=False)
    with pytest.raises(ConfigError, match="--resume"):
        run_seeds(config, SEEDS, run=ran.append)
    run_seeds(dataclasses.replace(config, resume=True), SEEDS, run=ran.append)
    assert ran == []  # both seeds finished: nothing measured again, the same pooled probe written
    assert (pooled_dir / "probe.json").read_text() == before
    changed = dataclasses.replace(config, resume=True, max_new_tokens=9)
    with pytest.raises(ConfigError, match="max_new_tokens 8 vs 9"):
        run_seeds(changed, SEEDS, run=ran.append)


@pytest.mark.e2e
def test_pooling_refuses_other_settings_and_one_seed(pooled_dir):
    probes = {s: _read(seed_dir(pooled_dir, s) / "probe.json") for s in SEEDS}
    other = copy.deepcopy(probes)
    other[1]["meta"]["config"]["temperature"] = 0.5
    with pytest.raises(PoolingError, match="temperature"):
        pool_probes(other)
    with pytest.raises(PoolingError, match="two seeds"):
        pool_probes({0: probes[0]})
    # probes written before the credit study kept per-group shares: its class summaries combine as strata
    old = copy.deepcopy(probes)
    for p in old.values():
        for k in ("shares", "shares_nll"):
            p["studies"]["credit"]["contributions"].pop(k)
    credit = pool_probes(old)["studies"]["credit"]["contributions"]
    checked = 0
    for cls, summaries in credit["classes"].items():
        for key, pooled in summaries.items():
            per_seed = [p["studies"]["credit"]["contributions"]["classes"][cls][key] for p in old.values()]
            have = [r for r in per_seed if r.get("mean") is not None]
            if not have:
                assert pooled["mean"] is None
                continue
            checked += 1  # the groups-weighted mean of the seeds' means
            expected = sum(r["n"] * r["mean"] for r in have) / sum(r["n"] for r in have)
            assert pooled["mean"] == pytest.approx(expected, rel=1e-12)
    assert checked, "no class had a share in either seed: the test's probe must measure one"
    assert "shares" not in credit and credit["groups"] == sum(
        p["studies"]["credit"]["contributions"]["groups"] for p in old.values()
    )
    with pytest.raises(ConfigError, match="two distinct seeds"):
        run_seeds(probe_config(pooled_dir), [3, 3])


@pytest.mark.e2e
def test_cli_resume_reads_the_pooled_dirs_settings(pooled_dir, capsys):
    from grpo_lens.cli import main

    before = _read(pooled_dir / "probe.json")
    # no flag but --seeds, --out, --resume: the settings come from OUT/config.yaml, both seeds are finished
    assert main(["probe", "--seeds", *map(str, SEEDS), "--out", str(pooled_dir), "--resume"]) == 0
    assert "pooled probe of seeds 0, 1" in capsys.readouterr().out
    assert _read(pooled_dir / "probe.json") == before


def test_cli_refuses_seed_with_seeds_and_one_seed(tmp_path, capsys):
    from grpo_lens.cli import main

    assert main(["probe", "--seeds", "0", "1", "--seed", "2", "--out", str(tmp_path / "a")]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["probe", "--seeds", "4", "--out", str(tmp_path / "b")]) == 2
    assert "at least two distinct seeds" in capsys.readouterr().err


def test_compare_pools_runs_that_differ_only_in_their_seed(tmp_path):
    """Three runs of one configuration, seeds 0, 1, 2, rewards constant 0.2, 0.4, 0.9: final means 0.2, 0.4, 0.9,
    their mean 0.5, SD over runs sqrt(((0.3)^2 + (0.1)^2 + (0.4)^2) / 2) = sqrt(0.13) = 0.360555."""
    import yaml

    from grpo_lens.report.compare import compare_runs

    def make(name, seed, reward, lr=1e-5):
        path = tmp_path / name
        path.mkdir()
        (path / "config.yaml").write_text(
            yaml.safe_dump(
                {
                    "task": "arithmetic",
                    "task_options": {},
                    "dataset": None,
                    "seed": seed,
                    "learning_rate": lr,
                    "out": str(path),
                }
            )
        )
        (path / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "reward/mean": reward}) + "\n" for s in range(1, 4))
        )
        return path

    runs = [make(f"s{s}", s, r) for s, r in zip((0, 1, 2), (0.2, 0.4, 0.9))]
    md = compare_runs(runs, tmp_path / "cmp").read_text()
    pooled = json.loads((tmp_path / "cmp" / "compare.json").read_text())["pooled_over_seeds"]["reward/mean"]
    assert pooled["per_run"] == pytest.approx([0.2, 0.4, 0.9]) and pooled["runs"] == 3
    assert pooled["mean"] == pytest.approx(0.5) and pooled["sd"] == pytest.approx(math.sqrt(0.13), rel=1e-9)
    assert "## Seeds pooled" in md and "0.361" in md
    other = make("lr", 3, 0.5, lr=1e-4)  # another setting too: not reruns, nothing pooled
    assert "## Seeds pooled" not in compare_runs([runs[0], other], tmp_path / "cmp2").read_text()


@pytest.mark.e2e
def test_cli_probe_seeds_without_studies(tmp_path, capsys):
    from grpo_lens.cli import main

    out = tmp_path / "pooled"
    argv = [
        "probe",
        "--seeds",
        "3",
        "4",
        "--out",
        str(out),
        "--model",
        "tiny",
        "--rewards",
        "test_parity",
        "--group-sizes",
        "2",
        "--prompts",
        "8",
        "--max-new-tokens",
        "6",
        "--baseline-study-prompts",
        "0",
        "--credit-groups",
        "0",
        "--g2-groups",
        "0",
        "--device",
        "cpu",
        "--no-progress",
    ]
    assert main(argv) == 0
    assert f"next: grpo-lens report {out}" in capsys.readouterr().out
    pooled = _read(out / "probe.json")
    assert pooled["meta"]["seeds"] == [3, 4] and pooled["studies"] == {}
    assert [_read(seed_dir(out, s) / "probe.json")["meta"]["config"]["seed"] for s in (3, 4)] == [3, 4]
    assert main(["report", str(out)]) == 0 and "## Seeds pooled" in (out / "report.md").read_text()
