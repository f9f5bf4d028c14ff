"""The exact Gram from one backward equals dense exact autograd per-rollout gradients (float64, STYLE.md §9).

The oracle is :func:`grpo_lens.gradients.exact.exact_rollout_grads` (one forward + backward per rollout), then G G^T.
The error is max |Gram - Gram_exact| / max |Gram_exact|, on the whole matrix and on every parameter's own [N, N]
block. A wrong formula (a missing tied cross term, RMSNorm's xhat in float64 instead of float32, a dropped prompt
position, a tile summed once instead of with its transpose) is off by 1e-8 or more; float64 rounding is ~1e-15.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, NemotronConfig, Qwen2Config

from grpo_lens.gradients.exact import exact_rollout_grads
from grpo_lens.gradients.gram import GramCapture, exact_rollout_gram
from grpo_lens.gradients.gram_blocks import (
    choose_form,
    form_costs,
    gram_factor,
    gram_of_rows,
    shared_columns,
    shared_token_cost,
    shared_token_gram,
    token_pair_gram,
)
from grpo_lens.gradients.params import param_slices
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.rollout import RolloutBatch, batch_logprobs

pytestmark = pytest.mark.e2e  # builds tiny models

TOL = 1e-10
VOCAB = 101
TEMPERATURE = 0.7
SCORE_WEIGHTS = torch.tensor([0.3, 1.2, 0.7, 2.0, 0.5, 0.9], dtype=torch.float64)
ARCHS = ["llama_tied", "qwen2_bias", "nemotron", "nemotron_tied"]


def tiny_config(arch: str):
    """Tiny configs of the supported architectures (hidden 32, 2 layers)."""
    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    if arch == "llama_tied":  # tied embeddings; pad_token_id = 0 gives the embedding a padding_idx
        return LlamaConfig(**common, tie_word_embeddings=True, pad_token_id=0)
    if arch == "qwen2_bias":  # q/k/v biases, untied head
        return Qwen2Config(**common, tie_word_embeddings=False)
    if arch.startswith("nemotron"):  # LayerNorm1P (weight + bias), relu2 MLP, partial rotary
        return NemotronConfig(**common, head_dim=8, tie_word_embeddings=arch.endswith("tied"))
    raise KeyError(arch)


@functools.cache
def tiny_model(arch: str) -> nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).to(torch.float64).eval()
    with torch.no_grad():  # move every parameter off its init (norm weights 1, biases 0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def make_batch(seed: int = 0) -> RolloutBatch:
    """B = 2 prompts x R = 3: prompts of 5 and 9 tokens (left padded), completions of 7, 3, 1, 5, 0, 6 tokens (right
    padded, one empty), tokens from a small range so they repeat within and across rollouts, token 0 (= padding_idx
    of llama_tied) at real positions."""
    g = torch.Generator().manual_seed(seed)
    B, R, T = 2, 3, 7
    prompt_lens, comp_lens = [5, 9], [7, 3, 1, 5, 0, 6]
    Lp, N = max(prompt_lens), B * R
    prompt_ids = torch.zeros(N, Lp, dtype=torch.long)
    prompt_mask = torch.zeros(N, Lp, dtype=torch.long)
    for b in range(B):
        ids = torch.randint(0, 12, (prompt_lens[b],), generator=g)
        ids[1] = 0
        prompt_ids[b * R : (b + 1) * R, Lp - prompt_lens[b] :] = ids
        prompt_mask[b * R : (b + 1) * R, Lp - prompt_lens[b] :] = 1
    completion_ids = torch.zeros(N, T, dtype=torch.long)
    for i, c in enumerate(comp_lens):
        completion_ids[i, :c] = torch.randint(0, 15, (c,), generator=g)
    completion_mask = torch.arange(T)[None, :] < torch.tensor(comp_lens)[:, None]
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        sampler_logprobs=torch.zeros(N, T),
        truncated=torch.zeros(N, dtype=torch.bool),
        group_size=R,
    )


@functools.cache
def oracle(arch: str, weighted: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    grads = exact_rollout_grads(
        tiny_model(arch), make_batch(), score_weights=SCORE_WEIGHTS if weighted else None, temperature=TEMPERATURE
    ).double()
    return grads @ grads.T, {n: grads[:, s] @ grads[:, s].T for n, s in param_slices(tiny_model(arch)).items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)


def run(arch: str, form: str, blocked: bool, **extra):
    kw = dict(
        form=form, keep_param_grams=True, check_dropped=True, score_weights=SCORE_WEIGHTS, temperature=TEMPERATURE
    )
    if blocked:  # tiles shorter than one rollout and across rollout boundaries; rollout blocks < N; 3 rows a chunk
        kw.update(token_block=5, rollout_block=2, budget_bytes=6 * 64 * 8 * 3)
    kw.update(extra)
    return exact_rollout_gram(tiny_model(arch), make_batch(), **kw)


@pytest.mark.parametrize("form,blocked", [("token", True), ("rollout", True), ("auto", False)])
@pytest.mark.parametrize("arch", ARCHS)
def test_gram_equals_dense_oracle(arch, form, blocked):
    gram, info = run(arch, form, blocked)
    exact, per_param = oracle(arch)
    assert rel_err(gram, exact) < TOL
    assert set(info["param_grams"]) == set(per_param)  # every parameter, tied ones once
    worst = max((rel_err(info["param_grams"][n], e), n) for n, e in per_param.items() if float(e.abs().max()) > 0)
    assert worst[0] < TOL, worst
    assert info["max_dropped_delta"] == 0.0  # padding carries no gradient, so skipping it is exact
    if form != "auto":
        assert set(info["forms"].values()) == {form}
    # coverage: every parameter; the kinds' trace shares sum to 1; norms take the (self-checked) closed form
    assert info["coverage"] == 1.0 and info["uncovered"] == {} and info["unreached"] == 0
    assert abs(sum(info["trace_share"].values()) - 1.0) < 1e-12
    assert ("tied_embedding" in info["trace_share"]) == arch.endswith("tied")
    assert ("bias" in info["trace_share"]) == (arch == "qwen2_bias")
    assert info["norm_closed_form"] and all(info["norm_closed_form"].values())


def test_tied_cross_term_is_needed():
    """The cross term LE + LE^T of the tied matrix is a visible share of the trace on the tiny Llama (~0.5 %):
    a Gram without it would miss the oracle by ~1e-3, 10^7 times the tolerance."""
    _, info = run("llama_tied", "auto", False)
    cross = info["tied_terms_share"]["model.embed_tokens.weight/cross"]
    assert abs(cross) > 1e-4


def test_default_score_weights_and_row_weights():
    """omega_i = 1/|o_i| (the default) and row weights w (G1's Gram: w = A) give diag(w) Gram diag(w)."""
    exact, _ = oracle("llama_tied", False)
    w = torch.tensor([1.0, -0.5, 2.0, 0.0, 0.3, -1.0], dtype=torch.float64)
    gram, _ = exact_rollout_gram(tiny_model("llama_tied"), make_batch(), weights=w, temperature=TEMPERATURE)
    assert rel_err(gram, exact * w[:, None] * w[None, :]) < TOL


def test_capture_around_plain_backward():
    """GramCapture around a plain loss.backward() gives the same Gram, and .grad is still the summed gradient."""
    model, batch = tiny_model("qwen2_bias"), make_batch()
    exact, _ = oracle("qwen2_bias")
    model.zero_grad(set_to_none=True)
    with GramCapture(model) as cap:
        rollout_scores(batch_logprobs(model, batch, TEMPERATURE), batch.completion_mask, SCORE_WEIGHTS).sum().backward()
    gram, _ = cap.result()
    assert rel_err(gram, exact) < TOL
    summed = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    rows = exact_rollout_grads(model, batch, score_weights=SCORE_WEIGHTS, temperature=TEMPERATURE)
    assert torch.allclose(summed, rows.sum(0), rtol=1e-10, atol=1e-14)
    model.zero_grad(set_to_none=True)


def test_uncovered_parameter_is_reported():
    """A parameter no hook can attribute (of a non-leaf module) is listed, the coverage says so, and the Gram is exact
    over the covered parameters."""
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(tiny_config("llama_tied")).to(torch.float64).eval()
    mlp = model.model.layers[0].mlp
    mlp.extra = nn.Parameter(1 + 0.1 * torch.randn(32, dtype=torch.float64))
    forward = mlp.forward
    mlp.forward = lambda x: forward(x) * mlp.extra
    batch = make_batch()
    gram, info = exact_rollout_gram(model, batch)
    assert info["uncovered"] == {"model.layers.0.mlp.extra": "parameter of a non-leaf module"}
    total = sum(p.numel() for p in model.parameters())
    assert info["covered_params"] == total - 32 and info["coverage"] == (total - 32) / total
    grads = exact_rollout_grads(model, batch).double()
    cols = torch.cat(
        [torch.arange(s.start, s.stop) for n, s in param_slices(model).items() if n != "model.layers.0.mlp.extra"]
    )
    assert rel_err(gram, grads[:, cols] @ grads[:, cols].T) < TOL


def test_one_forward_per_capture():
    model, batch = tiny_model("llama_tied"), make_batch()
    with pytest.raises(NotImplementedError, match="one grad-enabled forward"):
        with GramCapture(model):
            for _ in range(2):
                model(input_ids=batch.input_ids(), attention_mask=batch.attention_mask())


def test_bfloat16_model_agrees_to_bf16_precision():
    """A bf16 model: activations and deltas are multiplied in float32; the Gram agrees with the bf16 oracle to bf16's
    own precision (the oracle's rows are bf16-rounded: ~1e-2 relative)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama_tied")).to(torch.bfloat16).eval()
    batch = make_batch()
    gram, info = exact_rollout_gram(model, batch)
    rows = exact_rollout_grads(model, batch).float().double()
    assert info["coverage"] == 1.0
    assert rel_err(gram, rows @ rows.T) < 5e-2


def test_pure_helpers():
    """gram_of_rows over slices equals f f^T; gram_factor's rows reproduce the Gram; the hybrid rule picks token pairs
    for few positions and wide outputs, per-rollout gradients for many positions and a square layer."""
    torch.manual_seed(0)
    f = torch.randn(3, 20, dtype=torch.float64)
    assert torch.allclose(gram_of_rows(f, slice_len=6), f @ f.T, rtol=1e-14, atol=1e-13)
    v = gram_factor(f @ f.T)
    assert torch.allclose(v @ v.T, f @ f.T, rtol=1e-12, atol=1e-12)
    # The costs (form_costs): token 1.3 (nt + 1) / (2 nt) M^2 (d_in + d_out + 2N + 64), rollout
    # d_in d_out (M + 50 N + N^2 / 3); with N = 8 the rollout's per-element overhead is 50 * 8 + 64 / 3 = 421.
    # M = 200, N = 8, d = 576 -> 49152 (the 135M LM head at 24 tokens), one tile:
    # token 1.3 * 200^2 * (576 + 49152 + 16 + 64) = 2.6e9 < rollout 576 * 49152 * (200 + 421) = 1.8e10
    assert choose_form(200, 8, 576, 49152, 1024) == "token"
    # M = 4416, 576 x 576 (a decoder layer at 512 tokens), 5 tiles cover 0.6 of the pairs:
    # token 1.3 * 0.6 * 4416^2 * 1232 = 1.9e10 > rollout 576^2 * (4416 + 421) = 1.6e9
    assert choose_form(4416, 8, 576, 576, 1024) == "rollout"
    # M = 512, 576 x 1536 (an MLP up projection at 64 tokens): token 1.3 * 512^2 * 2192 = 7.5e8 < rollout
    # 576 * 1536 * (512 + 421) = 8.3e8; a cost model without the 50 N term (576 * 1536 * (512 + 64) = 5.1e8 <
    # 262144 * 2192 = 5.7e8) picks rollout, the slower form there (docs/benchmarks.md §Gram forms)
    assert choose_form(512, 8, 576, 1536, 1024) == "token"
    token, rollout = form_costs([512], [8], 576, 1536, 1024, constants=(1.0, 0.0, 1.0))
    assert rollout < token  # the model without the 50 N term picks rollout
    # blocks: the costs add, so 4 blocks of 2 rollouts at M = 128 each price as 4 single blocks
    one = form_costs([128], [2], 576, 576, 1024)
    assert form_costs([128] * 4, [2] * 4, 576, 576, 1024) == pytest.approx(tuple(4 * c for c in one), rel=1e-12)


@pytest.mark.parametrize("form", ["token", "rollout", "auto"])
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2_bias", "nemotron"])
def test_block_diagonal_gram_equals_per_group_passes(arch, form):
    """Many groups from ONE backward (``blocks``): each [R, R] block equals the Gram of that group's own pass (the
    readable per-group reference), per parameter too, to 1e-10 in float64; entries across blocks are exactly 0 (never
    formed). Blocks of 1, 2 and 3 rows cut the two prompts' rollouts unevenly, and tiles (token_block=5) straddle
    rollouts. A wrong block mask ([2, 4] instead of [1, 2, 3]) puts rows 1 and 2 in different blocks and loses their
    cross term <g_1, g_2>: the comparison fails, so the test can fail."""
    model, batch = tiny_model(arch), make_batch()
    kw = dict(form=form, keep_param_grams=True, temperature=TEMPERATURE, token_block=5)
    blocks = [1, 2, 3]
    gram, info = exact_rollout_gram(model, batch, score_weights=SCORE_WEIGHTS, blocks=blocks, **kw)
    r0 = 0
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for b in blocks:
        rows = torch.arange(r0, r0 + b)
        ref, ref_info = exact_rollout_gram(model, batch.select(rows), score_weights=SCORE_WEIGHTS[rows], **kw)
        assert rel_err(gram[r0 : r0 + b, r0 : r0 + b], ref) < TOL
        for name, g in ref_info["param_grams"].items():
            if float(g.abs().max()) > 0:
                assert rel_err(info["param_grams"][name][r0 : r0 + b, r0 : r0 + b], g) < TOL, name
        mask[r0 : r0 + b, r0 : r0 + b] = True
        r0 += b
    assert float(gram[~mask].abs().max()) == 0.0  # cross-block entries are not formed
    # the full Gram's blocks are the same numbers (rows never interact), so the block mask only saves work
    full, _ = exact_rollout_gram(model, batch, score_weights=SCORE_WEIGHTS, **kw)
    assert rel_err(gram, full * mask) < TOL
    wrong, _ = exact_rollout_gram(model, batch, score_weights=SCORE_WEIGHTS, blocks=[2, 4], **kw)
    assert rel_err(wrong[1:3, 1:3], gram[1:3, 1:3]) > 1e-3  # <g_1, g_2> not formed: 0 in the wrong mask
    with pytest.raises(ValueError, match="summing"):
        exact_rollout_gram(model, batch, blocks=[2, 2], **kw)


def test_shared_columns_pair_each_shared_input_once():
    """shared_token_gram (a group's prompt paired once) equals the token-pair form to float64 rounding, with a left
    padded block, rows of different lengths, tiles that cut rows and kernels reused from a cache by a second layer
    reading the same input. Equality of inputs is checked, not assumed: one ulp in one row unshares that column, and a
    column declared shared where the rows differ gives another Gram (so the comparison can fail)."""
    g = torch.Generator().manual_seed(3)
    n, length, d_in, d_out = 5, 17, 6, 4
    x = torch.randn(n, length, d_in, dtype=torch.float64, generator=g)
    x[:, 2:9] = x[0, 2:9]  # the prompt: columns 2-8 the same in every row
    x[:, 9] = x[0, 9]  # and a completion's first token every row drew alike
    keep = torch.ones(n, length, dtype=torch.bool)
    keep[:, :2] = False  # left padding
    keep[1, 12:], keep[3, 10:] = False, False  # shorter completions
    shared = shared_columns(x, keep)
    assert shared.nonzero().flatten().tolist() == list(range(2, 10))
    cache: dict = {}
    for _layer in range(2):  # the second layer reads the first one's cached kernels
        delta = torch.randn(n, length, d_out, dtype=torch.float64, generator=g)
        reference = token_pair_gram(x, delta, keep, 4)
        assert rel_err(shared_token_gram(x, delta, keep, shared, 4, cache), reference) < 1e-13
        assert rel_err(token_pair_gram(x, delta, keep, 4, spans=[(0, n)], shared=[shared]), reference) < 1e-13
    assert {"k_ss", "k_so", "own"} <= set(cache)
    bumped = x.clone()
    bumped[2, 4, 1] = torch.nextafter(bumped[2, 4, 1], torch.tensor(1.0, dtype=torch.float64))
    assert not bool(shared_columns(bumped, keep)[4]) and int(shared_columns(bumped, keep).sum()) == 7
    different = x.clone()
    different[2, 4] += 0.5
    wrong = shared_token_gram(different, delta, keep, shared, 4)  # column 4 declared shared, but row 2 differs
    assert rel_err(wrong, token_pair_gram(different, delta, keep, 4)) > 1e-3
    assert not bool(shared_columns(x[:1], keep[:1]).any())  # one row shares nothing


def test_shared_columns_lower_the_token_forms_price():
    """shared_token_cost with s shared columns per block: own positions M_o = M - n s paired as tokens, plus
    1.3 ((s^2 + s M_o) d_in + n s (s + n + M_o) d_out) and 50 (M_o + n s) d_out for the gathered gradients;
    form_costs' token price is the lower of that and the plain token pairs'."""
    assert form_costs([488], [8], 576, 576, 1024, shared=[0]) == form_costs([488], [8], 576, 576, 1024)
    token, rollout = form_costs([488], [8], 576, 576, 1024, shared=[45])
    # a group of 8 rollouts, a 45-token prompt and 16 completion tokens each (M = 8 * 61 = 488, M_o = 128):
    # 1.3 (128^2 (576 + 576 + 16 + 64) + (45^2 + 45 * 128) 576 + 8 * 45 (45 + 8 + 128) 576) + 50 * 488 * 576
    # = 5.16e7 + 1.41e7 = 6.6e7
    expected = 1.3 * (128**2 * 1232 + (45**2 + 45 * 128) * 576 + 8 * 45 * 181 * 576) + 50 * 488 * 576
    assert token == pytest.approx(expected, rel=1e-12)
    assert shared_token_cost([488], [8], [45], 576, 576, 1024) == pytest.approx(expected, rel=1e-12)
    # unshared the same group prices 1.3 * 488^2 * 1232 = 3.8e8 > rollout 576^2 (488 + 421) = 3.0e8
    plain_token, _ = form_costs([488], [8], 576, 576, 1024)
    assert plain_token > rollout > token
    # the LM head (d_out 49152, 25 kept columns of which the prompt's last one is shared, M = 8 * 16 = 128):
    # sharing saves 1.3 (128^2 - 120^2) (576 + 49152 + 80) = 1.3e8 of pairs but copies 50 * 128 * 49152 = 3.1e8
    # more gradient entries, so the plain pairs stay
    head_plain = form_costs([128], [8], 576, 49152, 1024)[0]
    assert shared_token_cost([128], [8], [1], 576, 49152, 1024) > head_plain
    assert form_costs([128], [8], 576, 49152, 1024, shared=[1])[0] == head_plain


@pytest.mark.parametrize("arch", ARCHS)
def test_groups_sharing_a_prompt_give_the_dense_oracles_blocks(arch):
    """Blocks = the two groups, each of whose 3 rows runs the same prompt: every linear layer's token form but the LM
    head's pairs the prompt's positions once (info["shared_layers"]; the head keeps only completion positions and the
    prompt's last one, too few to pay for the copy, shared_token_cost) and each group's [3, 3] block equals the dense
    oracle's to 1e-10 in float64, per parameter too."""
    gram, info = run(arch, "token", False, blocks=[3, 3])
    exact, per_param = oracle(arch)
    assert info["shared_layers"] == len(info["forms"]) - 1 > 0
    for r0 in (0, 3):
        block = slice(r0, r0 + 3)
        assert rel_err(gram[block, block], exact[block, block]) < TOL
        for name, e in per_param.items():
            if float(e[block, block].abs().max()) > 0:
                assert rel_err(info["param_grams"][name][block, block], e[block, block]) < TOL, name
