"""Probe-side studies of GRPO's baselines, S1 and token credit on a model and task (``grpo-lens probe``).

Each study samples its own rollouts with the trainer's sampling settings, computes with the pure functions of
:mod:`grpo_lens.formulas` and returns a JSON-ready dict that ``probe.json`` stores and the report renders. Formulas:
docs/theory.md §S1, §Baselines at matched expectation, §Token credit.

- :func:`run_baseline_study`: >= 8 prompts with reward contrast, M = 4R rollouts each; per-rollout gradient terms
  c_i g_i sketched over every ``nn.Linear`` weight; bias, variance, MSE and cosine of none / group mean (rescaled) /
  rloo / leave-one-out b* / population b* against a held-out reference; m_C / m_W and the m_C = m_W test per prompt;
  ||E h|| of the length-normalised score. The same rollouts give S1 measured (the first R of each prompt) and S1
  predicted from the other M - R (:func:`s1_measured_and_predicted`), over every sampled prompt.
- :func:`run_credit_study`: signed per-token contributions to a few groups' updates (exact update direction), their
  relative-position profile and answer / format / reasoning shares; Monte Carlo segment advantages of one correct and
  one wrong rollout of the first groups against GRPO's uniform A_i.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from grpo_lens.config.base import field_values
from grpo_lens.formulas.advantages import compute_advantages, constant_groups
from grpo_lens.formulas.baselines import baseline_study
from grpo_lens.formulas.credit import (
    compare_with_uniform,
    paired_class_shares,
    relative_position_profile,
    segment_advantages,
    segment_boundaries,
    segment_counts,
    summarise_class_shares,
    token_classes,
)
from grpo_lens.formulas.losses import aggregation_rollout_weights
from grpo_lens.formulas.sparsity import s1_predicted_outside_group
from grpo_lens.formulas.stats import mean_interval
from grpo_lens.gradients.sketch import sketch_rollout_grads, square_sketch
from grpo_lens.gradients.token_credit import prefix_values_many, signed_token_contributions
from grpo_lens.rewards import combine_rewards, score_batch
from grpo_lens.rollout import sample_groups
from grpo_lens.seeding import derive_seed

if TYPE_CHECKING:
    from grpo_lens.probe.config import ProbeConfig


@dataclass(frozen=True)
class StudySettings:
    """What both studies read: their group size, how they sample and the loss aggregation whose per-rollout weights
    their gradients carry. Built once from a :class:`grpo_lens.probe.config.ProbeConfig` by the studies'
    ``from_probe_config``."""

    group_size: int = 4
    """R_s, rollouts per group of the study (``study_group_size``)."""
    prompts_per_batch: int = 4
    """Prompts per ``generate`` call."""
    max_new_tokens: int = 24
    """Completion length cap T."""
    temperature: float = 0.7
    """Sampling temperature (also the temperature of the scored log-probs)."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    top_p: float = 1.0
    """Nucleus sampling (1: off)."""
    aggregation: str = "seq-mean-token-mean"
    """Loss aggregation whose per-rollout weights the gradients carry (:mod:`grpo_lens.formulas.losses`)."""
    seed: int = 0
    """The probe's seed; every draw's seed is derived from it (:func:`grpo_lens.seeding.derive_seed`)."""

    def sampling(self) -> dict[str, Any]:
        """The keyword arguments of :func:`grpo_lens.rollout.sample_groups` that these settings fix."""
        return dict(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k
        )


def _common_settings(config: ProbeConfig, prompts_per_batch: int) -> dict[str, Any]:
    """The :class:`StudySettings` fields ``config`` sets (the aggregation keeps its default)."""
    return dict(
        group_size=config.study_group_size,
        prompts_per_batch=prompts_per_batch,
        **field_values(config, "max_new_tokens", "temperature", "top_k", "top_p", "seed"),
    )


@dataclass(frozen=True)
class BaselineStudySettings(StudySettings):
    """The baseline study's settings (:func:`run_baseline_study`)."""

    prompts: int = 8
    """Prompts with reward contrast to analyse."""
    max_prompts: int = 32
    """Prompts to sample at most while looking for them."""
    pool_factor: int = 4
    """M / R: rollouts per prompt over the group size (>= 4: the study needs M >= 4R)."""
    sketch_dim: int = 16
    """sketch_in = sketch_out of the LoGra sketch of every ``nn.Linear`` weight (P_s = layers k^2)."""
    resamples: int = 512
    """Resampled groups per prompt for the baselines' bias and variance."""

    @classmethod
    def from_probe_config(cls, config: ProbeConfig, prompts_per_batch: int) -> BaselineStudySettings:
        """``baseline_study_prompts`` prompts with contrast out of at most 4 times as many, at least 2 resamples."""
        return cls(
            prompts=config.baseline_study_prompts,
            max_prompts=4 * config.baseline_study_prompts,
            sketch_dim=config.sketch_dim,
            resamples=max(config.resamples, 2),
            **_common_settings(config, prompts_per_batch),
        )


@dataclass(frozen=True)
class CreditStudySettings(StudySettings):
    """The credit study's settings (:func:`run_credit_study`)."""

    groups: int = 8
    """Mixed groups whose signed token contributions are measured."""
    max_prompts: int = 48
    """Prompts to sample at most while looking for them."""
    mc_groups: int = 2
    """Of those, the first groups whose correct and wrong rollout get Monte Carlo segment advantages."""
    mc_samples: int = 8
    """K_mc continuations sampled per prefix."""
    segments: int = 4
    """Segments per Monte Carlo rollout."""
    bins: int = 10
    """Relative-position bins of the contribution profile."""
    std: str = "sample"
    """GRPO's advantage normalisation (:func:`grpo_lens.formulas.advantages.compute_advantages`)."""
    std_eps: float = 1e-4
    """GRPO's epsilon in A_i = (r_i - mean) / (std + std_eps)."""
    step: float = 1e-2
    """Finite-difference step of the directional derivatives (:mod:`grpo_lens.gradients.token_credit`)."""

    @classmethod
    def from_probe_config(cls, config: ProbeConfig, prompts_per_batch: int) -> CreditStudySettings:
        """``credit_groups`` groups out of at most 6 times as many prompts, the probe's advantage normalisation."""
        return cls(
            groups=config.credit_groups,
            max_prompts=6 * config.credit_groups,
            mc_groups=config.mc_groups,
            mc_samples=config.mc_samples,
            std=config.std,
            std_eps=config.std_eps,
            **_common_settings(config, prompts_per_batch),
        )


def s1_measured_and_predicted(correct: torch.Tensor, valid: torch.Tensor, group_size: int) -> dict[str, Any]:
    """S1 of the first R rollouts of each prompt, and its prediction from the prompt's other M - R rollouts.

    The prediction [C(k', R) + C(M' - k', R)] / C(M', R) (k' correct among the M' = M - R others) is unbiased for
    p^R + (1-p)^R and independent of the measured group, so measured - predicted has mean 0 under the Bernoulli
    model (docs/theory.md §S1). Prompts with an invalid reward are left out.

    Args:
        correct: [B, M] bool.  valid: [B, M] bool.  group_size: R, with M - R >= R.

    Returns:
        {"measured": mean_interval over prompts of the indicator, "predicted": mean_interval of the estimate,
            "difference": mean_interval of measured - predicted, "prompts": B used, "rollouts_per_prompt": M}.

    Raises:
        ValueError: M - R < R.
    """
    B, M = correct.shape
    R = group_size
    keep = valid.all(1)
    c = correct[keep]
    predicted = s1_predicted_outside_group(c, R)  # raises for M - R < R
    group = c[:, :R].double()
    measured = constant_groups(group, torch.ones_like(group, dtype=torch.bool)).double()  # all correct or all wrong
    return {
        "measured": mean_interval(measured.tolist(), bounds=(0.0, 1.0)),
        "predicted": mean_interval(predicted.tolist(), bounds=(0.0, 1.0)),
        "difference": mean_interval((measured - predicted).tolist(), bounds=(-1.0, 1.0)),
        "prompts": int(keep.sum()),
        "rollouts_per_prompt": M,
    }


def _sample_scored(
    policy, tokenizer, task, reward_fns, prompts: int, rollouts: int, seed: int, **sampling: Any
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``prompts`` task prompts drawn with ``seed``, ``rollouts`` completions of each sampled with the same seed, and
    their rewards: (batch, rewards [B, rollouts] float32 NaN where invalid, valid [B, rollouts] bool)."""
    examples = task.sample(prompts, seed=seed)
    batch = sample_groups(policy, tokenizer, examples, rollouts, generator_seed=seed, **sampling)
    rewards, valid, _ = score_batch(batch, reward_fns)
    return batch, rewards, valid


def _score_fn(reward_fns: Any, prompt: Any, extras: dict[str, Any]) -> Callable[[list[str]], list[float]]:
    """completions -> rewards of one prompt (invalid rewards count as 0)."""

    def score(texts: list[str]) -> list[float]:
        # the dataset's extra columns: keywords of the reward functions
        rewards, valid, _ = combine_rewards(
            reward_fns,
            [prompt] * len(texts),
            texts,
            **{k: [v] * len(texts) for k, v in extras.items()},  # type: ignore[arg-type]
        )
        return [float(r) if bool(v) else 0.0 for r, v in zip(rewards, valid)]

    return score


def run_baseline_study(
    policy,
    tokenizer,
    task,
    reward_fns,
    settings: BaselineStudySettings,
    *,
    progress: Any = None,
    presampled: Sequence[tuple[Any, torch.Tensor, torch.Tensor]] = (),
) -> dict[str, Any]:
    """Baselines at matched expectation and S1 predicted without bias, on ``prompts`` prompts with contrast.

    Takes prompts first from ``presampled`` (batches already drawn with M = pool_factor * R rollouts per prompt, and
    their rewards and valid [B, M]: the probe's shared draws, docs/theory.md §Shared draws), then samples prompts in
    batches (seeded) with M rollouts each, until ``prompts`` of them have reward contrast with every reward valid, or
    ``max_prompts`` were used.

    Returns:
        {"baselines": :func:`grpo_lens.formulas.baselines.baseline_study` (per-prompt rows trimmed to
            numbers), "s1": :func:`s1_measured_and_predicted` over every sampled prompt, "meta": {group_size,
            rollouts_per_prompt, prompts_sampled, gradients: "sketch of every nn.Linear weight", sketch_dim,
            aggregation, seconds, presampled_prompts (of prompts_sampled, those from ``presampled``)}}.

    Raises:
        ValueError: pool_factor < 4 (the study needs M >= 4R).
    """
    st = settings
    if st.pool_factor < 4:
        raise ValueError(f"pool_factor must be >= 4 (M >= 4R rollouts per prompt), got {st.pool_factor}")
    t_start = time.perf_counter()
    R, M = st.group_size, st.pool_factor * st.group_size
    pools: list[tuple[torch.Tensor, torch.Tensor]] = []
    correct_rows, valid_rows = [], []
    sampled, draw, reused = 0, 0, 0
    given = iter(presampled)
    while len(pools) < st.prompts and sampled < st.max_prompts:
        item = next(given, None)
        if item is not None:  # a batch the probe already drew, M rollouts per prompt
            batch, rewards, valid = item
            if rewards.shape[1] != M:
                raise ValueError(f"presampled batches need M = {M} rollouts per prompt, got {rewards.shape[1]}")
            n = min(rewards.shape[0], st.max_prompts - sampled)
            reused += n
        else:
            draw += 1
            s = derive_seed(st.seed, group_size=R, draw=draw, offset=17)
            n = min(st.prompts_per_batch, st.max_prompts - sampled)
            batch, rewards, valid = _sample_scored(policy, tokenizer, task, reward_fns, n, M, s, **st.sampling())
        for j in range(n):
            sampled += 1
            rows = torch.arange(j * M, (j + 1) * M)
            r, v = rewards[j], valid[j]
            correct_rows.append(torch.where(v, r >= 1.0, torch.zeros_like(v)))
            valid_rows.append(v)
            if len(pools) >= st.prompts or not bool(v.all()) or bool(constant_groups(r.view(1, M), v.view(1, M))):
                continue
            sub = batch.select(rows)
            c = aggregation_rollout_weights(sub.completion_mask, st.aggregation)
            sketch = sketch_rollout_grads(
                policy,
                sub,
                **square_sketch(st.sketch_dim),
                seed=st.seed,
                temperature=st.temperature,
                weights=c.float().to(sub.completion_ids.device),
            )
            pools.append((sketch.sketch.detach().double().cpu(), r.double().cpu()))
            if progress is not None:  # a tqdm bar: one tick per analysed prompt
                progress.update(1)
    study = baseline_study(pools, R, num_resamples=st.resamples, seed=st.seed) if pools else None
    s1 = s1_measured_and_predicted(torch.stack(correct_rows), torch.stack(valid_rows), R)
    return {
        "baselines": study,
        "s1": s1,
        "meta": {
            "group_size": R,
            "rollouts_per_prompt": M,
            "prompts_sampled": sampled,
            "presampled_prompts": reused,
            "prompts_with_contrast": len(pools),
            "gradients": "LoGra sketch of every nn.Linear weight (embeddings and norms not covered)",
            "sketch_dim": st.sketch_dim,
            "aggregation": st.aggregation,
            "seconds": time.perf_counter() - t_start,
        },
    }


def _segment_counts(rows: list[dict[str, Any]], z: float = 2.0) -> dict[str, int]:
    """:func:`grpo_lens.formulas.credit.segment_counts` (the body lives there, with the other credit formulas)."""
    return segment_counts(rows, z)


def _mean_ci_per_bin(rows: Sequence[Sequence[float]]) -> list[dict[str, float | int | None]]:
    if not rows:
        return []
    return [mean_interval([r[b] for r in rows]) for b in range(len(rows[0]))]


def monte_carlo_rows(
    policy, tokenizer, picks: Sequence[tuple], *, mc_samples: int, seed: int, **sampling: Any
) -> list[dict[str, Any]]:
    """Monte Carlo segment advantages of the picked rollouts, every prefix of all of them sampled in shared
    ``generate`` calls (:func:`grpo_lens.gradients.token_credit.prefix_values_many`).

    Args:
        picks: (prompt_ids [Lp], completion_ids [T'], boundaries, score, reward r_i, GRPO advantage A_i) per rollout.
        mc_samples: K_mc continuations per prefix.  seed: the calls' sampling seed.  sampling: max_new_tokens,
            temperature, top_k, top_p.

    Returns:
        per rollout, {reward, grpo_advantage, boundaries, values, errors, advantages, adv_errors} and
        :func:`grpo_lens.formulas.credit.compare_with_uniform`'s keys (docs/theory.md §Token credit).
    """
    if not picks:
        return []
    prompts, completions, bounds, scores, rewards, advantages = zip(*picks)
    estimates = prefix_values_many(
        policy, tokenizer, prompts, completions, bounds, scores, num_samples=mc_samples, seed=seed, **sampling
    )
    rows = []
    for completion, b, r, a, (values, errors) in zip(completions, bounds, rewards, advantages, estimates):
        seg_adv, seg_err = segment_advantages(values, errors, r)
        full = list(b) + [len(completion)]
        lens = [full[k + 1] - full[k] for k in range(len(b))]
        rows.append(
            {
                "reward": r,
                "grpo_advantage": a,
                "boundaries": full,
                "values": values.tolist(),
                "errors": errors.tolist(),
                "advantages": seg_adv.tolist(),
                "adv_errors": seg_err.tolist(),
                **compare_with_uniform(seg_adv, seg_err, lens, a),
            }
        )
    return rows


def run_credit_study(
    policy, tokenizer, task, reward_fns, settings: CreditStudySettings, *, progress: Any = None
) -> dict[str, Any]:
    """Signed token contributions on ``groups`` mixed groups and Monte Carlo advantages on the first ``mc_groups``.

    Returns:
        {"contributions": {"position_profile": per relative-position bin, mean_interval over groups of the bin's
            summed share; "classes": {class: {"update_share", "token_share", "ratio"}: mean_interval over groups};
            "classes_nll": {class: {"ratio": the same tokens' ratio under NLL weights (every A_i = 1: the control with
            the same gradient geometry), "ratio_minus_nll": the paired difference per group}: mean_interval over
            groups}; "shares", "shares_nll": each group's class shares under A and NLL weights (what --seeds pools);
            "closure": max |sum s - 1| over groups; "groups": n},
            "monte_carlo": {"rollouts": [{reward, grpo_advantage, boundaries, values, errors, advantages, adv_errors,
            disagree, agree, neutral, top_segment_share}], "disagree", "agree", "neutral", "top_segment_share":
            mean_interval over rollouts, "segments": {"disagree", "agree", "total"} counts of segments pooled over
            rollouts (beyond 2 SE), "samples_per_prefix": K_mc},
            "meta": {group_size, groups_sampled, seconds, gradients: "exact (every parameter)", step}}.
    """
    t_start = time.perf_counter()
    st, R = settings, settings.group_size
    found = _CreditGroups()
    analysed, sampled, draw = 0, 0, 0
    # 1. sample batches until ``groups`` mixed groups are measured (or ``max_prompts`` prompts were drawn)
    while analysed < st.groups and sampled < st.max_prompts:
        draw += 1
        s = derive_seed(st.seed, group_size=R, draw=draw, offset=29)
        n = min(st.prompts_per_batch, st.max_prompts - sampled)
        batch, rewards, valid = _sample_scored(policy, tokenizer, task, reward_fns, n, R, s, **st.sampling())
        for j in range(n):
            sampled += 1
            r, v = rewards[j], valid[j]
            if analysed >= st.groups or not bool(v.all()) or bool(constant_groups(r.view(1, R), v.view(1, R))):
                continue
            analysed += 1
            if progress is not None:  # a tqdm bar: one tick per analysed group
                progress.update(1)
            # 2. the group's signed token contributions, and its Monte Carlo rollouts while they are wanted
            _measure_credit_group(policy, tokenizer, reward_fns, batch, j, r, st, found)
    # 3. every Monte Carlo prefix of the picked rollouts in shared generate calls
    mc_rows = monte_carlo_rows(
        policy,
        tokenizer,
        found.mc_picks,
        mc_samples=st.mc_samples,
        seed=derive_seed(st.seed, "monte carlo", group_size=R),
        **st.sampling(),
    )
    # 4. the summaries over groups and rollouts
    return _credit_summary(found, mc_rows, st, analysed, sampled, time.perf_counter() - t_start)


@dataclass
class _CreditGroups:
    """What the credit study measured of its groups so far: each group's position profile, class shares under A and
    under NLL weights, closure, and the (correct, wrong) rollouts picked for Monte Carlo."""

    profiles: list[list[float]] = field(default_factory=list)
    shares: list[dict[str, float]] = field(default_factory=list)
    shares_nll: list[dict[str, float]] = field(default_factory=list)
    closures: list[float] = field(default_factory=list)
    mc_picks: list[tuple] = field(default_factory=list)


def _measure_credit_group(
    policy,
    tokenizer,
    reward_fns,
    batch: Any,
    j: int,
    r: torch.Tensor,
    st: CreditStudySettings,
    found: _CreditGroups,
) -> None:
    """Group ``j`` of ``batch`` (rewards ``r`` [R], mixed): its signed token contributions under GRPO's A and under
    NLL weights (:func:`grpo_lens.formulas.credit.paired_class_shares`) added to ``found``, and, while fewer than
    ``mc_groups`` groups are picked, its best and worst rollout with their segment boundaries."""
    R = st.group_size
    group = batch.select(torch.arange(j * R, (j + 1) * R))
    # the config's check allows only these names
    adv = compute_advantages(r.view(1, R).double(), "grpo", std=st.std, std_eps=st.std_eps)[0]  # type: ignore[arg-type]
    mask = group.completion_mask.cpu()
    classes = token_classes(tokenizer, group.completion_ids.cpu(), mask)
    # under A and under the control with the same gradient geometry (NLL weights, every A_i = 1)
    res, sh, sh_nll = paired_class_shares(
        lambda a: signed_token_contributions(
            policy, group, a, aggregation=st.aggregation, step=st.step, temperature=st.temperature
        ),
        adv,
        classes,
    )
    found.profiles.append(relative_position_profile(res["contributions"], mask, st.bins).tolist())
    found.shares.append(sh)
    found.shares_nll.append(sh_nll)
    found.closures.append(abs(res["closure"]))
    if len(found.mc_picks) < 2 * st.mc_groups:  # its correct and its wrong rollout, sampled after the loop
        prompt_ids = group.prompt_ids[0][group.prompt_mask[0].bool()]
        score = _score_fn(reward_fns, batch.prompts[j], {k: vals[j] for k, vals in batch.extras.items()})
        for i in (int(torch.nonzero(r == r.max())[0]), int(torch.nonzero(r == r.min())[0])):
            completion = group.completion_ids[i][group.completion_mask[i]]
            bounds = segment_boundaries(len(completion), st.segments)[:-1]  # the whole rollout needs none
            found.mc_picks.append((prompt_ids, completion, bounds, score, float(r[i]), float(adv[i])))


def _credit_summary(
    found: _CreditGroups,
    mc_rows: list[dict[str, Any]],
    st: CreditStudySettings,
    analysed: int,
    sampled: int,
    seconds: float,
) -> dict[str, Any]:
    """:func:`run_credit_study`'s result from its groups and Monte Carlo rows."""
    class_summary, nll_summary = summarise_class_shares(found.shares, found.shares_nll)
    return {
        "contributions": {
            "position_profile": _mean_ci_per_bin(found.profiles),
            "classes": class_summary,
            "classes_nll": nll_summary,
            "shares": found.shares,
            "shares_nll": found.shares_nll,  # per group
            "closure": max(found.closures) if found.closures else None,
            "groups": analysed,
        },
        "monte_carlo": {
            "rollouts": mc_rows,
            "samples_per_prefix": st.mc_samples,
            **{
                k: mean_interval([row[k] for row in mc_rows], bounds=(0.0, 1.0))
                for k in ("disagree", "agree", "neutral", "top_segment_share")
            },
            "segments": _segment_counts(mc_rows),
        },
        "meta": {
            "group_size": st.group_size,
            "groups_sampled": sampled,
            "gradients": "exact update direction (every parameter)",
            "step": st.step,
            "seconds": seconds,
        },
    }
