"""LoRA through peft: training moves only the adapter, a killed-and-resumed LoRA run equals the uninterrupted one bit
for bit, final_model holds the merged model and the adapter alone (both compute the trained policy), the probe
accepts it, and the lens's two gradient spaces are tied by the chain rule."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from grpo_lens.config import ConfigError, TrainConfig
from grpo_lens.rundir import RunDir
from grpo_lens.train.loop import train

pytestmark = [
    pytest.mark.e2e,  # every test here builds a model
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs the lora extra (peft)"),
]


def lora_config(out, **overrides) -> TrainConfig:
    values = dict(
        model="tiny",
        rewards=["test_parity"],
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=6,
        max_steps=4,
        learning_rate=3e-2,
        micro_batch_size=8,
        lens_every=2,
        seed=0,
        device="cpu",
        out=str(out),
        progress=False,
        save_final_model=True,
        log_completions=0,
        checkpoint_every=2,
        keep_checkpoints=3,
        lora_rank=4,
        lora_alpha=8.0,
        lora_target_modules=["q_proj", "v_proj"],
    )
    values.update(overrides)
    return TrainConfig(**values)


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _no_perf(records):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


def test_lora_trains_the_adapter_resumes_bit_identically_and_saves_merged_and_adapter(tmp_path):
    from grpo_lens.models import build_tiny_model, load_model

    straight = train(lora_config(tmp_path / "straight"))
    # the same run, stopped after the checkpoint of step 2 and resumed to step 4
    train(lora_config(tmp_path / "resumed", max_steps=2))
    resumed = train(lora_config(tmp_path / "resumed", resume=True))

    a = _weights(straight.path / "checkpoints" / "step-000004" / "model.safetensors")
    b = _weights(resumed.path / "checkpoints" / "step-000004" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed LoRA run differs from the uninterrupted one"
    ra, rb = RunDir(straight.path).read_metrics(), RunDir(resumed.path).read_metrics()
    assert _no_perf(ra) == _no_perf(rb)

    # only the adapter moved: every base weight equals the tiny model's initial one; lora_B left its zero init
    base, _ = build_tiny_model(seed=0)
    initial = dict(base.named_parameters())
    lora_keys = [k for k in a if "lora_" in k]
    assert lora_keys and all(("q_proj" in k or "v_proj" in k) for k in lora_keys)
    for k, v in a.items():
        if "lora_" in k:
            continue
        name = k.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(v, initial[name].detach()), k
    assert any(a[k].abs().max() > 0 for k in lora_keys if "lora_B" in k)

    # the lens measured the adapter space exactly at its steps (2 and 4)
    lens_steps = [r["step"] for r in ra if "rank/mixed_groups" in r]
    assert lens_steps and any("rank/g1_erank" in r for r in ra)

    # final_model: merged (a plain transformers model) and adapter/ (peft) compute the same log-probs
    from peft import PeftModel

    merged, tok = load_model(straight.path / "final_model")
    assert (straight.path / "final_model" / "adapter" / "adapter_config.json").is_file()
    fresh, _ = build_tiny_model(seed=0)
    adapted = PeftModel.from_pretrained(fresh, straight.path / "final_model" / "adapter").eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        lm, la = merged(ids).logits, adapted(ids).logits
        l0 = build_tiny_model(seed=0)[0](ids).logits
    assert torch.allclose(lm, la, atol=1e-5), (lm - la).abs().max()
    assert (lm - l0).abs().max() > 1e-4, "the trained adapter changes the model"


def test_probe_accepts_the_lora_final_model(tmp_path):
    from grpo_lens.probe.config import ProbeConfig
    from grpo_lens.probe.run import run_probe

    run = train(lora_config(tmp_path / "run", max_steps=1, lens_every=0))
    out = run_probe(
        ProbeConfig(
            model=str(run.path / "final_model"),
            rewards=["test_parity"],
            group_sizes=[4],
            prompts=4,
            max_new_tokens=6,
            device="cpu",
            out=str(tmp_path / "probe"),
        )
    )
    assert (out / "probe.json").is_file()


def test_adapter_and_full_space_gradients_obey_the_chain_rule(fresh_tiny_model_and_tokenizer):
    # With W' = W + s B A (s = alpha / r) in a layer, the rollout's gradient with respect to the frozen W equals its
    # gradient with respect to W' of the merged model, and the adapter's gradients follow from it:
    #   grad_B = s grad_W A^T,   grad_A = s B^T grad_W.
    # lora_rollout_grads("full", projection="identity") must give grad_W exactly; ("trainable") grad_A, grad_B.
    from grpo_lens.gradients.exact import exact_rollout_grads
    from grpo_lens.gradients.lora_spaces import lora_rollout_grads
    from grpo_lens.gradients.params import linear_layer_names, param_slices
    from grpo_lens.lora import apply_lora, merged_copy
    from grpo_lens.rollout import sample_groups
    from grpo_lens.tasks import get_task

    model, tok = fresh_tiny_model_and_tokenizer
    r, alpha = 4, 8.0
    peft_model = apply_lora(model, r, alpha, ["q_proj"]).double()
    with torch.no_grad():  # a non-zero B, so that both chain-rule terms are non-trivial
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype) * 0.3)
    examples = get_task("arithmetic").sample(1, seed=0)
    batch = sample_groups(peft_model, tok, examples, 2, max_new_tokens=5, temperature=1.0, generator_seed=0)

    full = lora_rollout_grads(
        peft_model, batch, "full", projection="identity", dtype=torch.float64
    )  # [2, sum d_out d_in]
    adapter = lora_rollout_grads(peft_model, batch, "trainable")  # [2, P_adapter]
    merged = merged_copy(peft_model).requires_grad_(True)  # peft froze the base weights it merged into
    layer = "model.layers.1.self_attn.q_proj"
    exact_w = exact_rollout_grads(merged, batch, params=[f"{layer}.weight"])  # [2, d_out d_in]
    d_out, d_in = merged.get_submodule(layer).weight.shape

    # the full-space rows hold every base linear layer in module order; find this layer's block
    names = linear_layer_names(peft_model, lambda n: "lora_" not in n)
    sizes = [peft_model.get_submodule(n).weight.numel() for n in names]
    k = names.index(f"base_model.model.{layer}.base_layer")
    start = sum(sizes[:k])
    torch.testing.assert_close(full[:, start : start + d_out * d_in], exact_w, rtol=1e-9, atol=1e-12)

    slices = param_slices(peft_model)
    pre = f"base_model.model.{layer}"
    A = peft_model.get_parameter(f"{pre}.lora_A.default.weight")  # [r, d_in]
    B = peft_model.get_parameter(f"{pre}.lora_B.default.weight")  # [d_out, r]
    s = alpha / r
    for i in range(2):
        g_w = exact_w[i].view(d_out, d_in)
        g_a = adapter[i, slices[f"{pre}.lora_A.default.weight"]].view(r, d_in)
        g_b = adapter[i, slices[f"{pre}.lora_B.default.weight"]].view(d_out, r)
        torch.testing.assert_close(g_b, s * g_w @ A.detach().T, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(g_a, s * B.detach().T @ g_w, rtol=1e-9, atol=1e-12)
        assert g_w.abs().max() > 1e-6


def test_bad_lora_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="lora_rank"):
        lora_config(tmp_path / "x", lora_rank=-1)
    with pytest.raises(ConfigError, match="lens_space"):
        lora_config(tmp_path / "x", lens_space="adapter")
    with pytest.raises(ValueError, match="linear layers are named .*q_proj"):
        train(lora_config(tmp_path / "y", lora_target_modules=["qproj"]))
    assert not (tmp_path / "y").exists()
