"""One precision's training process for ``ampkit bench``.

Each precision trains in its own process: ampkit's O1 turns casting on process-wide
and ``initialize`` starts a new AMP session, so precisions sharing a process would
disturb each other, and CUDA peak memory is per process. The parent
(:mod:`ampkit.tools.bench.runner`) drives the workers one at a time over a pipe, a short
block of steps each in turn, so machine noise falls on every precision alike.

Messages (parent -> worker): ``("setup", RunSpec)``, ``("train", n_steps)``,
``("finish",)``, ``("close",)``. Replies: ``("ready", info)``, ``("block", BlockStats)``,
``("result", dict)``, ``("unavailable", message)`` or ``("error", message, traceback)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import traceback
import warnings
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from ampkit._internal.dtypes import DTYPES_BY_NAME

from .allocator import allocator_info, hold_freed_memory, minor_page_faults
from .memory import MIB, PeakMeter, SavedActivations, live_tensor_bytes, storage_ptrs
from .recipes import Recipe, RecipeUnavailable, make_recipe
from .workloads import make_workload

__all__ = ["RunSpec", "TrainingRun", "worker_main"]

DTYPES: dict[str, torch.dtype] = DTYPES_BY_NAME


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What one worker trains: a workload at a size, under one precision."""

    workload: str
    size: str
    precision: str
    device: str
    dtype: str
    steps: int
    seed: int


class TrainingRun:
    """A model, optimizer and batch stream under one recipe, trained in blocks."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        self.dtype = DTYPES[spec.dtype]
        # The recipe first: an unavailable precision should not load data.
        self.recipe: Recipe = make_recipe(spec.precision, self.device, self.dtype)
        self.workload = make_workload(spec.workload, spec.size, self.device, spec.seed)
        self.data_ptrs = storage_ptrs(self.workload.data_tensors())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.cuda_base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        torch.manual_seed(spec.seed)
        model = self.workload.build_model()
        optimizer = self.workload.build_optimizer(model)
        self.model, self.optimizer = self.recipe.prepare(model, optimizer)
        self.scheduler = self.workload.build_scheduler(self.optimizer, spec.steps)
        self.batches = self.workload.batches(torch.Generator().manual_seed(spec.seed))

    def info(self) -> dict[str, Any]:
        """What the parent shows before training starts."""
        return {
            "description": self.workload.description,
            "config": self.workload.config(),
            "allocator": allocator_info(),
        }

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _step(self, measure: contextlib.AbstractContextManager[Any] | None = None) -> tuple[torch.Tensor, bool]:
        x, y = next(self.batches)
        self.optimizer.zero_grad(set_to_none=True)
        with measure if measure is not None else contextlib.nullcontext():
            with self.recipe.scope():
                loss = self.workload.loss(self.model(x), y)
            skipped = self.recipe.backward_step(loss, self.optimizer)
            if self.scheduler is not None:
                self.scheduler.step()
        return loss.detach(), skipped

    def train(self, n: int) -> dict[str, Any]:
        """Run ``n`` steps; return their losses, skips, loss scales, wall time and the
        minor page faults the process took meanwhile (None where not counted)."""
        losses: list[torch.Tensor] = []
        skipped: list[bool] = []
        scales: list[float | None] = []
        self._sync()
        faults = minor_page_faults()
        start = time.perf_counter()
        for _ in range(n):
            loss, was_skipped = self._step()
            losses.append(loss)
            skipped.append(was_skipped)
            scales.append(self.recipe.loss_scale())
        self._sync()
        seconds = time.perf_counter() - start
        after = minor_page_faults()
        values = torch.stack(losses).float().tolist() if losses else []
        return {
            "losses": values,
            "skipped": skipped,
            "scales": scales,
            "seconds": seconds,
            "steps": n,
            "page_faults": None if faults is None or after is None else after - faults,
        }

    def finish(self) -> dict[str, Any]:
        """Held-out metrics and memory figures after training."""
        metrics = self.workload.evaluate(self.model, self.recipe.scope)
        memory: dict[str, Any] = {}
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) - self.cuda_base
            memory = {"peak_mib": peak / MIB, "memory_method": "cuda_max_memory_allocated"}
        else:
            memory = self._measure_cpu_step()
        return {**{k: _finite(v) for k, v in metrics.items()}, **memory}

    def _measure_cpu_step(self) -> dict[str, Any]:
        """CPU: one more training step, after the metrics and out of the timing, under
        :class:`~ampkit.tools.bench.memory.PeakMeter` (the method ``benchmarks/memory.py``
        uses too): its exact peak of tensor bytes, the dataset left out. Beside it
        what was alive before it (``state_mib``) and what autograd saved for backward
        in it (``activation_mib``)."""
        state = live_tensor_bytes(self.device, exclude=self.data_ptrs)
        meter = PeakMeter(self.device, exclude=self.data_ptrs)
        params = storage_ptrs(self.model.parameters()) | storage_ptrs(self.model.buffers())
        saved = SavedActivations(self.data_ptrs | params)

        @contextlib.contextmanager
        def measured() -> Iterator[None]:  # entered by _step after zero_grad
            with meter.profiling(), meter.window(), saved:
                yield

        self._step(measured())
        return {
            "peak_mib": meter.peak / MIB,
            "state_mib": state / MIB,
            "activation_mib": saved.nbytes / MIB,
            "memory_method": "exact_step_peak",
        }

    def close(self) -> None:
        """Drop the run and any process-wide state its recipe set up."""
        self.recipe.cleanup()


def _reset_ampkit() -> None:
    """Start each workload from a clean ampkit state, whatever a failed one left."""
    import ampkit

    ampkit.reset()


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def worker_main(conn: Connection, threads: int, hold_memory: bool = True) -> None:
    """Entry point of a worker process: serve commands until ``("close",)``.
    ``hold_memory``: keep freed memory in the process (:func:`hold_freed_memory`)."""
    if hold_memory:
        hold_freed_memory()
    torch.set_num_threads(threads)
    # The parent prints its own note once for fp16 on CPU; one per worker is noise.
    warnings.filterwarnings("ignore", message=r".*float16 on CPU.*", category=UserWarning)
    run: TrainingRun | None = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        cmd = msg[0]
        if cmd == "close":
            return
        try:
            if cmd == "setup":
                if run is not None:
                    run.close()
                run = None
                _reset_ampkit()
                run = TrainingRun(msg[1])
                conn.send(("ready", run.info()))
            elif cmd == "train":
                assert run is not None, "train before setup"
                conn.send(("block", run.train(int(msg[1]))))
            elif cmd == "finish":
                assert run is not None, "finish before setup"
                result = run.finish()
                run.close()
                run = None
                conn.send(("result", result))
            else:
                conn.send(("error", f"unknown command {cmd!r}", ""))
        except RecipeUnavailable as exc:
            run = None
            conn.send(("unavailable", str(exc)))
        except KeyboardInterrupt:
            return
        except Exception as exc:  # reported to the parent, shown in the table
            if run is not None:
                with contextlib.suppress(Exception):
                    run.close()
            run = None
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
