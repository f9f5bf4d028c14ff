"""Rank measures against closed-form spectra; G1 controls; distinct completions; the G2 rank bound."""

import math

import pytest
import torch
from references import gram_of
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lens.analysis.group import analyse_group
from grpo_lens.formulas.spectrum import (
    G1_CONTROLS,
    RANK_MEASURES,
    count_distinct_prefixes,
    distinct_completions,
    distinct_completions_per_group,
    energy_rank,
    g1_controls,
    g1_matrix,
    g2_rank_bound,
    gram_singular_values,
    group_row_sums,
    matrix_rank_measures,
    numerical_rank,
    random_zero_sum_weights,
    rank_measures,
    singular_values,
)
from grpo_lens.gradients.exact import layer_weight_grads
from grpo_lens.rollout import RolloutBatch


def test_two_singular_values_closed_form():
    # s = (3, 1): p = (3/4, 1/4), erank = exp(-(0.75 ln 0.75 + 0.25 ln 0.25)) = 1.75483...;
    # energies (9, 1): stable rank = 10/9, participation ratio = 10^2 / (81 + 1) = 100/82;
    # s_1 holds exactly 9/10 of the energy -> k90 = 1, k99 = 2.
    m = rank_measures(torch.tensor([3.0, 1.0]))
    assert m["erank"] == pytest.approx(math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))), rel=1e-12)
    assert m["erank"] == pytest.approx(1.754765, rel=1e-6)
    assert m["stable_rank"] == pytest.approx(10 / 9, rel=1e-12)
    assert m["participation_ratio"] == pytest.approx(100 / 82, rel=1e-12)
    assert (m["k90"], m["k99"]) == (1, 2)


def test_flat_spectrum_and_rank_one_and_zero():
    # n equal singular values: erank = stable rank = PR = n; k90 = ceil(0.9 n), k99 = ceil(0.99 n).
    m = rank_measures(torch.ones(10))
    for key in ("erank", "stable_rank", "participation_ratio"):
        assert m[key] == pytest.approx(10.0, rel=1e-12)
    assert (m["k90"], m["k99"]) == (9, 10)
    # one non-zero value: every measure is 1 (0 ln 0 = 0)
    assert rank_measures(torch.tensor([2.0, 0.0, 0.0])) == {
        "erank": 1.0,
        "k90": 1.0,
        "k99": 1.0,
        "participation_ratio": 1.0,
        "stable_rank": 1.0,
        "top1_share": 1.0,
        "top2_share": 1.0,
    }
    # zero matrix: all 0, no NaN, on every path
    zero = rank_measures(singular_values(torch.zeros(4, 100)))
    assert zero == {k: 0.0 for k in RANK_MEASURES.names()}
    assert all(v == 0.0 for k, v in matrix_rank_measures(torch.zeros(3, 3)).items())


def test_diagonal_matrix_singular_values_and_energy_rank():
    # diag(4, 2, 1, 0.5): energies 16, 4, 1, 0.25 (sum 21.25); 16/21.25 = 0.753, 20/21.25 = 0.941 -> k90 = 2;
    # 21/21.25 = 0.988 -> k99 = 4 (needs the last one).
    d = torch.diag(torch.tensor([1.0, 4.0, 0.5, 2.0]))
    for method in ("svd", "gram", "auto"):
        torch.testing.assert_close(singular_values(d, method), torch.tensor([4.0, 2.0, 1.0, 0.5], dtype=torch.float64))
    assert energy_rank(torch.tensor([4.0, 2.0, 1.0, 0.5]), 0.9) == 2
    assert energy_rank(torch.tensor([4.0, 2.0, 1.0, 0.5]), 0.99) == 4


def test_gram_path_matches_svd_for_few_rows():
    g = torch.Generator().manual_seed(0)
    m = (
        torch.randn(6, 2000, generator=g, dtype=torch.float64)
        * torch.tensor([5.0, 3, 2, 1, 0.5, 0.1]).double()[:, None]
    )
    torch.testing.assert_close(singular_values(m, "gram"), torch.linalg.svdvals(m), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gram_singular_values(m @ m.T), torch.linalg.svdvals(m), rtol=1e-10, atol=1e-10)
    assert numerical_rank(singular_values(m[:3].repeat(2, 1), "svd")) == 3
    # float32 round-off on a rank-3 matrix counts as rank under the float64 rule, not under the float32 one
    noisy = (m[:3].repeat(2, 1).float()).double() + 1e-7 * torch.randn(6, 2000, generator=g, dtype=torch.float64)
    assert numerical_rank(singular_values(noisy, "svd"), shape=(6, 2000)) == 6
    assert numerical_rank(singular_values(noisy, "svd"), shape=(6, 2000), dtype=torch.float32) == 3


def test_registry_and_input_errors():
    with pytest.raises(ValueError, match="erank, k90, k99, participation_ratio, stable_rank"):
        rank_measures(torch.ones(2), names=["nuclear"])
    with pytest.raises(ValueError, match=">= 0"):
        rank_measures(torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="auto, gram, svd"):
        singular_values(torch.ones(2, 2), method="qr")


def test_random_zero_sum_weights_and_g1_controls():
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5])
    w = random_zero_sum_weights(adv, 5, torch.Generator().manual_seed(0))
    assert w.shape == (5, 4)
    torch.testing.assert_close(w.sum(-1), torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(w.norm(dim=-1), torch.full((5,), float(adv.norm()), dtype=torch.float64))
    assert random_zero_sum_weights(torch.zeros(4), 2).abs().max() == 0

    # Identical completions -> identical g_i: every control has rank 1 (g1_controls: the body analyse_group reports).
    g = torch.randn(1, 50).repeat(4, 1).double()
    mask = torch.ones(4, 3, dtype=torch.bool)
    controls = g1_controls(g @ g.T, adv, mask)
    assert tuple(controls) == G1_CONTROLS
    for name in ("g1", "g1_no_adv", "g1_random", "g1_nll"):
        assert controls[name]["erank"] == pytest.approx(1.0) and controls[name]["k99"] == 1
    # Orthonormal g_i: rows A_i g_i have singular values |A_i| = (1.5, .5, .5, .5):
    # stable rank = (2.25 + 0.75) / 2.25 = 4/3; score rows have 4 equal singular values -> erank 4.
    eye = torch.eye(4, 50, dtype=torch.float64)
    controls = g1_controls(eye @ eye.T, adv)
    assert controls["g1"]["stable_rank"] == pytest.approx(4 / 3)
    assert controls["g1_no_adv"]["erank"] == pytest.approx(4.0)
    torch.testing.assert_close(g1_matrix(torch.eye(4, 50), adv)[:, :4], torch.diag(adv))
    # the key the tool prints: adv = grpo's advantages of rewards (1, 0, 0, 0) (sample std 1/2, eps 0)
    row = analyse_group(gram_of(torch.eye(4, 50)), torch.tensor([1.0, 0.0, 0.0, 0.0]), adv, std_eps=0.0)
    assert row["rank/g1_stable_rank"] == pytest.approx(4 / 3)


def test_g3_rows_are_group_sums():
    grads = torch.arange(12.0).reshape(6, 2)
    adv = torch.tensor([[1.0, -1.0, 0.0], [0.5, 0.5, -1.0]])
    # group 0: g0 - g1 = (0,1) - (2,3) = (-2, -2); group 1: .5 (6,7) + .5 (8,9) - (10,11) = (-3, -3)
    torch.testing.assert_close(group_row_sums(grads, 3, adv), torch.tensor([[-2.0, -2.0], [-3.0, -3.0]]))


def test_distinct_completions_and_prefixes():
    ids = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 2, 3], [5, 9, 9]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    # completions (1,2,3), (1,2,4), (1,2,3), (5,) -> 3 distinct;
    # prefixes (1), (1,2), (1,2,3), (1,2,4), (5) -> 5 distinct
    assert distinct_completions(ids, mask) == 3
    assert count_distinct_prefixes(ids, mask) == 5
    # proper prefixes (shorter than their completion): (1), (1,2) -> 2
    assert count_distinct_prefixes(ids, mask, proper=True) == 2
    assert distinct_completions_per_group(ids, mask, 2).tolist() == [2, 2]
    prompt_mask = torch.tensor([[0, 1, 1]] * 4)
    assert g2_rank_bound(prompt_mask, ids, mask) == 2 + 2


@pytest.mark.e2e
def test_g2_numerical_rank_within_prompt_plus_prefix_bound():
    # One group, 3 prompt tokens, R = 4 completions of 3 tokens sharing the first token: proper prefixes are
    # (7) and four (7, a_i), so the bound is 3 + 1 + 4 = 8 < 16 = min(d_out, d_in) of the smallest layer. It is
    # tight: the MLP layers reach it (layer 0's q_proj has rank 7: the first position attends only to itself, so
    # its query gets no gradient).
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double().eval()
    g = torch.Generator().manual_seed(1)
    r = 4
    completion_ids = torch.cat([torch.full((r, 1), 7), torch.randint(1, 50, (r, 2), generator=g)], dim=1)
    completion_mask = torch.ones(r, 3, dtype=torch.bool)
    prompt_ids = torch.randint(1, 50, (1, 3), generator=g).repeat(r, 1)
    batch = RolloutBatch(
        prompt_ids,
        torch.ones(r, 3, dtype=torch.long),
        completion_ids,
        completion_mask,
        torch.zeros(r, 3),
        torch.zeros(r, dtype=torch.bool),
        r,
    )
    bound = g2_rank_bound(batch.prompt_mask, completion_ids, completion_mask)
    assert bound == 8
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64)
    g2 = layer_weight_grads(model, batch, adv)
    ranks = {name: numerical_rank(singular_values(mat, "svd"), rtol=1e-10) for name, mat in g2.items()}
    for name, mat in g2.items():
        assert 0 < ranks[name] <= bound < min(mat.shape), name
    assert ranks["model.layers.0.mlp.down_proj"] == bound
    assert ranks["model.layers.0.self_attn.q_proj"] == bound - 1


def test_top_energy_shares_and_the_simulated_null():
    from grpo_lens.formulas.spectrum import (
        random_direction_grams,
        simulated_null_measures,
    )

    # singular values (4, 2, 1, 0.5): energies 16, 4, 1, 0.25 of 21.25 -> top-1 0.75294, top-2 20/21.25 = 0.94118
    m = rank_measures(torch.tensor([1.0, 4.0, 0.5, 2.0]))
    assert m["top1_share"] == pytest.approx(16 / 21.25, rel=1e-12) and m["top2_share"] == pytest.approx(20 / 21.25)
    # uniform unit vectors in R^P: unit diagonal, off-diagonal cosines with mean 0 and variance 1/P (both branches
    # of the chi-square draw: sums of squares at P = 64, Wilson-Hilferty at P = 4096); 20000 draws, SE of the
    # variance ratio ~0.01, so 5% tolerances catch a wrong degrees of freedom (P - i vs P: ratio off by R/P only at
    # small P) or a missing normalisation (diagonal != 1)
    gen = torch.Generator().manual_seed(0)
    for p in (64, 4096):
        c = random_direction_grams(4, p, 20000, gen)
        assert torch.allclose(c.diagonal(dim1=1, dim2=2), torch.ones(20000, 4, dtype=torch.float64))
        off = c[:, 0, 1]
        assert abs(float(off.mean())) < 4 / (p**0.5 * 141) and float(off.var()) * p == pytest.approx(1.0, rel=0.05)
    # the simulated null of equal-norm rows: at huge P the directions are orthogonal (erank = R = 4, flat); in few
    # dimensions random rows overlap and the null's erank drops (3.52 at P = 5, 3.95 at P = 50)
    gram = torch.eye(4, dtype=torch.float64)
    a = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    e9, e50, e5 = (simulated_null_measures(gram, a, p, num_draws=200)["erank"] for p in (10**9, 50, 5))
    assert e9 == pytest.approx(4.0, abs=1e-3) and e5 < 3.7 < e50 < e9


def _psd_pair_with_top_singular_values(s, d_in=80, seed=0):
    """K_X = X Xᵀ and K_D = D Dᵀ with Dᵀ X = M' = U diag(s) Vᵀ exactly: D = Q C, X = Q C^-T M' (C invertible and far
    from orthogonal, so K_X K_D = Q C^-T M' M'ᵀ Cᵀ Qᵀ is similar to M' M'ᵀ but not normal)."""
    g = torch.Generator().manual_seed(seed)
    n = len(s)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d_in, n, generator=g, dtype=torch.float64))
    m = u @ torch.diag(torch.tensor(s, dtype=torch.float64)) @ v.T
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    c = torch.eye(n, dtype=torch.float64) + 0.5 * torch.randn(n, n, generator=g, dtype=torch.float64)
    d, x = q @ c, q @ torch.linalg.inv(c).T @ m
    return x @ x.T, d @ d.T, d.T @ x


def test_top_eigenvalue_of_a_psd_product_with_close_top_singular_values():
    from grpo_lens.formulas.spectrum import top_eigenvalue_psd_product

    # s1 = 1, s2 = 0.99 (lambda ratio 0.98), the rest <= 0.3: lambda_max(K_X K_D) = s1^2 = 1 exactly by construction
    s = [1.0, 0.99] + [0.3 * 0.9**i for i in range(58)]
    kx, kd, m = _psd_pair_with_top_singular_values(s)
    assert float(torch.linalg.svdvals(m)[0]) == pytest.approx(1.0, abs=1e-12)
    lam, _ = top_eigenvalue_psd_product(kx, kd)
    assert lam == pytest.approx(1.0, rel=1e-6)
    # the 0.1 body: 50 iterations of ||K_X K_D v|| from the ones vector, no check; off by ~4e-3 here, which the
    # tolerance above would not accept
    v = torch.ones(60, dtype=torch.float64) / 60**0.5
    for _ in range(50):
        w = kx @ (kd @ v)
        old, v = float(w.norm()), w / w.norm()
    assert abs(old - 1.0) > 1e-3
    # well-separated top eigenvalue (s2 = 0.5): the iteration converges by its residual check, same value as svdvals
    kx, kd, m = _psd_pair_with_top_singular_values([2.0, 1.0] + [0.3 * 0.9**i for i in range(58)], seed=1)
    lam, converged = top_eigenvalue_psd_product(kx, kd)
    assert converged and lam == pytest.approx(float(torch.linalg.svdvals(m)[0]) ** 2, rel=1e-6)
    # float32 inputs (as the capture passes them) and a forced fallback agree with the exact value to float32 rounding
    lam32, _ = top_eigenvalue_psd_product(kx.float(), kd.float(), max_iter=1)
    assert lam32 == pytest.approx(4.0, rel=1e-4)
    assert top_eigenvalue_psd_product(kx, torch.zeros_like(kd)) == (0.0, True)
    with pytest.raises(ValueError, match="one shape"):
        top_eigenvalue_psd_product(kx, kd[:3, :3])


def test_batched_top_eigenvalues_equal_one_problem_at_a_time():
    from grpo_lens.formulas.spectrum import (
        top_eigenvalue_psd_product,
        top_eigenvalues_psd_products,
    )

    # three K_D's against one K_X: a well-separated top (converges), close top singular values (slower), and K_D = 0
    # (value 0 by definition); each problem leaves the batch when it converges, so its value is the one-at-a-time one
    kx, kd1, m1 = _psd_pair_with_top_singular_values([2.0, 1.0] + [0.3 * 0.9**i for i in range(58)], seed=1)
    g = torch.Generator().manual_seed(3)
    d2 = kd1 @ torch.diag(torch.rand(60, generator=g, dtype=torch.float64) + 0.5)
    kd2 = (d2 + d2.T) / 2 + 60 * torch.eye(60, dtype=torch.float64)  # PSD, a different spectrum
    kds = torch.stack([kd1, kd2, torch.zeros_like(kd1)])
    lams, converged = top_eigenvalues_psd_products(kx, kds)
    singles = [top_eigenvalue_psd_product(kx, k) for k in kds]
    assert lams.tolist() == pytest.approx([s for s, _ in singles], rel=1e-9)
    assert converged.tolist() == [c for _, c in singles]
    assert float(lams[0]) == pytest.approx(float(torch.linalg.svdvals(m1)[0]) ** 2, rel=1e-6)
    # the exact fallback (max_iter=1) of the batch: lambda_max from eigvalsh of R^T K_D R, per problem
    exact = [float(torch.linalg.eigvals(kx @ k).real.max()) for k in kds[:2]]
    lams1, conv1 = top_eigenvalues_psd_products(kx, kds[:2], max_iter=1)
    assert lams1.tolist() == pytest.approx(exact, rel=1e-8) and not bool(conv1.any())
    with pytest.raises(ValueError, match=r"kds \[W, n, n\]"):
        top_eigenvalues_psd_products(kx, kd1)
