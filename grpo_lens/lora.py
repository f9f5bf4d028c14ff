"""LoRA through peft: wrap the policy, name its parameter spaces for the lens, save it merged and adapter-only.

With ``--lora-rank r`` each targeted linear layer W [out, in] becomes W + (alpha / r) B A with A [r, in], B [out, r]
trainable and W frozen (Hu et al. 2021, arXiv 2106.09685, eq. 3; peft's ``LoraConfig``). The optimizer, the gradient
clipping, the checkpoints and the lens's update sparsity (S4) then see only the adapter parameters.

The lens measures per-rollout gradients in one of two spaces (``--lens-space``):

- ``trainable`` (default): the gradient of every trainable parameter -- with LoRA the adapter's A and B, measured
  exactly (one backward per rollout; the adapter is small), which is the space the update moves in;
- ``full``: the gradient with respect to every frozen base weight W of the linear layers, as full fine-tuning would
  follow it (sketched, the base space is large). Because the frozen W sits in the same forward pass, its gradient
  is delta^T x of the base layer, read by hooks on the base layers without updating W.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Name fragment of peft's adapter modules (``...q_proj.lora_A.default``); base layers are ``...q_proj.base_layer``.
ADAPTER_MARK = "lora_"


def is_lora(model: torch.nn.Module) -> bool:
    """True when ``model`` is a peft model (a policy wrapped by :func:`apply_lora`)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def apply_lora(
    model: torch.nn.Module, rank: int, alpha: float, target_modules: list[str], linear_layers: Iterable[str] = ()
) -> torch.nn.Module:
    """Wrap ``model`` with a fresh LoRA adapter (A random, B = 0: the wrapped model computes what ``model`` did).

    Args:
        model: a transformers causal LM.
        rank: r >= 1.  alpha: the scale numerator (update = alpha / r * B A).
        target_modules: module-name suffixes to adapt (e.g. ``q_proj v_proj``) or ``all-linear`` (every linear layer
            but the output head).
        linear_layers: the model's linear-layer names, from the caller
            (:func:`grpo_lens.gradients.params.linear_layer_names`: nn.Linear and GPT-2's Conv1D); only the error for
            unmatched ``target_modules`` reads them, to list the names that would match.

    Returns:
        the ``peft.PeftModel``; only the adapter's parameters require grad.

    Raises:
        ImportError: peft is not installed (names the extra).  ValueError: no module matches ``target_modules``.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError(
            "--lora-rank needs peft: pip install '.[lora]' in the grpo-lens folder (or pip install peft)"
        ) from None
    targets: Any = "all-linear" if list(target_modules) == ["all-linear"] else list(target_modules)
    # peft's annotation says int; it takes a float
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n in linear_layers})
        raise ValueError(
            f"--lora-target-modules {' '.join(target_modules)}: {str(e).splitlines()[0][:200]}; this "
            f"model's linear layers are named {', '.join(names)} (or use all-linear)"
        ) from None


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain transformers model with the adapter folded into the base weights (W + alpha/r B A); ``model`` is
    left as it was."""
    # nn.Module types a transformers/peft model's attribute as Tensor | Module
    return copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]


def save_lora_model(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """Write the merged model + tokenizer into ``path`` (loadable as ``--model path`` without peft) and the adapter
    alone into ``path/adapter`` (``PeftModel.from_pretrained(base, path/adapter)``)."""
    # nn.Module types a transformers/peft model's attribute as Tensor | Module
    merged_copy(model).save_pretrained(path)  # type: ignore[operator]
    tokenizer.save_pretrained(path)
    # nn.Module types a transformers/peft model's attribute as Tensor | Module
    model.save_pretrained(path / "adapter")  # type: ignore[operator]
