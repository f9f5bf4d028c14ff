"""``--estimator optimal`` in training: b* per group, leave-one-out, from sketched squared gradient norms.

The oracle is the exact per-rollout gradient (one backward per rollout) of every nn.Linear weight; the trainer's path
is :func:`sketched_rollout_sq_norms` (one batched backward, LoGra sketch). With identity projections the sketch is
exact, so the two must give the same b*_{-i} to float64 round-off; with the Gaussian sketch they agree within its
error bound.
"""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lens.formulas.advantages import compute_advantages, loo_optimal_baseline
from grpo_lens.formulas.baselines import optimal_vs_rloo
from grpo_lens.formulas.losses import aggregation_rollout_weights
from grpo_lens.gradients.exact import exact_rollout_grads
from grpo_lens.gradients.params import linear_layer_names
from grpo_lens.gradients.sketch import sketched_rollout_sq_norms
from grpo_lens.rollout import RolloutBatch

VOCAB = 50


def tiny_model():
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double().eval()


def tiny_batch(num_groups=2, group_size=4, prompt_len=5, completion_len=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = num_groups * group_size
    prompt_ids = torch.randint(1, VOCAB, (num_groups, prompt_len), generator=g).repeat_interleave(group_size, 0)
    prompt_mask = torch.ones(n, prompt_len, dtype=torch.long)
    completion_ids = torch.randint(1, VOCAB, (n, completion_len), generator=g)
    lengths = torch.randint(1, completion_len + 1, (n,), generator=g)
    completion_mask = torch.arange(completion_len).unsqueeze(0) < lengths.unsqueeze(1)
    completion_ids[~completion_mask] = 0
    return RolloutBatch(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        torch.zeros(n, completion_len),
        torch.zeros(n, dtype=torch.bool),
        group_size,
    )


REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])


@pytest.fixture(scope="module")
def model_batch_exact():
    model, batch = tiny_model(), tiny_batch()
    names = [n + ".weight" for n in linear_layer_names(model)]
    exact = exact_rollout_grads(model, batch, names)  # [N, P_linear] rows g_i
    return model, batch, exact


def test_aggregation_rollout_weights_closed_form():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    # seq-mean-token-mean: (1/|o_i|) sum_t 1 = 1 (0 for the empty row); token sums: |o_i| = 3, 1, 0
    assert aggregation_rollout_weights(mask, "seq-mean-token-mean").tolist() == [1.0, 1.0, 0.0]
    assert aggregation_rollout_weights(mask, "token-mean").tolist() == [3.0, 1.0, 0.0]
    assert aggregation_rollout_weights(mask, "seq-mean-token-sum-norm").tolist() == [3.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregation_rollout_weights(mask, "median")


@pytest.mark.e2e
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_identity_sketch_reproduces_exact_b_star(model_batch_exact, aggregation):
    model, batch, exact = model_batch_exact
    need = torch.ones(batch.num_rollouts, dtype=torch.bool)
    sq = sketched_rollout_sq_norms(model, batch, need, aggregation=aggregation, projection="identity")
    c = aggregation_rollout_weights(batch.completion_mask, aggregation)
    want_sq = exact.double().square().sum(-1) * c.square()  # ||c_i g_i||^2 from the oracle
    # the log-probs and the sketch are float32 (completion_logprobs, GradientCapture): float32 round-off, ~1e-7
    torch.testing.assert_close(sq, want_sq, rtol=1e-6, atol=0.0)
    # b*_{-i} from the trainer's advantages equals the exact leave-one-out b* of each group
    adv = compute_advantages(REWARDS.double(), "optimal", grad_sq_norms=sq.view(2, 4))
    for b in range(2):
        want_b = loo_optimal_baseline(REWARDS[b].double(), want_sq[b * 4 : (b + 1) * 4])
        torch.testing.assert_close(REWARDS[b].double() - adv[b], want_b, rtol=1e-6, atol=1e-7)


@pytest.mark.e2e
def test_gaussian_sketch_b_star_within_its_error(model_batch_exact):
    # The trainer's default: a Gaussian sketch with sketch_in = sketch_out = 16 per layer (14 linear layers here). Each
    # layer's ||S(G)||^2 has relative std <= sqrt(c(16,16)) = sqrt(0.266) = 0.52 (rank-1 worst case); over 14 layers of
    # comparable norm the total's relative error is about 0.52 / sqrt(14) = 0.14. b*_{-i} is a weighted mean of 0/1
    # rewards, so an error e in the weights moves it by at most about e * b(1 - b) <= e / 4 ~ 0.035 typical;
    # allow 0.12 (3.5 sigma). A wrong weighting (e.g. squared norms squared again) moves b* by 0.2-0.4 here.
    model, batch, exact = model_batch_exact
    need = torch.ones(batch.num_rollouts, dtype=torch.bool)
    sq = sketched_rollout_sq_norms(model, batch, need, sketch_dim=16, seed=3)
    want_sq = exact.double().square().sum(-1)
    for b in range(2):
        got = loo_optimal_baseline(REWARDS[b].double(), sq[b * 4 : (b + 1) * 4])
        want = loo_optimal_baseline(REWARDS[b].double(), want_sq[b * 4 : (b + 1) * 4])
        assert (got - want).abs().max() < 0.12, (got, want)


@pytest.mark.e2e
def test_only_needed_rollouts_are_sketched(model_batch_exact):
    model, batch, exact = model_batch_exact
    need = torch.tensor([True, True, True, True, False, False, False, False])
    sq = sketched_rollout_sq_norms(model, batch, need, projection="identity")
    assert (sq[4:] == 0).all()
    torch.testing.assert_close(sq[:4], exact[:4].double().square().sum(-1), rtol=1e-6, atol=0.0)


def test_optimal_vs_rloo_closed_form():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    valid = torch.ones(2, 4, dtype=torch.bool)
    sq = torch.tensor([[4.0, 1.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    adv = compute_advantages(rewards, "optimal", grad_sq_norms=sq)
    # group 0: b_0 = 2/(1+1+2) = 1/2, b_1 = (4+2)/(4+1+2) = 6/7, b_2 = 6/7, b_3 = 4/(4+1+1) = 2/3;
    # rloo: 1/3, 2/3, 2/3, 1/3. Group 1 has no contrast and is left out.
    b = [1 / 2, 6 / 7, 6 / 7, 2 / 3]
    rloo = [1 / 3, 2 / 3, 2 / 3, 1 / 3]
    s_b, s_gap, n = optimal_vs_rloo(rewards, valid, adv)
    assert n == 4
    assert s_b == pytest.approx(sum(b), abs=1e-6)
    assert s_gap == pytest.approx(sum(b) - sum(rloo), abs=1e-6)


@pytest.mark.e2e
def test_optimal_estimator_trains_the_tiny_model(tmp_path):
    from grpo_lens.config import TrainConfig
    from grpo_lens.train.loop import train

    # test_trainer.tiny_config's settings (test_parity reward: mixed groups on the random tiny model)
    config = TrainConfig(
        model="tiny",
        rewards=["test_parity"],
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=8,
        max_steps=2,
        learning_rate=1e-2,
        micro_batch_size=4,
        lens_every=0,
        seed=0,
        device="cpu",
        out=str(tmp_path / "run"),
        progress=False,
        save_final_model=False,
        estimator="optimal",
    )
    run = train(config)
    records = run.read_metrics()
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["grad/norm"] > 0 and r["perf/optimal_baseline_seconds"] > 0
        assert 0 <= r["adv/optimal_baseline"] <= 1  # a weighted mean of 0/1 rewards
        assert math.isfinite(r["adv/optimal_minus_rloo"])


@pytest.mark.e2e
def test_model_without_linear_layers_is_refused_before_out(tmp_path):
    from grpo_lens.config import TrainConfig
    from grpo_lens.train.loop import check_model

    config = TrainConfig(model="tiny", estimator="optimal", out=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="--estimator optimal needs"):
        check_model(config, torch.nn.Sequential(torch.nn.Embedding(3, 2)))
    check_model(config, tiny_model())  # has linear layers: no error
    assert not (tmp_path / "run").exists()
