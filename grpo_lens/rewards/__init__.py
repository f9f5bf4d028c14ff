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

Modules by role: :mod:`~grpo_lens.rewards.parsing` (number and answer extraction, normalisation),
:mod:`~grpo_lens.rewards.functions` (the built-in reward functions, math-verify, the registry of names) and
:mod:`~grpo_lens.rewards.scoring` (calling reward functions with copies and timeouts, validating what they return,
None-skips, combining weighted rewards). Import from ``grpo_lens.rewards``; to monkeypatch a name that the code looks
up, patch it in the submodule that defines it (e.g. ``grpo_lens.rewards.functions.REWARDS``).
"""

from grpo_lens.rewards.functions import (
    REWARDS,
    RewardFn,
    correctness,
    format_reward,
    get_reward,
    math_correctness_verdict,
    math_verify_available,
    math_verify_correctness,
    parse_reward_specs,
)
from grpo_lens.rewards.parsing import (
    completion_text,
    extract_answer,
    extract_marked_answer,
    is_scalar_reference,
    marked_answer_text,
    normalize_number_text,
    parse_number,
    reference_value,
)
from grpo_lens.rewards.scoring import (
    RESERVED_COLUMNS,
    RewardFunctionError,
    RewardState,
    RewardTimeout,
    _call_with_timeout,  # noqa: F401 - imported from here by grpo_lens.train.step_metrics
    call_reward_function,
    chat_completions,
    check_column_names,
    check_rewards_on_example,
    combine_rewards,
    reward_values,
    score_batch,
)

__all__ = [
    "RESERVED_COLUMNS",
    "REWARDS",
    "RewardFn",
    "RewardFunctionError",
    "RewardState",
    "RewardTimeout",
    "call_reward_function",
    "chat_completions",
    "check_column_names",
    "check_rewards_on_example",
    "combine_rewards",
    "completion_text",
    "correctness",
    "extract_answer",
    "extract_marked_answer",
    "format_reward",
    "get_reward",
    "is_scalar_reference",
    "marked_answer_text",
    "math_correctness_verdict",
    "math_verify_available",
    "math_verify_correctness",
    "normalize_number_text",
    "parse_number",
    "parse_reward_specs",
    "reference_value",
    "reward_values",
    "score_batch",
]
