"""The partial probe: what a running ``grpo-lens probe`` has measured so far, kept in OUT/probe_partial/ so that
``grpo-lens probe --resume`` continues a killed probe from its last finished prompt (and so its last finished group).

Layout of OUT/probe_partial/::

    config.yaml              the probe's settings (ProbeConfig fields; resume and overwrite stored as False)
    R<R>/prompt-<i>.pt       the record of the i-th prompt (0-based) of group size R: what it counted and measured
                             (:class:`PromptRecord`), one file per prompt, written when the prompt is done
    R<R>.json                the finished group size's probe.json entry, once all its prompts are done
    study-<name>.json        a finished study (baselines, credit)

Every file is written through a temporary file and an atomic rename, so a probe killed at any moment leaves only
whole files; the folder is deleted once probe.json is written. Which prompts a resumed probe samples next follows
from the count of records alone: the probe draws prompts in batches seeded by (seed, R, batch number), and every
random number after that is seeded from the batch's seed, so the i-th prompt is the same in every run with the same
settings.
"""

from __future__ import annotations

import errno
import io
import json
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from grpo_lens.config import ConfigError
from grpo_lens.rundir import atomic_write_text, disk_full, read_saved_config, write_config_yaml, write_file

#: Probe settings that may differ when a probe resumes: they change no number (the train loop lets device change too).
RESUMABLE_KEYS = ("progress", "device", "report_to")

#: Fields that say how one command treats --out, not what the probe measures.
COMMAND_KEYS = ("resume", "overwrite", "out")

PARTIAL_DIR = "probe_partial"


@dataclass
class PromptRecord:
    """What one sampled prompt contributed to its group size's results (the unit a resumed probe restarts after).

    Attributes:
        status: "invalid" (a reward of the group's R rollouts is invalid), "all_equal" (its R rewards are equal) or
            "mixed" (analysed).
        s1_prediction: S1 predicted from the M - R rollouts outside the group when all M rewards are valid, else None.
        row: the analysed group's canonical keys (mixed only).
        extra: its spectra, G3 rows {weighting: [P_s]}, advantages [R], credit profile and Gram coverage (mixed only).
        check: the sketch-vs-exact check of the group, when it was one of the first ``coverage_groups``.
        g2_weightings: G2 under every weighting, when it was one of the first ``g2_groups``.
        baseline_variance: the baseline variances of the prompt's M rollouts, when it was one of the first
            ``baseline_prompts``.
        seconds: {"generation": its share of its batch's generation, "gradient", "g2_weightings", "sketch_check"}.
    """

    status: str
    s1_prediction: float | None = None
    row: dict[str, float] | None = None
    extra: dict[str, Any] | None = None
    check: dict[str, float] | None = None
    g2_weightings: dict[str, float] | None = None
    baseline_variance: dict[str, float] | None = None
    seconds: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what :func:`torch.save` stores; tensors stay tensors)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _checked_record(record: PromptRecord) -> PromptRecord:
    """``record`` if its fields have the types a probe writes (a crafted or damaged one fails here, by field name,
    not later inside the analysis).

    Raises:
        TypeError: naming the first field of another type.
    """
    if record.status not in ("invalid", "all_equal", "mixed"):
        raise TypeError(f"field 'status' is {record.status!r}, not invalid, all_equal or mixed")
    if record.s1_prediction is not None and (
        isinstance(record.s1_prediction, bool) or not isinstance(record.s1_prediction, (int, float))
    ):
        raise TypeError(f"field 's1_prediction' is a {type(record.s1_prediction).__name__}, not a number")
    for name in ("row", "extra", "check", "g2_weightings", "baseline_variance", "seconds"):
        value = getattr(record, name)
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"field {name!r} is a {type(value).__name__}, not a mapping")
    if record.status == "mixed" and record.row is None:
        raise TypeError("a mixed group's record has no 'row'")
    return record


def _atomic_save(obj: Any, path: Path) -> None:
    """torch.save ``obj`` to ``path`` through :func:`grpo_lens.rundir.write_file` (a temporary file, fsynced, an
    atomic rename; a planted link is replaced, never followed). Serialised in memory first, so a full disk shows
    as the OSError (ENOSPC) the CLI prints as one line, not torch's zip writer's RuntimeError."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        write_file(path, buffer.getvalue())
    except OSError as e:
        if disk_full(e, path.parent):
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from None
        raise


class PartialProbe:
    """OUT/probe_partial/ of one probe (see the module docstring for its layout)."""

    def __init__(self, out: str | Path):
        self.path = Path(out).absolute() / PARTIAL_DIR  # a reward calling os.chdir moves nothing
        self.config_path = self.path / "config.yaml"

    def exists(self) -> bool:
        """Whether a probe started in OUT and did not finish (its config.yaml is there)."""
        return self.config_path.is_file()

    # -- settings ------------------------------------------------------------------------------------------------------
    def saved_config(self) -> dict[str, Any]:
        """The settings the partial probe ran with (field name -> value).

        Raises:
            ConfigError: config.yaml is unreadable or not a mapping, saying what to do.
        """
        return read_saved_config(
            self.config_path,
            "restore it, or pass --overwrite (without --resume) to start the probe over",
            error=ConfigError,
            empty_ok=False,
        )

    def check_config(self, config_dict: dict[str, Any]) -> None:
        """Refuse to resume with settings other than the ones the partial probe's prompts were measured with.

        Every field but :data:`RESUMABLE_KEYS` and :data:`COMMAND_KEYS` must equal the saved one.

        Raises:
            ConfigError: naming every differing field with both values, and what to do.
        """
        saved = self.saved_config()
        skip = set(RESUMABLE_KEYS) | set(COMMAND_KEYS)
        diffs = [
            f"{k} {saved.get(k)!r} -> {v!r}" for k, v in config_dict.items() if k not in skip and saved.get(k) != v
        ]
        if diffs:
            raise ConfigError(
                f"--resume: {'; '.join(diffs)} differ from the settings the partial probe in "
                f"{self.path} was measured with, and a probe's settings cannot change under it: drop "
                f"those flags (or restore the values), or pass --overwrite (without --resume) to start "
                f"over; only {', '.join(RESUMABLE_KEYS)} may change on resume"
            )

    def start(self, config_dict: dict[str, Any]) -> None:
        """Create the folder and write the settings (``resume`` and ``overwrite`` stored as False)."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_config_yaml(self.config_path, {**config_dict, "resume": False, "overwrite": False})

    def remove(self) -> None:
        """Delete the folder (once probe.json holds everything, or to start over)."""
        shutil.rmtree(self.path, ignore_errors=True)

    # -- prompts of one group size ------------------------------------------------------------------------------------
    def _prompt_path(self, group_size: int, index: int) -> Path:
        return self.path / f"R{group_size}" / f"prompt-{index:05d}.pt"

    def prompt_records(self, group_size: int) -> list[PromptRecord]:
        """The records of R's finished prompts, in order: prompt 0, 1, ... up to the first one missing.

        Raises:
            ConfigError: a record file that cannot be read, naming it and what to do.
        """
        records: list[PromptRecord] = []
        while (path := self._prompt_path(group_size, len(records))).is_file():
            try:
                records.append(_checked_record(PromptRecord(**torch.load(path, weights_only=True))))
            except Exception as e:  # noqa: BLE001 - any unreadable record is reported with its recovery
                why = " ".join(str(e).split())[:160]
                raise ConfigError(
                    f"--resume: cannot read {path} ({type(e).__name__}: {why}); delete it and every later "
                    f"prompt-*.pt of {path.parent} to resume before it"
                ) from None
        return records

    def save_prompt(self, group_size: int, index: int, record: PromptRecord) -> None:
        """Write the record of R's prompt ``index`` (0-based)."""
        path = self._prompt_path(group_size, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(record.to_dict(), path)

    # -- finished phases ----------------------------------------------------------------------------------------------
    def _read_json(self, path: Path) -> Any:
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested thousands of levels deep
            raise ConfigError(
                f"--resume: cannot read {path} ({type(e).__name__}); delete it to measure that part again"
            ) from None

    def group_size_result(self, group_size: int) -> dict[str, Any] | None:
        """R's probe.json entry if R finished, else None."""
        return self._read_json(self.path / f"R{group_size}.json")

    def save_group_size_result(self, group_size: int, result: dict[str, Any]) -> None:
        """Keep R's probe.json entry (R finished)."""
        atomic_write_text(self.path / f"R{group_size}.json", json.dumps(result))

    def study(self, name: str) -> dict[str, Any] | None:
        """A finished study's result, else None."""
        return self._read_json(self.path / f"study-{name}.json")

    def save_study(self, name: str, result: dict[str, Any]) -> None:
        """Keep a finished study's result."""
        atomic_write_text(self.path / f"study-{name}.json", json.dumps(result))
