"""Reward functions and how they combine into one reward per rollout.

A reward function is called as TRL's GRPOTrainer calls it (:func:`call_reward_function`), so one written for TRL runs
unchanged: by keyword, ``f(prompts=..., completions=..., completion_ids=..., <every dataset column>=...,
trainer_state=..., log_extra=..., log_metric=...) -> list[float | None]``; it should take ``**kwargs``. ``prompts``,
``completions``, ``completion_ids`` and each column hold one entry per rollout (N of them; a prompt is repeated for
each of its R rollouts). Completions are strings for a string prompt (TRL's standard format) and
``[{"role": "assistant", "content": text}]`` for a prompt of chat messages (TRL's conversational format; the
built-in tasks give chat prompts). ``trainer_state`` has ``global_step`` and ``max_steps``; ``log_metric(name,
value)`` logs ``reward/logged/<name>``. A function without ``**kwargs`` gets only the arguments it names, and one
whose first two parameters are not called ``prompts`` and ``completions`` gets those two by position (the form
``f(p, c, **columns)``). ``None`` (or NaN) marks a rollout the function does not apply to (TRL's "not applicable",
its multi-task convention): that function is skipped for that rollout and the other functions' weighted rewards still
sum; a rollout that every function returns None for is invalid and is left out of its group's advantage mean and std
(docs/rewards.md). Each function gets its own copies of the prompts, completions and columns, so one that changes
them changes nothing the next one sees. Dataset columns named like the reserved keywords (:data:`RESERVED_COLUMNS`)
are refused when the task is built.

Built in (:data:`REWARDS`): ``correctness`` (the final number equals the reference), ``format`` (a final answer is
marked with ``####`` or ``\\boxed{}``), and ``math_verify`` when the ``math-verify`` package is installed.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import numbers
import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from grpo_lens.metrics import (
    PERF_REWARD_SECONDS,
    REWARD_ERROR_COUNT,
    REWARD_FUNCTION,
    REWARD_FUNCTION_INVALID_COUNT,
    REWARD_INVALID_COUNT,
    REWARD_LOGGED,
    REWARD_MEAN,
    REWARD_STD,
    REWARD_TIMEOUT_COUNT,
)
from grpo_lens.registry import Registry

if TYPE_CHECKING:
    from grpo_lens.rollout import RolloutBatch

logger = logging.getLogger(__name__)

RewardFn = Callable[..., list]

#: name -> reward function ``f(prompts, completions, **kwargs) -> list[float | None]``.
REWARDS: Registry = Registry("reward function")

#: The keyword arguments every reward function call carries besides the dataset columns (TRL's names): a dataset
#: column of one of these names would collide with them, so tasks refuse it (:func:`check_column_names`).
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def check_column_names(columns: Sequence[str], where: str) -> None:
    """Refuse dataset columns named like a reserved reward keyword (:data:`RESERVED_COLUMNS`), before anything runs.

    Raises:
        ValueError: naming the columns, ``where`` they are, and the fix (rename them).
    """
    clash = [c for c in columns if c in RESERVED_COLUMNS]
    if clash:
        raise ValueError(f"{where}: column(s) {', '.join(map(repr, clash))} collide with the keyword arguments every "
                         f"reward function receives ({', '.join(RESERVED_COLUMNS)}); rename them (e.g. "
                         f"{clash[0]!r} -> {clash[0] + '_ref'!r}) in the data and in your reward function")


@dataclass
class RewardState:
    """What ``trainer_state`` holds for a reward function (the fields of TRL's ``TrainerState`` that apply):
    ``global_step`` (the step being scored, 1-based; 0 outside training) and ``max_steps``."""

    global_step: int = 0
    max_steps: int = 0


def chat_completions(prompts: Sequence, completions: Sequence[str]) -> list:
    """Completions in TRL's format for their prompts: ``[{"role": "assistant", "content": text}]`` where the prompt
    is a list of chat messages (conversational), the text itself where it is a string (standard).

    Args:
        prompts: N prompts.   completions: N completion texts.
    """
    return [[{"role": "assistant", "content": c}] if isinstance(p, (list, tuple)) else c
            for p, c in zip(prompts, completions)]


def _parameters(fn: Callable) -> tuple[list[str], bool]:
    """(names of ``fn``'s parameters, whether it takes ``**kwargs``); ([], True) when the signature is unreadable."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return [], True
    return ([p.name for p in params if p.kind is not p.VAR_KEYWORD],
            any(p.kind is p.VAR_KEYWORD for p in params))


def call_reward_function(fn: Callable, prompts: Sequence, completions: Sequence, *,
                         completion_ids: Sequence | None = None, columns: Mapping[str, Sequence] | None = None,
                         trainer_state: Any = None, log_extra: Callable | None = None,
                         log_metric: Callable | None = None) -> Any:
    """Call one reward function as TRL's GRPOTrainer does, by keyword (see the module docstring).

    ``fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
    trainer_state=trainer_state, log_extra=log_extra, log_metric=log_metric)``; a function without ``**kwargs`` gets
    only the names it declares, and one whose first two positional parameters are not named ``prompts`` and
    ``completions`` gets those two by position.

    Args:
        prompts: N prompts.   completions: N completions (strings or message lists, :func:`chat_completions`).
        completion_ids: N lists of token ids.   columns: dataset columns, each N values.
        trainer_state: e.g. :class:`RewardState`.   log_extra, log_metric: TRL's logging callbacks (None: no-ops).
    Raises:
        ValueError: a column named like a reserved keyword (:data:`RESERVED_COLUMNS`).
    """
    columns = copy.deepcopy(dict(columns or {}))  # a function that edits its arguments changes nothing outside
    check_column_names(list(columns), "reward function call")
    keywords = {"prompts": copy.deepcopy(list(prompts)), "completions": copy.deepcopy(list(completions)),
                "completion_ids": None if completion_ids is None else copy.deepcopy(list(completion_ids)), **columns,
                "trainer_state": trainer_state, "log_extra": log_extra or (lambda column, values: None),
                "log_metric": log_metric or (lambda name, value: None)}
    names, var_kw = _parameters(fn)
    args: tuple = ()
    if len(names) >= 2 and names[:2] != ["prompts", "completions"] and "completions" not in names:
        args = (keywords.pop("prompts"), keywords.pop("completions"))  # the positional form f(p, c, **columns)
        names = names[2:]
    if not var_kw:
        keywords = {k: v for k, v in keywords.items() if k in names}
    return fn(*args, **keywords)

# A number: an optional minus sign (not one joining two numbers as in "3-5"), digits, optional decimals; or ".5".
_NUMBER = re.compile(r"(?:(?<![\w)\]}.])-)?(?:\d+(?:\.\d+)?|\.\d+)")
# A value in running text: a LaTeX fraction (\frac, \dfrac, \tfrac with braced parts), optionally signed, or a number.
_VALUE = re.compile(r"(?:(?<![\w)\]}.])-\s*)?\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}|" + _NUMBER.pattern)
# Thousands separators only in a well-formed group: 1-3 digits, then one or more ",ddd", not touching another digit
# or comma-digit on either side, nor a decimal point before it. "1,234,567" -> 1234567; "1,23,456", "1,2345", "3,4"
# and "1.5,250" (a decimal, then another number) stay separate numbers.
_THOUSANDS_GROUP = re.compile(r"(?<![\d,.])\d{1,3}(?:,\d{3})+(?![\d]|,\d)")
_FRACTION = re.compile(r"^\\[dt]?frac\s*\{(.*)\}\s*\{(.*)\}$")
_FRACTION_SHORT = re.compile(r"^\\[dt]?frac\s*(\d)\s*(\d)$")  # \frac12
_SCIENTIFIC = re.compile(r"(?:\d+(?:\.\d+)?|\.\d+)[eE][+-]?\d{1,4}")  # 1e3, 2.5E-2: a whole value only
_SLASH_FRACTION = re.compile(r"^(-?\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)$")
_MINUS_SIGNS = ("\u2212", "\u2013", "\ufe63", "\uff0d")  # minus sign, en dash, small and fullwidth hyphen-minus


def normalize_number_text(text: str) -> str:
    """Drop what is not part of a number's value: ``$``, thousands commas in well-formed groups (``1,234`` ->
    ``1234``, never merging separate numbers such as ``1,23,456`` or ``3,4``), and Unicode minus signs (-> ``-``)."""
    for minus in _MINUS_SIGNS:
        text = text.replace(minus, "-")
    text = text.replace("\\$", "").replace("$", "")
    return _THOUSANDS_GROUP.sub(lambda m: m.group(0).replace(",", ""), text)


def _enclosing(text: str, open_: str, close: str) -> bool:
    """True when ``text`` is ``open_ ... close`` with the first opener matched by the last closer."""
    if not (text.startswith(open_) and text.endswith(close)) or len(text) < len(open_) + len(close):
        return False
    depth = 0
    inner = text[len(open_):len(text) - len(close)]
    for ch in inner:
        depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def _strip_wrappers(text: str) -> str:
    """Remove spacing commands and wrappers around a whole value: ``\\left( ... \\right)``, ``( ... )``, ``{ ... }``."""
    text = re.sub(r"\\[,!;: ]|~", "", text).strip()
    while True:
        for open_, close in (("\\left(", "\\right)"), ("(", ")"), ("{", "}")):
            if _enclosing(text, open_, close):
                text = text[len(open_):len(text) - len(close)].strip()
                break
        else:
            return text


def parse_number(text: str) -> Fraction | None:
    """The exact value of a number string, or None.

    Reads ``"18.0"``, ``"-3"``, ``"1,234"``, ``"1/2"``, ``"\\frac{1}{2}"`` (also ``\\dfrac``, ``\\tfrac``,
    ``\\frac12``),
    with a sign before any of them, before parentheses or ``\\left( ... \\right)``, written with the Unicode minus:
    ``"-\\frac{1}{2}"``, ``"-\\dfrac{3}{4}"``, ``"-(5)"``, ``"\\left(-\\frac{1}{2}\\right)"``, ``"\u22123"``.
    Exact (Fraction) so that ``18.0 == 18`` and float error never decides a reward.
    """
    text = _strip_wrappers(normalize_number_text(text).strip().rstrip("."))
    sign = re.match(r"^([+-])\s*(.+)$", text)
    if sign:
        value = parse_number(sign.group(2))
        return None if value is None else (-value if sign.group(1) == "-" else value)
    for pattern in (_FRACTION, _FRACTION_SHORT):
        m = pattern.match(text)
        if m and (pattern is _FRACTION_SHORT or _enclosing("{" + m.group(1) + "}", "{", "}")):
            numerator, denominator = parse_number(m.group(1)), parse_number(m.group(2))
            if numerator is None or denominator is None or denominator == 0:
                return None
            return numerator / denominator
    m = _SLASH_FRACTION.match(text)
    if m:
        numerator, denominator = Fraction(m.group(1)), Fraction(m.group(2))
        return None if denominator == 0 else numerator / denominator
    if _NUMBER.fullmatch(text) or _SCIENTIFIC.fullmatch(text):
        return Fraction(text)
    return None


def _values(text: str) -> list[Fraction]:
    """Every value in running text, in order: signed LaTeX fractions and numbers (after normalisation)."""
    out = []
    for m in _VALUE.finditer(normalize_number_text(text)):
        value = parse_number(m.group(0))
        if value is not None:
            out.append(value)
    return out


def _boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                out.append(text[start:i])
                break
    return out


def _first_number(text: str) -> Fraction | None:
    values = _values(text)
    return values[0] if values else None


def extract_marked_answer(text: str) -> Fraction | None:
    """The answer a completion marks as final, or None: the value of the first ``####`` line that has one (the whole
    line read as one value, e.g. ``#### -\\frac{1}{2}``, else its first number), else the value of the last
    ``\\boxed{}`` (a number, fraction or signed expression :func:`parse_number` reads; else the last value inside)."""
    for m in re.finditer(r"####([^\n]*)", text):
        value = parse_number(m.group(1))
        if value is None:
            value = _first_number(m.group(1))
        if value is not None:
            return value
    boxed = _boxed_contents(text)
    if boxed:
        content = boxed[-1]
        value = parse_number(content)
        if value is None:
            values = _values(content)
            value = values[-1] if values else None
        return value
    return None


def extract_answer(text: str) -> Fraction | None:
    """The final numeric answer of a completion, or None when it has no number.

    In order: the value after ``####`` (GSM8K's format), else the value in the last ``\\boxed{}``, else the last
    value in the text (a signed LaTeX fraction or a number). ``$`` and thousands commas are ignored, so
    ``"#### $1,000"`` gives 1000, and ``\\boxed{-\\frac{1}{2}}`` gives -1/2.

    >>> extract_answer("The answer is 18.0.") == 18
    True
    """
    if not isinstance(text, str):
        raise TypeError(f"a completion must be a string or a list of chat messages, got {type(text).__name__}")
    value = extract_marked_answer(text)
    if value is not None:
        return value
    values = _values(text)
    return values[-1] if values else None


def is_scalar_reference(reference: Any) -> bool:
    """Whether a reference answer is a string or a real number (not a bool, list or mapping)."""
    return isinstance(reference, (str, int, float, Fraction)) and not isinstance(reference, bool)


def reference_value(reference: Any) -> Fraction | None:
    """The value of a reference answer: a bare number (``"72"``, ``"1,234"``, ``"1/2"``) or a text whose final answer
    :func:`extract_answer` finds (e.g. a whole GSM8K solution ending in ``#### 72``); None if it has no number, and
    None for a reference that is not a string or a number (a list ``[2]`` or a mapping: never read from its repr)."""
    if not is_scalar_reference(reference):
        return None
    text = str(reference)
    value = parse_number(text)
    return value if value is not None else extract_answer(text)


def completion_text(completion: Any) -> str:
    """The text of a completion given as a string or, as TRL does for chat data, a list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        return "".join(m.get("content", "") for m in completion if m.get("role", "assistant") == "assistant")
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")


def _references(answer: Sequence | None, n: int, fn_name: str) -> Sequence:
    if answer is None:
        raise ValueError(f"reward {fn_name!r} needs the reference answers: pass the task column 'answer' (a list "
                         "with one entry per completion)")
    if len(answer) != n:
        raise ValueError(f"reward {fn_name!r}: got {len(answer)} answers for {n} completions; pass one per completion")
    return answer


@REWARDS.register("correctness")
def correctness(prompts: Sequence, completions: Sequence, answer: Sequence | None = None, **kwargs) -> list:
    """1.0 when the completion's final number (:func:`extract_answer`) equals the reference, else 0.0.

    A completion with no number scores 0.0 (a valid, wrong answer). A reference that is not a number gives None
    (the rollout cannot be scored). The reference may be a bare number or a full GSM8K solution ending in ``####``.

    Args:
        prompts: N prompts (unused).
        completions: N completions (strings or chat messages).
        answer: N reference answers.
    """
    refs = _references(answer, len(completions), "correctness")
    out: list[float | None] = []
    for completion, ref in zip(completions, refs):
        ref_value = reference_value(ref)
        if ref_value is None:
            logger.warning("correctness: reference %r is not a number; rollout marked invalid", ref)
            out.append(None)
            continue
        predicted = extract_answer(completion_text(completion))
        out.append(1.0 if predicted is not None and predicted == ref_value else 0.0)
    return out


@REWARDS.register("format")
def format_reward(prompts: Sequence, completions: Sequence, **kwargs) -> list:
    """1.0 when the completion marks a numeric final answer with ``#### <number>`` or ``\\boxed{<number>}``,
    else 0.0."""
    return [0.0 if extract_marked_answer(completion_text(c)) is None else 1.0 for c in completions]


class _TimeoutNoticeFilter(logging.Filter):
    """Drops math-verify's one-time "Timeout is disabled ..." warning: grpo-lens passes no timeout on purpose
    (math-verify's signal-based timeout works only on the main thread; :func:`combine_rewards` bounds a reward call
    with ``timeout_s`` instead), so the notice is about a choice already made. Other math-verify records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


def _quiet_math_verify_timeout_notice() -> None:
    """Install :class:`_TimeoutNoticeFilter` on math-verify's parser and grader loggers (once)."""
    for name in ("math_verify.parser", "math_verify.grader"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _TimeoutNoticeFilter) for f in log.filters):
            log.addFilter(_TimeoutNoticeFilter())


def math_verify_available() -> bool:
    """Whether the optional ``math-verify`` package is importable."""
    return importlib.util.find_spec("math_verify") is not None


def math_verify_correctness(prompts: Sequence, completions: Sequence, answer: Sequence | None = None,
                            **kwargs) -> list:
    """1.0 when ``math_verify.verify`` finds the completion's answer equal to the reference (symbolic, LaTeX aware),
    else 0.0; None where the reference does not parse. Needs ``pip install math-verify``.

    Timeouts inside math-verify use signals, which only work in the main thread; they are switched off here, so
    bound the call with ``combine_rewards(..., timeout_s=...)`` instead.
    """
    from math_verify import parse, verify

    _quiet_math_verify_timeout_notice()
    refs = _references(answer, len(completions), "math_verify")
    out: list[float | None] = []
    for completion, ref in zip(completions, refs):
        gold = parse(str(ref), parsing_timeout=None)
        if not gold:
            out.append(None)
            continue
        predicted = parse(completion_text(completion), parsing_timeout=None)
        out.append(1.0 if predicted and verify(gold, predicted, timeout_seconds=None) else 0.0)
    return out


if math_verify_available():
    REWARDS.register("math_verify")(math_verify_correctness)


def marked_answer_text(text: str) -> str:
    """The part of a completion that states its final answer: the first ``####`` line that holds a value, else the
    last ``\\boxed{...}`` (kept boxed), else the whole text. Lets a verifier read the marked answer rather than
    whatever number comes last (``#### 72\\nDone in 3 steps.`` -> ``72``)."""
    for m in re.finditer(r"####([^\n]*)", text):
        line = m.group(1).strip()
        if parse_number(line) is not None or _first_number(line) is not None:
            return f"${line}$" if "\\" in line else line  # LaTeX in math delimiters, as verifiers expect it
    boxed = _boxed_contents(text)
    if boxed:
        return "\\boxed{" + boxed[-1] + "}"
    return text


def math_correctness_verdict(completions: Sequence, answers: Sequence,
                             use_math_verify: bool = False) -> list[float | None]:
    """The 0/1 correctness verdict of math answers: 1.0 when the completion's marked final answer
    (:func:`marked_answer_text`) equals the reference, else 0.0; None where there is no reference or it does not parse.

    With ``use_math_verify`` (needs the ``math`` extra) equality is ``math_verify.verify`` on the marked answer
    (symbolic, LaTeX aware); otherwise it is :func:`extract_answer` against :func:`reference_value`, exactly (the
    ``correctness`` reward's check). Independent of any reward function or weight: ``reward/accuracy`` is its mean.

    Args:
        completions: N completion texts (or chat messages).   answers: N reference answers (or None).
        use_math_verify: compare with math-verify.
    Raises:
        ValueError: lengths differ, or use_math_verify without math-verify installed.
    Returns:
        N values in {0.0, 1.0, None}.
    """
    if len(answers) != len(completions):
        raise ValueError(f"got {len(answers)} answers for {len(completions)} completions; pass one per completion")
    if use_math_verify:
        if not math_verify_available():
            raise ValueError("use_math_verify needs the math-verify package: pip install '.[math]'")
        from math_verify import parse, verify
        _quiet_math_verify_timeout_notice()
    out: list[float | None] = []
    for completion, ref in zip(completions, answers):
        if ref is None or not is_scalar_reference(ref):
            out.append(None)
            continue
        text = completion_text(completion)
        if use_math_verify:
            gold = parse(str(ref), parsing_timeout=None)
            if not gold:
                out.append(None)
                continue
            predicted = parse(marked_answer_text(text), parsing_timeout=None)
            out.append(1.0 if predicted and verify(gold, predicted, timeout_seconds=None) else 0.0)
        else:
            ref_value = reference_value(ref)
            if ref_value is None:
                out.append(None)
                continue
            predicted = extract_answer(text)
            out.append(1.0 if predicted is not None and predicted == ref_value else 0.0)
    return out


def get_reward(name: str) -> RewardFn:
    """The reward function called ``name``; ValueError listing the valid names (and how to get ``math_verify``)."""
    if name == "math_verify" and name not in REWARDS:
        raise ValueError("reward 'math_verify' needs the math-verify package: pip install '.[math]' in the grpo-lens "
                         f"folder (or pip install math-verify); valid names now: {', '.join(REWARDS.names())}")
    return REWARDS.get(name)


def _normalize_funcs(funcs_with_weights: Any) -> list[tuple[str, RewardFn, float]]:
    """(name, function, weight) triples from: a mapping name/function -> weight, a sequence of (name or function,
    weight) pairs, or a sequence of names/functions (weight 1)."""
    if callable(funcs_with_weights) or isinstance(funcs_with_weights, str):
        funcs_with_weights = [funcs_with_weights]
    items = funcs_with_weights.items() if isinstance(funcs_with_weights, Mapping) else funcs_with_weights
    out: list[tuple[str, RewardFn, float]] = []
    for item in items:
        fn, weight = item if isinstance(item, tuple) else (item, 1.0)
        if isinstance(fn, str):
            name, fn = fn, get_reward(fn)
        elif callable(fn):
            name = getattr(fn, "__name__", type(fn).__name__)
        else:
            raise TypeError(f"a reward must be a registered name or a callable, got {fn!r}")
        out.append((name, fn, float(weight)))
    if not out:
        raise ValueError(f"no reward functions given; valid names: {', '.join(REWARDS.names())}")
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"reward function names must be distinct (they key the metrics), got {names}")
    return out


def parse_reward_specs(specs: str | Sequence[str]) -> list[tuple[str, float]]:
    """``["correctness", "format:0.1"]`` -> ``[("correctness", 1.0), ("format", 0.1)]``: the CLI/YAML form
    (``NAME`` or ``NAME:WEIGHT``) as :func:`combine_rewards` takes it. Names are checked against :data:`REWARDS`.

    Raises:
        ValueError: an unknown name (listing the valid ones) or a weight that is not a number.
    """
    if isinstance(specs, str):
        specs = [specs]
    out = []
    for spec in specs:
        name, _, weight = str(spec).partition(":")
        name = name.strip()
        get_reward(name)
        try:
            out.append((name, float(weight) if weight.strip() else 1.0))
        except ValueError:
            raise ValueError(f"reward spec {spec!r}: the weight after ':' must be a number, "
                             f"e.g. 'format:0.1'") from None
        if not math.isfinite(out[-1][1]):
            raise ValueError(f"reward spec {spec!r}: the weight after ':' must be a finite number, e.g. "
                             f"'{name}:0.1'")
    if not out:
        raise ValueError(f"no reward functions given; valid names: {', '.join(REWARDS.names())}")
    return out


class RewardTimeout(TimeoutError):
    """A reward function call ran past its time limit."""


def _call_with_timeout(fn: Callable, timeout_s: float | None, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)``, in a daemon worker thread when ``timeout_s`` is set.

    A call that runs past ``timeout_s`` raises :class:`RewardTimeout`; its thread cannot be killed and is left to
    finish in the background (daemon, so it never blocks interpreter exit).
    """
    if timeout_s is None:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = err

    worker = threading.Thread(target=target, name=f"reward-{getattr(fn, '__name__', 'fn')}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeout(f"did not return within {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class RewardFunctionError(ValueError):
    """A reward function did what no reward function may: called ``sys.exit`` (raised SystemExit)."""


def _exit_error(name: str, err: SystemExit) -> RewardFunctionError:
    return RewardFunctionError(f"reward {name!r} called sys.exit({err.code!r}) (raised SystemExit): a reward function "
                               f"returns one value (or None) per completion and never ends the run; return None for a "
                               f"completion it cannot score, or raise an exception")


def _describe(value: Any) -> str:
    """A short description of what a reward function returned, for messages."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def reward_values(values: Any, n: int) -> list[Any]:
    """A reward function's return as a list of ``n`` entries, each None or a real number (TRL's ``list[float |
    None]``; a tuple, NumPy array or 1-d tensor is read as its entries).

    Raises:
        TypeError: a scalar, generator, string, mapping, None, or an entry that is neither None nor a real number
            (a string like ``"abc"`` or ``"1.0"``), saying what it was.
        ValueError: a list of another length than ``n``.
    """
    if isinstance(values, Tensor):
        values = values.tolist() if values.dim() == 1 else values
    elif type(values).__module__ == "numpy" and getattr(values, "ndim", None) == 1:
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"returned {_describe(values)}, not a list of one number (or None) per completion")
    if len(values) != n:
        raise ValueError(f"returned {len(values)} values for {n} completions; return one value (or None) per "
                         f"completion")
    for v in values:
        if v is not None and not (isinstance(v, numbers.Real) or (isinstance(v, Tensor) and v.numel() == 1)):
            raise TypeError(f"returned a list holding {_describe(v)}, which is neither a number nor None")
    return list(values)


def _to_float(value: Any) -> float:
    """A reward value as a float; NaN for None, NaN, or anything that is not a real number."""
    if value is None:
        return math.nan
    try:
        x = float(value)
    except (TypeError, ValueError):
        return math.nan
    return x if math.isfinite(x) else math.nan


def combine_rewards(
    funcs_with_weights: Any,
    prompts: Sequence,
    completions: Sequence,
    timeout_s: float | None = None,
    *,
    columns: Mapping[str, Sequence] | None = None,
    completion_ids: Sequence | None = None,
    trainer_state: Any = None,
    **kwargs,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Call every reward function (:func:`call_reward_function`, TRL's convention) and sum their weighted rewards.

    reward_n = sum over the functions k that score rollout n of w_k r_{k,n}: a function that gives a rollout None,
    NaN or +-inf is skipped for it (TRL's multi-task convention: math-only and code-only functions, each None on the
    other's rows), and a rollout no function scores is invalid. A function call that raises, returns something that
    is not a list of N numbers/None (:func:`reward_values`) or runs past ``timeout_s`` makes all N rollouts of that
    call invalid (a failure is not "not applicable"). Failures are logged and counted; the run goes on, except for
    a function that calls ``sys.exit``.

    Args:
        funcs_with_weights: reward functions or registered names, with weights: ``{"correctness": 1.0}``,
            ``[("correctness", 1.0), (my_fn, 0.1)]``, or ``["correctness"]`` (weight 1).
        prompts: N prompts, one per rollout.
        completions: N completion texts (or chat messages).
        timeout_s: per-call time limit in seconds (each function runs in a worker thread); None: no limit, no thread.
        columns: task columns, each a list of N values (e.g. ``answer``), passed to every function by keyword; a
            column may have any name but the reserved ones (:data:`RESERVED_COLUMNS`).
        completion_ids: N lists of completion token ids.   trainer_state: passed as is (e.g. :class:`RewardState`).
        kwargs: more columns (the older form; a column named ``timeout_s`` or like a parameter here must go in
            ``columns``).

    Raises:
        RewardFunctionError: a function raised SystemExit (``sys.exit``), naming it.

    Returns:
        (rewards [N] float32, NaN where invalid; valid [N] bool; metrics) with metrics
        ``reward/mean``, ``reward/std`` (over valid rollouts; NaN when none is valid), ``reward/invalid_count``,
        ``reward/timeout_count`` and ``reward/error_count`` (function calls), and per function ``reward/<name>``
        (mean of its valid values, unweighted) and ``reward/<name>/invalid_count``, and its wall time
        ``perf/reward_<name>_seconds``, and ``reward/logged/<name>`` for each ``log_metric`` name (the mean of
        the step's values). A function's first failure is logged with its traceback; later ones in one line.
    """
    columns = {**kwargs, **(columns or {})}
    funcs = _normalize_funcs(funcs_with_weights)
    N = len(completions)
    if len(prompts) != N:
        raise ValueError(f"got {len(prompts)} prompts for {N} completions; pass one prompt per completion (repeat "
                         "each prompt R times)")
    total = torch.zeros(N, dtype=torch.float64)
    scored = torch.zeros(N, dtype=torch.bool)  # some function scored the rollout
    failed = torch.zeros(N, dtype=torch.bool)  # some function's call failed
    metrics: dict[str, float] = {REWARD_TIMEOUT_COUNT: 0, REWARD_ERROR_COUNT: 0}
    logged: dict[str, list[float]] = {}

    def log_metric(metric: str, value: float) -> None:
        logged.setdefault(str(metric), []).append(float(value))

    call = {"completion_ids": completion_ids, "columns": columns, "trainer_state": trainer_state,
            "log_metric": log_metric}
    for name, fn, weight in funcs:
        start = time.perf_counter()
        try:
            values = reward_values(_call_with_timeout(call_reward_function, timeout_s, (fn, prompts, completions),
                                                      call), N)
            r = torch.tensor([_to_float(v) for v in values], dtype=torch.float64)  # [N]
            call_failed = False
        except SystemExit as err:
            raise _exit_error(name, err) from None
        except RewardTimeout as err:
            logger.error("reward %r %s: its %d rollouts are marked invalid", name, err, N)
            metrics[REWARD_TIMEOUT_COUNT] += 1
            r, call_failed = torch.full((N,), math.nan, dtype=torch.float64), True
        except Exception as err:  # noqa: BLE001 - a failing reward function must not stop the run
            if _first_failure(fn):
                logger.exception("reward %r raised: its %d rollouts are marked invalid (later failures of this "
                                 "function are logged in one line)", name, N)
            else:
                logger.error("reward %r raised %s: %s; its %d rollouts are marked invalid", name,
                             type(err).__name__, err, N)
            metrics[REWARD_ERROR_COUNT] += 1
            r, call_failed = torch.full((N,), math.nan, dtype=torch.float64), True
        ok = ~torch.isnan(r)
        if (~ok).any() and not call_failed:  # None is "not applicable" (TRL): normal for a multi-task pair
            logger.debug("reward %r: %d of %d rollouts not scored (None or NaN)", name, int((~ok).sum()), N)
        metrics[REWARD_FUNCTION.format(name=name)] = float(r[ok].mean()) if ok.any() else math.nan
        metrics[REWARD_FUNCTION_INVALID_COUNT.format(name=name)] = int((~ok).sum())
        metrics[PERF_REWARD_SECONDS.format(name=name)] = time.perf_counter() - start  # timing keys live under perf/
        scored |= ok
        failed |= call_failed
        total += weight * torch.nan_to_num(r, nan=0.0)  # a skipped function adds nothing
    for metric, values in logged.items():
        metrics[REWARD_LOGGED.format(name=metric)] = sum(values) / len(values)
    valid = scored & ~failed  # [N]: some function scored it, and no function's call failed
    rewards = torch.where(valid, total, torch.full_like(total, math.nan)).float()  # [N]
    metrics[REWARD_INVALID_COUNT] = int((~valid).sum())
    metrics[REWARD_MEAN] = float(rewards[valid].mean()) if valid.any() else math.nan
    metrics[REWARD_STD] = float(rewards[valid].std(unbiased=False)) if valid.any() else math.nan
    return rewards, valid, metrics


_FAILED: set[int] = set()  # ids of the reward functions that have failed once in this process


def _first_failure(fn: Callable) -> bool:
    """True the first time ``fn`` fails in this process: its traceback is shown once, later failures in one line."""
    if id(fn) in _FAILED:
        return False
    _FAILED.add(id(fn))
    return True


def check_rewards_on_example(funcs_with_weights: Any, prompt: Any, columns: Mapping[str, Any],
                             timeout_s: float | None = None, where: str = "the first example",
                             trainer_state: Any = None) -> None:
    """Call every reward function once, before training, on one example's prompt and columns with the empty
    completion (a model can write one: EOS first), so that a function that cannot be called with the dataset's
    columns fails now, with its error, rather than making every rollout of the run invalid.

    A call that runs past ``timeout_s`` is not an error here (the run's own timeout handles it).

    Raises:
        ValueError: naming the reward function, ``where``, the error and what to do.
    """
    completions = chat_completions([prompt], [""])
    call = {"completion_ids": [[]], "columns": {k: [v] for k, v in columns.items()},
            "trainer_state": trainer_state if trainer_state is not None else RewardState()}
    for name, fn, _ in _normalize_funcs(funcs_with_weights):
        try:
            values = _call_with_timeout(call_reward_function, timeout_s, (fn, [prompt], completions), call)
        except RewardTimeout:
            continue
        except SystemExit as err:
            raise _exit_error(name, err) from None
        except Exception as err:  # noqa: BLE001 - reported as one line, before anything is written
            why = str(err).splitlines()[0][:300] if str(err) else ""
            raise ValueError(f"reward {name!r} fails on {where} (columns: {', '.join(sorted(columns)) or 'none'}) "
                             f"with an empty completion: {type(err).__name__}: {why}. Fix the function or the data "
                             f"(a function that cannot score a completion returns None for it)") from None
        try:
            reward_values(values, 1)
        except (TypeError, ValueError) as err:
            raise ValueError(f"reward {name!r} on {where} with an empty completion {err}; a reward function returns "
                             f"a list with one number (or None) per completion, as TRL's do") from None


def score_batch(
    batch: "RolloutBatch", funcs_with_weights: Any, timeout_s: float | None = None,
    trainer_state: Any = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """:func:`combine_rewards` for a :class:`~grpo_lens.rollout.RolloutBatch`, shaped by group.

    The batch's B prompts and per-prompt ``extras`` are repeated R times to give TRL's one-entry-per-rollout lists;
    completions go in TRL's format for their prompt (:func:`chat_completions`), with their token ids (up to the end of
    each completion) as ``completion_ids``. ``trainer_state``: :class:`RewardState` (None: step 0).

    Returns:
        (rewards [B, R] float32 with NaN where invalid, valid [B, R] bool, metrics as in :func:`combine_rewards`).
    """
    R, B = batch.group_size, batch.num_groups
    if len(batch.prompts) != B:
        raise ValueError(f"batch has {len(batch.prompts)} prompts for {B} groups; score the whole batch, not a "
                         "select()-ed part")
    prompts = [p for p in batch.prompts for _ in range(R)]
    columns = {k: [v for v in values for _ in range(R)] for k, values in batch.extras.items()}
    ids = [row[mask].tolist() for row, mask in zip(batch.completion_ids.cpu(), batch.completion_mask.cpu())]
    rewards, valid, metrics = combine_rewards(funcs_with_weights, prompts, chat_completions(prompts, batch.completions),
                                              timeout_s, columns=columns, completion_ids=ids,
                                              trainer_state=trainer_state if trainer_state is not None
                                              else RewardState())
    return rewards.view(B, R), valid.view(B, R), metrics
