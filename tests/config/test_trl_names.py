"""TRL's GRPOConfig names set grpo-lens' fields (YAML, flags, dicts); values and names with no grpo-lens meaning fail
with the option to use; ``--eps`` is deprecated for ``--std-eps`` with a warning that names TRL's epsilon."""

from __future__ import annotations

import argparse
import warnings

import pytest

from grpo_lens.config import TrainConfig
from grpo_lens.config.base import (
    ConfigError,
    ConfigNameWarning,
    add_config_arguments,
    config_from_args,
)
from grpo_lens.probe.config import ProbeConfig


def parse(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, TrainConfig)
    return config_from_args(parser.parse_args(list(argv)), TrainConfig)


def test_trl_names_set_the_same_settings():
    c = TrainConfig.from_dict(
        {
            "num_generations": 4,
            "max_completion_length": 32,
            "num_iterations": 2,
            "epsilon": 0.3,
            "loss_type": "dr_grpo",
            "scale_rewards": "none",
            "lr_scheduler_type": "cosine",
            "mask_truncated_completions": True,
        }
    )
    assert (c.group_size, c.max_new_tokens, c.mu) == (4, 32, 2)
    assert (c.eps_low, c.eps_high) == (0.3, 0.3), "TRL's epsilon_high defaults to epsilon"
    assert (c.loss_aggregation, c.estimator, c.lr_scheduler, c.overlong) == (
        "seq-mean-token-sum-norm",
        "dr_grpo",
        "cosine",
        "mask",
    )
    c = TrainConfig.from_dict({"epsilon": 0.2, "epsilon_high": 0.28, "loss_type": "dapo", "scale_rewards": "group"})
    assert (c.eps_low, c.eps_high, c.loss_aggregation, c.estimator) == (0.2, 0.28, "token-mean", "grpo")
    # per_device_train_batch_size x steps_per_generation rollouts per step, steps_per_generation optimizer steps
    c = TrainConfig.from_dict({"num_generations": 4, "per_device_train_batch_size": 8, "steps_per_generation": 2})
    assert (c.rollout_batch_size, c.prompts_per_step, c.num_mini_batches) == (16, 4, 2)


def test_trl_objective_names_set_the_policy_loss_and_the_estimator():
    # TRL's GSPO is loss_type grpo with importance_sampling_level sequence (the GSPO paper's setup, TRL's advice).
    c = TrainConfig.from_dict({"loss_type": "grpo", "importance_sampling_level": "sequence"})
    assert (c.policy_loss, c.loss_aggregation) == ("gspo", "seq-mean-token-mean")
    assert TrainConfig.from_dict({"importance_sampling_level": "token"}).policy_loss == "vanilla"
    # cispo aggregates like dapo, and TRL's epsilon_high is its cap eps_max itself: 5.0 -> eps_high 4.0
    c = TrainConfig.from_dict({"loss_type": "cispo", "epsilon_high": 5.0})
    assert (c.policy_loss, c.loss_aggregation, c.eps_high) == ("cispo", "token-mean", 4.0)
    c = TrainConfig.from_dict({"loss_type": "sapo", "sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.2})
    assert (c.policy_loss, c.loss_aggregation, c.sapo_tau_pos, c.sapo_tau_neg) == (
        "sapo",
        "seq-mean-token-mean",
        0.9,
        1.2,
    )
    assert TrainConfig.from_dict({"scale_rewards": "batch"}).estimator == "grpo_batch"
    assert TrainConfig.from_dict({"loss_type": "dapo"}).policy_loss == "vanilla"


def test_trl_flags_parse_like_grpo_lens_flags():
    c = parse(
        "--num-generations",
        "4",
        "--max-completion-length",
        "32",
        "--epsilon",
        "0.25",
        "--mask-truncated-completions",
        "--loss-type",
        "grpo",
    )
    assert (c.group_size, c.max_new_tokens, c.eps_low, c.eps_high, c.overlong) == (4, 32, 0.25, 0.25, "mask")
    assert c.loss_aggregation == "seq-mean-token-mean"


@pytest.mark.parametrize(
    "values, words",
    [
        ({"num_generations": 4, "group_size": 8}, ["TRL's name for 'group_size'", "is given too"]),
        ({"epsilon": 0.2, "eps_low": 0.3}, ["eps_low", "give one"]),
        ({"scale_rewards": "max"}, ["--estimator grpo", "--estimator grpo_batch", "--estimator dr_grpo"]),
        ({"loss_type": "luspo"}, ["--loss-aggregation", "--policy-loss"]),
        ({"loss_type": "sapo", "importance_sampling_level": "sequence"}, ["--policy-loss gspo"]),
        ({"loss_type": "cispo", "policy_loss": "vanilla"}, ["policy_loss", "give one"]),
        ({"gradient_accumulation_steps": 4}, ["--micro-batch-size"]),
        ({"use_vllm": True}, ["generate"]),
    ],
)
def test_trl_names_without_a_grpo_lens_meaning_fail_naming_the_option(values, words):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(values)
    for w in words:
        assert w in str(e.value)


def test_eps_is_deprecated_for_std_eps_and_says_it_is_not_trls_epsilon():
    for cls in (TrainConfig, ProbeConfig):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = cls.from_dict({"eps": 0.2})
        assert c.std_eps == 0.2
        (w,) = [w for w in caught if issubclass(w.category, ConfigNameWarning)]
        assert "'std_eps'" in str(w.message) and "TRL's epsilon" in str(w.message) and "--eps-low" in str(w.message)
    assert "eps" not in TrainConfig().to_dict() and TrainConfig().to_dict()["std_eps"] == 1e-4


def test_schedule_settings_are_checked():
    with pytest.raises(ConfigError, match="lr_scheduler"):
        TrainConfig(lr_scheduler="polynomial")
    with pytest.raises(ConfigError, match="warmup_ratio.*give one"):
        TrainConfig.from_dict({"warmup_ratio": 0.1, "warmup_steps": 3})
    with pytest.raises(ConfigError, match="warmup_ratio"):
        TrainConfig.from_dict({"warmup_ratio": 1.0})
    with pytest.raises(ConfigError, match="warmup_steps"):
        TrainConfig(warmup_steps=2.5)  # neither whole steps nor a share


def test_train_help_names_trl_aliases(capsys):
    """`grpo-lens train --help` shows each TRL alias beside the option it sets (they were accepted but not shown)."""
    from grpo_lens.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare with single spaces
    for alias in (
        "--num-generations (TRL)",
        "--max-completion-length (TRL)",
        "--epsilon (TRL)",
        "--loss-type (TRL)",
        "--num-iterations (TRL)",
        "--warmup-ratio (TRL)",
    ):
        assert alias in text.replace("- ", "-"), alias


def test_one_loss_type_map_covers_every_accepted_trl_loss_type_with_registered_losses():
    """The one TRL ``loss_type`` map (config/trl_names.py): every value TRL 1.16 documents is in it or refused by name
    (luspo), every value the config or the lens accepts maps to a registered aggregation (and, for cispo / sapo, a
    registered policy loss), and the lens reads the same map."""
    from types import SimpleNamespace

    from grpo_lens.config.trl_names import (
        LENS_ONLY_LOSS_TYPES,
        LOSS_TYPE_AGGREGATIONS,
        LOSS_TYPE_POLICY_LOSSES,
        TRAINER_LOSS_TYPES,
    )
    from grpo_lens.formulas.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
    from grpo_lens.lens.settings import LensSettings

    # TRL 1.16's GRPOConfig.loss_type help: 'grpo', 'dr_grpo', 'dapo', 'bnpo', 'cispo', 'sapo', 'luspo', 'vespo'
    trl_values = {"grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"}
    assert set(LOSS_TYPE_AGGREGATIONS) == trl_values - {"luspo"}
    assert (
        set(TRAINER_LOSS_TYPES)
        == set(LOSS_TYPE_AGGREGATIONS) - set(LENS_ONLY_LOSS_TYPES)
        == trl_values
        - {
            "luspo",
            "vespo",
        }
    )
    for loss_type, aggregation in LOSS_TYPE_AGGREGATIONS.items():
        assert aggregation in LOSS_AGGREGATIONS.names(), loss_type
    assert set(LOSS_TYPE_POLICY_LOSSES) <= set(TRAINER_LOSS_TYPES)
    assert set(LOSS_TYPE_POLICY_LOSSES.values()) <= set(POLICY_LOSSES.names())
    for loss_type in TRAINER_LOSS_TYPES:  # the config sets the map's aggregation
        assert TrainConfig.from_dict({"loss_type": loss_type}).loss_aggregation == LOSS_TYPE_AGGREGATIONS[loss_type]
    args = SimpleNamespace(scale_rewards="group", temperature=1.0, max_completion_length=8)
    for loss_type, aggregation in LOSS_TYPE_AGGREGATIONS.items():  # the lens of a TRL run reads the same map
        assert LensSettings.from_trl(SimpleNamespace(**vars(args), loss_type=loss_type)).loss_aggregation == aggregation
    for refused in ("vespo", "luspo"):
        with pytest.raises(ConfigError, match=f"loss_type '{refused}'"):
            TrainConfig.from_dict({"loss_type": refused})
