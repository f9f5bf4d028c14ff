"""LensSettings: the one typed record TrainerLens reads, from grpo-lens' TrainConfig or from TRL's GRPOConfig."""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest

from grpo_lens.config import TrainConfig
from grpo_lens.lens.settings import LensSettings, as_lens_settings

#: the TRL side of one set of settings: TRL's loss_type "grpo", scale_rewards "group", temperature, length cap
TRL_ARGS = SimpleNamespace(loss_type="grpo", scale_rewards="group", temperature=0.9, max_completion_length=6)

#: the fields both constructors must give for it, written out
EXPECTED = {
    "sketch_dim": 8,
    "lens_space": "full",
    "gram_source": "sketch",
    "seed": 3,
    "estimator": "grpo",
    "std": "sample",
    "std_eps": 1e-4,
    "temperature": 0.9,
    "loss_aggregation": "seq-mean-token-mean",
    "max_new_tokens": 6,
    "overlong": "none",
    "lens_noise_proxy": False,
    "lens_landing": False,
    "lens_dead_kl": False,
}


def test_from_train_config_and_from_trl_give_the_same_fields_for_matching_settings():
    cfg = TrainConfig(
        sketch_dim=8,
        lens_space="full",
        gram_source="sketch",
        seed=3,
        estimator="grpo",
        std="sample",
        std_eps=1e-4,
        temperature=0.9,
        loss_aggregation="seq-mean-token-mean",
        max_new_tokens=6,
        overlong="none",
    )
    ours = LensSettings.from_train_config(cfg)
    theirs = LensSettings.from_trl(TRL_ARGS, sketch_dim=8, lens_space="full", seed=3, gram_source="sketch")
    assert dataclasses.asdict(ours) == EXPECTED
    assert dataclasses.asdict(theirs) == EXPECTED
    assert ours == theirs
    assert {f.name for f in dataclasses.fields(LensSettings)} == set(EXPECTED)


def test_trl_reward_scaling_maps_onto_the_estimator():
    assert LensSettings.from_trl(SimpleNamespace(**{**vars(TRL_ARGS), "scale_rewards": "none"})).estimator == "dr_grpo"
    batch = SimpleNamespace(**{**vars(TRL_ARGS), "scale_rewards": "batch"})
    assert LensSettings.from_trl(batch).estimator == "trl_scale_batch"
    mixed = LensSettings.from_trl(TRL_ARGS, multi_objective_aggregation="normalize_then_sum")
    assert mixed.estimator == "trl_normalize_then_sum"
    dapo = SimpleNamespace(**{**vars(TRL_ARGS), "loss_type": "dr_grpo"})
    assert LensSettings.from_trl(dapo).loss_aggregation == "seq-mean-token-sum-norm"


def test_the_settings_are_frozen():
    s = LensSettings.from_trl(TRL_ARGS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.sketch_dim = 4


def test_unknown_names_raise_with_the_valid_names():
    with pytest.raises(ValueError, match="lens_space = 'adapter': valid names: full, trainable"):
        LensSettings.from_trl(TRL_ARGS, lens_space="adapter")
    with pytest.raises(ValueError, match="lens_gram_source = 'dense': valid names: exact, sketch"):
        LensSettings.from_trl(TRL_ARGS, gram_source="dense")
    luspo = SimpleNamespace(**{**vars(TRL_ARGS), "loss_type": "luspo"})
    with pytest.raises(ValueError, match="TRL loss_type 'luspo': the lens knows .*bnpo, cispo, dapo, dr_grpo, grpo"):
        LensSettings.from_trl(luspo)
    with pytest.raises(ValueError, match="sketch_dim = 0: must be >= 1"):
        LensSettings.from_trl(TRL_ARGS, sketch_dim=0)
    # the record itself checks its closed sets whatever built it
    good = LensSettings.from_trl(TRL_ARGS)
    with pytest.raises(ValueError, match="gram_source = 'dense': valid names: exact, sketch"):
        dataclasses.replace(good, gram_source="dense")
    with pytest.raises(ValueError, match="lens_space = 'adapter': valid names: trainable, full"):
        dataclasses.replace(good, lens_space="adapter")
    with pytest.raises(ValueError, match="overlong = 'drop': valid names: none, mask, filter, soft-punish"):
        dataclasses.replace(good, overlong="drop")
    with pytest.raises(ValueError, match="loss_aggregation = 'mean': valid names: .*seq-mean-token-mean"):
        dataclasses.replace(good, loss_aggregation="mean")
    with pytest.raises(ValueError, match="temperature = 0.0: must be > 0"):
        dataclasses.replace(good, temperature=0.0)


def test_trainer_lens_takes_lens_settings_or_a_train_config_and_nothing_else(fresh_tiny_model_and_tokenizer):
    from grpo_lens.lens.trainer_lens import TrainerLens

    model, _ = fresh_tiny_model_and_tokenizer
    cfg = TrainConfig(sketch_dim=4, seed=5)
    assert TrainerLens(model, cfg).settings == LensSettings.from_train_config(cfg)
    settings = LensSettings.from_trl(TRL_ARGS)
    assert TrainerLens(model, settings).settings is settings
    with pytest.raises(TypeError, match="LensSettings or a TrainConfig.*got int"):
        TrainerLens(model, 3)
    with pytest.raises(TypeError, match="LensSettings or a TrainConfig.*got SimpleNamespace"):
        as_lens_settings(SimpleNamespace(seed=0))


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs the trl extra")
def test_the_trl_wrapper_keeps_its_keywords():
    from grpo_lens.integrations.trl import lens_settings

    new = lens_settings(TRL_ARGS, sketch_dim=8, lens_space="full", seed=3, gram_source="sketch")
    assert dataclasses.asdict(new) == EXPECTED
    assert lens_settings(TRL_ARGS).sketch_dim == 16  # the default, as --sketch-dim's
    with pytest.raises(TypeError, match="lens_sketch_dim"):  # the 0.2 name is gone
        lens_settings(TRL_ARGS, lens_sketch_dim=8)
    with pytest.raises(ValueError, match="lens_gram_source = 'dense': valid names: exact, sketch"):
        lens_settings(TRL_ARGS, gram_source="dense")
