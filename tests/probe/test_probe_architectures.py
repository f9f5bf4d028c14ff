"""``probe`` and ``train`` with the lens on a saved folder of every supported family, each exact Gram they
compute checked against the dense oracle, and ``--layers``.

Families: tests/architectures.py (Llama, Qwen2, GPT-2 with Conv1D, Mistral, Phi-3, Gemma, Nemotron; 2 layers, hidden
32, the 259-token byte-level tokenizer), saved with ``save_pretrained`` and loaded by path, as ``--model FOLDER``
does. Reward ``test_parity`` (a coin flip per rollout on a random model), so groups of 4 are mixed with probability
7/8. The oracle: every call of ``exact_rollout_gram`` inside the probe and the lens is wrapped so that it also computes
:func:`grpo_lens.gradients.exact.exact_rollout_grads` on the same rollouts (one backward per rollout) and compares
G G^T. The models are float32: the Gram's products run in float32 and sum in float64, the oracle's rows are float32,
so they agree to ~1e-7 relative; 1e-5 is the tolerance, and a missing term is far larger (Gemma's embedding scale:
0.48; a Conv1D read as [d_out, d_in] stops the probe).
"""

from __future__ import annotations

import json

import pytest
import torch
from architectures import DEFAULT_LAYER, FAMILIES, save_family_folder

import grpo_lens.lens.trainer_lens as lens_module
import grpo_lens.probe.gradient_sources as probe_gradients
from grpo_lens.cli import main
from grpo_lens.config import TrainConfig
from grpo_lens.gradients.exact import exact_rollout_grads
from grpo_lens.gradients.gram_blocks import block_spans
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.run import run_probe
from grpo_lens.train.loop import train

pytestmark = pytest.mark.e2e  # builds models, runs probe and train

ORACLE_RTOL = 1e-5  # measured up to 7e-7 (the baseline prompt's M = 8 rollouts); Gemma without its scale: 0.5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: saved model folder}, built on first use."""
    made: dict = {}

    def get(family: str):
        if family not in made:
            made[family] = save_family_folder(family, tmp_path_factory.mktemp(family) / "model")
        return made[family]

    return get


@pytest.fixture
def oracle_checked(monkeypatch):
    """Wrap ``exact_rollout_gram`` where the probe and the lens call it: every Gram they compute is compared with
    G G^T of the dense per-rollout gradients of the same rollouts; returns the list of relative errors."""
    errors: list[float] = []

    def wrap(original):
        def checked(model, batch, **kw):
            gram, info = original(model, batch, **kw)
            grads = (
                exact_rollout_grads(
                    model, batch, score_weights=kw.get("score_weights"), temperature=kw.get("temperature", 1.0)
                )
                .double()
                .cpu()
            )
            want = grads @ grads.T
            w = kw.get("weights")
            if w is not None:
                want = want * w.double().cpu()[:, None] * w.double().cpu()[None, :]
            if kw.get("blocks") is not None:  # the probe's batched pass: only the groups' diagonal blocks are formed
                inside = torch.zeros_like(want, dtype=torch.bool)
                for r0, r1 in block_spans(kw["blocks"], want.shape[0]):
                    inside[r0:r1, r0:r1] = True
                want = torch.where(inside, want, torch.zeros_like(want))
            errors.append(float((gram - want).abs().max() / want.abs().max()))
            return gram, info

        return checked

    monkeypatch.setattr(probe_gradients, "exact_rollout_gram", wrap(probe_gradients.exact_rollout_gram))
    monkeypatch.setattr(lens_module, "exact_rollout_gram", wrap(lens_module.exact_rollout_gram))
    return errors


def probe_config(folder, out, **overrides) -> ProbeConfig:
    """One R = 4 batch of 2 prompts, 6 new tokens, G2 and the sketch check on one group, no studies: ~3 s."""
    values = {
        "model": str(folder),
        "rewards": ["test_parity"],
        "group_sizes": [4],
        "prompts": 2,
        "prompts_per_batch": 2,
        "max_new_tokens": 6,
        "baseline_prompts": 1,
        "resamples": 8,
        "random_draws": 2,
        "seed": 0,
        "device": "cpu",
        "out": str(out),
        "baseline_study_prompts": 0,
        "credit_groups": 0,
        "g2_groups": 1,
        "progress": False,
    }
    return ProbeConfig(**{**values, **overrides})


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_runs_on_every_family(family, folders, oracle_checked, tmp_path):
    out = run_probe(probe_config(folders(family), tmp_path / "probe"))
    probe = json.loads((out / "probe.json").read_text())
    meta, r4 = probe["meta"], probe["per_group_size"]["4"]
    assert meta["layer"] == DEFAULT_LAYER.get(family, "model.layers.1.mlp.down_proj")
    assert meta["gradients"] == "exact_gram" and meta["gram_coverage"] == 1.0  # every parameter, Conv1D included
    assert r4["groups_mixed"] >= 1 and r4["g2_weightings"] is not None
    # the groups' Grams and the baseline prompt's M = 8 rollouts, each against the dense oracle
    assert len(oracle_checked) >= r4["groups_mixed"] and max(oracle_checked) < ORACLE_RTOL, oracle_checked
    assert "rank/g1_erank" in r4["summary"] and "rank/g1_layer_erank" in r4["summary"]
    assert (out / "report.md").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_train_with_the_lens_on_every_family(family, folders, oracle_checked, tmp_path):
    config = TrainConfig(
        model=str(folders(family)),
        rewards=["test_parity"],
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=6,
        max_steps=2,
        learning_rate=1e-2,
        micro_batch_size=8,
        lens_every=1,
        seed=0,
        device="cpu",
        out=str(tmp_path / "run"),
        progress=False,
        save_final_model=False,
        lens_from_update=False,  # the lens's own pass calls exact_rollout_gram (the oracle's hook); the Gram read off
        # the update's backward equals it to 1e-10 (tests/train/test_lens_fused.py)
    )
    records = train(config).read_metrics()
    lens = [r for r in records if "rank/g1_erank" in r]
    assert len(records) == 2 and lens, [sorted(r) for r in records]
    assert all(r["grad/gram_coverage"] == 1.0 for r in lens)
    assert oracle_checked and max(oracle_checked) < ORACLE_RTOL, oracle_checked
    # the rank-2 identity holds on every family (float32: ~1e-8)
    assert all(r["grad/identity_residual"] < 1e-6 for r in lens)
    # every parameter has a layer type of its own in the sparsity keys: none falls to "other"
    assert not any(k.startswith("sparsity/other/") for r in records for k in r)
    assert any(k.startswith("sparsity/attention/") for k in records[-1])


def test_probe_layers_restricts_g2_and_the_default_layer(folders, tmp_path):
    out = run_probe(
        probe_config(folders("gpt2"), tmp_path / "probe", layers="*.mlp.*", baseline_prompts=0, coverage_groups=0)
    )
    probe = json.loads((out / "probe.json").read_text())
    assert probe["meta"]["layer"] == "transformer.h.1.mlp.c_proj"
    kinds = {
        k.split("_adv_")[1].rsplit("_stable_rank")[0]
        for k in probe["per_group_size"]["4"]["g2_weightings"]["summary"]
        if "_adv_" in k
    }
    # the MLP's two Conv1D layers; without --layers also c_attn, attn_c_proj and lm_head
    assert kinds == {"c_fc", "mlp_c_proj"}
    assert "weight gradient of the group loss (the layers --layers '*.mlp.*' keeps)" in (out / "report.md").read_text()


def test_probe_layers_matching_nothing_stops_before_writing(tmp_path, capsys):
    out = tmp_path / "probe"
    assert main(["probe", "--model", "tiny", "--layers", "*.c_attn", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--layers '*.c_attn' matches no linear layer" in err
    assert "model.layers.0.self_attn.q_proj" in err  # a few valid names
    assert not out.exists()


def test_probe_of_a_model_without_linear_layers_names_its_classes(tmp_path):
    class NoLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)

    with pytest.raises(
        ValueError,
        match=r"^the model has no linear layer .* Embedding \(40\); linear layers cover "
        r"0\.0% of its 40 trainable parameters$",
    ):
        run_probe(probe_config("tiny", tmp_path / "probe"), policy=NoLinear(), tokenizer=None)
    assert not (tmp_path / "probe").exists()


def test_gpt2_layer_rows_agree_across_gradient_sources(folders, tmp_path):
    """The probed Conv1D layer's exact rows come from the identity sketch (weight layout [d_in, d_out]) with the exact
    Gram and with the sketch, and from the dense gradients with --dense-oracle: the same rollouts (seed 0) give the
    same G2 singular values in all three. Rows read as [d_out, d_in] and reshaped to the weight would scramble them
    (relative differences of order 1)."""
    spectra = {}
    for name, kw in {"exact_gram": {}, "sketch": {"gram_source": "sketch"}, "exact": {"dense_oracle": True}}.items():
        out = run_probe(probe_config(folders("gpt2"), tmp_path / name, g2_groups=0, baseline_prompts=0, **kw))
        probe = json.loads((out / "probe.json").read_text())
        assert probe["meta"]["gradients"] == name
        spectra[name] = torch.tensor(probe["per_group_size"]["4"]["spectra"]["G2"], dtype=torch.float64)
    ref = spectra["exact_gram"]
    assert ref.numel() > 0 and float(ref.abs().max()) > 0
    for name in ("sketch", "exact"):
        assert torch.allclose(spectra[name], ref, rtol=1e-4, atol=1e-6 * float(ref.max())), name
