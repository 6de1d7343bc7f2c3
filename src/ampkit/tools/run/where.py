"""Where in the script a call came from: the ``file:line`` that ``ampkit run``'s
notes and report name."""

from __future__ import annotations

import sys
from pathlib import Path

from ampkit._internal.where import SKIPPED_PATHS


def _user_site() -> str:
    """``file:line`` of the first frame outside ampkit, torch and contextlib (the
    script's line that called into them)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(SKIPPED_PATHS):
        frame = frame.f_back
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
