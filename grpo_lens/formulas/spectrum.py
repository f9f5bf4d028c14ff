"""Singular values and effective-rank measures of GRPO gradient matrices, G1 and its controls (docs/theory.md §5).

Matrices (N = B*R rollouts, R group size, B prompts, P parameters, or P_s sketch dimensions):

- G1 per-rollout matrix, rows A_i g_i: [R, P] (all parameters, one layer's slice, or a sketch). Never materialised:
  its singular values come from the Gram matrix G = (<g_i, g_j>) [R, R] of the g_i, as those of W G W with
  W = diag(A) (:func:`weighted_gram_singular_values`).
- G2 per-layer weight gradient of the group (or batch) loss: [d_out, d_in]
  (:func:`grpo_lens.gradients.exact.layer_weight_grads`; bound on its rank: :func:`g2_rank_bound`).
- G3 per-group matrix, rows = each group's policy gradient sum_i A_i g_i: [B, P] (:func:`group_row_sums`).

Rank measures (:data:`RANK_MEASURES`): erank, stable rank, participation ratio, k90, k99, top-1 and top-2 energy
shares; plus :func:`numerical_rank`.

Controls of G1 on the same tokens (:func:`g1_controls`, the one body :func:`grpo_lens.analysis.group.analyse_group`
reports as ``rank/g1_*``): rows g_i without advantages; rows w_i g_i with random zero-sum weights w of the same norm
as A (:func:`random_zero_sum_weights`, averaged over draws); rows of the supervised NLL gradient
(:func:`nll_weights`); and the orthogonal null, the singular values G1 would have if its rows were orthogonal
(:func:`orthogonal_null_singular_values`). Sign-flipped or permuted advantages are not used as controls: singular
values do not change when rows change sign, and the random zero-sum weights replace the "shuffled advantages" of the
starting design with a control that keeps sum w = 0 and ||w|| = ||A|| without reusing A's values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from grpo_lens.registry import Registry

RankMeasure = Callable[[Tensor], float]


RANK_MEASURES: Registry[RankMeasure] = Registry("rank measure")


def _clean(s: Tensor) -> Tensor:
    s = torch.as_tensor(s).detach().double().reshape(-1)
    if (s < 0).any():
        raise ValueError("singular values must be >= 0")
    return torch.sort(s, descending=True).values


@RANK_MEASURES.register("erank")
def effective_rank(s: Tensor) -> float:
    """Roy & Vetterli (EUSIPCO 2007) effective rank exp(-sum_k p_k ln p_k), p_k = s_k / sum s (0 ln 0 = 0).

    s: [m] singular values >= 0. Returns a float in [1, m] (0 for all-zero s).
    """
    s = _clean(s)
    total = s.sum()
    if total == 0:
        return 0.0
    p = s[s > 0] / total
    return float(torch.exp(-(p * p.log()).sum()))


@RANK_MEASURES.register("stable_rank")
def stable_rank(s: Tensor) -> float:
    """Stable rank ||M||_F^2 / ||M||_2^2 = sum s^2 / s_1^2. s: [m]. Returns a float in [1, m] (0 for all-zero s)."""
    s = _clean(s)
    if s.numel() == 0 or s[0] == 0:
        return 0.0
    return float((s**2).sum() / s[0] ** 2)


@RANK_MEASURES.register("participation_ratio")
def participation_ratio(s: Tensor) -> float:
    """Participation ratio of the energies s^2: (sum s^2)^2 / sum s^4. s: [m]. In [1, m]; 0 for all-zero s."""
    s = _clean(s)
    e = s**2
    denom = (e**2).sum()
    if denom == 0:
        return 0.0
    return float(e.sum() ** 2 / denom)


def energy_rank(s: Tensor, fraction: float) -> int:
    """Fewest singular values holding ``fraction`` of the energy sum s^2 (k90: 0.9, k99: 0.99).

    A relative slack of 1e-12 absorbs round-off (s = (3, 1) holds exactly 9/10 in s_1: k90 = 1). 0 for all-zero s.

    Raises:
        ValueError: fraction outside (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    e = _clean(s) ** 2
    total = e.sum()
    if total == 0:
        return 0
    cum = e.cumsum(0) / total
    return int((cum < fraction - 1e-12).sum()) + 1


@RANK_MEASURES.register("k90")
def k90(s: Tensor) -> float:
    """:func:`energy_rank` at 90%."""
    return float(energy_rank(s, 0.90))


@RANK_MEASURES.register("k99")
def k99(s: Tensor) -> float:
    """:func:`energy_rank` at 99%."""
    return float(energy_rank(s, 0.99))


@RANK_MEASURES.register("top1_share")
def top1_share(s: Tensor) -> float:
    """Energy share of the top direction, s_1² / Σ s² (docs/theory.md §5). s: [m]. In [1/m, 1]; 0 for all-zero s."""
    e = _clean(s) ** 2
    total = e.sum()
    return float(e[0] / total) if e.numel() and total > 0 else 0.0


@RANK_MEASURES.register("top2_share")
def top2_share(s: Tensor) -> float:
    """Energy share of the top two directions, (s_1² + s_2²) / Σ s² (docs/theory.md §5; "k90 = 2" is top-2 share
    >= 0.9 > top-1 share). s: [m]. In [min(2/m, 1), 1]; 0 for all-zero s."""
    e = _clean(s) ** 2
    total = e.sum()
    return float(e[:2].sum() / total) if total > 0 else 0.0


def rank_measures(singular_values: Tensor, names: list[str] | None = None) -> dict[str, float]:
    """All (or the named) measures of :data:`RANK_MEASURES` for one spectrum (docs/theory.md §5).

    Args:
        singular_values: [m] >= 0 (any order).
        names: subset of :data:`RANK_MEASURES`; None = all of erank, stable_rank, participation_ratio, k90, k99,
            top1_share, top2_share.

    Returns:
        {name: float}; every measure is 0 for a zero matrix (no NaN).

    Raises:
        ValueError: an unknown measure name (listing the valid ones) or a negative singular value.
    """
    return {name: RANK_MEASURES.get(name)(singular_values) for name in (names or RANK_MEASURES.names())}


def numerical_rank(
    s: Tensor, rtol: float | None = None, shape: tuple[int, int] | None = None, dtype: torch.dtype = torch.float64
) -> int:
    """Number of singular values above rtol * s_1 (numpy's matrix_rank rule).

    Args:
        s: [m] singular values.
        rtol: relative tolerance; default max(shape) * eps(dtype) when ``shape`` is given, else m * eps(dtype).
        shape: the matrix shape, for the default tolerance.
        dtype: the precision the matrix was computed in (pass torch.float32 for gradients of a float32 model even
            after ``.double()``, or its round-off counts as rank).
    """
    s = _clean(s)
    if s.numel() == 0 or s[0] == 0:
        return 0
    if rtol is None:
        rtol = (max(shape) if shape else s.numel()) * torch.finfo(dtype).eps
    return int((s > rtol * s[0]).sum())


def singular_values(matrix: Tensor, method: str = "auto") -> Tensor:
    """Singular values of ``matrix`` [m, n], descending, float64.

    ``method="gram"`` (chosen by ``"auto"`` when min(m, n) <= 64 and the other side is at least 4 times larger,
    e.g. G1's R x P) takes sqrt of the eigenvalues of the smaller Gram matrix M M^T (or M^T M) in float64: cheap
    for R x P. It loses relative accuracy below about 1e-8 * s_1 (squared condition number); use ``"svd"`` for
    numerical ranks. ``"svd"`` calls ``torch.linalg.svdvals`` in float64.

    Returns:
        [min(m, n)] float64 >= 0.

    Raises:
        ValueError: matrix not 2-D, or an unknown method.
    """
    if matrix.dim() != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {tuple(matrix.shape)}")
    if method not in ("auto", "gram", "svd"):
        raise ValueError(f"unknown method {method!r}; valid names: auto, gram, svd")
    m = matrix.detach().double()
    small, large = sorted(m.shape)
    if method == "auto":
        method = "gram" if small <= 64 and large >= 4 * small else "svd"
    if method == "svd":
        return torch.linalg.svdvals(m)
    gram = m @ m.T if m.shape[0] <= m.shape[1] else m.T @ m
    eig = torch.linalg.eigvalsh(gram).clamp(min=0.0)
    return torch.sort(eig.sqrt(), descending=True).values


def gram_singular_values(gram: Tensor) -> Tensor:
    """Singular values of M from its Gram matrix M M^T [R, R] (e.g. a sketched Gram). Returns [R] float64 >= 0."""
    g = gram.detach().double()
    g = (g + g.T) / 2
    return torch.sort(torch.linalg.eigvalsh(g).clamp(min=0.0).sqrt(), descending=True).values


def matrix_rank_measures(matrix: Tensor, method: str = "auto") -> dict[str, float]:
    """:func:`rank_measures` of :func:`singular_values` of ``matrix`` [m, n], plus ``fro_norm`` (its ||.||_F)."""
    s = singular_values(matrix, method)
    out = rank_measures(s)
    out["fro_norm"] = float(s.square().sum().sqrt())
    return out


def g1_matrix(grads: Tensor, advantages: Tensor) -> Tensor:
    """G1 (docs/theory.md §5): rows A_i g_i. grads [R, P] (or [R, P_s] sketches); advantages [R]. Returns [R, P]."""
    assert grads.dim() == 2 and advantages.shape == (grads.shape[0],), (grads.shape, advantages.shape)
    return grads * advantages.to(grads.dtype).unsqueeze(1)


def random_zero_sum_weights(advantages: Tensor, num_draws: int, generator: torch.Generator | None = None) -> Tensor:
    """Random zero-sum weights with the same Euclidean norm as the advantages: the G1 control (docs/theory.md §5).

    w = z - mean z, z ~ N(0, I_R), rescaled so that ||w|| = ||A|| (all zeros when A = 0).

    Args:
        advantages: [R].
        num_draws: D.
        generator: optional torch generator (CPU).

    Returns:
        [D, R] float64.
    """
    R = advantages.shape[-1]
    z = torch.randn(num_draws, R, generator=generator, dtype=torch.float64)
    w = z - z.mean(-1, keepdim=True)
    target = advantages.detach().double().norm()
    norm = w.norm(dim=-1, keepdim=True)
    return torch.where(norm > 0, w / norm.clamp(min=1e-300) * target, torch.zeros_like(w))


def nll_weights(completion_mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Row weights that turn the g_i into the supervised (NLL) gradient of the same completions.

    The token-mean NLL of the completions, -(1/sum_j |o_j|) sum_{i,t} log pi(o_{i,t}|.), has gradient
    sum_i w_i g_i with w_i = -|o_i| / sum_j |o_j|: the control "same tokens, no advantages" (docs/theory.md §5).

    Args:
        completion_mask: [N, T] bool.
        dtype: of the result (float64 for the G1 control of :func:`g1_controls`).

    Returns:
        [N] weights (all 0 when no rollout has a token).
    """
    lengths = completion_mask.to(dtype).sum(-1)
    return -lengths / lengths.sum().clamp(min=1.0)


#: The matrices :func:`g1_controls` measures, in the order it returns them (``rank/<name>_<m>`` in docs/metrics.md).
G1_CONTROLS = ("g1", "g1_no_adv", "g1_null", "g1_random", "g1_nll")


def g1_controls(
    gram: Tensor,
    advantages: Tensor,
    completion_mask: Tensor | None = None,
    *,
    num_random: int = 8,
    seed: int = 0,
    measure: Callable[[Tensor], Mapping[str, float]] = rank_measures,
) -> dict[str, dict[str, float]]:
    """Rank measures of G1 and of its controls on the same rows, for one group (docs/theory.md §5).

    - ``g1``: rows A_i g_i (G1 itself).
    - ``g1_no_adv``: rows g_i.
    - ``g1_null``: the orthogonal null, singular values |A_i| ||g_i|| (:func:`orthogonal_null_singular_values`).
    - ``g1_random``: rows w_i g_i with w from :func:`random_zero_sum_weights` (``num_random`` draws from a generator
      seeded with ``seed``, measures averaged); absent when num_random = 0.
    - ``g1_nll``: rows of the supervised token-mean NLL gradient (:func:`nll_weights`); only with a completion mask.

    Args:
        gram: [R, R] float64 Gram matrix (<g_i, g_j>) of the per-rollout gradients (exact or sketched).
        advantages: [R].
        completion_mask: [R, T] bool, optional.
        num_random: number of random-weight draws.
        seed: their seed.
        measure: singular values [R] -> {measure: float}; default :func:`rank_measures`.

    Returns:
        {control: {measure: float}}, controls in the order of :data:`G1_CONTROLS`.
    """
    R = gram.shape[0]
    a = advantages.detach().double()
    assert gram.shape == (R, R) and a.shape == (R,), (gram.shape, advantages.shape)

    def rows(w: Tensor) -> dict[str, float]:
        return dict(measure(weighted_gram_singular_values(gram, w)))

    out = {
        "g1": rows(a),
        "g1_no_adv": rows(torch.ones(R, dtype=torch.float64)),
        "g1_null": dict(measure(orthogonal_null_singular_values(gram, a))),
    }
    gen = torch.Generator().manual_seed(seed)
    draws = [rows(w) for w in random_zero_sum_weights(a, num_random, gen)]
    if draws:
        out["g1_random"] = {m: sum(d[m] for d in draws) / len(draws) for m in draws[0]}
    if completion_mask is not None:
        out["g1_nll"] = rows(nll_weights(completion_mask, torch.float64))
    return out


def _sequences(completion_ids: Tensor, completion_mask: Tensor) -> list[tuple[int, ...]]:
    assert completion_ids.shape == completion_mask.shape, (completion_ids.shape, completion_mask.shape)
    ids, mask = completion_ids.tolist(), completion_mask.bool().tolist()
    return [tuple(t for t, keep in zip(row, m) if keep) for row, m in zip(ids, mask)]


def distinct_completions(completion_ids: Tensor, completion_mask: Tensor) -> int:
    """Number of distinct completions among the R rollouts of one group (identical completions have identical g_i,
    so G1 of the group has rank at most this number).

    Args:
        completion_ids: [R, T] long.
        completion_mask: [R, T] bool.
    """
    return len(set(_sequences(completion_ids, completion_mask)))


def distinct_completions_per_group(completion_ids: Tensor, completion_mask: Tensor, group_size: int) -> Tensor:
    """:func:`distinct_completions` of each group. completion_ids/mask: [N, T]. Returns [B] long."""
    n = completion_ids.shape[0]
    if n % group_size:
        raise ValueError(f"number of rollouts {n} is not a multiple of the group size {group_size}")
    return torch.tensor(
        [
            distinct_completions(completion_ids[b : b + group_size], completion_mask[b : b + group_size])
            for b in range(0, n, group_size)
        ],
        dtype=torch.long,
    )


def count_distinct_prefixes(completion_ids: Tensor, completion_mask: Tensor, proper: bool = False) -> int:
    """Number of distinct non-empty completion prefixes o_{i,<=t} over the rollouts of one group.

    Args:
        completion_ids: [R, T] long.
        completion_mask: [R, T] bool.
        proper: count only prefixes shorter than their completion (t = 1..|o_i|-1) instead of t = 1..|o_i|.
    """
    prefixes: set[tuple[int, ...]] = set()
    for seq in _sequences(completion_ids, completion_mask):
        prefixes.update(seq[:t] for t in range(1, len(seq) + (0 if proper else 1)))
    return len(prefixes)


def g2_rank_bound(prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor) -> int:
    """Upper bound on rank(G2) of any linear layer for ONE group: prompt tokens + distinct proper completion prefixes.

    G2 = sum_i (A_i/|o_i|) sum_t delta_{i,t} x_{i,t}^T over input positions. Causal attention makes the layer
    input x at a position a function of the tokens up to it, so x is the same for all R rollouts at prompt
    positions (same prompt, same padding) and equal for two rollouts at completion positions whose prefixes agree.
    The input position of a completion's last token predicts nothing and nothing attends back to it, so its delta
    is 0. Grouping the remaining terms by distinct x leaves at most Lp_real + #{distinct o_{i,<=t}, t < |o_i|}
    rank-one terms. rank(G2) is also at most min(d_out, d_in); for a batch, add the bounds of its groups.

    Args:
        prompt_mask: [R, Lp] (rows equal; the first row is counted).
        completion_ids: [R, T] long.
        completion_mask: [R, T] bool.

    Returns:
        the bound (int).
    """
    return int(prompt_mask[0].bool().sum()) + count_distinct_prefixes(completion_ids, completion_mask, proper=True)


def weighted_gram_singular_values(gram: Tensor, weights: Tensor) -> Tensor:
    """Singular values of the matrix with rows w_i g_i from the Gram matrix G = (<g_i, g_j>): its Gram is W G W.

    Args:
        gram: [R, R] float64.  weights: [R] (A for G1).

    Returns:
        [R] float64 >= 0, descending.
    """
    w = weights.to(gram.dtype)
    return gram_singular_values(gram * torch.outer(w, w))


def weighted_gram_measures(gram: Tensor, weights: Tensor) -> dict[str, float]:
    """:func:`rank_measures` of :func:`weighted_gram_singular_values`: {measure: float} for every
    :data:`RANK_MEASURES` name. gram: [R, R] float64; weights: [R]."""
    return rank_measures(weighted_gram_singular_values(gram, weights))


def orthogonal_null_singular_values(gram: Tensor, advantages: Tensor) -> Tensor:
    """Singular values |A_i| ||g_i|| of G1 if its rows were orthogonal (the structureless null, docs/theory.md §5).

    gram: [R, R]; advantages: [R]. Returns [R] float64, descending.
    """
    s = advantages.double().abs() * gram.diagonal().double().clamp(min=0).sqrt()
    return torch.sort(s, descending=True).values


def wishart(group_size: int, dim: int, num_draws: int, generator: torch.Generator) -> Tensor:
    """[num_draws, R, R] draws of Wishart(dim, I_R), R = ``group_size`` (the Gram matrix of R iid N(0, I_dim)
    vectors) by Bartlett's decomposition (Bartlett 1933): W = L Lᵀ with L lower triangular, L_ij ~ N(0, 1) below the
    diagonal and L_ii² ~ χ²(dim − i) (i = 0..R−1). The cost does not depend on dim. χ² is a sum of squared normals
    for dim <= 512 and the Wilson-Hilferty cube (Wilson & Hilferty, PNAS 17, 1931; relative error < 1e-4 there) above.

    Raises:
        ValueError: dim < R.
    """
    if dim < group_size:
        raise ValueError(f"dim must be >= R = {group_size}, got {dim}")
    df = torch.arange(dim, dim - group_size, -1, dtype=torch.float64)  # [R]
    if dim <= 512:
        chi2 = torch.stack(
            [torch.randn(num_draws, int(d), generator=generator, dtype=torch.float64).square().sum(1) for d in df], 1
        )
    else:
        z = torch.randn(num_draws, group_size, generator=generator, dtype=torch.float64)
        c = 2 / (9 * df)
        chi2 = df * (1 - c + z * c.sqrt()) ** 3
    low = torch.randn(num_draws, group_size, group_size, generator=generator, dtype=torch.float64).tril(-1)
    low = low + torch.diag_embed(chi2.clamp(min=0).sqrt())
    return low @ low.transpose(1, 2)


def random_direction_grams(group_size: int, dim: int, num_draws: int, generator: torch.Generator) -> Tensor:
    """[num_draws, R, R] Gram matrices of R = ``group_size`` iid uniform unit vectors in R^dim (docs/theory.md §5): the
    normalised :func:`wishart`, D^(-1/2) W D^(-1/2) with D = diag(W).

    Raises:
        ValueError: dim < R.
    """
    w = wishart(group_size, dim, num_draws, generator)
    d = w.diagonal(dim1=1, dim2=2).sqrt()
    return w / (d[:, :, None] * d[:, None, :])


def simulated_null_measures(
    gram: Tensor, advantages: Tensor, dim: int, *, num_draws: int = 8, seed: int = 0
) -> dict[str, float]:
    """Mean rank measures of the simulated null of G1: rows with G1's norms |A_i| ||g_i|| and iid uniform random
    directions in R^dim (docs/theory.md §5, §11). As dim grows it tends to the orthogonal null
    (:func:`orthogonal_null_singular_values`); at finite dim random rows share O(1/sqrt(dim)) of their direction, so
    this null is what unstructured gradients in dim dimensions give.

    Args:
        gram: [R, R] Gram of the g_i.  advantages: [R].  dim: P, the dimension the g_i live in.
        num_draws: draws averaged.  seed: their seed.

    Returns:
        {measure: float} for every :data:`RANK_MEASURES` name.
    """
    R = gram.shape[0]
    n = advantages.double().abs() * gram.diagonal().double().clamp(min=0).sqrt()  # [R] row norms of G1
    c = random_direction_grams(R, dim, num_draws, torch.Generator().manual_seed(seed))
    energies = torch.linalg.eigvalsh(c * n[None, :, None] * n[None, None, :]).clamp(min=0)  # [draws, R]
    draws = [rank_measures(e.sqrt()) for e in energies]
    return {m: sum(d[m] for d in draws) / len(draws) for m in draws[0]}


def g1_singular_values(grads: Tensor, advantages: Tensor) -> Tensor:
    """Singular values of G1 (rows A_i g_i). grads [R, P]; advantages [R]. Returns [R] float64, descending."""
    g = grads.detach().double()
    return weighted_gram_singular_values(g @ g.T, advantages.double())


def top_singular_value(matrix: Tensor, rank: int = 8, iters: int = 4) -> float:
    """s_1 of ``matrix`` [m, n] by randomized subspace iteration (Halko, Martinsson & Tropp, SIAM Review 53(2), 2011,
    Alg. 4.4; ``torch.svd_lowrank``) with ``rank`` vectors and ``iters`` power iterations, in float32, with a fixed
    seed in a forked RNG (deterministic, leaves the global RNG alone). The error in s_1 shrinks like
    (s_{rank+1}/s_1)^(2 iters + 1); exact for matrices of rank <= ``rank``. A few passes over the matrix instead of a
    full SVD: every layer of a 135M model in about a second."""
    m = matrix.detach().float()
    if not bool(m.any()):
        return 0.0
    q = min(rank, *m.shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        _, s, _ = torch.svd_lowrank(m, q=q, niter=iters)
    return float(s[0])


def top_eigenvalue_psd_product(
    kx: Tensor, kd: Tensor, tol: float = 1e-6, max_iter: int = 100, block: int = 8
) -> tuple[float, bool]:
    """lambda_max(K_X K_D) of two PSD matrices [n, n]: :func:`top_eigenvalues_psd_products` for one K_D.

    Returns:
        (lambda_max >= 0, converged: False when the exact fallback gave the value).

    Raises:
        ValueError: shapes that are not [n, n] and equal.
    """
    if kx.dim() != 2 or kx.shape[0] != kx.shape[1] or kx.shape != kd.shape:
        raise ValueError(f"need two [n, n] matrices of one shape, got {tuple(kx.shape)} and {tuple(kd.shape)}")
    lam, converged = top_eigenvalues_psd_products(kx, kd.unsqueeze(0), tol=tol, max_iter=max_iter, block=block)
    return float(lam[0]), bool(converged[0])


def top_eigenvalues_psd_products(
    kx: Tensor, kds: Tensor, tol: float = 1e-6, max_iter: int = 100, block: int = 8
) -> tuple[Tensor, Tensor]:
    """lambda_max(K_X K_D^(w)) for PSD K_X [n, n] (or one per problem, [W, n, n]) and a stack of PSD K_D^(w)
    [W, n, n], i.e. s_1(M_w)^2 of
    M_w = D_w^T X when K_X = X X^T and K_D^(w) = D_w D_w^T (the nonzero eigenvalues of M M^T and of K_X K_D agree):
    G2's top squared singular value under W weightings at once (docs/theory.md §6).

    K_X K_D is not symmetric, but it is self-adjoint in the K_D inner product <u, v> = u^T K_D v, so block subspace
    iteration with Rayleigh-Ritz in that inner product behaves like a symmetric one (Parlett, *The Symmetric
    Eigenvalue Problem*, 1998, ch. 14): the top Ritz value is <= lambda_max, and with ``block`` vectors close top
    eigenvalues inside the block do not slow it (the rate is lambda_{block+1} / lambda_1). Each w stops when its top
    Ritz pair's relative residual ||K_X K_D v - rho v||_{K_D} / (rho ||v||_{K_D}) <= tol (rho then lies within tol
    of an eigenvalue, §4.5); a w without convergence in ``max_iter`` steps falls back to the exact symmetric solver,
    lambda_max(R^T K_D R) with K_X = R R^T (eigh, float64). Fixed Gaussian start block. The W problems iterate as
    one batch (batched QR, eigh and products: a tenth of the calls of one problem at a time); each converged w
    leaves the batch, so its value is what it would be alone. The 0.1 body iterated ||K_X K_D v|| 50 times without
    a check: on a non-normal product with close top eigenvalues it was off by percents.

    Args:
        kx: [n, n] or [W, n, n] symmetric PSD.  kds: [W, n, n] symmetric PSD (float32 or float64).  tol: relative
            residual to stop at.  max_iter: > 0.  block: vectors iterated together (capped at n).

    Returns:
        (lambda_max [W] float64 >= 0, converged [W] bool: False where the exact fallback gave the value).

    Raises:
        ValueError: shapes that are not [n, n] (or [W, n, n]) and [W, n, n].
    """
    if kds.dim() != 3 or kds.shape[1] != kds.shape[2] or kx.shape not in (kds.shape[1:], kds.shape):
        raise ValueError(
            f"need kx [n, n] or [W, n, n] and kds [W, n, n] of one n, got {tuple(kx.shape)} and {tuple(kds.shape)}"
        )
    b = kds.double()
    a = kx.double()  # [n, n] (shared: broadcast) or [W, n, n]
    n, W = b.shape[1], b.shape[0]
    lam_out = torch.zeros(W, dtype=torch.float64)
    converged = torch.ones(W, dtype=torch.bool)
    gen = torch.Generator(device="cpu").manual_seed(0)
    v = torch.randn(n, min(block, n), generator=gen, dtype=torch.float64).to(b.device).expand(W, -1, -1)
    live = torch.arange(W)  # the problems still iterating; a, b, v hold their rows only
    for _ in range(max_iter):
        v = torch.linalg.qr(v).Q  # conditioning only: the span is what Rayleigh-Ritz uses
        y = b @ v  # K_D V
        z = a @ y  # K_X K_D V
        g, h = v.mT @ y, y.mT @ z  # V^T K_D V and V^T K_D (K_X K_D) V, both symmetric
        lam, q = torch.linalg.eigh((g + g.mT) / 2)
        keep = lam > lam.amax(-1, keepdim=True).clamp(min=0) * 1e-12
        # K_D-orthonormal basis V t of span(V) (K_D's null directions dropped: zero columns)
        t = q * torch.where(keep, lam.clamp(min=1e-300).rsqrt(), torch.zeros_like(lam)).unsqueeze(-2)
        theta, c = torch.linalg.eigh(t.mT @ ((h + h.mT) / 2) @ t)
        rho = theta[:, -1]
        coef = t @ c[:, :, -1:]  # top Ritz vector V coef, unit K_D-norm: [w, b, 1]
        r = z @ coef - rho.view(-1, 1, 1) * (v @ coef)  # residual A x - rho x
        res2 = (r.mT @ (b @ r)).view(-1)
        zero = ~keep.any(-1) | (rho <= 0)  # V in K_D's null space, or no positive Ritz value: K_X K_D V = 0
        done = zero | (res2 <= (tol * rho) ** 2)
        lam_out[live[done]] = torch.where(zero[done], torch.zeros_like(rho[done]), rho[done]).cpu()
        v = z
        if bool(done.any()):  # the converged leave the batch
            live, v, b = live[~done.cpu()], v[~done], b[~done]
            a = a[~done] if a.dim() == 3 else a
        if live.numel() == 0:
            return lam_out, converged
    w, q = torch.linalg.eigh(a)
    root = q * w.clamp(min=0).sqrt().unsqueeze(-2)  # K_X = root root^T
    top = torch.linalg.eigvalsh(root.mT @ b @ root)[:, -1].clamp(min=0)
    lam_out[live] = top.cpu()
    converged[live] = False
    return lam_out, converged


def weighted_row_sum(rows: Tensor, weights: Tensor) -> Tensor:
    """sum_i w_i rows_i. rows: [N, P] (exact, or a sketch's [N, P_s]); weights: [N]. Returns [P].

    Sketches are linear in the gradient, so the sketch of sum_i A_i g_i is ``weighted_row_sum(sketch, A)``.
    """
    assert rows.dim() == 2 and weights.shape == (rows.shape[0],), (rows.shape, weights.shape)
    return weights.to(rows.dtype) @ rows


def group_row_sums(rows: Tensor, group_size: int, weights: Tensor | None = None) -> Tensor:
    """Per-group sums of (weighted) rows: rows of G3 (docs/theory.md §5) when ``weights = A``.

    Args:
        rows: [N, P], N = B*R, groups contiguous.
        group_size: R.
        weights: [N] or [B, R], optional.

    Returns:
        [B, P].

    Raises:
        ValueError: N is not a multiple of R.
    """
    n, k = rows.shape
    if n % group_size:
        raise ValueError(f"number of rows {n} is not a multiple of the group size {group_size}")
    if weights is not None:
        rows = rows * weights.reshape(n, 1).to(rows.dtype)
    return rows.reshape(n // group_size, group_size, k).sum(1)
