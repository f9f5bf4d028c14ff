"""Memory of a training process: the micro-batch size the update picks when ``micro_batch_size`` is unset, and the
peak memory each step reports.

:func:`auto_micro_batch_size` fits as many rollouts per forward/backward as a share of the device's total memory
(:func:`total_memory_bytes`) allows, after weights, gradients and AdamW's moments, at
:func:`activation_bytes_per_rollout` each. :func:`_peak_memory_mb` is ``perf/peak_memory_mb``: CUDA's peak allocated
memory, or the process's peak resident set size on the CPU.
"""

from __future__ import annotations

import math
import resource

import torch


def total_memory_bytes(device: torch.device) -> int | None:
    """The memory a training process may plan with: a CUDA device's total memory, else the machine's RAM (Linux
    ``MemTotal``); None when unknown. Total rather than free memory, so the choice it feeds is the same in a
    resumed run on the same machine (the micro-batch size changes float rounding, never the gradient)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def activation_bytes_per_rollout(model: torch.nn.Module, seq_len: int, scored_len: int) -> int:
    """Estimated memory one rollout's forward keeps for its backward, in bytes (an upper-side estimate).

    Per position and decoder layer about 10 H + 4 I saved values (norm inputs and outputs, q/k/v, attention output,
    the MLP's gate, up, activation and down inputs) plus n_heads * L attention probabilities; per scored position
    three float32 vocabulary rows (logits, their float copy divided by the temperature, the log-softmax saved for
    backward). H hidden size, I MLP width, L = seq_len.

    Args:
        model: a transformers causal LM (its ``config`` gives the sizes; missing fields fall back to H = 1024,
            I = 4 H, 24 layers, 16 heads, V = 50,000).
        seq_len: L = Lp + T positions per rollout.   scored_len: T completion positions that get logits.
    """
    cfg = getattr(model, "config", None)
    hidden = int(getattr(cfg, "hidden_size", 1024) or 1024)
    inter = int(getattr(cfg, "intermediate_size", 4 * hidden) or 4 * hidden)
    layers = int(getattr(cfg, "num_hidden_layers", 24) or 24)
    heads = int(getattr(cfg, "num_attention_heads", 16) or 16)
    vocab = int(getattr(cfg, "vocab_size", 50_000) or 50_000)
    elem = next(model.parameters()).element_size()
    per_layer = seq_len * (10 * hidden + 4 * inter + heads * seq_len) * elem
    return layers * per_layer + 3 * scored_len * vocab * 4


def auto_micro_batch_size(
    model: torch.nn.Module, n_rollouts: int, seq_len: int, scored_len: int, total_bytes: int | None, share: float = 0.25
) -> int:
    """Rollouts per forward/backward when ``micro_batch_size`` is unset: as many as fit, up to all ``n_rollouts``.

    The budget is ``share`` of what ``total_bytes`` leaves after the weights, gradients and AdamW's two moments (4
    copies of the parameters); each rollout takes :func:`activation_bytes_per_rollout`. One pass over the whole
    mini-batch is fastest (larger matrix products, one LM-head call); smaller micro-batches only save memory.

    Args:
        n_rollouts: rollouts in the mini-batch.   seq_len: L.   scored_len: T.
        total_bytes: :func:`total_memory_bytes`; None (unknown) gives 8 rollouts, the former fixed default.
        share: the fraction of total memory the activations may use.

    Returns:
        an int in [1, n_rollouts].
    """
    if total_bytes is None:
        return max(1, min(8, n_rollouts))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = share * (total_bytes - 4 * params)
    per_rollout = max(activation_bytes_per_rollout(model, seq_len, scored_len), 1)
    return int(max(1, min(n_rollouts, budget // per_rollout)))


def _peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far in MiB: CUDA's max allocated on ``device``, else the peak RSS (NaN when the
    platform does not report it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    except (ImportError, AttributeError):
        return math.nan
