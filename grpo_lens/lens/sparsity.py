"""Sparsity of the update and of the policy gradient over training, separated from bf16 rounding.

docs/theory.md §Sparsity over training. Shapes: P parameters; S sampled entries (a fixed, stratified uniform
subsample of the P, each with a weight w = entries it stands for, so weighted sums estimate sums over all P).

Why not only "bf16-unchanged": a bf16 value changes only when the update moves the float32 weight out of its bf16
rounding cell (relative half-width 2^-9 ~ 2e-3). An update whose every entry is non-zero but smaller than that leaves
almost every bf16 value unchanged, so the bf16-unchanged share measures update size against bf16's resolution, not
sparsity. Each bf16 share is therefore reported next to the share the same update entries give when permuted within
each tensor (:func:`permuted_bf16_unchanged_probability`: the magnitudes kept, their placement removed), next to the
share a *dense* update of the same per-tensor RMS would give (every entry Gaussian with that RMS:
:func:`dense_bf16_unchanged_probability`), with standard errors stratified by tensor, and the float32-unchanged share,
Hoyer sparsity (S3) and the top-1% energy share (S2-style) measure sparsity of the float32 vector itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from grpo_lens import metrics as mk
from grpo_lens.formulas.sparsity import (
    UPDATE_MEASURES,
    bf16_unchanged_counts,
    dense_bf16_unchanged_probability,
    flatten_sparsity,
    hoyer_from_norms,
    layer_type,
    permuted_bf16_unchanged_probability,
    top_share_of_sorted,
)
from grpo_lens.formulas.stats import stratified_mean_se
from grpo_lens.runtime.sharding import entries, local_part, sum_over_shards
from grpo_lens.seeding import derive_seed


@dataclass
class ParameterSample:
    """A fixed stratified uniform subsample of a model's trainable entries.

    Tensor t (numel n_t) contributes s_t = min(n_t, max(min_per_tensor, ceil(fraction * n_t))) entries drawn
    uniformly with replacement (seeded by the parameter name), each with weight n_t / s_t, so weighted sums over the
    sample are unbiased for sums over all entries. Tensors no larger than ``min_per_tensor`` are taken whole.

    Attributes:
        names: parameter names.  index: {name: [s_t] long flat indices}.  weight: {name: float n_t / s_t}.
        kinds: {name: layer type}.
    """

    names: list[str]
    index: dict[str, Tensor]
    weight: dict[str, float]
    kinds: dict[str, str]
    numel: int = 0
    size: int = 0
    params: dict[str, nn.Parameter] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, model: nn.Module, size: int = 2**19, min_per_tensor: int = 1024, seed: int = 0) -> ParameterSample:
        """Sample about ``size`` entries of ``model``'s trainable parameters (see the class docstring).

        Raises:
            ValueError: size < 1 or the model has no trainable parameter.
        """
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if size < 1 or not named:
            raise ValueError(f"need size >= 1 and a trainable parameter (size={size}, {len(named)} parameters)")
        total = sum(p.numel() for _, p in named)
        fraction = min(1.0, size / total)
        index, weight, kinds = {}, {}, {}
        taken = 0
        for n, p in named:
            k = min(p.numel(), max(min_per_tensor, math.ceil(fraction * p.numel())))
            gen = torch.Generator().manual_seed(derive_seed(seed, n, modulus=2**63))
            # whole small tensors; uniform draws with replacement otherwise (unbiased weighted sums, and no
            # randperm over tens of millions of entries)
            idx = torch.arange(p.numel()) if k == p.numel() else torch.randint(p.numel(), (k,), generator=gen)
            index[n] = idx.sort().values.to(p.device)
            weight[n] = p.numel() / k
            kinds[n] = layer_type(n)
            taken += k
        return cls([n for n, _ in named], index, weight, kinds, total, taken, dict(named))

    def values(self, tensors: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """{name: [s_t] float32 copy} of the sampled entries of the parameters (or of ``tensors``, e.g. grads)."""
        src = tensors if tensors is not None else {n: p.detach() for n, p in self.params.items()}
        # FSDP2 shards (DTensors): each process reads its own entries, one all-reduce joins them
        return dict(zip(self.names, entries([src.get(n) for n in self.names], [self.index[n] for n in self.names])))

    def grads(self) -> dict[str, Tensor]:
        """The sampled entries of each parameter's ``.grad`` (zeros where it is None)."""
        return self.values({n: p.grad for n, p in self.params.items() if p.grad is not None})

    def groups(self) -> dict[str, list[str]]:
        """{"all": every name, layer type: its names} (types present only)."""
        out: dict[str, list[str]] = {"all": list(self.names)}
        for n in self.names:
            out.setdefault(self.kinds[n], []).append(n)
        return out


def _flatten(sample: ParameterSample, vals: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, list[str], Tensor]:
    """(x [S], weights [S] float64, group id [S] long, group names, tensor id [S] long): every sampled entry once,
    its layer type's id and its tensor's (the sample's strata)."""
    kinds = sorted({sample.kinds[n] for n in sample.names})
    kid = {k: i for i, k in enumerate(kinds)}
    x = torch.cat([vals[n] for n in sample.names])
    w = torch.cat([torch.full((len(vals[n]),), sample.weight[n], dtype=torch.float64) for n in sample.names])
    g = torch.cat([torch.full((len(vals[n]),), kid[sample.kinds[n]], dtype=torch.long) for n in sample.names])
    t = torch.cat([torch.full((len(vals[n]),), i, dtype=torch.long) for i, n in enumerate(sample.names)])
    return x, w, g, kinds, t


def _grouped(
    x: Tensor,
    w: Tensor,
    g: Tensor,
    kinds: list[str],
    extra: dict[str, Tensor] | None = None,
    top: float = 0.01,
    strata: Tensor | None = None,
    se: dict[str, Tensor] | None = None,
) -> dict[str, dict[str, float]]:
    """zero share, Hoyer, top-1% energy and weighted means of ``extra`` per-entry values, overall and per group,
    in one pass: the same numbers as :func:`sparsity_measures` on each group's entries (entries sorted once); with
    ``strata`` (tensor ids), also ``<name>_se``, the stratified standard error of each ``se`` value's weighted mean
    (:func:`grpo_lens.formulas.stats.stratified_mean_se`).

    Each group's entries are one contiguous slice after a stable sort by group: the same vectors, in the same order,
    as the group's boolean mask selects, so every sum is the same to the bit, without a mask and a copy per group and
    per quantity."""
    v = x.detach().double()
    e = v.square()
    order = torch.argsort(e, descending=True)  # one sort serves every group's top-1%
    e_s, w_s = e[order], w[order]
    # group slices, entries in their original order (a stable sort by group, as a few compares)
    by_group = torch.cat([(g == i).nonzero().squeeze(1) for i in range(len(kinds))])
    g_s = g[order]
    by_group_s = torch.cat([(g_s == i).nonzero().squeeze(1) for i in range(len(kinds))])  # still sorted by energy
    counts = torch.bincount(g, minlength=len(kinds)).tolist()
    values = {"w": w, "v": v, "e": e, **(extra or {}), **{f"se:{k}": t for k, t in (se or {}).items()}}
    if strata is not None:
        values["strata"] = strata
    grouped = {k: t[by_group] for k, t in values.items()}
    e_sg, w_sg = e_s[by_group_s], w_s[by_group_s]
    slices = [("all", values, e_s, w_s)]
    start = 0
    for k, c in zip(kinds, counts):
        cut = slice(start, start + c)
        slices.append((k, {n: t[cut] for n, t in grouped.items()}, e_sg[cut], w_sg[cut]))
        start += c
    out = {}
    for name, part, e_top, w_top in slices:
        wm, vm = part["w"], part["v"]
        n = float(wm.sum())
        if n < 2:
            continue
        hoyer = hoyer_from_norms(float((wm * vm.abs()).sum()), math.sqrt(float((wm * part["e"]).sum())), n)
        res = {
            "zero": float((wm * (vm == 0)).sum()) / n,
            "hoyer": hoyer,
            "top1_energy": top_share_of_sorted(e_top, w_top, top),
        }
        for key in extra or {}:
            res[key] = float((wm * part[key]).sum()) / n
        if strata is not None:
            for key in se or {}:
                res[f"{key}_se"] = stratified_mean_se(part[f"se:{key}"], wm, part["strata"])
        out[name] = res
    return out


def sampled_update_sparsity(
    sample: ParameterSample, before: dict[str, Tensor], after: dict[str, Tensor]
) -> dict[str, dict[str, float]]:
    """:func:`update_sparsity` of after - before, overall and per layer type, each tensor its own stratum (the
    permutation control permutes within it, the dense control uses its RMS, the standard errors are stratified by it).

    Every per-entry quantity is computed once for the whole sample and then summed per group (the numbers equal
    :func:`update_sparsity` on each group's entries; a test checks it).

    Args:
        sample: where the values come from.  before, after: {name: [s_t]} from :meth:`ParameterSample.values`.

    Returns:
        {"all" | layer type: {m: value for m in :data:`grpo_lens.formulas.sparsity.UPDATE_MEASURES`}}.
    """
    rms = {n: float((after[n].double() - before[n].double()).square().mean().sqrt()) for n in sample.names}
    b, w, g, kinds, t = _flatten(sample, before)
    a = torch.cat([after[n] for n in sample.names])
    r = torch.cat([torch.full((len(before[n]),), rms[n], dtype=torch.float64) for n in sample.names])
    d = a.float() - b.float()
    same16 = (b.float().to(torch.bfloat16) == a.float().to(torch.bfloat16)).double()
    dense = dense_bf16_unchanged_probability(b, r)
    perm = permuted_bf16_unchanged_probability(b, d, t)
    res = _grouped(
        d,
        w,
        g,
        kinds,
        {"bf16_unchanged": same16, "bf16_permuted": perm, "bf16_dense": dense},
        strata=t,
        se={"f32_unchanged": (d == 0).double(), "bf16_unchanged": same16, "bf16_excess": same16 - perm},
    )
    return {
        k: {"f32_unchanged": m["zero"], **{x: m[x] for x in UPDATE_MEASURES if x != "f32_unchanged"}}
        for k, m in res.items()
    }


def sampled_vector_sparsity(sample: ParameterSample, vals: dict[str, Tensor]) -> dict[str, dict[str, float]]:
    """:func:`sparsity_measures` of a sampled vector (e.g. the policy gradient), overall and per layer type."""
    x, w, g, kinds, _ = _flatten(sample, vals)
    return _grouped(x, w, g, kinds)


class SparsityOverTraining:
    """Sparsity of the step's update, of the update since the start, of the step's gradient and of the gradient summed
    since the start, on a fixed sample.

    Call :meth:`accumulate_grad` after every step's backward (it adds the sampled gradient to the running sum), and on
    measured steps also :meth:`before_step` (same moment, before the optimizer step) and :meth:`after_step` after it.
    The start values are the weights at construction: build it from the freshly loaded model (before a checkpoint is
    restored) and a resumed run measures "since the start" from the same weights; the gradient sum travels in
    :meth:`state_dict`.

    Args:
        model: the policy.  size, min_per_tensor, seed: see :meth:`ParameterSample.build`.
    """

    def __init__(self, model: nn.Module, size: int = 2**19, min_per_tensor: int = 1024, seed: int = 0) -> None:
        self.sample = ParameterSample.build(model, size, min_per_tensor, seed)
        self.start = self.sample.values()
        self.grad_sum = {n: torch.zeros_like(v, dtype=torch.float64) for n, v in self.start.items()}
        self._before: dict[str, Tensor] | None = None
        self._grad: dict[str, Tensor] | None = None

    def accumulate_grad(self) -> None:
        """Add the sampled ``.grad`` of this step to the gradient summed since the start (float64); a step whose
        sampled gradient is not finite (the trainer skips its optimizer step) is left out."""
        grads = self.sample.grads()
        if not all(bool(torch.isfinite(g).all()) for g in grads.values()):
            return
        for n, g in grads.items():
            self.grad_sum[n] += g.double()

    def before_step(self) -> None:
        """Record the sampled weights and gradient just before the optimizer step."""
        self._before = self.sample.values()
        self._grad = self.sample.grads()

    def after_step(self) -> dict[str, float]:
        """{"sparsity/update_step_*", "sparsity/update_total_*", "sparsity/grad_*", "sparsity/grad_total_*"} overall
        and per layer type, plus "sparsity/sample_entries" (how many entries the numbers come from); {} without
        :meth:`before_step`."""
        if self._before is None:
            return {}
        after = self.sample.values()
        out = flatten_sparsity("update_step", sampled_update_sparsity(self.sample, self._before, after))
        out.update(flatten_sparsity("update_total", sampled_update_sparsity(self.sample, self.start, after)))
        # before_step set the gradient
        out.update(flatten_sparsity("grad", sampled_vector_sparsity(self.sample, self._grad)))  # type: ignore[arg-type]
        out.update(flatten_sparsity("grad_total", sampled_vector_sparsity(self.sample, self.grad_sum)))
        out[mk.SPARSITY_SAMPLE_ENTRIES] = float(self.sample.size)
        self._before = self._grad = None
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """The running gradient sum (the rest is rebuilt from the seed and the start weights)."""
        return {n: v.clone() for n, v in self.grad_sum.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict` (a run resumed from a checkpoint)."""
        for n in self.grad_sum:
            if n in state:
                self.grad_sum[n] = state[n].clone().double()


class Bf16UpdateTracker:
    """S4: tracks which parameters change in bfloat16 between steps and since the start.

    Keeps two bf16 copies of the tracked parameters (2 bytes each): the one at construction (start) and the
    previous :meth:`update`. Call :meth:`update` after each optimizer step.

    Args:
        params: a model (its parameters with ``requires_grad``) or an iterable of tensors.
        device: where the snapshots live (default: with each parameter; ``"cpu"`` saves accelerator memory).

    Example::

        tracker = Bf16UpdateTracker(model)
        for step in ...:
            optimizer.step()
            metrics.update(tracker.update())
    """

    def __init__(self, params: nn.Module | Iterable[Tensor], device: str | torch.device | None = None) -> None:
        if isinstance(params, nn.Module):
            params = [p for p in params.parameters() if p.requires_grad]
        self.params = list(params)
        self.device = device
        self.start = self._snapshot()
        self.previous = self.start

    def _snapshot(self) -> list[Tensor]:
        """bf16 copies of the parameters (of this process's shards, for an FSDP2-sharded model)."""
        return [
            local_part(p.detach())
            .to(torch.bfloat16)
            .to(self.device if self.device is not None else p.device, copy=True)
            for p in self.params
        ]

    def _unchanged(self, before: list[Tensor], after: list[Tensor]) -> float:
        """Share of entries with the same bf16 value, counted over every process's shards."""
        same, total = sum_over_shards(list(bf16_unchanged_counts(before, after)), self.params)
        return same / total if total else 1.0

    @property
    def num_params(self) -> int:
        """Number of tracked scalar parameters."""
        return sum(p.numel() for p in self.params)

    def mark(self) -> None:
        """Take the 'previous' snapshot now without comparing (what :meth:`update` does, less its two full-model
        comparisons): the next :meth:`update` measures the change since this call."""
        self.previous = self._snapshot()

    def update(self) -> dict[str, float]:
        """Compare the current parameters (as bf16) with the previous snapshot and the start, then take a snapshot.

        Returns:
            {"sparsity/update_step": share unchanged since the previous call (or the start),
                "sparsity/update_total": share unchanged since the start}.
        """
        current = self._snapshot()
        out = {
            mk.SPARSITY_UPDATE_STEP: self._unchanged(self.previous, current),
            mk.SPARSITY_UPDATE_TOTAL: self._unchanged(self.start, current),
        }
        self.previous = current
        return out
