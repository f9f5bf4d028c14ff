"""Several training processes (torchrun / accelerate launch): who this process is, and every sum and gather the
trainer does across processes.

:class:`Processes` knows this process's rank, the number of processes and the device; its methods are every
collective of the loop and the update: tensor sums and gathers (:meth:`Processes.sum`, :meth:`Processes.gather`,
:meth:`Processes.gather_all`), float sums and maxima (:meth:`Processes.sum_floats`, :meth:`Processes.max_float`), a
flag any process raised (:meth:`Processes.any`), the gradient all-reduce (:meth:`Processes.sum_grads`) and
:meth:`Processes.barrier`. With one process every one of them returns its input unchanged,
so a single-process run does no extra arithmetic. :func:`setup_processes` starts accelerate's process state;
:func:`gather_objects` gathers picklable objects (the lens's per-group rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

from grpo_lens.config import resolve_device

#: The most elements one gradient all-reduce carries (:meth:`Processes.sum_grads`): 2^24, 64 MiB of float32, so
#: flattening a bucket costs at most that much memory more, while a model of ~100M parameters takes a few collectives,
#: not one per tensor. A larger tensor goes alone, in place.
GRAD_BUCKET_ELEMENTS = 1 << 24


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
    sharded: bool = False  # the policy is FSDP2-sharded (--parallelism fsdp2): its backward sums the gradients itself

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

    def gather_all(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:meth:`gather` of each of ``values``, in order."""
        return tuple(self.gather(v) for v in values)

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Each of ``values`` summed over processes (one float64 all-reduce); the values, as floats, for one process."""
        if self.world == 1:
            return [float(v) for v in values]
        return self.sum(torch.tensor(list(values), dtype=torch.float64, device=self.device)).tolist()

    def max_float(self, value: float) -> float:
        """The largest of every process's ``value`` (float64); ``value`` itself for one process."""
        if self.world == 1:
            return float(value)
        return float(self.gather(torch.tensor([value], dtype=torch.float64, device=self.device)).max())

    def any(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any of them, so all processes take the same branch."""
        if self.world == 1:
            return bool(flag)
        return self.sum_floats([float(flag)])[0] > 0

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """All-reduce sum of the gradients of ``params``, in place (nothing for one process, nor for an FSDP2-sharded
        policy, whose backward already reduce-scattered the sum: :mod:`grpo_lens.runtime.sharding`).

        Each process's loss is already divided by the normaliser summed over processes, so the sum is the gradient of
        the whole batch's loss, the one a single process would compute on all of it.

        Every process runs the same collectives whatever gradients it holds: a process whose groups have no reward
        contrast forwards them without gradient and runs no backward (:func:`grpo_lens.train.update.still_rows`), so
        it may hold none while another holds all (an all-reduce of only the gradients that exist aborted
        with a gloo "collective mismatch"). One small all-reduce first counts, per parameter, the processes holding
        its gradient; every parameter that any process holds one for is then summed, zeros standing in where this
        process has none, in ``params``' order, flattened into buckets of at most :data:`GRAD_BUCKET_ELEMENTS`
        elements of one dtype and device (:func:`grad_buckets`). A parameter no process holds a gradient for keeps
        ``grad`` None, as in one process on the whole batch (AdamW then leaves it and its moments alone).
        """
        if self.world == 1 or self.sharded:
            return
        held = self.sum(torch.tensor([float(p.grad is not None) for p in params], device=self.device))  # [P]
        summed = [p for p, n in zip(params, held.tolist()) if n > 0]
        for p in summed:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # every summed grad is set above
        for bucket in grad_buckets([p.grad for p in summed], GRAD_BUCKET_ELEMENTS):  # type: ignore[misc]
            if len(bucket) == 1:
                torch.distributed.all_reduce(bucket[0])
                continue
            flat = torch.cat([g.reshape(-1) for g in bucket])
            torch.distributed.all_reduce(flat)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def barrier(self) -> None:
        """Wait for every process (no-op for one process)."""
        if self.world > 1:
            torch.distributed.barrier()


def grad_buckets(grads: Sequence[torch.Tensor], max_elements: int) -> list[list[torch.Tensor]]:
    """``grads`` in order, cut into consecutive buckets of one dtype and device with at most ``max_elements`` elements
    in all (a tensor larger than that is a bucket of its own): the all-reduces of :meth:`Processes.sum_grads`.

    The same list on every process, since it depends only on the parameters' order, shapes and dtypes.
    """
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        last = buckets[-1][-1] if buckets else None
        if last is None or last.dtype != g.dtype or last.device != g.device or size + g.numel() > max_elements:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel()
    return buckets


def setup_processes(device: str) -> Processes:
    """Start accelerate's process state (reads torchrun/accelerate env vars; gloo on CPU).

    Raises:
        ConfigError: ``device`` names a CUDA device torch cannot see.
    """
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
