"""The metric vocabulary (grpo_lens.metrics) is the one source of every key.

1. The tiny model through ``train`` (lens on; with KL, importance weights and soft overlong punishment; with
   ``--estimator optimal``; with ``--dynamic-sampling``) and through ``run_probe``: every key written to metrics.jsonl
   and to probe.json (group rows, summaries, strata, g3, g2_weightings, sketch_check, per-R fields, studies) is
   defined by an entry of its scope, and (the other way round) every entry of those scopes is written by one of the
   runs, except the few that need a condition the runs do not meet.
2. No module of the package outside grpo_lens/metrics/ holds a string literal or an f-string that looks like a key.
3. docs/metrics.md's tables are the generated ones, and every entry appears there.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from grpo_lens import metrics as mk
from grpo_lens.config import TrainConfig
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.run import run_probe
from grpo_lens.train.loop import train

ROOT = Path(__file__).resolve().parent.parent
REWARD_NAMES = {"test_parity"}  # the runs' reward function (tests/conftest.py)


# ---------------------------------------------------------------------------------------------------------------------
# The entries
# ---------------------------------------------------------------------------------------------------------------------
def test_every_entry_is_complete():
    titles, numbers = _theory_sections()
    for m in mk.METRICS:
        assert m.meaning and m.unit and m.section in mk.SECTIONS, m.key
        assert m.where and set(m.where) <= set(mk.SCOPES), m.key
        assert not (m.trl or m.verl) or mk.JSONL in m.where, f"{m.key}: TRL / verl names are for metrics.jsonl keys"
        if m.source:  # a docs/theory.md section: a number or a (sub)section title
            cite = m.source.removeprefix("§")
            assert cite in numbers or cite in titles, f"{m.key}: source {m.source} is no section of docs/theory.md"
    keys = [(m.key, scope) for m in mk.METRICS for scope in m.where]
    assert len(keys) == len(set(keys)), "a key is defined twice in one scope"


def test_placeholder_sets_agree_with_the_code_that_fills_them():
    from grpo_lens.analysis.group import parameter_category
    from grpo_lens.formulas.sparsity import (
        GRAD_MEASURES,
        LAYER_TYPES,
        UPDATE_MEASURES,
        sparsity_measures,
        update_sparsity,
    )
    from grpo_lens.formulas.spectrum import G1_CONTROLS, RANK_MEASURES
    from grpo_lens.formulas.zero_sum import WEIGHTINGS

    assert set(mk.RANK_MEASURE_NAMES) == set(RANK_MEASURES.names())
    assert mk.WEIGHTING_NAMES == WEIGHTINGS
    assert mk.LAYER_TYPE_NAMES == tuple(k for k, _ in LAYER_TYPES) + ("other",)
    assert mk.SPARSITY_MEASURES == {
        "update_step": UPDATE_MEASURES,
        "update_total": UPDATE_MEASURES,
        "grad": GRAD_MEASURES,
        "grad_total": GRAD_MEASURES,
    }
    # the names are declared in metrics; the functions that fill them must return exactly those keys
    before = torch.linspace(-1.0, 1.0, 64)
    after = before + torch.where(torch.arange(64) % 2 == 0, 0.1, 0.0)  # half the entries moved
    filled = update_sparsity(before, after, strata=torch.zeros(64, dtype=torch.long))
    assert set(filled) == set(mk.SPARSITY_MEASURES["update_step"])
    assert set(sparsity_measures(after - before)) == set(mk.SPARSITY_MEASURES["grad"])
    names = ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.up_proj.bias")
    assert {parameter_category(n, n.endswith(".weight") and "lm" in n) for n in names} == set(mk.PARAMETER_CATEGORIES)
    for matrix in (*G1_CONTROLS, "g1_layer", "g2", "g3", "g3_null", *(f"g3_{w}" for w in WEIGHTINGS[1:])):
        assert mk.rank_key(matrix, "erank") == f"rank/{matrix}_erank"


def test_templates_format_parse_and_expand():
    assert mk.RANK_G1.format(m="erank") == "rank/g1_erank"
    assert mk.RANK_G1_VS_NULL.parse("rank/g1_stable_rank_vs_null") == {"m": "stable_rank"}
    assert mk.RANK_G1.parse("rank/g1_null_erank") is None  # 'null_erank' is no rank measure
    assert mk.RANK_G2_WEIGHTED.parse("rank/g2_abs_down_proj_stable_rank") == {"w": "abs", "kind": "down_proj"}
    assert mk.REWARD_FUNCTION.format(name="my fn") == "reward/my fn"  # a free placeholder takes any text
    assert len(mk.RANK_G3_WEIGHTED.expand()) == 5 * 7  # the weightings but adv, times the rank measures
    assert "rank/g3_adv_erank" not in mk.RANK_G3_WEIGHTED.expand()
    assert mk.sparsity_key("grad", "hoyer", "mlp") == "sparsity/mlp/grad_hoyer"
    assert mk.zero_sum_key("cos_gap", "p") == mk.ZERO_SUM_COS_GAP_P
    with pytest.raises(ValueError, match="not one of"):
        mk.RANK_G1.format(m="rank")
    with pytest.raises(ValueError, match="takes m"):
        mk.RANK_G1.format(measure="erank")
    with pytest.raises(ValueError, match="free placeholder"):
        mk.REWARD_FUNCTION.expand()
    for bad in (
        lambda: mk.rank_key("g4", "erank"),
        lambda: mk.zero_sum_key("span", "p"),
        lambda: mk.sparsity_key("grad", "f32_unchanged"),
        lambda: mk.sketch_share_key("bias"),
    ):
        with pytest.raises(ValueError, match="not"):
            bad()
    # a plain key wins over a template that would also match it; a scope narrows the look-up
    assert mk.lookup("reward/mean")[0].key == "reward/mean" and mk.lookup("reward/format") == (
        mk.REWARD_FUNCTION,
        {"name": "format"},
    )
    assert mk.lookup("groups", mk.G3)[0] is not mk.lookup("groups", mk.PROBE)[0]
    assert mk.lookup("rank/g1_erank", mk.G3) is None


def test_s1_is_one_concept_under_several_names():
    # the five names of S1 keep their keys (no rename in this version); the vocabulary ties them together
    s1 = {m.key for m in mk.concepts()["S1"]}
    assert {
        "reward/frac_zero_std_groups",
        "dynamic/zero_var_frac_sampled",
        "dynamic/kept_frac_zero_std_groups",
        "s1_measured",
        "baselines.s1",
    } <= s1


# ---------------------------------------------------------------------------------------------------------------------
# 1. What the trainer and the probe write
# ---------------------------------------------------------------------------------------------------------------------
def _train_config(out, **overrides) -> TrainConfig:
    values = dict(
        model="tiny",
        rewards=["test_parity"],
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=8,
        max_steps=2,
        learning_rate=1e-2,
        mu=1,
        micro_batch_size=4,
        lens_every=1,
        seed=0,
        device="cpu",
        out=str(out),
        progress=False,
        save_final_model=False,
        log_completions=0,
        checkpoint_every=100,
    )
    values.update(overrides)
    return TrainConfig(**values)


#: (name, config overrides) of the training runs: between them every conditional key is written
TRAIN_RUNS = {
    "lens_kl_tis_overlong": dict(
        beta=0.1, tis_cap=2.0, overlong="soft-punish", overlong_buffer=4, mu=2, num_mini_batches=2
    ),
    "optimal": dict(estimator="optimal", eval_every=2, eval_prompts=2, eval_samples=1),
    "dynamic": dict(dynamic_sampling=True, seed=3),
    "kl_in_reward": dict(beta=0.1, kl_in_reward=True, lens_every=0),
}

#: entries neither the training runs nor the probe write, and why
NOT_WRITTEN = {
    "sketch/exact_share_other": "the tiny model has no parameter outside linear, embedding and norm",
    "reward/logged/{name}": "only a reward function calling log_metric writes it (test_run_integrity.py)",
    "rank/g1_{m}_lo": "the lens writes it from 8 mixed groups a step; tests/claims covers the function",
    "rank/g1_{m}_hi": "as rank/g1_{m}_lo",
    **{
        f"noise/{q}_{end}": "the lens writes it from 8 groups a step; tests/formulas/test_noise.py covers the function"
        for q in ("grad_sq", "trace_sigma", "b_simple")
        for end in ("lo", "hi")
    },
    **{
        f"noise/{k}": "only with --lens-noise-proxy: tests/train/test_diagnostics.py"
        for k in ("proxy_total_power", "exact_total_power", "proxy_rank_corr")
    },
    **{
        k: "only with --lens-landing / --lens-dead-kl: tests/train/test_landing.py"
        for k in (
            *(f"landing/{c}_{q}" for c in ("answer", "format", "reasoning") for q in ("share", "token_share")),
            "landing/positive_share",
            "landing/closure",
            "landing/tokens",
            "dead/kl_grad_norm",
            "dead/kl_grad_ratio",
            "perf/lens_landing_seconds",
        )
    },
}


@pytest.fixture(scope="module")
def train_records(tmp_path_factory):
    out = {}
    for name, overrides in TRAIN_RUNS.items():
        run = train(_train_config(tmp_path_factory.mktemp("train") / name, **overrides))
        out[name] = [r for r in run.read_metrics() if "step" in r]
    return out


def _undefined(keys, scope, free=None) -> list[str]:
    """The keys no entry of ``scope`` defines, or that fill a free placeholder with a value not in ``free``."""
    bad = []
    for key in keys:
        found = mk.lookup(key, scope)
        if found is None:
            bad.append(key)
        elif free is not None and any(
            v not in free.get(p, ()) for p, v in found[1].items() if found[0].values_of(p) is None
        ):
            bad.append(f"{key} (free value {found[1]})")
    return bad


def _entries_seen(keys, scope) -> set[str]:
    return {mk.lookup(k, scope)[0].key for k in keys if mk.lookup(k, scope) is not None}


@pytest.mark.e2e
def test_every_key_the_trainer_writes_is_defined(train_records):
    keys = {k for records in train_records.values() for r in records for k in r}
    assert not _undefined(keys, mk.JSONL, free={"name": REWARD_NAMES}), "keys the vocabulary does not define"
    assert all(records for records in train_records.values())
    # ... and every metrics.jsonl entry is written by one of the runs (no dead entries)
    unseen = {m.key for m in mk.METRICS if mk.JSONL in m.where} - _entries_seen(keys, mk.JSONL) - set(NOT_WRITTEN)
    assert not unseen, f"entries no run writes: {sorted(unseen)}"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    config = ProbeConfig(
        model="tiny",
        rewards=["test_parity"],
        group_sizes=[4],
        prompts=8,
        prompts_per_batch=4,
        max_new_tokens=8,
        baseline_prompts=1,
        resamples=32,
        random_draws=4,
        seed=0,
        device="cpu",
        out=str(tmp_path_factory.mktemp("probe") / "p"),
        study_group_size=2,
        baseline_study_prompts=2,
        credit_groups=1,
        mc_groups=1,
        mc_samples=2,
        progress=False,
    )
    return json.loads((run_probe(config) / "probe.json").read_text())


@pytest.mark.e2e
def test_every_key_the_probe_writes_is_defined(probe):
    seen: dict[str, set[str]] = {scope: set() for scope in mk.SCOPES}
    for per_r in probe["per_group_size"].values():
        assert not _undefined(per_r, mk.PROBE)
        seen[mk.PROBE] |= set(per_r)
        rows = list(per_r[mk.PROBE_GROUPS]) + [per_r[mk.PROBE_SUMMARY]]
        rows += [s for by in per_r[mk.PROBE_STRATA].values() for s in by.values()]
        for scope, part in ((mk.G2_WEIGHTINGS, mk.PROBE_G2_WEIGHTINGS), (mk.SKETCH_CHECK, mk.PROBE_SKETCH_CHECK)):
            assert per_r[part], f"{part} not written: the test's probe must write it"
            for row in [*per_r[part][mk.PROBE_GROUPS], per_r[part][mk.PROBE_SUMMARY]]:
                assert not _undefined(row, scope)
                seen[scope] |= set(row)
        for row in rows:
            assert not _undefined(row, mk.GROUPS)
            seen[mk.GROUPS] |= set(row)
        assert not _undefined(per_r[mk.PROBE_G3], mk.G3)
        seen[mk.G3] |= set(per_r[mk.PROBE_G3])
        for m in mk.METRICS:  # the objects with named fields hold only those
            value = per_r.get(m.key) if mk.PROBE in m.where else None
            if m.fields and isinstance(value, dict):
                assert set(value) <= set(m.fields), (m.key, sorted(set(value) - set(m.fields)))
    assert not _undefined(probe["meta"]["sketch_check"], mk.SKETCH_CHECK)
    for scope in (mk.GROUPS, mk.G3, mk.G2_WEIGHTINGS, mk.SKETCH_CHECK, mk.PROBE):
        unseen = {m.key for m in mk.METRICS if scope in m.where} - _entries_seen(seen[scope], scope) - set(NOT_WRITTEN)
        assert not unseen, f"{scope}: entries the probe does not write: {sorted(unseen)}"


@pytest.mark.e2e
def test_every_field_of_the_studies_is_defined(probe):
    entries = {m.key: m for m in mk.METRICS if mk.STUDIES in m.where}
    seen = set()

    def check(path: str, value) -> None:
        m = entries[path]
        seen.add(path)
        items = (value if isinstance(value, list) else list(value.values())) if m.each else [value]
        for item in items:
            assert set(item) <= set(m.fields), (path, sorted(set(item) - set(m.fields)))
        if not m.each:
            for field, sub in value.items():
                if f"{path}.{field}" in entries and sub:
                    check(f"{path}.{field}", sub)

    studies = probe["studies"]
    assert studies.get("baselines") and studies.get("credit"), "the test's probe must run both studies"
    for study, parts in studies.items():
        for part, value in parts.items():
            assert f"{study}.{part}" in entries, f"studies field {study}.{part} is not in the vocabulary"
            check(f"{study}.{part}", value)
    assert seen == set(entries), f"study entries the probe does not write: {sorted(set(entries) - seen)}"


# ---------------------------------------------------------------------------------------------------------------------
# 2. No key literals outside grpo_lens/metrics/
# ---------------------------------------------------------------------------------------------------------------------
#: A string that looks like a metric key: a vocabulary prefix and a slash (``"rank/"``, ``"reward/mean"``).
KEY_LIKE = re.compile(rf"(?:{'|'.join(mk.PREFIXES)})/[\w<>{{}}/.-]*")

#: probe.json fields whose names are distinctive enough to spot as literals (S1 and the group counts).
FIELD_NAMES = {m.key for m in mk.METRICS if mk.PROBE in m.where and m.key.startswith(("s1_", "groups_"))}


def key_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal or f-string in ``source`` that looks like a metric key, in line order."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if KEY_LIKE.fullmatch(node.value) or node.value in FIELD_NAMES:
                out.add((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            head = str(node.values[0].value)
            if any(head.startswith(f"{p}/") for p in mk.PREFIXES):
                out.add((node.lineno, f"f{head!r}..."))
    return sorted(out)


def test_the_scan_sees_key_literals():
    found = key_literals(
        'a = {"reward/mean": 1}\nb = f"rank/{m}_x"\nc = "sparsity/" + t\nd = r["s1_measured"]\n'
        'e = "nats/token"\nf = f"{out}/probe.json"\n'
    )
    assert sorted({line for line, _ in found}) == [1, 2, 3, 4]


def test_no_metric_key_literal_outside_the_vocabulary():
    bad = []
    for path in sorted((ROOT / "grpo_lens").rglob("*.py")):
        if path.parent == ROOT / "grpo_lens" / "metrics":
            continue
        bad += [f"{path.relative_to(ROOT)}:{line}: {text}" for line, text in key_literals(path.read_text())]
    assert not bad, "metric keys written as literals (use grpo_lens.metrics):\n" + "\n".join(bad)


# ---------------------------------------------------------------------------------------------------------------------
# 3. docs/metrics.md
# ---------------------------------------------------------------------------------------------------------------------
def test_metrics_doc_is_generated_from_the_vocabulary():
    # what tools/update_docs.py --check tests (in process: no command, so a pure test): every table is the one the
    # registry generates and every section has its markers; run `.venv/bin/python tools/update_docs.py` to regenerate
    spec = importlib.util.spec_from_file_location("update_docs", ROOT / "tools" / "update_docs.py")
    update_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(update_docs)
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf8")
    assert update_docs.updated(text) == text, "docs/metrics.md is out of date: run tools/update_docs.py"
    missing = [n for m in mk.METRICS for n in m.display() if f"`{n}`" not in text]
    assert not missing, f"entries docs/metrics.md does not show: {missing}"


def _theory_sections() -> tuple[set[str], set[str]]:
    """(titles, numbers) of docs/theory.md's sections and subsections (a title without its parenthesis or what
    follows a colon)."""
    titles, numbers = set(), set()
    for heading in re.findall(r"^#{2,3} (.*)$", (ROOT / "docs" / "theory.md").read_text(encoding="utf8"), re.M):
        num = re.match(r"(\d+)\. (.*)", heading)
        if num:
            numbers.add(num.group(1))
            heading = num.group(2)
        titles.add(re.split(r"[:(]", heading)[0].strip())
    return titles, numbers


def test_trl_and_verl_names_map_one_to_one_and_round_trip():
    """Each TRL / verl name belongs to one key; TRL's logged dict reads back into ours except where the definitions
    differ (reward_std is TRL's sample std, ours the population std)."""
    for scheme in ("trl", "verl"):
        names = [getattr(m, scheme) for m in mk.METRICS if getattr(m, scheme)]
        assert len(names) == len(set(names)), scheme
    assert mk.other_name(mk.REWARD_FUNCTION.format(name="fmt"), "trl") == "rewards/fmt/mean"
    assert mk.other_name(mk.rank_key("g1", "erank"), "trl") is None
    logs = {
        "reward": 0.5,
        "reward_std": 0.4,
        "rewards/fmt/mean": 0.25,
        "grad_norm": 3.0,
        "learning_rate": 1e-6,
        "num_tokens": 99.0,
    }
    assert mk.from_trl(logs) == {
        mk.REWARD_MEAN: 0.5,
        mk.REWARD_FUNCTION.format(name="fmt"): 0.25,
        mk.GRAD_NORM: 3.0,
        mk.LR: 1e-6,
    }
    record = {mk.REWARD_MEAN: 0.5, mk.STEP: 3, mk.RANK_MIXED_GROUPS: 2.0}
    assert mk.renamed_record(record, "trl") == {"reward": 0.5, mk.STEP: 3, mk.RANK_MIXED_GROUPS: 2.0}
    with pytest.raises(ValueError, match="valid names"):
        mk.other_name(mk.REWARD_MEAN, "openrlhf")
