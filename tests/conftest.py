"""Shared fixtures. Everything here is built in code (no download) and takes well under a second."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers


def parity_reward(prompts, completions, **kwargs):
    """1.0 when the UTF-8 byte sum of the completion is odd, else 0.0: a coin flip per rollout on a random model, so
    groups mix right and wrong rollouts. Registered as the reward ``test_parity``. Completions of chat prompts are
    TRL's message lists, so the text is read with ``completion_text``."""
    from grpo_lens.rewards import completion_text

    return [float(sum(completion_text(c).encode()) % 2) for c in completions]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` use the default model: they are end-to-end too (``-m "not e2e"`` leaves them out)."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.e2e)


def pytest_configure(config):
    from grpo_lens.rewards import REWARDS

    if "test_parity" not in REWARDS:
        REWARDS.register("test_parity")(parity_reward)


@pytest.fixture(autouse=True)
def pure_tests_build_no_model(request, monkeypatch):
    """A test without the ``e2e`` marker (which every ``slow`` test gets) is a pure test: it may not build a model.
    Building one raises, so a test that does is marked e2e (and ``pytest -m 'not e2e'`` is the pure suite indeed)."""
    if request.node.get_closest_marker("e2e"):
        return

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} builds a model but is not marked e2e: add @pytest.mark.e2e")

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", refuse)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny models run several times faster on one thread than on two OpenMP threads competing on a busy 2-core
    machine; a whole-suite setting keeps every test file equally fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
