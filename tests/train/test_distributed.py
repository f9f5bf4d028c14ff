"""The multi-process path: 2 processes (torchrun, gloo on CPU) take the same optimizer steps as 1 process on the
whole batch.

Each process computes its share of the loss with the normaliser summed over processes, and the gradients are summed
with an all-reduce (trainer.policy_update), so the per-process gradients add up to the whole batch's. The rollouts of
a real 2-process run differ from a 1-process run (each rank samples with its own seed), so the comparison uses a fixed
batch: tests/_distributed_worker.py splits it across the ranks and calls policy_update directly, for every loss
aggregation and for 1 and 2 mini-batches; here the same function runs in one process on the whole batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import _distributed_worker as worker
import pytest
import torch
from helpers_distributed import run_torchrun, torchrun_available

from grpo_lens.runtime.processes import Processes

WORLD = 2
TIMEOUT_S = 300


class RankResults(list):
    """Each rank's results (a list indexed by rank), and ``out``, the worker's output folder."""

    def __init__(self, results: list, out: Path):
        super().__init__(results)
        self.out = out


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    if not torchrun_available():
        pytest.skip("torchrun / torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("dist")
    proc = run_torchrun("_distributed_worker.py", out, WORLD, TIMEOUT_S)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert [(d["rank"], d["world"]) for d in ranks] == [(r, WORLD) for r in range(WORLD)], (
        "the workers did not form one group of 2 processes"
    )
    return RankResults([d["results"] for d in ranks], out)


@pytest.fixture(scope="module")
def one_process_results():
    return worker.run_updates(Processes(0, 1, torch.device("cpu")), as_world=WORLD)


KEYS = [(mode, m) for mode in sorted(worker.LOSS_AGGREGATIONS.names()) for m in worker.MINI_BATCHES]


def _assert_close(a: dict, b: dict, what: str, atol: float, rtol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=lambda m: f"{what} {name}: {m}")  # noqa: B023


def test_group_order():
    # 2 ranks x 2 mini-batches: rank 0 holds groups 0, 1 and rank 1 holds 2, 3; step 1 = {0, 2}, step 2 = {1, 3}
    assert worker.group_order(2, 2) == [0, 2, 1, 3]
    assert worker.group_order(2, 1) == [0, 1, 2, 3]
    assert worker.group_order(1, 2) == [0, 1, 2, 3]


@pytest.mark.e2e
@pytest.mark.parametrize("mode,mini_batches", KEYS)
def test_two_processes_equal_one(two_process_results, one_process_results, mode, mini_batches):
    key = (mode, mini_batches)
    single = one_process_results[key]
    for rank, results in enumerate(two_process_results):
        got = results[key]
        # the summed first-step gradient (before clipping) is the whole batch's gradient
        _assert_close(got["grad"], single["grad"], f"rank {rank} first-step gradient", atol=1e-6, rtol=1e-4)
        # after mu=2 passes x mini-batches of SGD steps with clipping, the weights agree: lr * (float noise)
        _assert_close(got["params"], single["params"], f"rank {rank} parameters", atol=1e-6, rtol=1e-5)
        assert got["metrics"]["grad/optimizer_steps"] == single["metrics"]["grad/optimizer_steps"] == 2 * mini_batches
        assert got["metrics"]["grad/norm"] == pytest.approx(single["metrics"]["grad/norm"], rel=1e-5)
        # the logged loss and token statistics are the whole batch's, not one rank's share
        for k in (
            "loss/policy",
            "loss/kl",
            "kl/mean",
            "clip/ratio_region",
            "clip/ratio_low",
            "clip/ratio_high",
            "ratio/mean",
            "ratio/max",
        ):
            assert got["metrics"][k] == pytest.approx(single["metrics"][k], rel=1e-4, abs=1e-7), k


def test_the_batch_exercises_the_loss(one_process_results):
    # guard against a vacuous comparison: the gradient is non-zero, the clip binds, and the aggregations differ
    m = one_process_results[("token-mean", 1)]["metrics"]
    assert m["clip/ratio_low"] > 0 and m["clip/ratio_high"] > 0 and m["kl/mean"] > 0
    grads = {
        mode: one_process_results[(mode, 1)]["grad"]["lm_head.weight"] for mode in worker.LOSS_AGGREGATIONS.names()
    }
    assert all(g.abs().max() > 0 for g in grads.values())
    assert not torch.allclose(grads["token-mean"], grads["seq-mean-token-mean"], rtol=1e-3)


@pytest.mark.e2e
def test_cli_train_under_torchrun(two_process_results):
    """The real loop with 2 processes (``grpo-lens train`` in the worker, after the fixed-batch updates): it
    finishes (no collective left waiting), and rank 0 alone writes one metrics line per step, a checkpoint and the
    final model."""
    out = two_process_results.out / "run"
    assert [(two_process_results.out / f"cli_rc{r}").read_text() for r in range(WORLD)] == ["0"] * WORLD
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # test_alternating gives 1, 0 in each group: both groups mixed, mean 0.5
        assert r["reward/mean"] == 0.5 and r["reward/frac_zero_std_groups"] == 0.0
        assert r["completions/mean_length"] <= 6 and r["grad/norm"] > 0
        assert r["grad/optimizer_steps"] == 1 and "rank/g1_erank" in r
        # the lens gathered every process's groups: one mixed group on each of the 2 processes
        assert r["rank/mixed_groups"] == 2.0
    assert (out / "checkpoints" / "step-000002" / "model.safetensors").is_file()
    assert (out / "final_model" / "config.json").is_file()


def test_mini_batches_must_divide_each_process_share():
    # B = 6 over 2 processes: 3 prompts each, which 2 mini-batches cannot split into equal optimizer steps (a
    # process would take 3 steps of 1 prompt); 3 mini-batches can.
    from grpo_lens.config import TrainConfig
    from grpo_lens.train.checks import check_inputs

    procs = Processes(0, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="num_mini_batches"):
        check_inputs(TrainConfig(model="tiny", prompts_per_step=6, num_mini_batches=2), procs)
    check_inputs(TrainConfig(model="tiny", prompts_per_step=6, num_mini_batches=3), procs)
    with pytest.raises(ValueError, match="prompts_per_step"):
        check_inputs(TrainConfig(model="tiny", prompts_per_step=3, num_mini_batches=1), procs)


@pytest.mark.e2e
def test_a_process_without_reward_contrast_runs_no_backward_yet_sums(two_process_results, one_process_results):
    """Process 0's groups all have advantage 0 (worker.STILL), so it forwards them without gradient and
    holds no gradient, while process 1 does. The all-reduce covers every trainable parameter on both (zeros where a
    process has none), so the summed gradient and the weights are one process's on the whole batch."""
    single = one_process_results[worker.STILL]
    assert single["metrics"]["grad/norm"] > 0  # process 1's groups move the weights
    for rank, results in enumerate(two_process_results):
        got = results[worker.STILL]
        _assert_close(got["grad"], single["grad"], f"rank {rank} first-step gradient", atol=1e-6, rtol=1e-4)
        _assert_close(got["params"], single["params"], f"rank {rank} parameters", atol=1e-6, rtol=1e-5)
        assert got["metrics"]["grad/optimizer_steps"] == 2  # mu = 2 passes, one mini-batch
        assert got["metrics"]["grad/norm"] == pytest.approx(single["metrics"]["grad/norm"], rel=1e-5)


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(worker.FLAT_RUNS))
def test_cli_trains_when_one_process_has_no_reward_contrast(two_process_results, name):
    """``grpo-lens train`` with 2 processes where process 0's groups never have reward contrast (a gloo
    "collective mismatch" abort at the first such step): without the lens, with it every step, and with it on a LoRA
    adapter, both processes finish both steps and hold bit-equal weights."""
    out = two_process_results.out
    assert [(out / f"{name}_rc{r}").read_text() for r in range(WORLD)] == ["0"] * WORLD
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # test_rank0_flat: process 0's group is 0, 0 (no contrast), process 1's 1, 0: mean 0.25, half the groups flat
        assert r["reward/mean"] == 0.25 and r["reward/frac_zero_std_groups"] == 0.5
        assert r["grad/optimizer_steps"] == 1 and r["grad/norm"] > 0
        assert ("rank/mixed_groups" in r) == (name != "flat")
        if name != "flat":  # the lens gathered both processes' groups: process 1's is the one mixed group
            assert r["rank/mixed_groups"] == 1.0
    weights = [torch.load(out / f"{name}_weights{r}.pt", weights_only=True) for r in range(WORLD)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_grad_buckets_cut_at_the_size_and_at_a_dtype():
    from grpo_lens.runtime.processes import grad_buckets

    f32 = [torch.zeros(n) for n in (3, 4, 2, 9, 1)]
    # at most 8 elements: 3 + 4 = 7 (+ 2 > 8), 2 (+ 9 > 8), 9 alone (larger than a bucket), 1
    assert [[g.numel() for g in b] for b in grad_buckets(f32, 8)] == [[3, 4], [2], [9], [1]]
    mixed = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), torch.zeros(2)]
    assert [[g.dtype for g in b] for b in grad_buckets(mixed, 100)] == [
        [torch.float32],
        [torch.float64, torch.float64],
        [torch.float32],
    ]
    flat = [g for b in grad_buckets(f32, 8) for g in b]  # the tensors themselves, in order: reduced in place
    assert len(flat) == len(f32) and all(a is b for a, b in zip(flat, f32))
