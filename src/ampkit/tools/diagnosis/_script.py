"""Run a training script with the doctor on (``ampkit doctor script.py [args]``), and
the doctor's part of ``ampkit run --doctor`` (:func:`doctor_reports`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import runpy
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ampkit._internal.script import ScriptError, check_script, exit_code, script_argv
from ampkit.errors import AmpError
from ampkit.trainer.managed import managed_state

from . import _core

__all__ = ["DoctorRun", "ScriptError", "doctor_reports", "run_script"]

logger = logging.getLogger("ampkit.doctor")


@dataclasses.dataclass
class DoctorRun:
    """What :func:`run_script` returns.

    Attributes:
        code: the script's exit code (0, its ``sys.exit`` code, 1 after an uncaught
            exception, 130 on Ctrl-C).
        reports: the reports of the doctors that ran, in order (empty: the script never
            passed an optimizer to ``init_trainer``/``initialize``).
        unmanaged: the optimizers the script stepped outside ampkit, one
            ``"SGD (train.py:31)"`` each (class, and the script's line of its first step).
    """

    code: int
    reports: list[Any]
    unmanaged: list[str]


@contextlib.contextmanager
def doctor_reports() -> Iterator[list[Any]]:
    """For the block, ``AMPKIT_DOCTOR=1`` (every optimizer passed to
    ``init_trainer``/``initialize`` is watched by the process-wide doctor) and the
    process-wide doctors that stop in it (``ampkit.reset()``) kept. When the block ends,
    however it ends, the doctor still running is stopped, the environment variable
    restored, and the list yielded receives the reports of every doctor that ran, in
    order."""
    saved_env = os.environ.get(_core.ENV)
    os.environ[_core.ENV] = "1"
    _core._KEEP_FINISHED = True
    _core._FINISHED.clear()
    reports: list[Any] = []
    try:
        yield reports
    finally:
        if saved_env is None:
            os.environ.pop(_core.ENV, None)
        else:
            os.environ[_core.ENV] = saved_env
        _core._stop_global()  # the doctor of a script that did not call ampkit.reset()
        _core._KEEP_FINISHED = False
        doctors = list(_core._FINISHED)
        _core._FINISHED.clear()
        reports.extend(d.report() for d in doctors)


class _UnmanagedSteps:
    """The optimizers a script steps outside ampkit (a step post-hook of every
    optimizer, for the length of ``ampkit doctor``'s run: the doctor's own extension
    keeps every optimizer it watches on the host path, so the hook changes no step).
    At the first such step while no doctor runs, one warning says that this run will
    have nothing to report, and what to run instead."""

    def __init__(self, script: Path, args: list[str]) -> None:
        self.script = script
        self.args = args
        self.seen: dict[int, str] = {}

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in self.seen or _stepped_by_ampkit():
            return
        try:
            managed_state(optimizer)
            return
        except AmpError:
            pass
        line = _script_line(self.script)
        self.seen[id(optimizer)] = f"{type(optimizer).__name__}" + (f" ({line})" if line else "")
        if len(self.seen) == 1 and _core.current() is None:
            logger.warning(
                "ampkit doctor: the %s stepped%s is not managed by ampkit (the script has not "
                "passed it to ampkit.init_trainer or ampkit.initialize): the doctor watches only the "
                "steps ampkit manages, so this run will end with nothing to report. To diagnose the "
                "script as it is, stop it (Ctrl-C) and run: %s",
                type(optimizer).__name__, f" at {line}" if line else "", run_doctor_command(self.script, self.args),
            )


def run_doctor_command(script: Path | str, args: list[str]) -> str:
    """The ``ampkit run --doctor`` command line that runs ``script`` with ``args``
    under ampkit, with the doctor on."""
    import shlex

    return shlex.join(["ampkit", "run", "--doctor", str(script), *args])


_TORCH = str(Path(torch.__file__).resolve().parent)
_AMPKIT = str(Path(__file__).resolve().parents[2])


def _stepped_by_ampkit() -> bool:
    """Whether the step being taken was called by ampkit's own code (a throwaway
    optimizer ``init_trainer`` steps to probe a fused kernel): the first frame outside
    torch and contextlib is ampkit's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_TORCH) or name == contextlib.__file__):
            return name.startswith(_AMPKIT)
        frame = frame.f_back
    return False


def _script_line(script: Path) -> str | None:
    """``name.py:LINE`` of the innermost frame of ``script`` on the stack (None: none)."""
    target = str(script)
    for frame in reversed(traceback.extract_stack()):
        if frame.filename == target:
            return f"{script.name}:{frame.lineno}"
    return None


def run_script(path: str | Path, args: list[str]) -> DoctorRun:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]`` and the doctor on
    for every optimizer it passes to ``init_trainer``/``initialize`` (the process-wide
    doctor, as ``AMPKIT_DOCTOR=1`` does). Returns a :class:`DoctorRun`: the script's exit
    code (an uncaught exception's traceback is printed on stderr), the reports of the
    doctors that ran, and the optimizers it stepped outside ampkit.

    ``sys.argv``, ``sys.path[0]`` and the environment variable are restored after, and
    the doctor is stopped (its hooks removed) when the script ends."""
    script = check_script(path)
    unmanaged = _UnmanagedSteps(script, list(args))
    code = 0
    with doctor_reports() as reports:
        handle = register_optimizer_step_post_hook(unmanaged)
        try:
            with script_argv(script, args):
                runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exc:
            code = exit_code(exc.code)
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # the script failed: show it as Python would, report anyway
            traceback.print_exc()
            code = 1
        finally:
            handle.remove()
    return DoctorRun(code, reports, list(unmanaged.seen.values()))
