"""How the lens's cost grows with the model: a training step, the exact Gram, the sketch and the dense oracle at four
model sizes x completion lengths x group sizes, with power laws fitted in P, T and R.

Models: Llama architectures built from configs with random weights (float32, tied embeddings, SmolLM2's 49,152-token
vocabulary; no download), at about 10M, 35M, 135M (SmolLM2-135M's shape) and 360M (SmolLM2-360M's shape) parameters.
One cell = one size x completion length T x group size R: one group of R rollouts of one random prompt of
``--prompt-len`` tokens, every completion T random tokens long (N = R rows, L = Lp + T positions). Systems, on the
same batch:

    plain    a training step's forward + backward: grpo_lens.formulas.losses.grpo_loss (on-policy, seq-mean-token-mean)
             of grpo_lens.rollout.batch_logprobs (logits only at completion positions), .backward() into every
             parameter's .grad
    gram     grpo_lens.gradients.gram.exact_rollout_gram: the lens's exact per-rollout Gram of every parameter (its own
             forward + backward, as the trainer's lens and the probe run it); "step + lens" = plain + gram
    sketch   grpo_lens.gradients.sketch.sketch_rollout_grads (sketch_in = sketch_out = 16, every nn.Linear) and its Gram
    oracle   grpo_lens.gradients.exact.exact_rollout_grads (one backward per rollout, the dense [R, P] rows) and
             their Gram (grpo_lens.gradients.gram_blocks.gram_of_rows); skipped, with the reason printed, when its
             rows would exceed ``--oracle-max-gb``. Where it runs, the exact Gram's error against it is printed.

Time: wall seconds of each system, the systems interleaved in each of ``--repeats`` rounds (medians printed), after one
untimed warm-up of every system on the first cell. Memory: ``step MB`` = the process's peak resident set while the
system ran minus the resident set before it (Linux VmHWM, reset through /proc/self/clear_refs after glibc malloc_trim;
the model and its other state are in both, so this is what the system adds), first round only. FLOPs: the plain step's
forward + backward counted from the model's shape (benchmarks/common.py: 6 x linear parameters x tokens, the LM head at
T + 1 positions, causal attention), and the CPU's float32 GEMM throughput measured in the same run.

Cells run cheapest first. ``--budget-s`` caps the run's wall time: before each system the time it would take is
predicted (from the measured cell nearest in log P, log T, log R, scaled by the FLOP count; before any, from the GEMM
throughput), and a system or cell that would not fit in what is left is printed as skipped with the prediction, never
dropped silently; a second or later round of a cell runs only if the later cells' first rounds would still fit.
Fits: ln(seconds) = c + a ln P + b ln T + g ln R by least squares over the cells measured (P = every
parameter, shared ones once), printed with standard errors, the cells' ranges of P, T, R and the residual RMS;
a variable that takes one value is left out of that fit.

    python benchmarks/bench_scaling.py --budget-s 1400 --repeats 1              # the README's table (2-core CPU)
    python benchmarks/bench_scaling.py --sizes 10M 35M --lengths 24 128 --group-sizes 4
    python benchmarks/bench_scaling.py --quick                                  # two tiny models, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from common import (
    gemm_flops_per_s,
    load_avg,
    mem_available,
    peak_rss,
    reset_peak,
    rss_now,
    shape_of,
    step_flops,
)
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lens.formulas.losses import grpo_loss, loss_normalizer
from grpo_lens.gradients.exact import exact_rollout_grads
from grpo_lens.gradients.gram import exact_rollout_gram
from grpo_lens.gradients.gram_blocks import gram_of_rows
from grpo_lens.gradients.sketch import sketch_rollout_grads
from grpo_lens.rollout import RolloutBatch, batch_logprobs

VOCAB = 49152
AGGREGATION = "seq-mean-token-mean"

#: {name: LlamaConfig sizes}. 135M and 360M are SmolLM2-135M's and SmolLM2-360M's configs (HuggingFaceTB); 10M and
#: 35M are narrower, shallower Llamas of the same family (head_dim 32 and 64, grouped-query attention).
SIZES = {
    "10M": dict(
        hidden_size=160, intermediate_size=448, num_hidden_layers=6, num_attention_heads=5, num_key_value_heads=1
    ),
    "35M": dict(
        hidden_size=384, intermediate_size=1024, num_hidden_layers=10, num_attention_heads=6, num_key_value_heads=2
    ),
    "135M": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    ),
    "360M": dict(
        hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5
    ),
}
#: ``--quick``: two tiny Llamas over a 512-token vocabulary (a test's run in seconds).
QUICK_SIZES = {
    "quick-a": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "quick-b": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
    ),
}
QUICK_VOCAB = 512
SYSTEMS = ("plain", "gram", "sketch", "oracle")
#: Before any cell is measured: each system's seconds as a multiple of the plain step's FLOPs at half the GEMM rate.
PRIOR = {"plain": 1.0, "gram": 2.5, "sketch": 2.0, "oracle": 3.0}
SAFETY = 1.25  # predictions are multiplied by this before they are compared with the time left


def llama_config(sizes: dict, vocab: int) -> LlamaConfig:
    """A tied-embedding Llama config of the given sizes (SmolLM2's norm eps, RoPE theta and context)."""
    return LlamaConfig(
        **sizes,
        vocab_size=vocab,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
    )


def build_model(config: LlamaConfig) -> torch.nn.Module:
    """Random weights (seed 0), float32, eval mode (no dropout; gradients still flow)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).to(torch.float32).eval()


def model_shape(config: LlamaConfig) -> dict[str, int]:
    """:func:`common.shape_of` of the model on the meta device (no weights allocated)."""
    with torch.device("meta"):
        return shape_of(LlamaForCausalLM(config))


def build_batch(vocab: int, group_size: int, prompt_len: int, completion_len: int) -> RolloutBatch:
    """One group: R copies of a random prompt of Lp tokens, R random completions of T tokens, all full length."""
    g = torch.Generator().manual_seed(0)
    r = group_size
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=g).repeat(r, 1)
    comp = torch.randint(0, vocab, (r, completion_len), generator=g)
    return RolloutBatch(
        prompt_ids=prompt,
        prompt_mask=torch.ones(r, prompt_len, dtype=torch.long),
        completion_ids=comp,
        completion_mask=torch.ones(r, completion_len, dtype=torch.bool),
        sampler_logprobs=torch.zeros(r, completion_len),
        truncated=torch.ones(r, dtype=torch.bool),
        group_size=r,
    )


# ---------------------------------------------------------------------------------------------------------------------
# The systems: each takes (model, batch, advantages [N]) and returns the [N, N] Gram (None for plain) and an info dict
# ---------------------------------------------------------------------------------------------------------------------
def run_plain(model, batch, adv):
    model.zero_grad(set_to_none=True)
    mask = batch.completion_mask
    logp = batch_logprobs(model, batch)
    loss, _ = grpo_loss(
        logp,
        logp.detach(),
        adv,
        mask,
        normalizer=loss_normalizer(mask, AGGREGATION, mask.shape[1]),
        aggregation=AGGREGATION,
    )
    loss.backward()
    model.zero_grad(set_to_none=True)
    return None, {}


def run_gram(model, batch, adv):
    return exact_rollout_gram(model, batch)


def run_sketch(model, batch, adv):
    return sketch_rollout_grads(model, batch, sketch_in=16, sketch_out=16).gram().double(), {}


def run_oracle(model, batch, adv):
    rows = exact_rollout_grads(model, batch)
    return gram_of_rows(rows), {}


RUN = {"plain": run_plain, "gram": run_gram, "sketch": run_sketch, "oracle": run_oracle}


# ---------------------------------------------------------------------------------------------------------------------
# Cells, predictions, the budget
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Cell:
    """One size x T x R, what it measured and what it skipped."""

    size: str
    T: int
    R: int
    params: int
    flops: float  # the plain step's forward + backward FLOPs
    times: dict[str, list[float]] = field(default_factory=dict)
    mem: dict[str, int] = field(default_factory=dict)  # step bytes per system
    skipped: dict[str, str] = field(default_factory=dict)
    gram_err: float | None = None
    coverage: float | None = None
    load: str = ""

    def median(self, system: str) -> float | None:
        ts = self.times.get(system)
        return statistics.median(ts) if ts else None

    def key(self) -> tuple[float, float, float]:
        return math.log(self.params), math.log(self.T), math.log(self.R)


def predict(system: str, cell: Cell, done: list[Cell], gemm: float) -> float:
    """Seconds ``system`` would take on ``cell``: the FLOP-scaled time of the measured cell nearest in (ln P, ln T,
    ln R), else :data:`PRIOR` at half the GEMM rate; times :data:`SAFETY`."""
    have = [c for c in done if c.median(system) is not None]
    if have:
        near = min(have, key=lambda c: sum(abs(a - b) for a, b in zip(c.key(), cell.key())))
        return SAFETY * near.median(system) * cell.flops / near.flops
    return SAFETY * PRIOR[system] * cell.flops / (0.5 * gemm)


def oracle_bytes(cell: Cell) -> int:
    """The oracle's [R, P] float32 rows plus one parameter-sized gradient."""
    return (cell.R + 1) * cell.params * 4


def cell_systems(cell: Cell, args) -> list[str]:
    """The systems asked for, less the oracle where its rows would exceed ``--oracle-max-gb``."""
    return [s for s in args.systems if s != "oracle" or oracle_bytes(cell) <= args.oracle_max_gb * 2**30]


def run_cells(cells: list[Cell], models: dict, args, gemm: float, t_start: float) -> None:
    """Measure every cell in order (cheapest first) within the budget; fills each Cell in place."""
    deadline = t_start + args.budget_s if args.budget_s is not None else float("inf")
    done: list[Cell] = []
    warmed = False
    for k, cell in enumerate(cells):
        systems = cell_systems(cell, args)
        if "oracle" in args.systems and "oracle" not in systems:
            cell.skipped["oracle"] = (
                f"memory: [R, P] rows + a gradient need {oracle_bytes(cell) / 2**30:.1f} GB > "
                f"--oracle-max-gb {args.oracle_max_gb:.1f}"
            )
        preds = {s: predict(s, cell, done, gemm) for s in systems}
        left = deadline - time.perf_counter()
        if sum(preds.values()) > left and preds.get("plain", 0) > left:
            for s in systems:
                cell.skipped[s] = f"budget: predicted {preds[s]:.0f} s, {max(left, 0):.0f} s left"
            print(
                f"skip {cell.size} T={cell.T} R={cell.R}: predicted {sum(preds.values()):.0f} s for all systems, "
                f"{max(left, 0):.0f} s left",
                flush=True,
            )
            continue
        if cell.size not in models:
            models[cell.size] = build_model(args.configs[cell.size])
        model = models[cell.size]
        batch = build_batch(model.config.vocab_size, cell.R, args.prompt_len, cell.T)
        adv = torch.randn(cell.R, generator=torch.Generator().manual_seed(1))
        if not warmed:  # untimed, once: thread pools, allocator, first-call paths
            for s in systems:
                RUN[s](model, batch, adv)
            warmed = True
        cell.load = load_avg()
        print(
            f"\n== {cell.size} ({fmt_params(cell.params)}) T={cell.T} R={cell.R}: {cell.flops / 1e9:.1f} GFLOP; "
            f"load {cell.load}",
            flush=True,
        )
        grams = {}
        for rep in range(args.repeats):
            # a repeat runs only if the first rounds of the cells after this one would still fit after it
            later = (
                sum(predict(s, c, done + [cell], gemm) for c in cells[k + 1 :] for s in cell_systems(c, args))
                if rep
                else 0.0
            )
            for s in systems:
                if s in cell.skipped:
                    continue
                pred = predict(s, cell, done + ([cell] if cell.times else []), gemm)
                left = deadline - time.perf_counter()
                if pred + later > left:
                    if rep == 0:
                        cell.skipped[s] = f"budget: predicted {pred:.0f} s, {max(left, 0):.0f} s left"
                    continue
                measure = rep == 0
                if measure:
                    reset_peak()
                    before = rss_now()
                t0 = time.perf_counter()
                gram, info = RUN[s](model, batch, adv)
                cell.times.setdefault(s, []).append(time.perf_counter() - t0)
                if measure:
                    cell.mem[s] = peak_rss() - before
                    grams[s] = gram
                    if s == "gram":
                        cell.coverage = info["coverage"]
                del gram, info
            ran = [f"{s} {cell.times[s][-1]:.2f} s" for s in systems if len(cell.times.get(s, [])) > rep]
            if ran:
                print(f"  round {rep}: " + "  ".join(ran) + f"   load {load_avg()}", flush=True)
        if grams.get("gram") is not None and grams.get("oracle") is not None:
            o = grams["oracle"]
            cell.gram_err = float((grams["gram"] - o).abs().max() / o.abs().max())
        for s, why in cell.skipped.items():
            print(f"  skipped {s}: {why}", flush=True)
        done.append(cell)


# ---------------------------------------------------------------------------------------------------------------------
# Power-law fits
# ---------------------------------------------------------------------------------------------------------------------
def fit_power_law(points: list[tuple[float, float, float, float]]) -> dict | None:
    """Least squares of ln y = c + a ln P + b ln T + g ln R over ``points`` [(P, T, R, y)], y > 0.

    A variable with one value among the points is left out. Returns None with fewer points than coefficients + 1;
    else {"exponents": {name: (value, standard error)}, "n", "ranges": {name: (min, max)}, "rms": residual RMS in
    ln y, "const": c}. Standard errors: the usual OLS ones, sigma^2 (X^T X)^-1 with sigma^2 = RSS / (n - k).
    """
    pts = [p for p in points if p[3] is not None and p[3] > 0]
    names = [n for k, n in enumerate("PTR") if len({p[k] for p in pts}) > 1]
    cols = [k for k, n in enumerate("PTR") if n in names]
    n, k = len(pts), 1 + len(cols)
    if n < k + 1:
        return None
    x = np.array([[1.0] + [math.log(p[c]) for c in cols] for p in pts])
    y = np.array([math.log(p[3]) for p in pts])
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ beta
    rss = float(resid @ resid)
    cov = rss / (n - k) * np.linalg.inv(x.T @ x)
    se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    return {
        "exponents": {name: (float(beta[i + 1]), float(se[i + 1])) for i, name in enumerate(names)},
        "n": n,
        "ranges": {name: (min(p[c] for p in pts), max(p[c] for p in pts)) for name, c in zip(names, cols)},
        "rms": math.sqrt(rss / n),
        "const": float(beta[0]),
    }


def fit_line(label: str, fit: dict | None, unit: str) -> str:
    """One fitted law as text."""
    if fit is None:
        return f"- {label}: too few cells to fit"
    law = " ".join(f"{n}^{v:.2f}±{e:.2f}" for n, (v, e) in fit["exponents"].items())
    fmt = {"P": fmt_params, "T": lambda v: f"{v:.0f}", "R": lambda v: f"{v:.0f}"}
    ranges = ", ".join(f"{n} {fmt[n](lo)}-{fmt[n](hi)}" for n, (lo, hi) in fit["ranges"].items())
    return f"- {label}: {unit} ∝ {law} ({fit['n']} cells; {ranges}; residual RMS {fit['rms']:.2f} in ln)"


# ---------------------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------------------
def fmt_params(p: float) -> str:
    return f"{p / 1e6:.1f}M" if p >= 1e6 else f"{p / 1e3:.0f}K"


def fmt_s(v: float | None, why: str | None = None) -> str:
    if v is not None:
        return f"{v:.2f}"
    return "skipped" if why else "-"


def print_tables(cells: list[Cell], gemm: tuple[float, float]) -> None:
    print(
        "\n| model | P | T | R | GFLOP | plain s | plain GFLOP/s | gram s | gram / plain | step + lens s | "
        "sketch s | sketch / plain | oracle s | oracle / plain | gram vs oracle | coverage |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    order = sorted(cells, key=lambda c: (c.params, c.T, c.R))
    for c in order:
        p, g, sk, o = (c.median(s) for s in SYSTEMS)
        ratio = lambda v: f"{v / p:.2f}x" if v is not None and p else "-"  # noqa: E731, B023 (used in this iteration)
        lens = f"{p + g:.2f}" if p is not None and g is not None else "-"
        err = f"{c.gram_err:.1e}" if c.gram_err is not None else "-"
        cov = f"{c.coverage:.2f}" if c.coverage is not None else "-"
        rate = f"{c.flops / p / 1e9:.0f}" if p else "-"
        print(
            f"| {c.size} | {fmt_params(c.params)} | {c.T} | {c.R} | {c.flops / 1e9:.1f} | "
            f"{fmt_s(p, c.skipped.get('plain'))} | {rate} | {fmt_s(g, c.skipped.get('gram'))} | {ratio(g)} | "
            f"{lens} | {fmt_s(sk, c.skipped.get('sketch'))} | {ratio(sk)} | {fmt_s(o, c.skipped.get('oracle'))} | "
            f"{ratio(o)} | {err} | {cov} |"
        )
    print(
        f"\n(float32 GEMM {gemm[0] / 1e9:.0f} GFLOP/s at the start, {gemm[1] / 1e9:.0f} at the end; plain GFLOP/s = "
        "the step's counted FLOPs / its seconds)"
    )
    print("\nStep memory (MB the system adds to the process's peak resident set):\n")
    print("| model | T | R | plain | gram | sketch | oracle |")
    print("|---|---|---|---|---|---|---|")
    for c in order:
        mem = [f"{c.mem[s] / 2**20:.1f}" if s in c.mem else "-" for s in SYSTEMS]
        print(f"| {c.size} | {c.T} | {c.R} | " + " | ".join(mem) + " |")
    skipped = [(c, s, why) for c in order for s, why in c.skipped.items()]
    if skipped:
        print("\nSkipped:")
        for c, s, why in skipped:
            print(f"- {c.size} T={c.T} R={c.R} {s}: {why}")


def print_fits(cells: list[Cell]) -> dict:
    """The fitted laws of each system's seconds, of step + lens, of gram / plain and of each system's step memory."""
    fits = {}
    for s in SYSTEMS:
        fits[s] = fit_power_law([(c.params, c.T, c.R, c.median(s)) for c in cells])
    paired = [c for c in cells if c.median("plain") is not None and c.median("gram") is not None]
    fits["step + lens"] = fit_power_law([(c.params, c.T, c.R, c.median("plain") + c.median("gram")) for c in paired])
    fits["gram / plain"] = fit_power_law([(c.params, c.T, c.R, c.median("gram") / c.median("plain")) for c in paired])
    print("\nFitted laws (least squares in logs; ± one standard error):\n")
    for name, f in fits.items():
        print(fit_line(name, f, "ratio" if "/" in name else "seconds"))
    for s in SYSTEMS:
        f = fit_power_law([(c.params, c.T, c.R, c.mem.get(s)) for c in cells])
        fits[f"{s} memory"] = f
        print(fit_line(f"{s} step memory", f, "bytes"))
    return fits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), help=f"of {', '.join(SIZES)}")
    ap.add_argument("--lengths", type=int, nargs="+", default=[24, 128, 512], help="completion lengths T")
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8], help="group sizes R")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt tokens Lp")
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per cell (fewer when the budget is short)")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--budget-s", type=float, default=None, help="wall-time cap of the whole run, seconds")
    ap.add_argument(
        "--oracle-max-gb",
        type=float,
        default=None,
        help="skip the dense oracle when its rows need more (default: 0.3 x MemAvailable at start)",
    )
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", help="also write every cell's numbers and the fits to this file")
    ap.add_argument("--quick", action="store_true", help="two tiny models, T in {8, 16}, R in {2, 4}: seconds")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    if args.quick:
        sizes, vocab = QUICK_SIZES, QUICK_VOCAB
        args.sizes, args.lengths, args.group_sizes = list(QUICK_SIZES), [8, 16], [2, 4]
        args.prompt_len, args.repeats = 4, 1
    else:
        sizes, vocab = SIZES, VOCAB
        unknown = [s for s in args.sizes if s not in SIZES]
        if unknown:
            ap.error(f"unknown sizes {unknown}; valid: {', '.join(SIZES)}")
    if args.oracle_max_gb is None:
        args.oracle_max_gb = 0.3 * mem_available() / 2**30
    args.configs = {s: llama_config(sizes[s], vocab) for s in args.sizes}
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, {args.threads} threads, "
        f"{os.cpu_count()} cores; load average {load_avg()}; budget "
        f"{'none' if args.budget_s is None else f'{args.budget_s:.0f} s'}; Lp = {args.prompt_len}; "
        f"repeats {args.repeats}; oracle cap {args.oracle_max_gb:.1f} GB",
        flush=True,
    )
    gemm = gemm_flops_per_s()
    print(f"float32 GEMM 2048^3: {gemm / 1e9:.0f} GFLOP/s", flush=True)
    shapes = {s: model_shape(args.configs[s]) for s in args.sizes}
    cells = [
        Cell(s, T, R, shapes[s]["params"], step_flops(shapes[s], R, args.prompt_len, T))
        for s in args.sizes
        for T in args.lengths
        for R in args.group_sizes
    ]
    cells.sort(key=lambda c: c.flops)
    run_cells(cells, {}, args, gemm, t_start)
    gemm_end = gemm_flops_per_s()
    print(
        f"\nfloat32 GEMM at the end: {gemm_end / 1e9:.0f} GFLOP/s; load average {load_avg()}; wall "
        f"{time.perf_counter() - t_start:.0f} s"
    )
    print_tables(cells, (gemm, gemm_end))
    fits = print_fits(cells)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "gemm_flops_per_s": [gemm, gemm_end],
                    "prompt_len": args.prompt_len,
                    "cells": [{k: v for k, v in vars(c).items()} for c in cells],
                    "fits": fits,
                },
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
