"""The gradient noise scale of a step and its dead groups (docs/theory.md §Noise scale and dead groups).

The "example" is the group (one prompt with its R rollouts), not the rollout: prompts are drawn independently, while a
group's rollouts share its baseline, so their gradients are not independent (the advantages of a group sum to 0 under
the group-mean baseline). G_b = sum_{i in b} c_i g_i is group b's share of the step's policy-gradient, g_i the
per-rollout gradient the lens's Gram holds and c_i its weight in the update (-A_i / N on the first on-policy pass,
docs/theory.md §3); a group without reward contrast has every A_i = 0 and so G_b = 0 (beta = 0): it still counts as an
example, a prompt the policy drew and learned nothing from. With B groups (those G_b = 0 included):

    D = sum_b |G_b|^2                 (the diagonal of the [B, B] group Gram M[b, c] = <G_b, G_c>)
    S = |sum_b G_b|^2                 (every entry of M summed; or the update's own gradient norm squared)
    |G|^2 unbiased    = (S - D) / (B (B - 1))        E<G_b, G_c> = |G|^2 for b != c (independent prompts)
    tr(Sigma) unbiased = (D - S / B) / (B - 1)        the sample variance of the G_b, summed over coordinates
    B_simple = tr(Sigma) / |G|^2,   SNR = |G|^2 / (tr(Sigma) / B) = B / B_simple

(McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training", arXiv 1812.06162, §2.2 and
App. A: there |G|^2 and tr(Sigma) come from gradient norms at two batch sizes; with the exact Gram every pair is
known, so the same unbiased estimators are exact sums.) B_simple is in groups (prompts): the batch size at which the
step's noise energy tr(Sigma)/B equals its signal |G|^2. SNR is the step's own: its signal over its noise energy.

Intervals: the delete-one-group jackknife (:func:`noise_scale_jackknife`), none below
:data:`grpo_lens.formulas.stats.MIN_INTERVAL_UNITS` groups. Null: the sign-flip test of |G|^2 = 0
(:func:`signal_sign_flip_p`): under E G_b = 0 with a symmetric G_b, flipping each group's sign leaves the cross sum's
distribution unchanged.

verl's logit-space proxy (verl PR #4678, ``compute_variance_proxy_metrics``):
W_i = sum_t (1 - 2 pi(o_t) + sum_v pi_v^2) = sum_t |e_{o_t} - pi_t|^2, the squared norm of d log pi(o_t) /
d logits summed over tokens (cross-token terms and the logits' Jacobian dropped), and its "total power" mean_i A_i^2
W_i (:func:`logit_variance_proxy`), which the exact Gram's mean_i A_i^2 <g_i, g_i> can be set beside.

Dead groups (:func:`dead_group_counts`, :func:`normalizer_dilution`): groups without contrast split into all at the
best reward (all correct, binary), all at the worst (all wrong) and all equal elsewhere; the share of the loss
normaliser their rollouts hold (tokens or sequences, per the aggregation), which scales every other gradient down.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS, student_t_quantile


def group_gradient_gram(gram: Tensor, weights: Tensor, group_size: int) -> Tensor:
    """M[b, c] = <G_b, G_c> with G_b = sum_{i in b} w_i g_i, from the per-rollout Gram.

    Args:
        gram: [n, n] <g_i, g_j> of n = B_a R rollouts, groups consecutive (NaN entries stay NaN).
        weights: [n] w_i (the update's -A_i / N).   group_size: R.

    Returns:
        [B_a, B_a] float64.

    Raises:
        ValueError: n is not a multiple of R, or the shapes disagree.
    """
    n = gram.shape[0]
    if gram.shape != (n, n) or weights.shape != (n,) or n % group_size:
        raise ValueError(
            f"Gram {tuple(gram.shape)} and weights {tuple(weights.shape)} must be [n, n] and [n], n a "
            f"multiple of the group size {group_size}"
        )
    w = weights.detach().to(torch.float64).cpu()
    k = gram.detach().to(torch.float64).cpu() * w[:, None] * w[None, :]
    b = n // group_size
    return k.view(b, group_size, b, group_size).sum(dim=(1, 3))


def noise_scale_from_sums(sum_sq: float, total_sq: float, num_groups: int) -> dict[str, float]:
    """|G|^2, tr(Sigma), B_simple and SNR from D = sum_b |G_b|^2 and S = |sum_b G_b|^2 over B groups (module
    docstring; McCandlish et al. 2018, §2.2).

    Returns:
        {"grad_sq", "trace_sigma", "b_simple", "snr"}; B_simple and SNR are NaN when |G|^2 <= 0 (no signal
        measured: the estimate of |G|^2 is unbiased, so it can be negative) or tr(Sigma) <= 0.

    Raises:
        ValueError: fewer than 2 groups.
    """
    if num_groups < 2:
        raise ValueError(f"the noise scale needs at least 2 groups, got {num_groups}")
    B = float(num_groups)
    grad_sq = (total_sq - sum_sq) / (B * (B - 1))
    trace = (sum_sq - total_sq / B) / (B - 1)
    ok = grad_sq > 0 and trace > 0
    return {
        "grad_sq": grad_sq,
        "trace_sigma": trace,
        "b_simple": trace / grad_sq if ok else math.nan,
        "snr": grad_sq * B / trace if ok else math.nan,
    }


def noise_scale(group_gram: Tensor, num_groups: int | None = None) -> dict[str, float]:
    """:func:`noise_scale_from_sums` of a [B_a, B_a] group Gram M, with num_groups - B_a more groups whose G_b = 0
    (groups without contrast; None: B_a)."""
    b_a = group_gram.shape[0]
    B = b_a if num_groups is None else int(num_groups)
    if B < b_a:
        raise ValueError(f"num_groups {B} is fewer than the Gram's {b_a} groups")
    m = group_gram.to(torch.float64)
    return noise_scale_from_sums(float(m.diagonal().sum()), float(m.sum()), B)


def noise_scale_jackknife(group_gram: Tensor, num_groups: int | None = None, level: float = 0.95) -> dict[str, float]:
    """Delete-one-group jackknife intervals of |G|^2, tr(Sigma) and B_simple: {"<name>_lo", "<name>_hi"}.

    Deleting group b leaves D - M_bb and S - 2 sum_c M_bc + M_bb over B - 1 groups (a group with G_b = 0 leaves D
    and S); theta +- t_{(1+level)/2, B-1} SE with SE^2 = (B-1)/B sum_b (theta_(b) - mean)^2 (Efron & Tibshirani 1993,
    §11.2). Empty below :data:`MIN_INTERVAL_UNITS` groups; an estimate that is NaN in any deletion (B_simple where
    |G|^2 <= 0) gets no interval.
    """
    m = group_gram.to(torch.float64)
    b_a = m.shape[0]
    B = b_a if num_groups is None else int(num_groups)
    if B < MIN_INTERVAL_UNITS:
        return {}
    d, s = float(m.diagonal().sum()), float(m.sum())
    rows = m.sum(dim=1)
    loo = [
        noise_scale_from_sums(d - float(m[b, b]), s - 2 * float(rows[b]) + float(m[b, b]), B - 1) for b in range(b_a)
    ]
    loo += [noise_scale_from_sums(d, s, B - 1)] * (B - b_a)
    t = student_t_quantile((1 + level) / 2, B - 1)
    out: dict[str, float] = {}
    for name in ("grad_sq", "trace_sigma", "b_simple"):
        vals = torch.tensor([x[name] for x in loo], dtype=torch.float64)
        if not bool(torch.isfinite(vals).all()):
            continue
        theta = noise_scale_from_sums(d, s, B)[name]
        se = math.sqrt((B - 1) / B * float(((vals - vals.mean()) ** 2).sum()))
        out[f"{name}_lo"], out[f"{name}_hi"] = theta - t * se, theta + t * se
    return out


def signal_sign_flip_p(group_gram: Tensor, draws: int = 2000, seed: int = 0) -> float:
    """One-sided p-value of |G|^2 > 0: the share of sign flips s in {-1, 1}^B whose cross sum
    sum_{b != c} s_b s_c M_bc reaches the observed sum_{b != c} M_bc (the identity counted; Phipson & Smyth 2010).
    Groups with G_b = 0 add nothing to either sum, so M of the analysed groups suffices. NaN below 2 groups."""
    m = group_gram.to(torch.float64)
    b = m.shape[0]
    if b < 2:
        return math.nan
    off = m - torch.diag(m.diagonal())
    observed = float(off.sum())
    gen = torch.Generator().manual_seed(int(seed))
    s = torch.randint(0, 2, (draws, b), generator=gen, dtype=torch.float64) * 2 - 1  # [draws, B]
    flipped = ((s @ off) * s).sum(dim=1)
    return (1 + int((flipped >= observed - 1e-12 * abs(observed)).sum())) / (draws + 1)


def score_norm_proxy(token_probs: Tensor, sum_sq_probs: Tensor, mask: Tensor) -> Tensor:
    """verl's W_i = sum_t (1 - 2 pi(o_t) + sum_v pi_v^2) = sum_t |e_{o_t} - pi_t|^2 over each completion's tokens.

    Args:
        token_probs: [N, T] pi(o_t), the sampled token's probability.   sum_sq_probs: [N, T] sum_v pi_v(t)^2.
        mask: [N, T] bool, the completion tokens.

    Returns:
        [N] float64.
    """
    w = (1 - 2 * token_probs.double() + sum_sq_probs.double()) * mask
    return w.sum(dim=1)


def logit_variance_proxy(advantages: Tensor, w: Tensor) -> float:
    """verl's "total power" proxy mean_i A_i^2 W_i (verl PR #4678, ``variance_proxy/proxy2_total_power``) over the
    rollouts given: a logit-space stand-in for mean_i |A_i grad log pi(o_i)|^2 (its W_i clamped at 0 as verl does).

    Args:
        advantages: [N] one scalar per rollout.   w: [N] :func:`score_norm_proxy`.
    """
    return float((advantages.double() ** 2 * w.double().clamp(min=0)).mean())


def rank_correlation(x: Tensor, y: Tensor) -> float:
    """Spearman's rho of x [n] and y [n]: Pearson's correlation of their ranks (ties get their mean rank). NaN below 3
    values or when either is constant. Used to say whether verl's proxy orders rollouts by gradient power as the exact
    Gram does (scale-free: the proxy lives in logit space)."""
    if x.numel() < 3:
        return math.nan

    def ranks(v: Tensor) -> Tensor:
        v = v.double().flatten()
        eq = v[:, None] == v[None, :]
        below = (v[None, :] < v[:, None]).sum(dim=1).double()
        return below + (eq.sum(dim=1).double() + 1) / 2  # mean rank of the tied block, 1-based

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float((rx.square().sum() * ry.square().sum()).sqrt())
    return float((rx * ry).sum()) / den if den > 0 else math.nan


def dead_group_counts(
    rewards: Tensor,
    valid: Tensor,
    best: float | None = None,
    worst: float | None = None,
) -> dict[str, int]:
    """Groups without reward contrast split by where their rewards sit.

    Args:
        rewards: [B, R] (any value where invalid).   valid: [B, R] bool.
        best: the reward scale's top (binary correctness: 1); None: the batch's own max valid reward.
        worst: its bottom (binary correctness: 0); None: the batch's own min valid reward.

    Returns:
        {"all_best": groups whose valid rewards all equal ``best`` (all correct), "all_worst": all equal ``worst``
        (all wrong), "all_other": all equal elsewhere, "mixed": groups with contrast, "empty": groups with no valid
        rollout}; a group with one valid rollout has no contrast.
    """
    v = valid.bool()
    r = rewards.double()
    has = v.any(dim=1)
    if best is None or worst is None:
        vals = r[v]
        best = float(vals.max()) if vals.numel() else math.nan if best is None else best
        worst = float(vals.min()) if vals.numel() else math.nan if worst is None else worst
    hi = torch.where(v, r, torch.full_like(r, -math.inf)).max(dim=1).values
    lo = torch.where(v, r, torch.full_like(r, math.inf)).min(dim=1).values
    const = has & (hi == lo)
    at_best = const & (hi == best)
    at_worst = const & (lo == worst) & ~at_best
    return {
        "all_best": int(at_best.sum()),
        "all_worst": int(at_worst.sum()),
        "all_other": int((const & ~at_best & ~at_worst).sum()),
        "mixed": int((has & ~const).sum()),
        "empty": int((~has).sum()),
    }


def zero_advantage_groups(advantages: Tensor) -> Tensor:
    """[B] bool: groups whose advantages [B, R] are all exactly 0 (no policy-gradient term in the update)."""
    return (advantages == 0).all(dim=1)


def normalizer_dilution(rollout_units: Tensor, dead: Tensor) -> float:
    """Share of the loss normaliser that rollouts of zero-advantage groups hold: sum over dead rollouts of their
    units over the sum over all. Units: each rollout's tokens in the loss (token-mean: Z = sum_i |o_i|), or 1 per
    rollout with a token in the loss (seq-mean-token-mean: Z = N; seq-mean-token-sum-norm: Z = N T_max, the same
    share). Every other rollout's gradient is divided by Z, so a share d scales the step down by (1 - d) against a
    loss over the mixed groups alone (docs/theory.md §3).

    Args:
        rollout_units: [B, R] float.   dead: [B] bool (:func:`zero_advantage_groups`).

    Returns:
        A share in [0, 1]; NaN when the normaliser is 0.
    """
    total = float(rollout_units.double().sum())
    if total <= 0:
        return math.nan
    return float(rollout_units.double()[dead].sum()) / total
