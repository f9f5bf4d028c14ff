"""Token credit: per-token advantages, position alignment, profiles, answer shares and answer masks."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lens.formulas.credit import (
    answer_mask_from_char_span,
    answer_mask_from_tokenizer,
    answer_share,
    completion_positions,
    credit_metrics,
    decode_offsets,
    last_number_span,
    position_profile,
    token_advantages,
    within_rollout_advantage_variance,
)
from grpo_lens.gradients.sketch import token_grad_sq_norms
from grpo_lens.rollout import RolloutBatch


class PieceTokenizer:
    """A tokenizer stand-in: token id j decodes to PIECES[j]; id 0 is a special token (skipped)."""

    PIECES = ["<eos>", "The", " answer", " is", " 4", "2", ".", " -", "7", ",", "000"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0))


def test_output_only_reward_gives_zero_within_rollout_variance():
    adv = torch.tensor([1.5, -0.5, 0.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    tok = token_advantages(adv, mask)
    torch.testing.assert_close(tok, torch.tensor([[1.5, 1.5, 1.5, 0.0], [-0.5, -0.5, 0, 0], [0.0, 0, 0, 0]]))
    assert within_rollout_advantage_variance(tok, mask).abs().max() == 0  # exactly 0 by construction
    # a per-token advantage that varies does show up: (1, 2, 3) has population variance 2/3
    ramp = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    var = within_rollout_advantage_variance(ramp, torch.tensor([[1, 1, 1, 0]], dtype=torch.bool))
    torch.testing.assert_close(var, torch.tensor([2 / 3]))


def test_alignment_profile_and_answer_share_closed_form():
    # Input positions 0..5 with Lp = 2: token t is scored at position Lp - 1 + t = 1 + t -> positions 1..4.
    per_position = torch.arange(6.0).repeat(2, 1)
    torch.testing.assert_close(completion_positions(per_position, 2), torch.tensor([[1.0, 2, 3, 4]] * 2))
    n = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    # profile: position 0 -> (1 + 5)/2, 1 -> (2 + 6)/2, 2 -> 3 (only row 0), 3 -> 4
    torch.testing.assert_close(position_profile(n, mask), torch.tensor([3.0, 4.0, 3.0, 4.0], dtype=torch.float64))
    answer = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    # row 0: (3 + 4) / 10; row 1: 6 / (5 + 6) (its positions 2, 3 are outside the completion)
    torch.testing.assert_close(answer_share(n, answer, mask), torch.tensor([0.7, 6 / 11], dtype=torch.float64))
    metrics = credit_metrics(token_advantages(torch.tensor([1.0, -1.0]), mask), n, mask, answer)
    assert metrics == {
        "credit/adv_var_within_max": 0.0,
        "credit/answer_share_mean": pytest.approx((0.7 + 6 / 11) / 2),
        "credit/answer_token_frac": pytest.approx(3 / 6),
    }


def test_last_number_span():
    text = "So 3 apples, total 1,234.5 dollars."
    assert text[slice(*last_number_span(text))] == "1,234.5"
    assert last_number_span("pay -7, then") == (4, 6)
    assert last_number_span("no digits here") is None


def test_answer_mask_from_tokenizer_and_char_span():
    tok = PieceTokenizer()
    # "The answer is 42." + <eos> + padding -> the last number "42" is tokens " 4", "2" (indices 3, 4)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 0, 0], [1, 7, 8, 9, 10, 0, 0, 0], [1, 2, 6, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[1] * 7 + [0], [1] * 6 + [0] * 2, [1] * 4 + [0] * 4], dtype=torch.bool)
    got = answer_mask_from_tokenizer(tok, ids, mask)
    assert got[0].nonzero().flatten().tolist() == [3, 4]
    # " -7,000": regex takes "-7,000" -> tokens " -", "7", ",", "000"
    assert got[1].nonzero().flatten().tolist() == [1, 2, 3, 4]
    assert not got[2].any()  # no number
    text, offsets = decode_offsets(tok, [1, 2, 0, 3])
    assert text == "The answer is" and offsets == [(0, 3), (3, 10), (10, 10), (10, 13)]
    assert answer_mask_from_char_span(offsets, (4, 8), length=6).tolist() == [False, True, False, False, False, False]


@pytest.mark.e2e
def test_real_token_norms_share_sums_to_one():
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    n, lp, t = 4, 3, 5
    mask = torch.arange(t) < torch.tensor([[5], [4], [3], [5]])
    batch = RolloutBatch(
        torch.randint(1, 50, (n, lp), generator=g),
        torch.ones(n, lp, dtype=torch.long),
        torch.randint(1, 50, (n, t), generator=g),
        mask,
        torch.zeros(n, t),
        torch.zeros(n, dtype=torch.bool),
        2,
    )
    per_token = completion_positions(token_grad_sq_norms(model, batch), lp)  # [N, T]
    assert per_token.shape == (n, t) and bool((per_token[mask] > 0).all())
    answer = torch.zeros(n, t, dtype=torch.bool)
    answer[:, 1] = True
    share = answer_share(per_token, answer, mask)
    rest = answer_share(per_token, ~answer, mask)
    torch.testing.assert_close(share + rest, torch.ones(n, dtype=torch.float64))
    assert position_profile(per_token, mask).shape == (t,)
