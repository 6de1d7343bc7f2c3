"""LR schedulers and skipped steps.

A skipped step must not advance a per-step LR schedule, or the schedule runs ahead of
the parameters. Two ways, both explicit (ampkit never looks for schedulers itself):

- pass them: ``init_trainer(opt, schedulers=[sched])``: ampkit calls ``sched.step()``
  right after every real (not skipped) step of the scheduler's optimizer; the loop
  calls no ``sched.step()`` of its own (ampkit warns once if it does);
- or keep stepping them in the loop, guarded: ``if not amp.step_skipped(opt): sched.step()``.

Epoch-level schedulers (stepped once per epoch, ReduceLROnPlateau with its metric)
are stepped by the loop as usual: a skipped step inside an epoch does not concern them.

Every managed ``step()`` sets torch's ``optimizer._opt_called`` marker, skipped or not,
so a scheduler stepped after a skipped first step does not warn that
``lr_scheduler.step()`` came before ``optimizer.step()``.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ampkit._internal import torch_compat
from ampkit._internal.where import user_stacklevel
from ampkit.errors import StateError

from .device_skip import settle
from .extensions import StepExtension

__all__ = ["mark_step_called", "check_schedulers", "SchedulerStepper"]

_LR = torch.optim.lr_scheduler


def mark_step_called(optimizer: torch.optim.Optimizer) -> None:
    """Set torch's ``_opt_called`` marker: ``optimizer.step()`` was called (also when
    ampkit skipped it), so LR schedulers stepped next do not warn."""
    torch_compat.mark_optimizer_stepped(optimizer)


def check_schedulers(schedulers: Any, optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
    """Validate ``init_trainer``'s ``schedulers``: per-step LR schedulers of the given
    optimizers, each once. Returns them as a list; raises :class:`~ampkit.StateError`."""
    if schedulers is None:
        return []
    listed = list(schedulers) if isinstance(schedulers, (list, tuple)) else [schedulers]
    for sched in listed:
        if isinstance(sched, _LR.ReduceLROnPlateau):
            raise StateError(
                "init_trainer: ReduceLROnPlateau steps on a metric (sched.step(val_loss)), "
                "usually once per epoch: keep stepping it yourself and leave it out of "
                "schedulers=."
            )
        if not isinstance(sched, _LR.LRScheduler):
            raise StateError(
                "init_trainer: schedulers must be torch.optim.lr_scheduler.LRScheduler "
                f"objects, got {type(sched).__name__}."
            )
        if not any(sched.optimizer is opt for opt in optimizers):
            raise StateError(
                f"init_trainer: the {type(sched).__name__} in schedulers= drives an optimizer "
                "that is not in this init_trainer call; pass its optimizer too."
            )
    if len({id(s) for s in listed}) != len(listed):
        raise StateError("init_trainer: the same scheduler appears twice in schedulers=.")
    return listed


class SchedulerStepper(StepExtension):
    """Steps the per-step schedulers of one optimizer after each of its real steps (a
    :class:`~ampkit.trainer.extensions.StepExtension`: ``after_step(skipped=False)``). A scheduler whose ``last_epoch`` moved on by one since ampkit
    last stepped it was stepped by the loop too: warned about once (a larger move is a
    ``load_state_dict``, not a step).

    On a step skipped on the device (:mod:`ampkit.trainer.device_skip`), whose outcome
    the host records later, the schedulers step right after the update as if it was
    taken (what a reader of the learning rate sees after the usual, taken step), and a
    skipped outcome puts back each scheduler's state and the param groups'
    hyperparameters as they were, before anything reads them through ampkit or the
    next step uses them: a scheduler's ``state_dict``/``load_state_dict`` and the
    optimizer's record the outcome first. Only where no param group holds a tensor
    hyperparameter (a scheduler writes those in place); else the step is decided on
    the host."""

    def __init__(self, schedulers: Sequence[Any]) -> None:
        self.schedulers = list(schedulers)
        self._epochs = [s.last_epoch for s in self.schedulers]
        self._warned = False
        self._owner: Any = None
        self._undo: tuple[list[Any], list[dict], list[int]] | None = None

    @property  # type: ignore[override]
    def device_skip(self) -> bool:
        groups = self.schedulers[0].optimizer.param_groups
        return not any(torch.is_tensor(v) for g in groups for k, v in g.items() if k != "params")

    def on_add(self, optimizer: Any) -> None:
        self._owner = optimizer

    def after_update(self) -> None:
        owner = self._owner
        if owner is None or owner.pending_outcome is None:
            return  # decided on the host: after_step(skipped) steps them
        groups = self.schedulers[0].optimizer.param_groups
        self._undo = (
            [copy.deepcopy(s.state_dict()) for s in self.schedulers],
            [{k: v for k, v in g.items() if k != "params"} for g in groups],
            list(self._epochs),
        )
        self()
        for sched in self.schedulers:  # their own save/load see the outcome recorded
            for name in ("state_dict", "load_state_dict"):
                sched.__dict__[name] = functools.partial(_settled_first, owner, getattr(type(sched), name), sched)

    def after_step(self, skipped: bool) -> None:
        undo, self._undo = self._undo, None
        if undo is None:
            if not skipped:
                self()
            return
        for sched in self.schedulers:
            sched.__dict__.pop("state_dict", None)
            sched.__dict__.pop("load_state_dict", None)
        if skipped:  # stepped ahead of a step that turned out skipped: back
            states, hypers, self._epochs = undo
            for sched, state in zip(self.schedulers, states):
                sched.load_state_dict(state)
            for group, saved in zip(self.schedulers[0].optimizer.param_groups, hypers):
                group.update(saved)

    def __call__(self) -> None:
        for i, sched in enumerate(self.schedulers):
            if sched.last_epoch == self._epochs[i] + 1 and not self._warned:
                self._warned = True
                warnings.warn(
                    f"ampkit: this {type(sched).__name__} was passed to "
                    "init_trainer(schedulers=...), so ampkit steps it after every real "
                    "optimizer step, and it was stepped elsewhere too (it now advances "
                    "twice per step). Remove your sched.step() call, or leave it out of "
                    "schedulers= and write: if not amp.step_skipped(opt): sched.step()",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
            sched.step()
            self._epochs[i] = sched.last_epoch


def _settled_first(owner: Any, method: Any, sched: Any, *args: Any) -> Any:
    """``method(sched, *args)`` (a scheduler's ``state_dict`` or ``load_state_dict``)
    after ``owner``'s pending outcome is recorded."""
    settle(owner)
    return method(sched, *args)
