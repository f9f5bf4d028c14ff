"""The built-in reward functions and the registry of reward names.

:data:`REWARDS` maps a name to a reward function (``correctness``, ``format``, and ``math_verify`` when the
``math-verify`` package is installed); :func:`get_reward` looks one up, :func:`parse_reward_specs` reads the CLI/YAML
``NAME:WEIGHT`` form. :func:`math_correctness_verdict` is the tasks' 0/1 correctness verdict (``reward/accuracy``).
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Callable, Sequence

from grpo_lens.registry import Registry
from grpo_lens.rewards.parsing import (
    completion_text,
    extract_answer,
    extract_marked_answer,
    is_scalar_reference,
    marked_answer_text,
    reference_value,
)

logger = logging.getLogger(__package__)  # "grpo_lens.rewards": log lines name the package, as before the split


RewardFn = Callable[..., list]

#: name -> reward function ``f(prompts, completions, **kwargs) -> list[float | None]``.
REWARDS: Registry = Registry("reward function")


def _references(answer: Sequence | None, n: int, fn_name: str) -> Sequence:
    if answer is None:
        raise ValueError(
            f"reward {fn_name!r} needs the reference answers: pass the task column 'answer' (a list "
            "with one entry per completion)"
        )
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


def math_verify_correctness(prompts: Sequence, completions: Sequence, answer: Sequence | None = None, **kwargs) -> list:
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


def math_correctness_verdict(
    completions: Sequence, answers: Sequence, use_math_verify: bool = False
) -> list[float | None]:
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
        raise ValueError(
            "reward 'math_verify' needs the math-verify package: pip install '.[math]' in the grpo-lens "
            f"folder (or pip install math-verify); valid names now: {', '.join(REWARDS.names())}"
        )
    return REWARDS.get(name)


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
            raise ValueError(
                f"reward spec {spec!r}: the weight after ':' must be a number, e.g. 'format:0.1'"
            ) from None
        if not math.isfinite(out[-1][1]):
            raise ValueError(f"reward spec {spec!r}: the weight after ':' must be a finite number, e.g. '{name}:0.1'")
    if not out:
        raise ValueError(f"no reward functions given; valid names: {', '.join(REWARDS.names())}")
    return out
