"""Prompt tokens are what the tokenizer or chat template says (and chat prefill)."""

from __future__ import annotations

import pytest
from tokenizers.processors import TemplateProcessing

from grpo_lens.rollout import prompt_token_ids, sample_groups

pytestmark = pytest.mark.e2e  # every test here builds a model or runs a command


def _base_tokenizer(tok, template: str):
    """The tiny tokenizer as a base model's: no chat template, and a post-processor that adds special tokens (as
    Llama's adds BOS) with ``template``, e.g. ``"<|im_start|> $A"``."""
    tok.chat_template = None
    specials = [(t, tok.convert_tokens_to_ids(t)) for t in ("<|im_start|>", "<|im_end|>") if t in template]
    tok._tokenizer.post_processor = TemplateProcessing(single=template, special_tokens=specials)
    return tok


@pytest.mark.parametrize(
    "template",
    [
        "<|im_start|> $A",  # case 6: BOS added by the post-processor
        "<|im_start|> $A <|im_end|>",  # one more: BOS and EOS both added, kept exactly as tokenizer(prompt) gives
    ],
)
def test_base_model_prompts_are_tokenized_exactly_as_the_tokenizer_does(fresh_tiny_model_and_tokenizer, template):
    model, tok = fresh_tiny_model_and_tokenizer
    tok = _base_tokenizer(tok, template)
    prompts = ["2 + 2 =", "The capital of France is"]
    want = [tok(p)["input_ids"] for p in prompts]
    assert all(ids[0] == tok.convert_tokens_to_ids("<|im_start|>") for ids in want)  # the tokenizer adds BOS
    batch = sample_groups(model, tok, prompts, 2, max_new_tokens=2, generator_seed=0)
    for g, ids in enumerate(want):
        row, mask = batch.prompt_ids[2 * g], batch.prompt_mask[2 * g].bool()
        assert row[mask].tolist() == ids  # special tokens included, nothing added or dropped
        assert prompt_token_ids(tok, prompts[g]) == ids


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "The answer is"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "7 * 6 ="},
            {"role": "assistant", "content": "Let me think: 7 * 6"},
        ],
    ],
)
def test_chat_prompt_ending_with_the_assistant_is_continued(tiny_model_and_tokenizer, messages):
    model, tok = tiny_model_and_tokenizer
    other = [{"role": "user", "content": "Hi"}]
    batch = sample_groups(model, tok, [messages, other], 2, max_new_tokens=2, generator_seed=0)
    text = tok.decode(batch.prompt_ids[0][batch.prompt_mask[0].bool()])
    # prefill: the assistant's text is the end of the prompt, its turn not closed and no new turn opened
    assert text.endswith(messages[-1]["content"])
    assert text == tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    # a prompt whose last message is the user's still opens the assistant turn
    text_other = tok.decode(batch.prompt_ids[2][batch.prompt_mask[2].bool()])
    assert text_other == tok.apply_chat_template(other, tokenize=False, add_generation_prompt=True)
    assert not text_other.endswith("Hi")
