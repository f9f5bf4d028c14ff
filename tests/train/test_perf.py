"""Speed work must not change any number: logits only where scored, the automatic micro-batch."""

from __future__ import annotations

import math

import pytest
import torch
from references import dtype_recording_loader

from grpo_lens.models import build_tiny_model
from grpo_lens.rollout import accepts_logits_to_keep, completion_logprobs, scored_logits
from grpo_lens.runtime.memory import activation_bytes_per_rollout, auto_micro_batch_size

pytestmark = pytest.mark.e2e  # every test here builds a model or runs a command


class NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward has no ``logits_to_keep`` argument (the fallback path)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def _inputs(seed=0, n=3, lp=5, t=4, vocab=259):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 3, (n, lp + t), generator=g)
    mask = torch.ones(n, lp + t, dtype=torch.long)
    mask[0, :2] = 0  # left padding on one row
    return ids, mask, t


def test_logits_only_at_scored_positions_equal_the_full_forward():
    model, _ = build_tiny_model()
    ids, mask, t = _inputs()
    assert accepts_logits_to_keep(model) and not accepts_logits_to_keep(NoLogitsToKeep(model))
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    try:
        kept = scored_logits(model, ids, mask, t)
        full = scored_logits(NoLogitsToKeep(model), ids, mask, t)
    finally:
        handle.remove()
    # The LM head ran on T + 1 = 5 positions with logits_to_keep and on all L = 9 without.
    assert seen == [t + 1, ids.shape[1]]
    assert kept.shape == full.shape == (3, t, model.config.vocab_size)
    # Same positions, same hidden states: the logits agree to float32 rounding of the LM-head matmul.
    torch.testing.assert_close(kept, full, rtol=1e-5, atol=1e-5)
    lp_kept = completion_logprobs(model, ids, mask, t, temperature=0.7)
    lp_full = completion_logprobs(NoLogitsToKeep(model), ids, mask, t, temperature=0.7)
    torch.testing.assert_close(lp_kept, lp_full, rtol=1e-5, atol=1e-5)
    # A wrong slice (one position off) would differ by far more than rounding.
    shifted = full.roll(1, dims=1)
    assert (shifted - kept).abs().max() > 1e-2


def test_auto_micro_batch_size_fills_the_budget():
    model, _ = build_tiny_model()
    per = activation_bytes_per_rollout(model, seq_len=40, scored_len=16)
    # tiny model: 2 layers, H 64, I 128, 4 heads, V 259, float32:
    # per layer 40 * (10*64 + 4*128 + 4*40) * 4 = 40 * 1312 * 4 = 209,920; x2 layers = 419,840;
    # logits 3 * 16 * 259 * 4 = 49,728 -> 469,568 bytes.
    assert per == 469_568
    params = sum(p.numel() * 4 for p in model.parameters())
    for k in (1, 3, 7):
        # budget = share * (total - 4 * params) = k * per + per / 2 -> floor(budget / per) = k
        total = int((k * per + per // 2) / 0.25) + 4 * params
        assert auto_micro_batch_size(model, 32, 40, 16, total) == k
    assert auto_micro_batch_size(model, 32, 40, 16, 10**15) == 32  # everything fits: the whole mini-batch
    assert auto_micro_batch_size(model, 32, 40, 16, 1) == 1  # nothing fits: still one rollout at a time
    assert auto_micro_batch_size(model, 32, 40, 16, None) == 8  # unknown memory: the former default
    assert auto_micro_batch_size(model, 5, 40, 16, None) == 5


def test_shared_prompt_prefill_samples_the_distribution_the_trainer_recomputes():
    from grpo_lens.rollout import batch_logprobs, sample_groups

    model, tok = build_tiny_model()
    examples = ["What is 2 + 3?", "Hi", "What is 12 + 30? Reply with just the number."]  # unequal lengths: padding
    shapes = []
    handle = model.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        shared = sample_groups(model, tok, examples, 4, max_new_tokens=10, temperature=0.9, generator_seed=3)
        first_shared = shapes[:2]
        shapes.clear()
        plain = sample_groups(
            model, tok, examples, 4, max_new_tokens=10, temperature=0.9, generator_seed=3, share_prompt_prefill=False
        )
        first_plain = shapes[:1]
    finally:
        handle.remove()
    lp = shared.prompt_ids.shape[1]
    # Shared: one prefill of the 3 distinct prompts over Lp - 1 tokens, then generate feeds only the last prompt
    # token of all 12 rows. Plain: generate prefills 12 rows x Lp tokens.
    assert first_shared == [(3, lp - 1), (12, 1)] and first_plain == [(12, lp)]
    # Same seed, same distribution: the same tokens, and the sampler's log-probs agree to float32 rounding.
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    torch.testing.assert_close(shared.sampler_logprobs, plain.sampler_logprobs, rtol=0, atol=1e-5)
    # The trainer's own forward recomputes the sampler's log-probs (the on-policy ratio is 1 up to rounding).
    trainer = batch_logprobs(model, shared, 0.9).detach()
    m = shared.completion_mask
    assert m.sum() > 20
    assert ((trainer - shared.sampler_logprobs) * m).abs().max() < 1e-5


def test_bf16_mixed_runs_forwards_in_bf16_and_keeps_float32_weights(tmp_path):
    """--dtype bf16-mixed (the GPU setting) on the CPU: autocast reaches every forward of the step (sampler, update,
    lens), weights and AdamW state stay float32, and the first pass's ratio is exactly 1."""
    import json

    from grpo_lens import models
    from grpo_lens.config import TrainConfig
    from grpo_lens.rollout import forward_precision
    from grpo_lens.train.loop import train

    seen: dict[str, set] = {"generate": set(), "train": set()}
    original = models.load_model

    load_and_hook = dtype_recording_loader(original, seen, "train")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("grpo_lens.train.loop.load_model", load_and_hook)  # where the trainer looks it up
        run = train(
            TrainConfig(
                model="tiny",
                rewards=["test_parity"],
                group_size=4,
                prompts_per_step=2,
                max_new_tokens=6,
                max_steps=1,
                lens_every=1,
                seed=0,
                device="cpu",
                dtype="bf16-mixed",
                out=str(tmp_path / "run"),
                progress=False,
                save_final_model=False,
            )
        )
    assert seen == {"generate": {torch.bfloat16}, "train": {torch.bfloat16}}
    record = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()][0]
    assert record["ratio/max"] == 1.0  # pi_old is this forward's own detached log-prob
    assert math.isfinite(record["loss/policy"]) and math.isfinite(record["grad/norm"])
    with forward_precision(torch.device("cpu"), "float32"):
        assert not torch.is_autocast_enabled("cpu")
    with forward_precision(torch.device("cpu"), "bf16-mixed"):
        assert torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_lens_from_the_update_equals_the_lens_own_pass(tmp_path, aggregation, monkeypatch):
    """The lens's g_i read off the update's first pass (no extra forward/backward) give the same lens numbers as
    its own pass, and the training trajectory does not change (the capture only reads gradients)."""
    import json

    from grpo_lens.config import TrainConfig
    from grpo_lens.train.loop import train

    def run(name, from_update):
        out = train(
            TrainConfig(
                model="tiny",
                rewards=["test_parity"],
                group_size=4,
                prompts_per_step=2,
                max_new_tokens=8,
                max_steps=2,
                learning_rate=1e-2,
                mu=2,
                micro_batch_size=3,
                lens_every=1,
                seed=0,
                device="cpu",
                out=str(tmp_path / name),
                progress=False,
                save_final_model=False,
                loss_aggregation=aggregation,
                lens_from_update=from_update,
                gram_source="sketch",
            )
        )  # reads the update
        return [json.loads(line) for line in (out.path / "metrics.jsonl").read_text().splitlines()]

    from grpo_lens.gradients.sketch import sketch_rollout_grads

    calls = []
    original = sketch_rollout_grads
    monkeypatch.setattr(
        "grpo_lens.lens.trainer_lens.sketch_rollout_grads", lambda *a, **kw: calls.append(1) or original(*a, **kw)
    )
    own = run("own", False)
    own_calls = len(calls)
    reused = run("reused", True)
    assert own_calls == 2 and len(calls) == own_calls  # the lens's own pass on both steps, then never
    compared = 0
    for a, b in zip(own, reused):
        assert a["rank/mixed_groups"] == b["rank/mixed_groups"] >= 1
        for key in a:
            if key.startswith("perf/") or not isinstance(a[key], (int, float)) or key not in b:
                continue
            if key.startswith(("rank/", "grad/identity", "baseline/", "zero_sum/", "group/")):
                # same sketch up to float32 rounding of two backward paths (1e-6 relative per row)
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
                compared += 1
            else:  # training itself is untouched: bit-identical
                assert b[key] == a[key] or (math.isnan(a[key]) and math.isnan(b[key])), key
    assert compared >= 10


@pytest.mark.parametrize("family", ["llama", "nemotron"])
@pytest.mark.parametrize("mu", [1, 2])
def test_the_update_with_shared_prompts_gives_the_per_rollout_gradient(family, mu):
    """shared_prompt_forward runs each group's prompt once in the update's forwards (and pi_old's, with mu > 1): the
    accumulated gradient equals the per-rollout forward's (lens steps, or the option off) up to float rounding."""
    from architectures import family_model

    from grpo_lens.config import TrainConfig
    from grpo_lens.models import build_tiny_tokenizer
    from grpo_lens.rollout import sample_groups
    from grpo_lens.runtime.processes import Processes
    from grpo_lens.train.update import UpdateSums, backward_mini_batch, plan_update

    tok = build_tiny_tokenizer()
    model = family_model(family, len(tok), dtype=torch.float64, pad=tok.pad_token_id, eos=tok.eos_token_id)
    prompts = ["What is 2 + 3?", "Hi! What is 17 - 5, please?"]  # unequal lengths: left padding
    batch = sample_groups(model, tok, prompts, 3, max_new_tokens=6, temperature=0.7, generator_seed=0)
    advantages = torch.tensor([0.9, -1.3, 0.4, 1.1, -0.6, -0.5], dtype=torch.float64)
    cfg = TrainConfig(model="tiny", group_size=3, prompts_per_step=2, max_new_tokens=6, temperature=0.7, mu=mu)
    procs = Processes(0, 1, torch.device("cpu"))
    positions: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, a, o: positions.append(a[0].numel()))

    def gradient(per_rollout: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        positions.clear()
        plan = plan_update(model, batch, cfg, procs, per_rollout)
        backward_mini_batch(
            model, batch, advantages, None, plan, 0, mu - 1, cfg, procs, UpdateSums(), None, per_rollout
        )
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    try:
        shared, shared_positions = gradient(False), list(positions)
        own, own_positions = gradient(True), list(positions)
    finally:
        hook.remove()
    Lp, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    # per forward: the 2 prompts once (left padded to Lp) and the 6 rows' first T - 1 tokens, against 6 rows of Lp + T;
    # with mu = 2, pi_old's forward (no gradient) first
    assert shared_positions == [2 * Lp, 6 * (T - 1)] * mu and own_positions == [6 * (Lp + T)] * mu
    scale = max(g.abs().max().item() for g in own)
    tol = 1e-12 if family == "nemotron" else 1e-6  # float32 inside transformers' RMSNorm (tests/test_rollout.py)
    assert max((a - b).abs().max().item() for a, b in zip(shared, own)) < tol * scale


def test_without_shared_prompts_the_lens_leaves_training_bit_identical(tmp_path):
    """--no-shared-prompt-forward: every step runs every rollout's own prompt, so a run with the lens every step and
    one without it train alike to the last bit (docs/theory.md §Shared prompts: the lens only reads gradients)."""
    import json

    from test_trainer import tiny_config

    from grpo_lens.train.loop import train

    def run(name: str, lens_every: int) -> list[dict]:
        # one on-policy pass, automatic micro-batches: the lens reads the update's own backward
        config = tiny_config(
            tmp_path / name, mu=1, micro_batch_size=None, lens_every=lens_every, shared_prompt_forward=False
        )
        out = train(config)
        return [json.loads(line) for line in (out.path / "metrics.jsonl").read_text().splitlines()]

    with_lens, without = run("lens", 1), run("off", 0)
    keys = ("loss/policy", "grad/norm", "reward/mean", "policy/entropy", "completions/mean_length")
    assert any("rank/" in k for k in with_lens[0])  # the lens measured
    assert [[r[k] for k in keys] for r in with_lens] == [[r[k] for k in keys] for r in without]
    assert with_lens[-1]["grad/norm"] > 0  # a step that trained
