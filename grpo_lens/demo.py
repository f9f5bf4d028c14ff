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
from pathlib import Path

import yaml

from grpo_lens.config import ConfigError
from grpo_lens.config.base import safe_load_yaml
from grpo_lens.config.demo import QUICK as QUICK  # re-exported: the demo's settings live beside the other configs
from grpo_lens.config.demo import DemoConfig
from grpo_lens.probe.partial import PartialProbe
from grpo_lens.probe.run import run_probe
from grpo_lens.report import write_report
from grpo_lens.rundir import clear_run_dir, holds_run_dir, run_dir_entries
from grpo_lens.train.loop import train

logger = logging.getLogger(__name__)


def run_demo(config: DemoConfig) -> Path:
    """Run (or continue) the main job; return the path of OUT/report.md.

    Holds OUT for its whole call (one writer per --out, :func:`grpo_lens.rundir.holds_run_dir`)."""
    return holds_run_dir("demo")(_run_demo)(config)


def _run_demo(config: DemoConfig) -> Path:
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
