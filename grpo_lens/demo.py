"""``grpo-lens demo`` (what ``make demo`` runs): probe -> GRPO training with the lens -> probe again -> report.

Layout of OUT::

    OUT/probe_before/probe.json   the gradient probe of the initial model
    OUT/train/                    the training run (config.yaml, metrics.jsonl, checkpoints/, final_model/)
    OUT/probe_after/probe.json    the same probe on the trained model
    OUT/report.md, OUT/*.png      the report over all three

Each stage is skipped when its output exists, a probe continues from its last finished group (``probe --resume``)
and training resumes from its last checkpoint, so a killed demo rerun
with the same command continues where it stopped; OUT/demo.yaml records the settings, and a rerun with other settings
is refused. ``--overwrite`` starts over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import yaml

from grpo_lens.config import ConfigError, ConfigFile, TrainConfig, at_least
from grpo_lens.config.base import Names, option, safe_load_yaml
from grpo_lens.config.groups import (
    EXACT_REFUSAL,
    Adapter,
    Advantage,
    Lens,
    Model,
    Optimizer,
    Output,
    Probing,
    Runtime,
    Sampling,
    TaskData,
    check_task_dataset,
)
from grpo_lens.probe.config import ProbeConfig

logger = logging.getLogger(__name__)

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


@dataclass
class DemoConfig(ConfigFile):
    """Settings of the main job; field help is the CLI help. Everything not here takes TrainConfig's and ProbeConfig's
    defaults; every field here is an option group's (:mod:`grpo_lens.config.groups`), the demo's overrides marked."""

    kind: ClassVar[str] = "demo"
    names: ClassVar[Names] = Names(refused={"exact": EXACT_REFUSAL})

    out: str = Output.out("runs/demo", contents="probe_before/, train/, probe_after/, report.md")  # default overridden
    model: str = Model.model()
    task: str = TaskData.task()
    dataset: str | None = TaskData.dataset()
    task_options: dict = TaskData.task_options()
    max_steps: int = Optimizer.max_steps(check=at_least(1))  # overridden: the demo trains at least one step
    group_size: int = Sampling.group_size()
    prompts_per_step: int = Sampling.prompts_per_step()
    learning_rate: float = Optimizer.learning_rate()
    max_new_tokens: int = Sampling.max_new_tokens()
    lens_every: int = Lens.lens_every()
    rewards: list = TaskData.rewards()
    estimator: str = Advantage.estimator()
    lora_rank: int = Adapter.lora_rank()
    report_to: list = Output.report_to()
    probe_group_sizes: list = Probing.group_sizes()
    probe_prompts: int = Probing.prompts()
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
    dense_oracle: bool = Lens.dense_oracle()
    seed: int = Runtime.seed()
    device: str = Runtime.device()
    overwrite: bool = Output.overwrite(what="an existing demo run")

    def check(self) -> None:
        """The check of two fields together (each field's own check ran before), and ``quick``'s values."""
        check_task_dataset(self)
        if self.quick:
            defaults = {f.name: DemoConfig.__dataclass_fields__[f.name] for f in fields(self)}
            for name, value in QUICK.items():
                f = defaults[name]
                default = f.default_factory() if callable(f.default_factory) else f.default
                if getattr(self, name) == default:
                    setattr(self, name, value)

    def _shared(self) -> dict[str, Any]:
        """The settings every stage takes from the demo."""
        return dict(
            task=self.task,
            dataset=self.dataset,
            task_options=self.task_options,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed,
            device=self.device,
        )

    def train_config(self) -> TrainConfig:
        """The TrainConfig of the training stage."""
        return TrainConfig(
            model=self.model,
            max_steps=self.max_steps,
            group_size=self.group_size,
            prompts_per_step=self.prompts_per_step,
            learning_rate=self.learning_rate,
            lens_every=self.lens_every,
            rewards=self.rewards,
            estimator=self.estimator,
            lora_rank=self.lora_rank,
            report_to=self.report_to,
            out=str(Path(self.out) / "train"),
            **self._shared(),
        )

    def probe_config(self, model: str, out: Path, resume: bool = False) -> ProbeConfig:
        """The ProbeConfig of a probe stage on ``model`` (``resume``: continue the probe a killed demo left there)."""
        # Monte Carlo credit only where it can reach its claim's 8 rollouts (4 of the credit study's groups):
        # about 18 s a group, wasted on fewer (the --quick demo's 2 groups)
        mc_groups = ProbeConfig.mc_groups if self.probe_study_prompts >= ProbeConfig.mc_groups else 0
        return ProbeConfig(
            model=model,
            group_sizes=self.probe_group_sizes,
            prompts=self.probe_prompts,
            dense_oracle=self.dense_oracle,
            rewards=self.rewards,
            estimator=self.estimator,
            baseline_study_prompts=self.probe_study_prompts,
            credit_groups=self.probe_study_prompts,
            mc_groups=mc_groups,
            out=str(out),
            resume=resume,
            **self._shared(),
        )


def run_demo(config: DemoConfig) -> Path:
    """Run (or continue) the main job; return the path of OUT/report.md.

    Holds OUT for its whole call (one writer per --out, :func:`grpo_lens.rundir.holds_run_dir`)."""
    from grpo_lens.rundir import holds_run_dir  # here: rundir loads torch, and ``demo --help`` must not

    return holds_run_dir("demo")(_run_demo)(config)


def _run_demo(config: DemoConfig) -> Path:
    # Imported here, not at the top: DemoConfig builds ``grpo-lens demo --help``, which must not load torch (issue 30).
    from grpo_lens.probe.partial import PartialProbe
    from grpo_lens.probe.run import run_probe
    from grpo_lens.report import write_report
    from grpo_lens.rundir import clear_run_dir, run_dir_entries
    from grpo_lens.train.loop import train

    out = Path(config.out).absolute()  # a reward function may os.chdir
    train_cfg = config.train_config()  # validates the training settings before any stage runs
    saved_path = out / "demo.yaml"
    settings = {k: v for k, v in config.to_dict().items() if k not in ("overwrite", "device")}
    if saved_path.exists() and not config.overwrite:
        saved = DemoConfig.canonical(safe_load_yaml(saved_path.read_text()) or {}, f"in {saved_path}")
        changed = sorted(k for k in settings if k in saved and saved[k] != settings[k])
        if changed:
            raise ConfigError(
                f"{out} holds a demo run with other settings "
                f"({', '.join(f'{k}={saved[k]!r}' for k in changed)}); rerun with the same settings "
                f"to continue it, pass --overwrite to start over, or choose another --out"
            )
    elif out.exists() and run_dir_entries(out) and not config.overwrite:
        raise ConfigError(f"{out} is not empty and holds no demo run (no demo.yaml); choose another --out")
    if config.overwrite and out.exists():
        if run_dir_entries(out) and not saved_path.exists():
            raise ConfigError(f"--overwrite: {out} holds files that are not a demo run; they are never deleted")
        clear_run_dir(out)  # all but the lock file this process holds
    out.mkdir(parents=True, exist_ok=True)
    if not saved_path.exists():
        saved_path.write_text(yaml.safe_dump(settings, sort_keys=False))
    t0 = time.perf_counter()

    before = out / "probe_before"
    if not (before / "probe.json").exists():
        logger.info("[1/4] probing the initial model (R = %s)", config.probe_group_sizes)
        run_probe(config.probe_config(config.model, before, resume=PartialProbe(before).exists()))

    run_dir = Path(train_cfg.out)
    final = run_dir / "final_model"
    if not final.exists():
        logger.info("[2/4] GRPO training for %d steps with the lens every %d", config.max_steps, config.lens_every)
        train_cfg.resume = (run_dir / "config.yaml").exists()
        train(train_cfg)

    after = out / "probe_after"
    if not (after / "probe.json").exists():
        logger.info("[3/4] probing the trained model")
        run_probe(config.probe_config(str(final), after, resume=PartialProbe(after).exists()))

    logger.info("[4/4] writing the report")
    report = write_report(out)
    logger.info("demo done in %.0f s: %s", time.perf_counter() - t0, report)
    return report
