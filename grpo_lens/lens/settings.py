"""The settings :class:`grpo_lens.lens.trainer_lens.TrainerLens` reads, as one typed, frozen record.

Two sources fill it: grpo-lens' own trainer (:meth:`LensSettings.from_train_config`, from a
:class:`grpo_lens.config.TrainConfig`) and the TRL integration (:meth:`LensSettings.from_trl`, from a
``trl.GRPOConfig`` and the integration's keywords, with TRL's settings mapped onto grpo-lens' names: docs/trl.md).
The fields are exactly what the lens and the functions it passes them to read; nothing else of a config reaches it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from grpo_lens.config import TrainConfig
from grpo_lens.config.groups import GRAM_SOURCES
from grpo_lens.config.trl_names import LOSS_TYPE_AGGREGATIONS
from grpo_lens.formulas.advantages import STD_CONVENTIONS
from grpo_lens.formulas.losses import LOSS_AGGREGATIONS
from grpo_lens.formulas.overlong import OVERLONG_MODES

#: The parameter spaces of the lens's per-rollout gradients (``--lens-space``, docs/theory.md §18).
LENS_SPACES = ("trainable", "full")


@dataclass(frozen=True)
class LensSettings:
    """What :class:`grpo_lens.lens.trainer_lens.TrainerLens` reads (every field required; see the constructors).

    Raises:
        ValueError: ``sketch_dim`` < 1, ``temperature`` <= 0, ``std_eps`` < 0, ``max_new_tokens`` < 1, or a name
            outside its closed set (``lens_space``, ``gram_source``, ``std``, ``loss_aggregation``, ``overlong``),
            listing the valid names.
    """

    #: sketch side d_s per linear layer (sketch_in = sketch_out of :class:`grpo_lens.gradients.sketch.GradientCapture`):
    #: a layer's sketch has d_s^2 entries (a count, >= 1; ``--sketch-dim``).
    sketch_dim: int
    #: parameter space of the per-rollout gradients, ``trainable`` or ``full`` (a name; ``--lens-space``, §18).
    lens_space: str
    #: source of the per-rollout Gram matrix, ``exact`` or ``sketch`` (a name; ``--gram-source``, §Exact Gram).
    gram_source: str
    #: seed of the sketch projections, the random controls and the sparsity sample (an integer; ``--seed``).
    seed: int
    #: advantage estimator whose identity constant the analysis uses (a registry name, or ``trl_*`` for TRL
    #: settings without a per-group constant; docs/theory.md §2, §4).
    estimator: str
    #: std convention of the advantages, ``sample`` (ddof 1) or ``population`` (ddof 0) (a name; ``--std``).
    std: str
    #: eps added to the group's reward std (reward units, >= 0; ``--std-eps``).
    std_eps: float
    #: sampling temperature the log-probs are scaled by (dimensionless, > 0; docs/theory.md §14).
    temperature: float
    #: loss aggregation whose per-rollout weights omega_i the gradients carry (a name; docs/theory.md §3).
    loss_aggregation: str
    #: completion length cap (tokens, >= 1): the normaliser of ``seq-mean-token-sum-norm``.
    max_new_tokens: int
    #: overlong mode, which tokens the loss sums (a name; docs/theory.md §13).
    overlong: str
    #: also verl's logit-space gradient-power proxy beside the exact Gram's (``--lens-noise-proxy``; one no-grad
    #: forward of the mixed groups; docs/theory.md §Noise scale and dead groups).
    lens_noise_proxy: bool = False
    #: per-token landing shares of the update's own first gradient at lens steps (``--lens-landing``; four no-grad
    #: forwards of the rows with a nonzero advantage; docs/theory.md §Landing shares and the dead groups' KL gradient).
    lens_landing: bool = False
    #: the KL-only gradient norm of the groups without reward contrast at lens steps (``--lens-dead-kl``, beta > 0;
    #: one forward + backward of those rows; same section).
    lens_dead_kl: bool = False

    def __post_init__(self) -> None:
        closed = {
            "lens_space": LENS_SPACES,
            "gram_source": GRAM_SOURCES,
            "std": STD_CONVENTIONS,
            "loss_aggregation": tuple(LOSS_AGGREGATIONS.names()),
            "overlong": OVERLONG_MODES,
        }
        for name, valid in closed.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} = {getattr(self, name)!r}: valid names: {', '.join(valid)}")
        for name, ok, rule in (
            ("sketch_dim", self.sketch_dim >= 1, ">= 1"),
            ("temperature", self.temperature > 0, "> 0"),
            ("std_eps", self.std_eps >= 0, ">= 0"),
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
        ):
            if not ok:
                raise ValueError(f"{name} = {getattr(self, name)}: must be {rule}")

    @classmethod
    def from_train_config(cls, cfg: TrainConfig) -> LensSettings:
        """The settings of grpo-lens' own trainer: the :class:`grpo_lens.config.TrainConfig` fields of the same
        names, unchanged.

        Raises:
            ValueError: as :class:`LensSettings` (a checked TrainConfig always passes).
        """
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_trl(
        cls,
        args: Any,
        *,
        sketch_dim: int = 16,
        lens_space: str = "trainable",
        seed: int = 0,
        multi_objective_aggregation: str = "sum_then_normalize",
        gram_source: str = "exact",
    ) -> LensSettings:
        """The settings of the TRL integration, from a ``trl.GRPOConfig`` (read: ``scale_rewards``, ``loss_type``,
        ``temperature``, ``max_completion_length``) and the integration's lens keywords.

        TRL's ``scale_rewards="group"`` is grpo-lens' ``grpo`` estimator and ``"none"`` is ``dr_grpo``, with TRL's
        std (sample) and eps (1e-4); ``"batch"`` or ``multi_objective_aggregation="normalize_then_sum"`` have no
        per-group identity constant (``trl_*``). ``loss_type`` maps through
        :data:`grpo_lens.config.trl_names.LOSS_TYPE_AGGREGATIONS`;
        ``overlong`` is ``none`` because TRL's ``mask_truncated_completions`` is already in its completion mask.

        Args:
            args: the ``trl.GRPOConfig`` (any object with those attributes).
            sketch_dim: sketch side per linear layer (as ``--sketch-dim``).
            lens_space: ``trainable`` or ``full`` (``--lens-space``).
            seed: the lens's seed.
            multi_objective_aggregation: TRL's trainer attribute.
            gram_source: ``exact`` or ``sketch`` (``--gram-source``).

        Raises:
            ValueError: ``sketch_dim`` < 1, an unknown ``lens_space`` or ``gram_source`` (named by the integration's
                keyword, with the valid names), or a TRL ``loss_type`` whose rollout weights the lens does not know
                (luspo), with the known ones.
        """
        if sketch_dim < 1:
            raise ValueError(f"sketch_dim = {sketch_dim}: must be >= 1")
        if gram_source not in GRAM_SOURCES:
            raise ValueError(f"lens_gram_source = {gram_source!r}: valid names: {', '.join(GRAM_SOURCES)}")
        if lens_space not in LENS_SPACES:
            raise ValueError(f"lens_space = {lens_space!r}: valid names: {', '.join(sorted(LENS_SPACES))}")
        scale = getattr(args, "scale_rewards", "group")
        if multi_objective_aggregation != "sum_then_normalize":
            estimator = "trl_" + multi_objective_aggregation  # no per-group identity constant
        else:
            estimator = {"group": "grpo", "none": "dr_grpo"}.get(scale, f"trl_scale_{scale}")
        loss_type = getattr(args, "loss_type", "dapo")
        if loss_type not in LOSS_TYPE_AGGREGATIONS:
            raise ValueError(
                f"TRL loss_type {loss_type!r}: the lens knows the rollout weights of "
                f"{', '.join(sorted(LOSS_TYPE_AGGREGATIONS))}; use one of them"
            )
        return cls(
            sketch_dim=sketch_dim,
            lens_space=lens_space,
            gram_source=gram_source,
            seed=seed,
            estimator=estimator,
            std="sample",
            std_eps=1e-4,
            temperature=float(args.temperature),
            loss_aggregation=LOSS_TYPE_AGGREGATIONS[loss_type],
            max_new_tokens=int(args.max_completion_length),
            overlong="none",
        )


def as_lens_settings(config: LensSettings | TrainConfig) -> LensSettings:
    """``config`` as :class:`LensSettings`: itself, or :meth:`LensSettings.from_train_config` of a
    :class:`grpo_lens.config.TrainConfig`.

    Raises:
        TypeError: anything else (naming both accepted types).
    """
    if isinstance(config, LensSettings):
        return config
    if isinstance(config, TrainConfig):
        return LensSettings.from_train_config(config)
    raise TypeError(
        f"the lens's settings must be a LensSettings or a TrainConfig (grpo_lens.lens.settings.LensSettings, "
        f"grpo_lens.config.TrainConfig), got {type(config).__name__}"
    )
