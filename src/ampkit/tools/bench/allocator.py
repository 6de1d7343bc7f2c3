"""Freed memory and page faults: what a benchmark process's C allocator does between steps.

On Linux, glibc's ``malloc`` hands large freed blocks back to the kernel (blocks over
its mmap threshold are unmapped; free space at the top of the heap beyond its trim
threshold is trimmed), and the next step's allocation of the same size faults every
page in again. Both thresholds adapt to what the process has freed so far, so whether
a training step pays this, and how much, depends on the order of earlier allocations:
two runs of the same code measured 0 and 5,000 minor page faults per step (about
10 ms of a 50 ms CNN step, 35% of a 38M-parameter MLP's fp32 step) on one CPU.

A benchmark that compares precisions in separate processes would then measure that
luck, not the precisions. :func:`hold_freed_memory` fixes both thresholds high, so
that freed blocks stay in the process for reuse (the process's resident memory no
longer shrinks after a peak); :func:`allocator_info` says which allocator a figure
was measured under, and :func:`minor_page_faults` counts the faults.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Any

__all__ = [
    "MMAP_THRESHOLD",
    "TRIM_THRESHOLD",
    "hold_freed_memory",
    "allocator_info",
    "minor_page_faults",
]

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Blocks up to this many bytes come from the heap, not from their own mapping (1 GiB).
MMAP_THRESHOLD = 1 << 30
#: The heap is trimmed only when this much is free at its top (the largest ``int``: never, in effect).
TRIM_THRESHOLD = 2**31 - 1

# Allocators that replace glibc's malloc when preloaded; mallopt does not reach them.
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")

_held = False


def _preloaded() -> str | None:
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        name = os.path.basename(entry)
        if any(kind in name for kind in _PRELOADED):
            return name
    return None


def _glibc() -> Any:
    """The process's C library when it is glibc and its malloc is the one in use, else None."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc" or _preloaded():
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def hold_freed_memory() -> bool:
    """Keep this process's freed memory in the process (glibc on Linux): set glibc's
    mmap threshold to :data:`MMAP_THRESHOLD` and its trim threshold to
    :data:`TRIM_THRESHOLD` with ``mallopt``, for the rest of the process's life.

    Returns True when both were set; False, changing nothing, where the allocator is
    not glibc's (macOS, Windows, musl, or jemalloc/tcmalloc/mimalloc in
    ``LD_PRELOAD``, which keep freed memory on their own). Memory freed before the
    call is not affected; call it first thing in a benchmark process. The cost: the
    resident size stays at the process's peak, as with a caching allocator.
    """
    global _held
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD)) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(TRIM_THRESHOLD)) == 1 and ok
    _held = _held or ok
    return ok


def allocator_info() -> dict[str, Any]:
    """Which C allocator this process uses and whether it keeps freed memory (plain
    JSON types): ``allocator`` (``"glibc 2.36"``, the preloaded library's file name,
    or ``"system"``) and ``freed_memory``: ``"held"`` after :func:`hold_freed_memory`,
    ``"allocator's own"`` for a preloaded allocator, ``"returned to the OS"`` for
    glibc's defaults, ``"unknown"`` elsewhere."""
    preloaded = _preloaded()
    if preloaded:
        return {"allocator": preloaded, "freed_memory": "allocator's own"}
    name, version = platform.libc_ver() if sys.platform == "linux" else ("", "")
    if name == "glibc":
        return {"allocator": f"glibc {version}", "freed_memory": "held" if _held else "returned to the OS"}
    return {"allocator": "system", "freed_memory": "unknown"}


def minor_page_faults() -> int | None:
    """Minor page faults this process has taken so far (``getrusage``); None where
    the ``resource`` module is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
