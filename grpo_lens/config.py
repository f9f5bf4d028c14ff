"""The one training configuration: a dataclass whose field help is the CLI help and whose names are the YAML keys.

Load order: defaults <- YAML file (``--config``) <- command-line flags (``--group-size 8``). Every value is checked in
``__post_init__``; a bad one raises :class:`ConfigError` naming the field and how to fix it, before any model loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml

from grpo_lens.formulas.advantages import ADVANTAGE_ESTIMATORS, STD_CONVENTIONS
from grpo_lens.formulas.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS
from grpo_lens.formulas.overlong import OVERLONG_MODES
from grpo_lens.trackers import REPORT_TO


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and how to fix it."""


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a CUDA device is available, else ``cpu``; other values are checked.

    Raises:
        ConfigError: a CUDA device is asked for but torch sees none (a CPU build of torch, or no GPU).
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: torch sees no CUDA device (torch {torch.__version__}, "
                          f"torch.cuda.is_available() is False); use --device cpu, or install a CUDA build of torch "
                          f"into .venv first")
    return device


def option(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field whose ``help`` is its CLI help (``kw`` adds metadata, e.g. ``item_type`` of a list)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


class ConfigFile:
    """YAML and dict round-trips shared by the config dataclasses (TrainConfig, ProbeConfig, DemoConfig)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (YAML-serialisable)."""
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Any:
        """Build from a mapping; unknown keys raise ConfigError listing the valid ones."""
        known = {f_.name for f_ in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(known))}")
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> Any:
        """Read a YAML file and apply ``overrides`` on top.

        Raises:
            ConfigError: missing or unreadable file, not a mapping, unknown keys, invalid values.
        """
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            values = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {yaml_error_line(e)}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"config file {p} must hold a mapping of field: value, got {type(values).__name__}")
        values.update(overrides or {})
        return cls.from_dict(values)


@dataclass
class TrainConfig(ConfigFile):
    """Everything a GRPO run needs. Field help doubles as CLI help (flags use dashes: ``--group-size``)."""

    # --- what to train on ------------------------------------------------------------------------------------------
    model: str = option("smollm2-135m-instruct", "Policy model: an alias (smollm2-135m-instruct, tiny), a local Hugging "
                    "Face directory, a hub id, or a .gguf file.")
    task: str = option("arithmetic", "Task giving prompts and reference answers: arithmetic, gsm8k, or jsonl (with "
                   "--dataset).")
    dataset: str | None = option(None, "Path to a JSONL file (or a Hugging Face dataset name) with a 'prompt' column; "
                             "other columns are passed to reward functions. Used by --task jsonl.")
    task_options: dict = option({}, "Task options as a YAML mapping, e.g. '{max_operand: 9}' for arithmetic.")
    rewards: list = option(["correctness"], "Reward functions, each NAME or NAME:WEIGHT; their weighted sum is the "
                       "reward.")
    reward_timeout: float = option(10.0, "Seconds a reward function may take for one step's batch before the rollouts "
                               "it was scoring are marked invalid.")
    # --- sampling ----------------------------------------------------------------------------------------------------
    group_size: int = option(8, "R: completions sampled per prompt (the group). At least 2.")
    prompts_per_step: int = option(4, "B: prompts per optimizer step, so B*R rollouts per step.")
    rollout_batch_size: int | None = option(None, "Rollouts per step (B*R); if set it must be a multiple of group_size "
                                        "and replaces prompts_per_step.")
    max_new_tokens: int = option(24, "Longest completion in tokens (T_max); longer ones are cut and flagged truncated.")
    temperature: float = option(0.7, "Sampling temperature; log-probs (sampler, policy, reference) are those of the "
                            "temperature-scaled distribution (docs/theory.md).")
    top_p: float = option(1.0, "Nucleus sampling mass in (0, 1]; 1 disables. Shapes sampling only, not log-probs.")
    top_k: int = option(0, "Top-k sampling; 0 disables. Shapes sampling only, not log-probs.")
    dynamic_sampling: bool = option(False, "DAPO dynamic sampling (arXiv 2503.14476): sample extra rounds of prompts "
                                "until the step has prompts_per_step groups whose rewards are not all equal; at the "
                                "cap trains on the mixed groups found (logged as dynamic/mixed_groups).")
    dynamic_sampling_max_rounds: int = option(3, "Cap on dynamic sampling's extra sampling rounds per step.")
    overlong: str = option("none", "Completions cut at max_new_tokens: none, mask (advantage 0, kept in group "
                           "statistics and the loss normaliser), filter (DAPO overlong filtering: their tokens leave "
                           "the loss and its normaliser), soft-punish (DAPO's length penalty, eq. 13, added to the "
                           "reward). DAPO arXiv 2503.14476; docs/theory.md.")
    overlong_max_length: int | None = option(None, "soft-punish: L_max, the length past which the penalty is -1 "
                                             "(unset: max_new_tokens).")
    overlong_buffer: int | None = option(None, "soft-punish: L_cache, the width of the interval before L_max over "
                                         "which the penalty falls linearly from 0 to -1 (unset: L_max // 5, DAPO's "
                                         "4096 of 20480).")
    mask_truncated: bool = option(False, "Deprecated alias of --overlong mask (kept so that old runs' configs load "
                                  "and resume).")
    # --- advantages and loss -----------------------------------------------------------------------------------------
    estimator: str = option("grpo", "Advantage estimator: " + ", ".join(ADVANTAGE_ESTIMATORS.names()) + ".")
    std: str = option("sample", "Std convention for grpo: sample (ddof 1, TRL/verl default) or population (ddof 0).")
    eps: float = option(1e-4, "Added to the group std in grpo's advantage denominator (> 0).")
    loss_aggregation: str = option("seq-mean-token-mean", "How token losses become one number: "
                               + ", ".join(LOSS_AGGREGATIONS.names())
                               + " (GRPO, Dr. GRPO arXiv 2503.20783, DAPO arXiv 2503.14476).")
    beta: float = option(0.0, "KL coefficient against the frozen reference model (0 = no reference model).")
    kl_estimator: str = option("k3", "KL estimator (Schulman 2020): " + ", ".join(KL_ESTIMATORS.names()) + ".")
    eps_low: float = option(0.2, "Lower clip range: ratios below 1 - eps_low are clipped for A < 0.")
    eps_high: float = option(0.2, "Upper clip range: ratios above 1 + eps_high are clipped for A > 0 (DAPO's "
                         "clip-higher uses 0.28).")
    dual_clip: float | None = option(None, "Dual-clip bound c > 1 on the loss of A < 0 tokens (Ye et al. 2020); "
                                 "unset disables.")
    tis_cap: float | None = option(None, "Truncated importance sampling against sampler-trainer mismatch: weight each "
                                "token's policy loss by min(pi_old / pi_sampler, tis_cap) (Ionides 2008; Yao et al. "
                                "2025; docs/theory.md); unset disables.")
    mu: int = option(1, "Inner optimisation passes over each step's rollouts (mu in GRPO); > 1 makes the policy move "
                 "off the sampler and the clip matter.")
    num_mini_batches: int = option(1, "Optimizer steps per pass: the step's prompts are split into this many "
                               "mini-batches (must divide prompts_per_step).")
    micro_batch_size: int | None = option(None, "Rollouts per forward/backward (gradient accumulation; the gradient "
                                      "does not depend on it). Unset: picked per mini-batch from the model's shape "
                                      "and the machine's total memory (the whole mini-batch when it fits).")
    # --- optimizer ---------------------------------------------------------------------------------------------------
    max_steps: int = option(30, "Optimizer steps (sampling rounds) to train for.")
    learning_rate: float = option(5e-6, "AdamW learning rate.")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    adam_beta1: float = option(0.9, "AdamW beta1.")
    adam_beta2: float = option(0.99, "AdamW beta2.")
    max_grad_norm: float = option(1.0, "Clip the gradient's global L2 norm to this (0 disables).")
    max_consecutive_skips: int = option(3, "A step whose loss or gradient is non-finite is skipped (no optimizer "
                                        "change); stop with an error after this many consecutive skipped steps.")
    # --- lens --------------------------------------------------------------------------------------------------------
    lens_every: int = option(5, "Measure the gradient lens (rank, sparsity, baselines) at the first step, every this "
                         "many steps and the last step (0 = never).")
    lens_sketch_dim: int = option(16, "Side of the random projection per linear layer for sketched per-rollout "
                              "gradients (k_in = k_out): sketch dims per layer = this squared. Also sets the sketch "
                              "of --estimator optimal's squared gradient norms.")
    lens_from_update: bool = option(True, "Take the lens's sketched per-rollout gradients from the update's own "
                                "first pass when the loss allows it (beta 0, no tis_cap, one mini-batch, nonzero "
                                "advantages in the mixed groups): the same numbers without the lens's extra forward "
                                "and backward. Off: the lens always runs its own pass.")
    lens_space: str = option("trainable", "Parameter space of the lens's per-rollout gradients: trainable (with LoRA "
                         "the adapter's parameters, exact; without LoRA every linear layer, sketched) or full (every "
                         "linear layer's full weight, sketched; with LoRA the frozen base weights, what full "
                         "fine-tuning would follow).")
    # --- LoRA (peft) -------------------------------------------------------------------------------------------------
    lora_rank: int = option(0, "LoRA rank r (Hu et al. 2021, arXiv 2106.09685) through peft; 0 trains every parameter "
                        "(full fine-tuning).")
    lora_alpha: float = option(32.0, "LoRA scale numerator: the update is lora_alpha / lora_rank * B A.")
    lora_target_modules: list = option(["all-linear"], "Module names LoRA adapts (e.g. q_proj v_proj), or all-linear "
                                   "(every linear layer but the output head).")
    # --- run ---------------------------------------------------------------------------------------------------------
    seed: int = option(0, "Random seed (prompts, sampling, projections).")
    dtype: str = option("float32", "Precision: float32; bfloat16 (bf16 weights and optimizer state: half the memory, "
                    "but updates below bf16's resolution are lost); bf16-mixed (float32 weights and optimizer, every "
                    "forward under bf16 autocast: the usual GPU setting).")
    device: str = option("auto", "cpu, cuda, cuda:N or auto.")
    out: str | None = option(None, "Run directory (config.yaml, metrics.jsonl, checkpoints/).")
    resume: bool = option(False, "Continue the run in --out from its last checkpoint.")
    overwrite: bool = option(False, "Replace a different run already in --out.")
    checkpoint_every: int = option(10, "Write a checkpoint every this many steps (and at the end).")
    keep_checkpoints: int = option(2, "How many recent checkpoints to keep.")
    save_final_model: bool = option(True, "Save the trained policy and tokenizer as a Hugging Face folder in "
                                    "RUN/final_model at the end (loadable with --model RUN/final_model).")
    report_to: list = option(["none"], "Experiment trackers that get every metrics record too: none, tensorboard, "
                             "wandb (WANDB_MODE=offline works without a network), trackio; metrics.jsonl stays the "
                             "source of truth.")
    log_completions: int = option(2, "Completions per step written to completions.jsonl (0 = none).")
    progress: bool = option(True, "Show a progress bar.")

    def __post_init__(self) -> None:
        self.validate()

    def overlong_length(self) -> int:
        """L_max of soft-punish: ``overlong_max_length``, or ``max_new_tokens`` when unset."""
        return self.overlong_max_length if self.overlong_max_length is not None else self.max_new_tokens

    def overlong_cache(self) -> int:
        """L_cache of soft-punish: ``overlong_buffer``, or max(1, L_max // 5) when unset."""
        return self.overlong_buffer if self.overlong_buffer is not None else max(1, self.overlong_length() // 5)

    # ------------------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every field; raise :class:`ConfigError` naming the first bad one."""

        def bad(name: str, why: str) -> None:
            raise ConfigError(f"config field '{name}' (flag --{name.replace('_', '-')}) = {getattr(self, name)!r}: "
                              f"{why}")

        def choice(name: str, valid: list[str] | tuple[str, ...]) -> None:
            if getattr(self, name) not in valid:
                bad(name, f"unknown name; valid names: {', '.join(sorted(valid))}")

        if isinstance(self.rewards, str):  # YAML `rewards: correctness` means a list of one
            self.rewards = [self.rewards]
        for f_ in fields(self):  # types first: a YAML file can hold anything
            value = getattr(self, f_.name)
            want = _base_type(f_.type)
            if value is None and _is_optional(f_.type):
                continue
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                setattr(self, f_.name, float(value))
                continue
            if want is float and isinstance(value, str):  # YAML 1.1 reads '1e-3' (no dot) as a string
                try:
                    value = float(value)
                    setattr(self, f_.name, value)
                except ValueError:
                    pass
            if want is not None and not isinstance(value, want) or (want is int and isinstance(value, bool)):
                bad(f_.name, f"must be of type {want.__name__}")
            if want is float and not math.isfinite(value):
                bad(f_.name, "must be a finite number")

        if self.group_size < 2:
            bad("group_size", "GRPO needs at least 2 completions per prompt to form a baseline; use 2 or more")
        if self.rollout_batch_size is not None:
            if self.rollout_batch_size < 1 or self.rollout_batch_size % self.group_size:
                bad("rollout_batch_size", f"must be a positive multiple of group_size={self.group_size} (whole "
                    f"groups); e.g. {self.group_size * max(1, self.rollout_batch_size // self.group_size)}")
            self.prompts_per_step = self.rollout_batch_size // self.group_size
        if self.prompts_per_step < 1:
            bad("prompts_per_step", "must be >= 1")
        if self.max_new_tokens < 1:
            bad("max_new_tokens", "must be >= 1 token")
        if self.temperature <= 0:
            bad("temperature", "must be > 0 (sampling needs it; use a small value like 0.1 for near-greedy)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            bad("top_k", "must be >= 0 (0 disables)")
        choice("estimator", ADVANTAGE_ESTIMATORS.names())
        choice("std", STD_CONVENTIONS)
        if self.eps <= 0:
            bad("eps", "must be > 0 (it keeps the advantage finite when the group std is tiny)")
        choice("loss_aggregation", LOSS_AGGREGATIONS.names())
        if self.beta < 0:
            bad("beta", "must be >= 0")
        choice("kl_estimator", KL_ESTIMATORS.names())
        if not 0 <= self.eps_low < 1:
            bad("eps_low", "must be in [0, 1)")
        if self.eps_high < 0:
            bad("eps_high", "must be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            bad("dual_clip", "must be > 1, or unset to disable")
        choice("overlong", OVERLONG_MODES)
        if self.mask_truncated:  # the deprecated alias
            if self.overlong == "none":
                self.overlong = "mask"
            elif self.overlong != "mask":
                bad("mask_truncated", f"is the deprecated alias of --overlong mask and contradicts --overlong "
                    f"{self.overlong}; drop --mask-truncated")
        if self.overlong_max_length is not None and not 1 <= self.overlong_max_length <= self.max_new_tokens:
            bad("overlong_max_length", f"must be in [1, max_new_tokens = {self.max_new_tokens}], or unset")
        if self.overlong_buffer is not None and not 1 <= self.overlong_buffer <= self.overlong_length():
            bad("overlong_buffer", f"must be in [1, L_max = {self.overlong_length()}], or unset")
        if self.tis_cap is not None and not self.tis_cap > 0:
            bad("tis_cap", "must be > 0 (e.g. 2.0), or unset to disable")
        if self.mu < 1:
            bad("mu", "must be >= 1")
        if self.num_mini_batches < 1 or self.prompts_per_step % self.num_mini_batches:
            bad("num_mini_batches", f"must divide prompts_per_step={self.prompts_per_step}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            bad("micro_batch_size", "must be >= 1")
        if self.max_steps < 0:
            bad("max_steps", "must be >= 0")
        if self.learning_rate <= 0:
            bad("learning_rate", "must be > 0")
        if self.weight_decay < 0:
            bad("weight_decay", "must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                bad(name, "must be in [0, 1)")
        if self.max_consecutive_skips < 1:
            bad("max_consecutive_skips", "must be >= 1")
        if self.max_grad_norm < 0:
            bad("max_grad_norm", "must be >= 0 (0 disables clipping)")
        if self.lens_every < 0:
            bad("lens_every", "must be >= 0 (0 disables the lens)")
        if self.lens_sketch_dim < 1:
            bad("lens_sketch_dim", "must be >= 1")
        if self.checkpoint_every < 1:
            bad("checkpoint_every", "must be >= 1")
        if self.keep_checkpoints < 1:
            bad("keep_checkpoints", "must be >= 1")
        if self.reward_timeout <= 0:
            bad("reward_timeout", "must be > 0 seconds")
        if self.log_completions < 0:
            bad("log_completions", "must be >= 0")
        choice("dtype", ("float32", "bfloat16", "bf16-mixed"))
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            bad("device", "use cpu, cuda, cuda:N or auto")
        if not self.rewards:
            bad("rewards", "give at least one reward function")
        if self.resume and self.overwrite:
            bad("overwrite", "--resume continues the run in --out and --overwrite replaces it: pass one of them")
        for spec in self.rewards:
            _, _, weight = str(spec).partition(":")
            if weight:
                try:
                    float(weight)
                except ValueError:
                    bad("rewards", f"{spec!r}: the weight after ':' must be a number")
        if isinstance(self.report_to, str):  # YAML `report_to: tensorboard` means a list of one
            self.report_to = [self.report_to]

        for name in self.report_to:
            if name not in REPORT_TO:
                bad("report_to", f"unknown tracker {name!r}; valid names: {', '.join(REPORT_TO)}")
        if "none" in self.report_to and len(self.report_to) > 1:
            bad("report_to", "'none' cannot be combined with a tracker; drop it")
        if self.dynamic_sampling_max_rounds < 0:
            bad("dynamic_sampling_max_rounds", "must be >= 0 (0 = only the step's own round)")
        choice("lens_space", ("trainable", "full"))
        if self.lora_rank < 0:
            bad("lora_rank", "must be >= 0 (0 = full fine-tuning)")
        if self.lora_alpha <= 0:
            bad("lora_alpha", "must be > 0")
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [self.lora_target_modules]
        if not self.lora_target_modules:
            bad("lora_target_modules", "name at least one module, or all-linear")
        if self.task == "jsonl" and not self.dataset:
            bad("task", "task 'jsonl' needs --dataset PATH")

    # ------------------------------------------------------------------------------------------------------------


def yaml_error_line(err: Exception) -> str:
    """A YAML parse error on one line: what is wrong and where (``line 3, column 7``)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(err, "context", None)
    return f"{problem}{where}" + (f" ({context})" if context else "")


# ---------------------------------------------------------------------------------------------------------------------
# CLI generation from the dataclass: one source for help, types and defaults.
# ---------------------------------------------------------------------------------------------------------------------
def _is_optional(tp: Any) -> bool:
    tp = _resolve(tp)
    return isinstance(tp, types.UnionType) and type(None) in typing.get_args(tp) or (
        typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp))


def _resolve(tp: Any) -> Any:
    if isinstance(tp, str):
        return eval(tp, {**vars(typing), "dict": dict, "list": list}, {})  # annotations are postponed strings
    return tp


def _base_type(tp: Any) -> type | None:
    tp = _resolve(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)] if _is_optional(tp) else [tp]
    base = typing.get_origin(args[0]) or args[0]
    return base if isinstance(base, type) else None


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = TrainConfig,
                         skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per dataclass field, help from the field's metadata, default None (= not given)."""
    for f_ in fields(cls):
        if f_.name in skip:
            continue
        flag = "--" + f_.name.replace("_", "-")
        base = _base_type(f_.type)
        default = f_.default if f_.default is not dataclasses.MISSING else f_.default_factory()
        help_ = f"{f_.metadata.get('help', '')} (default: {default})"
        if base is bool:
            parser.add_argument(flag, dest=f_.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif base is list:
            parser.add_argument(flag, dest=f_.name, nargs="+", type=f_.metadata.get("item_type", str), default=None,
                                help=help_)
        elif base is dict:
            parser.add_argument(flag, dest=f_.name, type=_yaml_mapping, default=None, help=help_)
        else:
            parser.add_argument(flag, dest=f_.name, type=base, default=None, help=help_)


def _yaml_mapping(text: str) -> dict:
    """argparse type of dict fields: a YAML mapping; anything else is an argparse error (exit 2, one line)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise argparse.ArgumentTypeError(f"not valid YAML ({yaml_error_line(e)}): {text!r}; expected a mapping like "
                                         "'{max_operand: 9}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a YAML mapping like '{{max_operand: 9}}', got {text!r}")
    return value


def config_from_args(args: argparse.Namespace, cls: type = TrainConfig, config_file: str | None = None) -> Any:
    """Defaults <- YAML file <- flags given on the command line."""
    overrides = {f_.name: getattr(args, f_.name) for f_ in fields(cls)
                 if getattr(args, f_.name, None) is not None}
    if config_file:
        return cls.load(config_file, overrides)
    return cls.from_dict(overrides)


def reference_markdown(cls: type = TrainConfig) -> str:
    """A Markdown table of every field of ``cls``: flag, default, help (the README's CLI reference is this)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f_ in fields(cls):
        default = f_.default if f_.default is not dataclasses.MISSING else f_.default_factory()
        help_ = f_.metadata.get("help", "").replace("|", "\\|")
        rows.append(f"| `--{f_.name.replace('_', '-')}` | `{default}` | {help_} |")
    return "\n".join(rows)
