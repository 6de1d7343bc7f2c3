"""The run's view of optimizer steps, per optimizer (no process-wide optimizer hooks:
those would run on every optimizer of the process and keep every managed step decided
on the host, :mod:`ampkit.trainer.device_skip`).

- :class:`_StepWatch`, a :class:`~ampkit.trainer.extensions.StepExtension` on each
  managed optimizer: the time of its updates and each step (taken or skipped) reported
  as it happens, also for a step skipped on the device whose outcome the host records
  later (``device_skip = True``);
- :class:`_UnmanagedSteps`: step pre/post hooks on the instances of the optimizers
  ampkit does not manage (the fp32 run, an optimizer left alone, one superseded),
  removed when the run ends.

Both report to the run through a :class:`_StepEvents`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ampkit.trainer.extensions import StepExtension


@dataclasses.dataclass(frozen=True)
class _StepEvents:
    """What the run is told of: ``update_starts()`` right before an optimizer's own
    update (may refuse the run), ``update_seconds(s)`` its duration after, and
    ``stepped(ref)`` once per ``step()`` call of the optimizer ``ref`` refers to, taken
    or skipped, when the call returns (for an unmanaged optimizer: its taken steps, the
    only ones it has)."""

    update_starts: Callable[[], None]
    update_seconds: Callable[[float], None]
    stepped: Callable[[weakref.ref], None]


class _StepWatch(StepExtension):
    """The run's extension of one managed optimizer (see :class:`_StepEvents`).

    A step decided on the host is reported at its ``after_step`` (taken or skipped, at
    once). A step skipped on the device runs ``before_update``/``after_update`` around
    an update whose outcome is not known yet: it is reported at ``after_update``, when
    ``step()`` returns as a taken step does, and its ``after_step``, which comes when the
    host records the outcome, passes. An update that raises is no step of the run, on
    either path (its ``after_step`` never runs on the host path)."""

    device_skip = True

    def __init__(self, events: _StepEvents, optimizer: torch.optim.Optimizer) -> None:
        self._events = events
        self._ref = weakref.ref(optimizer)
        self._owner: Any = None  # the ManagedOptimizer this is added to
        self._started = 0.0
        self._handling: BaseException | None = None  # the exception handled around the update's start
        self._reported = False  # the pending step was reported at its update: its after_step passes

    def on_add(self, optimizer: Any) -> None:
        self._owner = optimizer

    def _pending(self) -> bool:
        return self._owner is not None and self._owner.pending_outcome is not None

    def before_update(self, args: tuple, kwargs: dict) -> None:
        self._handling = sys.exc_info()[1]
        self._started = time.perf_counter()
        try:
            self._events.update_starts()
        except BaseException:
            self._reported = self._pending()  # refused: no step of the run
            raise

    def after_update(self) -> None:
        self._events.update_seconds(time.perf_counter() - self._started)
        if self._pending() and sys.exc_info()[1] is self._handling:  # returned, not raised
            self._reported = True
            self._events.stepped(self._ref)

    def on_error(self) -> None:
        if self._pending():
            self._reported = True

    def after_step(self, skipped: bool) -> None:
        if self._reported:
            self._reported = False
            return
        self._events.stepped(self._ref)


class _UnmanagedSteps:
    """Step pre/post hooks on the optimizers ampkit does not manage (:meth:`watch`),
    reporting their updates and taken steps; :meth:`remove` takes them all off."""

    def __init__(self, events: _StepEvents) -> None:
        self._events = events
        self._handles: list[Any] = []
        self._watched: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook ``optimizer``'s steps (once)."""
        if optimizer in self._watched:
            return
        self._watched.add(optimizer)
        events, ref = self._events, weakref.ref(optimizer)
        started = [0.0]

        # plain functions (not bound methods): a copy.deepcopy of the optimizer copies
        # its hook dicts, and leaves functions as they are
        def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            started[0] = time.perf_counter()
            events.update_starts()

        def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            events.update_seconds(time.perf_counter() - started[0])
            events.stepped(ref)

        self._handles += [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._watched = weakref.WeakSet()
