"""Token credit that measures something: each token's signed share of the group update, and Monte Carlo advantages.

docs/theory.md §Token credit. Shapes: R rollouts of one group, T completion tokens, P parameters, K_mc Monte Carlo
continuations per prefix.

1. **Signed contribution to the group update.** The group's update direction (on-policy, first pass) is
   u = sum_{i,t} w_{i,t} grad log pi(o_{i,t}) with w_{i,t} = A_i c_i / |o_i| (c_i from the loss aggregation:
   :func:`grpo_lens.formulas.losses.aggregation_rollout_weights`). Token (i, t) contributes the vector
   w_{i,t} grad log pi(o_{i,t}); its signed share of the update is

       s_{i,t} = w_{i,t} <grad log pi(o_{i,t}), u> / ||u||^2,        sum_{i,t} s_{i,t} = 1.

   The directional derivatives <grad log pi(o_{i,t}), u> of every token come from four extra forwards at
   theta +- e u and theta +- (e/2) u (Richardson-extrapolated central differences, error O(e^4) plus float
   round-off); the closure sum s - 1 is reported as the measurement's error.
2. **Monte Carlo token advantages (VinePPO).** From the prefix q + o_{<t} of a rollout, K_mc continuations give
   V_hat(prefix_t) = mean reward; segment advantages A_seg = V_hat(end) - V_hat(start) with standard errors, set
   against GRPO's uniform A_i on every token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Required, TypedDict, Unpack

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from grpo_lens.formulas.credit import signed_contributions, token_weights
from grpo_lens.rollout import (
    RolloutBatch,
    _stop_token_ids,
    accepts_logits_to_keep,
    group_logprobs,
    repeated_cache,
    sampling_generation_config,
)


def squared_norm(tensors: Sequence[Tensor]) -> float:
    """sum_k ||t_k||^2 of tensors shaped like the parameters (a direction v in parameter space), in float64."""
    return sum(float(t.double().square().sum()) for t in tensors)


def token_directional_derivatives(
    model: nn.Module,
    batch: RolloutBatch,
    direction: Sequence[Tensor],
    params: Sequence[nn.Parameter],
    *,
    step: float = 1e-2,
    temperature: float = 1.0,
    norm: float | None = None,
) -> Tensor:
    """<grad_theta log pi(o_{i,t}), v> for every completion token, by Richardson-extrapolated central differences.

    D(e) = (log pi(theta + e v) - log pi(theta - e v)) / (2 e) has error O(e^2); (4 D(e/2) - D(e)) / 3 cancels it,
    leaving O(e^4) (Richardson extrapolation). e = step / ||v|| (a move of L2 length ``step``): larger steps lose
    less to float round-off (float32 inside the model, ~1e-7 relative per forward), smaller ones less to curvature.
    Four forwards; the parameters are restored bit for bit afterwards.

    Args:
        model: causal LM.  batch: R rollouts.  direction: tensors shaped like ``params`` (v).  params: the
            parameters v lives in.  step: L2 length of the larger perturbation.  temperature: the sampling
            temperature (the policy's log-probs, docs/theory.md §Log-probabilities).  norm: ||v|| when the caller
            has it (the square root of :func:`squared_norm` of ``direction``); None: computed here.

    Returns:
        [R, T] float64 (0 where v = 0).
    """
    norm = math.sqrt(squared_norm(direction)) if norm is None else norm
    if norm == 0:
        return torch.zeros(batch.completion_ids.shape, dtype=torch.float64)
    saved = [p.detach().clone() for p in params]

    def logp_at(e: float) -> Tensor:
        for p, s, d in zip(params, saved, direction):
            torch.mul(d.to(p.dtype), e, out=p)  # then + s: the bits of s + e d, with no [P] temporaries
            p.add_(s)
        # without return_entropy: one tensor
        return group_logprobs(model, batch, temperature).double().cpu()  # type: ignore[union-attr]

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


def signed_token_contributions(
    model: nn.Module,
    group: RolloutBatch,
    advantages: Tensor,
    *,
    aggregation: str = "seq-mean-token-mean",
    step: float = 1e-2,
    temperature: float = 1.0,
) -> dict:
    """s_{i,t} = w_{i,t} <grad log pi(o_{i,t}), u> / ||u||^2 of one group (module docstring, item 1).

    u is the exact gradient of sum_{i,t} w_{i,t} log pi(o_{i,t}) over every trainable parameter (one backward);
    ``.grad`` is untouched. The directional derivatives come from :func:`token_directional_derivatives`; the shares
    from :func:`grpo_lens.formulas.credit.signed_contributions` (the body the planted cases of `grpo-lens calibrate`
    share).

    Args:
        model: causal LM.  group: its R rollouts.  advantages: [R].  aggregation: the loss aggregation.
        step: see :func:`token_directional_derivatives`.
        temperature: see :func:`token_directional_derivatives`.

    Returns:
        {"contributions": [R, T] float64 (0 off the completion), "weights": [R, T] w_{i,t},
            "closure": sum s - 1 (0 up to the finite-difference error), "update_norm": ||u||}; all-zero contributions
        and closure NaN when u = 0 (no reward contrast).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    w = token_weights(advantages, group.completion_mask, aggregation)  # [R, T]
    logp = group_logprobs(model, group, temperature)
    # without return_entropy: one tensor
    objective = (logp.double() * w.to(logp.device)).sum()  # type: ignore[union-attr, operator]
    grads = (
        torch.autograd.grad(objective, params, allow_unused=True) if objective.requires_grad else [None] * len(params)
    )
    u = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]
    u_sq = squared_norm(u)
    d = (
        torch.zeros_like(w)
        if u_sq == 0  # no update: nothing to differentiate along (no forwards)
        else token_directional_derivatives(
            model, group, u, params, step=step, temperature=temperature, norm=math.sqrt(u_sq)
        )
    )
    return signed_contributions(w, d, u_sq)


class PrefixSampling(TypedDict, total=False):
    """:func:`prefix_values_many`'s sampling keywords, passed through by :func:`prefix_values` (meaning and defaults
    there)."""

    num_samples: Required[int]
    max_new_tokens: Required[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int


@torch.no_grad()
def prefix_values(
    model: nn.Module,
    tokenizer,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    boundaries: Sequence[int],
    score: Callable[[list[str]], list[float]],
    **sampling: Unpack[PrefixSampling],
) -> tuple[Tensor, Tensor]:
    """V_hat(prefix) = mean reward of K_mc continuations sampled from the prompt plus the first b tokens, per boundary.

    One rollout's :func:`prefix_values_many` (one ``generate`` call for every boundary).

    Args:
        prompt_ids: [Lp] unpadded prompt tokens.  completion_ids: [T'] the rollout's completion tokens (no padding).
        boundaries: prefix lengths b (each < len(completion_ids); the complete rollout needs no sampling).
        score: completions (decoded texts) -> rewards.
        sampling: :class:`PrefixSampling`, as :func:`prefix_values_many`: num_samples K_mc >= 2, max_new_tokens,
            temperature, top_k, top_p, seed (the sampling seed).

    Returns:
        (values [n_b] float64, standard errors [n_b]: sample std / sqrt(K_mc)).

    Raises:
        ValueError: K_mc < 2, or a boundary outside [0, len(completion_ids)).
    """
    (out,) = prefix_values_many(
        model,
        tokenizer,
        prompt_ids,
        [completion_ids],
        [boundaries],
        score,
        **sampling,
    )
    return out


def prefix_values_many(
    model: nn.Module,
    tokenizer,
    prompt_ids: Tensor | Sequence[Tensor],
    completions: Sequence[Tensor],
    boundaries: Sequence[Sequence[int]],
    score: Callable[[list[str]], list[float]] | Sequence[Callable[[list[str]], list[float]]],
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    max_rows: int = 256,
) -> list[tuple[Tensor, Tensor]]:
    """V_hat(prefix) of every boundary of several rollouts (of one prompt or several), from batched ``generate`` calls.

    Each prefix q_j + o_{j,<b} gets K_mc continuations with the remaining budget max_new_tokens - b; sampling uses the
    trainer's transforms only (temperature, top-k, top-p, as :func:`grpo_lens.rollout.sample_groups`). The prefixes
    are left padded into batches of at most ``max_rows`` rows (K_mc rows per prefix, never split), each sampled for
    max_new_tokens - min b steps; each row's continuation is cut at its own budget (the first max_new_tokens - b
    tokens of an autoregressive sample are a sample with that budget) and at its first EOS, and the full completion
    (prefix + continuation) is decoded and scored by its rollout's ``score`` (one call per rollout). Source: the
    Monte Carlo value estimates of VinePPO (Kazemnejad et al. 2024, arXiv 2410.01679, §4); docs/theory.md §Token credit.

    Args:
        prompt_ids: [Lp] unpadded prompt tokens shared by every rollout, or one [Lp_j] per rollout.
        completions: n rollouts' completion tokens, each [T'_j] (no padding).
        boundaries: per rollout, prefix lengths b (each in [0, T'_j); the complete rollout needs no sampling).
        score: completions (decoded texts) -> rewards, shared or one per rollout.  num_samples: K_mc >= 2.
        seed: sampling seed (batch c of the call is seeded with seed + c).  max_rows: rows per ``generate`` call
            (memory knob; at least K_mc; the samples depend on it).

    Returns:
        per rollout, (values [n_b] float64, standard errors [n_b]: sample std / sqrt(K_mc)).

    Raises:
        ValueError: K_mc < 2, max_rows < K_mc, a boundary outside [0, T'_j), or per-rollout lists of different lengths.
    """
    K_mc = num_samples
    if K_mc < 2:
        raise ValueError(f"need K_mc >= 2 continuations per prefix for a standard error, got {K_mc}")
    if max_rows < K_mc:
        raise ValueError(f"max_rows = {max_rows} holds no prefix's K_mc = {K_mc} continuations: need max_rows >= K_mc")
    n = len(completions)
    prompts = [prompt_ids] * n if isinstance(prompt_ids, Tensor) else list(prompt_ids)
    scores = [score] * n if callable(score) else list(score)
    if not len(prompts) == len(boundaries) == len(scores) == n:
        raise ValueError(
            f"{n} completions but {len(prompts)} prompts, {len(boundaries)} lists of boundaries, {len(scores)} scores"
        )
    prefixes: list[tuple[int, int, Tensor]] = []  # (rollout, b, prompt + completion[:b]), one per (rollout, boundary)
    for j, (prompt, completion, bounds) in enumerate(zip(prompts, completions, boundaries)):
        for b in bounds:
            if not 0 <= b < len(completion):
                raise ValueError(f"boundary {b} outside [0, {len(completion)}): the complete rollout needs no sampling")
            prefixes.append((j, int(b), torch.cat([prompt.cpu(), completion[:b].cpu()])))
    texts: list[list[str]] = [[] for _ in range(n)]  # per rollout, its prefixes' K_mc completions in order
    per_call = max_rows // K_mc
    for c, start in enumerate(range(0, len(prefixes), per_call)):
        chunk = prefixes[start : start + per_call]
        for (j, b, _), row_texts in zip(
            chunk,
            _continue_prefixes(model, tokenizer, chunk, K_mc, max_new_tokens, temperature, top_k, top_p, seed + c),
        ):
            head = completions[j][:b].tolist()
            texts[j].extend(tokenizer.decode(head + cont, skip_special_tokens=True) for cont in row_texts)
    results = []
    for j in range(n):
        rewards = torch.tensor([float(x) for x in scores[j](texts[j])], dtype=torch.float64)
        rewards = rewards.view(len(boundaries[j]), K_mc)
        results.append((rewards.mean(1), rewards.std(1, unbiased=True) / math.sqrt(K_mc)))
    return results


@torch.no_grad()
def shared_prefill(model: nn.Module, ids: Tensor, mask: Tensor, repeats: int):
    """The KV cache of ``ids[:, :-1]`` (left padded), each row's cache repeated ``repeats`` times, for ``generate``
    to continue from (it runs the last prompt token itself); None when the model does not return a cache with
    ``reorder_cache`` (``generate`` then prefills every row).

    Positions are ``generate``'s own for left padding (cumsum of the mask - 1, 1 on padding), so each row's cache
    holds the same keys and values as ``generate``'s prefill of the repeated rows, computed once per prefix instead of
    K_mc times. Args: ids, mask: [n, L] (L >= 2).  repeats: K_mc. Returns {name: a transformers ``Cache`` of n * K_mc
    rows}, the keyword ``generate`` takes it by (``cache``, ``past_key_values`` before transformers 5)."""
    if ids.shape[1] < 2:
        return None
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    kwargs = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
    out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1], use_cache=True, **kwargs)
    return repeated_cache(out, torch.arange(ids.shape[0], device=ids.device).repeat_interleave(repeats))


def _continue_prefixes(
    model: nn.Module,
    tokenizer,
    prefixes: Sequence[tuple[int, int, Tensor]],
    mc_samples: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    share_prefill: bool = True,
) -> list[list[list[int]]]:
    """K_mc sampled continuations of each (rollout, b, prefix tokens), left padded into one ``generate`` call; each cut
    at its budget max_new_tokens - b and before its first EOS: per prefix, K_mc token lists.

    ``share_prefill``: each prefix's KV cache is computed once and repeated for its K_mc rows
    (:func:`shared_prefill`) instead of K_mc identical prefills; False runs the K_mc prefills (the reference)."""
    K_mc = mc_samples
    device = next(model.parameters()).device
    eos = _stop_token_ids(model, tokenizer)
    pad = int(tokenizer.pad_token_id)
    width = max(len(seq) for _, _, seq in prefixes)
    ids = torch.stack([torch.cat([seq.new_full((width - len(seq),), pad), seq]) for _, _, seq in prefixes])
    mask = torch.stack([(torch.arange(width) >= width - len(seq)).long() for _, _, seq in prefixes])
    ids, mask = ids.to(device), mask.to(device)
    config = sampling_generation_config(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=max(max_new_tokens - min(b for _, b, _ in prefixes), 1),
        eos_token_ids=eos,
        pad_token_id=pad,
    )
    config.output_scores = config.output_logits = False  # only the tokens are read
    was_training, own_config = model.training, getattr(model, "generation_config", None)
    model.eval()
    try:
        # nn.Module types a transformers model's attribute as Tensor | Module
        model.generation_config = GenerationConfig()  # type: ignore[assignment]  # as sample_groups: only our own sampling settings apply
        cache = shared_prefill(model, ids, mask, K_mc) if share_prefill else None
        ids, mask = ids.repeat_interleave(K_mc, dim=0), mask.repeat_interleave(K_mc, dim=0)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            # nn.Module types a transformers model's attribute as Tensor | Module
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **(cache or {}))  # type: ignore[operator]
    finally:
        # nn.Module types a transformers model's attribute as Tensor | Module
        model.generation_config = own_config  # type: ignore[assignment]
        model.train(was_training)
    sampled = out.sequences[:, width:].cpu().tolist()  # [n_prefix K_mc, <= steps]
    result = []
    for p, (_, b, _) in enumerate(prefixes):
        rows = []
        for row in sampled[p * K_mc : (p + 1) * K_mc]:
            cont = row[: max(max_new_tokens - b, 1)]
            rows.append(cont[: next((k for k, tok in enumerate(cont) if tok in eos), len(cont))])
        result.append(rows)
    return result
