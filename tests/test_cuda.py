"""Tests that need a CUDA device (skipped without one; benchmarks/gpu_check.py runs them on a GPU machine).

Every other test runs on the CPU, so these are the only checks of the device paths: the exact Gram's hooks and
float32 products on the GPU against the float64 CPU oracle, and a bf16-mixed training step with the lens on the GPU.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from grpo_lens.config import TrainConfig
from grpo_lens.gradients.exact import exact_rollout_grads
from grpo_lens.gradients.gram import exact_rollout_gram
from grpo_lens.rollout import RolloutBatch
from grpo_lens.train.loop import train

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 101


def _batch(device: str) -> RolloutBatch:
    """2 prompts x R = 3, prompts of 4 and 6 tokens (left padded), completions of 5, 2, 5, 1, 4, 3 tokens."""
    g = torch.Generator().manual_seed(0)
    n, lp, t = 6, 6, 5
    prompt_mask = torch.ones(n, lp, dtype=torch.long)
    prompt_mask[:3, :2] = 0
    lens = torch.tensor([5, 2, 5, 1, 4, 3])
    batch = RolloutBatch(
        prompt_ids=torch.randint(0, VOCAB, (n, lp), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(0, VOCAB, (n, t), generator=g),
        completion_mask=torch.arange(t)[None, :] < lens[:, None],
        sampler_logprobs=torch.zeros(n, t),
        truncated=torch.zeros(n, dtype=torch.bool),
        group_size=3,
    )
    return RolloutBatch(
        *(
            x.to(device) if isinstance(x, torch.Tensor) else x
            for x in (
                batch.prompt_ids,
                batch.prompt_mask,
                batch.completion_ids,
                batch.completion_mask,
                batch.sampler_logprobs,
                batch.truncated,
                batch.group_size,
            )
        )
    )


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            tie_word_embeddings=True,
        ),  # the tied LM head's cross term
        Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            tie_word_embeddings=False,
        ),  # q/k/v biases
    ],
    ids=["llama_tied", "qwen2_bias"],
)
def test_exact_gram_on_cuda_equals_the_float64_cpu_oracle(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).double().eval()
    oracle = exact_rollout_grads(model, _batch("cpu"), temperature=0.7)
    want = oracle @ oracle.T  # float64 on the CPU: exact to ~1e-15
    gram, info = exact_rollout_gram(model.float().cuda(), _batch("cuda"), temperature=0.7)
    # float32 products on the GPU (TF32 off, torch's default for matmul): ~1e-6 relative; a missing parameter kind or
    # cross term, or a delta taken at the wrong positions, is off by 1e-2 or more
    assert float((gram - want).abs().max() / want.abs().max()) < 1e-4
    assert info["coverage"] == 1.0


def test_bf16_mixed_training_with_the_lens_on_cuda(tmp_path):
    run = train(
        TrainConfig(
            model="tiny",
            rewards=["test_parity"],
            group_size=4,
            prompts_per_step=2,
            max_new_tokens=8,
            max_steps=2,
            lens_every=1,
            seed=0,
            device="cuda",
            dtype="bf16-mixed",
            out=str(tmp_path / "run"),
            progress=False,
            save_final_model=False,
        )
    )
    records = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss/policy" in r]
    assert len(steps) == 2
    for r in steps:
        assert math.isfinite(r["loss/policy"]) and math.isfinite(r["grad/norm"])
        assert r["ratio/max"] == 1.0  # the first pass's pi_old is its own detached forward
    assert any(r.get("grad/gram_coverage") == 1.0 for r in records)  # the lens's exact Gram covered every parameter
