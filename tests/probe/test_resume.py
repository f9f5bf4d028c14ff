"""``grpo-lens probe --resume``: a probe killed after k prompts (inside a batch, between group sizes, or during the
studies) continues from its partial probe (OUT/probe_partial/) and writes the probe.json an uninterrupted probe with the
same settings writes, timings aside; the refusals happen before anything is written.

The kill is a :class:`Killed` raised from a monkeypatched hook right after the k-th prompt record was saved (or from a
study), which is what a SIGKILL at that moment leaves: every record written whole, nothing after it.
"""

from __future__ import annotations

import json

import pytest

import grpo_lens.probe.estimate as probe_estimate
import grpo_lens.probe.run as probe_module
from grpo_lens.cli import main
from grpo_lens.config import ConfigError
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.partial import PartialProbe, PromptRecord
from grpo_lens.probe.run import run_probe

#: keys of probe.json that hold wall times (or say whether the probe was resumed): the only ones allowed to differ
TIMING_KEYS = ("seconds", "studies_seconds", "timing", "resumed")


class Killed(Exception):
    """Stands for the probe's process being killed."""


def config(out, **overrides) -> ProbeConfig:
    # 6 prompts per R in batches of 4: prompt 5 is the second prompt of the second batch. Every study runs (the MC
    # one on one group), every optional per-R measurement (G2 weightings, the sketch check, baseline variances) too.
    values = dict(
        model="tiny",
        rewards=["test_parity"],
        group_sizes=[2, 4],
        prompts=6,
        prompts_per_batch=4,
        max_new_tokens=6,
        baseline_prompts=1,
        resamples=16,
        random_draws=2,
        seed=3,
        device="cpu",
        out=str(out),
        study_group_size=2,
        baseline_study_prompts=2,
        credit_groups=1,
        mc_groups=1,
        mc_samples=2,
        gram_source="sketch",
        progress=False,
    )
    values.update(overrides)
    return ProbeConfig(**values)


def without_timings(x):
    """probe.json without its wall times (and the --out it was written to)."""
    if isinstance(x, dict):
        return {k: without_timings(v) for k, v in x.items() if k not in TIMING_KEYS + ("out",)}
    if isinstance(x, list):
        return [without_timings(v) for v in x]
    return x


def read(out):
    return json.loads((out / "probe.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = run_probe(config(tmp_path_factory.mktemp("whole")))
    return read(out)


def kill_after_prompts(monkeypatch, k: int) -> None:
    """Raise :class:`Killed` right after the k-th prompt record (over all R) is saved."""
    saved = []
    original = PartialProbe.save_prompt

    def save_then_maybe_die(self, group_size, index, record):
        original(self, group_size, index, record)
        saved.append((group_size, index))
        if len(saved) == k:
            raise Killed(saved[-1])

    monkeypatch.setattr(PartialProbe, "save_prompt", save_then_maybe_die)


@pytest.mark.e2e
@pytest.mark.parametrize("k", [5, 7])  # inside R = 2's second batch; inside R = 4's first batch (R = 2 finished)
def test_resumed_probe_equals_the_uninterrupted_one(tmp_path, monkeypatch, uninterrupted, k):
    out = tmp_path / "probe"
    with monkeypatch.context() as mp:
        kill_after_prompts(mp, k)
        with pytest.raises(Killed):
            run_probe(config(out))
    partial = PartialProbe(out)
    assert not (out / "probe.json").exists() and partial.exists()
    assert len(partial.prompt_records(2)) == min(k, 6) and len(partial.prompt_records(4)) == max(k - 6, 0)
    assert (partial.group_size_result(2) is not None) == (k > 6)

    measured = []  # prompts measured after the resume: (R, index of the prompt within its batch)
    original = probe_estimate.analyse_prompts

    def recording(policy, tokenizer, drawn, first, *args, **kwargs):
        measured.extend(range(first, drawn.rewards.shape[0]))
        return original(policy, tokenizer, drawn, first, *args, **kwargs)

    monkeypatch.setattr(probe_estimate, "analyse_prompts", recording)
    run_probe(config(out, resume=True))
    # the resume measured only the 12 - k prompts left, starting inside the batch the kill cut (k mod 6 = 5 or 1)
    assert len(measured) == 12 - k and measured[0] == (k % 6) % 4
    resumed = read(out)
    assert resumed["meta"]["resumed"] is True and uninterrupted["meta"]["resumed"] is False
    assert without_timings(resumed) == without_timings(uninterrupted)
    assert resumed["per_group_size"]["4"]["groups_mixed"] > 0  # the comparison covers analysed groups
    assert not partial.path.exists()  # deleted once probe.json holds everything


@pytest.mark.e2e
def test_probe_killed_in_the_studies_resumes_after_the_finished_ones(tmp_path, monkeypatch, uninterrupted):
    out = tmp_path / "probe"
    with monkeypatch.context() as mp:

        def killed(*args, **kwargs):
            raise Killed("credit study")

        mp.setattr(probe_module, "run_credit_study", killed)
        with pytest.raises(Killed):
            run_probe(config(out))
    partial = PartialProbe(out)
    assert partial.study("baselines") is not None and partial.study("credit") is None

    def not_again(*args, **kwargs):
        raise AssertionError("measured again after the resume")

    # every group size and the baseline study are finished: none is measured again
    monkeypatch.setattr(probe_module, "probe_group_size", not_again)
    monkeypatch.setattr(probe_module, "run_baseline_study", not_again)
    run_probe(config(out, resume=True))
    assert without_timings(read(out)) == without_timings(uninterrupted)


@pytest.mark.e2e
def test_resume_refusals_write_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "probe"
    # --resume without a partial probe
    with pytest.raises(ConfigError, match="holds no partial probe, nothing to resume"):
        run_probe(config(out, resume=True))
    assert not out.exists()
    with monkeypatch.context() as mp:
        kill_after_prompts(mp, 2)
        with pytest.raises(Killed):
            run_probe(config(out))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*"))
    # other settings: every differing field named with both values
    with pytest.raises(ConfigError, match=r"prompts 6 -> 8; temperature 0\.7 -> 0\.9 differ"):
        run_probe(config(out, resume=True, prompts=8, temperature=0.9))
    # a new probe into the partial one's folder, without --resume or --overwrite
    with pytest.raises(ConfigError, match="did not finish.*pass --resume"):
        run_probe(config(out))
    with pytest.raises(ConfigError, match="pass one of them"):
        config(out, resume=True, overwrite=True)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*")) == before
    # the CLI takes the partial probe's settings (no flags repeated) and names a flag that differs
    assert main(["probe", "--out", str(out), "--resume", "--prompts", "7"]) == 2
    assert "prompts 6 -> 7" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*")) == before
    assert main(["probe", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert (out / "probe.json").exists() and not PartialProbe(out).path.exists()
    # a finished probe: nothing to resume; --overwrite still replaces it
    with pytest.raises(ConfigError, match=r"holds a finished probe \(probe\.json\), nothing to resume"):
        run_probe(config(out, resume=True))
    with pytest.raises(ConfigError, match="overwrite"):
        run_probe(config(out))


def test_prompt_record_round_trips_through_its_file(tmp_path):
    # what a record holds comes back equal from its file (tensors, None, nested dicts), and records are read in order
    # up to the first missing one (a record written after a gap is never read: prompts finish in order)
    import torch

    partial = PartialProbe(tmp_path)
    partial.start(ProbeConfig(out=str(tmp_path)).to_dict())
    record = PromptRecord(
        "mixed",
        0.25,
        {"rank/g1_erank": 1.5},
        {"advantages": torch.tensor([0.5, -0.5]), "g3_rows": {"adv": torch.ones(3)}},
        None,
        None,
        {"none": 2.0},
        {"gradient": 0.1},
    )
    partial.save_prompt(4, 0, record)
    partial.save_prompt(4, 2, PromptRecord("invalid"))
    (back,) = partial.prompt_records(4)
    assert back.to_dict().keys() == record.to_dict().keys()
    assert back.row == record.row and back.baseline_variance == {"none": 2.0} and back.check is None
    assert torch.equal(back.extra["advantages"], record.extra["advantages"])
    assert partial.prompt_records(2) == []


@pytest.mark.e2e
def test_overwrite_starts_over_and_a_bad_layer_keeps_the_partial_probe(tmp_path, monkeypatch, uninterrupted):
    out = tmp_path / "probe"
    with monkeypatch.context() as mp:
        kill_after_prompts(mp, 3)
        with pytest.raises(Killed):
            run_probe(config(out))
    # an --overwrite that fails on its settings deletes nothing
    with pytest.raises(ConfigError, match="not a linear layer"):
        run_probe(config(out, overwrite=True, layer="no.such.layer"))
    assert len(PartialProbe(out).prompt_records(2)) == 3
    # --overwrite measures every prompt again (none restored) and gives the uninterrupted numbers
    measured = []
    original = probe_estimate.analyse_prompts
    monkeypatch.setattr(
        probe_estimate,
        "analyse_prompts",
        lambda *a, **k: measured.extend(range(a[3], a[2].rewards.shape[0])) or original(*a, **k),
    )
    run_probe(config(out, overwrite=True))
    assert len(measured) == 12 and read(out)["meta"]["resumed"] is False
    assert without_timings(read(out)) == without_timings(uninterrupted)
