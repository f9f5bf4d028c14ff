"""The metric vocabulary: every key grpo-lens writes, named once, with its meaning, unit, source and scope.

Every writer (the trainer, the lens, the probe, the formulas that return keyed dicts, the reward functions) and every
reader (the claims, the report, ``grpo-lens compare``, the trackers) takes its keys from here, and docs/metrics.md's
tables are generated from :data:`METRICS` (``tools/update_docs.py``). A test runs the trainer and the probe and fails
on a written key that no entry defines; another scans the package for key-like string literals outside this module.

An entry (:class:`Metric`) is a plain key (``reward/mean``) or a template with named placeholders
(``rank/g1_{m}``). A placeholder of :data:`PLACEHOLDERS` either ranges over a known set (``m``: the rank measures,
``w``: the row weightings, ``type``: the parameter layer types) or stays free (``name``: a reward function's name,
``kind``: a linear module's last name component). Plain keys are module constants holding the key string
(``REWARD_MEAN = "reward/mean"``); templates are :class:`Metric` objects (``REWARD_FUNCTION.format(name="format")``);
families built from parts have a function (:func:`rank_key`, :func:`zero_sum_key`, :func:`sparsity_key`,
:func:`sketch_share_key`) that checks the key it returns is defined.

Scopes (:data:`SCOPES`, an entry's ``where``): a metrics.jsonl record, probe.json's per-group rows and their summaries
(``groups``, ``summary``, ``strata``), probe.json's ``g3``, ``g2_weightings`` and ``sketch_check``, the fields of one
group size ``per_group_size["R"]``, and the probe's ``studies``. One quantity may have several names, one per scope
(S1 has five): such entries share a ``concept``, and docs/metrics.md lists them together. ``trl`` and ``verl`` hold
the name of the same quantity in those libraries' logs (empty until a mapping is added).

Imports nothing but the standard library, so that :mod:`grpo_lens.formulas` may import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------------------------------
# Units, scopes, placeholders
# ---------------------------------------------------------------------------------------------------------------------
SHARE = "share in [0, 1]"
SHARE_DIFFERENCE = "share difference"
P_VALUE = "p-value"
COUNT = "count"
FLAG = "0 or 1"
TOKENS = "tokens"
SECONDS = "seconds"
NATS = "nats"
NATS_PER_TOKEN = "nats/token"
REWARD_UNITS = "reward units"
ADVANTAGE_UNITS = "advantage units"
LOSS_UNITS = "loss units"
RANK_UNITS = "rank (dimensionless)"
RATIO = "ratio (dimensionless)"
RELATIVE_ERROR = "relative error"
COSINE_GAP = "cosine difference"
GRAD_NORM_UNITS = "gradient norm"
SQ_GRAD_NORM_UNITS = "squared gradient norm"
SPARSITY_UNITS = "Hoyer sparsity in [0, 1]"
LEARNING_RATE = "learning rate"
STEP_UNITS = "step"
MEGABYTES = "MB"
TOKENS_PER_SECOND = "tokens/second"
INTERVAL = "{mean, lo, hi, n}"
ROWS = "list of rows"
OBJECT = "object"

JSONL = "metrics.jsonl"
GROUPS = "probe.json groups"
G3 = "probe.json g3"
G2_WEIGHTINGS = "probe.json g2_weightings"
SKETCH_CHECK = "probe.json sketch_check"
PROBE = "probe.json per_group_size"
STUDIES = "probe.json studies"

#: Where an entry's key appears (its ``where``).
SCOPES = (JSONL, GROUPS, G3, G2_WEIGHTINGS, SKETCH_CHECK, PROBE, STUDIES)

#: The rank measures of :data:`grpo_lens.formulas.spectrum.RANK_MEASURES` (a test checks they agree).
RANK_MEASURE_NAMES = ("erank", "stable_rank", "participation_ratio", "k90", "k99", "top1_share", "top2_share")

#: The row weightings of :data:`grpo_lens.formulas.zero_sum.WEIGHTINGS` (a test checks they agree).
WEIGHTING_NAMES = ("adv", "abs", "shift", "reward", "uniform", "single")

#: The parameter layer types of :func:`grpo_lens.formulas.sparsity.layer_type` (a test checks they agree).
LAYER_TYPE_NAMES = ("norm", "embedding", "attention", "mlp", "other")

#: The parameter categories of :func:`grpo_lens.analysis.group.parameter_category`.
PARAMETER_CATEGORIES = ("linear", "embedding", "norm", "other")

#: The measures of the sampled update (``update_step``, ``update_total``) and of a sampled vector (``grad``,
#: ``grad_total``) in ``sparsity/<quantity>_<measure>`` (:data:`grpo_lens.formulas.sparsity.UPDATE_MEASURES`,
#: :data:`grpo_lens.formulas.sparsity.GRAD_MEASURES`).
_UPDATE_MEASURES = (
    "f32_unchanged",
    "bf16_unchanged",
    "bf16_permuted",
    "bf16_dense",
    "hoyer",
    "top1_energy",
    "f32_unchanged_se",
    "bf16_unchanged_se",
    "bf16_excess_se",
)
SPARSITY_MEASURES = {
    "update_step": _UPDATE_MEASURES,
    "update_total": _UPDATE_MEASURES,
    "grad": ("zero", "hoyer", "top1_energy"),
    "grad_total": ("zero", "hoyer", "top1_energy"),
}

#: The sampled sparsity keys without their ``sparsity/`` prefix: the ``<key>`` of ``sparsity/<type>/<key>``.
SAMPLED_SPARSITY_KEYS = tuple(f"{q}_{m}" for q, ms in SPARSITY_MEASURES.items() for m in ms)


@dataclass(frozen=True)
class Placeholder:
    """A named part of a template key: ``{name}`` in the template, ``shown`` in docs/metrics.md, ranging over
    ``values`` (None: free, any text; a key parses back only when the text has no slash)."""

    name: str
    shown: str
    values: tuple[str, ...] | None
    meaning: str


PLACEHOLDERS = {
    p.name: p
    for p in (
        Placeholder("m", "<m>", RANK_MEASURE_NAMES, "a rank measure"),
        Placeholder("w", "<w>", WEIGHTING_NAMES, "a row weighting"),
        Placeholder("type", "<type>", LAYER_TYPE_NAMES, "a parameter layer type"),
        Placeholder("key", "<key>", SAMPLED_SPARSITY_KEYS, "a sampled sparsity key"),
        Placeholder("name", "<name>", None, "a reward function's name"),
        Placeholder(
            "kind",
            "<kind>",
            None,
            "a linear module's last name component (q_proj, down_proj, lm_head, ...; "
            "GPT-2: c_attn, attn_c_proj, c_fc, mlp_c_proj)",
        ),
    )
}

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


# ---------------------------------------------------------------------------------------------------------------------
# The entry and the registry
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Metric:
    """One entry of the vocabulary.

    Attributes:
        key: the key, or a template with ``{placeholder}`` parts (:data:`PLACEHOLDERS`).
        meaning: what it measures (docs/metrics.md shows this text).
        unit: e.g. :data:`SHARE`, :data:`NATS_PER_TOKEN`, :data:`RANK_UNITS`.
        source: the docs/theory.md section that defines it (``§5``, ``§S1``), or "" when none does.
        where: the scopes it appears in (:data:`SCOPES`).
        section: the docs/metrics.md table it sits in (:data:`SECTIONS`).
        concept: the quantity it names when several keys name one quantity at different scopes (``S1``), else "".
        shown: how docs/metrics.md writes the key, when not as ``key`` (``("summary[key]",)``).
        fields: for a probe.json object (studies, containers), the names of its fields.
        each: ``fields`` are those of each item of a list or of each value of a mapping.
        only: per-placeholder restriction of its values, as ((name, values), ...).
        trl, verl: the name of the same quantity in TRL's and verl's logs ("" when unmapped).
        row: entries with the same row number share one row of docs/metrics.md.
    """

    key: str
    meaning: str
    unit: str
    source: str
    where: tuple[str, ...]
    section: str
    concept: str = ""
    shown: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    each: bool = False
    only: tuple[tuple[str, tuple[str, ...]], ...] = ()
    trl: str = ""
    verl: str = ""
    row: int = 0

    @property
    def placeholders(self) -> tuple[str, ...]:
        """The placeholder names of the template, in order (empty for a plain key)."""
        return tuple(_PLACEHOLDER.findall(self.key))

    @property
    def is_template(self) -> bool:
        """Whether the key has placeholders."""
        return bool(self.placeholders)

    def values_of(self, placeholder: str) -> tuple[str, ...] | None:
        """The values ``placeholder`` ranges over in this entry (None: free)."""
        return dict(self.only).get(placeholder, PLACEHOLDERS[placeholder].values)

    def format(self, **values: str) -> str:
        """The key with every placeholder filled in.

        Raises:
            ValueError: the placeholders given are not the template's, or a value lies outside its known set (a free
                placeholder takes any text).
        """
        if set(values) != set(self.placeholders):
            raise ValueError(
                f"{self.key!r} takes {', '.join(self.placeholders) or 'no placeholders'}, got "
                f"{', '.join(sorted(values)) or 'none'}"
            )
        for name, value in values.items():
            allowed = self.values_of(name)
            if allowed is not None and value not in allowed:
                raise ValueError(f"{self.key!r}: {name} = {value!r} is not one of {', '.join(allowed)}")
        return self.key.format(**values)

    def expand(self) -> tuple[str, ...]:
        """Every key of the entry (the key itself for a plain key).

        Raises:
            ValueError: a placeholder is free.
        """
        names = self.placeholders
        if any(self.values_of(n) is None for n in names):
            raise ValueError(f"{self.key!r} has a free placeholder: its keys cannot be listed")
        keys = [{}]
        for n in names:
            keys = [{**k, n: v} for k in keys for v in self.values_of(n)]
        return tuple(self.key.format(**k) for k in keys)

    def parse(self, key: str) -> dict[str, str] | None:
        """The placeholder values that give ``key`` ({} for the plain key itself), None when it is not this entry's."""
        if not self.is_template:
            return {} if key == self.key else None
        parts, last = [], 0
        for m in _PLACEHOLDER.finditer(self.key):
            parts.append(re.escape(self.key[last : m.start()]))
            allowed = self.values_of(m.group(1))
            alternatives = "|".join(re.escape(v) for v in sorted(allowed, key=len, reverse=True)) if allowed else ""
            parts.append(f"(?P<{m.group(1)}>{alternatives if allowed is not None else '[^/]+'})")
            last = m.end()
        parts.append(re.escape(self.key[last:]))
        found = re.fullmatch("".join(parts), key)
        return found.groupdict() if found else None

    def display(self) -> tuple[str, ...]:
        """The key as docs/metrics.md writes it: ``shown``, or the template with ``<m>``-style placeholders."""
        return self.shown or (_PLACEHOLDER.sub(lambda m: PLACEHOLDERS[m.group(1)].shown, self.key),)


_ENTRIES: list[Metric] = []  # filled by the definitions below, then frozen as METRICS

#: The docs/metrics.md tables, in order; each is generated from the entries of its section.
SECTIONS = (
    "reward",
    "adv",
    "completions",
    "loss",
    "mismatch",
    "policy",
    "dynamic",
    "grad",
    "guard",
    "noise",
    "dead",
    "landing",
    "group",
    "probe_group",
    "g3",
    "g2_weightings",
    "sparsity",
    "perf",
    "eval",
    "probe",
    "sketch_check",
    "studies",
)


def _add(
    section: str,
    keys: tuple[str, ...],
    units: str | tuple[str, ...],
    meaning: str,
    source: str,
    where: tuple[str, ...],
    concepts: str | tuple[str, ...] = "",
    **extra,
) -> list[Metric]:
    """Register one docs/metrics.md row: one entry per key, sharing ``meaning`` and ``source``."""
    units = units if isinstance(units, tuple) else (units,) * len(keys)
    concepts = concepts if isinstance(concepts, tuple) else (concepts,) * len(keys)
    assert section in SECTIONS and len(units) == len(keys) == len(concepts), (section, keys)
    row = len({m.row for m in _ENTRIES}) + 1
    out = [
        Metric(key, meaning, unit, source, where, section, concept=concept, row=row, **extra)
        for key, unit, concept in zip(keys, units, concepts)
    ]
    _ENTRIES.extend(out)
    return out


def _key(
    section: str,
    key: str,
    unit: str,
    meaning: str,
    *,
    source: str = "",
    where: tuple[str, ...] = (JSONL,),
    concept: str = "",
    **extra,
) -> str:
    """A plain key on its own row; returns the key."""
    return _add(section, (key,), unit, meaning, source, where, concept, **extra)[0].key


def _keys(
    section: str,
    keys: tuple[str, ...],
    units: str | tuple[str, ...],
    meaning: str,
    *,
    source: str = "",
    where: tuple[str, ...] = (JSONL,),
    concepts: str | tuple[str, ...] = "",
) -> tuple[str, ...]:
    """Plain keys sharing one row (one meaning); returns the keys."""
    return tuple(m.key for m in _add(section, keys, units, meaning, source, where, concepts))


def _template(
    section: str, key: str, unit: str, meaning: str, *, source: str = "", where: tuple[str, ...] = (JSONL,), **extra
) -> Metric:
    """A template on its own row; returns its entry."""
    return _add(section, (key,), unit, meaning, source, where, **extra)[0]


LENS = (JSONL, GROUPS)  # the per-group analysis path: lens means in metrics.jsonl, probe rows and summaries

# ---------------------------------------------------------------------------------------------------------------------
# metrics.jsonl: reward/
# ---------------------------------------------------------------------------------------------------------------------
REWARD_MEAN, REWARD_STD = _keys(
    "reward",
    ("reward/mean", "reward/std"),
    REWARD_UNITS,
    "mean and (population) std of the valid rewards of the step's N rollouts",
)
REWARD_ACCURACY = _key(
    "reward",
    "reward/accuracy",
    SHARE,
    "mean over the step's rollouts of the task's own 0/1 correctness verdict (`grpo_lens.tasks.correctness_verdict`: "
    "the marked final answer against the reference; math-verify for gsm8k when installed), independent of the "
    "configured reward functions and weights; absent when no rollout has a reference answer",
)
REWARD_KL_PENALTY = _key(
    "reward",
    "reward/kl_penalty",
    REWARD_UNITS,
    "with `--kl-in-reward`: mean over the step's valid rollouts of beta * sum_t (log pi_old - log pi_ref), the KL "
    "penalty subtracted from their rewards before the advantages; `reward/mean` includes it",
    source="§Losses, aggregation, KL and the gradient the trainer follows",
)
REWARD_OVERLONG_PENALTY = _key(
    "reward",
    "reward/overlong_penalty",
    REWARD_UNITS,
    "with `--overlong soft-punish`: mean over the step's rollouts of DAPO's length penalty R_length in [−1, 0] added "
    "to their rewards (docs/theory.md §Overlong handling); `reward/mean` includes it",
    source="§Overlong handling",
)
REWARD_FRAC_ZERO_STD_GROUPS = _key(
    "reward",
    "reward/frac_zero_std_groups",
    SHARE,
    "**S1 measured** (§9): share of the B groups whose valid rewards are all equal (or with < 2 valid rollouts). "
    "These groups contribute exactly zero policy gradient",
    source="§S1",
    concept="S1",
)
REWARD_INVALID_FRAC, REWARD_INVALID_COUNT = _keys(
    "reward",
    ("reward/invalid_frac", "reward/invalid_count"),
    (SHARE, COUNT),
    "share / number of rollouts whose reward was invalid (None, NaN, error, timeout); they get advantage 0 and are "
    "left out of group statistics",
    source="§2",
)
REWARD_ERROR_COUNT, REWARD_TIMEOUT_COUNT = _keys(
    "reward",
    ("reward/error_count", "reward/timeout_count"),
    COUNT,
    "reward-function calls that raised / exceeded `reward_timeout`",
)
REWARD_FUNCTION = _template(
    "reward", "reward/{name}", REWARD_UNITS, "mean of reward function `<name>` (before its weight) over valid rollouts"
)
REWARD_FUNCTION_INVALID_COUNT = _template(
    "reward",
    "reward/{name}/invalid_count",
    COUNT,
    "rollouts that function could not score this step (None, NaN, error, timeout)",
)
REWARD_LOGGED = _template(
    "reward",
    "reward/logged/{name}",
    "as logged",
    "a value a reward function logged with TRL's `log_metric(name, value)` keyword (`grpo_lens.rewards."
    "call_reward_function`), averaged over this step's calls",
)

# ---------------------------------------------------------------------------------------------------------------------
# adv/, completions/
# ---------------------------------------------------------------------------------------------------------------------
ADV_MEAN, ADV_ABS_MEAN, ADV_MAX, ADV_MIN = _keys(
    "adv",
    ("adv/mean", "adv/abs_mean", "adv/max", "adv/min"),
    ADVANTAGE_UNITS,
    "statistics of the N advantages A_i (§2). `adv/mean` is 0 up to rounding for zero-sum estimators",
    source="§2",
)
ADV_OPTIMAL_BASELINE = _key(
    "adv",
    "adv/optimal_baseline",
    REWARD_UNITS,
    "`--estimator optimal` only: mean over the valid rollouts of groups with reward contrast (all processes) of the "
    "leave-one-out b*_{-i} = r_i − A_i, from sketched squared gradient norms (docs/theory.md §The variance-optimal "
    "baseline in training)",
    source="§The variance-optimal baseline in training",
)
ADV_OPTIMAL_MINUS_RLOO = _key(
    "adv",
    "adv/optimal_minus_rloo",
    REWARD_UNITS,
    "`--estimator optimal` only: mean over the same rollouts of b*_{-i} − mean_{j≠i} r_j; 0 means the optimal "
    "baseline reduced to RLOO's on this step (m_C = m_W)",
    source="§The variance-optimal baseline in training",
)
COMPLETIONS_MEAN_LENGTH, COMPLETIONS_MAX_LENGTH = _keys(
    "completions",
    ("completions/mean_length", "completions/max_length"),
    TOKENS,
    "completion length in tokens (up to and including EOS)",
)
COMPLETIONS_TRUNCATED_FRAC = _key(
    "completions",
    "completions/truncated_frac",
    SHARE,
    "share of completions cut at `max_new_tokens` without EOS (what happens to them is `--overlong`: none, mask, "
    "filter or soft-punish; in every mode they still count in their group's mean and std; docs/theory.md "
    "§Overlong handling)",
    source="§Overlong handling",
)

# ---------------------------------------------------------------------------------------------------------------------
# loss/, kl/, clip/, ratio/, mismatch/, policy/
# ---------------------------------------------------------------------------------------------------------------------
LOSS_POLICY = _key(
    "loss",
    "loss/policy",
    LOSS_UNITS,
    "the clipped-surrogate part of the aggregated loss (§3), averaged over the step's optimizer steps. With ratio 1 "
    "and centred advantages it is ~0 even though its gradient is not",
    source="§3",
)
LOSS_KL = _key("loss", "loss/kl", LOSS_UNITS, "beta × aggregated KL part of the loss", source="§3")
KL_MEAN = _key(
    "loss",
    "kl/mean",
    NATS_PER_TOKEN,
    "token mean of the per-token KL estimate (`kl_estimator`) between policy and reference model; 0 when beta = 0",
    source="§3",
)
CLIP_RATIO_LOW = _key(
    "loss",
    "clip/ratio_low",
    SHARE,
    "share of completion tokens where rho < 1 − eps_low and A < 0 (the lower clip binds)",
    source="§3",
)
CLIP_RATIO_HIGH = _key(
    "loss", "clip/ratio_high", SHARE, "share where rho > 1 + eps_high and A > 0 (the upper clip binds)", source="§3"
)
CLIP_RATIO_REGION = _key(
    "loss", "clip/ratio_region", SHARE, "share where either binds; 0 on the first on-policy pass (mu = 1)", source="§3"
)
CLIP_RATIO_DUAL = _key(
    "loss", "clip/ratio_dual", SHARE, "share where the dual clip binds (A < 0, rho > dual_clip)", source="§3"
)
RATIO_MEAN, RATIO_MAX = _keys(
    "loss",
    ("ratio/mean", "ratio/max"),
    RATIO,
    "importance ratio rho = pi_theta / pi_old over completion tokens; pi_old is the trainer's own detached forward, so "
    "the first pass over the first mini-batch has rho = 1 exactly, in any dtype (docs/theory.md §Log-probabilities)",
    source="§Log-probabilities",
)
MISMATCH_LOGPROB_ABS_DIFF_MEAN, MISMATCH_LOGPROB_ABS_DIFF_MAX = _keys(
    "mismatch",
    ("mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max"),
    NATS,
    "mean / max over completion tokens of |log pi_old − log pi_sampler| (nats): the trainer's forward against the "
    "log-probs `generate` recorded, same definition. ~1e-6 (max ~5e-6) in float32 on the CPU; ~1e-2 (max ~0.05) in "
    "bfloat16 (docs/theory.md §Sampler-trainer mismatch)",
    source="§Sampler-trainer mismatch",
)
MISMATCH_KL_K3 = _key(
    "mismatch",
    "mismatch/kl_k3",
    NATS_PER_TOKEN,
    "token mean of the k3 estimate e^d − d − 1, d = log pi_old − log pi_sampler: KL(pi_sampler ‖ pi_old) in nats per "
    "token, ≥ 0",
    source="§Sampler-trainer mismatch",
)
MISMATCH_TIS_WEIGHT_MEAN = _key(
    "mismatch",
    "mismatch/tis_weight_mean",
    RATIO,
    "with `tis_cap`: mean truncated importance weight min(pi_old / pi_sampler, tis_cap) on the policy loss",
    source="§Sampler-trainer mismatch",
)
MISMATCH_TIS_CAPPED_FRAC = _key(
    "mismatch",
    "mismatch/tis_capped_frac",
    SHARE,
    "with `tis_cap`: share of completion tokens whose weight hit the cap",
    source="§Sampler-trainer mismatch",
)
POLICY_ENTROPY = _key(
    "policy",
    "policy/entropy",
    NATS_PER_TOKEN,
    "token mean, over the completion tokens of the step's first update pass (all processes), of the entropy "
    "−Σ_v π(v) log π(v) in nats of the temperature-scaled policy (docs/theory.md §Log-probabilities; the sampler's "
    "top-k / top-p truncation is not applied), from the logits that pass computes anyway (no extra forward; "
    "docs/theory.md §Policy entropy). With num_mini_batches > 1 mini-batch k is read after k optimizer steps. A fall "
    "towards 0 is entropy collapse",
    source="§Policy entropy",
)

# ---------------------------------------------------------------------------------------------------------------------
# dynamic/
# ---------------------------------------------------------------------------------------------------------------------
DYNAMIC_MIXED_GROUPS = _key(
    "dynamic",
    "dynamic/mixed_groups",
    COUNT,
    "mixed groups (rewards not all equal) the step trained on: prompts_per_step unless the cap was hit. The step's "
    "`reward/mean`, `reward/std`, `reward/frac_zero_std_groups` (S1), `reward/invalid_frac` and `reward/accuracy` "
    "describe ALL sampled groups (every round: the policy's actual behaviour); its other keys (adv/, completions/, "
    "loss/, the lens) describe the kept groups only",
    source="§Dynamic sampling",
)
DYNAMIC_ROUNDS = _key(
    "dynamic",
    "dynamic/rounds",
    COUNT,
    "sampling rounds of prompts_per_step prompts this step took (1 = the ordinary batch sufficed)",
    source="§Dynamic sampling",
)
DYNAMIC_SAMPLED_GROUPS = _key(
    "dynamic",
    "dynamic/sampled_groups",
    COUNT,
    "groups sampled over all rounds (rounds × prompts_per_step)",
    source="§Dynamic sampling",
)
DYNAMIC_ZERO_VAR_FRAC_SAMPLED = _key(
    "dynamic",
    "dynamic/zero_var_frac_sampled",
    SHARE,
    "share of all sampled groups whose rewards were all equal: the S1 that dynamic sampling paid for with extra "
    "generation",
    source="§Dynamic sampling",
    concept="S1",
)
(
    DYNAMIC_KEPT_REWARD_MEAN,
    DYNAMIC_KEPT_REWARD_STD,
    DYNAMIC_KEPT_FRAC_ZERO_STD_GROUPS,
    DYNAMIC_KEPT_INVALID_FRAC,
    DYNAMIC_KEPT_ACCURACY,
) = _keys(
    "dynamic",
    (
        "dynamic/kept_reward_mean",
        "dynamic/kept_reward_std",
        "dynamic/kept_frac_zero_std_groups",
        "dynamic/kept_invalid_frac",
        "dynamic/kept_accuracy",
    ),
    (REWARD_UNITS, REWARD_UNITS, SHARE, SHARE, SHARE),
    "the same statistics as `reward/mean`, `reward/std`, `reward/frac_zero_std_groups`, `reward/invalid_frac`, "
    "`reward/accuracy`, over the kept (trained-on) groups only: selected for reward contrast, so they are not the "
    "policy's reward or S1 (kept S1 is 0 unless the cap was hit)",
    source="§Dynamic sampling",
    concepts=("", "", "S1", "", ""),
)
DYNAMIC_HIT_CAP = _key(
    "dynamic",
    "dynamic/hit_cap",
    FLAG,
    "1 when the step ended at `dynamic_sampling_max_rounds` with fewer than prompts_per_step mixed groups (it then "
    "trains on those; with none, on the first round's batch, whose policy gradient is zero)",
    source="§Dynamic sampling",
)

#: With dynamic sampling these keys describe all sampled groups; the kept groups' values of them go to these keys.
KEPT_KEYS = {
    REWARD_MEAN: DYNAMIC_KEPT_REWARD_MEAN,
    REWARD_STD: DYNAMIC_KEPT_REWARD_STD,
    REWARD_FRAC_ZERO_STD_GROUPS: DYNAMIC_KEPT_FRAC_ZERO_STD_GROUPS,
    REWARD_INVALID_FRAC: DYNAMIC_KEPT_INVALID_FRAC,
    REWARD_ACCURACY: DYNAMIC_KEPT_ACCURACY,
}

# ---------------------------------------------------------------------------------------------------------------------
# grad/, guard/
# ---------------------------------------------------------------------------------------------------------------------
GRAD_NORM = _key(
    "grad",
    "grad/norm",
    GRAD_NORM_UNITS,
    "global L2 norm of the step's first optimizer step's gradient, before clipping: the on-policy GRPO gradient of "
    "the whole batch when num_mini_batches = 1, of the first mini-batch otherwise",
)
GRAD_NORM_LAST = _key(
    "grad",
    "grad/norm_last",
    GRAD_NORM_UNITS,
    "the same for the step's last optimizer step (differs when mu > 1 or num_mini_batches > 1)",
)
GRAD_OPTIMIZER_STEPS = _key(
    "grad",
    "grad/optimizer_steps",
    COUNT,
    "optimizer steps taken this sampling round (mu × num_mini_batches, less any skipped)",
)
GRAD_IDENTITY_RESIDUAL = _key(
    "grad",
    "grad/identity_residual",
    RELATIVE_ERROR,
    "lens steps: max over mixed 0/1 groups of the relative residual of Σ A_i g_i = c (ḡ_C − ḡ_W) with the configured "
    "estimator's own constant c (theory §4); absent when the identity does not apply (reinforce, optimal, "
    "`mask_truncated` groups with a truncated rollout, non-0/1 rewards)",
    source="§4",
    where=LENS,
)
GRAD_IDENTITY_CONSTANT = _key(
    "grad",
    "grad/identity_constant",
    ADVANTAGE_UNITS,
    "lens steps: mean over those groups of c (= k A_C, the estimator's constant for the group's k and R)",
    source="§4",
    where=LENS,
)
# the exact Gram's coverage (gradients/gram.py)
GRAD_GRAM_COVERAGE = _key(
    "grad",
    "grad/gram_coverage",
    SHARE,
    "lens steps with the exact Gram (`gram_source: exact`): the share of the trainable parameters (by count) whose "
    "per-rollout gradients the Gram covers, so the share of Σ‖g_i‖² it carries is 1 when this is 1 "
    "(grpo_lens.gradients.gram; a parameter it cannot attribute is listed, not guessed)",
    source="§Exact Gram",
    where=(JSONL,),
)
GUARD_SKIPPED_OPTIMIZER_STEPS = _key(
    "guard",
    "guard/skipped_optimizer_steps",
    COUNT,
    "optimizer steps of this round skipped because a loss or the gradient norm was non-finite (no weight or AdamW "
    "change)",
    source="§Numerical guards",
)
GUARD_STEP_SKIPPED = _key(
    "guard",
    "guard/step_skipped",
    FLAG,
    "1 when this round skipped any optimizer step, else 0",
    source="§Numerical guards",
)
GUARD_SKIPPED_STEPS = _key(
    "guard",
    "guard/skipped_steps",
    COUNT,
    "running total of skipped rounds in the run (kept across --resume)",
    source="§Numerical guards",
)
GUARD_CONSECUTIVE_SKIPPED = _key(
    "guard",
    "guard/consecutive_skipped",
    COUNT,
    "skipped rounds in a row up to this one; the run stops at `max_consecutive_skips`",
    source="§Numerical guards",
)

# ---------------------------------------------------------------------------------------------------------------------
# the exact gradient noise scale (lens steps) and dead-group accounting (every step)
# (grpo_lens/formulas/noise.py, docs/theory.md §Noise scale and dead groups)
# ---------------------------------------------------------------------------------------------------------------------
GROUPS_UNITS = "groups (prompts)"
_NOISE = "§Noise scale and dead groups"
NOISE_GROUPS = _key(
    "noise",
    "noise/groups",
    COUNT,
    "lens steps: B, the groups (prompts) the noise scale counts: every group of the step, those without a policy "
    "gradient (all A_i = 0) with G_b = 0",
    source=_NOISE,
)
NOISE_GRAD_SQ, NOISE_GRAD_SQ_LO, NOISE_GRAD_SQ_HI = _keys(
    "noise",
    ("noise/grad_sq", "noise/grad_sq_lo", "noise/grad_sq_hi"),
    SQ_GRAD_NORM_UNITS,
    "lens steps: the unbiased |G|^2 = (S - D) / (B (B - 1)) of the mean group gradient G = E[G_b], G_b = sum_{i in b} "
    "(-A_i / N) g_i (the update's policy-gradient rows, KL excluded), D = sum_b |G_b|^2, S = |sum_b G_b|^2, from the "
    "exact Gram; lo/hi: delete-one-group jackknife 95% interval (full Gram, >= 8 groups). Can be negative: no signal",
    source=_NOISE,
)
NOISE_TRACE_SIGMA, NOISE_TRACE_SIGMA_LO, NOISE_TRACE_SIGMA_HI = _keys(
    "noise",
    ("noise/trace_sigma", "noise/trace_sigma_lo", "noise/trace_sigma_hi"),
    SQ_GRAD_NORM_UNITS,
    "lens steps: the unbiased tr(Sigma) = (D - S / B) / (B - 1), the per-group gradient covariance's trace; lo/hi "
    "as `noise/grad_sq`",
    source=_NOISE,
)
NOISE_B_SIMPLE, NOISE_B_SIMPLE_LO, NOISE_B_SIMPLE_HI = _keys(
    "noise",
    ("noise/b_simple", "noise/b_simple_lo", "noise/b_simple_hi"),
    GROUPS_UNITS,
    "lens steps: the gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, arXiv 1812.06162, "
    "§2.2), in groups: the batch at which noise and signal energy are equal; NaN when |G|^2 <= 0; lo/hi as "
    "`noise/grad_sq`",
    source=_NOISE,
)
NOISE_SNR = _key(
    "noise",
    "noise/snr",
    RATIO,
    "lens steps: the step's signal-to-noise |G|^2 / (tr(Sigma) / B) = B / B_simple (> 1: the step's mean gradient "
    "holds more signal than noise energy)",
    source=_NOISE,
)
NOISE_GRAD_SQ_P = _key(
    "noise",
    "noise/grad_sq_p",
    P_VALUE,
    "lens steps, full Gram: the null control, a one-sided sign-flip p-value of |G|^2 > 0 (2000 flips of each "
    "group's sign; large: the step's signal is not told apart from noise)",
    source=_NOISE,
)
NOISE_FROM_UPDATE = _key(
    "noise",
    "noise/from_update",
    FLAG,
    "1 when S = |sum_b G_b|^2 is the update's own first gradient norm squared (the Gram read off the update's "
    "backward holds each group's block only: no interval, no null), 0 when it is the sum of the full Gram",
    source=_NOISE,
)
NOISE_PROXY_TOTAL_POWER, NOISE_EXACT_TOTAL_POWER = _keys(
    "noise",
    ("noise/proxy_total_power", "noise/exact_total_power"),
    ("logit-space squared norm", SQ_GRAD_NORM_UNITS),
    "lens steps with `--lens-noise-proxy`: verl's proxy mean_i A_i^2 W_i, W_i = sum_t |e_{o_t} - pi_t|^2 (verl PR "
    "#4678, `variance_proxy/proxy2_total_power`), and the exact mean_i A_i^2 |sum_t grad log pi(o_it)|^2 from the "
    "Gram's diagonal, both over the step's N rollouts in the loss (A_i = 0 outside the mixed groups): two scales, "
    "compare their orderings (`noise/proxy_rank_corr`)",
    source=_NOISE,
)
NOISE_PROXY_RANK_CORR = _key(
    "noise",
    "noise/proxy_rank_corr",
    RATIO,
    "lens steps with `--lens-noise-proxy`: Spearman's rho over the mixed groups' rollouts between verl's A_i^2 W_i and "
    "the exact A_i^2 |sum_t grad log pi(o_it)|^2 (1: the proxy orders rollouts by gradient power as the Gram does)",
    source=_NOISE,
)
DEAD_ALL_CORRECT, DEAD_ALL_WRONG, DEAD_ALL_OTHER = _keys(
    "dead",
    ("dead/all_correct_groups", "dead/all_wrong_groups", "dead/all_equal_other_groups"),
    COUNT,
    "every step: groups without reward contrast whose valid rewards all equal 1 (all correct under the 0/1 "
    "correctness reward), all equal 0 (all wrong), or all equal another value; with `reward/frac_zero_std_groups` "
    "they split S1",
    source=_NOISE,
)
DEAD_MIXED_GROUPS = _key(
    "dead",
    "dead/mixed_groups",
    COUNT,
    "every step: groups with reward contrast (every process's); 0 counts toward `--stop-after-dead-steps`",
    source=_NOISE,
)
DEAD_NORMALIZER_SHARE = _key(
    "dead",
    "dead/normalizer_share",
    SHARE,
    "every step: share of the loss normaliser (completion tokens for token-mean, rollouts otherwise) held by "
    "rollouts of groups whose advantages are all 0: every other rollout's gradient is divided by it too, so the step "
    "is (1 - share) of what a loss over the other groups alone would take",
    source=_NOISE,
)
DEAD_STEPS = _key(
    "dead",
    "dead/steps_without_mixed",
    COUNT,
    "every step: consecutive steps up to this one without a mixed group (kept across --resume); "
    "`--stop-after-dead-steps N` stops the run when it reaches N",
    source=_NOISE,
)

# ---------------------------------------------------------------------------------------------------------------------
# Landing shares during training and the dead groups' KL-only gradient (lens steps, opt-in)
# ---------------------------------------------------------------------------------------------------------------------
_LANDING = "§Landing shares and the dead groups' KL gradient"
SIGNED_SHARE = "signed share (the shares sum to 1)"
LANDING_ANSWER_SHARE, LANDING_FORMAT_SHARE, LANDING_REASONING_SHARE = _keys(
    "landing",
    ("landing/answer_share", "landing/format_share", "landing/reasoning_share"),
    SIGNED_SHARE,
    "lens steps with `--lens-landing` and a tokenizer: the token class's share of the update's landing, sum over its "
    "tokens of s_it = w_it <grad log pi(o_it), u> / |u|^2 (u the update's own first gradient, negated; w_it = A_i "
    "omega_i / N) over the sum of s_it over every measured token; classes as the credit study's (answer: the last "
    "number's tokens, format: no letter or digit, reasoning: the rest); signed, so one may exceed 1 or fall below 0",
    source=_LANDING,
)
LANDING_ANSWER_TOKENS, LANDING_FORMAT_TOKENS, LANDING_REASONING_TOKENS = _keys(
    "landing",
    ("landing/answer_token_share", "landing/format_token_share", "landing/reasoning_token_share"),
    SHARE,
    "lens steps with `--lens-landing` and a tokenizer: the class's share of the measured tokens, the control its "
    "landing share is read against (equal: the class carries the update in proportion to its size)",
    source=_LANDING,
)
LANDING_POSITIVE_SHARE = _key(
    "landing",
    "landing/positive_share",
    SIGNED_SHARE,
    "lens steps with `--lens-landing`: the share of the update's landing on tokens of rollouts with A_i > 0 (the rest "
    "lands on A_i < 0 rollouts' tokens)",
    source=_LANDING,
)
LANDING_CLOSURE = _key(
    "landing",
    "landing/closure",
    RATIO,
    "lens steps with `--lens-landing`: sum of s_it over the measured tokens; 1 (to the finite differences' O(e^4) "
    "error) when they make the whole update (one process, no KL term in the loss, no importance weights), the "
    "share of |u|^2 they account for otherwise",
    source=_LANDING,
)
LANDING_TOKENS = _key(
    "landing",
    "landing/tokens",
    TOKENS,
    "lens steps with `--lens-landing`: the tokens measured (every token the loss sums of this process's rollouts "
    "with A_i != 0 in the update's first mini-batch, whose gradient the first optimizer step takes)",
    source=_LANDING,
)
DEAD_KL_GRAD_NORM = _key(
    "dead",
    "dead/kl_grad_norm",
    GRAD_NORM_UNITS,
    "lens steps with `--lens-dead-kl`, beta > 0 and the KL in the loss: |grad of the loss over the rollouts of groups "
    "whose advantages are all 0| = |beta grad KL| of those rows (their policy term has no gradient), aggregated and "
    "normalised as in the update, at the step's starting weights, every trainable parameter (one process)",
    source=_LANDING,
)
DEAD_KL_GRAD_RATIO = _key(
    "dead",
    "dead/kl_grad_ratio",
    RATIO,
    "lens steps with `--lens-dead-kl`: `dead/kl_grad_norm` over the update's first gradient norm (before clipping): "
    "how large the push groups without reward contrast give through the KL term is next to the whole step's",
    source=_LANDING,
)
PERF_LENS_LANDING_SECONDS = _key(
    "perf",
    "perf/lens_landing_seconds",
    SECONDS,
    "lens steps with `--lens-landing` or `--lens-dead-kl`: wall time of their extra forwards and backward (not in "
    "`perf/lens_seconds`)",
)

# ---------------------------------------------------------------------------------------------------------------------
# The per-group analysis path (lens steps and probe.json)
# ---------------------------------------------------------------------------------------------------------------------
RANK_MIXED_GROUPS = _key(
    "group",
    "rank/mixed_groups",
    COUNT,
    "lens: groups analysed this step (mixed, all rewards valid), over every process",
)
GROUP_SIZE = _key("group", "group/size", COUNT, "R (probe only; the lens omits it)", where=(GROUPS,))
GROUP_REWARD_MEAN = _key("group", "group/reward_mean", REWARD_UNITS, "the group's mean reward", where=LENS)
GROUP_CORRECT = _key(
    "group", "group/correct", COUNT, "k, the number of rollouts with reward 1 (0/1 rewards only)", where=LENS
)
GROUP_DISTINCT_COMPLETIONS = _key(
    "group",
    "group/distinct_completions",
    COUNT,
    "distinct completions among the R (identical completions have identical g_i and cap G1's rank)",
    where=LENS,
)
RANK_G1 = _template("group", "rank/g1_{m}", RANK_UNITS, "G1, rows A_i g_i (theory §5)", source="§5", where=LENS)
RANK_G1_NULL = _template(
    "group",
    "rank/g1_null_{m}",
    RANK_UNITS,
    "the orthogonal null: singular values |A_i|·‖g_i‖, what G1 would have if its rows shared no direction (theory §5)",
    source="§5",
    where=LENS,
)
RANK_G1_SIMNULL = _template(
    "group",
    "rank/g1_simnull_{m}",
    RANK_UNITS,
    "the simulated null: G1's row norms with iid uniform random directions in R^P (mean over draws; only when "
    "the dimension P is given, e.g. by `grpo-lens calibrate`); tends to the orthogonal null as P grows (theory §5)",
    source="§5",
    where=LENS,
)
RANK_G1_LENS_LO, RANK_G1_LENS_HI = (
    _template(
        "group",
        f"rank/g1_{{m}}_{end}",
        RANK_UNITS,
        f"lens: the {side} end of the 95% interval over the step's mixed groups of rank/g1_<m> (Hall's t, theory §7; "
        f"absent with fewer than 8 groups)",
        source="§7",
        where=(JSONL,),
    )
    for end, side in (("lo", "lower"), ("hi", "upper"))
)
RANK_G1_VS_NULL = _template(
    "group",
    "rank/g1_{m}_vs_null",
    RATIO,
    "rank/g1_<m> / rank/g1_null_<m>: below 1 = shared directions beyond the row norms",
    source="§5",
    where=LENS,
)
RANK_G1_NO_ADV = _template(
    "group", "rank/g1_no_adv_{m}", RANK_UNITS, "control: rows g_i (no advantages)", source="§5", where=LENS
)
RANK_G1_RANDOM = _template(
    "group",
    "rank/g1_random_{m}",
    RANK_UNITS,
    "control: rows w_i g_i, w random zero-sum with ‖w‖ = ‖A‖ (mean over draws)",
    source="§5",
    where=LENS,
)
RANK_G1_NLL = _template(
    "group",
    "rank/g1_nll_{m}",
    RANK_UNITS,
    "control: rows of the supervised token-mean NLL gradient of the same completions",
    source="§5",
    where=LENS,
)
BASELINE_M_CORRECT, BASELINE_M_WRONG = _keys(
    "group",
    ("baseline/m_correct", "baseline/m_wrong"),
    SQ_GRAD_NORM_UNITS,
    "m_C, m_W: mean ‖g_i‖² of correct / wrong rollouts",
    source="§2",
    where=LENS,
)
BASELINE_B_STAR = _key(
    "group",
    "baseline/b_star",
    REWARD_UNITS,
    "b* = Σ‖g_i‖² r_i / Σ‖g_i‖², the variance-optimal constant baseline (plug-in, theory §2)",
    source="§2",
    where=LENS,
)
BASELINE_GROUP_MEAN = _key(
    "group",
    "baseline/group_mean",
    REWARD_UNITS,
    "the group mean reward, GRPO's baseline; equals b* iff m_C = m_W",
    source="§2",
    where=LENS,
)
BASELINE_B_STAR_MINUS_MEAN = _key(
    "group", "baseline/b_star_minus_mean", REWARD_UNITS, "b* − group mean", source="§2", where=LENS
)
ZERO_SUM_SPAN_ENERGY = _key(
    "group",
    "zero_sum/span_energy",
    SHARE,
    "share of G1's energy ΣA_i²‖g_i‖² that lies in span{ḡ_C, ḡ_W} (theory §6)",
    source="§6",
    where=LENS,
)
ZERO_SUM_SPAN_ENERGY_NULL = _key(
    "group",
    "zero_sum/span_energy_null",
    SHARE,
    "its mean over relabellings of the group with k fixed (the permutation null)",
    source="§6",
    where=LENS,
)
ZERO_SUM_SPAN_ENERGY_P = _key(
    "group",
    "zero_sum/span_energy_p",
    P_VALUE,
    "permutation p-value: share of relabellings with a span energy ≥ the true labels'",
    source="§6",
    where=LENS,
)
ZERO_SUM_SPAN_ENERGY_EXCESS = _key(
    "group",
    "zero_sum/span_energy_excess",
    SHARE_DIFFERENCE,
    "span energy minus its relabelling mean; mean zero under the null when all C(R, k) relabellings are enumerated, "
    "so its mean over groups with an interval is the across-group test (theory §6)",
    source="§6",
    where=LENS,
)
ZERO_SUM_SPAN_ENERGY_NULL_VAR = _key(
    "group",
    "zero_sum/span_energy_null_var",
    "squared share",
    "variance of the span energy over the relabellings with k fixed: the group's null variance in the across-group "
    "relabelling test of the claims (theory §11)",
    source="§11",
    where=LENS,
)
ZERO_SUM_COS_GAP = _key(
    "group",
    "zero_sum/cos_gap",
    COSINE_GAP,
    "mean within-class minus mean between-class cosine of the g_i (absent for R = 2)",
    source="§6",
    where=LENS,
)
ZERO_SUM_COS_GAP_NULL, ZERO_SUM_COS_GAP_EXCESS, ZERO_SUM_COS_GAP_NULL_VAR, ZERO_SUM_COS_GAP_P = _keys(
    "group",
    ("zero_sum/cos_gap_null", "zero_sum/cos_gap_excess", "zero_sum/cos_gap_null_var", "zero_sum/cos_gap_p"),
    (COSINE_GAP, COSINE_GAP, "squared cosine gap", P_VALUE),
    "its relabelling mean, excess over it, variance over the relabellings, and permutation p-value",
    source="§6",
    where=LENS,
)

(
    ZERO_SUM_UNIT_SPAN_ENERGY,
    ZERO_SUM_UNIT_SPAN_ENERGY_NULL,
    ZERO_SUM_UNIT_SPAN_ENERGY_EXCESS,
    ZERO_SUM_UNIT_SPAN_ENERGY_NULL_VAR,
    ZERO_SUM_UNIT_SPAN_ENERGY_P,
) = _keys(
    "group",
    (
        "zero_sum/unit_span_energy",
        "zero_sum/unit_span_energy_null",
        "zero_sum/unit_span_energy_excess",
        "zero_sum/unit_span_energy_null_var",
        "zero_sum/unit_span_energy_p",
    ),
    (SHARE, SHARE, SHARE_DIFFERENCE, "squared share", P_VALUE),
    "the span energy on the cosine Gram (every g_i scaled to norm 1, so a label effect on gradient norms alone "
    "cannot raise it): observed, relabelling mean, excess, variance over the relabellings, permutation p-value; the "
    "mechanism claim's θ (theory §11)",
    source="§11",
    where=LENS,
)

#: The statistics of the zero-sum test (:func:`grpo_lens.formulas.zero_sum.zero_sum_tests`) and the parts of each.
ZERO_SUM_STATS = ("span_energy", "cos_gap")

#: the span energy of the cosine Gram (the mechanism claim's θ; not in the report's zero-sum table)
ZERO_SUM_UNIT_STATS = ("unit_span_energy",)
ZERO_SUM_PARTS = ("", "null", "excess", "null_var", "p")

# probe only, computed with the model
RANK_G1_LAYER = _template(
    "probe_group", "rank/g1_layer_{m}", RANK_UNITS, "G1 of one layer's rows", source="§5", where=(GROUPS,)
)
RANK_G2 = _template(
    "probe_group",
    "rank/g2_{m}",
    RANK_UNITS,
    "that layer's weight gradient of the group loss, [d_out, d_in]",
    source="§5",
    where=(GROUPS,),
)
RANK_G2_NUMERICAL_RANK = _key(
    "probe_group",
    "rank/g2_numerical_rank",
    RANK_UNITS,
    "G2's singular values above max(d_out, d_in) × the float epsilon of the precision G2 was computed in, × s₁",
    source="§5",
    where=(GROUPS,),
)
RANK_G2_RANK_BOUND = _key(
    "probe_group",
    "rank/g2_rank_bound",
    RANK_UNITS,
    "prompt tokens + distinct proper completion prefixes",
    source="§5",
    where=(GROUPS,),
)
CREDIT_ADV_VAR_WITHIN_MAX = _key(
    "probe_group",
    "credit/adv_var_within_max",
    "advantage units²",
    "the largest variance of the per-token advantages within a rollout: 0 by construction under an output-only reward",
    source="§10",
    where=(GROUPS,),
)
CREDIT_ANSWER_SHARE_MEAN = _key(
    "probe_group",
    "credit/answer_share_mean",
    SHARE,
    "share of a rollout's Σ_t ‖∇_t‖² on its final-answer tokens",
    source="§10",
    where=(GROUPS,),
)
CREDIT_ANSWER_TOKEN_FRAC = _key(
    "probe_group",
    "credit/answer_token_frac",
    SHARE,
    "share of its tokens that are answer tokens: what a flat profile gives",
    source="§10",
    where=(GROUPS,),
)

# one matrix per R: probe.json g3
RANK_G3 = _template(
    "g3", "rank/g3_{m}", RANK_UNITS, "G3, rows = the analysed groups' updates Σ_i A_i g_i", source="§5", where=(G3,)
)
RANK_G3_NULL = _template(
    "g3",
    "rank/g3_null_{m}",
    RANK_UNITS,
    "its orthogonal null, singular values = the row norms",
    source="§5",
    where=(G3,),
)
RANK_G3_WEIGHTED = _template(
    "g3",
    "rank/g3_{w}_{m}",
    RANK_UNITS,
    "G3 with rows Σ_i w_i g_i under the weighting `<w>`",
    source="§6",
    where=(G3,),
    only=(("w", WEIGHTING_NAMES[1:]),),
)
G3_GROUPS = _key("g3", "groups", COUNT, "the analysed groups, G3's rows (one matrix: no interval)", where=(G3,))

# probe.json g2_weightings
RANK_G2_WEIGHTED = _template(
    "g2_weightings",
    "rank/g2_{w}_{kind}_stable_rank",
    RANK_UNITS,
    "the mean over the layers of kind `<kind>` (q_proj, down_proj, lm_head, ...) of the stable rank ‖G2‖_F²/s₁² of "
    "every nn.Linear layer's G2 under weighting `<w>` (s₁ by subspace iteration with a residual check, the exact "
    "symmetric solver where it does not converge; `probe.json` `g2_weightings`)",
    source="§6",
    where=(G2_WEIGHTINGS,),
)

# ---------------------------------------------------------------------------------------------------------------------
# sparsity/ (lens steps)
# ---------------------------------------------------------------------------------------------------------------------
SPARSITY_UPDATE_STEP = _key(
    "sparsity",
    "sparsity/update_step",
    SHARE,
    "**S4**: share of parameters whose bf16 value did not change in this step (every parameter)",
    source="§9",
    concept="S4",
)
SPARSITY_UPDATE_TOTAL = _key(
    "sparsity",
    "sparsity/update_total",
    SHARE,
    "**S4**: share whose bf16 value is the same as before training (every parameter)",
    source="§9",
    concept="S4",
)
SPARSITY_UPDATE_STEP_F32_UNCHANGED, SPARSITY_UPDATE_TOTAL_F32_UNCHANGED = _keys(
    "sparsity",
    ("sparsity/update_step_f32_unchanged", "sparsity/update_total_f32_unchanged"),
    SHARE,
    "share of weights exactly unchanged in float32 by this step's update / since the start (docs/theory.md "
    "§Sparsity over training)",
    source="§Sparsity over training",
)
SPARSITY_UPDATE_STEP_BF16_UNCHANGED, SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED = _keys(
    "sparsity",
    ("sparsity/update_step_bf16_unchanged", "sparsity/update_total_bf16_unchanged"),
    SHARE,
    "share whose bf16 value is unchanged, on the fixed sample (estimates S4)",
    source="§Sparsity over training",
    concepts="S4",
)
SPARSITY_UPDATE_STEP_BF16_PERMUTED, SPARSITY_UPDATE_TOTAL_BF16_PERMUTED = _keys(
    "sparsity",
    ("sparsity/update_step_bf16_permuted", "sparsity/update_total_bf16_permuted"),
    SHARE,
    "**the control** for the line above: the expected bf16-unchanged share when the same update entries are permuted "
    "within each tensor (each tensor's magnitudes, zeros included, kept; where they land removed; exact mean over "
    "permutations)",
    source="§Sparsity over training",
)
SPARSITY_UPDATE_STEP_BF16_DENSE, SPARSITY_UPDATE_TOTAL_BF16_DENSE = _keys(
    "sparsity",
    ("sparsity/update_step_bf16_dense", "sparsity/update_total_bf16_dense"),
    SHARE,
    "a second control: the expected bf16-unchanged share of a dense Gaussian update with the same per-tensor RMS "
    "(shown, not the claim's control: with heavy-tailed magnitudes the RMS is set by the few large entries, so this "
    "reads a dense update as sparser than rounding)",
    source="§Sparsity over training",
)
SPARSITY_UPDATE_STEP_F32_UNCHANGED_SE, SPARSITY_UPDATE_TOTAL_F32_UNCHANGED_SE = _keys(
    "sparsity",
    ("sparsity/update_step_f32_unchanged_se", "sparsity/update_total_f32_unchanged_se"),
    SHARE,
    "standard error of the float32-unchanged share from the fixed sample, stratified by tensor (Cochran 1977 §5.3; "
    "tensors taken whole add none)",
    source="§Sparsity over training",
)
SPARSITY_UPDATE_STEP_BF16_UNCHANGED_SE, SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED_SE = _keys(
    "sparsity",
    ("sparsity/update_step_bf16_unchanged_se", "sparsity/update_total_bf16_unchanged_se"),
    SHARE,
    "the same for the bf16-unchanged share",
    source="§Sparsity over training",
)
SPARSITY_UPDATE_STEP_BF16_EXCESS_SE, SPARSITY_UPDATE_TOTAL_BF16_EXCESS_SE = _keys(
    "sparsity",
    ("sparsity/update_step_bf16_excess_se", "sparsity/update_total_bf16_excess_se"),
    SHARE,
    "the same for bf16-unchanged − the permutation control (per-entry differences treated as independent within a "
    "tensor: the control's own sampling noise is left out)",
    source="§Sparsity over training",
)
SPARSITY_UPDATE_STEP_HOYER, SPARSITY_UPDATE_TOTAL_HOYER = _keys(
    "sparsity",
    ("sparsity/update_step_hoyer", "sparsity/update_total_hoyer"),
    SPARSITY_UNITS,
    "Hoyer sparsity (S3) of the update: 0 equal magnitudes, ≈ 0.20 Gaussian, 1 one entry; null for a zero update (0/0)",
    source="§Sparsity over training",
)
SPARSITY_UPDATE_STEP_TOP1_ENERGY, SPARSITY_UPDATE_TOTAL_TOP1_ENERGY = _keys(
    "sparsity",
    ("sparsity/update_step_top1_energy", "sparsity/update_total_top1_energy"),
    SHARE,
    "share of ‖Δθ‖² in the top 1% of entries (S2-style): ≈ 0.105 for a Gaussian vector, 1 when ≤ 1% of entries move; "
    "null for a zero update",
    source="§Sparsity over training",
)
SPARSITY_GRAD_ZERO, SPARSITY_GRAD_HOYER, SPARSITY_GRAD_TOP1_ENERGY = _keys(
    "sparsity",
    ("sparsity/grad_zero", "sparsity/grad_hoyer", "sparsity/grad_top1_energy"),
    (SHARE, SPARSITY_UNITS, SHARE),
    "the same measures of the step's policy gradient (the first optimizer step's gradient, before clipping)",
    source="§Sparsity over training",
)
SPARSITY_GRAD_TOTAL_ZERO, SPARSITY_GRAD_TOTAL_HOYER, SPARSITY_GRAD_TOTAL_TOP1_ENERGY = _keys(
    "sparsity",
    ("sparsity/grad_total_zero", "sparsity/grad_total_hoyer", "sparsity/grad_total_top1_energy"),
    (SHARE, SPARSITY_UNITS, SHARE),
    "the same measures of the policy gradients summed over every step since the start (the sampled entries, "
    "accumulated in float64 on every step; kept in checkpoints)",
    source="§Sparsity over training",
)
SPARSITY_BY_TYPE = _template(
    "sparsity",
    "sparsity/{type}/{key}",
    "as `<key>`",
    "each of the keys above for one layer type: `norm`, `embedding`, `attention`, `mlp` (`other` if any)",
    source="§Sparsity over training",
)
SPARSITY_SAMPLE_ENTRIES = _key(
    "sparsity",
    "sparsity/sample_entries",
    COUNT,
    "how many weight entries the sampled keys come from (a fixed stratified uniform sample, weights n_t/s_t; standard "
    "error of a share ≤ 0.5/√this)",
    source="§Sparsity over training",
)

# ---------------------------------------------------------------------------------------------------------------------
# perf/ and others
# ---------------------------------------------------------------------------------------------------------------------
PERF_STEP_SECONDS = _key(
    "perf", "perf/step_seconds", SECONDS, "wall time of the whole step (sampling, rewards, lens, update)"
)
PERF_GENERATION_SECONDS = _key("perf", "perf/generation_seconds", SECONDS, "wall time of sampling")
PERF_OPTIMAL_BASELINE_SECONDS = _key(
    "perf",
    "perf/optimal_baseline_seconds",
    SECONDS,
    "`--estimator optimal` only: wall time of the sketched backward that gives b*'s squared gradient norms (this "
    "process)",
)
PERF_LENS_SECONDS = _key(
    "perf",
    "perf/lens_seconds",
    SECONDS,
    "wall time of the lens measurement (lens steps): its own forward + backward and the analysis; when the exact Gram "
    "comes from the update's own backward (`--lens-from-update`, docs/theory.md §Lens inside the update's backward), "
    "its hooks' time inside that backward and the analysis; when the sketch comes from the update's first pass "
    "(docs/theory.md §Lens sketch from the update), the analysis alone",
)
PERF_LENS_SPARSITY_SECONDS = _key(
    "perf",
    "perf/lens_sparsity_seconds",
    SECONDS,
    "wall time of the lens's snapshots and sparsity measures around the optimizer step (lens steps). With "
    "`lens_from_update` the lens's gradient capture runs inside the update's first pass and is in neither lens key: "
    "measured on the default model (2-core CPU, shared machine, 4 steps, same rollouts with and without the lens) the "
    "lens cost 2.06 s per lens step, of which these two keys held 1.6 s, on 12.2 s steps: 3.9% of a 30-step run at "
    "`lens_every` = 5 (7 lens steps), 17% at `lens_every` = 1",
)
PERF_REWARD_SECONDS = _template(
    "perf",
    "perf/reward_{name}_seconds",
    SECONDS,
    "wall time of reward function `<name>` this step (a timed-out call counts up to `reward_timeout`)",
)
PERF_TOKENS_PER_SECOND = _key(
    "perf", "perf/tokens_per_second", TOKENS_PER_SECOND, "completion tokens of the step / step seconds"
)
PERF_PEAK_MEMORY_MB = _key(
    "perf", "perf/peak_memory_mb", MEGABYTES, "peak GPU memory allocated, or the process's peak resident memory on CPU"
)
LR = _key("perf", "lr", LEARNING_RATE, "learning rate of the step")
STEP = _key("perf", "step", STEP_UNITS, "the optimizer step (sampling round), from 1")

# ---------------------------------------------------------------------------------------------------------------------
# eval/: held-out accuracy every --eval-every steps (grpo_lens.train.evaluate)
# ---------------------------------------------------------------------------------------------------------------------
EVAL_GREEDY_ACCURACY, EVAL_GREEDY_ACCURACY_LO, EVAL_GREEDY_ACCURACY_HI = _keys(
    "eval",
    ("eval/greedy_accuracy", "eval/greedy_accuracy_lo", "eval/greedy_accuracy_hi"),
    SHARE,
    "share of the `eval_prompts` held-out prompts whose greedy completion (temperature 0) the task's own verdict "
    "marks correct, and its 95% Wilson interval over prompts (`grpo_lens.formulas.stats.wilson_interval`)",
)
EVAL_SAMPLED_ACCURACY, EVAL_SAMPLED_ACCURACY_LO, EVAL_SAMPLED_ACCURACY_HI = _keys(
    "eval",
    ("eval/sampled_accuracy", "eval/sampled_accuracy_lo", "eval/sampled_accuracy_hi"),
    SHARE,
    "share of correct completions among `eval_samples` sampled ones per held-out prompt (the training temperature), "
    "and its 95% Wilson interval over the completions (they share prompts, so it is narrower than one over prompts)",
)
EVAL_PROMPTS = _key("eval", "eval/prompts", COUNT, "held-out prompts the evaluation scored")
EVAL_SECONDS = _key("eval", "eval/seconds", SECONDS, "wall time of the evaluation (not in perf/step_seconds)")

# ---------------------------------------------------------------------------------------------------------------------
# probe.json per_group_size["R"]
# ---------------------------------------------------------------------------------------------------------------------
ROLLOUTS_PER_PROMPT = _key(
    "probe",
    "rollouts_per_prompt",
    COUNT,
    "M = max(2R, 8) completions drawn per prompt; the first R form the group",
    where=(PROBE,),
)
PROMPTS_SAMPLED = _key(
    "probe",
    "prompts_sampled",
    COUNT,
    "prompts drawn for this R (`--prompts`, a fixed number: the probe never stops at the N-th mixed group)",
    where=(PROBE,),
)
GROUPS_ALL_EQUAL, GROUPS_MIXED, GROUPS_INVALID = _keys(
    "probe",
    ("groups_all_equal", "groups_mixed", "groups_invalid"),
    COUNT,
    "of those: groups with all rewards equal (no gradient), mixed (all analysed), with an invalid reward",
    where=(PROBE,),
)
S1_MEASURED = _key(
    "probe",
    "s1_measured",
    SHARE,
    "all-equal groups / groups with all rewards valid",
    source="§S1",
    where=(PROBE,),
    concept="S1",
)
S1_MEASURED_CI = _key(
    "probe",
    "s1_measured_ci",
    INTERVAL,
    "`{mean, lo, hi, n}`: S1 measured with its 95% interval over the prompts (Hall's transformed t, §7) "
    '(per-prompt indicator "all rewards equal")',
    source="§S1",
    where=(PROBE,),
    concept="S1",
)
S1_PREDICTED = _key(
    "probe",
    "s1_predicted",
    SHARE,
    "mean over prompts (all M rewards valid) of [C(k′,R) + C(M′−k′,R)] / C(M′,R), k′ correct among the M′ = M − R "
    "rollouts outside the group: unbiased for p^R + (1−p)^R and not computed from the measured group (docs/theory.md "
    "§S1)",
    source="§S1",
    where=(PROBE,),
    concept="S1 predicted",
)
S1_PREDICTED_CI = _key(
    "probe",
    "s1_predicted_ci",
    INTERVAL,
    "`{mean, lo, hi, n}`: its 95% interval over prompts (Hall's transformed t, §7)",
    source="§S1",
    where=(PROBE,),
    concept="S1 predicted",
)
PROBE_GROUPS = _key(
    "probe", "groups", ROWS, "one row per analysed group: the keys of the per-group analysis path above", where=(PROBE,)
)
PROBE_SUMMARY = _key(
    "probe",
    "summary",
    INTERVAL,
    "`{mean, lo, hi, n}`: mean over the groups that have the key, with its 95% Hall's transformed-t interval "
    "over groups (theory §7, `grpo_lens.formulas.stats.mean_interval`; lo = hi = null for n < 8)",
    source="§7",
    where=(PROBE,),
    shown=("summary[key]",),
)
PROBE_STRATA = _key(
    "probe",
    "strata",
    INTERVAL,
    "the same summaries within the groups with k correct rollouts / d distinct completions, for the rank, null, "
    "identity and zero-sum keys",
    source="§7",
    where=(PROBE,),
    shown=('strata.correct["k"][key]', 'strata.distinct["d"][key]'),
    fields=("correct", "distinct"),
)
PROBE_G3 = _key(
    "probe",
    "g3",
    OBJECT,
    "`rank/g3_<m>`, `rank/g3_null_<m>`, `rank/g3_<w>_<m>` and `groups` (one matrix: no interval)",
    source="§5",
    where=(PROBE,),
)
PROBE_G2_WEIGHTINGS = _key(
    "probe",
    "g2_weightings",
    OBJECT,
    "`groups` (rows of `rank/g2_<w>_<kind>_stable_rank`, one per group with G2 of every layer) and their `summary`",
    source="§6",
    where=(PROBE,),
    fields=("groups", "summary"),
)
PROBE_SPECTRA = _key(
    "probe",
    "spectra",
    OBJECT,
    "singular values per group: `G1`, `G1_no_adv`, `G1_null`, `G2` (first 64)",
    source="§5",
    where=(PROBE,),
    shown=("spectra[matrix]",),
    fields=("G1", "G1_no_adv", "G1_null", "G2"),
)
PROBE_BASELINES = _key(
    "probe",
    "baselines",
    OBJECT,
    "`variance[name]` trace variance of (1/R)Σ(r_i − b_i)g_i for baselines none / mean / rloo / optimal, by "
    "resampling groups of R from M rollouts; `relative_variance` = variance / optimal's; `prompts` used",
    source="§2",
    where=(PROBE,),
    fields=("variance", "relative_variance", "prompts"),
)
PROBE_CREDIT = _key(
    "probe",
    "credit",
    OBJECT,
    "`position_profile` (mean per-token gradient norm by completion position)",
    source="§10",
    where=(PROBE,),
    fields=("position_profile",),
)
PROBE_SKETCH_CHECK = _key(
    "probe",
    "sketch_check",
    OBJECT,
    "unless --dense-oracle: `groups` (rows of the keys below, one per checked group: the first `--coverage-groups` "
    "mixed groups of this R) and their `summary`",
    source="§8",
    where=(PROBE,),
    fields=("groups", "summary"),
)
# the exact Gram's coverage in the probe
PROBE_GRAM_COVERAGE = _key(
    "probe",
    "gram_coverage",
    SHARE,
    "with the exact Gram (`gram_source: exact`): the smallest share, over the analysed groups, of the trainable "
    "parameters whose per-rollout gradients the Gram covers (1: every parameter, so all of Σ‖g_i‖²); null in the "
    "sketch and dense modes",
    source="§Exact Gram",
    where=(PROBE,),
)
PROBE_TIMING = _key(
    "probe",
    "timing",
    SECONDS,
    "seconds for this R: `generation_seconds`, `gradient_seconds` (every analysed group, including "
    "`g2_weightings_seconds` and `sketch_check_seconds`), `seconds` (the whole R); `meta.seconds` and "
    "`meta.studies_seconds` give the probe's and its studies'. After `--resume` (`meta.resumed` true) the R's "
    "times include the prompts a killed probe measured, `meta.seconds` and `meta.studies_seconds` count from the "
    "resume",
    where=(PROBE,),
    fields=("generation_seconds", "gradient_seconds", "g2_weightings_seconds", "sketch_check_seconds", "seconds"),
)

# sketch check keys (per checked group)
SKETCH_COVERAGE = _key(
    "sketch_check",
    "sketch/coverage",
    SHARE,
    "Σ‖S g_i‖² / Σ‖g_i‖²: the share of the exact squared gradient norm that the sketch carries",
    source="§8",
    where=(SKETCH_CHECK,),
)
(SKETCH_EXACT_SHARE_LINEAR, SKETCH_EXACT_SHARE_EMBEDDING, SKETCH_EXACT_SHARE_NORM, SKETCH_EXACT_SHARE_OTHER) = _keys(
    "sketch_check",
    tuple(f"sketch/exact_share_{c}" for c in PARAMETER_CATEGORIES),
    SHARE,
    "each parameter category's share of the exact Σ‖g_i‖²; a tied embedding counts under embedding, both uses",
    source="§8",
    where=(SKETCH_CHECK,),
)
SKETCH_GRAM_ERROR = _key(
    "sketch_check",
    "sketch/gram_error",
    RELATIVE_ERROR,
    "‖Ĝ − G‖_F / ‖G‖_F for G1's Gram, sketched vs exact over every parameter",
    source="§8",
    where=(SKETCH_CHECK,),
)
SKETCH_GRAM_ERROR_BOUND = _key(
    "sketch_check",
    "sketch/gram_error_bound",
    RELATIVE_ERROR,
    "the projection-error bound for the sketched layers alone",
    source="§8",
    where=(SKETCH_CHECK,),
)
SKETCH_G1_ERANK_ERROR = _key(
    "sketch_check",
    "sketch/g1_erank_error",
    RANK_UNITS,
    "erank(G1) sketched minus exact",
    source="§8",
    where=(SKETCH_CHECK,),
)

# ---------------------------------------------------------------------------------------------------------------------
# probe.json studies (R = --study-group-size; grpo_lens.probe.studies)
# ---------------------------------------------------------------------------------------------------------------------
STUDY_BASELINES_META = _key(
    "studies",
    "baselines.meta",
    OBJECT,
    "group_size R, rollouts_per_prompt M = 4R, prompts_sampled, presampled_prompts (of those, the probe's shared "
    "draws it reused), prompts_with_contrast, the gradient source (LoGra "
    "sketch of every nn.Linear weight) and sketch_dim, aggregation, seconds",
    where=(STUDIES,),
    fields=(
        "group_size",
        "rollouts_per_prompt",
        "prompts_sampled",
        "presampled_prompts",
        "prompts_with_contrast",
        "gradients",
        "sketch_dim",
        "aggregation",
        "seconds",
    ),
)
STUDY_BASELINES_S1 = _key(
    "studies",
    "baselines.s1",
    OBJECT,
    "`measured` (first R rollouts of each prompt all equal), `predicted` (from the other M − R rollouts, unbiased), "
    "`difference`: each `{mean, lo, hi, n}` over every sampled prompt with valid rewards",
    source="§S1",
    where=(STUDIES,),
    concept="S1",
    fields=("measured", "predicted", "difference", "prompts", "rollouts_per_prompt"),
)
STUDY_BASELINES_PER_PROMPT = _key(
    "studies",
    "baselines.baselines.per_prompt",
    OBJECT,
    "one prompt with contrast: `estimators[name]` = `{bias2, variance, mse, cosine}` against the held-out reference "
    "for none / mean_rescaled / rloo / optimal_loo / optimal_pop; `ref_norm2`, `ref_noise` (the reference's own trace "
    "variance, in every mse), `b_star_pop`, `b_star_exact` (corrected for E[h] ≠ 0), `p`, `m_correct`, `m_wrong`, "
    "`mean_score` (`mean_norm`, `floor_norm`, `ratio`, `excess`, `mean_sq_norm`), `equal_norms` (`ratio` m_C/m_W, `p` "
    "its permutation p-value, bootstrap `lo`, `hi` (null with < 8 rollouts a side), `verdict`), `log_ratio` "
    "log(m_C/m_W) and `log_ratio_var` its delta-method variance (null with < 2 rollouts a side; the baseline claim's "
    "input)",
    source="§Baselines at matched expectation",
    where=(STUDIES,),
    shown=("baselines.baselines.per_prompt[j]",),
    fields=(
        "estimators",
        "ref_norm2",
        "ref_noise",
        "b_star_pop",
        "b_star_exact",
        "p",
        "m_correct",
        "m_wrong",
        "mean_score",
        "equal_norms",
        "log_ratio",
        "log_ratio_var",
    ),
    each=True,
)
STUDY_BASELINES_SUMMARY = _key(
    "studies",
    "baselines.baselines.summary",
    INTERVAL,
    "`mse_ratio_to_rloo`, `cosine`, `bias2_share`: `{mean, lo, hi, n}` over prompts",
    source="§Baselines at matched expectation",
    where=(STUDIES,),
    shown=("baselines.baselines.summary[name]",),
    fields=("mse_ratio_to_rloo", "cosine", "bias2_share"),
    each=True,
)
STUDY_BASELINES = _key(
    "studies",
    "baselines.baselines",
    OBJECT,
    "`prompts`, `prompts_constant` (pools without contrast, skipped), `b_star_shift`, `b_star_minus_p`, `norm_ratio` "
    "(m_C/m_W), `mean_score_ratio`: `{mean, lo, hi, n}` over prompts; `equal_norms_rejected` (share of testable "
    "prompts whose permutation test rejects m_C = m_W at 0.05), `equal_norms_testable`; `log_ratio_rms` (`msq` mean "
    "over prompts of log(m_C/m_W)² less its noise with `lo`, `hi`, `n`; `rms`, `rms_lo`, `rms_hi` their roots)",
    source="§Baselines at matched expectation",
    where=(STUDIES,),
    shown=("baselines.baselines.*",),
    fields=(
        "per_prompt",
        "summary",
        "prompts",
        "prompts_constant",
        "b_star_shift",
        "b_star_minus_p",
        "norm_ratio",
        "mean_score_ratio",
        "equal_norms_rejected",
        "equal_norms_testable",
        "log_ratio_rms",
    ),
)
STUDY_CREDIT_CONTRIBUTIONS = _key(
    "studies",
    "credit.contributions",
    OBJECT,
    "`position_profile` (per relative-position bin, `{mean, lo, hi, n}` over groups of the summed signed share s of "
    "the group update), `classes[answer|format|reasoning]` (`update_share`, `token_share`, `ratio`, each over "
    "groups), `classes_nll[class]` (`ratio`: the same tokens' ratio under NLL weights, every A_i = 1, the control "
    "with the same gradient geometry; `ratio_minus_nll`: the paired difference, over groups), `closure` (max over "
    "groups of abs(Σ s − 1): the finite-difference error), `groups`, `shares` and `shares_nll` (each group's "
    "`classes` entry under A and under NLL weights: what `probe --seeds` pools)",
    source="§Token credit",
    where=(STUDIES,),
    fields=("position_profile", "classes", "classes_nll", "closure", "groups", "shares", "shares_nll"),
)
STUDY_CREDIT_MONTE_CARLO = _key(
    "studies",
    "credit.monte_carlo",
    OBJECT,
    "`rollouts` (per rollout: reward, grpo_advantage, boundaries, values and errors of V(prefix), segment advantages "
    "and their errors, disagree / agree / neutral token shares, top_segment_share), the means over rollouts of "
    "`disagree`, `agree`, `neutral`, `top_segment_share` with intervals, `samples_per_prefix` K_mc",
    source="§Token credit",
    where=(STUDIES,),
    fields=("rollouts", "samples_per_prefix", "disagree", "agree", "neutral", "top_segment_share", "segments"),
)
STUDY_CREDIT_META = _key(
    "studies",
    "credit.meta",
    OBJECT,
    "group_size, groups_sampled, gradient source (exact update over every parameter), finite-difference step, seconds",
    where=(STUDIES,),
    fields=("group_size", "groups_sampled", "gradients", "step", "seconds"),
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
