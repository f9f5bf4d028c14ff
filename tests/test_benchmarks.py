"""The benchmark scripts' own logic: bench_scaling's fits, quick run and budget, common.py's FLOP counts, and
gpu_check.py's CPU dry run.

The scripts live in benchmarks/ (not a package); they import their helpers as ``common``, so the folder goes on
sys.path here as it does when a script runs.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def bench(monkeypatch):
    """Import a benchmark module by name with benchmarks/ on sys.path."""
    monkeypatch.syspath_prepend(str(BENCH))

    def load(name: str):
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    return load


def test_fit_power_law_recovers_planted_exponents(bench):
    scaling = bench("bench_scaling")
    # y = 3 P^0.5 T^1.25 R^2 exactly: ln y is linear in the logs, so least squares returns the exponents with zero
    # residual (standard errors 0 up to rounding).
    pts = [(p, t, r, 3 * p**0.5 * t**1.25 * r**2) for p in (1e7, 4e7, 1.6e8) for t in (24, 128, 512) for r in (4, 8)]
    fit = scaling.fit_power_law(pts)
    assert fit["n"] == 18
    for name, want in (("P", 0.5), ("T", 1.25), ("R", 2.0)):
        value, se = fit["exponents"][name]
        assert value == pytest.approx(want, abs=1e-9) and se < 1e-6
    assert fit["const"] == pytest.approx(math.log(3), abs=1e-8) and fit["rms"] < 1e-9
    assert fit["ranges"]["T"] == (24, 512)
    # one R only: R leaves the fit (its column would be collinear with the constant); P and T are unchanged
    fit = scaling.fit_power_law([p for p in pts if p[2] == 4])
    assert set(fit["exponents"]) == {"P", "T"} and fit["exponents"]["T"][0] == pytest.approx(1.25, abs=1e-9)
    # fewer points than coefficients + 1: no fit
    assert scaling.fit_power_law(pts[:2]) is None


def test_step_flops_count_from_the_shape(bench):
    common = bench("common")
    shape = {"linear": 1000, "lm_head": 500, "layers": 2, "attn_width": 8, "params": 0}
    # N = 3, Lp = 4, T = 6, L = 10: linear 2*1000*3*10 = 60000; lm_head at T + 1 = 7 positions 2*500*3*7 = 21000;
    # attention 2 layers * 2 * 8 * 3 * 10 * 11 = 10560; forward 91560, forward + backward 3x = 274680.
    assert common.step_flops(shape, 3, 4, 6) == 274680.0
    # logits at every position (a naive loop): lm_head 2*500*3*10 = 30000 -> 3 * (60000 + 30000 + 10560)
    assert common.step_flops(shape, 3, 4, 6, logits_positions=10) == 3 * 100560.0
    # generation, N = 3, Lp = 4, T = 3: prefill 2*1000*3*4 + 2*500*3*1 + 2*2*8*3*4*5 = 24000 + 3000 + 1920;
    # two one-token forwards 2*(1000 + 500)*3 each = 9000 each; their attention 4*2*8*3*(4+1) + 4*2*8*3*(4+2)
    assert common.generation_flops(shape, 3, 4, 3) == 28920 + 18000 + 960 + 1152
    # each of B = 2 prompts once, N = 4, Lp = 4, T = 3: the prompts' forward 2*1000*2*4 + 2*500*2*1 + 2*2*8*2*4*5 =
    # 16000 + 2000 + 1280 = 19280; the completions 2*(1000 + 500)*4*3 = 36000 and attention 4*2*8*4*(3*4 + 3*4/2) =
    # 4608; generation with the N-row prefill (38560) replaced by the prompts' (19280): 38560 + 24000 + 2816 - 19280
    assert common.shared_prompt_flops(shape, 4, 2, 4, 3) == (65376 - 38560 + 19280) + 3 * (19280 + 36000 + 4608)
    # one row per prompt: nothing is shared, and the count is the plain loop's
    assert common.shared_prompt_flops(shape, 3, 3, 4, 6) == common.generation_flops(shape, 3, 4, 6) + common.step_flops(
        shape, 3, 4, 6
    )


@pytest.mark.e2e
def test_quick_run_measures_every_cell_and_the_gram_matches_the_oracle(bench, tmp_path, capsys):
    scaling = bench("bench_scaling")
    out = tmp_path / "scaling.json"
    assert scaling.main(["--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["cells"]) == 2 * 2 * 2  # 2 models x T in {8, 16} x R in {2, 4}
    for cell in data["cells"]:
        assert set(cell["times"]) == set(scaling.SYSTEMS) and not cell["skipped"]
        # float32 Gram from one backward vs the dense oracle's rows: rounding only (~1e-7); a missing parameter kind
        # or a wrong cross term is O(1e-2) or more
        assert cell["gram_err"] < 1e-5 and cell["coverage"] == 1.0
    text = capsys.readouterr().out
    assert "| quick-b | " in text and "Fitted laws" in text
    assert "- plain: seconds ∝ P^" in text and "T 8-16, R 2-4" in text


@pytest.mark.e2e
def test_budget_prints_every_cell_it_skips(bench, tmp_path, capsys):
    scaling = bench("bench_scaling")
    out = tmp_path / "scaling.json"
    assert scaling.main(["--quick", "--budget-s", "0", "--json", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 8 and all(not c["times"] for c in cells)
    assert all(
        set(c["skipped"]) == set(scaling.SYSTEMS)
        and all(w.startswith("budget: predicted") for w in c["skipped"].values())
        for c in cells
    )
    text = capsys.readouterr().out
    assert text.count("skip quick-") == 8
    assert sum(line.startswith("| quick-") and "| skipped |" in line for line in text.splitlines()) == 8
    assert "- plain: too few cells to fit" in text


@pytest.mark.e2e
def test_gpu_check_dry_run_runs_every_step_and_writes_their_figures(tmp_path):
    """benchmarks/gpu_check.py --dry-run: the GPU check's steps on the CPU with tiny sizes (about a minute: seven
    Python processes), every step's section and figures in the one file."""
    out = tmp_path / "gpu_check.md"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "gpu_check.py"),
            "--dry-run",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--budget-s",
            "400",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    sections = {s.split("\n", 1)[0]: s for s in text.split("\n## ")[1:]}
    assert list(sections) == ["env", "cuda-tests", "train", "build-big", "train-big", "probe", "bench-step", "summary"]
    for name in ("cuda-tests", "train", "build-big", "train-big", "probe", "bench-step"):
        assert "\nexit 0 in " in sections[name], sections[name]
    assert "3 skipped" in sections["cuda-tests"]  # no CUDA here: the CUDA tests are collected and skipped
    for name in ("train", "train-big"):  # one step's row of metrics.jsonl, with its seconds
        assert "| step | perf/step_seconds |" in sections[name] and "\n| 1 | " in sections[name]
    assert '"class": "Qwen2ForCausalLM"' in sections["build-big"]
    assert "- gradients: exact_gram" in sections["probe"]
    assert "x floor" in sections["bench-step"] and "FLOP floor:" in sections["bench-step"]
    assert "6 of 6 steps exited 0" in sections["summary"]


def test_import_sets_passive_openmp_waits_unless_the_user_chose():
    # import grpo_lens sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (bench_threads.py measures why); a value
    # the user set is kept
    code = "import os, grpo_lens; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = [sys.executable, "-c", code]
    assert subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout.strip() == "PASSIVE"
    mine = subprocess.run(run, env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, capture_output=True, text=True, check=True)
    assert mine.stdout.strip() == "ACTIVE"


def test_bench_threads_runs_both_policies_on_the_tiny_model():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_threads.py"
    out = subprocess.run(
        [sys.executable, str(script), "--model", "tiny", "--group-size", "2", "--repeats", "1"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith(("plain", "exact"))]
    assert len(rows) == 2 and all(float(r.split()[-1]) > 0 for r in rows)
