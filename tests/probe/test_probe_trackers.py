"""``probe --report-to``: a finished probe's summary means and counts reach the tracker at step R, the claims table
as a text, read back from the TensorBoard event files."""

from __future__ import annotations

import importlib.util
import json

import pytest
from test_probe import probe_config

from grpo_lens.config import ConfigError
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.run import run_probe
from grpo_lens.probe.tracking import probe_records


def test_probe_records_are_the_summary_means_at_step_r():
    probe = {
        "per_group_size": {
            "4": {
                "summary": {"rank/g1_erank": {"mean": 3.5, "lo": 3.0, "hi": 4.0, "n": 9}},
                "prompts_sampled": 12,
                "groups_mixed": 9,
            },
            "2": {"summary": {}, "prompts_sampled": 12, "groups_mixed": 5},
        }
    }
    (r2, rec2), (r4, rec4) = probe_records(probe)
    assert (r2, r4) == (2, 4)
    assert rec4["rank/g1_erank"] == 3.5 and rec4["probe/groups_mixed"] == 9 and rec2["probe/prompts_sampled"] == 12
    assert rec4["probe/s1_measured"] is None  # absent: None, which the trackers drop


def test_unknown_tracker_is_refused():
    with pytest.raises(ConfigError, match="report_to.*unknown tracker 'tensorbord'"):
        ProbeConfig(report_to=["tensorbord"])


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard extra")
def test_tensorboard_gets_the_probe(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_trackers import read_tensorboard

    out = run_probe(probe_config(tmp_path / "probe", report_to=["tensorboard"], progress=False))
    probe = json.loads((out / "probe.json").read_text())
    events = read_tensorboard(out / "tensorboard")
    for R, d in probe["per_group_size"].items():
        assert events["probe/groups_mixed"][int(R)] == d["groups_mixed"]
        erank = d["summary"]["rank/g1_erank"]["mean"]
        assert events["rank/g1_erank"][int(R)] == pytest.approx(erank, rel=1e-6)  # float32 in TensorBoard
    texts = []
    for run in (out / "tensorboard").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(run.parent))
        acc.Reload()
        texts += acc.Tags().get("tensors", [])
    assert any("claims" in t for t in texts)
