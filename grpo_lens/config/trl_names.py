"""TRL's ``GRPOConfig`` names for grpo-lens' settings, accepted as YAML keys and flags (``--num-generations 4``).

Where TRL's setting means what a grpo-lens field means, its name is an :class:`grpo_lens.config.base.Alias` that sets
that field (no warning); where the value has no grpo-lens meaning (``loss_type: luspo``, ``vespo``),
or the setting itself has none (``gradient_accumulation_steps``, ``use_vllm``), the error names the grpo-lens option
to use instead. TRL names that equal grpo-lens' own (``beta``, ``temperature``, ``top_p``, ``top_k``,
``learning_rate``, ``max_steps``, ``seed``, ``weight_decay``, ``adam_beta1``, ``adam_beta2``, ``max_grad_norm``,
``report_to``, ``warmup_steps``) are the fields themselves. Names are read from trl 1.16.

=============================  ==============================================================================
TRL                            grpo-lens
=============================  ==============================================================================
num_generations                group_size (R)
max_completion_length          max_new_tokens
num_iterations                 mu
epsilon                        eps_low, and eps_high unless epsilon_high / eps_high is given (as in TRL)
epsilon_high                   eps_high (with loss_type cispo: TRL's cap eps_max, eps_high = epsilon_high - 1)
loss_type                      loss_aggregation: grpo -> seq-mean-token-mean, bnpo / dapo (TRL's default)
                               -> token-mean, dr_grpo -> seq-mean-token-sum-norm; cispo -> policy_loss cispo
                               with token-mean, sapo -> policy_loss sapo with seq-mean-token-mean
importance_sampling_level      policy_loss: sequence -> gspo (GSPO), token -> the loss_type's own
sapo_temperature_pos / _neg    sapo_tau_pos / sapo_tau_neg
scale_rewards                  estimator: group (or true) -> grpo, none (or false) -> dr_grpo, batch -> grpo_batch
mask_truncated_completions     overlong: true -> mask, false -> none
lr_scheduler_type              lr_scheduler
warmup_ratio                   warmup_steps (a share in [0, 1): transformers 5 takes it as warmup_steps itself)
per_device_train_batch_size    rollout_batch_size = per_device_train_batch_size x steps_per_generation (one
                               process: grpo-lens' rollout_batch_size counts every process's rollouts)
steps_per_generation           num_mini_batches (optimizer steps per generation batch)
output_dir                     out
=============================  ==============================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_lens.config.base import Alias, ConfigError, Names

LIBRARY = "TRL"

#: TRL's ``loss_type`` -> grpo-lens' loss aggregation with the same per-rollout weights of the log-prob sums
#: (docs/theory.md §3): grpo/sapo average each sequence's tokens; bnpo/dapo/cispo/vespo divide by the batch's tokens
#: (a constant across rollouts); dr_grpo divides by max_completion_length. The one map: grpo-lens' config reads it for
#: the ``loss_type`` key (less :data:`LENS_ONLY_LOSS_TYPES`), the TRL integration's lens
#: (:meth:`grpo_lens.lens.settings.LensSettings.from_trl`) for every key. TRL's ``luspo`` is in neither.
LOSS_TYPE_AGGREGATIONS = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "cispo": "token-mean",
    "sapo": "seq-mean-token-mean",
    "vespo": "token-mean",
}

#: TRL's loss_type values whose rollout weights the lens knows but whose policy loss grpo-lens' own trainer does not
#: implement (the config refuses them, naming --loss-aggregation and --policy-loss).
LENS_ONLY_LOSS_TYPES = ("vespo",)

#: TRL's loss_type values grpo-lens' config accepts, in :data:`LOSS_TYPE_AGGREGATIONS`'s order.
TRAINER_LOSS_TYPES = tuple(t for t in LOSS_TYPE_AGGREGATIONS if t not in LENS_ONLY_LOSS_TYPES)

#: TRL's loss_type values that name a policy loss too (the others are the clipped surrogate, ``vanilla``).
LOSS_TYPE_POLICY_LOSSES = {"cispo": "cispo", "sapo": "sapo"}


def _same(field: str) -> Alias:
    """A TRL name for exactly the grpo-lens field ``field``."""
    return Alias(LIBRARY, lambda value, given: {field: value}, flag_type=_FLAG_TYPES.get(field, str), fields=(field,))


_FLAG_TYPES = {
    "group_size": int,
    "max_new_tokens": int,
    "mu": int,
    "eps_low": float,
    "eps_high": float,
    "num_mini_batches": int,
    "sapo_tau_pos": float,
    "sapo_tau_neg": float,
}


def _epsilon(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if "epsilon_high" in given or "eps_high" in given:
        return {"eps_low": value}
    return {"eps_low": value, "eps_high": value}  # TRL: epsilon_high defaults to epsilon


def _loss_type(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if value not in TRAINER_LOSS_TYPES:
        raise ConfigError(
            f"TRL's loss_type {value!r} changes the policy loss itself in a way grpo-lens does not "
            f"implement; grpo-lens takes loss_type {', '.join(TRAINER_LOSS_TYPES)}, or set --loss-aggregation and "
            f"--policy-loss directly"
        )
    if value in LOSS_TYPE_POLICY_LOSSES:
        if given.get("importance_sampling_level", "token") == "sequence":
            raise ConfigError(
                f"TRL's loss_type {value!r} with importance_sampling_level 'sequence' has no grpo-lens "
                f"counterpart: GSPO is --policy-loss gspo (loss_type grpo with the sequence level)"
            )
        return {"loss_aggregation": LOSS_TYPE_AGGREGATIONS[value], "policy_loss": LOSS_TYPE_POLICY_LOSSES[value]}
    return {"loss_aggregation": LOSS_TYPE_AGGREGATIONS[value]}


def _importance_sampling_level(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if value == "sequence":
        if given.get("loss_type") in LOSS_TYPE_POLICY_LOSSES:
            return {}  # loss_type refuses the combination with its own message
        return {"policy_loss": "gspo"}
    if value == "token":
        return {}  # the loss_type's own policy loss (vanilla unless cispo or sapo)
    raise ConfigError(f"TRL's importance_sampling_level {value!r}: TRL takes 'token' or 'sequence'")


def _epsilon_high(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if given.get("loss_type") == "cispo":  # TRL's cispo caps the weight at epsilon_high itself (ScaleRL's eps_max)
        return {"eps_high": value - 1.0}
    return {"eps_high": value}


def _scale_rewards(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if value in ("group", True, "true", "True"):
        return {"estimator": "grpo"}
    if value in ("none", False, "false", "False"):
        return {"estimator": "dr_grpo"}
    if value == "batch":
        return {"estimator": "grpo_batch"}
    raise ConfigError(
        f"TRL's scale_rewards {value!r}: TRL takes group (--estimator grpo), batch (--estimator grpo_batch) or "
        f"none (--estimator dr_grpo)"
    )


def _mask_truncated(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    return {"overlong": "mask" if value else "none"}


def _warmup_ratio(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        raise ConfigError(
            f"warmup_ratio = {value!r}: must be a share of max_steps in [0, 1) (or give whole steps "
            f"with --warmup-steps)"
        )
    return {"warmup_steps": float(value)}


def _per_device_batch(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    steps = given.get("steps_per_generation") or 1
    if not isinstance(value, int) or not isinstance(steps, int):
        raise ConfigError(
            f"TRL's per_device_train_batch_size = {value!r} (steps_per_generation = {steps!r}): must be integers"
        )
    return {"rollout_batch_size": value * steps}


#: TRL's name -> its translation.
ALIASES = {
    "num_generations": _same("group_size"),
    "max_completion_length": _same("max_new_tokens"),
    "num_iterations": _same("mu"),
    "epsilon": Alias(LIBRARY, _epsilon, flag_type=float, fields=("eps_low", "eps_high")),
    "epsilon_high": Alias(LIBRARY, _epsilon_high, flag_type=float, fields=("eps_high",)),
    "loss_type": Alias(LIBRARY, _loss_type, fields=("loss_aggregation", "policy_loss")),
    "importance_sampling_level": Alias(LIBRARY, _importance_sampling_level, fields=("policy_loss",)),
    "sapo_temperature_pos": _same("sapo_tau_pos"),
    "sapo_temperature_neg": _same("sapo_tau_neg"),
    "scale_rewards": Alias(LIBRARY, _scale_rewards, fields=("estimator",)),
    "mask_truncated_completions": Alias(LIBRARY, _mask_truncated, flag_type=bool, fields=("overlong",)),
    "lr_scheduler_type": _same("lr_scheduler"),
    "warmup_ratio": Alias(LIBRARY, _warmup_ratio, flag_type=float, fields=("warmup_steps",)),
    "per_device_train_batch_size": Alias(LIBRARY, _per_device_batch, flag_type=int, fields=("rollout_batch_size",)),
    "steps_per_generation": _same("num_mini_batches"),
    "output_dir": _same("out"),
}

#: TRL names with no grpo-lens counterpart -> what to use instead.
REFUSED = {
    "gradient_accumulation_steps": "grpo-lens accumulates gradients by itself: --micro-batch-size sets the rollouts "
    "per forward/backward (the gradient does not depend on it), and one optimizer "
    "step is taken per mini-batch (--num-mini-batches)",
    "use_vllm": "grpo-lens samples with transformers' generate; there is no vLLM option",
    "generation_batch_size": "the rollouts per step are --rollout-batch-size (or --prompts-per-step x --group-size)",
}


def register_trl_names(names: Names, fields: set[str]) -> None:
    """Add TRL's names to a config's ``names``: the aliases whose every target is one of the config's ``fields``,
    and the refusals. A name the config already has (renamed or refused) is left as it is."""
    probe = {}
    for name, alias in ALIASES.items():
        try:
            probe = alias.translate(_SAMPLE.get(name, 1), {})
        except ConfigError:
            probe = {}
        known = set(names.renamed) | set(names.refused) | set(names.aliases) | fields
        if probe and set(probe) <= fields and name not in known:
            names.alias(name, alias)
    for name, use in REFUSED.items():
        if name not in set(names.renamed) | set(names.refused) | set(names.aliases) | fields:
            names.refuse(name, f"it is TRL's name, and {use}")


#: A value of each alias that translates (to find the fields it sets).
_SAMPLE = {
    "loss_type": "grpo",
    "importance_sampling_level": "sequence",
    "scale_rewards": "group",
    "mask_truncated_completions": True,
    "warmup_ratio": 0.1,
}


def grpo_lens_settings(trl_settings: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's ``GRPOConfig`` values (``{"num_generations": 4, "epsilon": 0.2, ...}``) under grpo-lens' field names,
    through :data:`ALIASES`; a name grpo-lens shares (``beta``, ``temperature``) stays as it is. Names with no
    grpo-lens counterpart (:data:`REFUSED`), values without a grpo-lens meaning and unset (None) values are left out:
    they say nothing a grpo-lens run could agree or differ with.

    Used by ``grpo-lens compare`` to put a TRL run's settings (its config.yaml's ``trl`` block) beside a grpo-lens
    run's.
    """
    out: dict[str, Any] = {}
    for name, value in trl_settings.items():
        if value is None or name in REFUSED:
            continue
        if name not in ALIASES:
            out[name] = value
            continue
        try:
            out.update(ALIASES[name].translate(value, trl_settings))
        except ConfigError:
            continue
    return out
