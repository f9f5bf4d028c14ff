"""grpo-lens' lens inside TRL's ``GRPOTrainer``: replace ``GRPOTrainer(...)`` by ``LensGRPOTrainer(...)``.

::

    from grpo_lens.integrations.trl import LensGRPOTrainer        # instead of: from trl import GRPOTrainer
    trainer = LensGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=..., lens_every=5)
    trainer.train()   # lens keys (rank/g1_erank, rank/mixed_groups, ...) appear wherever TRL's metrics go

**Why a subclass and not a callback.** In TRL 1.16 a ``TrainerCallback`` is called with ``args``, ``state``,
``control`` and ``model``/``processing_class``/``optimizer``/``lr_scheduler``/dataloaders, never with the batch:
``GRPOTrainer._prepare_inputs`` generates and scores the completions and computes the advantages inside
``_generate_and_score_completions``, and the dict it returns (``prompt_ids``, ``prompt_mask``, ``completion_ids``,
``completion_mask``, ``advantages``) goes straight to ``compute_loss``. The rewards are not even in that dict (only
``_calculate_rewards`` sees them). The lens needs exactly those tensors, so :class:`GRPOLensMixin` overrides these two
methods: ``_calculate_rewards`` (calls TRL's, keeps the rewards) and ``_generate_and_score_completions`` (calls
TRL's, then measures the lens on its output, unchanged). The mixin also composes with your own GRPOTrainer subclass:
``class MyTrainer(GRPOLensMixin, MyGRPOTrainer)``.

**What is measured.** Every ``lens_every`` optimizer steps (at global steps 0, N, 2N, ...), on the generation batch
TRL just produced (this process's share, before any update on it), the same analysis as grpo-lens' own trainer:
:class:`grpo_lens.lens.TrainerLens` (sketched per-rollout gradients, or with a peft/LoRA model the adapter's exact
ones; :func:`grpo_lens.diagnostics.analyse_group` per mixed group). Rows g_i are gradients of each completion's
log-prob sum weighted as TRL's ``loss_type`` weights it (:data:`TRL_LOSS_AGGREGATION`), at TRL's temperature (TRL's
training log-probs apply no top-k / top-p); the advantages are TRL's.
The metrics are appended to TRL's ``_metrics["train"]``, which ``GRPOTrainer.log`` averages over the logging window
and sends to every ``report_to`` backend and ``trainer.state.log_history``. Update sparsity (S4) is not measured
here.

Mapping of TRL's settings onto the lens's: ``scale_rewards="group"`` is grpo-lens' ``grpo`` estimator (sample std,
eps 1e-4, as TRL), ``"none"`` is ``dr_grpo``; with ``"batch"`` or ``multi_objective_aggregation=
"normalize_then_sum"`` the rank-2 identity has no per-group constant and ``grad/identity_residual`` is absent.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from grpo_lens.rollout import RolloutBatch
from grpo_lens.train.lens import TrainerLens

try:
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("grpo_lens.integrations.trl needs TRL: pip install 'grpo-lens[trl]' (or pip install trl)") from e


#: TRL's ``loss_type`` -> grpo-lens' loss aggregation with the same per-rollout weights of the log-prob sums
#: (docs/theory.md §3): grpo/sapo average each sequence's tokens; bnpo/dapo/cispo/vespo divide by the batch's tokens
#: (a constant across rollouts); dr_grpo divides by max_completion_length.
TRL_LOSS_AGGREGATION = {"grpo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "bnpo": "token-mean",
                        "dapo": "token-mean", "cispo": "token-mean", "vespo": "token-mean",
                        "dr_grpo": "seq-mean-token-sum-norm"}


def lens_settings(args: Any, *, sketch_dim: int = 16, space: str = "trainable", seed: int = 0,
                  multi_objective_aggregation: str = "sum_then_normalize") -> SimpleNamespace:
    """The settings :class:`grpo_lens.lens.TrainerLens` reads, from a ``trl.GRPOConfig``.

    Raises:
        ValueError: ``sketch_dim`` < 1, an unknown ``space``, or a TRL ``loss_type`` whose rollout weights the lens
            does not know (luspo).
    """
    if sketch_dim < 1:
        raise ValueError(f"lens_sketch_dim = {sketch_dim}: must be >= 1")
    if space not in ("trainable", "full"):
        raise ValueError(f"lens_space = {space!r}: valid names: full, trainable")
    scale = getattr(args, "scale_rewards", "group")
    if multi_objective_aggregation != "sum_then_normalize":
        estimator = "trl_" + multi_objective_aggregation  # no per-group identity constant
    else:
        estimator = {"group": "grpo", "none": "dr_grpo"}.get(scale, f"trl_scale_{scale}")
    loss_type = getattr(args, "loss_type", "dapo")
    if loss_type not in TRL_LOSS_AGGREGATION:
        raise ValueError(f"TRL loss_type {loss_type!r}: the lens knows the rollout weights of "
                         f"{', '.join(sorted(TRL_LOSS_AGGREGATION))}; use one of them")
    return SimpleNamespace(sketch_dim=sketch_dim, lens_space=space, seed=seed, estimator=estimator,
                           std="sample", eps=1e-4, temperature=float(args.temperature), top_k=0, top_p=1.0,
                           loss_aggregation=TRL_LOSS_AGGREGATION[loss_type],
                           max_new_tokens=int(args.max_completion_length),
                           overlong="none")  # TRL's mask_truncated_completions is already in its completion_mask


def rollout_batch_from_trl(output: dict[str, Any], group_size: int) -> RolloutBatch:
    """A :class:`RolloutBatch` holding TRL's generation batch (its tensors, not copies of other data).

    Args:
        output: the dict ``GRPOTrainer._generate_and_score_completions`` returns: ``prompt_ids`` [N, Lp] (left
            padded), ``prompt_mask`` [N, Lp], ``completion_ids`` [N, T], ``completion_mask`` [N, T] (up to and
            including EOS), optional ``tool_mask`` [N, T] (0 on tool-output tokens, which get no loss).
        group_size: R (TRL's ``num_generations``); N must be a multiple of it.

    Returns:
        the batch; ``sampler_logprobs`` are zeros and ``truncated`` marks rows whose mask reaches the last position
        (neither is used by the lens).

    Raises:
        ValueError: N is not a multiple of R.
    """
    mask = output["completion_mask"].bool()
    if "tool_mask" in output:
        mask = mask & output["tool_mask"].bool()
    n = mask.shape[0]
    if n % group_size:
        raise ValueError(f"TRL's batch has {n} completions, not a multiple of num_generations={group_size}")
    return RolloutBatch(prompt_ids=output["prompt_ids"], prompt_mask=output["prompt_mask"],
                        completion_ids=output["completion_ids"], completion_mask=mask,
                        sampler_logprobs=torch.zeros(mask.shape, dtype=torch.float32, device=mask.device),
                        truncated=mask[:, -1].clone(), group_size=group_size)


@contextmanager
def activation_checkpointing_off(model: torch.nn.Module):
    """Turn transformers' activation (gradient) checkpointing off inside the block and back on after it.

    TRL enables it by default (``GRPOConfig.gradient_checkpointing=True``); the lens's gradient sketch hooks the
    linear layers' forward outputs (:class:`grpo_lens.diagnostics.GradientCapture`), which checkpointing recomputes
    inside the backward. The flag lives on each ``GradientCheckpointingLayer``; the numbers do not depend on it.
    """
    switched = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in switched:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in switched:
            m.gradient_checkpointing = True


class GRPOLensMixin:
    """Adds the lens to a ``trl.GRPOTrainer`` (subclass); see the module docstring for why it is not a callback.

    Args (keywords, the rest goes to the trainer):
        lens_every: measure every this many optimizer steps (>= 1).
        lens_sketch_dim: sketch side per linear layer (as grpo-lens' ``--sketch-dim``).
        lens_space: ``trainable`` or ``full`` (as ``--lens-space``; matters with a peft model).
        lens_seed: seed of the sketch projections and random controls.

    Raises:
        ValueError: a bad lens setting.
    """

    def __init__(self, *args: Any, lens_every: int = 5, lens_sketch_dim: int = 16, lens_space: str = "trainable",
                 lens_seed: int = 0, **kwargs: Any):
        if lens_every < 1:
            raise ValueError(f"lens_every = {lens_every}: must be >= 1")
        super().__init__(*args, **kwargs)
        self.lens_every = lens_every
        self.lens_settings = lens_settings(self.args, sketch_dim=lens_sketch_dim, space=lens_space, seed=lens_seed,
                                           multi_objective_aggregation=self.multi_objective_aggregation)
        self._lens = None
        self._lens_rewards: torch.Tensor | None = None

    # -- TRL's methods, extended -------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # The reward TRL's advantages start from (sum_then_normalize): weighted sum, NaN where no function scored.
        weighted = rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = weighted.nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = math.nan
        self._lens_rewards = rewards  # [N over all processes]
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training and self.state.global_step % self.lens_every == 0:
            for key, value in self.measure_lens(output).items():
                if value is not None and math.isfinite(value):
                    self._metrics["train"][key].append(float(value))
        return output

    # -- the lens ------------------------------------------------------------------------------------------------
    def measure_lens(self, output: dict[str, Any]) -> dict[str, float]:
        """The lens metrics of one TRL generation batch (this process's rows of it; every process calls this).

        Args:
            output: what ``_generate_and_score_completions`` returned (see :func:`rollout_batch_from_trl`).

        Returns:
            {canonical lens key: value}, as :meth:`grpo_lens.lens.TrainerLens.measure` writes them.
        """
        policy = self.accelerator.unwrap_model(self.model)
        if self._lens is None:
            self._lens = TrainerLens(policy, self.lens_settings)
        R = self.num_generations
        batch = rollout_batch_from_trl(output, R)
        n = batch.num_rollouts
        start = self.accelerator.process_index * n
        if start % R:
            raise ValueError(f"this process's share of TRL's batch ({n} completions) splits a group of "
                             f"num_generations={R}; make the per-process generation batch a multiple of it")
        rewards = self._lens_rewards[start:start + n].to(batch.completion_ids.device)
        valid = ~torch.isnan(rewards)
        advantages = output["advantages"].reshape(-1)
        with activation_checkpointing_off(policy):  # the gradient sketch needs the layers' own forward (TRL turns
            return self._lens.measure(int(self.state.global_step), policy, batch, rewards, valid, advantages)


class LensGRPOTrainer(GRPOLensMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with grpo-lens' lens every ``lens_every`` steps (keywords of :class:`GRPOLensMixin`)."""
