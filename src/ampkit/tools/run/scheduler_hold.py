"""LR schedulers held on skipped steps: :class:`_SchedulerHold`."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

from ampkit.trainer.managed import resolve_optimizer

from .steps import _StepWatch


class _SchedulerHold:
    """For the run, ``step()`` of torch's LR schedulers (the base class and the
    subclasses with a ``step`` of their own; not ReduceLROnPlateau, which follows a
    metric) does nothing while the scheduler's optimizer is managed and its last step
    was skipped: the script's ``sched.step()`` after a skipped step leaves the schedule
    where the parameters are. Class attributes, restored at exit (nothing is stored on
    the schedulers: their ``state_dict()`` is their ``__dict__``).

    A step whose outcome the host has not recorded yet (skipped on the device,
    :mod:`ampkit.trainer.device_skip`) is not asked for it: that would wait for the
    device. The scheduler steps ahead, and should the step turn out skipped when the
    host records it (at the next step, or when anything reads what it changes), the
    run's :class:`~ampkit.tools.run.steps._StepWatch` of that optimizer puts the
    scheduler and the optimizer's hyperparameters back as they were (and counts the
    step held). The scheduler's own ``state_dict``/``load_state_dict`` record the
    outcome first."""

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
            state = getattr(resolve_optimizer(opt), "__dict__", {}).get("_ampkit_managed") if opt is not None else None
            if state is None:
                return orig(sched, *args, **kwargs)
            watch = _watch_of(state) if state.pending_outcome is not None else None
            if watch is not None:
                return hold._step_ahead(watch, orig, sched, args, kwargs)
            if last_skipped(opt):
                hold.held += 1
                return None
            return orig(sched, *args, **kwargs)

        return step

    def _step_ahead(self, watch: _StepWatch, orig: Callable[..., Any], sched: Any, args: tuple, kwargs: dict) -> Any:
        """``sched.step()`` before the host knows whether the step it follows was
        skipped; undone by ``watch`` if it was."""
        undo = _Undo(self, sched)
        watch.undo_if_skipped.append(undo)  # before the step: nested schedulers undo innermost first
        try:
            result = orig(sched, *args, **kwargs)
        except BaseException:
            watch.undo_if_skipped.remove(undo)
            undo.forget()
            raise
        return result


_SETTLING = ("state_dict", "load_state_dict")


class _Undo:
    """A scheduler's state and its optimizer's hyperparameters as they were before a
    step ahead; called, puts them back and counts the step held. Meanwhile the
    scheduler's own ``state_dict``/``load_state_dict`` first record the pending outcome
    (which may call this)."""

    def __init__(self, hold: _SchedulerHold, sched: Any) -> None:
        self._hold = hold
        self._sched = sched
        state = type(sched).state_dict(sched)  # (not an instance's settling one, nor it in the state)
        self._state = copy.deepcopy({k: v for k, v in state.items() if k not in _SETTLING})
        groups = sched.optimizer.param_groups
        self._hypers = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        owner = getattr(resolve_optimizer(sched.optimizer), "__dict__", {}).get("_ampkit_managed")
        for name in _SETTLING:
            if name not in sched.__dict__:
                sched.__dict__[name] = functools.partial(_settled_first, owner, getattr(type(sched), name), sched)

    def forget(self) -> None:
        for name in _SETTLING:
            sched_method = self._sched.__dict__.get(name)
            if isinstance(sched_method, functools.partial) and sched_method.func is _settled_first:
                del self._sched.__dict__[name]

    def __call__(self, skipped: bool) -> None:
        self.forget()
        if not skipped:
            return
        type(self._sched).load_state_dict(self._sched, self._state)
        for group, saved in zip(self._sched.optimizer.param_groups, self._hypers):
            group.update(saved)
        self._hold.held += 1


def _settled_first(owner: Any, method: Callable[..., Any], sched: Any, *args: Any) -> Any:
    from ampkit.trainer.device_skip import settle

    if owner is not None:
        settle(owner)
    return method(sched, *args)


def _watch_of(state: Any) -> _StepWatch | None:
    """The run's step watch among the managed optimizer's extensions (None: not the run's)."""
    return next((ext for ext in state.extensions if isinstance(ext, _StepWatch)), None)
