"""Checks shared by the ``ampkit`` sub-commands."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path


def unwritable(path: Path | None, what: str, prog: str) -> str | None:
    """The one-line error for an output file ``path`` whose folder is missing or not
    writable (None when it can be written, or no path was given)."""
    if path is None:
        return None
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        return f"{prog}: cannot write {what} to {str(path)!r} (folder missing or not writable)"
    return None


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
