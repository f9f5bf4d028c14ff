"""Memory of a training process: the micro-batch size the update picks when ``micro_batch_size`` is unset, the peak
memory each step reports, and how freed memory is kept for reuse.

:func:`auto_micro_batch_size` fits as many rollouts per forward/backward as a share of the device's total memory
(:func:`total_memory_bytes`) allows, after weights, gradients and AdamW's moments, at
:func:`activation_bytes_per_rollout` each. :func:`_peak_memory_mb` is ``perf/peak_memory_mb``: CUDA's peak allocated
memory, or the process's peak resident set size on the CPU. :func:`keep_freed_memory` has glibc's malloc keep freed
memory for the next step instead of returning it to the OS (the train and probe entry points call it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import resource

import torch

logger = logging.getLogger(__name__)

#: mallopt's parameter numbers (glibc <malloc.h>)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: the value :func:`keep_freed_memory` gives both thresholds: the largest a C int holds (mallopt takes an int)
KEEP_FREED_BYTES = 2**31 - 1
#: set to 0 to keep glibc's own malloc thresholds in grpo-lens' train and probe
KEEP_FREED_MEMORY_ENV = "GRPO_LENS_KEEP_FREED_MEMORY"
_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_kept: bool | None = None  # this process's answer, once asked


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks of up to 2 GiB for reuse, instead of returning them to the OS; True when
    it now does (once per process; later calls return the first answer).

    A CPU step allocates and frees gigabytes of activations, logits and gradients. With glibc's defaults every block
    above the (dynamic, at most 32 MiB) mmap threshold is a fresh mapping and freed heap tops are trimmed, so the next
    step page-faults all of it in again (zeroed pages; on a virtual machine each fault costs more). Both thresholds at
    :data:`KEEP_FREED_BYTES` keep the memory mapped: on the default model (2-core CPU, B = 4 x R = 8, 24 tokens) a
    4-step lens-off run page-faulted 1.8 M times instead of 5.7 M, and a step took 11.4 s instead of 15.3 s, for about
    3% more peak resident memory (docs/benchmarks.md §Freed memory kept for reuse). Numbers are unchanged: torch
    aligns every block alike, and no computation reads where a block lies (a 2-step run's metrics are equal).

    Left as it is: a libc without ``mallopt`` (not glibc: macOS, musl), a user's own malloc settings in the
    environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``), or
    ``GRPO_LENS_KEEP_FREED_MEMORY=0``. The setting is process-wide: a script that calls
    :func:`grpo_lens.train.loop.train` keeps it after the call.
    """
    global _kept
    if _kept is not None:
        return _kept
    _kept = False
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1") == "0" or any(k in os.environ for k in _USER_MALLOC_ENV):
        return _kept
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        return _kept
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting either turns glibc's dynamic threshold off
    _kept = bool(mallopt(M_MMAP_THRESHOLD, KEEP_FREED_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES))
    if _kept:
        logger.debug("malloc keeps freed memory for reuse (%s=0 to keep glibc's defaults)", KEEP_FREED_MEMORY_ENV)
    return _kept


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
