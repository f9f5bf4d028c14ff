"""`grpo-lens calibrate --planted FILE.npz`: your own Gram matrices through the same path."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpo_lens.analysis.group import (
    analyse_group,
)
from grpo_lens.calibrate.families import _advantages, _shares, probe_of
from grpo_lens.calibrate.run import write_outputs
from grpo_lens.claims.base import CLAIMS


# ---------------------------------------------------------------------------------------------------------------------
# bring your own planted cases
# ---------------------------------------------------------------------------------------------------------------------
class PlantedFileError(ValueError):
    """A ``--planted`` file whose arrays are missing or malformed (one line, naming the array and the shape)."""


#: The most bytes a ``--planted`` file's arrays may hold, as their headers declare and as the zip stores them
#: (a calibration file of 200 trials x 64 groups of R = 8 holds 6.6 MB).
MAX_PLANTED_BYTES = 1 << 30


def check_npz_sizes(path: Path, limit: int = MAX_PLANTED_BYTES) -> None:
    """Refuse a ``.npz`` whose arrays would not fit in ``limit`` bytes before any is read: each member's uncompressed
    size in the zip directory and each array's shape x itemsize from its .npy header (only the header is
    decompressed), so a 2 MB zip bomb or a header claiming 10^12 entries costs nothing.

    Raises:
        PlantedFileError: not a zip archive (a bare .npy, any other file), an unreadable member or header, or over
            ``limit`` (naming the array and its size).
    """
    import zipfile

    import numpy as np

    fmt = np.lib.format
    if not Path(path).is_file():
        raise PlantedFileError(f"{path}: no such file; pass the .npz that numpy.savez wrote")
    if not zipfile.is_zipfile(path):
        raise PlantedFileError(
            f"{path}: not a .npz archive (a zip of .npy arrays, as numpy.savez writes); a bare .npy holds one array, "
            f"and --planted needs gram and rewards: np.savez(FILE, gram=..., rewards=...)"
        )
    total = 0
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                name = info.filename.removesuffix(".npy")
                if info.file_size > limit:
                    raise PlantedFileError(
                        f"{path}: array '{name}' unpacks to {info.file_size:,} bytes, more than the {limit:,} a "
                        f"planted file may hold"
                    )
                with archive.open(info) as f:
                    version = fmt.read_magic(f)
                    if version not in ((1, 0), (2, 0)):
                        raise ValueError(f".npy format version {version} (numpy.savez writes 1.0 or 2.0)")
                    read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
                    shape, _, dtype = read(f)
                declared = math.prod(shape) * dtype.itemsize
                total += declared
                if declared > limit or total > limit:
                    raise PlantedFileError(
                        f"{path}: array '{name}' declares shape {list(shape)} of {dtype} ({declared:,} bytes), more "
                        f"than the {limit:,} a planted file may hold"
                    )
    except PlantedFileError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        why = " ".join(str(e).split())[:160]
        raise PlantedFileError(f"{path}: not a readable .npz file ({type(e).__name__}: {why})") from None


def read_planted(path: Path) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(gram [trials, n, R, R] float64, rewards [trials, n, R], dim or None) from a ``.npz`` file, checked.

    Raises:
        PlantedFileError: a missing or unreadable file, a missing array, or a shape or value that is not the one
            expected (the message names the array and the expected shape).
    """
    import numpy as np  # optional at import time: only this command reads .npz files

    check_npz_sizes(path)
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise PlantedFileError(f"{path}: not a readable .npz file ({e})") from None
    for name in ("gram", "rewards"):
        if name not in data.files:
            raise PlantedFileError(
                f"{path}: array '{name}' is missing; expected gram [trials, n, R, R] float64 and "
                f"rewards [trials, n, R] (optional dim)"
            )
    gram, rewards = data["gram"], data["rewards"]
    if gram.ndim != 4 or gram.shape[2] != gram.shape[3] or gram.shape[2] < 2:
        raise PlantedFileError(
            f"{path}: array 'gram' has shape {list(gram.shape)}; expected [trials, n, R, R] float64 with R >= 2"
        )
    if gram.dtype != np.float64:
        raise PlantedFileError(f"{path}: array 'gram' has dtype {gram.dtype}; expected [trials, n, R, R] float64")
    t, n, R, _ = gram.shape
    if tuple(rewards.shape) != (t, n, R):
        raise PlantedFileError(
            f"{path}: array 'rewards' has shape {list(rewards.shape)}; expected [trials, n, R] = "
            f"[{t}, {n}, {R}] (as gram)"
        )
    if not (np.isfinite(gram).all() and np.isfinite(rewards).all()):
        raise PlantedFileError(f"{path}: arrays 'gram' and 'rewards' must be finite")
    if not np.allclose(gram, gram.transpose(0, 1, 3, 2), rtol=1e-8, atol=1e-12):
        raise PlantedFileError(
            f"{path}: array 'gram' is not symmetric in its last two axes; expected "
            f"[trials, n, R, R] Gram matrices <g_i, g_j>"
        )
    dim = None
    if "dim" in data.files:
        d = data["dim"]
        if d.ndim != 0 or not float(d).is_integer() or int(d) < R:
            raise PlantedFileError(f"{path}: array 'dim' is {d.tolist()!r}; expected a scalar integer P >= R = {R}")
        dim = int(d)
    return torch.from_numpy(gram), torch.from_numpy(rewards).double(), dim


def run_planted(path: Path, out: Path, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """``grpo-lens calibrate --planted FILE.npz --out DIR``: each trial's groups through ``analyse_group`` (GRPO
    advantages, ``null_dim`` = dim) and the per-group claims (rank, its mechanism), as the probe does; writes
    DIR/planted.json, [{"claim", "R", "holds", "does_not_hold", "inconclusive", "trials", "groups"}]. The file is
    checked before anything is written (:func:`read_planted`)."""
    gram, rewards, dim = read_planted(path)
    t, n, R, _ = gram.shape
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    verdicts: dict[str, list[str]] = {"rank_two_top2_share": [], "zero_sum_rank_two": []}
    try:
        for i in range(t):
            rows = [
                analyse_group(gram[i, j], rewards[i, j], _advantages(rewards[i, j]), null_dim=dim, seed=j)
                for j in range(n)
            ]
            p = probe_of({R: rows}, dim)
            for name in verdicts:
                claims = CLAIMS.get(name)(p)
                verdicts[name].append(claims[0].verdict if claims else "inconclusive")
    finally:
        torch.set_num_threads(threads)
    res = [
        {"claim": name, "R": R, **_shares(vs), "inconclusive": 1 - sum(_shares(vs).values()), "trials": t, "groups": n}
        for name, vs in verdicts.items()
    ]
    write_outputs(out, {"planted.json": json.dumps(res, indent=1)})
    log(f"planted: {t} trials of {n} groups at R = {R} (P = {dim or 'orthogonal null'}) -> {out / 'planted.json'}")
    return res
