"""Logging as a plain script has it, for tests of what ampkit shows by default.

pytest puts capture handlers on the root logger for each phase of a test (setup, call,
teardown), so a fixture cannot take them off for the test body: :func:`unconfigured_logging`
is entered inside the test."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def unconfigured_logging() -> Iterator[None]:
    """No handler on the root or the ``"ampkit"`` logger, ``"ampkit"`` at NOTSET and the
    root at WARNING (Python's defaults); each put back as it was on exit."""
    root, ours = logging.getLogger(), logging.getLogger("ampkit")
    saved = (root.handlers[:], root.level, ours.handlers[:], ours.level)
    root.handlers.clear()
    ours.handlers.clear()
    root.setLevel(logging.WARNING)
    ours.setLevel(logging.NOTSET)
    try:
        assert not ours.hasHandlers()
        yield
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        ours.handlers[:] = saved[2]
        ours.setLevel(saved[3])


class Records(logging.Handler):
    """A handler keeping the records it is given."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def configured_logging(level: int = logging.INFO) -> Iterator[Records]:
    """An application's logging: :func:`unconfigured_logging` plus a :class:`Records`
    handler on the root, which is at ``level``; yields the handler."""
    handler = Records()
    root = logging.getLogger()
    with unconfigured_logging():
        root.addHandler(handler)
        root.setLevel(level)
        yield handler
