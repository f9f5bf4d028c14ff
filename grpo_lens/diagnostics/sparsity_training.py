"""Sparsity of the update and of the policy gradient over training, separated from bf16 rounding.

docs/theory.md §Sparsity over training. Shapes: P parameters; S sampled entries (a fixed, stratified uniform
subsample of the P, each with a weight w = entries it stands for, so weighted sums estimate sums over all P).

Why not only "bf16-unchanged": a bf16 value changes only when the update moves the float32 weight out of its bf16
rounding cell (relative half-width 2^-9 ~ 2e-3). An update whose every entry is non-zero but smaller than that leaves
almost every bf16 value unchanged, so the bf16-unchanged share measures update size against bf16's resolution, not
sparsity. Each bf16 share is therefore reported next to the share a *dense* update of the same per-tensor RMS would
give (every entry Gaussian with that RMS: :func:`dense_bf16_unchanged_probability`), and the float32-unchanged share,
Hoyer sparsity (S3) and the top-1% energy share (S2-style) measure sparsity of the float32 vector itself.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


# ----------------------------------------------------------------------------------------------------------------
# Layer types
# ----------------------------------------------------------------------------------------------------------------

#: (type, regex searched in a parameter name), tried in this order; the first match is the parameter's type (norm
#: first, so that ``post_attention_layernorm`` is a norm, not attention).
LAYER_TYPES: tuple[tuple[str, str], ...] = (
    ("norm", r"norm|ln_"),
    ("embedding", r"embed|wte|wpe|lm_head"),
    ("attention", r"q_proj|k_proj|v_proj|o_proj|attn|attention"),
    ("mlp", r"gate_proj|up_proj|down_proj|mlp|fc\d"),
)


def layer_type(name: str) -> str:
    """The layer type of parameter ``name``: norm, embedding, attention, mlp (:data:`LAYER_TYPES`), else other."""
    for kind, pattern in LAYER_TYPES:
        if re.search(pattern, name):
            return kind
    return "other"


# ----------------------------------------------------------------------------------------------------------------
# Weighted sparsity measures of a vector (exact with unit weights on every entry)
# ----------------------------------------------------------------------------------------------------------------


def _weights_like(x: Tensor, weights: Tensor | None) -> Tensor:
    w = torch.ones_like(x, dtype=torch.float64) if weights is None else weights.to(torch.float64)
    assert w.shape == x.shape, (w.shape, x.shape)
    return w


def zero_share(x: Tensor, weights: Tensor | None = None) -> float:
    """Share of entries exactly 0. x: [S]; weights: [S] entries each sample stands for (None: 1 each). -> [0, 1]."""
    w = _weights_like(x, weights)
    return float((w * (x == 0)).sum() / w.sum()) if w.sum() > 0 else 1.0


def weighted_hoyer(x: Tensor, weights: Tensor | None = None) -> float:
    """Hoyer sparsity (S3) (sqrt(n) - ||x||_1/||x||_2) / (sqrt(n) - 1) of the full vector, from weighted samples.

    n = sum w (the full vector's length); ||x||_1 ~ sum w |x|, ||x||_2^2 ~ sum w x^2 (exact with unit weights on
    every entry, where it equals :func:`grpo_lens.diagnostics.hoyer_sparsity`). Source: Hoyer, JMLR 5 (2004), eq. 1.

    Args:
        x: [S] float.  weights: [S] > 0 or None.

    Returns:
        float in [0, 1]; 1 for an all-zero x.
    """
    w = _weights_like(x, weights)
    v = x.detach().double()
    n = float(w.sum())
    if n < 2:
        raise ValueError(f"Hoyer sparsity needs at least 2 entries, got {n}")
    l2 = math.sqrt(float((w * v.square()).sum()))
    if l2 == 0:
        return 1.0
    l1 = float((w * v.abs()).sum())
    return (math.sqrt(n) - l1 / l2) / (math.sqrt(n) - 1)


def top_energy_share(x: Tensor, weights: Tensor | None = None, top: float = 0.01) -> float:
    """Share of ||x||^2 held by the largest-|x| ``top`` fraction of entries (S2-style; 0.01 = the top 1%).

    With weights, entries are sorted by |x| and taken, largest first, until their weights reach ``top * sum w``
    (the last one fractionally). A dense vector with equal magnitudes gives ``top``; a one-hot vector gives 1.

    Args:
        x: [S] float.  weights: [S] or None.  top: fraction in (0, 1].

    Returns:
        float in [0, 1]; ``top`` for an all-zero x (no entry is larger than another).
    """
    if not 0 < top <= 1:
        raise ValueError(f"top must be in (0, 1], got {top}")
    w = _weights_like(x, weights)
    e = x.detach().double().square()
    total = float((w * e).sum())
    if total == 0:
        return top
    order = torch.argsort(e, descending=True)
    e, w = e[order], w[order]
    budget = top * float(w.sum())
    before = torch.cumsum(w, 0) - w  # weight of the larger entries
    take = (budget - before).clamp(min=0).minimum(w)  # how much of each entry's weight is in the top
    return float((take * e).sum() / total)


def sparsity_measures(x: Tensor, weights: Tensor | None = None, top: float = 0.01) -> dict[str, float]:
    """{"zero": :func:`zero_share`, "hoyer": :func:`weighted_hoyer`, "top1_energy": :func:`top_energy_share`}."""
    return {"zero": zero_share(x, weights), "hoyer": weighted_hoyer(x, weights),
            "top1_energy": top_energy_share(x, weights, top)}


# ----------------------------------------------------------------------------------------------------------------
# bf16 rounding: measured and what a dense update would give
# ----------------------------------------------------------------------------------------------------------------


def bf16_rounding_cell(values: Tensor) -> tuple[Tensor, Tensor]:
    """[lo, hi]: the float32 interval that rounds to the same bfloat16 value as each entry.

    bf16 keeps the top 16 bits of a float32, so the bf16 neighbours of v = bf16(x) are the float32 bit patterns
    of v +- 2^16; the cell runs between the midpoints (round to nearest; ties, which have measure 0, are ignored).

    Args:
        values: [S] float.

    Returns:
        (lo [S], hi [S]) float64 with lo <= x <= hi for finite x.
    """
    v = values.detach().float().to(torch.bfloat16).float()
    bits = v.view(torch.int32)
    a = (bits + 65536).view(torch.float32).double()  # next bf16 away from 0 (towards -inf for negative v)
    b = (bits - 65536).view(torch.float32).double()  # next bf16 towards 0
    v64 = v.double()
    zero = v == 0
    tiny = 2.0 ** -133  # the smallest positive bf16 (subnormal)
    b = torch.where(zero, torch.full_like(v64, -tiny), b)  # bits - 2^16 of +0 is not a number
    a = torch.where(zero, torch.full_like(v64, tiny), a)
    m1, m2 = (v64 + a) / 2, (v64 + b) / 2
    return torch.minimum(m1, m2), torch.maximum(m1, m2)


def dense_bf16_unchanged_probability(values: Tensor, rms: Tensor | float) -> Tensor:
    """P(bf16(v + d) == bf16(v)) for a dense Gaussian update d ~ N(0, rms^2) of each entry.

    = Phi((hi - v) / rms) - Phi((lo - v) / rms) with [lo, hi] the bf16 rounding cell of v
    (:func:`bf16_rounding_cell`). The control for the bf16-unchanged share: an update with no zero entries at all
    still leaves this share of bf16 values unchanged.

    Args:
        values: [S] float, the weights before the update.
        rms: scalar or [S] > 0, the update's per-tensor root mean square.

    Returns:
        [S] float64 probabilities (1 where rms = 0).
    """
    lo, hi = bf16_rounding_cell(values)
    v = values.detach().double()
    s = torch.as_tensor(rms, dtype=torch.float64).expand_as(v)
    safe = s.clamp(min=1e-300)
    phi = lambda z: 0.5 * torch.erfc(-z / math.sqrt(2.0))  # noqa: E731  (standard normal CDF, accurate in the tails)
    p = phi((hi - v) / safe) - phi((lo - v) / safe)
    return torch.where(s > 0, p, torch.ones_like(p))


def update_sparsity(before: Tensor, after: Tensor, weights: Tensor | None = None,
                    rms: Tensor | float | None = None) -> dict[str, float]:
    """Sparsity of the update d = after - before of sampled entries, and its bf16 view with the dense control.

    Args:
        before, after: [S] float32 weights (the sampled entries).
        weights: [S] entries each sample stands for, or None.
        rms: [S] or scalar, the per-tensor RMS of d for the dense control; default: the RMS of the given d.

    Returns:
        {"f32_unchanged": share with d = 0 exactly, "bf16_unchanged": share with bf16(after) = bf16(before),
         "bf16_dense": the expected bf16-unchanged share of a dense Gaussian update with the same per-tensor RMS,
         "hoyer", "top1_energy": of d}. All weighted means over the sampled entries.
    """
    assert before.shape == after.shape, (before.shape, after.shape)
    d = after.detach().float() - before.detach().float()
    w = _weights_like(d, weights)
    if rms is None:
        rms = float(d.double().square().mean().sqrt()) if d.numel() else 0.0
    same16 = before.detach().float().to(torch.bfloat16) == after.detach().float().to(torch.bfloat16)
    dense = dense_bf16_unchanged_probability(before, rms)
    m = sparsity_measures(d, w)
    return {"f32_unchanged": m["zero"], "bf16_unchanged": float((w * same16).sum() / w.sum()),
            "bf16_dense": float((w * dense).sum() / w.sum()), "hoyer": m["hoyer"],
            "top1_energy": m["top1_energy"]}


# ----------------------------------------------------------------------------------------------------------------
# A fixed subsample of a model's parameters
# ----------------------------------------------------------------------------------------------------------------


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
    def build(cls, model: nn.Module, size: int = 2**19, min_per_tensor: int = 1024, seed: int = 0
              ) -> "ParameterSample":
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
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(n.encode())) % (2**63))
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
        out = {}
        for n in self.names:
            t = src.get(n)
            out[n] = (torch.zeros(len(self.index[n])) if t is None
                      else t.detach().reshape(-1)[self.index[n]].float().cpu().clone())
        return out

    def grads(self) -> dict[str, Tensor]:
        """The sampled entries of each parameter's ``.grad`` (zeros where it is None)."""
        return self.values({n: p.grad for n, p in self.params.items() if p.grad is not None})

    def groups(self) -> dict[str, list[str]]:
        """{"all": every name, layer type: its names} (types present only)."""
        out: dict[str, list[str]] = {"all": list(self.names)}
        for n in self.names:
            out.setdefault(self.kinds[n], []).append(n)
        return out


def _flatten(sample: ParameterSample, vals: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, list[str]]:
    """(x [S], weights [S] float64, group id [S] long, group names): every sampled entry once, its layer type's id."""
    kinds = sorted({sample.kinds[n] for n in sample.names})
    kid = {k: i for i, k in enumerate(kinds)}
    x = torch.cat([vals[n] for n in sample.names])
    w = torch.cat([torch.full((len(vals[n]),), sample.weight[n], dtype=torch.float64) for n in sample.names])
    g = torch.cat([torch.full((len(vals[n]),), kid[sample.kinds[n]], dtype=torch.long) for n in sample.names])
    return x, w, g, kinds


def _grouped(x: Tensor, w: Tensor, g: Tensor, kinds: list[str], extra: dict[str, Tensor] | None = None,
             top: float = 0.01) -> dict[str, dict[str, float]]:
    """zero share, Hoyer, top-1% energy and weighted means of ``extra`` per-entry values, overall and per group,
    in one pass: the same numbers as :func:`sparsity_measures` on each group's entries (entries sorted once)."""
    v = x.detach().double()
    e = v.square()
    order = torch.argsort(e, descending=True)  # one sort serves every group's top-1%
    e_s, w_s, g_s = e[order], w[order], g[order]
    out = {}
    for name, sel in [("all", None)] + [(k, i) for i, k in enumerate(kinds)]:
        m = torch.ones_like(w, dtype=torch.bool) if sel is None else g == sel
        ms = torch.ones_like(w_s, dtype=torch.bool) if sel is None else g_s == sel
        wm, n = w[m], float(w[m].sum())
        if n < 2:
            continue
        l2 = math.sqrt(float((wm * e[m]).sum()))
        l1 = float((wm * v[m].abs()).sum())
        hoyer = 1.0 if l2 == 0 else (math.sqrt(n) - l1 / l2) / (math.sqrt(n) - 1)
        ew, ww = e_s[ms], w_s[ms]
        total = float((ww * ew).sum())
        if total == 0:
            top_share = top
        else:
            before = torch.cumsum(ww, 0) - ww
            take = (top * n - before).clamp(min=0).minimum(ww)
            top_share = float((take * ew).sum() / total)
        res = {"zero": float((wm * (v[m] == 0)).sum()) / n, "hoyer": hoyer, "top1_energy": top_share}
        for key, val in (extra or {}).items():
            res[key] = float((wm * val[m]).sum()) / n
        out[name] = res
    return out


def sampled_update_sparsity(sample: ParameterSample, before: dict[str, Tensor], after: dict[str, Tensor]
                            ) -> dict[str, dict[str, float]]:
    """:func:`update_sparsity` of after - before, overall and per layer type, dense control at each tensor's RMS.

    Every per-entry quantity is computed once for the whole sample and then summed per group (the numbers equal
    :func:`update_sparsity` on each group's entries; a test checks it).

    Args:
        sample: where the values come from.  before, after: {name: [s_t]} from :meth:`ParameterSample.values`.

    Returns:
        {"all" | layer type: {"f32_unchanged", "bf16_unchanged", "bf16_dense", "hoyer", "top1_energy"}}.
    """
    rms = {n: float((after[n].double() - before[n].double()).square().mean().sqrt()) for n in sample.names}
    b, w, g, kinds = _flatten(sample, before)
    a = torch.cat([after[n] for n in sample.names])
    r = torch.cat([torch.full((len(before[n]),), rms[n], dtype=torch.float64) for n in sample.names])
    d = a.float() - b.float()
    same16 = (b.float().to(torch.bfloat16) == a.float().to(torch.bfloat16)).double()
    dense = dense_bf16_unchanged_probability(b, r)
    res = _grouped(d, w, g, kinds, {"bf16_unchanged": same16, "bf16_dense": dense})
    return {k: {"f32_unchanged": m["zero"], "bf16_unchanged": m["bf16_unchanged"], "bf16_dense": m["bf16_dense"],
                "hoyer": m["hoyer"], "top1_energy": m["top1_energy"]} for k, m in res.items()}


def sampled_vector_sparsity(sample: ParameterSample, vals: dict[str, Tensor]) -> dict[str, dict[str, float]]:
    """:func:`sparsity_measures` of a sampled vector (e.g. the policy gradient), overall and per layer type."""
    x, w, g, kinds = _flatten(sample, vals)
    return _grouped(x, w, g, kinds)


# ----------------------------------------------------------------------------------------------------------------
# Over training: what the lens calls around an optimizer step
# ----------------------------------------------------------------------------------------------------------------

#: Metric names of :meth:`SparsityOverTraining.after_step` for the whole model; per layer type they are
#: ``sparsity/<type>/<name>`` (docs/metrics.md).
UPDATE_MEASURES = ("f32_unchanged", "bf16_unchanged", "bf16_dense", "hoyer", "top1_energy")
GRAD_MEASURES = ("zero", "hoyer", "top1_energy")


def flatten_sparsity(prefix: str, results: dict[str, dict[str, float]]) -> dict[str, float]:
    """{"all": {m: v}, type: {m: v}} -> {"sparsity/<prefix>_<m>": v, "sparsity/<type>/<prefix>_<m>": v}."""
    out = {}
    for group, values in results.items():
        head = "sparsity/" if group == "all" else f"sparsity/{group}/"
        for m, v in values.items():
            out[f"{head}{prefix}_{m}"] = v
    return out


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
        out.update(flatten_sparsity("grad", sampled_vector_sparsity(self.sample, self._grad)))
        out.update(flatten_sparsity("grad_total", sampled_vector_sparsity(self.sample, self.grad_sum)))
        out["sparsity/sample_entries"] = float(self.sample.size)
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
