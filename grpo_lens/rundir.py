"""The self-describing run directory: resolved config, metrics as JSONL, atomic checkpoints.

Layout (keys: docs/metrics.md)::

    RUN/config.yaml            the resolved TrainConfig
    RUN/metrics.jsonl          one JSON object per step, keys grouped by slash
    RUN/completions.jsonl      a few sampled completions per step
    RUN/checkpoints/step-000010/{model.safetensors, optimizer.pt, state.pt}
    RUN/checkpoints/latest     the name of the newest complete checkpoint
    RUN/.grpo-lens.lock        while a process writes the run: its pid and host (fcntl.flock; deleted at the end)

Crash safety: a checkpoint is written to a temporary folder, fsynced, then renamed into place, and ``latest`` is
replaced atomically after it; a kill at any moment leaves the previous checkpoint intact. Metrics are appended per
step; on resume, lines after the checkpoint's step are dropped, so each step appears once.

Checkpoints hold only tensors and plain values and are read with ``torch.load(weights_only=True)``, so a crafted
optimizer.pt or state.pt cannot run code on ``--resume`` (:func:`load_pickled_state`). One process writes a run
directory at a time (:func:`acquire_run_lock`). benchmarks/faults.py injects kills, torn writes, a full disk and a
second writer, and checks that each resumed run equals the uninterrupted one.

Tests prove this by killing the trainer at named moments: :func:`crash_point` sends SIGKILL to the process when the
environment variable ``GRPO_LENS_TEST_KILL_AT`` names the point (see tests/train/test_crash_resume.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import functools
import json
import logging
import math
import os
import pickle
import re
import secrets
import shutil
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, load_model, save_file, save_model

from grpo_lens import metrics as mk
from grpo_lens.config.base import safe_load_yaml, yaml_error_line
from grpo_lens.plugins import config_header


class RunDirError(ValueError):
    """The output directory cannot be used as asked (holds another run, has no checkpoint to resume, ...)."""


#: Environment variable naming a crash point, ``POINT`` or ``POINT@STEP`` (test hook, see :func:`crash_point`).
KILL_ENV = "GRPO_LENS_TEST_KILL_AT"


#: The moments a test can kill the trainer at, in the order a step reaches them.
CRASH_POINTS = (
    "during_generation",
    "before_optimizer_step",
    "after_metrics_write",
    "mid_checkpoint",
    "after_checkpoint_rename",
    "after_latest",
    "mid_final_model",
)


_CHECKPOINT_NAME = re.compile(r"step-(\d{6,})")


def crash_point(point: str, step: int, module: torch.nn.Module | None = None) -> None:
    """Test hook: SIGKILL this process at ``point`` of ``step`` when ``$GRPO_LENS_TEST_KILL_AT`` asks for it.

    The variable holds ``POINT`` (the first time the point is reached) or ``POINT@STEP``; POINT is one of
    :data:`CRASH_POINTS`. With ``module`` the kill happens inside that module's second forward call from now (e.g.
    in the middle of ``generate``) rather than at once. Unset, this costs one environment lookup.

    Raises:
        ValueError: the variable names an unknown point or a step that is not an integer.
    """
    want = os.environ.get(KILL_ENV)
    if not want:
        return
    name, _, at = want.partition("@")
    if name not in CRASH_POINTS or (at and not at.isdigit()):
        raise ValueError(
            f"{KILL_ENV}={want!r}: expected POINT or POINT@STEP with POINT one of {', '.join(CRASH_POINTS)}"
        )
    if name != point or (at and int(at) != step):
        return
    if module is None:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    calls = []

    def kill_on_second_call(*_):
        calls.append(1)
        if len(calls) >= 2:
            os.kill(os.getpid(), signal.SIGKILL)

    module.register_forward_hook(kill_on_second_call)


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


def read_saved_config(
    path: Path, remedy: str, error: type[Exception] = RunDirError, empty_ok: bool = True
) -> dict[str, Any]:
    """The settings mapping of a saved config.yaml, read for ``--resume`` (a run's or a partial probe's).

    Args:
        path: the config.yaml.   remedy: what the user can do, ending each error message.
        error: the exception class raised.   empty_ok: an empty file reads as {} (else it is "not a mapping").

    Raises:
        ``error``: the file is unreadable, not YAML, or does not hold a mapping.
    """
    try:
        values = safe_load_yaml(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        why = f"{type(e).__name__}: {yaml_error_line(e)}" if isinstance(e, yaml.YAMLError) else type(e).__name__
        raise error(f"--resume: cannot read {path} ({why}); {remedy}") from None
    if values is None and empty_ok:
        values = {}
    if not isinstance(values, dict):
        raise error(f"--resume: {path} does not hold a config mapping; {remedy}")
    return values


class UnsafeWriteError(RunDirError):
    """A write would leave the folder it belongs to through a symbolic link, or the folder cannot be written."""


#: The folder every :func:`write_file` of the current context must stay inside (:func:`writes_confined_to`).
_WRITE_ROOT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("grpo_lens_write_root", default=None)


@contextlib.contextmanager
def writes_confined_to(root: str | Path):
    """Within the block, :func:`write_file` refuses any file whose folder resolves outside ``root`` (a planted
    ``plots -> /etc`` link): ``report`` confines its writes to the run directory, ``compare`` to its --out."""
    token = _WRITE_ROOT.set(Path(root).resolve())
    try:
        yield
    finally:
        _WRITE_ROOT.reset(token)


def write_file(path: str | Path, data: bytes | str, root: str | Path | None = None) -> Path:
    """Write ``data`` to ``path`` the one safe way: into a new temporary file beside it (``O_EXCL | O_NOFOLLOW``: a
    link planted at that name is never opened), fsynced, then renamed over ``path`` (``os.replace`` replaces a
    symbolic link at ``path`` itself, never the file it points to). Every report, plot, compare and probe file is
    written through here, so no file outside the folder written changes.

    Args:
        path: the file.   data: its bytes (text is written as UTF-8).
        root: the folder ``path`` must stay inside once links are resolved; default the one of the enclosing
            :func:`writes_confined_to` (none: only the link at ``path`` itself is guarded).

    Raises:
        UnsafeWriteError: ``path``'s folder resolves outside ``root`` (a symbolic link on the way), ``path`` is a
            folder, or the folder is not writable by this user (one line naming it).
        OSError: the disk is full (ENOSPC), shown by the CLI as one line.
    """
    path = Path(path)
    base = Path(root).resolve() if root is not None else _WRITE_ROOT.get()
    if base is not None:
        parent = path.parent.resolve()
        if parent != base and base not in parent.parents:
            raise UnsafeWriteError(
                f"{path}: its folder leads to {parent}, outside {base}, through a symbolic link; nothing is "
                f"written through a link that leaves the folder written: remove the link"
            )
    if path.is_dir() and not path.is_symlink():
        raise UnsafeWriteError(f"{path} is a folder, so the file cannot be written there; move the folder away")
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except (PermissionError, IsADirectoryError, NotADirectoryError, FileNotFoundError) as e:
        raise UnsafeWriteError(
            f"cannot write {path} ({e.strerror or type(e).__name__}); choose a folder this user can write, or "
            f"fix its permissions"
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and an atomic rename (:func:`write_file`: a symbolic link
    at ``path`` is replaced, never followed)."""
    write_file(path, text)
    _fsync_dir(Path(path).parent)


def write_config_yaml(path: Path, config_dict: dict[str, Any]) -> None:
    """Write a run's settings to ``path`` (its config.yaml) atomically: the plugins header, then ``config_dict`` as
    YAML in field order. ``resume`` and ``overwrite``, where present, say how one command treated --out, not what the
    run is: they are stored as False, so resuming with the same settings rewrites the same bytes."""
    stored: dict[str, Any] = {**config_dict, **{k: False for k in ("resume", "overwrite") if k in config_dict}}
    atomic_write_text(path, config_header() + yaml.safe_dump(stored, sort_keys=False))


def start_seeds_dir(out: Path, config_dict: dict[str, Any]) -> None:
    """Create a ``--seeds`` run's DIR and write the settings its seeds share to DIR/config.yaml
    (:func:`write_config_yaml`: resume and overwrite stored as False)."""
    out.mkdir(parents=True, exist_ok=True)
    write_config_yaml(out / "config.yaml", config_dict)


def disk_full(err: BaseException, where: Path) -> bool:
    """Whether ``err``, raised while writing under ``where``, means the disk (or quota) is full: an OSError with
    ENOSPC / EDQUOT, a message saying so (safetensors' "os error 28"), or a RuntimeError of torch.save's zip writer
    ("file write failed", which carries no errno) when less than 1 MiB is left for this user."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    if "No space left" in text or "os error 28" in text or "Disk quota" in text or "os error 122" in text:
        return True
    try:
        st = os.statvfs(where if where.exists() else where.parent)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def _step_of(path: Path) -> int | None:
    """The step of a checkpoint folder ``step-NNNNNN``, or None for any other name."""
    m = _CHECKPOINT_NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, torch.Tensor):
        return _json_safe(value.item()) if value.numel() == 1 else value.tolist()
    return value


#: The globals a checkpoint may hold besides tensors and plain containers: NumPy's array reconstruction, for the
#: NumPy random state that checkpoints written before state.pt stored it as a tensor hold. Nothing else is allowed.
_NUMPY_CORE = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
_CHECKPOINT_SAFE_GLOBALS = [_NUMPY_CORE.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


class UnsafeCheckpointError(RunDirError):
    """A checkpoint file holds something other than tensors and plain values (``torch.load(weights_only=True)``
    refuses it): it could run code when loaded, so it is not loaded."""


def load_pickled_state(path: Path, hint: str) -> Any:
    """The object in a checkpoint's ``optimizer.pt`` or ``state.pt``, loaded with ``torch.load(weights_only=True)``:
    tensors, numbers, strings, lists, tuples and dicts only (plus NumPy arrays, :data:`_CHECKPOINT_SAFE_GLOBALS`), so
    a crafted file (a pickle whose ``__reduce__`` calls a function) is refused before anything in it runs.

    Args:
        path: the file.   hint: what to do next, appended to the message (e.g. how to resume without it).

    Raises:
        UnsafeCheckpointError: the file holds another object (one line naming the file and the refused global).
        RunDirError: the file is unreadable or not a torch file (corrupt).
    """
    try:
        with torch.serialization.safe_globals(_CHECKPOINT_SAFE_GLOBALS):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = f"the global {found.group(1)}" if found else "an object that is not tensors or plain values"
        raise UnsafeCheckpointError(
            f"checkpoint file {path} holds {what}, which loading would call; it is refused (weights_only=True): "
            f"a checkpoint holds only tensors and plain values, so this one was not written by grpo-lens or was "
            f"altered; do not resume from it{'; ' + hint if hint else ''}"
        ) from None
    except Exception as e:  # noqa: BLE001 - any unreadable file means a corrupt checkpoint
        why = str(e).splitlines()[0][:200] if str(e) else ""
        raise RunDirError(
            f"checkpoint {path.parent} is corrupt ({path.name}: {type(e).__name__}: {why}){'; ' + hint if hint else ''}"
        ) from None


# ---------------------------------------------------------------------------------------------------------------------
# One writer per run directory
# ---------------------------------------------------------------------------------------------------------------------
#: The lock file in a run directory: ``fcntl.flock``-ed by the one process writing it, and holding its pid and host.
LOCK_NAME = ".grpo-lens.lock"


class RunDirLockedError(RunDirError):
    """Another live process holds the run directory's lock (it is writing there)."""


_HELD: dict[Path, list] = {}  # resolved directory -> [open lock file, depth] of the locks this process holds


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_holder(text: str) -> str:
    """``pid 123 on host h (grpo-lens train since ...)`` from a lock file's contents."""
    try:
        info = json.loads(text)
        return (
            f"pid {info['pid']} on host {info['host']} (grpo-lens {info.get('command', '?')} since "
            f"{info.get('since', '?')})"
        )
    except (ValueError, KeyError, TypeError):
        return "another process (its lock file names no pid)"


def acquire_run_lock(path: str | Path, command: str) -> Callable[[], None]:
    """Take the one-writer lock of run directory ``path`` for ``command`` (train, probe, demo); returns the release.

    ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``path/.grpo-lens.lock``, which then holds this process's pid, host, command
    and start time; the kernel drops the lock when the process ends however it ends. The release deletes the file
    (while still holding the lock; a process that locked the deleted file sees that it is no longer the one at the
    path and tries again), so a finished run, or a start refused before writing, leaves no lock file. A lock file left
    by a process that died without releasing (kill -9) is taken over with a warning naming it. A directory that does
    not exist yet is created to hold the lock, and the release removes it again when it holds nothing else. Taking the
    same lock twice in one process nests (the release of the outer one frees it).

    Raises:
        RunDirLockedError: a live process holds the lock, naming it (pid, host, command, since when) and what to do.
    """
    path = Path(path)
    key = path.resolve()
    if key in _HELD:
        _HELD[key][1] += 1
        return functools.partial(_release_run_lock, key, False)
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    lock_path = path / LOCK_NAME
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunDirLockedError(
                f"{path} is being written by {_lock_holder(text)}: one process writes a run "
                f"directory at a time, so --overwrite, --resume or a new run there is refused; "
                f"wait for it to finish or stop it, or choose another --out"
            ) from None
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder released and deleted the file between our open and flock: again
    previous = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    if previous:
        try:
            pid = int(json.loads(previous)["pid"])
        except (ValueError, KeyError, TypeError):
            pid = -1
        state = "is no longer running" if pid <= 0 or not _pid_alive(pid) else "no longer holds it"
        logging.getLogger(__name__).warning(
            "%s: taking over the stale lock of %s, which %s (ended without releasing it, e.g. killed)",
            path,
            _lock_holder(previous),
            state,
        )
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command,
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode() + b"\n", 0)
    _HELD[key] = [fd, 1]
    return functools.partial(_release_run_lock, key, created)


def _release_run_lock(key: Path, created: bool) -> None:
    """Release one level of :func:`acquire_run_lock`; the outermost deletes the lock file and frees the lock."""
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD[key]
    fd = held[0]
    try:
        os.unlink(key / LOCK_NAME)  # still locked: no one else holds this file meanwhile
    except OSError:
        pass
    if created:
        try:
            key.rmdir()  # a failed start leaves --out as it was: absent (only when it holds nothing)
        except OSError:
            pass
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def holds_run_dir(command: str, out_of: Callable[..., Any] = lambda config, *a, **k: config.out):
    """Decorator: the function holds the run directory ``out_of(*args, **kwargs)`` (default ``config.out``) for its
    whole call (:func:`acquire_run_lock`); nothing is locked when that is empty, or on processes other than the main
    one of a torchrun / accelerate launch (``RANK`` > 0: the main process alone writes)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def locked(*args, **kwargs):
            out = out_of(*args, **kwargs)
            if not out or os.environ.get("RANK", "0") != "0":
                return fn(*args, **kwargs)
            try:
                release = acquire_run_lock(out, command)
            except RunDirLockedError:
                raise
            except OSError:  # --out is a file, under a file, or not writable: the function's own checks say so
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                release()

        return locked

    return wrap


def run_dir_entries(path: Path) -> list[Path]:
    """What a directory holds besides its lock file (:data:`LOCK_NAME`)."""
    return [p for p in Path(path).iterdir() if p.name != LOCK_NAME]


def clear_run_dir(path: Path) -> None:
    """Delete everything in ``path`` but its lock file, which the process replacing the run holds."""
    for p in run_dir_entries(path):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


class RunDir:
    """A run directory on disk.

    Args:
        path: the directory.

    Raises:
        RunDirError: from :meth:`prepare` and :meth:`load_checkpoint`, with what is wrong and how to fix it.
    """

    def __init__(self, path: str | Path):
        # absolute now: a reward function that calls os.chdir (a code sandbox) must not move the run's later writes
        self.path = Path(path).absolute()
        self.config_path = self.path / "config.yaml"
        self.metrics_path = self.path / "metrics.jsonl"
        self.completions_path = self.path / "completions.jsonl"
        self.checkpoints = self.path / "checkpoints"

    # ---------------------------------------------------------------------------------------------------------------
    def resolve(
        self,
        config_dict: dict[str, Any],
        *,
        resume: bool,
        overwrite: bool,
        resumable_keys: tuple[str, ...] = (),
        canonical: Callable[[dict[str, Any], str], dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Check that the directory can be used as asked and return the config to run with; writes nothing.

        A new run needs a missing or empty directory, or one holding a grpo-lens run (config.yaml) and ``overwrite``.
        A resumed run takes the saved config; values given now must equal the saved ones except ``resumable_keys``
        (e.g. max_steps, to train longer). ``canonical(saved, where)`` renames the saved config's deprecated keys to
        the current ones before the comparison (``TrainConfig.canonical``; it warns once per deprecated key).

        Raises:
            RunDirError: --resume without a run, a resumed value that differs, a directory holding another run
                without --overwrite or --resume, or holding files that are not a run (never deleted).
        """
        has_run = self.config_path.is_file()
        if resume:
            if not has_run:
                raise RunDirError(
                    f"--resume: {self.path} holds no run (no config.yaml); start a new run with "
                    f"--out {self.path} and without --resume"
                )
            saved = read_saved_config(self.config_path, "restore it or start a new run in another --out")
            if canonical is not None:
                saved = canonical(saved, f"in {self.config_path}")
            for key, value in config_dict.items():
                if key in resumable_keys or key in ("resume", "overwrite", "out"):
                    continue
                if key in saved and saved[key] != value:
                    raise RunDirError(
                        f"--resume: {key}={value!r} differs from the run's saved {key}={saved[key]!r} "
                        f"in {self.config_path}; drop the flag, or start a new run in another --out"
                    )
            self.check_writable()
            merged = {**saved, **{k: config_dict[k] for k in resumable_keys if k in config_dict}}
            merged.update(resume=True, overwrite=False, out=str(self.path))
            return merged
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"output path {self.path} is a file, not a directory; choose another --out")
        self.check_writable()
        if self.path.exists() and run_dir_entries(self.path):
            if not has_run:
                raise RunDirError(
                    f"output directory {self.path} already holds files that are not a grpo-lens run "
                    f"(no config.yaml); --overwrite only replaces a run, so choose another --out or "
                    f"empty it yourself"
                )
            if not overwrite and self.never_stepped():
                logging.getLogger(__name__).warning(
                    "%s holds a run that stopped before its first step ended (config.yaml and nothing else): "
                    "replacing it",
                    self.path,
                )
            elif not overwrite:
                raise RunDirError(
                    f"output directory {self.path} already holds a run; pass --resume to continue "
                    f"it, --overwrite to replace it, or choose another --out"
                )
        return config_dict

    def never_stepped(self) -> bool:
        """Whether the directory holds a run that stopped before its first step ended: config.yaml, and at most empty
        metrics / completions files and an empty checkpoints folder (a failed first step, e.g. out of memory, or a
        kill). Such a run has nothing to lose, so a new run replaces it without --overwrite."""
        allowed = {"config.yaml", "metrics.jsonl", "completions.jsonl", "checkpoints"}
        entries = run_dir_entries(self.path)
        if any(p.name not in allowed or p.is_symlink() for p in entries):
            return False
        for p in entries:
            if p.is_dir() and (p.name != "checkpoints" or any(p.iterdir())):
                return False
            if p.name.endswith(".jsonl") and (not p.is_file() or p.stat().st_size > 0):
                return False
        return True

    def check_writable(self) -> None:
        """The directory, or the nearest folder above it that exists, must be a writable directory.

        Raises:
            RunDirError: a file on the way (``--out a_file/run``) or a folder this user cannot write.
        """
        base = self.path
        while not base.exists() and base != base.parent:
            base = base.parent
        if not base.is_dir():
            raise RunDirError(
                f"--out {self.path}: {base} is a file, so no run directory can be made under it; choose another --out"
            )
        if not os.access(base, os.W_OK | os.X_OK):
            raise RunDirError(
                f"--out {self.path}: {base} is not writable by this user; choose another --out or "
                f"change its permissions"
            )

    def prepare(
        self, config_dict: dict[str, Any], *, resume: bool, overwrite: bool, resumable_keys: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """:meth:`resolve`, then make the directory ready: a replaced run is deleted, a new directory is created.

        Raises:
            RunDirError: as :meth:`resolve`, before anything is deleted.
        """
        resolved = self.resolve(config_dict, resume=resume, overwrite=overwrite, resumable_keys=resumable_keys)
        if not resume and self.config_path.is_file():  # resolve() allowed it: overwrite a run
            clear_run_dir(self.path)  # all but the lock file, which this process holds
        self.path.mkdir(parents=True, exist_ok=True)
        return resolved

    def write_config(self, config_dict: dict[str, Any]) -> None:
        """Write config.yaml atomically (:func:`write_config_yaml`)."""
        write_config_yaml(self.config_path, config_dict)

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
        """Keep only records with step <= last_step (and drop a torn last line) in every JSONL of the run.

        Raises:
            RunDirError: a line that is not a usable record (:func:`read_record_lines`), naming file and line.
        """
        for path in (self.metrics_path, self.completions_path):
            if not path.exists():
                continue
            kept = [line for line, rec in read_record_lines(path) if rec.get(mk.STEP, 0) <= last_step]
            atomic_write_text(path, "".join(k + "\n" for k in kept))

    def read_metrics(self) -> list[dict[str, Any]]:
        """All metric records, in order (:func:`read_records`; a torn last line is skipped).

        Raises:
            RunDirError: a line that is not a usable record, naming file and line.
        """
        return read_records(self.metrics_path)

    # ---------------------------------------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        keep: int = 2,
        model_state: dict[str, torch.Tensor] | None = None,
        optimizer_state: dict[str, Any] | None = None,
    ) -> Path:
        """Write model (safetensors), optimizer and trainer state for ``step`` atomically; keep the newest ``keep``.

        ``model_state`` / ``optimizer_state``: full state dicts to write instead of ``model``'s and ``optimizer``'s
        own (a sharded policy's, gathered by :func:`grpo_lens.runtime.sharding.full_model_state`; each tied matrix
        once).

        Order: files into ``.step-N.tmp-PID``, fsync, rename to ``step-N``, then ``latest`` (atomic), then clean-up.
        A kill before ``latest`` is replaced leaves the previous checkpoint in charge. Checkpoints of later steps than
        ``step`` are left-overs of a killed run that this resumed run has replaced: they are deleted, and the
        checkpoint just written is never among those removed.
        """
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        name = f"step-{step:06d}"
        final = self.checkpoints / name
        tmp = self.checkpoints / f".{name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        writing = tmp / "model.safetensors"
        try:
            if model_state is not None:
                save_file(model_state, str(writing))
            else:
                save_model(model, str(writing))
            crash_point("mid_checkpoint", step)
            writing = tmp / "optimizer.pt"
            torch.save(optimizer.state_dict() if optimizer_state is None else optimizer_state, writing)
            writing = tmp / "state.pt"
            torch.save({**state, "step": step}, writing)
            for f in tmp.iterdir():
                writing = f
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            _fsync_dir(tmp)
        except Exception as e:
            full = disk_full(e, tmp)
            shutil.rmtree(tmp, ignore_errors=True)  # the half-written checkpoint; the previous one stays in charge
            if full:
                raise OSError(errno.ENOSPC, "No space left on device", str(writing)) from None
            raise
        if final.exists():  # a left-over of a killed run (never the one ``latest`` names: that step is done)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.checkpoints)
        crash_point("after_checkpoint_rename", step)
        atomic_write_text(self.checkpoints / "latest", name + "\n")
        crash_point("after_latest", step)
        self.prune_checkpoints(step, keep)
        return final

    def prune_checkpoints(self, step: int, keep: int) -> None:
        """Delete what a run at ``step`` no longer needs: checkpoints of later steps (left by a killed run that this
        one has replaced), all but the newest ``keep`` up to ``step`` (the one of ``step`` itself always stays), and
        half-written temporary folders."""
        if not self.checkpoints.is_dir():
            return
        # only step-* folders with a step
        done = sorted(
            (p for p in self.checkpoints.glob("step-*") if p.is_dir() and _step_of(p) is not None),
            key=_step_of,  # type: ignore[arg-type]
        )
        # only step-* folders with a step
        older = [p for p in done if _step_of(p) < step]  # type: ignore[operator]
        stale = [p for p in done if _step_of(p) > step]  # type: ignore[operator]
        kept_older = max(0, keep - (1 if any(_step_of(p) == step for p in done) else 0))
        for old in older[: max(0, len(older) - kept_older)] + stale:
            shutil.rmtree(old, ignore_errors=True)
        for stray in self.checkpoints.glob(".step-*.tmp-*"):
            shutil.rmtree(stray, ignore_errors=True)

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint folder, or None if there is none (no ``latest`` pointer yet).

        Raises:
            RunDirError: ``latest`` is unreadable, names no checkpoint (``step-NNNNNN``) or a missing folder.
        """
        pointer = self.checkpoints / "latest"
        if not pointer.exists():
            return None
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise RunDirError(
                f"checkpoint pointer {pointer} is unreadable ({type(e).__name__}); write the name of "
                f"a checkpoint folder (e.g. step-000010) into it, or delete it to restart from step "
                f"0"
            ) from None
        if not _CHECKPOINT_NAME.fullmatch(name):
            raise RunDirError(
                f"checkpoint pointer {pointer} holds {name[:40]!r}, not a checkpoint name like "
                f"step-000010; write the newest folder name under {self.checkpoints} into it, or "
                f"delete it to restart from step 0"
            )
        path = self.checkpoints / name
        if not path.is_dir():
            raise RunDirError(
                f"checkpoint pointer {pointer} names {name}, which is missing; delete {pointer} to "
                f"restart the run from step 0, or restore the folder"
            )
        return path

    def load_checkpoint(
        self,
        path: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        load_states: Callable[[dict[str, torch.Tensor], dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Restore model and optimizer in place from ``path``; return the trainer state (with ``step``).

        ``load_states(model_state, optimizer_state)``: loads the files' full state dicts instead of
        ``load_state_dict`` (a sharded policy: :func:`grpo_lens.runtime.sharding.load_full_states`).

        Raises:
            RunDirError: a file is missing or unreadable (corrupt), naming it and how to go on.
        """
        files = {n: path / n for n in ("model.safetensors", "optimizer.pt", "state.pt")}
        for n, f in files.items():
            if not f.is_file():
                raise RunDirError(f"checkpoint {path} is incomplete: {n} is missing; {self._recovery_hint(path)}")
        optimizer_state = load_pickled_state(files["optimizer.pt"], self._recovery_hint(path))
        state = load_pickled_state(files["state.pt"], self._recovery_hint(path))
        try:
            if load_states is not None:
                load_states(load_file(str(files["model.safetensors"])), optimizer_state)
            else:
                load_model(model, str(files["model.safetensors"]), strict=True)
                optimizer.load_state_dict(optimizer_state)
            if not isinstance(state, dict) or "step" not in state:
                raise ValueError("state.pt holds no step")
        except Exception as e:  # noqa: BLE001 - any unreadable file means a corrupt checkpoint
            why = str(e).splitlines()[0][:200] if str(e) else ""
            raise RunDirError(
                f"checkpoint {path} is corrupt ({type(e).__name__}: {why}); {self._recovery_hint(path)}"
            ) from None
        return state

    def check_resumed_config(
        self,
        path: Path,
        config_dict: dict[str, Any],
        resumable_keys: tuple[str, ...],
        canonical: Callable[[dict[str, Any], str], dict[str, Any]] | None = None,
    ) -> None:
        """Refuse to resume from checkpoint ``path`` with settings other than the ones its steps ran with.

        Every checkpoint's state.pt holds the config its run ran with (``config``); config.yaml can be edited and
        flags can be given, so what resumes is compared with that, field by field. Only ``resumable_keys`` (and
        ``resume``, ``overwrite``, ``out``) may differ: they change no step already taken. A checkpoint written before
        configs were saved in it (no ``config``) is not checked.

        Raises:
            RunDirError: naming every differing field with both values, and what to do.
        """
        try:
            state = load_pickled_state(path / "state.pt", "")
        except RunDirError:  # load_checkpoint reports an unusable checkpoint with its recovery hint
            return
        ran = state.get("config") if isinstance(state, dict) else None
        if not isinstance(ran, dict):
            return
        if canonical is not None:
            ran = canonical(ran, f"in {path / 'state.pt'}")
        skip = set(resumable_keys) | {"resume", "overwrite", "out"}
        diffs = [
            f"{k} {ran[k]!r} -> {v!r}" for k, v in config_dict.items() if k not in skip and k in ran and ran[k] != v
        ]
        if diffs:
            raise RunDirError(
                f"--resume: {'; '.join(diffs)} differ from what the run's steps ran with (checkpoint "
                f"{path.name}), and a run's settings cannot change under it: restore the values in "
                f"{self.config_path} (or drop the flags), or start a new run in another --out; only "
                f"{', '.join(resumable_keys)} may change on resume"
            )

    def _recovery_hint(self, bad: Path) -> str:
        """How to resume without the unusable checkpoint ``bad``: from the newest older one, or from step 0."""
        pointer = self.checkpoints / "latest"
        step = _step_of(bad)
        older = sorted(
            (
                p
                for p in self.checkpoints.glob("step-*")
                # only step-* folders with a step
                if p.is_dir() and _step_of(p) is not None and step is not None and _step_of(p) < step  # type: ignore[operator]
            ),
            key=_step_of,  # type: ignore[arg-type]
        )
        if older:
            return (
                f"to resume from the previous checkpoint write {older[-1].name} into {pointer} (and delete "
                f"{bad}), or delete {pointer} to restart from step 0"
            )
        return f"delete {bad} and {pointer} to restart the run from step 0 (no older checkpoint is left)"


def loads_json(text: str | bytes, where: str, error: type[Exception] = RunDirError, **kwargs: Any) -> Any:
    """``json.loads(text, **kwargs)`` that turns a document nested too deep for Python (``[[[[...`` 100,000 levels:
    RecursionError) into one line naming ``where`` (a file, and a line of it). Other JSON errors pass through.

    Raises:
        ``error``: nested too deep.   json.JSONDecodeError: not valid JSON.
    """
    try:
        return json.loads(text, **kwargs)
    except RecursionError:
        raise error(
            f"{where}: JSON nested deeper than Python can read (thousands of levels); nothing grpo-lens writes or "
            f"reads is nested like that: fix or delete it"
        ) from None


def read_json_file(path: str | Path, error: type[Exception] = RunDirError, fix: str = "restore it or delete it") -> Any:
    """The JSON value in ``path`` (probe.json, a partial probe's record), read the one bounded way.

    Raises:
        ``error``: one line naming the file: unreadable, not UTF-8, not valid JSON (where), or nested too deep.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}); {fix}") from None
    except OSError as e:
        raise error(f"cannot read {path} ({e.strerror or type(e).__name__}); {fix}") from None
    try:
        return loads_json(text, str(path), error)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}; cut?); {fix}") from None


def read_record_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of every record line of a run-directory JSONL file (metrics.jsonl, completions.jsonl): the one
    reader of resume, report, compare and the trackers. Blank lines are skipped, and so is a last line that is not
    valid JSON (cut by a kill mid-write: every earlier line was fsynced whole).

    Raises:
        RunDirError: naming the file and line, and what to do: a line before the last that is not valid JSON, a line
            that is JSON but not an object (``5``), or a record whose ``step`` is not an integer >= 0
            (``{"step": null}``).
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise RunDirError(
            f"{path}: not UTF-8 text (byte {e.start}); restore the file from the run, or delete it "
            f"to resume from the last checkpoint without the metrics before it"
        ) from None
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    fix = "delete or repair that line (each line is one JSON object with an integer 'step')"
    out = []
    for i, (n, line) in enumerate(numbered):
        try:
            rec = loads_json(line, f"{path}, line {n}")
        except json.JSONDecodeError as e:
            if i == len(numbered) - 1:
                continue  # the last line, cut by a kill mid-write
            raise RunDirError(f"{path}, line {n}: not valid JSON ({e.msg} at column {e.colno}); {fix}") from None
        if not isinstance(rec, dict):
            raise RunDirError(
                f"{path}, line {n}: holds {line.strip()[:40]!r}, which is not a record (a JSON object); {fix}"
            )
        step = rec.get(mk.STEP, 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise RunDirError(f"{path}, line {n}: 'step' is {step!r}, not a step number (an integer >= 0); {fix}")
        out.append((line, rec))
    return out


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a run-directory JSONL file, in order (:func:`read_record_lines`); [] when it does not exist.

    Raises:
        RunDirError: a line that is not a usable record, naming file and line.
    """
    if not Path(path).exists():
        return []
    return [rec for _, rec in read_record_lines(Path(path))]


def lens_overhead(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """The lens's share of training wall time from metrics records: lens seconds / (step seconds - lens seconds).

    Lens seconds are ``perf/lens_seconds`` (before the update) plus ``perf/lens_sparsity_seconds`` (around the
    optimizer step), summed over the run.

    Returns:
        {"lens_seconds", "train_seconds" (the steps without the lens), "overhead" (a fraction), "lens_steps",
        "steps"}, or None without step timings.
    """
    steps = [r for r in records if r.get(mk.PERF_STEP_SECONDS) is not None]
    if not steps:
        return None
    lens = sum((r.get(mk.PERF_LENS_SECONDS) or 0.0) + (r.get(mk.PERF_LENS_SPARSITY_SECONDS) or 0.0) for r in steps)
    base = sum(r[mk.PERF_STEP_SECONDS] for r in steps) - lens
    return {
        "lens_seconds": lens,
        "train_seconds": base,
        "overhead": lens / base if base > 0 else float("nan"),
        "lens_steps": sum(r.get(mk.PERF_LENS_SECONDS) is not None for r in steps),
        "steps": len(steps),
    }


# ---------------------------------------------------------------------------------------------------------------------
# `train --seeds`: the pooled record that `grpo-lens report DIR` reads (grpo_lens/train/seeds.py writes it)
# ---------------------------------------------------------------------------------------------------------------------
#: the pooled record's file in DIR: {"seeds": [s, ...], "dirs": ["seed_<s>", ...], "steps": [last step per seed]}
TRAIN_SEEDS_FILE = "train_seeds.json"


def read_train_seeds(run_dir: str | Path) -> list[Path] | None:
    """The seeds' run directories of a pooled training directory (``train --seeds``), in the record's order; None
    when ``run_dir`` holds no readable DIR/train_seeds.json (then it is an ordinary run directory). Only names that
    stay inside ``run_dir`` are followed."""
    path = Path(run_dir) / TRAIN_SEEDS_FILE
    if not path.is_file():
        return None
    try:
        record = read_json_file(path)
    except (RunDirError, ValueError):
        return None
    dirs = record.get("dirs") if isinstance(record, dict) else None
    if not isinstance(dirs, list):
        return None
    return [Path(run_dir) / d for d in dirs if isinstance(d, str) and d and "/" not in d and d not in (".", "..")]
