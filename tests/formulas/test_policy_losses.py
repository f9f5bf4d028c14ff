"""The policy-loss registry (formulas/losses.py POLICY_LOSSES, verl's ``@register_policy_loss``): the clipped
surrogate registered as ``vanilla``, unknown names listing the valid ones, and the trainer's ``policy_loss`` field."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch

from grpo_lens.config import ConfigError, TrainConfig
from grpo_lens.config.base import add_config_arguments
from grpo_lens.formulas.losses import (
    POLICY_LOSSES,
    clipped_surrogate,
    grpo_loss,
    loss_normalizer,
)

CALLS: list[str] = []


def _unclipped(logp, old_logp, advantages, eps_low, eps_high, dual_clip):  # the six positional arguments only
    """-rho A, no clip (a test variant that records its calls)."""
    CALLS.append("test_unclipped")
    ratio = torch.exp(logp - old_logp)
    return -ratio * advantages.unsqueeze(-1), ratio.detach()


if "test_unclipped" not in POLICY_LOSSES:
    POLICY_LOSSES.register("test_unclipped")(_unclipped)


def test_vanilla_is_the_clipped_surrogate_and_the_default():
    assert POLICY_LOSSES.get("vanilla") is clipped_surrogate
    assert TrainConfig().policy_loss == "vanilla"


def test_unknown_policy_loss_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'; valid names: .*vanilla"):
        POLICY_LOSSES.get("ppo")
    with pytest.raises(ConfigError, match="policy_loss.*vanilla"):
        TrainConfig(policy_loss="ppo")


def test_grpo_loss_looks_the_policy_loss_up():
    # rho = 1.5 on every token, A = [1, -1], eps 0.2, seq-mean-token-mean over N = 2 rollouts (normaliser 2):
    # vanilla: rollout 1 -min(1.5, 1.2) = -1.2, rollout 2 -min(-1.5, -1.2) = 1.5 -> (-1.2 + 1.5) / 2 = 0.15
    # unclipped: -1.5 and 1.5 -> 0
    old = torch.zeros(2, 3)
    logp = old + math.log(1.5)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    norm = loss_normalizer(mask, "seq-mean-token-mean", 3)
    assert norm == 2.0
    default, _ = grpo_loss(logp, old, adv, mask, normalizer=norm)
    vanilla, _ = grpo_loss(logp, old, adv, mask, normalizer=norm, policy_loss="vanilla")
    unclipped, _ = grpo_loss(logp, old, adv, mask, normalizer=norm, policy_loss="test_unclipped")
    assert float(default) == float(vanilla) == pytest.approx(0.15, abs=1e-6)
    assert float(unclipped) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="unknown policy loss"):
        grpo_loss(logp, old, adv, mask, normalizer=norm, policy_loss="nope")


@pytest.mark.e2e
def test_trainer_uses_the_configured_policy_loss(tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "train"))
    from test_trainer import tiny_config

    from grpo_lens.train.loop import train

    CALLS.clear()
    train(tiny_config(tmp_path / "run", max_steps=1, mu=1, policy_loss="test_unclipped"))
    assert CALLS, "the trainer did not call the configured policy loss"


def test_dual_clip_only_with_a_clipped_loss():
    assert TrainConfig(policy_loss="gspo", dual_clip=3.0).dual_clip == 3.0
    for name in ("cispo", "sapo", "gpg"):
        with pytest.raises(ConfigError, match=f"dual_clip.*{name} has no clip"):
            TrainConfig(policy_loss=name, dual_clip=3.0)


def test_train_help_offers_the_objectives():
    # `grpo-lens train --help` lists every registered policy loss with its source, and SAPO's temperatures.
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, TrainConfig)
    text = " ".join(parser.format_help().split())
    for word in ("gspo", "cispo", "sapo", "gpg", "2507.18071", "2506.13585", "2511.20347", "--sapo-tau-pos"):
        assert word in text


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["gspo", "cispo", "sapo", "gpg"])
def test_two_step_runs_with_the_lens_on_every_step(tmp_path, name):
    # 2 steps of each objective with the lens on both, mu = 2 (the second pass off
    # policy, where the losses differ); every step is measured and its loss and gradient are finite.
    sys.path.insert(0, str(Path(__file__).parents[1] / "train"))
    from test_trainer import tiny_config

    from grpo_lens.rundir import read_records
    from grpo_lens.train.loop import train

    out = tmp_path / name
    train(tiny_config(out, max_steps=2, mu=2, lens_every=1, policy_loss=name))
    steps = [r for r in read_records(out / "metrics.jsonl") if "loss/policy" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rank/mixed_groups"] >= 1 and math.isfinite(r["loss/policy"]) and math.isfinite(r["grad/norm"])
        assert r["grad/optimizer_steps"] == 2  # mu = 2 passes, both taken


def test_a_loss_gets_by_name_only_the_settings_it_declares():
    from grpo_lens.formulas.losses import policy_loss_call

    seen: dict = {}

    def only_eps_high(logp, old_logp, advantages, eps_high):
        seen.update(eps_high=eps_high)
        return -advantages.unsqueeze(-1) * logp, logp.detach()

    def takes_all(logp, old_logp, advantages, **settings):
        seen.update(settings)
        return -advantages.unsqueeze(-1) * logp, logp.detach()

    for name, fn in (("test_only_eps_high", only_eps_high), ("test_takes_all", takes_all)):
        if name not in POLICY_LOSSES:
            POLICY_LOSSES.register(name)(fn)
    x, mask, adv = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.tensor([1.0, -1.0])
    policy_loss_call("test_only_eps_high", x, x, adv, mask, eps_low=0.1, eps_high=0.28, sapo_tau_pos=2.0)
    assert seen == {"eps_high": 0.28}
    seen.clear()
    policy_loss_call("test_takes_all", x, x, adv, mask, eps_high=0.28, sapo_tau_pos=2.0)
    # the clip defaults fill what was not given: 0.2 below, no dual clip
    assert seen == {"mask": mask, "eps_low": 0.2, "eps_high": 0.28, "dual_clip": None, "sapo_tau_pos": 2.0}


def test_gspo_through_the_registry_gets_the_clip_defaults_not_its_own():
    # gspo_surrogate's own defaults are the paper's 3e-4 / 4e-4; through policy_loss_call (the trainer's path) an
    # unset clip range is PPO's 0.2, as before the settings were passed by name. log-ratio 0.1 per token:
    # s = e^0.1 = 1.105 lies inside [0.8, 1.2] (unclipped, loss -s A) but far outside [1 - 3e-4, 1 + 4e-4].
    from grpo_lens.formulas.losses import gspo_surrogate, policy_loss_call

    old = torch.zeros(1, 2)
    logp = old + 0.1
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0])
    via_registry, _ = policy_loss_call("gspo", logp, old, adv, mask)
    torch.testing.assert_close(via_registry, torch.full((1, 2), -math.exp(0.1)))
    torch.testing.assert_close(via_registry, gspo_surrogate(logp, old, adv, 0.2, 0.2, mask=mask)[0])
    assert not torch.allclose(via_registry, gspo_surrogate(logp, old, adv, mask=mask)[0])
