"""Tasks: GSM8K answers, arithmetic problems and their values, user data and its error messages, the registry."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from grpo_lens.rewards import correctness, parse_number
from grpo_lens.tasks import (
    TASKS,
    ArithmeticTask,
    Example,
    GSM8KTask,
    Task,
    dataset_task,
    get_task,
    gsm8k_reference,
    jsonl_task,
)
from grpo_lens.tasks.arithmetic import evaluate
from grpo_lens.tasks.gsm8k import load_gsm8k


# ---------------------------------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------------------------------
def test_registry_names_and_unknown_task():
    assert TASKS.names() == ["arithmetic", "gsm8k", "jsonl"]
    with pytest.raises(ValueError, match="unknown task 'nope'; valid names: arithmetic, gsm8k, jsonl"):
        get_task("nope")
    with pytest.raises(ValueError, match="takes no dataset"):
        get_task("gsm8k", dataset="x.jsonl")
    with pytest.raises(ValueError, match="needs a dataset"):
        get_task("jsonl")
    with pytest.raises(TypeError):
        get_task("arithmetic", no_such_option=1)


def test_tasks_follow_the_protocol():
    for task in (get_task("gsm8k"), get_task("arithmetic")):
        assert isinstance(task, Task)
        examples = task.sample(3, 0)
        assert len(examples) == 3 and all(isinstance(e, Example) for e in examples)
        assert all(e.prompt[-1]["role"] == "user" and isinstance(e.answer, str) for e in examples)
        assert task.sample(0, 0) == []


# ---------------------------------------------------------------------------------------------------------------------
# gsm8k
# ---------------------------------------------------------------------------------------------------------------------
def test_gsm8k_reference():
    assert gsm8k_reference("48/2 = 24\n#### 72") == "72"
    assert gsm8k_reference("... #### 1,234") == "1234"
    with pytest.raises(ValueError, match="####"):
        gsm8k_reference("no answer here")


def test_gsm8k_data_and_answers():
    train, test = load_gsm8k("train"), load_gsm8k("test")
    assert (len(train), len(test)) == (7473, 1319)  # the standard GSM8K split sizes
    # Every reference is a number (the correctness reward can score every prompt).
    assert all(parse_number(gsm8k_reference(row["answer"])) is not None for row in train + test)
    task = GSM8KTask()
    natalia = task.example(train[0])  # "Natalia sold clips to 48 of her friends in April ... #### 72"
    assert natalia.answer == "72"
    assert natalia.prompt[-1]["content"].startswith("Natalia sold clips")
    assert "####" in natalia.prompt[-1]["content"] and "step by step" in natalia.prompt[-1]["content"]
    assert natalia.columns()["solution"] == train[0]["answer"]
    # The reference solution itself scores 1 under the correctness reward.
    assert correctness(["q"], [train[0]["answer"]], answer=[natalia.answer]) == [1.0]


def test_gsm8k_sampling():
    task = get_task("gsm8k")
    a, b = task.sample(50, 7), task.sample(50, seed=7)
    assert a == b  # same seed, positional or keyword
    assert len({e.extras["question"] for e in a}) == 50  # without replacement
    assert task.sample(5, 7, split="test") != task.sample(5, 7)
    assert {e.extras["question"] for e in task.sample(5, 0, split="test")} <= {
        r["question"] for r in load_gsm8k("test")
    }
    with pytest.raises(ValueError, match="valid splits: train, test"):
        task.sample(1, 0, split="validation")
    system = GSM8KTask(system_prompt="You are a careful solver.").sample(1, 0)[0]
    assert system.prompt[0] == {"role": "system", "content": "You are a careful solver."}


# ---------------------------------------------------------------------------------------------------------------------
# arithmetic
# ---------------------------------------------------------------------------------------------------------------------
def test_evaluate_precedence():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14  # 2 + 12
    assert evaluate([2, 3, 4], ["*", "+"]) == 10  # 6 + 4
    assert evaluate([10, 2, 3], ["-", "-"]) == 5  # left to right
    assert evaluate([10, 2, 3], ["-", "*"]) == 4  # 10 - 6


def test_arithmetic_answers_match_python():
    task = ArithmeticTask(min_operand=0, max_operand=30, num_operands=3, ops="+-*", allow_negative=True)
    for e in task.sample(200, 1):
        expression = e.extras["expression"]
        assert e.answer == str(eval(expression))  # Python's precedence is the oracle
        assert e.prompt[-1]["content"] == f"What is {expression}? Reply with just the number."


def test_arithmetic_ranges_and_non_negative():
    task = ArithmeticTask(min_operand=3, max_operand=7, num_operands=2, ops="-")
    for e in task.sample(200, 2):
        a, op, b = e.extras["expression"].split()
        assert 3 <= int(a) <= 7 and 3 <= int(b) <= 7 and op == "-"
        assert int(e.answer) >= 0  # allow_negative=False redraws a < b
    # Over 200 draws from 5 x 5 pairs every a >= b pair (15 of them) shows up.
    assert len({e.extras["expression"] for e in task.sample(200, 2)}) == 15


def test_arithmetic_default_difficulty():
    # Chosen by benchmarks/measure_arithmetic_difficulty.py (see the module docstring of grpo_lens.tasks.arithmetic).
    task = get_task("arithmetic")
    assert (task.min_operand, task.max_operand, task.num_operands, task.ops) == (0, 9, 2, "+")
    assert all(0 <= int(e.answer) <= 18 for e in task.sample(100, 0))


def test_arithmetic_seeding():
    task = ArithmeticTask()
    assert task.sample(20, random.Random(3)) == task.sample(20, random.Random(3))
    assert task.sample(20, 3) == task.sample(20, seed=3)
    assert task.sample(20, 3) != task.sample(20, 4)
    assert task.sample(20, 3, split="test") != task.sample(20, 3)
    g1, g2 = np.random.default_rng(5), np.random.default_rng(5)
    assert task.sample(10, g1) == task.sample(10, g2)  # a numpy Generator is accepted
    with pytest.raises(TypeError, match="not both"):
        task.sample(2, 1, seed=1)


def test_arithmetic_rejects_bad_options():
    with pytest.raises(ValueError, match="num_operands"):
        ArithmeticTask(num_operands=1)
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops="/")
    with pytest.raises(ValueError, match="expression"):
        ArithmeticTask(template="no placeholder")
    with pytest.raises(ValueError, match="min_operand"):
        ArithmeticTask(min_operand=5, max_operand=1)


# ---------------------------------------------------------------------------------------------------------------------
# user data
# ---------------------------------------------------------------------------------------------------------------------
def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_task(tmp_path):
    path = _write_jsonl(
        tmp_path / "data.jsonl",
        [
            json.dumps({"prompt": "What is 2 + 3?", "answer": 5, "level": "easy"}),
            "",  # blank lines are skipped
            json.dumps(
                {
                    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}],
                    "answer": "2",
                }
            ),
        ],
    )
    task = get_task(str(path))
    assert task.splits == ("train",) and task.size() == 2
    examples = sorted(task.sample(2, 0), key=lambda e: e.answer)
    assert examples[0].prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}]
    assert examples[1].prompt == "What is 2 + 3?"  # a string prompt stays a string (TRL standard format)
    assert examples[1].answer == "5"  # stringified
    assert examples[1].columns() == {"answer": "5", "level": "easy"}  # extra columns go to reward functions
    # The same file through the trainer's path: task "jsonl" with a dataset.
    assert get_task("jsonl", dataset=str(path)).sample(2, 0) == task.sample(2, 0)


def test_jsonl_task_with_test_split_and_system_prompt(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", [json.dumps({"prompt": "a"})])
    test = _write_jsonl(tmp_path / "test.jsonl", [json.dumps({"prompt": "b"})])
    task = jsonl_task(train, test_path=test, system_prompt="sys")
    assert task.splits == ("train", "test")
    assert task.sample(1, 0, split="test")[0].prompt == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "b"},
    ]
    assert task.sample(1, 0)[0].answer is None and task.sample(1, 0)[0].columns() == {}


@pytest.mark.parametrize(
    "line,problem",
    [
        ('{"question": "2 + 3?", "answer": "5"}', "no 'prompt' column"),
        ('{"prompt": "   ", "answer": "5"}', "the prompt is empty"),
        ('{"prompt": 12}', "the prompt is a int"),
        ('{"prompt": []}', "empty list of messages"),
        ('{"prompt": [{"role": "user"}]}', "prompt message 0"),
        ('{"prompt": "unterminated', "not valid JSON"),
        ('["prompt"]', "expected a JSON object"),
    ],
)
def test_malformed_rows_name_file_and_row(tmp_path, line, problem):
    path = _write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"prompt": "fine", "answer": "1"}), line])
    with pytest.raises(ValueError) as info:
        get_task(str(path))
    message = str(info.value)
    assert "bad.jsonl" in message and "row 2" in message and problem in message
    assert "Fix:" in message and "'prompt'" in message


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        get_task(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="no rows"):
        get_task(str(_write_jsonl(tmp_path / "empty.jsonl", [""])))


def test_dataset_task_from_rows_and_splits():
    task = dataset_task([{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "2"}], name="mine")
    assert task.size() == 2 and task.name == "mine"
    split_task = dataset_task({"train": [{"prompt": "x"}], "test": [{"prompt": "y"}]})
    assert split_task.splits == ("train", "test")
    with pytest.raises(ValueError, match=r"mine \[train\], row 2: no 'prompt'"):
        dataset_task([{"prompt": "x"}, {"text": "y"}], name="mine")


def test_hf_dataset_task():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "2 + 2?", "answer": "4"}])
    task = get_task("jsonl", dataset=ds)
    assert sorted(e.answer for e in task.sample(2, 0)) == ["2", "4"]
