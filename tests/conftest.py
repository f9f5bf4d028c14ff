"""Shared fixtures. Everything here is built in code (no download) and takes well under a second."""

from __future__ import annotations

import copy

import pytest


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer():
    """(model, tokenizer) of :func:`grpo_lens.models.build_tiny_model`: a 2-layer random LlamaForCausalLM
    (hidden 64, vocab 259) with a byte-level ChatML tokenizer, fp32 on the CPU, eval mode.

    Shared by the whole session: do not change its weights or tokenizer in place. A test that trains or edits the
    model takes ``fresh_tiny_model_and_tokenizer`` instead.
    """
    from grpo_lens.models import build_tiny_model

    return build_tiny_model(seed=0)


@pytest.fixture
def fresh_tiny_model_and_tokenizer(tiny_model_and_tokenizer):
    """A private deep copy of ``tiny_model_and_tokenizer`` that a test may train or modify."""
    model, tokenizer = tiny_model_and_tokenizer
    return copy.deepcopy(model), copy.deepcopy(tokenizer)
