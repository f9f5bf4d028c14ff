"""Token-level credit under an output-only reward (docs/theory.md §10, §Token credit): what each token gets.

Shapes: N rollouts (R of one group), T completion tokens, Lp prompt positions, L = Lp + T input positions.

Under an output-only reward every token of rollout i gets the same advantage A_i, so the within-rollout variance of
the per-token advantage is 0 by construction (:func:`token_advantages`, :func:`within_rollout_advantage_variance`).
What still varies along a rollout is how much gradient each position carries: per-position squared norms
(:func:`grpo_lens.gradients.sketch.token_grad_sq_norms`, aligned by :func:`completion_positions`) give the profile
along positions (:func:`position_profile`) and the share carried by the final-answer tokens (:func:`answer_share`,
answer masks from :func:`answer_mask_from_tokenizer`); :func:`credit_metrics` gives the ``credit/*`` keys.

The credit study's pure pieces: each token's weight in the group update (:func:`token_weights`), profiles over
relative position (:func:`relative_position_profile`), token classes answer / format / reasoning
(:func:`token_classes`, :func:`class_shares`, summarised over groups by :func:`summarise_class_shares`), each token's
signed share of the update from its directional derivative (:func:`signed_contributions`; from explicit per-token
gradients :func:`exact_directional_derivatives`), and Monte Carlo segments (:func:`segment_boundaries`,
:func:`segment_advantages`, :func:`compare_with_uniform`). The model calls are :mod:`grpo_lens.gradients.token_credit`.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from grpo_lens import metrics as mk
from grpo_lens.formulas.losses import aggregation_rollout_weights
from grpo_lens.formulas.stats import binomial_pmf, mean_interval

#: The last number of a completion: optional sign, digits with optional thousands commas, optional decimals.
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def token_advantages(advantages: Tensor, completion_mask: Tensor) -> Tensor:
    """Per-token advantages A_{i,t} = A_i on the completion's tokens, 0 elsewhere (output-only reward).

    Args:
        advantages: [N] (or [B, R], flattened).
        completion_mask: [N, T] bool.

    Returns:
        [N, T] float.
    """
    a = advantages.reshape(-1)
    assert a.shape[0] == completion_mask.shape[0], (advantages.shape, completion_mask.shape)
    return a.unsqueeze(1) * completion_mask.to(a.dtype)


def within_rollout_advantage_variance(token_adv: Tensor, completion_mask: Tensor) -> Tensor:
    """Variance of A_{i,t} over the tokens t of each rollout (population, over masked tokens).

    Zero for :func:`token_advantages` (every token of a rollout carries A_i): the measured evidence that an
    output-only reward assigns no token-level credit.

    Args:
        token_adv: [N, T] per-token advantages.
        completion_mask: [N, T] bool.

    Returns:
        [N] float (0 for an empty rollout).
    """
    assert token_adv.shape == completion_mask.shape, (token_adv.shape, completion_mask.shape)
    m = completion_mask.to(token_adv.dtype)
    count = m.sum(-1).clamp(min=1.0)
    mean = (token_adv * m).sum(-1) / count
    return (((token_adv - mean.unsqueeze(1)) ** 2) * m).sum(-1) / count


def completion_positions(token_sq_norms: Tensor, prompt_len: int) -> Tensor:
    """Align per-position values over the input [N, Lp+T] with the completion tokens [N, T].

    log pi(o_t | q, o_<t) is computed from the model's output at input position Lp - 1 + t, so token t gets
    position Lp - 1 + t (t = 0..T-1): the last prompt position for o_0, and the position of o_{T-1} itself (which
    predicts nothing) is dropped.

    Args:
        token_sq_norms: [N, Lp + T].
        prompt_len: Lp.

    Returns:
        [N, T].
    """
    t = token_sq_norms.shape[1] - prompt_len
    assert prompt_len >= 1 and t >= 1, (token_sq_norms.shape, prompt_len)
    return token_sq_norms[:, prompt_len - 1 : prompt_len - 1 + t]


def position_profile(token_sq_norms: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-position gradient-norm^2 profile averaged over rollouts.

    Args:
        token_sq_norms: [N, T] squared per-position gradient norms (e.g. :func:`completion_positions` of
            :func:`grpo_lens.gradients.sketch.token_grad_sq_norms`).
        mask: [N, T] bool, positions that count (e.g. the completion mask); None counts all.

    Returns:
        [T] float: mean over the rollouts valid at position t of the squared norm; 0 where none is valid.
    """
    x = token_sq_norms.double()
    m = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    assert m.shape == x.shape, (m.shape, x.shape)
    return (x * m).sum(0) / m.sum(0).clamp(min=1.0)


def answer_share(token_sq_norms: Tensor, answer_mask: Tensor, completion_mask: Tensor) -> Tensor:
    """Share of each rollout's gradient norm^2 carried by its final-answer tokens.

    share_i = sum_{t in answer} n_{i,t} / sum_{t in completion} n_{i,t}; 1 - share_i is carried by the rest
    (reasoning, formatting).

    Args:
        token_sq_norms: [N, T] squared per-token norms aligned with the completion tokens.
        answer_mask: [N, T] bool (:func:`answer_mask_from_tokenizer`, :func:`answer_mask_from_char_span`).
        completion_mask: [N, T] bool.

    Returns:
        [N] float64 in [0, 1]; 0 for a rollout with no gradient.
    """
    assert token_sq_norms.shape == answer_mask.shape == completion_mask.shape, (
        token_sq_norms.shape,
        answer_mask.shape,
        completion_mask.shape,
    )
    x = token_sq_norms.double() * completion_mask.double()
    total = x.sum(-1)
    ans = (x * answer_mask.double()).sum(-1)
    return torch.where(total > 0, ans / total.clamp(min=1e-300), torch.zeros_like(total))


def last_number_span(text: str) -> tuple[int, int] | None:
    """Character span [start, end) of the last number in ``text`` (:data:`NUMBER_RE`), or None when there is none.

    A trailing comma of the match (as in "42, then") is not part of the number.
    """
    matches = list(NUMBER_RE.finditer(text))
    if not matches:
        return None
    start, end = matches[-1].span()
    while end > start and text[end - 1] == ",":
        end -= 1
    return start, end


def answer_mask_from_char_span(
    offsets: Sequence[tuple[int, int]], span: tuple[int, int] | None, length: int | None = None
) -> Tensor:
    """Tokens whose character range overlaps ``span``.

    Args:
        offsets: per-token (start, end) character offsets into the decoded completion, T' of them.
        span: [start, end) character span, or None (no answer: all False).
        length: T, pad the mask with False up to this length.

    Returns:
        [T] bool (T = ``length`` or len(offsets)).
    """
    t = len(offsets) if length is None else length
    mask = torch.zeros(t, dtype=torch.bool)
    if span is None:
        return mask
    s0, s1 = span
    for j, (a, b) in enumerate(offsets[:t]):
        if b > a and a < s1 and b > s0:
            mask[j] = True
    return mask


def decode_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """Decoded text of ``ids`` and each token's character range in it, by cumulative decoding.

    Token j covers [len(decode(ids[:j])), len(decode(ids[:j+1]))) (clamped to be monotone); works with any
    tokenizer that has ``decode`` (special tokens skipped; they get empty ranges). O(T^2) characters decoded.

    Returns:
        (text, offsets) with len(offsets) = len(ids).
    """
    ids = list(ids)
    offsets, prev = [], 0
    for j in range(len(ids)):
        cur = len(tokenizer.decode(ids[: j + 1], skip_special_tokens=True))
        cur = max(cur, prev)
        offsets.append((prev, cur))
        prev = cur
    return tokenizer.decode(ids, skip_special_tokens=True), offsets


def answer_mask_from_tokenizer(tokenizer, completion_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Answer mask [N, T]: the tokens of the last number of each decoded completion.

    Args:
        tokenizer (Any): anything with ``decode(ids, skip_special_tokens=True)``.
        completion_ids: [N, T] long.
        completion_mask: [N, T] bool.

    Returns:
        [N, T] bool, False outside the completion and for completions without a number.
    """
    assert completion_ids.shape == completion_mask.shape, (completion_ids.shape, completion_mask.shape)
    n, t = completion_ids.shape
    out = torch.zeros(n, t, dtype=torch.bool)
    for i in range(n):
        keep = completion_mask[i].bool()
        positions = keep.nonzero().flatten().tolist()
        text, offsets = decode_offsets(tokenizer, completion_ids[i][keep].tolist())
        local = answer_mask_from_char_span(offsets, last_number_span(text))
        out[i, positions] = local
    return out


def credit_metrics(
    token_adv: Tensor, token_sq_norms: Tensor, completion_mask: Tensor, answer_mask: Tensor | None = None
) -> dict[str, float]:
    """Batch summaries: max within-rollout advantage variance and, with an answer mask, the mean answer share.

    Args:
        token_adv: [N, T]; token_sq_norms: [N, T] (completion-aligned); completion_mask, answer_mask: [N, T] bool.

    Returns:
        {"credit/adv_var_within_max", "credit/answer_share_mean" (if answer_mask), "credit/answer_token_frac"
        (share of completion tokens that are answer tokens, the share a uniform profile would give)}.
    """
    out = {mk.CREDIT_ADV_VAR_WITHIN_MAX: float(within_rollout_advantage_variance(token_adv, completion_mask).max())}
    if answer_mask is not None:
        out[mk.CREDIT_ANSWER_SHARE_MEAN] = float(answer_share(token_sq_norms, answer_mask, completion_mask).mean())
        tokens = completion_mask.double().sum().clamp(min=1.0)
        out[mk.CREDIT_ANSWER_TOKEN_FRAC] = float((answer_mask & completion_mask.bool()).double().sum() / tokens)
    return out


#: token classes of :func:`token_classes`
TOKEN_CLASSES = ("answer", "format", "reasoning")


def token_weights(advantages: Tensor, completion_mask: Tensor, aggregation: str = "seq-mean-token-mean") -> Tensor:
    """w_{i,t} = A_i c_i / |o_i| on completion tokens, 0 elsewhere: each token's weight in the group update.

    Args:
        advantages: [R].  completion_mask: [R, T] bool.  aggregation: the trainer's loss aggregation.

    Returns:
        [R, T] float64.
    """
    m = completion_mask.to(torch.float64)
    c = aggregation_rollout_weights(completion_mask, aggregation)
    per = advantages.detach().double().cpu() * c / m.sum(-1).clamp(min=1.0)
    return per.unsqueeze(1) * m


def relative_position_profile(values: Tensor, completion_mask: Tensor, bins: int = 10) -> Tensor:
    """Sum of per-token ``values`` in each bin of relative position t / |o_i| in [0, 1).

    Args:
        values: [R, T].  completion_mask: [R, T] bool.  bins: number of equal-width bins.

    Returns:
        [bins] float64 (sums over the rollouts and tokens in each bin).
    """
    m = completion_mask.bool().cpu()
    lengths = m.sum(-1, keepdim=True).clamp(min=1)
    pos = torch.arange(m.shape[1]).unsqueeze(0).expand_as(m)
    b = (pos * bins // lengths).clamp(max=bins - 1)
    out = torch.zeros(bins, dtype=torch.float64)
    return out.index_add_(0, b[m], values.detach().double().cpu()[m])


def token_classes(tokenizer, completion_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Class of each completion token: 0 answer (the last number's tokens), 1 format (a token whose decoded text has
    no letter or digit: punctuation, whitespace, EOS and other special tokens), 2 reasoning (the rest); -1 off the
    completion.

    Args:
        tokenizer (Any): with ``decode``.
        completion_ids: [R, T].
        completion_mask: [R, T].

    Returns:
        [R, T] long.
    """

    answer = answer_mask_from_tokenizer(tokenizer, completion_ids.cpu(), completion_mask.cpu())
    out = torch.full(completion_ids.shape, -1, dtype=torch.long)
    for i in range(completion_ids.shape[0]):
        for t in completion_mask[i].nonzero().flatten().tolist():
            text = tokenizer.decode([int(completion_ids[i, t])], skip_special_tokens=True)
            if answer[i, t]:
                out[i, t] = 0
            elif not any(ch.isalnum() for ch in text):
                out[i, t] = 1
            else:
                out[i, t] = 2
    return out


def signed_contributions(weights: Tensor, derivatives: Tensor, update_sq_norm: float) -> dict:
    """s_{i,t} = w_{i,t} <grad log pi(o_{i,t}), u> / ||u||^2 from the directional derivatives
    (docs/theory.md §Token credit): the one body of
    :func:`grpo_lens.gradients.token_credit.signed_token_contributions` (derivatives by finite differences on a model)
    and of the planted cases of `grpo-lens calibrate` (:func:`exact_directional_derivatives` of per-token gradient
    vectors).

    Args:
        weights: [R, T] w_{i,t} (:func:`token_weights`; 0 off the completion).  derivatives: [R, T]
            <grad log pi(o_{i,t}), u>.  update_sq_norm: ||u||^2 of u = sum_{i,t} w_{i,t} grad log pi(o_{i,t}).

    Returns:
        {"contributions": [R, T] float64, "weights": the weights, "closure": sum s - 1 (0 up to the derivatives'
        error), "update_norm": ||u||}; all-zero contributions and closure NaN when u = 0 (no reward contrast).
    """
    assert weights.shape == derivatives.shape, (weights.shape, derivatives.shape)
    if update_sq_norm == 0:
        return {"contributions": torch.zeros_like(weights), "weights": weights, "closure": math.nan, "update_norm": 0.0}
    s = weights * derivatives.to(weights.dtype) / update_sq_norm
    return {
        "contributions": s,
        "weights": weights,
        "closure": float(s.sum()) - 1.0,
        "update_norm": math.sqrt(update_sq_norm),
    }


def exact_directional_derivatives(token_grads: Tensor, weights: Tensor) -> tuple[Tensor, float]:
    """<g_{i,t}, u> and ||u||^2 for u = sum_{i,t} w_{i,t} g_{i,t}, from explicit per-token gradients (planted cases;
    a model's are too large to hold, so the model path takes the same numbers by finite differences).

    Args:
        token_grads: [R, T, P] g_{i,t} = grad log pi(o_{i,t}) (anything off the completion, where w = 0).
        weights: [R, T] w_{i,t}.

    Returns:
        (derivatives [R, T] float64, ||u||^2).
    """
    assert token_grads.shape[:2] == weights.shape, (token_grads.shape, weights.shape)
    g = token_grads.double()
    u = torch.einsum("rtp,rt->p", g, weights.double())  # [P]
    return g @ u, float(u @ u)


def paired_class_shares(
    contribute: Callable[[Tensor], dict], advantages: Tensor, classes: Tensor
) -> tuple[dict, dict, dict]:
    """One group's class shares under its GRPO advantages A and under NLL weights (every A_i = 1: the control with the
    same gradient geometry), the credit study's per-group body (docs/theory.md §12).

    Args:
        contribute: advantages [R] -> the dict of :func:`signed_contributions` (a model's finite differences in
            :func:`grpo_lens.probe.studies.run_credit_study`, explicit per-token gradients in `grpo-lens calibrate`).
        advantages: [R] A.  classes: [R, T] (:func:`token_classes`).

    Returns:
        (the dict under A, :func:`class_shares` under A, :func:`class_shares` under NLL weights).
    """
    res = contribute(advantages)
    nll = contribute(torch.ones_like(advantages))
    return res, class_shares(res["contributions"], classes), class_shares(nll["contributions"], classes)


def summarise_class_shares(shares: Sequence[dict], shares_nll: Sequence[dict]) -> tuple[dict, dict]:
    """The credit study's class summary over groups (``classes`` and ``classes_nll`` of
    :func:`grpo_lens.probe.studies.run_credit_study`), from per-group :func:`class_shares` under A and under NLL
    weights (every A_i = 1), paired by group.

    Returns:
        (classes {class: {"update_share", "token_share", "ratio"}: mean_interval over groups},
            classes_nll {class: {"ratio": under NLL weights, "ratio_minus_nll": ratio under A − under NLL, paired per
            group}: mean_interval over groups}); non-finite values (an absent class) are dropped.
    """
    assert len(shares) == len(shares_nll), (len(shares), len(shares_nll))

    def finite(values):
        return [v for v in values if math.isfinite(v)]

    classes = {
        c: {k: mean_interval(finite(sh[c][k] for sh in shares)) for k in ("update_share", "token_share", "ratio")}
        for c in TOKEN_CLASSES
    }
    classes_nll = {
        c: {
            "ratio": mean_interval(finite(sh[c]["ratio"] for sh in shares_nll)),
            "ratio_minus_nll": mean_interval(finite(a[c]["ratio"] - b[c]["ratio"] for a, b in zip(shares, shares_nll))),
        }
        for c in TOKEN_CLASSES
    }
    return classes, classes_nll


def class_shares(contributions: Tensor, classes: Tensor) -> dict[str, dict[str, float]]:
    """Per token class: its share of the group update and its share of the completion tokens (the control).

    Returns:
        {class: {"update_share": sum_{t in class} s_{i,t} (the s sum to 1), "token_share": its share of the
        completion tokens, "ratio": update_share / token_share (1 = the class carries the update in proportion to
        its size; NaN when the class is absent)}}.
    """
    s = contributions.detach().double().cpu()
    valid = classes >= 0
    total = float(s[valid].sum())
    n = int(valid.sum())
    out = {}
    for k, name in enumerate(TOKEN_CLASSES):
        sel = classes == k
        share = float(s[sel].sum()) / total if total != 0 else math.nan
        tok = float(sel.sum()) / max(n, 1)
        out[name] = {"update_share": share, "token_share": tok, "ratio": share / tok if tok > 0 else math.nan}
    return out


def segment_boundaries(length: int, segments: int) -> list[int]:
    """Prefix lengths 0 = b_0 < b_1 < ... < b_n = length splitting a completion into ~equal segments (n <= segments)."""
    if length <= 0:
        return [0]
    n = min(segments, length)
    return sorted({round(k * length / n) for k in range(n + 1)})


def segment_advantages(values: Tensor, errors: Tensor, final_reward: float) -> tuple[Tensor, Tensor]:
    """A_seg,j = V(b_{j+1}) - V(b_j) for consecutive boundaries, the last ending at the complete rollout (V = r).

    Args:
        values: [n] at boundaries b_0..b_{n-1} (from :func:`prefix_values`).
        errors: [n] at the same boundaries (from :func:`prefix_values`).
        final_reward: r of the rollout.

    Returns:
        (advantages [n], standard errors [n]); the advantages sum to r - V(b_0) (telescoping).
    """
    v = torch.cat([values.double(), torch.tensor([float(final_reward)], dtype=torch.float64)])
    e = torch.cat([errors.double(), torch.zeros(1, dtype=torch.float64)])
    return v[1:] - v[:-1], (e[1:].square() + e[:-1].square()).sqrt()


def compare_with_uniform(
    seg_adv: Tensor, seg_err: Tensor, seg_len: Sequence[int], grpo_advantage: float, z: float = 2.0
) -> dict[str, float]:
    """Where Monte Carlo credit and GRPO's uniform A_i disagree, for one rollout.

    GRPO gives every token A_i; Monte Carlo gives segment j the advantage A_seg,j. A segment *disagrees* when
    A_seg,j has the opposite sign of A_i and |A_seg,j| > z * SE, *agrees* when the same sign beyond z * SE, and is
    *neutral* otherwise (within noise of 0: the segment did not change the expected reward).

    Returns:
        {"disagree", "agree", "neutral": token-weighted shares of the rollout, "top_segment_share": the largest
        |A_seg| over sum |A_seg| (uniform credit over n segments would give ~1/n), "segments": n}.
    """
    a, e = seg_adv.double(), seg_err.double()
    lens = torch.tensor(list(seg_len), dtype=torch.float64)
    sig = a.abs() > z * e
    same = torch.sign(a) == math.copysign(1.0, grpo_advantage) if grpo_advantage != 0 else torch.zeros_like(sig)
    total = float(lens.sum()) or 1.0
    mass = float(a.abs().sum())
    return {
        "disagree": float(lens[sig & ~same].sum()) / total,
        "agree": float(lens[sig & same].sum()) / total,
        "neutral": float(lens[~sig].sum()) / total,
        "top_segment_share": float(a.abs().max()) / mass if mass > 0 else math.nan,
        "segments": len(a),
    }


def opposition_size(mc_samples: int, d: int, grid: int = 2001) -> float:
    """sup over p of P(X - Y >= d), X, Y iid Binomial(K_mc, p): the largest chance that two prefixes with one success
    probability show an opposing count difference of at least d (docs/theory.md §12, the Monte Carlo credit rule).

    P(X - Y >= d) rises in X's probability and falls in Y's, so over the null "the later prefix is at least as likely
    to succeed" (p_Y >= p_X) it is largest at p_X = p_Y; the sup over that common p is taken on a grid of ``grid``
    points of [0, 1] (the function is a polynomial of degree 2 K_mc; the grid's step 1/2000 is far below its scale).

    Args:
        mc_samples: K_mc >= 1 continuations per prefix.  d: the count difference, >= 1.

    Returns:
        the size in [0, 1].

    Raises:
        ValueError: mc_samples < 1 or d < 1.
    """
    if mc_samples < 1 or d < 1:
        raise ValueError(f"need K_mc >= 1 and d >= 1, got K_mc = {mc_samples}, d = {d}")
    best = 0.0
    for j in range(grid):
        pmf = binomial_pmf(mc_samples, j / (grid - 1))
        tail = math.fsum(pmf[x] * pmf[y] for x in range(mc_samples + 1) for y in range(mc_samples + 1) if x - y >= d)
        best = max(best, tail)
    return best


@functools.lru_cache(maxsize=64)
def opposition_threshold(mc_samples: int, tests: int, level: float = 0.05) -> tuple[int, float]:
    """(d, size): the smallest count difference d whose :func:`opposition_size` is at most ``level / tests``
    (Bonferroni over a rollout's ``tests`` interior segments), so that a rollout whose segments truly all have A_i's
    sign or 0 shows an opposing difference >= d in some segment with probability <= tests * size <= level.

    Returns (K_mc + 1, 0.0), K_mc = ``mc_samples``, when no d <= K_mc is small enough (then no rollout can be flagged).

    Raises:
        ValueError: mc_samples < 1, tests < 1 or level outside (0, 1).
    """
    if mc_samples < 1 or tests < 1 or not 0 < level < 1:
        raise ValueError(f"need K_mc >= 1, tests >= 1 and level in (0, 1), got {mc_samples}, {tests}, {level}")
    for d in range(1, mc_samples + 1):
        size = opposition_size(mc_samples, d)
        if size <= level / tests:
            return d, size
    return mc_samples + 1, 0.0


def prefix_success_counts(values: Sequence[float], errors: Sequence[float], mc_samples: int) -> list[int] | None:
    """Successes among the K_mc = ``mc_samples`` continuations of each prefix, from
    :func:`grpo_lens.gradients.token_credit.prefix_values`' mean and SE, or None when the rewards were not 0/1 (the
    mean times K_mc is not an integer, or the SE is not the one 0/1 draws give: sqrt(x (K_mc - x) / (K_mc² (K_mc -
    1))))."""
    counts = []
    for v, e in zip(values, errors):
        x = round(v * mc_samples)
        if (
            abs(v * mc_samples - x) > 1e-6
            or abs(e - math.sqrt(x * (mc_samples - x) / (mc_samples * mc_samples * (mc_samples - 1)))) > 1e-6
        ):
            return None
        counts.append(x)
    return counts


def opposing_differences(counts: Sequence[int], grpo_advantage: float) -> list[int]:
    """Per interior segment b_j -> b_{j+1} (j = 0..n-2), the success-count difference in the direction that opposes
    A_i: X_j - X_{j+1} when A_i > 0 (the later prefix succeeds less), X_{j+1} - X_j when A_i < 0; [] when A_i = 0.

    The last segment (b_{n-1} -> the complete rollout, whose value is its reward r) is not among them: with 0/1
    rewards and a mixed group, r = 1 where A_i > 0 and r = 0 where A_i < 0, so it cannot oppose A_i.

    Args:
        counts: [n] successes at the prefixes b_0..b_{n-1} (:func:`prefix_success_counts`).
    """
    if grpo_advantage == 0:
        return []
    sign = 1 if grpo_advantage > 0 else -1
    return [sign * (counts[j] - counts[j + 1]) for j in range(len(counts) - 1)]


def segment_counts(rows: list[dict], z: float = 2.0) -> dict[str, int]:
    """Segments (all rollouts pooled) whose Monte Carlo advantage opposes / agrees with A_i beyond z SE, and all: the
    credit study's descriptive count (the claim decides by :func:`opposition_threshold`'s exact test instead).

    rows: the study's per-rollout dicts with "grpo_advantage", "advantages" [segments] and "adv_errors" [segments].
    Returns {"disagree", "agree", "total"}.
    """
    out = {"disagree": 0, "agree": 0, "total": 0}
    for row in rows:
        sign = math.copysign(1.0, row["grpo_advantage"]) if row["grpo_advantage"] != 0 else 0.0
        for a, e in zip(row["advantages"], row["adv_errors"]):
            out["total"] += 1
            if abs(a) > z * e and sign != 0:
                out["agree" if math.copysign(1.0, a) == sign else "disagree"] += 1
    return out


def opposing_shifts(
    counts: Sequence[Sequence[int]], grpo_advantages: Sequence[float], mc_samples: int
) -> list[list[float]]:
    """Per interior segment position j, the rollouts' opposing shifts e_ij = :func:`opposing_differences` / K_mc: an
    unbiased estimate of δ_ij = sign(A_i)(p_ij − p_i,j+1), how much the segment b_j -> b_{j+1} moves the success
    probability against A_i (positive: it opposes A_i; the two prefixes' continuations are independent, so
    E e_ij = δ_ij exactly). Rollouts with A_i = 0 and positions a rollout does not reach are left out.

    Args:
        counts: per rollout, [n_i] successes at the prefixes (:func:`prefix_success_counts`).
        grpo_advantages: per rollout A_i.  mc_samples: K_mc.

    Returns:
        [positions] lists of e_ij over the rollouts that have position j (positions = the most interior segments).
    """
    out: list[list[float]] = []
    for c, a in zip(counts, grpo_advantages):
        for j, x in enumerate(opposing_differences(c, a)):
            if j == len(out):
                out.append([])
            out[j].append(x / mc_samples)
    return out
