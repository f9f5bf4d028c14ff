"""One analysis path: everything measured on ONE group of R rollouts, as a flat dict of canonical metric keys.

:func:`analyse_group` is the single per-group function that both the trainer's lens (:mod:`grpo_lens.lens`) and
``grpo-lens probe`` (:mod:`grpo_lens.probe`) call; they only aggregate its rows over groups (the lens: means over the
step's mixed groups; the probe: means with bootstrap intervals, strata by k and by distinct completions, see
:mod:`grpo_lens.diagnostics.stats`). Every key is documented in docs/metrics.md; formulas are in docs/theory.md.

Inputs are the group's per-rollout gradients ``grads`` [R, K] (exact [R, P] or a linear sketch [R, K]: everything here
uses inner products only, so a sketch gives unbiased Gram entries), its rewards [R] and the advantages [R] the trainer
actually used. ``grads`` row i must be the rollout's term in the trainer's loss gradient without its advantage
(``sum_i A_i grads_i`` = the group's share of the update direction; docs/theory.md §3).

Keys (``<m>`` ranges over :data:`grpo_lens.diagnostics.spectrum.RANK_MEASURES`: erank, stable_rank,
participation_ratio, k90, k99):

- ``group/size`` R, ``group/reward_mean``, ``group/correct`` k (0/1 rewards only), ``group/distinct_completions``
  (when completion ids are given).
- ``rank/g1_<m>``: G1, rows A_i g_i.  Controls on the same rows: ``rank/g1_no_adv_<m>`` (rows g_i),
  ``rank/g1_random_<m>`` (rows w_i g_i, w random zero-sum with ||w|| = ||A||, mean over draws), ``rank/g1_nll_<m>``
  (rows of the supervised token-mean NLL gradient; with a completion mask), ``rank/g1_null_<m>`` (the orthogonal null:
  singular values |A_i| ||g_i||, what G1 would have if its rows were orthogonal) and ``rank/g1_<m>_vs_null`` =
  rank/g1_<m> / rank/g1_null_<m>.
- ``grad/identity_residual``: relative residual of sum_i A_i g_i = c (gbar_C - gbar_W) with the estimator's own c
  (:func:`grpo_lens.diagnostics.identity.identity_constant`); absent when the identity does not apply (non-binary
  rewards, an estimator without the decomposition, advantages not two-valued per class). ``grad/identity_constant`` c.
- ``baseline/m_correct``, ``baseline/m_wrong``, ``baseline/b_star``, ``baseline/group_mean``,
  ``baseline/b_star_minus_mean`` (0/1 rewards).
- ``zero_sum/span_energy`` (share of G1's energy in span{gbar_C, gbar_W}), ``zero_sum/cos_gap`` (mean within-class
  minus mean between-class cosine of the g_i), each with ``..._null`` (mean over relabellings that keep k),
  ``..._excess`` (observed minus that mean) and ``..._p`` (permutation p-value, exact over all C(R, k) relabellings up
  to ``max_permutations``); 0/1 rewards only.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch
from torch import Tensor

from grpo_lens.diagnostics.baselines import baseline_metrics
from grpo_lens.diagnostics.identity import identity_constant
from grpo_lens.diagnostics.spectrum import (
    RANK_MEASURES,
    distinct_completions,
    gram_singular_values,
    random_zero_sum_weights,
    rank_measures,
)


def _is_binary(rewards: Tensor) -> bool:
    return bool(torch.all((rewards == 0) | (rewards == 1)))


def weighted_gram_measures(gram: Tensor, weights: Tensor) -> dict[str, float]:
    """Rank measures of the matrix with rows w_i g_i from the Gram matrix G = (<g_i, g_j>): its Gram is W G W.

    Args:
        gram: [R, R] float64.  weights: [R].

    Returns:
        {measure: float} for every :data:`RANK_MEASURES` name.
    """
    w = weights.to(gram.dtype)
    return rank_measures(gram_singular_values(gram * torch.outer(w, w)))


def orthogonal_null_singular_values(gram: Tensor, advantages: Tensor) -> Tensor:
    """Singular values |A_i| ||g_i|| of G1 if its rows were orthogonal (the structureless null, docs/theory.md §5).

    gram: [R, R]; advantages: [R]. Returns [R] float64, descending.
    """
    s = advantages.double().abs() * gram.diagonal().double().clamp(min=0).sqrt()
    return torch.sort(s, descending=True).values


def g1_singular_values(grads: Tensor, advantages: Tensor) -> Tensor:
    """Singular values of G1 (rows A_i g_i). grads [R, K]; advantages [R]. Returns [R] float64, descending."""
    g = grads.detach().double()
    return gram_singular_values((g @ g.T) * torch.outer(advantages.double(), advantages.double()))


def fixed_k_labellings(r: int, k: int, max_permutations: int, generator: torch.Generator) -> list[Tensor]:
    """The relabellings of a permutation test with k fixed: all C(r, k) boolean labellings with k ones when there are
    at most ``max_permutations``, else that many drawn at random with ``generator`` (each a [r] bool tensor; the
    caller adds the observed labelling to a random draw's p-value)."""
    if math.comb(r, k) <= max_permutations:
        out = []
        for idx in itertools.combinations(range(r), k):
            lab = torch.zeros(r, dtype=torch.bool)
            lab[list(idx)] = True
            out.append(lab)
        return out
    out = []
    for _ in range(max_permutations):
        lab = torch.zeros(r, dtype=torch.bool)
        lab[torch.randperm(r, generator=generator)[:k]] = True
        out.append(lab)
    return out


def span_energy(gram: Tensor, labels: Tensor, advantages: Tensor) -> float:
    """Share of the energy of the rows A_i g_i that lies in span{gbar_C, gbar_W} (C = labels, W = not labels).

    With U = [gbar_C, gbar_W] = g^T M^T (M [2, R] the class-averaging matrix), the projection energy of x_i = A_i g_i
    is A_i^2 (M G)_{:,i}^T (M G M^T)^+ (M G)_{:,i}; the share divides its sum by sum_i A_i^2 G_ii (docs/theory.md §6).

    Args:
        gram: [R, R] float64 Gram matrix of the g_i.  labels: [R] bool.  advantages: [R].

    Returns:
        a share in [0, 1]; NaN when the rows have no energy.
    """
    r = gram.shape[0]
    m = torch.zeros(2, r, dtype=gram.dtype)
    m[0, labels] = 1.0 / labels.sum()
    m[1, ~labels] = 1.0 / (~labels).sum()
    mg = m @ gram  # [2, R]
    inner = torch.linalg.pinv(mg @ m.T, hermitian=True)  # [2, 2]
    a2 = advantages.to(gram.dtype).square()
    proj = (a2 * (mg * (inner @ mg)).sum(0)).sum()
    total = (a2 * gram.diagonal()).sum()
    return float(proj / total) if total > 0 else math.nan


def cosine_gap(gram: Tensor, labels: Tensor) -> float:
    """Mean cosine of g_i, g_j over same-class pairs minus over cross-class pairs (docs/theory.md §6).

    gram: [R, R]; labels: [R] bool. NaN when there is no same-class pair (R = 2) or a zero gradient.
    """
    d = gram.diagonal().clamp(min=0).sqrt()
    if bool((d == 0).any()):
        return math.nan
    cos = gram / torch.outer(d, d)
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    off = ~torch.eye(len(labels), dtype=torch.bool)
    within, between = cos[same & off], cos[~same]
    if within.numel() == 0 or between.numel() == 0:
        return math.nan
    return float(within.mean() - between.mean())


def zero_sum_tests(gram: Tensor, rewards: Tensor, advantages: Tensor, *, max_permutations: int = 256,
                   seed: int = 0) -> dict[str, float]:
    """The label-permutation test with k fixed for one group with 0/1 rewards (docs/theory.md §6).

    For the true labels (correct = reward 1) and for each relabelling with the same k, computes
    :func:`span_energy` (the advantages follow the labels: A_C on the labelled-correct rows, A_W on the others) and
    :func:`cosine_gap`. p = #{relabellings with stat >= observed} / #relabellings (the true labelling is one of them
    when all C(R, k) are enumerated, so p >= 1/C(R, k); with random relabellings p = (1 + #{>=}) / (1 + n)).

    Args:
        gram: [R, R] float64.  rewards: [R] in {0, 1}, 0 < k < R.  advantages: [R] (two-valued per class).
        max_permutations: enumerate every relabelling up to this many, else draw this many at random.
        seed: seed of the random relabellings.

    Returns:
        {"zero_sum/span_energy", "zero_sum/span_energy_null", "zero_sum/span_energy_excess" (observed - null
        mean: mean-zero under the null when the relabellings are enumerated), "zero_sum/span_energy_p", and the same
        four for "zero_sum/cos_gap" (absent when undefined, e.g. R = 2)}.
    """
    labels = rewards == 1
    r, k = len(rewards), int(labels.sum())
    a_c = float(advantages[labels].mean())
    a_w = float(advantages[~labels].mean())
    gen = torch.Generator().manual_seed(seed)
    labs = fixed_k_labellings(r, k, max_permutations, gen)
    exhaustive = math.comb(r, k) <= max_permutations

    def adv_for(lab: Tensor) -> Tensor:
        return torch.where(lab, torch.tensor(a_c, dtype=gram.dtype), torch.tensor(a_w, dtype=gram.dtype))

    out: dict[str, float] = {}
    for name, stat in (("span_energy", lambda lab: span_energy(gram, lab, adv_for(lab))),
                       ("cos_gap", lambda lab: cosine_gap(gram, lab))):
        obs = stat(labels)
        if not math.isfinite(obs):
            continue
        null = torch.tensor([stat(lab) for lab in labs], dtype=torch.float64)
        ge = int((null >= obs - 1e-12).sum())
        p = ge / len(labs) if exhaustive else (1 + ge) / (1 + len(labs))
        out[f"zero_sum/{name}"] = obs
        out[f"zero_sum/{name}_null"] = float(null.mean())
        out[f"zero_sum/{name}_excess"] = obs - float(null.mean())
        out[f"zero_sum/{name}_p"] = p
    return out


def analyse_group(
    grads: Tensor,
    rewards: Tensor,
    advantages: Tensor,
    *,
    estimator: str = "grpo",
    std: str = "sample",
    eps: float = 1e-4,
    completion_mask: Tensor | None = None,
    completion_ids: Tensor | None = None,
    num_random: int = 8,
    max_permutations: int = 256,
    seed: int = 0,
) -> dict[str, float]:
    """Every per-group measurement of GRPO's gradient structure, as canonical metric keys (module docstring).

    Args:
        grads: [R, K] per-rollout gradients g_i (exact or sketched), float.
        rewards: [R] float, all valid.
        advantages: [R] the advantages the trainer used for these rollouts.
        estimator, std, eps: how the advantages were computed (for the identity's constant).
        completion_mask: [R, T] bool, optional (NLL control).
        completion_ids: [R, T] long, optional (distinct completions).
        num_random: draws of random zero-sum weights for ``rank/g1_random_*``.
        max_permutations: relabellings of the permutation test (exhaustive up to this many).
        seed: seed of the random draws.

    Returns:
        {key: float}; keys that do not apply to this group are absent (see module docstring).

    Raises:
        AssertionError: shapes disagree.
    """
    r = grads.shape[0]
    assert grads.dim() == 2 and rewards.shape == (r,) and advantages.shape == (r,), \
        (grads.shape, rewards.shape, advantages.shape)
    g = grads.detach().double()
    a = advantages.detach().double()
    rw = rewards.detach().double()
    gram = g @ g.T  # [R, R]: every measure below needs only inner products
    out: dict[str, float] = {"group/size": float(r), "group/reward_mean": float(rw.mean())}
    if completion_ids is not None and completion_mask is not None:
        out["group/distinct_completions"] = float(distinct_completions(completion_ids, completion_mask))

    # G1 and its controls
    g1 = weighted_gram_measures(gram, a)
    null = rank_measures(orthogonal_null_singular_values(gram, a))
    variants = {"g1": g1, "g1_no_adv": weighted_gram_measures(gram, torch.ones(r, dtype=torch.float64)),
                "g1_null": null}
    gen = torch.Generator().manual_seed(seed)
    draws = [weighted_gram_measures(gram, w) for w in random_zero_sum_weights(a, num_random, gen)]
    if draws:
        variants["g1_random"] = {m: sum(d[m] for d in draws) / len(draws) for m in draws[0]}
    if completion_mask is not None:
        lengths = completion_mask.double().sum(-1)
        variants["g1_nll"] = weighted_gram_measures(gram, -lengths / lengths.sum().clamp(min=1.0))
    for name, measures in variants.items():
        for m, v in measures.items():
            out[f"rank/{name}_{m}"] = v
    for m in RANK_MEASURES.names():
        if null[m] > 0:
            out[f"rank/g1_{m}_vs_null"] = g1[m] / null[m]

    if _is_binary(rw):
        labels = rw == 1
        k = int(labels.sum())
        out["group/correct"] = float(k)
        if 0 < k < r:
            out.update({key: float(v) for key, v in baseline_metrics(g, rw).items()})
            out["baseline/group_mean"] = out.pop("baseline/mean")
            two_valued = bool((a[labels] == a[labels][0]).all() and (a[~labels] == a[~labels][0]).all())
            c = identity_constant(estimator, k, r, std, eps)  # None: the estimator has no decomposition
            if c is not None and two_valued:
                lhs = a @ g
                rhs = c * (g[labels].mean(0) - g[~labels].mean(0))
                den = float(lhs.norm())
                out["grad/identity_constant"] = c
                out["grad/identity_residual"] = float((lhs - rhs).norm()) / den if den > 0 else 0.0
            if two_valued:
                out.update(zero_sum_tests(gram, rw, a, max_permutations=max_permutations, seed=seed))
    return out


def mean_over_groups(rows: Sequence[dict[str, float]], max_keys: Sequence[str] = ("grad/identity_residual",)
                     ) -> dict[str, float]:
    """The lens's aggregate: the mean over groups of every key (max for ``max_keys``), NaN/None skipped.

    rows: per-group dicts from :func:`analyse_group`. Returns {key: float}.
    """
    keys = sorted({k for row in rows for k in row})
    out = {}
    for k in keys:
        vals = [float(row[k]) for row in rows if row.get(k) is not None and math.isfinite(float(row[k]))]
        if vals:
            out[k] = max(vals) if k in max_keys else sum(vals) / len(vals)
    return out


def g1_rank_keys(grads: Tensor, advantages: Tensor, name: str) -> dict[str, float]:
    """``rank/<name>_<m>`` for the matrix with rows A_i grads_i (e.g. ``name="g1_layer"`` for one layer's rows).

    grads: [R, K]; advantages: [R]. Returns {key: float}.
    """
    g = grads.detach().double()
    return {f"rank/{name}_{m}": v for m, v in weighted_gram_measures(g @ g.T, advantages.double()).items()}


def g2_keys(g2: Tensor, rank_bound: int, computed_dtype: torch.dtype = torch.float32,
            singular_values: Tensor | None = None) -> dict[str, float]:
    """``rank/g2_<m>``, ``rank/g2_numerical_rank`` and ``rank/g2_rank_bound`` of one layer's weight gradient of the
    group loss, G2 [d_out, d_in] (docs/theory.md §5).

    Args:
        g2: [d_out, d_in].  rank_bound: :func:`grpo_lens.diagnostics.spectrum.g2_rank_bound` of the group.
        computed_dtype: the precision G2 was computed in (sets the numerical-rank tolerance).
        singular_values: G2's singular values if already computed (else from the smaller Gram matrix in float64:
            accurate to ~1e-8 s_1, well below the float32 rank tolerance max(d) * 1.2e-7).
    """
    from grpo_lens.diagnostics.spectrum import numerical_rank
    from grpo_lens.diagnostics.spectrum import singular_values as svals

    s = svals(g2.double(), method="gram") if singular_values is None else singular_values
    out = {f"rank/g2_{m}": v for m, v in rank_measures(s).items()}
    out["rank/g2_numerical_rank"] = float(numerical_rank(s, shape=tuple(g2.shape), dtype=computed_dtype))
    out["rank/g2_rank_bound"] = float(rank_bound)
    return out


def parameter_category(name: str, module_is_linear: bool) -> str:
    """'linear' (an nn.Linear weight: what the sketch covers), 'embedding', 'norm' or 'other' (biases, ...)."""
    if module_is_linear and name.endswith(".weight"):
        return "linear"
    if "embed" in name:
        return "embedding"
    if "norm" in name:
        return "norm"
    return "other"


def sketch_check_keys(exact: Tensor, sketch: Tensor, advantages: Tensor, categories: dict[str, slice | list[slice]],
                      layer_slices: Sequence[slice], k_in: int, k_out: int) -> dict[str, float]:
    """How well one group's sketch stands in for its exact per-rollout gradients (docs/theory.md §8).

    Args:
        exact: [R, P] exact g_i over every parameter.  sketch: [R, K] the sketched g_i of the same rollouts.
        advantages: [R].
        categories: {category: slice or list of slices of P} (from :func:`parameter_category`).
        layer_slices: the slices of P of the sketched (nn.Linear) weights, one per layer, for the error bound.
        k_in, k_out: sketch sizes.

    Returns:
        ``sketch/coverage``: Σ_i ||S g_i||² / Σ_i ||g_i||² (the sketch's energy, unbiased for the part it sees, over the
        exact total); ``sketch/exact_share_<category>``: each category's share of Σ_i ||g_i||²;
        ``sketch/gram_error``: ||Ĝ - G||_F / ||G||_F for G1's Gram (W G W) sketched vs exact over every parameter
        (missing coverage and projection noise together); ``sketch/gram_error_bound``: the bound of
        :func:`grpo_lens.diagnostics.gradients.sketch_gram_error_bound` for the sketched layers alone;
        ``sketch/g1_erank_error``: erank(G1) sketched minus exact.
    """
    from grpo_lens.diagnostics.gradients import sketch_gram_error_bound
    from grpo_lens.diagnostics.spectrum import effective_rank

    e, s = exact.detach(), sketch.detach().double()  # exact stays in its dtype: [R, P] can be GBs
    a = advantages.detach().double()
    total = float(e.double().square().sum()) if e.numel() < 10**7 else float(sum(float(r.double().square().sum())
                                                                                   for r in e))
    out: dict[str, float] = {}
    if total == 0:
        return out
    out["sketch/coverage"] = float(s.square().sum()) / total
    for cat, sl in categories.items():
        parts = sl if isinstance(sl, list) else [sl]
        out[f"sketch/exact_share_{cat}"] = sum(float(e[:, p].double().square().sum()) for p in parts) / total
    w = torch.outer(a, a)
    g_exact, g_sketch = (e @ e.T).double() * w, (s @ s.T) * w
    den = float(g_exact.norm())
    if den > 0:
        out["sketch/gram_error"] = float((g_sketch - g_exact).norm()) / den
        grams = [(e[:, sl] @ e[:, sl].T).double() * w for sl in layer_slices]
        if grams:
            out["sketch/gram_error_bound"] = sketch_gram_error_bound(grams, k_in, k_out)
    out["sketch/g1_erank_error"] = effective_rank(gram_singular_values(g_sketch)) - effective_rank(
        gram_singular_values(g_exact))
    return out


#: Row weightings of the zero-sum test on G2 and G3 (docs/theory.md §6): the advantages and controls that are not
#: zero-sum (|A|, A + lambda 1 with lambda = mean |A|, the rewards r, uniform 1) and a single rollout (e_1).
WEIGHTINGS = ("adv", "abs", "shift", "reward", "uniform", "single")


def weightings(advantages: Tensor, rewards: Tensor) -> dict[str, Tensor]:
    """{name: [R] weights} for :data:`WEIGHTINGS`: adv = A; abs = |A|; shift = A + mean|A| (not zero-sum); reward = r;
    uniform = 1; single = (1, 0, ..., 0) (the first rollout alone). advantages, rewards: [R]. float64."""
    a, r = advantages.detach().double(), rewards.detach().double()
    single = torch.zeros_like(a)
    single[0] = 1.0
    return {"adv": a, "abs": a.abs(), "shift": a + a.abs().mean(), "reward": r, "uniform": torch.ones_like(a),
            "single": single}


def layer_type(name: str) -> str:
    """The last component of a module name (``model.layers.3.mlp.down_proj`` -> ``down_proj``): the layer type G2 is
    summarised by."""
    return name.rsplit(".", 1)[-1]


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


def g2_by_type_keys(layer_grads: dict[str, Tensor], weighting: str) -> dict[str, float]:
    """Reference for :class:`G2WeightingCapture` from materialised weight gradients (slower: a backward and a
    decomposition per weighting). ``rank/g2_<weighting>_<type>_stable_rank``: the mean over the layers of each type of
    the stable rank
    ||G2||_F^2 / s_1^2 of their G2 (one weighting's weight gradients, {layer name: [d_out, d_in]}); s_1 by randomized
    subspace iteration (:func:`top_singular_value`), so every layer of a 135M model costs a few passes over its
    matrix instead of a full SVD."""
    per_type: dict[str, list[float]] = {}
    for name, g2 in layer_grads.items():
        s1 = top_singular_value(g2)
        fro2 = float(g2.detach().float().square().sum(dtype=torch.float64))
        per_type.setdefault(layer_type(name), []).append(fro2 / s1**2 if s1 > 0 else 0.0)
    return {f"rank/g2_{weighting}_{t}_stable_rank": sum(v) / len(v) for t, v in per_type.items()}


class G2WeightingCapture:
    """Stable rank of every nn.Linear layer's G2 under several row weightings, from ONE backward (docs/theory.md §6).

    G2 of a layer under weights w is M(w) = sum_i w_i sum_t delta_{i,t} x_{i,t}^T = D^T W X, with D [nL, d_out] the
    output gradients and X [nL, d_in] the inputs at the n·L positions of the batch (backpropagating sum_i s_i once),
    and W the per-position weight (w_i on rollout i's positions): rows never interact, so rollout i's deltas scale by
    w_i. With K_X = X X^T and K_D(w) = W D D^T W, both [nL, nL]:

        ||M(w)||_F^2 = sum_ab K_X[a, b] K_D(w)[a, b],      s_1(M(w))^2 = lambda_max(K_X K_D(w))

    (the nonzero eigenvalues of M M^T and of K_X K_D(w) agree). K_X and D D^T are formed once per layer in the
    backward hook and every weighting costs only [nL, nL] work, instead of a backward and a decomposition of
    [d_out, d_in] per weighting. lambda_max by 50 power iterations on K_X K_D(w) (a product of two PSD matrices, with
    real nonnegative eigenvalues).

    Args:
        model: the model (its nn.Linear layers are hooked).
        weightings: {name: [n] weights}, n = rollouts of the pass.

    After a forward + backward inside the context, :meth:`result` gives
    ``{"rank/g2_<name>_<type>_stable_rank": mean over the layers of that type}``.
    """

    def __init__(self, model: torch.nn.Module, weightings: dict[str, Tensor]):
        from grpo_lens.diagnostics.gradients import linear_layer_names

        self.model = model
        self.weightings = {k: v.detach().float() for k, v in weightings.items()}
        modules = dict(model.named_modules())
        self.layers = {n: modules[n] for n in linear_layer_names(model)}
        self.stable: dict[str, dict[str, float]] = {}  # layer -> weighting -> stable rank
        self._handles: list = []

    def _forward(self, name: str, module, args, output) -> None:
        if not torch.is_grad_enabled() or not isinstance(output, Tensor) or not output.requires_grad:
            return
        x = args[0].detach()
        x2 = x.reshape(-1, x.shape[-1]).float()  # [nL, d_in]
        n = x.shape[0] if x.dim() == 3 else 1

        def on_grad(grad: Tensor) -> None:
            d2 = grad.reshape(-1, grad.shape[-1]).float()  # [nL, d_out]
            keep = d2.abs().sum(1) > 0  # positions with no gradient (padding, the last token) add nothing
            xs, ds = x2[keep], d2[keep]
            rollout = torch.arange(n, device=grad.device).repeat_interleave(x2.shape[0] // n)[keep]
            kx, kd = xs @ xs.T, ds @ ds.T
            out = {}
            for wname, w in self.weightings.items():
                wp = w.to(grad.device)[rollout]
                kdw = kd * torch.outer(wp, wp)
                fro2 = float((kx * kdw).sum(dtype=torch.float64))
                if fro2 <= 0:
                    out[wname] = 0.0
                    continue
                v = torch.ones(kx.shape[0], device=grad.device) / kx.shape[0] ** 0.5
                lam = 0.0
                for _ in range(50):
                    u = kx @ (kdw @ v)
                    lam = float(u.norm())
                    if lam == 0:
                        break
                    v = u / lam
                out[wname] = fro2 / lam if lam > 0 else 0.0
            self.stable[name] = out

        output.register_hook(on_grad)

    def __enter__(self) -> "G2WeightingCapture":
        for name, module in self.layers.items():
            self._handles.append(module.register_forward_hook(
                lambda m, a, o, _name=name: self._forward(_name, m, a, o)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def result(self) -> dict[str, float]:
        """{"rank/g2_<weighting>_<type>_stable_rank": mean over the layers of each type}."""
        per: dict[tuple[str, str], list[float]] = {}
        for name, by_w in self.stable.items():
            for wname, sr in by_w.items():
                per.setdefault((wname, layer_type(name)), []).append(sr)
        return {f"rank/g2_{w}_{t}_stable_rank": sum(v) / len(v) for (w, t), v in per.items()}
