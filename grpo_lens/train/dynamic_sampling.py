"""Dynamic sampling (DAPO, Yu et al. arXiv 2503.14476 §3.2): resample until the step has B groups with reward contrast.

A group whose valid rewards are all equal has zero advantage on every rollout and carries no policy gradient (S1,
docs/theory.md §Dynamic sampling). :func:`collect_mixed_groups` keeps drawing rounds of B fresh prompts, keeps the
mixed groups in sampling order, and stops at B of them or after ``max_extra_rounds`` extra rounds; at the cap it
returns what it found (fewer than B groups), never fails. :func:`concat_batches` and :func:`select_groups` are the
batch bookkeeping it needs.

Shapes: B prompts, R group size, N = B R rollouts, Lp prompt tokens (left padded), T completion tokens (right padded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_lens import metrics as mk
from grpo_lens.formulas.advantages import constant_groups
from grpo_lens.rollout import RolloutBatch

#: One sampling round: round index -> (batch of N rollouts, rewards [N] NaN invalid, valid [N] bool, reward metrics,
#: *other per-rollout [N] tensors to keep alongside, e.g. correctness).
SampleRound = Callable[[int], tuple]


def select_groups(batch: RolloutBatch, groups: list[int]) -> RolloutBatch:
    """The rollouts of whole groups ``groups`` (indices into the B groups), with their prompts, texts and extras."""
    R = batch.group_size
    rows = [g * R + i for g in groups for i in range(R)]
    sub = batch.select(rows)
    sub.prompts = [batch.prompts[g] for g in groups]
    sub.extras = {k: [v[g] for g in groups] for k, v in batch.extras.items()}
    return sub


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Rollouts of several batches (same R) one after another: prompts left padded to the longest Lp, completions
    right padded to the longest T (pad_id, mask 0, sampler log-prob 0)."""
    if len(batches) == 1:
        return batches[0]
    lp = max(b.prompt_ids.shape[1] for b in batches)
    t = max(b.completion_ids.shape[1] for b in batches)

    def left(x: Tensor, width: int, value) -> Tensor:
        return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

    def right(x: Tensor, width: int, value) -> Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    return RolloutBatch(
        prompt_ids=torch.cat([left(b.prompt_ids, lp, pad_id) for b in batches]),
        prompt_mask=torch.cat([left(b.prompt_mask, lp, 0) for b in batches]),
        completion_ids=torch.cat([right(b.completion_ids, t, pad_id) for b in batches]),
        completion_mask=torch.cat([right(b.completion_mask, t, False) for b in batches]),
        sampler_logprobs=torch.cat([right(b.sampler_logprobs, t, 0.0) for b in batches]),
        truncated=torch.cat([b.truncated for b in batches]),
        group_size=batches[0].group_size,
        prompts=[p for b in batches for p in b.prompts],
        completions=[c for b in batches for c in b.completions],
        extras={k: [v for b in batches for v in b.extras[k]] for k in batches[0].extras},
    )


def _merge_reward_info(infos: list[dict]) -> dict:
    """Reward metrics of several rounds: counts and seconds add up, means are averaged (equal-size rounds)."""
    out: dict = {}
    for key in infos[0]:
        vals = [i[key] for i in infos if isinstance(i.get(key), (int, float))]
        if not vals:
            continue
        additive = key.endswith("_count") or key.endswith("_seconds")
        out[key] = sum(vals) if additive else sum(vals) / len(vals)
    return out


def collect_mixed_groups(
    sample_round: SampleRound, num_groups: int, max_extra_rounds: int, pad_id: int
) -> tuple[RolloutBatch, Tensor, Tensor, dict, dict[str, float], list[Tensor]]:
    """Sample rounds until ``num_groups`` mixed groups are found or ``max_extra_rounds`` extra rounds are spent.

    Args:
        sample_round: draws round r's B groups (round 0 is the step's ordinary batch) and scores them.
        num_groups: B, the mixed groups wanted.
        max_extra_rounds: the cap on rounds after round 0 (>= 0).
        pad_id: padding token id for :func:`concat_batches`.

    Returns:
        (batch, rewards [n], valid [n], reward metrics, dynamic metrics, [the round's other per-rollout tensors, each
        [n]]): the first ``num_groups`` mixed groups in
        sampling order (fewer at the cap; round 0's whole batch when no group was mixed), and
        ``dynamic/mixed_groups`` (groups trained on that are mixed), ``dynamic/rounds`` (rounds sampled, >= 1),
        ``dynamic/sampled_groups``, ``dynamic/zero_var_frac_sampled`` (share of all sampled groups with no
        contrast), ``dynamic/hit_cap`` (1.0 when the step has fewer than B mixed groups).
    """
    parts: list[tuple] = []
    infos: list[dict] = []
    first = None
    found = sampled = rounds = seen_mixed = 0
    for r in range(max_extra_rounds + 1):
        batch, rewards, valid, info, *others = sample_round(r)
        rounds += 1
        infos.append(info)
        if first is None:
            first = (batch, rewards, valid, *others)
        R = batch.group_size
        mixed = (~constant_groups(rewards.view(-1, R).nan_to_num(0.0), valid.view(-1, R))).nonzero().flatten()
        sampled += batch.num_groups
        seen_mixed += int(mixed.numel())
        keep = mixed[: num_groups - found].tolist()
        if keep:
            rows = torch.tensor([g * R + i for g in keep for i in range(R)], device=rewards.device)
            parts.append((select_groups(batch, keep), rewards[rows], valid[rows], *(o[rows] for o in others)))
            found += len(keep)
        if found >= num_groups:
            break
    stats = {
        mk.DYNAMIC_MIXED_GROUPS: float(found),
        mk.DYNAMIC_ROUNDS: float(rounds),
        mk.DYNAMIC_SAMPLED_GROUPS: float(sampled),
        mk.DYNAMIC_HIT_CAP: float(found < num_groups),
        mk.DYNAMIC_ZERO_VAR_FRAC_SAMPLED: 1.0 - seen_mixed / sampled,
    }
    if found == 0:
        batch, rewards, valid, *others = first  # type: ignore[misc]  # found == 0: the first round's draw is kept
    else:
        batch = concat_batches([p[0] for p in parts], pad_id)
        rewards, valid, *others = (torch.cat([p[i] for p in parts]) for i in range(1, len(parts[0])))
    return batch, rewards, valid, _merge_reward_info(infos), stats, list(others)
