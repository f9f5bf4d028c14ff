"""Token credit that measures something: each token's signed share of the group update, and Monte Carlo advantages.

docs/theory.md §Token credit. Shapes: R rollouts of one group, T completion tokens, P parameters, K Monte Carlo
continuations per prefix.

1. **Signed contribution to the group update.** The group's update direction (on-policy, first pass) is
   u = sum_{i,t} w_{i,t} grad log pi(o_{i,t}) with w_{i,t} = A_i c_i / |o_i| (c_i from the loss aggregation:
   :func:`grpo_lens.diagnostics.baselines.aggregation_rollout_weights`). Token (i, t) contributes the vector
   w_{i,t} grad log pi(o_{i,t}); its signed share of the update is

       s_{i,t} = w_{i,t} <grad log pi(o_{i,t}), u> / ||u||^2,        sum_{i,t} s_{i,t} = 1.

   The directional derivatives <grad log pi(o_{i,t}), u> of every token come from four extra forwards at
   theta +- e u and theta +- (e/2) u (Richardson-extrapolated central differences, error O(e^4) plus float
   round-off); the closure sum s - 1 is reported as the measurement's error.
2. **Monte Carlo token advantages (VinePPO).** From the prefix q + o_{<t} of a rollout, K continuations give
   V_hat(prefix_t) = mean reward; segment advantages A_seg = V_hat(end) - V_hat(start) with standard errors, set
   against GRPO's uniform A_i on every token.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from grpo_lens.rollout import RolloutBatch, batch_logprobs

#: token classes of :func:`token_classes`
TOKEN_CLASSES = ("answer", "format", "reasoning")


# ----------------------------------------------------------------------------------------------------------------
# 1. Signed contributions
# ----------------------------------------------------------------------------------------------------------------


def token_weights(advantages: Tensor, completion_mask: Tensor, aggregation: str = "seq-mean-token-mean") -> Tensor:
    """w_{i,t} = A_i c_i / |o_i| on completion tokens, 0 elsewhere: each token's weight in the group update.

    Args:
        advantages: [R].  completion_mask: [R, T] bool.  aggregation: the trainer's loss aggregation.

    Returns:
        [R, T] float64.
    """
    from grpo_lens.diagnostics.baselines import aggregation_rollout_weights

    m = completion_mask.to(torch.float64)
    c = aggregation_rollout_weights(completion_mask, aggregation)
    per = advantages.detach().double().cpu() * c / m.sum(-1).clamp(min=1.0)
    return per.unsqueeze(1) * m


def token_directional_derivatives(model: nn.Module, batch: RolloutBatch, direction: Sequence[Tensor],
                                  params: Sequence[nn.Parameter], *, step: float = 1e-2,
                                  temperature: float = 1.0) -> Tensor:
    """<grad_theta log pi(o_{i,t}), v> for every completion token, by Richardson-extrapolated central differences.

    D(e) = (log pi(theta + e v) - log pi(theta - e v)) / (2 e) has error O(e^2); (4 D(e/2) - D(e)) / 3 cancels it,
    leaving O(e^4) (Richardson extrapolation). e = step / ||v|| (a move of L2 length ``step``): larger steps lose
    less to float round-off (float32 inside the model, ~1e-7 relative per forward), smaller ones less to curvature.
    Four forwards; the parameters are restored bit for bit afterwards.

    Args:
        model: causal LM.  batch: R rollouts.  direction: tensors shaped like ``params`` (v).  params: the
            parameters v lives in.  step: L2 length of the larger perturbation.  temperature: the sampling
            temperature (the policy's log-probs, docs/theory.md §Log-probabilities).

    Returns:
        [R, T] float64 (0 where v = 0).
    """
    norm = math.sqrt(sum(float(d.double().square().sum()) for d in direction))
    if norm == 0:
        return torch.zeros(batch.completion_ids.shape, dtype=torch.float64)
    saved = [p.detach().clone() for p in params]

    def logp_at(e: float) -> Tensor:
        for p, s, d in zip(params, saved, direction):
            p.copy_(s + e * d.to(p.dtype))
        return batch_logprobs(model, batch, temperature).double().cpu()

    diffs = []
    try:
        with torch.no_grad():
            for e in (step / norm, step / (2 * norm)):
                diffs.append((logp_at(e) - logp_at(-e)) / (2 * e))
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    return (4 * diffs[1] - diffs[0]) / 3


def signed_token_contributions(model: nn.Module, group: RolloutBatch, advantages: Tensor, *,
                               aggregation: str = "seq-mean-token-mean", step: float = 1e-2,
                               temperature: float = 1.0) -> dict:
    """s_{i,t} = w_{i,t} <grad log pi(o_{i,t}), u> / ||u||^2 of one group (module docstring, item 1).

    u is the exact gradient of sum_{i,t} w_{i,t} log pi(o_{i,t}) over every trainable parameter (one backward);
    ``.grad`` is untouched.

    Args:
        model: causal LM.  group: its R rollouts.  advantages: [R].  aggregation: the loss aggregation.
        step, temperature: see :func:`token_directional_derivatives`.

    Returns:
        {"contributions": [R, T] float64 (0 off the completion), "weights": [R, T] w_{i,t},
         "closure": sum s - 1 (0 up to the finite-difference error), "update_norm": ||u||}; all-zero contributions
        and closure NaN when u = 0 (no reward contrast).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    w = token_weights(advantages, group.completion_mask, aggregation)  # [R, T]
    logp = batch_logprobs(model, group, temperature)
    objective = (logp.double() * w.to(logp.device)).sum()
    grads = torch.autograd.grad(objective, params, allow_unused=True) if objective.requires_grad else [None] * len(
        params)
    u = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]
    u_sq = sum(float(x.double().square().sum()) for x in u)
    if u_sq == 0:
        z = torch.zeros_like(w)
        return {"contributions": z, "weights": w, "closure": math.nan, "update_norm": 0.0}
    d = token_directional_derivatives(model, group, u, params, step=step, temperature=temperature)
    s = w * d / u_sq
    return {"contributions": s, "weights": w, "closure": float(s.sum()) - 1.0, "update_norm": math.sqrt(u_sq)}


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
        tokenizer: with ``decode``.  completion_ids, completion_mask: [R, T].

    Returns:
        [R, T] long.
    """
    from grpo_lens.diagnostics.credit import answer_mask_from_tokenizer

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


# ----------------------------------------------------------------------------------------------------------------
# 2. Monte Carlo token advantages (VinePPO)
# ----------------------------------------------------------------------------------------------------------------


def segment_boundaries(length: int, segments: int) -> list[int]:
    """Prefix lengths 0 = b_0 < b_1 < ... < b_n = length splitting a completion into ~equal segments (n <= segments)."""
    if length <= 0:
        return [0]
    n = min(segments, length)
    return sorted({round(k * length / n) for k in range(n + 1)})


@torch.no_grad()
def prefix_values(model: nn.Module, tokenizer, prompt_ids: Tensor, completion_ids: Tensor,
                  boundaries: Sequence[int], score: Callable[[list[str]], list[float]], *, num_samples: int,
                  max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0) -> tuple[Tensor, Tensor]:
    """V_hat(prefix) = mean reward of K continuations sampled from the prompt plus the first b tokens, per boundary.

    Sampling uses the trainer's transforms only (temperature, top-k, top-p, as :func:`grpo_lens.rollout.sample_groups`)
    with the remaining budget max_new_tokens - b; the full completion (prefix + continuation) is decoded and scored.

    Args:
        prompt_ids: [Lp] unpadded prompt tokens.  completion_ids: [T'] the rollout's completion tokens (no padding).
        boundaries: prefix lengths b (each < len(completion_ids); the complete rollout needs no sampling).
        score: completions (decoded texts) -> rewards.  num_samples: K >= 2.  seed: sampling seed.

    Returns:
        (values [n_b] float64, standard errors [n_b]: sample std / sqrt(K)).
    """
    from transformers import GenerationConfig

    from grpo_lens.rollout import _stop_token_ids, sampling_generation_config

    if num_samples < 2:
        raise ValueError(f"need K >= 2 continuations per prefix for a standard error, got {num_samples}")
    device = next(model.parameters()).device
    eos = _stop_token_ids(model, tokenizer)
    values, errors = [], []
    was_training, own_config = model.training, getattr(model, "generation_config", None)
    model.eval()
    try:
        model.generation_config = GenerationConfig()  # as sample_groups: only our own sampling settings apply
        for j, b in enumerate(boundaries):
            prefix = torch.cat([prompt_ids.cpu(), completion_ids[:b].cpu()]).to(device)
            ids = prefix.unsqueeze(0).repeat(num_samples, 1)
            config = sampling_generation_config(temperature=temperature, top_k=top_k, top_p=top_p,
                                                max_new_tokens=max(max_new_tokens - b, 1), eos_token_ids=eos,
                                                pad_token_id=int(tokenizer.pad_token_id))
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed * 7919 + j)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            texts = []
            for row in out.sequences[:, len(prompt_ids):].cpu().tolist():
                cut = next((k for k, tok in enumerate(row) if tok in eos and k >= b), len(row))
                texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
            r = torch.tensor([float(x) for x in score(texts)], dtype=torch.float64)
            values.append(float(r.mean()))
            errors.append(float(r.std(unbiased=True)) / math.sqrt(num_samples))
    finally:
        model.generation_config = own_config
        model.train(was_training)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(errors, dtype=torch.float64)


def segment_advantages(values: Tensor, errors: Tensor, final_reward: float) -> tuple[Tensor, Tensor]:
    """A_seg = V(b_{k+1}) - V(b_k) for consecutive boundaries, the last ending at the complete rollout (V = r).

    Args:
        values, errors: [n] at boundaries b_0..b_{n-1} (from :func:`prefix_values`).  final_reward: r of the rollout.

    Returns:
        (advantages [n], standard errors [n]); the advantages sum to r - V(b_0) (telescoping).
    """
    v = torch.cat([values.double(), torch.tensor([float(final_reward)], dtype=torch.float64)])
    e = torch.cat([errors.double(), torch.zeros(1, dtype=torch.float64)])
    return v[1:] - v[:-1], (e[1:].square() + e[:-1].square()).sqrt()


def compare_with_uniform(seg_adv: Tensor, seg_err: Tensor, seg_len: Sequence[int], grpo_advantage: float,
                         z: float = 2.0) -> dict[str, float]:
    """Where Monte Carlo credit and GRPO's uniform A_i disagree, for one rollout.

    GRPO gives every token A_i; Monte Carlo gives segment k the advantage A_seg,k. A segment *disagrees* when
    A_seg,k has the opposite sign of A_i and |A_seg,k| > z * SE, *agrees* when the same sign beyond z * SE, and is
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
    return {"disagree": float(lens[sig & ~same].sum()) / total, "agree": float(lens[sig & same].sum()) / total,
            "neutral": float(lens[~sig].sum()) / total,
            "top_segment_share": float(a.abs().max()) / mass if mass > 0 else math.nan, "segments": len(a)}
