"""Rollouts on the tiny model: group layout, masks, truncation, seeding, and the on-policy ratio.

The essential properties: tokens are drawn from process_logits of the model's logits and nothing else, and the
trainer's log-probs of the sampled tokens (batch_logprobs, one full forward pass, docs/theory.md §Log-probabilities)
equal the sampler's own (token_logprobs of generate's raw logits) within float32 rounding.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpo_lens.rollout import (
    RolloutBatch,
    batch_logprobs,
    completion_mask_from_ids,
    group_logprobs,
    process_logits,
    sample_groups,
    token_entropy,
)
from grpo_lens.tasks import Example

PROMPTS = ["What is 2 + 3?", "Hi! What is 17 - 5, please?", "7 * 6 ="]


@contextmanager
def eos_bias(model, tokenizer, bias: float):
    """Add ``bias`` to the EOS logit inside the model (a forward hook on lm_head), so that generate and
    batch_logprobs both see it. The random tiny model rarely samples EOS (it is one of 259 tokens); +2 makes
    roughly a third to a half of 16-token rollouts end with EOS, so finished and truncated rollouts both occur."""
    eos = tokenizer.eos_token_id

    def hook(module, inputs, output):
        output = output.clone()
        output[..., eos] += bias
        return output

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _sample(model, tokenizer, prompts=PROMPTS, R=4, **kw):
    settings = dict(max_new_tokens=16, temperature=0.7, top_p=1.0, top_k=0, generator_seed=0)
    settings.update(kw)
    return sample_groups(model, tokenizer, prompts, R, **settings)


# ---------------------------------------------------------------------------------------------------------------------
# process_logits against hand-computed values and HF's warpers
# ---------------------------------------------------------------------------------------------------------------------
def test_process_logits_top_p_closed_form():
    # probs 0.1, 0.2, 0.3, 0.4. top_p = 0.5: the smallest set with mass >= 0.5 is {0.4, 0.3} (0.7); the kept
    # tokens renormalise to 3/7 and 4/7.
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    logp = torch.log_softmax(process_logits(logits, top_p=0.5), dim=-1)
    assert torch.isinf(logp[:2]).all()
    torch.testing.assert_close(logp[2:].exp(), torch.tensor([3 / 7, 4 / 7]), rtol=0, atol=1e-6)
    # top_p = 0.75: {0.4, 0.3} holds 0.7 < 0.75, so 0.2 joins: only 0.1 is dropped; 0.2 / 0.9 = 2/9.
    logp = torch.log_softmax(process_logits(logits, top_p=0.75), dim=-1)
    assert torch.isinf(logp[0]) and torch.isfinite(logp[1:]).all()
    assert logp[1].exp().item() == pytest.approx(2 / 9, abs=1e-6)


def test_process_logits_temperature_and_top_k_closed_form():
    # logits [0, ln 2, ln 4] at temperature 0.5 -> [0, 2 ln 2, 4 ln 2] = ln [1, 4, 16]: probs 1/21, 4/21, 16/21.
    logits = torch.log(torch.tensor([1.0, 2.0, 4.0]))
    probs = torch.softmax(process_logits(logits, temperature=0.5), dim=-1)
    torch.testing.assert_close(probs, torch.tensor([1, 4, 16]) / 21.0, rtol=0, atol=1e-6)
    # top_k = 2 then keeps 4 and 16: probs 0, 4/20, 16/20.
    probs = torch.softmax(process_logits(logits, temperature=0.5, top_k=2), dim=-1)
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.2, 0.8]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (0.7, 5, 0.9), (1.3, 0, 0.8), (1.0, 40, 1.0)])
def test_process_logits_equals_hf_warpers(temperature, top_k, top_p):
    # HF's sampler applies temperature -> top-k -> top-p (GenerationMixin._get_logits_processor).
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    expected = warpers(None, logits.clone())
    got = process_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=0, atol=1e-6)


def test_process_logits_rejects_bad_settings():
    with pytest.raises(ValueError, match="temperature"):
        process_logits(torch.zeros(3), temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        process_logits(torch.zeros(3), top_p=0)


# ---------------------------------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------------------------------
def test_completion_mask_from_ids_closed_form():
    E = 9  # EOS
    ids = torch.tensor(
        [
            [5, 7, E, 9, E],  # ends at position 2: mask up to and including it
            [1, 2, 3, 4, 5],  # no EOS: truncated, all tokens count
            [E, E, E, E, E],  # EOS first (later EOS are padding)
            [1, 2, 3, 4, E],
        ]
    )  # EOS on the last allowed token: not truncated
    mask, truncated = completion_mask_from_ids(ids, [E])
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True] * 5,
        [True, False, False, False, False],
        [True] * 5,
    ]
    assert truncated.tolist() == [False, True, False, False]
    # Several stop ids: the first of any of them ends the completion.
    mask, truncated = completion_mask_from_ids(torch.tensor([[1, 8, 2, 9]]), [9, 8])
    assert mask.tolist() == [[True, True, False, False]] and truncated.tolist() == [False]


# ---------------------------------------------------------------------------------------------------------------------
# sample_groups
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (0.7, 5, 0.9), (1.0, 0, 0.6)])
def test_on_policy_ratio_is_one(tiny_model_and_tokenizer, temperature, top_k, top_p):
    model, tok = tiny_model_and_tokenizer
    with eos_bias(model, tok, 2.0):
        batch = _sample(model, tok, R=4, temperature=temperature, top_k=top_k, top_p=top_p, generator_seed=3)
        trainer_logp = batch_logprobs(model, batch, temperature)  # [N, T]
    mask = batch.completion_mask
    # Both finished and truncated rollouts occur, so positions after an EOS are exercised too.
    assert batch.truncated.any() and (~batch.truncated).any()
    assert not mask.all()
    diff = (trainer_logp - batch.sampler_logprobs)[mask].abs().max().item()
    assert diff < 1e-4, diff
    # ratio = exp(trainer - sampler) = 1 within fp32 precision on every counted token.
    torch.testing.assert_close(
        torch.exp(trainer_logp - batch.sampler_logprobs)[mask], torch.ones(int(mask.sum())), rtol=0, atol=1e-4
    )
    # The sampler's log-probs are 0 outside the mask and finite, <= 0 inside it.
    assert (batch.sampler_logprobs[~mask] == 0).all()
    assert torch.isfinite(batch.sampler_logprobs).all() and (batch.sampler_logprobs[mask] <= 0).all()


@pytest.mark.e2e
def test_on_policy_ratio_with_chunked_generation(tiny_model_and_tokenizer):
    # batch_size=4 splits the N = 12 rollouts into 3 generate calls whose lengths differ; padding the shorter
    # chunks must not change the log-probs of counted tokens.
    model, tok = tiny_model_and_tokenizer
    with eos_bias(model, tok, 4.0):
        batch = _sample(model, tok, R=4, top_k=5, top_p=0.9, batch_size=4, generator_seed=11)
        trainer_logp = batch_logprobs(model, batch, 0.7)
    assert batch.num_rollouts == 12
    assert (trainer_logp - batch.sampler_logprobs)[batch.completion_mask].abs().max().item() < 1e-4


@pytest.mark.e2e
def test_group_layout_and_extras(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    examples = [
        Example(prompt=[{"role": "user", "content": p}], answer=str(i), extras={"id": i}) for i, p in enumerate(PROMPTS)
    ]
    B, R = len(examples), 3
    batch = sample_groups(
        model, tok, examples, R, max_new_tokens=5, temperature=0.7, top_p=1.0, top_k=0, generator_seed=0
    )
    N, T = B * R, batch.completion_ids.shape[1]
    assert batch.num_rollouts == N and batch.num_groups == B and batch.group_size == R
    assert batch.prompt_ids.shape == batch.prompt_mask.shape and batch.prompt_ids.shape[0] == N
    assert batch.completion_ids.shape == batch.completion_mask.shape == batch.sampler_logprobs.shape == (N, T)
    assert batch.truncated.shape == (N,) and len(batch.completions) == N
    # Rollouts of one prompt are contiguous: rows g*R .. g*R + R - 1 share prompt g.
    for g in range(B):
        rows = batch.prompt_ids[g * R : (g + 1) * R]
        assert (rows == rows[0]).all()
        text = tok.decode(rows[0][batch.prompt_mask[g * R].bool()])
        assert text == tok.apply_chat_template(examples[g].prompt, tokenize=False, add_generation_prompt=True)
    # Left padding: the shorter prompts start with pad tokens (mask 0), every prompt ends at the last column.
    assert (batch.prompt_mask[:, -1] == 1).all()
    lengths = batch.prompt_mask.sum(dim=1)
    assert lengths.min() < lengths.max()
    assert (batch.prompt_ids[batch.prompt_mask == 0] == tok.pad_token_id).all()
    # Per-prompt columns, length B; prompts as given.
    assert batch.extras == {"answer": ["0", "1", "2"], "id": [0, 1, 2]}
    assert batch.prompts == [e.prompt for e in examples]


@pytest.mark.e2e
def test_prompts_as_strings_dicts_and_messages(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    items = [
        "What is 1 + 1?",
        {"prompt": "What is 2 + 2?", "answer": "4"},
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 3?"}],
    ]
    batch = sample_groups(model, tok, items, 2, max_new_tokens=3, generator_seed=0)
    assert batch.extras == {"answer": [None, "4", None]}
    assert batch.num_rollouts == 6


@pytest.mark.e2e
def test_prompts_without_chat_template(fresh_tiny_model_and_tokenizer):
    # A base model's tokenizer has no chat template: string prompts go in verbatim, chat messages are refused.
    model, tok = fresh_tiny_model_and_tokenizer
    tok.chat_template = None
    batch = sample_groups(model, tok, ["2 + 2 ="], 1, max_new_tokens=2, generator_seed=0)
    assert tok.decode(batch.prompt_ids[0]) == "2 + 2 ="
    with pytest.raises(ValueError, match="no chat template"):
        sample_groups(model, tok, [[{"role": "user", "content": "hi"}]], 1, max_new_tokens=2)


@pytest.mark.e2e
def test_truncation_flags(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    # EOS made impossible: every rollout runs to max_new_tokens = 6 and is truncated, with all 6 tokens counted.
    with eos_bias(model, tok, -math.inf):
        batch = _sample(model, tok, R=2, max_new_tokens=6)
    assert batch.completion_ids.shape[1] == 6
    assert batch.truncated.all() and batch.completion_mask.all()
    # EOS made certain: every rollout is EOS at once; generate stops after one token; nothing is truncated,
    # the mask holds just the EOS, and the decoded completion (special tokens skipped) is empty.
    with eos_bias(model, tok, 1e4):
        batch = _sample(model, tok, R=2, max_new_tokens=6)
    assert batch.completion_ids.shape[1] == 1
    assert (batch.completion_ids[:, 0] == tok.eos_token_id).all()
    assert not batch.truncated.any() and batch.completion_mask.all()
    assert batch.completions == [""] * 6
    # The log-prob of a certain EOS is log 1 = 0.
    assert batch.sampler_logprobs.abs().max().item() < 1e-6
    # Mixed case: truncated exactly when no EOS appears among the sampled tokens.
    with eos_bias(model, tok, 3.0):
        batch = _sample(model, tok, R=4, max_new_tokens=8)
    has_eos = (batch.completion_ids == tok.eos_token_id).any(dim=1)
    assert torch.equal(batch.truncated, ~has_eos)
    assert batch.truncated.any() and (~batch.truncated).any()
    lengths = batch.completion_mask.sum(dim=1)
    assert (lengths[batch.truncated] == batch.completion_ids.shape[1]).all()


@pytest.mark.e2e
def test_top_k_one_is_greedy(tiny_model_and_tokenizer):
    # top_k = 1 leaves one token, so the completion is the greedy one whatever the seed. Its recorded log-prob is
    # not 0 (the probability after top-k renormalisation) but log softmax(z / T) of the argmax token, the one
    # definition the trainer recomputes: finite, < 0, and equal to the trainer's.
    model, tok = tiny_model_and_tokenizer
    a = _sample(model, tok, R=2, top_k=1, max_new_tokens=6, generator_seed=0)
    b = _sample(model, tok, R=2, top_k=1, max_new_tokens=6, generator_seed=1)
    assert torch.equal(a.completion_ids, b.completion_ids)
    with torch.no_grad():
        trainer = batch_logprobs(model, a, 0.7)
    m = a.completion_mask
    assert (a.sampler_logprobs[m] < 0).all() and (trainer - a.sampler_logprobs)[m].abs().max() < 1e-4
    greedy = model.generate(
        input_ids=a.prompt_ids[:1],
        attention_mask=a.prompt_mask[:1],
        do_sample=False,
        max_new_tokens=6,
        pad_token_id=tok.pad_token_id,
    )
    assert torch.equal(greedy[0, a.prompt_ids.shape[1] :], a.completion_ids[0])


@pytest.mark.e2e
def test_seeded_sampling_is_deterministic_and_leaves_global_rng(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    state = torch.get_rng_state()
    a = _sample(model, tok, generator_seed=5)
    b = _sample(model, tok, generator_seed=5)
    c = _sample(model, tok, generator_seed=6)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    assert a.completions == b.completions
    assert (
        not torch.equal(a.completion_ids, c.completion_ids[:, : a.completion_ids.shape[1]])
        or a.completion_ids.shape != c.completion_ids.shape
    )
    # A torch.Generator works too: equal generator states give equal samples.
    d = _sample(model, tok, generator_seed=torch.Generator().manual_seed(42))
    e = _sample(model, tok, generator_seed=torch.Generator().manual_seed(42))
    assert torch.equal(d.completion_ids, e.completion_ids)


@pytest.mark.e2e
def test_sample_groups_restores_padding_side_and_mode(fresh_tiny_model_and_tokenizer):
    model, tok = fresh_tiny_model_and_tokenizer
    tok.padding_side = "right"
    model.train()
    batch = _sample(model, tok, R=1, max_new_tokens=2)
    assert tok.padding_side == "right" and model.training
    assert (batch.prompt_mask[:, -1] == 1).all()  # still left padded


@pytest.mark.e2e
def test_sample_groups_rejects_bad_arguments(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    with pytest.raises(ValueError, match="group_size"):
        _sample(model, tok, R=0)
    with pytest.raises(ValueError, match="empty"):
        _sample(model, tok, prompts=[])
    with pytest.raises(ValueError, match="top_p"):
        _sample(model, tok, top_p=1.5)


@pytest.mark.e2e
def test_select_keeps_rows(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    batch = _sample(model, tok, R=2, max_new_tokens=4)
    sub = batch.select([1, 4])
    assert isinstance(sub, RolloutBatch) and sub.num_rollouts == 2
    assert torch.equal(sub.completion_ids[1], batch.completion_ids[4])
    assert sub.completions == [batch.completions[1], batch.completions[4]]


@pytest.mark.e2e
@pytest.mark.slow
def test_on_policy_ratio_default_model():
    # The default SmolLM2 model has pad == eos (<|im_end|>), unlike the tiny one.
    from grpo_lens.models import load_model
    from grpo_lens.tasks import get_task

    model, tok = load_model("smollm2-135m-instruct")
    assert tok.pad_token_id == tok.eos_token_id
    examples = get_task("arithmetic").sample(2, 0)
    for top_k, top_p in [(0, 1.0), (5, 0.9)]:
        batch = sample_groups(
            model, tok, examples, 4, max_new_tokens=24, temperature=0.7, top_p=top_p, top_k=top_k, generator_seed=0
        )
        logp = batch_logprobs(model, batch, 0.7)
        assert (~batch.truncated).any()
        assert (logp - batch.sampler_logprobs)[batch.completion_mask].abs().max().item() < 1e-4


# ---------------------------------------------------------------------------------------------------------------------
# Policy entropy
# ---------------------------------------------------------------------------------------------------------------------
def test_token_entropy_closed_form():
    # softmax([0, log 3]) = (1/4, 3/4): H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351446...
    h = 0.25 * math.log(4) + 0.75 * math.log(4 / 3)
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    got = token_entropy(logits)
    assert got[0].item() == pytest.approx(h, abs=1e-6)
    assert got[1].item() == pytest.approx(math.log(2), abs=1e-6)  # uniform over 2: ln 2
    # a filtered (-inf) entry has p = 0 and adds nothing (not NaN): same H as without it
    filtered = torch.tensor([[0.0, math.log(3.0), -math.inf]])
    assert token_entropy(filtered)[0].item() == pytest.approx(h, abs=1e-6)


@pytest.mark.e2e
def test_entropy_comes_from_the_same_forward(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    batch = _sample(model, tok, R=2, temperature=0.7, generator_seed=1)
    plain = batch_logprobs(model, batch, 0.7)
    logp, ent = batch_logprobs(model, batch, 0.7, return_entropy=True)
    assert torch.equal(plain, logp)  # the log-probs are unchanged by asking for the entropy
    # the entropy of the temperature-scaled policy (docs/theory.md §Log-probabilities) recomputed from the model's
    # logits, position by position
    ids, am = batch.input_ids(), batch.attention_mask()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
    T = batch.completion_ids.shape[1]
    want = token_entropy(logits[:, -T - 1 : -1].float() / 0.7)
    torch.testing.assert_close(ent, want, rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad
    assert (ent >= 0).all() and (ent <= math.log(model.config.vocab_size) + 1e-5).all()
    # a lower temperature sharpens the same logits: entropy at T = 0.35 is below the one at T = 0.7 at every position
    _, ent_low = batch_logprobs(model, batch, 0.35, return_entropy=True)
    assert (ent_low < ent).all()


# ---------------------------------------------------------------------------------------------------------------------
# group_logprobs: a group's shared prompt run once, against batch_logprobs' one row at a time
# ---------------------------------------------------------------------------------------------------------------------
@contextmanager
def family_rollouts(family: str):
    """(a float64 tiny model of ``family`` with EOS made likelier, its rollouts of the 3 PROMPTS x R = 4, at most 8
    tokens), inside the EOS bias (log-probs computed in the block see the logits the rollouts were drawn from)."""
    from architectures import family_model

    from grpo_lens.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    ids = dict(pad=tok.pad_token_id, bos=tok.bos_token_id, eos=tok.eos_token_id)
    model = family_model(family, len(tok), dtype=torch.float64, **ids)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    with eos_bias(model, tok, 3.0):
        yield model, _sample(model, tok, R=4, max_new_tokens=8)


def assert_same_gradient(model, family: str, batch, first, second) -> None:
    """The gradients of one weighted sum of ``first``'s and of ``second``'s log-probs of ``batch`` agree: to 1e-12 of
    the largest entry where the family's norms compute in the model's dtype (GPT-2, Nemotron), to 1e-6 where
    transformers' RMSNorm computes in float32 whatever the model's dtype and the shared prompt backpropagates the rows'
    sum through it where the per-row forward backpropagates each row (measured 3e-8 on Llama, 8e-16 on GPT-2 and
    Nemotron; a position off by one moves it by 1e-2 to 0.5 of that entry, a detached cache by 0.3 to 0.9)."""
    mask = batch.completion_mask
    w = torch.linspace(-1.0, 2.0, mask.numel(), dtype=torch.float64).view_as(mask) * mask
    params = [p for p in model.parameters() if p.requires_grad]
    g_first = torch.autograd.grad((first(model, batch, 0.7) * w).sum(), params)
    g_second = torch.autograd.grad((second(model, batch, 0.7) * w).sum(), params)
    scale = max(g.abs().max().item() for g in g_second)
    assert scale > 1e-3
    tol = 1e-12 if family in ("gpt2", "nemotron") else 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(g_first, g_second)) < tol * scale


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "mistral", "phi3", "gemma", "nemotron"])
def test_group_logprobs_equal_batch_logprobs_and_run_the_prompt_once(family):
    with family_rollouts(family) as (model, batch):
        assert (~batch.truncated).any()  # some rows end early: padding inside the completion
        positions = []
        hook = model.get_input_embeddings().register_forward_hook(lambda m, a, o: positions.append(a[0].numel()))
        try:
            for j in range(len(PROMPTS)):  # prompts of different lengths: the shorter ones are left padded
                group = batch.select(torch.arange(4 * j, 4 * j + 4))
                mask = group.completion_mask
                positions.clear()
                shared = group_logprobs(model, group, 0.7)
                # one prompt of Lq real tokens, then the 4 rows' first T - 1 completion tokens
                Lq, T = int(group.prompt_mask[0].sum()), mask.shape[1]
                assert positions == [Lq, 4 * (T - 1)], (positions, Lq, T)
                full = batch_logprobs(model, group, 0.7)
                assert (shared - full)[mask].abs().max().item() < 1e-10
                # the gradient of a weighted sum: autograd sums the rows' contributions through the shared prompt
                assert_same_gradient(model, family, group, group_logprobs, batch_logprobs)
            # rows of different prompts: the per-row forward (one call over every position)
            mixed = batch.select([0, 4])
            positions.clear()
            assert torch.equal(group_logprobs(model, mixed, 0.7), batch_logprobs(model, mixed, 0.7))
            assert positions[0] == mixed.input_ids().numel()
        finally:
            hook.remove()


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "mistral", "phi3", "gemma", "nemotron"])
def test_group_logprobs_of_several_groups_run_each_prompt_once(family):
    """The training update's case: a micro-batch of whole groups whose prompts differ in length (left padded)."""
    with family_rollouts(family) as (model, batch):  # 3 prompts of different lengths x 4 rollouts
        mask = batch.completion_mask
        assert (~batch.truncated).any() and len(set(batch.prompt_mask.sum(1).tolist())) == 3
        positions = []
        hook = model.get_input_embeddings().register_forward_hook(lambda m, a, o: positions.append(a[0].numel()))
        try:
            shared, ent = group_logprobs(model, batch, 0.7, return_entropy=True)
        finally:
            hook.remove()
        # the 3 distinct prompts once (left padded to the longest), then the 12 rows' first T - 1 completion tokens
        Lp, T = batch.prompt_ids.shape[1], mask.shape[1]
        assert positions == [3 * Lp, 12 * (T - 1)], (positions, Lp, T)
        full, ent_full = batch_logprobs(model, batch, 0.7, return_entropy=True)
        assert (shared - full)[mask].abs().max().item() < 1e-10
        assert (ent - ent_full)[mask].abs().max().item() < 1e-10
        assert_same_gradient(model, family, batch, group_logprobs, batch_logprobs)
        # rows in another order: a run of one row shares nothing, the others still do; the values follow the rows
        order = torch.tensor([0, 4, 5, 1, 2, 3, 8, 9, 10, 11, 6, 7])
        mixed = batch.select(order)
        assert (group_logprobs(model, mixed, 0.7) - full[order])[mask[order]].abs().max().item() < 1e-10
