"""LR schedulers held on skipped steps: :class:`_SchedulerHold`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


class _SchedulerHold:
    """For the run, ``step()`` of torch's LR schedulers (the base class and the
    subclasses with a ``step`` of their own; not ReduceLROnPlateau, which follows a
    metric) does nothing while the scheduler's optimizer is managed and its last step
    was skipped: the script's ``sched.step()`` after a skipped step leaves the schedule
    where the parameters are. Class attributes, restored at exit (nothing is stored on
    the schedulers: their ``state_dict()`` is their ``__dict__``)."""

    def __init__(self) -> None:
        self._saved: list[tuple[type, Any]] = []
        self.held = 0

    def install(self) -> None:
        lr = torch.optim.lr_scheduler
        classes = [lr.LRScheduler] + [
            c for c in vars(lr).values()
            if isinstance(c, type) and issubclass(c, lr.LRScheduler) and c is not lr.LRScheduler
            and not issubclass(c, lr.ReduceLROnPlateau) and "step" in c.__dict__
        ]
        for cls in classes:
            orig = cls.__dict__["step"]
            self._saved.append((cls, orig))
            cls.step = self._held(orig)  # type: ignore[method-assign]

    def remove(self) -> None:
        while self._saved:
            cls, orig = self._saved.pop()
            cls.step = orig  # type: ignore[method-assign]

    def _held(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        from ampkit.trainer.managed import last_skipped

        hold = self

        @functools.wraps(orig)
        def step(sched: Any, *args: Any, **kwargs: Any) -> Any:
            opt = getattr(sched, "optimizer", None)
            if opt is not None and last_skipped(opt) and "_ampkit_managed" in opt.__dict__:
                hold.held += 1
                return None
            return orig(sched, *args, **kwargs)

        return step
