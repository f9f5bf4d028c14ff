"""``grpo-lens demo`` (what ``make demo`` runs): probe -> GRPO training with the lens -> probe again -> report.

Layout of OUT::

    OUT/probe_before/probe.json   the gradient probe of the initial model
    OUT/train/                    the training run (config.yaml, metrics.jsonl, checkpoints/, final_model/)
    OUT/probe_after/probe.json    the same probe on the trained model
    OUT/report.md, OUT/*.png      the report over all three

Each stage is skipped when its output exists and training resumes from its last checkpoint, so a killed demo rerun
with the same command continues where it stopped; OUT/demo.yaml records the settings, and a rerun with other settings
is refused. ``--overwrite`` starts over.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from grpo_lens.config import ConfigError, ConfigFile, TrainConfig, option
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.run import run_probe
from grpo_lens.report import write_report
from grpo_lens.train.loop import train

logger = logging.getLogger(__name__)


@dataclass
class DemoConfig(ConfigFile):
    """Settings of the main job; field help is the CLI help. Everything not here takes TrainConfig's default."""

    out: str = option("runs/demo", "Output directory.")
    model: str = option("smollm2-135m-instruct", "Model (alias, Hugging Face folder or hub id, .gguf file).")
    task: str = option("arithmetic", "Task: arithmetic, gsm8k, or jsonl (with --dataset).")
    dataset: str | None = option(None, "JSONL file for --task jsonl.")
    task_options: dict = option({}, "Task options as a YAML mapping.")
    max_steps: int = option(30, "GRPO steps.")
    group_size: int = option(8, "R during training.")
    prompts_per_step: int = option(4, "Prompts per training step.")
    learning_rate: float = option(5e-6, "AdamW learning rate.")
    max_new_tokens: int = option(24, "Longest completion in tokens.")
    lens_every: int = option(5, "Lens every this many training steps.")
    probe_group_sizes: list = option([2, 4, 8], "Group sizes R of the probes.", item_type=int)
    probe_prompts: int = option(0, "Prompts sampled per R in each probe (every mixed group among them is analysed; "
                                "0 = the probe's default max(24, 128 / R)).")
    exact: bool = option(False, "Exact per-rollout gradients in the probes (slow; small models).")
    seed: int = option(0, "Random seed.")
    device: str = option("auto", "cpu, cuda, cuda:N or auto.")
    overwrite: bool = option(False, "Delete OUT and start over.")

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ConfigError(f"demo field 'max_steps' (flag --max-steps) = {self.max_steps}: must be >= 1")

    def train_config(self) -> TrainConfig:
        """The TrainConfig of the training stage."""
        return TrainConfig(model=self.model, task=self.task, dataset=self.dataset, task_options=self.task_options,
                           max_steps=self.max_steps, group_size=self.group_size,
                           prompts_per_step=self.prompts_per_step, learning_rate=self.learning_rate,
                           max_new_tokens=self.max_new_tokens, lens_every=self.lens_every, seed=self.seed,
                           device=self.device, out=str(Path(self.out) / "train"))

    def probe_config(self, model: str, out: Path) -> ProbeConfig:
        """The ProbeConfig of a probe stage on ``model``."""
        return ProbeConfig(model=model, task=self.task, dataset=self.dataset, task_options=self.task_options,
                           group_sizes=self.probe_group_sizes, prompts=self.probe_prompts,
                           max_new_tokens=self.max_new_tokens, exact=self.exact,
                           seed=self.seed, device=self.device, out=str(out))


def run_demo(config: DemoConfig) -> Path:
    """Run (or continue) the main job; return the path of OUT/report.md."""
    out = Path(config.out)
    train_cfg = config.train_config()  # validates the training settings before any stage runs
    saved_path = out / "demo.yaml"
    settings = {k: v for k, v in config.to_dict().items() if k not in ("overwrite", "device")}
    if saved_path.exists() and not config.overwrite:
        saved = yaml.safe_load(saved_path.read_text()) or {}
        changed = sorted(k for k in settings if k in saved and saved[k] != settings[k])
        if changed:
            raise ConfigError(f"{out} holds a demo run with other settings ({', '.join(f'{k}={saved[k]!r}' for k in changed)}); "
                              f"rerun with the same settings to continue it, pass --overwrite to start over, or "
                              f"choose another --out")
    elif out.exists() and any(out.iterdir()) and not config.overwrite:
        raise ConfigError(f"{out} is not empty and holds no demo run (no demo.yaml); choose another --out")
    if config.overwrite and out.exists():
        if any(out.iterdir()) and not saved_path.exists():
            raise ConfigError(f"--overwrite: {out} holds files that are not a demo run; they are never deleted")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if not saved_path.exists():
        saved_path.write_text(yaml.safe_dump(settings, sort_keys=False))
    t0 = time.perf_counter()

    before = out / "probe_before"
    if not (before / "probe.json").exists():
        logger.info("[1/4] probing the initial model (R = %s)", config.probe_group_sizes)
        run_probe(config.probe_config(config.model, before))

    run_dir = Path(train_cfg.out)
    final = run_dir / "final_model"
    if not final.exists():
        logger.info("[2/4] GRPO training for %d steps with the lens every %d", config.max_steps, config.lens_every)
        train_cfg.resume = (run_dir / "config.yaml").exists()
        train(train_cfg)

    after = out / "probe_after"
    if not (after / "probe.json").exists():
        logger.info("[3/4] probing the trained model")
        run_probe(config.probe_config(str(final), after))

    logger.info("[4/4] writing the report")
    report = write_report(out)
    logger.info("demo done in %.0f s: %s", time.perf_counter() - t0, report)
    return report
