"""Cost of per-rollout gradients relative to one plain backward of the same batch.

Prints, for one group of R rollouts on the default model (SmolLM2-135M shape), the wall-clock ratios

    sketch  = sketch_rollout_grads (all nn.Linear layers, sketch_in x sketch_out per layer, ONE
              batched forward+backward)
              / plain forward+backward of sum_i s_i (parameter gradients, as a trainer computes them)
    capture = the plain forward+backward with a GradientCapture around it (the trainer's way) / plain
    exact   = exact_rollout_grads (one forward+backward per rollout, all parameters) / plain

Target: sketch <= 1.5. Times are medians over ``--repeats``, with the three measurements interleaved in each repeat
so that load from other processes hits them alike.

    .venv/bin/python benchmarks/bench_sketch.py [--group-size 8 --prompt-len 64 --completion-len 128 --k 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from grpo_lens.gradients.exact import exact_rollout_grads
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.gradients.sketch import GradientCapture, sketch_rollout_grads
from grpo_lens.rollout import RolloutBatch, batch_logprobs


def load(name: str, device: str):
    """The default model via grpo_lens.models.load_model, else a random LlamaForCausalLM of the same shape."""
    try:
        from grpo_lens.models import load_model

        model, _ = load_model(name, device=device)
        return model, f"{name} (load_model)"
    except Exception as err:  # noqa: BLE001 - any failure falls back to the same-shape random model
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        return LlamaForCausalLM(config).to(device).eval(), f"random SmolLM2-135M-shaped Llama ({type(err).__name__})"


def random_batch(vocab: int, group_size: int, prompt_len: int, completion_len: int, device: str) -> RolloutBatch:
    """One group: a shared random prompt, R random completions whose lengths range over [T/2, T]."""
    g = torch.Generator().manual_seed(0)
    r = group_size
    prompt_ids = torch.randint(0, vocab, (1, prompt_len), generator=g).repeat(r, 1)
    completion_ids = torch.randint(0, vocab, (r, completion_len), generator=g)
    lengths = torch.randint(completion_len // 2, completion_len + 1, (r, 1), generator=g)
    completion_mask = torch.arange(completion_len) < lengths
    return RolloutBatch(
        prompt_ids.to(device),
        torch.ones(r, prompt_len, dtype=torch.long, device=device),
        completion_ids.to(device),
        completion_mask.to(device),
        torch.zeros(r, completion_len),
        torch.zeros(r, dtype=torch.bool),
        r,
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=16, help="sketch size per side (sketch_in = sketch_out)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-exact", action="store_true", help="skip the exact path")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    model, source = load(args.model, args.device)
    for p in model.parameters():
        p.requires_grad_(True)
    batch = random_batch(model.config.vocab_size, args.group_size, args.prompt_len, args.completion_len, args.device)
    n_lin = sum(isinstance(m, torch.nn.Linear) for m in model.modules())

    def plain():
        model.zero_grad(set_to_none=True)
        rollout_scores(batch_logprobs(model, batch), batch.completion_mask).sum().backward()

    def sketch():
        sketch_rollout_grads(model, batch, sketch_in=args.k, sketch_out=args.k)

    def capture():
        with GradientCapture(model, sketch_in=args.k, sketch_out=args.k) as cap:
            plain()
        cap.result()

    def exact():
        for i in range(batch.num_rollouts):  # exact_rollout_grads row by row, so that [N, P] is never held
            exact_rollout_grads(model, batch.select([i]))

    runs = {"plain": plain, "sketch": sketch, "capture": capture}
    if not args.no_exact:
        runs["exact"] = exact
    for fn in runs.values():  # warm-up (allocator, projections)
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            sync(args.device)
            t0 = time.perf_counter()
            fn()
            sync(args.device)
            times[name].append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    med = {k: statistics.median(v) for k, v in times.items()}

    print(f"model: {source}; {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {n_lin} nn.Linear")
    print(
        f"batch: R = {args.group_size} rollouts x ({args.prompt_len} prompt + {args.completion_len} completion) "
        f"tokens; sketch {args.k}x{args.k} per layer = {n_lin * args.k * args.k} dims; device {args.device}, "
        f"{torch.get_num_threads()} threads; median of {args.repeats}"
    )
    print(f"plain forward+backward:            {med['plain']:8.3f} s   1.00x")
    for name, label in (
        ("sketch", "sketched per-rollout (one pass)"),
        ("capture", "plain + GradientCapture hooks"),
        ("exact", "exact per-rollout (R passes)"),
    ):
        if name in med:
            print(f"{label + ':':34s} {med[name]:8.3f} s   {med[name] / med['plain']:.2f}x")
    verdict = "meets" if med["sketch"] / med["plain"] <= 1.5 else "MISSES"
    print(f"sketch / plain = {med['sketch'] / med['plain']:.2f} ({verdict} the <= 1.5x target)")


if __name__ == "__main__":
    main()
