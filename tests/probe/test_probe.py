"""``run_probe`` on the tiny model: the documented probe.json schema, the rank-2 identity, S1, rank measures of G1 and
its controls, the sketched probe against the exact one, and the report.

Reward: ``test_parity`` (1 when the completion's byte sum is odd), a coin flip per rollout on the random tiny model, so
about half of the R=2 groups and 7/8 of the R=4 groups are mixed, and every reward is 0 or 1 (what the identity and
the baselines need).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.run import run_probe

MAX_IMAGE_BYTES = 300 * 1024
RANK_MEASURES = ("erank", "stable_rank", "participation_ratio", "k90", "k99")
# per-group matrices: G1, its orthogonal null and controls, one layer's G1 (R rows each), and G2
ROW_MATRICES = ("g1", "g1_null", "g1_no_adv", "g1_random", "g1_nll", "g1_layer")


def probe_config(out, **overrides) -> ProbeConfig:
    values = dict(
        model="tiny",
        rewards=["test_parity"],
        group_sizes=[2, 4],
        prompts=8,
        prompts_per_batch=4,
        max_new_tokens=8,
        baseline_prompts=1,
        resamples=32,
        random_draws=4,
        seed=0,
        device="cpu",
        out=str(out),
        study_group_size=2,
        baseline_study_prompts=2,
        credit_groups=1,
        mc_groups=1,
        mc_samples=2,
    )
    values.update(overrides)
    return ProbeConfig(**values)


def linear_weights_only(model):
    """Freeze every parameter but the nn.Linear weights: the exact path then differentiates the same parameters
    the sketch covers (the sketch only sees linear layers; embeddings and norms hold about half of ||g||^2 here)."""
    from grpo_lens.gradients.params import linear_layer_names

    keep = {name + ".weight" for name in linear_layer_names(model)}
    for name, p in model.named_parameters():
        p.requires_grad_(name in keep)
    return model


@pytest.fixture(scope="module")
def sketch_probe(tmp_path_factory):
    """The sketched probe (sketch_dim 16, ``gram_source: sketch``, the earlier default), loading the model by name."""
    out = run_probe(probe_config(tmp_path_factory.mktemp("probe") / "sketch", gram_source="sketch"))
    return out, json.loads((out / "probe.json").read_text())


@pytest.fixture(scope="module")
def exact_probe(tmp_path_factory, tiny_model_and_tokenizer):
    """The exact probe on the linear weights, recording each analysed group (its rollouts and rewards)."""
    import copy

    import grpo_lens.probe.groups as probe_module

    model, tokenizer = copy.deepcopy(tiny_model_and_tokenizer)
    model = linear_weights_only(model)
    groups = []
    original = probe_module.measure_group

    def recording(policy, tok, sub, rewards, *args, **kwargs):
        groups.append((sub, rewards.clone()))
        return original(policy, tok, sub, rewards, *args, **kwargs)

    config = probe_config(tmp_path_factory.mktemp("probe") / "exact", dense_oracle=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe_module, "measure_group", recording)
        out = run_probe(config, policy=model, tokenizer=tokenizer)
    return out, json.loads((out / "probe.json").read_text()), model, groups, config


# ---------------------------------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------------------------------
def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.e2e
def test_probe_json_schema(sketch_probe):
    _, probe = sketch_probe
    assert set(probe) == {"meta", "per_group_size", "studies"}
    # the studies (their numbers are tested in test_studies.py): R = 2, M = 8, 2 prompts with contrast, 1 credit group
    assert probe["studies"]["baselines"]["meta"]["rollouts_per_prompt"] == 8
    assert probe["studies"]["baselines"]["baselines"]["prompts"] == 2
    assert probe["studies"]["credit"]["contributions"]["groups"] == 1
    meta = probe["meta"]
    assert {"model", "task", "gradients", "sketch_dim", "std", "eps", "layer", "seconds", "studies_seconds"} <= set(
        meta
    )
    assert 0 < meta["studies_seconds"] < meta["seconds"]
    assert meta["gradients"] == "sketch" and meta["sketch_dim"] == 16 and meta["std"] == "sample"
    assert meta["layer"] == "model.layers.1.mlp.down_proj"  # default_layer: the middle layer's MLP down projection
    assert meta["parameters"] == 107_200
    assert set(probe["per_group_size"]) == {"2", "4"}
    for R, d in probe["per_group_size"].items():
        assert {
            "prompts_sampled",
            "groups_all_equal",
            "groups_mixed",
            "groups_invalid",
            "s1_measured",
            "s1_predicted",
            "groups",
            "summary",
            "strata",
            "g3",
            "spectra",
            "baselines",
            "credit",
            "timing",
        } <= set(d), R
        assert d["prompts_sampled"] == 8  # a fixed number of prompts, never stopping at the N-th mixed group
        t = d["timing"]
        assert t["generation_seconds"] + t["gradient_seconds"] <= t["seconds"] < meta["seconds"]
        assert 0 < t["g2_weightings_seconds"] + t["sketch_check_seconds"] <= t["gradient_seconds"]
        assert len(d["groups"]) == d["groups_mixed"] >= 2, R
        # the summary is the bootstrap summary of the rows: same keys, mean = the plain mean over groups
        keys = {k for row in d["groups"] for k in row}
        assert set(d["summary"]) == keys
        for key in (
            "rank/g1_erank",
            "rank/g1_null_erank",
            "grad/identity_residual",
            "baseline/b_star",
            "group/correct",
            "group/distinct_completions",
            "rank/g2_erank",
            "credit/answer_token_frac",
        ):
            vals = [row[key] for row in d["groups"] if key in row]
            s = d["summary"][key]
            assert s["n"] == len(vals) and s["mean"] == pytest.approx(sum(vals) / len(vals), rel=1e-12), key
            if len(vals) >= MIN_INTERVAL_UNITS:
                assert s["lo"] <= s["mean"] <= s["hi"], key
            else:  # the one rule: fewer units than MIN_INTERVAL_UNITS give no interval (docs/theory.md §7)
                assert s["lo"] is None and s["hi"] is None, key
        # strata by k and by distinct completions partition the analysed groups
        for by, key in (("correct", "group/correct"), ("distinct", "group/distinct_completions")):
            strata = d["strata"][by]
            assert sum(st["rank/g1_erank"]["n"] for st in strata.values()) == len(d["groups"])
            assert set(strata) == {str(int(row[key])) for row in d["groups"]}
        assert set(d["baselines"]) >= {"variance", "relative_variance", "prompts"}
        assert set(d["timing"]) >= {"generation_seconds", "gradient_seconds"}
        assert d["g3"]["groups"] == len(d["groups"])
        # the sketch checked against exact gradients of every parameter on the first mixed group (coverage_groups=1)
        (check,) = d["sketch_check"]["groups"]
        shares = [
            check[f"sketch/exact_share_{c}"]
            for c in ("linear", "embedding", "norm")
            if f"sketch/exact_share_{c}" in check
        ]
        assert sum(shares) == pytest.approx(1.0, abs=1e-9)  # every parameter of the tiny model is in a category
        # the sketch sees the linear weights (and the tied lm_head use): a share of ||g||^2 between the linear
        # weights' exact share (minus projection noise) and 1
        assert 0.3 < check["sketch/coverage"] < 1.0
        assert 0 < check["sketch/gram_error"] < 1.5 and 0 < check["sketch/gram_error_bound"] < 1
    assert probe["meta"]["sketch_coverage"] == pytest.approx(
        sum(d["sketch_check"]["groups"][0]["sketch/coverage"] for d in probe["per_group_size"].values()) / 2
    )


@pytest.mark.e2e
def test_s1_fields(sketch_probe):
    _, probe = sketch_probe
    for _R, d in probe["per_group_size"].items():
        valid = d["prompts_sampled"] - d["groups_invalid"]
        assert d["groups_invalid"] == 0  # the parity reward scores everything
        assert d["groups_all_equal"] + d["groups_mixed"] == valid
        # S1 measured = all-equal groups / valid groups
        assert d["s1_measured"] == pytest.approx(d["groups_all_equal"] / valid)
        # S1 predicted = mean over prompts of the unbiased [C(k',R) + C(M'-k',R)] / C(M',R) from the M - R rollouts
        # outside the group: in [0, 1] (unlike the plug-in it can go below 2^(1-R), e.g. 6/15 for k' = 3 of 6, R = 2)
        assert 0.0 <= d["s1_predicted"] <= 1.0 + 1e-12
        ci = d["s1_predicted_ci"]
        assert ci["mean"] == pytest.approx(d["s1_predicted"]) and ci["n"] == valid


@pytest.mark.e2e
def test_identity_residual_and_rank_measures(sketch_probe):
    _, probe = sketch_probe
    for R, d in probe["per_group_size"].items():
        rows = d["groups"]
        assert all(row["grad/identity_residual"] <= 1e-5 for row in rows)  # float64 Gram algebra: ~1e-16
        for row in rows:
            for matrix in ROW_MATRICES:
                for m in RANK_MEASURES:
                    # rank measures of an R-row matrix lie in [1, R]
                    assert 1.0 - 1e-9 <= row[f"rank/{matrix}_{m}"] <= int(R) + 1e-9, (R, matrix, m)
            # the ratio to the orthogonal null is the quotient of the two rows' numbers
            assert row["rank/g1_erank_vs_null"] == pytest.approx(row["rank/g1_erank"] / row["rank/g1_null_erank"])
            # G2's numerical rank is bounded by prompt tokens + distinct completion prefixes
            assert row["rank/g2_numerical_rank"] <= row["rank/g2_rank_bound"]
            # output-only reward: every token of a rollout has the same advantage
            assert row["credit/adv_var_within_max"] == pytest.approx(0.0, abs=1e-12)
        # the group mean is (R-1)/R times the rloo estimate on the same resampled groups: variance ratio ((R-1)/R)^2
        var = d["baselines"]["variance"]
        assert var["mean"] == pytest.approx(((int(R) - 1) / int(R)) ** 2 * var["rloo"], rel=1e-9)
        assert d["baselines"]["relative_variance"]["optimal"] == pytest.approx(1.0)
    # R = 2: two rows, so G1 has at most 2 non-zero singular values and erank <= 2
    assert probe["per_group_size"]["2"]["summary"]["rank/g1_erank"]["mean"] <= 2.0 + 1e-9
    assert all(len(s) == 2 for s in probe["per_group_size"]["2"]["spectra"]["G1"])


@pytest.mark.e2e
def test_report_written(sketch_probe):
    out, _ = sketch_probe
    report = (out / "report.md").read_text()
    assert "## Gradient probe: probe" in report and "## Findings" in report
    assert "### Stratified by k" in report and "orthogonal null" in report
    names = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert {
        "erank_vs_R_probe.png",
        "spectra_probe.png",
        "baseline_variance_probe.png",
        "credit_profile_probe.png",
    } <= set(names)
    for name in names:
        path = out / name
        assert path.read_bytes()[:4] == b"\x89PNG" and 0 < path.stat().st_size < MAX_IMAGE_BYTES, name


@pytest.mark.e2e
def test_existing_probe_needs_overwrite(sketch_probe):
    from grpo_lens.config import ConfigError

    out, _ = sketch_probe
    with pytest.raises(ConfigError, match="overwrite"):
        run_probe(probe_config(out))


# ---------------------------------------------------------------------------------------------------------------------
# Sketched vs exact
# ---------------------------------------------------------------------------------------------------------------------
def _jl_gram_error(model, sub, rewards, config, k: int) -> float:
    """The Kronecker-JL bound on the relative Frobenius error of the sketched Gram M = D G D of G1's rows (D =
    diag(A)) for this group: sqrt(c(k, k) * sum_l (tr M_l)^2) / ||M||_F from the exact per-layer Grams
    (grpo_lens.diagnostics.sketch_gram_error_bound; an RMS bound over the random projections)."""
    from grpo_lens.formulas.advantages import compute_advantages
    from grpo_lens.formulas.sketch_error import sketch_gram_error_bound
    from grpo_lens.gradients.exact import exact_rollout_grads
    from grpo_lens.gradients.params import param_slices

    R = sub.num_rollouts
    adv = compute_advantages(rewards.view(1, R).double(), "grpo", std=config.std, std_eps=config.std_eps)[0]
    rows = exact_rollout_grads(model, sub, temperature=config.temperature).double() * adv.unsqueeze(1)
    grams = [rows[:, s] @ rows[:, s].T for s in param_slices(model).values()]  # one per linear weight
    return sketch_gram_error_bound(grams, k, k)


def _erank_tolerance(s_exact: list[float], eps: float) -> float:
    """How far erank can move when G1's Gram moves by eps * ||M||_F (first order, x2 for curvature).

    Hoffman-Wielandt: the sorted eigenvalues lambda = s^2 of the Gram move by ||d lambda||_2 <= ||dM||_F <=
    eps ||lambda||_2. With p = s / sum s and H = -sum p ln p (erank = e^H), dH/d lambda_k = -(ln p_k + H) / (2 S s_k),
    S = sum s, so |dH| <= ||grad H||_2 * eps * ||lambda||_2 to first order, and |d erank| <= erank (e^{|dH|} - 1).
    """
    s = torch.tensor(s_exact, dtype=torch.float64)
    lam, S = s.square(), s.sum()
    p = s / S
    H = float(-(p * p.log()).sum())
    grad = -(p.log() + H) / (2 * S * s)
    dH = 2.0 * float(grad.norm()) * eps * float(lam.norm())
    return math.exp(H) * (math.exp(dH) - 1.0)


@pytest.mark.e2e
def test_sketch_and_exact_probes_see_the_same_groups(sketch_probe, exact_probe):
    # sampling and rewards do not depend on how gradients are computed: same seeds, same groups
    s, e = sketch_probe[1]["per_group_size"], exact_probe[1]["per_group_size"]
    assert exact_probe[1]["meta"]["gradients"] == "exact" and exact_probe[1]["meta"]["sketch_dim"] is None
    for R in ("2", "4"):
        for key in ("prompts_sampled", "groups_all_equal", "groups_mixed", "s1_measured", "s1_predicted"):
            assert s[R][key] == e[R][key], (R, key)
        assert [row["group/distinct_completions"] for row in s[R]["groups"]] == [
            row["group/distinct_completions"] for row in e[R]["groups"]
        ]
        assert max(row["grad/identity_residual"] for row in e[R]["groups"]) <= 1e-5


@pytest.mark.e2e
def test_exact_gram_probe_equals_the_dense_exact_probe(tmp_path, exact_probe, tiny_model_and_tokenizer):
    """The default probe (exact Gram from one backward) on the same linear weights as the dense exact probe: the same
    groups, and every Gram-based per-group number equal to float32 rounding (the Gram agrees to ~1e-7 relative; a
    missing layer or a Gram scaled by 2 moves erank and the span energies by far more than 1e-4)."""
    import copy

    _, exact, model, _, _ = exact_probe
    out = run_probe(probe_config(tmp_path / "gram"), policy=copy.deepcopy(model), tokenizer=tiny_model_and_tokenizer[1])
    gram = json.loads((out / "probe.json").read_text())
    assert gram["meta"]["gradients"] == "exact_gram" and gram["meta"]["gram_coverage"] == 1.0
    assert "coverage 1.00" in (out / "report.md").read_text()
    keys = (
        "rank/g1_erank",
        "rank/g1_stable_rank",
        "rank/g1_null_erank",
        "rank/g1_layer_erank",
        "grad/identity_residual",
    )
    for R in ("2", "4"):
        g_rows, e_rows = gram["per_group_size"][R]["groups"], exact["per_group_size"][R]["groups"]
        assert len(g_rows) == len(e_rows) >= 2
        for g_row, e_row in zip(g_rows, e_rows):
            for key in keys:
                assert abs(g_row[key] - e_row[key]) <= 1e-4 * max(1.0, abs(e_row[key])), (R, key)
            assert set(g_row) == set(e_row)
            assert "zero_sum/span_energy" in e_row
            for key in ("zero_sum/span_energy", "zero_sum/span_energy_null", "zero_sum/cos_gap"):
                if key in e_row:  # (the cosine gap needs two rollouts on each side)
                    assert abs(g_row[key] - e_row[key]) <= 1e-4, (R, key)  # shares and cosines: absolute
        assert gram["per_group_size"][R]["gram_coverage"] == 1.0
        # G2 under every weighting: inside the exact Gram's backward here, in its own pass in the dense probe
        g2_fused, g2_own = (p["per_group_size"][R]["g2_weightings"]["groups"] for p in (gram, exact))
        assert len(g2_fused) == len(g2_own) >= 2 and set(g2_fused[0]) == set(g2_own[0])
        for f_row, o_row in zip(g2_fused, g2_own):
            for key, value in o_row.items():
                assert f_row[key] == pytest.approx(value, rel=1e-4, abs=1e-9), (R, key)


@pytest.mark.e2e
def test_sketched_g1_agrees_with_exact_within_the_jl_error(sketch_probe, exact_probe):
    """Gram (spectrum) and erank of G1, sketched (k = 16 per side per layer) vs exact, group by group.

    The sketch of the default probe and the exact probe on the linear weights see the same rollouts and the same
    advantages, so they estimate the same Gram matrix M = D G D; the sketch is unbiased with relative RMS error at
    most eps (the JL bound of _jl_gram_error: 0.25-0.3 for these groups; the measured spectrum errors are 0.03-0.14).
    Checks:

    - spectrum: ||lambda_sketch - lambda_exact||_2 <= eps * ||lambda_exact||_2 (Hoffman-Wielandt turns the Gram
      error into this eigenvalue error; a Gram scaled by 2 or missing lm_head breaks it);
    - erank: |erank_sketch - erank_exact| <= _erank_tolerance(s_exact, eps), per group and for the reported mean.
      For R = 2 this is 0.01-0.17 (mean 0.09): tight. For R = 4 the first-order bound is 1.5-3.3, no test at all (the
      small eigenvalues of G1 are ~1/15 of the top one, and an error of eps * ||M||_F could move them a lot), so there
      the spectrum check is the sharp one.
    """
    _, sketch = sketch_probe
    _, exact, model, groups, config = exact_probe
    k = sketch["meta"]["sketch_dim"]
    by_r: dict[str, list] = {}
    for sub, rewards in groups:
        by_r.setdefault(str(sub.num_rollouts), []).append((sub, rewards))
    for R, recorded in by_r.items():
        s_exact = exact["per_group_size"][R]["spectra"]["G1"]
        s_sketch = sketch["per_group_size"][R]["spectra"]["G1"]
        assert len(recorded) == len(s_exact) == len(s_sketch) >= 2
        tolerances = []
        for (sub, rewards), se, ss in zip(recorded, s_exact, s_sketch):
            eps = _jl_gram_error(model, sub, rewards, config, k)
            assert 0 < eps < 1
            lam_e = torch.tensor(se, dtype=torch.float64).square()
            lam_s = torch.tensor(ss, dtype=torch.float64).square()
            rel = float((lam_s - lam_e).norm() / lam_e.norm())
            assert rel <= eps, f"R={R}: sketched G1 spectrum off by {rel:.3f} > JL bound {eps:.3f}"
            assert rel > 1e-6  # a real (random) sketch, not the exact path twice
            tol = _erank_tolerance(se, eps)
            tolerances.append(tol)

            def erank(s):
                p = torch.tensor(s, dtype=torch.float64)
                p = p[p > 0] / p.sum()
                return math.exp(float(-(p * p.log()).sum()))

            assert abs(erank(ss) - erank(se)) <= tol, (R, erank(ss), erank(se), tol)
        if R == "2":
            # the R = 2 comparison is a tight one (tolerances 0.01-0.17 for these groups, mean 0.09)
            assert sum(tolerances) / len(tolerances) < 0.1
        got = sketch["per_group_size"][R]["summary"]["rank/g1_erank"]["mean"]
        want = exact["per_group_size"][R]["summary"]["rank/g1_erank"]["mean"]
        assert abs(got - want) <= sum(tolerances) / len(tolerances), (R, got, want)


def test_default_prompt_counts():
    # max(24, 128 // R): the counts benchmarks/bench_probe.py measured to give >= 16 mixed groups per R on the default
    # task in under 8 minutes (README §Timing); an explicit --prompts wins
    assert [ProbeConfig().prompts_for(R) for R in (2, 4, 8, 16)] == [64, 32, 24, 24]
    assert ProbeConfig(prompts=5).prompts_for(8) == 5


@pytest.mark.e2e
def test_progress_counts_every_prompt_once(tmp_path, tiny_model_and_tokenizer):
    # the progress callback gets each batch's prompt count: they add up to the prompts sampled (6 = batches of 4 + 2)
    # and the last mixed count is the R's groups_mixed
    from grpo_lens.probe.estimate import probe_group_size
    from grpo_lens.rewards import parse_reward_specs
    from grpo_lens.tasks import get_task

    model, tokenizer = tiny_model_and_tokenizer
    config = probe_config(tmp_path, prompts=6, max_new_tokens=4, g2_groups=0, coverage_groups=0, baseline_prompts=0)
    calls = []
    out = probe_group_size(
        model,
        tokenizer,
        get_task(config.task),
        parse_reward_specs(config.rewards),
        2,
        config,
        "model.layers.1.mlp.down_proj",
        lambda done, mixed: calls.append((done, mixed)),
    )
    assert [d for d, _ in calls] == [4, 2] and calls[-1][1] == out["groups_mixed"]
    assert out["prompts_sampled"] == 6


@pytest.mark.e2e
@pytest.mark.parametrize("gram_source", ["exact", "sketch"])
def test_sketch_check_from_the_exact_gram_equals_dense_vectors(tiny_model_and_tokenizer, gram_source):
    # The sketch check reads per-parameter exact Grams (the group's own pass with the exact Gram, one more batched
    # backward with the sketch), never [R, P] vectors. Reference, from dense per-rollout gradients e [R, P] (one
    # backward per rollout): coverage = sum ||s_i||^2 / sum ||e_i||^2, a category's share = its columns' sum of
    # squares / sum ||e_i||^2, gram error = ||W (S S^T - E E^T) W||_F / ||W E E^T W||_F with W = diag(A).
    from grpo_lens.gradients.exact import exact_rollout_grads
    from grpo_lens.gradients.params import param_slices
    from grpo_lens.probe.gradient_sources import _rollout_grads, score_weights, sketch_check
    from grpo_lens.rollout import sample_groups
    from grpo_lens.tasks import get_task

    model, tokenizer = tiny_model_and_tokenizer
    config = probe_config("unused", gram_source=gram_source, sketch_dim=8)
    sub = sample_groups(
        model,
        tokenizer,
        get_task(config.task).sample(1, seed=3),
        4,
        max_new_tokens=6,
        temperature=config.temperature,
        generator_seed=3,
    )
    measured = _rollout_grads(model, sub, config, None)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    extra = {"grads": measured.rows, "advantages": adv, "param_grams": measured.param_grams}
    assert (measured.param_grams is None) == (gram_source == "sketch")
    check = sketch_check(model, sub, extra, config)

    e = exact_rollout_grads(
        model, sub, temperature=config.temperature, score_weights=score_weights(sub, config)
    ).double()
    s = measured.rows
    total = float(e.square().sum())
    assert check["sketch/coverage"] == pytest.approx(float(s.square().sum()) / total, rel=1e-5)
    slices = param_slices(model)
    embed = sum(float(e[:, sl].square().sum()) for n, sl in slices.items() if "embed" in n) / total
    assert embed > 0.01  # the tiny model's embedding carries a share a dropped category would lose
    assert check["sketch/exact_share_embedding"] == pytest.approx(embed, rel=1e-5)
    w = torch.outer(adv, adv)
    ge, gs = (e @ e.T) * w, (s @ s.T) * w
    assert check["sketch/gram_error"] == pytest.approx(float((gs - ge).norm() / ge.norm()), rel=1e-4)
