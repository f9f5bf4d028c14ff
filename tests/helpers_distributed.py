"""Launching a test worker under torchrun (gloo on CPU): shared by tests/train/test_distributed.py and
tests/train/test_fsdp.py."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent  # tests/, where the workers live


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous port of one torchrun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_available() -> bool:
    """torch.distributed with gloo and torchrun's module are available."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_gloo_available()
        and importlib.util.find_spec("torch.distributed.run") is not None
    )


def run_torchrun(worker: str, out: Path, world: int, timeout_s: float) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node world tests/<worker> out`` on one node, one thread per process; returns the
    finished process (the caller checks its return code)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(world),
        "--nnodes",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(HERE / worker),
        str(out),
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=HERE.parent)
