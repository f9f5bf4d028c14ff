"""G2, each linear layer's weight gradient of the group loss, under several row weightings (docs/theory.md §5, §6).

:class:`G2WeightingCapture` gives the stable rank of every linear layer's G2 (``nn.Linear``; GPT-2's ``Conv1D``, whose
G2 is the transpose) under each weighting of :data:`grpo_lens.formulas.zero_sum.WEIGHTINGS` from ONE backward,
through [nL, nL] kernels instead of a backward and a decomposition per weighting; :func:`g2_by_type_keys` is its
readable reference from materialised weight gradients (tests check that they agree). Both summarise by
:func:`module_kind`, the last component of a module name (``down_proj``), as
``rank/g2_<weighting>_<kind>_stable_rank``. (The sparsity keys split by a parameter's layer type, norm / embedding /
attention / mlp: that is :func:`grpo_lens.formulas.sparsity.layer_type`, another grouping.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lens import metrics as mk
from grpo_lens.formulas.spectrum import top_eigenvalues_psd_products, top_singular_value
from grpo_lens.gradients.params import LayerFilter, linear_layer_names

#: Last name components that one family uses in two roles, so their kind keeps the parent too: GPT-2's ``c_proj``
#: is the attention output (``attn.c_proj`` -> ``attn_c_proj``) and the MLP down projection (``mlp_c_proj``).
SHARED_KIND_NAMES = frozenset({"c_proj"})


def module_kind(name: str) -> str:
    """The last component of a module name (``model.layers.3.mlp.down_proj`` -> ``down_proj``): the kind of linear
    layer G2's stable ranks are averaged over (``rank/g2_<weighting>_<kind>_stable_rank``); for a name in
    :data:`SHARED_KIND_NAMES`, parent and last component (``transformer.h.0.mlp.c_proj`` -> ``mlp_c_proj``).

    Not the parameter's layer type of the sparsity keys (:func:`grpo_lens.formulas.sparsity.layer_type`: ``mlp``).
    """
    parts = name.rsplit(".", 2)
    if parts[-1] in SHARED_KIND_NAMES and len(parts) > 1:
        return f"{parts[-2]}_{parts[-1]}"
    return parts[-1]


def g2_by_type_keys(layer_grads: dict[str, Tensor], weighting: str) -> dict[str, float]:
    """Reference for :class:`G2WeightingCapture` from materialised weight gradients (slower: a backward and a
    decomposition per weighting). ``rank/g2_<weighting>_<kind>_stable_rank``: the mean over the layers of each kind of
    the stable rank
    ||G2||_F^2 / s_1^2 of their G2 (one weighting's weight gradients, {layer name: [d_out, d_in]}); s_1 by randomized
    subspace iteration (:func:`top_singular_value`), so every layer of a 135M model costs a few passes over its
    matrix instead of a full SVD."""
    per_type: dict[str, list[float]] = {}
    for name, g2 in layer_grads.items():
        s1 = top_singular_value(g2)
        fro2 = float(g2.detach().float().square().sum(dtype=torch.float64))
        per_type.setdefault(module_kind(name), []).append(fro2 / s1**2 if s1 > 0 else 0.0)
    return {mk.RANK_G2_WEIGHTED.format(w=weighting, kind=t): sum(v) / len(v) for t, v in per_type.items()}


class G2WeightingCapture:
    """Stable rank of every linear layer's G2 under several row weightings, from ONE backward (docs/theory.md §6).

    G2 of a layer under weights w is M(w) = sum_i w_i sum_t delta_{i,t} x_{i,t}^T = D^T W X, with D [nL, d_out] the
    output gradients and X [nL, d_in] the inputs at the n·L positions of the batch (backpropagating sum_i s_i once),
    and W the per-position weight (w_i on rollout i's positions): rows never interact, so rollout i's deltas scale by
    w_i. With K_X = X X^T and K_D(w) = W D D^T W, both [nL, nL]:

        ||M(w)||_F^2 = sum_ab K_X[a, b] K_D(w)[a, b],      s_1(M(w))^2 = lambda_max(K_X K_D(w))

    (the nonzero eigenvalues of M M^T and of K_X K_D(w) agree). K_X and D D^T are formed once per layer in the
    backward hook and every weighting costs only [nL, nL] work, instead of a backward and a decomposition of
    [d_out, d_in] per weighting. A ``Conv1D`` layer (weight [d_in, d_out]) has M(w)^T as its weight gradient: the
    same kernels, norm and singular values.

    **A shared prompt** (``shared_prefix`` = Lp): in one GRPO group every rollout has the same prompt, so a layer's
    input at the Lp prompt positions is the same in all n rollouts (causal attention), x_{i,t} = x_t. Those positions
    then add sum_t x_t^T (sum_i w_i delta_{i,t}): one row per position, with the weighted sum of the rollouts'
    deltas. The rows become Lp + (completion positions) instead of n·Lp + (completion positions) (on the default
    model at R = 8: 131 instead of 438), with the same M(w). The prefix inputs are checked to agree across the
    rollouts at the first layer that sees them (ValueError otherwise: not one group's prompt; prompts that differ
    differ at every layer, so one check serves the pass); layers whose input is not the whole sequence (an LM head
    run at the scored positions only) keep one row per position.

    lambda_max of every (layer, weighting) pair is solved after the backward (or when ``budget_bytes`` of kernels
    have accumulated), in batches of one row count, by
    :func:`grpo_lens.formulas.spectrum.top_eigenvalues_psd_products`: block subspace iteration in the K_D(w) inner
    product (where K_X K_D(w) is self-adjoint) with a residual check, and the exact symmetric eigen-solver when it
    does not converge (a cluster of near-top eigenvalues); :attr:`exact_fallbacks` counts those. (A few hundred small
    problems one at a time cost their per-call overhead, not their FLOPs.)

    Args:
        model: the model (its linear layers, :func:`grpo_lens.gradients.params.linear_layer_names`, are hooked).
        weightings: {name: [n] weights}, n = rollouts of the pass.
        shared_prefix: Lp, the leading positions every rollout of the pass shares (its prompt, left padded as one);
            0: none.
        seq_len: L = Lp + T, the pass's sequence length (needed with ``shared_prefix``: which layers see it whole).
        budget_bytes: the kernels kept for the batched solve (they are solved when more accumulate) and the float64
            working set of one batch.
        include: which linear layers (a :data:`grpo_lens.gradients.params.LayerFilter`; the probe's ``--layers``
            passes :func:`grpo_lens.gradients.params.layer_pattern`); None: all.
        rows: (r0, r1): the pass's rows this group holds, when one backward serves several groups (each with its own
            capture; a layer's input and output gradient are cut to these rows in the hook); None: every row.

    After a forward + backward inside the context, :meth:`result` gives
    ``{"rank/g2_<name>_<kind>_stable_rank": mean over the layers of that kind}``.

    Raises:
        ValueError: ``shared_prefix`` without ``seq_len``; prefix inputs that differ across the rollouts.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        weightings: dict[str, Tensor],
        shared_prefix: int = 0,
        seq_len: int | None = None,
        budget_bytes: int = 256 * 2**20,
        include: LayerFilter = None,
        rows: tuple[int, int] | None = None,
    ):
        if shared_prefix and seq_len is None:
            raise ValueError("G2WeightingCapture: shared_prefix needs seq_len (the pass's sequence length)")
        self.model = model
        self.weightings = {k: v.detach().float() for k, v in weightings.items()}
        self.shared_prefix, self.seq_len = shared_prefix, seq_len
        self.budget_bytes = budget_bytes
        self.rows = rows
        modules = dict(model.named_modules())
        self.layers = {n: modules[n] for n in linear_layer_names(model, include)}
        self.stable: dict[str, dict[str, float]] = {}  # layer -> weighting -> stable rank
        self.exact_fallbacks = 0  # (layer, weighting) pairs whose lambda_max came from the exact solver
        self._pending: list[tuple[str, Tensor, Tensor, dict[str, float]]] = []  # (layer, K_X, K_D(w) stack, fro2)
        self._pending_bytes = 0
        self._handles: list = []
        self._prefix_checked = False  # the shared prefix's inputs agree (checked at the first layer that has one)

    def _kernels(self, x: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
        """(K_X [m, m], K_D(w) [W, m, m]) of one layer over its m rows: one per position and rollout, or with a
        shared prefix one per prefix position carrying sum_i w_i delta_{i,t} (see the class docstring); positions
        without gradient (padding, the last token) dropped."""
        n = x.shape[0] if x.dim() == 3 else 1
        w = torch.stack(list(self.weightings.values())).to(grad.device)  # [W, n]
        lp = self.shared_prefix if x.dim() == 3 and x.shape[1] == self.seq_len else 0
        x3, d3 = x.reshape(n, -1, x.shape[-1]).float(), grad.reshape(n, -1, grad.shape[-1]).float()
        if not lp:  # K_D(w) = W (D D^T) W: one product for every weighting
            keep = d3.abs().sum(-1).reshape(-1) > 0
            xr, dr = x3.reshape(-1, x3.shape[-1])[keep], d3.reshape(-1, d3.shape[-1])[keep]
            wp = w.repeat_interleave(d3.shape[1], dim=1)[:, keep]  # [W, m]
            return xr @ xr.T, (dr @ dr.T).unsqueeze(0) * (wp.unsqueeze(2) * wp.unsqueeze(1))
        xp = x3[:, :lp]  # [n, Lp, d_in]
        if not self._prefix_checked and not torch.allclose(
            xp, xp[:1].expand_as(xp), rtol=1e-4, atol=1e-5 * float(xp.abs().max())
        ):
            raise ValueError(
                "G2WeightingCapture: the rollouts' inputs differ at the shared prefix positions: pass "
                "shared_prefix only for one group's rollouts (one prompt)"
            )
        self._prefix_checked = True  # one layer tells: rollouts whose prompts differ differ at every layer
        xc, dc = x3[:, lp:], d3[:, lp:]  # [n, L - Lp, .]
        xr = torch.cat([xp[0], xc.reshape(-1, xc.shape[-1])])
        dr = torch.cat(
            [
                torch.einsum("wi,itd->wtd", w, d3[:, :lp]),  # sum_i w_i delta_{i,t}
                (w[:, :, None, None] * dc.unsqueeze(0)).reshape(w.shape[0], -1, dc.shape[-1]),
            ],
            dim=1,
        )
        keep = dr.abs().sum(dim=(0, 2)) > 0
        xr, dr = xr[keep], dr[:, keep]
        return xr @ xr.T, dr @ dr.mT

    def _forward(self, name: str, module, args, output) -> None:
        if not torch.is_grad_enabled() or not isinstance(output, Tensor) or not output.requires_grad:
            return
        x = args[0].detach()
        if self.rows is not None:
            x = x[self.rows[0] : self.rows[1]]

        def on_grad(grad: Tensor) -> None:
            if self.rows is not None:
                grad = grad[self.rows[0] : self.rows[1]]
            kx, kds = self._kernels(x, grad)  # [m, m], [W, m, m]
            fro2 = (kx.unsqueeze(0) * kds).sum(dim=(1, 2), dtype=torch.float64)  # ||M(w)||_F^2 [W]
            self._pending.append((name, kx, kds, dict(zip(self.weightings, fro2.tolist()))))
            self._pending_bytes += (kx.numel() + kds.numel()) * kx.element_size()
            if self._pending_bytes > self.budget_bytes:
                self._solve()

        output.register_hook(on_grad)

    def _solve(self) -> None:
        """lambda_max of every pending (layer, weighting) pair, batched by row count m in batches of at most
        :attr:`budget_bytes` of float64 work; fills :attr:`stable`."""
        by_size: dict[int, list[tuple[str, Tensor, Tensor, dict[str, float]]]] = {}
        for item in self._pending:
            by_size.setdefault(item[1].shape[0], []).append(item)
        self._pending, self._pending_bytes = [], 0
        for m, items in by_size.items():
            fro2_of = {name: fro2 for name, _, _, fro2 in items}
            live = [
                (name, wname, kx, kds[j])
                for name, kx, kds, fro2 in items
                for j, wname in enumerate(self.weightings)
                if fro2[wname] > 0
            ]
            for name in fro2_of:
                self.stable[name] = {wname: 0.0 for wname in self.weightings}
            chunk = max(1, self.budget_bytes // (4 * m * m * 8))  # K_X, K_D and their float64 copies
            for c in range(0, len(live), chunk):
                part = live[c : c + chunk]
                lams, converged = top_eigenvalues_psd_products(
                    torch.stack([p[2] for p in part]), torch.stack([p[3] for p in part])
                )
                self.exact_fallbacks += int((~converged).sum())
                for (name, wname, _, _), lam in zip(part, lams.tolist()):
                    self.stable[name][wname] = fro2_of[name][wname] / lam if lam > 0 else 0.0

    def __enter__(self) -> G2WeightingCapture:
        for name, module in self.layers.items():
            self._handles.append(
                module.register_forward_hook(lambda m, a, o, _name=name: self._forward(_name, m, a, o))
            )
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def result(self) -> dict[str, float]:
        """{"rank/g2_<weighting>_<kind>_stable_rank": mean over the layers of each kind}."""
        self._solve()
        per: dict[tuple[str, str], list[float]] = {}
        for name, by_w in self.stable.items():
            for wname, sr in by_w.items():
                per.setdefault((wname, module_kind(name)), []).append(sr)
        return {mk.RANK_G2_WEIGHTED.format(w=w, kind=t): sum(v) / len(v) for (w, t), v in per.items()}
