"""Reading a completion's answer: number parsing, answer extraction and normalisation.

Pure text functions, no registry and no torch: :func:`parse_number` reads one value exactly (a Fraction, so that
``18.0 == 18``), :func:`extract_answer` finds a completion's final answer (``####``, else the last ``\\boxed{}``, else
the last value), :func:`reference_value` reads a reference answer, :func:`completion_text` the text of a string or
chat-message completion, and :func:`marked_answer_text` the part of a completion that states its answer.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

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
    inner = text[len(open_) : len(text) - len(close)]
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
                text = text[len(open_) : len(text) - len(close)].strip()
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
