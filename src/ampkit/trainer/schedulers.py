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

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ampkit._internal import torch_compat
from ampkit._internal.where import user_stacklevel
from ampkit.errors import StateError

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
    ``load_state_dict``, not a step)."""

    def __init__(self, schedulers: Sequence[Any]) -> None:
        self.schedulers = list(schedulers)
        self._epochs = [s.last_epoch for s in self.schedulers]
        self._warned = False

    def after_step(self, skipped: bool) -> None:
        if not skipped:
            self()

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
