"""The per-step gradient bookkeeping of a managed optimizer (:class:`StepGrads`, the
``step_grads`` component of :class:`ampkit.trainer.managed.ManagedOptimizer`): where the step stands
(:class:`StepStage`), which loss id's scale the grads gathered so far carry, the
found-inf flags of the step's checked *segments* (one per loss id switch, one at
``step()``, one for edits after ``ampkit.unscale``; see :mod:`ampkit.trainer.decision`),
and the detection of a step abandoned since ampkit last looked at its grads. The step
wrapper reads the segments once per step and decides (``ManagedOptimizer._resolve_step``)."""

from __future__ import annotations

import enum
import itertools
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ampkit._internal import torch_compat
from ampkit._internal.where import user_stacklevel
from ampkit.errors import StateError
from ampkit.scaling.loss_scaler import group_grads, to_fp32, unscale_and_check_

from .fused_step import nonfinite_flag

if TYPE_CHECKING:
    from .decision import Segment
    from .extensions import StepExtension
    from .grad_hooks import GradPath
    from .loss_slots import LossSlot
    from .managed import ManagedOptimizer

__all__ = ["StepGrads", "StepStage", "sum_flags"]


class StepStage(enum.Enum):
    """Where the current step of a managed optimizer stands (its ``stage``).

    - ``READY``: nothing gathered since the last step (or a fresh start).
    - ``GATHERING``: a ``scale_loss`` ran; the grads of its loss id are not closed yet.
    - ``ABORTED``: gathering, and a ``scale_loss`` block was left by an exception (the
      step may have been abandoned: the next ``scale_loss`` checks whether the grads
      were dropped).
    - ``UNSCALED``: the grads were unscaled and checked (``ampkit.unscale``, or ``step()``
      until it decides); a ``scale_loss`` now reopens the step.
    """

    READY = "ready"
    GATHERING = "gathering"
    ABORTED = "aborted"
    UNSCALED = "unscaled"


class StepOwner(Protocol):
    """What :class:`StepGrads` reads of the managed optimizer it belongs to."""

    optimizer: torch.optim.Optimizer
    backward_params: Iterable[torch.Tensor] | None
    grad_path: GradPath

    @property
    def extensions(self) -> tuple[StepExtension, ...]: ...


class StepGrads:
    """Per-step state of the grads of one managed optimizer and the checks that fill it.

    Args:
        owner: the managed optimizer (held weakly): its ``optimizer``,
            ``backward_params``, ``grad_path`` and ``extensions`` (their
            ``before_check``).
        slots: its loss slots, one per loss id (their scalers)."""

    def __init__(self, owner: ManagedOptimizer, slots: list[LossSlot]) -> None:
        self._owner = weakref.ref(owner)
        self._slots = slots
        # Where the step stands, the loss id whose scale the grads carry (not yet
        # unscaled) and the found-inf flags of this step's segments in order.
        self._stage = StepStage.READY
        self._pending: int | None = None
        self._segments: list[Segment] = []
        self._fp16_warned = False

    @property
    def owner(self) -> ManagedOptimizer:
        owner = self._owner()
        if owner is None:
            raise StateError("the managed optimizer of this step was released.")
        return owner

    @property
    def stage(self) -> StepStage:
        """Where the current step stands (:class:`StepStage`)."""
        return self._stage

    @property
    def unscaled(self) -> bool:
        """Whether this step's grads were unscaled and checked (``UNSCALED``)."""
        return self._stage is StepStage.UNSCALED

    @property
    def pending(self) -> int | None:
        """The loss id whose scale the grads gathered since the last close carry."""
        return self._pending

    def take_segments(self) -> list[Segment]:
        """This step's segments, handed to the decision; the next step starts afresh."""
        segments, self._segments = self._segments, []
        self._pending = None
        self._stage = StepStage.READY
        return segments

    def grad_params(self) -> Iterator[torch.Tensor]:
        """The params whose grads the step unscales, checks and steps: those currently
        in ``optimizer.param_groups`` (fp32 masters under O2), in order."""
        return itertools.chain.from_iterable(group["params"] for group in self.owner.optimizer.param_groups)

    def segment_flags(self) -> list[torch.Tensor]:
        """The found-inf flags (0-dim tensors, > 0 on inf/NaN) of this step's segments
        checked so far, in order; no host sync."""
        return [f for _, f in self._segments if f is not None]

    def add_segment(self, found: torch.Tensor) -> None:
        """Add a found-inf flag (a 0-dim tensor, > 0 skips the step) to this step as a
        segment of no loss id: it can skip the step but blames no loss scaler."""
        self._segments.append((None, found))

    def mark_aborted(self) -> None:
        """A ``scale_loss`` block of this step was left by an exception: the next
        ``scale_loss`` checks whether the step was abandoned."""
        if self._stage is StepStage.GATHERING:
            self._stage = StepStage.ABORTED

    def _tracked_grads(self) -> list[torch.Tensor]:
        """The grads this step holds: of the params in ``param_groups`` and of the
        ``backward_params`` (each tensor once; sparse grads by their values)."""
        params = itertools.chain(self.grad_params(), self.owner.backward_params or ())
        grads: dict[int, torch.Tensor] = {}
        for p in params:
            g = p.grad
            if g is not None:
                grads[id(g)] = torch_compat.sparse_values(g) if g.is_sparse else g
        return list(grads.values())

    def start_fresh_step(self) -> None:
        self._segments = []
        self._pending = None
        self._stage = StepStage.READY
        self.owner.grad_path.forget_flags()

    def drop_abandoned_step(self) -> None:
        """At a ``scale_loss``: if this step's grads were dropped since ampkit last
        looked at them (``zero_grad()`` after an exception in backward, in a clip, or
        any abandoned batch), forget the old step's flags and start a fresh one.

        The grads count as dropped when every one is None (``zero_grad()``), or -- only
        after ``unscale`` or an exception inside a ``scale_loss`` block, at the cost of
        one host sync -- when every one is zero (``zero_grad(set_to_none=False)``)."""
        self.owner.grad_path.finish()  # a backward pass that raised: settle its hooks' work
        flagged = self.unscaled or any(f is not None for _, f in self._segments)
        aborted = self._stage is StepStage.ABORTED
        if aborted:
            self._stage = StepStage.GATHERING
        if not flagged:
            return
        self.owner.grad_path.reconcile()  # O2: the model's and the masters' grads agree
        params = itertools.chain(self.grad_params(), self.owner.backward_params or ())
        if all(p.grad is None for p in params):
            self.start_fresh_step()
            return
        if aborted or self.unscaled:
            grads = self._tracked_grads()
            nonzero = torch.stack([g.ne(0).any().to(grads[0].device) for g in grads]).any()
            if not bool(nonzero):
                self.start_fresh_step()

    def check_before_backward(self) -> None:
        """Raise (changing nothing but dropping an abandoned step) if ``scale_loss``
        cannot start a backward pass now."""
        self.drop_abandoned_step()
        if self.unscaled and self.owner.grad_path.unhooked(self.grad_params()):
            raise StateError(
                "this optimizer's grads were already unscaled this step (ampkit.unscale) "
                "and some of them (FSDP2's sharded parameters) are only unscaled at the "
                "step: run every scale_loss/backward of the step before unscale, then "
                "step(). To drop a batch after unscale, call optimizer.zero_grad() first."
            )

    def before_backward(self, loss_id: int) -> None:
        """Called by ``scale_loss`` before the backward of ``loss_id`` (after
        :meth:`check_before_backward` passed for every optimizer of the call)."""
        path = self.owner.grad_path
        path.refresh()
        path.finish()
        # The hooks keep grads real: a backward after ``unscale`` in the same step just
        # reopens the step.
        self._stage = StepStage.GATHERING
        pending = self._pending
        if pending is not None and pending != loss_id:
            path.reconcile()
            ratio = _ratio(self._slots[loss_id].scaler.scale, self._slots[pending].scaler.scale)
            self._segments.append((pending, self._close(pending, ratio)))
        self._pending = loss_id
        self._slots[loss_id].expect(self.owner)

    def _close(self, loss_id: int | None, unhooked_factor: float = 1.0) -> torch.Tensor | None:
        """The inf/NaN flag of the grads gathered since the last close: the hooks'
        flags for ``loss_id``, one fused check of grads they did not check (edited,
        assigned, or produced with a scale of 1), and the fused multiply by
        ``unhooked_factor`` and check of grads without hooks. No host sync."""
        path = self.owner.grad_path
        flags = path.take_found(loss_id) if loss_id is not None else []
        params = list(self.grad_params())
        raw = path.unhooked(params)
        if raw:
            raw_groups = group_grads(raw)
            found = (
                nonfinite_flag(raw_groups) if unhooked_factor == 1.0 else unscale_and_check_(raw_groups, unhooked_factor)
            )
            if found is not None:
                flags.append(found)
            path.unchecked(raw)  # checked just now
        unchecked = path.unchecked(params + path.held_params())
        if unchecked:
            found = nonfinite_flag(group_grads(unchecked))  # reads only: nothing to multiply
            if found is not None:
                flags.append(found)
        return sum_flags(flags) if flags else None

    def unscale(self) -> None:
        """The extensions' ``before_check``, then close this step's pending grads: their
        inf/NaN flag (no sync). The grads are unscaled already
        (:mod:`ampkit.trainer.grad_hooks`). Idempotent within a step."""
        if self.unscaled:
            return
        for ext in self.owner.extensions:
            ext.before_check()
        path = self.owner.grad_path
        path.finish(absorb_raw=True)
        path.reconcile()
        if self._pending is not None:
            scaler = self._slots[self._pending].scaler
            if not self._fp16_warned and scaler.scale != 1.0:
                self._warn_fp16(self.grad_params())
            self._segments.append((self._pending, self._close(self._pending, scaler.inv_scale)))
            self._pending = None
        elif not self._segments:
            # No scale_loss this step: still refuse to step on inf/NaN grads.
            self._segments.append((None, self._close(None)))
        self._stage = StepStage.UNSCALED

    def check_edits(self) -> None:
        """At ``step`` after an explicit ``unscale``: check grads changed since (e.g.
        clipped); an inf/NaN there skips the step without blaming a loss scaler."""
        self.owner.grad_path.reconcile()
        found = self._close(None)
        if found is not None:
            self._segments.append((None, found))

    def _warn_fp16(self, params: Iterable[torch.Tensor]) -> None:
        if any(g is not None and g.dtype == torch.float16 for g in (p.grad for p in params)):
            self._fp16_warned = True
            warnings.warn(
                "ampkit: this optimizer holds float16 parameters; unscaling their grads in "
                "float16 loses the small values loss scaling preserved. Keep the parameters "
                "in float32 (casting in the forward pass) or use fp32 master weights.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )


def sum_flags(flags: Sequence[torch.Tensor]) -> torch.Tensor:
    """Found-inf flags (0-dim tensors, > 0 on inf/NaN; at least one) as one, on the
    first one's device: > 0 when any is. No host sync."""
    total = flags[0]
    for other in flags[1:]:
        total = total + other.to(total.device, non_blocking=True)
    return total


def _ratio(new: float, old: float) -> float:
    return to_fp32(new / old)
