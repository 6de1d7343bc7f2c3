"""What a benchmark figure was measured on: one record for every script and ``ampkit bench``.

A figure means little without the machine: a CPU without native bf16 runs a bf16
matmul 65-115x slower than fp32, one with ``avx512_bf16``/``amx_bf16`` about 5x
faster. :func:`machine_info` names the CPU (or GPU), the instruction-set flags that
decide bf16/fp16 speed, the ATen kernel level torch dispatches to, torch and Python
versions, the date and the command line, so that a table generated from a script's
JSON can say where it comes from. :func:`write_record` writes a script's ``--json``
file: that record first, then the script's figures.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ampkit._internal.files import write_text

from .allocator import allocator_info

__all__ = ["SPEED_FLAGS", "cpu_flags", "device_name", "machine_info", "write_record"]

# The /proc/cpuinfo flags that decide how fast 16-bit math runs on an x86-64 CPU.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> list[str]:
    """The flags of :data:`SPEED_FLAGS` this CPU reports (Linux ``/proc/cpuinfo``);
    an empty list where the file is not there (macOS, Windows, an ARM CPU)."""
    reported = set((_cpuinfo_field("flags") or "").split())
    return [f for f in SPEED_FLAGS if f in reported]


def device_name(device: str) -> str:
    """``"cuda"``: the GPU's name; otherwise the CPU's model name."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def machine_info(device: str = "cpu", threads: int | None = None) -> dict[str, Any]:
    """The record a benchmark's JSON starts with (plain JSON types only):
    ``device``, ``device_name``, ``cpu_flags``, ``cpu_capability`` (the ATen kernel
    level, e.g. ``"AVX512"``), ``threads`` (torch's intra-op threads unless given),
    ``malloc`` (:func:`~ampkit.tools.bench.allocator.allocator_info`: whether freed
    memory stays in the process), ``torch``, ``python``, ``platform``, ``date_utc`` (ISO 8601, seconds),
    ``load_avg`` (the system's 1, 5 and 15-minute load averages as the record is written,
    None where the platform has none: a figure timed on a shared machine says so),
    ``cpu_count`` (logical CPUs) and
    ``command`` (this process's command line)."""
    return {
        "device": device,
        "device_name": device_name(device),
        "cpu_name": device_name("cpu"),
        "cpu_flags": cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads() if threads is None else threads,
        "malloc": allocator_info(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_avg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "cpu_count": os.cpu_count(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "",
    }


def _plain(value: Any) -> Any:
    """``value`` with every non-finite float made ``None`` (JSON has no NaN or inf)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_record(
    path: str | Path, figures: Mapping[str, Any], device: str = "cpu", threads: int | None = None
) -> dict[str, Any]:
    """Write a benchmark's ``--json`` file and return what was written: ``{"machine":
    machine_info(device, threads), **figures}`` (the machine record holds the date and
    the command line), indented JSON. ``figures`` holds plain JSON types; a NaN or
    infinite float (a ratio to a zero time) is written as ``null``. ``device``
    defaults to ``"cpu"``; ``threads`` to torch's intra-op threads. The file is replaced
    whole; :class:`ampkit.OutputPathError` where ``path`` is a folder, a symlink, a FIFO
    or a device, or its folder is missing or read-only."""
    record = {"machine": machine_info(device, threads), **_plain(figures)}
    write_text(path, json.dumps(record, indent=1) + "\n", "the benchmark record")
    return record
