"""``TrainConfig``: every setting of ``grpo-lens train``, a dataclass whose field help is the CLI help and whose
names are the YAML keys of the run's config.yaml.

Shared fields come from the option groups (:mod:`grpo_lens.config.groups`), the trainer's own ones are written here;
each field's check lives with the field, and :meth:`TrainConfig.check` holds the checks of two or more fields and the
derived ones (``prompts_per_step`` from ``rollout_batch_size``, ``overlong`` from the deprecated ``mask_truncated``).
Deprecated names (``lens_sketch_dim`` -> ``sketch_dim``) are in :attr:`TrainConfig.names`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from grpo_lens import metrics as mk
from grpo_lens.config.base import (
    ConfigFile,
    Names,
    above,
    at_least,
    one_of,
    option,
    require,
)
from grpo_lens.config.groups import (
    EPS_NOTE,
    Adapter,
    Advantage,
    Lens,
    Model,
    Optimizer,
    Output,
    Runtime,
    Sampling,
    TaskData,
    check_task_dataset,
)
from grpo_lens.config.trl_names import register_trl_names
from grpo_lens.registry import declared_constant, declared_names

# Registries and constants of torch modules, read without importing them (``grpo-lens --help``; config/groups.py).
_KL_ESTIMATORS = "grpo_lens.formulas.losses", "KL_ESTIMATORS"
_POLICY_LOSSES = "grpo_lens.formulas.losses", "POLICY_LOSSES"
_PARALLELISMS = "grpo_lens.runtime.sharding", "PARALLELISMS"
OVERLONG_MODES = declared_constant("grpo_lens.formulas.overlong", "OVERLONG_MODES")

#: The ``lr_scheduler`` values: transformers' schedulers of those names (``transformers.get_scheduler``).
LR_SCHEDULERS = ("constant", "linear", "cosine")


_UNIT = require(lambda v: 0 <= v < 1, "must be in [0, 1)")  # a clip range or an Adam beta


@dataclass
class TrainConfig(ConfigFile):
    """Everything a GRPO run needs. Field help doubles as CLI help (flags use dashes: ``--group-size``)."""

    names: ClassVar[Names] = Names(
        renamed={
            "lens_sketch_dim": "sketch_dim",  # 0.2 names, accepted until 0.3
            "eps": "std_eps",
        },
        notes={"eps": EPS_NOTE},
    )

    # --- what to train on ------------------------------------------------------------------------------------------
    model: str = Model.model()
    task: str = TaskData.task()
    dataset: str | None = TaskData.dataset()
    dataset_sha256: str | None = option(
        None,
        "Written by the trainer, not to set: the sha256 of the --dataset file "
        "when the run started (config.yaml records it with the file's absolute path); "
        "a --resume whose file differs is refused unless --allow-dataset-change.",
    )
    dataset_rows: int | None = option(
        None, "Written by the trainer, not to set: the number of rows of the --dataset file when the run started."
    )
    allow_dataset_change: bool = option(
        False,
        "--resume although the --dataset file changed since the run started "
        "(its sha256 differs); the new hash and this flag are recorded in "
        "config.yaml.",
    )
    task_options: dict = TaskData.task_options()
    rewards: list = TaskData.rewards()
    reward_timeout: float = TaskData.reward_timeout()
    # --- sampling ----------------------------------------------------------------------------------------------------
    group_size: int = Sampling.group_size()
    prompts_per_step: int = Sampling.prompts_per_step()
    rollout_batch_size: int | None = option(
        None, "Rollouts per step (B*R); if set it must be a multiple of group_size and replaces prompts_per_step."
    )
    max_new_tokens: int = Sampling.max_new_tokens()
    temperature: float = Sampling.temperature()
    top_p: float = Sampling.top_p()
    top_k: int = Sampling.top_k()
    prompt_order: str = option(
        "independent",
        "How each step draws its B prompts from a dataset's rows: independent (each step B distinct rows at random, "
        "independently of other steps, so a row can come back before every row was seen) or epoch (TRL's "
        "convention: shuffled passes over the rows, each row once per epoch; needs --task jsonl with --dataset).",
        check=one_of(("independent", "epoch")),
    )
    dynamic_sampling: bool = option(
        False,
        "DAPO dynamic sampling (arXiv 2503.14476): sample extra rounds of prompts "
        "until the step has prompts_per_step groups whose rewards are not all equal; at "
        "the cap trains on the mixed groups found (logged as dynamic/mixed_groups).",
    )
    dynamic_sampling_max_rounds: int = option(
        3,
        "Cap on dynamic sampling's extra sampling rounds per step.",
        check=at_least(0, "must be >= 0 (0 = only the step's own round)"),
    )
    overlong: str = option(
        "none",
        "Completions cut at max_new_tokens: none, mask (advantage 0, kept in group "
        "statistics and the loss normaliser), filter (DAPO overlong filtering: their tokens leave "
        "the loss and its normaliser), soft-punish (DAPO's length penalty, eq. 13, added to the "
        "reward). DAPO arXiv 2503.14476; docs/theory.md.",
        check=one_of(OVERLONG_MODES),
    )
    overlong_max_length: int | None = option(
        None, "soft-punish: L_max, the length past which the penalty is -1 (unset: max_new_tokens)."
    )
    overlong_buffer: int | None = option(
        None,
        "soft-punish: L_cache, the width of the interval before L_max over "
        "which the penalty falls linearly from 0 to -1 (unset: L_max // 5, DAPO's "
        "4096 of 20480).",
    )
    mask_truncated: bool = option(
        False, "Deprecated alias of --overlong mask (kept so that old runs' configs load and resume)."
    )
    # --- advantages and loss -----------------------------------------------------------------------------------------
    estimator: str = Advantage.estimator()
    std: str = Advantage.std()
    std_eps: float = Advantage.std_eps()
    loss_aggregation: str = Advantage.loss_aggregation()
    beta: float = option(
        0.0, "KL coefficient against the frozen reference model (0 = no reference model).", check=at_least(0)
    )
    kl_in_reward: bool = option(
        False,
        "With beta > 0: subtract beta * sum_t k1 (log pi_old - log pi_ref over the "
        "completion) from each valid rollout's reward before the advantages, RLHF's KL "
        "penalty (Ziegler et al. 2019), instead of a KL term in the loss.",
    )
    kl_estimator: str = option(
        "k3",
        "KL estimator (Schulman 2020): " + ", ".join(declared_names(*_KL_ESTIMATORS)) + "; k1 "
        "takes the KL's score-function gradient (log-ratio x grad log pi), not its own.",
        check=one_of(lambda: declared_names(*_KL_ESTIMATORS)),
    )
    policy_loss: str = option(
        "vanilla",
        "Per-token policy loss, one of " + ", ".join(declared_names(*_POLICY_LOSSES)) + " "
        "(grpo_lens/formulas/losses.py; verl's policy_loss.loss_mode): vanilla = the PPO / "
        "GRPO clipped surrogate (DeepSeekMath eq. 3); gspo = the same on the sequence ratio "
        "(arXiv 2507.18071; TRL's importance_sampling_level=sequence; its paper clips at "
        "--eps-low 3e-4 --eps-high 4e-4); cispo = clipped, detached IS weight x A x log pi "
        "(MiniMax-M1, arXiv 2506.13585); sapo = a soft sigmoid gate instead of the clip "
        "(arXiv 2511.20347; --sapo-tau-pos / --sapo-tau-neg); gpg = -A log pi, no ratio "
        "(arXiv 2504.02546). All give the same gradient at ratio 1, so they train alike unless "
        "--mu > 1 or --num-mini-batches > 1 (docs/theory.md).",
        check=one_of(lambda: declared_names(*_POLICY_LOSSES)),
    )
    sapo_tau_pos: float = option(
        1.0,
        "SAPO's gate temperature for tokens with A > 0 (--policy-loss sapo; TRL's sapo_temperature_pos).",
        check=above(0),
    )
    sapo_tau_neg: float = option(
        1.05,
        "SAPO's gate temperature for tokens with A <= 0 (--policy-loss sapo; TRL's sapo_temperature_neg).",
        check=above(0),
    )
    eps_low: float = option(0.2, "Lower clip range: ratios below 1 - eps_low are clipped for A < 0.", check=_UNIT)
    eps_high: float = option(
        0.2,
        "Upper clip range: ratios above 1 + eps_high are clipped for A > 0 (DAPO's clip-higher uses 0.28).",
        check=at_least(0),
    )
    dual_clip: float | None = option(
        None,
        "Dual-clip bound c > 1 on the loss of A < 0 tokens (Ye et al. 2020); unset disables.",
        check=above(1, "must be > 1, or unset to disable"),
    )
    tis_cap: float | None = option(
        None,
        "Truncated importance sampling against sampler-trainer mismatch: weight each "
        "token's policy loss by min(pi_old / pi_sampler, tis_cap) (Ionides 2008; Yao et al. "
        "2025; docs/theory.md); unset disables.",
        check=above(0, "must be > 0 (e.g. 2.0), or unset to disable"),
    )
    mu: int = option(
        1,
        "Inner optimisation passes over each step's rollouts (mu in GRPO); > 1 makes the policy move "
        "off the sampler and the clip matter.",
        check=at_least(1),
    )
    num_mini_batches: int = option(
        1,
        "Optimizer steps per pass: the step's prompts are split into this many "
        "mini-batches (must divide prompts_per_step).",
    )
    micro_batch_size: int | None = option(
        None,
        "Rollouts per forward/backward (gradient accumulation; the gradient "
        "does not depend on it). Unset: picked per mini-batch from the model's "
        "shape and the machine's total memory (the whole mini-batch when it fits).",
        check=at_least(1),
    )
    shared_prompt_forward: bool = option(
        True,
        "Run each group's prompt once in the update's forwards (and the reference "
        "model's): the B prompts of Lp tokens once, then the B x R completions of "
        "T tokens from their prompt's KV cache, instead of B x R rows of Lp + T "
        "tokens; the same log-probs and gradient up to float rounding "
        "(docs/theory.md §Shared prompts). Lens steps and an FSDP2-sharded policy "
        "run every rollout's own prompt either way; --no-shared-prompt-forward: "
        "every step does, and runs with and without the lens stay bit-identical.",
    )
    # --- optimizer ---------------------------------------------------------------------------------------------------
    max_steps: int = Optimizer.max_steps()
    learning_rate: float = Optimizer.learning_rate()
    weight_decay: float = option(0.0, "AdamW weight decay.", check=at_least(0))
    adam_beta1: float = option(0.9, "AdamW beta1.", check=_UNIT)
    adam_beta2: float = option(0.99, "AdamW beta2.", check=_UNIT)
    max_grad_norm: float = option(
        1.0,
        "Clip the gradient's global L2 norm to this (0 disables).",
        check=at_least(0, "must be >= 0 (0 disables clipping)"),
    )
    lr_scheduler: str = option(
        "constant",
        "Learning-rate schedule over max_steps, transformers' schedulers (TRL's "
        "lr_scheduler_type): constant, linear (to 0 at max_steps), cosine (half a cosine to 0), "
        "each after the warm-up. The LR is set once per step (sampling round) and holds for its "
        "mu x num_mini_batches optimizer steps.",
        check=one_of(LR_SCHEDULERS),
    )
    warmup_steps: float = option(
        0.0,
        "Warm-up: the LR rises linearly from 0 over this many steps (a whole number), "
        "or over this share of max_steps, rounded up (a value in (0, 1)), then follows "
        "--lr-scheduler: transformers' and TRL's warmup_steps (their older warmup_ratio is "
        "accepted as well).",
        check=require(
            lambda v: v >= 0 and (v < 1 or float(v).is_integer()),
            "must be a whole number of steps, or a share of max_steps in [0, 1)",
        ),
    )
    max_consecutive_skips: int = option(
        3,
        "A step whose loss or gradient is non-finite is skipped (no optimizer "
        "change); stop with an error after this many consecutive skipped steps, "
        "or this many consecutive steps where no rollout could be scored.",
        check=at_least(1),
    )
    stop_after_dead_steps: int = option(
        0,
        "Stop the run (cleanly: checkpoint, final model, a line in the log and "
        "stopped.json in the run directory) after this many consecutive steps "
        "without a mixed group (every group's rewards all equal: nothing to learn "
        "from; docs/theory.md §Noise scale and dead groups). 0: never.",
        check=at_least(0),
    )
    # --- lens --------------------------------------------------------------------------------------------------------
    lens_every: int = Lens.lens_every()
    sketch_dim: int = Lens.sketch_dim()
    gram_source: str = Lens.gram_source()
    lens_from_update: bool = option(
        True,
        "Take the lens's exact Gram (gram_source exact: hooks in the update's own "
        "backward, docs/theory.md §Lens inside the update's backward) or sketched "
        "per-rollout gradients (gram_source sketch) from the update's own first pass "
        "when the loss allows it (no per-token KL term, no tis_cap, one mini-batch, "
        "nonzero advantages in the mixed groups; exact also: each mixed group in one "
        "micro-batch, not --estimator optimal): the same numbers without the lens's "
        "extra forward and backward; the run's log says why when it cannot. Off: the "
        "lens always runs its own pass.",
    )
    lens_noise_proxy: bool = option(
        False,
        "At lens steps with the exact Gram, also compute verl's logit-space "
        "gradient-power proxy mean A^2 W, W = sum_t |e_o - pi_t|^2 (one no-grad "
        "forward of the mixed groups at the step's weights), beside the exact "
        "mean A^2 |grad log pi(o)|^2 and their rank correlation over rollouts "
        "(noise/proxy_*; docs/theory.md §Noise scale and dead groups).",
    )
    lens_landing: bool = option(
        False,
        "At lens steps, also the per-token landing shares of the update's own first "
        "gradient u: s_it = w_it <grad log pi(o_it), u> / |u|^2 summed per token class "
        "(answer, format, reasoning) and over positive-advantage rollouts, with their "
        "closure (landing/*; four no-grad forwards of the rows with a nonzero "
        "advantage just before the optimizer step; docs/theory.md §Landing shares and "
        "the dead groups' KL gradient).",
    )
    lens_dead_kl: bool = option(
        False,
        "At lens steps with beta > 0 (KL in the loss), also the norm of the KL-only "
        "gradient of the groups without reward contrast and its ratio to the update's "
        "first gradient norm (dead/kl_grad_*; one forward + backward of those rows "
        "before the update, one process; docs/theory.md §Landing shares and the dead "
        "groups' KL gradient).",
    )
    lens_space: str = option(
        "trainable",
        "Parameter space of the lens's per-rollout gradients: trainable (with LoRA "
        "the adapter's parameters, exact; without LoRA as gram_source says) or full "
        "(every linear layer's full weight, sketched; with LoRA the frozen base weights, what "
        "full fine-tuning would follow).",
        check=one_of(("trainable", "full")),
    )
    # --- LoRA (peft) -------------------------------------------------------------------------------------------------
    lora_rank: int = Adapter.lora_rank()
    lora_alpha: float = option(
        32.0, "LoRA scale numerator: the update is lora_alpha / lora_rank * B A.", check=above(0)
    )
    lora_target_modules: list = option(
        ["all-linear"],
        "Module names LoRA adapts (e.g. q_proj v_proj), or all-linear (every linear layer but the output head).",
        check=require(bool, "name at least one module, or all-linear"),
    )
    # --- run ---------------------------------------------------------------------------------------------------------
    seed: int = Runtime.seed()
    dtype: str = Runtime.dtype()
    device: str = Runtime.device()
    parallelism: str = option(
        "ddp",
        "How several processes (torchrun / accelerate launch) hold the policy: ddp (each "
        "process a whole copy, gradients summed by an all-reduce) or fsdp2 (torch's "
        "fully_shard of each decoder layer and the root: each process holds 1/N of every "
        "weight, gradient and AdamW moment). fsdp2 needs 2 or more processes and refuses "
        "LoRA and --estimator optimal; checkpoints hold full tensors either way.",
        check=one_of(lambda: declared_names(*_PARALLELISMS)),
    )
    out: str | None = Output.out(contents="config.yaml, metrics.jsonl, checkpoints/")
    resume: bool = Output.resume(what="the run in --out from its last checkpoint")
    overwrite: bool = Output.overwrite(what="a different run already")
    checkpoint_every: int = option(10, "Write a checkpoint every this many steps (and at the end).", check=at_least(1))
    keep_checkpoints: int = option(2, "How many recent checkpoints to keep.", check=at_least(1))
    save_final_model: bool = option(
        True,
        "Save the trained policy and tokenizer as a Hugging Face folder in "
        "RUN/final_model at the end (loadable with --model RUN/final_model).",
    )
    report_to: list = Output.report_to()
    log_completions: int = option(2, "Completions per step written to completions.jsonl (0 = none).", check=at_least(0))
    metric_names: str = option(
        "grpo-lens",
        "Names the trackers log under: grpo-lens (the keys of docs/metrics.md), "
        "trl or verl (those libraries' names where they log the same quantity; every other key "
        "keeps its name). metrics.jsonl always has grpo-lens' keys.",
        check=one_of(mk.METRIC_NAME_SCHEMES),
    )
    # --- evaluation ------------------------------------------------------------------------------------------------
    eval_every: int = option(
        0,
        "Held-out accuracy every this many steps and at the last step, after the step's "
        "update (0 = never): greedy and sampled, with Wilson intervals (eval/* keys).",
        check=at_least(0, "must be >= 0 (0 disables evaluation)"),
    )
    eval_split: str = option(
        "test",
        "The task's split the evaluation draws from (gsm8k: the 1319-problem test "
        "split; arithmetic: problems from the test stream; jsonl: a split of the dataset).",
    )
    eval_prompts: int = option(64, "Held-out prompts per evaluation (the same ones every time).", check=at_least(1))
    eval_samples: int = option(
        4,
        "Sampled completions per held-out prompt (at --temperature) for the sampled accuracy; 0 = greedy only.",
        check=at_least(0),
    )
    progress: bool = Output.progress()

    def overlong_length(self) -> int:
        """L_max of soft-punish: ``overlong_max_length``, or ``max_new_tokens`` when unset."""
        return self.overlong_max_length if self.overlong_max_length is not None else self.max_new_tokens

    def overlong_cache(self) -> int:
        """L_cache of soft-punish: ``overlong_buffer``, or max(1, L_max // 5) when unset."""
        return self.overlong_buffer if self.overlong_buffer is not None else max(1, self.overlong_length() // 5)

    def check(self) -> None:
        """The checks of two or more fields, and the derived fields (each field's own check ran before)."""
        if self.rollout_batch_size is not None:
            if self.rollout_batch_size < 1 or self.rollout_batch_size % self.group_size:
                self.bad(
                    "rollout_batch_size",
                    f"must be a positive multiple of group_size={self.group_size} (whole "
                    f"groups); e.g. {self.group_size * max(1, self.rollout_batch_size // self.group_size)}",
                )
            self.prompts_per_step = self.rollout_batch_size // self.group_size
        if self.mask_truncated:  # the deprecated alias
            if self.overlong == "none":
                self.overlong = "mask"
            elif self.overlong != "mask":
                self.bad(
                    "mask_truncated",
                    f"is the deprecated alias of --overlong mask and contradicts --overlong "
                    f"{self.overlong}; drop --mask-truncated",
                )
        if self.overlong_max_length is not None and not 1 <= self.overlong_max_length <= self.max_new_tokens:
            self.bad("overlong_max_length", f"must be in [1, max_new_tokens = {self.max_new_tokens}], or unset")
        if self.overlong_buffer is not None and not 1 <= self.overlong_buffer <= self.overlong_length():
            self.bad("overlong_buffer", f"must be in [1, L_max = {self.overlong_length()}], or unset")
        if self.num_mini_batches < 1 or self.prompts_per_step % self.num_mini_batches:
            self.bad("num_mini_batches", f"must divide prompts_per_step={self.prompts_per_step}")
        if self.resume and self.overwrite:
            self.bad("overwrite", "--resume continues the run in --out and --overwrite replaces it: pass one of them")
        if self.dual_clip is not None and self.policy_loss in ("cispo", "sapo", "gpg"):
            self.bad("dual_clip", f"--policy-loss {self.policy_loss} has no clip to bound; unset --dual-clip")
        check_task_dataset(self)


register_trl_names(TrainConfig.names, {f.name for f in fields(TrainConfig)})
