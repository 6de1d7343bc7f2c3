"""Errors raised by ampkit.

Every error ampkit raises on purpose is an :class:`AmpError`, so one ``except``
catches them all. Each message says what was wrong and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "AmpError",
    "PolicyError",
    "ScalerError",
    "NumericsError",
    "StateError",
    "DistributedError",
    "OutputPathError",
]


class AmpError(Exception):
    """Base class of every error raised by ampkit."""


class PolicyError(AmpError, ValueError):
    """A :class:`~ampkit.Policy` (or an argument that builds one) is invalid:
    an op in two categories, a name that is no torch function, an unsupported
    dtype or device type."""


class ScalerError(AmpError, ValueError):
    """A loss scaler was configured or used incorrectly."""


class NumericsError(AmpError, FloatingPointError):
    """Training keeps producing non-finite gradients and loss scaling cannot
    recover (the scale sits at its floor, or too many steps were skipped in a row)."""


class StateError(AmpError, RuntimeError):
    """An ampkit verb was called in the wrong order or on an object ampkit does
    not manage (e.g. ``scale_loss`` on an optimizer never passed to ``init_trainer``),
    or a state dict does not fit the current session."""


class DistributedError(AmpError, RuntimeError):
    """A distributed setup ampkit cannot support, or ranks that disagree."""


class OutputPathError(AmpError, ValueError):
    """An output path given to ampkit cannot be written: not a path, a folder, or in a
    folder that is missing or not writable. Raised before any work is done."""
