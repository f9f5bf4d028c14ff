"""Per-rollout gradients: the sketched path against the exact oracle (STYLE.md §9)."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lens.formulas.sketch_error import (
    kronecker_sketch_variance,
    kronecker_sketch_variance_factor,
    sketch_gram_error_bound,
)
from grpo_lens.formulas.spectrum import group_row_sums, nll_weights
from grpo_lens.gradients.exact import (
    exact_nll_grad,
    exact_policy_grad,
    exact_rollout_grads,
    exact_weighted_grad,
    layer_weight_grads,
)
from grpo_lens.gradients.params import linear_layer_names, param_slices
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.gradients.sketch import (
    GradientCapture,
    sketch_nll_grad,
    sketch_policy_grad,
    sketch_rollout_grads,
    token_grad_sq_norms,
)
from grpo_lens.rollout import RolloutBatch, batch_logprobs

VOCAB = 50


def tiny_model(dtype=torch.float64, seed=0):
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_batch(num_groups=2, group_size=3, prompt_len=5, completion_len=6, seed=0):
    """Random ids; prompt i of a group left-padded by a shared amount, completions of varying length (one empty)."""
    g = torch.Generator().manual_seed(seed)
    n = num_groups * group_size
    prompt_ids = torch.randint(1, VOCAB, (num_groups, prompt_len), generator=g).repeat_interleave(group_size, 0)
    prompt_mask = torch.ones(n, prompt_len, dtype=torch.long)
    prompt_mask[:group_size, :2] = 0  # first group's prompt is 2 tokens shorter
    prompt_ids[prompt_mask == 0] = 0
    completion_ids = torch.randint(1, VOCAB, (n, completion_len), generator=g)
    lengths = torch.randint(1, completion_len + 1, (n,), generator=g)
    lengths[-1] = 0  # an empty completion: g_i = 0
    completion_mask = torch.arange(completion_len).unsqueeze(0) < lengths.unsqueeze(1)
    completion_ids[~completion_mask] = 0
    return RolloutBatch(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        torch.zeros(n, completion_len),
        torch.zeros(n, dtype=torch.bool),
        group_size,
    )


# Paths that weight rows before vs after the float32 log-softmax of completion_logprobs differ by float32
# round-off in the logits' gradient: about float32 eps (1.2e-7) times the largest entry (~1).
FP32_TOL = dict(rtol=1e-6, atol=1e-7)


def linear_weight_names(model):
    return [f"{n}.weight" for n in linear_layer_names(model)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def batch():
    return tiny_batch()


@pytest.fixture(scope="module")
def exact(model, batch):
    return exact_rollout_grads(model, batch, linear_weight_names(model))


@pytest.mark.e2e
def test_exact_rows_are_gradients_of_length_normalised_scores(model, batch, exact):
    # Row i is grad of (1/|o_i|) sum_t log pi: a central difference along a unit direction u checks <g_i, u>.
    # u leans on the rows themselves so that <g_i, u> is O(||g_i||), far above the difference's error:
    # completion_logprobs takes the log-softmax in float32 (rounding ~2e-7 per score -> ~1e-5 after dividing by
    # 2h with h = 1e-2) and the O(h^2) truncation is ~1e-5. Forgetting 1/|o_i| would be off by a factor 2-6.
    names = linear_weight_names(model)
    params = dict(model.named_parameters())
    slices = param_slices(model, names)
    lean = exact.sum(0) / exact.sum(0).norm()
    noise = torch.randn(exact.shape[1], dtype=exact.dtype, generator=torch.Generator().manual_seed(1))
    u_flat = lean + noise / noise.norm()
    u_flat = u_flat / u_flat.norm()
    u = {n: u_flat[slices[n]].view_as(params[n]) for n in names}
    h = 1e-2

    def scores():
        with torch.no_grad():
            return rollout_scores(batch_logprobs(model, batch), batch.completion_mask)

    with torch.no_grad():
        for n in names:
            params[n].add_(h * u[n])
    plus = scores()
    with torch.no_grad():
        for n in names:
            params[n].sub_(2 * h * u[n])
    minus = scores()
    with torch.no_grad():
        for n in names:
            params[n].add_(h * u[n])
    fd = ((plus - minus) / (2 * h)).double()
    torch.testing.assert_close(exact @ u_flat, fd, rtol=1e-3, atol=1e-3)
    assert exact[-1].abs().max() == 0  # empty completion: g = 0


@pytest.mark.e2e
def test_identity_projection_sketch_equals_exact_per_rollout_gradient(model, batch, exact):
    sk = sketch_rollout_grads(model, batch, projection="identity", dtype=torch.float64)
    slices = param_slices(model, linear_weight_names(model))
    for name in sk.layer_names:
        torch.testing.assert_close(sk.per_layer[name], exact[:, slices[f"{name}.weight"]], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sk.sketch, exact, rtol=1e-10, atol=1e-12)


@pytest.mark.e2e
def test_weighted_rows_policy_and_nll_gradients_exact_and_sketched(model, batch, exact):
    names = linear_weight_names(model)
    adv = torch.tensor([1.0, -0.5, -0.5, 0.7, 0.7, -1.4], dtype=torch.float64)
    # exact: one batched backward of sum_i w_i s_i == w @ (rows of per-rollout backward)
    torch.testing.assert_close(exact_weighted_grad(model, batch, adv, names), adv @ exact, **FP32_TOL)
    torch.testing.assert_close(exact_policy_grad(model, batch, adv, names), adv @ exact, **FP32_TOL)
    w_nll = nll_weights(batch.completion_mask).double()
    lengths = batch.completion_mask.sum(-1).double()
    torch.testing.assert_close(w_nll, -lengths / lengths.sum())  # token-mean NLL weights
    torch.testing.assert_close(exact_nll_grad(model, batch, names), w_nll @ exact, **FP32_TOL)
    # sketched (identity projection, so exact too): weighted rows and sums
    sk = sketch_rollout_grads(model, batch, projection="identity", dtype=torch.float64, weights=adv)
    torch.testing.assert_close(sk.sketch, adv.unsqueeze(1) * exact, **FP32_TOL)
    plain = sketch_rollout_grads(model, batch, projection="identity", dtype=torch.float64)
    torch.testing.assert_close(sketch_policy_grad(plain, adv), adv @ exact, **FP32_TOL)
    torch.testing.assert_close(sketch_nll_grad(plain, batch.completion_mask), w_nll @ exact, **FP32_TOL)
    # G3 rows: per-group sums
    torch.testing.assert_close(group_row_sums(exact, 3, adv), torch.stack([adv[:3] @ exact[:3], adv[3:] @ exact[3:]]))


@pytest.mark.e2e
def test_layer_weight_grads_is_weighted_sum_of_rollout_grads(model, batch, exact):
    adv = torch.tensor([1.0, -0.5, -0.5, 0.7, 0.7, -1.4], dtype=torch.float64)
    g2 = layer_weight_grads(model, batch, adv, layers=r"mlp")
    slices = param_slices(model, linear_weight_names(model))
    assert sorted(g2) == sorted(n for n in linear_layer_names(model) if "mlp" in n)
    for name, mat in g2.items():
        assert mat.shape == dict(model.named_modules())[name].weight.shape
        torch.testing.assert_close(mat.reshape(-1), adv @ exact[:, slices[f"{name}.weight"]], **FP32_TOL)


@pytest.mark.e2e
def test_sketch_does_not_touch_grad_and_capture_works_around_a_plain_backward(model, batch):
    for p in model.parameters():
        p.grad = None
    ref = sketch_rollout_grads(model, batch, sketch_in=4, sketch_out=8, seed=3)
    assert all(p.grad is None for p in model.parameters())
    assert ref.sketch.shape == (6, len(ref.layer_names) * 32)
    # The trainer's way: its own forward/backward, in two micro-batches; rows come back in forward order.
    with GradientCapture(model, sketch_in=4, sketch_out=8, seed=3) as cap:
        for rows in ([0, 1, 2], [3, 4, 5]):
            sub = batch.select(rows)
            rollout_scores(batch_logprobs(model, sub), sub.completion_mask).sum().backward()
        with torch.no_grad():  # ignored: no gradient
            model(input_ids=batch.input_ids())
    got = cap.result()
    assert any(p.grad is not None for p in model.parameters())
    for p in model.parameters():
        p.grad = None
    torch.testing.assert_close(got.sketch.double(), ref.sketch.double(), rtol=1e-4, atol=1e-6)


def test_kronecker_sketch_variance_formula_by_monte_carlo():
    # The exact variance of <P_out A P_in^T, P_out B P_in^T> (Wishart moments) against 200k sampled projection
    # pairs; the sample mean must be <A, B> (unbiased scaling) and the sample variance within a few % of the
    # formula (its own standard error here is ~1%). The worst-case bound c ||A||^2 ||B||^2 must lie above.
    g = torch.Generator().manual_seed(0)
    d_out, d_in, sketch_in, sketch_out, draws = 5, 4, 3, 2, 200_000
    a = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    b = a + 0.5 * torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    p_in = torch.randn(draws, sketch_in, d_in, generator=g, dtype=torch.float64) / math.sqrt(sketch_in)
    p_out = torch.randn(draws, sketch_out, d_out, generator=g, dtype=torch.float64) / math.sqrt(sketch_out)
    x = ((p_out @ a @ p_in.transpose(1, 2)) * (p_out @ b @ p_in.transpose(1, 2))).sum((1, 2))
    var = kronecker_sketch_variance(a, b, sketch_in, sketch_out)
    assert float(x.mean()) == pytest.approx(float((a * b).sum()), abs=4 * math.sqrt(var / draws))
    assert float(x.var()) == pytest.approx(var, rel=0.05)
    assert var <= kronecker_sketch_variance_factor(sketch_in, sketch_out) * float(a.square().sum() * b.square().sum())
    # rank one, A = B: the bound is attained
    u = torch.randn(d_out, 1, generator=g, dtype=torch.float64) @ torch.randn(1, d_in, generator=g, dtype=torch.float64)
    assert kronecker_sketch_variance(u, u, sketch_in, sketch_out) == pytest.approx(
        kronecker_sketch_variance_factor(sketch_in, sketch_out) * float(u.square().sum()) ** 2
    )


@pytest.mark.e2e
def test_gaussian_sketch_gram_within_jl_bound_and_wrong_scaling_fails(model, batch, exact):
    # Bound (docstring of sketch_gram_error_bound): E||G_hat - G||_F^2 <= c sum_l (tr G_l)^2,
    # c = 2/sketch_in + 2/sketch_out + 4/(sketch_in sketch_out). Each seed's relative error must be within that bound,
    # and the mean of S independent seeds (unbiased) within bound / sqrt(S) * 1.5. A Gram off by a factor s has error
    # |s - 1|, which must break the averaged check for s in {2, 1/2, sketch_out}.
    k, seeds = 32, 8
    assert kronecker_sketch_variance_factor(k, k) == pytest.approx(2 / 32 + 2 / 32 + 4 / 1024)
    slices = param_slices(model, linear_weight_names(model))
    layer_grams = torch.stack([exact[:, s] @ exact[:, s].T for s in slices.values()])
    gram = layer_grams.sum(0)
    bound = sketch_gram_error_bound(layer_grams, k, k)
    assert 0 < bound < 1
    sketches = [
        sketch_rollout_grads(model, batch, sketch_in=k, sketch_out=k, seed=s, dtype=torch.float64).gram()
        for s in range(seeds)
    ]

    def rel_err(estimate):
        return float((estimate - gram).norm() / gram.norm())

    for est in sketches:
        assert rel_err(est) <= bound
    mean_gram = torch.stack(sketches).mean(0)
    tol = 1.5 * bound / math.sqrt(seeds)
    assert rel_err(mean_gram) <= tol
    for wrong in (2.0, 0.5, float(k)):
        assert rel_err(wrong * mean_gram) > tol


@pytest.mark.e2e
def test_token_sq_norms_equal_explicit_outer_products(model, batch):
    # Oracle: store x and delta of every linear layer, form delta_t x_t^T explicitly, sum squared Frobenius norms.
    store = {}
    handles = []
    for name in linear_layer_names(model):
        module = dict(model.named_modules())[name]

        def fwd(m, args, out, name=name):
            store[name] = [args[0].detach()]
            out.register_hook(lambda g: store[name].append(g.detach()))

        handles.append(module.register_forward_hook(fwd))
    try:
        loss = rollout_scores(batch_logprobs(model, batch), batch.completion_mask).sum()
        torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    L = batch.input_ids().shape[1]
    # The LM head runs on the last T + 1 positions only (logits_to_keep): its terms sit at the right end of the row.
    oracle = sum(
        torch.nn.functional.pad(torch.einsum("nto,nti->ntoi", d, x).square().sum((-1, -2)), (L - x.shape[1], 0))
        for x, d in store.values()
    )
    got = token_grad_sq_norms(model, batch)
    assert got.shape == batch.input_ids().shape
    torch.testing.assert_close(got.double(), oracle, rtol=1e-5, atol=1e-9)
    assert got[:3, :2].abs().max() == 0  # left-padding positions carry no gradient


@pytest.mark.e2e
def test_errors_name_the_valid_choices(model, batch):
    with pytest.raises(ValueError, match="gaussian, identity"):
        GradientCapture(model, projection="srht")
    with pytest.raises(ValueError, match="no linear layer of the model matches"):
        GradientCapture(model, include="no_such_layer")
    with pytest.raises(ValueError, match="unknown parameter names"):
        exact_rollout_grads(model, batch, ["nope.weight"])
    with pytest.raises(RuntimeError, match="no gradient was captured"):
        with GradientCapture(model) as cap:
            pass
        cap.result()
