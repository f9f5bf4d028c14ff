"""The ``grpo-lens`` command: train, probe, report, demo.

Every command turns a known bad input (invalid config value, unusable --out, missing model or checkpoint, malformed
dataset row) into one line on stderr that says what is wrong and how to fix it, and exit status 2; nothing written
before is lost.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from grpo_lens.config import TrainConfig, add_config_arguments, config_from_args


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input rather than a bug: shown as one line, exit status 2."""
    from grpo_lens.config import ConfigError
    from grpo_lens.rundir import RunDirError

    errors: list[type[BaseException]] = [ConfigError, RunDirError, ValueError, FileNotFoundError]
    try:
        from grpo_lens.models import ModelNotFoundError

        errors.append(ModelNotFoundError)
    except ImportError:
        pass
    return tuple(errors)


def _cmd_train(args: argparse.Namespace) -> int:
    from grpo_lens.trainer import train

    config = config_from_args(args, TrainConfig, args.config)
    run = train(config)
    print(f"run written to {run.path}")
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    from grpo_lens.probe import ProbeConfig, run_probe

    config = config_from_args(args, ProbeConfig, args.config)
    out = run_probe(config)
    print(f"probe written to {out}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from grpo_lens.report import write_report

    path = write_report(Path(args.run_dir))
    print(f"report written to {path}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from grpo_lens.demo import DemoConfig, run_demo

    config = config_from_args(args, DemoConfig, args.config)
    path = run_demo(config)
    print(f"demo report: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; flags come from the config dataclasses' fields and help."""
    parser = argparse.ArgumentParser(prog="grpo-lens", description="Train with GRPO and measure its gradient.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="GRPO training with the lens every few steps",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="YAML file of TrainConfig fields; flags override it")
    add_config_arguments(p, TrainConfig)
    p.set_defaults(fn=_cmd_train)

    try:
        from grpo_lens.probe import ProbeConfig

        p = sub.add_parser("probe", help="measure GRPO's gradient structure (rank, identity, baselines, credit)")
        p.add_argument("--config", help="YAML file of ProbeConfig fields; flags override it")
        add_config_arguments(p, ProbeConfig)
        p.set_defaults(fn=_cmd_probe)
    except ImportError:
        pass

    p = sub.add_parser("report", help="write RUN_DIR/report.md and plots from a run directory")
    p.add_argument("run_dir", help="a run directory written by train, probe or demo")
    p.set_defaults(fn=_cmd_report)

    try:
        from grpo_lens.demo import DemoConfig

        p = sub.add_parser("demo", help="the main job: probe, train with the lens, probe again, report")
        p.add_argument("--config", help="YAML file of DemoConfig fields; flags override it")
        add_config_arguments(p, DemoConfig)
        p.set_defaults(fn=_cmd_demo)
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``grpo-lens`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "accelerate", "urllib3", "filelock", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.fn(args)
    except _user_errors() as e:
        if args.verbose:
            raise
        print(f"grpo-lens {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; resume with --resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
