"""The one line an integration logs when ampkit takes over a framework's precision.

When :mod:`ampkit.integrations.hf`, :mod:`~ampkit.integrations.accelerate` or
:mod:`~ampkit.integrations.lightning` sets ampkit up inside its framework, it says so
once per process and framework (rank 0 alone in a distributed run)::

    ampkit O2 (bf16) manages precision for this Trainer (Hugging Face); the framework's own mixed precision is off

By default it is shown: where the application has configured logging (a handler on the
``"ampkit"`` logger or the root, e.g. ``logging.basicConfig()``), it is a record at
``INFO`` on the ``"ampkit"`` logger, which that configuration shows or hides as any
other; where it has not, logging's last-resort handler writes it to stderr. Never
through ``print`` or ``warnings``. ``logging.getLogger("ampkit").setLevel(logging.WARNING)``
silences it.
"""

from __future__ import annotations

import threading

import torch

from ampkit._internal import inform
from ampkit._internal.dist import is_rank_zero
from ampkit._internal.dtypes import dtype_name
from ampkit.levels.opt_level import is_fp32_level

__all__ = ["ANNOUNCED", "LOGGER_NAME", "announce", "banner"]

#: The logger the line goes to where logging is configured.
LOGGER_NAME = inform.LOGGER_NAME
#: The frameworks announced in this process (one line each, whatever the level).
ANNOUNCED: set[str] = set()
_LOCK = threading.Lock()


def banner(framework: str, what: str, level: str, dtype: torch.dtype | None) -> str:
    """The line itself: ``level`` (``"O2"``) in ``dtype`` (None, or a level computing
    nothing in 16 bits: fp32) manages precision for ``what`` (``"Trainer"``,
    ``"Accelerator"``) of ``framework`` (``"Hugging Face"``, ``"Accelerate"``, ``"Lightning"``)."""
    computes = "fp32" if dtype is None or is_fp32_level(level) else dtype_name(dtype)
    return (
        f"ampkit {level} ({computes}) manages precision for this {what} ({framework}); "
        "the framework's own mixed precision is off"
    )


def announce(framework: str, what: str, level: str, dtype: torch.dtype | None) -> bool:
    """Say :func:`banner` the first time ``framework`` is set up in this process: at
    ``INFO`` on the ``"ampkit"`` logger where logging is configured, else on stderr
    through logging's last-resort handler (see the module docstring). True when it was
    said now, False when ``framework`` was announced before (it is in :data:`ANNOUNCED`)
    or this process is not rank 0 of a distributed run (which speaks for all ranks).

    Args:
        framework: the framework's name, the key of "once per process".
        what: the object of the framework ampkit runs in (``"Trainer"``).
        level: the opt level's name (``"O2"``).
        dtype: the compute dtype (None: fp32)."""
    with _LOCK:
        if framework in ANNOUNCED:
            return False
        ANNOUNCED.add(framework)
    if not is_rank_zero():
        return False
    inform.inform("%s", banner(framework, what, level, dtype))
    return True
