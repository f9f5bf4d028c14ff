"""Tiny random models of the architecture families grpo-lens supports, built from configs (no download).

Each family is a transformers config of 2 layers, hidden 32, 4 heads (2 KV heads where the family has them), with
what sets the family apart from Llama kept: Qwen2's q/k/v biases, GPT-2's ``Conv1D`` layers (weight [d_in, d_out]),
learned position embedding, LayerNorm with bias and tied head, Mistral's sliding-window config, Phi-3's fused
``qkv_proj`` / ``gate_up_proj``, Gemma's scaled embedding (x sqrt(d)), (1 + w) RMSNorm and tied head, Nemotron's
LayerNorm1P (weight and bias) and squared-ReLU MLP. Shared by tests/gradients/test_architectures.py (the Gram, the
sketch and G2 against the dense oracle) and tests/probe/test_architectures.py (probe and train end to end).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    NemotronConfig,
    Phi3Config,
    Qwen2Config,
)

FAMILIES = ("llama", "qwen2", "gpt2", "mistral", "phi3", "gemma", "nemotron")

#: The module the probe's default --layer picks in each family: the middle (second of two) layer's MLP down projection.
DEFAULT_LAYER = {"gpt2": "transformer.h.1.mlp.c_proj"}


def family_config(
    family: str, vocab: int, pad: int | None = None, bos: int | None = None, eos: int | None = None, hidden: int = 32
):
    """The tiny config of ``family`` (2 layers, ``hidden`` wide, MLP 2 x hidden, 4 heads) with the given vocabulary
    size and special token ids. Raises KeyError for an unknown family (valid: :data:`FAMILIES`)."""
    ids = {"pad_token_id": pad, "bos_token_id": bos, "eos_token_id": eos}
    if family == "gpt2":  # Conv1D everywhere but the (tied) head, no dropout
        return GPT2Config(
            n_embd=hidden,
            n_layer=2,
            n_head=4,
            vocab_size=vocab,
            n_positions=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **ids,
        )
    common = {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        **ids,
    }
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if family == "qwen2":  # q/k/v biases
        return Qwen2Config(**common, tie_word_embeddings=False)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=64, tie_word_embeddings=False)
    if family == "phi3":  # fused qkv_proj and gate_up_proj
        return Phi3Config(**common, original_max_position_embeddings=256, tie_word_embeddings=False)
    if family == "gemma":  # embedding scaled by sqrt(hidden), (1 + w) RMSNorm, tied head
        return GemmaConfig(**common, head_dim=hidden // 4)
    if family == "nemotron":  # LayerNorm1P, relu2 MLP, partial rotary
        return NemotronConfig(**common, head_dim=hidden // 4, partial_rotary_factor=0.5, tie_word_embeddings=False)
    raise KeyError(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")


def family_model(
    family: str, vocab: int, *, dtype: torch.dtype = torch.float32, seed: int = 0, jitter: float = 0.05, **ids
) -> nn.Module:
    """A random model of ``family`` in eval mode, every parameter moved off its init by ``jitter`` N(0, 1) (norm weights
    1 and biases 0 would hide a missing term), weights fixed by ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(family_config(family, vocab, **ids)).to(dtype).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(jitter * torch.randn_like(p))
    return model


def save_family_folder(family: str, folder: Path, seed: int = 0) -> Path:
    """A Hugging Face model folder of ``family`` with the tiny byte-level ChatML tokenizer
    (:func:`grpo_lens.models.build_tiny_tokenizer`, 259 tokens; a 320-row embedding): what ``--model FOLDER``
    loads."""
    from grpo_lens.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    # the embedding padded to a multiple of 64 rows, as released checkpoints pad theirs: loaded beside a Qwen2
    # config.json the byte tokenizer comes back as Qwen2's class with one more token (<|endoftext|>), and a folder
    # whose embedding is smaller than its tokenizer is refused (grpo_lens.models)
    vocab = -(-(len(tok) + 1) // 64) * 64
    model = family_model(
        family, vocab, seed=seed, jitter=0.02, pad=tok.pad_token_id, bos=tok.bos_token_id, eos=tok.eos_token_id
    )
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
