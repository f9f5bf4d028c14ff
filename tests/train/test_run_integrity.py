"""The run you asked for is the run you get. One test per reported case (``test_case<N>_*``)
plus one constructed case of the same kind that the report did not name.

Tiny model (2-layer Llama built in code), CPU float32; rewards from tests/helpers_rewards.py depend only on the
rollout's position, so groups are mixed whatever the model writes.
"""

from __future__ import annotations

import helpers_rewards  # noqa: F401 - registers the test_* reward functions
import pytest
import torch

import grpo_lens.train.checks as checks
import grpo_lens.train.loop as loop
from grpo_lens.config import TrainConfig
from grpo_lens.models import build_tiny_model
from grpo_lens.rollout import batch_logprobs, sample_groups
from grpo_lens.runtime.processes import setup_processes

R = 4


def tiny_config(tmp_path, name="run", **overrides) -> TrainConfig:
    """A short run of the tiny model: B = 2 prompts, R = 4, T_max = 4."""
    values = dict(
        model="tiny",
        task="arithmetic",
        rewards=["test_alternating"],
        group_size=R,
        prompts_per_step=2,
        max_new_tokens=4,
        max_steps=1,
        checkpoint_every=10,
        lens_every=0,
        progress=False,
        device="cpu",
        save_final_model=False,
        log_completions=0,
        micro_batch_size=2 * R,
        seed=0,
    )
    values.update(overrides)
    return TrainConfig(out=str(tmp_path / name), **values)


def dropout_model(name, dtype, device):
    """The tiny Llama with attention_dropout 0.3 (Llama's functional attention dropout) and, GPT-2 style, an
    nn.Dropout(0.5) after every MLP: in train mode two forwards of the same tokens differ by ~1 nat/token."""
    model, tokenizer = build_tiny_model()
    model.config.attention_dropout = 0.3
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.3
    for layer in model.model.layers:
        layer.mlp = torch.nn.Sequential(layer.mlp, torch.nn.Dropout(0.5))
    return model, tokenizer


# ---------------------------------------------------------------------------------------------------------------------
# 1. dropout off in every log-prob forward
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_case1_dropout_off_in_policy_and_reference(monkeypatch, tmp_path):
    """build_models leaves no module of the policy or the reference in train mode, so two forwards agree exactly;
    in train mode the same model's two forwards differ (the check can fail)."""
    monkeypatch.setattr(loop, "load_model", dropout_model)
    config = tiny_config(tmp_path, beta=0.1)
    models = loop.build_models(config, setup_processes("cpu"))
    batch = sample_groups(models.policy, models.tokenizer, ["What is 2 + 3?"], R, max_new_tokens=4, generator_seed=0)
    for model in (models.policy, models.reference):
        assert not any(m.training for m in model.modules())
        with torch.no_grad():
            assert torch.equal(batch_logprobs(model, batch), batch_logprobs(model, batch))
    models.policy.train()  # the wrong code: the same two forwards with dropout on
    with torch.no_grad():
        gap = (batch_logprobs(models.policy, batch) - batch_logprobs(models.policy, batch)).abs().max()
    assert gap > 0.1


@pytest.mark.e2e
def test_case1_dropout_run_has_no_sampler_trainer_gap(monkeypatch, tmp_path):
    """Two steps with mu = 2 on the dropout model: the sampler-vs-trainer gap is float noise (1.97 nats/token and
    ratio/max 5821 on main before the fix, in this setting) and the first pass's ratio is 1."""
    monkeypatch.setattr(loop, "load_model", dropout_model)
    run = loop.train(tiny_config(tmp_path, mu=2, max_steps=1, learning_rate=1e-5))
    (record,) = run.read_metrics()
    assert record["mismatch/logprob_abs_diff_mean"] < 1e-4
    assert record["ratio/max"] < 1.5  # pass 2 after one AdamW step of 1e-5 per weight


# ---------------------------------------------------------------------------------------------------------------------
# 2. an edited config.yaml on resume
# ---------------------------------------------------------------------------------------------------------------------
def _edit_config(run_path, **changes):
    import yaml

    path = run_path / "config.yaml"
    values = yaml.safe_load(path.read_text())
    values.update(changes)
    path.write_text(yaml.safe_dump(values, sort_keys=False))


@pytest.mark.e2e
def test_case2_edited_config_refused_on_resume(tmp_path):
    """group_size 4 -> 8, beta 0 -> 0.5 and learning_rate -> 0.5 written into config.yaml: the resume is refused
    before anything changes, naming each field with both values (main ran steps 2.. with them and exit 0)."""
    from grpo_lens.rundir import RunDirError

    config = tiny_config(tmp_path)
    run = loop.train(config)
    before = run.metrics_path.read_text()
    _edit_config(run.path, group_size=8, beta=0.5, learning_rate=0.5, max_steps=2)
    resumed = TrainConfig.from_dict({**TrainConfig.read(str(run.config_path)), "resume": True})
    with pytest.raises(RunDirError) as err:
        loop.train(resumed)
    for field in ("group_size 4 -> 8", "beta 0.0 -> 0.5", "learning_rate 5e-06 -> 0.5"):
        assert field in str(err.value)
    assert "max_steps" not in str(err.value).split("only")[0]  # max_steps may change
    assert run.metrics_path.read_text() == before


@pytest.mark.e2e
def test_case2_extending_max_steps_resumes(tmp_path):
    """The constructed case: max_steps (safe to extend) edited in config.yaml resumes, and config.yaml then holds
    exactly what the checkpoint ran with plus the new max_steps."""
    import yaml

    run = loop.train(tiny_config(tmp_path))
    ran = yaml.safe_load(run.config_path.read_text())
    _edit_config(run.path, max_steps=2)
    loop.train(TrainConfig.from_dict({**TrainConfig.read(str(run.config_path)), "resume": True}))
    assert [r["step"] for r in run.read_metrics()] == [1, 2]
    assert yaml.safe_load(run.config_path.read_text()) == {**ran, "max_steps": 2}


# ---------------------------------------------------------------------------------------------------------------------
# 3. reward functions written for TRL run unchanged
# ---------------------------------------------------------------------------------------------------------------------
# Written from TRL's GRPOTrainer documentation alone: keyword arguments, dataset columns by name, **kwargs, message
# lists for conversational prompts, strings for standard ones, completion_ids, trainer_state, None = not applicable.
TRL_REWARDS = """
SEEN = {}


def capital(completions, answer, **kwargs):
    SEEN["capital"] = {"completion": completions[0], "keys": sorted(kwargs)}
    return [1.0 if a.lower() in c[0]["content"].lower() else 0.0 for c, a in zip(completions, answer)]


def reward_len(completions, **kwargs):
    SEEN["reward_len"] = {"completion": completions[0], "keys": sorted(kwargs)}
    return [-abs(20 - len(c)) for c in completions]


def by_step(prompts, completions, completion_ids, trainer_state, log_metric, **kwargs):
    SEEN.setdefault("steps", []).append(trainer_state.global_step)
    log_metric("mean_ids", sum(len(i) for i in completion_ids) / len(completion_ids))
    return [None if i == 0 else float(len(ids) % 2) for i, ids in enumerate(completion_ids)]
"""


def _plugin(tmp_path, monkeypatch, name="trl_style_rewards"):
    """Write TRL_REWARDS as module ``name``, register its functions, return the module."""
    import importlib

    from grpo_lens.rewards import REWARDS

    (tmp_path / f"{name}.py").write_text(TRL_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    for fn in (module.capital, module.reward_len, module.by_step):
        monkeypatch.setitem(REWARDS._entries, fn.__name__, fn)  # as @REWARDS.register would, undone after the test
    return module


def _jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.e2e
def test_case3_trl_reward_functions_run_unchanged(tmp_path, monkeypatch):
    """A conversational dataset with TRL's capital(completions, answer, **kwargs) (c[0]["content"]), and a standard
    one with reward_len(completions, **kwargs) on strings, through the CLI: exit 0, rewards scored (main: 'got
    multiple values for argument answer', then 'string indices must be integers', every rollout invalid)."""
    from grpo_lens.cli import main

    module = _plugin(tmp_path, monkeypatch)
    chat = _jsonl(
        tmp_path / "chat.jsonl",
        [
            {"prompt": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris"},
            {"prompt": [{"role": "user", "content": "Capital of Peru?"}], "answer": "Lima"},
        ],
    )
    plain = _jsonl(
        tmp_path / "plain.jsonl", [{"prompt": "Say something.", "topic": "x"}, {"prompt": "Say more.", "topic": "y"}]
    )
    common = [
        "train",
        "--model",
        "tiny",
        "--task",
        "jsonl",
        "--group-size",
        "4",
        "--prompts-per-step",
        "2",
        "--max-new-tokens",
        "4",
        "--lens-every",
        "0",
        "--no-progress",
        "--device",
        "cpu",
        "--no-save-final-model",
    ]
    assert (
        main(
            common
            + ["--dataset", chat, "--rewards", "capital", "by_step", "--max-steps", "2", "--out", str(tmp_path / "a")]
        )
        == 0
    )
    assert (
        main(common + ["--dataset", plain, "--rewards", "reward_len", "--max-steps", "1", "--out", str(tmp_path / "b")])
        == 0
    )
    seen = module.SEEN
    assert seen["capital"]["completion"][0]["role"] == "assistant"  # a message list for a chat prompt
    assert isinstance(seen["reward_len"]["completion"], str)  # a string for a string prompt
    assert {"prompts", "completion_ids", "trainer_state", "log_metric", "topic"} <= set(seen["reward_len"]["keys"])
    assert seen["steps"] == [0, 1, 2]  # 0: the start-up check on one row of the data, then steps 1 and 2
    from grpo_lens.rundir import RunDir

    a = RunDir(tmp_path / "a").read_metrics()
    assert all(r["reward/capital/invalid_count"] == 0 for r in a)
    assert all(r["reward/by_step/invalid_count"] == 1 for r in a)  # None = not applicable, one rollout a call
    assert all("reward/logged/mean_ids" in r for r in a)
    (b,) = RunDir(tmp_path / "b").read_metrics()
    assert b["reward/invalid_count"] == 0 and b["reward/mean"] < 0  # -|20 - len| of 4-token completions


def test_case3_reserved_column_refused_before_anything_runs(tmp_path):
    """A dataset column named completions, prompts, completion_ids or trainer_state is refused when the task is built
    (main: TypeError traceback at step 1), naming the column, the row and the fix; timeout_s is an ordinary column
    now (the constructed case: it collided with combine_rewards' own parameter)."""
    from grpo_lens.rewards import combine_rewards
    from grpo_lens.tasks import get_task

    for column in ("completions", "prompts", "completion_ids", "trainer_state"):
        path = _jsonl(tmp_path / f"{column}.jsonl", [{"prompt": "q", column: "x"}])
        with pytest.raises(ValueError, match=rf"row 1: column\(s\) '{column}' collide.*rename them"):
            get_task(path)
    path = _jsonl(tmp_path / "timeout.jsonl", [{"prompt": "q", "timeout_s": 3}])
    assert get_task(path).sample(1, 0)[0].columns() == {"timeout_s": 3}
    rewards, valid, _ = combine_rewards(
        [lambda completions, timeout_s, **kw: [float(t) for t in timeout_s]], ["q"], ["a"], columns={"timeout_s": [3]}
    )
    assert rewards.tolist() == [3.0]


def test_case3_positional_form_still_works():
    """The documented positional form f(p, c, **columns) keeps working: names other than prompts/completions get
    the two lists by position, and a function without **kwargs gets only the names it declares."""
    from grpo_lens.rewards import call_reward_function

    assert call_reward_function(
        lambda p, c, **k: [len(p), len(c), k["answer"][0]], ["q"], ["a"], columns={"answer": ["5"]}
    ) == [1, 1, "5"]
    assert call_reward_function(lambda completions: [completions[0]], ["q"], ["a"], columns={"answer": ["5"]}) == ["a"]


# ---------------------------------------------------------------------------------------------------------------------
# 4. a run where nothing can be scored
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_case4_nothing_scorable_is_refused_at_start(tmp_path):
    """The default correctness reward on data without an 'answer' column, and a reward function that always raises,
    fail before --out exists, naming the function and its error (main: exit 0, reward/mean 0.0 at every step)."""
    data = _jsonl(tmp_path / "no_answer.jsonl", [{"prompt": "What is 2 + 3?"}, {"prompt": "What is 1 + 1?"}])
    with pytest.raises(ValueError, match=r"reward 'correctness' fails on .*needs the reference answers"):
        loop.train(tiny_config(tmp_path, task="jsonl", dataset=data, rewards=["correctness"]))
    with pytest.raises(ValueError, match=r"reward 'test_raises' fails on .*RuntimeError: test reward function"):
        loop.train(tiny_config(tmp_path, rewards=["test_raises"]))
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_case4_steps_without_a_scorable_rollout_stop_the_run(tmp_path):
    """A function that raises at every step: after max_consecutive_skips = 2 such steps the run stops with
    NoScorableRolloutError before step 2's checkpoint; reward/mean is null (not 0.0) in both records."""
    config = tiny_config(
        tmp_path, rewards=["test_raises_in_training"], max_steps=4, max_consecutive_skips=2, checkpoint_every=1
    )
    with pytest.raises(loop.NoScorableRolloutError, match="no rollout could be scored for 2 consecutive steps"):
        loop.train(config)
    run = loop.RunDir(config.out)
    records = run.read_metrics()
    assert [r["step"] for r in records] == [1, 2]
    assert all(
        r["reward/mean"] is None and r["reward/std"] is None and r["reward/invalid_frac"] == 1.0 for r in records
    )
    assert run.latest_checkpoint().name == "step-000001"  # the last good state stays the last checkpoint


def test_case4_a_step_with_one_scorable_rollout_resets_the_count():
    """The constructed case: the counter counts consecutive unscored steps only, and a statistic over no valid
    rollout is NaN while one valid rollout gives its own value."""
    from grpo_lens.train.step_metrics import reward_metrics

    state = loop.RunState()
    for unscored in (True, True, False, True):
        state.count_unscored(unscored)
    assert state.guard["unscored"] == 1
    none = reward_metrics(torch.tensor([float("nan")] * 4), torch.zeros(4, dtype=torch.bool), 2)
    assert all(none[k] != none[k] for k in ("reward/mean", "reward/std", "reward/frac_zero_std_groups"))  # NaN
    one = reward_metrics(
        torch.tensor([0.5, float("nan"), float("nan"), float("nan")]), torch.tensor([True, False, False, False]), 2
    )
    assert one["reward/mean"] == 0.5 and one["reward/std"] == 0.0 and one["reward/invalid_frac"] == 0.75


# ---------------------------------------------------------------------------------------------------------------------
# 6. dynamic sampling and --num-mini-batches
# ---------------------------------------------------------------------------------------------------------------------
def test_case6_mini_batches_whatever_the_groups_kept():
    """M = 2 mini-batches of any number of kept groups: 3 groups of R = 2 give [2 groups, 1 group] (main: 3
    mini-batches of one group, so 3 optimizer steps); 1 group gives its 2 rollouts one each; 4 groups 2 + 2."""
    from grpo_lens.train.update import mini_batch_rows

    rows = lambda chunks: [c.tolist() for c in chunks]  # noqa: E731
    assert rows(mini_batch_rows(3, 2, 2)) == [[0, 1, 2, 3], [4, 5]]
    assert rows(mini_batch_rows(4, 2, 2)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rows(mini_batch_rows(1, 2, 2)) == [[0], [1]]
    # the constructed case: 5 kept groups into 4 mini-batches (main: 5 steps), and fewer rollouts than mini-batches
    assert [len(c) for c in mini_batch_rows(5, 3, 4)] == [6, 3, 3, 3]
    assert rows(mini_batch_rows(1, 2, 4)) == [[0], [1]]  # N = 2 < M: two steps, never an empty one


@pytest.mark.e2e
def test_case6_dynamic_sampling_takes_mu_times_m_optimizer_steps(tmp_path):
    """B = 4 groups of R = 2 with coin-flip rewards and no extra rounds, so steps keep 0-4 mixed groups: every step
    takes mu M = 2 optimizer steps (main: [2, 3, 2, 3, ...] with 3 kept groups taking 3)."""
    run = loop.train(
        tiny_config(
            tmp_path,
            rewards=["test_parity"],
            group_size=2,
            prompts_per_step=4,
            num_mini_batches=2,
            dynamic_sampling=True,
            dynamic_sampling_max_rounds=0,
            max_steps=4,
            learning_rate=1e-5,
        )
    )
    records = run.read_metrics()
    assert [r["grad/optimizer_steps"] for r in records] == [2, 2, 2, 2]
    assert len({r["dynamic/mixed_groups"] for r in records}) > 1  # the kept count did vary


# ---------------------------------------------------------------------------------------------------------------------
# 7. a failed start leaves --out as it was
# ---------------------------------------------------------------------------------------------------------------------
def base_model(name, dtype, device):
    """The tiny model with a tokenizer that has no chat template (a base model)."""
    model, tokenizer = build_tiny_model()
    tokenizer.chat_template = None
    return model, tokenizer


@pytest.mark.e2e
def test_case7_failed_starts_leave_out_untouched(tmp_path, monkeypatch):
    """No chat template with chat prompts, a lone surrogate in a prompt, a reserved column: each fails before --out
    exists (main: config.yaml left behind, so the retry was refused with 'already holds a run'), and the hint works:
    the base model trains from a JSONL file of string prompts."""
    from grpo_lens.cli import main

    out = tmp_path / "run"
    monkeypatch.setattr(loop, "load_model", base_model)
    with pytest.raises(ValueError, match=r"prompt 1: .*no chat template.*--task jsonl with string prompts"):
        loop.train(tiny_config(tmp_path))
    assert not out.exists()
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"prompt": "What is \\ud800 2 + 3?"}\n')
    reserved = _jsonl(tmp_path / "reserved.jsonl", [{"prompt": "q", "completions": "x"}])
    for data, why in ((str(surrogate), "lone surrogate"), (reserved, "collide with the keyword")):
        code = main(
            [
                "train",
                "--model",
                "tiny",
                "--task",
                "jsonl",
                "--dataset",
                data,
                "--rewards",
                "test_alternating",
                "--out",
                str(out),
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        assert code == 2 and not out.exists(), why
    plain = _jsonl(tmp_path / "plain.jsonl", [{"prompt": "2 + 3 ="}, {"prompt": "1 + 1 ="}])
    run = loop.train(tiny_config(tmp_path, task="jsonl", dataset=plain))
    assert [r["step"] for r in run.read_metrics()] == [1]


@pytest.mark.e2e
def test_case7_prompt_longer_than_the_context_is_refused(tmp_path, monkeypatch):
    """The constructed case (and item 9's 20,034-token prompt): a prompt that with max_new_tokens exceeds the model's
    positions is refused before --out exists, naming the row and both numbers."""

    def short_context(name, dtype, device):
        model, tokenizer = build_tiny_model()
        model.config.max_position_embeddings = 64
        return model, tokenizer

    monkeypatch.setattr(loop, "load_model", short_context)
    data = _jsonl(tmp_path / "long.jsonl", [{"prompt": "short"}, {"prompt": "x" * 100}])
    with pytest.raises(ValueError, match=r"row 2: the prompt is 1\d\d tokens.*more than the 64 positions"):
        loop.train(tiny_config(tmp_path, task="jsonl", dataset=data))
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------------
# 8. run-directory lines that are JSON but not records
# ---------------------------------------------------------------------------------------------------------------------
GOOD = '{"step": 1, "reward/mean": 0.5}'


@pytest.mark.parametrize(
    "bad,why",
    [
        ("5", "holds '5', which is not a record"),
        ('{"step": null}', "'step' is None, not a step number"),
        ('{"step": "2"}', "'step' is '2', not a step number"),
        ('{"step": 2, "reward', "not valid JSON"),  # a torn line that is not the last
    ],
)
def test_case8_one_reader_names_file_and_line(tmp_path, bad, why):
    """Every reader (resume, report, compare) goes through read_records, which names the file, the line and the fix
    (main: AttributeError / TypeError tracebacks, and compare named neither file nor line)."""
    from grpo_lens.report.compare import CompareError, read_run
    from grpo_lens.rundir import RunDir, RunDirError

    run = RunDir(tmp_path)
    run.metrics_path.write_text(f"{GOOD}\n{bad}\n{GOOD}\n")
    (tmp_path / "config.yaml").write_text("model: tiny\n")
    for read in (run.read_metrics, lambda: run.truncate_metrics(5)):
        with pytest.raises(RunDirError, match=rf"metrics.jsonl, line 2: .*{why}.*delete or repair that line"):
            read()
    with pytest.raises(CompareError, match="line 2"):
        read_run(tmp_path)


def test_case8_a_torn_last_line_is_skipped(tmp_path):
    """The constructed case: a line cut by a kill is the last one; it is skipped (and dropped on resume), while
    the same text before the last line is an error."""
    from grpo_lens.rundir import RunDir

    run = RunDir(tmp_path)
    run.metrics_path.write_text(f'{GOOD}\n{{"step": 2, "rew')
    assert run.read_metrics() == [{"step": 1, "reward/mean": 0.5}]
    run.truncate_metrics(1)
    assert run.metrics_path.read_text() == GOOD + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# 9. the smaller items
# ---------------------------------------------------------------------------------------------------------------------
def test_case9_decimal_then_number_is_not_a_thousands_group():
    """extract_answer("The two values are 1.5,250") is 250 (main: 1.5250, the comma read as a thousands separator
    after a decimal point); the constructed case: a real thousands group after a decimal elsewhere still merges."""
    from fractions import Fraction

    from grpo_lens.rewards import extract_answer

    assert extract_answer("The two values are 1.5,250") == 250
    assert extract_answer("0.5 of 1,250") == 1250
    assert extract_answer("#### $1,234.50") == Fraction("1234.5")


def test_case9_utf8_bom_is_not_data(tmp_path):
    """A JSONL file saved with a UTF-8 byte-order mark reads as without one (main: 'row 1: not valid JSON')."""
    from grpo_lens.tasks import get_task

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "What is 2 + 3?", "answer": "5"}\n')
    assert get_task(str(path)).sample(1, 0)[0].prompt == "What is 2 + 3?"


def test_case9_out_under_a_file_or_unwritable(tmp_path, monkeypatch):
    """--out under a file, or in a folder this user cannot write, is one RunDirError naming it (main: a
    FileExistsError / PermissionError traceback from mkdir)."""
    import os

    from grpo_lens.rundir import RunDir, RunDirError

    (tmp_path / "a_file").write_text("x")
    with pytest.raises(RunDirError, match="a_file is a file, so no run directory can be made under it"):
        RunDir(tmp_path / "a_file" / "run").resolve({}, resume=False, overwrite=False)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for a non-root user without write permission
    with pytest.raises(RunDirError, match="is not writable by this user"):
        RunDir(tmp_path / "new" / "run").resolve({}, resume=False, overwrite=False)


def test_case9_disk_full_is_one_line(tmp_path, monkeypatch, capsys):
    """A full disk while training is one line on stderr saying nothing written is lost and how to go on (main: an
    OSError traceback)."""
    import errno

    import grpo_lens.cli as cli

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))

    monkeypatch.setattr(cli, "_cmd_train", full)  # build_parser binds the command when main() runs
    assert cli.main(["train", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    # the stop's wording: "disk full while writing FILE; nothing lost ...; free space ... and resume"
    assert (
        f"disk full while writing {tmp_path / 'metrics.jsonl'}; nothing lost" in err and "resume with --resume" in err
    )
    assert "Traceback" not in err


def test_case9_model_directory_without_tokenizer(tmp_path):
    """A model directory with weights but no tokenizer files is named as such (main: transformers' message about
    sentencepiece / tiktoken)."""
    from grpo_lens.models import ModelSource

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds no tokenizer files .*tokenizer.save_pretrained"):
        checks.check_tokenizer_files(ModelSource("local", str(tmp_path)))
    (tmp_path / "tokenizer.json").write_text("{}")
    checks.check_tokenizer_files(ModelSource("local", str(tmp_path)))  # the constructed case: one file is enough


def test_case9_reward_function_metrics_cover_every_process():
    """Two processes, 4 rollouts each: reward/f is 1.0 over process 0's 2 valid rollouts and 0.0 over process 1's
    4, so the step's value is (2 * 1 + 4 * 0) / 6 = 1/3 (main: 1.0, the main process's share); counts add up,
    seconds take the slower process."""
    from grpo_lens.train.step_metrics import merge_reward_infos

    p0 = {"reward/f": 1.0, "reward/f/invalid_count": 2, "perf/reward_f_seconds": 0.5, "reward/error_count": 0}
    p1 = {"reward/f": 0.0, "reward/f/invalid_count": 0, "perf/reward_f_seconds": 0.7, "reward/error_count": 1}
    merged = merge_reward_infos([p0, p1], [4, 4])
    assert merged["reward/f"] == pytest.approx(1 / 3, abs=1e-15)
    assert merged["reward/f/invalid_count"] == 2 and merged["reward/error_count"] == 1
    assert merged["perf/reward_f_seconds"] == 0.7
    # the constructed case: a process where no rollout was valid (NaN) leaves the other's value alone
    p1_none = {"reward/f": float("nan"), "reward/f/invalid_count": 4}
    assert merge_reward_infos([p0, p1_none], [4, 4])["reward/f"] == 1.0


class _Lens:
    """A lens that offers the update capture and calls every group mixed."""

    update_capture = None

    @staticmethod
    def mixed_groups(rewards, valid, R):
        return list(range(len(rewards) // R))


class _OtherProcessSays:
    """A stand-in for Processes whose any() reports what another process would say."""

    def __init__(self, other: bool):
        self.other = other

    def any(self, flag: bool) -> bool:
        return bool(flag) or self.other


def test_lens_reads_update_agrees_across_processes(tmp_path):
    """lens_reads_update is one answer for all processes: True here, but False when another process cannot (its
    groups have a zero advantage), so no process opens the capture while another runs the lens's own pass."""
    from grpo_lens.train.update import lens_reads_update

    config = tiny_config(tmp_path, lens_every=1, gram_source="sketch")  # the exact Gram never reads the update
    rewards, valid = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.ones(4, dtype=torch.bool)
    adv = torch.tensor([0.5, -0.5, 0.5, -0.5])
    assert lens_reads_update(config, _Lens(), rewards, valid, adv, _OtherProcessSays(False))
    assert not lens_reads_update(config, _Lens(), rewards, valid, adv, _OtherProcessSays(True))
    assert not lens_reads_update(config, _Lens(), rewards, valid, torch.zeros(4), _OtherProcessSays(False))
    # the exact Gram (the default source) needs every rollout in one backward: it never reads the micro-batched update
    exact = tiny_config(tmp_path, lens_every=1)
    assert exact.gram_source == "exact"
    assert not lens_reads_update(exact, _Lens(), rewards, valid, adv, _OtherProcessSays(False))


@pytest.mark.e2e
def test_case5_kl_in_reward_moves_the_reward_not_the_loss(tmp_path):
    """--kl-in-reward: the loss has no KL term (loss/kl 0) and the step's rewards are the raw ones (test_alternating:
    mean 0.5) minus the mean penalty; once the policy has moved (lr 1e-2) the penalty is no longer float noise."""
    run = loop.train(tiny_config(tmp_path, beta=0.5, kl_in_reward=True, max_steps=2, learning_rate=1e-2))
    first, second = run.read_metrics()
    for r in (first, second):
        assert r["loss/kl"] == 0.0
        assert r["reward/mean"] == pytest.approx(0.5 - r["reward/kl_penalty"], abs=1e-6)
    assert abs(first["reward/kl_penalty"]) < 1e-4  # pi_old = pi_ref at step 1
    assert abs(second["reward/kl_penalty"]) > 1e-3
