"""Hostile files and inputs: planted links, a reward that changes the working folder, resource
bombs in YAML / JSON / npz, and inputs that used to end in a traceback. Each case fails before its fix; each checks
that no file outside the folder written changes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import helpers_rewards  # noqa: F401 - registers the test_* reward functions
import pytest
import yaml
from helpers_cli import tiny_train_args

from grpo_lens.cli import main


def one_error_line(capsys) -> str:
    """The one ``grpo-lens CMD: error: ...`` line on stderr (and no traceback)."""
    err = capsys.readouterr().err
    progress = ("Loading weights", "Writing model shards")  # transformers' progress bars on stderr
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not line.startswith(progress)]
    assert "Traceback" not in err and len(lines) == 1 and "error:" in lines[0], err
    return lines[0]


def training_run(path: Path, rewards=(0.25, 0.5, 0.75), **config) -> Path:
    """A hand-written training run directory: config.yaml and metrics.jsonl (no model needed to report on it)."""
    path.mkdir(parents=True)
    cfg = {"task": "arithmetic", "task_options": {}, "dataset": None, "estimator": "grpo", "seed": 0, **config}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [json.dumps({"step": s, "reward/mean": r, "reward/accuracy": r}) for s, r in enumerate(rewards, 1)]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


# --- item 4: no write through a planted link ---------------------------------------------------------------------
def test_write_file_replaces_a_planted_link_and_never_writes_its_target(tmp_path):
    from grpo_lens.rundir import write_file

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "report.md").symlink_to(victim)
    write_file(tmp_path / "run" / "report.md", "new report\n")
    assert victim.read_text() == "precious\n"  # the target is untouched
    assert not (tmp_path / "run" / "report.md").is_symlink()  # the link itself was replaced by the file
    assert (tmp_path / "run" / "report.md").read_text() == "new report\n"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["report.md"]  # no temporary file left


def test_write_file_refuses_a_folder_that_leads_out_of_the_root(tmp_path):
    from grpo_lens.rundir import UnsafeWriteError, write_file, writes_confined_to

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "probe_before").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with writes_confined_to(tmp_path / "run"), pytest.raises(UnsafeWriteError, match="outside"):
        write_file(tmp_path / "run" / "probe_before" / "spectra.png", b"png")
    assert list((tmp_path / "elsewhere").iterdir()) == []
    write_file(tmp_path / "run" / "inside.txt", "ok")  # outside the block nothing is confined, inside is fine


@pytest.mark.e2e
def test_report_through_planted_links_changes_nothing_outside(tmp_path, capsys):
    run = training_run(tmp_path / "run")
    victim_md, victim_png = tmp_path / "victim.md", tmp_path / "victim.png"
    victim_md.write_text("keep me\n")
    victim_png.write_bytes(b"keep me too")
    (run / "report.md").symlink_to(victim_md)
    (run / "learning_curves.png").symlink_to(victim_png)
    assert main(["report", str(run)]) == 0
    assert victim_md.read_text() == "keep me\n" and victim_png.read_bytes() == b"keep me too"
    assert (run / "report.md").read_text().startswith("# grpo-lens report")
    assert not (run / "report.md").is_symlink()


@pytest.mark.e2e
def test_compare_through_planted_links_changes_nothing_outside(tmp_path, capsys):
    a, b = training_run(tmp_path / "a"), training_run(tmp_path / "b", estimator="rloo")
    out = tmp_path / "cmp"
    out.mkdir()
    victims = {}
    for name in ("compare.md", "compare.png", "compare.json"):
        victims[name] = tmp_path / f"victim-{name}"
        victims[name].write_text("keep\n")
        (out / name).symlink_to(victims[name])
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    assert all(v.read_text() == "keep\n" for v in victims.values())
    assert (out / "compare.md").read_text().startswith("# grpo-lens compare")


def test_calibrate_through_planted_links_changes_nothing_outside(tmp_path):
    # calibrate wrote calibration.json / .md, levels.json and planted.json with plain writes, which follow
    # a link planted in --out to the file it names; now each link is replaced and its target keeps its bytes
    import numpy as np

    from grpo_lens.calibrate import CalibrationConfig, render, run_calibration, run_planted

    out = tmp_path / "cal"
    out.mkdir()
    victims = {}
    for name in ("calibration.json", "calibration.md", "levels.json", "planted.json"):
        victims[name] = tmp_path / f"victim-{name}"
        victims[name].write_text("keep\n")
        (out / name).symlink_to(victims[name])
    tiny = CalibrationConfig(
        trials=2,
        pool=30,
        coverage_trials=10,
        families=("a0.01",),
        group_cells=(16,),
        s4_families=(),
        mc_families={},
        baseline_families={},
        training=False,
        workers=1,
    )
    res = run_calibration(tiny, out, mode="quick", log=lambda s: None)
    planted = _planted(tmp_path / "p.npz", gram=np.eye(2).reshape(1, 1, 2, 2), rewards=np.array([[[0.0, 1.0]]]))
    run_planted(planted, out, log=lambda s: None)
    assert all(v.read_text() == "keep\n" for v in victims.values())
    assert not any((out / name).is_symlink() for name in victims)
    assert (out / "calibration.md").read_text() == render(res)
    assert json.loads((out / "planted.json").read_text())[0]["trials"] == 1


@pytest.mark.e2e
def test_compare_md_escapes_run_names_and_config_values(tmp_path, capsys):
    # A run name with raw HTML and a config value with a newline and a heading: both stay inside one code span.
    a = training_run(tmp_path / "<img src=x onerror=alert(1)>")
    b = training_run(tmp_path / "b", estimator="rloo\n# Injected heading\n`x`")
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "# Injected heading" not in md.splitlines()  # no line is the injected heading
    assert not any(line.startswith("# Injected") for line in md.splitlines())
    assert "`<img src=x onerror=alert(1)>`" in md  # in a code span: shown as text, not rendered as HTML
    assert "`` rloo # Injected heading `x` ``" in md  # the value's backticks cannot close its span: a longer fence


@pytest.mark.e2e
def test_report_and_compare_into_an_unwritable_folder_are_one_line(tmp_path, capsys, monkeypatch):
    # Simulated (the tests may run as root, who writes anywhere): the folder refuses new files / reports no access.
    import errno

    import grpo_lens.report.compare as compare
    import grpo_lens.rundir as rundir

    run = training_run(tmp_path / "run")
    b = training_run(tmp_path / "b", estimator="rloo")
    real_open = os.open

    def refuse(path, flags, *args):
        if ".tmp-" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(rundir.os, "open", refuse)
    assert main(["report", str(run)]) == 2
    line = one_error_line(capsys)
    assert "cannot write" in line and str(run) in line and "Permission denied" in line
    monkeypatch.setattr(rundir.os, "open", real_open)
    monkeypatch.setattr(compare.os, "access", lambda *a: False)
    assert main(["compare", str(run), str(b), "--out", str(tmp_path / "cmp")]) == 2
    assert "not writable" in one_error_line(capsys)
    assert not (tmp_path / "cmp").exists()


@pytest.mark.e2e
def test_compare_out_under_a_file_is_refused_before_computing(tmp_path, capsys):
    a, b = training_run(tmp_path / "a"), training_run(tmp_path / "b", estimator="rloo")
    (tmp_path / "file").write_text("x")
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "file" / "cmp")]) == 2
    assert "is a file" in one_error_line(capsys)


# --- item 5: a reward that changes the working folder ------------------------------------------------------------
TRAIN = tiny_train_args()


def chdir_reward(prompts, completions, **kwargs):
    """What a code-execution sandbox does: work in its own folder (and leave the process there)."""
    sandbox = Path("sandbox").absolute()
    sandbox.mkdir(exist_ok=True)
    os.chdir(sandbox)
    return [float(n % 2) for n in range(len(completions))]


@pytest.mark.e2e
def test_a_reward_that_changes_folder_does_not_move_the_run(tmp_path, capsys, monkeypatch):
    from grpo_lens.rewards import REWARDS

    if "test_chdir" not in REWARDS:
        REWARDS.register("test_chdir")(chdir_reward)
    monkeypatch.chdir(tmp_path)
    assert main(TRAIN + ["--rewards", "test_chdir", "--out", "p_chdir"]) == 0
    said = capsys.readouterr().out
    run = tmp_path / "p_chdir"
    assert (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()
    assert f"run written to {run}" in said  # the path printed is where the run is
    assert not (tmp_path / "sandbox" / "p_chdir" / "metrics.jsonl").exists()


# --- item 6: every row checked against the context --------------------------------------------------------------
@pytest.mark.e2e
def test_a_long_prompt_past_row_10000_is_refused_with_a_count(tmp_path, monkeypatch):
    """Before: only the first 10,000 rows were tokenized at start, so rows 10,005 and 10,007 (100+ tokens with 2 new
    ones, past the 64 positions) trained; now every row is checked (batched), and the count is said."""
    import grpo_lens.train.loop as loop
    from grpo_lens.config import TrainConfig
    from grpo_lens.models import build_tiny_model

    def short_context(name, dtype, device):
        model, tokenizer = build_tiny_model()
        model.config.max_position_embeddings = 64
        return model, tokenizer

    monkeypatch.setattr(loop, "load_model", short_context)
    rows = [{"prompt": f"{n} + 1 ="} for n in range(10_010)]
    rows[10_004]["prompt"] = rows[10_006]["prompt"] = "x" * 100  # rows 10,005 and 10,007 (1-based)
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = TrainConfig(
        model="tiny",
        task="jsonl",
        dataset=str(data),
        rewards=["test_alternating"],
        group_size=2,
        prompts_per_step=1,
        max_new_tokens=2,
        max_steps=1,
        lens_every=0,
        device="cpu",
        out=str(tmp_path / "run"),
        progress=False,
        save_final_model=False,
    )
    with pytest.raises(ValueError, match=r"row 10005: the prompt is 1\d\d tokens.*64 positions.*2 of 10,010 prompts"):
        loop.train(config)
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_prompt_lengths_equal_the_one_prompt_token_count():
    """The batched count equals len(prompt_token_ids) for string prompts without a template and chat prompts with one
    (prefill included), and a template that raises names the prompt's index."""
    from grpo_lens.models import build_tiny_model
    from grpo_lens.rollout import PromptFormatError, prompt_lengths, prompt_token_ids

    _, tok = build_tiny_model()
    chats = ["What is 2 + 3?", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]]
    assert prompt_lengths(tok, chats, chunk=1) == [len(prompt_token_ids(tok, p)) for p in chats]
    tok.chat_template = None
    plain = ["a", "b c d e", "x" * 50]
    assert prompt_lengths(tok, plain, chunk=2) == [len(prompt_token_ids(tok, p)) for p in plain]
    with pytest.raises(PromptFormatError, match="no chat template") as err:
        prompt_lengths(tok, ["a", [{"role": "user", "content": "b"}]])
    assert err.value.index == 1
    tok.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}x"
    )
    with pytest.raises(PromptFormatError, match="System role not supported.*system message") as err:
        prompt_lengths(tok, ["a", [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}]])
    assert err.value.index == 1
    tok.chat_template = "{{ cycler.__init__.__globals__.os.popen('touch ran.txt').read() }}"  # a crafted template
    with pytest.raises(PromptFormatError, match="SecurityError"):  # transformers' sandbox refuses; one line
        prompt_lengths(tok, ["a"])
    assert not Path("ran.txt").exists()


# --- item 7: resource bombs --------------------------------------------------------------------------------------
def alias_bomb() -> str:
    """A 'billion laughs' in under 1 KB: nine levels of nine aliases expand to 9^9 ~ 3.9e8 strings."""
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for prev, name in zip("abcdefgh", "bcdefghi"):
        text += f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]\n"
    return text


def test_yaml_alias_bomb_deep_nesting_and_recursion_are_refused_before_building():
    import yaml

    from grpo_lens.config.base import safe_load_yaml

    assert len(alias_bomb()) < 1024
    with pytest.raises(yaml.YAMLError, match="expands to more than 100,000 values"):
        safe_load_yaml(alias_bomb())
    with pytest.raises(yaml.YAMLError, match="recursive alias"):
        safe_load_yaml("a: &a [*a]")
    with pytest.raises(yaml.YAMLError, match="more than 64"):
        safe_load_yaml("x: " + "[" * 65 + "]" * 65)  # 66 levels: the mapping, then 65 lists
    assert safe_load_yaml("x: " + "[" * 62 + "]" * 62) is not None  # 63 levels: read
    # a few aliases are fine: 3 uses of a 4-value list
    assert safe_load_yaml("a: &a [1, 2, 3, 4]\nb: [*a, *a, *a]")["b"] == [[1, 2, 3, 4]] * 3


def test_yaml_integers_are_decimal_and_dumped_strings_read_back():
    # YAML 1.1 read 010 as octal 8 (max_steps: 010 trained 8 steps) and 1:30 as sexagesimal 90.
    from grpo_lens.config.base import safe_load_yaml

    assert safe_load_yaml("a: 010\nb: 0o10\nc: 0x1f\nd: -1_000\ne: 0b11\nf: 1:30\ng: '010'\nh: 7") == {
        "a": 10,
        "b": "0o10",  # safe_dump writes this string unquoted: it must read back as the string
        "c": 31,
        "d": -1000,
        "e": 3,
        "f": "1:30",
        "g": "010",
        "h": 7,
    }
    import yaml

    for value in ("0o10", "1:30", "010", "0x1f", "1_000", "yes"):  # every string round-trips through safe_dump
        assert safe_load_yaml(yaml.safe_dump({"v": value})) == {"v": value}


@pytest.mark.e2e
def test_alias_bomb_in_config_or_a_runs_config_yaml_is_one_line(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert main(TRAIN + ["--config", str(bomb), "--out", str(tmp_path / "run")]) == 2
    line = one_error_line(capsys)
    assert str(bomb) in line and "alias bomb" in line
    run = training_run(tmp_path / "resumed")
    (run / "config.yaml").write_text(alias_bomb())
    assert main(["train", "--resume", "--out", str(run)]) == 2
    line = one_error_line(capsys)
    assert str(run / "config.yaml") in line and "alias bomb" in line
    b = training_run(tmp_path / "b")
    assert main(["compare", str(run), str(b), "--out", str(tmp_path / "cmp")]) == 2
    assert str(run / "config.yaml") in one_error_line(capsys)


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.e2e
def test_json_nested_100000_deep_is_one_line_naming_the_file(tmp_path, capsys):
    # metrics.jsonl: report and compare
    run = training_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "x": ' + DEEP + "}\n" + json.dumps({"step": 5}) + "\n")
    assert main(["report", str(run)]) == 2
    line = one_error_line(capsys)
    assert f"{run / 'metrics.jsonl'}, line 4" in line and "nested deeper" in line
    b = training_run(tmp_path / "b")
    assert main(["compare", str(run), str(b), "--out", str(tmp_path / "cmp")]) == 2
    assert "line 4" in one_error_line(capsys)
    # probe.json
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "probe.json").write_text(DEEP)
    assert main(["report", str(probe)]) == 2
    assert str(probe / "probe.json") in one_error_line(capsys)
    # a JSONL dataset column: train refuses before --out
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": "5"})[:-1] + ', "deep": ' + DEEP + "}\n")
    assert (
        main(
            TRAIN
            + [
                "--rewards",
                "test_alternating",
                "--task",
                "jsonl",
                "--dataset",
                str(data),
                "--out",
                str(tmp_path / "new"),
            ]
        )
        == 2
    )
    line = one_error_line(capsys)
    assert f"{data}, row 1" in line and "nested deeper" in line
    assert not (tmp_path / "new").exists()


@pytest.mark.e2e
@pytest.mark.parametrize(
    "text,expect",
    [("{}", "no meta, per_group_size object"), ("[]", "a JSON list"), ('{"meta": {}, "per_group_', "not valid JSON")],
    ids=["empty-object", "list", "cut"],
)
def test_report_on_a_probe_json_that_is_not_a_probe_is_one_line(tmp_path, capsys, text, expect):
    (tmp_path / "probe.json").write_text(text)
    assert main(["report", str(tmp_path)]) == 2
    line = one_error_line(capsys)
    assert str(tmp_path / "probe.json") in line and expect in line
    assert not (tmp_path / "report.md").exists()


@pytest.mark.e2e
def test_report_on_nan_and_infinity_metrics(tmp_path, capsys):
    run = training_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/mean": NaN, "reward/accuracy": Infinity, "loss/policy": -Infinity}\n')
    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    assert (run / "report.md").read_text().startswith("# grpo-lens report")


# --- item 7 / 8: calibrate's planted file and arguments ------------------------------------------------------------
def _planted(path: Path, **arrays) -> Path:
    import numpy as np

    np.savez_compressed(path, **arrays)
    return path


def test_planted_zip_bomb_and_huge_headers_are_refused_before_reading(tmp_path):
    """A zip whose array header declares 2.2 GB of zeros (a 2 MB bomb once reached 2.2 GB before its refusal), a
    header claiming 10^12 entries, a bare .npy: one line each, read from the zip directory and the .npy header alone."""
    import zipfile

    import numpy as np

    from grpo_lens.calibrate import PlantedFileError, check_npz_sizes

    bomb = tmp_path / "bomb.npz"
    header = io_header(np, (275_000_000,), "<f8")  # 2.2 GB of float64 zeros
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z, z.open("gram.npy", "w", force_zip64=True) as f:
        f.write(header)
        zeros = bytes(1 << 20)
        for _ in range(4):  # only 4 MiB written: the header's declared size is refused before any data is read
            f.write(zeros)
    with pytest.raises(PlantedFileError, match=r"array 'gram' declares shape \[275000000\]"):
        check_npz_sizes(bomb)
    lying = tmp_path / "lying.npz"
    with zipfile.ZipFile(lying, "w") as z:
        z.writestr("gram.npy", io_header(np, (10**12,), "<f8"))
    with pytest.raises(PlantedFileError, match=r"\[1000000000000\] of float64 \(8,000,000,000,000 bytes\)"):
        check_npz_sizes(lying)
    bare = tmp_path / "gram.npy"
    np.save(bare, np.zeros((2, 1, 2, 2)))
    with pytest.raises(PlantedFileError, match="not a .npz archive"):
        check_npz_sizes(bare)
    fine = _planted(tmp_path / "ok.npz", gram=np.zeros((2, 1, 2, 2)), rewards=np.zeros((2, 1, 2)))
    check_npz_sizes(fine)  # 64 + 32 bytes: no error


def io_header(np, shape, descr) -> bytes:
    """A .npy file's magic and header for ``shape`` (no data)."""
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()  # write_array_header_1_0 writes the magic string too


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args,expect",
    [
        (["--trials", "0"], "--trials 0: must be >= 1"),
        (["--out", "{tmp}/file"], "is a file"),
        (["--out", "{tmp}/file/sub"], "is under the file"),
        (["--planted", "{tmp}/x.npy"], "not a .npz archive"),
    ],
    ids=["trials-0", "out-file", "out-under-file", "planted-npy"],
)
def test_calibrate_bad_arguments_are_one_line_before_computing(tmp_path, capsys, monkeypatch, args, expect):
    import numpy as np

    import grpo_lens.calibrate as calibrate

    monkeypatch.setattr(calibrate, "run_calibration", lambda *a, **k: pytest.fail("computed before checking"))
    (tmp_path / "file").write_text("mine\n")
    np.save(tmp_path / "x.npy", np.zeros(3))
    argv = ["calibrate", "--out", str(tmp_path / "cal"), *[a.replace("{tmp}", str(tmp_path)) for a in args]]
    assert main(argv) == 2
    assert expect in one_error_line(capsys)
    assert (tmp_path / "file").read_text() == "mine\n" and not (tmp_path / "cal").exists()


@pytest.mark.e2e
def test_model_export_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("mine\n")
    assert main(["model", "tiny", "--export", str(tmp_path / "file" / "m")]) == 2
    assert "--export" in one_error_line(capsys)


# --- item 8 / 9: sizes that cannot be allocated, a run that never finished a step --------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize(
    "argv,expect",
    [
        (
            ["train", "--group-size", "1000000000"],
            "'group_size' (flag --group-size) = 1000000000: must be at most 4,096",
        ),
        (["probe", "--group-sizes", "2", "100000000"], "each group size must be an integer >= 2 and <= 4,096"),
    ],
    ids=["train-group-size-1e9", "probe-group-sizes-1e8"],
)
def test_group_sizes_that_cannot_be_held_are_refused_before_writing(tmp_path, capsys, argv, expect):
    # Before: a 488 GB allocation error in the first step, with config.yaml left behind (the retry was refused).
    out = tmp_path / "run"
    assert main([*argv, "--model", "tiny", "--device", "cpu", "--out", str(out)]) == 2
    assert expect in one_error_line(capsys)
    assert not out.exists()


@pytest.mark.e2e
def test_a_run_that_stopped_before_its_first_step_does_not_block_the_retry(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("group_size: 1000000000\n")  # what the failed first step left
    (out / "metrics.jsonl").write_text("")
    (out / "checkpoints").mkdir()
    assert main(TRAIN + ["--rewards", "test_alternating", "--out", str(out)]) == 0, capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    # a run with a step is still refused without --overwrite or --resume
    assert main(TRAIN + ["--rewards", "test_alternating", "--out", str(out)]) == 2
    assert "already holds a run" in one_error_line(capsys)


# --- item 8 / 9: broken model folders, custom code ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """The tiny model saved as a Hugging Face folder (config.json, model.safetensors, tokenizer files)."""
    from grpo_lens.models import build_tiny_model

    model, tokenizer = build_tiny_model()
    path = tmp_path_factory.mktemp("models") / "tiny"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


class Boom:
    """A pickle that would write a file when loaded (weights_only refuses it before it runs)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "ran"))


def _break_config(p: Path) -> None:
    (p / "config.json").write_text("{")


def _no_weights(p: Path) -> None:
    (p / "model.safetensors").unlink()


def _other_shapes(p: Path) -> None:
    cfg = json.loads((p / "config.json").read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    (p / "config.json").write_text(json.dumps(cfg))


def _cut_tokenizer(p: Path) -> None:
    text = (p / "tokenizer.json").read_text()
    (p / "tokenizer.json").write_text(text[: len(text) // 2])


def _small_embedding(p: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(p)
    model.resize_token_embeddings(100)  # the tokenizer has 259 tokens
    model.config.pad_token_id = 0  # the tiny model's pad id (258) has no row now: a folder that still loads
    model.save_pretrained(p, safe_serialization=True)


def _bad_generation_config(p: Path) -> None:
    (p / "generation_config.json").write_text('{"eos_token_id": [1, 2')


def _pickled_bin(p: Path) -> None:
    import pickle

    (p / "model.safetensors").unlink()
    (p / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Boom(str(p.parent / "ran.txt"))}))


def _custom_tokenizer_code(p: Path) -> None:
    cfg = json.loads((p / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["custom_tok.CustomTokenizer", None]}
    (p / "tokenizer_config.json").write_text(json.dumps(cfg))
    (p / "custom_tok.py").write_text(
        f"from pathlib import Path\nPath({str(p.parent / 'ran.txt')!r}).write_text('ran')\n"
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    "edit,expect",
    [
        (_break_config, "could not load the model folder"),
        (_no_weights, "could not load the model folder"),
        (_other_shapes, "could not load the model folder"),
        (_cut_tokenizer, "could not load the model folder"),
        (_small_embedding, "embedding has 100 rows but its tokenizer has 259 tokens"),
        (_pickled_bin, "could not load the model folder"),
        (_bad_generation_config, "generation_config.json is not valid JSON"),
    ],
    ids=[
        "invalid-config",
        "no-weights",
        "shape-mismatch",
        "cut-tokenizer",
        "small-embedding",
        "pickle-bin",
        "bad-generation-config",
    ],
)
def test_a_broken_model_folder_is_one_line_and_runs_nothing(tmp_path, capsys, tiny_folder, edit, expect):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    edit(folder)
    out = tmp_path / "run"
    argv = ["train", "--model", str(folder), "--group-size", "2", "--prompts-per-step", "1", "--max-new-tokens", "2"]
    assert main([*argv, "--max-steps", "1", "--device", "cpu", "--rewards", "test_alternating", "--out", str(out)]) == 2
    line = one_error_line(capsys)
    assert expect in line and str(folder) in line, line
    assert not out.exists() and not (tmp_path / "ran.txt").exists()  # nothing written, no code from the folder ran


@pytest.mark.e2e
def test_a_tokenizer_asking_for_custom_code_never_runs_it(tmp_path, capsys, monkeypatch, tiny_folder):
    """trust_remote_code is pinned to False in every from_pretrained (before: unset, so a terminal prompted
    'run the custom code? [y/N]' and y ran it): the folder's code never runs, whatever the answer would be."""
    import shutil

    import transformers

    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    _custom_tokenizer_code(folder)
    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, *args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    monkeypatch.setattr("builtins.input", lambda *a: "y")  # a user who would say yes
    from grpo_lens.models import load_model

    try:
        load_model(str(folder))
    except Exception:  # noqa: BLE001 - refusing is fine; running the code is not
        pass
    assert seen == [False] and not (tmp_path / "ran.txt").exists()


# --- item 9: a seed out of range, plugins for --version, an ASCII terminal ----------------------------------------
@pytest.mark.e2e
def test_a_seed_out_of_torchs_range_names_the_flag(tmp_path, capsys):
    # Before: "Overflow when unpacking long long" from torch.manual_seed, after config.yaml was written.
    assert main(TRAIN + ["--rewards", "test_alternating", "--seed", str(2**64), "--out", str(tmp_path / "r")]) == 2
    line = one_error_line(capsys)
    assert "--seed" in line and "2**64 - 1" in line and not (tmp_path / "r").exists()


def _cli(args: list[str], env: dict[str, str], cwd: Path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    extra = env.pop("PYTHONPATH", "")
    full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), str(root / "tests"), extra]))}
    return subprocess.run(
        [sys.executable, "-m", "grpo_lens.cli", *args], env=full, cwd=cwd, capture_output=True, timeout=120
    )


@pytest.mark.e2e
def test_version_imports_no_plugin(tmp_path):
    # A plugin module that would fail (or run anything) is not imported for --version.
    (tmp_path / "noisy_plugin.py").write_text("raise SystemExit('imported')\n")
    result = _cli(["--version"], {"GRPO_LENS_PLUGINS": "noisy_plugin", "PYTHONPATH": str(tmp_path)}, tmp_path)
    assert result.returncode == 0 and result.stdout.decode().startswith("grpo-lens "), result.stderr


@pytest.mark.e2e
def test_an_ascii_terminal_with_a_non_ascii_out_prints_the_last_line(tmp_path):
    run = training_run(tmp_path / "lauf-ü")
    result = _cli(["report", str(run)], {"PYTHONIOENCODING": "ascii"}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "report written to" in result.stdout.decode("ascii") and "lauf-\\xfc" in result.stdout.decode("ascii")


# --- item 9: rows once per epoch, selectable ----------------------------------------------------------------------
def test_epoch_rows_are_each_row_once_per_pass_and_a_function_of_position():
    from grpo_lens.tasks.base import epoch_rows

    rows = list(range(8))
    first = [epoch_rows(rows, 2, 2 * s, seed=0) for s in range(4)]  # 4 steps of B = 2: one epoch
    assert sorted(r for step in first for r in step) == rows  # every row once (independent draws: 6 of 8, one twice)
    second = epoch_rows(rows, 8, 8, seed=0)
    assert sorted(second) == rows and second != [r for step in first for r in step]  # a new shuffle each epoch
    assert epoch_rows(rows, 3, 7, seed=0) == [first[3][1], *second[:2]]  # across the epoch boundary, same rows
    assert epoch_rows(rows, 8, 0, seed=1) != [r for step in first for r in step]  # the seed changes the order


@pytest.mark.e2e
def test_prompt_order_epoch_trains_every_row_once_per_pass(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"row {i}:", "answer": str(i)}) + "\n" for i in range(4)))
    out = tmp_path / "run"
    argv = TRAIN + ["--rewards", "test_alternating", "--task", "jsonl", "--dataset", str(data), "--out", str(out)]
    assert main([*argv, "--prompt-order", "epoch", "--max-steps", "4", "--log-completions", "1"]) == 0
    seen = [json.loads(line)["prompt"] for line in (out / "completions.jsonl").read_text().splitlines()]
    assert sorted(seen) == [f"row {i}:" for i in range(4)], seen  # B = 1, 4 steps, 4 rows: each once
    assert main(TRAIN + ["--rewards", "test_alternating", "--prompt-order", "epoch", "--out", str(tmp_path / "a")]) == 2
    assert "--prompt-order epoch needs a dataset" in one_error_line(capsys)


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["mask", "filter"])
def test_every_completion_truncated_under_overlong_mask_or_filter_stops_with_a_line(tmp_path, capsys, mode):
    # The tiny random model never writes EOS within 2 tokens: every completion is cut, so mask / filter zero every
    # advantage. Before: exit 0, nothing trained, no word.
    out = tmp_path / "run"
    argv = TRAIN + ["--rewards", "test_alternating", "--overlong", mode, "--max-steps", "2", "--out", str(out)]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert "every completion of the last 2 steps was cut at --max-new-tokens 2" in line and f"--overlong {mode}" in line


# --- item 8: probe on a full disk, into an unwritable folder -----------------------------------------------------
PROBE = ["probe", "--model", "tiny", "--group-sizes", "2", "--prompts", "2", "--max-new-tokens", "2", "--no-progress"]


@pytest.mark.e2e
@pytest.mark.parametrize("errno_name,expect", [("ENOSPC", "disk full while writing"), ("EACCES", "cannot write")])
def test_probe_on_a_full_disk_or_unwritable_folder_is_one_line(tmp_path, capsys, monkeypatch, errno_name, expect):
    # Before: the partial probe's torch.save raised its zip writer's RuntimeError (a traceback) on a full disk, and
    # open() a PermissionError. Every probe file now goes through rundir.write_file: the error is one line.
    import errno

    import grpo_lens.rundir as rundir

    real_open = os.open

    def failing(path, flags, *args):
        if ".pt.tmp-" in str(path):  # a partial probe's prompt record (torch.save), after its config.yaml
            code = getattr(errno, errno_name)
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(rundir.os, "open", failing)
    assert main([*PROBE, "--rewards", "test_alternating", "--out", str(tmp_path / "p")]) == 2
    assert expect in one_error_line(capsys)


@pytest.mark.e2e
def test_a_non_utf8_config_names_the_file(tmp_path, capsys):
    # Before: "'utf-8' codec can't decode byte 0xff ..." without the file's name.
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("model: tiny\n# caf\xe9\n".encode("latin-1"))
    assert main(TRAIN + ["--config", str(bad), "--out", str(tmp_path / "run")]) == 2
    line = one_error_line(capsys)
    assert str(bad) in line and "not UTF-8" in line
    run = training_run(tmp_path / "old")
    (run / "config.yaml").write_bytes(bad.read_bytes())
    assert main(["train", "--resume", "--out", str(run)]) == 2
    assert str(run / "config.yaml") in one_error_line(capsys)


@pytest.mark.parametrize(
    "record,expect",
    [
        ({"status": "mixed", "s1_prediction": 0.5, "row": [1, 2]}, "field 'row' is a list, not a mapping"),
        ({"status": "mixed", "s1_prediction": "0.5", "row": {}}, "field 's1_prediction' is a str, not a number"),
        ({"status": "done"}, "field 'status' is 'done'"),
        ({"status": "mixed"}, "a mixed group's record has no 'row'"),
    ],
    ids=["row-list", "s1-str", "status", "mixed-no-row"],
)
def test_a_partial_probe_record_with_wrong_field_types_is_one_line(tmp_path, record, expect):
    # Before: the record loaded as it was (its types checked nowhere), to fail later, if at all, inside the analysis.
    import torch

    from grpo_lens.config import ConfigError
    from grpo_lens.probe.partial import PartialProbe

    probe = PartialProbe(tmp_path)
    (probe.path / "R2").mkdir(parents=True)
    torch.save(record, probe.path / "R2" / "prompt-00000.pt")
    with pytest.raises(ConfigError, match="prompt-00000.pt") as err:
        probe.prompt_records(2)
    assert expect in str(err.value) and "delete it" in str(err.value)
