"""Output files: check that a path can be written before the work that fills it.

Both names delegate to :mod:`ampkit._internal.files`, whose writer refuses the same
targets: a folder, a symlink, a FIFO, a device node or a socket at the name, a folder
that is missing, read-only or in which no file can be created."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ampkit._internal.files import check_target, target_problem
from ampkit.errors import AmpError, OutputPathError

__all__ = ["output_path", "unwritable_reason"]


def unwritable_reason(path: Path) -> str | None:
    """Why ampkit will not write a file at ``path`` (None when it will)."""
    return target_problem(Path(path))


def output_path(path: Any, what: str, error: type[AmpError] = OutputPathError) -> Path:
    """``path`` (a ``str`` or ``os.PathLike``) as a :class:`~pathlib.Path` that can be
    written, else raise ``error`` saying why; ``what`` names the file in the message."""
    return check_target(path, what, error)
