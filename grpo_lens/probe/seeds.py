"""``grpo-lens probe --seeds 0 1 2 --out DIR``: one probe per seed, then one pooled result (docs/seeds.md).

Layout of DIR::

    config.yaml        the settings every seed ran with (ProbeConfig fields; ``seed`` is each seed dir's own)
    seed_<s>/          a normal probe run directory per seed (probe.json, report.md, PNGs; probe_partial/ while it
                       runs, so ``--resume`` continues it)
    probe.json         the pooled probe: the probe.json schema of :mod:`grpo_lens.probe.run` over every seed's groups,
                       plus ``seeds`` (below)
    report.md          ``grpo-lens report DIR``: the claims table decided on the pooled groups, and the seeds section

Pooling reads only the seeds' probe.json files, at the level of the per-group records they hold: rows of analysed
groups, G2-weighting and sketch-check rows, spectra, the baseline study's per-prompt results and the credit study's
Monte Carlo rollouts are concatenated and aggregated again by the probe's own functions (summaries and strata over
groups, :func:`grpo_lens.formulas.baselines.summarise_baseline_prompts`,
:func:`grpo_lens.formulas.credit.summarise_class_shares`); counts are summed. What a probe.json keeps only as an
aggregate is combined per seed as a stratum (:func:`grpo_lens.formulas.pooling.combine_summaries`: S1 predicted, the
credit shares of probes written before they kept per-group shares). G3 (one matrix per run over that run's groups,
from a sketch seeded by the run's seed) is not pooled: the seeds section shows each seed's.

``seeds`` in the pooled probe.json::

    {"seeds": [s, ...], "dirs": ["seed_<s>", ...],
     "per_group_size": {"<R>": {"group_seeds": [seed of each pooled group row, in order],
                                "g2_seeds": [...], "g3": {"<s>": that seed's g3},
                                "keys": {key: {"within": [each seed's own {mean, lo, hi, n}],
                                               "spread": between_seed_spread, "stratified": stratified_interval,
                                               "pooled": the pooled groups' interval}}}}}

The claims table of the pooled directory is :func:`grpo_lens.claims.evaluate_claims` on the pooled probe.json: the
claims' rules decide on the pooled groups. Beside it the report prints each seed's verdicts, the between-seed spread
of the numbers the claims decide on and their stratified intervals (the seed as a stratum).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from grpo_lens import metrics as mk
from grpo_lens.config import ConfigError
from grpo_lens.config.base import refuse_started_seeds, seeds_run_args
from grpo_lens.formulas.baselines import (
    summarise_baseline_prompts,
    variance_relative_to_optimal,
)
from grpo_lens.formulas.credit import summarise_class_shares
from grpo_lens.formulas.pooling import (
    between_seed_spread,
    combine_summaries,
    stratified_interval,
)
from grpo_lens.formulas.stats import (
    mean_interval,
    summarise_rows,
)
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.estimate import probe_strata
from grpo_lens.probe.partial import COMMAND_KEYS, RESUMABLE_KEYS, PartialProbe
from grpo_lens.probe.run import run_probe
from grpo_lens.probe.tracking import log_probe
from grpo_lens.report import write_report
from grpo_lens.rundir import atomic_write_text, read_json_file, start_seeds_dir
from grpo_lens.trackers import check_trackers

logger = logging.getLogger(__name__)

#: the pooled probe.json's section on the seeds (see the module docstring)
SEEDS = "seeds"

#: settings that may differ between the pooled runs: the seed, and what changes no number
PER_RUN_KEYS = ("seed", *RESUMABLE_KEYS, *COMMAND_KEYS)


class PoolingError(ValueError):
    """The seed directories cannot be pooled (missing, unfinished, or probed with other settings)."""


def seed_dir(out: str | Path, seed: int) -> Path:
    """DIR/seed_<seed>: the probe run directory of one seed."""
    return Path(out) / f"seed_{seed}"


# -- pooling (pure: probe.json dicts in, a probe.json dict out) -------------------------------------------------------
def _settings_differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    keys = sorted((set(a) | set(b)) - set(PER_RUN_KEYS))
    return [f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def _concat(entries: Sequence[dict[str, Any] | None], key: str) -> list[Any]:
    return [x for e in entries for x in ((e or {}).get(key) or [])]


def pool_group_size(entries: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """One R's pooled probe.json entry from the seeds' entries for that R (one per seed, in seed order): the
    analysed groups (and G2-weighting, sketch-check rows, spectra) concatenated and summarised, stratified by k and
    by distinct completions as the probe does; counts summed; S1 measured from the summed counts, S1 predicted
    combined over seeds as strata; G3 left out (one matrix per run, see the module docstring)."""
    M = {e[mk.ROLLOUTS_PER_PROMPT] for e in entries}
    if len(M) != 1:
        raise PoolingError(f"the seeds sampled different rollouts per prompt ({sorted(M)})")
    rows = _concat(entries, mk.PROBE_GROUPS)
    counts = {
        k: sum(int(e[k]) for e in entries)
        for k in (mk.PROMPTS_SAMPLED, mk.GROUPS_ALL_EQUAL, mk.GROUPS_MIXED, mk.GROUPS_INVALID)
    }
    valid = counts[mk.PROMPTS_SAMPLED] - counts[mk.GROUPS_INVALID]
    # S1 measured is a share of the valid groups: its pooled indicators are the summed counts (order does not matter)
    indicators = [1.0] * counts[mk.GROUPS_ALL_EQUAL] + [0.0] * (valid - counts[mk.GROUPS_ALL_EQUAL])
    predicted = combine_summaries([e.get(mk.S1_PREDICTED_CI) for e in entries], bounds=(0.0, 1.0))
    ci: dict[str, Any] = {"seed": seed}

    def rows_and_summary(key: str) -> dict[str, Any] | None:
        pooled = _concat([e.get(key) for e in entries], mk.PROBE_GROUPS)
        return {mk.PROBE_GROUPS: pooled, mk.PROBE_SUMMARY: summarise_rows(pooled, **ci)} if pooled else None

    variances = [(e.get(mk.PROBE_BASELINES) or {}) for e in entries]
    prompts = sum(int(v.get("prompts") or 0) for v in variances)
    var = {}
    if prompts:
        names = [k for k in (variances[0].get("variance") or {})]
        var = {
            k: math.fsum(float(v["variance"][k]) * int(v["prompts"]) for v in variances if v.get("prompts")) / prompts
            for k in names
        }
    profiles = [
        ((e.get(mk.PROBE_CREDIT) or {}).get("position_profile") or [], int(e[mk.GROUPS_MIXED])) for e in entries
    ]
    T = max((len(p) for p, _ in profiles), default=0)
    profile = []
    for t in range(T):  # a position's mean over the seeds' groups, each seed weighted by its analysed groups
        have = [(p[t], n) for p, n in profiles if len(p) > t and n > 0]
        profile.append(math.fsum(x * n for x, n in have) / sum(n for _, n in have) if have else 0.0)
    covs = [e[mk.PROBE_GRAM_COVERAGE] for e in entries if e.get(mk.PROBE_GRAM_COVERAGE) is not None]
    timing = {
        k: math.fsum(float((e.get(mk.PROBE_TIMING) or {}).get(k) or 0.0) for e in entries)
        for k in ("generation_seconds", "gradient_seconds", "g2_weightings_seconds", "sketch_check_seconds", "seconds")
    }
    spectra = {
        name: _concat([e.get(mk.PROBE_SPECTRA) for e in entries], name) for name in ("G1", "G1_no_adv", "G1_null", "G2")
    }
    return {
        mk.ROLLOUTS_PER_PROMPT: M.pop(),
        **counts,
        mk.S1_MEASURED: counts[mk.GROUPS_ALL_EQUAL] / valid if valid else None,
        mk.S1_PREDICTED: predicted["mean"],
        mk.S1_PREDICTED_CI: {k: predicted[k] for k in ("mean", "lo", "hi", "n")},
        mk.S1_MEASURED_CI: mean_interval(indicators),
        mk.PROBE_GROUPS: rows,
        mk.PROBE_SUMMARY: summarise_rows(rows, **ci),
        mk.PROBE_STRATA: probe_strata(rows, seed),
        mk.PROBE_G3: {},
        mk.PROBE_G2_WEIGHTINGS: rows_and_summary(mk.PROBE_G2_WEIGHTINGS),
        mk.PROBE_SKETCH_CHECK: rows_and_summary(mk.PROBE_SKETCH_CHECK),
        mk.PROBE_SPECTRA: spectra,
        mk.PROBE_BASELINES: {
            "variance": var,
            "relative_variance": variance_relative_to_optimal(var) if var else {},
            "prompts": prompts,
        },
        mk.PROBE_CREDIT: {"position_profile": profile},
        mk.PROBE_GRAM_COVERAGE: min(covs) if covs else None,
        mk.PROBE_TIMING: timing,
    }


def pool_baseline_study(studies: list[dict[str, Any]]) -> dict[str, Any]:
    """The baseline study over the seeds: per-prompt results concatenated and summarised again
    (:func:`grpo_lens.formulas.baselines.summarise_baseline_prompts`); S1 measured / predicted / difference combined
    with each seed as a stratum; counts and seconds summed."""
    parts = [s["baselines"] for s in studies if s.get("baselines")]
    baselines = None
    if parts:
        baselines = summarise_baseline_prompts(
            [p for part in parts for p in part["per_prompt"]], sum(int(p.get("prompts_constant") or 0) for p in parts)
        )
    s1s = [s.get("s1") or {} for s in studies]
    s1: dict[str, Any] = {
        k: combine_summaries([x.get(k) for x in s1s], bounds=(-1.0, 1.0) if k == "difference" else (0.0, 1.0))
        for k in ("measured", "predicted", "difference")
    }
    s1.update(
        prompts=sum(int(x.get("prompts") or 0) for x in s1s), rollouts_per_prompt=s1s[0].get("rollouts_per_prompt")
    )
    meta = dict(studies[0].get("meta") or {})
    for k in ("prompts_sampled", "prompts_with_contrast", "seconds"):
        meta[k] = sum((s.get("meta") or {}).get(k) or 0 for s in studies)
    return {"baselines": baselines, "s1": s1, "meta": meta}


def pool_credit_study(studies: list[dict[str, Any]]) -> dict[str, Any]:
    """The credit study over the seeds: Monte Carlo rollouts concatenated (their count test is per rollout) and
    their shares summarised again; segment counts summed; the class shares summarised again from the per-group
    shares (:func:`grpo_lens.formulas.credit.summarise_class_shares`) when every seed kept them, else combined
    with each seed as a stratum."""
    mc_samples = {s["monte_carlo"].get("samples_per_prefix") for s in studies}
    if len(mc_samples) != 1:
        raise PoolingError(
            f"the seeds' Monte Carlo credit used different continuations per prefix ({sorted(mc_samples)})"
        )
    rollouts = [r for s in studies for r in s["monte_carlo"]["rollouts"]]
    segments = {
        k: sum(int(s["monte_carlo"].get("segments", {}).get(k) or 0) for s in studies)
        for k in ("disagree", "agree", "total")
    }
    mc = {
        "rollouts": rollouts,
        "samples_per_prefix": mc_samples.pop(),
        **{
            k: mean_interval([r[k] for r in rollouts], bounds=(0.0, 1.0))
            for k in ("disagree", "agree", "neutral", "top_segment_share")
        },
        "segments": segments,
    }
    contributions = [s["contributions"] for s in studies]
    pooled: dict[str, Any] = {
        "closure": max((c["closure"] for c in contributions if c.get("closure") is not None), default=None),
        "groups": sum(int(c.get("groups") or 0) for c in contributions),
    }
    if all("shares" in c and "shares_nll" in c for c in contributions):
        shares = [x for c in contributions for x in c["shares"]]
        shares_nll = [x for c in contributions for x in c["shares_nll"]]
        pooled["classes"], pooled["classes_nll"] = summarise_class_shares(shares, shares_nll)
        pooled.update(shares=shares, shares_nll=shares_nll)
    else:  # probes that kept only summaries: each summary combined over the seeds as strata

        def combine(tree: list[dict[str, Any]]) -> dict[str, Any]:
            if all(isinstance(t, dict) and "mean" in t for t in tree):
                return combine_summaries(tree)
            keys = [k for k in tree[0] if all(isinstance(t, dict) and k in t for t in tree)]
            return {k: combine([t[k] for t in tree]) for k in keys}

        for key in ("classes", "classes_nll"):
            if all(c.get(key) for c in contributions):
                pooled[key] = combine([c[key] for c in contributions])
    bins = [c.get("position_profile") or [] for c in contributions]
    pooled["position_profile"] = [
        combine_summaries([b[i] for b in bins if len(b) > i]) for i in range(max((len(b) for b in bins), default=0))
    ]
    meta = dict(studies[0].get("meta") or {})
    for k in ("groups_sampled", "seconds"):
        meta[k] = sum((s.get("meta") or {}).get(k) or 0 for s in studies)
    return {"contributions": pooled, "monte_carlo": mc, "meta": meta}


def _key_spread(
    entries: list[dict[str, Any]], group_seeds_rows: list[list[dict[str, Any]]], pooled_summary: dict[str, Any]
) -> dict[str, Any]:
    """{key: {within, spread, stratified, pooled}} over every key of the pooled summary."""
    out = {}
    for key, pooled in pooled_summary.items():
        values = [[row.get(key) for row in rows] for rows in group_seeds_rows]
        out[key] = {
            "within": [(e.get(mk.PROBE_SUMMARY) or {}).get(key) for e in entries],
            "spread": between_seed_spread(values),
            "stratified": stratified_interval(values),
            "pooled": pooled,
        }
    return out


def pool_probes(probes: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The pooled probe.json of several seeds' probe.json dicts ({seed: probe}, at least two), see the module
    docstring.

    Raises:
        PoolingError: fewer than two seeds, or seeds probed with settings other than the seed that differ (named), or
            with different group sizes or studies.
    """
    if len(probes) < 2:
        raise PoolingError(f"pooling needs at least two seeds, got {len(probes)}")
    seeds = list(probes)
    first = probes[seeds[0]]
    for s in seeds[1:]:
        diffs = _settings_differ(first["meta"].get("config") or {}, probes[s]["meta"].get("config") or {})
        if diffs:
            raise PoolingError(
                f"seed {s} was probed with other settings than seed {seeds[0]} ({'; '.join(diffs)}); "
                f"only the seed may differ between pooled runs"
            )
        if set(probes[s]["per_group_size"]) != set(first["per_group_size"]):
            raise PoolingError(
                f"seed {s} has group sizes {sorted(probes[s]['per_group_size'], key=int)}, seed "
                f"{seeds[0]} {sorted(first['per_group_size'], key=int)}"
            )
        if set(probes[s].get("studies") or {}) != set(first.get("studies") or {}):
            raise PoolingError(
                f"seed {s} ran the studies {sorted(probes[s].get('studies') or {})}, seed {seeds[0]} "
                f"{sorted(first.get('studies') or {})}"
            )
    per_group_size, seeds_r = {}, {}
    for R in sorted(first["per_group_size"], key=int):
        entries = [probes[s]["per_group_size"][R] for s in seeds]
        per_group_size[R] = pool_group_size(entries)
        rows_by_seed = [e.get(mk.PROBE_GROUPS) or [] for e in entries]
        seeds_r[R] = {
            "group_seeds": [s for s, rows in zip(seeds, rows_by_seed) for _ in rows],
            "g2_seeds": [
                s
                for s, e in zip(seeds, entries)
                for _ in ((e.get(mk.PROBE_G2_WEIGHTINGS) or {}).get(mk.PROBE_GROUPS) or [])
            ],
            "g3": {str(s): e.get(mk.PROBE_G3) or {} for s, e in zip(seeds, entries)},
            "keys": _key_spread(entries, rows_by_seed, per_group_size[R][mk.PROBE_SUMMARY]),
        }
    studies: dict[str, Any] = {}
    for name, fn in (("baselines", pool_baseline_study), ("credit", pool_credit_study)):
        if name in (first.get("studies") or {}):
            studies[name] = fn([probes[s]["studies"][name] for s in seeds])
    metas = [probes[s]["meta"] for s in seeds]
    checks = [
        c for d in per_group_size.values() for c in ((d.get(mk.PROBE_SKETCH_CHECK) or {}).get(mk.PROBE_GROUPS) or [])
    ]
    check_summary = summarise_rows(checks) if checks else {}
    covs = [m["gram_coverage"] for m in metas if m.get("gram_coverage") is not None]
    meta = {
        **first["meta"],
        "gram_coverage": min(covs) if covs else None,
        "sketch_coverage": (check_summary.get(mk.SKETCH_COVERAGE) or {}).get("mean"),
        "sketch_check": check_summary,
        "seconds": math.fsum(float(m.get("seconds") or 0) for m in metas),
        "studies_seconds": math.fsum(float(m.get("studies_seconds") or 0) for m in metas),
        "resumed": any(m.get("resumed") for m in metas),
        "config": {**(first["meta"].get("config") or {}), "seed": None},
        "seeds": seeds,
    }
    return {
        "meta": meta,
        "per_group_size": per_group_size,
        "studies": studies,
        SEEDS: {"seeds": seeds, "dirs": [f"seed_{s}" for s in seeds], "per_group_size": seeds_r},
    }


# -- run directories ---------------------------------------------------------------------------------------------------
def read_seed_probes(out: str | Path, seeds: list[int]) -> dict[int, dict[str, Any]]:
    """{seed: DIR/seed_<s>/probe.json} of the given seeds.

    Raises:
        PoolingError: a seed directory without probe.json (not run, or not finished: ``--resume`` continues it).
    """
    probes = {}
    for s in seeds:
        path = seed_dir(out, s) / "probe.json"
        if not path.is_file():
            state = (
                "did not finish (pass --resume to continue it)" if PartialProbe(path.parent).exists() else "has not run"
            )
            raise PoolingError(f"{path} is missing: the probe of seed {s} {state}")
        try:
            probes[s] = read_json_file(path, PoolingError, "run that seed again with --overwrite")
        except ValueError as e:
            raise PoolingError(f"{path} is not valid JSON ({e}); run that seed again with --overwrite") from None
    return probes


def write_pooled(out: str | Path, seeds: list[int]) -> Path:
    """Pool DIR/seed_<s>/probe.json over ``seeds`` into DIR/probe.json and write DIR/report.md; return DIR."""
    out = Path(out)
    pooled = pool_probes(read_seed_probes(out, seeds))
    atomic_write_text(out / "probe.json", json.dumps(pooled, indent=1))
    write_report(out)
    return out


def run_seeds(config: ProbeConfig, seeds: list[int], run: Callable[[ProbeConfig], Path] | None = None) -> Path:
    """One probe per seed into DIR/seed_<s> (``config.out`` = DIR), then the pooled DIR/probe.json and report.md.

    Each seed's probe is ``config`` with that seed, so DIR/seed_<s> holds what ``grpo-lens probe --seed s --out
    DIR/seed_<s>`` would. With ``config.resume``, a finished seed (probe.json, settings equal) is kept, an unfinished
    one continues from its last finished prompt, and the others start. With ``config.overwrite`` every seed starts
    over.

    Args:
        config: the probe settings; ``out`` required, ``seed`` ignored (each run's seed comes from ``seeds``).
        seeds: at least two distinct seeds, in the order they are run and reported.
        run: the probe runner (default :func:`grpo_lens.probe.run.run_probe`; tests pass one that reuses a model).

    Raises:
        ConfigError: no --out, fewer than two seeds, DIR already holding a probe without --resume or --overwrite, a
            finished seed probed with other settings.
    """
    run = run_probe if run is None else run
    out, seeds = seeds_run_args("probe", config.out, seeds, "probe.json")
    check_trackers(config.report_to)  # a missing tracker library fails before --out is touched
    out = out.absolute()  # a reward function may os.chdir
    paths = [out / "probe.json", *(seed_dir(out, s) for s in seeds)]
    refuse_started_seeds(out, paths, config.resume, config.overwrite, "keep the finished seeds and continue the others")
    # 1) what each seed needs, every check before anything is written
    todo = []
    for s in seeds:
        sub = replace(config, seed=s, out=str(seed_dir(out, s)), resume=False)
        finished = seed_dir(out, s) / "probe.json"
        if config.resume and PartialProbe(sub.out).exists():  # type: ignore[arg-type]  # each seed's config has its out
            todo.append(replace(sub, resume=True, overwrite=False))  # continues from its last finished prompt
        elif config.resume and finished.is_file():
            saved = (json.loads(finished.read_text()).get("meta") or {}).get("config") or {}
            diffs = _settings_differ(saved, sub.to_dict())
            if diffs:
                raise ConfigError(
                    f"--resume: seed {s}'s finished probe ({finished}) was measured with other settings "
                    f"({'; '.join(diffs)}); restore them, or pass --overwrite to start every seed over"
                )
            logger.info("seed %d: finished probe kept (%s)", s, finished)
        else:
            todo.append(replace(sub, overwrite=False) if config.resume else sub)
    # 2) the settings, then the seeds' probes, then the pool
    start_seeds_dir(out, config.to_dict())
    for sub in todo:
        logger.info("probe of seed %d into %s", sub.seed, sub.out)
        run(sub)
    write_pooled(out, seeds)
    log_probe(out, config.report_to, {**config.to_dict(), "seed": None, "seeds": seeds})  # the pool, under DIR
    return out


def seed_summary_line(pooled: dict[str, Any]) -> str:
    """One line for the console: per R, the pooled mixed groups and each seed's share of them."""
    parts = []
    for R, d in pooled["per_group_size"].items():
        group_seeds = pooled[SEEDS]["per_group_size"][R]["group_seeds"]
        per_seed = " + ".join(str(group_seeds.count(s)) for s in pooled[SEEDS]["seeds"])
        parts.append(f"R = {R}: {d[mk.GROUPS_MIXED]} mixed groups ({per_seed})")
    return "; ".join(parts)
