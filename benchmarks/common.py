"""Helpers shared by the benchmark scripts: load average, a process's resident memory, the CPU's matmul throughput, and
the FLOPs of a GRPO step counted from the model's shape.

Imported as ``common`` by scripts run as ``python benchmarks/<script>.py`` (the script's folder is on ``sys.path``).

FLOP counts (:func:`forward_flops`, :func:`step_flops`, :func:`generation_flops`) are the dense matrix products a
decoder-only transformer must do, 2 FLOPs per multiply-add; element-wise work (norms, activations, softmax, RoPE,
the optimizer) and the embedding lookup count 0. For N sequences of L = Lp + T positions:

    linear      2 * P_linear * N * L      P_linear: every nn.Linear weight except the LM head
    lm_head     2 * V * d * N * K          K positions with logits (T + 1 under ``logits_to_keep``, L without)
    attention   2 * H * hd * N * L (L + 1) per layer: Q K^T and A V over the L (L + 1) / 2 causal pairs

and forward + backward = 3 x forward (the backward computes input and weight gradients: two products per forward
one), the usual 6 * params * tokens of Kaplan et al. (arXiv 2001.08361, §2.1) plus attention.
"""

from __future__ import annotations

import ctypes
import os
import time

import torch
from torch import nn


def load_avg() -> str:
    """The 1, 5 and 15 minute load averages as one string."""
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


# ---------------------------------------------------------------------------------------------------------------------
# Resident memory (Linux /proc)
# ---------------------------------------------------------------------------------------------------------------------
def rss_now() -> int:
    """The process's resident set, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """The process's peak resident set since the last :func:`reset_peak` (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak() -> bool:
    """Return freed heap memory to the system (glibc ``malloc_trim``), then reset the peak resident set to the current
    one (Linux: write 5 to /proc/self/clear_refs), so that a peak read afterwards is the next step's. False when the
    kernel refuses the reset (then :func:`peak_rss` is the process's lifetime peak)."""
    malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def malloc_trim() -> None:
    """glibc ``malloc_trim(0)``: freed memory cached by the allocator goes back to the system (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def mem_available() -> int:
    """MemAvailable of /proc/meminfo, bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0


# ---------------------------------------------------------------------------------------------------------------------
# Throughput and FLOPs
# ---------------------------------------------------------------------------------------------------------------------
def gemm_flops_per_s(n: int = 2048, repeats: int = 5, device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a square [n, n] x [n, n] matrix product (2 n^3 FLOPs) on ``device`` with the current thread count:
    the best of ``repeats`` timed products after one untimed one (the best, so that a moment of load from other
    processes lowers it least)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def shape_of(model: nn.Module) -> dict[str, int]:
    """The sizes the FLOP count needs: ``linear`` (weights of every nn.Linear but the LM head), ``lm_head`` (V * d),
    ``layers``, ``attn_width`` (H * head_dim) and ``params`` (every parameter, shared ones once)."""
    head = model.get_output_embeddings()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "linear": sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head),
        "lm_head": head.weight.numel(),
        "layers": cfg.num_hidden_layers,
        "attn_width": cfg.num_attention_heads * head_dim,
        "params": sum(p.numel() for p in model.parameters()),
    }


def forward_flops(shape: dict[str, int], n: int, lp: int, t: int, logits_positions: int) -> dict[str, float]:
    """Forward FLOPs of N sequences of Lp + T positions with logits at ``logits_positions`` of each (module doc):
    {linear, lm_head, attention, total}."""
    length = lp + t
    out = {
        "linear": 2.0 * shape["linear"] * n * length,
        "lm_head": 2.0 * shape["lm_head"] * n * logits_positions,
        "attention": 2.0 * shape["layers"] * shape["attn_width"] * n * length * (length + 1),
    }
    out["total"] = sum(out.values())
    return out


def step_flops(shape: dict[str, int], n: int, lp: int, t: int, logits_positions: int | None = None) -> float:
    """Forward + backward FLOPs (3 x :func:`forward_flops`) of a training pass over N rollouts of Lp + T positions;
    logits at the T + 1 positions ``logits_to_keep`` keeps unless ``logits_positions`` says otherwise."""
    return 3.0 * forward_flops(shape, n, lp, t, t + 1 if logits_positions is None else logits_positions)["total"]


def shared_prompt_flops(shape: dict[str, int], n: int, groups: int, lp: int, t: int) -> float:
    """:func:`generation_flops` + :func:`step_flops` of N = B R rollouts with each of the B distinct prompts run once
    (``groups`` = B): the prefill and the training forward run B prompts of Lp positions (logits at the last one),
    the training forward then N rows of T completion positions, the k-th attending to Lp + k keys
    (grpo_lens.rollout.group_logprobs, shared_prompt_cache); decoding is unchanged."""
    prompt = forward_flops(shape, groups, lp, 0, 1)["total"]
    completion = 2.0 * (shape["linear"] + shape["lm_head"]) * n * t + 4.0 * shape["layers"] * shape[
        "attn_width"
    ] * n * (t * lp + t * (t + 1) / 2)
    generation = generation_flops(shape, n, lp, t) - forward_flops(shape, n, lp, 0, 1)["total"] + prompt
    return generation + 3.0 * (prompt + completion)


def generation_flops(shape: dict[str, int], n: int, lp: int, t: int) -> float:
    """Forward FLOPs of sampling T tokens after an Lp-token prompt for N sequences with a KV cache: the prompt's
    forward (logits at its last position) and T - 1 one-token forwards, the k-th (k = 1 .. T - 1) attending to
    Lp + k positions."""
    prefill = forward_flops(shape, n, lp, 0, 1)["total"]
    per_token = 2.0 * (shape["linear"] + shape["lm_head"]) * n
    attention = sum(4.0 * shape["layers"] * shape["attn_width"] * n * (lp + k) for k in range(1, t))
    return prefill + per_token * max(t - 1, 0) + attention
