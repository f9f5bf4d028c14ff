"""The probe's fast paths against their readable references (STYLE.md §9), and its shared (nested) draws.

- Batched: many groups' gradients from one block-diagonal backward (``analyse_prompts`` / ``measure_groups``) against a
  backward per group (``per_group_passes``, ``analyse_prompt`` / ``measure_group``): on the same draws every number
  of probe.json agrees to 1e-10 (relative) in float64, with the exact Gram and with the sketch. A block mask that let
  another group's rows into a group's Gram, or a wrong row offset for a G2 capture, changes ranks by far more.
- Shared draws: every R reads the same prompts, and R's group is the first R of the prompt's rollouts (nested, so
  paired across R); ``independent_draws`` keeps the per-R batches seeded by (seed, R, batch) of before.
"""

from __future__ import annotations

import copy
import json
import math

import pytest

import grpo_lens.probe.estimate as probe_module
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.draws import DrawBatch, batch_seed, draw_plan
from grpo_lens.probe.gradient_sources import pass_chunks
from grpo_lens.probe.run import run_probe

pytestmark = pytest.mark.e2e

TOL = 1e-10
# wall times and what this process did (a per-group probe runs more passes): not numbers of the probe
SKIP = ("seconds", "studies_seconds", "timing", "out", "per_group_passes")


def config(out, **overrides) -> ProbeConfig:
    values = dict(
        model="tiny",
        rewards=["test_parity"],
        group_sizes=[2, 4],
        prompts=8,
        prompts_per_batch=4,
        max_new_tokens=6,
        baseline_prompts=2,
        resamples=16,
        random_draws=2,
        seed=1,
        device="cpu",
        out=str(out),
        study_group_size=2,
        baseline_study_prompts=0,
        credit_groups=0,
        g2_groups=3,
        coverage_groups=1,
        progress=False,
    )
    values.update(overrides)
    return ProbeConfig(**values)


def assert_close(a, b, path="") -> None:
    """Same structure; numbers equal to TOL relative, plus 1e-14 absolute for quantities that are 0 but for float64
    rounding (e.g. a cosine gap of 1e-18)."""
    if isinstance(a, dict):
        keys = {k for k in a if k not in SKIP}
        assert keys == {k for k in b if k not in SKIP}, path
        for k in keys:
            assert_close(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            assert math.isnan(a) and math.isnan(b), path
        else:
            assert abs(a - b) <= TOL * max(abs(a), abs(b)) + 1e-14, (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.fixture(scope="module")
def float64_model(tiny_model_and_tokenizer):
    model, tokenizer = copy.deepcopy(tiny_model_and_tokenizer)
    return model.double(), tokenizer


@pytest.mark.parametrize("gram_source", ["exact", "sketch"])
def test_batched_probe_equals_per_group_passes(tmp_path, float64_model, gram_source):
    model, tokenizer = float64_model
    passes = []
    original = probe_module.measure_groups

    def counting(policy, tok, batch, jobs, *args, **kwargs):
        passes.append(len(jobs))
        return original(policy, tok, batch, jobs, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe_module, "measure_groups", counting)
        fast = run_probe(config(tmp_path / "fast", gram_source=gram_source), policy=model, tokenizer=tokenizer)
    slow = run_probe(
        config(tmp_path / "slow", gram_source=gram_source, per_group_passes=True), policy=model, tokenizer=tokenizer
    )
    a, b = (json.loads((p / "probe.json").read_text()) for p in (fast, slow))
    mixed = sum(d["groups_mixed"] for d in a["per_group_size"].values())
    assert mixed >= 6 and max(passes) >= 2  # several groups shared a backward
    assert a["meta"]["config"]["per_group_passes"] is False and b["meta"]["config"]["per_group_passes"] is True
    assert_close(a, b)
    if gram_source == "exact":  # the G2 weightings and the sketch check rode the batched pass too
        assert a["per_group_size"]["2"]["g2_weightings"]["groups"] and a["per_group_size"]["2"]["sketch_check"]


def test_nested_draws_share_prompts_and_rollouts(tmp_path, tiny_model_and_tokenizer):
    """Shared draws: R = 2's group of a prompt is the first 2 of the rollouts R = 4 analyses (same completions,
    rewards and so the same first-two advantages' signs); independent draws sample each R apart."""
    model, tokenizer = tiny_model_and_tokenizer
    seen: dict[int, list] = {2: [], 4: []}
    original = probe_module.analyse_prompts

    def recording(policy, tok, drawn, first, *args, **kwargs):
        M, R = drawn.rewards.shape[1], drawn.group_size
        seen[R].extend(drawn.batch.completions[j * M : j * M + R] for j in range(first, drawn.rewards.shape[0]))
        return original(policy, tok, drawn, first, *args, **kwargs)

    for independent in (False, True):
        seen = {2: [], 4: []}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(probe_module, "analyse_prompts", recording)
            out = run_probe(
                config(
                    tmp_path / str(independent),
                    gram_source="sketch",
                    independent_draws=independent,
                    g2_groups=0,
                    baseline_prompts=0,
                    coverage_groups=0,
                ),
                policy=model,
                tokenizer=tokenizer,
            )
        nested = [c4[:2] == c2 for c2, c4 in zip(seen[2], seen[4])]
        assert len(nested) == 8
        assert all(nested) != independent
        meta = json.loads((out / "probe.json").read_text())["meta"]
        assert meta["draws"] == ("independent" if independent else "nested")
        assert meta["config"]["independent_draws"] is independent


def test_draw_plan():
    """Shared: 64 / 32 / 24 prompts for R = 2 / 4 / 8 (prompts 0): prompts 0-23 get M = 16 (R = 8 uses them), 24-63
    M = 8; seeds (seed, 0, batch). Independent: R's own batches seeded (seed, R, batch), as before."""
    c = ProbeConfig(out="x", prompts_per_batch=5)
    plan = draw_plan(c, None)
    assert [(b.first, b.n, b.M) for b in plan] == [(0, 5, 16), (5, 5, 16), (10, 5, 16), (15, 5, 16), (20, 4, 16)] + [
        (a, min(5, 64 - a), 8) for a in range(24, 64, 5)
    ]
    assert plan[0] == DrawBatch(("pool", 1), batch_seed(0, 0, 1), 5, 16, 0)
    assert sum(b.n * b.M for b in plan) == 24 * 16 + 40 * 8  # 704 rollouts, against 512 + 256 + 384 = 1152
    ind = draw_plan(c, None, group_size=8)
    assert [(b.key, b.seed, b.n, b.M) for b in ind][:2] == [
        (("R", 8, 1), batch_seed(0, 8, 1), 5, 16),
        (("R", 8, 2), batch_seed(0, 8, 2), 5, 16),
    ]
    assert sum(b.n for b in ind) == 24


def test_pass_chunks():
    assert pass_chunks([2, 2, 2], 4) == [[0, 1], [2]]
    assert pass_chunks([8, 2], 4) == [[0], [1]]  # a group larger than the budget is a pass alone
    assert pass_chunks([], 4) == []


def estimate_config(group_sizes=(2,), baseline_study_prompts=0, credit_groups=0, **kw) -> ProbeConfig:
    """The estimate tests' probe: 10 prompts per R, 4 per generate call, no baseline prompts inside the R phases."""
    return ProbeConfig(
        out="x",
        group_sizes=list(group_sizes),
        prompts=10,
        prompts_per_batch=4,
        baseline_prompts=0,
        baseline_study_prompts=baseline_study_prompts,
        credit_groups=credit_groups,
        **kw,
    )


def test_estimate_seconds_closed_form():
    """10 prompts at R = 2 (M = 8), every prompt's success share 0.5: expected mixed groups 10 (1 - 0.5^2 - 0.5^2) =
    5, i.e. 10 rows at 0.3 s = 3 s; generation 10 x 8 rollouts at 0.1 s = 8 s; no study. The baseline study (16
    prompts of M = 16 at R_s = 4) adds 16 x 16 rows x 0.3 s = 76.8 s and no generation when the pool has M = 16
    (R = 8 among the group sizes), else its rollouts (x 1.3 for prompts without contrast) at 0.1 s."""
    from grpo_lens.probe.run import estimate_seconds, format_estimate

    c = estimate_config()
    est = estimate_seconds(c, None, 0.1, 0.3, [0.5, 0.5])
    assert est == pytest.approx({"generation": 8.0, "R=2": 3.0, "studies": 0.0})
    assert format_estimate(est) == "about 11 s: generation 8 s, R = 2 3 s, studies 0 s"
    c8 = estimate_config(group_sizes=[8], baseline_study_prompts=16)
    assert estimate_seconds(c8, None, 0.1, 0.3, [0.5])["studies"] == pytest.approx(16 * 16 * 0.3)
    c2 = estimate_config(baseline_study_prompts=16)
    assert estimate_seconds(c2, None, 0.1, 0.3, [0.5])["studies"] == pytest.approx(16 * 16 * (0.3 + 0.1 * 1.3))


def test_estimate_seconds_counts_the_credit_study():
    """Credit study at R_s = 4, 8 groups, 4 Monte Carlo groups of K_mc = 8: analysis 3 rows x 8 groups x 4 rollouts
    x 0.3 s = 28.8 s; generation of its own groups 8 x 1.5 x 4 rollouts x 0.1 s = 4.8 s; Monte Carlo 4 groups x 2
    rollouts x 4 prefixes (4 segments) x 8 continuations x 0.1 s = 25.6 s; 59.2 s in all (3 prefixes: 52.8)."""
    from grpo_lens.probe.run import estimate_seconds

    c = estimate_config(credit_groups=8, mc_groups=4, mc_samples=8)
    assert estimate_seconds(c, None, 0.1, 0.3, [0.5])["studies"] == pytest.approx(28.8 + 4.8 + 25.6)
