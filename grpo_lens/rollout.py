"""Rollouts: group sampling with ``model.generate`` and the trainer's log-probs of the sampled tokens.

Shapes: B prompts, R completions per prompt (group size), N = B * R rollouts, Lp prompt tokens (left padded),
T completion tokens (right padded). Rollout n belongs to group n // R (rollouts of one prompt are contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    """The sampled completions of B prompts, R each, and what the sampler knew about them.

    Attributes:
        prompt_ids: [N, Lp] long, left padded with the pad token.
        prompt_mask: [N, Lp] long/bool, 1 on real prompt tokens.
        completion_ids: [N, T] long, right padded after the first EOS.
        completion_mask: [N, T] bool, True on completion tokens up to and including the first EOS.
        sampler_logprobs: [N, T] float32, log pi_old(o_t | .) of the sampled tokens under the sampler's processed
            distribution (temperature, top-k, top-p applied); 0 where completion_mask is False.
        truncated: [N] bool, True when the completion hit max_new_tokens without an EOS.
        group_size: R.
        prompts: B prompts as the task gave them (chat messages or strings).
        completions: N decoded completion texts.
        extras: per-prompt task columns (e.g. ``answer``), each a list of length B, passed to reward functions.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    sampler_logprobs: Tensor
    truncated: Tensor
    group_size: int
    prompts: list = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    extras: dict[str, list] = field(default_factory=dict)

    @property
    def num_rollouts(self) -> int:
        """N = B * R."""
        return self.completion_ids.shape[0]

    @property
    def num_groups(self) -> int:
        """B."""
        return self.num_rollouts // self.group_size

    def input_ids(self) -> Tensor:
        """[N, Lp + T] prompt and completion tokens side by side."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    def attention_mask(self) -> Tensor:
        """[N, Lp + T] long: 1 on real prompt tokens and on completion tokens up to the first EOS."""
        return torch.cat([self.prompt_mask.long(), self.completion_mask.long()], dim=1)

    def select(self, index: Tensor | list[int]) -> "RolloutBatch":
        """A sub-batch of whole rollouts (rows), e.g. a micro-batch. ``prompts``/``extras`` stay per group and are
        kept whole, so the result is only for log-prob and loss computation, not for rewards.

        Args:
            index: [n] long indices into the N rollouts.
        """
        index = torch.as_tensor(index, dtype=torch.long)
        return RolloutBatch(
            prompt_ids=self.prompt_ids[index],
            prompt_mask=self.prompt_mask[index],
            completion_ids=self.completion_ids[index],
            completion_mask=self.completion_mask[index],
            sampler_logprobs=self.sampler_logprobs[index],
            truncated=self.truncated[index],
            group_size=self.group_size,
            prompts=self.prompts,
            completions=[self.completions[i] for i in index.tolist()] if self.completions else [],
            extras=self.extras,
        )


def process_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The sampler's logits transform: divide by temperature, then keep the top-k, then the top-p nucleus.

    Applied in the same order as transformers' sampling warpers (temperature -> top-k -> top-p), so that the
    trainer's log-probs of sampled tokens equal the sampler's and the on-policy importance ratio is 1.
    Filtered entries become -inf.

    Args:
        logits: [..., V] float.
        temperature: > 0.
        top_k: keep the k largest logits; 0 disables.
        top_p: keep the smallest set of tokens whose probability sums to at least top_p; 1.0 disables.

    Returns:
        [..., V] float, the processed logits (log_softmax of it gives the sampling log-probs).

    Raises:
        ValueError: temperature <= 0, top_k < 0, or top_p outside (0, 1].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_len: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Tensor:
    """Per-token log-probs of the last ``completion_len`` tokens under ``model``, with the sampler's processing.

    Position ids are ``cumsum(attention_mask) - 1`` as in ``generate`` with left padding, so the values match the
    sampler's.

    Args:
        model: a causal LM returning ``.logits`` [N, L, V].
        input_ids: [N, L] long, L = Lp + T, prompts left padded.
        attention_mask: [N, L] 0/1.
        completion_len: T.
        temperature, top_k, top_p: as in :func:`process_logits`.

    Returns:
        [N, T] float32 log pi(o_t | q, o_<t); positions past a completion's end hold finite garbage, mask them.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, -completion_len - 1 : -1, :].float()
    logits = process_logits(logits, temperature, top_k, top_p)
    targets = input_ids[:, -completion_len:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # Tokens after EOS can fall outside a top-k / top-p set and give -inf: make them finite (they are masked).
    return torch.nan_to_num(logp, neginf=0.0)


def batch_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> Tensor:
    """:func:`completion_logprobs` of a :class:`RolloutBatch`: [N, T] float32."""
    return completion_logprobs(model, batch.input_ids(), batch.attention_mask(), batch.completion_ids.shape[1],
                               temperature, top_k, top_p)
