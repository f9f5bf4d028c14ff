"""grpo-lens compare of a TRL run (config.yaml with TRL's values under ``trl``) beside a grpo-lens run: settings are
compared under grpo-lens' names, so equal settings list no difference and one real difference lists exactly it."""

from __future__ import annotations

import json

import pytest
import yaml

from grpo_lens.report.compare import CompareError, compare_runs

#: A grpo-lens run's settings (a subset of TrainConfig's fields, as config.yaml writes them).
GRPO_LENS = {
    "model": "tiny",
    "task": "arithmetic",
    "dataset": None,
    "task_options": {},
    "rewards": ["correctness"],
    "group_size": 4,
    "prompts_per_step": 2,
    "rollout_batch_size": None,
    "max_new_tokens": 16,
    "temperature": 0.7,
    "top_p": 1.0,
    "top_k": 0,
    "overlong": "none",
    "mask_truncated": False,
    "estimator": "grpo",
    "std": "sample",
    "std_eps": 1e-4,
    "loss_aggregation": "seq-mean-token-mean",
    "beta": 0.0,
    "kl_estimator": "k3",
    "eps_low": 0.2,
    "eps_high": 0.2,
    "mu": 1,
    "num_mini_batches": 1,
    "micro_batch_size": None,
    "max_steps": 2,
    "learning_rate": 5e-6,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.99,
    "max_grad_norm": 1.0,
    "lr_scheduler": "constant",
    "warmup_steps": 0.0,
    "lens_every": 1,
    "sketch_dim": 16,
    "gram_source": "exact",
    "lens_space": "trainable",
    "lora_rank": 0,
    "seed": 0,
    "dtype": "float32",
    "out": "x",
}


def trl_config(**trl):
    """A config.yaml as grpo_lens.integrations.trl.run_config writes it for the same settings as GRPO_LENS."""
    given = {
        "num_generations": 4,
        "max_completion_length": 16,
        "num_iterations": 1,
        "epsilon": 0.2,
        "epsilon_high": None,
        "beta": 0.0,
        "loss_type": "grpo",
        "scale_rewards": "group",
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 0,
        "learning_rate": 5e-6,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "max_grad_norm": 1.0,
        "weight_decay": 0.0,
        "seed": 0,
        "mask_truncated_completions": False,
        **trl,
    }
    return {
        "trainer": "trl",
        "trl_version": "1.16.0",
        "model": "tiny",
        "group_size": given["num_generations"],
        "rollout_batch_size": given["per_device_train_batch_size"] * given["steps_per_generation"],
        "max_new_tokens": given["max_completion_length"],
        "temperature": given["temperature"],
        "estimator": "grpo",
        "std": "sample",
        "std_eps": 1e-4,
        "loss_aggregation": "seq-mean-token-mean",
        "beta": given["beta"],
        "eps_low": given["epsilon"],
        "eps_high": given["epsilon"],
        "mu": given["num_iterations"],
        "max_steps": 2,
        "learning_rate": given["learning_rate"],
        "lr_scheduler": "constant",
        "warmup_steps": 0.0,
        "lens_every": 1,
        "sketch_dim": 16,
        "gram_source": "exact",
        "lens_space": "trainable",
        "lora_rank": 0,
        "seed": 0,
        "trl": given,
    }


def write_run(path, config):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in (1, 2)))
    return path


@pytest.mark.e2e
def test_trl_run_with_equal_settings_differs_in_nothing(tmp_path):
    trl = write_run(tmp_path / "trl", trl_config())
    ours = write_run(tmp_path / "ours", GRPO_LENS)
    md = compare_runs([trl, ours], tmp_path / "cmp", allow_different_tasks=True)
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["differing_config"] == {}
    assert "None: the runs share every setting" in md.read_text()


@pytest.mark.e2e
def test_trl_run_lists_exactly_the_real_difference(tmp_path):
    # TRL's top_p lives only in the `trl` block: it is compared once translated, under grpo-lens' name
    trl = write_run(tmp_path / "trl", trl_config(top_p=0.9))
    ours = write_run(tmp_path / "ours", GRPO_LENS)
    compare_runs([trl, ours], tmp_path / "cmp", allow_different_tasks=True)
    diff = json.loads((tmp_path / "cmp" / "compare.json").read_text())["differing_config"]
    assert diff == {"top_p": {"trl": 0.9, "ours": 1.0}}


@pytest.mark.e2e
def test_trl_run_needs_allow_different_tasks_and_says_its_task_is_not_recorded(tmp_path):
    # a TRL run's config has no task: compare cannot check the runs share one, so it refuses (before writing) unless
    # asked, and then names each run's task instead of labelling both with the grpo-lens run's
    trl = write_run(tmp_path / "trl", trl_config())
    ours = write_run(tmp_path / "ours", {**GRPO_LENS, "task": "gsm8k"})
    with pytest.raises(CompareError, match="trl: a TRL run does not record its task"):
        compare_runs([trl, ours], tmp_path / "cmp")
    assert not (tmp_path / "cmp").exists()
    md = compare_runs([trl, ours], tmp_path / "cmp", allow_different_tasks=True).read_text()
    # run names and tasks are code spans (compare.md escapes what comes from the runs' files)
    assert (
        "Task: `trl`: not recorded (a TRL run: the task is its script's); `ours`: `gsm8k` (compared on request)" in md
    )


@pytest.mark.e2e
def test_the_default_models_alias_and_its_converted_folder_are_one_model(tmp_path, monkeypatch):
    # a TRL run records the folder model_folder() converted the default GGUF to; a grpo-lens run records the alias:
    # one model, so compare lists no difference (a new user saw `model` listed); a different folder still differs
    from grpo_lens import models

    gguf = tmp_path / "wheel" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "default_model_dir", lambda: gguf.parent)
    monkeypatch.setattr(models, "DEFAULT_MODEL_GGUF", "m.gguf")
    monkeypatch.setenv("GRPO_LENS_CACHE", str(tmp_path / "cache"))
    folder = models._gguf_cache_path(models.resolve_model("smollm2-135m-instruct"))
    folder.mkdir(parents=True)
    assert models.same_model_key(folder) == models.same_model_key("smollm2-135m-instruct")
    trl = write_run(tmp_path / "trl", {**trl_config(), "model": str(folder)})
    ours = write_run(tmp_path / "ours", {**GRPO_LENS, "model": "smollm2-135m-instruct"})
    compare_runs([trl, ours], tmp_path / "cmp", allow_different_tasks=True)
    assert "model" not in json.loads((tmp_path / "cmp" / "compare.json").read_text())["differing_config"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    trl2 = write_run(tmp_path / "trl2", {**trl_config(), "model": str(other)})
    compare_runs([trl2, ours], tmp_path / "cmp2", allow_different_tasks=True)
    assert "model" in json.loads((tmp_path / "cmp2" / "compare.json").read_text())["differing_config"]


def test_compare_numbers_have_three_significant_digits_and_no_trailing_point():
    # a new user saw "202." and "0.00" beside "0.250": '#' kept the point and zeros
    from grpo_lens.report.format import fmt_sig

    assert [fmt_sig(x) for x in (202.0, 0.0, 0.25, 13.33, 1e-4, 1234.4, None)] == [
        "202",
        "0",
        "0.250",
        "13.3",
        "0.000100",
        "1234",
        "–",
    ]


def test_a_one_step_span_reads_step_n():
    # trial 4 read "(steps 2–2, n=1 ...)" for a metric logged at one step
    from grpo_lens.report.compare import _steps

    assert (_steps((2, 2)), _steps((3, 10))) == ("step 2", "steps 3–10")
