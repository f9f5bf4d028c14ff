"""Experiment trackers (``--report-to``): every metrics.jsonl record is also sent to TensorBoard, W&B or trackio.

metrics.jsonl stays the source of truth (the report and ``grpo-lens compare`` read only it); a tracker gets a copy
of each record at its step, numbers only (a missing value, null in metrics.jsonl, is not sent). The trackers are
accelerate's (:mod:`accelerate.tracking`: ``TensorBoardTracker``, ``WandBTracker``, ``TrackioTracker``), which wrap
each library's own API; only the main process logs.

Where the data goes:

- ``tensorboard``: ``RUN/tensorboard/`` (event files; ``tensorboard --logdir RUN/tensorboard``). A resumed run
  opens its writer with ``purge_step`` = the first step it redoes, so TensorBoard hides the events a killed run had
  written after its last checkpoint and each step shows once.
- ``wandb``: project ``$WANDB_PROJECT`` (default ``grpo-lens``), run name = the run directory's name, files under
  ``RUN/wandb/``. ``WANDB_MODE=offline`` works without a network (``wandb sync RUN/wandb/offline-run-*`` uploads
  later). A resumed run continues the same W&B run id (stored in ``RUN/wandb/grpo_lens_run_id``).
- ``trackio``: project ``$TRACKIO_PROJECT`` (default ``grpo-lens``), run name = the run directory's name, stored
  locally by trackio (``$TRACKIO_DIR``; ``trackio show`` opens it).

Names: ``--metric-names trl`` (or ``verl``) sends each key under that library's name where it logs the same quantity
(:func:`grpo_lens.metrics.renamed_record`, the table in docs/metrics.md), so a dashboard built for TRL runs shows
grpo-lens runs too; metrics.jsonl keeps grpo-lens' keys.

Completion tables: each step's logged completions (prompt, completion, reward, advantage, truncated; the rows of
completions.jsonl) go to W&B as a table (``completions``) and to TensorBoard as a Markdown text (``completions``);
trackio gets none (accelerate's tracker has no table call).
"""

from __future__ import annotations

import importlib.util
import math
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from grpo_lens import metrics as mk
from grpo_lens.registry import Registry

#: ``--report-to`` names; ``none`` sends nothing.
REPORT_TO = ("none", "tensorboard", "wandb", "trackio")

#: The Python module each tracker needs and the pip extra that installs it.
_REQUIRES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
}

#: name -> factory(run_path, start_step) returning an accelerate ``GeneralTracker`` (not started).
TRACKERS: Registry[Callable[[Path, int], Any]] = Registry("tracker")


def check_trackers(names: list[str]) -> None:
    """Raise before anything is written when a named tracker is unknown or its library is not installed.

    Raises:
        ValueError: an unknown name (listing the valid ones), ``none`` with another name, or a missing library
            (naming the pip extra that installs it).
    """
    for name in names:
        if name not in REPORT_TO:
            raise ValueError(f"--report-to {name!r}: unknown tracker; valid names: {', '.join(REPORT_TO)}")
    if "none" in names and len(names) > 1:
        raise ValueError(f"--report-to {' '.join(names)}: 'none' cannot be combined with a tracker; drop it")
    for name in names:
        if name == "none":
            continue
        module, extra = _REQUIRES[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"--report-to {name}: the {module!r} package is not installed; install it with "
                f"pip install '.[{extra}]' in the grpo-lens folder (or pip install {module})"
            )


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics record (not ``step``; no None, NaN, bool or text), as floats."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != mk.STEP and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def _cell(value: Any) -> Any:
    """A completion-table cell: numbers and text as they are, anything else (a dict of rewards) as its text."""
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def _flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters as trackers accept them: bool/int/float/str, lists and mappings as their text."""
    return {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in config.items()}


@TRACKERS.register("tensorboard")
def _tensorboard(run_path: Path, start_step: int) -> Any:
    from accelerate.tracking import TensorBoardTracker

    kwargs = {"purge_step": start_step + 1} if start_step > 0 else {}
    return TensorBoardTracker("tensorboard", str(run_path), **kwargs)


def _tensorboard_hparams(tracker: Any, values: dict[str, Any]) -> None:
    """The run's hyperparameters into the tracker's own event file and ``hparams.yml`` beside it (accelerate's
    ``store_init_configuration`` makes a new timestamped subfolder for each; TensorBoard shows them either way)."""
    from torch.utils.tensorboard.summary import hparams

    writer = tracker.writer.file_writer if hasattr(tracker.writer, "file_writer") else tracker.writer._get_file_writer()
    for summary in hparams(values, {}):
        writer.add_summary(summary)
    tracker.writer.flush()
    (Path(tracker.writer.log_dir) / "hparams.yml").write_text(yaml.safe_dump(values))


@TRACKERS.register("wandb")
def _wandb(run_path: Path, start_step: int) -> Any:
    from accelerate.tracking import WandBTracker

    id_file = run_path / "wandb" / "grpo_lens_run_id"
    id_file.parent.mkdir(parents=True, exist_ok=True)
    if start_step > 0 and id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
    return WandBTracker(
        os.environ.get("WANDB_PROJECT", "grpo-lens"), name=run_path.name, dir=str(run_path), id=run_id, resume="allow"
    )


@TRACKERS.register("trackio")
def _trackio(run_path: Path, start_step: int) -> Any:
    from accelerate.tracking import TrackioTracker

    return TrackioTracker(
        os.environ.get("TRACKIO_PROJECT", "grpo-lens"),
        name=run_path.name,
        resume="allow" if start_step > 0 else "never",
    )


class Trackers:
    """The trackers of one run: started with the run's config, fed each metrics record, closed at the end.

    Args:
        names: ``--report-to`` values (``["none"]`` or ``[]``: nothing).
        run_path: the run directory.
        config: the resolved config (stored as the run's hyperparameters; its ``metric_names``, default
            ``grpo-lens``, names the keys the trackers get).
        start_step: the last step already done (0 for a new run).

    Raises:
        ValueError: as :func:`check_trackers`.
    """

    def __init__(self, names: list[str], run_path: Path, config: dict[str, Any], start_step: int = 0):
        check_trackers(names)
        self.metric_names = config.get("metric_names") or "grpo-lens"
        self.trackers = []
        for name in names:
            if name == "none":
                continue
            tracker = TRACKERS.get(name)(Path(run_path), start_step)
            tracker.start()
            if name == "tensorboard":
                _tensorboard_hparams(tracker, _flat_config(config))
            else:
                tracker.store_init_configuration(_flat_config(config))
            self.trackers.append(tracker)

    def log(self, record: dict[str, Any], step: int) -> None:
        """Send a metrics record's numbers at ``step``, under the ``metric_names`` scheme."""
        values = mk.renamed_record(scalars(record), self.metric_names)
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def log_completions(self, rows: list[dict[str, Any]], step: int) -> None:
        """Send one step's completion rows (dicts of the same keys) as the table ``completions``
        (:meth:`log_table`)."""
        self.log_table("completions", rows, step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        """Send rows (dicts of the same keys) as a table called ``name``: W&B ``log_table``, TensorBoard a Markdown
        table in ``add_text``; nothing for trackers without tables."""
        if not rows:
            return
        columns = [k for k in rows[0] if k != mk.STEP]
        data = [[_cell(row.get(c)) for c in columns] for row in rows]
        for tracker in self.trackers:
            if tracker.name == "wandb":
                tracker.log_table(name, columns=columns, data=data, step=step)
            elif tracker.name == "tensorboard":
                text = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                text += [
                    "| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |" for row in data
                ]
                tracker.writer.add_text(name, "\n".join(text), global_step=step)

    def finish(self) -> None:
        """Flush and close every tracker."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
