"""The batched zero-sum statistics (span_energies, cosine_gaps) against a readable reference on explicit vectors."""

import torch

from grpo_lens.formulas.zero_sum import cosine_gaps, span_energies, zero_sum_tests


def _reference(g, labels, adv):
    # rows x_i = A_i g_i projected on span{mean g of the labelled, mean g of the others} by least squares
    u = torch.stack([g[labels].mean(0), g[~labels].mean(0)], 1)  # [P, 2]
    x = adv[:, None] * g
    proj = u @ torch.linalg.lstsq(u, x.T).solution  # [P, R]
    energy = float(proj.square().sum() / x.square().sum())
    n = g / g.norm(dim=1, keepdim=True)
    cos = n @ n.T
    same = [(i, j) for i in range(len(g)) for j in range(len(g)) if i != j and labels[i] == labels[j]]
    cross = [(i, j) for i in range(len(g)) for j in range(len(g)) if labels[i] != labels[j]]
    gap = sum(float(cos[i, j]) for i, j in same) / len(same) - sum(float(cos[i, j]) for i, j in cross) / len(cross)
    return energy, gap


def test_batched_statistics_equal_the_reference():
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(8, 50, generator=gen, dtype=torch.float64)
    labs = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [0, 1, 0, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 1, 1]]).bool()
    adv = torch.where(labs, 1.2, -0.7).double()
    e, c = span_energies(g @ g.T, labs, adv), cosine_gaps(g @ g.T, labs)
    for i in range(3):
        ref_e, ref_c = _reference(g, labs[i], adv[i])
        assert abs(float(e[i]) - ref_e) < 1e-10 and abs(float(c[i]) - ref_c) < 1e-10
    # collinear class means (M G Mᵀ singular): the pseudo-inverse gives the projection on the one direction (share 1)
    g2 = torch.cat([g[:1].repeat(3, 1), 2 * g[:1].repeat(5, 1)])
    assert abs(float(span_energies(g2 @ g2.T, labs[:1], adv[:1])[0]) - 1.0) < 1e-10


def test_null_variance_is_the_variance_over_all_relabellings():
    # R = 4, k = 2: 6 relabellings; the null mean and variance are those of the 6 span energies (population variance)
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(4, 30, generator=gen, dtype=torch.float64)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    adv = torch.tensor([0.866, 0.866, -0.866, -0.866], dtype=torch.float64)
    out = zero_sum_tests(g @ g.T, rewards, adv)
    labs = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1], [0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 1, 1]]).bool()
    e = span_energies(g @ g.T, labs, torch.where(labs, 0.866, -0.866).double())
    assert abs(out["zero_sum/span_energy_null"] - float(e.mean())) < 1e-12
    assert abs(out["zero_sum/span_energy_null_var"] - float(e.var(unbiased=False))) < 1e-12
