"""Batch-level advantages (grpo_batch, reinforce_pp, reinforce_pp_baseline) in the trainer: each process's share of
the advantages computed on every process's groups together equals the single-process batch's (no model: two
processes simulated by the gather)."""

from __future__ import annotations

import pytest
import torch

import grpo_lens.train.loop as loop
from grpo_lens.config import TrainConfig
from grpo_lens.formulas.advantages import BATCH_ESTIMATORS, compute_advantages


@pytest.mark.parametrize("estimator", BATCH_ESTIMATORS)
def test_each_process_gets_its_rows_of_the_whole_batchs_advantages(monkeypatch, estimator):
    # 3 groups of 4 on process 0 and 2 groups on process 1 (uneven shares, as dynamic sampling can leave them).
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(5, 4, generator=g) > 0.5).float()
    rewards[4] = 1.0  # a group without contrast: 0 for the centred estimators, not for reinforce_pp
    valid = torch.rand(5, 4, generator=g) > 0.1
    shares = [(rewards[:3], valid[:3]), (rewards[3:], valid[3:])]
    whole = compute_advantages(rewards, estimator, mask=valid).reshape(-1)
    config = TrainConfig(estimator=estimator, group_size=4)
    monkeypatch.setattr(loop, "gather_objects", lambda obj: shares)
    got = []
    for rank, (r, v) in enumerate(shares):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda rank=rank: rank)
        got.append(loop.batch_advantages(config, r, v))
    torch.testing.assert_close(torch.cat(got), whole, rtol=0, atol=0)
    # each share alone would use its own batch statistics: a different answer (what the gather prevents)
    alone = compute_advantages(rewards[:3], estimator, mask=valid[:3]).reshape(-1)
    assert not torch.allclose(alone, whole[:12])


@pytest.mark.parametrize("estimator", BATCH_ESTIMATORS)
def test_the_probe_refuses_batch_level_estimators(estimator):
    # The probe computes advantages one group at a time: a batch statistic there would be the group's own.
    from grpo_lens.config import ConfigError
    from grpo_lens.probe.config import ProbeConfig

    with pytest.raises(ConfigError, match="batch-level estimator.*grpo-lens train"):
        ProbeConfig(estimator=estimator)
