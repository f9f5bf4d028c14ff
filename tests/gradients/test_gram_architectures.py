"""Every supported family's exact Gram, identity sketch and G2 against the dense oracle (float64, STYLE.md §9).

Families: tests/architectures.py (Llama, Qwen2, GPT-2, Mistral, Phi-3, Gemma, Nemotron; 2 layers, hidden 32). The
oracle is :func:`grpo_lens.gradients.exact.exact_rollout_grads`, one forward + backward per rollout. Error: max |Gram
- Gram_oracle| / max |Gram_oracle|, whole matrix and per parameter; float64 rounding gives ~1e-15, while a wrong
formula is off by far more than the 1e-10 tolerance: GPT-2's Conv1D read as [d_out, d_in] fails to run or mixes
rows and columns (~1), Gemma's embedding without its sqrt(32) = 5.7 scale misses 0.48 of the Gram (measured).
"""

from __future__ import annotations

import functools

import pytest
import torch
from architectures import FAMILIES, family_model
from test_gram import make_batch, rel_err
from torch import nn
from transformers.pytorch_utils import Conv1D

from grpo_lens.gradients.exact import exact_rollout_grads, layer_weight_grads
from grpo_lens.gradients.g2 import G2WeightingCapture, module_kind
from grpo_lens.gradients.gram import exact_rollout_gram
from grpo_lens.gradients.params import (
    is_linear,
    layer_pattern,
    linear_coverage,
    linear_layer_names,
    linear_shape,
    no_linear_layer_message,
    param_slices,
    select_layers,
)
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.gradients.sketch import GradientCapture, sketch_rollout_grads
from grpo_lens.rollout import batch_logprobs

TOL = 1e-10
VOCAB = 101  # make_batch's tokens are < 15
TEMPERATURE = 0.7
SCORE_WEIGHTS = torch.tensor([0.3, 1.2, 0.7, 2.0, 0.5, 0.9], dtype=torch.float64)


@functools.cache
def model_of(family: str) -> nn.Module:
    return family_model(family, VOCAB, dtype=torch.float64)


@functools.cache
def oracle(family: str) -> torch.Tensor:
    """[N, P] float64 dense per-rollout gradients (columns: param_slices)."""
    return exact_rollout_grads(
        model_of(family), make_batch(), score_weights=SCORE_WEIGHTS, temperature=TEMPERATURE
    ).double()


def tied_layers(model: nn.Module) -> set[str]:
    """Linear layers whose weight another module also uses (the tied LM head)."""
    users: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    modules = dict(model.named_modules())
    return {n for n in linear_layer_names(model) if users[id(modules[n].weight)] > 1}


@pytest.mark.e2e
@pytest.mark.parametrize("family", FAMILIES)
def test_gram_equals_dense_oracle(family):
    model, grads = model_of(family), oracle(family)
    # token pairs over 5-position tiles crossing rollouts, then per-rollout G_i in 2-rollout blocks of 3 rows
    for kw in (
        {"form": "token", "token_block": 5},
        {"form": "rollout", "rollout_block": 2, "budget_bytes": 6 * 64 * 8 * 3},
    ):
        gram, info = exact_rollout_gram(
            model,
            make_batch(),
            score_weights=SCORE_WEIGHTS,
            temperature=TEMPERATURE,
            keep_param_grams=True,
            check_dropped=True,
            **kw,
        )
        assert rel_err(gram, grads @ grads.T) < TOL, kw
        for name, s in param_slices(model).items():
            want = grads[:, s] @ grads[:, s].T
            if float(want.abs().max()) > 0:
                assert rel_err(info["param_grams"][name], want) < TOL, (kw, name)
        assert info["coverage"] == 1.0 and info["uncovered"] == {} and info["max_dropped_delta"] == 0.0
        # every linear layer (GPT-2's Conv1D included) takes the ghost-norm hooks, not the generic vjp fallback
        assert set(info["forms"]) == set(linear_layer_names(model)) and set(info["forms"].values()) == {kw["form"]}
        assert "linear" in info["trace_share"] and "Conv1D" not in info["norm_closed_form"]
    if family == "gpt2":
        assert sum(isinstance(m, Conv1D) for m in model.modules()) == 8  # c_attn, c_proj, c_fc, mlp.c_proj x 2


@pytest.mark.e2e
@pytest.mark.parametrize("family", FAMILIES)
def test_identity_sketch_rows_are_the_weight_gradients(family):
    """The identity "sketch" of each linear layer is its exact per-rollout weight gradient in the weight's own layout
    ([d_in, d_out] for a Conv1D), so the probe's G1_layer and G2 rows read any family; a Gaussian sketch has
    sketch_out * sketch_in columns per layer whatever the layout."""
    model, grads = model_of(family), oracle(family)
    tied = tied_layers(model)  # the sketch sees the LM use of a tied matrix only
    names = [n for n in linear_layer_names(model) if n not in tied]
    sk = sketch_rollout_grads(
        model,
        make_batch(),
        projection="identity",
        dtype=torch.float64,
        include=names,
        score_weights=SCORE_WEIGHTS,
        temperature=TEMPERATURE,
    )
    slices = param_slices(model)
    for name in names:
        assert rel_err(sk.per_layer[name], grads[:, slices[name + ".weight"]]) < TOL, name
    gauss = sketch_rollout_grads(model, make_batch(), sketch_in=3, sketch_out=5, include=names, temperature=TEMPERATURE)
    assert {t.shape[1] for t in gauss.per_layer.values()} == {15}


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["gpt2", "phi3"])
def test_g2_capture_matches_the_weight_gradients(family):
    """Stable rank ||G2(w)||_F^2 / s_1^2 per layer kind from the capture's kernels against autograd's weight gradients
    (transposed for a Conv1D: the same singular values); rel 1e-3 as for Llama in tests/train (float32 kernels,
    subspace iteration). With ``include`` only the kept layers are hooked."""
    model, batch = model_of(family), make_batch()
    w = torch.tensor([1.0, -0.5, 2.0, 0.0, 0.3, -1.0], dtype=torch.float64)
    cap = G2WeightingCapture(model, {"adv": w})
    with cap:
        loss = rollout_scores(batch_logprobs(model, batch, TEMPERATURE), batch.completion_mask).sum()
        torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    got = cap.result()
    per_kind: dict[str, list[float]] = {}
    tied = tied_layers(model)  # autograd's gradient of GPT-2's tied head has the embedding use too; G2 the LM use
    for layer, g2 in layer_weight_grads(model, batch, w, temperature=TEMPERATURE).items():
        s = torch.linalg.svdvals(g2)
        per_kind.setdefault(module_kind(layer), []).append(float(s.square().sum() / s[0] ** 2))
    assert set(got) == {f"rank/g2_adv_{k}_stable_rank" for k in per_kind}
    for kind, vals in per_kind.items():
        if kind in {module_kind(n) for n in tied}:
            continue
        assert got[f"rank/g2_adv_{kind}_stable_rank"] == pytest.approx(sum(vals) / len(vals), rel=1e-3), kind
    if family == "gpt2":  # attention output and MLP down projection are both c_proj: two kinds
        assert {"rank/g2_adv_attn_c_proj_stable_rank", "rank/g2_adv_mlp_c_proj_stable_rank"} <= set(got)
    kept = G2WeightingCapture(model, {"adv": w}, include=layer_pattern("*.1.mlp.*"))
    assert list(kept.layers) == [n for n in linear_layer_names(model) if ".1.mlp." in n] and kept.layers


# ---------------------------------------------------------------------------------------------------------------------
# Layer enumeration, --layers patterns and the coverage message (plain modules: no model build)
# ---------------------------------------------------------------------------------------------------------------------
class Toy(nn.Module):
    """An embedding (6 x 4 = 24), a Conv1D 4 -> 3 (weight [4, 3] = 12, bias 3), a Linear 3 -> 2 (6, no bias)."""

    def __init__(self, linear: bool = True):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.block = nn.ModuleDict({"c_fc": Conv1D(3, 4), "down": nn.Linear(3, 2, bias=False)}) if linear else None
        self.scale = nn.Parameter(torch.ones(4))


def test_linear_layers_include_conv1d():
    toy = Toy()
    assert linear_layer_names(toy) == ["block.c_fc", "block.down"]
    assert is_linear(toy.block["c_fc"]) and not is_linear(toy.emb)
    # (d_out, d_in) whatever the layout: Conv1D(nf=3, nx=4) holds [4, 3], Linear(3, 2) holds [2, 3]
    assert linear_shape(toy.block["c_fc"]) == (3, 4) and linear_shape(toy.block["down"]) == (2, 3)
    # linear weights 12 + 6 of 24 + 12 + 3 + 6 + 4 = 49 parameters
    share, other = linear_coverage(toy)
    assert share == pytest.approx(18 / 49) and other == {"Embedding": 24, "Toy": 4, "Conv1D": 3}


def test_layer_patterns_glob_or_regex():
    toy = Toy()
    assert select_layers(toy, None) == ["block.c_fc", "block.down"]
    assert select_layers(toy, "*.down") == ["block.down"]  # glob over the whole name (no valid regex)
    assert select_layers(toy, "c_fc|down") == ["block.c_fc", "block.down"]  # regex searched in the name
    assert select_layers(toy, "block.c_?c") == ["block.c_fc"]  # both readings agree
    with pytest.raises(
        ValueError,
        match=r"--layers 'attn' matches no linear layer .* include block\.c_fc, "
        r"block\.down",
    ):
        select_layers(toy, "attn")


def test_no_linear_layer_is_one_line_naming_classes_and_coverage():
    msg = no_linear_layer_message(Toy(linear=False))
    # 24 embedding + 4 of Toy's own: no linear weight, 0 % covered
    assert msg == (
        "the model has no linear layer (nn.Linear or transformers Conv1D) to probe: its parameters are in "
        "Embedding (24), Toy (4); linear layers cover 0.0% of its 28 trainable parameters"
    )
    with pytest.raises(ValueError, match="no linear layer .* to sketch: .* Embedding"):
        GradientCapture(Toy(linear=False))
