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

``demo --preset FILE`` (:func:`run_preset`, a preset such as configs/decide-cpu.yaml) runs instead::

    OUT/probe/       probe --seeds <probe_seeds> at the preset's probe settings (:mod:`grpo_lens.probe.seeds`)
    OUT/train/       train --seeds <train_seeds> at the preset's train settings (:mod:`grpo_lens.train.seeds`)
    OUT/report.md    one report over both: one claims table under one Holm family, then the rank readings

It prints its time estimate first (:func:`estimate_lines`, from the costs the preset records), skips a finished stage
without loading a model, resumes a killed one, and refuses a rerun with other settings (OUT/demo.yaml). With
``--report-only`` it runs nothing and writes OUT/report.md from the finished stages alone, naming the stage that is not
finished (:func:`finished_stages`). An OUT that
holds only stage folders written by the same commands (``probe --seeds`` / ``train --seeds`` run by hand, same
settings) is adopted: the finished stages are kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from grpo_lens.config import ConfigError, TrainConfig
from grpo_lens.config.base import safe_load_yaml
from grpo_lens.config.demo import QUICK as QUICK  # re-exported: the demo's settings live beside the other configs
from grpo_lens.config.demo import DemoConfig
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.partial import PartialProbe
from grpo_lens.probe.run import run_probe
from grpo_lens.probe.seeds import run_seeds
from grpo_lens.report import write_report
from grpo_lens.rewards import parse_reward_specs
from grpo_lens.rundir import clear_run_dir, holds_run_dir, read_train_seeds, run_dir_entries
from grpo_lens.trackers import check_trackers
from grpo_lens.train.loop import is_lens_step, train
from grpo_lens.train.seeds import SEEDS_FILE, _last_step, run_train_seeds

logger = logging.getLogger(__name__)


def run_demo(config: DemoConfig) -> Path:
    """Run (or continue) the main job; return the path of OUT/report.md.

    Holds OUT for its whole call (one writer per --out, :func:`grpo_lens.rundir.holds_run_dir`)."""
    return holds_run_dir("demo")(_run_demo)(config)


def _run_demo(config: DemoConfig) -> Path:

    if config.preset:
        return _run_preset(config)
    if config.report_only:
        raise ConfigError("--report-only needs --preset (a plain demo's report: grpo-lens report OUT)")
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

    # the demo sets out
    run_dir = Path(train_cfg.out)  # type: ignore[arg-type]
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


# -- demo --preset -----------------------------------------------------------------------------------------------------
#: the keys of a preset file (:func:`read_preset`)
PRESET_KEYS = ("probe_seeds", "probe", "train_seeds", "train", "estimate")

#: stage settings a preset may not set: the layout gives each stage's out, the seeds its seed, the command the rest
PRESET_FIXED = ("out", "seed", "resume", "overwrite", "device")

#: DemoConfig fields that combine with --preset (every other one is the preset's to set)
PRESET_FLAGS = ("out", "device", "overwrite", "preset", "report_only")

#: the keys of one device's measured costs under ``estimate:`` (``cpu`` or ``cuda``)
ESTIMATE_KEYS = ("probe_seed_minutes", "train_step_seconds", "lens_step_seconds", "measured")

#: stage settings that say how a command treats its folder, not what it measures: not compared between runs
STAGE_RUN_KEYS = ("out", "resume", "overwrite", "progress", "device", "report_to", "seed")


@dataclass(frozen=True)
class Preset:
    """A preset file read and checked: the two stages' seeds and settings (ProbeConfig / TrainConfig fields, the
    rest at the commands' defaults) and the measured costs ``{"cpu": {...}, "cuda": {...}}`` (:data:`ESTIMATE_KEYS`:
    minutes per probe seed, a number or [low, high]; seconds per training step with the lens off and per lens step;
    where they were measured)."""

    path: str
    probe_seeds: list[int]
    probe: dict[str, Any]
    train_seeds: list[int]
    train: dict[str, Any]
    estimate: dict[str, dict[str, Any]]

    def probe_config(self, out: Path, device: str) -> ProbeConfig:
        """The settings of ``probe --seeds`` into OUT/probe."""
        return ProbeConfig.from_dict({**self.probe, "out": str(out / "probe"), "device": device}, f"in {self.path}")

    def train_config(self, out: Path, device: str) -> TrainConfig:
        """The settings of ``train --seeds`` into OUT/train."""
        return TrainConfig.from_dict({**self.train, "out": str(out / "train"), "device": device}, f"in {self.path}")


def _seeds(value: Any, key: str, path: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        raise ConfigError(f"{path}: {key} must be a list of integer seeds, got {value!r}")
    if len(set(value)) < 2 or len(set(value)) != len(value):
        raise ConfigError(f"{path}: {key} needs at least two distinct seeds (each once) to pool, got {value}")
    return list(value)


def _costs(value: Any, path: str) -> dict[str, dict[str, Any]]:
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - {"cpu", "cuda"}:
        raise ConfigError(f"{path}: estimate must map cpu and/or cuda to measured costs, got {value!r}")
    for device, costs in value.items():
        bad = sorted(set(costs) - set(ESTIMATE_KEYS)) if isinstance(costs, dict) else ["(not a mapping)"]
        if bad:
            raise ConfigError(f"{path}: estimate.{device}: unknown key {bad[0]}; valid: {', '.join(ESTIMATE_KEYS)}")
        for key in ESTIMATE_KEYS[:3]:
            v = costs.get(key)
            if v is None:  # not measured: counts nothing
                continue
            nums = v if isinstance(v, list) and len(v) in (1, 2) else [v]
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in nums):
                raise ConfigError(f"{path}: estimate.{device}.{key} must be a number >= 0 (or [low, high]), got {v!r}")
    return value


def read_preset(path: str | Path) -> Preset:
    """The preset file at ``path``, checked before anything runs (every stage setting through ProbeConfig /
    TrainConfig's own checks).

    Raises:
        ConfigError: one line: the file is missing or not YAML, a key is unknown (the valid ones listed), a stage
            sets a field the preset may not (:data:`PRESET_FIXED`), seeds are not two or more distinct integers, a
            setting's value is invalid, or a cost is not a number.
    """
    path = str(path)
    try:
        data = safe_load_yaml(Path(path).read_text(encoding="utf8"))
    except OSError as e:
        raise ConfigError(
            f"--preset {path}: cannot read it ({e.strerror or e}); pass a preset file such as configs/decide-cpu.yaml"
        ) from None
    except (yaml.YAMLError, ValueError) as e:
        raise ConfigError(f"--preset {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--preset {path} must hold a mapping of {', '.join(PRESET_KEYS)}")
    unknown = sorted(set(data) - set(PRESET_KEYS))
    missing = [k for k in PRESET_KEYS[:4] if k not in data]
    if unknown or missing:
        what = f"unknown key {unknown[0]!r}" if unknown else f"no {missing[0]!r}"
        raise ConfigError(f"{path}: {what}; a preset's keys are {', '.join(PRESET_KEYS)} (estimate optional)")
    for stage in ("probe", "train"):
        settings = data[stage] or {}
        if not isinstance(settings, dict):
            raise ConfigError(f"{path}: {stage} must be a mapping of {stage}'s settings, got {settings!r}")
        fixed = [k.replace("-", "_") for k in settings if k.replace("-", "_") in PRESET_FIXED]
        if fixed:
            raise ConfigError(
                f"{path}: {stage}.{fixed[0]} cannot be set in a preset (out is OUT/{stage}, the seeds are "
                f"{stage}_seeds, the device is demo's --device)"
            )
        data[stage] = settings
    preset = Preset(
        path=path,
        probe_seeds=_seeds(data["probe_seeds"], "probe_seeds", path),
        probe=data["probe"],
        train_seeds=_seeds(data["train_seeds"], "train_seeds", path),
        train=data["train"],
        estimate=_costs(data.get("estimate"), path),
    )
    preset.probe_config(Path("OUT"), "auto"), preset.train_config(Path("OUT"), "auto")  # each setting's own check
    return preset


def _span(value: float | list[float], scale: float = 1.0) -> tuple[float, float]:
    lo, hi = (value[0], value[-1]) if isinstance(value, list) else (value, value)
    return lo * scale, hi * scale


def _minutes(lo: float, hi: float) -> str:
    return f"{lo:.0f} min" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f} min"


def estimate_lines(preset: Preset, out: Path, device: str) -> list[str]:
    """The time estimate ``demo --preset`` prints before any work: the stages' remaining work (a finished seed or
    step counts nothing) times the preset's measured costs for ``device``; "not measured" where the preset has no
    costs for it (a GPU, unless ``estimate.cuda`` exists).

    Probe: unfinished seeds x ``probe_seed_minutes``. Training, per seed: the steps left with the lens off x
    ``train_step_seconds`` + the lens steps left (:func:`grpo_lens.train.loop.is_lens_step`) x
    ``lens_step_seconds``.
    """
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    if device == "auto":
        import torch

        kind = "cuda" if torch.cuda.is_available() else "cpu"
    probe_cfg, train_cfg = preset.probe_config(out, device), preset.train_config(out, device)
    probe_left = [s for s in preset.probe_seeds if not (out / "probe" / f"seed_{s}" / "probe.json").is_file()]
    steps, lens = 0, 0
    for s in preset.train_seeds:
        done = _last_step(out / "train" / f"seed_{s}") or 0
        todo = range(done + 1, train_cfg.max_steps + 1)
        n_lens = sum(is_lens_step(t, train_cfg.lens_every, train_cfg.max_steps) for t in todo)
        steps, lens = steps + len(todo) - n_lens, lens + n_lens
    head = (
        f"time estimate for {preset.path} ({len(preset.probe_seeds)} probe seeds of R = "
        f"{', '.join(map(str, probe_cfg.group_sizes))}; {len(preset.train_seeds)} training seeds x "
        f"{train_cfg.max_steps} steps, the lens every {train_cfg.lens_every}) on {kind}:"
    )
    left = (
        f"left: {len(probe_left)} of {len(preset.probe_seeds)} probe seeds, {steps} training steps with the lens off "
        f"and {lens} lens steps"
    )
    costs = preset.estimate.get(kind)
    if not costs:
        where = "not measured on GPU" if kind == "cuda" else "not measured on CPU"
        return [f"{head} {where} (the preset records no estimate.{kind} costs); {left}"]
    p_lo, p_hi = _span(costs.get("probe_seed_minutes") or 0, len(probe_left))
    t_lo, t_hi = _span(costs.get("train_step_seconds") or 0, steps / 60)
    l_lo, l_hi = _span(costs.get("lens_step_seconds") or 0, lens / 60)
    return [
        head,
        f"  probe {_minutes(p_lo, p_hi)}, training {_minutes(t_lo + l_lo, t_hi + l_hi)}; total about "
        f"{_minutes(p_lo + t_lo + l_lo, p_hi + t_hi + l_hi)} ({left})",
        f"  costs measured: {costs.get('measured') or 'where unstated'}",
    ]


def _stage_settings(config: ProbeConfig | TrainConfig) -> dict[str, Any]:
    """A stage's settings that decide its numbers (:data:`STAGE_RUN_KEYS` left out)."""
    return {k: v for k, v in config.to_dict().items() if k not in STAGE_RUN_KEYS}


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    keys = sorted((set(saved) | set(now)) - set(STAGE_RUN_KEYS) - {"preset"})
    return [f"{k}={saved.get(k)!r} (now {now.get(k)!r})" for k in keys if saved.get(k) != now.get(k)]


def _check_preset_out(out: Path, settings: dict[str, Any], stages: dict[str, dict[str, Any]], overwrite: bool) -> None:
    """Refuse an OUT this preset run may not write into: a demo run of other settings, or a folder that holds other
    things than the stages' folders, or stage folders whose config.yaml differs from the preset's stage.

    Raises:
        ConfigError: one line naming what differs and what to do.
    """
    saved_path = out / "demo.yaml"
    if not out.exists():
        return
    if overwrite:
        if run_dir_entries(out) and not saved_path.exists():
            raise ConfigError(f"--overwrite: {out} holds files that are not a demo run; they are never deleted")
        return
    if saved_path.exists():
        saved = safe_load_yaml(saved_path.read_text()) or {}
        saved = {k: v for k, v in saved.items() if k != "preset"} if isinstance(saved, dict) else None  # its path
        diffs = _differences(saved, settings) if saved is not None else ["demo.yaml (not a mapping)"]
        if diffs:
            raise ConfigError(
                f"{out} holds a demo run with other settings ({'; '.join(diffs[:4])}); rerun with the same preset "
                f"to continue it, pass --overwrite to start over, or choose another --out"
            )
        return
    other = [p.name for p in run_dir_entries(out) if p.name not in (*stages, "report.md") and p.suffix != ".png"]
    if other:
        raise ConfigError(f"{out} is not empty and holds no demo run ({other[0]}); choose another --out")
    for stage, now in stages.items():  # stage folders written by hand with the same commands: adopted if equal
        path = out / stage / "config.yaml"
        if not path.is_file():
            continue
        saved = safe_load_yaml(path.read_text()) or {}
        diffs = _differences(saved, now) if isinstance(saved, dict) else ["config.yaml (not a mapping)"]
        if diffs:
            raise ConfigError(
                f"{path} was written with other settings than {settings['preset']}'s {stage} stage "
                f"({'; '.join(diffs[:4])}); choose another --out"
            )


def finished_stages(out: Path) -> dict[str, bool]:
    """Which stages of a ``demo --preset`` OUT are finished: probe (OUT/probe/probe.json, written after every seed)
    and train (OUT/train/train_seeds.json, written after every seed's last step)."""
    return {"probe": (out / "probe" / "probe.json").is_file(), "train": read_train_seeds(out / "train") is not None}


def _report_finished(out: Path, settings: dict[str, Any], stages: dict[str, dict[str, Any]], overwrite: bool) -> Path:
    """``demo --preset FILE --report-only``: OUT/report.md from the finished stages alone, after the same checks as a
    run (a stage folder of other settings is refused); nothing runs and no model is loaded.

    Raises:
        ConfigError: ``--overwrite`` given, OUT refused by :func:`_check_preset_out`, or no stage finished.
    """
    if overwrite:
        raise ConfigError("--report-only writes only OUT/report.md; it cannot be combined with --overwrite")
    _check_preset_out(out, settings, stages, False)
    done = finished_stages(out)
    if not any(done.values()):
        raise ConfigError(
            f"{out}: no stage finished (no probe/probe.json, no train/train_seeds.json); nothing to report"
        )
    print(
        "report only: " + "; ".join(f"{k} {'finished' if v else 'NOT finished (left out)'}" for k, v in done.items()),
        flush=True,
    )
    if not (out / "demo.yaml").exists():  # the settings the stages were checked against (tools/update_readme_claims.py)
        (out / "demo.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    return write_report(out)


def _run_preset(config: DemoConfig) -> Path:
    """``demo --preset FILE``: see the module docstring; return the path of OUT/report.md.

    Raises:
        ConfigError: a demo flag other than --out, --device, --overwrite given with --preset, a bad preset file, or
            an OUT this run may not write into (:func:`_check_preset_out`); all before anything is written.
    """
    assert config.preset is not None  # run_demo comes here only with --preset

    defaults = DemoConfig().to_dict()
    given = [k for k, v in config.to_dict().items() if k not in PRESET_FLAGS and v != defaults[k]]
    if given:
        raise ConfigError(
            f"--{given[0].replace('_', '-')} cannot be combined with --preset: set it in {config.preset}'s probe or "
            f"train settings (only --out, --device and --overwrite combine with --preset)"
        )
    preset = read_preset(config.preset)
    out = Path(config.out)
    probe_cfg, train_cfg = preset.probe_config(out, config.device), preset.train_config(out, config.device)
    stages = {"probe": _stage_settings(probe_cfg), "train": _stage_settings(train_cfg)}
    settings = {
        "preset": preset.path,
        "probe_seeds": preset.probe_seeds,
        "train_seeds": preset.train_seeds,
        **{f"{stage}.{k}": v for stage, d in stages.items() for k, v in d.items()},
    }
    for stage in (probe_cfg, train_cfg):  # what the stages check only after writing into their folders
        check_trackers(stage.report_to)
        parse_reward_specs(stage.rewards)
    out = out.absolute()  # a reward function may os.chdir
    if config.report_only:
        return _report_finished(out, settings, stages, config.overwrite)
    _check_preset_out(out, settings, stages, config.overwrite)
    for line in estimate_lines(preset, out, config.device):  # before any model is loaded
        print(line, flush=True)
    if config.overwrite and out.exists():
        clear_run_dir(out)  # all but the lock file this process holds
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "demo.yaml").exists():
        (out / "demo.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    t0 = time.perf_counter()

    probe_dir = out / "probe"
    if not (probe_dir / "probe.json").exists():
        logger.info("[1/3] probe --seeds %s into %s", preset.probe_seeds, probe_dir)
        run_seeds(replace(probe_cfg, resume=probe_dir.exists()), preset.probe_seeds)  # out as given: config.yaml

    train_dir = out / "train"
    finished = [(_last_step(train_dir / f"seed_{s}") or 0) >= train_cfg.max_steps for s in preset.train_seeds]
    if not ((train_dir / SEEDS_FILE).is_file() and all(finished)):
        logger.info("[2/3] train --seeds %s into %s", preset.train_seeds, train_dir)

        def run(sub: TrainConfig) -> None:  # a finished seed is kept without loading its model
            # train --seeds gives every seed its out
            if not (sub.resume and (_last_step(Path(sub.out)) or 0) >= sub.max_steps):  # type: ignore[arg-type]
                train(sub)

        run_train_seeds(replace(train_cfg, resume=train_dir.exists()), preset.train_seeds, run)

    logger.info("[3/3] writing the report")
    report = write_report(out)
    logger.info("demo --preset done in %.0f s: %s", time.perf_counter() - t0, report)
    return report
