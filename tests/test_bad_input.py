"""Bad input gives one clear error and loses nothing: a table of cases, almost all through ``grpo_lens.cli.main``.

Each case runs the CLI in-process and expects exit status 2, one ``grpo-lens ...: error: ...`` line on stderr that
names what is wrong (the field, file or row) and how to fix it, and no traceback. Config and data errors must fail
before a model loads (``load_model`` is replaced by a function that fails the test) and before --out is created; a
refused --out keeps every file byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import helpers_rewards  # noqa: F401 - registers the test_* reward functions
import pytest
from helpers_cli import tiny_train_args

from grpo_lens.cli import main

# A run that would take a second if the input were fine: the tiny model, R = 2, one prompt, two new tokens, one step.
TRAIN = tiny_train_args() + ["--rewards", "test_alternating"]


@dataclass
class Case:
    """One bad input.

    Attributes:
        id: the test id.
        args: CLI arguments after TRAIN (or the whole command line when ``command`` is False); ``{tmp}`` is the case's
            temporary directory, ``{out}`` its --out.
        expect: fragments the error line must contain (what is wrong, where, how to fix or the valid names).
        setup: ``setup(tmp, out, finished_run)`` prepares the case: writes files, copies a finished run into ``out``.
        model_may_load: the error can only be seen after the model loads (a corrupt checkpoint).
        command: prepend TRAIN and ``--out {out}``.
        env: environment variables for the case.
    """

    id: str
    args: list[str]
    expect: list[str]
    setup: Callable[[Path, Path, Path], None] | None = None
    model_may_load: bool = False
    command: bool = True
    env: dict[str, str] = field(default_factory=dict)


def write(name: str, text: str) -> Callable[[Path, Path, Path], None]:
    def setup(tmp: Path, out: Path, finished: Path) -> None:
        (tmp / name).write_text(text)

    return setup


def rows(*lines: str) -> Callable[[Path, Path, Path], None]:
    return write("data.jsonl", "".join(line + "\n" for line in lines))


def existing_run(edit: Callable[[Path], None] | None = None) -> Callable[[Path, Path, Path], None]:
    """Copy the module's finished run (one step, checkpoint step-000001) into ``out``, then ``edit`` it."""

    def setup(tmp: Path, out: Path, finished: Path) -> None:
        shutil.copytree(finished, out)
        if edit is not None:
            edit(out)

    return setup


def other_files(tmp: Path, out: Path, finished: Path) -> None:
    out.mkdir()
    (out / "notes.txt").write_text("my thesis, no backup\n")


GOOD_ROW = '{"prompt": "What is 2 + 3?", "answer": "5"}'
CKPT = Path("checkpoints") / "step-000001"

CASES = [
    # --- config values: the field, the value and the rule --------------------------------------------------------
    Case("group-size-1", ["--group-size", "1"], ["group_size", "--group-size", "at least 2"]),
    Case("group-size-0", ["--group-size", "0"], ["group_size", "at least 2"]),
    Case("learning-rate-negative", ["--learning-rate", "-0.001"], ["learning_rate", "-0.001", "must be > 0"]),
    Case("learning-rate-zero", ["--learning-rate", "0"], ["learning_rate", "must be > 0"]),
    Case("max-new-tokens-0", ["--max-new-tokens", "0"], ["max_new_tokens", ">= 1"]),
    Case(
        "rollout-batch-not-whole-groups",
        ["--group-size", "4", "--rollout-batch-size", "6"],
        ["rollout_batch_size", "multiple of group_size=4", "e.g. 4"],
    ),
    Case(
        "unknown-estimator",
        ["--estimator", "ppo"],
        [
            "estimator",
            "'ppo'",
            "valid names: dr_grpo, grpo, grpo_batch, optimal, reinforce, reinforce_pp, reinforce_pp_baseline, rloo",
        ],
    ),
    Case(
        "unknown-loss-mode",
        ["--loss-aggregation", "mean"],
        [
            "loss_aggregation",
            "valid names: seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-mean",
        ],
    ),
    Case("unknown-kl-estimator", ["--kl-estimator", "k4"], ["kl_estimator", "valid names: k1, k2, k3"]),
    Case("unknown-std", ["--std", "biased"], ["std", "valid names: population, sample"]),
    Case("temperature-0", ["--temperature", "0"], ["temperature", "must be > 0"]),
    Case("top-p-above-1", ["--top-p", "1.5"], ["top_p", "(0, 1]"]),
    Case("eps-low-1", ["--eps-low", "1"], ["eps_low", "[0, 1)"]),
    Case("dual-clip-1", ["--dual-clip", "1"], ["dual_clip", "> 1"]),
    Case("mu-0", ["--mu", "0"], ["mu", ">= 1"]),
    Case(
        "mini-batches-not-dividing",
        ["--prompts-per-step", "2", "--num-mini-batches", "3"],
        ["num_mini_batches", "must divide prompts_per_step=2"],
    ),
    Case("micro-batch-0", ["--micro-batch-size", "0"], ["micro_batch_size", ">= 1"]),
    Case("reward-timeout-0", ["--reward-timeout", "0"], ["reward_timeout", "> 0 seconds"]),
    Case("unknown-dtype", ["--dtype", "float16"], ["dtype", "valid names: bf16-mixed, bfloat16, float32"]),
    Case("unknown-device", ["--device", "tpu"], ["device", "cpu, cuda, cuda:N or auto"]),
    Case("not-a-number", ["--group-size", "four"], ["--group-size", "invalid int value"]),  # argparse's own error
    # --- names looked up in registries list the valid ones -------------------------------------------------------
    Case("unknown-task", ["--task", "poetry"], ["unknown task 'poetry'", "valid names: arithmetic, gsm8k, jsonl"]),
    Case(
        "unknown-reward",
        ["--rewards", "exactness"],
        ["unknown reward function 'exactness'", "valid names:", "correctness", "format"],
    ),
    Case(
        "reward-weight-not-a-number",
        ["--rewards", "correctness:heavy"],
        ["rewards", "correctness:heavy", "weight after ':' must be a number"],
    ),
    Case(
        "unknown-task-option",
        ["--task-options", "{max_operand: 9, digits: 3}"],
        ["task 'arithmetic'", "digits", "accepted options: min_operand, max_operand"],
    ),
    Case(
        "inconsistent-task-options",
        ["--task-options", "{min_operand: 5, max_operand: 1}"],
        ["min_operand (5) > max_operand (1)"],
    ),
    Case("task-options-not-yaml", ["--task-options", "{max_operand: [9}"], ["--task-options", "not valid YAML"]),
    Case("task-options-not-a-mapping", ["--task-options", "[1, 2]"], ["--task-options", "expected a YAML mapping"]),
    Case(
        "task-option-wrong-type",
        ["--task-options", "{max_operand: many}"],
        ["task 'arithmetic'", "max_operand", "accepted options"],
    ),
    # --- user data: the file and the row ------------------------------------------------------------------------------
    Case("jsonl-without-dataset", ["--task", "jsonl"], ["task 'jsonl' needs --dataset PATH"]),
    Case("dataset-missing", ["--task", "jsonl", "--dataset", "{tmp}/nope.jsonl"], ["nope.jsonl", "does not exist"]),
    Case(
        "dataset-empty", ["--task", "jsonl", "--dataset", "{tmp}/data.jsonl"], ["data.jsonl", "no rows"], setup=rows()
    ),
    Case(
        "row-missing-prompt",
        ["--task", "jsonl", "--dataset", "{tmp}/data.jsonl"],
        ["data.jsonl, row 2", "no 'prompt' column (columns: answer, question)", "Example line"],
        setup=rows(GOOD_ROW, '{"question": "What is 1 + 1?", "answer": "2"}'),
    ),
    Case(
        "row-empty-prompt",
        ["--task", "jsonl", "--dataset", "{tmp}/data.jsonl"],
        ["data.jsonl, row 1", "the prompt is empty"],
        setup=rows('{"prompt": "   ", "answer": "5"}', GOOD_ROW),
    ),
    Case(
        "row-prompt-wrong-type",
        ["--task", "jsonl", "--dataset", "{tmp}/data.jsonl"],
        ["data.jsonl, row 3", "the prompt is a int, expected a string or a list of messages"],
        setup=rows(GOOD_ROW, GOOD_ROW, '{"prompt": 42}'),
    ),
    Case(
        "row-bad-message",
        ["--task", "jsonl", "--dataset", "{tmp}/data.jsonl"],
        ["data.jsonl, row 1", "prompt message 0"],
        setup=rows('{"prompt": [{"role": "user"}]}'),
    ),
    Case(
        "row-not-json",
        ["--task", "jsonl", "--dataset", "{tmp}/data.jsonl"],
        ["data.jsonl, row 2", "not valid JSON"],
        setup=rows(GOOD_ROW, '{"prompt": "unclosed'),
    ),
    Case(
        "row-not-an-object",
        ["--task", "jsonl", "--dataset", "{tmp}/data.jsonl"],
        ["data.jsonl, row 1", "expected a JSON object, got list"],
        setup=rows('["What is 2 + 3?"]'),
    ),
    # --- the model ----------------------------------------------------------------------------------------------------
    Case("model-path-missing", ["--model", "{tmp}/no/such/model"], ["no/such/model", "does not exist", "pip install"]),
    Case(
        "model-file-not-gguf",
        ["--model", "{tmp}/weights.bin"],
        ["weights.bin", "not a .gguf file"],
        setup=write("weights.bin", "not a model"),
    ),
    Case("model-dir-without-config", ["--model", "{tmp}"], ["has no config.json and no .gguf file"]),
    # --- the config file ------------------------------------------------------------------------------------------
    Case("config-file-missing", ["--config", "{tmp}/nope.yaml"], ["nope.yaml", "does not exist"]),
    Case(
        "config-file-not-yaml",
        ["--config", "{tmp}/c.yaml"],
        ["c.yaml", "not valid YAML"],
        setup=write("c.yaml", "group_size: [4\n"),
    ),
    Case(
        "config-file-not-a-mapping",
        ["--config", "{tmp}/c.yaml"],
        ["c.yaml", "must hold a mapping"],
        setup=write("c.yaml", "- group_size\n- 4\n"),
    ),
    Case(
        "config-file-unknown-key",
        ["--config", "{tmp}/c.yaml"],
        ["unknown config key(s) grup_size", "group_size"],
        setup=write("c.yaml", "grup_size: 4\n"),
    ),
    Case(
        "config-file-wrong-type",
        ["--config", "{tmp}/c.yaml"],
        ["top_k", "'eight'", "must be of type int"],
        setup=write("c.yaml", "top_k: eight\n"),
    ),
    # --- the run directory: refused, and nothing in it changes ----------------------------------------------------
    Case(
        "out-holds-a-run", [], ["already holds a run", "--resume", "--overwrite", "another --out"], setup=existing_run()
    ),
    Case("out-holds-other-files", ["--overwrite"], ["not a grpo-lens run", "choose another --out"], setup=other_files),
    Case("out-is-a-file", [], ["is a file, not a directory"], setup=lambda tmp, out, finished: out.write_text("x")),
    Case("resume-without-run", ["--resume"], ["--resume", "holds no run", "without --resume"], setup=other_files),
    Case(
        "resume-with-changed-value",
        ["--resume", "--group-size", "4"],
        ["--resume: group_size=4 differs from the run's saved group_size=2", "drop the flag"],
        setup=existing_run(),
    ),
    Case(
        "resume-latest-names-missing-folder",
        ["--resume"],
        ["names step-000009, which is missing", "delete"],
        setup=existing_run(lambda out: (out / "checkpoints" / "latest").write_text("step-000009\n")),
    ),
    Case(
        "resume-latest-garbage",
        ["--resume"],
        ["not a checkpoint name like step-000010"],
        setup=existing_run(lambda out: (out / "checkpoints" / "latest").write_text("\x00\x17garbage")),
    ),
    Case(
        "resume-checkpoint-missing-file",
        ["--resume"],
        ["incomplete: optimizer.pt is missing", "step 0"],
        setup=existing_run(lambda out: (out / CKPT / "optimizer.pt").unlink()),
        model_may_load=True,
    ),
    Case(
        "resume-corrupt-model",
        ["--resume"],
        ["step-000001 is corrupt", "restart the run from step 0"],
        setup=existing_run(lambda out: (out / CKPT / "model.safetensors").write_bytes(b"\x08garbage")),
        model_may_load=True,
    ),
    Case(
        "resume-corrupt-state",
        ["--resume"],
        ["step-000001 is corrupt"],
        setup=existing_run(lambda out: (out / CKPT / "state.pt").write_bytes(b"PK\x03\x04 truncated")),
        model_may_load=True,
    ),
    Case(
        "resume-unreadable-config",
        ["--resume"],
        ["--resume: cannot read", "config.yaml"],
        setup=existing_run(lambda out: (out / "config.yaml").write_text("model: [tiny\n")),
    ),
    # --- plugins and reports ------------------------------------------------------------------------------------------
    Case(
        "plugin-not-importable",
        [],
        ["GRPO_LENS_PLUGINS", "no_such_plugin_module", "PYTHONPATH"],
        env={"GRPO_LENS_PLUGINS": "no_such_plugin_module"},
    ),
    Case("report-not-a-directory", ["report", "{tmp}/nothing"], ["nothing is not a directory"], command=False),
    Case(
        "report-nothing-to-report", ["report", "{tmp}"], ["holds neither metrics.jsonl nor probe.json"], command=False
    ),
]


def tree_digest(path: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``path`` (or of ``path`` itself when it is a file)."""
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished one-step run of the tiny model (checkpoint step-000001), copied by the run-directory cases."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(TRAIN + ["--out", str(out), "--checkpoint-every", "1"]) == 0
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_clear_error(case, tmp_path, capsys, monkeypatch, finished_run):
    out = tmp_path / "out"
    if case.setup is not None:
        case.setup(tmp_path, out, finished_run)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    if not case.model_may_load:

        def no_model(*args, **kwargs):
            raise AssertionError("a model was loaded before the bad input was reported")

        for where in ("grpo_lens.train.loop", "grpo_lens.probe.run"):  # every caller of load_model
            monkeypatch.setattr(f"{where}.load_model", no_model)
    before = tree_digest(out) if out.exists() else None
    capsys.readouterr()

    argv = [a.replace("{tmp}", str(tmp_path)).replace("{out}", str(out)) for a in case.args]
    if case.command:
        argv = TRAIN + ["--out", str(out)] + argv
    try:
        code = main(argv)
    except SystemExit as e:  # argparse reports its own errors this way, also with status 2
        code = e.code
    err = capsys.readouterr().err

    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    error_line = lines[-1]
    assert "error:" in error_line
    if "usage:" not in err:  # ours, not argparse's usage + error pair
        assert len(lines) == 1, err
    for fragment in case.expect:
        assert fragment in error_line, f"{fragment!r} not in {error_line!r}"
    # nothing lost: a refused --out is untouched, and a new one is not even created
    if before is None:
        assert not out.exists(), "the run directory was created for a run that could not start"
    else:
        assert tree_digest(out) == before


def test_unknown_rank_measure_lists_the_valid_ones():
    # Rank measures are chosen in code (grpo_lens.diagnostics), not on the command line.
    import torch

    from grpo_lens.formulas.spectrum import rank_measures

    with pytest.raises(
        ValueError,
        match="unknown rank measure 'nuclear'; valid names: erank, k90, k99, participation_ratio, stable_rank",
    ):
        rank_measures(torch.tensor([3.0, 1.0]), names=["nuclear"])


def test_unknown_crash_point_lists_the_valid_ones(monkeypatch):
    from grpo_lens.rundir import crash_point

    monkeypatch.setenv("GRPO_LENS_TEST_KILL_AT", "mid_lunch@3")
    with pytest.raises(ValueError, match="POINT one of during_generation, before_optimizer_step"):
        crash_point("mid_checkpoint", 3)


@pytest.mark.e2e
def test_overwrite_replaces_a_run_and_resume_needs_no_repeated_flags(tmp_path, capsys, finished_run):
    # The two ways past a refused --out work: --resume with only --out (the saved config is used; max_steps may grow)
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "2", "--no-progress"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    # and --overwrite starts the run again from step 1
    assert main(TRAIN + ["--out", str(out), "--overwrite"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]


@pytest.mark.e2e
def test_a_model_that_fails_to_load_creates_no_run_and_replaces_none(tmp_path, capsys, monkeypatch, finished_run):
    # A hub id can only be checked by trying to load it; the failure must still be one line and cost no files.
    import grpo_lens.models as models

    def offline(path, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your internet connection.")

    monkeypatch.setattr(models, "_from_pretrained", offline)
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=0: True)  # the hub answers; the download fails
    new = tmp_path / "new"
    assert main(TRAIN + ["--out", str(new), "--model", "someorg/some-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert (
        "'someorg/some-model'" in err
        and "couldn't connect" in err
        and "Check the hub id" in err
        and "pip install" not in err
    )
    assert not new.exists()
    old = tmp_path / "old"
    shutil.copytree(finished_run, old)
    before = tree_digest(old)
    assert main(TRAIN + ["--out", str(old), "--model", "someorg/some-model", "--overwrite"]) == 2
    assert tree_digest(old) == before  # --overwrite deletes the old run only once the new model has loaded
