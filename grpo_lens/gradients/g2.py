"""G2, each linear layer's weight gradient of the group loss, under several row weightings (docs/theory.md §5, §6).

:class:`G2WeightingCapture` gives the stable rank of every ``nn.Linear`` layer's G2 under each weighting of
:data:`grpo_lens.formulas.zero_sum.WEIGHTINGS` from ONE backward, through [nL, nL] kernels instead of a backward and
a decomposition per weighting; :func:`g2_by_type_keys` is its readable reference from materialised weight gradients
(tests check that they agree). Both summarise by :func:`module_kind`, the last component of a module name
(``down_proj``), as ``rank/g2_<weighting>_<kind>_stable_rank``. (The sparsity keys split by a parameter's layer type,
norm / embedding / attention / mlp: that is :func:`grpo_lens.formulas.sparsity.layer_type`, another grouping.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lens.formulas.spectrum import top_eigenvalue_psd_product, top_singular_value
from grpo_lens.gradients.params import linear_layer_names
from grpo_lens.metrics import RANK_G2_WEIGHTED


def module_kind(name: str) -> str:
    """The last component of a module name (``model.layers.3.mlp.down_proj`` -> ``down_proj``): the kind of linear
    layer G2's stable ranks are averaged over (``rank/g2_<weighting>_<kind>_stable_rank``).

    Not the parameter's layer type of the sparsity keys (:func:`grpo_lens.formulas.sparsity.layer_type`: ``mlp``).
    """
    return name.rsplit(".", 1)[-1]


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
    return {RANK_G2_WEIGHTED.format(w=weighting, kind=t): sum(v) / len(v) for t, v in per_type.items()}


class G2WeightingCapture:
    """Stable rank of every nn.Linear layer's G2 under several row weightings, from ONE backward (docs/theory.md §6).

    G2 of a layer under weights w is M(w) = sum_i w_i sum_t delta_{i,t} x_{i,t}^T = D^T W X, with D [nL, d_out] the
    output gradients and X [nL, d_in] the inputs at the n·L positions of the batch (backpropagating sum_i s_i once),
    and W the per-position weight (w_i on rollout i's positions): rows never interact, so rollout i's deltas scale by
    w_i. With K_X = X X^T and K_D(w) = W D D^T W, both [nL, nL]:

        ||M(w)||_F^2 = sum_ab K_X[a, b] K_D(w)[a, b],      s_1(M(w))^2 = lambda_max(K_X K_D(w))

    (the nonzero eigenvalues of M M^T and of K_X K_D(w) agree). K_X and D D^T are formed once per layer in the
    backward hook and every weighting costs only [nL, nL] work, instead of a backward and a decomposition of
    [d_out, d_in] per weighting. lambda_max by :func:`grpo_lens.formulas.spectrum.top_eigenvalue_psd_product`: block
    subspace iteration in the K_D(w) inner product (where K_X K_D(w) is self-adjoint) with a residual check, and the
    exact symmetric eigen-solver when it does not converge (a cluster of near-top eigenvalues);
    :attr:`exact_fallbacks` counts those.

    Args:
        model: the model (its nn.Linear layers are hooked).
        weightings: {name: [n] weights}, n = rollouts of the pass.

    After a forward + backward inside the context, :meth:`result` gives
    ``{"rank/g2_<name>_<kind>_stable_rank": mean over the layers of that kind}``.
    """

    def __init__(self, model: torch.nn.Module, weightings: dict[str, Tensor]):
        self.model = model
        self.weightings = {k: v.detach().float() for k, v in weightings.items()}
        modules = dict(model.named_modules())
        self.layers = {n: modules[n] for n in linear_layer_names(model)}
        self.stable: dict[str, dict[str, float]] = {}  # layer -> weighting -> stable rank
        self.exact_fallbacks = 0  # (layer, weighting) pairs whose lambda_max came from the exact solver
        self._handles: list = []

    def _forward(self, name: str, module, args, output) -> None:
        if not torch.is_grad_enabled() or not isinstance(output, Tensor) or not output.requires_grad:
            return
        x = args[0].detach()
        x2 = x.reshape(-1, x.shape[-1]).float()  # [nL, d_in]
        n = x.shape[0] if x.dim() == 3 else 1

        def on_grad(grad: Tensor) -> None:
            d2 = grad.reshape(-1, grad.shape[-1]).float()  # [nL, d_out]
            keep = d2.abs().sum(1) > 0  # positions with no gradient (padding, the last token) add nothing
            xs, ds = x2[keep], d2[keep]
            rollout = torch.arange(n, device=grad.device).repeat_interleave(x2.shape[0] // n)[keep]
            kx, kd = xs @ xs.T, ds @ ds.T
            out = {}
            for wname, w in self.weightings.items():
                wp = w.to(grad.device)[rollout]
                kdw = kd * torch.outer(wp, wp)
                fro2 = float((kx * kdw).sum(dtype=torch.float64))
                if fro2 <= 0:
                    out[wname] = 0.0
                    continue
                lam, converged = top_eigenvalue_psd_product(kx, kdw)
                self.exact_fallbacks += not converged
                out[wname] = fro2 / lam if lam > 0 else 0.0
            self.stable[name] = out

        output.register_hook(on_grad)

    def __enter__(self) -> "G2WeightingCapture":
        for name, module in self.layers.items():
            self._handles.append(module.register_forward_hook(
                lambda m, a, o, _name=name: self._forward(_name, m, a, o)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def result(self) -> dict[str, float]:
        """{"rank/g2_<weighting>_<kind>_stable_rank": mean over the layers of each kind}."""
        per: dict[tuple[str, str], list[float]] = {}
        for name, by_w in self.stable.items():
            for wname, sr in by_w.items():
                per.setdefault((wname, module_kind(name)), []).append(sr)
        return {RANK_G2_WEIGHTED.format(w=w, kind=t): sum(v) / len(v) for (w, t), v in per.items()}
