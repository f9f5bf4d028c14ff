"""Exact per-rollout Gram matrix of every parameter from ONE batched backward (docs/theory.md §Exact Gram).

Notation: N rollouts (rows of the batch, all groups together), L = Lp + T input positions, S a module's sequence
length (L, or T + 1 for the LM head under ``logits_to_keep``), M the kept (attention-mask) positions of a module summed
over rollouts, d_in / d_out a linear layer's sizes, V the vocabulary, U the batch's distinct input tokens.

    s_i = omega_i sum_t log pi(o_{i,t} | q_i, o_{i,<t})          (:func:`grpo_lens.gradients.scores.rollout_scores`)
    g_i = grad_theta s_i,      Gram[i, j] = <g_i, g_j>  over every trainable parameter,

without forming any g_i. Rows never interact in a decoder-only transformer, so one backward of sum_i s_i (taken with
respect to the input-embedding outputs: every module's output gradient delta, no weight gradient) gives at each
module and position t of row i a delta_{i,t} that belongs to rollout i alone. Hooks turn each module's (input x,
delta) into its parameters' [N, N] contribution (the pure pieces named below live in
:mod:`grpo_lens.gradients.gram_blocks`) and drop them:

- ``nn.Linear`` weight, G_i = sum_{t in i} delta_t x_t^T: <G_i, G_j> = sum_{t in i, u in j} (delta_t . delta_u)
  (x_t . x_u), the ghost-norm identity with cross terms (Li et al. 2021, arXiv 2110.05679, §4): either as token
  pairs (:func:`token_pair_gram`, cost ~ M^2 (d_in + d_out) / 2) or with each G_i formed transiently
  (:func:`rollout_layer_gram`, cost ~ (M + 50 N + N^2 / 3) d_in d_out, the 50 N for writing and reading the G_i);
  per layer the cheaper one (:func:`choose_form`, book-keeping's hybrid rule, Bu et al. 2022, arXiv 2210.00038, §3,
  with costs measured on a CPU: :func:`form_costs`).
- ``nn.Linear`` bias: g_i = sum_{t in i} delta_t.
- transformers' ``Conv1D`` (GPT-2; y = x W + b, W [d_in, d_out]): the same two hooks, since its G_i = sum_t x_t
  delta_t^T is the transpose of the linear one and <G_i, G_j> is unchanged by transposing both
  (:func:`grpo_lens.gradients.params.is_linear`).
- ``nn.Embedding``: g_i = sum_t e_{tok_t} delta_t^T, so <g_i, g_j> = sum_v r_{i,v} . r_{j,v} with r_{i,v} the sum of
  rollout i's deltas at token v (:func:`embedding_row_sums`; ``padding_idx`` positions get no gradient). A scaled
  embedding (Gemma's ``embed_scale``: y = c W[tok]) has g_i = c sum_t e_{tok_t} delta_t^T (:func:`embedding_scale`).
- tied LM head (``lm_head.weight is embed_tokens.weight``): the shared matrix's g_i is the sum of both uses, so its
  Gram is LL + EE + LE + LE^T with LE[i, j] = sum_v G^lm_i[v, :] . r_{j,v} (the cross term).
- norms (RMSNorm, LayerNorm, Nemotron's LayerNorm1P) in closed form (:func:`norm_rollout_grads`), checked once per
  class against a vmapped vector-Jacobian product of the module alone (:func:`vjp_rollout_grads`), which also covers
  any other leaf module with one tensor input.

What is not covered is reported, not guessed (``info["uncovered"]``, ``info["coverage"]``): a parameter held by a
non-leaf module, a weight shared other than embedding + LM head, an embedding with ``max_norm`` or
``scale_grad_by_freq``, a leaf module called with other than one [N, ...] tensor. A module called twice in one forward,
two forwards in one capture, and activation checkpointing raise. Padding positions have delta = 0 exactly (no loss
term, zero attention weight as a key), so the hooks skip them. Per-parameter Grams and every sum across blocks are
float64; products inside a block run in the model's dtype (bf16/fp16 upcast to float32).

The dense oracle, one backward per rollout, is :func:`grpo_lens.gradients.exact.exact_rollout_grads`; the tests
check equality to 1e-10 in float64 on tiny Llama (tied), Qwen2 (biases) and Nemotron models, and
tests/gradients/test_architectures.py on tiny GPT-2, Mistral, Phi-3 and Gemma ones.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import torch
from torch import Tensor, nn

from grpo_lens.gradients.gram_blocks import (
    FORMS,
    Form,
    block_outer,
    block_spans,
    embedding_row_sums,
    embedding_scale,
    form_costs,
    lm_rows_at_tokens,
    norm_rollout_grads,
    rollout_layer_gram,
    shared_columns,
    shared_token_cost,
    token_pair_gram,
    vjp_rollout_grads,
    wanted_spans,
)
from grpo_lens.gradients.params import is_linear, linear_shape
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.rollout import RolloutBatch, batch_logprobs

#: Trace-share kinds of :func:`exact_rollout_gram`'s info (each parameter's kind in the Gram).
KINDS = ("linear", "lm_head", "bias", "norm", "embedding", "tied_embedding")


def _upcast(t: Tensor) -> Tensor:
    """Half-precision activations and deltas are multiplied in float32 (bf16 products would lose the Gram)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _tensor_key(t: Tensor) -> tuple:
    """Identity of a module input, so layers reading the same tensor (q/k/v, gate/up) share its kernel tiles."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Which hook covers which parameter
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class _Tied:
    """A matrix used as an ``nn.Embedding`` weight and as an ``nn.Linear`` weight (the tied LM head), and its terms:
    lm_lm, emb_emb, lm_emb [N, N] float64 (LL, EE, LE); glm_rows [N, U, d] the LM use's rows at the input tokens."""

    name: str
    emb: nn.Module
    lin: nn.Module
    lm_lm: Tensor | None = None
    glm_rows: Tensor | None = None
    emb_emb: Tensor | None = None
    lm_emb: Tensor | None = None


@dataclass
class GramPlan:
    """Which hook covers each trainable parameter of a model (:func:`plan_gram`).

    kinds: {parameter name: kind in KINDS minus 'lm_head'}.   hooked: {module: {attr: kind}}.   tied: {module: _Tied}
    (both modules of a tied matrix).   uncovered: {parameter name: reason}.   numel: {parameter name: size}.
    """

    kinds: dict[str, str]
    hooked: dict[nn.Module, dict[str, str]]
    tied: dict[nn.Module, _Tied]
    uncovered: dict[str, str]
    numel: dict[str, int]


def _use_kind(module: nn.Module, attr: str, leaf: bool) -> str:
    if is_linear(module):  # nn.Linear or Conv1D
        return "linear" if attr == "weight" else "bias"
    if isinstance(module, nn.Embedding):
        ok = attr == "weight" and module.max_norm is None and not module.scale_grad_by_freq
        return "embedding" if ok else "unsupported"
    return "norm" if leaf else "unsupported"


def plan_gram(model: nn.Module) -> GramPlan:
    """Assign each trainable parameter (tied ones once, under ``named_parameters``' name) to the hook that covers it,
    or to ``uncovered`` with the reason."""
    names = {id(p): n for n, p in model.named_parameters()}
    uses: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for module in model.modules():
        leaf = not any(True for _ in module.children())
        for attr, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                uses.setdefault(id(p), []).append((_use_kind(module, attr, leaf), module, attr))
    plan = GramPlan(
        {},
        {},
        {},
        {},
        {names[pid]: p.numel() for pid, p in ((id(p), p) for p in model.parameters() if p.requires_grad)},
    )
    for pid, us in uses.items():
        name = names[pid]
        kinds = sorted(k for k, _, _ in us)
        if len(us) == 1 and kinds[0] != "unsupported":
            kind, module, attr = us[0]
            plan.kinds[name] = kind
            plan.hooked.setdefault(module, {})[attr] = kind
        elif kinds == ["embedding", "linear"] and any(isinstance(m, nn.Linear) for _, m, _ in us):  # tied LM head
            emb = next(m for k, m, _ in us if k == "embedding")
            lin = next(m for k, m, _ in us if k == "linear")
            plan.kinds[name] = "tied_embedding"
            plan.tied[emb] = plan.tied[lin] = _Tied(name, emb, lin)
            plan.hooked.setdefault(emb, {})["weight"] = "tied_embedding"
            plan.hooked.setdefault(lin, {})["weight"] = "tied_embedding"
        elif len(us) == 1:
            plan.uncovered[name] = (
                "parameter of a non-leaf module"
                if not isinstance(us[0][1], nn.Embedding)
                else "embedding with max_norm or scale_grad_by_freq"
            )
        else:
            plan.uncovered[name] = f"shared by {len(us)} uses {kinds}"
    return plan


# ---------------------------------------------------------------------------------------------------------------------
# The capture: hooks on one forward and its backward
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class _Pass:
    """One grad-enabled forward: N rollouts, L positions, keep [N, L] (attention mask), the embeddings' token maps
    {module: (tokens [U], uid [M], seg [M], flat [M])}, calls per module, the input-embedding outputs (backward
    roots), the shared-input kernel caches and each embedding's output scale c (:func:`embedding_scale`)."""

    n: int
    length: int
    keep: Tensor
    emb: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)
    roots: list = field(default_factory=list)
    x_users: dict = field(default_factory=dict)
    x_cache: dict = field(default_factory=dict)
    x_shared: dict = field(default_factory=dict)  # input key -> each span's shared columns (shared_columns)
    emb_scale: dict = field(default_factory=dict)
    sel: Tensor | None = None  # [n] the wanted rows (GramCapture.rows), None = all
    sel_spans: list | None = None  # the blocks (GramCapture.blocks) as row ranges of the wanted rows x[sel]


class GramOptions(TypedDict, total=False):
    """:class:`GramCapture`'s keywords, passed through by :func:`exact_rollout_gram` (defaults and meaning there)."""

    form: Form
    token_block: int
    rollout_block: int | None
    budget_bytes: int
    check_dropped: bool
    keep_param_grams: bool
    blocks: Sequence[int] | None


class GramCapture:
    """Context manager: the exact per-rollout Gram of the one backward that runs inside it.

    Inside the context exactly one grad-enabled forward of ``model`` over all N rollouts and its backward may run;
    :meth:`result` then gives Gram[i, j] = <g_i, g_j> of the per-row gradient terms of whatever scalar was
    differentiated (sum_i s_i gives the g_i). The backward may be a plain ``loss.backward()`` or
    ``torch.autograd.grad(loss, capture.backward_roots())``, which skips every weight-gradient GEMM. Module input and
    output-gradient hooks only: ``param.grad`` is never read.

    Args:
        model: a causal LM (batch-first [N, S, ...] activations, no dropout, no activation checkpointing).
        form: "auto" (per linear layer, :func:`choose_form`), "token" or "rollout" everywhere.
        token_block: positions per tile of the token-pair form.
        rollout_block: rollouts whose layer gradients are formed in one batched matmul (None: all N).
        budget_bytes: bound on one transient block (G_i chunks, cached kernels, embedding row sums).
        check_dropped: also record the largest |delta| at the skipped (padding) positions; it must be 0.
        keep_param_grams: keep one [N, N] Gram per parameter in the result (tests).
        blocks: sizes of consecutive row blocks (summing to N, e.g. one per GRPO group): only the entries inside a
            block are computed, the others are 0 (:func:`block_spans`); None: the whole [N, N] Gram.

    Raises:
        ValueError: unknown form, or activation checkpointing on.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        form: Form = "auto",
        token_block: int = 1024,
        rollout_block: int | None = None,
        budget_bytes: int = 256 << 20,
        check_dropped: bool = False,
        keep_param_grams: bool = False,
        blocks: Sequence[int] | None = None,
    ) -> None:
        if form not in FORMS:
            raise ValueError(f"unknown Gram form {form!r}; valid names: {', '.join(FORMS)}")
        if getattr(model, "is_activation_checkpointing", getattr(model, "gradient_checkpointing", False)):
            raise ValueError("activation checkpointing re-runs forwards inside the backward; turn it off for the Gram")
        self.model, self.form, self.token_block = model, form, max(1, int(token_block))
        self.rollout_block, self.budget = rollout_block, int(budget_bytes)
        self.check_dropped, self.keep_param_grams = check_dropped, keep_param_grams
        self.blocks = None if blocks is None else [int(b) for b in blocks]
        self.plan = plan_gram(model)
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        # each hooked (module, attribute)'s parameter name, resolved now: under FSDP2 (``fully_shard``) the attribute
        # holds another tensor (the unsharded parameter) while the hooks run
        self.attr_names = {
            (m, a): self.param_names[id(getattr(m, a))] for m, attrs in self.plan.hooked.items() for a in attrs
        }
        self.module_names = {m: n for n, m in reversed(list(model.named_modules()))}
        # a transformers model's method, which nn.Module's __getattr__ types as Tensor | Module
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # type: ignore[operator]
        self._head = self.param_names.get(id(out.weight)) if isinstance(out, nn.Linear) else None
        self._handles: list = []
        self._in_hook = False
        #: [N] bool or None, set before the forward: only these rows' entries are computed, the others' are 0 (the
        #: fused lens skips the rollouts it does not analyse, :class:`MicroBatchGrams`).
        self.rows: Tensor | None = None
        self._reset()

    def _reset(self) -> None:
        self.state: _Pass | None = None
        self.param_grams: dict[str, Tensor] = {}
        self.forms: dict[str, str] = {}
        self.norm_closed_form: dict[str, bool] = {}
        self.hook_seconds = 0.0
        self.shared_layers = 0  # linear layers whose token form paired shared columns once (shared_token_gram)
        self.max_dropped = 0.0
        self.late_uncovered: dict[str, str] = {}
        self.spans: list[tuple[int, int]] = []  # row blocks of the pass (block_spans), set by its forward
        for t in self.plan.tied.values():
            t.lm_lm = t.glm_rows = t.emb_emb = t.lm_emb = None

    def __enter__(self) -> GramCapture:
        self._reset()
        self._handles.append(self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True))
        for module in self.plan.hooked:
            self._handles.append(module.register_forward_hook(self._on_forward, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def backward_roots(self) -> list[Tensor]:
        """What to differentiate the loss with respect to so that every hooked module gets its delta and no weight
        gradient is computed: the pass's input-embedding outputs (else every covered trainable parameter)."""
        st = self.state
        if st is not None and st.roots and all(r.requires_grad for r in st.roots):
            return list(st.roots)
        return [p for n, p in self.model.named_parameters() if n in self.plan.kinds]

    # -- forward hooks -------------------------------------------------------------------------------------------
    def _on_model_forward(self, module, args, kwargs) -> None:
        if self._in_hook or not torch.is_grad_enabled():
            return
        if self.state is not None:
            raise NotImplementedError(
                "GramCapture takes one grad-enabled forward (all N rollouts) per context: the "
                "cross-rollout entries need both rollouts' deltas in the same backward"
            )
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if ids is None:
            raise ValueError("the model must be called with input_ids for the exact Gram")
        keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        sel = None
        if self.rows is not None:  # only these rows' entries: the others' positions are skipped (their Gram is 0)
            assert self.rows.shape == ids.shape[:1], (tuple(self.rows.shape), tuple(ids.shape))
            rows = self.rows.to(device=keep.device, dtype=torch.bool)
            keep = keep & rows.unsqueeze(1)
            sel = None if bool(rows.all()) else rows.nonzero().squeeze(1)
        self.spans = block_spans(self.blocks, ids.shape[0])
        sel_spans = None if sel is None else wanted_spans(self.spans, sel.cpu())
        self.state = _Pass(n=ids.shape[0], length=ids.shape[1], keep=keep, sel=sel, sel_spans=sel_spans)

    def _keep_for(self, shape: Sequence[int]) -> Tensor:
        """[N, S] kept positions of an activation [N, S, ...] (S < L: the last S, as under ``logits_to_keep``)."""
        st = self.state
        assert st is not None
        assert len(shape) >= 3 and shape[0] == st.n, f"activation of shape {tuple(shape)}; expected [N={st.n}, S, d]"
        if shape[1] > st.length:
            raise ValueError(f"sequence length {shape[1]} > input length {st.length}")
        return st.keep[:, st.length - shape[1] :]

    def _on_forward(self, module, args, kwargs, output) -> None:
        st = self.state
        if self._in_hook or st is None or not torch.is_grad_enabled():
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        st.calls[module] = st.calls.get(module, 0) + 1
        if st.calls[module] > 1:
            raise NotImplementedError(
                f"module {self.module_names[module]} was called twice in one forward; the exact "
                "Gram of a module used twice is not supported"
            )
        x = args[0] if args else kwargs.get("input")
        if isinstance(module, nn.Embedding):
            self._on_embedding_forward(module, x, output)
        elif is_linear(module):  # nn.Linear or Conv1D: the same (x, delta) hooks
            self._on_linear_forward(module, x.detach(), output)
        elif len(args) != 1 or kwargs or not isinstance(x, Tensor) or x.shape[0] != st.n:
            for attr in self.plan.hooked[module]:
                self.late_uncovered[self.attr_names[(module, attr)]] = (
                    "module called with other than one [N, ...] tensor"
                )
        else:
            x = x.detach()
            output.register_hook(lambda g, m=module, x=x: self._timed(self._norm_backward, m, x, g))

    def _on_embedding_forward(self, module: nn.Embedding, ids: Tensor, output: Tensor) -> None:
        st = self.state
        assert st is not None
        keep = self._keep_for(tuple(ids.shape) + (1,))
        if module.padding_idx is not None:  # torch gives the padding row no gradient
            keep = keep & (ids != module.padding_idx)
        flat = keep.reshape(-1).nonzero().squeeze(1)  # [M]
        tokens, uid = torch.unique(ids.reshape(-1)[flat], return_inverse=True)  # [U] sorted, [M]
        st.emb[module] = (tokens, uid, flat // ids.shape[1], flat)
        st.roots.append(output)
        scale = embedding_scale(module, ids, output)
        if scale is None:
            self.late_uncovered[self.attr_names[(module, "weight")]] = "embedding subclass whose output is not c W[tok]"
            return
        st.emb_scale[module] = scale
        output.register_hook(lambda g, m=module: self._timed(self._embedding_backward, m, g))

    def _on_linear_forward(self, module: nn.Module, x: Tensor, output: Tensor) -> None:
        st = self.state
        assert st is not None
        keep = self._keep_for(x.shape)
        form, key, shared = None, _tensor_key(x), None
        if "weight" in self.plan.hooked[module]:
            d_out, d_in = linear_shape(module)
            shared = self._shared_for(key, x, keep)
            counts = [int(c.sum()) for c in shared]
            if st.sel is not None:  # the wanted rows alone, in their blocks (the spans with a wanted row, in order)
                assert st.sel_spans is not None
                ms = [int(keep[st.sel[a:b]].sum()) for a, b in st.sel_spans]
                ns = [b - a for a, b in st.sel_spans]
                counts = [c for c, (r0, r1) in zip(counts, self.spans) if bool(keep[r0:r1].any())]
            else:
                ms = [int(keep[r0:r1].sum()) for r0, r1 in self.spans]
                ns = [r1 - r0 for r0, r1 in self.spans]
            plain, rollout = form_costs(ms, ns, d_in, d_out, self.token_block)
            paired = shared_token_cost(ms, ns, counts, d_in, d_out, self.token_block) if any(counts) else math.inf
            form = self.form if self.form != "auto" else ("token" if min(plain, paired) < rollout else "rollout")
            self.forms[self.module_names[module]] = form
            if form == "token":
                st.x_users[key] = st.x_users.get(key, 0) + 1
            if form != "token" or paired >= plain:  # the token pairs as they are are cheaper (or not token form)
                shared = None
        output.register_hook(
            lambda g, m=module, x=x, k=keep, f=form, key=key, sh=shared: self._timed(
                self._linear_backward, m, x, k, f, key, g, sh
            )
        )

    def _shared_for(self, key: tuple, x: Tensor, keep: Tensor) -> list[Tensor]:
        """Each span's :func:`shared_columns` of input ``x`` (computed once per input: q, k and v read the same)."""
        st = self.state
        assert st is not None
        if key not in st.x_shared:
            t0 = time.perf_counter()
            st.x_shared[key] = [shared_columns(x[r0:r1], keep[r0:r1]) for r0, r1 in self.spans]
            self.hook_seconds += time.perf_counter() - t0
        return st.x_shared[key]

    # -- backward hooks ------------------------------------------------------------------------------------------
    def _timed(self, fn, *args) -> None:
        t0 = time.perf_counter()
        self._in_hook = True
        try:
            with torch.no_grad():
                fn(*args)
        finally:
            self._in_hook = False
            self.hook_seconds += time.perf_counter() - t0

    def _add(self, module: nn.Module, attr: str, gram: Tensor) -> None:
        name = self.attr_names[(module, attr)]
        self.param_grams[name] = gram if name not in self.param_grams else self.param_grams[name] + gram

    def _note_dropped(self, g: Tensor, keep: Tensor) -> None:
        if self.check_dropped and bool((~keep).any()):
            self.max_dropped = max(self.max_dropped, float(g[~keep].abs().max()))

    def _linear_backward(
        self,
        module: nn.Module,
        x: Tensor,
        keep: Tensor,
        form: str | None,
        key: tuple,
        delta: Tensor,
        shared: list[Tensor] | None = None,
    ) -> None:
        assert self.state is not None
        attrs = self.plan.hooked[module]
        x, delta = _upcast(x), _upcast(delta)
        self._note_dropped(delta, keep)
        if "bias" in attrs:  # g_i = sum_t delta_t (skipped positions have delta = 0)
            gb = delta.sum(dim=1, dtype=torch.float64).reshape(delta.shape[0], -1)
            self._add(module, "bias", block_outer(gb, gb, self.spans))
        if "weight" not in attrs:
            return
        tied = self.plan.tied.get(module)
        tokens = self.state.emb[tied.emb][0] if tied is not None else None
        if form == "token":
            if shared is not None:
                self.shared_layers += 1
            gram = token_pair_gram(
                x, delta, keep, self.token_block, self._kernel_cache(key, int(keep.sum())), self.spans, shared
            )
            if tied is not None:
                assert tokens is not None
                tied.glm_rows = lm_rows_at_tokens(x, delta, keep, tokens, self.budget)
        elif self.state.sel is None:
            gram, rows = rollout_layer_gram(x, delta, keep, self.budget, self.rollout_block, tokens, self.spans)
            if tied is not None:
                tied.glm_rows = rows
        else:  # the wanted rows only (the others' G_i are 0: forming them would be wasted), scattered back
            sel, n = self.state.sel, x.shape[0]
            sub, sub_rows = rollout_layer_gram(
                x[sel], delta[sel], keep[sel], self.budget, self.rollout_block, tokens, self.state.sel_spans
            )
            gram = torch.zeros(n, n, dtype=torch.float64, device=x.device)
            gram[sel.unsqueeze(1), sel.unsqueeze(0)] = sub
            if tied is not None:
                assert sub_rows is not None
                tied.glm_rows = sub_rows.new_zeros((n,) + tuple(sub_rows.shape[1:]))
                tied.glm_rows[sel] = sub_rows
        if tied is not None:
            tied.lm_lm = gram
        else:
            self._add(module, "weight", gram)

    def _kernel_cache(self, key: tuple, m: int) -> dict | None:
        """The x-kernel tiles shared by the token-pair layers reading the same input while any is left (and they fit
        the budget), else None."""
        st = self.state
        assert st is not None
        users = st.x_users.get(key, 0)
        st.x_users[key] = users - 1
        if users <= 1:
            return st.x_cache.pop(key, None)
        return st.x_cache.setdefault(key, {}) if m * m * 8 <= self.budget else None

    def _embedding_backward(self, module: nn.Embedding, delta: Tensor) -> None:
        """EE[i, j] = sum_v r_{i,v} . r_{j,v}; with a tied head also LE[i, j] = sum_v G^lm_i[v] . r_{j,v}."""
        st = self.state
        assert st is not None
        tokens, uid, seg, flat = st.emb[module]
        n, d = st.n, delta.shape[-1]
        self._note_dropped(delta, self._keep_for(delta.shape))
        dk = _upcast(delta.reshape(-1, d)[flat])  # [M, d]
        if st.emb_scale[module] != 1.0:  # y = c W[tok]: the lookup's gradient is c delta
            dk = dk * st.emb_scale[module]
        tied = self.plan.tied.get(module)
        ee = torch.zeros(n, n, dtype=torch.float64, device=delta.device)
        le = torch.zeros(n, n, dtype=torch.float64, device=delta.device)
        chunk = max(1, self.budget // max(1, n * d * 8))
        for u0 in range(0, tokens.numel(), chunk):
            u1 = min(tokens.numel(), u0 + chunk)
            r = embedding_row_sums(dk, seg, uid, n, u0, u1).reshape(n, -1)  # [N, (u1 - u0) d]
            ee += block_outer(r, r, self.spans)
            if tied is not None and tied.glm_rows is not None:
                le += block_outer(tied.glm_rows[:, u0:u1].reshape(n, -1), r, self.spans)
        if tied is None:
            self._add(module, "weight", ee)
        else:
            tied.emb_emb, tied.lm_emb = ee, le

    def _norm_backward(self, module: nn.Module, x: Tensor, delta: Tensor) -> None:
        """A leaf module's own parameters: the closed form (:func:`norm_rollout_grads`), checked on each class's first
        call against :func:`vjp_rollout_grads` (which is used instead if they disagree, or for another kind)."""
        attrs = list(self.plan.hooked[module])
        cls = type(module).__name__
        grads = norm_rollout_grads(module, x, delta, attrs) if self.norm_closed_form.get(cls, True) else None
        if grads is not None and cls not in self.norm_closed_form:
            ref = vjp_rollout_grads(module, x, delta, attrs)
            tol = 1e-10 if x.dtype == torch.float64 else 1e-4
            self.norm_closed_form[cls] = all(
                float((grads[a] - ref[a].reshape(grads[a].shape).double()).abs().max())
                <= tol * max(1e-30, float(ref[a].abs().max()))
                for a in attrs
            )
            grads = grads if self.norm_closed_form[cls] else ref
        if grads is None:
            grads = vjp_rollout_grads(module, x, delta, attrs)
        for a in attrs:
            g = grads[a].reshape(x.shape[0], -1).double()
            self._add(module, a, block_outer(g, g, self.spans))

    # -- result --------------------------------------------------------------------------------------------------
    def _tied_grams(self, n: int) -> dict[str, float]:
        """Each tied matrix's Gram LL + EE + LE + LE^T into ``param_grams``; returns its terms' traces."""
        terms: dict[str, float] = {}
        zero = torch.zeros(n, n, dtype=torch.float64)
        for t in {id(t): t for t in self.plan.tied.values()}.values():
            ll, ee, le = (zero if v is None else v.cpu() for v in (t.lm_lm, t.emb_emb, t.lm_emb))
            self.param_grams[t.name] = ll + ee + le + le.T
            terms.update(
                {
                    f"{t.name}/lm_use": float(ll.trace()),
                    f"{t.name}/embedding_use": float(ee.trace()),
                    f"{t.name}/cross": float(2 * le.trace()),
                }
            )
        return terms

    def result(self) -> tuple[Tensor, dict[str, Any]]:
        """(Gram [N, N] float64 on the CPU, info); info's keys are listed in :func:`exact_rollout_gram`.

        Raises:
            RuntimeError: no grad-enabled forward ran inside the capture.
        """
        if self.state is None:
            raise RuntimeError("no grad-enabled forward ran inside the GramCapture")
        n = self.state.n
        terms = self._tied_grams(n)
        gram = torch.zeros(n, n, dtype=torch.float64)
        by_kind: dict[str, float] = {}
        uncovered = {**self.plan.uncovered, **self.late_uncovered}
        covered = unreached = 0
        for name, kind in self.plan.kinds.items():
            if name in self.late_uncovered:
                continue
            covered += self.plan.numel[name]
            g = self.param_grams.get(name)
            if g is None:  # hooked, but no gradient reached it: its g_i are 0
                unreached += 1
                continue
            gram += g.cpu()
            label = "lm_head" if kind == "linear" and name == self._head else kind
            by_kind[label] = by_kind.get(label, 0.0) + float(g.trace())
        total = sum(self.plan.numel.values())
        trace = float(gram.trace())
        info: dict[str, Any] = {
            "coverage": covered / total if total else 1.0,
            "covered_params": covered,
            "total_params": total,
            "uncovered": uncovered,
            "unreached": unreached,
            "trace_share": {k: v / trace if trace else float("nan") for k, v in sorted(by_kind.items())},
            "tied_terms_share": {k: v / trace if trace else float("nan") for k, v in terms.items()},
            "forms": dict(self.forms),
            "norm_closed_form": dict(self.norm_closed_form),
            "hook_seconds": self.hook_seconds,
            "shared_layers": self.shared_layers,
        }
        if self.check_dropped:
            info["max_dropped_delta"] = self.max_dropped
        if self.keep_param_grams:
            info["param_grams"] = {k: v.cpu() for k, v in self.param_grams.items()}
        return gram, info


# ---------------------------------------------------------------------------------------------------------------------
# One call
# ---------------------------------------------------------------------------------------------------------------------
def exact_rollout_gram(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    weights: Tensor | None = None,
    score_weights: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    captures: Sequence[ContextManager] = (),
    **options: Unpack[GramOptions],
) -> tuple[Tensor, dict[str, Any]]:
    """Gram[i, j] = <w_i g_i, w_j g_j> over every trainable parameter from one batched forward + backward.

    The backward is taken w.r.t. the input-embedding outputs (no weight gradient; ``.grad`` untouched). s_i follows
    grpo-lens' log-prob and score definitions (:func:`grpo_lens.rollout.batch_logprobs`,
    :func:`grpo_lens.gradients.scores.rollout_scores`), so the Gram is that of
    :func:`grpo_lens.gradients.exact.exact_rollout_grads`'s rows (docs/theory.md §Exact Gram).

    Args:
        model: causal LM (eval mode: no dropout).
        batch: N rollouts (all groups together: G1 per group is a diagonal block, G3 needs the off-diagonal ones).
        weights: [N] row weights w_i (``A`` gives G1's Gram); None = 1.
        score_weights: [N] omega_i of :func:`rollout_scores` (default 1/|o_i|; docs/theory.md §3).
        temperature: the sampling temperature. top_k, top_p: ignored (log-probs do not depend on them).
        captures: other context managers opened around the same forward and backward (e.g. a
            :class:`grpo_lens.gradients.sketch.GradientCapture` for vectors), so that they cost no pass of their own.
        options: :class:`GramCapture`'s keywords (:class:`GramOptions`): form, token_block, rollout_block,
            budget_bytes, check_dropped, keep_param_grams, and blocks, the row-block sizes (e.g. [R] * B: each group's
            [R, R] block, the rest 0; None: the whole [N, N] Gram).

    Returns:
        (gram [N, N] float64 on the CPU, info): ``coverage`` (covered share of the trainable parameter count),
        ``covered_params``, ``total_params``, ``uncovered`` {name: reason}, ``unreached`` (hooked parameters no
        gradient reached: their g_i are 0), ``trace_share`` {kind: share of trace(Gram)} (kinds: :data:`KINDS`),
        ``tied_terms_share`` (the tied matrix's LM use, embedding use and cross term), ``forms`` {linear layer:
        token | rollout}, ``norm_closed_form`` {class: closed form agreed}, ``hook_seconds``, ``shared_layers``
        (linear layers whose token form paired the columns a block's rows share once, :func:`shared_token_gram`),
        ``seconds`` {forward, backward (hooks included)}, and ``max_dropped_delta`` / ``param_grams`` on request.

    Raises:
        RuntimeError: nothing in the model requires grad.
    """
    n = batch.num_rollouts
    if weights is not None:
        assert weights.shape == (n,), (weights.shape, n)
    cap = GramCapture(model, **options)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(cap)
        for c in captures:
            stack.enter_context(c)
        loss = rollout_scores(batch_logprobs(model, batch, temperature), batch.completion_mask, score_weights).sum()
        t1 = time.perf_counter()
        roots = cap.backward_roots()
        if not loss.requires_grad or not roots:
            raise RuntimeError("the model's outputs do not require grad; no Gram to compute")
        torch.autograd.grad(loss, roots, allow_unused=True)
    gram, info = cap.result()
    if weights is not None:
        w = weights.detach().double().cpu()
        gram = gram * w[:, None] * w[None, :]
        if "param_grams" in info:
            info["param_grams"] = {k: v * w[:, None] * w[None, :] for k, v in info["param_grams"].items()}
    info["seconds"] = {"forward": t1 - t0, "backward": time.perf_counter() - t1}
    return gram, info


# ---------------------------------------------------------------------------------------------------------------------
# The Gram inside another backward: one block per micro-batch of the policy update
# ---------------------------------------------------------------------------------------------------------------------
class MicroBatchGrams:
    """The exact Gram of the rows of whatever loss the policy update differentiates, one [n, n] block per
    micro-batch, captured by hooks in the update's own forwards and backwards (no pass of its own; docs/theory.md
    §Lens inside the update's backward).

    The update's loss is a sum over rows, so the hooks of :class:`GramCapture` see each row's own output gradients and
    give <h_i, h_j> of the per-row loss gradients h_i = grad L_i of the rows of one micro-batch (rows of different
    micro-batches never share a backward: their entries are not measured). The caller divides the rows' weights out
    (:func:`grpo_lens.lens.trainer_lens.score_gram_from_update`).

    Use: ``with grams.micro_batch(idx): forward + loss.backward()`` for each micro-batch ``idx`` of the first pass.

    Args:
        model: the policy (see :class:`GramCapture` for what it must be).
        num_rows: N, the rows of the whole batch the micro-batches index.
        rows: [N] bool, the rows whose entries are wanted (the others' positions are skipped); None = all.
        group_size: R: only the entries of two rows of one group (rows b R .. (b + 1) R - 1) are computed, the
            others are NaN (the lens reads each group's [R, R] block alone: the reduction costs N R instead of N^2
            per layer); None: every pair of one micro-batch.
        kwargs: passed to :class:`GramCapture` (form, token_block, budget_bytes, ...; not ``blocks``).
    """

    def __init__(
        self,
        model: nn.Module,
        num_rows: int,
        rows: Tensor | None = None,
        group_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.capture = GramCapture(model, **kwargs)
        self.num_rows = int(num_rows)
        self.wanted = None if rows is None else rows.detach().to("cpu", torch.bool)
        self.group_size = None if group_size is None else int(group_size)
        #: (row indices [n] long on the CPU, Gram [n, n] float64 on the CPU, info) of each micro-batch measured
        self.blocks: list[tuple[Tensor, Tensor, dict[str, Any]]] = []

    def __enter__(self) -> MicroBatchGrams:
        self.blocks = []
        return self

    def __exit__(self, *exc) -> None:
        return None

    @contextlib.contextmanager
    def micro_batch(self, idx: Tensor):
        """Capture the Gram of micro-batch ``idx`` ([n] row indices into the N rows) around its forward and
        backward; a micro-batch with no wanted row runs without hooks."""
        idx = idx.detach().to("cpu", torch.long)
        want = None if self.wanted is None else self.wanted[idx]
        if want is not None and not bool(want.any()):
            yield
            return
        if self.group_size is not None:  # consecutive rows of one group form a block
            self.capture.blocks = torch.unique_consecutive(idx // self.group_size, return_counts=True)[1].tolist()
        with self.capture:
            self.capture.rows = want
            try:
                yield
            finally:
                self.capture.rows = None
        gram, info = self.capture.result()
        if self.group_size is not None:
            group = idx // self.group_size
            gram = gram.masked_fill(group.unsqueeze(1) != group.unsqueeze(0), float("nan"))
        self.blocks.append((idx, gram, info))

    def gram(self) -> tuple[Tensor, dict[str, Any]]:
        """(Gram [N, N] float64 on the CPU with NaN where two rows were in different micro-batches or groups (with
        ``group_size``), or one is not wanted; info: ``coverage`` (the smallest of the blocks'), ``hook_seconds``
        (summed), ``micro_batches``).

        Raises:
            RuntimeError: no micro-batch was captured.
        """
        if not self.blocks:
            raise RuntimeError("no micro-batch was captured: MicroBatchGrams.micro_batch was never entered")
        out = torch.full((self.num_rows, self.num_rows), float("nan"), dtype=torch.float64)
        for idx, g, _ in self.blocks:
            out[idx.unsqueeze(1), idx.unsqueeze(0)] = g
        if self.wanted is not None:
            out[~self.wanted] = float("nan")
            out[:, ~self.wanted] = float("nan")
        infos = [info for _, _, info in self.blocks]
        info = {
            "coverage": min(i["coverage"] for i in infos),
            "hook_seconds": sum(i["hook_seconds"] for i in infos),
            "micro_batches": len(infos),
            "uncovered": {k: v for i in infos for k, v in i["uncovered"].items()},
        }
        return out, info
