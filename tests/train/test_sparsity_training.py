"""Sparsity over training: weighted measures against exact ones, the bf16 cell and the dense-update control."""

import math

import pytest
import torch
from references import hoyer_sparsity  # the readable reference of weighted_hoyer

from grpo_lens.formulas.sparsity import (
    bf16_rounding_cell,
    dense_bf16_unchanged_probability,
    layer_type,
    top_energy_share,
    update_sparsity,
    weighted_hoyer,
    zero_share,
)
from grpo_lens.lens.sparsity import (
    ParameterSample,
    sampled_update_sparsity,
    sampled_vector_sparsity,
)


def test_hoyer_and_zero_share_with_unit_weights_are_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * (torch.rand(1000, generator=g) < 0.3)
    assert weighted_hoyer(x) == pytest.approx(hoyer_sparsity(x), abs=1e-12)
    assert weighted_hoyer(torch.tensor([0.0, 0.0, 5.0, 0.0])) == pytest.approx(1.0)  # one-hot
    assert weighted_hoyer(torch.tensor([-2.0, 2.0, 2.0, -2.0])) == pytest.approx(0.0, abs=1e-12)  # constant |x|
    assert zero_share(x) == pytest.approx(float((x == 0).double().mean()), abs=1e-12)


def test_top_energy_share_closed_form_and_weights():
    # 100 entries: one of magnitude 10, 99 of magnitude 1. Top 1% = the single big entry: 100 / (100 + 99).
    x = torch.ones(100)
    x[7] = 10.0
    assert top_energy_share(x) == pytest.approx(100 / 199, abs=1e-12)
    # the same vector as 2 weighted samples (the 10 once, a 1 standing for 99 entries): the same share
    assert top_energy_share(torch.tensor([10.0, 1.0]), torch.tensor([1.0, 99.0])) == pytest.approx(100 / 199)
    # top 2%: the big entry and one unit entry: 101 / 199 (the second sample is taken fractionally: 1 of its 99)
    assert top_energy_share(torch.tensor([10.0, 1.0]), torch.tensor([1.0, 99.0]), top=0.02) == pytest.approx(101 / 199)
    assert top_energy_share(torch.ones(50)) == pytest.approx(0.01)  # equal magnitudes: the top 1% hold 1%
    # the weighted value equals the value on the expanded vector, for random data
    g = torch.Generator().manual_seed(1)
    v, w = torch.randn(40, generator=g), torch.randint(1, 6, (40,), generator=g)
    assert top_energy_share(v, w.double(), 0.1) == pytest.approx(
        top_energy_share(v.repeat_interleave(w), None, 0.1), abs=0.02
    )


def test_bf16_rounding_cell_closed_form():
    # bf16 has 8 significant bits: above 1 the spacing is 2^-7, below 1 it is 2^-8; the cell of 1.0 runs between
    # the midpoints 1 - 2^-9 and 1 + 2^-8.
    lo, hi = bf16_rounding_cell(torch.tensor([1.0, -1.0, 3.0]))
    assert lo.tolist() == [1 - 2**-9, -1 - 2**-8, 3 - 2**-7]
    assert hi.tolist() == [1 + 2**-8, -1 + 2**-9, 3 + 2**-7]
    # every float32 inside the cell rounds to the same bf16 value, just outside it does not
    x = torch.tensor([1 + 2**-8 * 0.99, 1 + 2**-8 * 1.01])
    assert x.to(torch.bfloat16).float().tolist() == [1.0, 1.0 + 2**-7]


def test_dense_control_matches_simulation():
    # Weights like a trained model's (|w| ~ 0.02) and a dense Gaussian update with RMS 1e-4 (relative ~5e-3):
    # simulate bf16(v + d) == bf16(v) over 400,000 entries; the share's standard error is <= 0.5/sqrt(4e5) = 8e-4.
    g = torch.Generator().manual_seed(2)
    v = torch.randn(400_000, generator=g) * 0.02
    d = torch.randn(400_000, generator=g) * 1e-4
    simulated = float(((v + d).to(torch.bfloat16) == v.to(torch.bfloat16)).double().mean())
    expected = float(dense_bf16_unchanged_probability(v, 1e-4).mean())
    assert expected == pytest.approx(simulated, abs=4e-3)
    assert 0.2 < expected < 0.95  # the regime where the control matters: a dense update leaves most bf16 unchanged


def test_update_sparsity_separates_rounding_from_sparsity():
    g = torch.Generator().manual_seed(3)
    before = torch.randn(200_000, generator=g) * 0.02
    # (a) dense tiny update: no float32 entry unchanged, yet most bf16 values unchanged, as the dense control says
    dense = update_sparsity(before, before + torch.randn(200_000, generator=g) * 2e-5)
    # (float32 itself swallows a d below half an ulp of the weight, ~1e-9 here: P(|d| < 1e-9) ~ 1e-4)
    assert dense["f32_unchanged"] < 1e-3
    assert dense["bf16_unchanged"] > 0.5  # relative size ~1e-3 against bf16 half-cells of 2e-3 to 4e-3
    assert dense["bf16_unchanged"] == pytest.approx(dense["bf16_dense"], abs=0.01)
    assert dense["hoyer"] < 0.3  # a Gaussian vector: 1 - sqrt(2/pi) = 0.20 (n large)
    # (b) truly sparse update: 0.5% of entries move by 0.01, the rest not at all
    d = torch.zeros(200_000)
    d[torch.randperm(200_000, generator=g)[:1000]] = 0.01
    sparse = update_sparsity(before, before + d)
    assert sparse["f32_unchanged"] == pytest.approx(0.995, abs=1e-6)
    assert sparse["top1_energy"] == pytest.approx(1.0, abs=1e-6)  # every non-zero entry is in the top 1%
    assert sparse["hoyer"] > 0.9
    # its bf16 share is above the dense control at the same RMS (rms = 0.01 * sqrt(0.005) = 7e-4)
    assert sparse["bf16_unchanged"] > sparse["bf16_dense"] + 0.3


def test_layer_types():
    assert layer_type("model.layers.3.post_attention_layernorm.weight") == "norm"
    assert layer_type("model.layers.3.self_attn.k_proj.weight") == "attention"
    assert layer_type("model.layers.3.mlp.up_proj.weight") == "mlp"
    assert layer_type("model.embed_tokens.weight") == "embedding"
    assert layer_type("lm_head.weight") == "embedding"
    assert layer_type("score.bias") == "other"


@pytest.mark.e2e
def test_parameter_sample_estimates_whole_model_measures(fresh_tiny_model_and_tokenizer):
    model, _ = fresh_tiny_model_and_tokenizer
    sample = ParameterSample.build(model, size=20_000, min_per_tensor=256, seed=0)
    total = sum(p.numel() for p in model.parameters())
    weights = sum(len(sample.index[n]) * sample.weight[n] for n in sample.names)
    assert weights == pytest.approx(total)  # the weights stand for every entry once
    assert set(sample.groups()) >= {"all", "attention", "mlp", "norm", "embedding"}
    # a sparse update of the whole model: rows 0..9 of the embedding move, nothing else
    before = sample.values()
    with torch.no_grad():
        model.model.embed_tokens.weight[:10] += 0.5
    after = sample.values()
    exact_unchanged = 1 - 10 * model.config.hidden_size / total
    got = sampled_update_sparsity(sample, before, after)
    # the embedding is sampled at ~ 20000/total of its entries: the share's standard error is about
    # sqrt(q(1-q)/s) * (embedding share of P); loose tolerance 0.02 around the exact 1 - 640/P
    assert got["all"]["f32_unchanged"] == pytest.approx(exact_unchanged, abs=0.02)
    assert got["attention"]["f32_unchanged"] == 1.0 and got["mlp"]["f32_unchanged"] == 1.0
    assert got["norm"]["bf16_unchanged"] == 1.0
    # the gradient view on a vector that is zero except the embedding
    vec = sampled_vector_sparsity(sample, {n: after[n] - before[n] for n in sample.names})
    assert vec["mlp"]["zero"] == 1.0 and vec["all"]["zero"] == pytest.approx(exact_unchanged, abs=0.02)
    assert math.isfinite(vec["all"]["hoyer"])
    # the mlp part of that vector is all zero: Hoyer and top-1% are 0/0 there (NaN, stored as null), not 1 and 0.01,
    # through the lens's own grouped path (a second body of the formula used to give 1 here after the first was fixed)
    assert math.isnan(vec["mlp"]["hoyer"]) and math.isnan(vec["mlp"]["top1_energy"])
    assert math.isnan(got["mlp"]["hoyer"]) and math.isnan(got["mlp"]["top1_energy"])


@pytest.mark.e2e
def test_sparsity_over_training_around_an_optimizer_step(fresh_tiny_model_and_tokenizer):
    model, _ = fresh_tiny_model_and_tokenizer
    from grpo_lens.lens.sparsity import SparsityOverTraining

    tracker = SparsityOverTraining(model, size=20_000, min_per_tensor=256)
    assert tracker.after_step() == {}  # nothing recorded yet
    # a gradient on the mlp weights only, and an SGD step with it
    params = dict(model.named_parameters())
    for n, p in params.items():
        p.grad = torch.ones_like(p) if ".mlp." in n else None
    tracker.accumulate_grad()
    tracker.before_step()
    with torch.no_grad():
        for p in params.values():
            if p.grad is not None:
                p -= 0.1 * p.grad
    out = tracker.after_step()
    assert out["sparsity/mlp/grad_zero"] == 0.0 and out["sparsity/attention/grad_zero"] == 1.0
    assert out["sparsity/mlp/update_step_f32_unchanged"] == 0.0
    assert out["sparsity/attention/update_step_f32_unchanged"] == 1.0
    assert out["sparsity/update_total_f32_unchanged"] == out["sparsity/update_step_f32_unchanged"]  # first step
    # a constant update of 0.1 moves every mlp bf16 value (0.1 >> the cell of |w| ~ 0.02): dense control says 0 too
    assert out["sparsity/mlp/update_step_bf16_unchanged"] == 0.0
    assert out["sparsity/mlp/update_step_bf16_dense"] < 0.01
    assert out["sparsity/mlp/update_step_hoyer"] == pytest.approx(0.0, abs=1e-9)  # equal magnitudes
    assert out["sparsity/sample_entries"] == tracker.sample.size
    # the gradient summed since the start: one step so far, so it equals the step's gradient
    assert out["sparsity/mlp/grad_total_zero"] == 0.0 and out["sparsity/attention/grad_total_zero"] == 1.0
    # a second step with the gradient on attention only: the sum now covers both (mlp and attention non-zero)
    for n, p in params.items():
        p.grad = torch.ones_like(p) if ".self_attn." in n else None
    tracker.accumulate_grad()
    tracker.before_step()
    out2 = tracker.after_step()
    assert out2["sparsity/attention/grad_zero"] == 0.0 and out2["sparsity/mlp/grad_zero"] == 1.0
    assert out2["sparsity/mlp/grad_total_zero"] == 0.0 and out2["sparsity/attention/grad_total_zero"] == 0.0
    # the sum survives a checkpoint: a fresh tracker loaded from state_dict reports the same
    other = SparsityOverTraining(model, size=20_000, min_per_tensor=256)
    other.load_state_dict(tracker.state_dict())
    other.before_step()
    assert other.after_step()["sparsity/grad_total_hoyer"] == out2["sparsity/grad_total_hoyer"]
    # a non-finite gradient (a step the trainer skips) is left out of the sum
    for p in params.values():
        p.grad = torch.full_like(p, float("nan"))
    before_sum = {n: v.clone() for n, v in tracker.grad_sum.items()}
    tracker.accumulate_grad()
    assert all(torch.equal(before_sum[n], tracker.grad_sum[n]) for n in before_sum)


@pytest.mark.e2e
def test_grouped_fast_path_equals_the_reference_per_group(fresh_tiny_model_and_tokenizer):
    # sampled_update_sparsity computes every entry once and sums per group; it must equal update_sparsity (and
    # sampled_vector_sparsity sparsity_measures) applied to each group's entries separately
    from grpo_lens.formulas.sparsity import sparsity_measures

    model, _ = fresh_tiny_model_and_tokenizer
    sample = ParameterSample.build(model, size=5000, min_per_tensor=128, seed=1)
    before = sample.values()
    g = torch.Generator().manual_seed(4)
    after = {
        n: v + torch.randn(v.shape, generator=g) * 1e-3 * (torch.rand(v.shape, generator=g) < 0.3)
        for n, v in before.items()
    }
    fast = sampled_update_sparsity(sample, before, after)
    fast_vec = sampled_vector_sparsity(sample, {n: after[n] - before[n] for n in sample.names})
    for group, names in sample.groups().items():
        b = torch.cat([before[n] for n in names])
        a = torch.cat([after[n] for n in names])
        w = torch.cat([torch.full((len(before[n]),), sample.weight[n], dtype=torch.float64) for n in names])
        rms = torch.cat(
            [
                torch.full(
                    (len(before[n]),),
                    float((after[n] - before[n]).double().square().mean().sqrt()),
                    dtype=torch.float64,
                )
                for n in names
            ]
        )
        strata = torch.cat([torch.full((len(before[n]),), i, dtype=torch.long) for i, n in enumerate(names)])
        ref = update_sparsity(b, a, w, rms, strata)
        for k, v in ref.items():
            assert fast[group][k] == pytest.approx(v, rel=1e-9, abs=1e-12), (group, k)
        ref_vec = sparsity_measures(a.float() - b.float(), w)
        for k, v in ref_vec.items():
            assert fast_vec[group][k] == pytest.approx(v, rel=1e-9, abs=1e-12), (group, k)


def test_permutation_control_is_the_mean_over_within_tensor_permutations():
    # Two tensors with very different update scales: tensor 0 moves by ~1e-6 (far below its bf16 spacing, ~1e-4 at
    # |w| ~ 0.02), tensor 1 by ~1e-2 (far above). Under a random permutation within a tensor, entry i gets a uniform
    # one of its tensor's d_j, so p_i = mean_j [bf16(v_i + d_j) == bf16(v_i)] over the SAME tensor: the brute-force
    # [s, s] comparison below. Pooling the tensors (a wrong control) would give ~0.5 to every entry instead of ~1 / ~0.
    from grpo_lens.formulas.sparsity import permuted_bf16_unchanged_probability

    g = torch.Generator().manual_seed(5)
    v = torch.randn(1200, generator=g) * 0.02
    h = torch.cat([torch.zeros(700, dtype=torch.long), torch.ones(500, dtype=torch.long)])
    d = torch.randn(1200, generator=g) * torch.where(h == 0, 1e-6, 1e-2)
    got = permuted_bf16_unchanged_probability(v, d, h)
    ref = torch.empty(1200, dtype=torch.float64)
    for t in (0, 1):
        s = h == t
        ref[s] = (
            ((v[s][:, None] + d[s][None, :]).to(torch.bfloat16) == v[s][:, None].to(torch.bfloat16)).double().mean(1)
        )
    # equal up to ties at the cell's edges (float32 addition against the float64 cell): at most 1 count in 500
    assert float((got - ref).abs().max()) <= 2.5e-3 and float((got - ref).abs().mean()) < 1e-4
    assert float(got[:700].mean()) > 0.95 and float(got[700:].mean()) < 0.05
    # a sparse update (90% exact zeros) keeps its zeros under the permutation: the control is >= 0.9 per entry
    d2 = d * (torch.rand(1200, generator=g) < 0.1)
    assert float(permuted_bf16_unchanged_probability(v, d2, h).min()) >= 0.85


def test_permutation_control_keeps_a_heavy_tailed_dense_update_where_the_dense_control_does_not():
    # a dense update with a log-normal per-entry scale (log-SD 2): the RMS is set by the few large entries,
    # so the Gaussian control at that RMS moves most bf16 values, while the update itself leaves most unchanged; the
    # within-tensor permutation control has the same magnitudes and matches the observed share (the update is
    # independent of the weights: placement does not matter; SE of the difference ~ 0.5/sqrt(2e5) ~ 1e-3)
    g = torch.Generator().manual_seed(6)
    before = torch.randn(200_000, generator=g) * 0.02
    d = 3e-6 * torch.randn(200_000, generator=g) * torch.exp(2.0 * torch.randn(200_000, generator=g))
    res = update_sparsity(before, before + d)
    assert res["f32_unchanged"] < 0.01 and res["bf16_unchanged"] > 0.75
    assert res["bf16_permuted"] == pytest.approx(res["bf16_unchanged"], abs=0.005)
    assert res["bf16_dense"] < res["bf16_unchanged"] - 0.3


def test_stratified_se_against_the_design():
    from grpo_lens.formulas.stats import stratified_mean_se

    # Population: stratum A 10,000 entries with share 0.9, stratum B 1,000 with share 0.2; s = 100 and 400 draws with
    # replacement (weights 100 and 2.5). Var = (10/11)^2 * 0.09/100 + (1/11)^2 * 0.16/400 -> SE = 0.02733; the
    # simple-random-sample SE sqrt(q(1-q)/500) at q = (9000 + 200)/11000 = 0.836 is 0.0166 (wrong by 40%).
    true_se = math.sqrt((10 / 11) ** 2 * 0.09 / 100 + (1 / 11) ** 2 * 0.16 / 400)
    g = torch.Generator().manual_seed(7)
    w = torch.cat([torch.full((100,), 100.0), torch.full((400,), 2.5)]).double()
    h = torch.cat([torch.zeros(100, dtype=torch.long), torch.ones(400, dtype=torch.long)])
    est, ses = [], []
    for _ in range(2000):
        x = torch.cat([(torch.rand(100, generator=g) < 0.9), (torch.rand(400, generator=g) < 0.2)]).double()
        est.append(float((w * x).sum() / w.sum()))
        ses.append(stratified_mean_se(x, w, h))
    sd = float(torch.tensor(est).std())
    # the SD of 2000 estimates has relative SE ~ 1/sqrt(2 * 2000) = 1.6%; the mean SE has a small bias from sqrt
    assert sd == pytest.approx(true_se, rel=0.05)
    assert sum(ses) / len(ses) == pytest.approx(true_se, rel=0.05)
    # strata with no variation add nothing, and a stratum taken whole (weight 1) adds nothing
    ones_zeros = torch.cat([torch.ones(100), torch.zeros(400)]).double()
    assert stratified_mean_se(ones_zeros, w, h) == 0.0
    assert stratified_mean_se(x, torch.ones(500, dtype=torch.float64), h) == 0.0
    with pytest.raises(ValueError, match="constant within a stratum"):
        stratified_mean_se(x, torch.rand(500, dtype=torch.float64) + 1, h)
    # sorted strata (the sample's own layout) skip the sort; shuffled entries and other stratum labels give the same SE
    perm = torch.randperm(500, generator=g)
    assert stratified_mean_se(x[perm], w[perm], 5 * h[perm] + 3) == pytest.approx(ses[-1], rel=1e-12)
    with pytest.raises(ValueError, match="constant within a stratum"):
        stratified_mean_se(x[perm], torch.rand(500, dtype=torch.float64) + 1, h[perm])


def test_lens_s4_sparsity_before_step_only_snapshots_and_numbers_are_unchanged(
    fresh_tiny_model_and_tokenizer, monkeypatch
):
    """The lens's before-step snapshot compared the whole model twice (numbers thrown away); it now only
    snapshots, and S4 after the step is what comparing-then-snapshotting gave."""
    import grpo_lens.lens.sparsity as sparsity_module
    from grpo_lens.config import TrainConfig
    from grpo_lens.lens.settings import LensSettings
    from grpo_lens.lens.sparsity import Bf16UpdateTracker
    from grpo_lens.lens.trainer_lens import TrainerLens

    model, _ = fresh_tiny_model_and_tokenizer
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    reference = Bf16UpdateTracker(params, device="cpu")
    lens = TrainerLens(model, LensSettings.from_train_config(TrainConfig(seed=0)))
    with torch.no_grad():  # a first step before the lens step: 'previous' must move to the lens step's weights
        for p in params:
            p += 1e-2 * torch.randn(p.shape, generator=g)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    calls = []
    counts = sparsity_module.bf16_unchanged_counts
    monkeypatch.setattr(sparsity_module, "bf16_unchanged_counts", lambda a, b: calls.append(1) or counts(a, b))
    lens._pending = True
    lens.before_step(model)
    assert calls == [], "the before-step snapshot compares nothing"
    reference.update()  # the old before-step: compare, then snapshot
    with torch.no_grad():
        for i, p in enumerate(params):
            p += (1e-2 if i % 2 else 0.0) * torch.randn(p.shape, generator=g)  # half the tensors move
    expected = reference.update()
    calls.clear()
    out = lens.after_step(1, model, True)
    assert len(calls) == 2  # S4 for the step and since the start, once each
    assert out["sparsity/update_step"] == expected["sparsity/update_step"]
    assert out["sparsity/update_total"] == expected["sparsity/update_total"]
    assert 0.2 < out["sparsity/update_step"] < 0.9 and out["sparsity/update_total"] < out["sparsity/update_step"]
