"""What one ``init_trainer`` call sets up besides the step wrappers: one
:class:`LossSlot` per loss id (its scaler, fed once every optimizer that received the
loss's grads has stepped) and the :class:`Trainer` the session holds (checkpoints)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ampkit._internal.validate import is_count
from ampkit.errors import StateError
from ampkit.scaling.loss_scaler import LossScaler

from .device_skip import settle
from .session import require_keys
from .stats import SkipReport

if TYPE_CHECKING:
    from .managed import ManagedOptimizer

__all__ = ["LossSlot", "Trainer"]


class LossSlot:
    """One loss id of a trainer: its scaler and the optimizers that owe it an event
    for the current iteration (those that received this loss's grads and have not
    stepped yet). The scaler updates when the last of them steps."""

    def __init__(self, scaler: LossScaler, follow_scopes: bool = False) -> None:
        self.scaler = scaler
        self.owed: list[ManagedOptimizer] = []
        self.reports: list[bool | None] = []
        self.skips = SkipReport()
        #: "first" while the default scale waits for the first scale_loss to tell bf16
        #: scopes; "watch" once that chose a static 1 for them (an fp16 scope makes it
        #: dynamic again); None otherwise (``ampkit.trainer.api``)
        self.follow_scopes: str | None = "first" if follow_scopes else None
        scaler.on_read(self.settle_owed)

    def settle_owed(self) -> None:
        """Record the pending outcome of every optimizer that owes this scaler its event
        (steps skipped on the device, ``ampkit.trainer.device_skip.settle``)."""
        for state in tuple(self.owed):
            if state.pending_outcome is not None:
                settle(state)

    def expect(self, state: ManagedOptimizer) -> None:
        if not any(s is state for s in self.owed):
            self.owed.append(state)

    def report(self, state: ManagedOptimizer, event: bool | None) -> None:
        """``event``: True overflow, False clean, None unknown (masked by another loss)."""
        if not any(s is state for s in self.owed):
            return
        self.owed = [s for s in self.owed if s is not state]
        self.reports.append(event)
        if self.owed:
            return
        reports, self.reports = self.reports, []
        if any(r is True for r in reports):
            self.scaler.update(True)
        elif all(r is False for r in reports):
            self.scaler.update(False)

    def clear(self) -> None:
        self.owed = []
        self.reports = []


class Trainer:
    """What one ``init_trainer`` call registers in the session: its optimizers and
    their shared scalers (one per loss id)."""

    def __init__(self, optimizers: list[ManagedOptimizer], slots: list[LossSlot]) -> None:
        self.optimizers = optimizers
        self.slots = slots

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_losses": len(self.slots),
            "scalers": [slot.scaler.state_dict() for slot in self.slots],
            "optimizers": [state.state_dict() for state in self.optimizers],
        }

    def load_state_dict(self, state_dict: dict[str, Any], where: str) -> None:
        self.prepare_load(state_dict, where)()

    def prepare_load(self, state_dict: Any, where: str) -> Callable[[], None]:
        """Validate a :meth:`state_dict` completely (every scaler and optimizer entry);
        return the function that loads it."""
        require_keys(state_dict, ("num_losses", "scalers", "optimizers"), where)
        num_losses, scalers, opts = (
            state_dict["num_losses"], state_dict["scalers"], state_dict["optimizers"]
        )
        if not is_count(num_losses) or num_losses != len(self.slots):
            raise StateError(
                f"{where}: the checkpoint has num_losses={num_losses!r}, this run "
                f"{len(self.slots)}; pass the same num_losses to init_trainer."
            )
        if not isinstance(scalers, (list, tuple)) or len(scalers) != len(self.slots):
            raise StateError(
                f"{where}: expected a list of {len(self.slots)} scaler state(s), got {scalers!r:.80}."
            )
        if not isinstance(opts, (list, tuple)) or len(opts) != len(self.optimizers):
            count = len(opts) if isinstance(opts, (list, tuple)) else repr(opts)
            raise StateError(
                f"{where}: the checkpoint has {count} optimizer(s), "
                f"this run {len(self.optimizers)}; pass the same optimizers to init_trainer."
            )
        steps = [slot.scaler.prepare_load(sd) for slot, sd in zip(self.slots, scalers)]
        steps += [state.prepare_load(sd, where) for state, sd in zip(self.optimizers, opts)]

        def apply() -> None:
            for slot in self.slots:
                slot.clear()
            for step in steps:
                step()

        return apply

    def release(self) -> None:
        for state in self.optimizers:
            state.release()
        for slot in self.slots:
            slot.clear()
            slot.scaler.detach()
