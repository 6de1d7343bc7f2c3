"""Run a training script with the doctor on (``ampkit doctor script.py [args]``)."""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import Any

from . import _core


class ScriptError(Exception):
    """The script cannot be run (not found, not a file): one line for the user."""


def run_script(path: str | Path, args: list[str]) -> tuple[int, list[Any]]:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]`` and the doctor on
    for every optimizer it passes to ``init_trainer``/``initialize`` (the process-wide
    doctor, as ``AMPKIT_DOCTOR=1`` does). Returns the script's exit code (0, its
    ``sys.exit`` code, or 1 after an uncaught exception, whose traceback is printed on
    stderr) and the reports of the doctors that ran, in order.

    ``sys.argv``, ``sys.path[0]`` and the environment variable are restored after, and
    the doctor is stopped (its hooks removed) when the script ends."""
    script = Path(path)
    if not script.exists():
        raise ScriptError(f"no such file: {str(script)!r}")
    if not script.is_file():
        raise ScriptError(f"not a file: {str(script)!r} (pass a Python script)")
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    saved_env = os.environ.get(_core.ENV)
    os.environ[_core.ENV] = "1"
    _core._KEEP_FINISHED = True
    _core._FINISHED.clear()
    sys.argv = [str(script), *args]
    if sys.path:
        sys.path[0] = str(script.resolve().parent)
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # the script failed: show it as Python would, report anyway
        traceback.print_exc()
        code = 1
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        if saved_env is None:
            os.environ.pop(_core.ENV, None)
        else:
            os.environ[_core.ENV] = saved_env
        _core._stop_global()  # the doctor of a script that did not call ampkit.reset()
        _core._KEEP_FINISHED = False
    doctors = list(_core._FINISHED)
    _core._FINISHED.clear()
    return code, [d.report() for d in doctors]


def _exit_code(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)  # sys.exit("message") prints it and exits with 1
    return 1
