"""Running a user's script as ``__main__`` (``ampkit doctor``, ``ampkit run``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ampkit.errors import AmpError


def exit_code(value: Any) -> int:
    """The process exit code of ``SystemExit(value)``, as Python computes it: None is 0,
    an int is itself (a bool its int: ``SystemExit(True)`` exits with 1), anything
    else is printed on stderr and gives 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return int(value)
    print(value, file=sys.stderr)  # sys.exit("message") prints it and exits with 1
    return 1


class ScriptError(AmpError):
    """The script ``ampkit run``/``ampkit doctor`` was given cannot be run (no such
    file, not a file): one line for the user, exit 2."""


def check_script(path: str | Path) -> Path:
    """``path`` as a Path; raises :class:`ScriptError` with a one-line message when it
    is no file."""
    script = Path(path)
    if not script.exists():
        raise ScriptError(f"no such file: {str(script)!r}")
    if not script.is_file():
        raise ScriptError(f"not a file: {str(script)!r} (pass a Python script)")
    return script


@contextlib.contextmanager
def script_argv(script: Path, args: list[str]) -> Iterator[None]:
    """``sys.argv = [script, *args]`` and ``sys.path[0]`` = the script's folder, as
    ``python script.py args`` sets them; both restored on exit."""
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [str(script), *args]
    if sys.path:
        sys.path[0] = str(script.resolve().parent)
    try:
        yield
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
