"""The report's opening: one line per decided claim (verdict, the claim, where, the number that decided it), then
the undecided ones grouped by what would decide them.

The lines are the claims' own records (:func:`grpo_lens.claims.base.evaluate_claims`): a claim's ``rule`` text holds
the numbers its rule compared (the interval and the bound, or the count that fell short), so nothing here
re-derives a verdict. Undecided claims (inconclusive) that share a claim and a reason are one line listing their
scopes: a reader sees in a few lines which claims were decided and, for the rest, the one thing that would decide
them.
"""

from __future__ import annotations

from typing import Any

from grpo_lens.claims.base import INCONCLUSIVE, Claim, evaluate_claims, holm_claims
from grpo_lens.claims.sparsity import TRAINING_CLAIMS
from grpo_lens.report.format import mark_few


def training_data(
    records: list[dict[str, Any]], lora_rank: int = 0, seed_runs: list[list[dict[str, Any]]] | None = None
) -> dict[str, Any]:
    """What the claims over training read: the run's records, and with ``train --seeds`` every seed's records
    (``seeds``: the trends and "rank stays" are then decided over the seeds)."""
    return {"records": records, "lora_rank": lora_rank, **({"seeds": seed_runs} if seed_runs else {})}


def claim_sources(
    probes: dict[str, dict[str, Any]],
    records: list[dict[str, Any]] | None,
    lora_rank: int = 0,
    seed_runs: list[list[dict[str, Any]]] | None = None,
) -> dict[str, list[Claim]]:
    """{source label: its claims}: each probe first (the rank claims, the question a reader opens the report with),
    then ``training`` (the run's records: sparsity over training; ``seed_runs``: every seed's, from `train --seeds`)."""
    sources: dict[str, list[Claim]] = {label: evaluate_claims(probe) for label, probe in probes.items()}
    if records:
        sources["training"] = evaluate_claims(training_data(records, lora_rank, seed_runs), list(TRAINING_CLAIMS))
    # the verdicts of the claims table: the primary claims of every source under one Holm (issue 29)
    flat, _ = holm_claims([c for claims in sources.values() for c in claims])
    out, i = {}, 0
    for label, claims in sources.items():
        out[label], i = flat[i : i + len(claims)], i + len(claims)
    return out


def answer_lines(sources: dict[str, list[Claim]]) -> list[str]:
    """The Markdown lines of the answers: decided claims one per line, then the undecided ones grouped."""
    multi = len(sources) > 1
    decided, undecided = [], {}
    for label, claims in sources.items():
        for c in claims:
            if c.kind == "descriptive":  # no verdict: in the table's descriptive list only
                continue
            where = f"{label}, {c.scope}" if multi and not c.scope.startswith(label) else c.scope
            if c.verdict == INCONCLUSIVE:
                undecided.setdefault((c.claim, c.rule + (f". To decide: {c.advice}" if c.advice else "")), []).append(
                    where
                )
            else:
                check = " (check, not a test)" if c.kind == "check" else ""
                decided.append(f"- **{c.verdict}**{check}: {c.claim} ({where}): {c.rule}")
    lines = ["## Answers", ""]
    if decided:
        lines += ["Decided (verdict: claim (where): the numbers the rule compared):", "", *decided, ""]
    if undecided:
        lines += ["Not decided (inconclusive), with what would decide them:", ""]
        lines += [f"- {claim} ({'; '.join(wheres)}): {rule}" for (claim, rule), wheres in undecided.items()]
        lines.append("")
    if not decided and not undecided:
        lines += ["No claim could be evaluated on this run.", ""]
    lines += ["The full claims table, with each measurement, its control and the rule, is in the appendix.", ""]
    return lines


def answers_section(
    probes: dict[str, dict[str, Any]],
    records: list[dict[str, Any]] | None,
    lora_rank: int = 0,
    seed_runs: list[list[dict[str, Any]]] | None = None,
) -> list[str]:
    """The report's first section (:func:`answer_lines` of :func:`claim_sources`); empty when the run has neither a
    probe nor lens records."""
    sources = claim_sources(probes, records, lora_rank, seed_runs)
    if not any(sources.values()):
        return []
    return [mark_few(line) for line in answer_lines(sources)]  # "(n = 4 groups)†", as the tables print it
