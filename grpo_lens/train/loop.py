"""The GRPO training loop: sample -> reward -> advantages -> clipped-surrogate passes -> AdamW step, with the lens.

Read :func:`train` top to bottom: every formula it uses lives in a pure module (advantages, losses, diagnostics);
this file only moves tensors between them, writes the run directory and keeps the run resumable.

Several processes (``torchrun --nproc_per_node 2 -m grpo_lens.cli train ...``, or ``accelerate launch``): every
process draws the same B prompts for a step and samples the groups of its own share of them; losses are divided by a
normaliser summed over processes and the gradients are summed with an all-reduce, so the update equals a single
process's on the whole batch. With num_mini_batches M, each process splits its share into M chunks and optimizer step
k sums chunk k of every process.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from grpo_lens.config import TrainConfig
from grpo_lens.formulas.advantages import compute_advantages, constant_groups
from grpo_lens.formulas.baselines import optimal_vs_rloo
from grpo_lens.formulas.overlong import overlong_advantages, soft_overlong_penalty
from grpo_lens.gradients.params import linear_layer_names
from grpo_lens.gradients.sketch import sketched_rollout_sq_norms
from grpo_lens.lora import apply_lora, is_lora, save_lora_model
from grpo_lens.models import load_model, resolve_model
from grpo_lens.rewards import parse_reward_specs
from grpo_lens.rollout import RolloutBatch, batch_logprobs, sample_groups
from grpo_lens.rundir import RunDir, crash_point, lens_overhead
from grpo_lens.seeding import seed_everything
from grpo_lens.tasks import get_task
from grpo_lens.trackers import Trackers, check_trackers
from grpo_lens.train.dynamic_sampling import collect_mixed_groups
from grpo_lens.train.lens import TrainerLens, scores_from_update_rows
from grpo_lens.train.memory import _peak_memory_mb
from grpo_lens.train.processes import Processes, setup_processes
from grpo_lens.train.step_metrics import (
    _pad_to,
    accuracy_metrics,
    rollout_correctness,
    rollout_metrics,
    rollout_rewards,
    sampled_vs_kept,
)
from grpo_lens.train.update import forward_precision, lens_reads_update, policy_update

logger = logging.getLogger(__name__)


class NonFiniteUpdateError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient; the run stopped with its last checkpoint intact."""


#: Config fields that may change when a run is resumed (they do not change any step already taken).
RESUMABLE_KEYS = ("max_steps", "progress", "save_final_model", "checkpoint_every", "keep_checkpoints",
                  "log_completions", "device", "report_to",
                  "reward_timeout", "max_consecutive_skips")


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step``: every step's randomness derives from (seed, step), so a resumed run repeats it."""
    return (seed * 1_000_003 + step * 7_919) % (2**31 - 1)


def is_lens_step(step: int, lens_every: int, max_steps: int) -> bool:
    """Whether the lens measures step ``step`` (1-based): the first step, every ``lens_every``-th and the last.

    So every run with the lens on (``lens_every`` > 0) is measured at least at its start and end, even one shorter
    than ``lens_every`` steps. ``lens_every`` = 0 turns the lens off.
    """
    if lens_every <= 0:
        return False
    return step == 1 or step % lens_every == 0 or step == max_steps


# ---------------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------------
def check_inputs(config: TrainConfig, procs: Processes) -> tuple[Any, list[tuple[str, float]]]:
    """Everything about the inputs that can be checked without loading a model; returns (task, reward specs).

    Builds the task (which validates every data row), parses the reward specs and resolves the model name, so that
    a bad input fails before the run directory is written or a model loads.

    Raises:
        ValueError: prompts_per_step not divisible by the number of processes (or its per-process share by
            num_mini_batches), an unknown task or reward (listing the valid names), bad task options, a malformed
            data row (naming file and row).
        ModelNotFoundError: the model path does not exist.
    """
    if config.prompts_per_step % procs.world:
        raise ValueError(f"config field 'prompts_per_step' = {config.prompts_per_step} must be divisible by the "
                         f"number of processes ({procs.world}) so that each process samples whole groups")
    share = config.prompts_per_step // procs.world
    if share % config.num_mini_batches:  # optimizer step k takes the k-th chunk of every process's prompts
        raise ValueError(f"config field 'num_mini_batches' = {config.num_mini_batches} must divide the prompts each "
                         f"of the {procs.world} processes holds (prompts_per_step / processes = {share})")
    task = get_task(config.task, dataset=config.dataset, **config.task_options)
    reward_fns = parse_reward_specs(config.rewards)
    if config.dynamic_sampling and procs.world > 1:
        raise ValueError("--dynamic-sampling runs in one process only for now (processes would keep different "
                         "numbers of groups); drop it or run one process")
    if config.lora_rank > 0 and importlib.util.find_spec("peft") is None:
        raise ValueError("--lora-rank needs the peft package: pip install 'grpo-lens[lora]' (or pip install peft)")
    if procs.is_main:
        check_trackers(config.report_to)  # a missing tracker library fails before --out is touched
    resolve_model(config.model)
    return task, reward_fns


def check_model(config: TrainConfig, policy: torch.nn.Module) -> None:
    """Checks that need the loaded model; the trainer runs them before the run directory is written.

    Raises:
        ValueError: ``--estimator optimal`` with a model that has no ``nn.Linear`` layer (its b* weights are the
            sketched squared gradient norms of the linear layers).
    """
    if config.estimator == "optimal" and not linear_layer_names(policy):
        raise ValueError(f"--estimator optimal needs per-rollout gradient norms of the model's nn.Linear layers, and "
                         f"{config.model} has none; pick another --estimator (grpo, rloo, dr_grpo)")


def train(config: TrainConfig, lens: Any = None) -> RunDir:
    """Run GRPO as ``config`` says and return the run directory.

    Args:
        config: a validated :class:`TrainConfig`; ``config.out`` is required.
        lens: an object with ``before_step(step, policy)`` and ``measure(step, ...) -> dict`` (see
            :class:`grpo_lens.lens.TrainerLens`); built from the config when None and lens_every > 0.

    Every input is checked before anything is written; a new run's directory is created (or a run replaced with
    ``overwrite``) only once the model has loaded, and a resumed run's files change only once its checkpoint has
    loaded, so a failed start leaves --out as it was.

    Raises:
        ConfigError / RunDirError / ModelNotFoundError / ValueError: bad settings, an unusable --out, a missing model,
            an unknown task or reward, a malformed data row, a missing or corrupt checkpoint.
    """
    if not config.out:
        raise ValueError("config field 'out' (flag --out) is required: the run directory to write")
    procs = setup_processes(config.device)
    run = RunDir(config.out)

    # --- every input is checked, read-only, before the run directory is touched or a model loads ---------------------
    config = TrainConfig.from_dict(run.resolve(config.to_dict(), resume=config.resume, overwrite=config.overwrite,
                                               resumable_keys=RESUMABLE_KEYS, canonical=TrainConfig.canonical))
    task, reward_fns = check_inputs(config, procs)
    ckpt = run.latest_checkpoint() if config.resume else None  # a bad pointer fails before the model loads
    procs.barrier()  # every process has read --out before the main one changes it
    B, R = config.prompts_per_step, config.group_size

    # --- model, reference, optimizer ---------------------------------------------------------------------------------
    if not config.progress:
        hf_logging.disable_progress_bar()  # --no-progress silences transformers' loading bars too
    seed_everything(config.seed)
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32  # bf16-mixed: float32 weights
    policy, tokenizer = load_model(config.model, dtype=dtype, device=procs.device)
    policy.train()
    check_model(config, policy)  # before --out is written
    reference = None
    if config.beta > 0:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if config.lora_rank > 0:  # the reference above stays the plain base model

        policy = apply_lora(policy, config.lora_rank, config.lora_alpha, config.lora_target_modules)
        policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                  weight_decay=config.weight_decay)
    if lens is None and config.lens_every > 0:
        lens = TrainerLens(policy, config)

    # --- the run directory: written only once the model (and, to resume, the checkpoint) has loaded ------------------
    start_step = 0
    guard = {"consecutive": 0, "total": 0}  # trainer steps skipped for a non-finite loss or gradient
    if config.resume:
        if ckpt is not None:
            state = run.load_checkpoint(ckpt, policy, optimizer)
            start_step = int(state["step"])
            guard.update(state.get("guard") or {})
            if state.get("rng"):
                _set_rng_state(state["rng"])
            if lens is not None and state.get("lens") is not None:
                lens.load_state_dict(state["lens"])
        if procs.is_main:
            run.write_config(config.to_dict())
            run.prune_checkpoints(start_step, config.keep_checkpoints)
            run.truncate_metrics(start_step)
            logger.info("resuming %s from step %d", run.path, start_step)
    elif procs.is_main:
        run.prepare(config.to_dict(), resume=False, overwrite=config.overwrite)  # replaces a run only with overwrite
        run.write_config(config.to_dict())
    procs.barrier()
    if lens is not None and start_step == 0:
        lens.start(policy)

    if procs.is_main and start_step < config.max_steps and (run.path / "final_model").exists():
        shutil.rmtree(run.path / "final_model")  # it would be stale once training continues
    if procs.is_main and start_step >= config.max_steps:
        logger.warning("%s is already at step %d >= max_steps %d: nothing to train (raise --max-steps to continue)",
                       run.path, start_step, config.max_steps)
    progress = _progress(config, start_step, procs)
    trackers = None
    if procs.is_main and start_step < config.max_steps:
        trackers = Trackers(config.report_to, run.path, config.to_dict(), start_step)
    share = B // procs.world
    for step in range(start_step + 1, config.max_steps + 1):
        t0 = time.perf_counter()
        seed = step_seed(config.seed, step)

        gen_seconds: list[float] = []

        def sample_round(rnd: int):
            """Round ``rnd`` of this step (0: the ordinary batch; > 0: dynamic sampling's extra rounds)."""
            rseed = seed if rnd == 0 else step_seed(seed, rnd)
            # 1. prompts: every process draws the same B, samples its own share of them
            examples = task.sample(B, seed=rseed)[procs.rank * share:(procs.rank + 1) * share]
            # 2. rollouts: R completions per prompt, with the sampler's log-probs
            t_start = time.perf_counter()
            policy.eval()
            crash_point("during_generation", step, module=policy)
            with forward_precision(procs.device, config.dtype):
                batch = sample_groups(policy, tokenizer, examples, R, max_new_tokens=config.max_new_tokens,
                                      temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                                      generator_seed=rseed + 104_729 * procs.rank)
            policy.train()
            gen_seconds.append(time.perf_counter() - t_start)
            # 3. rewards (invalid rollouts are masked out of the group statistics)
            rewards, valid, reward_info = rollout_rewards(reward_fns, batch, config.reward_timeout)
            rewards, valid = rewards.to(procs.device), valid.to(procs.device)
            correct = rollout_correctness(task, batch, config.reward_timeout).to(procs.device)
            if config.overlong == "soft-punish":  # DAPO eq. 13 added to every valid rollout's reward
                penalty = soft_overlong_penalty(batch.completion_mask.sum(dim=1), config.overlong_length(),
                                                config.overlong_cache()).to(rewards.device)
                rewards = rewards + penalty.to(rewards.dtype)  # NaN (invalid) stays NaN
                reward_info["reward/overlong_penalty"] = float(procs.gather(penalty).mean())
            sampled.append((rewards, valid, correct))
            return batch, rewards, valid, reward_info, correct

        dynamic: dict[str, float] = {}
        sampled: list[tuple] = []  # every round's (rewards, valid, correct): dynamic sampling's all-groups view
        if config.dynamic_sampling:  # DAPO: extra rounds until B mixed groups (docs/theory.md §Dynamic sampling)
            batch, rewards, valid, reward_info, dynamic, (correct,) = collect_mixed_groups(
                sample_round, share, config.dynamic_sampling_max_rounds, tokenizer.pad_token_id)
        else:
            batch, rewards, valid, reward_info, correct = sample_round(0)
        t_gen = sum(gen_seconds)

        # 4. advantages: one scalar per rollout, shared by all its tokens; truncated completions count in their
        #    group's statistics and, with --overlong mask or filter, get zero advantage (no policy gradient)
        grad_sq_norms, baseline_metrics = None, {}
        if config.estimator == "optimal":  # b*_{-i} weights: sketched ||c_i g_i||^2 of the rollouts that need them
            t_b = time.perf_counter()
            contrast = ~constant_groups(rewards.view(-1, R), valid.view(-1, R))  # [B] groups with a gradient
            need = (valid.view(-1, R) & contrast.unsqueeze(1)).view(-1)
            with forward_precision(procs.device, config.dtype):
                grad_sq_norms = sketched_rollout_sq_norms(
                    policy, batch, need.cpu(), aggregation=config.loss_aggregation, sketch_dim=config.sketch_dim,
                    seed=config.seed, temperature=config.temperature,
                ).view(-1, R).to(procs.device)
            baseline_metrics["perf/optimal_baseline_seconds"] = time.perf_counter() - t_b
        advantages = compute_advantages(rewards.view(-1, R).float(), config.estimator, std=config.std,
                                        eps=config.eps, mask=valid.view(-1, R), grad_sq_norms=grad_sq_norms).view(-1)
        if config.estimator == "optimal":
            sums = procs.sum(torch.tensor(optimal_vs_rloo(rewards.view(-1, R), valid.view(-1, R),
                                                          advantages.view(-1, R)), dtype=torch.float64,
                                          device=procs.device)).tolist()
            if sums[2] > 0:
                baseline_metrics["adv/optimal_baseline"] = sums[0] / sums[2]
                baseline_metrics["adv/optimal_minus_rloo"] = sums[1] / sums[2]
        advantages = overlong_advantages(advantages, batch.truncated, config.overlong)  # mask / filter: A = 0

        # 5. reference log-probs for the KL term
        ref_logp = None
        if reference is not None:
            with torch.no_grad():
                with forward_precision(procs.device, config.dtype):
                    ref_logp = batch_logprobs(reference, batch, config.temperature)  # never top-k/top-p filtered

        # 6. the lens reads this step's rollouts before the update changes the policy
        lens_metrics: dict[str, float] = {}
        measure = lens is not None and is_lens_step(step, config.lens_every, config.max_steps)
        capture = None  # the lens's gradient capture inside the update's first pass, when that pass can serve it
        if measure and lens_reads_update(config, lens, rewards, valid, advantages):
            capture = lens.update_capture(policy)
        elif measure:
            with forward_precision(procs.device, config.dtype):
                lens_metrics = lens.measure(step, policy, batch, rewards, valid, advantages)

        # 7. policy update: mu passes, mini-batches, micro-batches, AdamW with gradient clipping
        try:
            loss_metrics = policy_update(policy, optimizer, batch, advantages, ref_logp, config, procs, params,
                                         before_step=(lambda: lens.before_step(policy)) if lens is not None else None,
                                         step=step, capture=capture)
        finally:
            if capture is not None:
                capture.__exit__(None, None, None)  # idempotent: hooks are gone whatever happened
        if capture is not None:  # g_i at the step's starting weights, read off the first pass's loss gradient rows

            n_total = float(procs.sum(batch.completion_mask.any(dim=1).sum().to(torch.float64)))
            sketch = scores_from_update_rows(capture.result().sketch, advantages, n_total)
            lens_metrics = lens.measure(step, policy, batch, rewards, valid, advantages, sketch=sketch)
        if lens is not None:
            lens_metrics.update(lens.after_step(step, policy, measure))
        step_skipped = loss_metrics["guard/skipped_optimizer_steps"] > 0
        guard["consecutive"] = guard["consecutive"] + 1 if step_skipped else 0
        guard["total"] += int(step_skipped)
        loss_metrics.update({"guard/step_skipped": int(step_skipped), "guard/skipped_steps": guard["total"],
                             "guard/consecutive_skipped": guard["consecutive"]})

        # 8. metrics over all processes' rollouts, one JSON line per step
        all_rewards, all_valid = procs.gather(rewards), procs.gather(valid)
        all_adv, all_mask = procs.gather(advantages), procs.gather(_pad_to(batch.completion_mask,
                                                                           config.max_new_tokens))
        all_trunc = procs.gather(batch.truncated)
        seconds = time.perf_counter() - t0
        tokens = float(all_mask.sum())
        record = {"step": step, **reward_info, **dynamic,  # this process's reward calls; all-process statistics win:
                  **rollout_metrics(all_rewards, all_valid, all_adv, all_mask, all_trunc, R),
                  **accuracy_metrics(procs.gather(correct)), **loss_metrics, **lens_metrics, **baseline_metrics,
                  "lr": optimizer.param_groups[0]["lr"],
                  "perf/step_seconds": seconds, "perf/generation_seconds": t_gen,
                  "perf/tokens_per_second": tokens / max(seconds, 1e-9),
                  "perf/peak_memory_mb": _peak_memory_mb(procs.device)}
        if config.dynamic_sampling:  # one process only (check_inputs), so no gather
            record.update(sampled_vs_kept(record, *(torch.cat([s[i] for s in sampled]) for i in range(3)), R))
        if procs.is_main:
            run.append_metrics(record)
            if trackers is not None:
                trackers.log(record, step)
            _log_completions(run, step, batch, rewards, advantages, config.log_completions)
            crash_point("after_metrics_write", step)
            if progress is not None:
                progress.set_postfix(reward=f"{record['reward/mean']:.3f}", sec=f"{seconds:.1f}")
                progress.update(1)

        if guard["consecutive"] >= config.max_consecutive_skips:  # before any checkpoint of this step
            procs.barrier()
            raise NonFiniteUpdateError(
                f"step {step}: the loss or gradient was non-finite for {guard['consecutive']} consecutive steps "
                f"(--max-consecutive-skips {config.max_consecutive_skips}), so training stopped; the last checkpoint "
                f"in {run.path / 'checkpoints'} is intact: lower --learning-rate or --beta, or check the rewards")

        # 9. checkpoint (atomic): model, optimizer, step; every step's randomness derives from (seed, step)
        if step % config.checkpoint_every == 0 or step == config.max_steps:
            if procs.is_main:
                state = {"rng": _rng_state(), "lens": lens.state_dict() if lens is not None else None,
                         "guard": dict(guard)}
                run.save_checkpoint(step, policy, optimizer, state, keep=config.keep_checkpoints)
            procs.barrier()

    if progress is not None:
        progress.close()
    if trackers is not None:
        trackers.finish()
    if lens is not None and procs.is_main:  # what the lens cost this run (the whole run, resumed parts included)

        cost = lens_overhead([r for r in run.read_metrics() if "step" in r])
        if cost and cost["lens_steps"]:
            logger.info("lens: %d of %d steps measured, %.1f s of its own, %.1f%% of the %.1f s the steps took "
                        "without it (a gradient capture inside the update's first pass is not in this count)",
                        cost["lens_steps"], cost["steps"], cost["lens_seconds"], 100 * cost["overhead"],
                        cost["train_seconds"])
    if config.save_final_model and procs.is_main and not (run.path / "final_model").exists():
        save_final_model(policy, tokenizer, run.path / "final_model")
    procs.barrier()
    return run


def save_final_model(policy: torch.nn.Module, tokenizer: Any, path: Path) -> Path:
    """Save policy and tokenizer with ``save_pretrained`` into ``path`` atomically (temp folder + rename); a LoRA
    policy is saved merged, with its adapter alone in ``path/adapter`` (:func:`grpo_lens.lora.save_lora_model`)."""
    for stray in path.parent.glob(f".{path.name}.tmp-*"):  # left by a run killed while saving
        shutil.rmtree(stray, ignore_errors=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")

    if is_lora(policy):  # merged model in path/, the adapter alone in path/adapter/
        save_lora_model(policy, tokenizer, tmp)
    else:
        policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    crash_point("mid_final_model", 0)
    os.replace(tmp, path)
    return path


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`_rng_state` saved, so a resumed run draws what the uninterrupted one would."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _log_completions(run: RunDir, step: int, batch: RolloutBatch, rewards: torch.Tensor, advantages: torch.Tensor,
                     n: int) -> None:
    R = batch.group_size
    for i in range(min(n, batch.num_rollouts)):
        prompt = batch.prompts[i // R]
        text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
        run.append_metrics({"step": step, "prompt": text, "completion": batch.completions[i],
                            "reward": float(rewards[i]), "advantage": float(advantages[i]),
                            "truncated": bool(batch.truncated[i])},
                           path=run.completions_path)


def _progress(config: TrainConfig, start: int, procs: Processes):
    if not (config.progress and procs.is_main):
        return None

    return tqdm(total=config.max_steps, initial=start, desc="GRPO", unit="step", dynamic_ncols=True)
