"""Report pieces read from a training run's metrics.jsonl records, beside the reward table of
:func:`grpo_lens.report.training.training_section`: policy entropy, sparsity over training next to its dense bf16
control (docs/theory.md §Sparsity over training), the gradient noise scale and dead groups
(docs/theory.md §Noise scale and dead groups), the lens's share of the wall time, and one sentence on dynamic
sampling (docs/theory.md §Dynamic sampling; also used by ``grpo-lens compare``).

Everything comes from the records alone; the claims these numbers decide are in :mod:`grpo_lens.claims.sparsity`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from grpo_lens import metrics as mk
from grpo_lens.report import plots
from grpo_lens.report.format import fmt, md_row, md_table
from grpo_lens.rundir import lens_overhead


def lens_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of lens steps (those with a lens timing)."""
    return [r for r in records if r.get(mk.PERF_LENS_SECONDS) is not None]


def plot_sparsity_measures(records: list[dict[str, Any]], path: Path) -> Path:
    """bf16-unchanged since start beside its permutation and dense controls and float32-unchanged (each in its
    :data:`grpo_lens.report.plots.SERIES_COLOURS` colour and line style, as in sparsity.png); Hoyer and top-1% energy
    of the step's update and gradient; Hoyer of the update since start per layer type. Series that coincide stay
    visible (:func:`grpo_lens.report.plots.plot_lines`); legends in 8 pt."""
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(plots.SIZE[0] * 1.5, plots.SIZE[1] * 1.4))
    plots.plot_lines(
        a1,
        [
            (label, *plots._series(records, key), plots.series_colour(key), style)
            for key, label, style in [
                (mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED, "bf16 unchanged", "-"),
                (mk.SPARSITY_UPDATE_TOTAL_BF16_PERMUTED, "permutation control", "--"),
                (mk.SPARSITY_UPDATE_TOTAL_BF16_DENSE, "dense control", ":"),
                (mk.SPARSITY_UPDATE_TOTAL_F32_UNCHANGED, "f32 unchanged", "-."),
            ]
        ],
        span=1.0,
    )  # a share axis: the three bf16 shares often lie within a line's width of each other
    a1.set_title("since start: unchanged shares", fontsize=9)
    a1.set_ylabel("share of sampled weights unchanged")
    a1.set_ylim(-0.02, 1.02)
    plots.plot_lines(
        a2,
        [
            (label, *plots._series(records, key), None, "-")
            for key, label in [
                (mk.SPARSITY_UPDATE_STEP_HOYER, "update Hoyer"),
                (mk.SPARSITY_UPDATE_STEP_TOP1_ENERGY, "update top-1% energy"),
                (mk.SPARSITY_GRAD_HOYER, "gradient Hoyer"),
                (mk.SPARSITY_GRAD_TOP1_ENERGY, "gradient top-1%"),
            ]
        ],
    )
    a2.axhline(0.20, color="gray", lw=0.8, ls=":")  # Hoyer of a Gaussian vector
    a2.set_title("this step (Gaussian: Hoyer 0.20, top-1% 0.105)", fontsize=8)
    a2.set_ylabel("Hoyer (0 to 1) or top-1% share of squared norm", fontsize=8)
    plots.plot_lines(
        a3,
        [
            (kind, *plots._series(records, mk.sparsity_key("update_total", "hoyer", kind)), None, style)
            for kind, style in zip(("embedding", "attention", "mlp", "norm"), ("-", "--", ":", "-."))
        ],
    )
    a3.set_title("update since start: Hoyer by layer type", fontsize=9)
    a3.set_ylabel("Hoyer sparsity (0 to 1, dimensionless)", fontsize=8)
    steps = [r[mk.STEP] for r in records if r.get(mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED) is not None]
    for ax in (a1, a2, a3):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if steps and not any(line.get_label() and not line.get_label().startswith("_") for line in ax.lines):
            # every value null: the vectors were all zero (Hoyer and top-1% are 0/0); the run's steps on the axis
            ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
            ax.set_xticks(sorted(set(steps)))
            ax.text(
                0.5,
                0.5,
                "undefined at every measured step:\nthe vector was all zero (0/0)",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=8,
                color="gray",
            )
        plots.legend_below(ax, ncol=1, fontsize=8)  # shares and Hoyer values reach 0 and 1: inside, it covers them
    return plots._save(fig, path)


#: fewest training steps the report reads a trend from: two non-overlapping windows of at least 2 steps
MIN_TREND_STEPS = 4

#: completions.jsonl rows shown per logged step in the report, and the steps shown (the first and the last).
COMPLETION_ROWS = 4


def eval_section(records: list[dict[str, Any]], findings: list[str]) -> list[str]:
    """Held-out accuracy (``--eval-every``): a table of the evaluated steps, greedy and sampled with their Wilson
    intervals, and a finding comparing the first and last evaluation."""
    rows = [r for r in records if r.get(mk.EVAL_GREEDY_ACCURACY) is not None]
    if not rows:
        return []

    def cell(r, mid, lo, hi):
        return "–" if r.get(mid) is None else f"{fmt(r[mid])} [{fmt(r.get(lo))}, {fmt(r.get(hi))}]"

    greedy = (mk.EVAL_GREEDY_ACCURACY, mk.EVAL_GREEDY_ACCURACY_LO, mk.EVAL_GREEDY_ACCURACY_HI)
    sampled = (mk.EVAL_SAMPLED_ACCURACY, mk.EVAL_SAMPLED_ACCURACY_LO, mk.EVAL_SAMPLED_ACCURACY_HI)
    lines = [
        "### Held-out accuracy",
        "",
        f"The same {int(rows[0].get(mk.EVAL_PROMPTS) or 0)} held-out prompts at each evaluated step, after its "
        "update: greedy (one completion, the argmax token each time; 95% Wilson interval over prompts) and "
        "sampled (at the training temperature; Wilson interval over completions).",
        "",
        *md_table(
            ["step", "greedy accuracy", "sampled accuracy"],
            [[r[mk.STEP], cell(r, *greedy), cell(r, *sampled)] for r in rows],
        ),
    ]
    lines.append("")
    first, last = rows[0], rows[-1]
    if len(rows) > 1:
        findings.append(
            f"Held-out greedy accuracy {cell(first, *greedy)} at step {first[mk.STEP]} -> "
            f"{cell(last, *greedy)} at step {last[mk.STEP]} (95% Wilson intervals over prompts)."
        )
    else:
        findings.append(f"Held-out greedy accuracy {cell(last, *greedy)} at step {last[mk.STEP]} (one evaluation).")
    return lines


def completions_section(rows: list[dict[str, Any]]) -> list[str]:
    """A few logged completions (completions.jsonl) of the first and last logged steps: prompt, completion, reward
    (and each reward function's value when the run logged them), advantage."""
    steps = sorted({r[mk.STEP] for r in rows if mk.STEP in r})
    if not steps:
        return []
    shown = [
        r
        for s in dict.fromkeys((steps[0], steps[-1]))
        for r in [x for x in rows if x.get(mk.STEP) == s][:COMPLETION_ROWS]
    ]
    per_func = sorted({k for r in shown for k in (r.get("rewards") or {})})

    def text(value: Any, n: int = 80) -> str:
        t = " ".join(str(value).split())  # md_row escapes its '|
        return t if len(t) <= n else t[: n - 1] + "…"

    head = ["step", "prompt", "completion", "reward", *per_func, "advantage"]
    lines = [
        "### Completions",
        "",
        f"The first {COMPLETION_ROWS} logged rollouts of the first and last logged steps "
        "(completions.jsonl has every logged one).",
        "",
        *md_table(head),
    ]
    for r in shown:
        funcs = [fmt((r.get("rewards") or {}).get(f)) for f in per_func]
        lines.append(
            md_row(
                r[mk.STEP],
                text(r.get("prompt")),
                text(r.get("completion")),
                fmt(r.get("reward")),
                *funcs,
                fmt(r.get("advantage")),
            )
        )
    return lines + [""]


def training_measures_section(
    records: list[dict[str, Any]], run_dir: Path, findings: list[str], beta: float | None = None, lora_rank: int = 0
) -> list[str]:
    """Policy entropy, sparsity over training (with the dense control) and the lens's cost (``lora_rank`` > 0: the
    sparsity numbers are over the LoRA adapter's weights)."""
    lines: list[str] = []
    lines += _entropy_lines(records, findings)
    rows = [r for r in lens_rows(records) if r.get(mk.SPARSITY_UPDATE_TOTAL_BF16_DENSE) is not None]
    if rows:
        lines += _sparsity_lines(records, rows, run_dir, findings, lora_rank)
    lines += noise_and_dead_section(records, findings)
    cost = lens_overhead(records)
    if cost and cost["lens_steps"]:
        lines += [
            f"The lens measured {cost['lens_steps']} of {cost['steps']} steps and took "
            f"{fmt(cost['lens_seconds'], 1)} s: {fmt(100 * cost['overhead'], 1)}% of the "
            f"{fmt(cost['train_seconds'], 1)} s the steps took without it.",
            "",
        ]
    return lines


def _entropy_lines(records: list[dict[str, Any]], findings: list[str]) -> list[str]:
    """The policy's token-mean entropy: first steps against last ones, or its mean when too few for a trend."""
    lines: list[str] = []
    ent = [r.get(mk.POLICY_ENTROPY) for r in records if r.get(mk.POLICY_ENTROPY) is not None]
    if len(ent) >= MIN_TREND_STEPS:  # two non-overlapping windows, as for the reward
        w = min(5, len(ent) // 2)
        head, tail = ent[:w], ent[len(ent) - w :]
        # no None: filtered above
        e0, e1 = sum(head) / len(head), sum(tail) / len(tail)  # type: ignore[arg-type]
        lines += [
            "### Policy entropy",
            "",
            f"Token-mean entropy of the policy (temperature-scaled, from the update's own logits): "
            f"{fmt(e0)} nats over the first {len(head)} steps -> {fmt(e1)} over the last {len(tail)} "
            f"(plotted with the reward in the learning curves; the KL panel is shown only when beta > 0).",
            "",
        ]
        findings.append(f"Policy entropy went {fmt(e0)} -> {fmt(e1)} nats/token (first {w} vs last {w} steps).")
    elif ent:
        lines += [
            "### Policy entropy",
            "",
            # no None: filtered above
            f"Token-mean entropy of the policy: mean {fmt(sum(ent) / len(ent))} nats over {len(ent)} step(s), "  # type: ignore[arg-type]
            f"too few for a trend (at least {MIN_TREND_STEPS}).",
            "",
        ]
    return lines


#: (column head, key, decimals) of the per-step sparsity table after its step column.
_SPARSITY_COLUMNS = (
    ("S1 measured", mk.REWARD_FRAC_ZERO_STD_GROUPS, 3),
    ("bf16 unchanged since start", mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED, 3),
    ("permutation control", mk.SPARSITY_UPDATE_TOTAL_BF16_PERMUTED, 3),
    ("dense control", mk.SPARSITY_UPDATE_TOTAL_BF16_DENSE, 3),
    ("f32 unchanged since start", mk.SPARSITY_UPDATE_TOTAL_F32_UNCHANGED, 4),
    ("update Hoyer (step)", mk.SPARSITY_UPDATE_STEP_HOYER, 3),
    ("update top-1% (step)", mk.SPARSITY_UPDATE_STEP_TOP1_ENERGY, 3),
    ("gradient zero", mk.SPARSITY_GRAD_ZERO, 4),
    ("gradient Hoyer", mk.SPARSITY_GRAD_HOYER, 3),
    ("gradient top-1%", mk.SPARSITY_GRAD_TOP1_ENERGY, 3),
)


def _sparsity_lines(
    records: list[dict[str, Any]], rows: list[dict[str, Any]], run_dir: Path, findings: list[str], lora_rank: int
) -> list[str]:
    """Sparsity over training at the lens steps ``rows``: the plot, the per-step table with its controls, the table by
    layer type at the last lens step, and the finding."""
    lines: list[str] = []
    plot_sparsity_measures(records, run_dir / "sparsity_measures.png")
    n = rows[-1].get(mk.SPARSITY_SAMPLE_ENTRIES)
    lines += [
        "### Sparsity over training: the update and the gradient, separated from bf16 rounding",
        "",
        "bf16 unchanged: share of weights whose bf16 value did not change; permutation control: the share "
        "the same update entries leave unchanged when permuted within each tensor (the magnitudes alone); "
        "dense control: the share a dense Gaussian update with the same per-tensor RMS would leave "
        "unchanged (misleading for heavy-tailed updates). "
        "f32 unchanged: exactly unchanged in float32. Hoyer: 0 equal magnitudes, 0.20 Gaussian, 1 one "
        "entry; top-1%: share of the squared norm in the largest 1% of entries (0.105 Gaussian); both are "
        "– for an all-zero vector (0/0: a step without reward contrast). "
        f"Computed on a fixed sample of {fmt(int(n) if n else None)} weights (standard error of a share "
        f"<= {fmt(0.5 / math.sqrt(n), 4) if n else '–'}).",
        "",
        "![sparsity measures](sparsity_measures.png)",
        "",
        *md_table(["step", *(head for head, _, _ in _SPARSITY_COLUMNS)]),
    ]
    for r in rows:
        lines.append(md_row(r[mk.STEP], *(fmt(r.get(key), nd) for _, key, nd in _SPARSITY_COLUMNS)))
    last = rows[-1]
    lines += _layer_type_lines(last)
    gap = last[mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED] - last[mk.SPARSITY_UPDATE_TOTAL_BF16_DENSE]
    weights = "the LoRA adapter's weights (not the full model's)" if lora_rank else "weights"
    findings.append(
        f"After {last[mk.STEP]} steps {fmt(last[mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED])} of {weights} "
        f"kept their bf16 value, against {fmt(last.get(mk.SPARSITY_UPDATE_TOTAL_BF16_PERMUTED))} for the "
        f"same update permuted within each tensor and "
        f"{fmt(last[mk.SPARSITY_UPDATE_TOTAL_BF16_DENSE])} for a dense "
        f"update of the same size (difference {fmt(gap)}); "
        f"{fmt(last.get(mk.SPARSITY_UPDATE_TOTAL_F32_UNCHANGED), 4)} were unchanged in float32."
    )
    lines.append("")
    return lines


def _layer_type_lines(last: dict[str, Any]) -> list[str]:
    """The sparsity table by layer type of the lens record ``last`` (empty when it has none)."""
    lines: list[str] = []
    kinds = [
        k
        for k in ("embedding", "attention", "mlp", "norm", "other")
        if last.get(mk.sparsity_key("update_total", "hoyer", k)) is not None
    ]
    if kinds:
        lines += [
            "",
            f"By layer type at step {last[mk.STEP]} (update since the start; gradient of the step):",
            "",
            *md_table(
                [
                    "layer type",
                    "bf16 unchanged",
                    "dense control",
                    "f32 unchanged",
                    "update Hoyer",
                    "update top-1%",
                    "gradient zero",
                    "gradient Hoyer",
                ]
            ),
        ]
        for k in kinds:
            total = {
                m: last.get(mk.sparsity_key("update_total", m, k))
                for m in ("bf16_unchanged", "bf16_dense", "f32_unchanged", "hoyer", "top1_energy")
            }
            lines.append(
                md_row(
                    *[
                        k,
                        fmt(total["bf16_unchanged"]),
                        fmt(total["bf16_dense"]),
                        fmt(total["f32_unchanged"], 4),
                        fmt(total["hoyer"]),
                        fmt(total["top1_energy"]),
                        fmt(last.get(mk.sparsity_key("grad", "zero", k)), 4),
                        fmt(last.get(mk.sparsity_key("grad", "hoyer", k))),
                    ]
                )
            )
    return lines


def _with_interval(r: dict[str, Any], key: str, lo: str, hi: str, nd: int = 3) -> str:
    """``value [lo, hi]`` of a record, or the value alone without an interval."""
    if r.get(lo) is None or r.get(hi) is None:
        return fmt(r.get(key), nd)
    return f"{fmt(r.get(key), nd)} [{fmt(r[lo], nd)}, {fmt(r[hi], nd)}]"


def noise_and_dead_section(records: list[dict[str, Any]], findings: list[str]) -> list[str]:
    """The gradient noise scale of each lens step and the run's dead groups (docs/theory.md §Noise scale and dead
    groups), from the records' ``noise/*`` and ``dead/*`` keys; empty when neither was written."""
    lines: list[str] = []
    dead = [r for r in records if r.get(mk.DEAD_MIXED_GROUPS) is not None]
    if dead:
        total = {
            k: sum(r.get(k) or 0 for r in dead)
            for k in (mk.DEAD_ALL_CORRECT_GROUPS, mk.DEAD_ALL_WRONG_GROUPS, mk.DEAD_ALL_EQUAL_OTHER_GROUPS)
        }
        mixed = sum(r[mk.DEAD_MIXED_GROUPS] for r in dead)
        shares = [r[mk.DEAD_NORMALIZER_SHARE] for r in dead if r.get(mk.DEAD_NORMALIZER_SHARE) is not None]
        longest = max((r.get(mk.DEAD_STEPS_WITHOUT_MIXED) or 0 for r in dead), default=0)
        share = fmt(sum(shares) / len(shares)) if shares else "–"
        lines += [
            "### Gradient noise scale and dead groups",
            "",
            f"Over {len(dead)} steps: {mixed} groups with reward contrast, "
            f"{total[mk.DEAD_ALL_CORRECT_GROUPS]} all correct, {total[mk.DEAD_ALL_WRONG_GROUPS]} all wrong and "
            f"{total[mk.DEAD_ALL_EQUAL_OTHER_GROUPS]} all equal at another reward; the groups "
            f"with all advantages 0 held on average {share} of the loss normaliser (each such share scales the step "
            f"down by as much); longest run of steps without a mixed group: {longest}.",
            "",
        ]
        findings.append(
            f"Dead groups: {total[mk.DEAD_ALL_CORRECT_GROUPS]} all correct and "
            f"{total[mk.DEAD_ALL_WRONG_GROUPS]} all wrong against "
            f"{mixed} mixed over {len(dead)} steps; mean normaliser share of zero-advantage groups {share}."
        )
    rows = [r for r in records if r.get(mk.NOISE_GRAD_SQ) is not None]
    if rows:
        if not lines:
            lines += ["### Gradient noise scale and dead groups", ""]
        lines += [
            "The exact gradient noise scale of each lens step (McCandlish et al. 2018), the group the example: "
            "|G|^2 and tr(Sigma) unbiased from the Gram, B_simple = tr(Sigma)/|G|^2 in groups, SNR = B/B_simple; "
            "[95% jackknife interval over groups] with the full Gram of 8 or more groups; null p: the sign-flip test "
            "of |G|^2 = 0 (large: no signal told apart from noise, so B_simple means nothing); route: Gram (own "
            "pass) or update (|G|^2 from the update's own gradient norm, no interval).",
            "",
            *md_table(
                ["step", "B", "|G|^2", "tr(Sigma)", "B_simple", "SNR", "null p", "proxy rho", "route"],
                [
                    (
                        r[mk.STEP],
                        fmt(int(r[mk.NOISE_GROUPS]) if r.get(mk.NOISE_GROUPS) is not None else None),
                        _with_interval(r, mk.NOISE_GRAD_SQ, mk.NOISE_GRAD_SQ_LO, mk.NOISE_GRAD_SQ_HI, 4),
                        fmt(r.get(mk.NOISE_TRACE_SIGMA), 4),
                        _with_interval(r, mk.NOISE_B_SIMPLE, mk.NOISE_B_SIMPLE_LO, mk.NOISE_B_SIMPLE_HI, 2),
                        fmt(r.get(mk.NOISE_SNR), 2),
                        fmt(r.get(mk.NOISE_GRAD_SQ_P)),
                        fmt(r.get(mk.NOISE_PROXY_RANK_CORR), 2),
                        "update" if r.get(mk.NOISE_FROM_UPDATE) else "Gram",
                    )
                    for r in rows
                ],
            ),
            "",
        ]
        last = rows[-1]
        findings.append(
            f"Gradient noise scale at step {last[mk.STEP]}: B_simple "
            f"{_with_interval(last, mk.NOISE_B_SIMPLE, mk.NOISE_B_SIMPLE_LO, mk.NOISE_B_SIMPLE_HI, 2)} groups against "
            f"B = {fmt(last.get(mk.NOISE_GROUPS), 0)} (SNR {fmt(last.get(mk.NOISE_SNR), 2)}; null p "
            f"{fmt(last.get(mk.NOISE_GRAD_SQ_P))})."
        )
    return lines


def dynamic_sampling_summary(records: list[dict]) -> str | None:
    """One sentence on a run's dynamic sampling from its metric records (None when the run did not use it): steps
    at the round cap, the share of sampled groups that were all-equal, and which keys describe what.

    Args:
        records: metrics.jsonl records (dicts with ``step``); steps without ``dynamic/hit_cap`` are ignored.
    """
    rows = [r for r in records if isinstance(r.get(mk.DYNAMIC_HIT_CAP), (int, float))]
    if not rows:
        return None
    cap = sum(r[mk.DYNAMIC_HIT_CAP] > 0 for r in rows)
    sampled = sum(r.get(mk.DYNAMIC_SAMPLED_GROUPS, 0.0) for r in rows)
    kept = sum(r.get(mk.DYNAMIC_MIXED_GROUPS, 0.0) for r in rows)
    zero = sum(r.get(mk.DYNAMIC_ZERO_VAR_FRAC_SAMPLED, 0.0) * r.get(mk.DYNAMIC_SAMPLED_GROUPS, 0.0) for r in rows)
    share = f"{zero / sampled:.3f}" if sampled else "–"
    return (
        f"Dynamic sampling (DAPO) was on: {cap} of {len(rows)} steps hit the extra-rounds cap "
        f"(dynamic_sampling_max_rounds) with fewer mixed groups than prompts_per_step; {share} of the "
        f"{sampled:.0f} sampled groups were all-equal and {kept:.0f} mixed groups were trained on. Reward, "
        f"accuracy and S1 are over all sampled groups (the policy's behaviour); the kept groups' values are "
        f"dynamic/kept_*."
    )
