"""The configuration machinery: a field written once (:class:`Option`), the config dataclass base (:class:`ConfigFile`)
with its YAML / dict / command-line round trips, and the names a config also answers to (:class:`Names`).

A config is a dataclass subclass of :class:`ConfigFile`. Each field comes from :func:`option` (a field only that config
has) or from an :class:`Option` of :mod:`grpo_lens.config.groups` (a field several configs share), and carries its help
(the CLI help and the README's reference), its default and its check. Building a config checks it
(``__post_init__``): first every field's type, then every field's own check, then the config's cross-field
:meth:`ConfigFile.check`; the first bad value raises :class:`ConfigError` naming the field, its flag and the rule.

Load order: defaults <- YAML file (``--config``) <- command-line flags (``--group-size 8``).

Names: a config's :class:`Names` maps a deprecated name to the current one (accepted, with one
:class:`ConfigNameWarning` line naming the new name), refuses a name that would mislead (a :class:`ConfigError`
naming what to use instead) and accepts another library's names for the same settings (:class:`Alias`, e.g. TRL's
``num_generations`` for ``group_size``, translated without a warning; :mod:`grpo_lens.config.trl_names`). They apply
wherever a name comes in: YAML keys, flags, :meth:`ConfigFile.from_dict` and a
run's saved config.yaml (``--resume``); a config written out uses only current names.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import yaml


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and how to fix it."""


class ConfigNameWarning(FutureWarning):
    """A config key or flag uses a deprecated name; the message names the current one (shown once per name)."""


def seeds_run_args(command: str, out: str | None, seeds: Iterable[int], pooled_file: str) -> tuple[Path, list[int]]:
    """The directory and the seeds of a ``--seeds`` run (``train`` or ``probe``), each seed once in the order given,
    after the checks both commands make before anything is written.

    Args:
        command: the command's name, as the error messages give it (``train``, ``probe``).
        out: the ``out`` field, the directory for seed_<s>/ and the pooled record.
        seeds: the seeds asked for (ints, duplicates allowed).
        pooled_file: the pooled record's file name in ``out``, for the message.
    Returns:
        Path(out) and the distinct seeds, at least two.
    Raises:
        ConfigError: ``out`` unset, or fewer than two distinct seeds.
    """
    if not out:
        raise ConfigError(
            f"{command} field 'out' (flag --out) is required: the directory for seed_<s>/ and the pooled {pooled_file}"
        )
    distinct = list(dict.fromkeys(int(s) for s in seeds))
    if len(distinct) < 2:
        raise ConfigError(f"--seeds needs at least two distinct seeds to pool, got {distinct}; for one seed use --seed")
    return Path(out), distinct


def refuse_started_seeds(out: Path, paths: Iterable[Path], resume: bool, overwrite: bool, resume_does: str) -> None:
    """A ``--seeds`` run's check that ``out`` holds no earlier run unless ``--resume`` or ``--overwrite`` is given.

    Args:
        out: the run's directory.
        paths: the pooled record and each seed's directory in ``out``; the first that exists is named.
        resume: ``--resume`` given.   overwrite: ``--overwrite`` given.
        resume_does: what ``--resume`` does for this command, for the message.
    Raises:
        ConfigError: one of ``paths`` exists and neither flag is given.
    """
    started = [p for p in paths if p.exists()]
    if started and not (resume or overwrite):
        raise ConfigError(
            f"{out} already holds {started[0]}; pass --resume to {resume_does}, --overwrite to start every seed over, "
            f"or choose another --out"
        )


#: A field's check: the value (never None: unset optional fields are not checked) -> why it is bad, or None if good.
Check = Callable[[Any], "str | None"]


def require(ok: Callable[[Any], bool], why: str) -> Check:
    """A check that accepts the values ``ok`` holds for and otherwise says ``why`` (e.g. ``"must be in (0, 1]"``)."""
    return lambda value: None if ok(value) else why


def at_least(low: float, why: str | None = None) -> Check:
    """``value >= low``; the message defaults to ``must be >= low``."""
    return require(lambda value: value >= low, why or f"must be >= {low}")


def at_most(high: float, why: str | None = None) -> Check:
    """``value <= high``; the message defaults to ``must be <= high``."""
    return require(lambda value: value <= high, why or f"must be <= {high}")


def all_of(*checks: Check) -> Check:
    """The first failing check's message, or None when every check passes."""
    return lambda value: next((why for why in (c(value) for c in checks) if why), None)


def above(low: float, why: str | None = None) -> Check:
    """``value > low``; the message defaults to ``must be > low``."""
    return require(lambda value: value > low, why or f"must be > {low}")


def one_of(names: Iterable[str] | Callable[[], Iterable[str]]) -> Check:
    """The value is one of ``names`` (a collection, or a registry's ``names`` method, read at check time so that
    plugins registered later count); the message lists the valid names, sorted."""

    def check(value: Any) -> str | None:
        valid = list(names() if callable(names) else names)
        return None if value in valid else f"unknown name; valid names: {', '.join(sorted(valid))}"

    return check


_SAME: Any = object()  # "not overridden" in Option.__call__
_PLACEHOLDER = re.compile(r"\{[a-z_]+\}")  # ``{contents}`` in a help text (not ``'{max_operand: 9}'``)


@dataclass(frozen=True)
class Option:
    """One configuration field, written once: default, help, check. Calling it gives the dataclass field of a config.

    Attributes:
        default: the value when neither YAML nor a flag sets it (lists and dicts are copied per instance).
        help: the CLI help and the README's text. ``{name}`` placeholders are filled per config by the keywords of
            :meth:`__call__` (only where the text must differ, e.g. what a command writes into --out).
        check: :data:`Check` of the value, or None.
        item_type: the argparse type of each item of a list field (``--group-sizes 2 4``).
        scalar_is_list: a lone value means a list of one (YAML ``rewards: correctness``).
    """

    default: Any
    help: str
    check: Check | None = None
    item_type: type | None = None
    scalar_is_list: bool = False

    def __call__(self, default: Any = _SAME, *, check: Any = _SAME, **fill: str) -> Any:
        """The field of one config; ``default`` / ``check`` override the shared ones (an explicit, visible override)."""
        if not fill and _PLACEHOLDER.search(self.help):
            raise TypeError(f"option help {self.help!r} has a placeholder: give its text as a keyword")
        spec = dataclasses.replace(
            self,
            default=self.default if default is _SAME else default,
            check=self.check if check is _SAME else check,
            help=self.help.format(**fill) if fill else self.help,
        )
        metadata = {
            "help": spec.help,
            "check": spec.check,
            "item_type": spec.item_type,
            "scalar_is_list": spec.scalar_is_list,
            "option": self,
        }
        if isinstance(spec.default, (list, dict)):
            return field(default_factory=lambda d=spec.default: type(d)(d), metadata=metadata)  # type: ignore[misc]  # a copy
        return field(default=spec.default, metadata=metadata)


def option(
    default: Any, help: str, *, check: Check | None = None, item_type: type | None = None, scalar_is_list: bool = False
) -> Any:
    """A field only one config has: its default, help (the CLI help) and check, written where the field is."""
    return Option(default, help, check, item_type, scalar_is_list)()


def field_values(config: Any, *names: str) -> dict[str, Any]:
    """{name: config.name} for each of ``names``: the settings one config hands on, under the same names, to another
    (the demo's to its stages, the probe's to its studies)."""
    return {name: getattr(config, name) for name in names}


@dataclass(frozen=True)
class Alias:
    """Another library's name for one or more settings.

    Attributes:
        library: whose name it is (``TRL``), for the messages.
        translate: ``(value, every name given) -> {field: value}``; raises :class:`ConfigError` when the value has no
            grpo-lens meaning (saying which option to use instead).
        flag_type: the argparse type of its hidden flag (``bool`` gives ``--name`` / ``--no-name``).
        fields: the fields it sets; their ``--help`` names it ("also: --num-generations (TRL)").
    """

    library: str
    translate: Callable[[Any, Mapping[str, Any]], dict[str, Any]]
    flag_type: type = str
    fields: tuple[str, ...] = ()


class Names:
    """The other names of a config's fields: ``renamed`` (deprecated name -> current name, accepted with a
    :class:`ConfigNameWarning`), ``refused`` (name -> what to use instead, a :class:`ConfigError`) and ``aliases``
    (another library's name -> its :class:`Alias`, translated silently).

    A config declares its own (``names: ClassVar[Names] = Names(renamed={"lens_sketch_dim": "sketch_dim"})``); code
    may add more later with :meth:`rename` and :meth:`refuse` (e.g. another library's names for the same settings).
    """

    def __init__(
        self,
        renamed: Mapping[str, str] | None = None,
        refused: Mapping[str, str] | None = None,
        notes: Mapping[str, str] | None = None,
        aliases: Mapping[str, Alias] | None = None,
    ):
        self.renamed: dict[str, str] = {}
        self.refused: dict[str, str] = {}
        self.notes: dict[str, str] = {}  # deprecated name -> a sentence its warning adds
        self.aliases: dict[str, Alias] = {}
        for old, new in (renamed or {}).items():
            self.rename(old, new, (notes or {}).get(old, ""))
        for name, use in (refused or {}).items():
            self.refuse(name, use)
        for name, alias in (aliases or {}).items():
            self.alias(name, alias)

    def alias(self, name: str, alias: Alias) -> None:
        """Accept ``name``, another library's name, translated by ``alias`` (no warning: it is not deprecated).

        Raises:
            ValueError: ``name`` is already registered.
        """
        if name in self.renamed or name in self.refused or name in self.aliases:
            raise ValueError(f"config name {name!r} is already registered")
        self.aliases[name] = alias

    def rename(self, old: str, new: str, note: str = "") -> None:
        """Accept ``old`` as a deprecated name of the field ``new`` (in YAML keys, flags and ``from_dict``).

        Raises:
            ValueError: ``old`` is already a renamed or refused name.
        """
        if old in self.renamed or old in self.refused or old == new:
            raise ValueError(f"config name {old!r} is already registered (or equals {new!r})")
        self.renamed[old] = new
        if note:
            self.notes[old] = note

    def refuse(self, name: str, use: str) -> None:
        """Refuse ``name`` with a ConfigError whose message is ``use`` (say what the name means elsewhere and which
        field or flag to use instead).

        Raises:
            ValueError: ``name`` is already a renamed or refused name.
        """
        if name in self.renamed or name in self.refused or name in self.aliases:
            raise ValueError(f"config name {name!r} is already registered")
        self.refused[name] = use

    def copy(self) -> Names:
        """An independent copy (a subclass's names start as its parent's)."""
        return Names(self.renamed, self.refused, self.notes, self.aliases)

    def canonical(self, values: Mapping[str, Any], *, where: str = "", warn: bool = True) -> dict[str, Any]:
        """``values`` with every deprecated name replaced by the current one (in place in the key order).

        Args:
            values: field name -> value, as read from YAML, flags or a dict.
            where: where the names come from (``"in c.yaml"``, ``"on the command line"``) for the messages.
            warn: emit the :class:`ConfigNameWarning` (False for readers of old runs, such as ``compare``).

        Raises:
            ConfigError: a refused name, a deprecated name together with its current one, another library's name
                together with the grpo-lens name it sets, or a value of it that has no grpo-lens meaning.
        """
        where = f" {where}" if where else ""
        out: dict[str, Any] = {}
        translated: dict[str, str] = {}  # field -> the other library's name that set it
        for key, value in values.items():
            if key in self.refused:
                raise ConfigError(f"{_name(key)}{where} is not accepted: {self.refused[key]}")
            if key in self.aliases:
                alias = self.aliases[key]
                for field_, v in alias.translate(value, values).items():
                    if field_ in values or field_ in translated:
                        also = f"{_name(translated[field_])} sets" if field_ in translated else "is given"
                        raise ConfigError(
                            f"{_name(key)}{where} is {alias.library}'s name for {_name(field_)}, "
                            f"which {also} too; give one of them"
                        )
                    translated[field_] = key
                    out[field_] = v
                continue
            new = self.renamed.get(key)
            if new is None:
                out[key] = value
                continue
            if new in values or new in out:
                raise ConfigError(
                    f"{_name(key)}{where} is the deprecated name of {_name(new)}, which is given too; give only {new!r}"
                )
            if warn:
                note = f" ({self.notes[key]})" if key in self.notes else ""
                warnings.warn(
                    f"{_name(key)}{where} is deprecated: use {_name(new)}{note}; the old name will stop "
                    f"working in a later release",
                    ConfigNameWarning,
                    stacklevel=2,
                )
            out[new] = value
        return out


def _name(key: str) -> str:
    """``'sketch_dim' (--sketch-dim)``: a field as a YAML key and as a flag."""
    return f"'{key}' (--{key.replace('_', '-')})"


class ConfigFile:
    """Base of the config dataclasses (TrainConfig, ProbeConfig, DemoConfig): checks, names, YAML and dict round trips.

    Class attributes:
        kind: the word error messages start with (``config field 'x'``, ``probe field 'x'``).
        names: the :class:`Names` of this config (each subclass gets its own copy of its parent's).
    """

    kind: ClassVar[str] = "config"
    names: ClassVar[Names] = Names()
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field]]  # every subclass is a dataclass (fields() takes it)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "names" not in cls.__dict__:
            cls.names = cls.names.copy()  # registering a name on one config never reaches another

    def __post_init__(self) -> None:
        self.validate()

    # -- checks ------------------------------------------------------------------------------------------------------
    def bad(self, name: str, why: str) -> NoReturn:
        """Raise the ConfigError of field ``name``: ``<kind> field 'name' (flag --name) = value: why``."""
        raise ConfigError(
            f"{self.kind} field '{name}' (flag --{name.replace('_', '-')}) = {getattr(self, name)!r}: {why}"
        )

    def validate(self) -> None:
        """Check every field: types (YAML can hold anything), then each field's own check, then :meth:`check`.

        Raises:
            ConfigError: naming the first bad field.
        """
        for f_ in fields(self):  # types first
            value = getattr(self, f_.name)
            if f_.metadata.get("scalar_is_list") and isinstance(value, str):  # `rewards: correctness`: a list of one
                value = [value]
                setattr(self, f_.name, value)
            want = _base_type(f_.type)
            if value is None and _is_optional(f_.type):
                continue
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                setattr(self, f_.name, float(value))
                continue
            if want is float and isinstance(value, str):  # YAML 1.1 reads '1e-3' (no dot) as a string
                try:
                    value = float(value)
                    setattr(self, f_.name, value)
                except ValueError:
                    pass
            if want is not None and not isinstance(value, want) or (want is int and isinstance(value, bool)):
                self.bad(f_.name, f"must be of type {want.__name__}")
            # a float: the isinstance check above
            if want is float and not math.isfinite(value):  # type: ignore[arg-type]
                self.bad(f_.name, "must be a finite number")
        for f_ in fields(self):  # each field's own rule
            check, value = f_.metadata.get("check"), getattr(self, f_.name)
            if check is not None and value is not None:
                why = check(value)
                if why:
                    self.bad(f_.name, why)
        self.check()

    def check(self) -> None:
        """Cross-field checks and derived fields of this config (the base has none).

        Raises:
            ConfigError: via :meth:`bad`.
        """

    # -- round trips -------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field under its current name (YAML-serialisable)."""
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def canonical(cls, values: Mapping[str, Any], where: str = "", warn: bool = True) -> dict[str, Any]:
        """``values`` under current field names (see :meth:`Names.canonical`).

        Raises:
            ConfigError: a refused name, or a deprecated name given together with its current one.
        """
        return cls.names.canonical(values, where=where, warn=warn)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "") -> Any:
        """Build from a mapping (deprecated names accepted with a warning).

        Raises:
            ConfigError: unknown keys (listing the valid ones), refused names, invalid values.
        """
        values = cls.canonical(values, where)
        known = {f_.name for f_ in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(known))}")
        return cls(**values)

    @classmethod
    def read(cls, path: str | Path) -> dict[str, Any]:
        """The mapping a YAML file holds, under current names (values not checked yet).

        Raises:
            ConfigError: missing or unreadable file, not a mapping, a refused name.
        """
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            values = safe_load_yaml(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {yaml_error_line(e)}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        if not isinstance(values, dict):
            raise ConfigError(f"config file {p} must hold a mapping of field: value, got {type(values).__name__}")
        return cls.canonical(values, f"in {p}")

    @classmethod
    def load(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> Any:
        """Read a YAML file and apply ``overrides`` on top.

        Raises:
            ConfigError: missing or unreadable file, not a mapping, unknown or refused keys, invalid values.
        """
        values = cls.read(path)
        values.update(cls.canonical(overrides or {}))
        return cls.from_dict(values)


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with the same key twice (plain YAML keeps the last one silently,
    so ``group_size: 4`` below ``group_size: 8`` would win unseen)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                continue  # SafeLoader's own error for an unhashable key follows
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r} (first on line {seen[key].line + 1}); keep one of them",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)

    # -- bounds: a settings file is small; an alias bomb or a 100,000-deep list is refused before it is built ------
    def get_single_node(self):
        try:
            node = super().get_single_node()
        except RecursionError:
            raise yaml.YAMLError(
                f"nested deeper than Python can read (a settings file needs at most {MAX_YAML_DEPTH} levels)"
            ) from None
        if node is not None:
            _check_yaml_size(node)
        return node


#: The most nodes a YAML document may expand to, aliases counted at every use (a settings file has a few hundred):
#: a 1 KB "billion laughs" of nested aliases expands to 10^9 and is refused before it is built.
MAX_YAML_NODES = 100_000

#: The deepest nesting a YAML document may have.
MAX_YAML_DEPTH = 64

#: The largest YAML text read (bytes): config.yaml, --config, demo.yaml.
MAX_YAML_BYTES = 1 << 20


def _check_yaml_size(root: yaml.Node) -> None:
    """Refuse a composed YAML document that expands to more than :data:`MAX_YAML_NODES` nodes or nests deeper than
    :data:`MAX_YAML_DEPTH` (aliases expanded: a node used by n aliases counts n times). Iterative and memoized by
    node, so a bomb costs its composed size (a few KB), not its expansion."""
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, depth)
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if key in sizes and not done:
            continue
        children = (
            [n for pair in node.value for n in pair]
            if isinstance(node, yaml.MappingNode)
            else list(node.value)
            if isinstance(node, yaml.SequenceNode)
            else []
        )
        if not done:
            if key in on_path:  # a recursive alias (&a [*a]): its expansion is infinite
                raise yaml.YAMLError("a recursive alias (an anchor used inside itself); write the value out")
            on_path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        on_path.discard(key)
        total = 1 + sum(sizes[id(c)][0] for c in children)
        depth = 1 + max((sizes[id(c)][1] for c in children), default=0)
        if total > MAX_YAML_NODES:
            raise yaml.YAMLError(
                f"expands to more than {MAX_YAML_NODES:,} values (aliases counted at each use: an alias bomb?); "
                f"a settings file is a few hundred"
            )
        if depth > MAX_YAML_DEPTH:
            raise yaml.YAMLError(f"nested {depth} levels deep, more than {MAX_YAML_DEPTH}")
        sizes[key] = (total, depth)


def _construct_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    """Decimal integers as YAML 1.2 reads them: ``010`` is ten (YAML 1.1 read it as octal 8: ``max_steps: 010``
    trained 8 steps); ``0x10`` hex and ``0b10`` binary as before, ``_`` separators allowed. ``0o10`` stays a string
    (yaml.safe_dump writes such a string unquoted, so reading it as a number would change a saved value), and so does
    YAML 1.1's sexagesimal ``1:30``."""
    text = loader.construct_scalar(node).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    body = text.lstrip("+-")
    for prefix, base in (("0x", 16), ("0b", 2)):
        if body.lower().startswith(prefix):
            return sign * int(body[2:], base)
    return sign * int(body, 10)


_INT_TAG = "tag:yaml.org,2002:int"
UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _INT_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
UniqueKeyLoader.add_implicit_resolver(
    _INT_TAG,
    re.compile(r"^(?:[-+]?0b[01_]+|[-+]?[0-9][0-9_]*|[-+]?0x[0-9a-fA-F_]+)$", re.X),
    list("-+0123456789"),
)
UniqueKeyLoader.add_constructor(_INT_TAG, _construct_int)


def safe_load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (:class:`UniqueKeyLoader`): for --config files, YAML-mapping
    flags (``--task-options``), a resumed run's config.yaml, a report's or compare's config.yaml and a demo's
    demo.yaml. Bounded: at most :data:`MAX_YAML_BYTES` of text, :data:`MAX_YAML_NODES` values with aliases expanded
    and :data:`MAX_YAML_DEPTH` levels, checked before anything is built; integers as YAML 1.2 reads them (``010`` is
    10, not octal 8).

    Raises:
        yaml.YAMLError: not valid YAML, a key twice in one mapping (naming the key and both lines), or over a bound.
    """
    if len(text) > MAX_YAML_BYTES:
        raise yaml.YAMLError(f"{len(text):,} characters, more than the {MAX_YAML_BYTES:,} a settings file may have")
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def yaml_error_line(err: Exception) -> str:
    """A YAML parse error on one line: what is wrong and where (``line 3, column 7``)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(err, "context", None)
    return f"{problem}{where}" + (f" ({context})" if context else "")


# ---------------------------------------------------------------------------------------------------------------------
# CLI generation from the dataclass: one source for help, types and defaults.
# ---------------------------------------------------------------------------------------------------------------------
def _is_optional(tp: Any) -> bool:
    tp = _resolve(tp)
    return (
        isinstance(tp, types.UnionType)
        and type(None) in typing.get_args(tp)
        or (typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp))
    )


def _resolve(tp: Any) -> Any:
    if isinstance(tp, str):
        return eval(tp, {**vars(typing), "dict": dict, "list": list}, {})  # annotations are postponed strings
    return tp


def _base_type(tp: Any) -> type | None:
    tp = _resolve(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)] if _is_optional(tp) else [tp]
    base = typing.get_origin(args[0]) or args[0]
    return base if isinstance(base, type) else None


def _default(f_: dataclasses.Field) -> Any:
    return f_.default if f_.default is not dataclasses.MISSING else f_.default_factory()  # type: ignore[operator]  # no default: a factory


def _add_flag(parser: argparse.ArgumentParser, flag: str, dest: str, f_: dataclasses.Field, help_: str) -> None:
    """One argparse flag for field ``f_``, stored in ``dest``, default None (= not given)."""
    base = _base_type(f_.type)
    if base is bool:
        parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_)
    elif base is list:
        parser.add_argument(
            flag, dest=dest, nargs="+", type=f_.metadata.get("item_type") or str, default=None, help=help_
        )
    elif base is dict:
        parser.add_argument(flag, dest=dest, type=_yaml_mapping, default=None, help=help_)
    else:
        parser.add_argument(flag, dest=dest, type=base, default=None, help=help_)  # type: ignore[arg-type]  # None: str


def other_library_flags(cls: type[ConfigFile]) -> dict[str, list[str]]:
    """{field: ["--num-generations (TRL)", ...]}: the other libraries' flags (:class:`Alias`) that set each field of
    config class ``cls``, for its ``--help`` and the README's CLI reference."""
    also: dict[str, list[str]] = {}
    for name, alias in cls.names.aliases.items():
        for target in alias.fields:
            also.setdefault(target, []).append(f"--{name.replace('_', '-')} ({alias.library})")
    return also


def add_config_arguments(parser: argparse.ArgumentParser, cls: type[ConfigFile], skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per dataclass field, help from the field's metadata, default None (= not given).

    The config's deprecated names get hidden flags of the same kind (``--lens-sketch-dim 8``), and its refused names
    hidden flags that take any values; :func:`config_from_args` turns both into the current name or the refusal.
    """
    by_name = {f_.name: f_ for f_ in fields(cls)}
    also = other_library_flags(cls)
    for f_ in fields(cls):
        if f_.name in skip:
            continue
        others = f"; also: {', '.join(also[f_.name])}" if f_.name in also else ""
        _add_flag(
            parser,
            "--" + f_.name.replace("_", "-"),
            f_.name,
            f_,
            f"{f_.metadata.get('help', '')} (default: {_default(f_)}{others})",
        )
    for old, new in cls.names.renamed.items():
        if new in by_name and new not in skip:
            _add_flag(parser, "--" + old.replace("_", "-"), old, by_name[new], argparse.SUPPRESS)
    for name in cls.names.refused:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, nargs="*", default=None, help=argparse.SUPPRESS)
    for name, alias in cls.names.aliases.items():
        flag = "--" + name.replace("_", "-")
        if alias.flag_type is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=argparse.SUPPRESS
            )
        else:
            parser.add_argument(flag, dest=name, type=alias.flag_type, default=None, help=argparse.SUPPRESS)


def _yaml_mapping(text: str) -> dict:
    """argparse type of dict fields: a YAML mapping; anything else is an argparse error (exit 2, one line)."""
    try:
        value = safe_load_yaml(text)
    except yaml.YAMLError as e:
        raise argparse.ArgumentTypeError(
            f"not valid YAML ({yaml_error_line(e)}): {text!r}; expected a mapping like '{{max_operand: 9}}'"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a YAML mapping like '{{max_operand: 9}}', got {text!r}")
    return value


def flags_given(args: argparse.Namespace, cls: type[ConfigFile]) -> dict[str, Any]:
    """The fields set by flags on the command line, under current names (deprecated flags warn, refused ones raise).

    Raises:
        ConfigError: a refused flag, or a deprecated flag together with its current one.
    """
    names = (
        [f_.name for f_ in fields(cls)] + list(cls.names.renamed) + list(cls.names.refused) + list(cls.names.aliases)
    )
    return cls.canonical(
        {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}, "on the command line"
    )


def config_from_args(args: argparse.Namespace, cls: type[ConfigFile], config_file: str | None = None) -> Any:
    """Defaults <- YAML file <- flags given on the command line."""
    overrides = flags_given(args, cls)
    if config_file:
        return cls.load(config_file, overrides)
    return cls.from_dict(overrides)


def reference_markdown(cls: type[ConfigFile]) -> str:
    """A Markdown table of every field of ``cls``: flag, default, help (the README's CLI reference is this)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    also = other_library_flags(cls)
    for f_ in fields(cls):
        help_ = f_.metadata.get("help", "").replace("|", "\\|")
        if f_.name in also:
            help_ += " Also: " + ", ".join(f"`{flag.split(' ')[0]}` {flag.split(' ')[1]}" for flag in also[f_.name])
        rows.append(f"| `--{f_.name.replace('_', '-')}` | `{_default(f_)}` | {help_} |")
    return "\n".join(rows)
