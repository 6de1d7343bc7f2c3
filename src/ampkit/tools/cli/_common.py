"""Checks shared by the ``ampkit`` sub-commands."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampkit._internal.paths import unwritable_reason


def add_command(sub: Any, name: str, summary: str, doc: str | None) -> argparse.ArgumentParser:
    """Add sub-command ``name`` to ``sub`` (an argparse sub-parsers object): ``summary``
    for ``ampkit --help``; ``ampkit NAME --help`` describes it with ``doc`` (the
    command module's docstring), its reST markup taken off."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc or "").replace("``", "")
    return sub.add_parser(name, help=summary, description=" ".join(text.split()))


def add_script_arguments(parser: argparse.ArgumentParser) -> None:
    """The trailing ``SCRIPT [ARGS...]`` of the commands that run a training script."""
    parser.add_argument("script", help="the training script (a .py file)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


class UsageError(Exception):
    """Bad command-line input to ``ampkit`` or a sub-command: printed as one line, exit
    code 2."""


def writable(path: Path) -> bool:
    """Whether a file can be written at ``path``: it is no folder, and its folder
    exists and is writable."""
    return unwritable_reason(path) is None


def unwritable(path: Path | None, what: str, prog: str) -> str | None:
    """The one-line error for an output file ``path`` that is a folder or whose
    folder is missing or not writable (None when it can be written, or no path was
    given)."""
    reason = None if path is None else unwritable_reason(path)
    if reason is None:
        return None
    return f"{prog}: cannot write {what} to {str(path)!r} ({reason})"


def check_writable(path: Path | None, what: str, prog: str) -> None:
    """Raise :class:`UsageError` with :func:`unwritable`'s line if ``path`` cannot be written."""
    error = unwritable(path, what, prog)
    if error is not None:
        raise UsageError(error)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def float_between(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a number in [low, high]."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g}, got {v}")
        return v

    return parse
