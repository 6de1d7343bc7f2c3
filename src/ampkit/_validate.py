"""Argument checks shared by ampkit's constructors and verbs: one message format for
each kind of bad argument."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .errors import AmpError


def require_optimizer(obj: Any, who: str, error: type[AmpError] = AmpError) -> None:
    """Raise ``error`` unless ``obj`` is a ``torch.optim.Optimizer`` (``who`` names the
    caller in the message)."""
    if not isinstance(obj, torch.optim.Optimizer):
        raise error(f"{who} expects a torch.optim.Optimizer, got {type(obj).__name__}.")


def require_choice(value: Any, choices: Sequence[Any], what: str, error: type[AmpError] = AmpError) -> None:
    """Raise ``error`` unless ``value`` is one of ``choices`` (``what`` names the argument)."""
    if value not in choices:
        raise error(f"{what} must be one of {tuple(choices)}, got {value!r}.")
