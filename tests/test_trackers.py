"""--report-to: every number of every metrics.jsonl record reaches the tracker at its step (read back from the
TensorBoard event files), a resumed run shows each step once, and bad tracker names fail before --out is touched."""

from __future__ import annotations

import importlib.util

import pytest

from grpo_lens import metrics as mk
from grpo_lens.config import ConfigError, TrainConfig
from grpo_lens.rundir import RunDir
from grpo_lens.trackers import check_trackers, scalars
from grpo_lens.train.loop import train


def tiny_config(out, **overrides) -> TrainConfig:
    values = dict(
        model="tiny",
        rewards=["test_parity"],
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=6,
        max_steps=3,
        learning_rate=1e-2,
        micro_batch_size=8,
        lens_every=2,
        seed=0,
        device="cpu",
        out=str(out),
        progress=False,
        save_final_model=False,
        log_completions=0,
        checkpoint_every=2,
        report_to=["tensorboard"],
    )
    values.update(overrides)
    return TrainConfig(**values)


def read_tensorboard(logdir) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar in the event files under ``logdir`` (the last write of a step wins,
    as TensorBoard shows it)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    out: dict[str, dict[int, float]] = {}
    for run, tags in mux.Runs().items():
        for tag in tags.get("scalars", []):
            for ev in mux.Scalars(run, tag):
                out.setdefault(tag, {})[ev.step] = ev.value
    return out


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard extra")
def test_tensorboard_gets_every_metric_key_at_its_step(tmp_path):
    run = train(tiny_config(tmp_path / "run"))
    records = RunDir(run.path).read_metrics()
    events = read_tensorboard(run.path / "tensorboard")
    assert len(records) == 3
    lens_keys = {"rank/mixed_groups", "perf/lens_seconds"}
    assert lens_keys <= set(records[1]), "the lens ran at step 2"
    assert set(events) == set().union(*(scalars(r) for r in records))
    for rec in records:
        for key, value in scalars(rec).items():
            # TensorBoard stores float32: equal to the JSON value at float32 rounding
            assert events[key][rec["step"]] == pytest.approx(value, rel=1e-6, abs=1e-30), (key, rec["step"])
    # and nothing else: each tag holds exactly the steps whose record has that key (the lens keys only at lens steps)
    for tag, by_step in events.items():
        assert set(by_step) == {r["step"] for r in records if tag in scalars(r)}, tag
    assert set(events["reward/mean"]) == {1, 2, 3}


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard extra")
def test_resumed_run_shows_each_step_once_with_its_final_value(tmp_path):
    # Train 3 steps (checkpoint at 2 and 3), then pretend steps after the checkpoint of step 2 were lost: resume
    # from step 2 to 4. TensorBoard's purge_step hides the first writer's step-3 event; step 3 is redone with the
    # same result, and steps 1-4 each show once with metrics.jsonl's value.
    out = tmp_path / "run"
    train(tiny_config(out, max_steps=3))
    (out / "checkpoints" / "latest").write_text("step-000002\n")
    train(tiny_config(out, max_steps=4, resume=True))
    records = RunDir(out).read_metrics()
    events = read_tensorboard(out / "tensorboard")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert sorted(events["reward/mean"]) == [1, 2, 3, 4]
    for rec in records:
        assert events["loss/policy"][rec["step"]] == pytest.approx(rec["loss/policy"], rel=1e-6)


def test_unknown_tracker_is_a_config_error():
    with pytest.raises(ConfigError, match="valid names: none, tensorboard, wandb, trackio"):
        tiny_config("x", report_to=["tensorbored"])
    with pytest.raises(ConfigError, match="cannot be combined"):
        tiny_config("x", report_to=["none", "wandb"])


def test_missing_tracker_library_names_the_extra(monkeypatch):
    import grpo_lens.trackers as trackers

    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install '\.\[wandb\]' in the grpo-lens folder"):
        check_trackers(["wandb"])
    check_trackers(["none"])  # needs nothing


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs the wandb extra")
def test_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)  # wandb reads the working directory, which an earlier test may have removed
    run = train(tiny_config(tmp_path / "run", max_steps=1, report_to=["wandb"], lens_every=1))
    offline = list((run.path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard extra")
def test_tensorboard_hparams_go_into_the_run_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpo_lens.trackers import Trackers

    t = Trackers(["tensorboard"], tmp_path, {"learning_rate": 1e-6, "rewards": ["a", "b"]}, 0)
    t.log({"reward/mean": 0.5}, 1)
    t.finish()
    tb = tmp_path / "tensorboard"
    # one event file and hparams.yml, no timestamped subfolders next to them
    assert [p for p in tb.iterdir() if p.is_dir()] == []
    (event,) = tb.glob("events.out.tfevents.*")
    ea = EventAccumulator(str(event))
    ea.Reload()
    assert "_hparams_/experiment" in ea.summary_metadata and ea.Tags()["scalars"] == ["reward/mean"]
    assert "learning_rate: 1.0e-06" in (tb / "hparams.yml").read_text()


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard extra")
def test_metric_names_trl_and_the_completion_table_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    run = train(tiny_config(tmp_path / "run", max_steps=1, lens_every=0, metric_names="trl", log_completions=2))
    record = RunDir(run.path).read_metrics()[0]
    assert mk.REWARD_MEAN in record, "metrics.jsonl keeps grpo-lens' keys"
    events = read_tensorboard(run.path / "tensorboard")
    assert {"reward", "grad_norm", "learning_rate"} <= set(events) and mk.REWARD_MEAN not in events
    assert events["reward"][1] == pytest.approx(record[mk.REWARD_MEAN], rel=1e-6)
    assert set(events) == {mk.other_name(k, "trl") or k for k in scalars(record)}
    assert mk.other_name(mk.GRAD_NORM, "trl") == "grad_norm" and mk.other_name(mk.LR, "trl") == "learning_rate"
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(run.path / "tensorboard"))
    mux.Reload()
    texts = [t for tags in mux.Runs().values() for t in tags.get("tensors", []) if t.startswith("completions")]
    assert texts, "the step's completions were logged as a table"
