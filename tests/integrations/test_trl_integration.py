"""LensGRPOTrainer: a TRL GRPOTrainer run on the tiny model logs the lens keys through TRL's logging, and the numbers
equal grpo-lens' own lens on the same batch (TRL's completions and masks, rewards recomputed, advantages from
grpo-lens' estimator) to float tolerance."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.e2e,  # every test here builds a model
              pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs the trl extra")]

R = 4


def parity(completions, **kwargs):
    """1 when the completion's UTF-8 byte sum is odd: a coin flip per rollout on the random tiny model."""
    return [float(sum(c.encode()) % 2) for c in completions]


def make_trainer(tmp_path, cls, **lens):
    from datasets import Dataset
    from trl import GRPOConfig

    from grpo_lens.models import build_tiny_model

    model, tok = build_tiny_model(seed=0)
    data = Dataset.from_dict({"prompt": [f"What is {a} + {a + 1}?" for a in range(16)]})
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2 * R, num_generations=R,
                      max_completion_length=6, max_steps=2, logging_steps=1, learning_rate=1e-2, loss_type="grpo",
                      scale_rewards="group", temperature=0.9, beta=0.0, report_to="none", use_cpu=True,
                      save_strategy="no", seed=0, bf16=False, disable_tqdm=True, dataloader_num_workers=0)
    return cls(model=model, reward_funcs=parity, args=args, train_dataset=data, processing_class=tok, **lens)


def test_trl_run_logs_lens_keys_equal_to_grpo_lens_own_lens(tmp_path):
    from grpo_lens.config import TrainConfig
    from grpo_lens.formulas.advantages import compute_advantages
    from grpo_lens.integrations.trl import LensGRPOTrainer
    from grpo_lens.models import build_tiny_model
    from grpo_lens.rollout import RolloutBatch
    from grpo_lens.train.lens import TrainerLens

    captured = []

    class Capturing(LensGRPOTrainer):
        def measure_lens(self, output):
            # the policy's weights as the lens sees them (before this batch's update) and TRL's batch
            state = self.accelerator.unwrap_model(self.model).state_dict()
            captured.append(({k: v.detach().clone() for k, v in state.items()},
                             {k: v.detach().clone() for k, v in output.items() if torch.is_tensor(v)},
                             int(self.state.global_step)))
            return super().measure_lens(output)

    trainer = make_trainer(tmp_path, Capturing, lens_every=1, lens_sketch_dim=8, lens_seed=3)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rank/mixed_groups" in h]
    assert len(captured) == 2 and len(logs) == 2, "the lens ran at global steps 0 and 1 and TRL logged it"

    tok = trainer.processing_class
    for (weights, out, step), logged in zip(captured, logs):
        policy, _ = build_tiny_model(seed=0)  # a fresh copy of the model, with the weights TRL had at that step
        policy.load_state_dict(weights)
        policy.train()
        # grpo-lens' side, built independently from TRL's tokens: rewards from the decoded texts, advantages from
        # grpo-lens' grpo estimator (sample std, eps 1e-4), the lens from a TrainConfig.
        texts = [tok.decode(ids[m.bool()], skip_special_tokens=True)
                 for ids, m in zip(out["completion_ids"], out["completion_mask"])]
        rewards = torch.tensor(parity(texts))
        adv = compute_advantages(rewards.view(-1, R), "grpo", std="sample", eps=1e-4).view(-1)
        torch.testing.assert_close(out["advantages"].float(), adv.float(), rtol=1e-5, atol=1e-5)
        n, t = out["completion_ids"].shape
        batch = RolloutBatch(prompt_ids=out["prompt_ids"], prompt_mask=out["prompt_mask"],
                             completion_ids=out["completion_ids"], completion_mask=out["completion_mask"].bool(),
                             sampler_logprobs=torch.zeros(n, t), truncated=torch.zeros(n, dtype=torch.bool),
                             group_size=R)
        config = TrainConfig(gram_source="sketch", sketch_dim=8, seed=3, temperature=0.9, estimator="grpo",
                             std="sample", eps=1e-4, loss_aggregation="seq-mean-token-mean",
                             max_new_tokens=6)  # TRL's loss_type="grpo"
        ours = TrainerLens(policy, config).measure(step, policy, batch, rewards, torch.ones(n, dtype=torch.bool),
                                                   adv)
        lens_keys = {k for k in ours if k.split("/")[0] in ("rank", "grad", "baseline", "zero_sum", "sparsity")}
        assert "rank/mixed_groups" in lens_keys
        for key in lens_keys:
            assert logged[key] == pytest.approx(ours[key], rel=1e-5, abs=1e-7), key
        if ours["rank/mixed_groups"] > 0:
            assert "rank/g1_erank" in logged


def test_bad_lens_settings_fail_before_training(tmp_path):
    from grpo_lens.integrations.trl import LensGRPOTrainer

    with pytest.raises(ValueError, match="lens_every"):
        make_trainer(tmp_path, LensGRPOTrainer, lens_every=0)
    with pytest.raises(ValueError, match="lens_space"):
        make_trainer(tmp_path, LensGRPOTrainer, lens_space="adapter")
