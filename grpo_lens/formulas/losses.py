"""GRPO's per-token policy loss, KL penalty, loss aggregation and the per-rollout weights of its gradient.

Shapes: N rollouts (N = B * R), T completion tokens. Every token tensor is [N, T] with a completion mask [N, T]
(True on real completion tokens). Per-token loss (DeepSeekMath, arXiv 2402.03300, eq. 3, negated for descent):

    l_{i,t} = -min(rho_{i,t} A_i, clip(rho_{i,t}, 1 - eps_low, 1 + eps_high) A_i) + beta * KL_{i,t},
    rho_{i,t} = exp(log pi_theta - log pi_old).

Aggregation turns l [N, T] into one number. To stay exact under gradient accumulation each mode is split into a
numerator that is a sum over rollouts (so micro-batches add up) and a normaliser computed once on the whole batch
(:func:`loss_normalizer`); sum over micro-batches of :func:`aggregate_loss` equals the whole batch's value.

Per-rollout weights of the aggregated loss's gradient (docs/theory.md §3), both read off :data:`LOSS_AGGREGATIONS`:
:func:`rollout_gradient_weights` omega_i, the weight on rollout i's summed log-prob gradient (with the batch
constant N/Z; what the lens and the probe differentiate), and :func:`aggregation_rollout_weights` c_i, the weight on
its length-normalised score gradient (what ``--estimator optimal`` and the credit study scale g_i by); for a rollout
with tokens omega_i = (N/Z) c_i / |o_i|.

Per-token weights of a policy loss's gradient at any ratio, :func:`policy_token_weights` omega_{i,t}: the lens's
row of rollout i at that pass is grad sum_t omega_{i,t} log pi(o_{i,t}).

Also: the policy losses (:data:`POLICY_LOSSES`; ``vanilla`` = :func:`clipped_surrogate`, ``gspo``, ``cispo``,
``sapo``, ``gpg``; docs/theory.md §Policy losses beyond the clipped surrogate), the KL estimators k1 / k2 /
k3 (:data:`KL_ESTIMATORS`), the sampler-trainer mismatch
(:func:`truncated_is_weights`, :func:`mismatch_sums`), and the clamp on log-ratios (:data:`LOG_RATIO_CLAMP`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_lens import metrics as mk
from grpo_lens.registry import Registry

# ---------------------------------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL Divergence", 2020), x = log pi_ref - log pi_theta per sampled token.
# Each is an estimator of KL(pi_theta || pi_ref) under samples from pi_theta; k3 is GRPO's choice (arXiv 2402.03300,
# eq. 4). Every estimator first clamps x to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] (docs/theory.md §Numerical guards), so
# exp(x) cannot overflow; a token clamped there contributes no KL gradient.
# ---------------------------------------------------------------------------------------------------------------------
KL_ESTIMATORS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("KL estimator")


#: Bound on |x| = |log pi_ref - log pi_theta| (nats) before any KL estimator uses it: exp(20) = 4.85e8 is finite in
#: float32 and bfloat16, and a real policy this far from its reference is already a failed run (docs/theory.md
#: §Numerical guards; verl clamps the same log-ratio to the same range).
LOG_RATIO_CLAMP = 20.0


def clamped_log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """x = clamp(log pi_ref - log pi_theta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP). [N, T] -> [N, T]."""
    return torch.clamp(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def clamped_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    """rho = exp(clamp(log pi_theta - log pi_old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), the per-token importance
    ratio with its log clamped (docs/theory.md §Numerical guards). [N, T], [N, T] -> [N, T], with logp's gradient."""
    return torch.exp(torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = -x = log pi_theta - log pi_ref (unbiased, high variance, can be negative), x clamped. [N, T] -> [N, T].

    Its value is k1; its gradient is the score-function estimator of grad KL(pi_theta || pi_ref),
    (log pi_theta - log pi_ref) grad log pi_theta (Schulman 2020; the k1-in-the-reward form of RLHF, Ouyang et al.
    2022, differentiated through the policy-gradient term), which equals k2's. The plain derivative of k1 in a loss is
    grad log pi_theta, whose expectation under on-policy samples is 0: it would not pull towards the reference at all
    (open-instruct#534; Tang & Munos, "On a few pitfalls in KL divergence gradient estimation for RL", arXiv
    2506.09477). Per token, like k2: the later tokens' log-ratios do not enter a token's weight (the partial gradient
    that paper also describes).

    .. warning:: libraries differ: a loss that differentiates k1 itself (d/dlogp = 1) pulls towards nothing in
       expectation; here the value logged is k1 and the gradient is the one of the KL.
    """
    k1 = -clamped_log_ratio(logp, ref_logp).detach()
    return k1 + k1 * (logp - logp.detach())  # value k1; d/dlogp = k1 = log pi_theta - log pi_ref (clamped)


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = x^2 / 2 (biased, low variance, >= 0), x clamped. [N, T] -> [N, T]."""
    return 0.5 * clamped_log_ratio(logp, ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(x) - x - 1 (unbiased, >= 0; GRPO's, arXiv 2402.03300 eq. 4), x clamped to +-LOG_RATIO_CLAMP so it is
    at most exp(20) - 21 ~ 4.85e8. [N, T] -> [N, T]."""
    x = clamped_log_ratio(logp, ref_logp)
    return torch.expm1(x) - x


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate between the policy and the reference model.

    Args:
        logp: [N, T] log pi_theta of the sampled tokens (carries the gradient).
        ref_logp: [N, T] log pi_ref of the same tokens (no gradient).
        estimator: "k1", "k2" or "k3".
    Returns:
        [N, T] in nats per token.
    Raises:
        ValueError: unknown estimator, listing the valid ones.
    """
    return KL_ESTIMATORS.get(estimator)(logp, ref_logp)


def kl_reward_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, beta: float) -> Tensor:
    """RLHF's KL penalty on the reward: beta * sum_t k1_t = beta * sum_t (log pi_old - log pi_ref) over each rollout's
    completion tokens, detached (Ziegler et al., arXiv 1909.08593, eq. 2; Ouyang et al. 2022, eq. 2). Subtracted from
    the reward before the advantages, it enters the policy gradient through A_i, as a sequence-level penalty.

    Args:
        logp: [N, T] log pi_old of the sampled tokens.   ref_logp: [N, T] log pi_ref.   mask: [N, T] bool.
        beta: the KL coefficient >= 0.
    Returns:
        [N] penalties in reward units (>= 0 in expectation, any sign per rollout).
    Raises:
        ValueError: shapes differ or beta < 0.
    """
    if logp.shape != ref_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, ref_logp {tuple(ref_logp.shape)} and mask {tuple(mask.shape)} "
            f"must all be [N, T]"
        )
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    k1 = kl_k1(logp.detach(), ref_logp.detach())
    return beta * masked_sum(k1, mask, dim=1)


# ---------------------------------------------------------------------------------------------------------------------
# Policy losses (verl's ``@register_policy_loss``): fn(logp [N, T], old_logp [N, T], advantages [N] or [N, T], **the
# settings it uses) -> (per-token loss [N, T], rho [N, T] detached), looked up by ``policy_loss``. The settings (mask
# [N, T] bool, eps_low, eps_high, dual_clip, sapo_tau_pos, sapo_tau_neg) are passed by name, each only to a loss that
# declares it (or **kwargs): a loss declares what it uses and nothing else. Every loss's gradient is
# sum_t w_{i,t} grad log pi with w_{i,t} proportional to A_i (for a fixed sign of A_i), which
# :func:`policy_token_weights` reads off; at ratio 1 every registered loss has the clipped surrogate's gradient
# (docs/theory.md §Policy losses beyond the clipped surrogate).
# ---------------------------------------------------------------------------------------------------------------------
PolicyLossFn = Callable[..., tuple[Tensor, Tensor]]

#: The clip settings a loss that declares them gets from :func:`policy_loss_call` unless told otherwise (PPO's 0.2,
#: no dual clip; GSPO's own smaller defaults apply only when it is called directly).
CLIP_DEFAULTS: dict[str, float | None] = {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def _broadcast_advantages(advantages: Tensor) -> Tensor:
    """[N] -> [N, 1] (one scalar per rollout, broadcast over its tokens); [N, T] unchanged."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


@POLICY_LOSSES.register("vanilla")  # verl's name for the PPO / GRPO clipped surrogate
def clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token PPO/GRPO policy loss -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A), optional dual clip.

    Asymmetric bounds (eps_high > eps_low, "clip-higher") come from DAPO, arXiv 2503.14476, eq. 10. Dual clip
    (Ye et al., "Mastering Complex Control in MOBA Games with Deep RL", AAAI 2020, eq. 5) bounds the loss of tokens
    with A < 0 by -dual_clip * A, so a huge ratio cannot give an unbounded step.

    Args:
        logp: [N, T] log pi_theta (with gradient).
        old_logp: [N, T] log pi_old, the sampler's log-probs (no gradient).
        advantages: [N] (one scalar per rollout, broadcast over its tokens) or [N, T].
        eps_low: the clip range below 1, >= 0.
        eps_high: the clip range above 1, >= 0.
        dual_clip: c > 1, or None to disable.
    Returns:
        loss [N, T] and rho [N, T] (the importance ratio, detached).
    Raises:
        ValueError: dual_clip <= 1.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    adv = _broadcast_advantages(advantages)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss, ratio.detach()


def _require_mask(mask: Tensor | None, logp: Tensor, loss: str) -> Tensor:
    if mask is None or mask.shape != logp.shape:
        raise ValueError(f"policy loss {loss!r} needs mask [N, T] = {tuple(logp.shape)}, got {mask!r:.60}")
    return mask.bool()


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's length-normalised sequence log-ratio (1/|o_i|) sum_t (log pi_theta - log pi_old), with gradient.

    Args:
        logp: [N, T].
        old_logp: [N, T].
        mask: [N, T] bool.
    Returns:
        [N, 1] in nats per token (0 for an empty completion).
    """
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1).to(logp.dtype)
    return masked_sum(logp - old_logp, mask, dim=1).unsqueeze(1) / lengths


@POLICY_LOSSES.register("gspo")  # verl's gspo; TRL's importance_sampling_level="sequence"
def gspo_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    dual_clip: float | None = None,
    *,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GSPO: the clipped surrogate on the sequence ratio s_i = exp((1/|o_i|) sum_t log(pi_theta / pi_old)).

    Per token (GSPO-token with A_{i,t} = A_i, Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071,
    eqs. 5-7 and 13): s_{i,t} = sg(s_i) pi_theta(o_{i,t}) / sg(pi_theta(o_{i,t})), whose value is s_i on every token
    and whose derivative by log pi(o_{i,t}) is s_i; loss -min(s_{i,t} A_i, clip(s_{i,t}, 1-eps_low, 1+eps_high) A_i).
    Its gradient is -A_i s_i sum_t grad log pi(o_{i,t}) times the aggregation's weight of rollout i where the clip
    does not bind, 0 where it does (for the whole rollout at once). Summing the broadcast sequence loss
    -min(s_i A_i, clip(s_i) A_i) over the rollout's tokens (TRL's form) has the same value and gradient under every
    aggregation of :data:`LOSS_AGGREGATIONS`. The paper's clip ranges are 3e-4 / 4e-4 (its §5.1), far below the token
    loss's 0.2: the sequence ratio is a geometric mean. The sequence log-ratio is clamped to +-LOG_RATIO_CLAMP.

    Args:
        logp: [N, T] log pi_theta (with gradient).   old_logp: [N, T] log pi_old.
        advantages: [N] (one per rollout; GSPO's advantages are sequence-level).
        eps_low: the sequence ratio's clip range below 1, >= 0.
        eps_high: its clip range above 1, >= 0.
        dual_clip: c > 1 bounds the loss of A < 0 rollouts by -c A (as :func:`clipped_surrogate`), or None.
        mask: [N, T] bool, the completion tokens (required: it defines |o_i|).
    Returns:
        loss [N, T] and the sequence ratio s_i broadcast to [N, T] (detached).
    Raises:
        ValueError: mask missing or of another shape, advantages not [N], dual_clip <= 1.
    """
    m = _require_mask(mask, logp, "gspo")
    if advantages.dim() != 1:
        raise ValueError(f"gspo's advantages are one per rollout, [N]; got {tuple(advantages.shape)}")
    log_s = torch.clamp(sequence_log_ratio(logp, old_logp, m), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, 1]
    token_log_s = log_s.detach() + (logp - logp.detach())  # value log s_i, d/dlogp_{i,t} = 1
    loss, _ = clipped_surrogate(token_log_s, torch.zeros_like(logp), advantages, eps_low, eps_high, dual_clip)
    return loss, torch.exp(log_s.detach()).expand_as(logp)


@POLICY_LOSSES.register("cispo")  # verl's and TRL's cispo
def cispo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_low: float = 0.2, eps_high: float = 0.2
) -> tuple[Tensor, Tensor]:
    """CISPO: -sg(clip(rho, 1 - eps_low, 1 + eps_high)) A log pi_theta per token (MiniMax-M1, arXiv 2506.13585, eqs.
    4-5): the importance weight is clipped and detached, and every token keeps a gradient -clip(rho) A grad log pi,
    where the clipped surrogate gives a clipped token none.

    .. warning:: the value is -clip(rho) A log pi, not a surrogate of the return: it is not 0 on policy, and it is
       not comparable with the other losses' ``loss/policy``. TRL's ``loss_type="cispo"`` has no lower bound and
       takes its ``epsilon_high`` as the cap itself (ScaleRL's eps_max, e.g. 5.0): grpo-lens' eps_high is that cap
       minus 1 (the TRL name ``epsilon_high`` with ``loss_type: cispo`` translates it), and grpo-lens keeps the lower
       bound 1 - eps_low (verl's cispo does too). MiniMax-M1 tuned only the upper bound.

    Args:
        logp: [N, T] (with gradient).   old_logp: [N, T].   advantages: [N] or [N, T].
        eps_low: the weight's clip range below 1.
        eps_high: its clip range above 1.
    Returns:
        loss [N, T] and rho [N, T] (detached).
    """
    ratio = clamped_ratio(logp, old_logp).detach()
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return -weight * _broadcast_advantages(advantages) * logp, ratio


def sapo_gate(ratio: Tensor, tau: Tensor | float) -> Tensor:
    """SAPO's soft gate f(r) = (4 / tau) sigmoid(tau (r - 1)): f(1) = 2 / tau and f'(1) = 1 whatever tau, so at
    ratio 1 SAPO's gradient is the clipped surrogate's. ratio: [N, T]; tau: a float or [N, T] (> 0). -> [N, T]."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


@POLICY_LOSSES.register("sapo")  # TRL's sapo
def sapo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, *, sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05
) -> tuple[Tensor, Tensor]:
    """SAPO: -f(rho) A per token with the soft gate f (:func:`sapo_gate`), tau = sapo_tau_pos where A > 0 and
    sapo_tau_neg elsewhere (Gao et al., "Soft Adaptive Policy Optimization", arXiv 2511.20347, eqs. 5-6; TRL's
    ``loss_type="sapo"``, defaults 1.0 / 1.05).

    Its gradient is -A f'(rho) rho grad log pi with f'(r) rho = 4 sigma(1 - sigma) r, sigma = sigmoid(tau (r - 1)):
    1 at rho = 1, falling smoothly off policy instead of the clip's cut to 0. No hard clip, so it declares no eps_low,
    eps_high or dual_clip.

    Args:
        logp: [N, T].
        old_logp: [N, T].
        advantages: [N] or [N, T].
        sapo_tau_pos: > 0.
        sapo_tau_neg: > 0.
    Returns:
        loss [N, T] and rho [N, T] (detached).
    Raises:
        ValueError: a temperature <= 0.
    """
    if not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise ValueError(f"SAPO's temperatures must be > 0, got {sapo_tau_pos} and {sapo_tau_neg}")
    adv = _broadcast_advantages(advantages)
    ratio = clamped_ratio(logp, old_logp)
    tau = torch.where(adv > 0, sapo_tau_pos, sapo_tau_neg).to(logp.dtype)
    return -sapo_gate(ratio, tau) * adv, ratio.detach()


@POLICY_LOSSES.register("gpg")  # verl's gpg
def gpg_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor) -> tuple[Tensor, Tensor]:
    """GPG: the plain policy gradient -A log pi_theta per token, no ratio and no clip (Chu et al., "GPG: A Simple and
    Strong Reinforcement Learning Baseline for Model Reasoning", arXiv 2504.02546, eq. 5). Its gradient is
    -A grad log pi at every pass, so with mu > 1 later passes take plain policy-gradient steps without a trust
    region. GPG's own batch rescaling (alpha = B / B_valid) is a learning-rate factor, left to ``learning_rate``.

    Args:
        logp: [N, T].
        old_logp: [N, T] (it only gives the logged ratio).
        advantages: [N] or [N, T].
    Returns:
        loss [N, T] and rho [N, T] (detached, for the ratio metrics only).
    """
    ratio = clamped_ratio(logp, old_logp).detach()
    return -_broadcast_advantages(advantages) * logp, ratio


#: The policy losses whose per-token loss and gradient are exactly 0 where A = 0, at any ratio (the update forwards
#: such rows without gradient, :func:`grpo_lens.train.update.still_rows`).
ZERO_AT_ZERO_ADVANTAGE = ("vanilla", "gspo", "cispo", "sapo", "gpg")


def policy_loss_call(
    name: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    **settings: float | None,
) -> tuple[Tensor, Tensor]:
    """The policy loss ``name`` called on (logp, old_logp, advantages) and, by name, those of ``mask`` and the
    settings that it declares (a loss with ``**kwargs``: all of them).

    Args:
        name: a name in :data:`POLICY_LOSSES`.
        logp: [N, T] (with gradient).   old_logp: [N, T].   advantages: [N] or [N, T].   mask: [N, T] bool.
        settings: eps_low, eps_high, dual_clip (default 0.2, 0.2 and None, :data:`CLIP_DEFAULTS`, whatever defaults
            the loss declares) and the losses' own settings (sapo_tau_pos, sapo_tau_neg).
    Returns:
        (per-token loss [N, T], rho [N, T] detached).
    Raises:
        ValueError: unknown name, listing the valid ones.
    """
    fn = POLICY_LOSSES.get(name)
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    given = {"mask": mask, **CLIP_DEFAULTS, **settings}
    return fn(logp, old_logp, advantages, **{k: v for k, v in given.items() if takes_all or k in params})


# ---------------------------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Aggregation:
    """A loss aggregation mode: numerator(loss [N, T], mask [N, T]) -> scalar, normaliser(mask, max_new_tokens), and
    rollout_weights(mask) -> [N] v_i with numerator(l, m) = sum_i v_i sum_t l_{i,t} m_{i,t} (what the per-rollout
    gradient term of docs/theory.md §3 is built from; a test checks the equality for every mode)."""

    numerator: Callable[[Tensor, Tensor], Tensor]
    normalizer: Callable[[Tensor, int], float]
    source: str
    rollout_weights: Callable[[Tensor], Tensor]


# a registry of records, not of functions
LOSS_AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")  # type: ignore[type-var]


def _rollouts_in_loss(mask: Tensor) -> float:
    """Rollouts with at least one token in the loss mask (all N unless some were filtered out, e.g. overlong)."""
    return float(mask.bool().any(dim=1).sum().item())


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum of ``values`` over the positions where ``mask`` is true (nonzero), along ``dim`` (all when None).

    ``torch.where``, never ``values * mask``: a NaN or inf at a masked-out position (a padded token's log-prob of
    -inf, say) would make the product NaN (0 * inf = NaN) and the whole loss with it (verl PR 6349).

    Args:
        values: [n, T] float.   mask: [n, T] bool or 0/1.
    """
    kept = torch.where(mask != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def _sequence_mean_numerator(loss: Tensor, mask: Tensor) -> Tensor:
    lengths = (mask != 0).sum(dim=1).clamp(min=1)
    return (masked_sum(loss, mask, dim=1) / lengths).sum()


def _token_sum_numerator(loss: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(loss, mask)


def _sequence_mean_weights(mask: Tensor) -> Tensor:
    return 1.0 / mask.sum(dim=1).clamp(min=1)


def _token_sum_weights(mask: Tensor) -> Tensor:
    return torch.ones(mask.shape[0], dtype=mask.dtype, device=mask.device)


# (1/N) sum_i (1/|o_i|) sum_t l_{i,t}: every rollout weighs the same whatever its length.
LOSS_AGGREGATIONS.register("seq-mean-token-mean")(
    Aggregation(
        _sequence_mean_numerator,
        lambda mask, max_new_tokens: _rollouts_in_loss(mask),
        "GRPO, DeepSeekMath arXiv 2402.03300 eq. 3",
        _sequence_mean_weights,
    )
)
# sum_{i,t} l_{i,t} / sum_i |o_i|: every token weighs the same.
LOSS_AGGREGATIONS.register("token-mean")(
    Aggregation(
        _token_sum_numerator,
        lambda mask, max_new_tokens: float(mask.sum().item()),
        "DAPO, arXiv 2503.14476 eq. 12",
        _token_sum_weights,
    )
)
# sum_{i,t} l_{i,t} / (N * T_max), T_max = max_new_tokens, a constant: no length bias.
LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")(
    Aggregation(
        _token_sum_numerator,
        lambda mask, max_new_tokens: _rollouts_in_loss(mask) * max_new_tokens,
        "Dr. GRPO, arXiv 2503.20783 §3.1",
        _token_sum_weights,
    )
)

# (1/N) sum_i sum_t l_{i,t}: each rollout's token sum, averaged over rollouts; a long rollout weighs more.
LOSS_AGGREGATIONS.register("seq-mean-token-sum")(
    Aggregation(
        _token_sum_numerator,
        lambda mask, max_new_tokens: _rollouts_in_loss(mask),
        "verl's loss_agg_mode seq-mean-token-sum (verl/trainer/ppo/core_algos.py agg_loss)",
        _token_sum_weights,
    )
)


def loss_normalizer(completion_mask: Tensor, mode: str, max_new_tokens: int) -> float:
    """The denominator of aggregation ``mode`` for a whole batch; compute it once, before splitting into micro-batches.

    Args:
        completion_mask: [N, T] bool of the whole batch (all processes' batches when training on several).
        mode: seq-mean-token-mean (N), token-mean (number of completion tokens), seq-mean-token-sum (N) or
            seq-mean-token-sum-norm (N * max_new_tokens), where N counts the rollouts with a token in the mask (a
            rollout filtered out of the loss, e.g. by ``overlong: filter``, leaves the normaliser too).
        max_new_tokens: T_max, the generation budget.
    Returns:
        A positive float (clamped to >= 1 so an empty batch cannot divide by zero).
    Raises:
        ValueError: unknown mode, listing the valid ones.
    """
    return max(LOSS_AGGREGATIONS.get(mode).normalizer(completion_mask, max_new_tokens), 1.0)


def rollout_gradient_weights(
    completion_mask: Tensor, mode: str, normalizer: float, num_rollouts: float | None = None
) -> Tensor:
    """omega_i such that the trainer's on-policy loss gradient is -(1/N) sum_i A_i omega_i sum_t grad log pi(o_{i,t}).

    On the first on-policy pass (ratio 1, no clip active, beta = 0) the gradient of the aggregated policy loss is
    -(1/Z) sum_i A_i v_i sum_t grad log pi(o_{i,t}) with v_i = rollout_weights(mask)_i and Z the normaliser; so
    omega_i = (N/Z) v_i: 1/|o_i| for seq-mean-token-mean (Z = N), N / sum_j |o_j| for token-mean, 1 for
    seq-mean-token-sum, 1/T_max for seq-mean-token-sum-norm (docs/theory.md §3). Pass omega to the per-rollout
    gradient functions of :mod:`grpo_lens.gradients` (``score_weights``) to measure the rows the update actually
    sums. For a rollout with tokens omega_i = (N/Z) c_i / |o_i| with c_i of :func:`aggregation_rollout_weights`
    (tests/formulas/test_losses.py checks that the two agree); an empty rollout keeps v_i (its log-prob sum, and so
    its gradient, is 0 either way).

    Args:
        completion_mask: [n, T] bool, the rollouts to weigh (a group, or a batch).
        mode: a name in :data:`LOSS_AGGREGATIONS`.
        normalizer: Z of the batch the loss is normalised over (:func:`loss_normalizer`, summed over processes).
        num_rollouts: N of that batch (rollouts in the loss); default: the rollouts of ``completion_mask`` with a token.

    Returns:
        [n] float64.

    Raises:
        ValueError: unknown mode, or normalizer <= 0.
    """
    if normalizer <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    agg = LOSS_AGGREGATIONS.get(mode)
    n = _rollouts_in_loss(completion_mask) if num_rollouts is None else float(num_rollouts)
    return agg.rollout_weights(completion_mask.to(torch.float64)) * (n / normalizer)


def aggregate_loss(loss: Tensor, mask: Tensor, mode: str, normalizer: float) -> Tensor:
    """One micro-batch's share of the batch loss: numerator(loss, mask) / normalizer.

    Summing this over the micro-batches of a batch gives exactly the whole batch's aggregated loss, for every mode,
    whatever the completion lengths in each micro-batch.

    Args:
        loss: [n, T] per-token loss of the micro-batch's n rollouts.
        mask: [n, T] bool completion mask.
        mode: a name in :data:`LOSS_AGGREGATIONS`.
        normalizer: from :func:`loss_normalizer` on the whole batch.
    Returns:
        A scalar tensor.
    Raises:
        ValueError: unknown mode.
    """
    return LOSS_AGGREGATIONS.get(mode).numerator(loss, mask.to(loss.dtype)) / normalizer


def _zero_outside(mask: Tensor, t: Tensor) -> Tensor:
    """``t`` [n, T] with 0 where ``mask`` [n, T] bool is False, by torch.where: a NaN / -inf there (padding) reaches
    neither the loss nor its gradient, which a multiply-by-mask would let through (0 * NaN = NaN)."""
    return torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    normalizer: float,
    aggregation: str = "seq-mean-token-mean",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    beta: float = 0.0,
    ref_logp: Tensor | None = None,
    kl_estimator: str = "k3",
    token_weights: Tensor | None = None,
    policy_loss: str = "vanilla",
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO's objective (negated) on one micro-batch: clipped surrogate (or another policy loss) + beta * KL,
    aggregated.

    Source: DeepSeekMath, arXiv 2402.03300, eq. 3 (with the aggregation and clip options of DAPO and Dr. GRPO).

    Args:
        logp: [n, T] log pi_theta of the completion tokens (with gradient).
        old_logp: [n, T] log pi_old (sampler); equal to logp.detach() on the first on-policy pass.
        advantages: [n] per-rollout advantages A_i.
        mask: [n, T] bool completion mask.
        normalizer: the whole batch's :func:`loss_normalizer`.
        aggregation: a name in :data:`LOSS_AGGREGATIONS`.
        eps_low: see :func:`clipped_surrogate`.
        eps_high: see :func:`clipped_surrogate`.
        dual_clip: see :func:`clipped_surrogate`.
        beta: KL coefficient >= 0; 0 skips the reference model.
        ref_logp: [n, T] log pi_ref; required when beta > 0.
        kl_estimator: k1, k2 or k3.
        token_weights: [n, T] detached per-token weights on the policy term (e.g. the truncated importance weights
            of :func:`truncated_is_weights`); None = 1.
        policy_loss: a name in :data:`POLICY_LOSSES` (default ``vanilla``, :func:`clipped_surrogate`; ``gspo``,
            ``cispo``, ``sapo``, ``gpg``).
        sapo_tau_pos: SAPO's gate temperature for A > 0 (:func:`sapo_loss`); other losses ignore it.
        sapo_tau_neg: its gate temperature for A < 0; other losses ignore it.

    Returns:
        (loss, metrics). ``loss`` is this micro-batch's share of the batch loss (sums over micro-batches).
        ``metrics`` holds, for the micro-batch: ``loss/policy`` and ``loss/kl`` (the two parts of ``loss``, summable
        over micro-batches like ``loss``), token means ``kl/mean``, ``clip/ratio_low`` (share of tokens with
        rho < 1 - eps_low and A < 0, where the clip binds), ``clip/ratio_high`` (rho > 1 + eps_high and A > 0),
        ``clip/ratio_region`` (either), ``clip/ratio_dual`` (dual clip binds), ``ratio/mean``, ``ratio/max``,
        and ``tokens`` (the count these means are over, to weight them when combining micro-batches). The clip
        shares count tokens whose ratio (GSPO: the sequence ratio) lies outside [1 - eps_low, 1 + eps_high] on the
        side where the clipped surrogate would bind; for cispo, sapo and gpg, which do not clip that way, they are
        those shares of tokens, not of tokens without gradient.

    Raises:
        ValueError: beta > 0 without ref_logp, shape mismatch, unknown aggregation, KL estimator or policy loss.
    """
    _check_loss_inputs(logp, old_logp, advantages, mask, beta, ref_logp)
    maskf = mask.to(logp.dtype)
    mask = mask.bool()
    logp, old_logp = _zero_outside(mask, logp), _zero_outside(mask, old_logp)  # 0 outside the mask from here on
    ref_logp = None if ref_logp is None else _zero_outside(mask, ref_logp)
    if token_weights is not None and token_weights.shape == mask.shape:
        token_weights = _zero_outside(mask, token_weights)
    policy_tok, ratio = policy_loss_call(
        policy_loss,
        logp,
        old_logp,
        advantages,
        mask,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual_clip,
        sapo_tau_pos=sapo_tau_pos,
        sapo_tau_neg=sapo_tau_neg,
    )
    if token_weights is not None:
        if token_weights.shape != logp.shape:
            raise ValueError(f"token_weights {tuple(token_weights.shape)} must be [n, T] = {tuple(logp.shape)}")
        policy_tok = policy_tok * token_weights.detach().to(policy_tok.dtype)
    policy = aggregate_loss(policy_tok, maskf, aggregation, normalizer)
    kl_tok = kl_penalty(logp, ref_logp, kl_estimator) if ref_logp is not None else None
    if beta > 0:
        # beta > 0 comes with ref_logp (checked by the callers' configs)
        kl_part = beta * aggregate_loss(kl_tok, maskf, aggregation, normalizer)  # type: ignore[arg-type]
        loss = policy + kl_part
    else:  # KL is still measured when ref_logp is given, but carries no gradient
        kl_part = torch.zeros((), dtype=logp.dtype, device=logp.device)
        loss = policy
    with torch.no_grad():
        tokens = maskf.sum().clamp(min=1.0)
        metrics = {
            mk.LOSS_POLICY: float(policy.detach()),
            mk.LOSS_KL: float(kl_part.detach()),
            mk.KL_MEAN: float(masked_sum(kl_tok.detach(), mask) / tokens) if kl_tok is not None else 0.0,
            **clip_shares(ratio, advantages, mask, tokens, eps_low, eps_high, dual_clip),
            "tokens": float(maskf.sum()),
        }
    return loss, metrics


def _check_loss_inputs(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, beta: float, ref_logp: Tensor | None
) -> None:
    """:func:`grpo_loss`'s input checks: [n, T] shapes, [n] advantages, beta >= 0 with its reference log-probs."""
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
            f"{tuple(mask.shape)} must all be [n, T]"
        )
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [n] = [{logp.shape[0]}], got {tuple(advantages.shape)}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (log-probs of the reference model)")


def clip_shares(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    tokens: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> dict[str, float]:
    """Shares of the kept tokens where :func:`grpo_loss`'s clip binds, and the ratio's mean and max over them.

    Args:
        ratio: [n, T] rho = pi_theta / pi_old (GSPO: the sequence ratio per token).
        advantages: [n] A_i.
        mask: [n, T] bool.
        tokens: [] max(mask.sum(), 1) in the loss's dtype, the shares' denominator.
        eps_low: the lower clip range (:func:`clipped_surrogate`).
        eps_high: the upper clip range.
        dual_clip: the dual clip's bound, or None.

    Returns:
        ``clip/ratio_low`` (rho < 1 - eps_low and A < 0), ``clip/ratio_high`` (rho > 1 + eps_high and A > 0),
        ``clip/ratio_region`` (either), ``clip/ratio_dual`` (A < 0 and rho > dual_clip), ``ratio/mean``,
        ``ratio/max`` (1 without tokens).
    """
    adv = advantages.unsqueeze(-1).expand_as(ratio)
    low = (ratio < 1.0 - eps_low) & (adv < 0) & mask
    high = (ratio > 1.0 + eps_high) & (adv > 0) & mask
    dual = torch.zeros_like(mask)
    if dual_clip is not None:
        dual = (adv < 0) & (ratio > dual_clip) & mask
    return {
        mk.CLIP_RATIO_LOW: float(low.sum() / tokens),
        mk.CLIP_RATIO_HIGH: float(high.sum() / tokens),
        mk.CLIP_RATIO_REGION: float((low | high).sum() / tokens),
        mk.CLIP_RATIO_DUAL: float(dual.sum() / tokens),
        mk.RATIO_MEAN: float(masked_sum(ratio, mask) / tokens),
        mk.RATIO_MAX: float(ratio.masked_fill(~mask, 0.0).max()) if mask.any() else 1.0,
    }


def policy_token_weights(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    aggregation: str,
    normalizer: float,
    num_rollouts: float | None = None,
    policy_loss: str = "vanilla",
    token_weights: Tensor | None = None,
    **options: float | None,
) -> Tensor:
    """omega_{i,t} such that the aggregated policy loss's gradient is -(1/N) sum_i A_i sum_t omega_{i,t} grad log
    pi(o_{i,t}): the per-token weights of rollout i's score whose gradient is the lens's row g_i at this pass.

    Every registered policy loss is a sum over rollouts whose token weights are A_i times a function of the sign of
    A_i (the clip sides, SAPO's temperature), of the ratios and of the aggregation: so omega = -N dL/dlogp / A_i,
    read off by autograd on a leaf copy of ``logp`` with each A_i replaced by its sign (+1 for A_i = 0, the weights
    a positive advantage would get). At ratio 1 (the first pass) every registered loss gives the clipped surrogate's
    omega_{i,t} = :func:`rollout_gradient_weights`_i on the loss mask; at ratio != 1 (later passes with mu > 1) they
    differ: the clipped surrogate zeroes clipped tokens, GSPO weighs a whole rollout by its sequence ratio s_i (0 where
    s_i is clipped), CISPO by the clipped ratio, SAPO by the gate's slope 4 sigma (1 - sigma) rho, GPG by 1
    (docs/theory.md §Policy losses beyond the clipped surrogate). The KL term is not in omega (it is not A_i times a
    score).

    Args:
        logp: [n, T] log pi_theta of the pass (any dtype; only its values are read).   old_logp: [n, T] log pi_old.
        advantages: [n] A_i.   mask: [n, T] bool, the loss mask.
        aggregation: a name in :data:`LOSS_AGGREGATIONS`.   normalizer: Z of the whole batch (:func:`loss_normalizer`).
        num_rollouts: N of the whole batch (default: the rows of ``mask`` with a token).
        policy_loss: a name in :data:`POLICY_LOSSES`.   token_weights: [n, T] detached importance weights, or None.
        options: eps_low, eps_high, dual_clip, sapo_tau_pos, sapo_tau_neg (as :func:`grpo_loss`).

    Returns:
        [n, T] float64, 0 off the mask.

    Raises:
        ValueError: shapes differ, normalizer <= 0, unknown aggregation or policy loss.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape or advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask {tuple(mask.shape)} must be [n, T] "
            f"and advantages {tuple(advantages.shape)} [n]"
        )
    if normalizer <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    m = mask.bool()
    n = _rollouts_in_loss(m) if num_rollouts is None else float(num_rollouts)
    sign = torch.where(advantages.detach() < 0, -1.0, 1.0).to(torch.float64)  # [n]
    zero = torch.zeros((), dtype=torch.float64, device=logp.device)
    x = torch.where(m, logp.detach().to(torch.float64), zero).requires_grad_(True)
    old = torch.where(m, old_logp.detach().to(torch.float64), zero)
    with torch.enable_grad():
        # options: the loss's own float settings
        tok, _ = policy_loss_call(policy_loss, x, old, sign, m, **options)
        if token_weights is not None:
            tok = tok * torch.where(m, token_weights.detach().to(torch.float64), zero)
        (grad,) = torch.autograd.grad(aggregate_loss(tok, m.to(torch.float64), aggregation, normalizer), x)
    return torch.where(m, -n * grad / sign.unsqueeze(1), zero)


# ---------------------------------------------------------------------------------------------------------------------
# Sampler-vs-trainer mismatch (docs/theory.md §Sampler-trainer mismatch)
# ---------------------------------------------------------------------------------------------------------------------
def truncated_is_weights(trainer_logp: Tensor, sampler_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance weights w = min(pi_trainer / pi_sampler, cap) per token, detached.

    Corrects the policy gradient for tokens drawn by a sampler whose numerics differ from the trainer's (Ionides,
    "Truncated Importance Sampling", J. Comput. Graph. Stat. 17(2), 2008, eq. 2.3; applied to LLM RL by Yao et al.,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", 2025). The log-ratio is clamped to
    +-LOG_RATIO_CLAMP before exponentiating.

    Args:
        trainer_logp: [N, T] the trainer's log-probs of the sampled tokens (pi_old, detached).
        sampler_logp: [N, T] the sampler's recorded log-probs of the same tokens.
        cap: C > 0, the truncation level.
    Returns:
        [N, T] float weights in (0, cap].
    Raises:
        ValueError: cap <= 0.
    """
    if not cap > 0:
        raise ValueError(f"the truncated importance-sampling cap must be > 0, got {cap}")
    log_w = torch.clamp(trainer_logp.detach() - sampler_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_w).clamp(max=cap)


def mismatch_sums(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Sums over the masked tokens of one micro-batch, to be divided by the token count by the caller.

    With d = log pi_trainer - log pi_sampler per sampled token (samples drawn from the sampler):
    ``abs_diff_sum`` = sum |d|; ``abs_diff_max`` = max |d|; ``k3_sum`` = sum (exp(d) - d - 1), whose mean is the
    k3 estimate of KL(pi_sampler || pi_trainer) (Schulman 2020; unbiased, >= 0), d clamped to +-LOG_RATIO_CLAMP;
    ``tokens`` = number of masked tokens.

    Args:
        trainer_logp: [n, T].
        sampler_logp: [n, T].
        mask: [n, T] bool.
    Returns:
        dict of python floats.
    """
    m = mask.bool()
    d = torch.clamp(trainer_logp.detach().float() - sampler_logp.float(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[m]
    if d.numel() == 0:
        return {"abs_diff_sum": 0.0, "abs_diff_max": 0.0, "k3_sum": 0.0, "tokens": 0.0}
    return {
        "abs_diff_sum": float(d.abs().sum()),
        "abs_diff_max": float(d.abs().max()),
        "k3_sum": float((torch.expm1(d) - d).sum()),
        "tokens": float(d.numel()),
    }


def aggregation_rollout_weights(completion_mask: Tensor, aggregation: str) -> Tensor:
    """c_i: the weight the loss aggregation's numerator puts on rollout i's length-normalised score gradient g_i.

    On the first (on-policy) pass the policy loss's gradient is -(1/Z) sum_i A_i c_i g_i with Z the aggregation's
    normaliser: c_i = 1 for seq-mean-token-mean (each rollout's token mean), c_i = |o_i| for the token-sum modes
    (token-mean, seq-mean-token-sum-norm). Computed from the registered numerator applied to a loss of 1 on every
    token of row i, so a newly registered aggregation is handled too (its numerator must be a sum over rows). The
    weights on the summed log-prob gradient instead, with the batch constant, are :func:`rollout_gradient_weights`.

    Args:
        completion_mask: [N, T] bool.
        aggregation: a name in :data:`LOSS_AGGREGATIONS`.

    Returns:
        [N] float64, >= 0 (0 for an empty completion).

    Raises:
        ValueError: unknown aggregation (listing the valid ones).
    """

    numerator = LOSS_AGGREGATIONS.get(aggregation).numerator
    mask = completion_mask.to(torch.float64)
    ones = torch.ones_like(mask)
    return torch.stack([numerator(ones[i : i + 1], mask[i : i + 1]) for i in range(mask.shape[0])]).reshape(-1)
