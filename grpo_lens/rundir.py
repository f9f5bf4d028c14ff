"""The self-describing run directory: resolved config, metrics as JSONL, atomic checkpoints.

Layout (DESIGN.md §7)::

    RUN/config.yaml            the resolved TrainConfig
    RUN/metrics.jsonl          one JSON object per step, keys grouped by slash
    RUN/completions.jsonl      a few sampled completions per step
    RUN/checkpoints/step-000010/{model.safetensors, optimizer.pt, state.pt}
    RUN/checkpoints/latest     the name of the newest complete checkpoint

Crash safety: a checkpoint is written to a temporary folder, fsynced, then renamed into place, and ``latest`` is
replaced atomically after it; a kill at any moment leaves the previous checkpoint intact. Metrics are appended per
step; on resume, lines after the checkpoint's step are dropped, so each step appears once.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml


class RunDirError(ValueError):
    """The output directory cannot be used as asked (holds another run, has no checkpoint to resume, ...)."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and an atomic rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, torch.Tensor):
        return _json_safe(value.item()) if value.numel() == 1 else value.tolist()
    return value


class RunDir:
    """A run directory on disk.

    Args:
        path: the directory.

    Raises:
        RunDirError: from :meth:`prepare` and :meth:`load_checkpoint`, with what is wrong and how to fix it.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config_path = self.path / "config.yaml"
        self.metrics_path = self.path / "metrics.jsonl"
        self.completions_path = self.path / "completions.jsonl"
        self.checkpoints = self.path / "checkpoints"

    # ---------------------------------------------------------------------------------------------------------------
    def prepare(self, config_dict: dict[str, Any], *, resume: bool, overwrite: bool,
                resumable_keys: tuple[str, ...] = ()) -> dict[str, Any]:
        """Make the directory ready for a new run or a resumed one; return the config to run with.

        A new run needs an empty or missing directory (or ``overwrite``). A resumed run takes the saved config; values
        given now must equal the saved ones except ``resumable_keys`` (e.g. max_steps, to train longer).
        """
        has_run = self.config_path.exists()
        if resume:
            if not has_run:
                raise RunDirError(f"--resume: {self.path} holds no run (no config.yaml); start a new run with "
                                  f"--out {self.path} and without --resume")
            saved = yaml.safe_load(self.config_path.read_text()) or {}
            for key, value in config_dict.items():
                if key in resumable_keys or key in ("resume", "overwrite", "out"):
                    continue
                if key in saved and saved[key] != value:
                    raise RunDirError(f"--resume: {key}={value!r} differs from the run's saved {key}={saved[key]!r} "
                                      f"in {self.config_path}; drop the flag, or start a new run in another --out")
            merged = {**saved, **{k: config_dict[k] for k in resumable_keys if k in config_dict}}
            merged.update(resume=True, overwrite=False, out=str(self.path))
            return merged
        if self.path.exists() and any(self.path.iterdir()):
            if not overwrite:
                what = "a run" if has_run else "other files"
                raise RunDirError(f"output directory {self.path} already holds {what}; pass --resume to continue "
                                  f"it, --overwrite to replace it, or choose another --out")
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        return config_dict

    def write_config(self, config_dict: dict[str, Any]) -> None:
        """Write config.yaml atomically."""
        atomic_write_text(self.config_path, yaml.safe_dump(config_dict, sort_keys=False))

    # ---------------------------------------------------------------------------------------------------------------
    def append_metrics(self, record: dict[str, Any], path: Path | None = None) -> None:
        """Append one JSON line (non-finite floats become null) and fsync it."""
        path = path or self.metrics_path
        line = json.dumps({k: _json_safe(v) for k, v in record.items()}, sort_keys=False)
        with open(path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate_metrics(self, last_step: int) -> None:
        """Keep only records with step <= last_step (and drop a torn last line) in every JSONL of the run."""
        for path in (self.metrics_path, self.completions_path):
            if not path.exists():
                continue
            kept = []
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill mid-write
                if int(rec.get("step", 0)) <= last_step:
                    kept.append(line)
            atomic_write_text(path, "".join(k + "\n" for k in kept))

    def read_metrics(self) -> list[dict[str, Any]]:
        """All metric records, in order."""
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    # ---------------------------------------------------------------------------------------------------------------
    def save_checkpoint(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        state: dict[str, Any], keep: int = 2) -> Path:
        """Write model (safetensors), optimizer and trainer state for ``step`` atomically; keep the newest ``keep``."""
        from safetensors.torch import save_model

        self.checkpoints.mkdir(parents=True, exist_ok=True)
        name = f"step-{step:06d}"
        final = self.checkpoints / name
        tmp = self.checkpoints / f".{name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({**state, "step": step}, tmp / "state.pt")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.checkpoints)
        atomic_write_text(self.checkpoints / "latest", name + "\n")
        for old in sorted(p for p in self.checkpoints.glob("step-*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stray in self.checkpoints.glob(".step-*.tmp-*"):
            shutil.rmtree(stray, ignore_errors=True)
        return final

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint folder, or None if there is none."""
        pointer = self.checkpoints / "latest"
        if not pointer.exists():
            return None
        name = pointer.read_text().strip()
        path = self.checkpoints / name
        if not path.is_dir():
            raise RunDirError(f"checkpoint pointer {pointer} names {name}, which is missing; delete {pointer} to "
                              f"restart the run from step 0, or restore the folder")
        return path

    def load_checkpoint(self, path: Path, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore model and optimizer in place from ``path``; return the trainer state (with ``step``).

        Raises:
            RunDirError: a file is missing or unreadable (corrupt), naming it.
        """
        from safetensors.torch import load_model

        files = {n: path / n for n in ("model.safetensors", "optimizer.pt", "state.pt")}
        for n, f in files.items():
            if not f.is_file():
                raise RunDirError(f"checkpoint {path} is incomplete: {n} is missing; delete {path} and "
                                  f"{self.checkpoints / 'latest'} to restart from the previous checkpoint")
        try:
            load_model(model, str(files["model.safetensors"]), strict=True)
            optimizer.load_state_dict(torch.load(files["optimizer.pt"], weights_only=False))
            state = torch.load(files["state.pt"], weights_only=False)
        except Exception as e:  # noqa: BLE001 - any unreadable file means a corrupt checkpoint
            raise RunDirError(f"checkpoint {path} is corrupt ({type(e).__name__}: {e}); delete it and "
                              f"{self.checkpoints / 'latest'} to resume from an earlier checkpoint") from None
        return state
