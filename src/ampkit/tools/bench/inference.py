"""Inference figures for ``ampkit convert`` and ``benchmarks/inference.py``: the bench
workloads as model factories and calibration sets, a short training run that writes
a checkpoint at any opt level, and an interleaved latency measurement.

Factories for ``ampkit convert --model`` / ``--calib`` (the ``quick`` sizes of the
bench workloads, which the checkpoints of :func:`train_checkpoint` use by default):
``digits_cnn``, ``digits_calib``, ``char_lm``, ``char_lm_calib``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .workloads import Workload, make_workload

__all__ = [
    "LatencyRow",
    "char_lm",
    "char_lm_calib",
    "digits_calib",
    "digits_cnn",
    "interleaved_latency",
    "speedups",
    "train_checkpoint",
]


def _workload(name: str, size: str = "quick") -> Workload:
    return make_workload(name, size, "cpu")


def digits_cnn(size: str = "quick") -> nn.Module:
    """The bench CNN (untrained) at ``size``: load a checkpoint into it."""
    return _workload("cnn", size).build_model()


def digits_calib(size: str = "quick", batches: int = 2, batch_size: int = 64) -> list[torch.Tensor]:
    """Calibration batches for :func:`digits_cnn`: training images (never the test set)."""
    data = _workload("cnn", size).data  # type: ignore[attr-defined]
    return [data.train_x[i * batch_size : (i + 1) * batch_size] for i in range(batches)]


def char_lm(size: str = "quick") -> nn.Module:
    """The bench character transformer (untrained) at ``size``."""
    return _workload("lm", size).build_model()


def char_lm_calib(size: str = "quick", batches: int = 2, batch_size: int = 8) -> list[torch.Tensor]:
    """Calibration batches for :func:`char_lm`: windows of the training text."""
    wl = _workload("lm", size)
    gen = torch.Generator().manual_seed(1234)
    it = wl.batches(gen)
    out = []
    for _ in range(batches):
        x, _ = next(it)
        out.append(x[:batch_size])
    return out


def train_checkpoint(
    name: str,
    opt_level: str = "O2",
    steps: int | None = None,
    size: str = "quick",
    seed: int = 0,
    named_params: bool = True,
    **overrides: Any,
) -> tuple[nn.Module, dict[str, Any], Workload]:
    """Train bench workload ``name`` (``"cnn"`` or ``"lm"``) for ``steps`` steps under
    ``ampkit.initialize(opt_level, **overrides)`` and return ``(model, checkpoint,
    workload)``. The checkpoint is ``{"model", "optimizer", "amp"}`` as a training
    script saves it; the AMP session is reset afterwards.

    ``named_params`` builds the optimizer from ``model.named_parameters()`` (torch
    then saves the names, which :func:`ampkit.fp32_weights` uses) instead of
    ``model.parameters()``.
    """
    import ampkit as amp

    wl = make_workload(name, size, "cpu", seed)
    steps = wl.steps if steps is None else steps
    torch.manual_seed(seed)
    model = wl.build_model()
    params = model.named_parameters() if named_params else model.parameters()
    opt = torch.optim.AdamW(params, lr=wl.lr, weight_decay=0.01)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, **overrides)
    sched = wl.build_scheduler(opt, steps)
    batches = wl.batches(torch.Generator().manual_seed(seed))
    try:
        for _ in range(steps):
            x, y = next(batches)
            opt.zero_grad()
            with amp.scale_loss(wl.loss(model(x), y), opt) as scaled:
                scaled.backward()
            opt.step()
            if sched is not None:
                sched.step()
        checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}
    finally:
        amp.reset()
    return model, checkpoint, wl


def interleaved_latency(
    runners: Mapping[str, Callable[[], Any]], rounds: int = 15, warmup: int = 2
) -> dict[str, float]:
    """Median milliseconds per call of each runner, measured in ``rounds`` rounds
    that call every runner once in turn (so machine noise hits all alike), after
    ``warmup`` untimed rounds."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    with torch.inference_mode():
        for r in range(warmup + rounds):
            for name, fn in runners.items():
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
                if r >= warmup:
                    times[name].append(elapsed * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


@dataclasses.dataclass
class LatencyRow:
    """One line of the inference table."""

    model: str
    runtime: str
    weight_bytes: int
    ms: float
    batch: int
    rel_error: float | None = None
    top1: float | None = None
    metric: str = ""

    @property
    def per_second(self) -> float:
        return self.batch * 1e3 / self.ms if self.ms > 0 else float("nan")


def speedups(rows: Sequence[LatencyRow]) -> list[float | None]:
    """Each row's speedup against the fp32 row of the same runtime (its first word:
    "onnxruntime storage" compares with "onnxruntime"); ``None`` where there is none."""
    base = {r.runtime.split()[0]: r.ms for r in rows if r.model == "fp32"}
    out: list[float | None] = []
    for r in rows:
        ref = base.get(r.runtime.split()[0])
        out.append(ref / r.ms if ref else None)
    return out


def table_rows(rows: Sequence[LatencyRow]) -> tuple[list[str], list[list[str]]]:
    """Column headers and formatted cells; speedups as :func:`speedups` gives them."""
    headers = ["model", "runtime", "size MiB", "ms/batch", "items/s", "speedup", "rel error", "top-1 agree"]
    if any(r.metric for r in rows):
        headers.append("metric")
    cells = []
    for r, speed in zip(rows, speedups(rows)):
        line = [
            r.model,
            r.runtime,
            f"{r.weight_bytes / 2**20:.3f}",
            f"{r.ms:.2f}",
            f"{r.per_second:,.0f}",
            f"{speed:.2f}x" if speed is not None else "-",
            "-" if r.rel_error is None else f"{r.rel_error:.2e}",
            "-" if r.top1 is None else f"{r.top1:.2%}",
        ]
        if len(headers) > 8:
            line.append(r.metric)
        cells.append(line)
    return headers, cells


def render(rows: Sequence[LatencyRow], title: str = "") -> None:
    """Print the table with rich when installed, else as plain text."""
    headers, cells = table_rows(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        if title:
            print(title)
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
        for c in cells:
            print("  ".join(x.ljust(w) for x, w in zip(c, widths)))
        return
    table = Table(title=title or None)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < 2 else "right")
    for c in cells:
        table.add_row(*c)
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    console.print(table)


def markdown(rows: Sequence[LatencyRow]) -> str:
    """The table as Markdown (for the README)."""
    headers, cells = table_rows(rows)
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join(out)
