"""Lines a user should see without configuring anything: :func:`ampkit.tune`'s progress
(``progress=None``) and the banner of an integration taking over a framework's precision.

Python's logging shows no INFO until an application configures it, so an INFO record on
the ``"ampkit"`` logger alone would say nothing to most users. :func:`inform` sends a line
through logging either way:

- logging configured (a handler on the ``"ampkit"`` logger or above it, the root's
  included: ``logger.hasHandlers()``): the ``"ampkit"`` logger at INFO, which the
  application's levels and handlers then show or hide, as any record;
- not configured: logging's own last-resort handler (``logging.lastResort``), which writes
  the bare message to stderr, as logging shows a warning nobody configured a handler for;
  unless the ``"ampkit"`` logger was quietened (a level above INFO set on it, disabled,
  a filter refusing the record, ``logging.disable(logging.INFO)``, or
  ``logging.lastResort = None``).

Never ``print``: the line stays a log record, with the ``"ampkit"`` logger's name and level.
"""

from __future__ import annotations

import logging

__all__ = ["LOGGER_NAME", "inform", "shows"]

#: The logger the lines go to.
LOGGER_NAME = "ampkit"
_LOG = logging.getLogger(LOGGER_NAME)


def _configured() -> bool:
    return _LOG.hasHandlers()


def _unconfigured_shows() -> bool:
    """Whether the last-resort handler is to show an INFO line of an unconfigured logging."""
    if logging.lastResort is None or _LOG.disabled or _LOG.manager.disable >= logging.INFO:
        return False
    return _LOG.level <= logging.INFO  # NOTSET (0) too: the root's WARNING is no choice of the user's


def shows() -> bool:
    """Whether :func:`inform` shows a line now (a caller may skip the work of making
    lines that go nowhere)."""
    return _LOG.isEnabledFor(logging.INFO) if _configured() else _unconfigured_shows()


def inform(msg: str, *args: object) -> None:
    """Say ``msg % args`` at INFO on the ``"ampkit"`` logger, or, where logging is not
    configured, on stderr through ``logging.lastResort`` (see the module docstring)."""
    if _configured():
        _LOG.info(msg, *args, stacklevel=2)
        return
    handler = logging.lastResort
    if handler is None or not _unconfigured_shows():
        return
    record = _LOG.makeRecord(_LOG.name, logging.INFO, "(ampkit)", 0, msg, args, None)
    if _LOG.filter(record):
        handler.handle(record)
