"""The report opens with one line per decided claim and groups the undecided ones by claim and reason."""

from __future__ import annotations

from grpo_lens.claims.base import DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, Claim
from grpo_lens.report.answers import answer_lines, claim_sources


def claim(name, scope, verdict, rule):
    return Claim(claim=name, scope=scope, measurement="m", control="c", verdict=verdict, rule=rule, source="s")


def test_decided_claims_get_one_line_and_undecided_ones_are_grouped_by_reason():
    sources = {
        "training": [claim("S4", "training, step 4", DOES_NOT_HOLD, "excess [-0.004, -0.002] vs 0.05")],
        "before": [
            claim("rank 2", "R = 4", INCONCLUSIVE, "1 groups < 8"),
            claim("identity", "all R", HOLDS, "max residual 1e-09 < 1e-04"),
        ],
        "after": [
            claim("rank 2", "R = 4", INCONCLUSIVE, "1 groups < 8"),
            claim("rank 2", "R = 2", INCONCLUSIVE, "R = 2 caps erank at 2"),
        ],
    }
    lines = answer_lines(sources)
    assert lines[0] == "## Answers"
    # the scope already names the source: no "training, training"
    assert "- **does not hold**: S4 (training, step 4): excess [-0.004, -0.002] vs 0.05" in lines
    assert "- **holds**: identity (before, all R): max residual 1e-09 < 1e-04" in lines
    assert "- rank 2 (before, R = 4; after, R = 4): 1 groups < 8" in lines  # one line for the same reason
    assert "- rank 2 (after, R = 2): R = 2 caps erank at 2" in lines
    assert lines.index("- rank 2 (before, R = 4; after, R = 4): 1 groups < 8") > lines.index(
        "- **holds**: identity (before, all R): max residual 1e-09 < 1e-04"
    ), "decided claims come first"


def test_the_probes_claims_open_the_answers_before_trainings():
    # a new user looked for "is the gradient rank 2?" and found the S4 sparsity line first: the probes' claims
    # (rank, zero-sum, identity) now come before the training run's (sparsity over training)
    sources = claim_sources({"before": {"meta": {}, "per_group_size": {}}}, [{"step": 1, "reward/mean": 0.5}])
    assert list(sources) == ["before", "training"]
