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
    """Undo ``ampkit.init``, ``init_trainer`` and ``initialize``. Objects you hold
    (policies, scalers, models) stay usable.

    Threads and processes, the one rule: *casting* is per thread, like
    ``torch.autocast``'s own state -- :func:`ampkit.init` turns it on for the calling
    thread only (other threads, running or started later, are not affected; replica
    threads of ``nn.DataParallel`` run under their caller's scopes), and ``reset``
    turns it off for the calling thread only. Everything else is per *process*: the
    AMP session (:func:`ampkit.state_dict`), every optimizer set up by
    ``init_trainer``/``initialize`` (released: their own ``step`` comes back) and the
    state of the opt levels; ``reset`` from any thread drops them all. ampkit's
    registered kernels and global module hooks are removed by a ``reset`` only in a
    process's one thread with no scope open; with other threads alive,
    :func:`ampkit.casting.release_kernels` removes them when you know those threads run
    no torch ops (see there how kept kernels differ from torch's own)."""
    for fn in reversed(_RESETTERS):
        fn()
