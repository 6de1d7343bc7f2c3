"""``ampkit tune script.py``: :func:`ampkit.tune` for an unmodified training script.

1. **Capture**, in a child process (:mod:`.worker`): the script runs for ``capture``
   steps in fp32 under ``ampkit run``'s machinery (nothing applied, observed); the model
   is the outermost module with parameters the script calls most with grad on, and its
   first calls' arguments are kept (detached).
2. **Measure and choose** there, on a copy of that model, as :func:`ampkit.tune` does,
   with :func:`~.measure.output_energy` (the mean square of the outputs) standing in for
   the script's own loss, which cannot be replayed outside the script.
3. **Confirm** with the script's own loss: each candidate (fp32; the module plan and
   everything lowered, at O1, O2 and O2K) is a child process ``ampkit run --plan ...
   --steps N`` whose report gives the loss series and the step time; the plan is the
   fastest run within the budget of fp32's final loss, as for models.

Every run of the script is a child process in a group of its own, bounded in time
(:mod:`.children`), so that what the script does (``os._exit``, a fork, a hang) stays in
it; a run that fails says why, and no plan is made from runs that all failed.
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from os import _exit as exit_now  # Python's own: no cleanup, no unwinding into the tuner
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit._internal.files import read_json, write_text
from ampkit.errors import AmpError
from ampkit.levels.precision_plan import ModuleChoice, TunePlan
from ampkit.tools.run import RunConfig, run_script

from . import measure
from .children import last_words, run_bounded
from .progress import Progress
from .search import Probe, build_plan, check_budget, check_settings, confirm

__all__ = ["capture", "check_timeout", "confirming_run", "tune_script"]


def capture(path: str | Path, args: Sequence[str], steps: int, calls: int = 4) -> tuple[nn.Module, list[measure.Call]]:
    """Run the script for ``steps`` steps in fp32 and return its model (the outermost
    module with parameters called most often with grad enabled) and the arguments,
    positional and keyword, of its first ``calls`` calls. :class:`ampkit.AmpError` when
    the script exits with an error or calls no such module. A process the script forks
    returns here too when its copy of the script ends: it exits there, with the script's
    exit code (only the process that called :func:`capture` goes on to tune)."""
    pid = os.getpid()
    depth = threading.local()
    seen: collections.Counter[int] = collections.Counter()
    modules: dict[int, nn.Module] = {}
    recorded: dict[int, list[measure.Call]] = collections.defaultdict(list)

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        level = getattr(depth, "n", 0)
        depth.n = level + 1
        if level:
            return
        depth.args = None  # the positional arguments of an outermost call to record
        if torch.is_grad_enabled() and next(module.parameters(), None) is not None:
            seen[id(module)] += 1
            modules.setdefault(id(module), module)
            if len(recorded[id(module)]) < calls:  # copied before the forward can change them
                depth.args = torch_compat.tree_map(_copy, tuple(args))

    def post(module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        # (kwargs, output) after a forward; (output,) alone after one that raised
        depth.n = max(0, getattr(depth, "n", 1) - 1)
        if depth.n or getattr(depth, "args", None) is None or len(rest) != 2:
            return
        # the global pre-hook sees no keyword arguments: this hook does
        recorded[id(module)].append(measure.Call(depth.args, torch_compat.tree_map(_copy, dict(rest[0]))))
        depth.args = None

    reg = nn.modules.module
    handles = [reg.register_module_forward_pre_hook(pre),
               reg.register_module_forward_hook(post, with_kwargs=True, always_call=True)]  # fmt: skip
    try:
        result = run_script(path, list(args), RunConfig(level="fp32", max_steps=steps))
    except BaseException:
        _end_if_forked(pid, 1)
        raise
    finally:
        for h in handles:
            h.remove()
    _end_if_forked(pid, result.code)
    if result.code != 0:
        raise AmpError(f"the script exited with code {result.code} while ampkit tune watched its first {steps} steps.")
    if not seen:
        raise AmpError("the script called no module with parameters while training (grad enabled): nothing to tune.")
    key, _ = seen.most_common(1)[0]
    return modules[key], recorded[key]


def _copy(t: Any) -> Any:
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _end_if_forked(pid: int, code: int) -> None:
    """In a process the script forked (not ``pid``), whose copy of the script has ended:
    exit with ``code`` now, as the script's own process would, instead of tuning too."""
    if os.getpid() == pid:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the script
            pass
    exit_now(code)


def confirming_run(script: Path, args: Sequence[str], plan: TunePlan | None, level: str, dtype: str, steps: int,
                   tmp: Path, timeout: float) -> tuple[Probe, str]:  # fmt: skip
    """``ampkit run`` of the script in a child process, stopped past ``timeout`` seconds
    (:class:`ampkit.AmpError`): its probe and ``""``, or an infinite loss and why it failed."""
    report = tmp / f"run-{level}-{len(list(tmp.iterdir()))}.json"
    cmd = [sys.executable, "-m", "ampkit", "run", "--level", level, "--steps", str(steps), "--report", str(report)]
    if plan is not None:
        path = report.with_suffix(".plan.json")
        plan.save(path)
        cmd += ["--plan", str(path), "--dtype", dtype]
    log = report.with_suffix(".log")
    what = f"the script's confirming run at {level} (`ampkit run --level {level} --steps {steps}`)"
    code = run_bounded([*cmd, str(script), *args], log, timeout, what)
    failed = Probe(math.inf, math.inf)
    if code != 0:
        return failed, f"{what} exited with code {code}: {last_words(log) or 'no output'}"
    if not report.exists():
        return failed, f"{what} ended before training finished, without a report (os._exit, or a signal)"
    try:
        doc = read_json(report, "the confirming run's report", AmpError)
    except AmpError as exc:  # not the report ampkit run writes: the run failed
        return failed, f"{what}: {exc}"
    losses = doc.get("losses") if isinstance(doc, dict) else None
    series = next(iter(losses.values()), []) if isinstance(losses, dict) and losses else []
    finite = [v for v in series if isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite or len(finite) < len(series) // 2 or doc.get("iteration_ms_median") is None:
        return failed, f"{what} logged no finite loss or no step time (its report: {report.name})"
    if doc.get("level_applied") != level:  # its figures are another level's
        notes = "; ".join(str(n) for n in doc.get("notes") or []) or "no note"
        return failed, f"{what} ran at {doc.get('level_applied')} instead: {notes}"
    k = max(1, len(finite) // 4)
    return Probe(sum(finite[-k:]) / k, float(doc["iteration_ms_median"])), ""


class _Relay:
    """Called while the capture process runs: begins ``report``'s measuring stage once the
    capture is done (the ``marker`` file exists), and passes on each line the process
    writes to ``lines`` (its own stages)."""

    def __init__(self, report: Progress, lines: Path, marker: Path) -> None:
        self.report, self.lines, self.marker = report, lines, marker
        self.offset, self.partial, self.measuring = 0, b"", False

    def __call__(self) -> None:
        if not self.measuring and self.marker.exists():
            self.measuring = True
            self.report.begin("measuring", "the script's model, in the capture process (its stages follow)")
        try:
            with open(self.lines, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:  # not written yet
            return
        self.offset += len(data)
        *done, self.partial = (self.partial + data).split(b"\n")
        for line in done:
            self.report.relay(line.decode("utf-8", "replace"))


def _captured_choices(path: Path, args: Sequence[str], tmp: Path, timeout: float, report: Progress,
                      **settings: Any) -> tuple[str, str, list[ModuleChoice], dict[str, str]]:  # fmt: skip
    """Steps 1 and 2 in a child process (:mod:`.worker`), the capture bounded by
    ``timeout`` seconds and the measuring by ``max_seconds`` more: the plan's dtype, the
    device type, the choices and the dtypes skipped. :class:`ampkit.AmpError` where the
    script failed, exited before its steps were seen, or ran too long. Each is a stage
    of ``report``, the child's own measuring stages passed on."""
    spec, marker, result, log = tmp / "capture.json", tmp / "captured", tmp / "result.json", tmp / "capture.log"
    lines = tmp / "progress.log"
    write_text(spec, json.dumps({"script": str(path), "args": list(args), "captured": str(marker),
                                 "result": str(result), "progress": str(lines) if report.on else None,
                                 **settings}), "ampkit tune's capture spec")  # fmt: skip
    steps = settings["capture_steps"]
    report.begin("capture", f"running the script's first {steps} steps in fp32 in a child process, to find its "
                 "model and the inputs it is called with")  # fmt: skip
    code = run_bounded([sys.executable, "-m", "ampkit.tools.tune.worker", str(spec)], log, timeout,
                       f"the script's capture run (its first {steps} steps, in fp32)",
                       then=(marker, settings["max_seconds"] + timeout, "measuring the script's model"),
                       watch=_Relay(report, lines, marker) if report.on else None)  # fmt: skip
    if not result.exists():
        said = last_words(log)
        if not marker.exists():
            raise AmpError(f"the script exited (exit code {code}) before training finished: ampkit tune watches its "
                           f"first {steps} steps, and the process ended before them without an error it could "
                           f"see (os._exit, or a signal){f'; its last output: {said}' if said else ''}.")  # fmt: skip
        raise AmpError(f"measuring the script's model ended (exit code {code}) without a result: {said or 'no output'}.")
    doc = read_json(result, "ampkit tune's capture result", AmpError)
    if "error" in doc:
        raise AmpError(doc["error"])
    report.end()
    return doc["dtype"], doc["device_type"], [ModuleChoice(**c) for c in doc["choices"]], doc["skipped"]


def check_timeout(timeout: Any) -> None:
    """Raise :class:`ampkit.AmpError` unless ``timeout`` is a number of seconds > 0 (inf: no bound)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise AmpError(f"timeout {timeout!r}: the seconds each run of the script may take, a number > 0 "
                       "(default 600; inf for no bound).")  # fmt: skip


#: Why ``ampkit tune script.py`` does not try fp8 (in :attr:`TunePlan.skipped`).
NO_FP8 = ("ampkit tune script.py does not try fp8: ampkit run converts fp8 linears at O2/O2K only, and the "
          "confirming runs start at O1; tune the model with ampkit.tune in the script for fp8")  # fmt: skip


def _check(path: Path, steps: Any, budget: Any, timeout: Any, **settings: Any) -> None:
    """:func:`tune_script`'s settings checked before anything runs (:class:`ampkit.AmpError`)."""
    if not path.is_file():
        raise AmpError(f"ampkit tune: no such script {str(path)!r}.")
    check_budget(budget)
    check_settings(**settings)
    check_timeout(timeout)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 4:
        raise AmpError(f"steps {steps!r}: at least 4 (the step time is a median after the third).")


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
    timeout: float = 600.0,
    progress: bool | None = None,
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
        timeout (float): the seconds each run of the script may take (the capture, whose
            measuring then gets ``max_seconds`` more, and each confirming run); one that
            takes longer is stopped, with what it started, and the tuning ends with
            :class:`ampkit.AmpError`. Default: ``600.0``.
        progress (bool | None): as :func:`ampkit.tune` (``ampkit tune`` passes True):
            the capture, the measuring stages of the capture process and each
            confirming run, with a status line at least every 5 s. Default: ``None``.

    Raises:
        AmpError: a bad setting; the script fails, exits before its first
            ``capture_steps`` steps, or runs past ``timeout``; its model fails when
            called again; or no confirming run succeeds (fp32's, or every one in 16 bits).
    """
    start = time.perf_counter()
    path = Path(script)
    _check(path, steps, budget, timeout, repeats=repeats, max_backoffs=max_backoffs, grad_limit=grad_limit,
           max_seconds=max_seconds)  # fmt: skip
    with Progress(progress, "ampkit tune") as report, tempfile.TemporaryDirectory(prefix="ampkit-tune-") as folder:
        tmp = Path(folder)
        dtype, device_type, choices, skipped = _captured_choices(
            path, args, tmp, timeout, report, capture_steps=capture_steps,
            candidates=[c for c in candidates if c != "fp8"], include_emulated=include_emulated, repeats=repeats,
            budget=budget, grad_limit=grad_limit, max_seconds=max_seconds)  # fmt: skip
        if "fp8" in candidates:  # its confirming runs start at O1, where ampkit run converts no linear
            skipped["fp8"] = NO_FP8
        names = [c.name for c in choices]
        failures: list[str] = []
        succeeded: list[str] = []

        def run(level: str | None, kept: list[str], fp8: Sequence[str] = ()) -> Probe:  # fp8: never chosen here
            plan = None if level is None else TunePlan.by_hand(
                [n for n in names if n not in kept], list(kept), dtype=dtype, level=level, device_type=device_type)  # fmt: skip
            result, error = confirming_run(path, args, plan, level or "fp32", dtype, steps, tmp, timeout)
            if error and level is None and not succeeded:  # no reference to compare with: nothing else is worth running
                raise AmpError(f"no probe run succeeded: {error}; see why with `ampkit run --level fp32 --steps "
                               f"{steps} {path}`.")  # fmt: skip
            (failures if error else succeeded).append(error or level or "fp32")
            if error and level is not None:  # in the plan's report: a failed run is no silent inf
                said = skipped.get(level)
                skipped[level] = f"{said}; and {error}" if said else f"a confirming run failed (no result): {error}"
            return result

        level, figures, choices, backed = confirm(run, dtype, choices, steps, budget, max_backoffs, report=report,
                                                  what="running the script (a child `ampkit run` each)")  # fmt: skip
    if failures and succeeded == ["fp32"] * len(succeeded):  # an O0 plan would hide the failures
        raise AmpError(f"no probe run succeeded: every run in {dtype} failed ({len(failures)}), the first: "
                       f"{failures[0]}; no plan is made.")  # fmt: skip
    return build_plan(dtype, level, device_type, budget, choices, skipped, figures, backed, start)
