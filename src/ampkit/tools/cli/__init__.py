"""The ``ampkit`` command line (``ampkit bench``); entry point :func:`main`."""

from __future__ import annotations

from .main import main

__all__ = ["main"]
