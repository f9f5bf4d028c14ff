"""The per-rollout term the lens and probe measure is the one the trainer's update sums (docs/theory.md §3).

For every loss aggregation, on the first on-policy pass (ratio 1, beta = 0) the trainer's actual loss gradient (taken
from ``policy_update`` just before its optimizer step) must equal -(1/N) sum_i A_i omega_i sum_t grad log pi(o_{i,t}),
omega = ``rollout_gradient_weights``: exactly for the exact per-rollout gradients, and for the per-layer rows of the
identity-projection sketch (the lens's path with P = I). The length-normalised g_i alone matches only
seq-mean-token-mean: for token-mean and Dr. GRPO it points elsewhere (the completions have lengths 1-6).
"""

from __future__ import annotations

import pytest
import torch
from _distributed_worker import TEMPERATURE, B, R, T, build_batch, build_model
from references import gram_of

from grpo_lens.analysis.group import analyse_group, mean_over_groups
from grpo_lens.config import TrainConfig
from grpo_lens.formulas.losses import (
    LOSS_AGGREGATIONS,
    loss_normalizer,
    rollout_gradient_weights,
)
from grpo_lens.formulas.zero_sum import weightings
from grpo_lens.gradients.exact import exact_rollout_grads, layer_weight_grads
from grpo_lens.gradients.g2 import G2WeightingCapture, module_kind
from grpo_lens.gradients.params import param_slices
from grpo_lens.gradients.sketch import sketch_rollout_grads
from grpo_lens.lens.step_batch import StepBatch
from grpo_lens.runtime.processes import Processes
from grpo_lens.train.update import policy_update


def _trainer_gradient(model, batch, advantages, mode, metrics=None):
    """The flat loss gradient policy_update computes before its (first and only) optimizer step (its metrics into
    ``metrics`` when given)."""
    config = TrainConfig(
        model="tiny",
        group_size=R,
        prompts_per_step=B,
        max_new_tokens=T,
        temperature=TEMPERATURE,
        loss_aggregation=mode,
        num_mini_batches=1,
        mu=1,
        micro_batch_size=3,
        beta=0.0,
        max_grad_norm=0.0,
        progress=False,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    grads: list[torch.Tensor] = []

    def snapshot():
        grads.append(torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params]))

    out = policy_update(
        model,
        torch.optim.SGD(params, lr=0.0),
        batch,
        advantages,
        None,
        config,
        Processes(0, 1, torch.device("cpu")),
        params,
        before_step=snapshot,
    )
    if metrics is not None:
        metrics.update(out)
    return grads[0].double()


@pytest.mark.e2e
def test_groups_without_a_gradient_are_forwarded_without_one(monkeypatch):
    # Groups whose advantages are all exactly 0 add nothing to the clipped surrogate's gradient (-min(rho A,
    # clip(rho) A) = 0 for any rho), so the update forwards them without gradient and leaves them out of the backward
    # (train.update.still_rows). Micro-batches of 3 rows (R = 2): group 1 (rows 2, 3) spans two of them, group 3
    # (rows 6, 7) is a micro-batch of its own, which then has no backward at all.
    from grpo_lens.train import update

    torch.manual_seed(0)
    model = build_model()
    batch, advantages, _ = build_batch(model)
    advantages[2:4] = 0.0
    advantages[6:8] = 0.0
    forwards = []  # (rows, gradients on) of every policy forward
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: forwards.append((kw["input_ids"].shape[0], torch.is_grad_enabled())), with_kwargs=True
    )
    try:
        fast_metrics, full_metrics = {}, {}
        fast = _trainer_gradient(model, batch, advantages, "token-mean", fast_metrics)
        fast_forwards = list(forwards)
        with monkeypatch.context() as m:
            m.setattr(update, "still_rows", lambda *a: None)  # every row through the backward, as before
            forwards.clear()
            full = _trainer_gradient(model, batch, advantages, "token-mean", full_metrics)
            assert forwards == [(3, True), (3, True), (2, True)]
            # the same skip with group 2 (advantages not 0) marked still too drops a real term: far off
            wrong = torch.zeros(B * R, dtype=torch.bool)
            wrong[2:6] = True
            wrong[6:8] = True
            m.setattr(update, "still_rows", lambda *a: wrong)
            dropped = _trainer_gradient(model, batch, advantages, "token-mean")
    finally:
        hook.remove()
    # micro-batch [0, 1, 2]: row 2 without gradient, then rows 0-1; [3, 4, 5]: row 3, then 4-5; [6, 7]: no gradient
    assert fast_forwards == [(1, False), (2, True), (1, False), (2, True), (2, False)]
    # the same sum without exact zeros (float32: GEMMs over fewer rows round differently)
    assert float((fast - full).norm() / full.norm()) < 1e-6
    assert float((dropped - full).norm() / full.norm()) > 1e-2
    assert fast_metrics.keys() == full_metrics.keys()
    for key, value in full_metrics.items():
        assert fast_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.e2e
@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_sum_of_weighted_rollout_terms_is_the_trainers_gradient(mode):
    torch.manual_seed(0)
    model = build_model()
    batch, advantages, _ = build_batch(model)
    N = batch.num_rollouts
    want = _trainer_gradient(model, batch, advantages, mode)
    omega = rollout_gradient_weights(batch.completion_mask, mode, loss_normalizer(batch.completion_mask, mode, T))
    rows = exact_rollout_grads(model, batch, score_weights=omega, temperature=TEMPERATURE).double()  # [N, P]
    got = -(advantages.double() @ rows) / N
    assert float((got - want).norm() / want.norm()) < 1e-5, mode

    # the sketch path (P = I: exact per-row weight gradients of every nn.Linear) sums to the same linear-weight part
    sketch = sketch_rollout_grads(
        model, batch, projection="identity", score_weights=omega, temperature=TEMPERATURE, dtype=torch.float64
    )
    slices = param_slices(model)
    for name in ("model.layers.0.mlp.down_proj", "lm_head"):
        key = name + ".weight"
        if key not in slices:
            continue
        got_layer = -(advantages.double() @ sketch.per_layer[name]) / N
        want_layer = want[slices[key]]
        assert float((got_layer - want_layer).norm() / want_layer.norm()) < 1e-5, (mode, name)

    # the length-normalised g_i (omega = 1/|o_i|) is the right term only for seq-mean-token-mean
    plain = exact_rollout_grads(model, batch, temperature=TEMPERATURE).double()
    cos = float(torch.nn.functional.cosine_similarity(-(advantages.double() @ plain), want, dim=0))
    if mode == "seq-mean-token-mean":
        assert cos > 1 - 1e-9
    else:
        assert cos < 0.99, (mode, cos)


def test_rollout_weights_reproduce_every_numerator():
    # numerator(l, m) = sum_i v_i sum_t l_it m_it for every registered mode (what omega is built from)
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.arange(7).unsqueeze(0) < torch.tensor([7, 3, 1, 5, 0]).unsqueeze(1)
    m = mask.double()
    for mode in LOSS_AGGREGATIONS.names():
        agg = LOSS_AGGREGATIONS.get(mode)
        want = agg.numerator(loss, m)
        got = (agg.rollout_weights(m) * (loss * m).sum(1)).sum()
        assert float(got) == pytest.approx(float(want), rel=1e-12), mode
    # closed form: seq-mean omega = 1/|o_i|; token-mean omega = N / sum|o| = 4/16 (4 rollouts with a token);
    # Dr. GRPO omega = 1/T_max = 1/7
    w = rollout_gradient_weights(mask, "seq-mean-token-mean", loss_normalizer(mask, "seq-mean-token-mean", 7))
    assert w[:4].tolist() == pytest.approx([1 / 7, 1 / 3, 1.0, 1 / 5])
    w = rollout_gradient_weights(mask, "token-mean", loss_normalizer(mask, "token-mean", 7))
    assert w.tolist() == pytest.approx([4 / 16] * 5)
    w = rollout_gradient_weights(mask, "seq-mean-token-sum-norm", loss_normalizer(mask, "seq-mean-token-sum-norm", 7))
    assert w.tolist() == pytest.approx([1 / 7] * 5)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "estimator,std", [("grpo", "sample"), ("grpo", "population"), ("dr_grpo", "sample"), ("rloo", "sample")]
)
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_lens_is_the_mean_of_the_per_group_path(estimator, std, mode):
    """TrainerLens.measure = mean over mixed groups of analyse_group on the same sketched rows; the identity uses the
    estimator's own constant, so its residual is round-off for every estimator and std convention."""
    from grpo_lens.formulas.advantages import compute_advantages
    from grpo_lens.lens.trainer_lens import TrainerLens

    torch.manual_seed(0)
    model = build_model()
    batch, _, _ = build_batch(model)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])  # groups 0, 1, 3 mixed; group 2 all-equal
    valid = torch.ones(8, dtype=torch.bool)
    adv = compute_advantages(rewards.view(B, R), estimator, std=std, std_eps=1e-4).view(-1)
    config = TrainConfig(
        model="tiny",
        group_size=R,
        prompts_per_step=B,
        max_new_tokens=T,
        temperature=TEMPERATURE,
        estimator=estimator,
        std=std,
        loss_aggregation=mode,
        sketch_dim=8,
        progress=False,
        gram_source="sketch",
    )
    out = TrainerLens(model, config).measure(StepBatch(3, model, batch, rewards, valid, adv))
    assert out["rank/mixed_groups"] == 3.0
    assert out["grad/identity_residual"] < 1e-5
    # the same numbers from the per-group function on the same sketch (same seed, same omega)
    mixed = [0, 1, 3]
    idx = torch.tensor([b * R + i for b in mixed for i in range(R)])
    sub = batch.select(idx)
    omega = rollout_gradient_weights(
        sub.completion_mask,
        mode,
        loss_normalizer(batch.completion_mask, mode, T),
        float(batch.completion_mask.any(1).sum()),
    )
    sk = sketch_rollout_grads(
        model, sub, sketch_in=8, sketch_out=8, seed=config.seed, score_weights=omega, temperature=TEMPERATURE
    ).sketch.double()
    rows = [
        analyse_group(
            gram_of(sk[j * R : (j + 1) * R]),
            rewards[b * R : (b + 1) * R].double(),
            adv[b * R : (b + 1) * R].double(),
            estimator=estimator,
            std=std,
            std_eps=1e-4,
            completion_mask=sub.completion_mask[j * R : (j + 1) * R],
            completion_ids=sub.completion_ids[j * R : (j + 1) * R],
            num_random=4,
            seed=config.seed + 3 * 1009 + b,
        )
        for j, b in enumerate(mixed)
    ]
    want = mean_over_groups(rows)
    for key in (
        "rank/g1_erank",
        "rank/g1_null_erank",
        "baseline/m_correct",
        "grad/identity_constant",
        "rank/g1_random_erank",
    ):
        assert out[key] == pytest.approx(want[key], rel=1e-9), key


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_lens_with_the_exact_gram_is_the_per_group_path_on_dense_exact_gradients(mode):
    """The default lens (``gram_source: exact``): the mean over mixed groups of analyse_group on each group's block of
    the dense exact Gram (one backward per rollout, every parameter), to float32 rounding; coverage 1. A lens that
    used the sketch, dropped a parameter kind or mixed groups' blocks would be off by far more than 1e-4."""
    from grpo_lens.formulas.advantages import compute_advantages
    from grpo_lens.lens.trainer_lens import TrainerLens

    torch.manual_seed(0)
    model = build_model()
    batch, _, _ = build_batch(model)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])  # groups 0, 1, 3 mixed; group 2 all-equal
    valid = torch.ones(8, dtype=torch.bool)
    adv = compute_advantages(rewards.view(B, R), "grpo", std="sample", std_eps=1e-4).view(-1)
    config = TrainConfig(
        model="tiny",
        group_size=R,
        prompts_per_step=B,
        max_new_tokens=T,
        temperature=TEMPERATURE,
        loss_aggregation=mode,
        std_eps=1e-4,
        progress=False,
    )
    assert config.gram_source == "exact"  # the default
    out = TrainerLens(model, config).measure(StepBatch(3, model, batch, rewards, valid, adv))
    assert out["grad/gram_coverage"] == 1.0
    mixed = [0, 1, 3]
    idx = torch.tensor([b * R + i for b in mixed for i in range(R)])
    sub = batch.select(idx)
    omega = rollout_gradient_weights(
        sub.completion_mask,
        mode,
        loss_normalizer(batch.completion_mask, mode, T),
        float(batch.completion_mask.any(1).sum()),
    )
    g = exact_rollout_grads(model, sub, score_weights=omega, temperature=TEMPERATURE).double()
    rows = [
        analyse_group(
            gram_of(g[j * R : (j + 1) * R]),
            rewards[b * R : (b + 1) * R].double(),
            adv[b * R : (b + 1) * R].double(),
            estimator="grpo",
            std="sample",
            std_eps=1e-4,
            completion_mask=sub.completion_mask[j * R : (j + 1) * R],
            completion_ids=sub.completion_ids[j * R : (j + 1) * R],
            num_random=4,
            seed=config.seed + 3 * 1009 + b,
        )
        for j, b in enumerate(mixed)
    ]
    want = mean_over_groups(rows)
    for key in (
        "rank/g1_erank",
        "rank/g1_null_erank",
        "baseline/m_correct",
        "grad/identity_constant",
        "rank/g1_random_erank",
        "zero_sum/span_energy",
    ):
        assert out[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


@pytest.mark.e2e
def test_exact_layer_rows_from_the_sketch_pass():
    # the identity capture opened beside the sketch gives each rollout's exact weight gradient of the layer: the same
    # numbers as the one-backward-per-rollout oracle (G1_layer and G2 of the probe come from these rows)
    torch.manual_seed(0)
    model = build_model()
    batch, _, _ = build_batch(model)
    layer = "model.layers.1.mlp.down_proj"
    sk = sketch_rollout_grads(model, batch, sketch_in=4, sketch_out=4, exact_layers=[layer], temperature=TEMPERATURE)
    want = exact_rollout_grads(model, batch, temperature=TEMPERATURE)[:, param_slices(model)[layer + ".weight"]]
    got = sk.exact_layers[layer]
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert sk.per_layer[layer].shape[1] == 16  # the sketch itself is unchanged (4 x 4)


@pytest.mark.e2e
def test_g2_weighting_capture_matches_the_weight_gradients():
    # stable rank ||G2(w)||_F^2 / s_1^2 of every linear layer under each weighting, from one backward through
    # position-space Gram matrices, against G2(w) from autograd's weight gradients of sum_i w_i s_i
    from grpo_lens.gradients.scores import rollout_scores
    from grpo_lens.rollout import batch_logprobs

    torch.manual_seed(0)
    model = build_model().eval()
    batch, advantages, _ = build_batch(model)
    sub = batch.select(torch.arange(4))  # two groups of R = 2, as one pass of 4 rollouts
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    ws = weightings(advantages[:4].double(), rewards.double())
    cap = G2WeightingCapture(model, ws)
    with cap:
        logp = batch_logprobs(model, sub, TEMPERATURE)
        loss = rollout_scores(logp, sub.completion_mask).sum()
        torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)
    got = cap.result()
    for name, w in ws.items():
        grads = layer_weight_grads(model, sub, w.float(), None, temperature=TEMPERATURE)
        per_type: dict[str, list[float]] = {}
        for layer, g2 in grads.items():
            s = torch.linalg.svdvals(g2.double())
            per_type.setdefault(module_kind(layer), []).append(float(s.square().sum() / s[0] ** 2))
        for t, vals in per_type.items():
            assert got[f"rank/g2_{name}_{t}_stable_rank"] == pytest.approx(sum(vals) / len(vals), rel=1e-3), (name, t)


def _g2_capture(model, sub, ws, **kw) -> tuple[dict[str, float], G2WeightingCapture]:
    from grpo_lens.gradients.scores import rollout_scores
    from grpo_lens.rollout import batch_logprobs

    cap = G2WeightingCapture(model, ws, **kw)
    with cap:
        loss = rollout_scores(batch_logprobs(model, sub, TEMPERATURE), sub.completion_mask).sum()
        torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)
    return cap.result(), cap


@pytest.mark.e2e
def test_g2_weighting_capture_with_a_shared_prompt_gives_the_same_stable_ranks():
    # one group (4 rollouts of ONE prompt, left padded alike): the prompt positions' inputs are the same in every
    # rollout, so the capture may fold them into one row per position (sum_i w_i delta_{i,t}); the stable ranks must
    # be those of the uncompressed rows (which the test above checks against autograd's weight gradients)
    torch.manual_seed(0)
    model = build_model().eval()
    batch, advantages, _ = build_batch(model)
    sub = batch.select(torch.arange(4))
    sub.prompt_ids[:] = sub.prompt_ids[0].clone()
    sub.prompt_mask[:] = sub.prompt_mask[0].clone()
    sub.prompt_ids[:, 0], sub.prompt_mask[:, 0] = 258, 0  # one left pad token, the same in every rollout
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = advantages[:4].double() - advantages[:4].double().mean()
    ws = weightings(adv, rewards.double())
    plain, _ = _g2_capture(model, sub, ws)
    lp, seq = sub.prompt_ids.shape[1], sub.prompt_ids.shape[1] + sub.completion_ids.shape[1]
    folded, cap = _g2_capture(model, sub, ws, shared_prefix=lp, seq_len=seq)
    assert folded.keys() == plain.keys() and len(plain) == len(ws) * len({module_kind(n) for n in cap.layers})
    for key, value in plain.items():
        assert folded[key] == pytest.approx(value, rel=1e-4), key
    # a batch of two prompts is not one group: the capture refuses to fold it
    two = batch.select(torch.arange(4))
    with pytest.raises(ValueError, match="differ at the shared prefix"):
        _g2_capture(model, two, ws, shared_prefix=lp, seq_len=seq)
    with pytest.raises(ValueError, match="needs seq_len"):
        G2WeightingCapture(model, ws, shared_prefix=lp)
