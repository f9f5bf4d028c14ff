"""Token credit: signed contributions to the group update (against per-token autograd), classes, position
profiles, and Monte Carlo segment advantages (closed forms and the tiny model)."""

import math

import pytest
import torch

from grpo_lens.formulas.credit import (
    class_shares,
    compare_with_uniform,
    exact_directional_derivatives,
    relative_position_profile,
    segment_advantages,
    segment_boundaries,
    signed_contributions,
    token_classes,
    token_weights,
)
from grpo_lens.gradients.token_credit import (
    prefix_values,
    prefix_values_many,
    signed_token_contributions,
    token_directional_derivatives,
)
from grpo_lens.rollout import batch_logprobs, sample_groups


@pytest.fixture(scope="module")
def model_group():
    from grpo_lens.models import build_tiny_model

    model, tok = build_tiny_model(seed=0)
    model = model.double()
    group = sample_groups(model, tok, ["What is 2 + 3?"], 3, max_new_tokens=6, temperature=1.0, generator_seed=0)
    return model, tok, group


@pytest.mark.e2e
def test_directional_derivatives_equal_per_token_autograd(model_group):
    model, _, group = model_group
    params = [p for p in model.parameters()]
    g = torch.Generator().manual_seed(0)
    v = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    got = token_directional_derivatives(model, group, v, params, step=1e-1)
    logp = batch_logprobs(model, group)
    mask = group.completion_mask
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            grads = torch.autograd.grad(logp[i, t], params, retain_graph=True, allow_unused=True)
            want = sum(float((gr * vv).sum()) for gr, vv in zip(grads, v) if gr is not None)
            # Richardson: O(e^4) truncation, plus the float32 inside LlamaRMSNorm even in a float64 model (relative
            # round-off ~1e-7 per forward, / e = 3e-4 (e = 0.1 / ||v||): ~3e-4); a plain central difference at this
            # step is 1% off, a wrong formula by far more
            assert got[i, t].item() == pytest.approx(want, rel=2e-3, abs=2e-3), (i, t)
    before = [p.detach().clone() for p in params]
    token_directional_derivatives(model, group, v, params)
    assert all(torch.equal(a, p) for a, p in zip(before, params))  # restored bit for bit


@pytest.mark.e2e
def test_contributions_sum_to_one_and_follow_the_weights(model_group):
    model, _, group = model_group
    adv = torch.tensor([1.0, -0.5, -0.5])
    out = signed_token_contributions(model, group, adv, step=1e-2)
    # sum_{i,t} w_{i,t} grad log pi_{i,t} = u, so sum s = <u, u> / ||u||^2 = 1 (closure up to the difference error)
    assert abs(out["closure"]) < 1e-3
    s, w = out["contributions"], out["weights"]
    assert (s[~group.completion_mask] == 0).all()
    # w_{i,t} = A_i / |o_i| under seq-mean-token-mean
    lengths = group.completion_mask.sum(-1).double()
    torch.testing.assert_close(w[:, 0], adv.double() / lengths)
    zero = signed_token_contributions(model, group, torch.zeros(3))
    assert zero["update_norm"] == 0.0 and math.isnan(zero["closure"])
    assert token_weights(adv, group.completion_mask, "token-mean")[0, 0].item() == 1.0  # A_i c_i/|o_i| = A_i


@pytest.mark.e2e
def test_contributions_from_per_token_gradients_equal_the_model_path(model_group):
    """The planted path (explicit per-token gradient vectors g_{i,t} in R^P through
    exact_directional_derivatives, then signed_contributions) gives the model path's shares (finite differences along
    the exact u), under GRPO advantages and under NLL weights."""
    model, _, group = model_group
    params = [p for p in model.parameters() if p.requires_grad]
    logp = batch_logprobs(model, group)
    mask = group.completion_mask
    r, t = logp.shape
    grads = torch.zeros(r, t, sum(p.numel() for p in params), dtype=torch.float64)  # [R, T, P]
    for i in range(r):
        for j in range(t):
            if mask[i, j]:
                gs = torch.autograd.grad(logp[i, j], params, retain_graph=True, allow_unused=True)
                grads[i, j] = torch.cat(
                    [(torch.zeros_like(p) if g is None else g).reshape(-1).double() for g, p in zip(gs, params)]
                )
    for adv in (torch.tensor([1.0, -0.5, -0.5]), torch.ones(3)):
        w = token_weights(adv, mask)
        d, u_sq = exact_directional_derivatives(grads, w)
        planted = signed_contributions(w, d, u_sq)
        model_path = signed_token_contributions(model, group, adv, step=1e-2)
        # both exact, up to the float32 inside RMSNorm
        assert planted["update_norm"] == pytest.approx(model_path["update_norm"], rel=1e-6)
        assert abs(planted["closure"]) < 1e-12  # sum s = <u, u> / ||u||^2 exactly with explicit gradients
        # the model path's shares carry the finite differences' O(e^4) + round-off error (closure < 1e-3 above); a
        # share computed with the wrong u or without the weight w would be off by O(1)
        torch.testing.assert_close(model_path["contributions"], planted["contributions"], rtol=0, atol=2e-3)
    assert math.isnan(signed_contributions(w, d, 0.0)["closure"])


def test_relative_position_profile_closed_form():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    # 2 bins: row 0 has t/4 -> bins 0,0,1,1; row 1 t/2 -> bins 0,1. Bin 0: 1+2+10, bin 1: 3+4+20
    assert relative_position_profile(values, mask, bins=2).tolist() == [13.0, 27.0]


def test_token_classes_and_shares():
    from grpo_lens.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    ids = torch.tensor([tok.encode("ab 12.", add_special_tokens=False) + [tok.eos_token_id, tok.pad_token_id]])
    mask = torch.tensor([[True] * 7 + [False]])
    classes = token_classes(tok, ids, mask)
    # a b -> reasoning (2); ' ' '.' EOS -> format (1); '1' '2' -> the last number: answer (0); padding -1
    assert classes.tolist() == [[2, 2, 1, 0, 0, 1, 1, -1]]
    s = torch.tensor([[0.1, 0.1, 0.0, 0.3, 0.3, 0.1, 0.1, 0.0]])
    shares = class_shares(s, classes)
    assert shares["answer"]["update_share"] == pytest.approx(0.6)
    assert shares["answer"]["token_share"] == pytest.approx(2 / 7)
    assert shares["answer"]["ratio"] == pytest.approx(0.6 * 7 / 2)
    assert shares["format"]["update_share"] == pytest.approx(0.2)


def test_segment_advantages_telescope_and_compare():
    assert segment_boundaries(10, 4) == [0, 2, 5, 8, 10] or segment_boundaries(10, 4) == [0, 3, 5, 8, 10]
    assert segment_boundaries(2, 4) == [0, 1, 2]
    values, errors = torch.tensor([0.5, 0.25, 0.75]), torch.tensor([0.1, 0.1, 0.1])
    adv, se = segment_advantages(values, errors, final_reward=1.0)
    assert adv.tolist() == [-0.25, 0.5, 0.25]
    assert float(adv.sum()) == pytest.approx(1.0 - 0.5)  # r - V(q)
    assert se.tolist() == pytest.approx([math.sqrt(0.02), math.sqrt(0.02), 0.1])
    # GRPO's A_i > 0: segment 0 goes the other way but within 2 SE (0.25 < 2 * 0.141): neutral; segment 1 agrees
    # (0.5 > 0.28); segment 2 is within noise (0.25 > 0.2 -> agrees)
    cmp = compare_with_uniform(adv, se, [2, 3, 5], grpo_advantage=0.7)
    assert cmp["neutral"] == pytest.approx(0.2) and cmp["agree"] == pytest.approx(0.8)
    assert cmp["disagree"] == 0.0 and cmp["top_segment_share"] == pytest.approx(0.5)
    flipped = compare_with_uniform(torch.tensor([-0.6, 0.1]), torch.tensor([0.1, 0.1]), [1, 1], grpo_advantage=0.7)
    assert flipped["disagree"] == 0.5


@pytest.mark.e2e
def test_prefix_values_on_the_tiny_model(model_group):
    model, tok, group = model_group
    prompt = group.prompt_ids[0][group.prompt_mask[0].bool()]
    completion = group.completion_ids[0][group.completion_mask[0]]
    # score 1 for every continuation: V = 1 with zero standard error at every prefix
    v, e = prefix_values(
        model, tok, prompt, completion, [0, 2], lambda texts: [1.0] * len(texts), num_samples=4, max_new_tokens=6
    )
    assert v.tolist() == [1.0, 1.0] and e.tolist() == [0.0, 0.0]
    # a score that reads the text: continuations start with the rollout's own first 2 tokens when b = 2
    head = tok.decode(completion[:2].tolist(), skip_special_tokens=True)
    v, _ = prefix_values(
        model,
        tok,
        prompt,
        completion,
        [2],
        lambda texts: [float(t.startswith(head)) for t in texts],
        num_samples=4,
        max_new_tokens=6,
    )
    assert v.tolist() == [1.0]


class _IdsTokenizer:
    """The tiny tokenizer, decoding to the token ids themselves ("5 17 3"): the test can count what was sampled."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


@pytest.mark.e2e
def test_prefix_values_many_cuts_each_prefix_at_its_own_budget(model_group):
    # Two rollouts' prefixes in one generate call: b = 0 gets 6 new tokens, b = 3 the remaining 6 - 3 = 3, each
    # completion (prefix + continuation) at most max_new_tokens = 6 tokens; a row not cut at its budget would read
    # 3 + 6 = 9 ids, one cut at the smallest budget would never reach 6 ids at b = 0.
    model, tok, group = model_group
    prompt = group.prompt_ids[0][group.prompt_mask[0].bool()]
    completions = [group.completion_ids[i][group.completion_mask[i]] for i in (0, 1)]
    seen: list[list[int]] = []

    def score(texts):
        seen.extend([int(x) for x in t.split()] for t in texts)
        return [1.0] * len(texts)

    out = prefix_values_many(
        model, _IdsTokenizer(tok), prompt, completions, [[0, 3], [3]], score, num_samples=4, max_new_tokens=6, seed=1
    )
    assert [v.tolist() for v, _ in out] == [[1.0, 1.0], [1.0]]
    assert len(seen) == 3 * 4  # one score call, prefixes in order: (0, b=0), (0, b=3), (1, b=3), K = 4 rows each
    assert all(len(ids) <= 6 for ids in seen)
    for n in range(4, 8):
        assert seen[n][:3] == completions[0][:3].tolist()
    for n in range(8, 12):
        assert seen[n][:3] == completions[1][:3].tolist()
    # the b = 0 rows ran their whole budget unless they met EOS
    assert any(len(ids) == 6 for ids in seen[:4])  # seed 1: no b = 0 row meets EOS before its budget
    with pytest.raises(ValueError, match="boundary 6 outside"):
        prefix_values_many(model, tok, prompt, completions[:1], [[6]], score, num_samples=2, max_new_tokens=6)


@pytest.mark.e2e
def test_prefix_values_many_keeps_each_rollouts_prompt_and_score(model_group):
    # Rollouts of two prompts (the second prompt is the first one's tokens reversed) in calls of max_rows = 8 rows
    # (two prefixes of K = 4 per call, three calls): each rollout's K continuations reach its own score (1 for the
    # first, 0 for the second), so the values are exactly [1, 1] and [0]; a mixed-up row or score would break them.
    model, tok, group = model_group
    prompt = group.prompt_ids[0][group.prompt_mask[0].bool()]
    completions = [group.completion_ids[i][group.completion_mask[i]] for i in (0, 1)]
    calls = []

    def constant(value):
        def score(texts):
            calls.append(len(texts))
            return [value] * len(texts)

        return score

    out = prefix_values_many(
        model,
        tok,
        [prompt, prompt.flip(0)],
        completions,
        [[0, 2], [1]],
        [constant(1.0), constant(0.0)],
        num_samples=4,
        max_new_tokens=6,
        max_rows=8,
    )
    assert [v.tolist() for v, _ in out] == [[1.0, 1.0], [0.0]]
    assert calls == [8, 4]  # one score call per rollout: 2 prefixes x K, 1 prefix x K
    with pytest.raises(ValueError, match="max_rows = 3"):
        prefix_values_many(
            model, tok, prompt, completions[:1], [[0]], constant(1.0), num_samples=4, max_new_tokens=6, max_rows=3
        )


@pytest.mark.e2e
def test_shared_prefill_gives_the_k_prefills_continuations(model_group, monkeypatch):
    # Each prefix's KV cache computed once and repeated K_mc times holds the keys and values of K_mc identical
    # prefills (float64 model: the same sums), so the same seed samples the same tokens; prefixes of different
    # lengths (left padding: b = 0, 2, 4) check the positions. The shared path must run its own prefill (one forward
    # of the 3 unique prefixes, not 12 rows), or the test would compare the reference with itself.
    from grpo_lens.gradients import token_credit

    model, tok, group = model_group
    prompt = group.prompt_ids[0][group.prompt_mask[0].bool()]
    completion = group.completion_ids[0][group.completion_mask[0]]
    prefixes = [(0, b, torch.cat([prompt, completion[:b]])) for b in (0, 2, 4)]
    rows = []
    original = token_credit.shared_prefill
    monkeypatch.setattr(
        token_credit, "shared_prefill", lambda m, ids, *a: rows.append(ids.shape[0]) or original(m, ids, *a)
    )
    args = (model, tok, prefixes, 4, 6, 1.0, 0, 1.0, 7)
    shared = token_credit._continue_prefixes(*args, share_prefill=True)
    reference = token_credit._continue_prefixes(*args, share_prefill=False)
    assert rows == [3]
    assert shared == reference
    assert len({tuple(r) for p in shared for r in p}) > 1  # the rows are samples, not one repeated continuation
