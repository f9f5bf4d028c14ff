"""Token credit that measures something: each token's signed share of the group update, and Monte Carlo advantages.

docs/theory.md §Token credit. Shapes: R rollouts of one group, T completion tokens, P parameters, K Monte Carlo
continuations per prefix.

1. **Signed contribution to the group update.** The group's update direction (on-policy, first pass) is
   u = sum_{i,t} w_{i,t} grad log pi(o_{i,t}) with w_{i,t} = A_i c_i / |o_i| (c_i from the loss aggregation:
   :func:`grpo_lens.formulas.losses.aggregation_rollout_weights`). Token (i, t) contributes the vector
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
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from grpo_lens.formulas.credit import signed_contributions, token_weights
from grpo_lens.rollout import (
    RolloutBatch,
    _stop_token_ids,
    batch_logprobs,
    sampling_generation_config,
)


def token_directional_derivatives(
    model: nn.Module,
    batch: RolloutBatch,
    direction: Sequence[Tensor],
    params: Sequence[nn.Parameter],
    *,
    step: float = 1e-2,
    temperature: float = 1.0,
) -> Tensor:
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
    grads = (
        torch.autograd.grad(objective, params, allow_unused=True) if objective.requires_grad else [None] * len(params)
    )
    u = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]
    u_sq = sum(float(x.double().square().sum()) for x in u)
    d = (
        torch.zeros_like(w)
        if u_sq == 0  # no update: nothing to differentiate along (no forwards)
        else token_directional_derivatives(model, group, u, params, step=step, temperature=temperature)
    )
    return signed_contributions(w, d, u_sq)


@torch.no_grad()
def prefix_values(
    model: nn.Module,
    tokenizer,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    boundaries: Sequence[int],
    score: Callable[[list[str]], list[float]],
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
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
            config = sampling_generation_config(
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                max_new_tokens=max(max_new_tokens - b, 1),
                eos_token_ids=eos,
                pad_token_id=int(tokenizer.pad_token_id),
            )
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed * 7919 + j)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            texts = []
            for row in out.sequences[:, len(prompt_ids) :].cpu().tolist():
                cut = next((k for k, tok in enumerate(row) if tok in eos and k >= b), len(row))
                texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
            r = torch.tensor([float(x) for x in score(texts)], dtype=torch.float64)
            values.append(float(r.mean()))
            errors.append(float(r.std(unbiased=True)) / math.sqrt(num_samples))
    finally:
        model.generation_config = own_config
        model.train(was_training)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(errors, dtype=torch.float64)
