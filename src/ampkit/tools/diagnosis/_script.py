"""Run a training script with the doctor on (``ampkit doctor script.py [args]``)."""

from __future__ import annotations

import os
import runpy
import traceback
from pathlib import Path
from typing import Any

from ampkit._internal.script import ScriptError, check_script, exit_code, script_argv

from . import _core

__all__ = ["ScriptError", "run_script"]


def run_script(path: str | Path, args: list[str]) -> tuple[int, list[Any]]:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]`` and the doctor on
    for every optimizer it passes to ``init_trainer``/``initialize`` (the process-wide
    doctor, as ``AMPKIT_DOCTOR=1`` does). Returns the script's exit code (0, its
    ``sys.exit`` code, or 1 after an uncaught exception, whose traceback is printed on
    stderr) and the reports of the doctors that ran, in order.

    ``sys.argv``, ``sys.path[0]`` and the environment variable are restored after, and
    the doctor is stopped (its hooks removed) when the script ends."""
    script = check_script(path)
    saved_env = os.environ.get(_core.ENV)
    os.environ[_core.ENV] = "1"
    _core._KEEP_FINISHED = True
    _core._FINISHED.clear()
    code = 0
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
        if saved_env is None:
            os.environ.pop(_core.ENV, None)
        else:
            os.environ[_core.ENV] = saved_env
        _core._stop_global()  # the doctor of a script that did not call ampkit.reset()
        _core._KEEP_FINISHED = False
    doctors = list(_core._FINISHED)
    _core._FINISHED.clear()
    return code, [d.report() for d in doctors]

