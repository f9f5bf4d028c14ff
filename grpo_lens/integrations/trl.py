"""grpo-lens' lens inside TRL's ``GRPOTrainer``: replace ``GRPOTrainer(...)`` by ``LensGRPOTrainer(...)``.

::

    from grpo_lens.integrations.trl import LensGRPOTrainer        # instead of: from trl import GRPOTrainer
    trainer = LensGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=..., lens_every=5)
    trainer.train()   # lens keys (rank/g1_erank, rank/mixed_groups, ...) appear wherever TRL's metrics go

**Why a subclass and not a callback.** In TRL 1.16 a ``TrainerCallback`` is called with ``args``, ``state``,
``control`` and ``model``/``processing_class``/``optimizer``/``lr_scheduler``/dataloaders, never with the batch:
``GRPOTrainer._prepare_inputs`` generates and scores the completions and computes the advantages inside
``_generate_and_score_completions``, and the dict it returns (``prompt_ids``, ``prompt_mask``, ``completion_ids``,
``completion_mask``, ``advantages``) goes straight to ``compute_loss``. The rewards are not even in that dict (only
``_calculate_rewards`` sees them). The lens needs exactly those tensors, so :class:`GRPOLensMixin` overrides these two
methods: ``_calculate_rewards`` (calls TRL's, keeps the rewards) and ``_generate_and_score_completions`` (calls
TRL's, then measures the lens on its output, unchanged). The mixin also composes with your own GRPOTrainer subclass:
``class MyTrainer(GRPOLensMixin, MyGRPOTrainer)``.

**What is measured.** On the first generation batch at or after each multiple of ``lens_every`` optimizer steps
(global steps 0, N, 2N, ...), and on the run's last generation batch (as ``grpo-lens train`` measures its last step;
with ``steps_per_generation`` or ``num_iterations`` > 1 TRL generates only every few
optimizer steps, so the lens takes the next batch that exists rather than waiting for a global step that never meets
a generation), on that batch (this process's share, before any update on it), the same analysis as grpo-lens' own
trainer:
:class:`grpo_lens.lens.trainer_lens.TrainerLens` with its Gram source (``lens_gram_source``, as the trainer's
``--gram-source``:
``exact``, the default as in the trainer, the exact Gram of every parameter from one batched backward; ``sketch``, the
LoGra sketch of the linear weights; with a peft/LoRA model the adapter's exact per-rollout gradients either way;
:func:`grpo_lens.analysis.group.analyse_group` per mixed group). The exact Gram runs without activation checkpointing,
which TRL turns on by default: the lens switches it off for its own pass only. Rows g_i are gradients of each
completion's log-prob sum weighted as TRL's ``loss_type`` weights it
(:data:`grpo_lens.config.trl_names.LOSS_TYPE_AGGREGATIONS`), at TRL's temperature (TRL's training log-probs apply no
top-k / top-p); the advantages are TRL's.
The metrics are appended to TRL's ``_metrics["train"]``, which ``GRPOTrainer.log`` averages over the logging window
and sends to every ``report_to`` backend and ``trainer.state.log_history``. Update sparsity (S4, and the sampled
sparsity keys) is measured around the first optimizer step after each lens batch, from TRL's
``on_pre_optimizer_step`` and ``on_step_end`` callback events.

**The update TRL takes.** On the first pass every ratio pi / pi_old is 1, so rollout i's share of TRL's loss has
gradient -(A_i / N) grad(omega_i sum_t W_it log pi(o_it)): W_it is 1 unless TRL weighs or masks tokens, and then the
lens's rows carry W (:func:`trl_token_weights`: vLLM's importance-sampling ratio, token or sequence, truncated or
masked, as TRL computed it; the off-policy sequence mask; the high-entropy token mask), measured by
:func:`weighted_rollout_rows`. What the rows cannot carry is refused at construction in one line
(:func:`trl_weights_refusal`): the entropy bonus, ``top_entropy_quantile`` < 1 with ``steps_per_generation`` > 1, and
token weights with a peft model.

**The run directory.** The trainer also writes a grpo-lens run directory, ``lens_out`` (default: TRL's ``output_dir``;
its one-writer lock is checked at construction and held through ``train()``, :func:`acquire_lens_out`), that ``grpo-lens
report`` and ``grpo-lens compare`` read: ``config.yaml`` (the TRL settings under grpo-lens' names, :func:`run_config`,
with the TRL names themselves under ``trl``), ``metrics.jsonl`` (one record per TRL log: every ``logging_steps``, and
every lens step and the run's last step whatever ``logging_steps``, in grpo-lens' vocabulary: reward, advantage and
completion statistics computed from TRL's batch with grpo-lens' definitions, TRL's own training metrics where the
definitions agree (:func:`grpo_lens.metrics.from_trl`), the lens keys and ``perf/step_seconds``) and
``completions.jsonl`` (prompt, completion, reward per function and advantage of the first ``lens_log_completions``
rollouts of each batch). A resumed TRL run (``resume_from_checkpoint``) drops the records after its checkpoint's step; a
new run in the same folder replaces them.

Mapping of TRL's settings onto the lens's: ``scale_rewards="group"`` is grpo-lens' ``grpo`` estimator (sample std,
eps 1e-4, as TRL), ``"none"`` is ``dr_grpo``; with ``"batch"`` or ``multi_objective_aggregation=
"normalize_then_sum"`` the rank-2 identity has no per-group constant and ``grad/identity_residual`` is absent.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml

from grpo_lens import metrics as mk
from grpo_lens.config.base import safe_load_yaml
from grpo_lens.formulas.losses import loss_normalizer, rollout_gradient_weights
from grpo_lens.gradients.gram import GramCapture
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.gradients.sketch import GradientCapture, backward_roots
from grpo_lens.lens.settings import LensSettings
from grpo_lens.lens.step_batch import StepBatch
from grpo_lens.lens.trainer_lens import TrainerLens
from grpo_lens.rewards import completion_text
from grpo_lens.rollout import RolloutBatch, batch_logprobs
from grpo_lens.rundir import RunDir, RunDirError, RunDirLockedError, acquire_run_lock
from grpo_lens.runtime.processes import gather_objects
from grpo_lens.train.step_metrics import dead_group_metrics, reward_metrics, rollout_metrics

try:
    import trl
    from transformers import TrainerCallback
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "grpo_lens.integrations.trl needs TRL: pip install trl (or pip install '.[trl]' in a clone of grpo-lens)"
    ) from e


#: The settings :class:`grpo_lens.lens.trainer_lens.TrainerLens` reads, from a ``trl.GRPOConfig`` and the
#: integration's lens keywords (``sketch_dim``, ``lens_space``, ``seed``, ``multi_objective_aggregation``,
#: ``gram_source``; defaults as the trainer's flags): :meth:`grpo_lens.lens.settings.LensSettings.from_trl`, which
#: documents them and what it raises. TRL's mask_truncated_completions is already in its completion_mask.
lens_settings = LensSettings.from_trl


def rollout_batch_from_trl(output: dict[str, Any], group_size: int, eos_token_id: int | None = None) -> RolloutBatch:
    """A :class:`RolloutBatch` holding TRL's generation batch (its tensors, not copies of other data).

    Args:
        output: the dict ``GRPOTrainer._generate_and_score_completions`` returns: ``prompt_ids`` [N, Lp] (left
            padded), ``prompt_mask`` [N, Lp], ``completion_ids`` [N, T], ``completion_mask`` [N, T] (up to and
            including EOS), optional ``tool_mask`` [N, T] (0 on tool-output tokens, which get no loss).
        group_size: R (TRL's ``num_generations``); N must be a multiple of it.
        eos_token_id: the tokenizer's EOS id; a completion without it among its tokens was cut at
            max_completion_length (TRL's ``completions/clipped_ratio``). None: rows whose mask reaches the last
            position count as cut.

    Returns:
        the batch; ``sampler_logprobs`` are zeros (the lens does not use them).

    Raises:
        ValueError: N is not a multiple of R.
    """
    mask = output["completion_mask"].bool()
    if "tool_mask" in output:
        mask = mask & output["tool_mask"].bool()
    n = mask.shape[0]
    if n % group_size:
        raise ValueError(f"TRL's batch has {n} completions, not a multiple of num_generations={group_size}")
    ids = output["completion_ids"]
    if eos_token_id is None:
        truncated = mask[:, -1].clone()
    else:
        truncated = ~((ids == eos_token_id) & output["completion_mask"].bool()).any(dim=1)
    return RolloutBatch(
        prompt_ids=output["prompt_ids"],
        prompt_mask=output["prompt_mask"],
        completion_ids=ids,
        completion_mask=mask,
        sampler_logprobs=torch.zeros(mask.shape, dtype=torch.float32, device=mask.device),
        truncated=truncated,
        group_size=group_size,
    )


def run_config(
    args: Any,
    settings: LensSettings,
    *,
    model: str,
    max_steps: int,
    lens_every: int,
    lora_rank: int,
    world_size: int,
) -> dict[str, Any]:
    """The config.yaml of a TRL run: TRL's settings under grpo-lens' field names where they mean the same, the lens's
    settings, and the TRL names themselves under ``trl`` (what ran, in TRL's words).

    Args:
        args: the run's ``trl.GRPOConfig``.
        settings: :func:`lens_settings` of it.
        model: the model's name or path.
        max_steps: TRL's resolved number of optimizer steps.
        lens_every: the lens's period.
        lora_rank: the peft adapter's rank (0 without peft).
        world_size: processes.
    """
    trl_names = (
        "num_generations",
        "max_completion_length",
        "num_iterations",
        "epsilon",
        "epsilon_high",
        "beta",
        "loss_type",
        "scale_rewards",
        "temperature",
        "top_p",
        "top_k",
        "learning_rate",
        "lr_scheduler_type",
        "warmup_steps",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "steps_per_generation",
        "max_grad_norm",
        "weight_decay",
        "seed",
        "mask_truncated_completions",
    )
    given = {n: getattr(args, n, None) for n in trl_names}
    given = {n: getattr(v, "value", v) for n, v in given.items()}  # enums (lr_scheduler_type) as their names
    given = {n: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for n, v in given.items()}
    epsilon = float(args.epsilon)  # TRL's clip range
    return {
        "trainer": "trl",
        "trl_version": trl.__version__,
        "model": model,
        "group_size": int(args.num_generations),
        "rollout_batch_size": int(args.per_device_train_batch_size) * int(args.steps_per_generation) * world_size,
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "estimator": settings.estimator,
        "std": settings.std,
        "std_eps": settings.std_eps,
        "loss_aggregation": settings.loss_aggregation,
        "beta": float(args.beta),
        "eps_low": epsilon,
        "eps_high": float(args.epsilon_high if args.epsilon_high is not None else epsilon),
        "mu": int(args.num_iterations),
        "max_steps": int(max_steps),
        "learning_rate": float(args.learning_rate),
        "lr_scheduler": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "warmup_steps": float(args.warmup_steps),
        "lens_every": lens_every,
        "sketch_dim": settings.sketch_dim,
        "gram_source": settings.gram_source,
        "lens_space": settings.lens_space,
        "lora_rank": lora_rank,
        "seed": int(args.seed),
        "trl": given,
    }


def acquire_lens_out(run: RunDir) -> Callable[[], None]:
    """Take the one-writer lock of the TRL lens's run directory (:func:`grpo_lens.rundir.acquire_run_lock`, the lock
    ``grpo-lens train`` and ``probe`` hold) and check that the folder holds no run but a TRL lens run; returns the
    release.

    A TRL run replaces the config.yaml, metrics.jsonl and completions.jsonl of the TRL run before it (or keeps them up
    to its checkpoint's step when resumed), never a ``grpo-lens train`` run's, finished or live.

    Raises:
        grpo_lens.rundir.RunDirLockedError: another live process writes the folder, named with the folder.
        grpo_lens.rundir.RunDirError: the folder holds a run that is not a TRL lens run (config.yaml without
            ``trainer: trl``), or a config.yaml that cannot be read.
    """
    try:
        release = acquire_run_lock(run.path, "trl")
    except RunDirLockedError as e:
        raise RunDirLockedError(
            f"LensGRPOTrainer: lens_out {run.path} is being written by another process ({e}); choose another "
            f"lens_out (or output_dir)"
        ) from None
    try:
        if run.config_path.is_file():
            try:
                saved = safe_load_yaml(run.config_path.read_text())
            except (OSError, yaml.YAMLError):
                saved = None
            if not isinstance(saved, dict) or saved.get("trainer") != "trl":
                raise RunDirError(
                    f"LensGRPOTrainer: lens_out {run.path} holds a grpo-lens run that is not a TRL lens run "
                    f"(its config.yaml has no 'trainer: trl'), whose config.yaml, metrics.jsonl and completions.jsonl "
                    f"the TRL lens would replace; choose another lens_out (or output_dir)"
                )
    except BaseException:
        release()
        raise
    return release


def trl_weights_refusal(trainer: Any) -> str | None:
    """Why the lens cannot measure the update this TRL trainer takes (one line naming the setting), or None.

    The lens's rows are per-rollout score gradients with TRL's token weights (:func:`trl_token_weights`); an entropy
    bonus (``entropy_coef`` != 0 or ``use_adaptive_entropy``) adds the gradient of the tokens' entropy, which is no
    weighted score of the sampled tokens, and ``top_entropy_quantile`` < 1 with several micro-batches per generation
    (``steps_per_generation`` > 1) takes its quantile over each shuffled micro-batch of the update, which the lens's
    generation batch does not reproduce.
    """
    if getattr(trainer, "_entropy_bonus_enabled", False) or float(getattr(trainer, "entropy_coef", 0.0) or 0.0):
        return (
            "LensGRPOTrainer: entropy_coef / use_adaptive_entropy add an entropy bonus whose gradient the lens's "
            "per-rollout score gradients do not hold; set entropy_coef=0.0 and use_adaptive_entropy=False, or use "
            "GRPOTrainer without the lens"
        )
    quantile = float(getattr(trainer, "top_entropy_quantile", 1.0))
    weighted = (
        (getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False))
        or getattr(trainer, "off_policy_mask_threshold", None) is not None
        or quantile < 1.0
    )
    if weighted and getattr(trainer.accelerator.unwrap_model(trainer.model), "peft_config", None):
        return (
            "LensGRPOTrainer: with a peft model the lens's per-rollout gradients take no token weights, so vLLM's "
            "importance sampling (use_vllm with vllm_importance_sampling_correction), off_policy_mask_threshold and "
            "top_entropy_quantile < 1 are refused; turn them off or measure the full model"
        )
    if quantile < 1.0 and int(getattr(trainer.args, "steps_per_generation", 1) or 1) > 1:
        return (
            f"LensGRPOTrainer: top_entropy_quantile={quantile} masks by a quantile over each shuffled micro-batch of "
            f"the update, and steps_per_generation={trainer.args.steps_per_generation} splits the lens's generation "
            f"batch into several; set steps_per_generation=1 (and gradient_accumulation_steps=1) or "
            f"top_entropy_quantile=1.0"
        )
    return None


def trl_token_weights(trainer: Any, output: dict[str, Any]) -> torch.Tensor | None:
    """W [N, T] float64: what TRL's loss multiplies rollout i's per-token loss at token t by on the update's first
    pass, beyond the loss aggregation (``GRPOTrainer._compute_loss`` of TRL 1.16); None when every factor is 1.

    On the first pass every ratio pi/pi_old is 1 (the clip is inactive), so the gradient of rollout i's share of the
    loss is -(A_i / N) grad(omega_i sum_t W_it log pi(o_it)) with omega_i the aggregation's weight
    (:func:`grpo_lens.formulas.losses.rollout_gradient_weights`) and W_it the product of:

    - ``importance_sampling_ratio`` (with ``use_vllm`` and ``vllm_importance_sampling_correction``, not for vespo,
      whose weights enter its own loss): pi_old / pi_sampler per token ([N, T], ``token_*`` modes) or per sequence
      ([N, 1], ``sequence_*``), truncated at the cap or 0 outside [min, max] (``*_mask``), as TRL computed it;
    - the off-policy sequence mask (``off_policy_mask_threshold``, [N, 1]): 0 for a rollout with A_i < 0 whose mean
      log pi_sampler - log pi_old over its tokens exceeds the threshold (TRL's ``get_off_policy_mask``);
    - the high-entropy token mask (``top_entropy_quantile`` < 1, [N, T]): 1 on the tokens whose entropy reaches the
      quantile over the batch's tokens on every process (TRL's ``get_high_entropy_mask``).

    Args:
        trainer: the GRPOTrainer (its settings and TRL's own mask functions).
        output: what ``_generate_and_score_completions`` returned: ``completion_mask`` [N, T], optional ``tool_mask``,
            ``advantages`` [N], and with vLLM ``importance_sampling_ratio``, ``old_per_token_logps`` [N, T],
            ``sampling_per_token_logps`` [N, T].

    Returns:
        [N, T] float64, or None. Every process calls this (the entropy quantile gathers across processes).
    """
    mask = output["completion_mask"]
    if "tool_mask" in output:
        mask = mask * output["tool_mask"]
    factors: list[torch.Tensor] = []
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction and trainer.loss_type != "vespo":
        factors.append(output["importance_sampling_ratio"])
    threshold = getattr(trainer, "off_policy_mask_threshold", None)
    quantile = float(getattr(trainer, "top_entropy_quantile", 1.0))
    old = output.get("old_per_token_logps")
    entropies = None
    need_logps = threshold is not None and old is None and "sampling_per_token_logps" in output
    if need_logps or quantile < 1.0:
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attention, output["completion_ids"].size(1), compute_entropy=True
            )
        old = logps if old is None else old
    if threshold is not None:
        advantages = output["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        if old is None:  # no sampler log-probs and no old ones: TRL compares the current log-probs with themselves
            old = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
        sampling = output.get("sampling_per_token_logps", old)
        factors.append(trainer.get_off_policy_mask(advantages, old, sampling, mask, threshold))
    if quantile < 1.0:
        factors.append(trainer.get_high_entropy_mask(entropies, mask, 1 - quantile))
    if not factors:
        return None
    w = torch.ones(mask.shape, dtype=torch.float64, device=mask.device)
    for f in factors:
        w = w * f.to(device=mask.device, dtype=torch.float64)
    return w


def weighted_rollout_rows(
    policy: torch.nn.Module,
    batch: RolloutBatch,
    omega: torch.Tensor,
    token_weights: torch.Tensor,
    settings: LensSettings,
) -> tuple[str, torch.Tensor, dict[str, Any]]:
    """The lens's rows g_i = grad(omega_i sum_t W_it log pi(o_it)) of ``batch``'s rollouts, token weights included,
    from one batched forward + backward: the exact Gram of every parameter (``gram_source`` exact, one [R, R] block per
    group, :class:`grpo_lens.gradients.gram.GramCapture`) or the sketched rows of every linear layer (``sketch``,
    :class:`grpo_lens.gradients.sketch.GradientCapture`). The log-probs are grpo-lens' own
    (:func:`grpo_lens.rollout.batch_logprobs`, at the settings' temperature).

    Args:
        policy: the causal LM (no activation checkpointing).   batch: n rollouts, whole groups.
        omega: [n] the aggregation's weights.   token_weights: [n, T] W (:func:`trl_token_weights`).

    Returns:
        ("gram", [n, n] float64 (0 between groups), info with ``coverage``) or ("sketch", [n, P_s] float64, {}).
    """

    def loss() -> torch.Tensor:
        logp = batch_logprobs(policy, batch, settings.temperature)
        weighted = logp * token_weights.to(device=logp.device, dtype=logp.dtype)
        return rollout_scores(weighted, batch.completion_mask, omega).sum()

    if settings.gram_source == "exact":
        cap = GramCapture(policy, blocks=[batch.group_size] * (batch.num_rollouts // batch.group_size))
        with cap:
            torch.autograd.grad(loss(), cap.backward_roots(), allow_unused=True)
        gram, info = cap.result()
        return "gram", gram.double().cpu(), info
    capture = GradientCapture(policy, settings.sketch_dim, settings.sketch_dim, seed=settings.seed)
    emb_out: list[torch.Tensor] = []
    # nn.Module types a transformers model's attribute as Tensor | Module
    handle = policy.get_input_embeddings().register_forward_hook(lambda m, a, o: emb_out.append(o))  # type: ignore[operator]
    try:
        with capture:
            total = loss()
            torch.autograd.grad(total, backward_roots(emb_out, capture._modules.values()), allow_unused=True)
    finally:
        handle.remove()
    return "sketch", capture.result().sketch.double().cpu(), {}


@contextmanager
def activation_checkpointing_off(model: torch.nn.Module):
    """Turn transformers' activation (gradient) checkpointing off inside the block and back on after it.

    TRL enables it by default (``GRPOConfig.gradient_checkpointing=True``); the lens's exact Gram (which refuses
    checkpointing) and its gradient sketch (:class:`grpo_lens.gradients.sketch.GradientCapture`) hook the modules'
    forward outputs, which checkpointing recomputes inside the backward. The flag lives on each
    ``GradientCheckpointingLayer``; the numbers do not depend on it.
    """
    switched = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in switched:
        # nn.Module types a transformers model's attribute as Tensor | Module
        m.gradient_checkpointing = False  # type: ignore[assignment]
    try:
        yield
    finally:
        for m in switched:
            # nn.Module types a transformers model's attribute as Tensor | Module
            m.gradient_checkpointing = True  # type: ignore[assignment]


class GRPOLensMixin:
    """Adds the lens and a grpo-lens run directory to a ``trl.GRPOTrainer`` (subclass); see the module docstring for
    why it is not a callback.

    Args (keywords, the rest goes to the trainer):
        lens_every: measure every this many optimizer steps (>= 1).
        sketch_dim: sketch side per linear layer (as grpo-lens' ``--sketch-dim``; default 16).
        lens_gram_source: ``exact`` (default) or ``sketch``, the source of the per-rollout Gram matrix (as
            grpo-lens' ``--gram-source``).
        lens_space: ``trainable`` or ``full`` (as ``--lens-space``; matters with a peft model).
        lens_seed: seed of the sketch projections and random controls.
        lens_out: the grpo-lens run directory to write (default: ``args.output_dir``); ``grpo-lens report`` reads it.
        lens_log_completions: rollouts per generation batch written to completions.jsonl (0 = none).

    Raises:
        ValueError: a bad lens setting.
    """

    # what this mixin reads of the trl.GRPOTrainer it comes before (TRL's objects: a boundary, kept Any)
    args: Any
    accelerator: Any
    model: Any
    state: Any
    processing_class: Any
    num_generations: Any
    reward_func_names: list[str]
    multi_objective_aggregation: str
    add_callback: Any

    def __init__(
        self,
        *args: Any,
        lens_every: int = 5,
        sketch_dim: int = 16,
        lens_space: str = "trainable",
        lens_seed: int = 0,
        lens_out: str | Path | None = None,
        lens_log_completions: int = 2,
        lens_gram_source: str = "exact",
        **kwargs: Any,
    ):
        if lens_every < 1:
            raise ValueError(f"lens_every = {lens_every}: must be >= 1")
        if lens_log_completions < 0:
            raise ValueError(f"lens_log_completions = {lens_log_completions}: must be >= 0")
        super().__init__(*args, **kwargs)
        self.lens_every = lens_every
        self.lens_settings = lens_settings(
            self.args,
            sketch_dim=sketch_dim,
            lens_space=lens_space,
            seed=lens_seed,
            multi_objective_aggregation=self.multi_objective_aggregation,
            gram_source=lens_gram_source,
        )
        self.lens_run = RunDir(lens_out if lens_out is not None else self.args.output_dir)
        self.lens_log_completions = lens_log_completions
        self._lens: TrainerLens | None = None
        self._lens_rewards: torch.Tensor | None = None  # [N over all processes] the reward TRL's advantages start from
        self._lens_rewards_per_func: torch.Tensor | None = None  # [N over all processes, functions]
        self._lens_next_step: int | None = None  # the global step from which the next generation batch is measured
        self._lens_step: int | None = None  # the global step of the last measured batch
        self._lens_step_pending = False  # a lens batch whose S4 waits for the next optimizer step
        self._lens_window: dict[str, list[float]] = defaultdict(list)  # per-batch metrics until TRL's next log
        self._lens_keys: set[str] = set()  # the lens's keys in TRL's logs (kept out of the console line)
        self._lens_logged: dict[str, Any] | None = None  # the last log dict whose record metrics.jsonl holds
        refusal = trl_weights_refusal(self)
        if refusal is not None:
            raise ValueError(refusal)
        if self.accelerator.is_main_process:  # refused here, before TRL trains or anything is written
            acquire_lens_out(self.lens_run)()
        self.add_callback(_LensCallback(self))
        _compact_console(self)

    def train(self, *args: Any, **kwargs: Any):
        """TRL's ``train``, holding the run directory's one-writer lock (:func:`acquire_lens_out`) throughout.

        Raises:
            grpo_lens.rundir.RunDirError: ``lens_out`` holds a grpo-lens train run or another process writes it.
        """
        release = acquire_lens_out(self.lens_run) if self.accelerator.is_main_process else None
        try:
            # train is the trainer's (trl.GRPOTrainer), the class this mixin comes before
            return super().train(*args, **kwargs)  # type: ignore[misc]
        finally:
            if release is not None:
                release()

    # -- TRL's methods, extended -------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # The reward TRL's advantages start from (sum_then_normalize): weighted sum, NaN where no function scored.
        weighted = rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = weighted.nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = math.nan
        self._lens_rewards = rewards  # [N over all processes]
        self._lens_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return output
        step = int(self.state.global_step)
        # TRL generates once per steps_per_generation x num_iterations optimizer steps: the last batch of the run is
        # the one after which no other comes, measured too (as grpo-lens train measures its last step)
        cadence = int(getattr(self.args, "steps_per_generation", None) or 1) * int(getattr(self, "num_iterations", 1))
        last = 0 < int(self.state.max_steps) <= step + cadence and self._lens_step != step
        if self._lens_next_step is None or step >= self._lens_next_step or last:  # first batch at/after the due step
            self._lens_next_step = (step // self.lens_every + 1) * self.lens_every
            self._lens_step = step
            for key, value in self.measure_lens(output).items():
                if value is not None and math.isfinite(value):
                    self._metrics["train"][key].append(float(value))
                    self._lens_keys.add(key)
            self._lens_step_pending = True
        for key, value in self.batch_metrics(output).items():
            self._lens_window[key].append(value)
        if self.accelerator.is_main_process and self.lens_log_completions:
            self.write_completions(inputs, output, step + 1)
        return output

    # -- the lens ------------------------------------------------------------------------------------------------
    def _local_rows(self, output: dict[str, Any]) -> tuple[RolloutBatch, slice]:
        """This process's batch and its rows' slice of the all-process rewards."""
        R = self.num_generations
        batch = rollout_batch_from_trl(output, R, getattr(self.processing_class, "eos_token_id", None))
        n = batch.num_rollouts
        start = self.accelerator.process_index * n
        if start % R:
            raise ValueError(
                f"this process's share of TRL's batch ({n} completions) splits a group of "
                f"num_generations={R}; make the per-process generation batch a multiple of it"
            )
        return batch, slice(start, start + n)

    def measure_lens(self, output: dict[str, Any]) -> dict[str, float]:
        """The lens metrics of one TRL generation batch (this process's rows of it; every process calls this).

        Args:
            output: what ``_generate_and_score_completions`` returned (see :func:`rollout_batch_from_trl`).

        Returns:
            {canonical lens key: value}, as :meth:`grpo_lens.lens.trainer_lens.TrainerLens.measure` writes them.
        """
        policy = self.accelerator.unwrap_model(self.model)
        if self._lens is None:
            self._lens = TrainerLens(policy, self.lens_settings)
        batch, rows = self._local_rows(output)
        assert self._lens_rewards is not None
        rewards = self._lens_rewards[rows].to(batch.completion_ids.device)
        valid = ~torch.isnan(rewards)
        advantages = output["advantages"].reshape(-1)
        weights = trl_token_weights(self, output)  # TRL's IS weights and masks (None: all 1)
        step_batch = StepBatch(int(self.state.global_step), policy, batch, rewards, valid, advantages)
        with activation_checkpointing_off(policy):  # the gradient sketch needs the layers' own forward (TRL turns
            if weights is None:
                return self._lens.measure(step_batch)
            rows_of = self.weighted_lens_rows(policy, batch, rewards, valid, weights)
            return self._lens.measure(step_batch, **rows_of)

    def weighted_lens_rows(
        self,
        policy: torch.nn.Module,
        batch: RolloutBatch,
        rewards: torch.Tensor,
        valid: torch.Tensor,
        weights: torch.Tensor,
    ) -> dict[str, Any]:
        """The keyword :meth:`grpo_lens.lens.trainer_lens.TrainerLens.measure` takes for rows it does not compute
        itself:
        ``gram`` ([N, N] float64, NaN outside the mixed groups' blocks, and its info) or ``sketch`` ([N, P_s], 0
        outside them), of the rows grad(omega_i sum_t W_it log pi(o_it)) (:func:`weighted_rollout_rows`) with
        omega_i as the lens weighs them (the whole batch's normaliser, summed over processes).

        Args:
            batch: this process's N rollouts.   rewards: [N] (NaN where invalid).   valid: [N] bool.
            weights: [N, T] W (:func:`trl_token_weights`).
        """
        t0 = time.perf_counter()
        c = self.lens_settings
        R = batch.group_size
        n = batch.num_rollouts
        mask = batch.completion_mask  # TRL's overlong masking is already in it (overlong "none")
        norm = gather_objects((loss_normalizer(mask, c.loss_aggregation, c.max_new_tokens), float(mask.any(1).sum())))
        z_total, n_total = sum(z for z, _ in norm), sum(k for _, k in norm)
        mixed = TrainerLens.mixed_groups(rewards, valid, R)
        if not mixed:
            return {"sketch": torch.zeros(n, 1, dtype=torch.float64)} if c.gram_source != "exact" else {}
        idx = torch.cat([torch.arange(b * R, (b + 1) * R) for b in mixed])
        sub = batch.select(idx)
        omega = rollout_gradient_weights(mask[idx.to(mask.device)], c.loss_aggregation, z_total, n_total)
        kind, rows, info = weighted_rollout_rows(policy, sub, omega, weights[idx.to(weights.device)], c)
        if kind == "gram":
            full = torch.full((n, n), math.nan, dtype=torch.float64)
            full[idx.unsqueeze(1), idx.unsqueeze(0)] = rows
            return {"gram": (full, {"coverage": info["coverage"], "hook_seconds": time.perf_counter() - t0})}
        full = torch.zeros(n, rows.shape[1], dtype=torch.float64)
        full[idx] = rows
        return {"sketch": full}

    def batch_metrics(self, output: dict[str, Any]) -> dict[str, float]:
        """grpo-lens' reward, advantage and completion statistics of one generation batch, with grpo-lens'
        definitions (:func:`grpo_lens.train.step_metrics.rollout_metrics`): the reward keys over every process's
        rollouts, the advantage and completion keys over this process's, and ``dead/*``
        (:func:`grpo_lens.train.step_metrics.dead_group_metrics`, as ``grpo-lens train`` writes them every step) over
        every process's, with TRL's ``loss_type`` as its loss aggregation
        (:data:`grpo_lens.config.trl_names.LOSS_TYPE_AGGREGATIONS`) and TRL's completion mask (its truncation masking
        already in it) as the tokens the loss sums."""
        batch, rows = self._local_rows(output)
        assert self._lens_rewards is not None
        rewards = self._lens_rewards.to(batch.completion_ids.device)
        local = rewards[rows]
        advantages = output["advantages"].reshape(-1).float()
        out = rollout_metrics(
            local,
            ~torch.isnan(local),
            advantages,
            batch.completion_mask,
            batch.truncated,
            self.num_generations,
        )
        out.update(reward_metrics(rewards, ~torch.isnan(rewards), self.num_generations))
        c = self.lens_settings
        parts = gather_objects((advantages.detach().cpu(), batch.completion_mask.cpu()))  # every process calls this
        masks = [torch.nn.functional.pad(m, (0, max(c.max_new_tokens - m.shape[1], 0))) for _, m in parts]
        all_rewards = rewards.cpu()
        out.update(
            dead_group_metrics(
                all_rewards,
                ~torch.isnan(all_rewards),
                torch.cat([a for a, _ in parts]),
                torch.cat(masks),
                c.loss_aggregation,
                c.max_new_tokens,
                self.num_generations,
            )
        )
        return out

    def write_completions(self, inputs: list[dict[str, Any]], output: dict[str, Any], step: int) -> None:
        """Append the first ``lens_log_completions`` rollouts of this process's batch to completions.jsonl: prompt,
        completion, reward, each reward function's value and advantage (the step whose update uses the batch)."""
        tok = self.processing_class
        batch, rows = self._local_rows(output)
        assert self._lens_rewards is not None and self._lens_rewards_per_func is not None
        for i in range(min(self.lens_log_completions, batch.num_rollouts)):
            prompt = inputs[i]["prompt"]
            text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
            ids = batch.completion_ids[i][batch.completion_mask[i]]
            j = rows.start + i
            per_func = {
                name: _finite(self._lens_rewards_per_func[j, f]) for f, name in enumerate(self.reward_func_names)
            }
            self.lens_run.append_metrics(
                {
                    mk.STEP: step,
                    "prompt": text,
                    "completion": completion_text(tok.decode(ids, skip_special_tokens=True)),
                    "reward": _finite(self._lens_rewards[j]),
                    "rewards": per_func,
                    "advantage": float(output["advantages"].reshape(-1)[i]),
                    "truncated": bool(batch.truncated[i]),
                },
                path=self.lens_run.completions_path,
            )

    def lens_record(self, logs: dict[str, Any]) -> dict[str, Any]:
        """The metrics.jsonl record of one TRL log: the step, the window's batch metrics (averaged as TRL averages
        its own), TRL's values of grpo-lens' quantities, and every logged key that is grpo-lens' own (the lens's)."""
        record: dict[str, Any] = {mk.STEP: int(self.state.global_step)}
        for key, values in self._lens_window.items():
            finite = [v for v in values if v is not None and math.isfinite(v)]
            record[key] = sum(finite) / len(finite) if finite else None
        self._lens_window.clear()
        record.update(mk.from_trl(logs))
        record.update(
            {k: v for k, v in logs.items() if k != mk.STEP and mk.is_defined(k, mk.JSONL) and k not in record}
        )
        return record


def _finite(value: torch.Tensor) -> float | None:
    v = float(value)
    return v if math.isfinite(v) else None


#: the longest string transformers' ProgressCallback prints whole (its ``max_str_len``)
CONSOLE_STR_LEN = 100


def compact_console_logs(logs: dict[str, Any], lens_keys: set[str], metrics_file: Path | None) -> dict[str, Any]:
    """What TRL's console line shows of a log dict: TRL's own keys as they are, and the lens's keys (about 200 at a
    lens step) replaced by one entry saying how many there are and where they went (every tracker and
    ``trainer.state.log_history`` get them all; ``metrics_file``, the run directory's metrics.jsonl, is named only
    when it holds this log's record, None otherwise: another process's log, or a log the lens does not record)."""
    shown = {k: v for k, v in logs.items() if k not in lens_keys}
    hidden = len(logs) - len(shown)
    if hidden:
        shown["lens"] = f"{hidden} keys in log_history"
        if metrics_file is not None:  # the shortest true name: transformers' console cuts a string over 100 characters
            where = min(str(metrics_file), os.path.relpath(metrics_file), key=len)
            fits = len(shown["lens"]) + len(where) + 5 <= CONSOLE_STR_LEN
            shown["lens"] += f" and {where}" if fits else f" and {metrics_file.name} in output_dir"
    return shown


def _compact_console(trainer: Any) -> None:
    """Swap transformers' console callbacks (ProgressCallback, PrinterCallback) for subclasses whose ``on_log``
    prints :func:`compact_console_logs`; the other callbacks (TensorBoard, W&B, ...) see the full logs."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for base in (ProgressCallback, PrinterCallback):
        for cb in [c for c in trainer.callback_handler.callbacks if type(c) is base]:
            # one class per base: on_log filters, everything else is the base's (a base mypy cannot see statically)
            class Compact(base):  # type: ignore[valid-type, misc]
                def on_log(self, args, state, control, logs=None, **kwargs):
                    if logs is not None:
                        written = trainer._lens_logged is logs and trainer.lens_run.metrics_path.is_file()
                        logs = compact_console_logs(
                            logs, trainer._lens_keys, trainer.lens_run.metrics_path if written else None
                        )
                    return super().on_log(args, state, control, logs=logs, **kwargs)

            trainer.callback_handler.remove_callback(cb)
            trainer.callback_handler.add_callback(
                Compact(**({"max_str_len": cb.max_str_len} if hasattr(cb, "max_str_len") else {}))
            )


class _LensCallback(TrainerCallback):
    """The events the lens needs from TRL's trainer loop: the run directory at the start, S4 around the optimizer
    step, the step's wall time, and one metrics.jsonl record per log."""

    def __init__(self, trainer: GRPOLensMixin):
        self.trainer = trainer
        self._t0: float | None = None
        self._seconds: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        t = self.trainer
        if not t.accelerator.is_main_process:
            return
        run = t.lens_run
        run.path.mkdir(parents=True, exist_ok=True)
        if state.global_step > 0:  # resumed from a TRL checkpoint: keep the records up to it
            run.truncate_metrics(int(state.global_step))
        else:
            for path in (run.metrics_path, run.completions_path):
                path.unlink(missing_ok=True)
        policy = t.accelerator.unwrap_model(t.model)
        lora = getattr(policy, "peft_config", None)
        rank = int(next(iter(lora.values())).r) if lora else 0
        model = getattr(getattr(policy, "config", None), "_name_or_path", "") or type(policy).__name__
        run.write_config(
            run_config(
                t.args,
                t.lens_settings,
                model=str(model),
                max_steps=int(state.max_steps),
                lens_every=t.lens_every,
                lora_rank=rank,
                world_size=t.accelerator.num_processes,
            )
        )

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        t = self.trainer
        if t._lens is not None:
            t._lens.before_step(t.accelerator.unwrap_model(t.model))

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        if self._t0 is not None:
            t._lens_window[mk.PERF_STEP_SECONDS].append(time.perf_counter() - self._t0)
        if t._lens_step_pending or int(state.global_step) >= int(state.max_steps):
            # a lens step (its keys and S4) and the run's last step are logged whatever logging_steps is: TRL's
            # default of 10 exceeds a short run's max_steps, and a step TRL does not log reaches no tracker,
            # log_history or metrics.jsonl
            control.should_log = True
        if t._lens is not None:
            lens_step, t._lens_step_pending = t._lens_step_pending, False
            for key, value in t._lens.after_step(
                int(state.global_step), t.accelerator.unwrap_model(t.model), lens_step
            ).items():
                if value is not None and math.isfinite(value):
                    t._metrics["train"][key].append(float(value))
                    t._lens_keys.add(key)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        t = self.trainer
        if (
            not logs
            or not t.accelerator.is_main_process
            or any(k.startswith("eval_") or k.startswith("train_") for k in logs)
        ):
            return
        t.lens_run.append_metrics(t.lens_record(logs))
        t._lens_logged = logs  # the console line of this log may name metrics.jsonl: it holds the record now


class LensGRPOTrainer(GRPOLensMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with grpo-lens' lens every ``lens_every`` steps and a grpo-lens run directory (keywords of
    :class:`GRPOLensMixin`)."""
