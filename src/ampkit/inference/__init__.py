"""Serving a trained model in 16 bits: :func:`convert` (calibrated per-module
decisions under an error budget, BatchNorm folding, fp32 islands) and export
(:func:`export_program`, :func:`export_onnx`; onnx is imported only when exporting)."""

from __future__ import annotations

from .conversion import (
    Budget,
    ConversionError,
    ConversionReport,
    NonFiniteError,
    OutputError,
    convert,
    fp32_weights,
)
from .export import OnnxExport, export_onnx, export_program

__all__ = [
    "Budget",
    "ConversionError",
    "ConversionReport",
    "NonFiniteError",
    "OnnxExport",
    "OutputError",
    "convert",
    "export_onnx",
    "export_program",
    "fp32_weights",
]
