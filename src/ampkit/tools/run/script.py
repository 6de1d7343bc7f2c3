"""Running the script: :func:`run_script` runs it as ``__main__`` under a
:class:`~.runner._Runner` and returns its exit code and report (:class:`RunResult`)."""

from __future__ import annotations

import dataclasses
import gc
import runpy
import time
import traceback
from pathlib import Path
from typing import Any

from ampkit._internal.script import check_script, exit_code, script_argv

from .config import RunConfig, RunRefused, _Refusal, _StopScript
from .report import format_summary
from .runner import _Runner

__all__ = ["RunResult", "run_script"]


@dataclasses.dataclass
class RunResult:
    """What :func:`run_script` returns: the script's exit code and the run's report
    (a JSON-ready dict: level, dtype, optimizers with steps/skipped/scale, iterations
    and their times, loss series by ``backward()`` call site, notes)."""

    code: int
    report: dict[str, Any]

    def summary(self) -> str:
        """The exit summary, a few plain lines for stderr."""
        return format_summary(self.report)


def run_script(path: str | Path, args: list[str] | None = None, config: RunConfig | None = None) -> RunResult:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]`` under ``config``
    (default :class:`RunConfig`: O1 bf16). Returns the script's exit code (0, its
    ``sys.exit`` code, 1 after an uncaught exception, whose traceback is printed on
    stderr, 130 on Ctrl-C) and the report.

    Raises :class:`ScriptError` for a path that is no file, and :class:`RunRefused`
    when the precision cannot be applied exactly (raised where the script reached
    that point; the run is undone first). ``sys.argv``, ``sys.path[0]``, the wrapped
    torch functions, the global hooks and every ampkit setup (``ampkit.reset``) are
    restored when the script ends, however it ends."""
    config = config or RunConfig()
    args = list(args or [])
    script = check_script(path)
    runner = _Runner(config)
    code = 0
    refused: RunRefused | None = None
    start = time.perf_counter()
    try:
        runner.install()
        with script_argv(script, args):
            runpy.run_path(str(script), run_name="__main__")
    except _StopScript:
        code = 0
    except _Refusal as stop:
        refused = stop.error
    except RunRefused as err:
        refused = err
    except SystemExit as exc:
        code = exit_code(exc.code)
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:  # the script failed: show it as Python would
        _print_script_traceback(exc, str(script))
        code = 1
    finally:
        runner.remove()
    if refused is None:
        refused = runner.refused  # refused in another thread of the script
    if refused is not None:
        raise refused
    wall = time.perf_counter() - start
    result = RunResult(code, runner.report(code, str(script), args, wall))
    # The script's objects die now, while torch's runtime is whole, as they do when
    # python runs the script itself. Left to the interpreter's teardown, a DDP
    # model's reference cycles were freed after the process group's threads were
    # gone, and torchrun's ranks aborted ("terminate called without an active
    # exception", SIGABRT) after a run that had succeeded.
    del runner
    gc.collect()
    return result


def _print_script_traceback(exc: BaseException, script: str) -> None:
    """The traceback from the script's own frame on (not ampkit's and runpy's frames
    that ran it), as ``python script.py`` prints it."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb if tb is not None else exc.__traceback__)
