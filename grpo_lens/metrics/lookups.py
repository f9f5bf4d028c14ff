"""TRL's and verl's names of the same quantities, :data:`METRICS`, and the look-ups (:func:`lookup`, the key builders
:func:`rank_key` and co., :func:`other_name`, :func:`from_trl`).
"""

from __future__ import annotations

import re

from grpo_lens.metrics.entry import _ENTRIES, JSONL, Metric
from grpo_lens.metrics.lens_keys import SPARSITY_BY_TYPE
from grpo_lens.metrics.perf_keys import LR
from grpo_lens.metrics.train_keys import (
    ADV_MAX,
    ADV_MEAN,
    ADV_MIN,
    CLIP_RATIO_HIGH,
    CLIP_RATIO_LOW,
    CLIP_RATIO_REGION,
    COMPLETIONS_MAX_LENGTH,
    COMPLETIONS_MEAN_LENGTH,
    COMPLETIONS_TRUNCATED_FRAC,
    GRAD_NORM,
    KL_MEAN,
    LOSS_POLICY,
    POLICY_ENTROPY,
    REWARD_FRAC_ZERO_STD_GROUPS,
    REWARD_FUNCTION,
    REWARD_MEAN,
    REWARD_STD,
)

# ---------------------------------------------------------------------------------------------------------------------
# The same quantities in TRL's and verl's logs
# ---------------------------------------------------------------------------------------------------------------------
#: key -> (TRL GRPOTrainer's logged name, verl's logged name); "" where that library logs no such quantity. TRL names
#: are read from trl 1.16 ``GRPOTrainer`` (``_metrics[mode][...]``) and transformers' ``Trainer`` (``grad_norm``,
#: ``learning_rate``); verl names from its PPO trainer's ``compute_data_metrics`` and actor metrics.
_OTHER_NAMES = {
    REWARD_MEAN: ("reward", "critic/score/mean"),
    REWARD_STD: ("reward_std", ""),
    REWARD_FRAC_ZERO_STD_GROUPS: ("frac_reward_zero_std", ""),
    REWARD_FUNCTION.key: ("rewards/{name}/mean", ""),
    ADV_MEAN: ("", "critic/advantages/mean"),
    ADV_MAX: ("", "critic/advantages/max"),
    ADV_MIN: ("", "critic/advantages/min"),
    COMPLETIONS_MEAN_LENGTH: ("completions/mean_length", "response_length/mean"),
    COMPLETIONS_MAX_LENGTH: ("completions/max_length", "response_length/max"),
    COMPLETIONS_TRUNCATED_FRAC: ("completions/clipped_ratio", "response_length/clip_ratio"),
    LOSS_POLICY: ("policy_loss", "actor/pg_loss"),
    KL_MEAN: ("kl", "actor/kl_loss"),
    CLIP_RATIO_LOW: ("clip_ratio/low_mean", "actor/pg_clipfrac_lower"),
    CLIP_RATIO_HIGH: ("clip_ratio/high_mean", ""),
    CLIP_RATIO_REGION: ("clip_ratio/region_mean", "actor/pg_clipfrac"),
    POLICY_ENTROPY: ("entropy", "actor/entropy"),
    GRAD_NORM: ("grad_norm", "actor/grad_norm"),
    LR: ("learning_rate", "actor/lr"),
}

#: Where the other library's number is not exactly ours: the difference, shown in docs/metrics.md.
NAME_NOTES = {
    REWARD_STD: "TRL's `reward_std` is the sample std (ddof 1) of the batch's rewards; ours is the population std "
    "(ddof 0): TRL's = ours × sqrt(N / (N − 1)) over N valid rewards",
    LOSS_POLICY: "TRL averages the policy loss over the logging window's micro-batches; verl's `actor/pg_loss` over "
    "its micro-batches",
    KL_MEAN: "verl logs `actor/kl_loss` only with `use_kl_loss`, in its `kl_loss_type` estimator",
    GRAD_NORM: "TRL's is transformers' norm of each optimizer step, averaged over the logging window",
}

#: TRL names :func:`from_trl` never reads into grpo-lens' key, because the definitions differ (the TRL integration
#: computes ours from the batch).
NOT_READ_FROM_TRL = (REWARD_STD,)

for _m in _ENTRIES:  # filled in place (while the registry is built), so the module's Metric constants carry them
    if _m.key in _OTHER_NAMES and JSONL in _m.where:
        object.__setattr__(_m, "trl", _OTHER_NAMES[_m.key][0])
        object.__setattr__(_m, "verl", _OTHER_NAMES[_m.key][1])

#: Every entry, in docs/metrics.md's order.
METRICS: tuple[Metric, ...] = tuple(_ENTRIES)


# ---------------------------------------------------------------------------------------------------------------------
# Look-ups
# ---------------------------------------------------------------------------------------------------------------------
_PLAIN: dict[str, list[Metric]] = {}
for _m in METRICS:
    if not _m.is_template:
        _PLAIN.setdefault(_m.key, []).append(_m)
_TEMPLATES = [m for m in METRICS if m.is_template]
#: every key of the plain entries and of the templates without a free placeholder
_CLOSED = frozenset(k for m in METRICS if all(m.values_of(n) is not None for n in m.placeholders) for k in m.expand())


def lookup(key: str, where: str | None = None) -> tuple[Metric, dict[str, str]] | None:
    """The entry that defines ``key`` (a plain key first, then the templates in order) and its placeholder values;
    with ``where``, only entries of that scope. None when no entry defines it."""
    for m in _PLAIN.get(key, ()):
        if where is None or where in m.where:
            return m, {}
    for m in _TEMPLATES:
        if where is None or where in m.where:
            values = m.parse(key)
            if values is not None:
                return m, values
    return None


def is_defined(key: str, where: str | None = None) -> bool:
    """Whether an entry (of scope ``where``, if given) defines ``key``."""
    return lookup(key, where) is not None


def concepts() -> dict[str, list[Metric]]:
    """{concept: its entries in docs/metrics.md order} for the quantities named at several scopes."""
    out: dict[str, list[Metric]] = {}
    for m in METRICS:
        if m.concept:
            out.setdefault(m.concept, []).append(m)
    return out


def _checked(key: str) -> str:
    """``key`` if an entry defines it, else ValueError naming it."""
    if key not in _CLOSED and not is_defined(key):
        raise ValueError(f"{key!r} is not a metric key of grpo_lens.metrics")
    return key


def rank_key(matrix: str, measure: str) -> str:
    """``rank/<matrix>_<measure>``: a rank measure of one of the vocabulary's matrices (g1, g1_null, g1_no_adv,
    g1_random, g1_nll, g1_layer, g2, g3, g3_null, g3_<w>).

    Raises:
        ValueError: the key is not defined (an unknown matrix or measure).
    """
    return _checked(f"rank/{matrix}_{measure}")


def zero_sum_key(stat: str, part: str = "") -> str:
    """``zero_sum/<stat>`` or ``zero_sum/<stat>_<part>`` for a statistic of :data:`ZERO_SUM_STATS` and a part of
    :data:`ZERO_SUM_PARTS` ("" the observed value, "null", "excess", "null_var", "p").

    Raises:
        ValueError: the key is not defined.
    """
    return _checked(f"zero_sum/{stat}_{part}" if part else f"zero_sum/{stat}")


def sparsity_key(quantity: str, measure: str, layer_type: str | None = None) -> str:
    """``sparsity/<quantity>_<measure>`` (whole model) or ``sparsity/<type>/<quantity>_<measure>`` (one layer type):
    quantity one of :data:`SPARSITY_MEASURES` (update_step, update_total, grad, grad_total).

    Raises:
        ValueError: the key is not defined.
    """
    name = f"{quantity}_{measure}"
    if layer_type is None:
        return _checked(f"sparsity/{name}")
    return SPARSITY_BY_TYPE.format(type=layer_type, key=name)


def sketch_share_key(category: str) -> str:
    """``sketch/exact_share_<category>`` for a category of :data:`PARAMETER_CATEGORIES`.

    Raises:
        ValueError: the key is not defined.
    """
    return _checked(f"sketch/exact_share_{category}")


#: The first path component of every slash key (``reward``, ``rank``, ...): what a metric key looks like.
PREFIXES = tuple(sorted({m.key.split("/", 1)[0] for m in METRICS if "/" in m.key}))


#: The naming schemes trackers can log under (``--metric-names``): grpo-lens' own keys, or TRL's / verl's names where
#: they name the same quantity (every other key keeps its grpo-lens name).
METRIC_NAME_SCHEMES = ("grpo-lens", "trl", "verl")


def other_name(key: str, scheme: str) -> str | None:
    """``key``'s name in ``scheme`` (:data:`METRIC_NAME_SCHEMES`), or None when that library has no such quantity.

    Raises:
        ValueError: an unknown scheme.
    """
    if scheme not in METRIC_NAME_SCHEMES:
        raise ValueError(f"metric names {scheme!r}: valid names: {', '.join(METRIC_NAME_SCHEMES)}")
    if scheme == "grpo-lens":
        return key
    found = lookup(key, JSONL)
    if found is None:
        return None
    entry, values = found
    name = getattr(entry, scheme)
    return name.format(**values) if name else None


def renamed_record(record: dict, scheme: str) -> dict:
    """A metrics record with each key under its ``scheme`` name where that library has one (else unchanged)."""
    if scheme == "grpo-lens":
        return dict(record)
    return {other_name(k, scheme) or k: v for k, v in record.items()}


def from_trl(logs: dict) -> dict:
    """The entries of a TRL ``GRPOTrainer`` log dict that name a grpo-lens quantity exactly, under grpo-lens' keys.

    TRL names whose definition differs from ours (:data:`NAME_NOTES`, e.g. ``reward_std``) are left out, and so is
    everything TRL logs that grpo-lens has no key for.
    """
    out = {}
    for m in METRICS:
        if not m.trl or m.key in NOT_READ_FROM_TRL:
            continue
        if not m.is_template:
            if m.trl in logs:
                out[m.key] = logs[m.trl]
            continue
        pattern = re.escape(m.trl).replace(r"\{name\}", "(?P<name>[^/]+)")
        for k, v in logs.items():
            hit = re.fullmatch(pattern, k)
            if hit:
                out[m.format(**hit.groupdict())] = v
    return out
