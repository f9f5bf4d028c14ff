"""The report's section on one probe (:func:`probe_section`), read from its probe.json.

One function per subsection, called in order by :func:`probe_section`:

header_lines        the model, task and gradient source; the sketch's check against exact gradients
groups_lines        per R: prompts, all-equal and mixed groups, S1 measured and predicted, the identity, G2's rank
rank_lines          "Effective rank vs group size, beside the orthogonal null": :func:`rank_table`, erank vs R
weighting_tables    "Zero-sum or not: G3 and G2 under other weightings"
strata_lines        "Stratified by k" and "Stratified by distinct completions" (:func:`strata_table`)
zero_sum_lines      "Zero-sum structure: label-permutation test with k fixed"
baselines_lines     "Baselines": gradient variance under each baseline relative to b*
credit_lines        "Credit": the per-token advantage within a rollout
(studies)           the probe's studies (:mod:`.studies`)

Each appends its sentences to ``findings`` in the order the report lists them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpo_lens import metrics as mk
from grpo_lens.formulas.zero_sum import WEIGHTINGS
from grpo_lens.report import plots
from grpo_lens.report.format import ci, fmt, md_row, md_table
from grpo_lens.report.studies import studies_section


def _ci(stats: dict[str, Any] | None, nd: int = 2) -> str:
    """:func:`grpo_lens.report.format.ci` with two decimals by default (this module's tables; the training measures
    and the studies print three)."""
    return ci(stats, nd)


#: (row label, key stem) of the rank table: G1, its null and controls, one layer's G1, G2.
RANK_ROWS = (
    ("G1 (rows A_i g_i)", "g1"),
    ("orthogonal null (|A_i| ||g_i||)", "g1_null"),
    ("G1_no_adv (rows g_i)", "g1_no_adv"),
    ("G1_random_zero_sum", "g1_random"),
    ("G1_nll", "g1_nll"),
    ("G1_layer", "g1_layer"),
    ("G2 (layer weight gradient)", "g2"),
)


def _group_values(per_size: dict[str, Any], key: str) -> list[Any]:
    """The recorded values of ``key`` over one group size's groups (``per_size[PROBE_GROUPS]``, a list of per-group
    dicts), in group order; a group without the key, or with it None, is left out."""
    return [g[key] for g in per_size.get(mk.PROBE_GROUPS, []) if g.get(key) is not None]


def _by_group_size(probe: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Each group size of ``probe`` in increasing order: ``(R, per_size, summary)``, ``per_size`` its
    ``per_group_size[R]`` and ``summary`` that entry's :data:`grpo_lens.metrics.PROBE_SUMMARY` ({} when absent)."""
    per_group_size = probe["per_group_size"]
    for R in sorted(per_group_size, key=int):
        yield R, per_group_size[R], per_group_size[R].get(mk.PROBE_SUMMARY, {})


def rank_table(
    probe: dict[str, Any], measures: tuple[str, ...] = ("erank", "stable_rank", "participation_ratio", "k90")
) -> list[str]:
    """Markdown table: rows = (R, matrix), columns = rank measures as mean [95% interval] over groups,
    plus G1's ratio to the orthogonal null and G3 (one matrix over the analysed groups, no interval)."""
    lines = md_table(["R", "matrix", "groups", *measures])
    for R, d, summ in _by_group_size(probe):
        for label, stem in RANK_ROWS:
            cells = [_ci(summ.get(mk.rank_key(stem, m))) for m in measures]
            n = (summ.get(mk.rank_key(stem, measures[0])) or {}).get("n", 0)
            if n:
                lines.append(md_row(R, label, n, *cells))
        cells = [_ci(summ.get(mk.RANK_G1_VS_NULL.format(m=m))) for m in measures]
        n = (summ.get(mk.RANK_G1_VS_NULL.format(m=measures[0])) or {}).get("n", 0)
        if n:
            lines.append(md_row(R, "G1 / null (ratio)", n, *cells))
        g3 = d.get(mk.PROBE_G3, {})
        if g3.get(mk.rank_key("g3", measures[0])) is not None:
            lines.append(
                md_row(
                    R,
                    "G3 (rows = groups' updates)",
                    g3.get(mk.G3_GROUPS),
                    *(
                        f"{fmt(g3.get(mk.rank_key('g3', m)), 2)} (null {fmt(g3.get(mk.rank_key('g3_null', m)), 2)})"
                        for m in measures
                    ),
                )
            )
    return lines


WEIGHTING_LABELS = {
    "adv": "A",
    "abs": "|A|",
    "shift": "A + mean|A|",
    "reward": "r",
    "uniform": "1",
    "single": "one rollout",
}


def weighting_tables(probe: dict[str, Any]) -> list[str]:
    """G3 and G2 (every layer, by layer type) under the weightings A, |A|, A + mean|A|, r, 1 and a single rollout:
    if a rank ≈ 2 came from the zero-sum advantages, A would stand apart from the weightings that are not zero-sum."""
    layers = (probe["meta"].get("config") or {}).get("layers")  # probe --layers PATTERN
    kept = f" (the layers --layers {layers!r} keeps)" if layers else ""
    lines = [
        "### Zero-sum or not: G3 and G2 under other weightings",
        "",
        "Rows weighted by A (GRPO), |A|, A + mean|A| and r (not zero-sum), 1 (no advantages) and a single "
        "rollout. "
        "G3: one matrix per R over the analysed groups, its stable rank (no interval: resampling its rows would "
        f"repeat rows and lower the rank). G2: every linear layer's weight gradient of the group loss{kept}, "
        "mean stable rank over the layers "
        "of each type, on the first --g2-groups group(s) of each R (mean over those groups).",
        "",
        *md_table(["R", "matrix", *(WEIGHTING_LABELS[w] for w in WEIGHTINGS)]),
    ]
    for R, d, _ in _by_group_size(probe):
        g3 = d.get(mk.PROBE_G3) or {}
        if g3.get(mk.rank_key("g3", "stable_rank")) is not None:
            cells = []
            for w in WEIGHTINGS:
                key = mk.rank_key("g3" if w == "adv" else f"g3_{w}", "stable_rank")
                cells.append(fmt(g3.get(key), 2))
            lines.append(md_row(R, f"G3 stable rank ({g3.get(mk.G3_GROUPS)} groups)", *cells))
        g2 = (d.get(mk.PROBE_G2_WEIGHTINGS) or {}).get(mk.PROBE_SUMMARY) or {}
        parsed = [mk.RANK_G2_WEIGHTED.parse(k) for k in g2]
        types = sorted({p["kind"] for p in parsed if p is not None and p["w"] == "adv"})
        for t in types:
            cells = [fmt((g2.get(mk.RANK_G2_WEIGHTED.format(w=w, kind=t)) or {}).get("mean"), 2) for w in WEIGHTINGS]
            n = (g2.get(mk.RANK_G2_WEIGHTED.format(w="adv", kind=t)) or {}).get("n")
            lines.append(md_row(R, f"G2 {t} stable rank ({n} group(s))", *cells))
    return lines + [""]


def strata_table(probe: dict[str, Any], by: str) -> list[str]:
    """Markdown table of G1 vs its null and the zero-sum statistics per stratum (``by`` = "correct" or "distinct")."""
    head = "k (correct)" if by == "correct" else "distinct completions"
    lines = md_table(
        [
            "R",
            head,
            "groups",
            "G1 erank",
            "null erank",
            "G1 / null erank",
            "G1 stable rank",
            "null stable rank",
            "span energy",
            "span energy, relabelled",
            "cos gap",
        ]
    )
    for R, d, _ in _by_group_size(probe):
        for stratum, summ in d.get(mk.PROBE_STRATA, {}).get(by, {}).items():
            n = (summ.get(mk.rank_key("g1", "erank")) or {}).get("n", 0)
            lines.append(
                md_row(
                    R,
                    stratum,
                    n,
                    _ci(summ.get(mk.rank_key("g1", "erank"))),
                    _ci(summ.get(mk.rank_key("g1_null", "erank"))),
                    _ci(summ.get(mk.RANK_G1_VS_NULL.format(m="erank"))),
                    _ci(summ.get(mk.rank_key("g1", "stable_rank"))),
                    _ci(summ.get(mk.rank_key("g1_null", "stable_rank"))),
                    _ci(summ.get(mk.ZERO_SUM_SPAN_ENERGY)),
                    _ci(summ.get(mk.ZERO_SUM_SPAN_ENERGY_NULL)),
                    _ci(summ.get(mk.ZERO_SUM_COS_GAP), 3),
                )
            )
    return lines


def _g2_cell(summ: dict[str, Any]) -> str:
    """'rank / bound' means over groups (the bound is prompt tokens + distinct completion prefixes)."""
    rk, bd = summ.get(mk.RANK_G2_NUMERICAL_RANK) or {}, summ.get(mk.RANK_G2_RANK_BOUND) or {}
    if rk.get("mean") is None:
        return "–"
    return f"{fmt(rk['mean'], 1)} / {fmt(bd.get('mean'), 1)}"


def header_lines(label: str, probe: dict[str, Any]) -> list[str]:
    """The section's heading and opening: model, task, the per-rollout gradients' source, std convention and eps;
    for a probe that did not use exact gradients of every parameter, the sketch's check against them (coverage,
    exact shares, G1's Gram error and its bound, the erank error) or that it was not checked."""
    meta = probe.get("meta", {})
    source = (
        "exact per-rollout gradients of every parameter"
        if meta.get("gradients") == "exact"
        else f"the exact Gram of the per-rollout gradients (coverage {fmt(meta.get('gram_coverage'), 2)} of "
        f"Σ||g_i||², every parameter; G3 from the sketch)"
        if meta.get("gradients") == "exact_gram"
        else f"sketched per-rollout gradients ({meta.get('sketch_dim')} per side per nn.Linear weight)"
    )
    lines = [
        f"## Gradient probe: {label}",
        "",
        f"Model {meta.get('model')}, task {meta.get('task')}, {source}, std convention {meta.get('std')}, "
        f"eps {meta.get('eps')}. Every mean is over the analysed (mixed) groups, with its 95% "
        "interval over groups in brackets (Hall's transformed t, docs/theory.md §7).",
        "",
    ]
    check = meta.get("sketch_check") or {}
    if meta.get("gradients") != "exact":
        cov = check.get(mk.SKETCH_COVERAGE)
        if cov:
            lines += [
                f"Sketch checked against exact gradients of every parameter on {cov.get('n')} group(s): it "
                f"carries {_ci(cov)} of Σ||g_i||² (Σ||S g_i||² / Σ||g_i||², the sketch's estimate of the "
                f"linear weights' share, which can exceed 1 by its error; exact shares: linear weights "
                f"{_ci(check.get(mk.SKETCH_EXACT_SHARE_LINEAR))}, embedding "
                f"{_ci(check.get(mk.SKETCH_EXACT_SHARE_EMBEDDING))}, norms "
                f"{_ci(check.get(mk.SKETCH_EXACT_SHARE_NORM))}); G1's Gram error, measured "
                f"{_ci(check.get(mk.SKETCH_GRAM_ERROR))} (missing parameters and projection noise), bound for the "
                f"sketched layers {_ci(check.get(mk.SKETCH_GRAM_ERROR_BOUND))}; erank(G1) sketched − exact "
                f"{_ci(check.get(mk.SKETCH_G1_ERANK_ERROR), 3)}.",
                "",
            ]
        else:
            lines += [
                "The sketch was not checked against exact gradients (coverage_groups = 0): the share of "
                "||g||² it covers is unknown; it sees nn.Linear weights only.",
                "",
            ]
    return lines


def groups_lines(label: str, probe: dict[str, Any], findings: list[str]) -> list[str]:
    """The groups table, one row per R: prompts, all-equal and mixed (analysed) groups, S1 measured and predicted,
    the largest identity residual, distinct completions and G2's numerical rank against its bound; a finding for
    each R without a mixed group (no rank could be measured)."""
    lines = md_table(
        [
            "R",
            "prompts",
            "all-equal",
            "mixed (analysed)",
            "S1 measured",
            "S1 predicted",
            "identity residual (max)",
            "distinct completions",
            "G2 numerical rank / bound",
        ]
    )
    for R, d, summ in _by_group_size(probe):
        res = _group_values(d, mk.GRAD_IDENTITY_RESIDUAL)
        lines.append(
            md_row(
                R,
                d.get(mk.PROMPTS_SAMPLED),
                d.get(mk.GROUPS_ALL_EQUAL),
                d.get(mk.GROUPS_MIXED),
                _ci(d[mk.S1_MEASURED_CI], 3) if d.get(mk.S1_MEASURED_CI) else fmt(d.get(mk.S1_MEASURED)),
                _ci(d[mk.S1_PREDICTED_CI], 3) if d.get(mk.S1_PREDICTED_CI) else fmt(d.get(mk.S1_PREDICTED)),
                f"{max(res):.1e}" if res else "–",
                _ci(summ.get(mk.GROUP_DISTINCT_COMPLETIONS)),
                _g2_cell(summ),
            )
        )
        if d.get(mk.GROUPS_MIXED, 0) == 0:
            findings.append(
                f"[{label}] R={R}: no mixed group among {d.get(mk.PROMPTS_SAMPLED)} prompts (S1 = "
                f"{fmt(d.get(mk.S1_MEASURED))}): GRPO's policy gradient was exactly zero on every "
                f"sampled group, so no rank could be measured."
            )
    return lines + [""]


def rank_lines(label: str, probe: dict[str, Any], run_dir: Path, findings: list[str]) -> list[str]:
    """ "Effective rank vs group size, beside the orthogonal null": what G1, its null, its controls, G1_layer, G2 and
    G3 are, :func:`rank_table`, and the figures erank vs R (erank_vs_R_{label}.png) and the spectra
    (spectra_{label}.png); findings on G1's erank beside its null per R and on the rank-2 identity's largest
    residual."""
    per_group_size = probe["per_group_size"]
    meta = probe.get("meta", {})
    lines = [
        "### Effective rank vs group size, beside the orthogonal null",
        "",
        "G1: rows A_i g_i of a group. The orthogonal null has singular values |A_i| ||g_i||: what G1 would be "
        "if its rows shared no direction; a ratio G1 / null well below 1 is structure beyond the row norms. "
        "Controls on the same tokens: G1_no_adv (rows g_i), G1_random_zero_sum (rows w_i g_i, w random "
        "zero-sum, ||w|| = ||A||), G1_nll (rows of the supervised NLL gradient). G1_layer: G1 of "
        f"`{meta.get('layer')}` only; G2: that layer's weight gradient of the group loss. G3: rows = the "
        "analysed groups' updates (one matrix; its null has singular values = the row norms).",
        "",
    ]
    lines += rank_table(probe) + [""]
    for R, _, summ in _by_group_size(probe):
        g1 = summ.get(mk.rank_key("g1", "erank")) or {}
        null = summ.get(mk.rank_key("g1_null", "erank")) or {}
        if g1.get("mean") is None:
            continue
        note = " (R = 2 caps every rank measure at 2)" if int(R) == 2 else ""
        findings.append(
            f"[{label}] R={R}: G1 erank {_ci(g1)} vs orthogonal null {_ci(null)} over {g1.get('n')} groups{note}."
        )
    res_all = [r for d in per_group_size.values() for r in _group_values(d, mk.GRAD_IDENTITY_RESIDUAL)]
    if res_all:
        findings.append(
            f"[{label}] The rank-2 identity sum_i A_i g_i = c(k,R)(gbar_C - gbar_W) held to a relative "
            f"residual of at most {max(res_all):.1e} over {len(res_all)} mixed 0/1 groups."
        )
    # the figure draws what the rank verdict tests: E₂ of G1 beside its nulls, with the boundary 0.9
    measure = plots.verdict_measure({label: probe})
    plots.plot_erank_vs_group_size({label: probe}, run_dir / f"erank_vs_R_{label}.png", measure=measure)
    plots.plot_spectra(probe, run_dir / f"spectra_{label}.png")
    return lines + [
        f"![{plots.MEASURE_ALT[measure]}]({f'erank_vs_R_{label}.png'})",
        f"![spectra]({f'spectra_{label}.png'})",
        "",
    ]


def strata_lines(probe: dict[str, Any]) -> list[str]:
    """ "Stratified by k (correct rollouts in the group)" and "Stratified by distinct completions"
    (:func:`strata_table` of each)."""
    return [
        "### Stratified by k (correct rollouts in the group)",
        "",
        *strata_table(probe, "correct"),
        "",
        "### Stratified by distinct completions",
        "",
        *strata_table(probe, "distinct"),
        "",
    ]


def zero_sum_lines(probe: dict[str, Any]) -> list[str]:
    """ "Zero-sum structure: label-permutation test with k fixed": per R, span energy and cos gap beside their
    relabelled (permutation-null) means and the share of groups whose own p-value is below 0.05."""
    lines = [
        "### Zero-sum structure: label-permutation test with k fixed",
        "",
        "span energy: share of G1's energy in span{gbar_C, gbar_W}; relabelled: its mean over every relabelling "
        "with the same k (the permutation null). cos gap: mean within-class minus between-class cosine of the "
        "g_i. p: share of groups whose own permutation p-value is below 0.05.",
        "",
        *md_table(
            ["R", "groups", "span energy", "relabelled", "groups p < 0.05", "cos gap", "relabelled", "groups p < 0.05"]
        ),
    ]
    for R, d, summ in _by_group_size(probe):
        cells = []
        for stat in mk.ZERO_SUM_STATS:
            p_key = mk.zero_sum_key(stat, "p")
            ps = _group_values(d, p_key)
            cells += [
                _ci(summ.get(mk.zero_sum_key(stat)), 3),
                _ci(summ.get(mk.zero_sum_key(stat, "null")), 3),
                f"{sum(p < 0.05 for p in ps)}/{len(ps)}" if ps else "–",
            ]
        n = (summ.get(mk.ZERO_SUM_SPAN_ENERGY) or {}).get("n", 0)
        lines.append(md_row(R, n, *cells))
    lines.append("")
    return lines


def baselines_lines(label: str, probe: dict[str, Any], run_dir: Path, findings: list[str]) -> list[str]:
    """ "Baselines": per R, b*, the group mean, m_C and m_W, and the gradient variance under no baseline, the group
    mean, rloo and b* relative to b*'s (baseline_variance_{label}.png); a finding on rloo's variance per R."""
    lines = [
        "### Baselines",
        "",
        "Variance of the gradient estimate (1/R) sum_i (r_i - b_i) g_i under each baseline, relative to the "
        "leave-one-out optimal baseline b*, from groups of R resampled out of M rollouts of one prompt. The "
        "group mean is not leave-one-out: it equals rloo scaled by (R-1)/R, so its variance is ((R-1)/R)^2 "
        "times rloo's (a shorter step, not a better direction).",
        "",
        *md_table(["R", "b*", "group mean", "m_C", "m_W", "Var/Var* none", "mean", "rloo", "optimal"]),
    ]
    for R, d, summ in _by_group_size(probe):
        b = d.get(mk.PROBE_BASELINES, {})
        rel = b.get("relative_variance", {})
        lines.append(
            md_row(
                R,
                _ci(summ.get(mk.BASELINE_B_STAR), 3),
                _ci(summ.get(mk.BASELINE_GROUP_MEAN), 3),
                _ci(summ.get(mk.BASELINE_M_CORRECT), 4),
                _ci(summ.get(mk.BASELINE_M_WRONG), 4),
                fmt(rel.get("none"), 2),
                fmt(rel.get("mean"), 2),
                fmt(rel.get("rloo"), 2),
                fmt(rel.get("optimal"), 2),
            )
        )
        if rel.get("rloo") is not None:
            none = rel.get("none")
            lower = (
                f"; with no baseline at all it is {fmt(none, 2)}x, lower: b* minimises the second moment "
                f"E||(r - b) g||^2, which is the variance only when E[g] = 0, and the length-normalised g_i's "
                f"mean is not 0"
                if none is not None and none < 1
                else f"; no baseline at all gives {fmt(none, 2)}x"
            )
            findings.append(
                f"[{label}] R={R}: the rloo baseline's gradient variance is {fmt(rel['rloo'], 2)}x the "
                f"leave-one-out optimal b*'s{lower} (one resampling estimate over {b.get('prompts')} "
                f"prompt(s) of {d.get(mk.ROLLOUTS_PER_PROMPT)} rollouts; no interval)."
            )
    plots.plot_baseline_variance(probe, run_dir / f"baseline_variance_{label}.png")
    return lines + ["", f"![baseline variance](baseline_variance_{label}.png)", ""]


def credit_lines(label: str, probe: dict[str, Any], run_dir: Path) -> list[str]:
    """ "Credit": per R, the largest within-rollout advantage variance, the answer tokens' share of ||g||^2 and of the
    tokens (credit_profile_{label}.png)."""
    lines = [
        "### Credit",
        "",
        "Under an output-only reward every token of a rollout gets the same advantage: the per-token "
        "advantage variance within a rollout is measured, not assumed.",
        "",
        *md_table(
            [
                "R",
                "within-rollout advantage variance (max)",
                "answer-token share of ||g||^2",
                "answer tokens share of tokens",
            ]
        ),
    ]
    for R, d, summ in _by_group_size(probe):
        vmax = max(_group_values(d, mk.CREDIT_ADV_VAR_WITHIN_MAX), default=None)
        lines.append(
            md_row(
                R,
                fmt(vmax, 6),
                _ci(summ.get(mk.CREDIT_ANSWER_SHARE_MEAN), 3),
                _ci(summ.get(mk.CREDIT_ANSWER_TOKEN_FRAC), 3),
            )
        )
    plots.plot_credit_profile(probe, run_dir / f"credit_profile_{label}.png")
    return lines + ["", f"![credit profile](credit_profile_{label}.png)", ""]


def probe_section(label: str, probe: dict[str, Any], run_dir: Path, findings: list[str]) -> list[str]:
    """Rank tables beside the orthogonal null (with intervals and strata), the zero-sum test, the identity, S1,
    baselines and credit of one probe: the subsections in order, each appending its findings."""
    lines = header_lines(label, probe)
    lines += groups_lines(label, probe, findings)
    lines += rank_lines(label, probe, run_dir, findings)
    lines += weighting_tables(probe)
    lines += strata_lines(probe)
    lines += zero_sum_lines(probe)
    lines += baselines_lines(label, probe, run_dir, findings)
    lines += credit_lines(label, probe, run_dir)
    if probe.get("studies"):
        lines += studies_section(label, probe["studies"], run_dir, findings)
    return lines
