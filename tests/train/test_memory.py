"""keep_freed_memory: glibc keeps a freed 64 MiB block for reuse, and leaves a user's own settings alone."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys

import pytest

#: a fresh interpreter: mallopt is process-wide, and the thresholds cannot be read back, only their effect
#: (glibc's mallinfo2: ``hblkhd`` counts bytes in separate mappings, ``fordblks`` free bytes kept in the heap)
SCRIPT = r"""
import ctypes, ctypes.util, sys, torch
from grpo_lens.runtime.memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    _fields_ = [(k, ctypes.c_size_t) for k in names]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
kept = keep_freed_memory()
mapped0 = libc.mallinfo2().hblkhd
x = torch.ones(64 * 2**20 // 4)  # 64 MiB
mapped = libc.mallinfo2().hblkhd - mapped0
del x
print(kept, keep_freed_memory(), mapped, libc.mallinfo2().fordblks)
"""

MIB64 = 64 * 2**20


def _glibc_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    return bool(name) and hasattr(ctypes.CDLL(name), "mallinfo2") and hasattr(ctypes.CDLL(name), "mallopt")


pytestmark = pytest.mark.skipif(not _glibc_mallinfo2(), reason="glibc's mallopt and mallinfo2 (glibc >= 2.33)")


def _run(**env) -> tuple[bool, bool, int, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    clean.pop("GRPO_LENS_KEEP_FREED_MEMORY", None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**clean, **env}, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", out[1] == "True", int(out[2]), int(out[3])


def test_a_freed_block_stays_in_the_heap_for_reuse():
    kept, again, mapped, free_after = _run()
    assert kept and again  # the second call returns the first answer
    # glibc's default maps a 64 MiB block on its own (above the 32 MiB maximum of the dynamic mmap threshold) and
    # unmaps it on free; kept, it comes from the heap (no new mapping) and its 64 MiB stay there, free, after del
    assert mapped < MIB64
    assert free_after >= MIB64


@pytest.mark.parametrize(
    "env", [{"GRPO_LENS_KEEP_FREED_MEMORY": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": ""}]
)
def test_glibc_defaults_when_opted_out_or_set_by_the_user(env):
    kept, again, mapped, free_after = _run(**env)
    assert not kept and not again
    if "MALLOC_TRIM_THRESHOLD_" not in env:  # glibc's own thresholds: the block was a mapping of its own
        assert mapped >= MIB64
