"""``grpo-lens demo``'s settings (:class:`DemoConfig`, ``--quick``'s :data:`QUICK`): the train and probe settings
the demo runs with, built from the same option groups as :class:`grpo_lens.config.TrainConfig` and
:class:`grpo_lens.probe.config.ProbeConfig`. Apart from :mod:`grpo_lens.demo` (which runs the demo) so that
``grpo-lens demo --help`` builds its flags without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from grpo_lens.config import ConfigFile, TrainConfig, at_least, groups
from grpo_lens.config.base import Names, field_values, option
from grpo_lens.probe.config import ProbeConfig

#: ``--quick``: a demo of a few minutes on a CPU (wide intervals, most claims inconclusive), for the settings left at
#: their defaults: 4 training steps of 2 prompts x 4 completions of 16 tokens, the lens every 2 steps, probes of
#: R = 2, 4 on 8 prompts each, studies on 2 prompts / groups.
QUICK = {
    "max_steps": 4,
    "group_size": 4,
    "prompts_per_step": 2,
    "max_new_tokens": 16,
    "lens_every": 2,
    "probe_group_sizes": [2, 4],
    "probe_prompts": 8,
    "probe_study_prompts": 2,
}


#: the demo's settings its training stage takes under the same names (besides the ones every stage takes)
TRAIN_SETTINGS = (
    "model",
    "max_steps",
    "group_size",
    "prompts_per_step",
    "learning_rate",
    "lens_every",
    "rewards",
    "estimator",
    "lora_rank",
    "report_to",
)


@dataclass
class DemoConfig(ConfigFile):
    """Settings of the main job; field help is the CLI help. Everything not here takes TrainConfig's and ProbeConfig's
    defaults; every field here is an option group's (:mod:`grpo_lens.config.groups`), the demo's overrides marked."""

    kind: ClassVar[str] = "demo"
    names: ClassVar[Names] = Names(refused={"exact": groups.EXACT_REFUSAL})

    # default overridden
    out: str = groups.Output.out("runs/demo", contents="probe_before/, train/, probe_after/, report.md")
    model: str = groups.Model.model()
    task: str = groups.TaskData.task()
    dataset: str | None = groups.TaskData.dataset()
    task_options: dict = groups.TaskData.task_options()
    max_steps: int = groups.Optimizer.max_steps(check=at_least(1))  # overridden: the demo trains at least one step
    group_size: int = groups.Sampling.group_size()
    prompts_per_step: int = groups.Sampling.prompts_per_step()
    learning_rate: float = groups.Optimizer.learning_rate()
    max_new_tokens: int = groups.Sampling.max_new_tokens()
    lens_every: int = groups.Lens.lens_every()
    rewards: list = groups.TaskData.rewards()
    estimator: str = groups.Advantage.estimator()
    lora_rank: int = groups.Adapter.lora_rank()
    report_to: list = groups.Output.report_to()
    probe_group_sizes: list = groups.Probing.group_sizes()
    probe_prompts: int = groups.Probing.prompts()
    probe_study_prompts: int = option(
        8,
        "Prompts (baseline study) and mixed groups (credit study) of each probe's "
        "studies, as probe's --baseline-study-prompts and --credit-groups (0 skips "
        "them).",
        check=at_least(0, "must be >= 0 (0 skips the studies)"),
    )
    quick: bool = option(
        False,
        "A demo of a few minutes: every setting of grpo_lens.demo.QUICK left at its default "
        "takes the small value there (4 steps, R = 2 and 4 probed on 8 prompts, studies on 2).",
    )
    dense_oracle: bool = groups.Lens.dense_oracle()
    seed: int = groups.Runtime.seed()
    device: str = groups.Runtime.device()
    overwrite: bool = groups.Output.overwrite(what="an existing demo run")
    preset: str | None = option(
        None,
        "A preset YAML file (configs/decide-cpu.yaml): probe --seeds and train --seeds at its settings into OUT/probe "
        "and OUT/train, then one report (docs/seeds.md); its time estimate is printed first. Only --out, --device, "
        "--overwrite and --report-only combine with it.",
    )
    report_only: bool = option(
        False,
        "With --preset: run nothing and load no model; write OUT/report.md from the stages already finished (a probe "
        "stage alone while training still runs), the report naming the stage that is not finished.",
    )

    def check(self) -> None:
        """The check of two fields together (each field's own check ran before), and ``quick``'s values."""
        groups.check_task_dataset(self)
        if self.quick:
            defaults = {f.name: DemoConfig.__dataclass_fields__[f.name] for f in fields(self)}
            for name, value in QUICK.items():
                f = defaults[name]
                default = f.default_factory() if callable(f.default_factory) else f.default
                if getattr(self, name) == default:
                    setattr(self, name, value)

    def _shared(self) -> dict[str, Any]:
        """The settings every stage takes from the demo."""
        return field_values(self, "task", "dataset", "task_options", "max_new_tokens", "seed", "device")

    def train_config(self) -> TrainConfig:
        """The TrainConfig of the training stage."""
        return TrainConfig(out=str(Path(self.out) / "train"), **field_values(self, *TRAIN_SETTINGS), **self._shared())

    def probe_config(self, model: str, out: Path, resume: bool = False) -> ProbeConfig:
        """The ProbeConfig of a probe stage on ``model`` (``resume``: continue the probe a killed demo left there)."""
        # Monte Carlo credit only where it can reach its claim's 8 rollouts (4 of the credit study's groups):
        # about 18 s a group, wasted on fewer (the --quick demo's 2 groups)
        mc_groups = ProbeConfig.mc_groups if self.probe_study_prompts >= ProbeConfig.mc_groups else 0
        return ProbeConfig(
            model=model,
            group_sizes=self.probe_group_sizes,
            prompts=self.probe_prompts,
            **field_values(self, "dense_oracle", "rewards", "estimator"),
            baseline_study_prompts=self.probe_study_prompts,
            credit_groups=self.probe_study_prompts,
            mc_groups=mc_groups,
            out=str(out),
            resume=resume,
            **self._shared(),
        )
