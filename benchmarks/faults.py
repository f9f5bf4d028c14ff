"""Fault injection on a tiny training run: every fault, then a resume, must give the uninterrupted run exactly.

    python benchmarks/faults.py [--kills 20] [--seed 0] [--keep DIR]

The run: the tiny Llama built from a config (``--model tiny``), 4 steps of B = 2 prompts x R = 4 rollouts, a
checkpoint every 2 steps (keep 1), the lens on step 3, on the CPU. A reference run goes through uninterrupted; each
case below damages another copy of the run and resumes it with ``--resume`` until it finishes, then compares the
final checkpoint's weights and AdamW state (bit for bit), metrics.jsonl (timings aside) and completions.jsonl with
the reference's. Cases:

- ``sigkill``: N runs, each SIGKILLed at a uniformly random moment of its life (from the outside, as kill -9 does),
  then resumed (the resume itself also killed at random with probability 1/2, then resumed again).
- ``torn/<file>``: the write of a run-directory file cut short. A kill mid-append leaves a torn last line in
  metrics.jsonl / completions.jsonl; a kill mid atomic-write leaves a half-written temporary file (config.yaml,
  checkpoints/latest, a checkpoint's model.safetensors / optimizer.pt / state.pt, final_model): each must resume
  identically. The same files torn *in place* (a damaged disk, not something a kill can do: those writes are atomic)
  must be refused in one line, exit status 2, no traceback (``refused`` in the table).
- ``disk-full``: a 2 MiB-short tmpfs (as root; otherwise a plugin that makes the checkpoint write raise ENOSPC): the
  run must stop with one line "disk full while writing ...", then resume identically once space is freed.
- ``two-writers``: a second ``train --overwrite`` and a ``train --resume`` of a live run are refused naming the
  holder's pid, and the live run finishes identical to the reference (it waits 4 s after each step, a plugin that
  changes nothing else, so that the second writer meets it alive on a fast machine too).

Processes are forked from tests/crash_zygote.py (imports paid once), each one a real ``grpo-lens train``. Prints one
line per case and ``n / n identical`` per kind. About 11 minutes with --kills 20 on a 2-core machine at load 9-10
(``--only`` and ``--kills`` pick fewer cases).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
sys.path.insert(0, str(TESTS))
from crash_zygote import RUN_ARGS  # noqa: E402 - tests/ holds the shared argv

ARGS = RUN_ARGS  # tests/crash_zygote.py

#: The plugin module that simulates a full disk where no tmpfs can be mounted: the checkpoint of step 4 fails with
#: ENOSPC (an OSError, as a real write would raise).
DISK_FULL_PLUGIN = """
import errno
import grpo_lens.rundir as rundir
_save = rundir.torch.save
def _full(obj, f, *args, **kwargs):
    if isinstance(obj, dict) and obj.get("step") == 4 or "step-000004" in str(f):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))
    return _save(obj, f, *args, **kwargs)
rundir.torch.save = _full
"""


#: A plugin that makes run A of ``two-writers`` wait 4 s after each step's metrics line (and changes nothing else), so
#: that the second writer's attempts meet it alive however fast the machine is.
SLOW_PLUGIN = """
import time
import grpo_lens.rundir as rundir
_append = rundir.RunDir.append_metrics
def _slow(self, record, path=None):
    _append(self, record, path)
    if path is None:
        time.sleep(4.0)
rundir.RunDir.append_metrics = _slow
"""


def env_for(plugins: str = "helpers_rewards") -> dict[str, str]:
    return {
        "GRPO_LENS_PLUGINS": plugins,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


class Zygote:
    """tests/crash_zygote.py as a child process: ``start`` forks one CLI process, ``wait`` returns its status."""

    def __init__(self, log_dir: Path, extra_path: Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), str(extra_path)]), **env_for()}
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
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> tuple[int, Path]:
        self.count += 1
        log = self.log_dir / f"run{self.count:03d}.log"
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env or env_for(), "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["pid"], log

    def wait(self) -> int:
        return json.loads(self.proc.stdout.readline())["rc"]

    def run(self, argv: list[str], env: dict[str, str] | None = None) -> tuple[int, Path]:
        _, log = self.start(argv, env)
        return self.wait(), log

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---------------------------------------------------------------------------------------------------------------------
# Comparing a run with the reference
# ---------------------------------------------------------------------------------------------------------------------
def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _final_state(run: Path) -> tuple[dict, dict]:
    import torch
    from safetensors.torch import load_file

    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    return load_file(str(ckpt / "model.safetensors")), {(i, k): v for i, s in optim.items() for k, v in s.items()}


def differences(run: Path, reference: Path) -> list[str]:
    """What differs between ``run`` and ``reference`` (empty: identical): weights and AdamW state bit for bit, each
    step once in metrics.jsonl with the same values (perf/ timings aside), completions.jsonl, the final model."""
    import torch

    out = []
    try:
        params, optim = _final_state(run)
    except Exception as e:  # noqa: BLE001 - reported as a difference
        return [f"no final checkpoint ({type(e).__name__}: {e})"]
    ref_params, ref_optim = _final_state(reference)
    if params.keys() != ref_params.keys() or optim.keys() != ref_optim.keys():
        out.append("different tensors")
    else:
        out += [f"weight {n}" for n in ref_params if not torch.equal(params[n], ref_params[n])][:3]
        out += [f"optimizer {k}" for k in ref_optim if not torch.equal(optim[k], ref_optim[k])][:3]

    def strip(records):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]

    metrics = _jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    if [m["step"] for m in metrics] != [1, 2, 3, 4]:
        out.append(f"metrics steps {[m['step'] for m in metrics]}")
    elif strip(metrics) != strip(_jsonl(reference / "metrics.jsonl")):
        out.append("metrics values")
    if _jsonl(run / "completions.jsonl") != _jsonl(reference / "completions.jsonl"):
        out.append("completions")
    if not (run / "final_model" / "model.safetensors").is_file():
        out.append("no final_model")
    return out


def finish(zygote: Zygote, run: Path, tries: int = 4) -> tuple[int, Path | None]:
    """Resume ``run`` until it exits 0 (at most ``tries`` times); (last exit status, its log)."""
    rc, log = 1, None
    for _ in range(tries):
        rc, log = zygote.run([*ARGS, "--out", str(run), "--resume"])
        if rc == 0:
            break
    return rc, log


def one_line_error(log: Path) -> str | None:
    """The one ``grpo-lens train: error: ...`` line of a log, or None when the log holds a traceback or no error."""
    text = log.read_text()
    if "Traceback" in text:
        return None
    lines = [line for line in text.splitlines() if line.startswith("grpo-lens train: error:")]
    return lines[0] if len(lines) == 1 else None


# ---------------------------------------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------------------------------------
def case_sigkill(
    zygote: Zygote, root: Path, reference: Path, seconds: float, rng: random.Random, i: int
) -> tuple[bool, str]:
    """One run killed from outside at a random moment (and its first resume, half the time), then resumed."""
    run = root / f"sigkill-{i:02d}"
    moments = []
    for attempt in range(2 if rng.random() < 0.5 else 1):
        argv = [*ARGS, "--out", str(run)] + (["--resume"] if attempt else [])
        delay = rng.uniform(0.02, 1.0) * seconds
        for _ in range(6):  # a run that ends before its kill (the machine ran faster) is redone with half the delay
            pid, _ = zygote.start(argv)
            time.sleep(delay)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = zygote.wait()
            if rc == -signal.SIGKILL:
                moments.append(f"{delay:.2f}s" + (" (in the resume)" if attempt else ""))
                break
            if attempt:  # the resume finished before its kill: nothing left to kill
                break
            shutil.rmtree(run, ignore_errors=True)
            delay /= 2
        if not (run / "config.yaml").exists():  # killed before the run directory was written: start it afresh
            shutil.rmtree(run, ignore_errors=True)
            rc, _ = zygote.run([*ARGS, "--out", str(run)])
            break
    if not moments:
        return False, "never killed (every run ended first)"
    rc, _ = finish(zygote, run)
    diff = differences(run, reference) if rc == 0 else [f"resume exit {rc}"]
    return not diff, f"killed at {', '.join(moments)}" + (f": {'; '.join(diff)}" if diff else "")


def _run_until(zygote: Zygote, run: Path, kill_at: str) -> None:
    env = {**env_for(), "GRPO_LENS_TEST_KILL_AT": kill_at}
    zygote.run([*ARGS, "--out", str(run)], env)


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: max(1, int(len(data) * keep))])


def torn_cases(zygote: Zygote, root: Path, reference: Path) -> list[tuple[str, bool, str]]:
    """Torn writes: those a kill can leave must resume identically; files damaged in place must be refused in one
    line. Each starts from a run killed after step 3's metrics were written (checkpoint of step 2 in charge)."""
    base = root / "torn-base"
    _run_until(zygote, base, "after_metrics_write@3")
    ckpt = "checkpoints/step-000002"
    kill_leftovers = {  # a kill in the middle of each write leaves this
        "metrics.jsonl (last line torn)": lambda r: _cut(r / "metrics.jsonl", 0.97),
        "completions.jsonl (last line torn)": lambda r: _cut(r / "completions.jsonl", 0.97),
        "config.yaml (temporary file half written)": lambda r: (r / ".config.yaml.tmp-99999").write_bytes(
            (r / "config.yaml").read_bytes()[:100]
        ),
        "checkpoints/latest (temporary file half written)": lambda r: (r / "checkpoints/.latest.tmp-99999").write_bytes(
            b"step-0"
        ),
        "model.safetensors (checkpoint folder half written)": lambda r: _half_checkpoint(r, "model.safetensors"),
        "optimizer.pt (checkpoint folder half written)": lambda r: _half_checkpoint(r, "optimizer.pt"),
        "state.pt (checkpoint folder half written)": lambda r: _half_checkpoint(r, "state.pt"),
        "final_model (temporary folder half written)": lambda r: _half_final_model(r),
    }
    in_place = {  # damage no kill can do (each of these is written atomically): refused in one line
        "config.yaml (cut in place)": lambda r: _cut(r / "config.yaml", 0.5),
        "checkpoints/latest (cut in place)": lambda r: _cut(r / "checkpoints/latest", 0.5),
        "model.safetensors (cut in place)": lambda r: _cut(r / ckpt / "model.safetensors", 0.5),
        "optimizer.pt (cut in place)": lambda r: _cut(r / ckpt / "optimizer.pt", 0.5),
        "state.pt (cut in place)": lambda r: _cut(r / ckpt / "state.pt", 0.5),
    }
    out = []
    for n, (name, damage) in enumerate(kill_leftovers.items()):
        run = root / f"torn-{n:02d}"
        shutil.copytree(base, run)
        damage(run)
        rc, _ = finish(zygote, run)
        diff = differences(run, reference) if rc == 0 else [f"resume exit {rc}"]
        out.append((f"torn/{name}", not diff, "; ".join(diff) or "resumed identical"))
    for n, (name, damage) in enumerate(in_place.items()):
        run = root / f"damaged-{n:02d}"
        shutil.copytree(base, run)
        damage(run)
        rc, log = zygote.run([*ARGS, "--out", str(run), "--resume"])
        line = one_line_error(log)
        ok = rc == 2 and line is not None
        out.append(
            (f"refused/{name}", ok, (line or log.read_text()[-300:]).replace("grpo-lens train: error: ", "")[:150])
        )
    return out


def _half_checkpoint(run: Path, cut: str) -> None:
    """A checkpoint of step 4 killed mid-write: its temporary folder with the files up to ``cut``, that one half."""
    src = run / "checkpoints" / "step-000002"
    tmp = run / "checkpoints" / ".step-000004.tmp-99999"
    tmp.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "state.pt"):
        shutil.copy(src / name, tmp / name)
        if name == cut:
            _cut(tmp / name, 0.5)
            break


def _half_final_model(run: Path) -> None:
    tmp = run / ".final_model.tmp-99999"
    tmp.mkdir()
    shutil.copy(run / "checkpoints" / "step-000002" / "model.safetensors", tmp / "model.safetensors")
    _cut(tmp / "model.safetensors", 0.3)


def case_disk_full(zygote: Zygote, root: Path, reference: Path, tmpfs: bool = True) -> tuple[str, bool, str]:
    """A full disk: a tmpfs just too small for the run (as root), else the ENOSPC plugin; one line, then a resume
    after freeing space gives the reference."""
    mount = root / "tmpfs"
    mount.mkdir()
    size = sum(p.stat().st_size for p in reference.rglob("*") if p.is_file() and "final_model" not in p.parts)
    mounted = (
        tmpfs
        and os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={max(64 * 1024, int(size * 1.2))}", "tmpfs", str(mount)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    try:
        run = mount / "run"
        if mounted:
            how = f"tmpfs of {int(size * 1.2) // 1024} KiB"
            rc, log = zygote.run([*ARGS, "--out", str(run)])
        else:
            how = "ENOSPC plugin (no tmpfs)"
            rc, log = zygote.run([*ARGS, "--out", str(run)], env_for("helpers_rewards,faults_disk_full"))
        line = one_line_error(log)
        if rc == 0:
            return f"disk-full ({how})", False, "the run did not fill the disk"
        if rc != 2 or line is None or "disk full while writing" not in line:
            return f"disk-full ({how})", False, f"exit {rc}: {log.read_text()[-300:]}"
        if mounted:  # free space: a bigger tmpfs, as clearing the disk would
            subprocess.run(["mount", "-o", f"remount,size={int(size * 4)}", str(mount)], check=True)
        rc, _ = finish(zygote, run)
        diff = differences(run, reference) if rc == 0 else [f"resume exit {rc}"]
        detail = line.replace("grpo-lens train: error: ", "")[:110]
        return f"disk-full ({how})", not diff, "; ".join(diff) or f"one line ({detail}...), resumed identical"
    finally:
        if mounted:
            shutil.copytree(mount / "run", root / "disk-full-run", dirs_exist_ok=True)
            subprocess.run(["umount", str(mount)], capture_output=True, check=False)


def case_two_writers(zygote_a: Zygote, zygote_b: Zygote, root: Path, reference: Path) -> tuple[str, bool, str]:
    """While run A writes DIR, B's --overwrite and --resume of DIR are refused naming A's pid; A ends identical."""
    run = root / "two-writers"
    pid, _ = zygote_a.start([*ARGS, "--out", str(run)], env_for("helpers_rewards,faults_slow"))
    lock = run / ".grpo-lens.lock"
    deadline = time.monotonic() + 120
    while not (lock.exists() and str(pid) in lock.read_text()):
        if time.monotonic() > deadline:
            return "two-writers", False, "run A never took the lock"
        time.sleep(0.01)
    results = []
    for flag in ("--overwrite", "--resume"):
        rc, log = zygote_b.run([*ARGS, "--out", str(run), flag])
        line = one_line_error(log) or ""
        results.append(rc == 2 and f"pid {pid}" in line)
    rc_a = zygote_a.wait()
    diff = differences(run, reference) if rc_a == 0 else [f"run A exit {rc_a}"]
    if not all(results):
        diff.append(f"second writer not refused (overwrite, resume: {results})")
    return "two-writers", not diff, "; ".join(diff) or f"--overwrite and --resume refused naming pid {pid}; A identical"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="random SIGKILL cases (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--keep", help="keep the run directories in this folder (default: a temporary one, deleted)")
    parser.add_argument(
        "--no-tmpfs",
        action="store_true",
        help="simulate the full disk with the ENOSPC plugin even where a tmpfs could be mounted",
    )
    parser.add_argument(
        "--only",
        choices=("sigkill", "torn", "disk-full", "two-writers"),
        nargs="+",
        help="run only these kinds of case (default: all)",
    )
    args = parser.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="grpo-lens-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    plugin_dir = root / "plugins"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "faults_disk_full.py").write_text(DISK_FULL_PLUGIN)
    (plugin_dir / "faults_slow.py").write_text(SLOW_PLUGIN)
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    zygote = Zygote(logs, plugin_dir)
    other = Zygote(logs, plugin_dir)
    results: list[tuple[str, bool, str]] = []
    try:
        reference = root / "reference"
        start = time.perf_counter()
        rc, log = zygote.run([*ARGS, "--out", str(reference)])
        seconds = time.perf_counter() - start
        if rc != 0:
            print(log.read_text()[-2000:])
            return 1
        print(f"reference run: {seconds:.1f} s (4 steps, tiny model, CPU)")
        kinds = set(args.only or ("sigkill", "torn", "disk-full", "two-writers"))
        for i in range(args.kills if "sigkill" in kinds else 0):
            ok, detail = case_sigkill(zygote, root, reference, seconds, rng, i)
            results.append((f"sigkill #{i + 1:02d}", ok, detail))
            print(f"  {'identical' if ok else 'DIFFERENT'}  {results[-1][0]}: {detail}", flush=True)
        cases = [
            *(torn_cases(zygote, root, reference) if "torn" in kinds else []),
            *([case_disk_full(zygote, root, reference, tmpfs=not args.no_tmpfs)] if "disk-full" in kinds else []),
            *([case_two_writers(zygote, other, root, reference)] if "two-writers" in kinds else []),
        ]
        for case in cases:
            results.append(case)
            verdict = ("refused" if case[0].startswith("refused") else "identical") if case[1] else "FAILED"
            print(f"  {verdict:9s}  {case[0]}: {case[2]}", flush=True)
    finally:
        zygote.close()
        other.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print()
    for kind in ("sigkill", "torn", "refused", "disk-full", "two-writers"):
        group = [ok for name, ok, _ in results if name.startswith(kind)]
        if group:
            word = "refused in one line" if kind == "refused" else "identical"
            print(f"{kind:12s} {sum(group)} / {len(group)} {word}")
    print(
        f"all: {sum(ok for _, ok, _ in results)} / {len(results)} in {time.perf_counter() - t0:.0f} s "
        f"(load: {os.getloadavg()[0]:.1f})"
    )
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
