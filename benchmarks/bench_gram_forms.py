"""Which form of a linear layer's exact Gram is faster, and how often the cost model picks it.

The exact Gram (grpo_lens.gradients.gram; its blocks in grpo_lens.gradients.gram_blocks) computes each linear layer's
[N, N] block either as token pairs (``token_pair_gram``) or with each rollout's weight gradient formed transiently
(``rollout_layer_gram``), per layer the one ``form_costs`` prices lower. This script times both forms on random inputs
over a sweep of layer shapes (d_in, d_out), group sizes n, positions per rollout L and groups G (the block-diagonal Gram
of G groups of n), then:

    1. fits the cost model's constants (relative least squares) to the timings:
           rollout seconds ~ a * N d_in d_out + b * M d_in d_out + c * G n^2 d_in d_out
           token seconds   ~ e * sum over blocks (nt + 1) / (2 nt) m^2 (d_in + d_out + 2 n + 64)
       and prints them as the shipped constants' units (TOKEN_PAIR_COST = e / b, ROLLOUT_ROW_COST = a / b,
       ROLLOUT_PAIR_COST = c / b) beside the shipped values;
    2. for three rules (``form_costs`` with the shipped constants; with the previous ones, PREVIOUS_CONSTANTS:
       rollout = d_in d_out (M + N^2) and token pairs at the per-rollout rate; with the fit's own), prints how many
       shapes it gives the faster form and its total seconds over the sweep against the oracle's (the faster form at
       every shape): rule / oracle = 1 is perfect.

Side by side, the rollout form is also timed with its G_i in one chunk of up to 256 MB (``budget_bytes``, the
chunking before ``ROLLOUT_CHUNK_BYTES``); the script prints that total over the sweep against the shipped chunks'.

Timings: one process, 2 threads (the project's CPU), each form the best of ``--repeats`` after the shape's tensors are
built; the load average is printed before and after.

    .venv/bin/python benchmarks/bench_gram_forms.py              # 45 shapes, ~1 min on 2 idle cores
    .venv/bin/python benchmarks/bench_gram_forms.py --quick      # 12 shapes, ~15 s
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
from common import load_avg

from grpo_lens.gradients import gram_blocks
from grpo_lens.gradients.gram_blocks import (
    ROLLOUT_CHUNK_BYTES,
    ROLLOUT_PAIR_COST,
    ROLLOUT_ROW_COST,
    TOKEN_PAIR_COST,
    block_spans,
    form_costs,
    rollout_layer_gram,
    token_pair_gram,
)

TOKEN_BLOCK = 1024
BUDGET_BYTES = 256 << 20
LAYERS = [(576, 576), (576, 1536), (576, 192), (1536, 576)]  # SmolLM2-135M's attention, MLP up, k/v, MLP down


def sweep_shapes(quick: bool) -> list[tuple[int, int, int, int, int]]:
    """(d_in, d_out, n, L, G) shapes: the 135M model's layers at the probe's and the lens's group sizes and lengths."""
    per_layer = [(2, 64, 4), (8, 64, 4), (8, 150, 4), (4, 300, 4), (8, 300, 4), (2, 400, 4)]
    per_layer += [(16, 64, 2), (32, 64, 1), (4, 64, 4), (8, 100, 4), (32, 30, 1), (2, 150, 8)]
    head = [(576, 49152, 8, 25, 4), (576, 49152, 2, 25, 4), (576, 49152, 8, 100, 2)]
    if quick:
        return [(di, do, *s) for di, do in LAYERS[:2] for s in per_layer[::2]]
    shapes = [(di, do, *s) for di, do in LAYERS[:3] for s in per_layer]
    shapes += [(1536, 576, *s) for s in per_layer[:6]]
    return shapes + head


def best_seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of fn(), seconds."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def time_forms(d_in: int, d_out: int, n: int, length: int, groups: int, repeats: int) -> tuple[float, float, float]:
    """(token seconds, rollout seconds, rollout seconds with one 256 MB chunk) for one layer's block-diagonal Gram of
    ``groups`` groups of n rollouts with ``length`` kept positions each, random float32 inputs."""
    rows = n * groups
    x, delta = torch.randn(rows, length, d_in), torch.randn(rows, length, d_out)
    keep = torch.ones(rows, length, dtype=torch.bool)
    spans = block_spans([n] * groups, rows)
    token = best_seconds(lambda: token_pair_gram(x, delta, keep, TOKEN_BLOCK, {}, spans), repeats)
    rollout = best_seconds(lambda: rollout_layer_gram(x, delta, keep, BUDGET_BYTES, None, None, spans), repeats)
    gram_blocks.ROLLOUT_CHUNK_BYTES = BUDGET_BYTES  # the chunking before the cache-sized chunks
    try:
        one_chunk = best_seconds(lambda: rollout_layer_gram(x, delta, keep, BUDGET_BYTES, None, None, spans), repeats)
    finally:
        gram_blocks.ROLLOUT_CHUNK_BYTES = ROLLOUT_CHUNK_BYTES
    return token, rollout, one_chunk


#: The rule before the fit: token pairs at the per-rollout rate, rollout = d_in d_out (M + N^2).
PREVIOUS_CONSTANTS = (1.0, 0.0, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="12 shapes instead of 45")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"load before: {load_avg()}   threads: {args.threads}")
    head = f"{'d_in':>5} {'d_out':>6} {'n':>3} {'L':>4} {'G':>2} | {'token s':>8} {'rollout s':>9} {'256 MB s':>9}"
    print(head + " | faster")
    rows, one_chunk_total = [], 0.0
    for d_in, d_out, n, length, groups in sweep_shapes(args.quick):
        token, rollout, one_chunk = time_forms(d_in, d_out, n, length, groups, args.repeats)
        rows.append((d_in, d_out, n, length, groups, token, rollout))
        one_chunk_total += one_chunk
        faster = "token" if token < rollout else "rollout"
        line = f"{d_in:>5} {d_out:>6} {n:>3} {length:>4} {groups:>2} | {token:8.4f} {rollout:9.4f} {one_chunk:9.4f}"
        print(line + f" | {faster}", flush=True)
    print(f"load after: {load_avg()}")
    rollout_total = sum(r[-1] for r in rows)
    print(
        f"rollout form over the sweep: {rollout_total:.2f} s in {ROLLOUT_CHUNK_BYTES >> 20} MB chunks, "
        f"{one_chunk_total:.2f} s in 256 MB ones: {one_chunk_total / rollout_total:.2f}x"
    )

    # 1. the fit: relative least squares (each shape's residual divided by its seconds)
    a_rows, b_rows, y_rollout, y_token = [], [], [], []
    for d_in, d_out, n, length, groups, token, rollout in rows:
        p, m = d_in * d_out, n * length
        a_rows.append([n * groups * p, m * groups * p, groups * n * n * p])
        tok, _ = form_costs([m] * groups, [n] * groups, d_in, d_out, TOKEN_BLOCK, (1.0, 0.0, 0.0))
        b_rows.append([tok])
        y_rollout.append(rollout)
        y_token.append(token)
    a, b = np.array(a_rows, dtype=float), np.array(b_rows, dtype=float)
    yr, yt = np.array(y_rollout), np.array(y_token)
    cr, *_ = np.linalg.lstsq(a / yr[:, None], np.ones_like(yr), rcond=None)
    ct, *_ = np.linalg.lstsq(b / yt[:, None], np.ones_like(yt), rcond=None)
    per_madd = cr[1]
    fitted = (ct[0] / per_madd, cr[0] / per_madd, cr[2] / per_madd)
    print(f"\nper-rollout multiply-add: {per_madd:.3g} s")
    shipped = (TOKEN_PAIR_COST, ROLLOUT_ROW_COST, ROLLOUT_PAIR_COST)
    print(f"{'constant':<18} {'fitted':>8} {'shipped':>8}")
    for name, fit, ship in zip(("TOKEN_PAIR_COST", "ROLLOUT_ROW_COST", "ROLLOUT_PAIR_COST"), fitted, shipped):
        print(f"{name:<18} {fit:8.3f} {ship:8.3f}")

    # 2. each rule's picks against the oracle
    oracle = sum(min(token, rollout) for *_, token, rollout in rows)
    print(f"\n{'rule':<10} {'faster form':>12} {'seconds':>8} {'/ oracle':>9}")
    for name, constants in (("shipped", shipped), ("previous", PREVIOUS_CONSTANTS), ("fit", fitted)):
        right, seconds = 0, 0.0
        for d_in, d_out, n, length, groups, token, rollout in rows:
            tok, rol = form_costs([n * length] * groups, [n] * groups, d_in, d_out, TOKEN_BLOCK, constants)
            picked = token if tok < rol else rollout
            right += picked == min(token, rollout)
            seconds += picked
        print(f"{name:<10} {right:>5} of {len(rows):<4} {seconds:8.2f} {seconds / oracle:9.3f}")
    print(f"{'oracle':<10} {'':>12} {oracle:8.2f} {1:9.3f}")


if __name__ == "__main__":
    main()
