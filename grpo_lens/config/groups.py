"""The option groups: every configuration field that more than one command has, written once with its help, default
and check. A config takes a shared field by calling its :class:`Option` (``temperature: float =
Sampling.temperature()``); a field only one command has is written in that command's config with ``option(...)``.

=========  =================================================  ======================================================
group      fields                                             used by
=========  =================================================  ======================================================
Model      model                                              train, probe, demo
TaskData   task, dataset, task_options, rewards,              train (all), probe (all but reward_timeout), demo
           reward_timeout                                     (task, dataset, task_options)
Sampling   group_size, prompts_per_step, max_new_tokens,      train (all), probe (max_new_tokens, temperature, top_p,
           temperature, top_p, top_k                          top_k), demo (group_size, prompts_per_step,
                                                              max_new_tokens)
Advantage  estimator, std, std_eps, loss_aggregation          train, probe
Lens       sketch_dim, lens_every, exact                      train (sketch_dim, lens_every), probe (sketch_dim,
                                                              exact), demo (lens_every, exact)
Optimizer  max_steps, learning_rate                           train, demo
Probing    group_sizes, prompts                               probe, demo (as probe_group_sizes, probe_prompts)
Runtime    seed, dtype, device                                train, probe, demo (seed, device)
Adapter    lora_rank                                          train, demo
Output     out, overwrite, resume, progress, report_to        train (all), probe (all), demo (out,
                                                              overwrite, report_to)
=========  =================================================  ======================================================

Overrides, each visible where the config takes the field: the demo's ``out`` defaults to ``runs/demo`` and its
``max_steps`` must be >= 1; ``out`` and ``overwrite`` name what each command writes into --out (``{contents}``,
``{what}``). The check of two fields together that every config having both runs is :func:`check_task_dataset`.
"""

from __future__ import annotations

import math

from grpo_lens.config.base import (
    ConfigError,
    ConfigFile,
    Option,
    above,
    all_of,
    at_least,
    at_most,
    one_of,
    require,
)
from grpo_lens.registry import declared_constant, declared_names
from grpo_lens.trackers import REPORT_TO

# The formulas' registries are read without importing their modules (torch): ``grpo-lens --help`` builds every flag
# from these option groups and answers at once; the checks read the live registries when they run.
_ESTIMATORS = "grpo_lens.formulas.advantages", "ADVANTAGE_ESTIMATORS"
_AGGREGATIONS = "grpo_lens.formulas.losses", "LOSS_AGGREGATIONS"
STD_CONVENTIONS = declared_constant("grpo_lens.formulas.advantages", "STD_CONVENTIONS")

#: The ``dtype`` values: float32, bf16 weights, or float32 weights with bf16 autocast forwards.
DTYPES = ("float32", "bfloat16", "bf16-mixed")
#: Sources of the per-rollout Gram matrix behind every Gram-based lens and probe quantity (Lens.gram_source).
GRAM_SOURCES = ("exact", "sketch")


def _trackers(names: list) -> str | None:
    """Check of ``report_to``: known tracker names, and ``none`` alone."""
    for name in names:
        if name not in REPORT_TO:
            return f"unknown tracker {name!r}; valid names: {', '.join(REPORT_TO)}"
    if "none" in names and len(names) > 1:
        return "'none' cannot be combined with a tracker; drop it"
    return None


def _reward_specs(specs: list) -> str | None:
    """Check of ``rewards``: at least one ``NAME`` or ``NAME:WEIGHT``, each weight a finite number."""
    if not specs:
        return "give at least one reward function"
    for spec in specs:
        _, _, weight = str(spec).partition(":")
        if weight:
            try:
                value = float(weight)
            except ValueError:
                return f"{spec!r}: the weight after ':' must be a number"
            if not math.isfinite(value):
                return (
                    f"{spec!r}: the weight after ':' must be a finite number (a NaN or infinite weight makes "
                    f"every reward NaN), e.g. {str(spec).partition(':')[0]}:0.1"
                )
    return None


class Model:
    """The model a command loads."""

    model = Option(
        "smollm2-135m-instruct",
        "Model: an alias (smollm2-135m-instruct, tiny), a local Hugging Face "
        "directory (e.g. a trained run's final_model/), a hub id, or a .gguf file.",
    )


class TaskData:
    """Where prompts, reference answers and rewards come from."""

    task = Option(
        "arithmetic", "Task giving prompts and reference answers: arithmetic, gsm8k, or jsonl (with --dataset)."
    )
    dataset = Option(
        None,
        "Path to a JSONL file (or a Hugging Face dataset name) with a 'prompt' column; other "
        "columns are passed to reward functions. Used by --task jsonl.",
    )
    task_options = Option({}, "Task options as a YAML mapping, e.g. '{max_operand: 9}' for arithmetic.")
    rewards = Option(
        ["correctness"],
        "Reward functions, each NAME or NAME:WEIGHT; their weighted sum is the reward.",
        check=_reward_specs,
        scalar_is_list=True,
    )
    reward_timeout = Option(
        10.0,
        "Seconds a reward function may take for one step's batch before the rollouts it was "
        "scoring are marked invalid.",
        check=above(0, "must be > 0 seconds"),
    )


#: The largest group size R: a group's R rollouts are sampled in one batch and its R x R Grams kept (R = 10^9 failed
#: in a 488 GB allocation after config.yaml was written).
MAX_GROUP_SIZE = 4096
MAX_GROUP_SIZE_WHY = f"must be at most {MAX_GROUP_SIZE:,} (R rollouts per prompt and R x R Grams are held in memory)"


class Sampling:
    """How many completions are sampled, and how."""

    group_size = Option(
        8,
        "R: completions sampled per prompt (the group). At least 2.",
        check=all_of(
            at_least(2, "GRPO needs at least 2 completions per prompt to form a baseline; use 2 or more"),
            at_most(MAX_GROUP_SIZE, MAX_GROUP_SIZE_WHY),
        ),
    )
    prompts_per_step = Option(4, "B: prompts per optimizer step, so B*R rollouts per step.", check=at_least(1))
    max_new_tokens = Option(
        24,
        "Longest completion in tokens (T_max); longer ones are cut and flagged truncated.",
        check=at_least(1, "must be >= 1 token"),
    )
    temperature = Option(
        0.7,
        "Sampling temperature; log-probs (sampler, policy, reference) are those of the "
        "temperature-scaled distribution (docs/theory.md).",
        check=above(0, "must be > 0 (sampling needs it; use a small value like 0.1 for near-greedy)"),
    )
    top_p = Option(
        1.0,
        "Nucleus sampling mass in (0, 1]; 1 disables. Shapes sampling only, not log-probs.",
        check=require(lambda p: 0 < p <= 1, "must be in (0, 1]"),
    )
    top_k = Option(
        0,
        "Top-k sampling; 0 disables. Shapes sampling only, not log-probs.",
        check=at_least(0, "must be >= 0 (0 disables)"),
    )


#: Why ``eps`` was renamed ``std_eps`` (its deprecation warning says it): it is not TRL's ``epsilon``.
EPS_NOTE = (
    "it is the epsilon added to the group std in grpo's advantage; TRL's epsilon, the clip range, is "
    "--epsilon / --eps-low"
)


class Advantage:
    """The advantage estimator and how token losses are aggregated (docs/theory.md §2, §3)."""

    estimator = Option(
        "grpo",
        "Advantage estimator: " + ", ".join(declared_names(*_ESTIMATORS)) + ".",
        check=one_of(lambda: declared_names(*_ESTIMATORS)),
    )
    std = Option(
        "sample",
        "Std convention for grpo and the batch-level estimators: sample (ddof 1, TRL/verl default) or "
        "population (ddof 0).",
        check=one_of(STD_CONVENTIONS),
    )
    std_eps = Option(
        1e-4,
        "Added to the group std in grpo's advantage denominator (> 0): A = (r - mean) / (std + "
        "std_eps); to the batch std in grpo_batch and reinforce_pp*. Not TRL's epsilon, which is the "
        "clip range (--eps-low / --epsilon).",
        check=above(0, "must be > 0 (it keeps the advantage finite when the group std is tiny)"),
    )
    loss_aggregation = Option(
        "seq-mean-token-mean",
        "How token losses become one number: "
        + ", ".join(declared_names(*_AGGREGATIONS))
        + " (GRPO, Dr. GRPO arXiv 2503.20783, DAPO arXiv 2503.14476).",
        check=one_of(lambda: declared_names(*_AGGREGATIONS)),
    )


#: Why ``exact`` is refused (a ConfigError naming the new key): the dense oracle is ``dense_oracle`` since 0.3, and
#: ``exact`` is a value of ``gram_source`` (the default exact Gram from one batched backward), not a switch.
EXACT_REFUSAL = (
    "renamed dense_oracle (--dense-oracle), the dense per-rollout gradient oracle; "
    "'--gram-source exact' is the default exact Gram"
)


class Lens:
    """How per-rollout gradients are measured: the sketch, the exact alternative, how often the trainer's lens runs."""

    sketch_dim = Option(
        16,
        "Side of the random projection per linear layer for sketched per-rollout gradients "
        "(both sides, sketch_in = sketch_out): sketch dims per layer = this squared. Also sets the sketch of "
        "--estimator optimal's squared gradient norms.",
        check=at_least(1),
    )
    lens_every = Option(
        5,
        "Measure the gradient lens (rank, sparsity, baselines) at the first step, every this many "
        "steps and the last step (0 = never).",
        check=at_least(0, "must be >= 0 (0 disables the lens)"),
    )
    dense_oracle = Option(
        False,
        "The dense oracle: exact per-rollout gradient vectors of all parameters (one backward per "
        "rollout; memory R x P floats) instead of the sketch, for the Gram and G3 alike (not "
        "--gram-source exact, the default Gram from one batched backward).",
    )
    gram_source = Option(
        "exact",
        "Source of the per-rollout Gram matrix behind every Gram-based number (ranks, "
        "span energies, permutation tests, the identity residual, b*): exact (every parameter, "
        "from one batched backward; docs/theory.md §Exact Gram) or sketch (the LoGra sketch of "
        "the nn.Linear weights, the earlier default). The sketch still gives what needs "
        "vectors (G3 across groups); --dense-oracle (dense vectors, the oracle) overrides both.",
        check=one_of(GRAM_SOURCES),
    )


class Optimizer:
    """How long and how fast the policy is trained."""

    max_steps = Option(30, "Optimizer steps (sampling rounds) to train for.", check=at_least(0))
    learning_rate = Option(5e-6, "AdamW learning rate.", check=above(0))


class Probing:
    """Which group sizes the probe measures, on how many prompts."""

    group_sizes = Option(
        [2, 4, 8],
        "Group sizes R to probe.",
        item_type=int,
        check=require(
            lambda sizes: sizes and all(isinstance(R, int) and 2 <= R <= MAX_GROUP_SIZE for R in sizes),
            f"each group size must be an integer >= 2 and <= {MAX_GROUP_SIZE:,}",
        ),
    )
    prompts = Option(
        0,
        "Prompts sampled for each R: a fixed number, and every mixed group among them is analysed, so "
        "S1 and the per-group means are unbiased. 0 = max(24, 128 / R): 64, 32, 24 for R = 2, 4, 8.",
        check=at_least(0, "must be >= 0 (0 = the default max(24, 128 / R))"),
    )


class Runtime:
    """Seed, precision and device."""

    seed = Option(
        0,
        "Random seed (prompts, sampling, projections).",
        check=require(
            lambda seed: -(2**63) <= seed < 2**64,
            "must be between -2**63 and 2**64 - 1 (the range torch.manual_seed takes)",
        ),
    )
    dtype = Option(
        "float32",
        "Precision: float32; bfloat16 (bf16 weights and optimizer state: half the memory, but "
        "updates below bf16's resolution are lost); bf16-mixed (float32 weights and optimizer, every "
        "forward under bf16 autocast: the usual GPU setting).",
        check=one_of(DTYPES),
    )
    device = Option(
        "auto",
        "cpu, cuda, cuda:N or auto.",
        check=require(lambda d: d in ("auto", "cpu", "cuda") or d.startswith("cuda:"), "use cpu, cuda, cuda:N or auto"),
    )


class Adapter:
    """LoRA through peft."""

    lora_rank = Option(
        0,
        "LoRA rank r (Hu et al. 2021, arXiv 2106.09685) through peft; 0 trains every parameter (full fine-tuning).",
        check=at_least(0, "must be >= 0 (0 = full fine-tuning)"),
    )


class Output:
    """Where a command writes, and how."""

    out = Option(None, "Output directory ({contents}).")
    overwrite = Option(False, "Replace {what} in --out.")
    resume = Option(False, "Continue {what}.")
    progress = Option(True, "Show a progress bar.")
    report_to = Option(
        ["none"],
        "Experiment trackers that get every metrics record too: none, tensorboard, "
        "wandb (WANDB_MODE=offline works without a network), trackio; metrics.jsonl stays the "
        "source of truth.",
        check=_trackers,
    )


#: Every option group, in the order the configs list them.
GROUPS = (Model, TaskData, Sampling, Advantage, Lens, Optimizer, Probing, Runtime, Adapter, Output)


def check_task_dataset(config: ConfigFile) -> None:
    """The check of ``task`` and ``dataset`` together, run by every config that has both: jsonl needs --dataset.

    Raises:
        ConfigError: ``task == "jsonl"`` without a dataset.
    """
    if config.task == "jsonl" and not config.dataset:  # type: ignore[attr-defined]
        config.bad("task", "task 'jsonl' needs --dataset PATH")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a CUDA device is available, else ``cpu``; other values are checked.

    Raises:
        ConfigError: a CUDA device is asked for but torch sees none (a CPU build of torch, or no GPU).
    """
    import torch  # here, not at the top: the option groups build ``grpo-lens --help`` without torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"--device {device}: torch sees no CUDA device (torch {torch.__version__}, "
            f"torch.cuda.is_available() is False); use --device cpu, or install a CUDA build of torch "
            f"into .venv first"
        )
    return device
