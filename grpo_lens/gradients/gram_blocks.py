"""The [N, N] Gram block of one module from its inputs and output gradients: the pure pieces of the exact Gram
(:mod:`grpo_lens.gradients.gram`, whose hooks call them; notation and derivation there and in
docs/theory.md §Exact Gram).

- ``nn.Linear`` weights as token pairs (:func:`token_pair_gram`, :func:`shared_token_gram` for layers reading one
  input) or with each rollout's G_i formed transiently (:func:`rollout_layer_gram`), the cheaper per layer by a cost
  model measured on a CPU (:func:`form_costs`, :func:`choose_form`);
- embeddings by per-token row sums (:func:`embedding_row_sums`, :func:`embedding_scale`) and the tied LM head's rows
  (:func:`lm_rows_at_tokens`);
- norms in closed form (:func:`norm_rollout_grads`) or by a vmapped vector-Jacobian product (:func:`vjp_rollout_grads`);
- the block structure (:func:`block_spans`, :func:`block_outer`) and Gram helpers (:func:`gram_of_rows`,
  :func:`gram_factor`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.func import grad as func_grad

Form = Literal["auto", "token", "rollout"]
FORMS = ("auto", "token", "rollout")


# ---------------------------------------------------------------------------------------------------------------------
# Pure pieces: each computes one parameter kind's [N, N] Gram from a module's inputs and output gradients
# ---------------------------------------------------------------------------------------------------------------------
def gram_of_rows(rows: Tensor, slice_len: int = 8192) -> Tensor:
    """rows rows^T [N, N] float64 of rows [N, P] (P: the rows' width), as dot products over ``slice_len``-long slices in
    the rows' dtype (one batched GEMM; on CPU much faster than one skinny [N, P] x [P, N] product) summed in float64."""
    n, k = rows.shape
    nb = k // slice_len
    out = torch.zeros(n, n, dtype=torch.float64, device=rows.device)
    if nb:
        v = rows[:, : nb * slice_len].reshape(n, nb, slice_len).transpose(0, 1)  # [nb, N, slice_len]
        out += torch.bmm(v, v.transpose(1, 2)).sum(0, dtype=torch.float64)
    if nb * slice_len < k:
        t = rows[:, nb * slice_len :]
        out += (t @ t.T).to(torch.float64)
    return out


def block_spans(blocks: Sequence[int] | None, n: int) -> list[tuple[int, int]]:
    """Row ranges [(r0, r1)] of consecutive blocks of sizes ``blocks`` (sum N), or one block of all N rows (None).

    The block-diagonal Gram (many groups from one backward): only entries inside a block are computed; the others
    are 0 in the result. Rows never interact in a decoder-only transformer, so each block equals the Gram its rows
    would give in a pass of their own (docs/theory.md §Exact Gram).

    Raises:
        ValueError: sizes that are not positive or do not sum to N.
    """
    if blocks is None:
        return [(0, n)]
    sizes = [int(b) for b in blocks]
    if any(b < 1 for b in sizes) or sum(sizes) != n:
        raise ValueError(f"Gram blocks {sizes} must be positive sizes summing to the batch's {n} rows")
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [(e - b, e) for b, e in zip(sizes, ends)]


def wanted_spans(spans: Sequence[tuple[int, int]], sel: Tensor) -> list[tuple[int, int]]:
    """The row blocks ``spans`` of N rows as row ranges of the wanted rows x[sel] (sel: [n] sorted row indices):
    block (r0, r1) keeps its wanted rows, which are consecutive in x[sel]; blocks without one are dropped.

    Example: spans [(0, 4), (4, 8), (8, 12)], sel [4, 5, 6, 7, 8, 9, 10, 11] -> [(0, 4), (4, 8)]."""
    out, start = [], 0
    for r0, r1 in spans:
        count = int(((sel >= r0) & (sel < r1)).sum())
        if count:
            out.append((start, start + count))
            start += count
    return out


def block_outer(a: Tensor, b: Tensor, spans: Sequence[tuple[int, int]]) -> Tensor:
    """[N, N] float64: a[r0:r1] b[r0:r1]^T in each block (r0, r1) of ``spans``, 0 elsewhere. a, b: [N, P]."""
    n = a.shape[0]
    if len(spans) == 1 and spans[0] == (0, n):
        return (a @ b.T).to(torch.float64)
    out = torch.zeros(n, n, dtype=torch.float64, device=a.device)
    for r0, r1 in spans:
        out[r0:r1, r0:r1] = (a[r0:r1] @ b[r0:r1].T).to(torch.float64)
    return out


#: The cost model of :func:`form_costs`, fitted (relative least squares) to both forms' seconds over 45 shapes on the
#: project's 2-core CPU (benchmarks/bench_gram_forms.py, docs/benchmarks.md §Gram forms) and rounded: a token-pair
#: multiply-add costs 1.3 of a per-rollout one, and each formed G_i costs about 50 positions' worth of multiply-adds
#: per element (writing it and reading it back: the formation's inner dimension is one rollout's few positions, so it
#: runs at memory speed, not the GEMM rate); the float64-summed reduction about n^2 / 3.
TOKEN_PAIR_COST = 1.3
ROLLOUT_ROW_COST = 50.0
ROLLOUT_PAIR_COST = 1 / 3
#: On a CPU the rollout form forms its G_i in chunks of at most this many bytes, reusing one buffer: a chunk that
#: stays in cache is 1.2-2.2x faster than one 256 MB block (docs/benchmarks.md §Gram forms).
ROLLOUT_CHUNK_BYTES = 16 << 20


def form_costs(
    ms: Sequence[int],
    ns: Sequence[int],
    d_in: int,
    d_out: int,
    token_block: int,
    constants: tuple[float, float, float] = (TOKEN_PAIR_COST, ROLLOUT_ROW_COST, ROLLOUT_PAIR_COST),
    shared: Sequence[int] | None = None,
) -> tuple[float, float]:
    """(token, rollout): the two forms' costs for one linear layer, in per-rollout multiply-adds, summed over blocks of
    ns[b] rollouts with ms[b] kept positions each (one block: the whole [N, N] Gram).

    token pairs: the kernels X X^T and D D^T over the tiles a <= b (nt tiles cover (nt + 1) / (2 nt) of the M^2
    pairs) plus the float64 reduction (the + 2n + 64 per pair), times :data:`TOKEN_PAIR_COST`; per rollout: forming
    the G_i (the weight gradient's own GEMM, M d_in d_out), writing and reading them (:data:`ROLLOUT_ROW_COST` n
    d_in d_out) and the n^2 d_in d_out reduction (times :data:`ROLLOUT_PAIR_COST`). Book-keeping's hybrid rule
    (Bu et al. 2022, arXiv 2210.00038, §3) with costs measured on a CPU. ``constants``: (token pair, rollout row,
    rollout pair) costs in place of the shipped ones (benchmarks/bench_gram_forms.py compares rules).

    ``shared``: s[b] columns of block b whose input every row shares (:func:`shared_columns`; a group's prompt). The
    token form's cost is then the lower of the plain token pairs' and :func:`shared_token_gram`'s
    (:func:`shared_token_cost`).
    """
    token_pair, rollout_row, rollout_pair = constants
    token = rollout = 0.0
    for m, n in zip(ms, ns):
        nt = max(1, math.ceil(m / max(1, token_block)))
        token += token_pair * (nt + 1) / (2 * nt) * m * m * (d_in + d_out + 2 * n + 64)
        rollout += d_in * d_out * (m + rollout_row * n + rollout_pair * n * n)
    if shared is not None and any(shared):
        token = min(token, shared_token_cost(ms, ns, shared, d_in, d_out, token_block, constants))
    return token, rollout


def shared_token_cost(
    ms: Sequence[int],
    ns: Sequence[int],
    shared: Sequence[int],
    d_in: int,
    d_out: int,
    token_block: int,
    constants: tuple[float, float, float] = (TOKEN_PAIR_COST, ROLLOUT_ROW_COST, ROLLOUT_PAIR_COST),
) -> float:
    """:func:`shared_token_gram`'s cost in :func:`form_costs`' units, summed over the blocks (s[b] shared columns):
    the M_o = m - n s own positions as token pairs; the kernels (s^2 + s M_o) d_in and n s (s + n + M_o) d_out
    multiply-adds at the token-pair price; and the output gradients gathered once more ((M_o + n s) d_out elements,
    each priced like the rollout form's writing and reading of an element of G_i). A block with s = 0 is priced as
    plain token pairs. That copy is what makes a layer with a wide output and few shared columns (the LM head, whose
    one shared column is the prompt's last position) cheaper unshared."""
    token_pair, rollout_row, _ = constants
    cost = 0.0
    for m, n, s in zip(ms, ns, shared):
        mo = m - n * s  # the positions paired as tokens
        nt = max(1, math.ceil(mo / max(1, token_block)))
        cost += token_pair * (nt + 1) / (2 * nt) * mo * mo * (d_in + d_out + 2 * n + 64)
        if s:
            cost += token_pair * ((s * s + s * mo) * d_in + n * s * (s + n + mo) * d_out)
            cost += rollout_row * (mo + n * s) * d_out
    return cost


def choose_form(m: int, n: int, d_in: int, d_out: int, token_block: int) -> str:
    """'token' or 'rollout', whichever :func:`form_costs` prices lower for one linear layer (one block).

    Args:
        m: kept positions M.   n: rollouts N.   d_in, d_out: the layer's sizes.   token_block: tile length.
    """
    return choose_block_form([m], [n], d_in, d_out, token_block)


def choose_block_form(
    ms: Sequence[int],
    ns: Sequence[int],
    d_in: int,
    d_out: int,
    token_block: int,
    shared: Sequence[int] | None = None,
) -> str:
    """:func:`choose_form` for a block-diagonal Gram: blocks of ns[b] rollouts with ms[b] kept positions each (and
    shared[b] shared columns, :func:`form_costs`); the costs of both forms summed over the blocks."""
    token, rollout = form_costs(ms, ns, d_in, d_out, token_block, shared=shared)
    return "token" if token < rollout else "rollout"


def shared_columns(x: Tensor, keep: Tensor) -> Tensor:
    """[S] bool: the columns t kept in every row of one block whose inputs x[i, t] are bit-equal in every row.

    In a per-rollout forward the R rollouts of a group run the same prompt, so every layer's input at the prompt's
    positions is the same in each row (and at any completion prefix the rows share); :func:`shared_token_gram` then
    pairs those positions once instead of R^2 times. Equality is checked, not assumed: a kernel whose rounding
    depended on the row would leave its columns unshared, and the Gram is the same either way. A block of one row
    shares nothing.

    Args:
        x: [n, S, d_in] one block's inputs.   keep: [n, S] bool, kept positions.
    """
    if x.shape[0] < 2:
        return torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
    cols = keep.all(0)
    if bool(cols.any()):
        cols = cols & (x == x[:1]).all(-1).all(0)
    return cols


def token_pair_gram(
    x: Tensor,
    delta: Tensor,
    keep: Tensor,
    token_block: int,
    cache: dict | None = None,
    spans: Sequence[tuple[int, int]] | None = None,
    shared: Sequence[Tensor] | None = None,
) -> Tensor:
    """<G_i, G_j> = sum_{t in i, u in j} (x_t . x_u)(delta_t . delta_u) of a linear weight, G_i = sum_t delta_t x_t^T.

    Computed over tiles of ``token_block`` kept positions (tiles a <= b, the transpose added for b > a); tiles may
    cut through rollouts, the one-hot map from positions to rollouts sums each tile's [ta, tb] products into [N, N].

    Args:
        x: [N, S, d_in] inputs.   delta: [N, S, d_out] output gradients.   keep: [N, S] bool, kept positions.
        token_block: tile length.   cache: {(a, b): x tile kernel} shared by layers with the same input, or None.
        spans: row blocks (:func:`block_spans`): only pairs inside one block are formed; None: all rows.
        shared: one [S] bool per span (or per the whole batch when ``spans`` is None), the columns whose input every
            row of the block shares (:func:`shared_columns`): a block with any goes through
            :func:`shared_token_gram`; None: none shared.

    Returns:
        [N, N] float64 (0 outside the blocks).
    """
    n = x.shape[0]
    whole = spans is None or (len(spans) == 1 and spans[0] == (0, n))
    if not whole:
        gram = torch.zeros(n, n, dtype=torch.float64, device=x.device)
        assert spans is not None
        for b, (r0, r1) in enumerate(spans):
            sub = None if cache is None else cache.setdefault(("block", r0, r1), {})
            cols = None if shared is None else [shared[b]]
            gram[r0:r1, r0:r1] = token_pair_gram(x[r0:r1], delta[r0:r1], keep[r0:r1], token_block, sub, shared=cols)
        return gram
    if shared is not None and bool(shared[0].any()):
        return shared_token_gram(x, delta, keep, shared[0], token_block, cache)
    flat = keep.reshape(-1).nonzero().squeeze(1)  # [M] row-major, rollout ids ascending
    seg = flat // keep.shape[1]  # [M] rollout of each kept position
    xk = x.reshape(-1, x.shape[-1])[flat]  # [M, d_in]
    dk = delta.reshape(-1, delta.shape[-1])[flat]  # [M, d_out]
    return _position_pairs(xk, dk, seg, n, token_block, cache)


def _position_pairs(xk: Tensor, dk: Tensor, seg: Tensor, n: int, token_block: int, cache: dict | None) -> Tensor:
    """[n, n] float64 sum_{t in i, u in j} (x_t . x_u)(delta_t . delta_u) over the M positions given: xk [M, d_in],
    dk [M, d_out], seg [M] their rows (ascending), over tiles a <= b of ``token_block`` (:func:`token_pair_gram`)."""
    gram = torch.zeros(n, n, dtype=torch.float64, device=xk.device)
    m = seg.numel()
    eye = torch.eye(n, dtype=torch.float64, device=xk.device)
    tiles = [(a, min(a + token_block, m)) for a in range(0, m, token_block)]
    for ia, (a0, a1) in enumerate(tiles):
        for ib in range(ia, len(tiles)):
            b0, b1 = tiles[ib]
            kx = cache.get((ia, ib)) if cache is not None else None
            if kx is None:
                kx = (xk[a0:a1] @ xk[b0:b1].T).to(torch.float64)  # [ta, tb] x_t . x_u
                if cache is not None:
                    cache[(ia, ib)] = kx
            c = kx * (dk[a0:a1] @ dk[b0:b1].T).to(torch.float64)  # [ta, tb] token-pair products
            part = torch.zeros(n, n, dtype=torch.float64, device=xk.device)
            part.index_add_(0, seg[a0:a1], c @ eye[seg[b0:b1]])  # S_a^T C S_b
            gram += part if ib == ia else part + part.T
    return gram


def shared_token_gram(
    x: Tensor, delta: Tensor, keep: Tensor, shared: Tensor, token_block: int, cache: dict | None = None
) -> Tensor:
    """:func:`token_pair_gram` of one block whose rows share their inputs at the columns ``shared``, each shared
    position's input paired once rather than once per pair of rows.

    With S_i = shared + own_i rollout i's positions and x_p the same in every row at a shared column p,
    <G_i, G_j> = sum_{a in S_i, b in S_j} K_ab (delta_ia . delta_jb), K = X_u X_u^T over the distinct inputs X_u
    (the shared columns once, then every row's own positions). Split by where a and b lie:

    - shared, shared: <Delta_i, K_ss Delta_j>, Delta_i = delta_i at the shared columns [s, d_out];
    - shared, own: sum_{p, u in own_j} K_pu (delta_ip . delta_u), and its transpose for own, shared;
    - own, own: :func:`token_pair_gram` over the own positions alone.

    The same sum as the token-pair form (the ghost-norm identity with cross terms, Li et al. 2021, arXiv 2110.05679,
    §4), in another order: the shared-shared part costs n s^2 d_out + n^2 s d_out multiply-adds instead of
    n^2 s^2 (d_in + d_out) (a group's prompt of s positions in each of its n rows; docs/theory.md §Exact Gram).
    Products run in the inputs' dtype, as in :func:`token_pair_gram`; so does K_ss Delta_j's sum over the s shared
    columns, and every other reduction across positions or rows runs in float64 (the float32 Gram of the default
    model's lens step agrees with the token-pair form's to 1.5e-7 relative).

    Args:
        x: [n, S, d_in].   delta: [n, S, d_out].   keep: [n, S] bool.
        shared: [S] bool (:func:`shared_columns`: kept in every row, x bit-equal across rows).
        token_block: tile length of the own positions' pairs.   cache: kernels shared by layers with the same input.

    Returns:
        [n, n] float64.
    """
    n, length = keep.shape
    d_in, d_out = x.shape[-1], delta.shape[-1]
    own = keep & ~shared.unsqueeze(0)  # [n, S]
    cols = shared.nonzero().squeeze(1)  # [s]
    flat = own.reshape(-1).nonzero().squeeze(1)  # [M_o] row-major
    seg = flat // length  # [M_o] rollout of each own position
    ds = delta[:, cols]  # [n, s, d_out]
    do = delta.reshape(-1, d_out)[flat]  # [M_o, d_out]
    xo = x.reshape(-1, d_in)[flat]  # [M_o, d_in]
    gram = _position_pairs(xo, do, seg, n, token_block, None if cache is None else cache.setdefault("own", {}))
    k_ss = None if cache is None else cache.get("k_ss")
    if k_ss is None:
        xs = x[0, cols]  # [s, d_in], the same in every row
        k_ss, k_so = xs @ xs.T, (xs @ xo.T).to(torch.float64)  # [s, s], [s, M_o]
        if cache is not None:
            cache["k_ss"], cache["k_so"] = k_ss, k_so
    else:
        assert cache is not None
        k_so = cache["k_so"]
    w = torch.matmul(k_ss, ds)  # [n, s, d_out]: sum_q K_pq delta_jq
    gram += ds.reshape(n, -1).to(torch.float64) @ w.reshape(n, -1).to(torch.float64).T
    if flat.numel():
        dd = torch.matmul(ds, do.T).to(torch.float64)  # [n, s, M_o]: delta_ip . delta_u
        c = (dd * k_so.unsqueeze(0)).sum(1)  # [n, M_o]: sum_p K_pu (delta_ip . delta_u)
        so = torch.zeros(n, n, dtype=torch.float64, device=x.device).index_add_(1, seg, c)  # [i, j]: u in own_j
        gram += so + so.T
    return gram


def crop_kept(x: Tensor, keep: Tensor) -> tuple[Tensor, int, int]:
    """(x[:, c0:c1] with skipped positions zeroed, c0, c1): the columns where any row keeps a position.

    x: [N, S, d]; keep: [N, S] bool. Zeroing x (not delta, which autograd still owns) makes the skipped positions'
    products exactly 0."""
    cols = keep.any(0).nonzero().squeeze(1)
    if cols.numel() == 0:
        return x[:, :0], 0, 0
    c0, c1 = int(cols[0]), int(cols[-1]) + 1
    k = keep[:, c0:c1]
    xs = x[:, c0:c1] if bool(k.all()) else x[:, c0:c1] * k.unsqueeze(-1).to(x.dtype)
    return xs, c0, c1


def rollout_layer_gram(
    x: Tensor,
    delta: Tensor,
    keep: Tensor,
    budget_bytes: int,
    rollout_block: int | None = None,
    token_rows: Tensor | None = None,
    spans: Sequence[tuple[int, int]] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """<G_i, G_j> of a linear weight with G_i = sum_t delta_t x_t^T formed transiently, a chunk of d_out rows (and a
    block of ``rollout_block`` rollouts) at a time, chunks sized so [N, rows, d_in] stays within ``budget_bytes``.

    Args:
        x: [N, S, d_in].   delta: [N, S, d_out].   keep: [N, S] bool.
        token_rows: [U] long, optional: also return those rows of every G_i (the tied LM head's rows at the batch's
            input tokens, for the cross term with the embedding use).
        spans: row blocks (:func:`block_spans`): only entries inside one block are reduced; None: all rows.

    Returns:
        ([N, N] float64 (0 outside the blocks), [N, U, d_in] float64 rows of G_i or None).
    """
    n, d_in, d_out = x.shape[0], x.shape[-1], delta.shape[-1]
    xs, c0, c1 = crop_kept(x, keep)
    ds = delta[:, c0:c1]
    gram = torch.zeros(n, n, dtype=torch.float64, device=x.device)
    picked = (
        None if token_rows is None else torch.zeros(n, token_rows.numel(), d_in, dtype=torch.float64, device=x.device)
    )
    if c1 == c0:
        return gram, picked
    chunk = min(budget_bytes, ROLLOUT_CHUNK_BYTES) if x.device.type == "cpu" else budget_bytes
    rows = max(1, min(d_out, chunk // max(1, n * d_in * x.element_size())))
    rb = n if rollout_block is None else max(1, int(rollout_block))
    buf = torch.empty(n * rows * d_in, dtype=x.dtype, device=x.device)  # one buffer for every chunk
    for r0 in range(0, d_out, rows):
        r1 = min(d_out, r0 + rows)
        f = buf[: n * (r1 - r0) * d_in].view(n, r1 - r0, d_in)  # [N, rows, d_in]: rows r0:r1 of G_i
        for b0 in range(0, n, rb):
            torch.bmm(ds[b0 : b0 + rb, :, r0:r1].transpose(1, 2), xs[b0 : b0 + rb], out=f[b0 : b0 + rb])
        if spans is None or (len(spans) == 1 and spans[0] == (0, n)):
            gram += gram_of_rows(f.reshape(n, -1))
        else:
            for s0, s1 in spans:
                gram[s0:s1, s0:s1] += gram_of_rows(f[s0:s1].reshape(s1 - s0, -1))
        if token_rows is not None:
            sel = ((token_rows >= r0) & (token_rows < r1)).nonzero().squeeze(1)
            if sel.numel():
                assert picked is not None
                picked[:, sel] = f[:, token_rows[sel] - r0].to(torch.float64)
    return gram, picked


def lm_rows_at_tokens(x: Tensor, delta: Tensor, keep: Tensor, tokens: Tensor, budget_bytes: int) -> Tensor:
    """G^lm_i[v, :] = sum_t delta_t[v] x_t for the tokens v (the tied LM head's rows needed by the cross term).

    x: [N, S, d_in]; delta: [N, S, V]; keep: [N, S]; tokens: [U] long. Returns [N, U, d_in] float64."""
    n, d_in = x.shape[0], x.shape[-1]
    xs, c0, c1 = crop_kept(x, keep)
    out = torch.zeros(n, tokens.numel(), d_in, dtype=torch.float64, device=x.device)
    if c1 == c0 or tokens.numel() == 0:
        return out
    cols = max(1, budget_bytes // max(1, n * (c1 - c0) * delta.element_size()))
    for u0 in range(0, tokens.numel(), cols):
        u1 = min(tokens.numel(), u0 + cols)
        dsel = delta[:, c0:c1].index_select(-1, tokens[u0:u1])  # [N, S', u]
        out[:, u0:u1] = torch.bmm(dsel.transpose(1, 2), xs)
    return out


def embedding_row_sums(delta: Tensor, seg: Tensor, uid: Tensor, n: int, u0: int, u1: int) -> Tensor:
    """r_{i,v} = sum_{t in i, tok_t = v} delta_t for the distinct tokens u0 <= v < u1: rollout i's embedding gradient
    rows (Gram entry sum_v r_{i,v} . r_{j,v}).

    delta: [M, d] kept positions' output gradients; seg: [M] rollout; uid: [M] index of the token among the U distinct
    ones. Returns [N, u1 - u0, d] float64."""
    r = torch.zeros(n, u1 - u0, delta.shape[-1], dtype=torch.float64, device=delta.device)
    sel = ((uid >= u0) & (uid < u1)).nonzero().squeeze(1)
    r.index_put_((seg[sel], uid[sel] - u0), delta[sel].to(torch.float64), accumulate=True)
    return r


def embedding_scale(module: nn.Embedding, ids: Tensor, output: Tensor) -> float | None:
    """c in y = c W[tok] of an embedding module: 1 for a plain ``nn.Embedding``, ``embed_scale`` for a subclass that
    multiplies its lookup by it (Gemma's ``GemmaTextScaledWordEmbedding``), None for a subclass whose output is
    neither (its parameter is then reported uncovered). ids: [N, S] long; output: [N, S, d]."""
    if type(module).forward is nn.Embedding.forward:
        return 1.0
    scale = getattr(module, "embed_scale", 1.0)
    scale = float(scale.item()) if isinstance(scale, Tensor) else float(scale)
    with torch.no_grad():
        ref = torch.nn.functional.embedding(ids, module.weight, module.padding_idx) * scale
        ok = torch.allclose(output.detach().to(ref.dtype), ref, rtol=1e-3, atol=1e-6 * float(ref.abs().max()) + 1e-30)
    return scale if ok else None


def norm_rollout_grads(module: nn.Module, x: Tensor, delta: Tensor, attrs: Sequence[str]) -> dict[str, Tensor] | None:
    """Closed-form per-rollout gradients of a norm's weight and bias; None for a module of another kind.

    Every supported norm is y = xhat * a(w) + b with a(w) = w (RMSNorm, LayerNorm) or w + 1 (Nemotron's LayerNorm1P,
    Gemma's RMSNorm), so dy_c/dw_c = xhat_c and dy_c/db_c = 1: g_{i,w} = sum_t delta_t * xhat_t, g_{i,b} = sum_t
    delta_t. xhat is recomputed as transformers computes it: RMSNorm in float32 whatever the model's dtype
    (``x * rsqrt(mean(x^2) + eps)``), LayerNorm by ``layer_norm`` without the affine part.

    Args:
        x: [N, S, d] the norm's input.   delta: [N, S, d] its output gradient.   attrs: 'weight' and/or 'bias'.

    Returns:
        {attr: [N, d] float64} or None.
    """
    w = getattr(module, "weight", None)
    if w is None or w.dim() != 1 or x.shape[-1] != w.shape[0] or set(attrs) - {"weight", "bias"}:
        return None
    if isinstance(module, nn.LayerNorm):
        xhat = torch.nn.functional.layer_norm(x, module.normalized_shape, None, None, module.eps)
    elif type(module).__name__.endswith("RMSNorm"):
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None:
            return None
        h = x.to(torch.float32)
        xhat = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    else:
        return None
    n = x.shape[0]
    out = {}
    if "weight" in attrs:
        out["weight"] = (delta * xhat).sum(dim=1, dtype=torch.float64).reshape(n, -1)
    if "bias" in attrs:
        out["bias"] = delta.sum(dim=1, dtype=torch.float64).reshape(n, -1)
    return out


def vjp_rollout_grads(module: nn.Module, x: Tensor, delta: Tensor, attrs: Sequence[str]) -> dict[str, Tensor]:
    """{attr: [N, *shape]} per-rollout gradients of <module(x_i), delta_i> w.r.t. the module's own parameters: a
    vmapped vector-Jacobian product (a loop of vjps where vmap cannot batch the module). x: [N, ...]; delta: like the
    module's output."""
    params = {a: getattr(module, a).detach() for a in attrs}

    def score(p, xr, dr):
        return (functional_call(module, p, (xr.unsqueeze(0),)) * dr.unsqueeze(0)).sum()

    try:
        return vmap(func_grad(score), in_dims=(None, 0, 0))(params, x, delta)
    except Exception:  # a module vmap cannot batch: one vjp per rollout
        out: dict[str, list] = {a: [] for a in attrs}
        for i in range(x.shape[0]):
            with torch.enable_grad():
                p = {a: t.clone().requires_grad_(True) for a, t in params.items()}
                gs = torch.autograd.grad(score(p, x[i], delta[i]), list(p.values()), allow_unused=True)
            for a, g in zip(attrs, gs):
                out[a].append(torch.zeros_like(params[a]) if g is None else g)
        return {a: torch.stack(v) for a, v in out.items()}


def gram_factor(gram: Tensor) -> Tensor:
    """Rows V [N, N] float64 with V V^T = gram (eigendecomposition, negative rounding clipped): stand-in vectors for
    a function of the rows that depends only on their inner products (e.g. a baseline's trace variance)."""
    g = (gram.double() + gram.double().T) / 2
    vals, vecs = torch.linalg.eigh(g)
    return vecs * vals.clamp(min=0).sqrt()
