"""The sampled distribution is the one the settings name, and log-probs follow one definition everywhere.

Four reported cases (against other GRPO trainers and the previous grpo-lens), each with one more case of the
same kind. docs/theory.md §Log-probabilities and §Sampler-trainer mismatch hold the definitions checked here.
Tiny random Llama (tests/conftest.py), CPU.
"""

from __future__ import annotations

import json
import math

import helpers_rewards  # noqa: F401 - registers the test_* reward functions
import pytest
import torch

from grpo_lens.config import TrainConfig
from grpo_lens.formulas.losses import mismatch_sums, truncated_is_weights
from grpo_lens.rollout import (
    batch_logprobs,
    process_logits,
    sample_groups,
    token_logprobs,
)
from grpo_lens.train import loop
from grpo_lens.train.loop import train

PROMPTS = ["What is 2 + 3?", "7 * 6 ="]


def _spy_generate(model):
    """Record every ``generate`` output (raw logits and processed scores) of ``model``."""
    outputs = []
    original = model.generate

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        outputs.append(out)
        return out

    model.generate = spy
    return outputs


def _assert_scores_are_process_logits(outputs, temperature, top_k, top_p):
    """Every step's processed scores (what generate sampled from) equal process_logits of its raw logits: no other
    logits processor touched the distribution. -inf patterns must match too (a processor that filters tokens)."""
    steps = 0
    for out in outputs:
        for raw, scores in zip(out.logits, out.scores):
            want = process_logits(raw.float(), temperature, top_k, top_p)
            assert torch.equal(torch.isinf(scores), torch.isinf(want))
            finite = torch.isfinite(want)
            torch.testing.assert_close(scores.float()[finite], want[finite], rtol=1e-6, atol=1e-5)
            steps += 1
    assert steps > 0


# Every GenerationConfig field of transformers 5.x that changes the next-token distribution of sampling (logits
# processors and warpers), or the decoding strategy, set to a value that would change it.
def _poison_generation_config(model, tokenizer):
    g = model.generation_config
    g.min_p = 0.5
    g.top_k = 3
    g.top_p = 0.3
    g.temperature = 3.0
    g.typical_p = 0.4
    g.epsilon_cutoff = 0.05
    g.eta_cutoff = 0.05
    g.top_h = 0.5
    g.repetition_penalty = 3.0
    g.encoder_repetition_penalty = 2.0
    g.no_repeat_ngram_size = 1
    g.min_new_tokens = 4
    g.min_length = 200
    g.bad_words_ids = [[tokenizer.convert_tokens_to_ids("a")]]
    g.suppress_tokens = [5, 6, 7]
    g.begin_suppress_tokens = [8, 9]
    g.sequence_bias = {(10,): 5.0}
    g.forced_bos_token_id = 11
    g.forced_eos_token_id = tokenizer.eos_token_id
    g.exponential_decay_length_penalty = (1, 2.0)
    g.renormalize_logits = True
    g.guidance_scale = 3.0
    g.watermarking_config = {"greenlist_ratio": 0.5, "bias": 10.0, "seeding_scheme": "lefthash"}
    g.penalty_alpha = 0.6  # contrastive search
    g.dola_layers = "high"  # DoLa decoding
    g.num_beam_groups = 2
    g.diversity_penalty = 1.0
    g.prompt_lookup_num_tokens = 3  # assisted decoding
    g.stop_strings = ["a"]  # stops (length, not distribution) are grpo-lens' too
    g.max_time = 1e-6
    g.max_length = 3
    g.num_return_sequences = 2
    g.do_sample = False
    g.num_beams = 2
    g.max_new_tokens = 1
    return g


@pytest.mark.e2e
@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (0.7, 0, 1.0),  # case 1: min_p = 0.5 (and every other field) on the model, sample_groups(temperature=0.7)
        (1.0, 5, 0.9),  # one more: the same poisoned config under grpo-lens' own top-k and top-p
    ],
)
def test_model_generation_config_never_leaks_into_sampling(fresh_tiny_model_and_tokenizer, temperature, top_k, top_p):
    model, tok = fresh_tiny_model_and_tokenizer
    poisoned = _poison_generation_config(model, tok)
    outputs = _spy_generate(model)
    batch = sample_groups(
        model, tok, PROMPTS, 4, max_new_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p, generator_seed=0
    )
    assert model.generation_config is poisoned and poisoned.min_p == 0.5  # put back untouched
    # Not one greedy/beam run of 1 token: 8 sampled tokens per rollout (min_p etc. would also end or force them).
    assert batch.completion_ids.shape[1] > 1
    _assert_scores_are_process_logits(outputs, temperature, top_k, top_p)
    # The on-policy ratio between the distribution sampled from and the trainer's recomputation of it is 1: the
    # log-probs of the sampled tokens under the processed scores equal those under process_logits of a full forward.
    ids, am = batch.input_ids(), batch.attention_mask()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
    T = batch.completion_ids.shape[1]
    trainer = torch.log_softmax(process_logits(logits[:, -T - 1 : -1].float(), temperature, top_k, top_p), -1)
    trainer = trainer.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    (out,) = outputs  # one generate call for all N rollouts
    new = out.sequences[:, -len(out.scores) :]  # [N, t] the sampled tokens
    sampler = torch.stack(
        [torch.log_softmax(s.float(), -1).gather(-1, new[:, t : t + 1]).squeeze(-1) for t, s in enumerate(out.scores)],
        1,
    )
    m = batch.completion_mask[:, : sampler.shape[1]]
    ratio = torch.exp(trainer[:, : sampler.shape[1]] - sampler)[m]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-4)


@pytest.mark.e2e
def test_leaking_config_would_change_the_distribution(fresh_tiny_model_and_tokenizer):
    # The control for the test above: generate with the model's poisoned generation_config in charge does apply
    # other processors, so the check of the scores can fail.
    model, tok = fresh_tiny_model_and_tokenizer
    model.generation_config.min_p = 0.5
    ids = torch.tensor([tok("2 + 2 =")["input_ids"]])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=0.7,
        top_k=0,
        max_new_tokens=3,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
    )
    with pytest.raises(AssertionError):
        _assert_scores_are_process_logits([out], 0.7, 0, 1.0)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "top_k,top_p",
    [
        (5, 1.0),  # case 2: top_k = 5, beta > 0
        (0, 0.5),  # one more: top_p = 0.5
    ],
)
def test_reference_logprobs_are_never_filtered_by_the_samplers_settings(tiny_model_and_tokenizer, top_k, top_p):
    from grpo_lens.models import build_tiny_model

    policy, tok = tiny_model_and_tokenizer
    reference, _ = build_tiny_model(seed=1)  # a different model: the policy's top-k set is not the reference's
    batch = sample_groups(
        policy, tok, PROMPTS, 8, max_new_tokens=8, temperature=0.7, top_k=top_k, top_p=top_p, generator_seed=0
    )
    with torch.no_grad():
        ref = batch_logprobs(reference, batch, 0.7)
        pol = batch_logprobs(policy, batch, 0.7)
        ids, am = batch.input_ids(), batch.attention_mask()
        logits = reference(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
    T = batch.completion_ids.shape[1]
    m = batch.completion_mask
    raw = logits[:, -T - 1 : -1].float()
    # The filtered reference the bug used: most sampled tokens lie outside the reference's own top-k / nucleus
    # (-inf there), which nan_to_num turned into 0.0. The test is only meaningful if that happens here.
    filtered = torch.log_softmax(process_logits(raw, 0.7, top_k, top_p), -1)
    filtered = filtered.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert torch.isinf(filtered[m]).float().mean() > 0.3
    # The reference's log-probs: log softmax(z_ref / 0.7)[o_t], finite and < 0 on every sampled token.
    want = torch.log_softmax(raw / 0.7, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ref[m], want[m], rtol=0, atol=1e-5)
    assert torch.isfinite(ref).all() and (ref[m] < 0).all()
    # k1's token mean is log pi - log pi_ref over unfiltered distributions: a KL estimate, positive here (the
    # sampled tokens are likelier under the policy that drew them); the bug's 0.0 made it negative.
    k1 = float((pol - ref)[m].mean())
    assert k1 == pytest.approx(float((pol - want)[m].mean()), abs=1e-5) and k1 > 0


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_sampled_token_has_a_finite_logprob(fresh_tiny_model_and_tokenizer, dtype):
    # Case 3: bfloat16, top_p = 0.5: tokens at the nucleus boundary used to fall outside the trainer's recomputed
    # set and got log-prob 0.0 (ratio 5.6-30.7, zero gradient). One more: float32, top_k = 2 after the policy
    # moved (as with mu > 1): the moved policy's top-2 is not the sampler's.
    model, tok = fresh_tiny_model_and_tokenizer
    model = model.to(dtype)
    top_k, top_p = (0, 0.5) if dtype == torch.bfloat16 else (2, 1.0)
    batch = sample_groups(
        model, tok, PROMPTS, 8, max_new_tokens=8, temperature=0.7, top_k=top_k, top_p=top_p, generator_seed=0
    )
    if dtype == torch.float32:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    m = batch.completion_mask
    logp = batch_logprobs(model, batch, 0.7)
    assert torch.isfinite(logp).all() and (logp[m] < 0).all()  # never -inf, never a silent 0.0
    assert torch.isfinite(batch.sampler_logprobs).all() and (batch.sampler_logprobs[m] < 0).all()
    # Every counted token gets a gradient: d(sum logp)/d logits is non-zero for each token's own row.
    (logp * m).sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    # The processed-distribution log-prob the old code used is -inf for some of these tokens (bf16 nucleus boundary,
    # or outside the moved top-2): the case the definition removes.
    with torch.no_grad():
        ids, am = batch.input_ids(), batch.attention_mask()
        logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
    T = batch.completion_ids.shape[1]
    old_def = torch.log_softmax(process_logits(logits[:, -T - 1 : -1].float(), 0.7, top_k, top_p), -1)
    old_def = old_def.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    if dtype == torch.float32:
        assert torch.isinf(old_def[m]).any()


def tiny_config(tmp_path, name="run", **overrides) -> TrainConfig:
    values = dict(
        model="tiny",
        task="arithmetic",
        rewards=["test_alternating"],
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=6,
        max_steps=1,
        checkpoint_every=10,
        lens_every=0,
        progress=False,
        device="cpu",
        save_final_model=False,
        log_completions=0,
        micro_batch_size=8,
        seed=0,
    )
    values.update(overrides)
    return TrainConfig(out=str(tmp_path / name), **values)


def _metrics(run):
    return [json.loads(line) for line in run.metrics_path.read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "dtype,top_p",
    [
        ("bfloat16", 1.0),  # case 4: --dtype bfloat16 --mu 1 with eps 0.02
        ("float32", 0.5),  # one more: float32 with a nucleus
    ],
)
def test_first_pass_ratio_is_exactly_one_in_any_dtype(tmp_path, monkeypatch, dtype, top_p):
    if dtype == "bfloat16":
        # A sampler that disagrees with the trainer: bf16 generate does on many machines, but on some CPUs its cached
        # path gives the full forward's values to the bit, so the disagreement is planted (0.05 nats on every token)
        # to keep the test able to fail where the ratio read the sampler's log-probs (it would be exp(0.05) > 1.02,
        # outside the clip).
        original = loop.sample_groups

        def disagreeing_sampler(*args, **kwargs):
            batch = original(*args, **kwargs)
            batch.sampler_logprobs = batch.sampler_logprobs - 0.05 * batch.completion_mask.to(batch.sampler_logprobs)
            return batch

        monkeypatch.setattr(loop, "sample_groups", disagreeing_sampler)
    m = _metrics(train(tiny_config(tmp_path, dtype=dtype, top_p=top_p, eps_low=0.02, eps_high=0.02)))[0]
    assert m["ratio/max"] == 1.0 and m["ratio/mean"] == 1.0  # exp(logp - logp.detach()) = exp(0)
    assert m["clip/ratio_region"] == 0.0
    # The sampler's cached path is measured instead: here 0.05 nats off (planted) and whatever bf16 adds; float32
    # forward passes agree with generate's in the last bits.
    if dtype == "bfloat16":
        assert m["mismatch/logprob_abs_diff_max"] > 0.04 and m["mismatch/kl_k3"] > 0
    else:
        assert m["mismatch/logprob_abs_diff_max"] < 1e-4 and m["mismatch/kl_k3"] < 1e-8
    assert 0 <= m["mismatch/logprob_abs_diff_mean"] <= m["mismatch/logprob_abs_diff_max"]


def test_mismatch_sums_closed_form():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    sampler = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -1.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = mismatch_sums(trainer, sampler, mask)
    d = [0.5, 0.0, -1.0, 0.0, 0.5]  # trainer - sampler on the 5 masked tokens
    assert out["tokens"] == 5 and out["abs_diff_max"] == 1.0
    assert out["abs_diff_sum"] == pytest.approx(2.0)
    assert out["k3_sum"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d), rel=1e-6)


def test_truncated_is_weights_closed_form():
    trainer = torch.tensor([[-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.0, -2.0, -1.0 + math.log(4.0)]])
    w = truncated_is_weights(trainer, sampler, cap=2.0)
    # ratios e^0 = 1, e^1 = 2.718 -> capped at 2, 1/4
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.25]]), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(trainer, sampler, cap=0.0)


@pytest.mark.e2e
def test_tis_cap_scales_the_first_step_gradient(tmp_path):
    # float32: pi_old / pi_sampler = 1 up to ~1e-7, so with cap 0.5 every weight is 0.5 and the pre-clip gradient
    # norm halves exactly (weights multiply every token's policy loss); the default (off) leaves it.
    off = _metrics(train(tiny_config(tmp_path, "off")))[0]
    on = _metrics(train(tiny_config(tmp_path, "on", tis_cap=0.5)))[0]
    assert "mismatch/tis_weight_mean" not in off
    assert on["mismatch/tis_weight_mean"] == pytest.approx(0.5, abs=1e-6) and on["mismatch/tis_capped_frac"] == 1.0
    assert on["grad/norm"] == pytest.approx(0.5 * off["grad/norm"], rel=1e-5)
    # cap 4: weights are e^d ~ 1 (uncapped) and the gradient is unchanged to float32 rounding
    big = _metrics(train(tiny_config(tmp_path, "big", tis_cap=4.0)))[0]
    assert big["mismatch/tis_capped_frac"] == 0.0 and big["grad/norm"] == pytest.approx(off["grad/norm"], rel=1e-5)


def test_token_logprobs_is_the_temperature_scaled_distribution():
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf]])
    # softmax(z / 0.5) = (1, 9, 0) / 10: log-probs of tokens 0 and 1
    assert token_logprobs(logits, torch.tensor([0]), 0.5).item() == pytest.approx(math.log(0.1), abs=1e-6)
    assert token_logprobs(logits, torch.tensor([1]), 0.5).item() == pytest.approx(math.log(0.9), abs=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, torch.tensor([0]), 0.0)
