"""Checks shared by the ``ampkit`` sub-commands."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path


class UsageError(Exception):
    """Bad command-line input to ``ampkit`` or a sub-command: printed as one line, exit
    code 2."""


def writable(path: Path) -> bool:
    """Whether a file can be written at ``path``: its folder exists and is writable."""
    parent = path.parent if str(path.parent) else Path(".")
    return parent.is_dir() and os.access(parent, os.W_OK)


def unwritable(path: Path | None, what: str, prog: str) -> str | None:
    """The one-line error for an output file ``path`` whose folder is missing or not
    writable (None when it can be written, or no path was given)."""
    if path is None or writable(path):
        return None
    return f"{prog}: cannot write {what} to {str(path)!r} (folder missing or not writable)"


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
