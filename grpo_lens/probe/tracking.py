"""``grpo-lens probe --report-to``: a finished probe's numbers sent to the trackers ``train`` has
(:mod:`grpo_lens.trackers`: TensorBoard, W&B, trackio), read back from OUT/probe.json (the source of truth).

What a tracker gets, at step = the group size R (so a dashboard plots each number against R):

- every per-group key's mean over the analysed groups (``summary``), under its canonical name (``rank/g1_erank``,
  ``zero_sum/span_energy_excess``, ...; docs/metrics.md);
- ``probe/prompts_sampled``, ``probe/groups_mixed``, ``probe/groups_all_equal``, ``probe/groups_invalid``,
  ``probe/s1_measured``, ``probe/s1_predicted``;

and, once, the claims table (claim, scope, verdict, measurement, rule) as a table named ``claims`` (W&B table,
TensorBoard text). The run's hyperparameters are the probe's settings. A pooled probe (``--seeds``) logs the pooled
numbers under DIR's name, and each seed's probe logs its own under ``seed_<s>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_lens import metrics as mk
from grpo_lens.claims import evaluate_claims
from grpo_lens.trackers import Trackers

#: the per-R counts and shares a tracker gets, under ``probe/<key>``
COUNT_KEYS = (
    mk.PROMPTS_SAMPLED,
    mk.GROUPS_MIXED,
    mk.GROUPS_ALL_EQUAL,
    mk.GROUPS_INVALID,
    mk.S1_MEASURED,
    mk.S1_PREDICTED,
)


def probe_records(probe: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """[(R, record)] in increasing R: each record holds the summary means and :data:`COUNT_KEYS` of group size R
    (None where not measured; :func:`grpo_lens.trackers.scalars` drops those)."""
    out = []
    for R in sorted(probe.get("per_group_size", {}), key=int):
        d = probe["per_group_size"][R]
        record = {key: s.get("mean") for key, s in (d.get(mk.PROBE_SUMMARY) or {}).items() if isinstance(s, dict)}
        record.update({f"probe/{k}": d.get(k) for k in COUNT_KEYS})
        out.append((int(R), record))
    return out


def claims_rows(probe: dict[str, Any]) -> list[dict[str, str]]:
    """The claims table of a probe (:func:`grpo_lens.claims.evaluate_claims`) as rows of text."""
    return [
        {k: getattr(c, k) for k in ("claim", "scope", "verdict", "measurement", "rule")} for c in evaluate_claims(probe)
    ]


def log_probe(out: str | Path, names: list[str], config: dict[str, Any]) -> None:
    """Send OUT/probe.json's numbers and claims table to the trackers ``names`` (``--report-to``; ``none`` or empty:
    nothing), with ``config`` as the run's hyperparameters.

    Raises:
        ValueError: an unknown tracker or one whose library is missing (:func:`grpo_lens.trackers.check_trackers`).
    """
    if not [n for n in names if n != "none"]:
        return
    out = Path(out)
    probe = json.loads((out / "probe.json").read_text())
    trackers = Trackers(names, out, config)
    try:
        for R, record in probe_records(probe):
            trackers.log(record, step=R)
        trackers.log_table("claims", claims_rows(probe), step=0)
    finally:
        trackers.finish()
