"""Registry of process-wide state to drop on :func:`ampkit.reset`.

Each subsystem that keeps global state (the casting engine under ``amp.init``,
the current AMP session, registered optimizers) registers a callable here at
import time; ``reset`` calls them all, most recently registered first.
"""

from __future__ import annotations

from collections.abc import Callable

_RESETTERS: list[Callable[[], None]] = []


def on_reset(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn`` to run on :func:`reset`; usable as a decorator."""
    _RESETTERS.append(fn)
    return fn


def reset() -> None:
    """Turn ampkit's process-wide state off: global casting, the current session
    and every optimizer integration. Objects you hold (policies, scalers) stay usable."""
    for fn in reversed(_RESETTERS):
        fn()
