"""--overlong none / mask / filter / soft-punish (docs/theory.md §Overlong handling, DAPO arXiv
2503.14476 §3.4 and eq. 13), and the deprecated --mask-truncated alias."""

from __future__ import annotations

import json
import math

import helpers_rewards  # noqa: F401 - registers the test_* reward functions
import pytest
import torch
import yaml

from grpo_lens.cli import main
from grpo_lens.config import ConfigError, TrainConfig
from grpo_lens.formulas.losses import grpo_loss, loss_normalizer
from grpo_lens.formulas.overlong import (
    overlong_advantages,
    overlong_loss_mask,
    soft_overlong_penalty,
)
from grpo_lens.train.loop import train

# Five rollouts, T_max = 10: three end with EOS after 9 tokens, two are cut at 10 (truncated): 47 tokens, 20 of them
# truncated -- the case of the report.
LENGTHS = [9, 9, 9, 10, 10]
TRUNCATED = torch.tensor([False, False, False, True, True])
A = torch.tensor([1.0, -0.5, -0.5, 0.75, -0.75])
T_MAX = 10


def _grad(mode: str, aggregation: str) -> torch.Tensor:
    mask = torch.tensor([[t < n for t in range(T_MAX)] for n in LENGTHS])
    logp = torch.full((5, T_MAX), -1.0, requires_grad=True)
    adv = overlong_advantages(A, TRUNCATED, mode)
    lm = overlong_loss_mask(mask, TRUNCATED, mode)
    loss, _ = grpo_loss(
        logp, logp.detach(), adv, lm, normalizer=loss_normalizer(lm, aggregation, T_MAX), aggregation=aggregation
    )
    loss.backward()
    return logp.grad


def test_filter_takes_truncated_tokens_out_of_the_token_mean_normaliser():
    # Case 9. On-policy (rho = 1) the token-mean gradient of token (i, t) is -A_i / Z. filter (DAPO): the 27 kept
    # tokens, Z = 27; mask: A = 0 on truncated rollouts but Z = 47 tokens, so mask = 27/47 = 0.574 x filter.
    g_filter, g_mask = _grad("filter", "token-mean"), _grad("mask", "token-mean")
    kept = torch.tensor([[t < n for t in range(T_MAX)] for n in LENGTHS]) & ~TRUNCATED.unsqueeze(1)
    want = torch.where(kept, -A.unsqueeze(1).expand(5, T_MAX) / 27, torch.zeros(5, T_MAX))
    torch.testing.assert_close(g_filter, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_mask, g_filter * 27 / 47, rtol=1e-6, atol=0)
    assert 27 / 47 == pytest.approx(0.574, abs=1e-3)
    assert (g_filter[TRUNCATED] == 0).all()


def test_filter_counts_kept_rollouts_for_per_rollout_normalisers():
    # One more of the kind: seq-mean-token-mean divides by the rollout count N: 3 kept of 5, so mask = 3/5 x filter;
    # token (i, t) gets -A_i / (|o_i| * 3) under filter.
    g_filter, g_mask = _grad("filter", "seq-mean-token-mean"), _grad("mask", "seq-mean-token-mean")
    assert g_filter[0, 0].item() == pytest.approx(-1.0 / (9 * 3), rel=1e-6)
    torch.testing.assert_close(g_mask, g_filter * 3 / 5, rtol=1e-6, atol=0)
    # none keeps the truncated rollouts' own advantages and tokens
    g_none = _grad("none", "seq-mean-token-mean")
    assert g_none[3, 0].item() == pytest.approx(-0.75 / (10 * 5), rel=1e-6)


def test_soft_overlong_penalty_is_dapo_eq_13():
    # L_max = 20, L_cache = 4: 0 up to 16, then (16 - |y|) / 4, -1 beyond 20.
    lengths = torch.tensor([10, 16, 17, 19, 20, 21])
    torch.testing.assert_close(
        soft_overlong_penalty(lengths, 20, 4), torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
    )
    # one more: L_cache = L_max, the penalty falls from 0 at |y| = 0 to -1 at L_max
    torch.testing.assert_close(soft_overlong_penalty(torch.tensor([0, 5, 10]), 10, 10), torch.tensor([0.0, -0.5, -1.0]))
    with pytest.raises(ValueError, match="L_cache"):
        soft_overlong_penalty(lengths, 20, 0)
    with pytest.raises(ValueError, match="valid names"):
        overlong_loss_mask(torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool), "drop")


def _eos_prone(load):
    def wrapped(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        eos = tokenizer.eos_token_id

        def boost(module, inputs, logits):
            out = logits.clone()
            out[..., eos] = logits.logsumexp(dim=-1) - math.log(2.0)  # P(EOS) ~ 1/3 at temperature 1
            return out

        model.lm_head.register_forward_hook(boost)
        return model, tokenizer

    return wrapped


def _config(tmp_path, name, **overrides) -> TrainConfig:
    values = dict(
        model="tiny",
        task="arithmetic",
        rewards=["test_alternating"],
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=3,
        max_steps=1,
        lens_every=0,
        progress=False,
        device="cpu",
        save_final_model=False,
        log_completions=8,
        micro_batch_size=8,
        seed=0,
        temperature=1.0,
    )
    values.update(overrides)
    return TrainConfig(out=str(tmp_path / name), **values)


def _run(tmp_path, name, **overrides):
    run = train(_config(tmp_path, name, **overrides))
    metrics = json.loads(run.metrics_path.read_text().splitlines()[0])
    rows = [json.loads(line) for line in run.completions_path.read_text().splitlines()]
    return metrics, rows


@pytest.mark.e2e
def test_trainer_filter_vs_mask_gradient_norm(tmp_path, monkeypatch):
    import grpo_lens.models as models

    monkeypatch.setattr("grpo_lens.train.loop.load_model", _eos_prone(models.load_model))
    m_mask, rows = _run(tmp_path, "mask", overlong="mask", loss_aggregation="token-mean")
    m_filter, _ = _run(tmp_path, "filter", overlong="filter", loss_aggregation="token-mean")
    n_trunc = sum(r["truncated"] for r in rows)
    assert 0 < n_trunc < 8, "need a mix of cut and finished completions"
    total = m_mask["completions/mean_length"] * 8
    kept = total - 3 * n_trunc  # a truncated completion has exactly max_new_tokens = 3 tokens
    assert m_mask["grad/norm"] == pytest.approx(m_filter["grad/norm"] * kept / total, rel=1e-5)


@pytest.mark.e2e
def test_trainer_soft_punish_adds_the_penalty_to_the_reward(tmp_path, monkeypatch):
    import grpo_lens.models as models

    monkeypatch.setattr("grpo_lens.train.loop.load_model", _eos_prone(models.load_model))
    m_none, rows_none = _run(tmp_path, "none")
    m_soft, rows_soft = _run(tmp_path, "soft", overlong="soft-punish", overlong_buffer=1)
    # L_max = 3, L_cache = 1: lengths 1, 2 -> 0; length 3 (EOS last, or truncated) -> -1.
    diffs = [s["reward"] - n["reward"] for s, n in zip(rows_soft, rows_none)]
    for d, row in zip(diffs, rows_soft):
        assert d in (0.0, -1.0) and (d == -1.0 or not row["truncated"])
    assert any(d == -1.0 for d in diffs) and any(d == 0.0 for d in diffs)
    assert m_soft["reward/overlong_penalty"] == pytest.approx(sum(diffs) / 8)
    assert m_soft["reward/mean"] == pytest.approx(m_none["reward/mean"] + sum(diffs) / 8)
    assert m_soft["reward/accuracy"] == m_none["reward/accuracy"]  # the verdict ignores rewards


@pytest.mark.e2e
def test_mask_truncated_is_an_alias_and_old_runs_resume(tmp_path, monkeypatch):
    import grpo_lens.models as models

    # some completions end within 3 tokens: with every one cut, mask trains nothing and the run stops
    monkeypatch.setattr("grpo_lens.train.loop.load_model", _eos_prone(models.load_model))
    assert TrainConfig(mask_truncated=True).overlong == "mask"
    with pytest.raises(ConfigError, match="deprecated alias"):
        TrainConfig(mask_truncated=True, overlong="filter")
    with pytest.raises(ConfigError, match="valid names: filter, mask, none, soft-punish"):
        TrainConfig(overlong="cut")
    with pytest.raises(ConfigError, match="overlong_buffer"):
        TrainConfig(overlong="soft-punish", max_new_tokens=10, overlong_buffer=11)
    # A run written before --overlong existed: its config.yaml has mask_truncated and none of the new keys.
    out = tmp_path / "old"
    args = [
        "train",
        "--model",
        "tiny",
        "--rewards",
        "test_alternating",
        "--group-size",
        "4",
        "--prompts-per-step",
        "2",
        "--max-new-tokens",
        "3",
        "--max-steps",
        "1",
        "--lens-every",
        "0",
        "--no-progress",
        "--device",
        "cpu",
        "--no-save-final-model",
        "--mask-truncated",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    for key in ("overlong", "overlong_max_length", "overlong_buffer", "tis_cap", "max_consecutive_skips"):
        saved.pop(key)
    (out / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "2"]) == 0
    resumed = yaml.safe_load((out / "config.yaml").read_text())
    assert resumed["overlong"] == "mask" and resumed["mask_truncated"] is True
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.e2e
def test_lens_weighs_rows_with_the_filtered_loss_mask(tmp_path, monkeypatch):
    # Smoke test: with filter the lens weighs rollouts with the update's own loss mask and normaliser and still
    # measures (observed: 2 mixed groups, identity residual 7.9e-9 on the group without a truncated rollout). A
    # common factor in omega would not move the relative residual, so this does not pin the weights themselves.
    import grpo_lens.models as models

    monkeypatch.setattr("grpo_lens.train.loop.load_model", _eos_prone(models.load_model))
    m, rows = _run(tmp_path, "lens", overlong="filter", loss_aggregation="token-mean", lens_every=1)
    assert any(r["truncated"] for r in rows) and "rank/mixed_groups" in m
    assert m["grad/identity_residual"] < 1e-6
