"""Diagnostic collection across layers: a per-thread stack of open collectors.

A diagnostic run (``ampkit.explain``) opens a collector; code of any layer that has
something to report while one is open (an fp8 matmul: its operands' dtypes and
scales) appends a record to every collector open in this thread. The collector is
generic, so the casting layer's ``explain`` collects records of the levels above it
without importing them. Per thread: a diagnostic run in one thread neither collects
another thread's records nor changes what that thread does."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["collecting", "collector", "emit"]

_LOCAL = threading.local()


def _stack() -> list[list[Any]]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def collecting() -> bool:
    """Whether a collector is open in this thread (code may then skip state updates a
    diagnostic run must not make, e.g. advancing fp8 scale histories)."""
    return bool(_stack())


def emit(record: Any) -> None:
    """Append ``record`` to every collector open in this thread (nothing if none)."""
    for records in _stack():
        records.append(record)


class collector:
    """``with collector() as records:`` gathers what :func:`emit` reports in this thread
    until the block exits (the list stays valid afterwards). Each collector removes
    only itself on exit, so nesting and exceptions leave the stack as they found it."""

    def __enter__(self) -> list[Any]:
        self.records: list[Any] = []
        _stack().append(self.records)
        return self.records

    def __exit__(self, *exc: object) -> None:
        stack = _stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self.records:
                del stack[i]
                break
