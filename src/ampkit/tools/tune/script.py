"""``ampkit tune script.py``: :func:`ampkit.tune` for an unmodified training script.

1. **Capture**: the script runs for ``capture`` steps in fp32 under ``ampkit run``'s
   machinery (nothing applied, observed); the model is the outermost module with
   parameters the script calls most with grad on, and its first calls' arguments are
   kept (detached).
2. **Measure and choose** on a copy of that model, as :func:`ampkit.tune` does, with
   :func:`~.measure.output_energy` (the mean square of the outputs) standing in for the
   script's own loss, which cannot be replayed outside the script.
3. **Confirm** with the script's own loss: each candidate (fp32; the module plan and
   everything lowered, at O1, O2 and O2K) is a child process ``ampkit run --plan ...
   --steps N`` whose report gives the loss series and the step time; the plan is the
   fastest run within the budget of fp32's final loss, as for models.
"""

from __future__ import annotations

import collections
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit.casting.precision_plan import TunePlan
from ampkit.errors import AmpError
from ampkit.tools.run import RunConfig, run_script

from . import measure
from .search import Probe, build_plan, check_budget, check_settings, confirm, measure_and_choose

__all__ = ["capture", "tune_script"]


def capture(path: str | Path, args: Sequence[str], steps: int, calls: int = 4) -> tuple[nn.Module, list[measure.Call]]:
    """Run the script for ``steps`` steps in fp32 and return its model (the outermost
    module with parameters called most often with grad enabled) and the positional
    arguments of its first ``calls`` calls (torch's global hooks see no keyword
    arguments: a model called with keywords cannot be tuned from its script).
    :class:`ampkit.AmpError` when the script calls none."""
    depth = threading.local()
    seen: collections.Counter[int] = collections.Counter()
    modules: dict[int, nn.Module] = {}
    recorded: dict[int, list[measure.Call]] = collections.defaultdict(list)

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        level = getattr(depth, "n", 0)
        depth.n = level + 1
        if level or not torch.is_grad_enabled() or next(module.parameters(), None) is None:
            return
        seen[id(module)] += 1
        modules.setdefault(id(module), module)
        if len(recorded[id(module)]) < calls:
            detach = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
            recorded[id(module)].append(measure.Call(*torch_compat.tree_map(detach, (tuple(args), dict(kwargs)))))

    def post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        depth.n = max(0, getattr(depth, "n", 1) - 1)

    reg = nn.modules.module
    handles = [reg.register_module_forward_pre_hook(_with_kwargs(pre)),
               reg.register_module_forward_hook(_post(post), always_call=True)]
    try:
        result = run_script(path, list(args), RunConfig(level="fp32", max_steps=steps))
    finally:
        for h in handles:
            h.remove()
    if result.code != 0:
        raise AmpError(f"the script exited with code {result.code} while ampkit tune watched its first {steps} steps.")
    if not seen:
        raise AmpError("the script called no module with parameters while training (grad enabled): nothing to tune.")
    key, _ = seen.most_common(1)[0]
    return modules[key], recorded[key]


def _with_kwargs(fn: Any) -> Any:
    """A global forward pre-hook (which gets no kwargs) calling ``fn(module, args, {})``."""
    return lambda module, args: fn(module, args, {})


def _post(fn: Any) -> Any:
    return lambda module, args, output: fn(module, args, None, output)


def _child_run(script: Path, args: Sequence[str], plan: TunePlan | None, level: str, dtype: str, steps: int,
               tmp: Path) -> Probe:  # fmt: skip
    """``ampkit run`` of the script in a child process; an infinite loss where it fails."""
    report = tmp / f"run-{level}-{len(list(tmp.iterdir()))}.json"
    cmd = [sys.executable, "-m", "ampkit", "run", "--level", level, "--steps", str(steps), "--report", str(report)]
    if plan is not None:
        path = report.with_suffix(".plan.json")
        plan.save(path)
        cmd += ["--plan", str(path), "--dtype", dtype]
    proc = subprocess.run([*cmd, str(script), *args], capture_output=True, text=True)
    if proc.returncode != 0 or not report.exists():
        return Probe(math.inf, math.inf)
    doc = json.loads(report.read_text())
    series = next(iter(doc["losses"].values()), [])
    finite = [v for v in series if isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite or len(finite) < len(series) // 2 or doc.get("iteration_ms_median") is None:
        return Probe(math.inf, math.inf)
    k = max(1, len(finite) // 4)
    return Probe(sum(finite[-k:]) / k, float(doc["iteration_ms_median"]))


def tune_script(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    steps: int = 50,
    budget: float = 0.01,
    candidates: Sequence[str] = ("bf16", "fp16", "fp8"),
    capture_steps: int = 4,
    repeats: int = 3,
    grad_limit: float = 0.1,
    max_backoffs: int = 2,
    max_seconds: float = 300.0,
    include_emulated: bool = False,
) -> TunePlan:
    """A per-module plan for an unmodified training script (see the module docstring).

    Args:
        script, args: the script and its arguments.
        steps (int): steps of each confirming run (fp32 and every candidate). Default: ``50``.
        budget (float): how much worse than fp32's the script's final loss may be
            (relative; the mean of each run's last quarter of losses). Default: ``0.01``.
        candidates, grad_limit, max_seconds, include_emulated: as :func:`ampkit.tune`,
            except that ``"fp8"`` is not tried (said in :attr:`TunePlan.skipped`): the
            confirming runs start at O1, where ``ampkit run`` converts no linear.
        capture_steps (int): steps of the capturing fp32 run (its first calls are the
            calibration batches). Default: ``4``.
        repeats (int): timed runs per module and dtype. Default: ``3``.
        max_backoffs (int): confirming runs repeated after putting a module back. Default: ``2``.
    """
    start = time.perf_counter()
    path = Path(script)
    if not path.is_file():
        raise AmpError(f"ampkit tune: no such script {str(path)!r}.")
    check_budget(budget)
    check_settings(repeats=repeats, max_backoffs=max_backoffs, grad_limit=grad_limit, max_seconds=max_seconds)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 4:
        raise AmpError(f"steps {steps!r}: at least 4 (the step time is a median after the third).")
    model, calls = capture(path, args, capture_steps)
    device_type = next(p.device.type for p in model.parameters())
    if not measure.candidate_modules(model):
        raise AmpError(f"the script's model ({type(model).__name__}) has no module with parameters of its own below "
                       "its root: nothing to tune.")  # fmt: skip
    skipped_here = {}
    if "fp8" in candidates:  # its confirming runs start at O1, where ampkit run converts no linear
        skipped_here["fp8"] = ("ampkit tune script.py does not try fp8: ampkit run converts fp8 linears at O2/O2K "
                               "only, and the confirming runs start at O1; tune the model with ampkit.tune "
                               "in the script for fp8")  # fmt: skip
    dtype, choices, skipped = measure_and_choose(
        model, calls, measure.output_energy, candidates=[c for c in candidates if c != "fp8"],
        device_type=device_type,
        include_emulated=include_emulated, repeats=repeats, budget=budget, grad_limit=grad_limit,
        deadline=start + max_seconds)  # fmt: skip
    skipped.update(skipped_here)
    names = [c.name for c in choices]
    with tempfile.TemporaryDirectory(prefix="ampkit-tune-") as tmp:

        def run(level: str | None, kept: list[str], fp8: Sequence[str] = ()) -> Probe:  # fp8: never chosen here
            if level is None:
                return _child_run(path, args, None, "fp32", dtype, steps, Path(tmp))
            plan = TunePlan.by_hand([n for n in names if n not in kept], list(kept), dtype=dtype, level=level,
                                    device_type=device_type)  # fmt: skip
            return _child_run(path, args, plan, level, dtype, steps, Path(tmp))

        level, figures, choices, backed = confirm(run, dtype, choices, steps, budget, max_backoffs)
    if not math.isfinite(figures["fp32_loss"]):
        raise AmpError("the script's fp32 run under ampkit run failed or logged no finite loss; run it with "
                       "`ampkit run --level fp32` to see why.")  # fmt: skip
    return build_plan(dtype, level, device_type, budget, choices, skipped, figures, backed, start)
