"""The 0.1 import paths that the README and docs/ showed still import, from their new homes, with a DeprecationWarning
(grpo_lens/_legacy.py; removed in the next release)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings

import pytest

# (old module, name) as the 0.1 README, docs/theory.md and docs/metrics.md wrote them, and where each lives now
SHOWN = [
    ("grpo_lens.advantages", "compute_advantages", "grpo_lens.formulas.advantages"),
    ("grpo_lens.advantages", "optimal_baseline_advantages", "grpo_lens.formulas.advantages"),
    ("grpo_lens.diagnostics", "analyse_group", "grpo_lens.analysis.group"),
    ("grpo_lens.diagnostics", "rank_measures", "grpo_lens.formulas.spectrum"),
    ("grpo_lens.diagnostics", "g1_spectra", "grpo_lens.formulas.spectrum"),  # the 0.1 README's Python example
    ("grpo_lens.diagnostics", "rank2_residual", "grpo_lens.formulas.identity"),
    ("grpo_lens.diagnostics", "sketch_rollout_grads", "grpo_lens.gradients.sketch"),
    ("grpo_lens.diagnostics.spectrum", "rank_measures", "grpo_lens.formulas.spectrum"),
    ("grpo_lens.diagnostics.baselines", "aggregation_rollout_weights", "grpo_lens.formulas.losses"),
    ("grpo_lens.diagnostics.baselines", "sketched_rollout_sq_norms", "grpo_lens.gradients.sketch"),
    ("grpo_lens.diagnostics.gradients", "rollout_scores", "grpo_lens.gradients.scores"),
    ("grpo_lens.diagnostics.sparsity", "unbiased_zero_variance_probability", "grpo_lens.formulas.sparsity"),
    ("grpo_lens.diagnostics.baseline_study", "baseline_study", "grpo_lens.formulas.baselines"),
    ("grpo_lens.diagnostics.token_credit", "signed_token_contributions", "grpo_lens.gradients.token_credit"),
    ("grpo_lens.lens", "scores_from_update_rows", "grpo_lens.train.lens"),
    ("grpo_lens.lora", "lora_rollout_grads", "grpo_lens.gradients.lora_spaces"),
    ("grpo_lens.losses", "LOG_RATIO_CLAMP", "grpo_lens.formulas.losses"),
    ("grpo_lens.losses", "mismatch_sums", "grpo_lens.formulas.losses"),
    ("grpo_lens.losses", "truncated_is_weights", "grpo_lens.formulas.losses"),
    ("grpo_lens.overlong", "overlong_loss_mask", "grpo_lens.formulas.overlong"),
    ("grpo_lens.studies", "run_baseline_study", "grpo_lens.probe.studies"),
    ("grpo_lens.trainer", "auto_micro_batch_size", "grpo_lens.train.memory"),
    ("grpo_lens.trainer", "policy_update", "grpo_lens.train.update"),
    ("grpo_lens.trainer", "train", "grpo_lens.train.loop"),
    ("grpo_lens.claims_measures", "group_mean_optimal", "grpo_lens.claims.baselines"),
    ("grpo_lens.claims", "erank_near_two", "grpo_lens.claims.rank"),
    ("grpo_lens.probe", "probe_group_size", "grpo_lens.probe.run"),
    ("grpo_lens.compare", "compare_runs", "grpo_lens.report.compare"),
    ("grpo_lens.dynamic_sampling", "collect_mixed_groups", "grpo_lens.train.dynamic_sampling"),
]
# paths that did not move: no warning
UNMOVED = [("grpo_lens.models", "load_model"), ("grpo_lens.rewards", "REWARDS"), ("grpo_lens.tasks", "TASKS"),
           ("grpo_lens.tasks", "correctness_verdict"), ("grpo_lens.rollout", "token_logprobs"),
           ("grpo_lens.integrations.trl", "LensGRPOTrainer"), ("grpo_lens.claims", "CLAIMS"), ("grpo_lens.cli", "main"),
           ("grpo_lens.probe", "run_probe")]


CHECK = """
import importlib, json, sys, warnings
out = []
for old, name, new in json.loads(sys.argv[1]):
    for m in [m for m in sys.modules if m == old or m.startswith(old + ".")]:
        if type(sys.modules[m]).__name__ == "_MovedModule":
            del sys.modules[m]  # import it afresh, as a user's first import would
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(importlib.import_module(old), name)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    out.append([old, name, value is getattr(importlib.import_module(new), name), messages])
print(json.dumps(out))
"""


@pytest.mark.e2e
def test_every_shown_old_path_is_the_new_object_with_a_deprecation_warning():
    # a fresh interpreter: the warning is raised where the old path is first imported or read
    result = subprocess.run([sys.executable, "-c", CHECK, json.dumps(SHOWN)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    for (old, name, new), (_, _, same, messages) in zip(SHOWN, json.loads(result.stdout)):
        assert same, f"{old}.{name} is not {new}.{name}"
        assert messages, f"{old}.{name}: no DeprecationWarning"
        # the message says it is the 0.1 layout and names the package to import from
        assert any("0.2" in m and new.split(".")[1] in m for m in messages), (old, name, messages)


@pytest.mark.parametrize("module, name", UNMOVED)
def test_paths_that_did_not_move_import_without_a_warning(module, name, recwarn):
    assert getattr(importlib.import_module(module), name) is not None
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "grpo-lens 0.2" in str(w.message)]


def test_an_unknown_name_on_an_old_path_is_an_attribute_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module("grpo_lens.diagnostics")
    with pytest.raises(AttributeError, match="no attribute 'no_such_function'"):
        module.no_such_function  # noqa: B018
