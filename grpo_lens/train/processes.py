"""The GRPO training loop: sample -> reward -> advantages -> clipped-surrogate passes -> AdamW step, with the lens.

Read :func:`train` top to bottom: every formula it uses lives in a pure module (advantages, losses, diagnostics);
this file only moves tensors between them, writes the run directory and keeps the run resumable.

Several processes (``torchrun --nproc_per_node 2 -m grpo_lens.cli train ...``, or ``accelerate launch``): every
process draws the same B prompts for a step and samples the groups of its own share of them; losses are divided by a
normaliser summed over processes and the gradients are summed with an all-reduce, so the update equals a single
process's on the whole batch. With num_mini_batches M, each process splits its share into M chunks and optimizer step
k sums chunk k of every process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

from grpo_lens.config import resolve_device


# ---------------------------------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Processes:
    """Where this process stands among the training processes (one when not launched by torchrun/accelerate)."""

    rank: int
    world: int
    device: torch.device
    accelerator: Any = None

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that writes the run directory."""
        return self.rank == 0

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """All-reduce sum across processes (identity for one process)."""
        if self.world > 1:
            value = value.clone()
            torch.distributed.all_reduce(value)
        return value

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        """Concatenate a [n, ...] tensor from every process along dim 0, in rank order."""
        if self.world == 1:
            return value
        parts = [torch.empty_like(value) for _ in range(self.world)]
        torch.distributed.all_gather(parts, value.contiguous())
        return torch.cat(parts, dim=0)

    def barrier(self) -> None:
        """Wait for every process (no-op for one process)."""
        if self.world > 1:
            torch.distributed.barrier()


def setup_processes(device: str) -> Processes:
    """Start accelerate's process state (reads torchrun/accelerate env vars; gloo on CPU)."""

    use_cpu = resolve_device(device) == "cpu"  # ConfigError for a CUDA device torch cannot see
    accelerator = Accelerator(cpu=use_cpu)
    dev = accelerator.device if device in ("auto", "cpu", "cuda") else torch.device(device)
    return Processes(accelerator.process_index, accelerator.num_processes, dev, accelerator)


def gather_objects(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] across processes (torch.distributed), or [obj] for one process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            parts: list[Any] = [None] * world
            torch.distributed.all_gather_object(parts, obj)
            return parts
    return [obj]
