"""How the policy is laid out over several training processes (``--parallelism``): replicated (``ddp``) or sharded
with torch's FSDP2 (``fsdp2``, :func:`torch.distributed.fsdp.fully_shard`), and every read of the weights, gradients
and optimizer state that has to know which.

``ddp``: every process holds the whole policy; after each backward the trainer sums the gradients with an all-reduce
(:meth:`grpo_lens.runtime.processes.Processes.sum_grads`). ``fsdp2``: each decoder layer (the classes the model names in
``_no_split_modules``) and then the root are ``fully_shard``-ed over all processes, so each process holds 1/W of
every parameter, gradient and AdamW moment (dim-0 shards); a module's weights are all-gathered for its forward and
backward, and each backward reduce-scatters the gradients with a sum (gradient divide factor 1: the trainer's loss
is already divided by the normaliser summed over processes), so the sharded gradient is the whole batch's.
docs/theory.md §Sums across processes says how each sum is formed.

Under FSDP2 every forward is a collective, so every process must run the same number of forwards: generation runs
with transformers' ``synced_gpus`` (set by :func:`shard_fsdp2`), the update's micro-batches are sized alike on every
process (:func:`grpo_lens.train.update.plan_update`), and the lens's own pass runs on every process
(:meth:`grpo_lens.lens.trainer_lens.TrainerLens.measure`).

Checkpoints and the final model hold full (unsharded) tensors, gathered to rank 0 by
:func:`torch.distributed.checkpoint.state_dict.get_model_state_dict` (:func:`full_model_state`,
:func:`full_optimizer_state`) and loaded back on every process by ``set_model_state_dict`` /
``set_optimizer_state_dict`` (:func:`load_full_states`); the optimizer file is then keyed by parameter name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from grpo_lens.registry import Registry

logger = logging.getLogger(__name__)

#: ``--parallelism`` values: name -> function(policy, world) -> policy laid out for ``world`` processes.
PARALLELISMS: Registry[Callable[[nn.Module, int], nn.Module]] = Registry("parallelism")


@PARALLELISMS.register("ddp")
def replicate(policy: nn.Module, world: int) -> nn.Module:
    """Every process holds the whole policy (the trainer all-reduces gradients): ``policy`` unchanged."""
    return policy


def decoder_layers(policy: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: those whose class the model lists in ``_no_split_modules`` (transformers'
    decoder-layer classes, as accelerate's transformer auto-wrap policy reads them), outermost first.

    Raises:
        ValueError: the model names no such class, or none of its modules is one.
    """
    names = set(getattr(policy, "_no_split_modules", None) or [])
    layers = [m for m in policy.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"--parallelism fsdp2 shards each decoder layer, and {type(policy).__name__} names no layer "
            f"class (_no_split_modules = {sorted(names)}); use --parallelism ddp"
        )
    return layers


@PARALLELISMS.register("fsdp2")
def shard_fsdp2(policy: nn.Module, world: int) -> nn.Module:
    """``fully_shard`` each decoder layer (:func:`decoder_layers`), then the root (embedding, final norm, LM head),
    over all ``world`` processes; gradients reduce-scattered as sums (divide factor 1), and transformers' generation
    told to keep every process's forwards in step (``synced_gpus``). Returns the same module, now an FSDPModule.

    Raises:
        ValueError: one process (``world`` < 2): there is nothing to shard.
    """
    if world < 2:
        raise ValueError(
            "--parallelism fsdp2 shards the policy over several processes and this run has 1: launch "
            "it with torchrun --nproc_per_node N (N >= 2) or accelerate launch --num_processes N, or use "
            "--parallelism ddp"
        )
    for layer in decoder_layers(policy):
        fully_shard(layer)
    fully_shard(policy)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: each process's loss carries the global normaliser
            module.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM (gloo has no PREMUL_SUM), then / 1.0
    # transformers' generate then runs with synced_gpus across processes (nn.Module types attributes Tensor | Module)
    policy._is_fsdp_managed_module = True  # type: ignore[assignment]
    return policy


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` was laid out by :func:`shard_fsdp2`."""
    return isinstance(module, FSDPModule)


# ---------------------------------------------------------------------------------------------------------------------
# Reading sharded tensors
# ---------------------------------------------------------------------------------------------------------------------
def local_part(t: Tensor) -> Tensor:
    """This process's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_flat_range(t: Tensor) -> tuple[int, int]:
    """[start, stop) of this process's entries in the row-major flattening of ``t``'s full tensor: FSDP2's dim-0
    shards, ``torch.chunk`` of the rows in rank order; (0, numel) for a plain tensor.

    Raises:
        ValueError: a DTensor sharded otherwise than on dim 0 over one mesh dimension.
    """
    if not isinstance(t, DTensor):
        return 0, t.numel()
    placements = t.placements
    if len(placements) != 1 or not placements[0].is_shard(0):
        raise ValueError(f"expected FSDP2's dim-0 shards, got placements {placements}")
    rows, world, rank = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    chunk = -(-rows // world)
    r0, r1 = min(rows, rank * chunk), min(rows, (rank + 1) * chunk)
    per_row = t.numel() // rows if rows else 0
    assert local_part(t).shape[0] == r1 - r0, (local_part(t).shape, r0, r1)
    return r0 * per_row, r1 * per_row


def entries(tensors: list[Tensor | None], index: list[Tensor]) -> list[Tensor]:
    """[s_t] float32 CPU copies of the entries ``index[t]`` (flat, of the full tensor) of each of ``tensors`` (None
    gives zeros); for DTensors each process reads the entries of its shard and one all-reduce sums them (every entry
    lives on exactly one process, so the sum is the entry itself)."""
    parts, sharded = [], False
    for t, idx in zip(tensors, index, strict=True):
        if t is None:
            parts.append(torch.zeros(len(idx)))
            continue
        if isinstance(t, DTensor):
            sharded = True
            a, b = local_flat_range(t)
            local = local_part(t).detach().reshape(-1)
            mine = (idx >= a) & (idx < b)
            out = torch.zeros(len(idx), dtype=torch.float32, device=local.device)
            out[mine] = local[idx[mine].to(local.device) - a].float()
            parts.append(out.cpu())
        else:
            parts.append(t.detach().reshape(-1)[idx.to(t.device)].float().cpu().clone())
    if sharded and parts:
        flat = torch.cat(parts)
        torch.distributed.all_reduce(flat)
        parts = list(torch.split(flat, [len(i) for i in index]))
    return parts


def sum_over_shards(values: list[float], tensors: list[Tensor]) -> list[float]:
    """``values`` summed over processes when any of ``tensors`` is a DTensor (sums of per-shard counts), else as
    they are."""
    if not any(isinstance(t, DTensor) for t in tensors):
        return values
    total = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(total)
    return total.tolist()


# ---------------------------------------------------------------------------------------------------------------------
# Full state dicts: checkpoints and the final model
# ---------------------------------------------------------------------------------------------------------------------
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(policy: nn.Module) -> dict[str, Tensor]:
    """The policy's full state dict on rank 0 ({} elsewhere), tensors on the CPU, each tied matrix once (under its
    first name). Every process must call it (all-gathers)."""
    state: dict[str, Any] = get_model_state_dict(policy, options=_FULL)  # full state dict: tensors
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        if t.data_ptr() not in seen or t.numel() == 0:
            seen.add(t.data_ptr())
            out[name] = t.contiguous()
    return out


def full_optimizer_state(policy: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state dict on rank 0 ({} elsewhere), keyed by parameter name. Every process calls it."""
    return get_optimizer_state_dict(policy, optimizer, options=_FULL)


def load_full_states(
    policy: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Tensor], optimizer_state: dict[str, Any]
) -> None:
    """Load what :func:`full_model_state` and :func:`full_optimizer_state` saved into the sharded ``policy`` and
    ``optimizer``, on every process (each keeps its shard).

    Raises:
        ValueError: the model state lacks a parameter that is not a tied alias of one it has, or has an unknown one.
    """
    aliases: dict[int, list[str]] = {}
    for name, p in policy.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    state = dict(model_state)
    expected = set(get_model_state_dict(policy, options=StateDictOptions(full_state_dict=False)))
    for names in aliases.values():
        have = [n for n in names if n in state]
        for n in names:
            if n not in state and have:
                state[n] = state[have[0]]
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unknown:
        raise ValueError(
            f"the checkpoint's model does not match the policy: missing {missing[:5]}, unknown {unknown[:5]}"
        )
    # torch types the state dict's values as a union a dict[str, Tensor] does not match (dict is invariant)
    set_model_state_dict(policy, state, options=StateDictOptions(full_state_dict=True))  # type: ignore[arg-type]
    set_optimizer_state_dict(policy, optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True))
