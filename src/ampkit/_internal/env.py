"""Defaults a launcher or a sweep sets without editing code: ``AMPKIT_LEVEL`` (the opt
level) and ``AMPKIT_DTYPE`` (the 16-bit compute dtype), read where a call leaves them
open -- ``ampkit.initialize``, ``ampkit.init``, ``ampkit run`` and the integrations.
Precedence: an argument > the environment > ampkit's default. A value that names no
level or dtype raises :class:`ampkit.AmpError` naming the variable."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ampkit._internal.dtypes import LOW_PRECISION_BY_NAME
from ampkit.errors import AmpError

__all__ = ["LEVEL_VAR", "DTYPE_VAR", "level_from_env", "dtype_from_env"]

LEVEL_VAR = "AMPKIT_LEVEL"
DTYPE_VAR = "AMPKIT_DTYPE"


def level_from_env(default: str, levels: Sequence[str]) -> str:
    """``AMPKIT_LEVEL`` (upper-cased) if set and not empty, else ``default``. Raises
    :class:`~ampkit.AmpError` when it is set to something outside ``levels``."""
    value = os.environ.get(LEVEL_VAR, "").strip()
    if not value:
        return default
    for level in levels:
        if value.upper() == level.upper():
            return level
    raise AmpError(
        f"{LEVEL_VAR}={value!r} in the environment names no opt level here; set one of "
        f"{', '.join(levels)}, or unset it (an argument given in the code takes precedence)."
    )


def dtype_from_env() -> torch.dtype | None:
    """``AMPKIT_DTYPE`` as a torch dtype (``bf16``/``bfloat16``, ``fp16``/``float16``,
    any case) if set and not empty, else None. Raises :class:`~ampkit.AmpError` for
    another value."""
    value = os.environ.get(DTYPE_VAR, "").strip()
    if not value:
        return None
    dtype = LOW_PRECISION_BY_NAME.get(value.lower())
    if dtype is None:
        raise AmpError(
            f"{DTYPE_VAR}={value!r} in the environment is no 16-bit dtype ampkit computes in; "
            "set bf16 (bfloat16) or fp16 (float16), or unset it."
        )
    return dtype
