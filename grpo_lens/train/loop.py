"""The GRPO training loop, :func:`train`: sample, rewards, advantages, update, lens, log, checkpoint, one call each.

:func:`train` first checks every input, read-only (:func:`grpo_lens.train.checks.check_before_writing`,
:func:`grpo_lens.train.checks.check_inputs`), loads the policy, the reference and the optimizer (:func:`build_models`,
:func:`grpo_lens.train.checks.check_model`), checks every prompt against the tokenizer and the model's context
(:func:`grpo_lens.train.checks.check_prompts`) and only then writes or resumes the run directory (:func:`open_run`).
Each step is then one call per stage: :func:`sample_step` (prompts, rollouts, rewards; DAPO's dynamic sampling in
:func:`sample_dynamic`), :func:`step_advantages` (the b* weights of ``--estimator optimal`` in
:func:`optimal_baseline_weights`), :func:`reference_logprobs`, :func:`plan_lens` (whether and how the lens measures the
step), :func:`grpo_lens.train.update.policy_update`, :func:`lens_after_update`, the non-finite guard
(:class:`grpo_lens.train.state.RunState`), :func:`grpo_lens.train.step_logs.step_record`, :class:`StepLogs` and
:func:`save_checkpoint_if_due`. The start-up checks live in :mod:`grpo_lens.train.checks`, what the loop carries in
:mod:`grpo_lens.train.state`, what it writes of each step in :mod:`grpo_lens.train.step_logs`.
Every formula lives in :mod:`grpo_lens.formulas`; this module moves tensors between them, writes the run directory
and keeps the run resumable: every step's randomness derives from (seed, step) (:func:`step_seed`), and a checkpoint
holds the rest (:class:`grpo_lens.train.state.RunState`, the random generators' states).

Several processes (``torchrun --nproc_per_node 2 -m grpo_lens.cli train ...``, or ``accelerate launch``): every
process draws the same B prompts for a step and samples the groups of its own share of them; the update sums over
processes (:mod:`grpo_lens.train.update`), each step's record gathers every process's rollouts
(:mod:`grpo_lens.runtime.processes`), and the main process alone writes the run directory. ``--parallelism fsdp2``
shards the policy over the processes instead of copying it (:mod:`grpo_lens.runtime.sharding`).

Shapes: B prompts per step, R group size, N = B R / processes rollouts on this process, T completion tokens.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from grpo_lens import metrics as mk
from grpo_lens.config import TrainConfig
from grpo_lens.formulas.advantages import BATCH_ESTIMATORS, compute_advantages, constant_groups
from grpo_lens.formulas.baselines import optimal_vs_rloo
from grpo_lens.formulas.losses import kl_reward_penalty
from grpo_lens.formulas.overlong import overlong_advantages, soft_overlong_penalty
from grpo_lens.gradients.params import linear_layer_names
from grpo_lens.gradients.sketch import sketched_rollout_sq_norms
from grpo_lens.lens.settings import LensSettings
from grpo_lens.lens.step_batch import StepBatch
from grpo_lens.lens.trainer_lens import TrainerLens
from grpo_lens.lora import apply_lora, is_lora, save_lora_model
from grpo_lens.models import load_model
from grpo_lens.rewards import RewardState
from grpo_lens.rollout import (
    RolloutBatch,
    forward_precision,
    sample_groups,
)
from grpo_lens.rundir import (
    RunDir,
    RunDirError,
    crash_point,
    holds_run_dir,
)
from grpo_lens.runtime.memory import keep_freed_memory
from grpo_lens.runtime.processes import Processes, gather_objects, setup_processes
from grpo_lens.runtime.sharding import (
    PARALLELISMS,
    full_model_state,
    full_optimizer_state,
    is_sharded,
    load_full_states,
)
from grpo_lens.seeding import derive_seed, seed_everything
from grpo_lens.tasks.base import Task, epoch_rows
from grpo_lens.trackers import Trackers
from grpo_lens.train.checks import check_before_writing, check_model, check_prompts
from grpo_lens.train.dynamic_sampling import collect_mixed_groups
from grpo_lens.train.evaluate import Evaluation
from grpo_lens.train.schedule import LRSchedule
from grpo_lens.train.state import Lens, LensPlan, Models, Rollouts, RunState, _rng_state, _set_rng_state
from grpo_lens.train.step_logs import _log_completions, _log_lens_cost, _progress, step_line, step_record
from grpo_lens.train.step_metrics import (
    accuracy_note,
    rollout_correctness,
    rollout_rewards,
)
from grpo_lens.train.update import lens_fuses_gram, lens_reads_update, mini_batch_rows, policy_update, update_logprobs

logger = logging.getLogger(__name__)
#: Why the lens ran its own pass instead of the update's backward, each said once per process (:func:`plan_lens`).
_LENS_OWN_PASS_LOGGED: set[str] = set()


class NonFiniteUpdateError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient; the run stopped with its last checkpoint intact."""


class NonFiniteWeightsError(NonFiniteUpdateError):
    """The weights became NaN or infinite in an update (e.g. a learning rate far too high); the run stopped before
    the next generate, with its last checkpoint intact."""


class NoScorableRolloutError(RuntimeError):
    """Too many consecutive steps had no rollout any reward function could score (a missing column, a reward function
    that raises); the run stopped with its last checkpoint intact."""


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step``: every step's randomness derives from (seed, step), so a resumed run repeats it."""
    return derive_seed(seed, step=step)


def is_lens_step(step: int, lens_every: int, max_steps: int) -> bool:
    """Whether the lens measures step ``step`` (1-based): the first step, every ``lens_every``-th and the last.

    So every run with the lens on (``lens_every`` > 0) is measured at least at its start and end, even one shorter
    than ``lens_every`` steps. ``lens_every`` = 0 turns the lens off.
    """
    if lens_every <= 0:
        return False
    return on_lens_cadence(step, lens_every) or step == max_steps


def on_lens_cadence(step: int, lens_every: int) -> bool:
    """Whether step ``step`` (1-based) is on the lens's cadence: the first step and every ``lens_every``-th, the lens
    steps that do not depend on ``max_steps``.

    Only these steps may run the update as the lens needs it (every rollout's own prompt, the lens's capture inside
    the update's first pass), which changes the update's float rounding where ``shared_prompt_forward`` is on. The
    run's last step, measured when off the cadence (:func:`is_lens_step`), is a lens step of this run but not of the
    same run resumed with a larger ``max_steps``, so there the lens runs its own pass and the update is a lens-off
    step's, bit for bit (:func:`plan_lens`: a resumed run then trains as the straight one).
    """
    return lens_every > 0 and (step == 1 or step % lens_every == 0)


# ---------------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------------
@holds_run_dir("train")  # one writer: a live run's --out is refused to any other process
def train(config: TrainConfig, lens: Lens | None = None) -> RunDir:
    """Run GRPO as ``config`` says and return the run directory.

    Args:
        config: a validated :class:`TrainConfig`; ``config.out`` is required.
        lens: any :class:`grpo_lens.train.state.Lens` (which lists the methods the loop calls;
            :class:`grpo_lens.lens.trainer_lens.TrainerLens` is grpo-lens's); built from the config when None and
            lens_every > 0.

    Every input is checked before anything is written; a new run's directory is created (or a run replaced with
    ``overwrite``) only once the model has loaded, and a resumed run's files change only once its checkpoint has
    loaded, so a failed start leaves --out as it was.

    Raises:
        ConfigError / RunDirError / ModelNotFoundError / ValueError: bad settings, an unusable --out, a missing model,
            an unknown task or reward, a malformed data row, a missing or corrupt checkpoint.
        NonFiniteUpdateError: ``max_consecutive_skips`` steps in a row had a non-finite loss or gradient.
    """
    if not config.out:
        raise ValueError("config field 'out' (flag --out) is required: the run directory to write")
    keep_freed_memory()  # a step's gigabytes of activations are reused, not page-faulted in again
    procs = setup_processes(config.device)
    run = RunDir(config.out)
    config, task, reward_fns, ckpt = check_before_writing(config, run, procs)  # read-only: --out is untouched
    evaluation = Evaluation.start(config, task)  # the held-out prompts (a missing split fails here)
    models = build_models(config, procs)
    check_prompts(config, task, models)  # every prompt formats and fits the model's context: still read-only
    schedule = LRSchedule(models.optimizer, config)  # the LR is a function of the step: resumes need no state
    if lens is None and config.lens_every > 0:
        lens = TrainerLens(models.policy, LensSettings.from_train_config(config), tokenizer=models.tokenizer)
    state = open_run(run, config, procs, models, lens, ckpt)  # writes --out (a new run, or resumes from ckpt)
    logs = StepLogs.start(run, config, procs, state.step)

    for step in range(state.step + 1, config.max_steps + 1):
        t0 = time.perf_counter()
        schedule.apply(step)  # --lr-scheduler with its warm-up
        # 1. prompts, rollouts and their rewards (with --dynamic-sampling: extra rounds until B mixed groups)
        rollouts = sample_step(config, procs, task, reward_fns, models, step)
        # 2. reference log-probs for the KL term (None with beta = 0); with --kl-in-reward its penalty on the rewards
        ref_logp = reference_logprobs(models.reference, rollouts.batch, config, procs)
        if config.kl_in_reward and ref_logp is not None:
            rollouts = penalise_kl_in_reward(rollouts, ref_logp, config.beta, procs)
        # 3. advantages: one scalar per rollout (with --estimator optimal: b* weighted by sketched gradient norms)
        advantages, baseline_metrics = step_advantages(config, procs, models.policy, rollouts)
        # 4. the lens reads this step's rollouts before the update changes the policy, or plans to read the update
        plan = plan_lens(lens, step, config, procs, models.policy, rollouts, advantages)
        if plan.lens_step and (config.lens_landing or config.lens_dead_kl):  # read at the first optimizer step
            with forward_precision(procs.device, config.dtype):
                kl = {} if config.kl_in_reward else {"beta": config.beta, "kl_estimator": config.kl_estimator}
                first = mini_batch_rows(rollouts.batch.num_groups, config.group_size, config.num_mini_batches)[0]
                # plan.lens_step: a lens is set; before_update is TrainerLens's
                lens.before_update(models.policy, rollouts.batch, advantages, ref_logp, **kl, first=first)  # type: ignore[union-attr]
        # 5. policy update: mu passes, mini-batches, micro-batches, AdamW with gradient clipping
        before_step = functools.partial(lens.before_step, models.policy) if lens is not None else None
        update_metrics = policy_update(
            models.policy,
            models.optimizer,
            rollouts.batch,
            advantages,
            ref_logp,
            config,
            procs,
            models.params,
            before_step=before_step,
            step=step,
            capture=plan.capture,
            per_rollout=plan.per_rollout,  # a lens step's numbers are the same whichever pass the lens reads
        )
        stop_if_weights_diverged(models, procs, run, step, state.step)  # before anything reads the new weights
        # 6. the lens after the update: its g_i read off the update's first pass, and S4 around the optimizer step
        lens_metrics = lens_after_update(lens, plan, step, procs, models.policy, rollouts, advantages)
        # 7. the guards: a step with a skipped optimizer step, or with no scorable rollout, counts toward
        #    --max-consecutive-skips
        update_metrics.update(state.count_skipped(update_metrics[mk.GUARD_SKIPPED_OPTIMIZER_STEPS] > 0))
        state.count_unscored(procs.sum_floats([float(rollouts.valid.sum())])[0] == 0)
        state.count_untrained(  # --overlong mask / filter with every completion cut: no rollout has a gradient
            config.overlong in ("mask", "filter")
            and procs.sum_floats([float((~rollouts.batch.truncated).sum())])[0] == 0
        )
        # 8. the step's record over all processes' rollouts, one JSON line in metrics.jsonl and the trackers
        parts = [update_metrics, lens_metrics, baseline_metrics, {mk.LR: models.optimizer.param_groups[0]["lr"]}]
        record = step_record(step, config, procs, rollouts, advantages, parts, t0)
        record.update(state.count_dead(record[mk.DEAD_MIXED_GROUPS] == 0))
        if evaluation is not None:  # --eval-every: held-out accuracy after the update
            record.update(evaluation(step, models.policy, models.tokenizer, procs.device))
        if procs.is_main:
            logs.write(step, record, rollouts, advantages, config.log_completions)
        stop_after_skips(state, config, procs, run, step)  # before any checkpoint of this step
        # 9. checkpoint (atomic): model, optimizer, step, guard, random generators; with --stop-after-dead-steps, a
        #    run that has had no mixed group for that many steps stops here, checkpointed
        dead_stop = 0 < config.stop_after_dead_steps <= state.guard["dead"]
        save_checkpoint_if_due(run, step, config, procs, models, lens, state, force=dead_stop)
        state.step = step
        if dead_stop:
            stop_after_dead_steps(run, config, procs, step, state.guard["dead"])
            break

    logs.close()
    finish_run(run, config, procs, models, lens)
    return run


def build_models(config: TrainConfig, procs: Processes) -> Models:
    """Seed the generators, load the policy, check it (:func:`grpo_lens.train.checks.check_model`), copy the
    reference, add LoRA, lay the policy out over the processes (``--parallelism``, :mod:`grpo_lens.runtime.sharding`;
    the reference stays a whole copy on every process) and make the optimizer: AdamW (lr, betas, weight decay from
    ``config``) over the parameters that require gradients (for fsdp2, their shards).

    The policy stays in eval mode for the whole run: dropout (``attention_dropout``, GPT-2's ``resid_pdrop``, LoRA's
    ``lora_dropout``) is off in every log-prob forward of the policy, pi_old, the reference and the lens, so the first
    pass's ratio is 1 and the trainer's log-probs are the sampler's (trl PR 3234). Gradients flow in eval mode.

    Raises:
        ModelNotFoundError: the model does not load.   ValueError: :func:`grpo_lens.train.checks.check_model`'s checks.
    """
    if not config.progress:
        hf_logging.disable_progress_bar()  # --no-progress silences transformers' loading bars too
    seed_everything(config.seed)
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32  # bf16-mixed: float32 weights
    policy, tokenizer = load_model(config.model, dtype=dtype, device=procs.device)
    policy.eval()  # dropout off in every forward (trl PR 3234): gradients need no train mode
    check_model(config, policy)  # before --out is written
    reference = None
    if config.beta > 0:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if config.lora_rank > 0:  # the reference above stays the plain base model
        policy = apply_lora(
            policy,
            config.lora_rank,
            config.lora_alpha,
            config.lora_target_modules,
            linear_layer_names(policy),
        )
        policy.eval()  # LoRA's own dropout off too
    policy = PARALLELISMS.get(config.parallelism)(policy, procs.world)  # fsdp2: fully_shard (reference unsharded)
    procs.sharded = is_sharded(policy)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), weight_decay=config.weight_decay
    )
    return Models(policy, tokenizer, reference, optimizer, params)


def open_run(
    run: RunDir, config: TrainConfig, procs: Processes, models: Models, lens: Lens | None, ckpt: Path | None
) -> RunState:
    """Write the run directory, once the model has loaded: a new run's, or, to resume, load ``ckpt`` (weights,
    optimizer, guard counters, random generators, lens state) first and then drop what came after it.

    The main process writes; every process waits for it. A stale ``final_model`` goes once training continues.
    """
    state = RunState()
    if config.resume:
        if ckpt is not None:
            load = functools.partial(load_full_states, models.policy, models.optimizer) if procs.sharded else None
            saved = run.load_checkpoint(ckpt, models.policy, models.optimizer, load_states=load)
            state.step = int(saved["step"])
            state.guard.update(saved.get("guard") or {})
            if saved.get("rng"):
                _set_rng_state(saved["rng"])
            if lens is not None and saved.get("lens") is not None:
                lens.load_state_dict(saved["lens"])
        if procs.is_main:
            run.write_config(config.to_dict())
            run.prune_checkpoints(state.step, config.keep_checkpoints)
            run.truncate_metrics(state.step)
            logger.info("resuming %s from step %d", run.path, state.step)
    elif procs.is_main:
        run.prepare(config.to_dict(), resume=False, overwrite=config.overwrite)  # replaces a run only with overwrite
        run.write_config(config.to_dict())
    procs.barrier()
    if lens is not None and state.step == 0:
        lens.start(models.policy)
    if procs.is_main and state.step < config.max_steps and (run.path / "final_model").exists():
        shutil.rmtree(run.path / "final_model")  # it would be stale once training continues
    if procs.is_main and state.step >= config.max_steps:
        logger.warning(
            "%s is already at step %d >= max_steps %d: nothing to train (raise --max-steps to continue)",
            run.path,
            state.step,
            config.max_steps,
        )
    return state


def sample_step(
    config: TrainConfig, procs: Processes, task: Task, reward_fns: list[tuple[str, float]], models: Models, step: int
) -> Rollouts:
    """This process's rollouts of step ``step``: round 0 (:func:`sample_round`) or, with ``dynamic_sampling``, the
    mixed groups of as many rounds as :func:`sample_dynamic` needs. Randomness derives from (seed, step) only."""
    draw = functools.partial(sample_round, config, procs, task, reward_fns, models, step, step_seed(config.seed, step))
    try:
        if config.dynamic_sampling:
            return sample_dynamic(
                draw,
                config.prompts_per_step // procs.world,
                config.dynamic_sampling_max_rounds,
                models.tokenizer.pad_token_id,
            )
        return draw(0)
    except RuntimeError as err:  # finite but huge weights overflow in the forward: sampling meets inf/nan
        text = str(err)
        if "probability tensor contains" not in text and not ("inf" in text and "nan" in text):
            raise
        lr = models.optimizer.param_groups[0]["lr"]
        raise NonFiniteWeightsError(
            f"step {step}: sampling met NaN/inf probabilities ({str(err).splitlines()[0][:80]}): the weights after "
            f"step {step - 1}'s update (learning rate {lr:.3g}) overflow; resume from step {step - 1} or earlier "
            f"with a lower --learning-rate (--resume --learning-rate ...)"
        ) from None


def sample_round(
    config: TrainConfig,
    procs: Processes,
    task: Task,
    reward_fns: list[tuple[str, float]],
    models: Models,
    step: int,
    seed: int,
    rnd: int,
) -> Rollouts:
    """Round ``rnd`` of a step (0: the ordinary batch; > 0: dynamic sampling's extra rounds), scored.

    Every process draws the same B prompts (seeded by ``seed``, or by ``step_seed(seed, rnd)`` for round > 0) and
    samples R completions for each prompt of its own share; rewards mask invalid rollouts (NaN) out of the group
    statistics, and with ``overlong = soft-punish`` DAPO's eq. 13 penalty is added to every valid rollout's reward.
    """
    B, R, share = config.prompts_per_step, config.group_size, config.prompts_per_step // procs.world
    rseed = seed if rnd == 0 else step_seed(seed, rnd)
    if rnd == 0 and config.prompt_order == "epoch":  # TRL's convention: each row once per pass (tasks.epoch_rows)
        # check_inputs refuses epoch order for a task without data rows
        examples = epoch_rows(task.data["train"], B, (step - 1) * B, config.seed)  # type: ignore[attr-defined]
    else:
        examples = task.sample(B, seed=rseed)
    examples = examples[procs.rank * share : (procs.rank + 1) * share]
    t_start = time.perf_counter()
    crash_point("during_generation", step, module=models.policy)
    with forward_precision(procs.device, config.dtype):
        batch = sample_groups(
            models.policy,
            models.tokenizer,
            examples,
            R,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            generator_seed=rseed + 104_729 * procs.rank,
        )
    seconds = time.perf_counter() - t_start
    rewards, valid, reward_info = rollout_rewards(
        reward_fns, batch, config.reward_timeout, RewardState(global_step=step, max_steps=config.max_steps)
    )
    rewards, valid = rewards.to(procs.device), valid.to(procs.device)
    correct = rollout_correctness(task, batch, config.reward_timeout).to(procs.device)
    if config.overlong == "soft-punish":  # DAPO eq. 13 added to every valid rollout's reward
        penalty = soft_overlong_penalty(
            batch.completion_mask.sum(dim=1), config.overlong_length(), config.overlong_cache()
        ).to(rewards.device)
        rewards = rewards + penalty.to(rewards.dtype)  # NaN (invalid) stays NaN
        reward_info[mk.REWARD_OVERLONG_PENALTY] = float(procs.gather(penalty).mean())
    return Rollouts(batch, rewards, valid, correct, reward_info, {}, [(rewards, valid, correct)], seconds)


def sample_dynamic(draw: Callable[[int], Rollouts], num_groups: int, max_extra_rounds: int, pad_id: int) -> Rollouts:
    """DAPO's dynamic sampling (docs/theory.md §Dynamic sampling): rounds ``draw(0)``, ``draw(1)``, ... until
    ``num_groups`` mixed groups (:func:`grpo_lens.train.dynamic_sampling.collect_mixed_groups`); the rollouts of the
    mixed groups kept, ``dynamic/*`` metrics, and every round's scores in ``sampled``."""
    rounds: list[Rollouts] = []

    def scored_round(rnd: int) -> tuple:
        rounds.append(draw(rnd))
        r = rounds[-1]
        return r.batch, r.rewards, r.valid, r.reward_info, r.correct

    batch, rewards, valid, reward_info, dynamic, (correct,) = collect_mixed_groups(
        scored_round, num_groups, max_extra_rounds, pad_id
    )
    return Rollouts(
        batch,
        rewards,
        valid,
        correct,
        reward_info,
        dynamic,
        [s for r in rounds for s in r.sampled],
        sum(r.generation_seconds for r in rounds),
    )


def penalise_kl_in_reward(rollouts: Rollouts, ref_logp: torch.Tensor, beta: float, procs: Processes) -> Rollouts:
    """``--kl-in-reward``: every valid rollout's reward minus beta * sum_t (log pi_old - log pi_ref)
    (:func:`grpo_lens.formulas.losses.kl_reward_penalty`; pi_old is the sampler's log-probs), and
    ``reward/kl_penalty``, the mean penalty over all processes' valid rollouts."""
    batch = rollouts.batch
    penalty = kl_reward_penalty(batch.sampler_logprobs, ref_logp, batch.completion_mask, beta).to(rollouts.rewards)
    total, count = procs.sum_floats([float(penalty[rollouts.valid].sum()), float(rollouts.valid.sum())])
    info = {**rollouts.reward_info, mk.REWARD_KL_PENALTY: total / count if count else math.nan}
    return replace(rollouts, rewards=rollouts.rewards - penalty, reward_info=info)  # NaN stays NaN


def step_advantages(
    config: TrainConfig, procs: Processes, policy: torch.nn.Module, rollouts: Rollouts
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages [N] of the step's rollouts, one scalar per rollout shared by all its tokens, and baseline metrics.

    :func:`grpo_lens.formulas.advantages.compute_advantages` with the configured estimator over each group's valid
    rollouts; with ``--estimator optimal`` its b* weights come from :func:`optimal_baseline_weights` and the metrics
    hold ``adv/optimal_baseline``, ``adv/optimal_minus_rloo`` (:func:`optimal_baseline_metrics`). Truncated
    completions count in their group's statistics and, with ``--overlong mask`` or ``filter``, get zero advantage.
    """
    R = config.group_size
    rewards, valid = rollouts.rewards.view(-1, R), rollouts.valid.view(-1, R)
    grad_sq_norms, metrics = None, {}
    if config.estimator == "optimal":
        t_b = time.perf_counter()
        grad_sq_norms = optimal_baseline_weights(config, procs, policy, rollouts)
        metrics[mk.PERF_OPTIMAL_BASELINE_SECONDS] = time.perf_counter() - t_b
    if config.estimator in BATCH_ESTIMATORS:  # statistics over every process's groups, then this process's share
        advantages = batch_advantages(config, rewards, valid)
    else:
        advantages = compute_advantages(
            rewards.float(),
            config.estimator,
            std=config.std,  # type: ignore[arg-type]  # the config's check allows only these names
            std_eps=config.std_eps,
            mask=valid,
            grad_sq_norms=grad_sq_norms,
        ).view(-1)
    if config.estimator == "optimal":
        metrics.update(optimal_baseline_metrics(procs, rewards, valid, advantages.view(-1, R)))
    return overlong_advantages(advantages, rollouts.batch.truncated, config.overlong), metrics  # mask / filter: A = 0


def batch_advantages(config: TrainConfig, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N] advantages of this process's groups under a batch-level estimator
    (:data:`grpo_lens.formulas.advantages.BATCH_ESTIMATORS`): computed on every process's [B, R] rewards together
    (what one process with the whole batch computes), then this process's rows."""
    parts = gather_objects((rewards.detach().cpu(), valid.detach().cpu()))
    rank = torch.distributed.get_rank() if len(parts) > 1 else 0
    everything = compute_advantages(
        torch.cat([r for r, _ in parts]).float(),
        config.estimator,
        std=config.std,  # type: ignore[arg-type]  # the config's check allows only these names
        std_eps=config.std_eps,
        mask=torch.cat([v for _, v in parts]),
    )
    start = sum(r.shape[0] for r, _ in parts[:rank])
    return everything[start : start + rewards.shape[0]].reshape(-1).to(rewards.device)


def optimal_baseline_weights(
    config: TrainConfig, procs: Processes, policy: torch.nn.Module, rollouts: Rollouts
) -> torch.Tensor:
    """The b*_{-i} weights of ``--estimator optimal``: [B, R] sketched ||c_i g_i||^2 of every valid rollout of a group
    with reward contrast (0 elsewhere), c_i the loss aggregation's per-rollout weight
    (:func:`grpo_lens.gradients.sketch.sketched_rollout_sq_norms`, docs/theory.md §The variance-optimal baseline in
    training)."""
    R = config.group_size
    rewards, valid = rollouts.rewards.view(-1, R), rollouts.valid.view(-1, R)
    contrast = ~constant_groups(rewards, valid)  # [B] groups with a gradient
    need = (valid & contrast.unsqueeze(1)).view(-1)
    with forward_precision(procs.device, config.dtype):
        return (
            sketched_rollout_sq_norms(
                policy,
                rollouts.batch,
                need.cpu(),
                aggregation=config.loss_aggregation,
                sketch_dim=config.sketch_dim,
                seed=config.seed,
                temperature=config.temperature,
            )
            .view(-1, R)
            .to(procs.device)
        )


def optimal_baseline_metrics(
    procs: Processes, rewards: torch.Tensor, valid: torch.Tensor, advantages: torch.Tensor
) -> dict[str, float]:
    """``adv/optimal_baseline`` (mean b* over the rollouts it applies to) and ``adv/optimal_minus_rloo`` (mean b* -
    RLOO baseline), over all processes (:func:`grpo_lens.formulas.baselines.optimal_vs_rloo`); empty when no rollout
    has one. rewards, advantages: [B, R] float.   valid: [B, R] bool."""
    total, minus_rloo, count = procs.sum_floats(optimal_vs_rloo(rewards, valid, advantages))
    if count > 0:
        return {mk.ADV_OPTIMAL_BASELINE: total / count, mk.ADV_OPTIMAL_MINUS_RLOO: minus_rloo / count}
    return {}


def reference_logprobs(
    reference: torch.nn.Module | None, batch: RolloutBatch, config: TrainConfig, procs: Processes
) -> torch.Tensor | None:
    """[N, T] log-probs of the rollouts under the reference model (never top-k/top-p filtered); None without one.
    Each group's prompt runs once where the update's does (:func:`grpo_lens.train.update.update_logprobs`)."""
    if reference is None:
        return None
    with torch.no_grad(), forward_precision(procs.device, config.dtype):
        return update_logprobs(config, procs)(reference, batch, config.temperature)


def plan_lens(
    lens: Lens | None,
    step: int,
    config: TrainConfig,
    procs: Processes,
    policy: torch.nn.Module,
    rollouts: Rollouts,
    advantages: torch.Tensor,
) -> LensPlan:
    """Before the update: whether the lens measures step ``step`` (:func:`is_lens_step`) and how. When the update's
    first pass can give the lens its g_i, the plan carries the lens's capture for it; otherwise the lens measures
    now, on its own pass, before the update changes the policy. The run's last step off the cadence
    (:func:`on_lens_cadence`) always takes the own pass and leaves the update a lens-off step's."""
    if lens is None or not is_lens_step(step, config.lens_every, config.max_steps):
        return LensPlan(lens_step=False)
    step_batch = StepBatch(step, policy, rollouts.batch, rollouts.rewards, rollouts.valid, advantages)
    if not on_lens_cadence(step, config.lens_every):  # the last step: measured here, not in a longer resumed run
        with forward_precision(procs.device, config.dtype):
            metrics = lens.measure(step_batch)
        return LensPlan(lens_step=True, metrics=metrics)
    # the exact Gram from the update's own backward where the loss's token weights factor (all processes agree)
    why_not = lens_fuses_gram(config, lens, step_batch, procs)
    if why_not is None:
        proxy = {"batch": rollouts.batch} if config.lens_noise_proxy else {}  # verl's W_i at the step's weights
        # an optional lens method, looked up with hasattr (Lens's docstring)
        gram_capture = lens.update_gram_capture(policy, rollouts.rewards, rollouts.valid, config.group_size, **proxy)  # type: ignore[attr-defined]
        return LensPlan(lens_step=True, capture=gram_capture, per_rollout=True)
    if config.gram_source == "exact" and why_not not in _LENS_OWN_PASS_LOGGED | {"no mixed group"}:  # once each
        _LENS_OWN_PASS_LOGGED.add(why_not)
        logger.info(
            "lens: its own forward + backward at step %d (the Gram cannot come from the update's: %s; "
            "docs/theory.md §Lens inside the update's backward)",
            step,
            why_not,
        )
    if lens_reads_update(config, lens, rollouts.rewards, rollouts.valid, advantages, procs):  # all processes agree
        # an optional lens method, looked up with hasattr (Lens's docstring)
        return LensPlan(lens_step=True, capture=lens.update_capture(policy), per_rollout=True)  # type: ignore[attr-defined]
    with forward_precision(procs.device, config.dtype):
        metrics = lens.measure(step_batch)
    return LensPlan(lens_step=True, metrics=metrics, per_rollout=True)


def lens_after_update(
    lens: Lens | None,
    plan: LensPlan,
    step: int,
    procs: Processes,
    policy: torch.nn.Module,
    rollouts: Rollouts,
    advantages: torch.Tensor,
) -> dict[str, float]:
    """The lens's metrics of the step: from the update's first-pass rows when ``plan`` had a capture (g_i at the
    step's starting weights, :func:`grpo_lens.lens.trainer_lens.scores_from_update_rows`), else the plan's own, plus the
    lens's after-step S4 and sparsity metrics. Empty without a lens."""
    if lens is None:
        return {}
    metrics = plan.metrics
    if plan.capture is not None:  # the exact Gram or the sketched rows of the update's first pass
        step_batch = StepBatch(step, policy, rollouts.batch, rollouts.rewards, rollouts.valid, advantages)
        # an optional lens method, looked up with hasattr (Lens's docstring)
        metrics = lens.measure_from_update(step_batch, plan.capture)  # type: ignore[attr-defined]
    metrics.update(lens.after_step(step, policy, plan.lens_step))
    return metrics


# ---------------------------------------------------------------------------------------------------------------------
# Logging, the guard, checkpoints, the end of a run
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class StepLogs:
    """Where the main process writes each step: metrics.jsonl and completions.jsonl of ``run``, the trackers (None on
    other processes or when nothing is left to train) and the progress bar (None without ``progress``)."""

    run: RunDir
    trackers: Trackers | None
    progress: Any
    lines_of: int = 0  # without a progress bar (--no-progress), one log line per step "step s/lines_of ..."
    rewards: tuple = ()  # the reward specs: a custom one renames "accuracy" in the step line

    @classmethod
    def start(cls, run: RunDir, config: TrainConfig, procs: Processes, start_step: int) -> StepLogs:
        """The logs of a run that continues after step ``start_step`` (0 for a new run)."""
        progress = _progress(config, start_step, procs)
        trackers = None
        if procs.is_main and start_step < config.max_steps:
            trackers = Trackers(config.report_to, run.path, config.to_dict(), start_step)
        if procs.is_main and (note := accuracy_note(config.rewards)):
            logger.info("%s", note)
        return cls(run, trackers, progress, 0 if progress is not None else config.max_steps, tuple(config.rewards))

    def write(
        self, step: int, record: dict[str, Any], rollouts: Rollouts, advantages: torch.Tensor, n_completions: int
    ) -> None:
        """Append ``record`` to metrics.jsonl and the trackers, the first ``n_completions`` rollouts' texts to
        completions.jsonl, and move the progress bar."""
        self.run.append_metrics(record)
        if self.trackers is not None:
            self.trackers.log(record, step)
        rows = _log_completions(self.run, step, rollouts.batch, rollouts.rewards, advantages, n_completions)
        if self.trackers is not None:
            self.trackers.log_completions(rows, step)
        crash_point("after_metrics_write", step)
        if self.progress is not None:
            self.progress.set_postfix(reward=f"{record[mk.REWARD_MEAN]:.3f}", sec=f"{record[mk.PERF_STEP_SECONDS]:.1f}")
            self.progress.update(1)
        elif self.lines_of:
            logger.info("%s", step_line(record, self.lines_of, list(self.rewards)))

    def close(self) -> None:
        """Close the progress bar and finish the trackers."""
        if self.progress is not None:
            self.progress.close()
        if self.trackers is not None:
            self.trackers.finish()


def weights_finite(params: list[torch.nn.Parameter]) -> bool:
    """Whether every trainable weight is finite (one fused reduction per tensor, no copy)."""
    return all(bool(torch.isfinite(p).all()) for p in params)


def stop_if_weights_diverged(models: Models, procs: Processes, run: RunDir, step: int, last_step: int) -> None:
    """Raise :class:`NonFiniteWeightsError` when an update of step ``step`` left a NaN or infinite weight (all
    processes agree), before the next generate would fail on it, naming the step, the learning rate and how to go on.
    ``last_step``: the step before (its checkpoint, when it has one, holds finite weights)."""
    (bad,) = procs.sum_floats([0.0 if weights_finite(models.params) else 1.0])
    if not bad:
        return
    lr = models.optimizer.param_groups[0]["lr"]
    try:
        ckpt = run.latest_checkpoint()
    except RunDirError:
        ckpt = None
    where = f"the checkpoint {ckpt.name} is intact" if ckpt is not None else "no checkpoint was written yet"
    procs.barrier()
    raise NonFiniteWeightsError(
        f"step {step}: the weights are NaN/inf after the update at learning rate {lr:.3g}, so the run stopped before "
        f"the next generate ({where}); resume from step {last_step} with a lower --learning-rate (--resume "
        f"--learning-rate ...; the run checkpoints every --checkpoint-every steps)"
    )


def stop_after_skips(state: RunState, config: TrainConfig, procs: Processes, run: RunDir, step: int) -> None:
    """Raise :class:`NonFiniteUpdateError` once ``max_consecutive_skips`` steps in a row were skipped (docs/theory.md
    §Numerical guards), or :class:`NoScorableRolloutError` once that many steps in a row had no scorable rollout,
    before the step's checkpoint, so the last checkpoint stays the last good state. A run shorter than
    ``max_consecutive_skips`` stops so at its last step when none of its steps had a scorable rollout: a run where
    nothing scores fails whatever its length."""
    error: Exception | None = None
    if state.guard.get("unscored", 0) >= min(config.max_consecutive_skips, config.max_steps):
        error = NoScorableRolloutError(
            f"step {step}: no rollout could be scored for {state.guard['unscored']} consecutive steps "
            f"(--max-consecutive-skips {config.max_consecutive_skips}): every reward was None/NaN or its reward "
            f"function failed (the first failure's traceback is in the log above; rewards {config.rewards}). Check "
            f"that the dataset has the columns the reward functions need (correctness needs 'answer'), fix the "
            f"function, and resume with --resume"
        )
    elif state.guard.get("untrained", 0) >= min(config.max_consecutive_skips, config.max_steps):
        error = NoScorableRolloutError(
            f"step {step}: every completion of the last {state.guard['untrained']} steps was cut at "
            f"--max-new-tokens {config.max_new_tokens}, and --overlong {config.overlong} gives a cut completion no "
            f"gradient, so nothing trained; raise --max-new-tokens, or use --overlong none or soft-punish"
        )
    elif state.guard["consecutive"] >= config.max_consecutive_skips:
        error = NonFiniteUpdateError(
            f"step {step}: the loss or gradient was non-finite for {state.guard['consecutive']} consecutive steps "
            f"(--max-consecutive-skips {config.max_consecutive_skips}), so training stopped; the last checkpoint "
            f"in {run.path / 'checkpoints'} is intact: lower --learning-rate or --beta, or check the rewards"
        )
    if error is not None:
        procs.barrier()
        raise error


def stop_after_dead_steps(run: RunDir, config: TrainConfig, procs: Processes, step: int, dead_steps: int) -> None:
    """``--stop-after-dead-steps``: log why the run stops at ``step`` and record it in RUN/stopped.json (main process;
    written to a temporary file and renamed, so it is whole or absent). The caller ends the loop; the step's checkpoint
    is already written, so ``--resume`` with a larger ``--max-steps`` or the flag off continues from it."""
    message = (
        f"step {step}: no group had reward contrast for {dead_steps} consecutive steps (--stop-after-dead-steps "
        f"{config.stop_after_dead_steps}): every group's rewards were all equal, so no policy gradient; training "
        f"stopped with a checkpoint at step {step}. Easier prompts, a larger --group-size or --dynamic-sampling give "
        f"groups with contrast"
    )
    if procs.is_main:
        logger.warning(message)
        record = {"step": step, "reason": "dead_steps", "steps_without_mixed": dead_steps, "message": message}
        tmp = run.path / "stopped.json.tmp"
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, run.path / "stopped.json")
    procs.barrier()


def save_checkpoint_if_due(
    run: RunDir,
    step: int,
    config: TrainConfig,
    procs: Processes,
    models: Models,
    lens: Lens | None,
    state: RunState,
    force: bool = False,
) -> None:
    """Every ``checkpoint_every`` steps and at the last: model, optimizer, step, the guard's counters, the random
    generators, the lens's state and the config the steps ran with (a resume compares with it), written atomically
    by the main process (an FSDP2-sharded policy's full tensors gathered to it first); every step's own randomness
    derives from (seed, step)."""
    if force or step % config.checkpoint_every == 0 or step == config.max_steps:
        full = {}
        if procs.sharded:  # every process takes part in gathering the full tensors to rank 0
            full = {
                "model_state": full_model_state(models.policy),
                "optimizer_state": full_optimizer_state(models.policy, models.optimizer),
            }
        if procs.is_main:
            saved = {
                "rng": _rng_state(),
                "lens": lens.state_dict() if lens is not None else None,
                "guard": dict(state.guard),
                "config": config.to_dict(),
            }
            run.save_checkpoint(step, models.policy, models.optimizer, saved, keep=config.keep_checkpoints, **full)
        procs.barrier()


def finish_run(run: RunDir, config: TrainConfig, procs: Processes, models: Models, lens: Lens | None) -> None:
    """After the last step: log what the lens cost and save the final model (main process), then wait for all."""
    if lens is not None and procs.is_main:
        _log_lens_cost(run)
    if config.save_final_model and not (run.path / "final_model").exists():
        state = full_model_state(models.policy) if procs.sharded else None  # every process gathers
        if procs.is_main:
            save_final_model(models.policy, models.tokenizer, run.path / "final_model", state_dict=state)
    procs.barrier()


def save_final_model(
    policy: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    path: Path,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save policy and tokenizer with ``save_pretrained`` into ``path`` atomically (temp folder + rename); a LoRA
    policy is saved merged, with its adapter alone in ``path/adapter`` (:func:`grpo_lens.lora.save_lora_model`).
    ``state_dict``: the full weights of an FSDP2-sharded policy (:func:`grpo_lens.runtime.sharding.full_model_state`),
    saved under the model's own class name."""
    for stray in path.parent.glob(f".{path.name}.tmp-*"):  # left by a run killed while saving
        shutil.rmtree(stray, ignore_errors=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if is_lora(policy):  # merged model in path/, the adapter alone in path/adapter/
        save_lora_model(policy, tokenizer, tmp)
    elif state_dict is not None:  # fully_shard renamed the class (FSDP<Name>): the config keeps the model's own
        architectures = getattr(policy.config, "architectures", None)
        # nn.Module types a transformers/peft model's attribute as Tensor | Module
        policy.config.architectures = (  # type: ignore[union-attr]
            [c.__name__ for c in type(policy).__mro__ if c.__name__ == type(policy).__name__.removeprefix("FSDP")][:1]
            or architectures
        )
        try:
            # nn.Module types a transformers/peft model's attribute as Tensor | Module
            policy.save_pretrained(tmp, state_dict=state_dict)  # type: ignore[operator]
        finally:
            # nn.Module types a transformers/peft model's attribute as Tensor | Module
            policy.config.architectures = architectures  # type: ignore[union-attr]
        tokenizer.save_pretrained(tmp)
    else:
        # nn.Module types a transformers/peft model's attribute as Tensor | Module
        policy.save_pretrained(tmp)  # type: ignore[operator]
        tokenizer.save_pretrained(tmp)
    crash_point("mid_final_model", 0)
    os.replace(tmp, path)
    return path
