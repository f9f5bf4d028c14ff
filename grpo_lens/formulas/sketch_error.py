"""Error of the Kronecker (LoGra) sketch of per-rollout weight gradients (docs/theory.md §8).

A layer's weight gradient G [d_out, d_in] is sketched as S(G) = P_out G P_in^T with independent Gaussian projections
P_in [sketch_in, d_in], P_out [sketch_out, d_out] of N(0, 1/sketch_in), N(0, 1/sketch_out) entries
(:class:`grpo_lens.gradients.sketch.GradientCapture`; sketch_in = sketch_out = d_s = ``sketch_dim`` wherever grpo-lens
calls it, docs/theory.md §1), so sketched inner products <S(A), S(B)> are unbiased for <A, B>. This module gives their
variance:

- :func:`kronecker_sketch_variance`: the exact Var <S(A), S(B)> of one layer (Wishart moments).
- :func:`kronecker_sketch_variance_factor`: c(sketch_in, sketch_out), the worst-case relative variance (rank-one
  gradients).
- :func:`sketch_gram_error_bound`: the bound on the expected relative Frobenius error of the sketched Gram matrix of
  N rollouts over L layers, which the probe's sketch check (``sketch/gram_error_bound``) prints beside the measured
  error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def kronecker_sketch_variance_factor(sketch_in: int, sketch_out: int) -> float:
    """c(sketch_in, sketch_out) = 2/sketch_in + 2/sketch_out + 4/(sketch_in sketch_out): the worst-case relative
    variance of a sketched inner product.

    For one layer with independent Gaussian P_in [sketch_in, d_in], P_out [sketch_out, d_out] with N(0, 1/sketch_in),
    N(0, 1/sketch_out) entries and S(G) = P_out G P_in^T, the estimate X = <S(A), S(B)> of <A, B> is unbiased and
    (Wishart moments E[Q M Q] = M + (M^T + tr(M) I)/m for Q = P^T P, m the rows of P: sketch_in or sketch_out)

        Var X = (1/sketch_out) [tr((B A^T)^2) + ||B A^T||_F^2] + (1/sketch_in) [tr((A^T B)^2) + ||A^T B||_F^2]
              + (1/(sketch_in sketch_out)) [||B A^T||_F^2 + ||A^T B||_F^2 + <A,B>^2 + ||A||^2 ||B||^2]
              <= c(sketch_in, sketch_out) ||A||_F^2 ||B||_F^2,

    with equality for A = B of rank one (then X is a product of two independent chi^2 estimates). Higher-rank
    gradients get close to the floor ||A||^2 ||B||^2 / (sketch_in sketch_out) of a plain JL sketch of dimension
    sketch_in*sketch_out.
    """
    return 2.0 / sketch_in + 2.0 / sketch_out + 4.0 / (sketch_in * sketch_out)


def kronecker_sketch_variance(a: Tensor, b: Tensor, sketch_in: int, sketch_out: int) -> float:
    """Exact Var <S(A), S(B)> of the two-sided Gaussian sketch (formula of :func:`kronecker_sketch_variance_factor`).

    Args:
        a: [d_out, d_in] a weight gradient of one layer.
        b: [d_out, d_in] another weight gradient of the same layer.
        sketch_in: sketch size on the layer-input side.
        sketch_out: sketch size on the layer-output side.

    Returns:
        the variance, in squared units of <A, B>.
    """
    a, b = a.double(), b.double()
    ba, ab = b @ a.T, a.T @ b  # [d_out, d_out], [d_in, d_in]
    fro2 = lambda m: float(m.square().sum())  # noqa: E731
    return (
        (float(torch.trace(ba @ ba)) + fro2(ba)) / sketch_out
        + (float(torch.trace(ab @ ab)) + fro2(ab)) / sketch_in
        + (fro2(ba) + fro2(ab) + float((a * b).sum()) ** 2 + fro2(a) * fro2(b)) / (sketch_in * sketch_out)
    )


def sketch_gram_error_bound(layer_grams: Sequence[Tensor] | Tensor, sketch_in: int, sketch_out: int) -> float:
    """Bound on the expected relative Frobenius error of the sketched Gram matrix of N rollouts over L layers.

    Layers have independent projections, so entry variances add over layers; summing the bound of
    :func:`kronecker_sketch_variance_factor` over the N^2 entries gives

        E ||G_hat - G||_F^2 <= c(sketch_in, sketch_out) * sum_l (tr G_l)^2,
        rel_err = sqrt(E ||G_hat - G||_F^2) / ||G||_F <= sqrt(c * sum_l (tr G_l)^2) / ||G||_F
                                                      <= sqrt(c) * tr(G) / ||G||_F,

    G_l = exact per-layer Gram [N, N], G = sum_l G_l. For sketch_in = sketch_out = 16, c = 0.266 (sqrt 0.52 per layer);
    spreading the norm over L layers shrinks it by about 1/sqrt(L); O(1/sqrt(d_s)) in general at
    sketch_in = sketch_out = d_s.

    Args:
        layer_grams: L exact Gram matrices [N, N] (list or [L, N, N]).
        sketch_in: sketch size on the layer-input side.
        sketch_out: sketch size on the layer-output side.

    Returns:
        the bound on sqrt(E ||G_hat - G||_F^2) / ||G||_F (dimensionless); 0 when G = 0.
    """
    grams = torch.stack(list(layer_grams)) if not isinstance(layer_grams, Tensor) else layer_grams
    grams = grams.double()
    total = grams.sum(0).norm()
    if total == 0:
        return 0.0
    traces = grams.diagonal(dim1=-2, dim2=-1).sum(-1)
    return float(math.sqrt(kronecker_sketch_variance_factor(sketch_in, sketch_out) * float((traces**2).sum())) / total)
