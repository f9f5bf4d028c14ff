"""Units, scopes, placeholders, the :class:`Metric` entry and the registry the key modules fill."""

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
        keys: list[dict[str, str]] = [{}]
        for n in names:
            keys = [{**k, n: v} for k in keys for v in self.values_of(n) or ()]
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


@dataclass(frozen=True)
class Section:
    """Declares rows of one docs/metrics.md table (:data:`SECTIONS`) that share a source and scopes.

    A row may name its own ``source`` or ``where``; every other keyword goes to :class:`Metric`.
    """

    name: str
    source: str = ""
    where: tuple[str, ...] = (JSONL,)

    def key(self, key: str, unit: str, meaning: str, *, concept: str = "", **extra) -> str:
        """A plain key on its own row; returns the key."""
        return self._add((key,), unit, meaning, concepts=concept, **extra)[0].key

    def keys(self, keys: tuple[str, ...], units: str | tuple[str, ...], meaning: str, **extra) -> tuple[str, ...]:
        """Plain keys sharing one row (one meaning); returns the keys."""
        return tuple(m.key for m in self._add(keys, units, meaning, **extra))

    def template(self, key: str, unit: str, meaning: str, **extra) -> Metric:
        """A template on its own row; returns its entry."""
        return self._add((key,), unit, meaning, **extra)[0]

    def _add(
        self,
        keys: tuple[str, ...],
        units: str | tuple[str, ...],
        meaning: str,
        *,
        source: str | None = None,
        where: tuple[str, ...] | None = None,
        concepts: str | tuple[str, ...] = "",
        **extra,
    ) -> list[Metric]:
        """Register one docs/metrics.md row: one entry per key, sharing ``meaning`` and ``source``."""
        units = units if isinstance(units, tuple) else (units,) * len(keys)
        concepts = concepts if isinstance(concepts, tuple) else (concepts,) * len(keys)
        assert self.name in SECTIONS and len(units) == len(keys) == len(concepts), (self.name, keys)
        source = self.source if source is None else source
        where = self.where if where is None else where
        row = len({m.row for m in _ENTRIES}) + 1
        out = [
            Metric(key, meaning, unit, source, where, self.name, concept=concept, row=row, **extra)
            for key, unit, concept in zip(keys, units, concepts)
        ]
        _ENTRIES.extend(out)
        return out


def family(template: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The keys that differ only by a name: ``template`` with ``{}`` replaced by each of ``names``, in order
    (``family("dead/all_{}_groups", ("correct", "wrong"))``)."""
    return tuple(template.format(name) for name in names)


def with_interval(key: str) -> tuple[str, ...]:
    """``key`` and the keys of its 95% interval's ends: ``key``, ``key_lo``, ``key_hi``."""
    return family(f"{key}{{}}", ("", "_lo", "_hi"))


LENS = (JSONL, GROUPS)  # the per-group analysis path: lens means in metrics.jsonl, probe rows and summaries
