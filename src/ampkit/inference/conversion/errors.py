"""The errors of :func:`ampkit.convert`."""

from __future__ import annotations

from ampkit.errors import AmpError

__all__ = ["ConversionError", "NonFiniteError"]


class ConversionError(AmpError, ValueError):
    """:func:`convert` cannot do what was asked: bad arguments, a checkpoint that does
    not fit the model, or an accuracy budget no choice of fp32 modules meets."""


class NonFiniteError(ConversionError):
    """The model to convert holds NaN/inf weights, or the fp32 model's own outputs
    on the calibration batches are NaN: a conversion can neither be built from it nor
    measured against it."""
