"""The two things the lower parts of the engine need from ``_scopes``, which builds
on them: opening a scope (a module rule opens one around its module) and re-entering
recorded scopes (a replica thread of ``DataParallel`` takes its caller's). ``_scopes``
installs them here when it is imported (``ampkit.casting`` imports it), so the module
graph has no cycle."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["install", "open_scope", "replay"]

# Engine state: installed once by ._scopes at import.
_OPEN: Callable[..., AbstractContextManager[Any]] | None = None
_REPLAY: Callable[[list[Any]], AbstractContextManager[Any]] | None = None


def install(
    open_scope: Callable[..., AbstractContextManager[Any]],
    replay: Callable[[list[Any]], AbstractContextManager[Any]],
) -> None:
    """Called by ``_scopes`` at import."""
    global _OPEN, _REPLAY
    _OPEN, _REPLAY = open_scope, replay


def open_scope(*args: Any, **kwargs: Any) -> AbstractContextManager[Any]:
    """``_scopes.open_scope`` (a scope of a policy; ``enabled=False`` for fp32)."""
    assert _OPEN is not None, "ampkit.casting._scopes installs the scope API at import"
    return _OPEN(*args, **kwargs)


def replay(frames: list[Any]) -> AbstractContextManager[Any]:
    """A context that re-enters the recorded scope ``frames`` (``_Frame`` objects) of
    another thread, with no module calls of its own."""
    assert _REPLAY is not None, "ampkit.casting._scopes installs the scope API at import"
    return _REPLAY(frames)
