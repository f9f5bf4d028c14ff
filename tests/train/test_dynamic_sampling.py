"""Dynamic sampling (DAPO): which groups are kept and in what order, the cap, the batch bookkeeping, and the trainer
training only on mixed groups."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_lens.config import ConfigError, TrainConfig
from grpo_lens.rollout import RolloutBatch, batch_logprobs, sample_groups
from grpo_lens.rundir import RunDir
from grpo_lens.train.dynamic_sampling import (
    collect_mixed_groups,
    concat_batches,
    select_groups,
)
from grpo_lens.train.loop import train

R = 2


def fake_batch(tag: int, rewards_per_group: list[list[float]], lp: int = 3, t: int = 4) -> RolloutBatch:
    """A batch whose rollout n has completion token 10*tag + n (to tell rows apart) and the given rewards."""
    n = len(rewards_per_group) * R
    return RolloutBatch(
        prompt_ids=torch.full((n, lp), 1),
        prompt_mask=torch.ones(n, lp, dtype=torch.long),
        completion_ids=(10 * tag + torch.arange(n)).unsqueeze(1).repeat(1, t),
        completion_mask=torch.ones(n, t, dtype=torch.bool),
        sampler_logprobs=torch.zeros(n, t),
        truncated=torch.zeros(n, dtype=torch.bool),
        group_size=R,
        prompts=[f"p{tag}.{g}" for g in range(len(rewards_per_group))],
        completions=[f"c{tag}.{i}" for i in range(n)],
        extras={"answer": [f"a{tag}.{g}" for g in range(len(rewards_per_group))]},
    )


ROUNDS = [  # per round: rewards of 4 groups of R = 2 (mixed = not equal)
    [[1, 1], [0, 1], [0, 0], [1, 1]],  # round 0: group 1 mixed
    [[1, 0], [0, 1], [1, 1], [0, 1]],  # round 1: groups 0, 1, 3 mixed
    [[0, 1], [0, 1], [0, 1], [0, 1]],  # round 2: never reached when B = 4
]


def sampler(rounds):
    calls = []

    def sample_round(r):
        calls.append(r)
        rewards = torch.tensor(rounds[r], dtype=torch.float32).view(-1)
        valid = torch.ones_like(rewards, dtype=torch.bool)
        return (
            fake_batch(r, rounds[r]),
            rewards,
            valid,
            {"reward/x_count": 1.0, "reward/mean_x": r},
            100 * r + torch.arange(len(rewards)),
        )

    return sample_round, calls


def test_keeps_the_first_b_mixed_groups_in_sampling_order():
    sample_round, calls = sampler(ROUNDS)
    batch, rewards, valid, info, stats, (tag,) = collect_mixed_groups(sample_round, 4, max_extra_rounds=5, pad_id=0)
    # round 0 gives group 1; round 1 gives groups 0, 1, 3: B = 4 reached after 2 rounds, round 2 is never sampled
    assert calls == [0, 1]
    assert batch.prompts == ["p0.1", "p1.0", "p1.1", "p1.3"]
    assert batch.extras["answer"] == ["a0.1", "a1.0", "a1.1", "a1.3"]
    assert batch.completions == ["c0.2", "c0.3", "c1.0", "c1.1", "c1.2", "c1.3", "c1.6", "c1.7"]
    assert batch.completion_ids[:, 0].tolist() == [2, 3, 10, 11, 12, 13, 16, 17]
    assert rewards.tolist() == [0, 1, 1, 0, 0, 1, 0, 1]
    assert tag.tolist() == [2, 3, 100, 101, 102, 103, 106, 107]  # other per-rollout tensors follow their rows
    # 8 groups sampled, 4 mixed among them: half had no contrast
    assert stats == {
        "dynamic/mixed_groups": 4.0,
        "dynamic/rounds": 2.0,
        "dynamic/sampled_groups": 8.0,
        "dynamic/hit_cap": 0.0,
        "dynamic/zero_var_frac_sampled": 0.5,
    }
    assert info == {"reward/x_count": 2.0, "reward/mean_x": 0.5}  # counts add up, means average


def test_at_the_cap_it_trains_on_what_it_found():
    sample_round, calls = sampler(ROUNDS)
    batch, rewards, _, _, stats, _ = collect_mixed_groups(sample_round, 4, max_extra_rounds=0, pad_id=0)
    assert calls == [0] and batch.prompts == ["p0.1"] and rewards.tolist() == [0, 1]
    assert stats["dynamic/mixed_groups"] == 1.0 and stats["dynamic/hit_cap"] == 1.0
    # no mixed group at all: the round-0 batch is returned whole (its gradient is zero)
    none_mixed, _ = sampler([[[1, 1], [0, 0]]])
    batch, rewards, _, _, stats, _ = collect_mixed_groups(none_mixed, 2, max_extra_rounds=0, pad_id=0)
    assert batch.num_groups == 2 and stats["dynamic/mixed_groups"] == 0.0 and stats["dynamic/hit_cap"] == 1.0


@pytest.mark.e2e
def test_concatenated_batches_give_the_same_logprobs(tiny_model_and_tokenizer):
    # Left-padding prompts and right-padding completions to the longest of both batches must not change any
    # rollout's log-probs (attention masks the padding): equal to float32 rounding.
    from grpo_lens.tasks import get_task

    model, tok = tiny_model_and_tokenizer
    task = get_task("arithmetic")
    a = sample_groups(model, tok, task.sample(1, seed=1), R, max_new_tokens=3, temperature=1.0, generator_seed=1)
    b = sample_groups(model, tok, task.sample(2, seed=7), R, max_new_tokens=6, temperature=1.0, generator_seed=2)
    both = concat_batches([a, select_groups(b, [1])], pad_id=tok.pad_token_id)
    assert both.num_groups == 2 and both.prompts == [a.prompts[0], b.prompts[1]]
    with torch.no_grad():
        la, lb, lab = (batch_logprobs(model, x, 1.0) for x in (a, select_groups(b, [1]), both))
    ta, tb = a.completion_ids.shape[1], b.completion_ids.shape[1]
    torch.testing.assert_close(lab[:R, :ta] * a.completion_mask, la * a.completion_mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        lab[R:, :tb] * both.completion_mask[R:, :tb], lb * both.completion_mask[R:, :tb], rtol=1e-5, atol=1e-5
    )


@pytest.mark.e2e
def test_trainer_trains_only_on_mixed_groups(tmp_path):
    # parity rewards on the random tiny model: a group of R = 2 is constant with probability ~1/2, so a plain step
    # of 3 groups often has a zero-variance group; with dynamic sampling every step that did not hit the cap has
    # S1 = 0 and exactly B groups.
    cfg = TrainConfig(
        model="tiny",
        rewards=["test_parity"],
        group_size=2,
        prompts_per_step=3,
        max_new_tokens=4,
        max_steps=3,
        lens_every=0,
        device="cpu",
        out=str(tmp_path / "run"),
        progress=False,
        save_final_model=False,
        log_completions=0,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=4,
    )
    train(cfg)
    records = RunDir(tmp_path / "run").read_metrics()
    assert len(records) == 3
    for rec in records:
        if rec["dynamic/hit_cap"] == 0:
            assert rec["dynamic/mixed_groups"] == 3 and rec["dynamic/kept_frac_zero_std_groups"] == 0
        # reward/ S1 is over every sampled group, the same share dynamic/zero_var_frac_sampled counts
        assert rec["reward/frac_zero_std_groups"] == pytest.approx(rec["dynamic/zero_var_frac_sampled"], abs=1e-7)
        assert rec["dynamic/rounds"] >= 1 and rec["dynamic/sampled_groups"] == 3 * rec["dynamic/rounds"]
    assert any(r["dynamic/rounds"] > 1 for r in records), "parity groups of 2 should need an extra round sometimes"


def test_bad_cap_is_a_config_error():
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds"):
        TrainConfig(dynamic_sampling_max_rounds=-1)


def test_sampled_vs_kept_reports_all_sampled_groups():
    from grpo_lens.train.step_metrics import sampled_vs_kept

    # 4 sampled groups of R = 2 with rewards (1,0) (1,1) (1,1) (0,0); the step kept the one mixed group (1,0).
    # Over all sampled: mean 5/8, population std sqrt(5/8 * 3/8), S1 = 3 constant groups / 4, accuracy 5/8.
    # The kept values (mean 1/2, S1 0, accuracy 1/2) move to dynamic/kept_*; keys that are not reward keys stay out.
    r = torch.tensor([1.0, 0, 1, 1, 1, 1, 0, 0])
    kept = {
        "reward/mean": 0.5,
        "reward/std": 0.5,
        "reward/frac_zero_std_groups": 0.0,
        "reward/invalid_frac": 0.0,
        "reward/accuracy": 0.5,
        "adv/mean": 0.0,
    }
    out = sampled_vs_kept(kept, r, torch.ones(8, dtype=torch.bool), r.clone(), group_size=2)
    assert out["reward/mean"] == pytest.approx(5 / 8, abs=1e-7)
    assert out["reward/std"] == pytest.approx((5 / 8 * 3 / 8) ** 0.5, abs=1e-6)
    assert out["reward/frac_zero_std_groups"] == pytest.approx(3 / 4, abs=1e-7)
    assert out["reward/accuracy"] == pytest.approx(5 / 8, abs=1e-7)
    assert out["dynamic/kept_reward_mean"] == 0.5 and out["dynamic/kept_frac_zero_std_groups"] == 0.0
    assert out["dynamic/kept_accuracy"] == 0.5 and "adv/mean" not in out


@pytest.mark.e2e
def test_dynamic_sampling_summary_counts_cap_hits(tmp_path):
    from grpo_lens.report.compare import compare_runs
    from grpo_lens.report.training_measures import dynamic_sampling_summary

    # 3 steps of B = 2: step 1 hit the cap after 3 rounds (6 groups, 5 all-equal, 1 kept), step 2 one round (2
    # groups, 0 all-equal, 2 kept), step 3 the cap again (6 groups, 6 all-equal, 0 kept): 2 of 3 steps at the cap,
    # 11 of 14 sampled groups all-equal = 0.786, 3 mixed groups trained on.
    recs = [
        {
            "step": 1,
            "dynamic/hit_cap": 1.0,
            "dynamic/sampled_groups": 6.0,
            "dynamic/zero_var_frac_sampled": 5 / 6,
            "dynamic/mixed_groups": 1.0,
        },
        {
            "step": 2,
            "dynamic/hit_cap": 0.0,
            "dynamic/sampled_groups": 2.0,
            "dynamic/zero_var_frac_sampled": 0.0,
            "dynamic/mixed_groups": 2.0,
        },
        {
            "step": 3,
            "dynamic/hit_cap": 1.0,
            "dynamic/sampled_groups": 6.0,
            "dynamic/zero_var_frac_sampled": 1.0,
            "dynamic/mixed_groups": 0.0,
        },
    ]
    text = dynamic_sampling_summary(recs)
    assert "2 of 3 steps hit the extra-rounds cap" in text and "0.786 of the 14 sampled groups" in text
    assert "3 mixed groups were trained on" in text
    assert dynamic_sampling_summary([{"step": 1, "reward/mean": 0.5}]) is None
    # compare names the run that used it and says the other did not
    for name, rows in (("ds", recs), ("plain", [{"step": s, "reward/mean": 0.1} for s in (1, 2, 3)])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text("task: arithmetic\n")
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    md = compare_runs([tmp_path / "ds", tmp_path / "plain"], tmp_path / "cmp").read_text()
    assert "- `ds`: Dynamic sampling (DAPO) was on: 2 of 3 steps hit" in md
    assert "- `plain`: no dynamic sampling" in md
