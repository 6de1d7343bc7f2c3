"""Checks shared by the ``ampkit`` sub-commands."""

from __future__ import annotations

import os
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
