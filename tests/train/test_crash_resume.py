"""Crash safety: SIGKILL the trainer at many moments, resume with --resume, and get the uninterrupted run exactly.

One run directory is killed again and again, each time at another moment of a 4-step run (checkpoint every 2 steps,
keep 1), and resumed each time; a second one is killed from outside at an arbitrary moment by the test. On the CPU
both must end with the parameters and optimizer state of an uninterrupted run bit for bit, and with metrics.jsonl and
completions.jsonl holding every step once with the uninterrupted run's values (perf/ timing keys aside).

Kill points inside the trainer come from ``GRPO_LENS_TEST_KILL_AT=POINT@STEP`` (grpo_lens.rundir.crash_point). The
processes are real: the external kill hits ``python -m grpo_lens.cli train``; the others are forked from
tests/crash_zygote.py, which has the imports done already, so that a dozen processes take seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from crash_zygote import RUN_ARGS

pytestmark = pytest.mark.e2e  # every test here builds a model or runs a command

TESTS = Path(__file__).resolve().parents[1]  # tests/, where crash_zygote.py lives
REPO = TESTS.parent

ARGS = RUN_ARGS  # tests/crash_zygote.py

# (kill point, then what the run directory must show: the checkpoint ``latest`` names, folders present). Each resume
# starts from the newest complete checkpoint (or step 0) and redoes the steps after it.
CHAIN = [
    ("after_metrics_write@1", None, []),  # step 1 logged, no checkpoint
    ("mid_checkpoint@2", None, [".step-000002.tmp-"]),  # model.safetensors written, no rename
    ("after_checkpoint_rename@2", None, ["step-000002"]),  # folder in place, ``latest`` not yet
    ("during_generation@3", "step-000002", ["step-000002"]),  # inside model.generate
    ("before_optimizer_step@4", "step-000002", ["step-000002"]),  # gradient computed, not applied
    ("after_latest@4", "step-000004", ["step-000002", "step-000004"]),  # old checkpoint not yet cleaned up
    ("mid_final_model", "step-000004", ["step-000004"]),  # final_model/ half written
]


def env_for(kill: str | None = None) -> dict[str, str]:
    # One thread: on a busy 2-core machine two OpenMP threads per tiny matmul make a run ~8x slower.
    env = {
        "GRPO_LENS_PLUGINS": "helpers_rewards",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    if kill:
        env["GRPO_LENS_TEST_KILL_AT"] = kill
    return env


class Zygote:
    """tests/crash_zygote.py as a child process: ``start`` forks one CLI process, ``wait`` returns its status."""

    def __init__(self, log_dir: Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]), **env_for()}
        env.pop("GRPO_LENS_TEST_KILL_AT", None)
        self.log_dir = log_dir
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "crash_zygote.py")],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.count = 0

    def ready(self) -> None:
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def start(self, argv: list[str], kill: str | None = None) -> int:
        self.count += 1
        log = self.log_dir / f"run{self.count:02d}.log"
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env_for(kill), "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["pid"]

    def wait(self) -> int:
        return json.loads(self.proc.stdout.readline())["rc"]

    def run(self, argv: list[str], kill: str | None = None) -> int:
        self.start(argv, kill)
        return self.wait()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_perf(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


def final_state(run: Path) -> tuple[dict, dict]:
    """(parameters, optimizer state tensors) of the run's last checkpoint."""
    from safetensors.torch import load_file

    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    optim = torch.load(ckpt / "optimizer.pt", weights_only=False)["state"]
    return load_file(str(ckpt / "model.safetensors")), {(i, k): v for i, s in optim.items() for k, v in s.items()}


def assert_same_run(run: Path, reference: Path) -> None:
    params, optim = final_state(run)
    ref_params, ref_optim = final_state(reference)
    assert params.keys() == ref_params.keys() and optim.keys() == ref_optim.keys()
    for name in ref_params:
        assert torch.equal(params[name], ref_params[name]), name
    for key in ref_optim:
        assert torch.equal(optim[key], ref_optim[key]), key
    metrics, ref_metrics = read_jsonl(run / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # each step once, in order
    assert without_perf(metrics) == without_perf(ref_metrics)
    assert read_jsonl(run / "completions.jsonl") == read_jsonl(reference / "completions.jsonl")
    assert (run / "final_model" / "model.safetensors").is_file()
    assert not list(run.glob(".final_model.tmp-*")) and not list((run / "checkpoints").glob(".step-*"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-000004"]


def test_kill_anywhere_then_resume_equals_the_uninterrupted_run(tmp_path):
    ref, chain, ext = tmp_path / "reference", tmp_path / "chain", tmp_path / "external"
    # A real `python -m grpo_lens.cli train`, killed from outside once step 1 is logged: wherever in step 2 (or its
    # checkpoint) the kill lands, the resumed run must come out the same. It imports while the zygote does.
    outside = subprocess.Popen(
        [sys.executable, "-m", "grpo_lens.cli", *ARGS, "--out", str(ext)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]), **env_for()},
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "external.log", "w"),
    )
    zygote = Zygote(tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not ((ext / "metrics.jsonl").exists() and (ext / "metrics.jsonl").read_text().count("\n") >= 1):
            assert outside.poll() is None, (tmp_path / "external.log").read_text()
            assert time.monotonic() < deadline, "the trainer did not log step 1 in time"
            time.sleep(0.02)
        outside.send_signal(signal.SIGKILL)
        assert outside.wait(timeout=30) == -signal.SIGKILL

        zygote.ready()
        assert zygote.run(ARGS + ["--out", str(ref)]) == 0, (tmp_path / "run01.log").read_text()

        for i, (kill, latest, present) in enumerate(CHAIN):
            argv = ARGS + ["--out", str(chain)] + (["--resume"] if i else [])
            rc = zygote.run(argv, kill)
            assert rc == -signal.SIGKILL, f"{kill}: exit status {rc}; log: {tmp_path}/run{zygote.count:02d}.log"
            pointer = chain / "checkpoints" / "latest"
            assert (pointer.read_text().strip() if pointer.exists() else None) == latest, kill
            names = [p.name for p in (chain / "checkpoints").iterdir()] if (chain / "checkpoints").exists() else []
            for folder in present:
                assert any(n.startswith(folder) for n in names), f"{kill}: no {folder} in {names}"
        assert list(chain.glob(".final_model.tmp-*")) and not (chain / "final_model").exists()

        for run in (chain, ext):
            assert zygote.run(["train", "--out", str(run), "--resume"]) == 0, f"see logs in {tmp_path}"
    finally:
        if outside.poll() is None:
            outside.kill()
        zygote.close()
    assert_same_run(chain, ref)
    assert_same_run(ext, ref)
