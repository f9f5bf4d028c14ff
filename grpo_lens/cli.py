"""The ``grpo-lens`` command: train, probe, report, demo, compare, calibrate.

Every command turns a known bad input (invalid config value, unusable --out, missing model or checkpoint, malformed
dataset row) into one line on stderr that says what is wrong and how to fix it, and exit status 2; nothing written
before is lost.

Plugins: ``GRPO_LENS_PLUGINS=my_rewards,my_tasks grpo-lens train ...`` imports those modules (comma-separated,
importable from the working directory or PYTHONPATH: :func:`load_plugins`) before anything else, so the reward functions
and tasks they register (``@REWARDS.register("name")``, ``@TASKS.register("name")``) can be named in flags and YAML.

Config keys and flags under a deprecated name (``--lens-sketch-dim``) work with one ``grpo-lens CMD: warning: ...``
line on stderr naming the current one.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from grpo_lens import __version__
from grpo_lens import metrics as mk
from grpo_lens.config import (
    ConfigError,
    ConfigNameWarning,
    TrainConfig,
    add_config_arguments,
    config_from_args,
    flags_given,
)
from grpo_lens.config.demo import DemoConfig
from grpo_lens.plugins import PLUGINS_ENV, check_resumed_plugins
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.registry import declared_constant

# The commands' modules (torch, transformers, matplotlib) are imported inside each ``_cmd_*``, when it runs: the
# parser is built from the config dataclasses alone, so ``--help`` and ``--version`` answer at once
# (tests/test_cli_speed.py). cli.py is the one module that imports the package inside functions (tests/test_layout.py).

#: The model that ``grpo-lens model`` names without an argument (:data:`grpo_lens.models.DEFAULT_MODEL`).
DEFAULT_MODEL = declared_constant("grpo_lens.models", "DEFAULT_MODEL")

#: Exceptions of the commands' modules that mean bad input, as (module, class): one that is not imported has not
#: been raised, so :func:`_user_errors` looks only in the modules already imported.
_COMMAND_ERRORS = (
    ("grpo_lens.rundir", "RunDirError"),
    ("grpo_lens.report.compare", "CompareError"),
    ("grpo_lens.models", "ModelNotFoundError"),
    ("grpo_lens.train.loop", "NonFiniteUpdateError"),
    ("grpo_lens.train.loop", "NoScorableRolloutError"),
)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input rather than a bug: shown as one line, exit status 2."""
    imported = tuple(getattr(sys.modules[module], name) for module, name in _COMMAND_ERRORS if module in sys.modules)
    return (ConfigError, ValueError, FileNotFoundError, PluginError) + imported


#: errno values of a full or read-only disk: shown as one line (the run resumes once the disk is fixed).
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)

C = TypeVar("C", TrainConfig, ProbeConfig)


class PluginError(ImportError):
    """A module named in ``$GRPO_LENS_PLUGINS`` could not be imported."""


def load_plugins(spec: str | None = None) -> list[str]:
    """Import the modules named in ``spec`` (default ``$GRPO_LENS_PLUGINS``, comma-separated); return their names.

    They are imported from ``sys.path`` with the working directory added where ``python -m`` would find a module
    beside the user (``GRPO_LENS_PLUGINS=my_rewards`` with my_rewards.py in the current folder loads without
    PYTHONPATH), but at its end, after PYTHONPATH and the installed packages: a stray file in the working directory
    named like a package (``math_verify.py``) never shadows that package (:func:`plugin_search_path`).

    Raises:
        PluginError: a module cannot be imported, naming it and the cause.
    """
    spec = os.environ.get(PLUGINS_ENV, "") if spec is None else spec
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if names:
        plugin_search_path()
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure to import is reported as one line
            raise PluginError(
                f"{PLUGINS_ENV}: cannot import plugin module {name!r} ({type(e).__name__}: {e}); "
                f"put it in the current directory ({os.getcwd()}) or on PYTHONPATH, or remove it from {PLUGINS_ENV}"
            ) from None
    return names


def plugin_search_path() -> None:
    """Add the working directory to the end of ``sys.path`` unless it is already on it (``python -m`` puts it first,
    the ``grpo-lens`` script does not); a folder already there keeps its place."""
    cwd = os.getcwd()
    on_path = {os.path.abspath(p or os.curdir) for p in sys.path}
    if cwd not in on_path:
        sys.path.append(cwd)
        importlib.invalidate_caches()


def _check_plugins(config: TrainConfig | ProbeConfig, config_path: Path) -> None:
    """:func:`grpo_lens.plugins.check_resumed_plugins` against the live registries (imported here: they load torch)."""
    from grpo_lens.rewards import REWARDS
    from grpo_lens.tasks import TASKS

    check_resumed_plugins(config.rewards, config.task, config_path, registered_rewards=REWARDS, registered_tasks=TASKS)


def _cmd_train(args: argparse.Namespace) -> int:
    if getattr(args, "seeds", None):
        return _cmd_train_seeds(args)
    from grpo_lens.train.loop import train

    config_file = args.config
    if args.resume and args.out and (Path(args.out) / "config.yaml").is_file():
        # Resume from the run's own config: flags need not be repeated, and a flag that differs from it is reported.
        config = _resume_config(args, Path(args.out) / "config.yaml", TrainConfig)
        _check_plugins(config, Path(args.out) / "config.yaml")  # names the module
    else:
        config = config_from_args(args, TrainConfig, config_file)
    run = train(config)
    if os.environ.get("RANK", "0") == "0":  # once, not once per process under torchrun / accelerate
        print(
            f"run written to {run.path}\nnext: grpo-lens report {run.path}   (report.md with the claims and "
            f"plots; grpo-lens compare RUN... --out DIR overlays runs)"
        )
    return 0


def _cmd_train_seeds(args: argparse.Namespace) -> int:
    """``train --seeds S...``: one training run per seed in OUT/seed_<s>, the pooled record OUT/train_seeds.json and
    OUT/report.md with the claims over training decided over the seeds (:mod:`grpo_lens.train.seeds`)."""
    from grpo_lens.report import write_report
    from grpo_lens.train.seeds import run_train_seeds

    config = _seeds_config(args, TrainConfig, "run")
    out = run_train_seeds(config, args.seeds)
    if os.environ.get("RANK", "0") == "0":
        report = write_report(out)
        print(
            f"runs of seeds {', '.join(map(str, args.seeds))} written to {out}/seed_<s>; pooled record "
            f"{out}/train_seeds.json; report {report} (the claims over training decided over the seeds)"
        )
    return 0


def _cmd_model(args: argparse.Namespace) -> int:
    from grpo_lens.models import export_model, model_folder

    if args.export:
        check_out_folder(Path(args.export), "--export")  # before the model is loaded or converted
        print(f"model {args.model} saved to {export_model(args.model, args.export)}")
    else:
        print(model_folder(args.model))
    return 0


def _resume_config(args: argparse.Namespace, saved: Path, cls: type[C]) -> C:
    """The config of ``--resume``: the run's (or partial probe's) saved config.yaml <- the ``--config`` file's keys <-
    the flags given, each under current names (a run saved with a deprecated name resumes, with one warning line per
    name). ``cls``: TrainConfig or ProbeConfig.

    Raises:
        RunDirError: config.yaml is unreadable.  ConfigError: the --config file or a resulting value is invalid.
    """
    from grpo_lens.rundir import read_saved_config

    values = read_saved_config(saved, "restore it or start a new run in another --out")
    values = cls.canonical(values, f"in {saved}")
    if args.config:
        from_file = cls.read(args.config)
        cls.from_dict(from_file)  # checks the file on its own: known keys, valid values
        values.update(from_file)
    values.update(flags_given(args, cls))
    values.update(resume=True, out=args.out)
    try:
        return cls.from_dict(values)
    except ConfigError as e:  # a value of the saved file (e.g. cut or edited), or a flag: name the file
        raise ConfigError(f"{e} (resuming from {saved} and the flags given)") from None


def _seeds_config(args: argparse.Namespace, cls: type[C], one: str) -> C:
    """The settings of ``train --seeds`` / ``probe --seeds`` (``one``: "run" / "probe", for the message): with
    ``--resume`` and OUT/config.yaml there, the settings every seed ran with (:func:`_resume_config`, its plugins
    checked); otherwise the ``--config`` file and the flags.

    Raises:
        ConfigError: ``--seed`` given too, or an invalid setting.  RunDirError: OUT/config.yaml is unreadable.
    """
    if args.seed is not None:
        raise ConfigError(f"pass --seed (one {one}) or --seeds (one {one} per seed, pooled), not both")
    saved = Path(args.out) / "config.yaml" if args.out else None
    if args.resume and saved is not None and saved.is_file():
        config = _resume_config(args, saved, cls)  # the settings every seed ran with
        _check_plugins(config, saved)
        return config
    return config_from_args(args, cls, args.config)


def _cmd_probe(args: argparse.Namespace) -> int:
    if args.seeds:
        return _cmd_probe_seeds(args)
    from grpo_lens.probe.partial import PartialProbe
    from grpo_lens.probe.run import run_probe

    partial = PartialProbe(args.out) if args.out else None
    if args.resume and partial is not None and partial.exists():
        # Resume with the partial probe's settings: flags need not be repeated, and one that differs is reported.
        config = _resume_config(args, partial.config_path, ProbeConfig)
        _check_plugins(config, partial.config_path)  # names a missing plugin module
    else:
        config = config_from_args(args, ProbeConfig, args.config)
    out = run_probe(config)
    data = json.loads((out / "probe.json").read_text())
    per_group_size = ", ".join(
        f"R = {R}: {d[mk.GROUPS_MIXED]} mixed of {d[mk.PROMPTS_SAMPLED]} prompts "
        f"in {d[mk.PROBE_TIMING]['seconds']:.0f} s"
        for R, d in data["per_group_size"].items()
    )
    meta = data["meta"]
    print(
        f"probe written to {out} in {meta['seconds']:.0f} s ({per_group_size}; studies {meta['studies_seconds']:.0f} s)"
    )
    return 0


def _cmd_probe_seeds(args: argparse.Namespace) -> int:
    """``probe --seeds S...``: one probe per seed in OUT/seed_<s>, pooled into OUT/probe.json
    (:mod:`grpo_lens.probe.seeds`)."""
    from grpo_lens.probe.seeds import run_seeds, seed_summary_line

    config = _seeds_config(args, ProbeConfig, "probe")
    out = run_seeds(config, args.seeds)
    pooled = json.loads((out / "probe.json").read_text())
    print(
        f"pooled probe of seeds {', '.join(map(str, args.seeds))} written to {out} ({seed_summary_line(pooled)}; "
        f"each seed in {out}/seed_<s>)\nnext: grpo-lens report {out}"
    )
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from grpo_lens.report import write_report

    path = write_report(Path(args.run_dir))
    print(f"report written to {path}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from grpo_lens.demo import run_demo

    config = config_from_args(args, DemoConfig, args.config)
    path = run_demo(config)
    print(f"demo report: {path}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from grpo_lens.report.compare import compare_runs

    path = compare_runs(args.run_dirs, args.out, last=args.last, allow_different_tasks=args.allow_different_tasks)
    print(f"comparison written to {path}")
    return 0


def check_out_folder(out: Path, flag: str = "--out") -> None:
    """``--out`` of calibrate / model --export: a folder, or a path that can be made one under a writable folder.

    Raises:
        ConfigError: a file at or above ``out``, or a folder this user cannot write (one line, before any work).
    """
    base = out
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        what = "is a file" if base == out else f"is under the file {base}"
        raise ConfigError(f"{flag} {out} {what}, so no folder can be made there; choose another {flag}")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {out}: {base} is not writable by this user; choose another {flag}")


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from grpo_lens.calibrate import CalibrationConfig, PlantedFileError, render, run_calibration, run_planted

    check_out_folder(Path(args.out))  # before minutes of computing
    if args.trials < 1:
        raise ConfigError(f"--trials {args.trials}: must be >= 1 (trials per planted cell; default 200)")
    if args.planted:
        try:
            run_planted(Path(args.planted), Path(args.out))
        except PlantedFileError as e:
            print(f"grpo-lens calibrate: error: {e}", file=sys.stderr)
            return 2
        return 0
    config = CalibrationConfig.quick() if args.quick else CalibrationConfig(trials=args.trials, seed=args.seed)
    result = run_calibration(config, Path(args.out), mode="quick" if args.quick else "full")
    print(render(result))
    print(f"calibration written to {Path(args.out) / 'calibration.md'} in {result['meta']['seconds']:.0f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; flags come from the config dataclasses' fields and help."""
    parser = argparse.ArgumentParser(
        prog="grpo-lens",
        description="Train with GRPO and measure its gradient.",
        epilog=f"Your own reward functions and tasks: put them in a module that "
        f"registers them and list it in {PLUGINS_ENV} (comma-separated), e.g. "
        f"{PLUGINS_ENV}=my_rewards grpo-lens train --rewards my_reward ...",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print grpo-lens' version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    commands = [
        ("train", "GRPO training with the lens every few steps", TrainConfig, _cmd_train),
        ("probe", "measure GRPO's gradient structure (rank, identity, baselines, credit)", ProbeConfig, _cmd_probe),
        ("demo", "the main job: probe, train with the lens, probe again, report", DemoConfig, _cmd_demo),
    ]
    seeds_help = {
        "probe": "one probe per seed into OUT/seed_<s>, then the groups pooled over the seeds in OUT/probe.json and "
        "report.md: the claims decided on the pooled groups, the between-seed spread beside each run's interval "
        "(docs/seeds.md)",
        "train": "one training run per seed into OUT/seed_<s>, then OUT/train_seeds.json and report.md: the claims "
        "over training decided over the seeds (each seed's trend one unit, a t over seeds; docs/seeds.md)",
    }
    for name, help_, cls, fn in commands:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", help=f"YAML file of {cls.__name__} fields; flags override it")
        add_config_arguments(p, cls)
        if name in seeds_help:
            p.add_argument("--seeds", type=int, nargs="+", metavar="SEED", help=seeds_help[name])
        p.set_defaults(fn=fn)

    p = sub.add_parser(
        "model",
        help="print the Hugging Face folder of a model (the default one: for TRL's "
        "from_pretrained), or save it as one with --export DIR",
    )
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"a model name (default: {DEFAULT_MODEL})")
    p.add_argument("--export", metavar="DIR", help="save the model and tokenizer as a Hugging Face folder DIR")
    p.set_defaults(fn=_cmd_model)

    p = sub.add_parser("report", help="write RUN_DIR/report.md and plots from a run directory")
    p.add_argument("run_dir", help="a run directory written by train, probe, demo or LensGRPOTrainer (TRL)")
    p.set_defaults(fn=_cmd_report)

    p = sub.add_parser("compare", help="overlay two or more training runs in one report (OUT/compare.md)")
    p.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="run directories written by grpo-lens train or LensGRPOTrainer (TRL)",
    )
    p.add_argument("--out", required=True, help="directory for compare.md, compare.png and compare.json")
    p.add_argument(
        "--last",
        type=int,
        default=10,
        help="final numbers average each run's last this many records of a metric; intervals need >= 8 (default: 10)",
    )
    p.add_argument(
        "--allow-different-tasks",
        action="store_true",
        help="compare runs whose task, task options or dataset differ, or a TRL run (which does not "
        "record its task) with others (refused otherwise)",
    )
    p.set_defaults(fn=_cmd_compare)

    p = sub.add_parser("calibrate", help="level and power of every verdict rule on planted cases (docs/calibration.md)")
    p.add_argument("--out", required=True, help="directory for calibration.md and calibration.json")
    p.add_argument("--quick", action="store_true", help="a few trials and families (seconds; not the calibration)")
    p.add_argument("--trials", type=int, default=200, help="trials per planted cell (default: 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the planted cases (default: 0)")
    p.add_argument(
        "--planted",
        metavar="FILE.npz",
        help="your own planted cases: arrays gram [trials, n, R, R] "
        "float64, rewards [trials, n, R], optional dim (P); writes OUT/planted.json, each claim's verdict "
        "shares through the probe's path",
    )
    p.set_defaults(fn=_cmd_calibrate)
    return parser


def _show_config_warning(show: Callable[..., None], command: str) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints a :class:`ConfigNameWarning` as one line, ``grpo-lens CMD: warning:
    ...``, and passes other warnings to ``show``."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ConfigNameWarning):
            print(f"grpo-lens {command}: warning: {message}", file=file or sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``grpo-lens`` console script; returns the exit status (2: bad input, one line on stderr).

    The arguments are parsed before the plugins are imported (``--version`` and ``--help`` import none), and
    stdout / stderr write what their encoding cannot hold as escapes (``PYTHONIOENCODING=ascii`` with a non-ASCII
    --out: the finished run's last line is printed, not an exit 2 after the work).
    """
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a stream that cannot change its error handler: left as it is
                pass
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        load_plugins()
    except PluginError as e:
        print(f"grpo-lens: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("transformers", "accelerate", "urllib3", "filelock", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_config_warning(warnings.showwarning, args.command)
            return args.fn(args)
    except _user_errors() as e:
        if args.verbose:
            raise
        print(f"grpo-lens {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in DISK_ERRORS or args.verbose:
            raise
        what = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else e.strerror
        print(
            f"grpo-lens {args.command}: error: {what} while writing {e.filename or 'a file'}; nothing lost (every "
            f"step written before is intact): free space (or fix the device) and resume with --resume",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("interrupted; resume with --resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
