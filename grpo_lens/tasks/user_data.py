"""Tasks from the user's own data: a JSONL file or a Hugging Face ``datasets`` dataset.

Each row needs a ``prompt``: a non-empty string (TRL's standard format: tokenized as is by a model without a chat
template, sent as one user message to a chat model; reward functions get string completions) or a non-empty list of
chat messages ``{"role": ..., "content": ...}`` (conversational: completions are message lists). Every other column
(e.g. ``answer``) is passed to reward functions as a keyword
argument, as TRL does.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_lens.rewards import check_column_names
from grpo_lens.tasks.base import TASKS, Example, check_split, sample_rows, split_rng

ROW_HELP = (
    "each row needs a 'prompt': a non-empty string, or a non-empty list of chat messages "
    '{"role": "user", "content": "..."}; other columns (e.g. "answer") are passed to reward functions. '
    'Example line: {"prompt": "What is 2 + 3?", "answer": "5"}'
)


def _row_error(source: str, row_number: int, problem: str) -> ValueError:
    return ValueError(f"{source}, row {row_number}: {problem}. Fix: {ROW_HELP}")


def row_to_example(row: Any, source: str, row_number: int, system_prompt: str | None = None) -> Example:
    """Validate one row and turn it into an :class:`Example`.

    Args:
        row: a dict with a ``prompt`` and any other columns.
        source: the file or dataset name, for error messages.
        row_number: 1-based row (line) number, for error messages.
        system_prompt: prepended as a system message to string prompts.

    Raises:
        ValueError: naming ``source`` and ``row_number`` when the row is not a dict, has no prompt, an empty prompt,
            or a prompt of the wrong type.
    """
    if not isinstance(row, dict):
        raise _row_error(source, row_number, f"expected a JSON object, got {type(row).__name__}")
    if "prompt" not in row:
        raise _row_error(source, row_number, f"no 'prompt' column (columns: {', '.join(sorted(row)) or 'none'})")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _row_error(source, row_number, "the prompt is empty")
        # A string stays a string (TRL's standard format): a base model without a chat template reads it as is, a
        # chat model gets it as one user message (grpo_lens.rollout.prompt_token_ids); a system prompt makes it chat.
        messages = (
            [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]
            if system_prompt
            else prompt
        )
    elif isinstance(prompt, list):
        if not prompt:
            raise _row_error(source, row_number, "the prompt is an empty list of messages")
        for i, message in enumerate(prompt):
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)
            ):
                raise _row_error(
                    source, row_number, f"prompt message {i} is not a {{'role': str, 'content': str}} dict: {message!r}"
                )
        if not any(m["content"].strip() for m in prompt):
            raise _row_error(source, row_number, "every prompt message is empty")
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise _row_error(
            source, row_number, f"the prompt is a {type(prompt).__name__}, expected a string or a list of messages"
        )
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate such as "\ud800" in the JSON
            raise _row_error(
                source,
                row_number,
                f"the prompt holds {text[err.start : err.end]!r} at character "
                f"{err.start}, which is not valid Unicode text (a lone surrogate); "
                f"remove or replace it",
            ) from None
    answer = row.get("answer")
    extras = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
    check_column_names(list(extras), f"{source}, row {row_number}")
    if answer is not None and not isinstance(answer, (list, dict)):
        answer = str(answer)  # a number or string; a list or mapping stays as given (never scored from its repr)
    return Example(prompt=messages, answer=answer, extras=extras)


def file_fingerprint(path: str | os.PathLike) -> tuple[str, int]:
    """(sha256 hex digest, number of non-blank lines) of a data file, read in 1 MiB blocks: what a run records of its
    --dataset so that a resume can tell that the file changed.

    Raises:
        OSError: the file cannot be read.
    """
    digest, rows = hashlib.sha256(), 0
    with open(path, "rb") as f:
        partial = b""
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            lines = (partial + block).split(b"\n")
            partial = lines.pop()
            rows += sum(1 for line in lines if line.strip())
        rows += 1 if partial.strip() else 0
    return digest.hexdigest(), rows


class _DuplicateKey(ValueError):
    """A JSON object with the same key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    """The rows of a JSONL file (blank lines skipped).

    Raises:
        FileNotFoundError: no such file.
        ValueError: naming the file (and line): gzip-compressed, a line not UTF-8 or not valid JSON, a key twice in
            one object.
    """
    path = Path(path)
    rows = []
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        raise ValueError(
            f"{path}: gzip-compressed, not JSONL text; decompress it first (gunzip -k {path}) and pass the .jsonl file"
        )
    if data[:3] == b"\xef\xbb\xbf":  # a UTF-8 byte-order mark (some editors write one) is not data
        data = data[3:]
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise _row_error(
                str(path),
                number,
                f"not UTF-8 text (byte {raw[err.start : err.start + 1]!r} at column "
                f"{err.start + 1}); save the file as UTF-8",
            ) from None
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line, object_pairs_hook=_unique_keys)))
        except json.JSONDecodeError as err:
            raise _row_error(str(path), number, f"not valid JSON ({err.msg} at column {err.colno})") from None
        except RecursionError:
            raise _row_error(
                str(path), number, "JSON nested deeper than Python can read (thousands of levels); flatten the row"
            ) from None
        except _DuplicateKey as err:
            raise _row_error(
                str(path),
                number,
                f"the key {err.args[0]!r} appears twice in one object (JSON keeps the last silently); keep one",
            ) from None
    if not rows:
        raise ValueError(f"{path}: no rows. Fix: {ROW_HELP}")
    return rows


@dataclass
class UserDataTask:
    """A task whose examples come from rows the user gave (already validated into Examples).

    Use :func:`jsonl_task` or :func:`dataset_task` to build one.

    Attributes:
        data: split name -> list of Examples.
        name: shown in errors and run configs.
    """

    data: dict[str, list[Example]]
    name: str = "user_data"
    splits: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        self.splits = tuple(self.data)

    def size(self, split: str = "train") -> int:
        """Number of rows in ``split``; ValueError for an unknown split."""
        check_split(self, split)
        return len(self.data[split])

    def sample(self, n: int, rng_or_seed=None, split: str = "train", *, seed: int | None = None) -> list[Example]:
        """n examples of ``split``, without replacement while n <= the split's size."""
        check_split(self, split)
        return sample_rows(self.data[split], n, split_rng(rng_or_seed, split, seed))


def jsonl_task(
    path: str | os.PathLike, test_path: str | os.PathLike | None = None, system_prompt: str | None = None
) -> UserDataTask:
    """A task from a JSONL file (split ``train``) and optionally a second one (split ``test``).

    Every row is validated up front. Raises ValueError naming the file and row number for a malformed row.
    """
    data = {}
    for split, p in (("train", path), ("test", test_path)):
        if p is None:
            continue
        data[split] = [row_to_example(row, str(p), number, system_prompt) for number, row in read_jsonl(p)]
    return UserDataTask(data=data, name=f"jsonl:{Path(path).name}")


def dataset_task(dataset: Any, name: str = "dataset", system_prompt: str | None = None) -> UserDataTask:
    """A task from a Hugging Face ``datasets.Dataset`` or a list of row dicts (split ``train``), or from a dict of
    split name -> those (a ``datasets.DatasetDict`` is one). Rows are validated up front; errors name the dataset,
    the split and the row number."""
    splits = dict(dataset) if isinstance(dataset, dict) else {"train": dataset}
    data = {
        split: [
            row_to_example(row, f"{name} [{split}]", number, system_prompt) for number, row in enumerate(rows, start=1)
        ]
        for split, rows in splits.items()
    }
    for split, examples in data.items():
        if not examples:
            raise ValueError(f"{name} [{split}]: no rows. Fix: {ROW_HELP}")
    return UserDataTask(data=data, name=name)


def user_task(
    dataset: Any, system_prompt: str | None = None, test_path: str | os.PathLike | None = None, split: str | None = None
) -> UserDataTask:
    """A task from the user's data, whatever form it takes.

    Args:
        dataset: a path to a JSONL file; a Hugging Face dataset name (loaded with ``datasets.load_dataset``, which
            needs the ``datasets`` package and, for the hub, the network); a ``datasets`` Dataset/DatasetDict; or a
            list of row dicts.
        system_prompt: prepended to string prompts as a system message.
        test_path: for a JSONL file, a second file for the ``test`` split.
        split: for a dataset name, the one split to load (all splits if None).
    """
    if isinstance(dataset, (str, os.PathLike)):
        path = Path(dataset)
        if path.is_file() or str(dataset).endswith((".jsonl", ".json")):
            if not path.is_file():
                raise FileNotFoundError(f"dataset file {str(dataset)!r} does not exist")
            return jsonl_task(path, test_path=test_path, system_prompt=system_prompt)
        try:
            import datasets
        except ImportError:
            raise ValueError(
                f"dataset {str(dataset)!r} is not a file; to load a Hugging Face dataset by name install datasets "
                "(pip install '.[data]' in the grpo-lens folder), or pass a JSONL file with a 'prompt' column"
            ) from None
        loaded = datasets.load_dataset(str(dataset), split=split)
        return dataset_task(loaded, name=str(dataset), system_prompt=system_prompt)
    return dataset_task(dataset, system_prompt=system_prompt)


TASKS.register("jsonl")(user_task)
