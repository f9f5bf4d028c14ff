"""The cells of `grpo-lens calibrate`, per rule group: the per-group (probe) rules, the training-run trends, rank
stays, S4 on a planted update, Monte Carlo credit, the baseline study, interval coverage."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from grpo_lens import metrics as mk
from grpo_lens.analysis.group import (
    lens_rank_intervals,
    mean_over_groups,
)
from grpo_lens.calibrate.families import (
    BASELINE_FAMILIES,
    FAMILIES,
    GROUP_CELLS,
    PLANTED_DIM,
    PLANTED_WARMUP,
    S1_TRENDS,
    SPARSITY_TRENDS,
    STAYS_FAMILIES,
    STAYS_SEEDS_FAMILIES,
    TREND_BUDGETS,
    CalibrationConfig,
    _draw,
    _outcomes,
    _theta,
    analysed_pool,
    boundary_noise,
    has_rank2_signal,
    label_directions,
    parallel_map,
    population_shares,
    probe_of,
)
from grpo_lens.claims.base import CLAIMS
from grpo_lens.claims.baselines import RULE_ID as BASELINE_RULE_ID
from grpo_lens.claims.credit import MC_RULE_ID
from grpo_lens.claims.rank import RULE_ID as RANK_RULE_ID
from grpo_lens.claims.rank import STAYS_RULE_ID, STAYS_SEEDS_RULE_ID
from grpo_lens.claims.sparsity import (
    S1_RULE_ID,
    S1_SEEDS_RULE_ID,
    S4_RULE_ID,
    SPARSITY_RULE_ID,
    SPARSITY_SEEDS_RULE_ID,
)
from grpo_lens.claims.zero_sum import NEGLIGIBLE_SHARE
from grpo_lens.claims.zero_sum import RULE_ID as ZERO_SUM_RULE_ID
from grpo_lens.formulas.baselines import baseline_prompt, summarise_baseline_prompts
from grpo_lens.formulas.credit import segment_advantages, segment_counts
from grpo_lens.formulas.sparsity import weighted_hoyer
from grpo_lens.formulas.stats import mean_interval
from grpo_lens.lens.sparsity import SparsityOverTraining  # the lens's own sampler: the path under test (S4)


# ---------------------------------------------------------------------------------------------------------------------
# the per-group rules (probe)
# ---------------------------------------------------------------------------------------------------------------------
def _family_rows(fam: str, config: CalibrationConfig, noise: dict[int, float]) -> tuple[list[dict[str, Any]], str]:
    """One family's rows of the rank and mechanism rules (a worker's unit: its own seeds, so the rows do not depend on
    which worker ran it or in which order)."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    index = list(FAMILIES).index(fam) if fam in FAMILIES else len(FAMILIES)
    gen = torch.Generator().manual_seed(config.seed + 7919 * (index + 1))
    pools, shares, thetas = {}, {}, {}
    for R in config.group_sizes:
        pools[R] = analysed_pool(fam, R, config.pool, PLANTED_DIM, config.seed + 1000 * R, noise.get(R))
        shares[R] = population_shares(fam, R, noise.get(R))
        thetas[R] = _theta(pools[R])
    # the boundary's E₂ = 0.9 is not above 0.9: not rank 2 by definition
    rank2 = has_rank2_signal(fam) and fam != "boundary" and all(e2 > 0.9 > e1 for e2, e1 in shares.values())
    labels = label_directions(fam) and all(th >= NEGLIGIBLE_SHARE for th in thetas.values())
    pop = "; ".join(f"R = {R}: E₂ {e2:.3f}, E₁ {e1:.3f}, θ {thetas[R]:.3f}" for R, (e2, e1) in shares.items())
    if fam == "boundary":
        pop += "; noise shares " + ", ".join(f"{noise[R]:.3f} (R = {R})" for R in config.group_sizes)
    out = []
    for cell in config.group_cells:
        ns = {R: GROUP_CELLS[cell].get(R, cell) for R in config.group_sizes}
        rank_v, zs_v = [], []
        for _ in range(config.trials):
            p = probe_of({R: _draw(pools[R], ns[R], gen) for R in config.group_sizes}, PLANTED_DIM)
            rank_v += list(CLAIMS.get("rank_two_top2_share")(p))
            zs_v += list(CLAIMS.get("zero_sum_rank_two")(p))
        base = {
            "family": fam,
            "R": "/".join(map(str, config.group_sizes)),
            "n": cell,
            "groups": " / ".join(str(ns[R]) for R in config.group_sizes),
            "unit": "groups per R",
            "population": pop,
        }
        out.append({**base, "rule": RANK_RULE_ID, "truth": "true" if rank2 else "false", **_outcomes(rank_v)})
        out.append({**base, "rule": ZERO_SUM_RULE_ID, "truth": "true" if labels else "false", **_outcomes(zs_v)})
    return out, f"calibrate: {fam}: {time.perf_counter() - t0:.1f} s ({pop})"


def calibrate_group_rules(config: CalibrationConfig, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Rows of the rank rule and the mechanism rule over the planted families: one truth per family and claim; the
    families run on ``config.workers`` processes."""
    noise = {R: boundary_noise(R) for R in config.group_sizes} if "boundary" in config.families else {}
    out: list[dict[str, Any]] = []
    results = parallel_map(_family_rows, list(config.families), config.workers, config, noise)
    for rows, line in results:
        log(line)
        out += rows
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the training-run rules
# ---------------------------------------------------------------------------------------------------------------------
def _ar(n: int, phi: float, gen: torch.Generator) -> list[float]:
    """n values of a stationary AR(1) with unit marginal variance (φ < 1) or a random walk of unit steps (φ = 1)."""
    z = torch.randn(n, generator=gen, dtype=torch.float64).tolist()
    out = [z[0]]
    for e in z[1:]:
        out.append(out[-1] + e if phi >= 1 else phi * out[-1] + math.sqrt(1 - phi * phi) * e)
    return out


#: the default schedule's lens steps (30 steps, lens every 5: the first, every 5th and the last)
LENS_STEPS = (1, 5, 10, 15, 20, 25, 30)


def lens_steps(steps: int, every: int) -> list[int]:
    """The steps the lens measures at: the first, every ``every``-th and the last (:data:`LENS_STEPS` at 30, 5)."""
    return sorted({1, steps, *range(every, steps + 1, every)})


def _planted_lr(step: int, kind: str) -> float:
    """The planted runs' learning rate: rising linearly over :data:`PLANTED_WARMUP` steps in the "warmup" kind,
    constant otherwise (what ``perf/lr`` logs)."""
    return 1e-6 * min(1.0, step / PLANTED_WARMUP) if kind == "warmup" else 1e-6


def _sparsity_records(
    kind: str, phi: float, gen: torch.Generator, size: int = 4096, steps: int = 30, every: int = 5
) -> list[dict[str, float]]:
    """metrics.jsonl-shaped lens records of a planted gradient-Hoyer sequence at :func:`lens_steps`: "ar" a flat
    Hoyer 0.3 plus AR(1) noise (SD 0.02) over every step with correlation φ^(1/5) per step (φ between lens steps 5
    apart; φ = 1 a random walk); "rising" 0.30 -> 0.45 over the run plus that noise; "warmup" that noise plus 0.1
    over the LR warm-up's steps; "groups" the Hoyer of a sum of m per-group gradients (each 70% zeros on a random
    support; m falls 8 -> 1 over the lens steps), whose per-group sparsity is constant."""
    at = lens_steps(steps, every)
    n = len(at)
    if kind == "groups":
        recs = []
        for i, step in enumerate(at):
            m = round(8 - 7 * i / (n - 1))
            g: torch.Tensor = sum(  # type: ignore[assignment]  # m >= 1 terms: a tensor, never the start 0
                torch.randn(size, generator=gen, dtype=torch.float64) * (torch.rand(size, generator=gen) < 0.3)
                for _ in range(m)
            )
            recs.append(
                {
                    mk.STEP: float(step),
                    mk.PERF_LENS_SECONDS: 0.0,
                    mk.LR: _planted_lr(step, kind),
                    mk.RANK_MIXED_GROUPS: float(m),
                    mk.SPARSITY_GRAD_HOYER: weighted_hoyer(g),
                }
            )
        return recs
    noise = _ar(steps, phi if phi >= 1 else phi ** (1 / 5), gen)
    rw = 1 / math.sqrt(5) if phi >= 1 else 1.0  # a random walk's lens-to-lens step of SD 1, as before
    out = []
    for step in at:
        base = 0.3 + (0.15 * (step - 1) / (steps - 1) if kind == "rising" else 0.0)
        base += 0.1 * (1 - (step - 1) / PLANTED_WARMUP) if kind == "warmup" and step <= PLANTED_WARMUP else 0.0
        out.append(
            {
                mk.STEP: float(step),
                mk.PERF_LENS_SECONDS: 0.0,
                mk.LR: _planted_lr(step, kind),
                mk.RANK_MIXED_GROUPS: 4.0,
                mk.SPARSITY_GRAD_HOYER: base + 0.02 * rw * noise[step - 1],
            }
        )
    return out


def _s1_records(
    kind: str, phi: float, gen: torch.Generator, steps: int = 30, groups: int = 4, group_size: int = 8
) -> list[dict[str, float]]:
    """Records of S1 per step: ``groups`` prompts per step with success rates p = Φ(mean + 0.8 z_t + 0.6 e) over an
    AR(1) z_t of correlation φ between steps (the model's accuracy drifting; φ = 1 a random walk of steps 0.3) and a
    per-prompt e; "rising" pushes the mean up so that S1 goes from about 0.35 to 0.85 (R = 8); "warmup" adds 1.5 to
    the mean over the LR warm-up's steps (S1 high while the LR rises), then stationary."""
    z = _ar(steps, phi, gen)
    recs = []
    for step in range(1, steps + 1):
        mu = 2.2 * (step - 1) / (steps - 1) if kind == "rising" else 0.0
        mu += 1.5 if kind == "warmup" and step < PLANTED_WARMUP else 0.0
        drift = 0.8 * z[step - 1] * (0.3 if phi >= 1 else 1.0)
        e = torch.randn(groups, generator=gen, dtype=torch.float64)
        lat = mu + (drift if kind in ("ar", "warmup") else 0.0) + (0.6 if kind in ("ar", "warmup") else 1.0) * e
        p = torch.special.ndtr(lat)
        correct = (torch.rand(groups, group_size, generator=gen, dtype=torch.float64) < p[:, None]).sum(1)
        recs.append(
            {
                mk.STEP: float(step),
                mk.LR: _planted_lr(step, kind),
                mk.REWARD_FRAC_ZERO_STD_GROUPS: float(((correct == 0) | (correct == group_size)).double().mean()),
            }
        )
    return recs


def _trend_data(runs: list[list[dict[str, float]]]) -> dict[str, Any]:
    """What a training claim reads: one run's records, or several seeds' (as the report of `train --seeds` passes)."""
    return {"records": runs[0], **({"seed_runs": runs} if len(runs) > 1 else {})}


def calibrate_training_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of the gradient-sparsity trend and the S1 trend, in one run (fixed-b HAC) at the default schedule (30
    steps, lens every 5) and with the lens on every step, and pooled over 3 and 5 seeds (t over seeds' OLS slopes):
    flat cases with autocorrelated steps, a warm-up transient and (pooled) a random walk as nulls, planted rises as
    alternatives (:data:`TREND_BUDGETS`)."""
    out = []
    gen = torch.Generator().manual_seed(config.seed + 7)
    claims = {"sparsity": CLAIMS.get("sparsity_intensifies"), "s1": CLAIMS.get("zero_variance_share_rises")}
    ids = {
        ("sparsity", False): SPARSITY_RULE_ID,
        ("sparsity", True): SPARSITY_SEEDS_RULE_ID,
        ("s1", False): S1_RULE_ID,
        ("s1", True): S1_SEEDS_RULE_ID,
    }
    for name, budgets in TREND_BUDGETS.items():
        families = SPARSITY_TRENDS if name == "sparsity" else S1_TRENDS
        for seeds, steps, every in budgets:
            pooled = seeds > 1
            tested = len(lens_steps(steps, every)) - 1 if name == "sparsity" else steps
            for fam, (truth, kind, phi) in families.items():
                vs = []
                for _ in range(config.trials):
                    if name == "sparsity":
                        runs = [_sparsity_records(kind, phi, gen, steps=steps, every=every) for _ in range(seeds)]
                    else:
                        runs = [_s1_records(kind, phi, gen, steps=steps) for _ in range(seeds)]
                    vs.append(claims[name](_trend_data(runs))[0])
                what = f"lens steps (every {every})" if name == "sparsity" else "steps × 4 prompts"
                out.append(
                    {
                        "rule": ids[name, pooled],
                        "family": fam,
                        "R": "–" if name == "sparsity" else 8,
                        "n": seeds if pooled else tested,
                        "unit": f"seeds × {tested} {what}" if pooled else what,
                        "truth": "true" if truth else "false",
                        **_outcomes(vs),
                    }
                )
    return out


def calibrate_stays_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of "rank stays ≈ 2": planted lens runs of 7 lens steps at R = 8, each step's rows drawn from a planted
    pool and aggregated as the lens does (:func:`grpo_lens.analysis.group.mean_over_groups`,
    :func:`grpo_lens.analysis.group.lens_rank_intervals`)."""
    gen = torch.Generator().manual_seed(config.seed + 29)
    good = analysed_pool("a0.01", 8, config.pool, PLANTED_DIM, config.seed + 31)
    bad = analysed_pool("a0.25", 8, config.pool, PLANTED_DIM, config.seed + 37)
    rule = CLAIMS.get("rank_stays_near_two")
    out = []

    def run(m: int, bad_step: str | None) -> list[dict[str, float]]:
        recs = []
        for i, step in enumerate(LENS_STEPS):
            pool = bad if bad_step == "all" or (bad_step and i == 3) else good
            rows = _draw(pool, m, gen)
            recs.append(
                {
                    mk.STEP: float(step),
                    mk.RANK_MIXED_GROUPS: float(m),
                    **mean_over_groups(rows),
                    **lens_rank_intervals(rows),
                }
            )
        return recs

    for fam, (truth, m, bad_step) in STAYS_FAMILIES.items():
        vs = [rule({"records": run(m, bad_step)})[0] for _ in range(config.trials)]
        out.append(
            {
                "rule": STAYS_RULE_ID,
                "family": fam,
                "R": 8,
                "n": m,
                "unit": "mixed groups per lens step",
                "truth": "true" if truth else "false",
                **_outcomes(vs),
            }
        )
    for fam, (truth, seeds, m, bad_step) in STAYS_SEEDS_FAMILIES.items():
        vs = [rule(_trend_data([run(m, bad_step) for _ in range(seeds)]))[0] for _ in range(config.trials)]
        out.append(
            {
                "rule": STAYS_SEEDS_RULE_ID,
                "family": fam,
                "R": 8,
                "n": seeds,
                "unit": f"seeds × 7 lens steps × {m} mixed groups",
                "truth": "true" if truth else "false",
                **_outcomes(vs),
            }
        )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# studies and the lens's S4 sampler
# ---------------------------------------------------------------------------------------------------------------------
#: per-tensor offsets of the zero share around a family's share (the tensors differ, as layers do: the stratified SE
#: matters); norms get no update at all
_S4_TENSOR_OFFSETS = {"embed_tokens": 0.05, "q_proj": -0.2, "up_proj": 0.1, "down_proj": -0.1}

#: weights of :func:`planted_update_model`
PLANTED_UPDATE_WEIGHTS = 256 * 64 + 64 * 64 + 2 * 128 * 64 + 2 * 64

#: weights the S4 calibration's lens samples (the default lens samples 2^19 of a real model: wider intervals here)
S4_SAMPLE = 4000


def planted_update_model(gen: torch.Generator) -> torch.nn.Module:
    """A small model with the parameter names of a decoder (embedding, q_proj, up/down_proj, a norm; 36,992 weights),
    weights N(0, 0.02²) like an initialised LM (norm weight 1, bias 0), for the S4 calibration."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.embed_tokens = torch.nn.Embedding(256, 64)
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.q_proj = torch.nn.Linear(64, 64, bias=False)
    layer.mlp = torch.nn.Module()
    layer.mlp.up_proj = torch.nn.Linear(64, 128, bias=False)
    layer.mlp.down_proj = torch.nn.Linear(128, 64, bias=False)
    root.model.layers = torch.nn.ModuleList([layer])
    root.model.norm = torch.nn.LayerNorm(64)
    with torch.no_grad():
        for name, p in root.named_parameters():
            if ".norm." not in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return root


def _s4_trial(
    family: tuple[str, float, float, float], gen: torch.Generator, seed: int
) -> tuple[dict[str, float], float]:
    """(the lens record after one planted update since the start, the whole model's float32-unchanged share): the
    update goes through :class:`grpo_lens.lens.sparsity.SparsityOverTraining` as the trainer's optimizer step does."""
    _, zero, scale, sigma = family
    model = planted_update_model(gen)
    lens = SparsityOverTraining(model, size=S4_SAMPLE, min_per_tensor=128, seed=seed)
    lens.before_step()
    unchanged = total = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind = next((k for k in _S4_TENSOR_OFFSETS if k in name), None)
            if kind is None:  # the norm: no update
                share = 1.0
            else:
                share = min(max(zero + _S4_TENSOR_OFFSETS[kind], 0.0), 1.0) if zero else 0.0
            d = scale * torch.randn(p.shape, generator=gen) * torch.exp(sigma * torch.randn(p.shape, generator=gen))
            d = d * (torch.rand(p.shape, generator=gen) >= share)
            new = p + d
            unchanged += int((new == p).sum())
            total += p.numel()
            p.copy_(new)
    return {mk.STEP: 30.0, mk.PERF_LENS_SECONDS: 0.0, **lens.after_step()}, unchanged / total


def calibrate_update_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of "most parameters unchanged" (S4): planted updates of a small model (:data:`S4_FAMILIES`) through the
    lens's sample and :func:`grpo_lens.claims.sparsity.most_parameters_unchanged`; each trial draws a new model,
    update and sample. Truth per trial: the whole model's float32-unchanged share > 0.5 (exact, every weight); also
    the coverage of the rule's 95% interval of that share (stratified SE)."""
    rule = CLAIMS.get("most_parameters_unchanged")
    gen = torch.Generator().manual_seed(config.seed + 13)
    out = []
    for i, fam in enumerate(config.s4_families):
        verdicts, truths, covered, bf16, perm, dense, zs = [], [], 0, [], [], [], []
        for t in range(config.trials):
            rec, z = _s4_trial(fam, gen, seed=config.seed + 1000 * i + t)
            verdicts.append(rule({"records": [rec]})[0])
            truths.append(z > 0.5)
            zs.append(z)
            est, se = rec[mk.SPARSITY_UPDATE_TOTAL_F32_UNCHANGED], rec[mk.SPARSITY_UPDATE_TOTAL_F32_UNCHANGED_SE]
            covered += abs(est - z) <= 1.96 * se
            bf16.append(rec[mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED])
            perm.append(rec[mk.SPARSITY_UPDATE_TOTAL_BF16_PERMUTED])
            dense.append(rec[mk.SPARSITY_UPDATE_TOTAL_BF16_DENSE])
        if len(set(truths)) > 1:
            raise RuntimeError(f"S4 family {fam[0]!r}: the truth differs between trials; move it off 0.5")
        mean = lambda v: sum(v) / len(v)  # noqa: E731
        out.append(
            {
                "rule": S4_RULE_ID,
                "family": fam[0],
                "R": "–",
                "n": S4_SAMPLE,
                "unit": "sampled weights",
                "truth": "true" if truths[0] else "false",
                "bf16_unchanged": mean(bf16),
                "bf16_permuted": mean(perm),
                "bf16_dense": mean(dense),
                "f32_unchanged": mean(zs),
                "f32_coverage": covered / config.trials,
                **_outcomes(verdicts),
            }
        )
    return out


def _mc_rollout(
    p: tuple[float, ...], reward: float, adv: float, mc_samples: int, gen: torch.Generator
) -> dict[str, Any]:
    """One rollout's Monte Carlo row as :func:`grpo_lens.probe.studies.run_credit_study` writes it: each prefix's
    value from K_mc = ``mc_samples`` Bernoulli(p) continuations (mean, sample std / √K_mc, as
    :func:`grpo_lens.gradients.token_credit.prefix_values`), then
    :func:`grpo_lens.formulas.credit.segment_advantages`."""
    draws = (torch.rand(len(p), mc_samples, generator=gen, dtype=torch.float64) < torch.tensor(p)[:, None]).double()
    values, errors = draws.mean(1), draws.std(1, unbiased=True) / math.sqrt(mc_samples)
    seg_adv, seg_err = segment_advantages(values, errors, reward)
    return {
        "reward": reward,
        "grpo_advantage": adv,
        "values": values.tolist(),
        "errors": errors.tolist(),
        "advantages": seg_adv.tolist(),
        "adv_errors": seg_err.tolist(),
    }


def _credit_family(item: tuple[int, str], config: CalibrationConfig) -> list[dict[str, Any]]:
    """One Monte Carlo credit family's rows (a worker's unit, its own seed)."""
    torch.set_num_threads(1)
    i, fam = item
    truth, p_correct, p_wrong = config.mc_families[fam]
    rule = CLAIMS.get("monte_carlo_credit")
    gen = torch.Generator().manual_seed(config.seed + 17 + 7919 * i)
    mc_samples = 8
    out = []
    for n in config.mc_rollouts:
        verdicts = []
        for _ in range(config.trials):
            rows = [
                _mc_rollout(p_correct, 1.0, 1.0, mc_samples, gen)
                if j % 2 == 0
                else _mc_rollout(p_wrong, 0.0, -1.0, mc_samples, gen)
                for j in range(n)
            ]
            credit = {
                "monte_carlo": {"rollouts": rows, "samples_per_prefix": mc_samples, "segments": segment_counts(rows)}
            }
            verdicts.append(rule({"studies": {"credit": credit}})[0])
        out.append(
            {
                "rule": MC_RULE_ID,
                "family": fam,
                "R": "–",
                "n": n,
                "unit": "rollouts",
                "truth": "true" if truth else "false",
                **_outcomes(verdicts),
            }
        )
    return out


def calibrate_credit_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of the Monte Carlo credit rule (:func:`grpo_lens.claims.credit.monte_carlo_credit`): planted true values
    at the prefixes (:data:`MC_FAMILIES`), K_mc = 8 continuations per prefix (the probe's default), the study's own
    segment counting (``grpo_lens.formulas.credit.segment_counts``) and the registered claim. Truth (one boundary,
    the rule's margin): some segment position's planted mean shift against A_i exceeds
    :data:`grpo_lens.claims.credit.MC_MARGIN` (a real opposition of 0.05, or of exactly 0.1, is false)."""
    items = list(enumerate(config.mc_families))
    return [row for rows in parallel_map(_credit_family, items, config.workers, config) for row in rows]


def planted_prompt(
    family: str, mu: torch.Tensor, gen: torch.Generator, group_size: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """One planted baseline-study prompt of ``family`` (:data:`BASELINE_FAMILIES`): (gradient terms [M, k], rewards
    [M]), M = 4R rollouts, rewards Bernoulli(0.5), g = ±μ/2 + noise in R^k (k = len(μ), ‖μ‖ = 1): the score's mean
    direction splits by class so E[g] = 0, noise N(0, I/k) scaled by the family's factor s for correct rollouts, so
    m_W = 1.25 and m_C = 0.25 + s² (:func:`grpo_lens.calibrate.families.planted_norm_ratio`)."""
    _, scale, kind = BASELINE_FAMILIES[family]
    dim, m = mu.shape[0], 4 * group_size
    rewards = (torch.rand(m, generator=gen) < 0.5).double()
    noise = torch.randn(m, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)
    if kind == "spread":  # correct rollouts' noise scaled by s_i, s_i² ~ Exponential(1): E s_i² = 1, equal means
        noise = noise * torch.where(
            rewards[:, None] == 1,
            torch.empty(m, 1, dtype=torch.float64).exponential_(generator=gen).sqrt(),
            torch.ones(m, 1, dtype=torch.float64),
        )
    g = torch.where(rewards[:, None] == 1, 0.5 * mu + scale * noise, -0.5 * mu + noise)
    if kind == "one string":  # one gradient for every correct rollout, ‖μ/2 + a z‖² = 1.25 = m_W exactly
        z = noise[0] - (noise[0] @ mu) * mu  # orthogonal to μ: ‖μ/2 + a z‖² = 0.25 + a² ‖z‖²
        g = torch.where(rewards[:, None] == 1, (0.5 * mu + z / z.norm())[None], g)
    return g, rewards


def _baseline_pool(family: str, size: int, seed: int, group_size: int = 4, dim: int = 64) -> list[dict[str, Any]]:
    """``size`` planted prompts (:func:`planted_prompt`) through :func:`grpo_lens.formulas.baselines.baseline_prompt`
    (the probe's 256 resampled groups)."""
    gen = torch.Generator().manual_seed(seed)
    mu = torch.randn(dim, generator=gen, dtype=torch.float64)
    mu = mu / mu.norm()
    out = []
    for j in range(size):
        g, rewards = planted_prompt(family, mu, gen, group_size)
        res = baseline_prompt(g, rewards, group_size, num_resamples=256, seed=seed + j)
        if res is not None:
            out.append(res)
    return out


def _baseline_family(item: tuple[int, str], config: CalibrationConfig) -> list[dict[str, Any]]:
    """One baseline family's rows (a worker's unit, its own seeds): its pool of 4× the largest
    ``config.baseline_prompts`` planted prompts, then n prompts drawn per trial at each of them."""
    torch.set_num_threads(1)
    i, fam = item
    truth = config.baseline_families[fam][0]
    rule = CLAIMS.get("group_mean_optimal")
    gen = torch.Generator().manual_seed(config.seed + 19 + 7919 * i)
    pool = _baseline_pool(fam, 4 * max(config.baseline_prompts), config.seed + 100 * i)
    out = []
    for n in config.baseline_prompts:
        verdicts = []
        for _ in range(config.trials):
            study = summarise_baseline_prompts(_draw(pool, n, gen))
            probe = {"studies": {"baselines": {"baselines": study, "meta": {"group_size": 4}}}}
            verdicts.append(rule(probe)[0])
        out.append(
            {
                "rule": BASELINE_RULE_ID,
                "family": fam,
                "R": 4,
                "n": n,
                "unit": "prompts",
                "truth": "true" if truth else "false",
                **_outcomes(verdicts),
            }
        )
    return out


def calibrate_baseline_rules(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Rows of :func:`grpo_lens.claims.baselines.group_mean_optimal`: a pool of planted prompts per family analysed
    once by the study's per-prompt body; each trial draws n prompts, summarises them with the study's own summary
    (:func:`grpo_lens.formulas.baselines.summarise_baseline_prompts`) and applies the registered claim."""
    items = list(enumerate(config.baseline_families))
    return [row for rows in parallel_map(_baseline_family, items, config.workers, config) for row in rows]


def interval_coverage(config: CalibrationConfig) -> list[dict[str, Any]]:
    """Coverage of :func:`grpo_lens.formulas.stats.mean_interval` (nominal 0.95) at n = 8, 22, 34 on normal,
    log-normal (σ = 1) and zero-inflated data (60% zeros, log-normal otherwise), with its one-sided misses."""
    gen = torch.Generator().manual_seed(config.seed + 11)
    samplers = {
        "normal": (lambda n: torch.randn(n, generator=gen, dtype=torch.float64), 0.0),
        "log-normal": (lambda n: torch.exp(torch.randn(n, generator=gen, dtype=torch.float64)), math.exp(0.5)),
        "zero-inflated": (
            lambda n: (
                (torch.rand(n, generator=gen) < 0.4).double()
                * torch.exp(torch.randn(n, generator=gen, dtype=torch.float64))
            ),
            0.4 * math.exp(0.5),
        ),
    }
    out = []
    for name, (draw, mu) in samplers.items():
        for n in (8, 22, 34):
            lo_miss = hi_miss = 0
            for _ in range(config.coverage_trials):
                ci = mean_interval(draw(n).tolist())
                lo_miss += float(ci["lo"]) > mu  # type: ignore[arg-type]  # n >= 8 values: never None
                hi_miss += float(ci["hi"]) < mu  # type: ignore[arg-type]
            t = config.coverage_trials
            out.append(
                {
                    "data": name,
                    "n": n,
                    "coverage": 1 - (lo_miss + hi_miss) / t,
                    "miss_below": hi_miss / t,
                    "miss_above": lo_miss / t,
                }
            )
    return out
