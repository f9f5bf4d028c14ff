"""Where a training step's update lands, token by token, and the dead groups' KL-only gradient (docs/theory.md
§Landing shares and the dead groups' KL gradient).

Shapes: n rollouts, T completion tokens, C labels (token classes, or any partition of the tokens).

The update's on-policy loss gradient (first pass, ratio 1, beta = 0, no importance weights) is
grad L = -sum_{i,t} w_{i,t} grad log pi(o_{i,t}), w_{i,t} = A_i omega_i / N on the tokens the loss sums
(:func:`token_update_weights`). With u = -grad L, token (i, t)'s signed landing share is

    s_{i,t} = w_{i,t} <grad log pi(o_{i,t}), u> / ||u||^2,        sum_{i,t} s_{i,t} = 1,

its share of the update's squared length (the credit study's signed contribution,
:func:`grpo_lens.formulas.credit.signed_contributions`, with the group's direction replaced by the step's own
gradient). :func:`landing_shares` sums them per label.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def token_update_weights(advantages: Tensor, omega: Tensor, loss_mask: Tensor, num_rollouts: float) -> Tensor:
    """w_{i,t} = A_i omega_i / N on the tokens the loss sums, 0 elsewhere: grad L = -sum_{i,t} w_{i,t} grad log pi.

    Source: docs/theory.md §3 (omega_i of :func:`grpo_lens.formulas.losses.rollout_gradient_weights`).

    Args:
        advantages: [n] A_i.   omega: [n] omega_i.   loss_mask: [n, T] bool.   num_rollouts: N, the rollouts in the
            loss summed over processes (> 0).

    Returns:
        [n, T] float64 on the CPU.

    Raises:
        ValueError: num_rollouts <= 0, or shapes that disagree.
    """
    if num_rollouts <= 0:
        raise ValueError(f"num_rollouts = {num_rollouts}: must be > 0")
    n = loss_mask.shape[0]
    if advantages.shape != (n,) or omega.shape != (n,):
        raise ValueError(f"advantages {tuple(advantages.shape)} and omega {tuple(omega.shape)} must be [{n}]")
    per = advantages.detach().double().cpu() * omega.detach().double().cpu() / float(num_rollouts)
    return per.unsqueeze(1) * loss_mask.detach().cpu().double()


def landing_shares(contributions: Tensor, labels: Tensor, num_labels: int) -> tuple[Tensor, float]:
    """Each label's share of the measured tokens' landing, and the measured tokens' total (the closure).

    share_k = sum_{labels = k} s_{i,t} / sum_{labels >= 0} s_{i,t};  the shares sum to 1 (a token with label -1 is
    not measured). closure = sum_{labels >= 0} s_{i,t}: 1 when the measured tokens make the whole update (u is their
    weighted sum), less when part of u comes from elsewhere (a KL term, rows of another mini-batch or process), and
    off 1 by the directional derivatives' error otherwise.

    Args:
        contributions: [n, T] s_{i,t}.   labels: [n, T] long in [-1, C).   num_labels: C >= 1.

    Returns:
        (shares [C] float64, NaN when the measured total is 0; closure).

    Raises:
        ValueError: shapes that disagree, or a label outside [-1, C).
    """
    if contributions.shape != labels.shape:
        raise ValueError(f"contributions {tuple(contributions.shape)} and labels {tuple(labels.shape)} differ")
    lab = labels.detach().cpu().long()
    if bool((lab < -1).any()) or bool((lab >= num_labels).any()):
        raise ValueError(f"labels must lie in [-1, {num_labels})")
    s = contributions.detach().cpu().double()
    kept = lab >= 0
    total = float(s[kept].sum())
    sums = torch.zeros(num_labels, dtype=torch.float64).index_add_(0, lab[kept], s[kept])
    shares = sums / total if total != 0 else torch.full((num_labels,), math.nan, dtype=torch.float64)
    return shares, total


def gradient_norm_ratio(part_sq: float, whole_sq: float) -> float:
    """||g_part|| / ||g_whole|| from squared norms (NaN when the whole is 0): the dead groups' KL-only gradient set
    against the update's first gradient (docs/theory.md §Landing shares and the dead groups' KL gradient)."""
    if whole_sq <= 0:
        return math.nan
    return math.sqrt(max(part_sq, 0.0) / whole_sq)
