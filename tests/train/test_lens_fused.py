"""The lens inside the update's backward: the exact Gram captured by hooks in the update's own first pass,
with the rollout weights divided out (:class:`grpo_lens.gradients.gram.MicroBatchGrams`,
:func:`grpo_lens.lens.trainer_lens.score_gram_from_update`), equals the lens's separate pass
(:func:`grpo_lens.gradients.gram.exact_rollout_gram` with the aggregation's omega_i) to 1e-10 in float64 on tiny Llama
(tied), Qwen2 (biases) and Nemotron models built from configs, for every loss aggregation; a perturbed rollout weight
breaks the equality; and a training run with it gives the lens numbers of the separate pass without running it.

Why the two agree: on the first pass the ratio is exactly 1 (pi_old is the forward's own detached log-prob), inside
both clip ranges, so d loss / d log pi(o_it) = -(A_i / Z) v_i m_it and rollout i's loss gradient is
h_i = -(A_i / N) g_i with g_i = grad(omega_i sum_t log pi), omega_i = (N / Z) v_i: Gram(g) = Gram(h) N^2 / (A_i A_j).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, NemotronConfig, Qwen2Config

from grpo_lens.config import TrainConfig
from grpo_lens.formulas.losses import loss_normalizer, rollout_gradient_weights
from grpo_lens.gradients.gram import MicroBatchGrams, exact_rollout_gram
from grpo_lens.lens.step_batch import StepBatch
from grpo_lens.lens.trainer_lens import score_gram_from_update
from grpo_lens.rollout import RolloutBatch
from grpo_lens.runtime.processes import Processes
from grpo_lens.train.update import UpdateSums, backward_mini_batch, lens_fuses_gram, plan_update

pytestmark = pytest.mark.e2e  # builds tiny models

TOL = 1e-10
TEMPERATURE = 0.7
AGGREGATIONS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
ARCHS = ["llama_tied", "qwen2_bias", "nemotron"]
# A_i of the B = 2 groups of R = 3: all nonzero, both signs (rollout 4 is the empty completion)
ADVANTAGES = torch.tensor([0.9, -1.3, 0.4, 1.1, -0.6, -0.5], dtype=torch.float64)


def tiny_model(arch: str) -> torch.nn.Module:
    """Hidden 32, 2 layers, float64, every parameter moved off its init (as tests/gradients/test_gram.py)."""
    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=64,
    )
    cfg = {
        "llama_tied": lambda: LlamaConfig(**common, tie_word_embeddings=True, pad_token_id=0),
        "qwen2_bias": lambda: Qwen2Config(**common, tie_word_embeddings=False),
        "nemotron": lambda: NemotronConfig(**common, head_dim=8, tie_word_embeddings=False),
    }[arch]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def make_batch() -> RolloutBatch:
    """B = 2 prompts (5 and 9 tokens, left padded) x R = 3 completions of 7, 3, 1, 5, 0, 6 tokens (one empty)."""
    g = torch.Generator().manual_seed(0)
    B, R, T, Lp = 2, 3, 7, 9
    prompt_lens, comp_lens = [5, 9], [7, 3, 1, 5, 0, 6]
    prompt_ids = torch.zeros(B * R, Lp, dtype=torch.long)
    prompt_mask = torch.zeros(B * R, Lp, dtype=torch.long)
    for b in range(B):
        prompt_ids[b * R : (b + 1) * R, Lp - prompt_lens[b] :] = torch.randint(1, 12, (prompt_lens[b],), generator=g)
        prompt_mask[b * R : (b + 1) * R, Lp - prompt_lens[b] :] = 1
    completion_ids = torch.zeros(B * R, T, dtype=torch.long)
    for i, c in enumerate(comp_lens):
        completion_ids[i, :c] = torch.randint(0, 15, (c,), generator=g)
    completion_mask = torch.arange(T)[None, :] < torch.tensor(comp_lens)[:, None]
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        sampler_logprobs=torch.zeros(B * R, T),
        truncated=torch.zeros(B * R, dtype=torch.bool),
        group_size=R,
    )


def config(aggregation: str, micro_batch_size: int | None) -> TrainConfig:
    return TrainConfig(
        model="tiny",
        group_size=3,
        prompts_per_step=2,
        max_new_tokens=7,
        temperature=TEMPERATURE,
        loss_aggregation=aggregation,
        micro_batch_size=micro_batch_size,
        device="cpu",
    )


def fused_and_separate(arch: str, aggregation: str, micro_batch_size: int | None, scaled: bool = False):
    """(the fused Gram of the update's first pass, the separate pass's Gram, the raw update Gram, N).

    ``scaled``: the separate pass of the rows the update differentiates, score weights -(A_i / N) omega_i, and the
    fused Gram undivided (see :func:`test_fused_gram_equals_the_separate_pass`)."""
    model, batch = tiny_model(arch), make_batch()
    cfg, procs = config(aggregation, micro_batch_size), Processes(0, 1, torch.device("cpu"))
    plan = plan_update(model, batch, cfg, procs)
    grams = MicroBatchGrams(model, batch.num_rollouts)
    with grams:  # the update's own first pass over its micro-batches, as policy_update runs it
        backward_mini_batch(model, batch, ADVANTAGES, None, plan, 0, 0, cfg, procs, UpdateSums(), grams.micro_batch)
    raw, info = grams.gram()
    assert info["coverage"] == 1.0 and info["micro_batches"] == len(plan.micro_batches[0])
    n = float(batch.completion_mask.any(dim=1).sum())  # 5: the empty completion is not in the loss
    z = loss_normalizer(batch.completion_mask, aggregation, cfg.max_new_tokens)
    omega = rollout_gradient_weights(batch.completion_mask, aggregation, z, n)
    if scaled:
        separate, _ = exact_rollout_gram(model, batch, score_weights=-ADVANTAGES / n * omega, temperature=TEMPERATURE)
        return raw, separate, raw, n
    separate, _ = exact_rollout_gram(model, batch, score_weights=omega, temperature=TEMPERATURE)
    return score_gram_from_update(raw, ADVANTAGES, n), separate, raw, n


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    keep = ~torch.isnan(a)
    return float((a[keep] - b[keep]).abs().max()) / float(b[keep].abs().max())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_fused_gram_equals_the_separate_pass(arch, aggregation):
    """One micro-batch: the whole [N, N] Gram is measured and equals the separate pass's.

    Nemotron's forward is float64 throughout: 1e-10 (measured 3e-16). Llama's and Qwen2's RMSNorm (transformers)
    computes in float32 whatever the model's dtype, so two backwards whose output gradients are scaled differently
    (-(A_i / N) omega_i against omega_i) round differently there: 1e-8 apart (measured 1.3e-8 and 1.1e-8), which is
    the models' float32 rounding, not the division. The update's rows themselves equal the separate pass of the same
    rows (score weights -(A_i / N) omega_i) to 1e-10 on all three, and the division is float64 arithmetic."""
    fused, separate, raw, n = fused_and_separate(arch, aggregation, None)
    assert not torch.isnan(fused).any()
    assert rel_err(fused, separate) < (TOL if arch == "nemotron" else 1e-7)
    assert float(separate.abs().max()) > 1e-6  # a real Gram, not zeros
    same_rows, separate_rows, _, _ = fused_and_separate(arch, aggregation, None, scaled=True)
    assert rel_err(same_rows, separate_rows) < TOL
    # the Gram of the rows A_i g_i (G1's) needs no division: raw N^2 = diag(A) Gram(g) diag(A)
    assert rel_err(raw * n**2, ADVANTAGES[:, None] * separate * ADVANTAGES[None, :]) < 1e-7
    # a perturbed rollout weight (A_1 off by 1e-4 relative) moves row 1 by 1e-4: the test sees it
    off = ADVANTAGES.clone()
    off[1] *= 1 + 1e-4
    assert rel_err(score_gram_from_update(raw, off, n), separate) > 1e-5
    omega_off = -ADVANTAGES / n
    omega_off[1] *= 1 + 1e-6  # and a perturbed score weight in the separate pass breaks the 1e-10 equality
    model, batch = tiny_model(arch), make_batch()
    z = loss_normalizer(batch.completion_mask, aggregation, 7)
    omega = rollout_gradient_weights(batch.completion_mask, aggregation, z, n)
    off_rows, _ = exact_rollout_gram(model, batch, score_weights=omega_off * omega, temperature=TEMPERATURE)
    assert rel_err(same_rows, off_rows) > 1e-7


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_gram_per_micro_batch_keeps_each_group_block(arch):
    # micro-batches of R = 3 rows: each group's [R, R] block is measured, the entries between groups are NaN
    fused, separate, _, _ = fused_and_separate(arch, "token-mean", 3, scaled=True)
    for b in range(2):
        block = slice(3 * b, 3 * b + 3)
        assert not torch.isnan(fused[block, block]).any()
        assert rel_err(fused[block, block], separate[block, block]) < TOL
    assert torch.isnan(fused[:3, 3:]).all() and torch.isnan(fused[3:, :3]).all()


def test_a_zero_advantage_is_not_divided():
    # A_i = 0 leaves nothing of g_i in the update's rows: NaN there, never a division by zero passed off as a number
    raw = torch.eye(3, dtype=torch.float64)
    out = score_gram_from_update(raw, torch.tensor([1.0, 0.0, -2.0]), 4.0)
    assert torch.isnan(out[1]).all() and torch.isnan(out[:, 1]).all()
    # <g_0, g_0> = 1 * 4^2 / (1 * 1) = 16; <g_2, g_2> = 1 * 16 / (-2)^2 = 4
    assert out[0, 0] == 16.0 and out[2, 2] == 4.0


class _Lens:
    """The two attributes :func:`lens_fuses_gram` asks of a lens."""

    update_gram_capture = None

    @staticmethod
    def mixed_groups(rewards, valid, R):
        from grpo_lens.lens.trainer_lens import TrainerLens

        return TrainerLens.mixed_groups(rewards, valid, R)


@pytest.mark.parametrize(
    "change,reason",
    [
        ({}, None),
        ({"beta": 0.1}, "per-token KL"),
        ({"beta": 0.1, "kl_in_reward": True}, None),  # the KL enters the reward, not the loss: still one scalar per row
        ({"estimator": "optimal"}, "optimal"),
        ({"tis_cap": 2.0}, "importance weights"),
        ({"num_mini_batches": 2}, "mini-batches"),
        ({"gram_source": "sketch"}, "not the exact Gram"),
        ({"lens_from_update": False}, "lens_from_update off"),
        ({"micro_batch_size": 2}, "spans two micro-batches"),
        ({"overlong": "filter"}, "--overlong"),  # (mask: the trainer sets the truncated A_i to 0, caught above)
    ],
)
def test_when_the_lens_fuses(change, reason):
    cfg = TrainConfig(
        **{
            **dict(model="tiny", group_size=3, prompts_per_step=2, max_new_tokens=7, device="cpu", micro_batch_size=3),
            **change,
        }
    )
    batch = make_batch()
    batch.truncated[0] = True  # only --overlong mask / filter care
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    got = lens_fuses_gram(
        cfg,
        _Lens(),
        StepBatch(1, tiny_model("llama_tied"), batch, rewards, torch.ones(6, dtype=torch.bool), ADVANTAGES.float()),
        Processes(0, 1, torch.device("cpu")),
    )
    assert got is None if reason is None else reason in got
    if reason is None:  # and a zero advantage in a mixed group keeps the lens's own pass
        a = ADVANTAGES.float().clone()
        a[2] = 0.0
        got = lens_fuses_gram(
            cfg,
            _Lens(),
            StepBatch(1, tiny_model("llama_tied"), batch, rewards, torch.ones(6, dtype=torch.bool), a),
            Processes(0, 1, torch.device("cpu")),
        )
        assert "advantage 0" in got


def test_training_with_the_fused_lens_gives_the_separate_pass_numbers(tmp_path, monkeypatch):
    """Two steps of a tiny model, lens every step: the fused run never calls the lens's own exact pass, its lens
    numbers equal the separate pass's to float32 rounding, and training itself is bit-identical."""
    from grpo_lens.train.loop import train

    def run(name, fused):
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
                micro_batch_size=4,
                lens_every=1,
                seed=0,
                device="cpu",
                out=str(tmp_path / name),
                progress=False,
                save_final_model=False,
                lens_from_update=fused,
                gram_source="exact",
            )
        )
        return [json.loads(line) for line in (out.path / "metrics.jsonl").read_text().splitlines()]

    calls = []
    original = exact_rollout_gram
    monkeypatch.setattr(
        "grpo_lens.lens.trainer_lens.exact_rollout_gram", lambda *a, **kw: calls.append(1) or original(*a, **kw)
    )
    own = run("own", False)
    own_calls = len(calls)
    fused = run("fused", True)
    assert own_calls == 2 and len(calls) == own_calls  # the lens's own pass on both steps, then never
    compared = 0
    for a, b in zip(own, fused):
        assert a["rank/mixed_groups"] == b["rank/mixed_groups"] >= 1
        assert b["grad/gram_coverage"] == a["grad/gram_coverage"]
        for key in a:
            # noise/: the same S by two routes (the full Gram, the update's norm): tests/train/test_diagnostics.py
            if key.startswith(("perf/", "noise/")) or not isinstance(a[key], (int, float)) or key not in b:
                continue
            if key.startswith(("rank/", "grad/identity", "baseline/", "zero_sum/", "group/")):
                # the same Gram up to float32 rounding of two backward paths
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
                compared += 1
            else:  # training itself is untouched: bit-identical
                assert b[key] == a[key] or (math.isnan(a[key]) and math.isnan(b[key])), key
    assert compared >= 10


@pytest.mark.parametrize("arch", ["llama_tied", "qwen2_bias"])
@pytest.mark.parametrize("form", ["rollout", "token"])
def test_wanted_rows_alone_give_their_block_of_the_full_gram(arch, form):
    # The capture skips the rows it is not asked for (their G_i are never formed): the wanted rows' block is the
    # full capture's block to float64 rounding, the rest NaN. A scatter into the wrong rows would be off by O(1).
    model, batch = tiny_model(arch), make_batch()
    cfg, procs = config("seq-mean-token-mean", None), Processes(0, 1, torch.device("cpu"))
    plan = plan_update(model, batch, cfg, procs)
    out = []
    for rows in (None, torch.tensor([False, False, False, True, True, True])):
        grams = MicroBatchGrams(model, batch.num_rollouts, rows=rows, form=form)
        with grams:
            backward_mini_batch(model, batch, ADVANTAGES, None, plan, 0, 0, cfg, procs, UpdateSums(), grams.micro_batch)
        out.append(grams.gram()[0])
        model.zero_grad(set_to_none=True)
    full, part = out
    assert rel_err(part[3:, 3:], full[3:, 3:]) < TOL and float(full[3:, 3:].abs().max()) > 0
    assert torch.isnan(part[:3]).all() and torch.isnan(part[:, :3]).all()


@pytest.mark.parametrize("arch", ["llama_tied", "qwen2_bias"])
@pytest.mark.parametrize("form", ["rollout", "token"])
@pytest.mark.parametrize("wanted", [None, [False, False, False, True, True, True], [True] * 3 + [False] * 3])
def test_group_blocks_give_the_full_grams_diagonal_blocks(arch, form, wanted):
    # group_size = 3 (B = 2 groups): only each group's [3, 3] block is computed, with or without a wanted-rows
    # subset; each block is the full capture's to float64 rounding and every entry between groups is NaN. Blocks cut
    # at the wrong rows (or spans of all N rows used on the wanted rows alone) would be off by O(1) or leave zeros.
    model, batch = tiny_model(arch), make_batch()
    cfg, procs = config("seq-mean-token-mean", 4), Processes(0, 1, torch.device("cpu"))  # micro-batches of 4 rows
    plan = plan_update(model, batch, cfg, procs)
    rows = None if wanted is None else torch.tensor(wanted)
    out = []
    for group_size in (None, 3):
        grams = MicroBatchGrams(model, batch.num_rollouts, rows=rows, group_size=group_size, form=form)
        with grams:
            backward_mini_batch(model, batch, ADVANTAGES, None, plan, 0, 0, cfg, procs, UpdateSums(), grams.micro_batch)
        out.append(grams.gram()[0])
        model.zero_grad(set_to_none=True)
    full, blocked = out
    keep = torch.ones(6, dtype=torch.bool) if rows is None else rows
    group = torch.arange(6) // 3
    same = (group.unsqueeze(1) == group.unsqueeze(0)) & keep.unsqueeze(1) & keep.unsqueeze(0)
    same &= ~torch.isnan(full)  # rows of one group in different micro-batches are not measured by either
    assert int(same.sum()) >= 5 and float(full[same].abs().max()) > 0  # 14, 9 or 5 entries measured
    assert float((blocked[same] - full[same]).abs().max()) / float(full[same].abs().max()) < TOL
    assert torch.isnan(blocked[~same]).all()
