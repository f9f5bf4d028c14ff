"""Duplicate completions in the label-permutation test: identical gradients are one unit."""

import math

import pytest
import torch

from grpo_lens import metrics as mk
from grpo_lens.formulas.zero_sum import distinct_rows, span_energies, zero_sum_tests


def _vectors(n: int, dim: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_distinct_rows_merges_identical_gradients_of_one_reward_only():
    a, b, c = _vectors(3)
    g = torch.stack([a, a, b, c, c])
    # rows 0, 1 identical and both correct: one kept; rows 3, 4 identical but rewards differ: both kept
    keep = distinct_rows(g @ g.T, torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0]))
    assert keep.tolist() == [0, 2, 3, 4]
    # a change of 1e-2 ‖a‖ in one coordinate: ‖Δ‖² / (‖a‖² + ‖a2‖²) = 5e-5, above the 1e-6 tolerance: kept apart
    a2 = a.clone()
    a2[0] += 1e-2 * a.norm()
    g = torch.stack([a, a2, b])
    assert distinct_rows(g @ g.T, torch.tensor([1.0, 1.0, 0.0])).tolist() == [0, 1, 2]


def test_one_string_class_with_one_other_rollout_carries_no_label_information():
    # R = 4, k = 3 correct rollouts one string, 1 wrong: merged, R' = 2 units, and span{g_C, g_W} holds both, so
    # every relabelling gives span energy 1: excess 0, null 1, null variance 0 (the unmerged test would compare
    # the truth with relabellings that split the duplicates, and read structure)
    a, b = _vectors(2)
    g = torch.stack([a, a, a, b])
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    adv = torch.tensor([0.5, 0.5, 0.5, -1.5])
    out = zero_sum_tests(g @ g.T, rewards, adv)
    for stat in ("span_energy", "unit_span_energy"):
        assert out[mk.zero_sum_key(stat)] == pytest.approx(1.0, abs=1e-9)
        assert out[mk.zero_sum_key(stat, "excess")] == pytest.approx(0.0, abs=1e-9)
        assert out[mk.zero_sum_key(stat, "null_var")] == pytest.approx(0.0, abs=1e-12)


def test_merged_test_is_the_test_of_the_distinct_completions():
    # R = 5: correct rollouts 0, 1 one string, correct 2 and wrong 3, 4 distinct. The merged test equals the test
    # of the 4 distinct rows (k' = 2 of 4: all C(4, 2) = 6 relabellings), excess = truth − mean of the 6
    v = _vectors(4, seed=3)
    g = torch.stack([v[0], v[0], v[1], v[2], v[3]])
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    adv = torch.tensor([0.6, 0.6, 0.6, -0.9, -0.9])
    out = zero_sum_tests(g @ g.T, rewards, adv)
    gd = v @ v.T
    labs = torch.zeros(6, 4, dtype=torch.bool)
    for i, idx in enumerate([(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]):
        labs[i, list(idx)] = True
    e = span_energies(gd, labs, torch.where(labs, 0.6, -0.9).double())
    assert out[mk.zero_sum_key("span_energy")] == pytest.approx(float(e[0]), rel=1e-9)  # (0, 1): the truth
    assert out[mk.zero_sum_key("span_energy", "excess")] == pytest.approx(float(e[0] - e.mean()), rel=1e-9)
    assert out[mk.zero_sum_key("span_energy", "p")] == pytest.approx(int((e >= e[0] - 1e-12).sum()) / 6)
    assert math.isfinite(out[mk.zero_sum_key("cos_gap")])


def test_token_ids_decide_duplicates_when_given():
    # rows 0, 1 are the same completion by their token ids but their gradients differ by 1% (a sketch's float32
    # noise would be far smaller): merged by ids, R' = 3 units with k' = 1 (C(3, 1) = 3 relabellings); by the Gram
    # alone they stay apart (R = 4, k = 2), and analyse_group follows the ids when it has them
    from grpo_lens.analysis.group import analyse_group

    v = _vectors(3, seed=5)
    a2 = v[0] * 1.01
    g = torch.stack([v[0], a2, v[1], v[2]])
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    ids = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 8, 0], [9, 9, 9]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    same = torch.tensor([[True, True, False, False], [True, True, False, False]] + [[False] * 4] * 2)
    same[2, 2] = same[3, 3] = True
    by_ids = zero_sum_tests(g @ g.T, rewards, adv, same_completion=same)
    assert distinct_rows(g @ g.T, rewards, same_completion=same).tolist() == [0, 2, 3]
    assert distinct_rows(g @ g.T, rewards).tolist() == [0, 1, 2, 3]
    # the merged test is the 3-unit test: 3 relabellings, so its p is a multiple of 1/3
    assert by_ids[mk.zero_sum_key("span_energy", "p")] * 3 == pytest.approx(
        round(by_ids[mk.zero_sum_key("span_energy", "p")] * 3)
    )
    row = analyse_group(g @ g.T, rewards, adv, completion_ids=ids, completion_mask=mask, num_random=1)
    assert row[mk.zero_sum_key("span_energy")] == pytest.approx(by_ids[mk.zero_sum_key("span_energy")], rel=1e-12)
    row = analyse_group(g @ g.T, rewards, adv, num_random=1)
    assert row[mk.zero_sum_key("span_energy")] != pytest.approx(by_ids[mk.zero_sum_key("span_energy")], rel=1e-6)
