"""Facts about a whole trainer step that GRPO users keep reporting broken, checked through :func:`train`.

Tiny model (2-layer Llama built in code), 2 prompts x R = 4, at most 4 new tokens, 1-3 steps, CPU float32. Rewards come
from tests/helpers_rewards.py and depend only on the rollout's position, so groups are mixed whatever the model writes.
The pure-math versions of these facts live in test_advantages.py, test_losses.py and test_rollout.py.
"""

from __future__ import annotations

import json
import math
import time

import helpers_rewards  # noqa: F401 - registers the test_* reward functions
import pytest
import torch

from grpo_lens.config import TrainConfig
from grpo_lens.formulas.advantages import compute_advantages
from grpo_lens.rundir import RunDir
from grpo_lens.train.loop import NoScorableRolloutError, train

pytestmark = pytest.mark.e2e  # every test here builds a model or runs a command

R = 4


def tiny_config(tmp_path, name="run", **overrides) -> TrainConfig:
    """A one-step run of the tiny model: B = 2 prompts, R = 4, T_max = 4, every rollout logged."""
    values = dict(
        model="tiny",
        task="arithmetic",
        rewards=["test_alternating"],
        group_size=R,
        prompts_per_step=2,
        max_new_tokens=4,
        max_steps=1,
        checkpoint_every=10,
        lens_every=0,
        progress=False,
        device="cpu",
        save_final_model=False,
        log_completions=2 * R,
        micro_batch_size=2 * R,
        seed=0,
    )
    values.update(overrides)
    return TrainConfig(out=str(tmp_path / name), **values)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


class GradCapture:
    """A trainer lens that keeps a copy of the gradient of the first optimizer step (after accumulation)."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] | None = None

    def start(self, policy):
        pass

    def before_step(self, policy):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}

    def measure(self, *args, **kwargs):
        return {}

    def after_step(self, step, policy, lens_step):
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def final_params(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / "step-000001" / "model.safetensors"))


# ---------------------------------------------------------------------------------------------------------------------
def test_invalid_rewards_are_left_out_of_the_group_and_counted(tmp_path):
    # test_some_invalid gives each group of 4: None, NaN, 1.0, 0.0. Only the two valid rollouts form the group:
    # mean 0.5, sample std sqrt(((0.5)^2 + (0.5)^2) / 1) = sqrt(0.5), so A = +-0.5 / (sqrt(0.5) + 1e-4) = +-0.70701.
    # Were the invalid ones counted as reward 0, the mean would be 0.25 and A(1.0) = 0.75 / (0.5 + 1e-4) = 1.4997.
    run = train(tiny_config(tmp_path, rewards=["test_some_invalid"]))
    rows = read_jsonl(run.completions_path)
    assert len(rows) == 2 * R
    expected = 0.5 / (math.sqrt(0.5) + 1e-4)
    for n, row in enumerate(rows):
        if n % 4 in (0, 1):
            assert row["reward"] is None and row["advantage"] == 0.0
        else:
            assert row["advantage"] == pytest.approx(expected if n % 4 == 2 else -expected, rel=1e-6)
    m = read_jsonl(run.metrics_path)[0]
    assert m["reward/invalid_count"] == 4 and m["reward/invalid_frac"] == 0.5
    assert m["reward/test_some_invalid/invalid_count"] == 4
    assert m["reward/mean"] == 0.5  # over the 4 valid rollouts: 1, 0, 1, 0


def test_a_raising_reward_function_invalidates_its_rollouts_and_the_run_goes_on(tmp_path):
    # it raises at every step but not in the start-up check (which refuses a function that always raises); two steps
    # are fewer than --max-consecutive-skips 3 steps without a scorable rollout, so the run goes on to its end, and
    # then, as nothing scored in the whole run, it stops non-zero with both steps' records written
    config = tiny_config(tmp_path, rewards=["test_alternating", "test_raises_in_training"], max_steps=2)
    with pytest.raises(NoScorableRolloutError, match="no rollout could be scored"):
        train(config)
    run = RunDir(config.out)
    metrics = read_jsonl(run.metrics_path)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["reward/error_count"] == 1 and m["reward/invalid_frac"] == 1.0
        assert m["adv/abs_mean"] == 0.0 and m["grad/norm"] == 0.0  # no valid rollout: no policy gradient
    assert all(row["advantage"] == 0.0 and row["reward"] is None for row in read_jsonl(run.completions_path))


def test_a_hanging_reward_function_times_out_and_the_run_goes_on(tmp_path):
    # test_sleeps sleeps 3 s; with a 0.2 s timeout each step's call is abandoned: all its rollouts are invalid.
    t0 = time.perf_counter()
    config = tiny_config(tmp_path, rewards=["test_alternating", "test_sleeps"], reward_timeout=0.2, max_steps=2)
    with pytest.raises(NoScorableRolloutError):  # nothing scored in the whole run: non-zero
        train(config)
    run = RunDir(config.out)
    elapsed = time.perf_counter() - t0
    metrics = read_jsonl(run.metrics_path)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["reward/timeout_count"] == 1 and m["reward/invalid_frac"] == 1.0 and m["adv/abs_mean"] == 0.0
        assert m["perf/reward_test_sleeps_seconds"] < helpers_rewards.SLEEP_SECONDS
    assert elapsed < 2 * helpers_rewards.SLEEP_SECONDS  # the run did not wait for the sleeping calls


def test_clip_metrics_are_zero_on_policy_and_positive_when_mu_moves_the_policy(tmp_path):
    # mu = 1: the only pass is on the sampler's policy, rho = 1 up to rounding, far inside [0.8, 1.2].
    on = read_jsonl(train(tiny_config(tmp_path, "mu1", learning_rate=0.05)).metrics_path)[0]
    assert on["clip/ratio_region"] == on["clip/ratio_low"] == on["clip/ratio_high"] == 0.0
    assert on["ratio/max"] == pytest.approx(1.0, abs=1e-4)
    # mu = 2 with a large step: the second pass sees a moved policy; tokens leave the clip range.
    off = read_jsonl(train(tiny_config(tmp_path, "mu2", learning_rate=0.05, mu=2)).metrics_path)[0]
    assert off["grad/optimizer_steps"] == 2
    assert off["clip/ratio_region"] > 0.0
    assert off["clip/ratio_region"] == pytest.approx(off["clip/ratio_low"] + off["clip/ratio_high"])
    assert off["ratio/max"] > 1.2


def test_step_gradient_does_not_depend_on_micro_batch_size(tmp_path):
    # token-mean (DAPO) divides by the batch's token count: a per-micro-batch count would be the classic bug. The
    # loss-level test (test_losses.py) covers every aggregation mode.
    aggregation = "token-mean"
    runs = {}
    for mbs in (1, 2 * R):
        lens = GradCapture()
        run = train(
            tiny_config(tmp_path, f"mbs{mbs}", micro_batch_size=mbs, loss_aggregation=aggregation, learning_rate=1e-3),
            lens=lens,
        )
        runs[mbs] = (lens.grads, final_params(run.path), read_jsonl(run.metrics_path)[0])
    (g1, p1, m1), (g8, p8, m8) = runs[1], runs[2 * R]
    assert m1["grad/norm"] > 0
    assert m1["grad/norm"] == pytest.approx(m8["grad/norm"], rel=1e-5)
    assert m1["loss/policy"] == pytest.approx(m8["loss/policy"], abs=1e-6)
    assert g1.keys() == g8.keys() and len(g1) > 0
    # Summation order differs (8 micro-batches vs 1), so entries agree to float32 rounding of the tensor's scale:
    # observed max |difference| <= 2e-7 * max |g|. A per-micro-batch normaliser would be off by a factor up to 8.
    for name in g1:
        scale = float(g8[name].abs().max())
        torch.testing.assert_close(g1[name], g8[name], rtol=0.0, atol=1e-5 * scale, msg=name)
    # AdamW's first step is lr * c g / (|c g| + 1e-8), c = min(1, max_grad_norm / ||g||) the clipping factor (the
    # captured g is before clipping): where |c g| ~ 1e-8 (Adam's eps) rounding noise in g moves the update by up to
    # about lr / 2 (observed: 2.5e-6 where g = -2.3e-8 vs -2.35e-8; 2e-6 on an AMD EPYC where |g| = 1.6e-6, c = 0.073,
    # c |g| = 1.2e-7). Where |c g| >= 1e-6 the update is lr * sign(g) to within 1%, so those parameters agree to 1e-3 of
    # the step size lr = 1e-3; a wrong gradient moves by ~lr. Everywhere they agree to lr / 2.
    clip = min(1.0, 1.0 / m8["grad/norm"])  # the default max_grad_norm 1.0
    assert sum(int((clip * g.abs() >= 1e-6).sum()) for g in g8.values()) > 100  # the tight check covers something
    for name in p1:
        strong = clip * g8[name].abs() >= 1e-6
        torch.testing.assert_close(p1[name][strong], p8[name][strong], rtol=0.0, atol=1e-6, msg=name)
        torch.testing.assert_close(p1[name], p8[name], rtol=0.0, atol=5e-4, msg=name)


def test_truncated_completions_are_flagged_logged_and_masked(tmp_path, monkeypatch):
    # Make EOS likely so that with 3 new tokens some completions end and some are cut.
    import grpo_lens.models as models

    monkeypatch.setattr("grpo_lens.train.loop.load_model", _eos_prone(models.load_model))
    runs = {}
    for mask in (False, True):
        run = train(tiny_config(tmp_path, f"mask{mask}", max_new_tokens=3, mask_truncated=mask, max_steps=1))
        runs[mask] = (read_jsonl(run.metrics_path)[0], read_jsonl(run.completions_path))
    (_m_off, rows_off), (m_on, rows_on) = runs[False], runs[True]
    truncated = [row["truncated"] for row in rows_on]
    assert [row["truncated"] for row in rows_off] == truncated  # same seed, same samples
    assert 0 < sum(truncated) < len(truncated), "need a mix of cut and finished completions"
    assert m_on["completions/truncated_frac"] == sum(truncated) / len(truncated)
    # Truncated rollouts still count in their group's mean and std; with mask_truncated only their own advantage
    # becomes 0, so the others keep exactly the advantages of the unmasked run.
    rewards = torch.tensor([row["reward"] for row in rows_on]).view(-1, R)
    expected = compute_advantages(rewards, "grpo").view(-1)
    for n, (row_on, row_off) in enumerate(zip(rows_on, rows_off)):
        assert row_off["advantage"] == pytest.approx(float(expected[n]), abs=1e-6)
        assert row_on["advantage"] == (0.0 if row_on["truncated"] else row_off["advantage"])
    assert m_on["reward/invalid_frac"] == 0.0  # masking is not invalidity


def _eos_prone(load):
    """Wrap ``load_model`` so that the model's EOS logit becomes log(sum of exp logits) - log 4: P(EOS) ~ 1/5 per
    token, in sampling and in the trainer's log-probs alike (the on-policy ratio stays 1)."""

    def wrapped(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        eos = tokenizer.eos_token_id
        model.lm_head.register_forward_hook(lambda module, inputs, out: _boost(out, eos))
        return model, tokenizer

    return wrapped


def _boost(logits: torch.Tensor, eos: int) -> torch.Tensor:
    out = logits.clone()
    out[..., eos] = logits.logsumexp(dim=-1) - math.log(4.0)  # P(EOS) ~ (1/4) / (1 + 1/4) = 1/5 at temperature 1
    return out


def test_same_config_and_seed_give_the_same_metrics(tmp_path):
    runs = []
    for name in ("a", "b"):
        run = train(tiny_config(tmp_path, name, max_steps=3, lens_every=2))
        runs.append([{k: v for k, v in m.items() if not k.startswith("perf/")} for m in read_jsonl(run.metrics_path)])
    assert len(runs[0]) == 3 and "rank/g1_erank" in runs[0][1]  # the lens measured on step 2
    assert runs[0] == runs[1]
