"""The exact Gram from one backward against one plain batched forward + backward, and against the sketch.

Model: SmolLM2-135M's architecture from its config with random weights (float32; the default model's shape, so no
download), R = 8 rollouts of one prompt of 40 tokens, every completion full length (T = 24 and 512 by default).
Systems, on the same batch:

    plain    one batched forward + backward of sum_i s_i with parameter gradients (what a trainer's step computes;
             batch_logprobs uses logits_to_keep)
    gram     grpo_lens.gradients.gram.exact_rollout_gram (every parameter; backward w.r.t. the embedding output)
    sketch   grpo_lens.gradients.sketch.sketch_rollout_grads (sketch_in = sketch_out = 16) and its Gram (the
             earlier default)

Timings: one process, the systems interleaved (plain, gram, sketch) x ``--repeats`` after one untimed warm-up of each,
medians and gram / plain printed with the load average before and after each length. Peak memory: each system in a
child process (``--worker``) that builds the model and runs one step: ``peak`` = the child's peak resident set during
the step (VmHWM, reset after the build; model included), ``step`` = peak minus the resident set before the step.
Targets: gram / plain <= 1.3 at 24 tokens and <= 2 at 512; gram's step memory <= the sketch's + 1 GB.

    .venv/bin/python benchmarks/bench_gram.py                       # 24 and 512 tokens (~10 min on 2 idle cores)
    .venv/bin/python benchmarks/bench_gram.py --lengths 24 --repeats 1 --no-memory
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from common import load_avg, peak_rss, reset_peak, rss_now
from transformers import AutoModelForCausalLM, LlamaConfig

from grpo_lens.gradients.gram import exact_rollout_gram
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.gradients.sketch import sketch_rollout_grads
from grpo_lens.rollout import RolloutBatch, batch_logprobs

R, LP, VOCAB = 8, 40, 49152


def build_model() -> torch.nn.Module:
    """SmolLM2-135M's architecture (LlamaConfig of HuggingFaceTB/SmolLM2-135M-Instruct), random weights, float32."""
    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(torch.float32).eval()


def build_batch(T: int) -> RolloutBatch:
    """R rollouts of one random prompt of LP tokens, random full-length completions of T tokens."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, LP), generator=g).repeat(R, 1)
    comp = torch.randint(0, VOCAB, (R, T), generator=g)
    return RolloutBatch(
        prompt_ids=prompt,
        prompt_mask=torch.ones(R, LP, dtype=torch.long),
        completion_ids=comp,
        completion_mask=torch.ones(R, T, dtype=torch.bool),
        sampler_logprobs=torch.zeros(R, T),
        truncated=torch.ones(R, dtype=torch.bool),
        group_size=R,
    )


def run_plain(model, batch):
    model.zero_grad(set_to_none=True)
    rollout_scores(batch_logprobs(model, batch), batch.completion_mask).sum().backward()
    model.zero_grad(set_to_none=True)
    return None


def run_gram(model, batch):
    return exact_rollout_gram(model, batch)


def run_sketch(model, batch):
    g = sketch_rollout_grads(model, batch, sketch_in=16, sketch_out=16).sketch.double()
    return g @ g.T, None


SYSTEMS = {"plain": run_plain, "gram": run_gram, "sketch": run_sketch}


def worker(system: str, T: int) -> None:
    """One step of ``system`` in this (child) process; prints its memory as JSON."""
    model, batch = build_model(), build_batch(T)
    reset_peak()
    before = rss_now()
    SYSTEMS[system](model, batch)
    print(json.dumps({"system": system, "T": T, "rss_before": before, "peak": peak_rss()}))


def memory(system: str, T: int) -> dict | None:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", system, "--T", str(T)], capture_output=True, text=True
    )
    if out.returncode != 0:  # e.g. killed for memory on a shared machine: say so, keep the timings
        print(f"  memory of {system} at T = {T}: child exited {out.returncode} {out.stderr[-500:]}", flush=True)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def timings(model, T: int, repeats: int, warm_up: bool) -> dict:
    """{system: [seconds per repeat]} and the Gram's info, the systems interleaved."""
    batch = build_batch(T)
    print(f"\n== T = {T} (N = {R}, Lp = {LP}, L = {LP + T}); load average before: {load_avg()}", flush=True)
    if warm_up:  # untimed, at the first length only: thread pools, allocator, first-call paths
        for fn in SYSTEMS.values():
            fn(model, batch)
    times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    info = {}
    for rep in range(repeats):
        for name, fn in SYSTEMS.items():
            t0 = time.perf_counter()
            out = fn(model, batch)
            times[name].append(time.perf_counter() - t0)
            if name == "gram":
                info = out[1]
        print(
            f"  repeat {rep}: " + "  ".join(f"{s} {times[s][-1]:7.2f} s" for s in SYSTEMS) + f"   load {load_avg()}",
            flush=True,
        )
    print(f"  load average after: {load_avg()}")
    return {"times": times, "info": info}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[24, 512])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-memory", action="store_true", help="skip the child processes' peak memory")
    ap.add_argument("--no-warm-up", action="store_true", help="no untimed first run (e.g. a long length alone)")
    ap.add_argument("--memory-only", action="store_true", help="only the child processes' peak memory")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--T", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.T)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} cores; load average {load_avg()}"
    )
    model = build_model()
    print(
        f"model: SmolLM2-135M architecture, random weights, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"parameters, attention {model.config._attn_implementation}"
    )
    results = (
        {}
        if args.memory_only
        else {
            T: timings(model, T, args.repeats, warm_up=k == 0 and not args.no_warm_up)
            for k, T in enumerate(args.lengths)
        }
    )
    del model
    mem = {} if args.no_memory else {(s, T): m for T in args.lengths for s in SYSTEMS if (m := memory(s, T))}
    if args.memory_only:
        for (s, T), m in mem.items():
            print(
                f"T = {T} {s}: peak {m['peak'] / 2**30:.2f} GB, step extra "
                f"{(m['peak'] - m['rss_before']) / 2**30:.2f} GB"
            )
        return None
    print("\n| T | system | seconds (each repeat) | median s | / plain | peak RSS GB | step extra GB |")
    print("|---|---|---|---|---|---|---|")
    for T, r in results.items():
        base = statistics.median(r["times"]["plain"])
        for s, ts in r["times"].items():
            med = statistics.median(ts)
            m = mem.get((s, T))
            peak = f"{m['peak'] / 2**30:.2f}" if m else "-"
            extra = f"{(m['peak'] - m['rss_before']) / 2**30:.2f}" if m else "-"
            print(
                f"| {T} | {s} | {' '.join(f'{t:.2f}' for t in ts)} | {med:.2f} | {med / base:.2f}x | {peak} | {extra} |"
            )
    for T, r in results.items():
        info = r["info"]
        forms = info["forms"]
        counts = {f: sum(1 for v in forms.values() if v == f) for f in ("token", "rollout")}
        ratio = statistics.median(r["times"]["gram"]) / statistics.median(r["times"]["plain"])
        target = 1.3 if T <= 24 else 2.0
        print(
            f"\nT = {T}: gram / plain = {ratio:.2f} ({'meets' if ratio <= target else 'MISSES'} the <= {target}x "
            f"target); coverage {info['coverage']:.4f} ({info['covered_params']}/{info['total_params']}); linear "
            f"forms {counts}, lm_head {forms.get('lm_head')}; hooks {info['hook_seconds']:.2f} s (forward "
            f"{info['seconds']['forward']:.2f} s, backward with hooks {info['seconds']['backward']:.2f} s)"
        )
        print("  trace share:", {k: round(v, 4) for k, v in info["trace_share"].items()})
        if ("gram", T) in mem and ("sketch", T) in mem:
            g, sk = mem[("gram", T)], mem[("sketch", T)]
            over = ((g["peak"] - g["rss_before"]) - (sk["peak"] - sk["rss_before"])) / 2**30
            print(
                f"  step memory gram - sketch = {over:+.2f} GB ({'meets' if over <= 1 else 'MISSES'} the <= +1 GB "
                "target)"
            )
    print(f"\nload average at the end: {load_avg()}")


if __name__ == "__main__":
    main()
