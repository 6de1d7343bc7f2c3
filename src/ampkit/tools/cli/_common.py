"""Checks shared by the ``ampkit`` sub-commands."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ampkit._internal.paths import unwritable_reason
from ampkit.errors import AmpError


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


def unwritable(path: Path | None, what: str, prog: str) -> str | None:
    """The one-line error for an output file ``path`` that is a folder, a symlink, a
    FIFO or a device, or whose folder is missing or not writable (None when it can be
    written, or no path was given)."""
    reason = None if path is None else unwritable_reason(path)
    if reason is None:
        return None
    return f"{prog}: cannot write {what} to {str(path)!r} ({reason})"


def check_writable(path: Path | None, what: str, prog: str, inputs: Iterable[Path | str | None] = ()) -> None:
    """Raise :class:`UsageError` with :func:`unwritable`'s line if ``path`` cannot be
    written, or one naming the input it would overwrite if ``path`` is one of
    ``inputs`` (the script, the checkpoint: an output never replaces an input)."""
    error = unwritable(path, what, prog)
    if error is not None:
        raise UsageError(error)
    if path is None:
        return
    for source in inputs:
        if source is not None and _same_file(Path(path), Path(source)):
            raise UsageError(f"{prog}: {what} would overwrite the input {str(source)!r}; choose another path")


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def launch_path(path: Path | None) -> Path | None:
    """``path`` made absolute against the current folder now, at launch (a script that
    changes folder does not move the command's output files); None stays None."""
    return None if path is None else Path(path).absolute()


def write_output(path: Path, write: Callable[[Path], Any], what: str, prog: str) -> None:
    """``write(path)`` (which writes through :mod:`ampkit._internal.files`): its
    :class:`ampkit.AmpError` (a special file or a folder gone since the check), or an
    OS error (a full disk), turned into :class:`UsageError`'s one line."""
    try:
        write(path)
    except AmpError as exc:
        raise UsageError(f"{prog}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{prog}: cannot write {what} to {str(path)!r} ({exc.strerror or exc})") from None


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


def thread_count(text: str) -> int:
    """An argparse type: CPU threads, 1 to this machine's CPU count (more oversubscribes,
    and torch.set_num_threads crashes on absurd values)."""
    return int_between(1, max(1, os.cpu_count() or 1))(text)


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
        if not math.isfinite(v) or not low <= v <= high:
            bounds = f"between {low:g} and {high:g}" if math.isfinite(high) else f"a finite number >= {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return v

    return parse
