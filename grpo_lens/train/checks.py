"""The trainer's start-up checks: everything ``grpo-lens train`` refuses before it writes --out (inputs, parallelism,
tokenizer files, the model, the prompts against the model's context, a resumed run's config and dataset), each a
one-line error, and the warnings it gives at start.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from grpo_lens import metrics as mk
from grpo_lens.config import TrainConfig
from grpo_lens.gradients.params import linear_layer_names
from grpo_lens.models import resolve_model
from grpo_lens.rewards import RewardState, check_rewards_on_example, parse_reward_specs
from grpo_lens.rollout import PromptFormatError, prompt_lengths
from grpo_lens.rundir import (
    RunDir,
    RunDirError,
    read_records,
    read_saved_config,
)
from grpo_lens.runtime.processes import Processes
from grpo_lens.tasks import Task, get_task
from grpo_lens.tasks.user_data import file_fingerprint
from grpo_lens.trackers import check_trackers
from grpo_lens.train.schedule import warmup_steps
from grpo_lens.train.state import Models

logger = logging.getLogger("grpo_lens.train.loop")  # the trainer's one log, as before the split


#: Config fields that may change when a run is resumed (they do not change any step already taken).
RESUMABLE_KEYS = (
    "max_steps",
    "progress",
    "save_final_model",
    "checkpoint_every",
    "keep_checkpoints",
    "log_completions",
    "device",
    "report_to",
    "reward_timeout",
    "max_consecutive_skips",
    "metric_names",
    "allow_dataset_change",
)

#: Config fields the trainer writes itself (what it found of --dataset): never compared with what was given.
RECORDED_KEYS = ("dataset_sha256", "dataset_rows")


# ---------------------------------------------------------------------------------------------------------------------
# Set-up: checks, models, the run directory
# ---------------------------------------------------------------------------------------------------------------------
def check_inputs(config: TrainConfig, procs: Processes) -> tuple[Any, list[tuple[str, float]]]:
    """Everything about the inputs that can be checked without loading a model; returns (task, reward specs).

    Builds the task (which validates every data row), parses the reward specs, calls every reward function once on
    one row with the empty completion (:func:`grpo_lens.rewards.check_rewards_on_example`) and resolves the model
    name, so that a bad input fails before the run directory is written or a model loads.

    Raises:
        ValueError: prompts_per_step not divisible by the number of processes (or its per-process share by
            num_mini_batches), an unknown task or reward (listing the valid names), bad task options, a malformed
            data row (naming file and row), a reward function that fails on one row of the data.
        ModelNotFoundError: the model path does not exist.
    """
    if config.prompts_per_step % procs.world:
        raise ValueError(
            f"config field 'prompts_per_step' = {config.prompts_per_step} must be divisible by the "
            f"number of processes ({procs.world}) so that each process samples whole groups"
        )
    share = config.prompts_per_step // procs.world
    if share % config.num_mini_batches:  # optimizer step k takes the k-th chunk of every process's prompts
        raise ValueError(
            f"config field 'num_mini_batches' = {config.num_mini_batches} must divide the prompts each "
            f"of the {procs.world} processes holds (prompts_per_step / processes = {share})"
        )
    task = get_task(config.task, dataset=config.dataset, **config.task_options)
    # task.data: checked with getattr
    if config.prompt_order == "epoch" and not (isinstance(getattr(task, "data", None), dict) and "train" in task.data):  # type: ignore[attr-defined]
        raise ValueError(
            f"--prompt-order epoch needs a dataset (--task jsonl --dataset FILE); task {config.task!r} draws "
            f"its prompts itself, so it has no epochs here: use --prompt-order independent"
        )
    reward_fns = parse_reward_specs(config.rewards)
    (example,) = task.sample(1, seed=config.seed)  # every reward function callable with the data's columns
    check_rewards_on_example(
        reward_fns,
        example.prompt,
        example.columns(),
        config.reward_timeout,
        where=f"a row of task {config.task!r}",
        trainer_state=RewardState(0, config.max_steps),
    )
    check_parallelism(config, procs)
    if config.dynamic_sampling and procs.world > 1:
        raise ValueError(
            "--dynamic-sampling runs in one process only for now (processes would keep different "
            "numbers of groups); drop it or run one process"
        )
    if config.lora_rank > 0 and importlib.util.find_spec("peft") is None:
        raise ValueError(
            "--lora-rank needs the peft package: pip install '.[lora]' in the grpo-lens folder (or pip install peft)"
        )
    if procs.is_main:
        check_trackers(config.report_to)  # a missing tracker library fails before --out is touched
    check_tokenizer_files(resolve_model(config.model))
    return task, reward_fns


def check_parallelism(config: TrainConfig, procs: Processes) -> None:
    """``--parallelism fsdp2`` needs several processes and is refused with the options it does not support yet.

    Raises:
        ValueError: fsdp2 with one process, with LoRA (``lora_rank`` > 0) or with ``--estimator optimal`` (its
            per-rollout backwards differ in number between processes), naming the alternative.
    """
    if config.parallelism != "fsdp2":
        return
    if procs.world < 2:
        raise ValueError(
            "--parallelism fsdp2 shards the policy over several processes and this run has 1: launch "
            "it with torchrun --nproc_per_node N (N >= 2) or accelerate launch --num_processes N, or use "
            "--parallelism ddp (the default)"
        )
    if config.lora_rank > 0:
        raise ValueError("--parallelism fsdp2 with LoRA (--lora-rank) is not supported; use --parallelism ddp")
    if config.estimator == "optimal":
        raise ValueError(
            "--parallelism fsdp2 with --estimator optimal is not supported (its per-rollout backwards "
            "differ in number between processes, and each sharded forward is a collective); use "
            "--parallelism ddp or another --estimator"
        )


#: Files of which a local model directory needs one for its tokenizer to load (transformers' names).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
)


def check_tokenizer_files(source: Any) -> None:
    """A local model directory must hold its tokenizer too (transformers' own message then names sentencepiece or
    tiktoken, which are not what is missing).

    Raises:
        ValueError: naming the directory, the files looked for and the fix.
    """
    if source.kind != "local" or not Path(source.path).is_dir():
        return
    folder = Path(source.path)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES) and not list(folder.glob("*.tiktoken")):
        raise ValueError(
            f"model directory {folder} holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
            f"save the tokenizer beside the weights (tokenizer.save_pretrained('{folder}'))"
        )


def check_model(config: TrainConfig, policy: torch.nn.Module) -> None:
    """Checks that need the loaded model; the trainer runs them before the run directory is written.

    Raises:
        ValueError: ``--estimator optimal`` with a model that has no ``nn.Linear`` layer (its b* weights are the
            sketched squared gradient norms of the linear layers).
    """
    if config.estimator == "optimal" and not linear_layer_names(policy):
        raise ValueError(
            f"--estimator optimal needs per-rollout gradient norms of the model's nn.Linear layers, and "
            f"{config.model} has none; pick another --estimator (grpo, rloo, dr_grpo)"
        )


#: How many sampled prompts :func:`check_prompts` tokenizes at start for a task without a fixed list of rows (a
#: dataset's rows are all checked).
PROMPTS_CHECKED = 64


def model_context(model: torch.nn.Module) -> int | None:
    """The number of positions the model can attend over (``max_position_embeddings``, GPT-2's ``n_positions``), or
    None when its config does not say."""
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_prompts(config: TrainConfig, task: Task, models: Models) -> None:
    """Before --out is touched: every prompt of the task formats with the tokenizer (a chat template for chat
    messages, none needed for strings) and, with ``max_new_tokens``, fits the model's context
    (:func:`model_context`). A task with a list of rows (a user dataset, GSM8K) is checked row by row, every row
    (:func:`grpo_lens.rollout.prompt_lengths`, batched), another task on :data:`PROMPTS_CHECKED` sampled prompts.

    Raises:
        ValueError: naming the row (or prompt), what is wrong and what to do; for prompts too long, how many rows are.
    """
    data = getattr(task, "data", None)
    if isinstance(data, dict) and "train" in data:
        examples = list(data["train"])
        where = f"task {config.task!r} row"
    else:
        examples = list(task.sample(PROMPTS_CHECKED, seed=config.seed))
        where = f"task {config.task!r} sampled prompt"
    try:
        lengths = prompt_lengths(models.tokenizer, [example.prompt for example in examples])
    except PromptFormatError as err:  # no chat template for chat messages, or a template that refuses one
        hint = (
            " (the built-in tasks give chat messages: train a base model on --task jsonl with string prompts)"
            if not isinstance(data, dict) and "no chat template" in str(err)
            else ""
        )
        raise ValueError(f"{where} {err.index + 1}: {err}{hint}") from None
    context = model_context(models.policy)
    if context is None or not lengths:
        return
    too_long = [i for i, n in enumerate(lengths) if n + config.max_new_tokens > context]
    if too_long:
        longest = max(too_long, key=lambda i: lengths[i])
        raise ValueError(
            f"{where} {longest + 1}: the prompt is {lengths[longest]:,} tokens, and with max_new_tokens "
            f"{config.max_new_tokens} that is more than the {context:,} positions of {config.model} "
            f"({len(too_long):,} of {len(lengths):,} prompts are, the first at {too_long[0] + 1}); "
            f"shorten or drop the long prompts, or lower --max-new-tokens"
        )


def check_before_writing(
    config: TrainConfig, run: RunDir, procs: Processes
) -> tuple[TrainConfig, Any, list[tuple[str, float]], Path | None]:
    """Everything checked, read-only, before the run directory is touched or a model loads.

    Returns:
        (config, task, reward specs, checkpoint): the config resolved against --out (a resumed run's saved config with
        the :data:`RESUMABLE_KEYS` it may change), :func:`check_inputs`' task and reward specs, and the checkpoint to
        resume from (None for a new run, or a resumed run without one yet).

    Raises:
        ConfigError / RunDirError / ModelNotFoundError / ValueError: see :func:`grpo_lens.train.loop.train`.
    """
    given = {k: v for k, v in absolute_dataset(config).to_dict().items() if k not in RECORDED_KEYS}
    resumable = RESUMABLE_KEYS + new_learning_rate(config, run)
    config = TrainConfig.from_dict(
        run.resolve(
            given,
            resume=config.resume,
            overwrite=config.overwrite,
            resumable_keys=resumable,
            canonical=TrainConfig.canonical,
        )
    )
    config = check_dataset_file(config)  # a resume trains on the run's own data
    task, reward_fns = check_inputs(config, procs)
    ckpt = run.latest_checkpoint() if config.resume else None  # a bad pointer fails before the model loads
    if ckpt is not None:  # config.yaml may have been edited: compare with what the checkpoint's steps ran with
        run.check_resumed_config(ckpt, config.to_dict(), resumable + RECORDED_KEYS, canonical=TrainConfig.canonical)
    if config.resume:  # a line of metrics/completions.jsonl that is no record fails now, naming file and line
        for path in (run.metrics_path, run.completions_path):
            read_records(path)
        if ckpt is not None:
            check_metrics_cover(run, ckpt)
    warn_long_warmup(config)
    procs.barrier()  # every process has read --out before the main one changes it
    return config, task, reward_fns, ckpt


def new_learning_rate(config: TrainConfig, run: RunDir) -> tuple[str, ...]:
    """``("learning_rate",)`` when a resume is given a learning rate other than the run's config.yaml holds (a flag:
    e.g. lower after the weights diverged), so that it may change from the next step on, with a warning; () else.
    An edit of config.yaml alone still differs from what the checkpoint ran with and is refused
    (:meth:`RunDir.check_resumed_config`)."""
    if not config.resume or not run.config_path.is_file():
        return ()
    try:
        saved = read_saved_config(run.config_path, "").get("learning_rate")
    except RunDirError:
        return ()  # resolve() reports the unreadable file
    if saved is None or float(saved) == config.learning_rate:
        return ()
    logger.warning(
        "--resume with --learning-rate %g (the run's is %g): the steps from here on use the new rate, "
        "and config.yaml records it",
        config.learning_rate,
        float(saved),
    )
    return ("learning_rate",)


def absolute_dataset(config: TrainConfig) -> TrainConfig:
    """``config`` with ``dataset`` made absolute when it names a file here, so that config.yaml records where the data
    is and a resume from another folder reads the same file (or, given a relative path again, is compared with it)."""
    if config.dataset and Path(config.dataset).is_file():
        return replace(config, dataset=str(Path(config.dataset).resolve()))
    return config


def check_dataset_file(config: TrainConfig) -> TrainConfig:
    """Record the --dataset file's sha256 and row count (a new run), or check them against the run's (a resume).

    A resume whose file's sha256 differs from the recorded one is refused, naming both hashes, unless
    ``allow_dataset_change`` (then the new hash and row count are recorded, with a warning). Nothing is recorded
    for a dataset that is not a local file (a Hugging Face dataset name) or a run without one.

    Raises:
        RunDirError: the file changed since the run started, or is gone.
    """
    if not config.dataset:
        return config
    path = Path(config.dataset)
    if not path.is_file():
        if config.resume and config.dataset_sha256:
            raise RunDirError(
                f"--resume: the run's dataset {path} (sha256 {config.dataset_sha256}) is not there any "
                f"more; restore it, or start a new run in another --out"
            )
        return config
    sha256, rows = file_fingerprint(path)
    if config.resume and config.dataset_sha256 and sha256 != config.dataset_sha256:
        if not config.allow_dataset_change:
            raise RunDirError(
                f"--resume: the dataset {path} changed since the run started: its sha256 is {sha256} ({rows} rows) "
                f"and the run recorded {config.dataset_sha256} ({config.dataset_rows} rows); restore the file, or "
                f"pass --allow-dataset-change to resume on the changed data (recorded in config.yaml)"
            )
        logger.warning(
            "--allow-dataset-change: resuming on %s, changed since the run started (sha256 %s, %s rows; "
            "the run recorded %s, %s rows)",
            path,
            sha256,
            rows,
            config.dataset_sha256,
            config.dataset_rows,
        )
    return replace(config, dataset_sha256=sha256, dataset_rows=rows)


def check_metrics_cover(run: RunDir, ckpt: Path) -> None:
    """A resume from checkpoint ``ckpt`` of step k needs metrics.jsonl with the records up to step k (each step's
    line is written and fsynced before its checkpoint): a file deleted or cut would lose the run's history silently.

    Raises:
        RunDirError: metrics.jsonl is missing or ends before step k, naming it and what to do.
    """
    step = int(ckpt.name.split("-")[1])
    if step <= 0:
        return
    records = run.read_metrics()
    last = max((r.get(mk.STEP, 0) for r in records), default=None)
    if last is None or last < step:
        held = "is missing" if not run.metrics_path.exists() else f"holds steps up to {last or 0}"
        raise RunDirError(
            f"--resume: {run.metrics_path} {held}, but the checkpoint {ckpt.name} is at step {step}: "
            f"resuming would lose the run's history; restore the file from a copy, or start a new run "
            f"in another --out"
        )


def warn_long_warmup(config: TrainConfig) -> None:
    """A warm-up as long as the run or longer leaves the LR below --learning-rate for every step: say so at start."""
    w = warmup_steps(config)
    if w > 0 and w >= config.max_steps:
        logger.warning(
            "--warmup-steps %s is %d steps, not fewer than the run's %d (--max-steps): the learning rate "
            "rises from 0 for the whole run and never reaches --learning-rate %g (with %d steps, a warm-up "
            "of at most %d steps, or a share such as 0.1)",
            config.warmup_steps,
            w,
            config.max_steps,
            config.learning_rate,
            config.max_steps,
            max(0, config.max_steps - 1),
        )
