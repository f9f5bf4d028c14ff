"""Rollouts: group sampling with ``model.generate`` and the trainer's log-probs of the sampled tokens.

Shapes: B prompts, R completions per prompt (group size), N = B * R rollouts, Lp prompt tokens (left padded),
T completion tokens (right padded). Rollout n belongs to group n // R (rollouts of one prompt are contiguous).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Literal, overload

import torch
from torch import Tensor
from transformers import Cache, DynamicCache, GenerationConfig


@dataclass
class RolloutBatch:
    """The sampled completions of B prompts, R each, and what the sampler knew about them.

    Attributes:
        prompt_ids: [N, Lp] long, left padded with the pad token.
        prompt_mask: [N, Lp] long/bool, 1 on real prompt tokens.
        completion_ids: [N, T] long, right padded after the first EOS.
        completion_mask: [N, T] bool, True on completion tokens up to and including the first EOS.
        sampler_logprobs: [N, T] float32, the sampler's log-prob of each sampled token under :func:`token_logprobs`
            (temperature-scaled, no top-k / top-p renormalisation), from generate's own logits; finite, and 0 where
            completion_mask is False.
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

    def select(self, index: Tensor | list[int]) -> RolloutBatch:
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


def forward_precision(device: torch.device, dtype: str):
    """The context every model forward of a step runs in: bf16 autocast for ``dtype == "bf16-mixed"`` (float32
    weights, gradients and AdamW state; matrix products in bfloat16), else nothing. Works on CPU and CUDA.

    Log-probs stay float32 under it (``completion_logprobs`` upcasts the logits before the log-softmax), and pi_old
    is the same forward's detached log-prob, so the first pass's ratio is exactly 1 here too.

    Args:
        device: where the model runs.   dtype: the config's ``dtype`` (float32, bfloat16, bf16-mixed).
    """
    if dtype == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def process_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The sampler's logits transform: divide by temperature, then keep the top-k, then the top-p nucleus.

    The same order as transformers' sampling warpers (temperature -> top-k -> top-p): softmax of the result is the
    distribution :func:`sample_groups` draws tokens from. Log-probs for the loss do not use it: they follow the one
    definition of :func:`token_logprobs` (temperature only; docs/theory.md §Log-probabilities). Filtered entries
    become -inf.

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


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """True when ``model.forward`` names a ``logits_to_keep`` argument (transformers' causal LMs do since 4.50)."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def scored_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, completion_len: int) -> Tensor:
    """The model's logits at the T positions that predict the last ``completion_len`` tokens, and nowhere else.

    Position ``L - T - 1 + t`` predicts completion token t, so the LM head runs on the last T + 1 positions only
    (``logits_to_keep=T + 1``, then the last one dropped): on the default model the LM head over the 49,152-token
    vocabulary is about a fifth of the FLOPs, and prompts are most of the positions. A model whose ``forward`` does
    not take ``logits_to_keep`` computes logits everywhere and they are sliced (same values). Position ids are
    ``cumsum(attention_mask) - 1`` as in ``generate`` with left padding.

    Args:
        model: a causal LM returning ``.logits``.
        input_ids: [N, L] long, L = Lp + T.   attention_mask: [N, L] 0/1.   completion_len: T >= 1.

    Returns:
        [N, T, V] logits in the model's dtype.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    if accepts_logits_to_keep(model):
        logits = model(**kwargs, logits_to_keep=completion_len + 1).logits  # [N, T + 1, V]
    else:
        logits = model(**kwargs).logits  # [N, L, V]
    return logits[:, -completion_len - 1 : -1, :]


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """grpo-lens' one log-prob definition: log softmax(z / temperature)[target], the temperature-scaled distribution
    over the whole vocabulary, without top-k / top-p renormalisation (docs/theory.md §Log-probabilities).

    The sampler's recorded log-probs, the policy's and the reference's all use it, so every sampled token's log-prob
    is finite (top-k / top-p only ever remove tokens that were not sampled) and the reference is never filtered by
    the policy's sampler settings.

    Args:
        logits: [..., V] raw logits (any float dtype; computed in float32).
        targets: [...] long token ids.
        temperature: > 0.

    Returns:
        [...] float32 log-probs, finite wherever the logits are.

    Raises:
        ValueError: temperature <= 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_len: int,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probs of the last ``completion_len`` tokens under ``model``, as :func:`token_logprobs` defines.

    Position ids are ``cumsum(attention_mask) - 1`` as in ``generate`` with left padding, so the values match the
    sampler's.

    Args:
        model: a causal LM returning ``.logits`` [N, L, V].
        input_ids: [N, L] long, L = Lp + T, prompts left padded.
        attention_mask: [N, L] 0/1.
        completion_len: T.
        temperature: > 0, the sampling temperature.
        return_entropy: also return the per-token entropy of the same temperature-scaled distribution, from the same
            logits (no extra forward; see :func:`token_entropy`).

    Returns:
        [N, T] float32 log pi(o_t | q, o_<t), finite everywhere; positions past a completion's end are scores of
        padding, mask them. With ``return_entropy``: (log-probs, entropy [N, T] float32 in nats, detached).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = scored_logits(model, input_ids, attention_mask, completion_len)  # [N, T, V]
    return _scored_logprobs(logits, input_ids[:, -completion_len:], temperature, return_entropy)


def _scored_logprobs(
    logits: Tensor, targets: Tensor, temperature: float, return_entropy: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`token_logprobs` of scored logits [N, T, V] at targets [N, T], from one log-softmax that the entropy
    shares: [N, T] float32 (float64 for a float64 model), and the entropy [N, T] on request."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp_all = torch.log_softmax(logits / temperature, dim=-1)  # token_logprobs' definition
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if return_entropy:
        return logp, token_entropy(logp_all.detach(), normalized=True)
    return logp


def token_entropy(logits: Tensor, normalized: bool = False) -> Tensor:
    """Entropy H = -sum_v p_v log p_v of the categorical distribution softmax(logits) at each position.

    Entries with -inf logits have p_v = 0 and contribute 0. This is the policy entropy TRL and verl log for GRPO
    (docs/theory.md §Policy entropy); given the trainer's temperature-scaled logits it is the entropy of the policy
    as docs/theory.md §Log-probabilities defines it (before any top-k / top-p truncation of the sampler).

    Args:
        logits: [..., V] float (or log-probs already normalised, with ``normalized=True``).
        normalized: the input is already log_softmax'ed (skips one pass over V).

    Returns:
        [...] float, nats; computed without gradient.
    """
    with torch.no_grad():
        logp = logits if normalized else torch.log_softmax(logits.float(), dim=-1)
        p = logp.exp()
        entropy = -(p * logp).sum(-1)  # [...]: 0 * log 0 is NaN only where a logit is -inf (or NaN)
        bad = ~torch.isfinite(entropy)
        if bool(bad.any()):  # those positions again, their p = 0 entries (and NaN ones) counted as 0
            entropy[bad] = -torch.where(p[bad] > 0, p[bad] * logp[bad], torch.zeros_like(p[bad])).sum(-1)
        return entropy


@overload
def batch_logprobs(
    model: torch.nn.Module, batch: RolloutBatch, temperature: float = ..., return_entropy: Literal[False] = ...
) -> Tensor: ...
@overload
def batch_logprobs(
    model: torch.nn.Module, batch: RolloutBatch, temperature: float, return_entropy: Literal[True]
) -> tuple[Tensor, Tensor]: ...
@overload
def batch_logprobs(
    model: torch.nn.Module, batch: RolloutBatch, temperature: float = ..., return_entropy: bool = ...
) -> Tensor | tuple[Tensor, Tensor]: ...
def batch_logprobs(
    model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0, return_entropy: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`completion_logprobs` of a :class:`RolloutBatch`: [N, T] float32 (and entropy [N, T] on request)."""
    return completion_logprobs(
        model,
        batch.input_ids(),
        batch.attention_mask(),
        batch.completion_ids.shape[1],
        temperature,
        return_entropy=return_entropy,
    )


def repeated_cache(out, rows: Tensor) -> dict | None:
    """The cache a forward with ``use_cache=True`` returned, its rows picked by ``rows`` in place (row k of the result
    is row ``rows[k]`` of the forward: ``arange(n).repeat_interleave(r)`` repeats each r times), as the keyword a
    model's forward (and ``generate``) takes it by: {``cache`` (transformers 5) or ``past_key_values``: a transformers
    ``Cache`` of len(rows) rows}. The pick is an ``index_select``, so gradients flow back to the rows it copies. None
    when the output holds no cache with ``reorder_cache`` (a custom model, or gradient checkpointing, which turns the
    cache off)."""
    key = "cache" if "cache" in out.keys() else "past_key_values"  # transformers 5 renamed it
    cache = out.get(key)
    if cache is None or not hasattr(cache, "reorder_cache"):
        return None
    cache.reorder_cache(rows)
    return {key: cache}


def prompt_runs(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """(owner [N]: each row's distinct prompt, first [B]: a representative row of each) of prompts that come in runs
    of equal consecutive rows (the groups of :func:`sample_groups`); None when no row equals the one before it.

    Args:
        prompt_ids: [N, Lp].
        prompt_mask: [N, Lp].
    """
    if prompt_ids.shape[0] < 2:
        return None
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)  # [N - 1]
    if not bool(same.any()):
        return None
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=same.device), ~same])  # [N] a new prompt begins
    return starts.long().cumsum(0) - 1, starts.nonzero().squeeze(1)


def group_logprobs(
    model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0, return_entropy: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`batch_logprobs` of rollouts whose prompts come in runs of equal rows (groups), each distinct prompt run
    once, not once per row.

    The B distinct prompts (consecutive equal rows count once; the columns that are padding in all of them dropped)
    go through the model once, left padded, with a cache; each row picks its prompt's cache and its completion
    continues from it, at the positions :func:`scored_logits` gives it (its prompt's length plus cumsum of the
    completion mask - 1). The values are :func:`batch_logprobs`' up to float rounding (the same sums in another
    order), and gradients flow through a shared prompt as through R copies of it (autograd sums the rows'
    contributions). B groups of R rollouts of T tokens after Lp prompt tokens cost B Lp + B R T positions instead of
    B R (Lp + T): the prompt is most of them on GSM8K and on the arithmetic task (docs/theory.md §Shared prompts).

    Falls back to :func:`batch_logprobs` (the same values) when no row shares its prompt with the next, or when the
    model returns no cache with ``reorder_cache`` (a custom model, or gradient checkpointing). The per-row
    activations at prompt positions, which the lens's per-rollout gradients need, exist only in :func:`batch_logprobs`.

    Args:
        model: a causal LM.  batch: N rollouts, [N, Lp] prompts (left padded), [N, T] completions.
        temperature: > 0, the sampling temperature.   return_entropy: also the per-token entropy, as
            :func:`completion_logprobs` gives it.

    Returns:
        [N, T] float32 (float64 for a float64 model) log pi(o_t | q, o_<t); positions past a completion's end are
        scores of padding, mask them. With ``return_entropy``: (log-probs, entropy [N, T], detached).

    Raises:
        ValueError: temperature <= 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    N, T = batch.completion_ids.shape
    prompt_mask = batch.prompt_mask.long()
    runs = prompt_runs(batch.prompt_ids, prompt_mask)
    cols = prompt_mask.any(0).nonzero().squeeze(1)
    if runs is None or cols.numel() == 0:
        return batch_logprobs(model, batch, temperature, return_entropy)
    owner, first = runs
    ids, mask = batch.prompt_ids[first, int(cols[0]) :], prompt_mask[first, int(cols[0]) :]  # [B, Lq]
    keep = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        **keep,
    )
    cache = repeated_cache(out, owner)
    if cache is None:
        return batch_logprobs(model, batch, temperature, return_entropy)
    logits = out.logits[:, -1:, :][owner]  # [N, 1, V]: predicts each completion's first token
    if T > 1:
        inputs = batch.completion_ids[:, : T - 1]  # position t predicts token t + 1
        cmask = batch.completion_mask[:, : T - 1].long()
        position_ids = mask.sum(-1)[owner, None] + (cmask.cumsum(-1) - 1).clamp(min=-1)  # scored_logits' positions
        attention = torch.cat([mask[owner], cmask], dim=1)
        rest = model(input_ids=inputs, attention_mask=attention, position_ids=position_ids, **cache).logits
        logits = torch.cat([logits, rest], dim=1)  # [N, T, V]
    return _scored_logprobs(logits, batch.completion_ids, temperature, return_entropy)


def sampling_generation_config(
    *, temperature: float, top_k: int, top_p: float, max_new_tokens: int, eos_token_ids: list[int], pad_token_id: int
) -> GenerationConfig:
    """The ``transformers.GenerationConfig`` of grpo-lens' sampler, built from its own settings alone.

    Ancestral sampling from :func:`process_logits` (temperature -> top-k -> top-p) and nothing else: no field of the
    model's ``generation_config`` (min_p, repetition penalty, suppressed or forced tokens, a minimum length, ...) and
    no transformers default (top_k = 50) enters; :func:`sample_groups` also hides the model's generation_config for
    the call, so none of its values can fill a field left unset here.

    Args:
        temperature: as in :func:`process_logits`.
        top_k: as in :func:`process_logits`.
        top_p: as in :func:`process_logits`.
        max_new_tokens: completion budget (>= 1).
        eos_token_ids: ids that end a completion.   pad_token_id: the padding id.

    Returns:
        a ``GenerationConfig`` with ``do_sample=True``, ``num_beams=1``, raw logits and processed scores returned.
    """
    return GenerationConfig(
        do_sample=True,
        num_beams=1,
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        max_new_tokens=int(max_new_tokens),
        min_length=0,
        eos_token_id=list(eos_token_ids),
        pad_token_id=int(pad_token_id),
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        use_cache=True,
        renormalize_logits=False,
        remove_invalid_values=False,
    )


def _stop_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """EOS ids that end a completion: the tokenizer's EOS plus the model's generation_config EOS ids."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if config_eos is not None:
        for i in [config_eos] if isinstance(config_eos, int) else list(config_eos):
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id and the model's generation_config names none")
    return ids


def completion_mask_from_ids(completion_ids: Tensor, eos_token_ids: list[int] | Tensor) -> tuple[Tensor, Tensor]:
    """Which completion tokens count, and which completions were cut off.

    Args:
        completion_ids: [N, T] long, sampled tokens.
        eos_token_ids: ids that end a completion.

    Returns:
        (completion_mask [N, T] bool: True up to and including the first EOS, all True when there is none;
        truncated [N] bool: no EOS within the T tokens).
    """
    eos = torch.as_tensor(
        list(eos_token_ids) if not isinstance(eos_token_ids, Tensor) else eos_token_ids, device=completion_ids.device
    )
    is_eos = torch.isin(completion_ids, eos)  # [N, T]
    # eos_before[n, t] = number of EOS strictly before t; a token counts while none came before it.
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()
    completion_mask = eos_before == 0
    truncated = ~is_eos.any(dim=1)
    return completion_mask, truncated


def _as_messages(prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """The token ids the model sees for one prompt.

    * No chat template (a base model) and a string prompt: exactly ``tokenizer(prompt)["input_ids"]``, special tokens
      (e.g. BOS) included as the tokenizer adds them.
    * A chat template: the messages (a string becomes one user message) rendered by it; when the last message is the
      assistant's, its text is continued (prefill: ``continue_final_message=True``), otherwise the assistant turn is
      opened (``add_generation_prompt=True``). The template holds any BOS the model wants, so no special token is
      added on top.

    Raises:
        ValueError: chat messages with a tokenizer that has no chat template, or a template that fails on them.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        if isinstance(prompt, str):
            return list(tokenizer(prompt)["input_ids"])
        raise ValueError(
            "the tokenizer has no chat template, so chat-message prompts cannot be formatted; set "
            "tokenizer.chat_template or pass plain string prompts"
        )
    return list(tokenizer(_render(tokenizer, prompt), add_special_tokens=False)["input_ids"])


class PromptFormatError(ValueError):
    """A prompt cannot be formatted for the model; ``index`` is its 0-based position in the list given."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def _render(tokenizer, prompt) -> str:
    """The text :func:`prompt_token_ids` tokenizes for ``prompt`` under a chat template (without BOS added)."""
    messages = _as_messages(prompt)
    prefill = bool(messages) and messages[-1].get("role") == "assistant"
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not prefill, continue_final_message=prefill
        )
    except Exception as e:  # noqa: BLE001 - a template's own raise_exception, or a message it cannot render
        why = " ".join(str(e).split())[:200]
        raise ValueError(
            f"the tokenizer's chat template fails on this prompt ({type(e).__name__}: {why}); e.g. some templates "
            f"(Gemma, Mistral) refuse a system message: drop it or use another model"
        ) from None


def prompt_lengths(tokenizer, prompts: list, chunk: int = 1024) -> list[int]:
    """``len(prompt_token_ids(tokenizer, p))`` of every prompt, tokenized ``chunk`` at a time (one tokenizer call
    per chunk, so that a dataset's every row can be checked against the context at start: 100,000 rows in seconds).

    Raises:
        PromptFormatError: a chat-message prompt without a chat template, or a chat template that fails on a prompt
            (e.g. Gemma's and Mistral's refuse a system message), with the prompt's index and the template's words.
    """
    template = getattr(tokenizer, "chat_template", None) is not None
    lengths: list[int] = []
    for start in range(0, len(prompts), chunk):
        part = prompts[start : start + chunk]
        if template:
            texts = []
            for i, p in enumerate(part):
                try:
                    texts.append(_render(tokenizer, p))
                except ValueError as e:
                    raise PromptFormatError(start + i, str(e)) from None
            encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        else:
            for i, p in enumerate(part):
                if not isinstance(p, str):
                    raise PromptFormatError(
                        start + i,
                        "the tokenizer has no chat template, so chat-message prompts cannot be formatted; set "
                        "tokenizer.chat_template or pass plain string prompts",
                    )
            encoded = tokenizer(list(part))["input_ids"]
        lengths += [len(ids) for ids in encoded]
    return lengths


def _example_fields(example) -> tuple[object, dict]:
    """(prompt, per-prompt columns) of a task Example, a dict with a ``prompt`` key, or a bare prompt."""
    if isinstance(example, dict):
        if "prompt" not in example:
            raise ValueError(f"an example given as a dict needs a 'prompt' key, got keys {sorted(example)}")
        return example["prompt"], {k: v for k, v in example.items() if k != "prompt"}
    if hasattr(example, "prompt"):
        columns = example.columns() if hasattr(example, "columns") else {}
        return example.prompt, dict(columns)
    return example, {}


def _seed_from(generator_seed: int | torch.Generator | None) -> int | None:
    if generator_seed is None or isinstance(generator_seed, int):
        return generator_seed
    if isinstance(generator_seed, torch.Generator):
        return int(torch.randint(0, 2**62, (1,), generator=generator_seed).item())
    raise TypeError(f"generator_seed must be an int, a torch.Generator or None, got {type(generator_seed).__name__}")


@torch.no_grad()
def shared_prompt_cache(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor) -> Cache | None:
    """The KV cache of all but the last prompt token, computed once per distinct prompt row and copied to its repeats.

    ``sample_groups`` repeats each prompt R times; ``generate`` would run the prompt forward (the prefill) on all
    N = B R rows, R times the same work. Here the B distinct rows (consecutive equal rows count once) run one forward
    over their first Lp - 1 tokens with the positions ``generate`` uses (``cumsum(mask) - 1``, 0 on padding), the
    cache's batch is expanded back to N rows (``Cache.reorder_cache`` with repeated indices), and ``generate`` then
    runs only the last prompt token before sampling. Same model, same positions, same mask: the distribution
    sampled from is unchanged (a test compares it with the plain prefill).

    Args:
        model: a transformers causal LM whose forward returns ``.cache`` (transformers >= 5) or ``.past_key_values``.
        prompt_ids: [n, Lp] long, left padded; equal prompts on consecutive rows.
        prompt_mask: [n, Lp].

    Returns:
        a ``transformers.Cache`` of n rows and Lp - 1 positions, or None when there is nothing to share (no repeated
            row, Lp < 2) or the model gives no cache (then ``generate`` prefills as usual).
    """
    runs = prompt_runs(prompt_ids, prompt_mask)
    if prompt_ids.shape[1] < 2 or runs is None:
        return None
    owner, first = runs
    ids, mask = prompt_ids[first, :-1], prompt_mask[first, :-1]
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate makes them
    try:
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            # nn.Module types a transformers model's attribute as Tensor | Module
            cache=DynamicCache(config=model.config),  # type: ignore[arg-type]
            logits_to_keep=1,
        )
    except (TypeError, ValueError, AttributeError):  # not a transformers >= 5 causal LM: no sharing
        return None
    picked = repeated_cache(out, owner)
    return None if picked is None else next(iter(picked.values()))


def _check_sampling(
    tokenizer, examples: list, group_size: int, max_new_tokens: int, temperature: float, top_p: float, top_k: int
) -> None:
    """:func:`sample_groups`'s input checks, each a ValueError naming what to change."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not examples:
        raise ValueError("examples is empty: need at least one prompt")
    process_logits(torch.zeros(1, 2), temperature, top_k, top_p)  # validates the settings with the same messages
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to the EOS token)")


def _left_padded_groups(
    encoded: list[list[int]], pad_id: int, group_size: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """(prompt ids [N, Lp], attention mask [N, Lp]) of B token-id lists, left padded whatever the tokenizer's
    padding_side (every prompt ends at the last column), each repeated ``group_size`` = R times (N = B R), on
    ``device``."""
    Lp = max(len(ids) for ids in encoded)
    ids_tensor = torch.tensor([[pad_id] * (Lp - len(ids)) + ids for ids in encoded], dtype=torch.long)
    mask_tensor = torch.tensor([[0] * (Lp - len(ids)) + [1] * len(ids) for ids in encoded], dtype=torch.long)
    return (
        ids_tensor.repeat_interleave(group_size, dim=0).to(device),
        mask_tensor.repeat_interleave(group_size, dim=0).to(device),
    )


def _joined_chunks(
    chunks_ids: list[Tensor], chunks_logp: list[Tensor], pad_id: int, eos_ids: list[int]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ``generate`` chunks' tokens and log-probs [n_c, t_c] right padded to the longest T and stacked:
    (completion ids [N, T], completion mask [N, T], truncated [N], sampler log-probs [N, T] float32, 0 outside the
    mask)."""
    T = max(c.shape[1] for c in chunks_ids)
    completion_ids = torch.cat(
        [torch.nn.functional.pad(c, (0, T - c.shape[1]), value=pad_id) for c in chunks_ids], dim=0
    )  # [N, T]
    logp = torch.cat([torch.nn.functional.pad(c, (0, T - c.shape[1]), value=0.0) for c in chunks_logp], dim=0)
    completion_mask, truncated = completion_mask_from_ids(completion_ids, eos_ids)  # [N, T], [N]
    # A chunk that stopped early is padded: its rows all ended with EOS, so the padding lies outside the mask.
    sampler_logprobs = torch.where(completion_mask, logp, torch.zeros_like(logp)).float()  # [N, T]
    return completion_ids, completion_mask, truncated, sampler_logprobs


def _generate_chunks(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    generation_config: GenerationConfig,
    temperature: float,
    step: int,
    seed: int | None,
    share_prompt_prefill: bool,
) -> tuple[list[Tensor], list[Tensor]]:
    """:func:`sample_groups`'s ``generate`` calls, ``step`` rows of ``prompt_ids`` / ``prompt_mask`` [N, Lp] at a
    time, in eval mode under the global RNG seeded with ``seed`` inside ``fork_rng`` (None: unseeded), the model's
    own generation_config hidden: each call's sampled tokens [n, t] and their log-probs [n, t] under
    :func:`token_logprobs` at ``temperature``."""
    N, device = prompt_ids.shape[0], prompt_ids.device
    chunks_ids: list[Tensor] = []
    chunks_logp: list[Tensor] = []
    devices = [device] if device.type == "cuda" else []
    was_training = model.training
    model_generation_config = getattr(model, "generation_config", None)
    model.eval()
    try:
        # Hide the model's own generation_config: generate() fills every field left unset in ours from it.
        # nn.Module types a transformers model's attribute as Tensor | Module
        model.generation_config = GenerationConfig()  # type: ignore[assignment]
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            for start in range(0, N, step):
                ids = prompt_ids[start : start + step]
                mask = prompt_mask[start : start + step]
                cache = shared_prompt_cache(model, ids, mask) if share_prompt_prefill else None
                extra = {"cache": cache} if cache is not None else {}
                # nn.Module types a transformers model's attribute as Tensor | Module
                out = model.generate(  # type: ignore[operator]
                    input_ids=ids, attention_mask=mask, generation_config=generation_config, **extra
                )
                sampled = out.sequences[:, ids.shape[1] :]  # [n, t]
                # logits[t]: the raw logits [n, V] the token at step t was drawn from (before any processing); one
                # step at a time (the same values as of the stacked [n, t, V], without the copy)
                logp = torch.stack(
                    [token_logprobs(z, sampled[:, t], temperature) for t, z in enumerate(out.logits)], dim=1
                )  # [n, t]
                chunks_ids.append(sampled)
                chunks_logp.append(logp)
    finally:
        # nn.Module types a transformers model's attribute as Tensor | Module
        model.generation_config = model_generation_config  # type: ignore[assignment]
        model.train(was_training)
    return chunks_ids, chunks_logp


def sample_groups(
    model: torch.nn.Module,
    tokenizer,
    examples: list,
    group_size: int,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator_seed: int | torch.Generator | None = None,
    batch_size: int | None = None,
    share_prompt_prefill: bool = True,
) -> RolloutBatch:
    """Sample R completions for each of B prompts with ``model.generate`` and record the sampler's log-probs.

    Prompts are tokenized by :func:`prompt_token_ids` (chat template, prefill of a final assistant message, or
    ``tokenizer(prompt)`` for a base model) and left padded to a common length Lp. Each prompt is repeated R times,
    so that rollouts of one prompt are contiguous (rollout n belongs to group n // R). Tokens are drawn from exactly
    :func:`process_logits` (temperature -> top-k -> top-p; 0 disables top-k) and nothing else: the generation config
    is :func:`sampling_generation_config`, built from these settings alone. ``sampler_logprobs`` are the sampler's
    own log-probs of its tokens under :func:`token_logprobs` (from generate's raw logits); the trainer measures how
    far its own forward is from them (``mismatch/*`` metrics) rather than assuming they agree.

    Args:
        model: a causal LM with ``generate``.
        tokenizer (Any): its tokenizer, with a pad token (and a chat template for chat prompts); prompts are left padded
            whatever its ``padding_side``.
        examples: B task examples (objects with ``prompt`` and ``columns()``, e.g. :class:`grpo_lens.tasks.Example`),
            dicts with a ``prompt`` key and extra columns, or bare prompts (a string or a list of chat messages).
        group_size: R >= 1.
        max_new_tokens: completion budget; completions without EOS within it are flagged ``truncated``.
        temperature: a sampling setting, as in :func:`process_logits`.
        top_p: a sampling setting, as in :func:`process_logits`.
        top_k: a sampling setting, as in :func:`process_logits`.
        generator_seed: an int seed or a ``torch.Generator`` to draw one from. ``generate`` takes no generator, so the
            global torch RNG is seeded inside ``torch.random.fork_rng`` (the caller's RNG state is left as it was).
            None samples from the global RNG. Given a seed, sampling is deterministic (on the CPU).
        batch_size: rollouts per ``generate`` call (memory knob); all N at once if None. The samples depend on it.
        share_prompt_prefill: run the prompt's forward once per distinct prompt and copy its KV cache to the R
            rollouts that share it (:func:`shared_prompt_cache`), instead of R identical prefills. The distribution
            sampled from is the same model's; only float rounding of the cached keys/values can differ (tested).

    Returns:
        a :class:`RolloutBatch` with N = B * R rollouts, its tensors on the model's device; ``prompts`` holds the B
        prompts as given, ``extras`` the per-prompt columns (each a list of length B) and ``completions`` the N
        decoded texts (special tokens skipped).
    """
    _check_sampling(tokenizer, examples, group_size, max_new_tokens, temperature, top_p, top_k)
    prompts, columns = zip(*(_example_fields(e) for e in examples))
    keys = sorted({k for c in columns for k in c})
    extras = {k: [c.get(k) for c in columns] for k in keys}
    pad_id = int(tokenizer.pad_token_id)
    encoded = [prompt_token_ids(tokenizer, p) for p in prompts]
    if any(not ids for ids in encoded):
        raise ValueError("a prompt tokenized to no tokens; give every prompt some text")
    R = group_size
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = _left_padded_groups(encoded, pad_id, R, device)  # [N, Lp] each
    N = prompt_ids.shape[0]

    eos_ids = _stop_token_ids(model, tokenizer)
    generation_config = sampling_generation_config(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_ids,
        pad_token_id=pad_id,
    )
    step = N if batch_size is None else int(batch_size)
    if step < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")

    seed = _seed_from(generator_seed)
    chunks_ids, chunks_logp = _generate_chunks(
        model, prompt_ids, prompt_mask, generation_config, temperature, step, seed, share_prompt_prefill
    )

    completion_ids, completion_mask, truncated, sampler_logprobs = _joined_chunks(
        chunks_ids, chunks_logp, pad_id, eos_ids
    )  # [N, T], [N, T], [N], [N, T]
    T = completion_ids.shape[1]
    completions = tokenizer.batch_decode(
        [row[m].tolist() for row, m in zip(completion_ids.cpu(), completion_mask.cpu())], skip_special_tokens=True
    )

    assert completion_ids.shape == (N, T) and sampler_logprobs.shape == (N, T) and truncated.shape == (N,)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        sampler_logprobs=sampler_logprobs,
        truncated=truncated,
        group_size=R,
        prompts=list(prompts),
        completions=completions,
        extras=extras,
    )
