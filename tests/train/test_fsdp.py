"""``--parallelism fsdp2``: 2 processes with the policy sharded by torch's ``fully_shard`` (gloo on CPU) take the same
steps, and the lens reads the same Gram matrices, as 1 process with the whole policy.

tests/_fsdp_worker.py runs :func:`_fsdp_worker.run_fixed` on each rank's share of three fixed batches (float64 tiny
Llama, AdamW, a binding gradient clip, KL term, the exact-Gram lens measuring every step, S4 and sampled sparsity
around every update); the same function runs here in one process on the whole batches. In float64 the two differ
only by reassociation of sums (~1e-16 relative). The weights alone cannot show a gradient averaged instead of summed
over processes: AdamW's step and the clipped direction do not depend on the gradient's scale, and with FSDP2's
default averaging the weights still agreed to 1e-6 while the first-step gradient was off by 0.089. So the gradient
(1e-9) and grad/norm (1e-12 relative) are compared too; a clip norm taken per shard or a Gram whose hooks missed a
shard's parameters break the grad/norm and Gram checks (1e-9 relative on entries of size ~1e3).
The worker then trains through the CLI with ``--parallelism fsdp2``: 3 steps in one go and 2 steps resumed to 3.
"""

from __future__ import annotations

import json

import _fsdp_worker as worker
import pytest
import torch
from helpers_distributed import run_torchrun, torchrun_available
from safetensors.torch import load_file

from grpo_lens.config import TrainConfig
from grpo_lens.models import build_tiny_model
from grpo_lens.runtime.processes import Processes
from grpo_lens.runtime.sharding import decoder_layers, shard_fsdp2
from grpo_lens.train.checks import check_inputs

WORLD = 2
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    if not torchrun_available():
        pytest.skip("torchrun / torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("fsdp")
    proc = run_torchrun("_fsdp_worker.py", out, WORLD, TIMEOUT_S)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert [(d["rank"], d["world"]) for d in ranks] == [(r, WORLD) for r in range(WORLD)]
    return [d["results"] for d in ranks], out


@pytest.fixture(scope="module")
def one_process():
    return worker.run_fixed(Processes(0, 1, torch.device("cpu")))


def _max_abs(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.e2e
def test_fsdp2_weights_equal_one_process(fsdp_run, one_process):
    results, _ = fsdp_run
    start = {n: p.detach().double() for n, p in build_tiny_model(seed=0)[0].named_parameters()}
    # the steps moved the weights (AdamW, lr 1e-3: up to ~3e-3 per entry), so equality is not the start's
    assert _max_abs(one_process["params"], start) > 1e-3
    for rank, res in enumerate(results):
        assert 0 < res["local_numel"] < sum(p.numel() for p in start.values())  # each rank holds a shard only
        # measured: 5.0e-16 (weights), 1.4e-17 (first-step gradient)
        assert _max_abs(res["params"], one_process["params"]) < 1e-6, rank
        assert _max_abs(res["grad"], one_process["grad"]) < 1e-9, rank
        for s in range(worker.STEPS):
            got, want = res["metrics"][s], one_process["metrics"][s]
            assert want["grad/norm"] > 1.0  # the clip binds: the global norm across shards is what it divides by
            assert got["grad/norm"] == pytest.approx(want["grad/norm"], rel=1e-12)
            for k in want:
                assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), (s, k)


@pytest.mark.e2e
def test_fsdp2_lens_equals_one_process(fsdp_run, one_process):
    results, _ = fsdp_run
    for rank, res in enumerate(results):
        rows = res["rows"]
        for s in range(worker.STEPS):
            # each rank's exact Gram of its own rollouts is the block of the whole batch's (measured <= 1.8e-12 abs on
            # entries up to 7.6e3)
            whole = one_process["gram"][s][rows][:, rows]
            assert float((res["gram"][s] - whole).abs().max()) <= 1e-9 * float(whole.abs().max()), (rank, s)
            lens, want = res["lens"][s], one_process["lens"][s]
            # the lens's per-group verdict inputs (ranks, span energies, baselines, identity residual), gathered over
            # ranks; step 2 (s = 1): rank 1 has no mixed group and joins the collective pass with a dummy one
            # noise/: one process only (the own pass's Gram is split over ranks: docs/theory.md, noise scale)
            assert {k for k in lens if not k.startswith("noise/")} == {k for k in want if not k.startswith("noise/")}
            assert lens["rank/mixed_groups"] == want["rank/mixed_groups"] == (2.0 if s == 1 else 4.0)
            for k in want:
                if not k.startswith(("perf/", "noise/")):
                    assert lens[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12, nan_ok=True), (rank, s, k)
            after, want_after = res["after"][s], one_process["after"][s]  # S4, sampled update/gradient sparsity
            assert after.keys() == want_after.keys() and "sparsity/update_step" in after
            for k in want_after:
                if not k.startswith("perf/"):
                    assert after[k] == pytest.approx(want_after[k], rel=1e-9, abs=1e-12, nan_ok=True), (s, k)


@pytest.mark.e2e
def test_fsdp2_cli_resumes_to_the_same_run(fsdp_run):
    _, out = fsdp_run
    assert [(out / f"cli_rc{r}").read_text() for r in range(WORLD)] == ["0 0 0"] * WORLD
    straight = load_file(out / "straight" / "checkpoints" / "step-000003" / "model.safetensors")
    resumed = load_file(out / "resumed" / "checkpoints" / "step-000003" / "model.safetensors")
    start = build_tiny_model(seed=0)[0].state_dict()
    assert straight.keys() == resumed.keys() == start.keys()  # full tensors, the model's own names
    assert max(float((straight[k] - start[k]).abs().max()) for k in start) > 0
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)  # measured: identical
    optimizer = torch.load(out / "straight" / "checkpoints" / "step-000003" / "optimizer.pt", weights_only=False)
    assert set(optimizer["state"]) == set(start) - {k for k in start if "rotary" in k}  # keyed by name, full
    records = [
        [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("straight", "resumed")
    ]
    assert [r["step"] for r in records[0]] == [r["step"] for r in records[1]] == [1, 2, 3]
    for a, b in zip(*records):
        assert a["grad/norm"] == b["grad/norm"] and a["rank/mixed_groups"] == b["rank/mixed_groups"] == 2.0
    config = json.loads((out / "straight" / "final_model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # not fully_shard's FSDPLlamaForCausalLM
    final = load_file(out / "straight" / "final_model" / "model.safetensors")
    assert all(torch.equal(final[k], straight[k]) for k in final)


@pytest.mark.e2e
def test_fsdp2_with_one_process_is_an_error():
    # chosen: an error, not a silent replicated run, so that config.yaml says what ran
    one = Processes(0, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="this run has 1: launch it with torchrun"):
        check_inputs(TrainConfig(model="tiny", parallelism="fsdp2"), one)
    with pytest.raises(ValueError, match="this run has 1"):
        shard_fsdp2(build_tiny_model(seed=0)[0], 1)
    two = Processes(0, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="LoRA"):
        check_inputs(TrainConfig(model="tiny", parallelism="fsdp2", prompts_per_step=2, lora_rank=2), two)
    with pytest.raises(ValueError, match="estimator optimal"):
        check_inputs(TrainConfig(model="tiny", parallelism="fsdp2", prompts_per_step=2, estimator="optimal"), two)
    check_inputs(TrainConfig(model="tiny", parallelism="fsdp2", prompts_per_step=2), two)


@pytest.mark.e2e
def test_decoder_layers_are_the_models_own_layer_class():
    model = build_tiny_model(seed=0)[0]
    assert decoder_layers(model) == list(model.model.layers)
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="--parallelism ddp"):
        decoder_layers(plain)
