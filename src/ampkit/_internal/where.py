"""Where a warning should point: the user's line, not ampkit's (nor torch's)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

# Code whose frames a warning skips: ampkit, torch, and contextlib (scale_loss and
# autocast blocks are generator-based context managers).
SKIPPED_PATHS = (
    str(Path(__file__).resolve().parent.parent),  # the ampkit package
    str(Path(torch.__file__).resolve().parent),
    str(Path(contextlib.__file__).resolve()),
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn`` (or a ``logging`` call), made in
    the function that calls this, report the first frame outside ampkit, torch and
    contextlib: the line of the user's script that led there."""
    frame = sys._getframe(1)  # the caller of this function: stacklevel 1
    level = 1
    while frame is not None:
        if not frame.f_code.co_filename.startswith(SKIPPED_PATHS):
            return level
        frame = frame.f_back
        level += 1
    return 1
