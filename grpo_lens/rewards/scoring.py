"""Calling reward functions as TRL does, and combining their weighted rewards into one reward per rollout.

:func:`call_reward_function` calls one function by TRL's keyword convention, on copies of its arguments;
:func:`combine_rewards` calls every function (each within ``timeout_s``, :func:`_call_with_timeout`), validates what
it returns (:func:`reward_values`), skips None ("not applicable") and sums the weighted rewards; :func:`score_batch`
does so for a :class:`~grpo_lens.rollout.RolloutBatch`; :func:`check_rewards_on_example` tries every function once
before training. The conventions are in the package docstring (:mod:`grpo_lens.rewards`) and docs/rewards.md.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo_lens import metrics as mk
from grpo_lens.rewards.functions import REWARDS, RewardFn, get_reward

if TYPE_CHECKING:
    from grpo_lens.rollout import RolloutBatch

logger = logging.getLogger(__package__)  # "grpo_lens.rewards": log lines name the package, as before the split


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
        raise ValueError(
            f"{where}: column(s) {', '.join(map(repr, clash))} collide with the keyword arguments every "
            f"reward function receives ({', '.join(RESERVED_COLUMNS)}); rename them (e.g. "
            f"{clash[0]!r} -> {clash[0] + '_ref'!r}) in the data and in your reward function"
        )


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
    return [
        [{"role": "assistant", "content": c}] if isinstance(p, (list, tuple)) else c
        for p, c in zip(prompts, completions)
    ]


def _parameters(fn: Callable) -> tuple[list[str], bool]:
    """(names of ``fn``'s parameters, whether it takes ``**kwargs``); ([], True) when the signature is unreadable."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return [], True
    return ([p.name for p in params if p.kind is not p.VAR_KEYWORD], any(p.kind is p.VAR_KEYWORD for p in params))


def call_reward_function(
    fn: Callable,
    prompts: Sequence,
    completions: Sequence,
    *,
    completion_ids: Sequence | None = None,
    columns: Mapping[str, Sequence] | None = None,
    trainer_state: Any = None,
    log_extra: Callable | None = None,
    log_metric: Callable | None = None,
) -> Any:
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
    keywords = {
        "prompts": copy.deepcopy(list(prompts)),
        "completions": copy.deepcopy(list(completions)),
        "completion_ids": None if completion_ids is None else copy.deepcopy(list(completion_ids)),
        **columns,
        "trainer_state": trainer_state,
        "log_extra": log_extra or (lambda column, values: None),
        "log_metric": log_metric or (lambda name, value: None),
    }
    names, var_kw = _parameters(fn)
    args: tuple = ()
    if len(names) >= 2 and names[:2] != ["prompts", "completions"] and "completions" not in names:
        args = (keywords.pop("prompts"), keywords.pop("completions"))  # the positional form f(p, c, **columns)
        names = names[2:]
    if not var_kw:
        keywords = {k: v for k, v in keywords.items() if k in names}
    return fn(*args, **keywords)


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


def _describe(value: Any) -> str:
    """A short description of what a reward function returned, for messages."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


class RewardFunctionError(ValueError):
    """A reward function did what no reward function may: called ``sys.exit`` (raised SystemExit)."""


def _exit_error(name: str, err: SystemExit) -> RewardFunctionError:
    return RewardFunctionError(
        f"reward {name!r} called sys.exit({err.code!r}) (raised SystemExit): a reward function "
        f"returns one value (or None) per completion and never ends the run; return None for a "
        f"completion it cannot score, or raise an exception"
    )


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
        raise ValueError(
            f"returned {len(values)} values for {n} completions; return one value (or None) per completion"
        )
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


def _call_one(
    name: str, fn: Any, args: tuple, call: dict[str, Any], timeout_s: float | None, N: int, metrics: dict[str, float]
) -> tuple[Tensor, bool]:
    """One reward function's call in :func:`combine_rewards`: (its N values [N] float64, NaN where it gave none,
    whether the call failed). A timeout or an exception marks all N NaN, is logged and counted in ``metrics``
    (``reward/timeout_count``, ``reward/error_count``); SystemExit raises :class:`RewardFunctionError`."""
    try:
        values = reward_values(_call_with_timeout(call_reward_function, timeout_s, args, call), N)
        r = torch.tensor([_to_float(v) for v in values], dtype=torch.float64)  # [N]
        call_failed = False
    except SystemExit as err:
        raise _exit_error(name, err) from None
    except RewardTimeout as err:
        logger.error("reward %r %s: its %d rollouts are marked invalid", name, err, N)
        metrics[mk.REWARD_TIMEOUT_COUNT] += 1
        r, call_failed = torch.full((N,), math.nan, dtype=torch.float64), True
    except Exception as err:  # noqa: BLE001 - a failing reward function must not stop the run
        if _first_failure(fn):
            logger.exception(
                "reward %r raised: its %d rollouts are marked invalid (later failures of this "
                "function are logged in one line)",
                name,
                N,
            )
        else:
            logger.error(
                "reward %r raised %s: %s; its %d rollouts are marked invalid", name, type(err).__name__, err, N
            )
        metrics[mk.REWARD_ERROR_COUNT] += 1
        r, call_failed = torch.full((N,), math.nan, dtype=torch.float64), True
    return r, call_failed


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
        kwargs (Any): more columns (the older form; a column named ``timeout_s`` or like a parameter here must go in
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
        raise ValueError(
            f"got {len(prompts)} prompts for {N} completions; pass one prompt per completion (repeat "
            "each prompt R times)"
        )
    total = torch.zeros(N, dtype=torch.float64)
    scored = torch.zeros(N, dtype=torch.bool)  # some function scored the rollout
    failed = torch.zeros(N, dtype=torch.bool)  # some function's call failed
    metrics: dict[str, float] = {mk.REWARD_TIMEOUT_COUNT: 0, mk.REWARD_ERROR_COUNT: 0}
    logged: dict[str, list[float]] = {}

    def log_metric(metric: str, value: float) -> None:
        logged.setdefault(str(metric), []).append(float(value))

    call = {
        "completion_ids": completion_ids,
        "columns": columns,
        "trainer_state": trainer_state,
        "log_metric": log_metric,
    }
    for name, fn, weight in funcs:
        start = time.perf_counter()
        r, call_failed = _call_one(name, fn, (fn, prompts, completions), call, timeout_s, N, metrics)
        ok = ~torch.isnan(r)
        if (~ok).any() and not call_failed:  # None is "not applicable" (TRL): normal for a multi-task pair
            logger.debug("reward %r: %d of %d rollouts not scored (None or NaN)", name, int((~ok).sum()), N)
        metrics[mk.REWARD_FUNCTION.format(name=name)] = float(r[ok].mean()) if ok.any() else math.nan
        metrics[mk.REWARD_FUNCTION_INVALID_COUNT.format(name=name)] = int((~ok).sum())
        metrics[mk.PERF_REWARD_SECONDS.format(name=name)] = time.perf_counter() - start  # timing keys live under perf/
        scored |= ok
        failed |= call_failed
        total += weight * torch.nan_to_num(r, nan=0.0)  # a skipped function adds nothing
    for metric, values in logged.items():
        metrics[mk.REWARD_LOGGED.format(name=metric)] = sum(values) / len(values)
    valid = scored & ~failed  # [N]: some function scored it, and no function's call failed
    rewards = torch.where(valid, total, torch.full_like(total, math.nan)).float()  # [N]
    metrics[mk.REWARD_INVALID_COUNT] = int((~valid).sum())
    metrics[mk.REWARD_MEAN] = float(rewards[valid].mean()) if valid.any() else math.nan
    metrics[mk.REWARD_STD] = float(rewards[valid].std(unbiased=False)) if valid.any() else math.nan
    return rewards, valid, metrics


_FAILED: set[int] = set()  # ids of the reward functions that have failed once in this process


def _first_failure(fn: Callable) -> bool:
    """True the first time ``fn`` fails in this process: its traceback is shown once, later failures in one line."""
    if id(fn) in _FAILED:
        return False
    _FAILED.add(id(fn))
    return True


def check_rewards_on_example(
    funcs_with_weights: Any,
    prompt: Any,
    columns: Mapping[str, Any],
    timeout_s: float | None = None,
    where: str = "the first example",
    trainer_state: Any = None,
) -> None:
    """Call every reward function once, before training, on one example's prompt and columns with the empty
    completion (a model can write one: EOS first), so that a function that cannot be called with the dataset's
    columns fails now, with its error, rather than making every rollout of the run invalid.

    A call that runs past ``timeout_s`` is not an error here (the run's own timeout handles it).

    Raises:
        ValueError: naming the reward function, ``where``, the error and what to do.
    """
    completions = chat_completions([prompt], [""])
    call: dict[str, Any] = {
        "completion_ids": [[]],
        "columns": {k: [v] for k, v in columns.items()},
        "trainer_state": trainer_state if trainer_state is not None else RewardState(),
    }
    for name, fn, _ in _normalize_funcs(funcs_with_weights):
        try:
            values = _call_with_timeout(call_reward_function, timeout_s, (fn, [prompt], completions), call)
        except RewardTimeout:
            continue
        except SystemExit as err:
            raise _exit_error(name, err) from None
        except Exception as err:  # noqa: BLE001 - reported as one line, before anything is written
            why = str(err).splitlines()[0][:300] if str(err) else ""
            raise ValueError(
                f"reward {name!r} fails on {where} (columns: {', '.join(sorted(columns)) or 'none'}) "
                f"with an empty completion: {type(err).__name__}: {why}. Fix the function or the data "
                f"(a function that cannot score a completion returns None for it)"
            ) from None
        try:
            reward_values(values, 1)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"reward {name!r} on {where} with an empty completion {err}; a reward function returns "
                f"a list with one number (or None) per completion, as TRL's do"
            ) from None


def score_batch(
    batch: RolloutBatch,
    funcs_with_weights: Any,
    timeout_s: float | None = None,
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
        raise ValueError(
            f"batch has {len(batch.prompts)} prompts for {B} groups; score the whole batch, not a select()-ed part"
        )
    prompts = [p for p in batch.prompts for _ in range(R)]
    columns = {k: [v for v in values for _ in range(R)] for k, values in batch.extras.items()}
    ids = [row[mask].tolist() for row, mask in zip(batch.completion_ids.cpu(), batch.completion_mask.cpu())]
    rewards, valid, metrics = combine_rewards(
        funcs_with_weights,
        prompts,
        chat_completions(prompts, batch.completions),
        timeout_s,
        columns=columns,
        completion_ids=ids,
        trainer_state=trainer_state if trainer_state is not None else RewardState(),
    )
    return rewards.view(B, R), valid.view(B, R), metrics
