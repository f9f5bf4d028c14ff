"""What ``model.generate`` costs in ``sample_groups`` against its FLOP floor on this machine.

The floor: the matrix-product FLOPs generation cannot avoid, 2 x (weights of every linear layer, LM head included) per
token the model runs on, plus attention (4 x layers x hidden x attended positions per token), divided by the machine's
measured float32 matmul throughput (a [M, H] x [H, I] product of the model's own MLP shape, M = the decode batch).
Tokens the model runs on: the prefill (every prompt row's Lp positions, or one row per distinct prompt with
``share_prompt_prefill``) and one position per row per decoding step (finished rows keep running until the last
row ends, as in ``generate``).

Prints seconds, GFLOP, floor seconds and seconds / floor for ``sample_groups`` with the prompt prefill shared across
each group (the default) and without, interleaved over ``--repeats`` so that load from other processes hits both alike.

    python benchmarks/bench_generate.py [--prompts 4 --group-size 8 --max-new-tokens 24 --repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def matmul_gflops(m: int, h: int, i: int, device: str, repeats: int = 20) -> float:
    """Measured float32 GFLOP/s of an [m, h] x [h, i] product (best of ``repeats``)."""
    a, b = torch.randn(m, h, device=device), torch.randn(h, i, device=device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * m * h * i / best / 1e9


def generation_flops(model, rows_prefill: int, prompt_len: int, rows: int, steps: int) -> float:
    """FLOPs of a prefill of ``rows_prefill`` x ``prompt_len`` positions and ``steps`` decoding steps of ``rows``."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.config
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    flops = 2 * linear * rows_prefill * prompt_len + 4 * layers * h * rows_prefill * prompt_len * prompt_len / 2
    for t in range(steps):
        flops += 2 * linear * rows + 4 * layers * h * rows * (prompt_len + t + 1)
    return flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from grpo_lens.models import load_model
    from grpo_lens.rollout import sample_groups
    from grpo_lens.tasks import get_task

    model, tok = load_model(args.model, device=args.device)
    examples = get_task("arithmetic").sample(args.prompts, seed=0)
    n = args.prompts * args.group_size
    h, i = model.config.hidden_size, model.config.intermediate_size
    decode_gflops = matmul_gflops(n, h, i, args.device)  # the decode step's shape
    gflops = max(decode_gflops, matmul_gflops(2048, h, i, args.device))  # the machine's best: the floor
    times: dict[bool, list[float]] = {True: [], False: []}
    shapes: dict[bool, tuple[int, int]] = {}
    for r in range(args.repeats + 1):  # the first round warms up and is not counted
        for share in (True, False):
            t0 = time.perf_counter()
            batch = sample_groups(
                model,
                tok,
                examples,
                args.group_size,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                generator_seed=r,
                share_prompt_prefill=share,
            )
            if r:
                times[share].append(time.perf_counter() - t0)
            shapes[share] = (batch.prompt_ids.shape[1], batch.completion_ids.shape[1])
    print(
        f"\n{args.model}, {args.device}, {args.threads} threads, B={args.prompts} x R={args.group_size}, "
        f"max_new_tokens={args.max_new_tokens}; measured float32 matmul throughput {gflops:.1f} GFLOP/s at "
        f"[2048, {h}] x [{h}, {i}], {decode_gflops:.1f} GFLOP/s at the decode shape [{n}, {h}] x [{h}, {i}]\n"
    )
    print("| prefill | seconds (median) | GFLOP | floor s | seconds / floor |")
    print("|---|---|---|---|---|")
    for share in (True, False):
        lp, t = shapes[share]
        rows_prefill = args.prompts if share else n
        flops = generation_flops(model, rows_prefill, lp, n, t)
        sec = statistics.median(times[share])
        floor = flops / (gflops * 1e9)
        print(
            f"| {'once per prompt' if share else 'once per rollout'} | {sec:.2f} | {flops / 1e9:.1f} | "
            f"{floor:.2f} | {sec / floor:.1f} |"
        )


if __name__ == "__main__":
    main()
