"""Tensor memory counts, one method for both benchmark trees.

Two trees measure ampkit: ``ampkit bench`` (:mod:`ampkit.tools.bench`, installed, what
users run: speed, memory and accuracy of built-in workloads) and the repository's
``benchmarks/`` scripts (what developers run: one figure each, e.g.
``benchmarks/memory.py``). Both count tensor memory with this module.

The method is exact and holds on CPU, where torch keeps no allocator statistics:

- what is alive: the distinct storages (views and shared tensors count once) of
  every tensor Python can reach, and of their ``.grad`` (:func:`live_tensor_bytes`),
  or of a model's parameters and its optimizer's state (:func:`param_and_state_bytes`);
- what a block of code allocates on top: every allocation and free of torch's CPU
  allocator, recorded by ``torch.profiler`` with ``profile_memory``, summed in order
  (:func:`allocation_peak`).

The peak of a step is the first plus the peak of the second over the step
(:class:`PeakMeter`). On CUDA ``ampkit bench`` reads the caching allocator's
``torch.cuda.max_memory_allocated`` instead. :class:`SavedActivations` counts what
autograd saves for backward (a breakdown the bench reports beside the peak).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ampkit._internal import torch_compat

__all__ = [
    "MIB",
    "SavedActivations",
    "allocation_peak",
    "live_tensor_bytes",
    "native_profiler_quiet",
    "PeakMeter",
    "param_and_state_bytes",
    "storage_ptrs",
]

MIB = float(2**20)


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of ``t``'s storage, or None for tensors without one: sparse
    and meta tensors, and the fake tensors torch.compile leaves alive (shapes only; their
    storage's pointer is 0, and reading it warns)."""
    if torch_compat.is_fake_tensor(t):
        return None
    try:
        if t.is_sparse or t.device.type == "meta":
            return None
        s = t.untyped_storage()
        ptr, nbytes = s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None
    if ptr == 0 or nbytes == 0:
        return None
    return ptr, nbytes


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Storage addresses of ``tensors`` (to exclude them from a count)."""
    out: set[int] = set()
    for t in tensors:
        key = _storage(t)
        if key is not None:
            out.add(key[0])
    return out


def live_tensor_bytes(device: torch.device, exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Bytes of the distinct storages of every tensor on ``device`` that Python can
    reach (and of their ``.grad``), except storages whose address is in ``exclude``."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if t is None or t.device.type != device.type:
            return
        key = _storage(t)
        if key is not None and key[0] not in exclude:
            seen[key[0]] = max(seen.get(key[0], 0), key[1])

    gc.collect()
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which some
        # deprecation proxies in torch's namespace answer with a warning.
        if issubclass(type(obj), torch.Tensor):
            add(obj)
            if obj.is_leaf and obj.requires_grad:
                add(obj.grad)
    return sum(seen.values())


def param_and_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages of ``model``'s parameters and of what
    ``optimizer`` holds: the parameters it steps (fp32 masters under O2), their
    compensation buffers (O2K) and every tensor of its state."""
    from ampkit.levels.setup import compensation_of  # the bench sits above the library

    sizes: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        key = None if t is None else _storage(t)
        if key is not None:
            sizes[key[0]] = max(sizes.get(key[0], 0), key[1])

    for p in model.parameters():
        add(p)
    comp = compensation_of(optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            add(p)
            if comp is not None:
                add(comp.buffer(p))
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                add(v)
    return sum(sizes.values())


def allocation_peak(prof: Any, window: str | None = None) -> int:
    """From a ``torch.profiler`` run with ``profile_memory``: the peak of bytes
    allocated minus bytes freed since the start, over the whole run or inside its one
    ``record_function(window)`` range. Every block freed there must have been
    allocated while profiling (the profiler knows the size of those only), so
    profiling starts before the first allocation of what is measured."""
    events = prof.profiler.kineto_results.events()
    start, end = -1, float("inf")
    if window is not None:
        marks = [e for e in events if e.name() == window]
        if len(marks) != 1:
            raise RuntimeError(f"expected one {window!r} range in the profile, found {len(marks)}")
        start, end = marks[0].start_ns(), marks[0].end_ns()
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    current = peak = 0
    for e in memory:
        if e.start_ns() < start:
            continue
        if e.start_ns() > end:
            break
        current += e.nbytes()
        peak = max(peak, current)
    return peak


# What torch's profiler writes from C++ straight to the process's stderr while it
# records memory: kineto's start/stop trace lines and the CPU allocator's note on
# blocks allocated before profiling began. Neither is about the user's run.
_PROFILER_NOISE = re.compile(
    r"SyncActivityProfilerHandler\.cpp.*profiler_(start|stop)"
    r"|CPUAllocator\.cpp.*\]|Memory block of unknown size was allocated before the profiling"
)


@contextlib.contextmanager
def native_profiler_quiet() -> Iterator[None]:
    """Hold back the profiler's own native stderr lines (:data:`_PROFILER_NOISE`)
    written inside the block; every other line written to file descriptor 2 there
    is passed on to ``sys.stderr`` when the block ends, in order."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real fd 2 (an embedded interpreter)
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                line
                for line in held.read().decode(errors="replace").splitlines(keepends=True)
                if not _PROFILER_NOISE.search(line)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class PeakMeter:
    """Exact peak tensor bytes of a stretch of code on ``device`` (CPU)::

        meter = PeakMeter(torch.device("cpu"), exclude=storage_ptrs([x, y]))
        with meter.profiling():       # from before the first allocation measured
            ...
            with meter.window():      # the stretch whose peak is wanted
                optimizer.step()
        meter.live, meter.extra, meter.peak

    ``live``: bytes alive as the window opens (:func:`live_tensor_bytes`, less the
    storages in ``exclude``); ``extra``: the peak of what the window allocates on top
    (:func:`allocation_peak`); ``peak``: their sum.
    """

    WINDOW = "ampkit.tools.bench.memory.window"

    def __init__(self, device: torch.device, exclude: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.device = device
        self.exclude = exclude
        self.live = 0
        self.extra = 0

    @property
    def peak(self) -> int:
        return self.live + self.extra

    @contextlib.contextmanager
    def profiling(self) -> Iterator[PeakMeter]:
        with native_profiler_quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield self
        self.extra = allocation_peak(prof, self.WINDOW)

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        self.live = live_tensor_bytes(self.device, exclude=self.exclude)
        with record_function(self.WINDOW):
            yield


class SavedActivations:
    """Context manager counting the distinct storages autograd saves for backward
    inside it, except those in ``exclude``. Read ``nbytes`` afterwards."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.seen: dict[int, int] = {}
        self.nbytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key is not None and key[0] not in self.exclude:
            self.seen[key[0]] = max(self.seen.get(key[0], 0), key[1])
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self.nbytes = sum(self.seen.values())
