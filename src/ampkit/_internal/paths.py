"""Output files: check that a path can be written before the work that fills it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ampkit.errors import AmpError, OutputPathError


def unwritable_reason(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (None when it can)."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        return "it is a folder; give a file name"
    if not parent.is_dir():
        return f"folder {str(parent)!r} does not exist"
    if not os.access(parent, os.W_OK):
        return f"folder {str(parent)!r} is not writable"
    return None


def output_path(path: Any, what: str, error: type[AmpError] = OutputPathError) -> Path:
    """``path`` (a ``str`` or ``os.PathLike``) as a :class:`~pathlib.Path` that can be
    written, else raise ``error`` saying why; ``what`` names the file in the message."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise error(f"{what}: expected a file path (str or os.PathLike), got {type(path).__name__} {path!r:.60}.")
    out = Path(path)
    reason = unwritable_reason(out)
    if reason is not None:
        raise error(f"cannot write {what} to {str(out)!r}: {reason}.")
    return out
