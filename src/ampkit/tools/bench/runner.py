"""Drives ``ampkit bench``: one worker process per precision, trained in
interleaved blocks, results gathered into one dict (written as results.json).

Interleaving: for each workload every worker runs ``block`` steps in turn (the
starting worker rotates each round) while the others wait idle on their pipe, so
only one precision computes at any time and slow spells of a shared machine fall
on all precisions alike. Step time is the median over blocks of (block wall time /
steps), leaving out each precision's first block (warm-up: kernel selection,
allocator growth). The CPU memory figure comes from one more step after the
last block, out of the timing (:mod:`ampkit.tools.bench.memory`).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import multiprocessing as mp
import os
import platform
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ampkit._internal.dtypes import default_device_type

from .machine import cpu_flags, device_name
from .recipes import PRECISIONS
from .worker import RunSpec, worker_main
from .workloads import SIZES, WORKLOADS, default_steps

__all__ = ["BenchConfig", "BenchError", "run_bench", "resolve_device", "MEMORY_NOTES"]

MEMORY_NOTES = {
    "cpu": (
        "peak MiB (CPU, exact) = the peak of tensor bytes during one training step run "
        "after the others: every tensor alive as it starts (weights, optimizer state, "
        "master/compensation copies, scaler; dataset excluded), in distinct storages, "
        "plus the peak of what the step allocates on top (torch.profiler's record of "
        "every allocation and free)"
    ),
    "cuda": "peak MiB = torch.cuda.max_memory_allocated during training, minus the dataset",
}


class BenchError(Exception):
    """A problem with the bench's input or environment, shown as one line (exit 2)."""


@dataclasses.dataclass
class BenchConfig:
    """Settings of one ``ampkit bench`` run (the CLI's options).

    ``hold_freed_memory`` (default True): each worker calls
    :func:`ampkit.tools.bench.allocator.hold_freed_memory` as it starts, so that no
    precision's step time includes page faults for memory glibc handed back to the
    OS after an earlier step (``--system-malloc`` turns it off)."""

    workloads: tuple[str, ...] = tuple(WORKLOADS)
    precisions: tuple[str, ...] = PRECISIONS
    device: str = "cpu"
    dtype: str = "bf16"
    size: str = "full"
    steps: int | None = None
    seed: int = 0
    threads: int = 1
    block: int | None = None
    hold_freed_memory: bool = True

    def __post_init__(self) -> None:
        # one worker per precision: a name given twice would drive it twice per round
        self.workloads = tuple(dict.fromkeys(self.workloads))
        self.precisions = tuple(dict.fromkeys(self.precisions))
        for w in self.workloads:
            if w not in WORKLOADS:
                raise BenchError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
        for p in self.precisions:
            if p not in PRECISIONS:
                raise BenchError(f"unknown precision {p!r}; choose from {', '.join(PRECISIONS)}")
        if not self.precisions:
            raise BenchError("no precision selected; pass e.g. --precisions fp32,ampkit-O2")
        if self.size not in SIZES:
            raise BenchError(f"unknown size {self.size!r}; choose from {', '.join(SIZES)}")
        if self.dtype not in ("bf16", "fp16"):
            raise BenchError(f"unknown dtype {self.dtype!r}; choose bf16 or fp16")
        if self.steps is not None and self.steps < 1:
            raise BenchError(f"--steps must be a positive number of steps, got {self.steps}")
        if self.threads < 1:
            raise BenchError(f"--threads must be at least 1, got {self.threads}")
        if self.block is not None and self.block < 1:
            raise BenchError(f"the interleaving block must be at least 1 step, got {self.block}")

    def steps_for(self, workload: str) -> int:
        """Training steps of ``workload`` in this run."""
        return self.steps if self.steps is not None else default_steps(workload, self.size)

    def block_for(self, steps: int) -> int:
        """Steps per interleaved block: about 20 blocks per precision, 1 to 10 steps each."""
        return self.block if self.block is not None else max(1, min(10, steps // 20))


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; check an explicit choice."""
    if device == "auto":
        return default_device_type()
    if device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise BenchError(
            f"--device cuda was requested but no CUDA GPU is available (torch {torch.__version__}, "
            f"{build}); use --device cpu or --device auto"
        )
    if device not in ("cpu", "cuda"):
        raise BenchError(f"unknown device {device!r}; choose auto, cpu or cuda")
    return device


# ---------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------
class _Worker:
    """Parent-side handle of one precision's worker process."""

    def __init__(self, ctx: Any, precision: str, threads: int, hold_memory: bool) -> None:
        self.precision = precision
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=worker_main,
            args=(child, threads, hold_memory),
            name=f"ampkit-bench-{precision}",
            daemon=True,
        )
        # The worker's memory step runs torch.profiler, whose kineto logs each start
        # and stop on stderr: quiet in the child (a spawned child takes the parent's
        # environment as it starts; the parent's own is put back).
        old = os.environ.get("KINETO_LOG_LEVEL")
        os.environ["KINETO_LOG_LEVEL"] = old if old is not None else "5"
        try:
            self.proc.start()
        finally:
            if old is None:
                del os.environ["KINETO_LOG_LEVEL"]
        child.close()
        self.alive = True

    def send(self, *msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            self.alive = False

    def recv(self) -> tuple[Any, ...]:
        if not self.alive:
            return ("error", "worker process is gone", "")
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.alive = False
            code = self.proc.exitcode if not self.proc.is_alive() else None
            return ("error", f"worker process died (exit code {code})", "")

    def close(self) -> None:
        if self.alive:
            self.send("close")
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
        self.conn.close()


@contextmanager
def _workers(precisions: tuple[str, ...], threads: int, hold_memory: bool) -> Iterator[dict[str, _Worker]]:
    ctx = mp.get_context("spawn")
    pool: dict[str, _Worker] = {}
    try:
        for p in precisions:
            pool[p] = _Worker(ctx, p, threads, hold_memory)
        yield pool
    finally:
        for w in pool.values():
            w.close()


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------
ProgressFn = Callable[[str, int, int], None]
"""``progress(workload, steps_done_total, steps_total)`` after every block."""


def _chunks(total: int, block: int) -> list[int]:
    return [min(block, total - start) for start in range(0, total, block)]


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def summarize_precision(blocks: list[dict[str, Any]], result: dict[str, Any]) -> dict[str, Any]:
    """Figures of one precision on one workload from its blocks and final result."""
    losses = [v for b in blocks for v in b["losses"]]
    scales = [s for b in blocks for s in b["scales"]]
    skipped = sum(bool(s) for b in blocks for s in b["skipped"])
    block_ms = [1000.0 * b["seconds"] / b["steps"] for b in blocks if b["steps"]]
    timed = block_ms[1:] if len(block_ms) > 1 else block_ms
    tail = losses[-max(1, len(losses) // 10) :]
    final_loss = statistics.fmean(tail) if tail and all(math.isfinite(v) for v in tail) else None
    known_scales = [s for s in scales if s is not None]
    faults = [b["page_faults"] / b["steps"] for b in blocks if b["steps"] and b.get("page_faults") is not None]
    timed_faults = faults[1:] if len(faults) > 1 else faults
    return {
        "status": "ok",
        "steps": len(losses),
        "step_ms": statistics.median(timed) if timed else None,
        "step_ms_mean": statistics.fmean(timed) if timed else None,
        "step_ms_min": min(timed) if timed else None,
        "block_ms": block_ms,
        "page_faults_per_step": statistics.median(timed_faults) if timed_faults else None,
        "final_train_loss": final_loss,
        "nonfinite_losses": sum(not math.isfinite(v) for v in losses),
        "skipped_steps": skipped,
        "final_loss_scale": known_scales[-1] if known_scales else None,
        "losses": [_finite_or_none(v) for v in losses],
        "loss_scales": scales,
        **result,
    }


def _add_ratios(precisions: dict[str, dict[str, Any]]) -> None:
    base = precisions.get("fp32", {})
    limit = precisions.get("bf16", {})
    base_ok, limit_ok = base.get("status") == "ok", limit.get("status") == "ok"
    for entry in precisions.values():
        if entry.get("status") != "ok":
            continue
        entry["time_vs_bf16"] = _time_ratio(entry, limit, "step_ms") if limit_ok else None
        entry["speedup"] = _time_ratio(base, entry, "step_ms") if base_ok else None
        entry["speedup_min"] = _time_ratio(base, entry, "step_ms_min") if base_ok else None
        peak, base_peak = entry.get("peak_mib"), base.get("peak_mib")
        entry["memory_vs_fp32"] = peak / base_peak if base_ok and base_peak and peak is not None else None
        if base_ok and base.get("accuracy") is not None and entry.get("accuracy") is not None:
            entry["accuracy_delta_vs_fp32"] = entry["accuracy"] - base["accuracy"]


def _time_ratio(top: dict[str, Any], bottom: dict[str, Any], key: str) -> float | None:
    """``top[key] / bottom[key]`` where both times were measured (non-zero), else None."""
    a, b = top.get(key), bottom.get(key)
    return a / b if a and b else None


def run_workload(
    name: str, config: BenchConfig, pool: dict[str, _Worker], progress: ProgressFn | None,
    announce: Callable[[str, str], None] | None,
) -> dict[str, Any]:
    steps = config.steps_for(name)
    block = config.block_for(steps)
    entries: dict[str, dict[str, Any]] = {}
    info: dict[str, Any] = {}
    for p in config.precisions:
        spec = RunSpec(name, config.size, p, config.device, config.dtype, steps, config.seed)
        pool[p].send("setup", spec)
    active: list[str] = []
    for p in config.precisions:
        reply = pool[p].recv()
        if reply[0] == "ready":
            active.append(p)
            info = info or reply[1]
        elif reply[0] == "unavailable":
            entries[p] = {"status": "unavailable", "note": reply[1]}
        else:
            entries[p] = {"status": "error", "note": reply[1], "traceback": reply[2] if len(reply) > 2 else ""}
    if announce is not None and info:
        announce(name, info["description"])

    blocks: dict[str, list[dict[str, Any]]] = {p: [] for p in active}
    done, total = 0, steps * len(active)
    if progress is not None:
        progress(name, done, total)
    for r, n in enumerate(_chunks(steps, block)):
        order = active[r % len(active) :] + active[: r % len(active)] if active else []
        for p in order:
            pool[p].send("train", n)
            reply = pool[p].recv()
            if reply[0] == "block":
                blocks[p].append(reply[1])
                done += n
            else:
                entries[p] = {"status": "error", "note": reply[1], "traceback": reply[2] if len(reply) > 2 else ""}
                active.remove(p)
                total -= steps - sum(b["steps"] for b in blocks[p])
            if progress is not None:
                progress(name, done, total)
    for p in list(active):
        pool[p].send("finish")
        reply = pool[p].recv()
        if reply[0] == "result":
            entries[p] = summarize_precision(blocks[p], reply[1])
        else:
            entries[p] = {"status": "error", "note": reply[1], "traceback": reply[2] if len(reply) > 2 else ""}
    ordered = {p: entries[p] for p in config.precisions}
    _add_ratios(ordered)
    return {
        "allocator": info.get("allocator"),
        "description": info.get("description", ""),
        "config": info.get("config", {}),
        "steps": steps,
        "block_steps": block,
        "metric": WORKLOADS[name].metric,
        "precisions": ordered,
    }


def run_bench(
    config: BenchConfig,
    progress: ProgressFn | None = None,
    announce: Callable[[str, str], None] | None = None,
) -> dict[str, Any]:
    """Train every workload of ``config`` under every precision, interleaved, and
    return the results (the content of results.json). ``config.device`` must be
    resolved (``cpu`` or ``cuda``); see :func:`resolve_device`.

    Workers start with the ``spawn`` method, so a script that calls this must
    guard it with ``if __name__ == "__main__":`` (the ``ampkit`` command does)."""
    import ampkit

    started = datetime.datetime.now(datetime.timezone.utc)
    results: dict[str, Any] = {
        "ampkit_version": ampkit.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": config.device,
        "device_name": device_name(config.device),
        "cpu_flags": cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "dtype": config.dtype,
        "threads": config.threads,
        "seed": config.seed,
        "size": config.size,
        "precisions": list(config.precisions),
        "memory_method": MEMORY_NOTES[config.device],
        "started_utc": started.isoformat(timespec="seconds"),
        "workloads": {},
    }
    with _workers(config.precisions, config.threads, config.hold_freed_memory) as pool:
        for name in config.workloads:
            results["workloads"][name] = run_workload(name, config, pool, progress, announce)
            allocator = results["workloads"][name].pop("allocator", None)
            if allocator and "allocator" not in results:
                results["allocator"] = allocator
    results["wall_seconds"] = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
    return results
