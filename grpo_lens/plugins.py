"""Plugin modules (``GRPO_LENS_PLUGINS``) recorded in a run directory, so that a resumed run that needs one names it.

``GRPO_LENS_PLUGINS=my_rewards grpo-lens train ...`` imports ``my_rewards`` before anything else
(:func:`grpo_lens.cli.load_plugins`), so the rewards and tasks it registers can be named. The run's config.yaml (and a
partial probe's) starts with the comment line :func:`config_header`, ``# GRPO_LENS_PLUGINS=my_rewards ...``: YAML
ignores it, so the config's fields do not change. When ``--resume`` finds a reward or task of the run that no
module imported now registers, :func:`check_resumed_plugins` fails with the recorded modules and the variable to set,
instead of "unknown reward function 'parity'".
"""

from __future__ import annotations

import os
import re
from collections.abc import Container
from pathlib import Path

from grpo_lens.config import ConfigError

#: Environment variable listing modules to import at start (comma-separated): they register rewards and tasks.
PLUGINS_ENV = "GRPO_LENS_PLUGINS"

_HEADER = re.compile(rf"^# {PLUGINS_ENV}=(\S*)", re.MULTILINE)


def plugin_names(spec: str | None = None) -> list[str]:
    """The module names of ``spec`` (default ``$GRPO_LENS_PLUGINS``), comma-separated, blanks dropped."""
    spec = os.environ.get(PLUGINS_ENV, "") if spec is None else spec
    return [n.strip() for n in spec.split(",") if n.strip()]


def config_header(spec: str | None = None) -> str:
    """The comment line a config.yaml starts with when plugins are loaded ('' without plugins)."""
    names = plugin_names(spec)
    if not names:
        return ""
    return (
        f"# {PLUGINS_ENV}={','.join(names)}  (plugin modules this run was started with; set the same to --resume it)\n"
    )


def recorded_plugins(config_path: str | Path) -> list[str]:
    """The plugin modules a saved config.yaml records in its :func:`config_header` ([] without one or no file)."""
    try:
        match = _HEADER.search(Path(config_path).read_text())
    except OSError:
        return []
    return plugin_names(match.group(1)) if match else []


def check_resumed_plugins(
    rewards: list[str],
    task: str,
    config_path: str | Path,
    *,
    registered_rewards: Container[str],
    registered_tasks: Container[str],
) -> None:
    """Before a run resumes: every reward function of ``rewards`` (NAME or NAME:WEIGHT) and the task must be
    registered by now, in ``registered_rewards`` and ``registered_tasks`` (:data:`grpo_lens.rewards.REWARDS` and
    :data:`grpo_lens.tasks.TASKS`, which the caller passes: they load torch, and this module is read by
    ``grpo-lens --help``).

    Raises:
        ConfigError: naming what is missing, the modules recorded in ``config_path`` and :data:`PLUGINS_ENV` (the
            one variable to set), or, for a run that recorded none, the variable to set to the module that
            registers them.
    """
    names = (str(s).split(":", 1)[0].strip() for s in rewards)
    missing = [f"reward function {n!r}" for n in names if n not in registered_rewards]
    task = os.fspath(task)
    is_file = task == "jsonl" or task.endswith((".jsonl", ".json")) or Path(task).is_file()
    if task not in registered_tasks and not is_file:
        missing.append(f"task {task!r}")
    if not missing:
        return
    what = " and ".join(missing)
    recorded = recorded_plugins(config_path)
    loaded = plugin_names()
    if recorded:
        need = [m for m in recorded if m not in loaded] or recorded
        raise ConfigError(
            f"--resume: {what} is not registered; this run was started with {PLUGINS_ENV}="
            f"{','.join(recorded)} (recorded in {config_path}): set {PLUGINS_ENV}={','.join(recorded)} "
            f"again, with {' and '.join(repr(m) for m in need)} importable from the current directory "
            f"or PYTHONPATH"
        )
    raise ConfigError(
        f"--resume: {what} is not registered, and {config_path} records no plugin module; set "
        f"{PLUGINS_ENV} to the module that registers it (comma-separated, importable from the current "
        f"directory or PYTHONPATH)" + (f"; loaded now: {','.join(loaded)}" if loaded else "")
    )
