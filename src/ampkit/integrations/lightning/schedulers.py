"""LR schedulers Lightning steps, held on the steps ampkit skipped: :class:`HeldScheduler`."""

from __future__ import annotations

from typing import Any

from ampkit import step_skipped
from ampkit.errors import StateError

__all__ = ["HeldScheduler"]


class HeldScheduler:
    """An LR scheduler whose ``step()`` does nothing right after a step ampkit skipped
    (inf/NaN gradients) of the scheduler's optimizer, so the schedule counts only the
    steps that updated the parameters; every other call, attribute and method
    (``state_dict``, ``load_state_dict``, ``get_last_lr``, ``optimizer``, ...) is the
    wrapped scheduler's.

    :class:`~ampkit.integrations.lightning.AmpkitPrecision` puts each scheduler
    configured with ``"interval": "step"`` in one (Lightning steps those after every
    optimizer step), in ``trainer.lr_scheduler_configs``: ``self.lr_schedulers()`` returns
    it, and Lightning's checkpoints hold the wrapped scheduler's own ``state_dict()``.
    The scheduler itself is ``scheduler``; ``held`` counts the calls held.
    """

    __slots__ = ("scheduler", "held")

    def __init__(self, scheduler: Any) -> None:
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "held", 0)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped scheduler's ``step(*args, **kwargs)``, unless the last step of its
        optimizer was skipped by ampkit (then nothing happens)."""
        optimizer = getattr(self.scheduler, "optimizer", None)
        if optimizer is not None and _skipped(optimizer):
            object.__setattr__(self, "held", self.held + 1)
            return None
        return self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "scheduler"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in HeldScheduler.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.scheduler, name, value)

    def __repr__(self) -> str:
        return f"HeldScheduler({self.scheduler!r})"


def _skipped(optimizer: Any) -> bool:
    try:
        return step_skipped(optimizer)
    except StateError:  # an optimizer ampkit does not manage (released, or never set up)
        return False
