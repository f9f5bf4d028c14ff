"""Each policy loss's lens rows are the trainer's own update, on the first pass and on the second (mu = 2).

The trainer's loss gradient before each optimizer step of ``policy_update`` (recorded by the optimizer) must equal
-(1/N) sum_i A_i grad sum_t omega_{i,t} log pi(o_{i,t}) with omega of
:func:`grpo_lens.formulas.losses.policy_token_weights` at that pass's weights and pi_old: at ratio 1 on the first
pass, and off policy on the second (the weights moved by the first step), where the losses differ.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _distributed_worker import TEMPERATURE, B, R, T, build_batch, build_model

from grpo_lens.config import TrainConfig
from grpo_lens.formulas.losses import loss_normalizer, policy_token_weights
from grpo_lens.gradients.exact import exact_rollout_grads
from grpo_lens.rollout import batch_logprobs
from grpo_lens.runtime.processes import Processes
from grpo_lens.train.update import policy_update


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps, before each step, the flat gradient and a copy of the parameters it is taken at."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.grads: list[torch.Tensor] = []
        self.weights: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        ps = [p for group in self.param_groups for p in group["params"]]
        self.grads.append(torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in ps]))
        self.weights.append([p.detach().clone() for p in ps])
        return super().step(closure)


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "sapo", "gpg"])
def test_lens_rows_sum_to_the_trainers_gradient_on_both_passes(name):
    torch.manual_seed(0)
    model = build_model()
    batch, advantages, _ = build_batch(model)
    eps = dict(eps_low=0.2, eps_high=0.2)
    mode = "token-mean"
    config = TrainConfig(
        model="tiny",
        group_size=R,
        prompts_per_step=B,
        max_new_tokens=T,
        temperature=TEMPERATURE,
        loss_aggregation=mode,
        num_mini_batches=1,
        mu=2,
        micro_batch_size=3,
        max_grad_norm=0.0,
        progress=False,
        policy_loss=name,
        **eps,
    )
    start = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = RecordingSGD(params, lr=0.01)  # second-pass ratios up to ~1.4-1.9: some past the clip, not all
    policy_update(model, opt, batch, advantages, None, config, Processes(0, 1, torch.device("cpu")), params)
    assert len(opt.grads) == 2
    mask = batch.completion_mask
    n = float(mask.any(dim=1).sum())
    z = loss_normalizer(mask, mode, T)
    with torch.no_grad():
        old = batch_logprobs(start, batch, TEMPERATURE)  # pi_old: the step's starting policy
    moved = 0.0
    for k in range(2):
        at = copy.deepcopy(start)
        with torch.no_grad():
            for p, w in zip([p for p in at.parameters() if p.requires_grad], opt.weights[k]):
                p.copy_(w)
            logp = batch_logprobs(at, batch, TEMPERATURE)
        moved = max(moved, float((logp - old)[mask].abs().max()))
        omega = policy_token_weights(
            logp, old, advantages, mask, aggregation=mode, normalizer=z, num_rollouts=n, policy_loss=name, **eps
        )
        if k == 1 and name in ("vanilla", "gspo"):  # the clip binds on some tokens (rollouts), not on all
            assert bool((omega[mask] == 0).any()) and bool((omega[mask] != 0).any()), name
        rows = exact_rollout_grads(at, batch, score_weights=omega, temperature=TEMPERATURE).double()  # [N, P]
        got = -(advantages.double() @ rows) / n
        want = opt.grads[k].double()
        assert float(want.norm()) > 0, (name, k)  # not every token (or rollout) clipped
        assert float((got - want).norm() / want.norm()) < 1e-4, (name, k)
    assert moved > 0.05  # the second pass is off policy indeed (ratios e^{+-0.05} or more)
