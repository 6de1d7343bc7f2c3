"""The skip decision of one step: one pure rule over the step's found-inf flags, the
same for a process alone and for ranks that agree.

A step's gradients are checked in *segments*: one per loss id switch (``scale_loss``
with another ``loss_id`` closes the grads gathered so far), one at ``step()``, and one
for edits after ``ampkit.unscale`` (loss id ``None``: blames no scaler). Each segment
leaves a found-inf flag (a 0-dim tensor, > 0 when its grads held inf/NaN; ``None`` when
it had no grads). The rule:

- the step is skipped if any segment overflowed;
- loss ``k``'s event is *overflow* if one of its segments overflowed before any earlier
  segment did, *unknown* (``None``: its scaler is left alone) if an earlier segment of
  the step had already overflowed (its grads are then non-finite whatever its scale),
  else *clean*.

:func:`encode` turns the segments into a small float vector on a device, with no host
sync, such that the element-wise MAX of several ranks' vectors is the vector of the
combined step (an overflow on any rank is an overflow; masked on some rank and
overflowing on none is unknown; clean means clean everywhere). :func:`decide` reads it
(the step's one host sync); a process alone reads its own vector, ranks that agree read
the all-reduced one. A multi-process layer supplies the all-reduce through the
:class:`Agreement` interface.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from ampkit.errors import DistributedError

__all__ = ["Segment", "Agreement", "StepAgreement", "encode", "decide"]

#: One checked part of a step: (loss id or None, found-inf flag or None).
Segment = tuple["int | None", "torch.Tensor | None"]

# Per-loss codes, ordered so that MAX combines ranks (see the module docs).
_ABSENT, _CLEAN, _MASKED, _OVERFLOW = -1.0, 0.0, 1.0, 2.0


class Agreement(Protocol):
    """The collective of one step: ``reduce`` all-reduces (MAX, in place) a float32
    vector that lives on ``device`` over the ranks that must decide alike."""

    device: torch.device

    def reduce(self, tensor: torch.Tensor) -> None: ...


class StepAgreement(Protocol):
    """How a multi-process layer joins every managed step (``ampkit.distributed``
    implements it; :func:`ampkit.init_trainer` gives each managed optimizer one).

    - ``agreement(state, segments)``: once per step, before the flags are read: None
      when this rank decides alone, else the :class:`Agreement` to run. Whether to
      agree may depend only on what every rank sees alike (a rank that all-reduces
      while another does not would hang), never on this rank's values.
    """

    def agreement(self, state: object, segments: Sequence[Segment]) -> Agreement | None: ...


def _codes(segments: Sequence[tuple[int | None, Any]], num_losses: int, maximum: Callable[[Any, Any], Any], absent: Any) -> list[Any]:
    """The rule, once: ``[code per loss id] + [skip]`` from the per-segment found flags
    (1.0 overflow, 0.0 clean); a loss id the step did not scale keeps ``absent``.
    Written in ``*``, ``-`` and ``maximum`` only, so it runs on host floats (a process
    alone, after its one host read) and on 0-dim device tensors (ranks that agree,
    before their all-reduce)."""
    codes = [absent] * num_losses
    masked = absent * 0.0  # 1.0 once a segment of this step has overflowed
    for loss_id, found in segments:
        if loss_id is not None:
            status = maximum(masked * _MASKED, found * (1.0 - masked) * _OVERFLOW)
            codes[loss_id] = maximum(codes[loss_id], status)
        masked = maximum(masked, found)
    codes.append(masked)  # the skip flag
    return codes


def encode(segments: Sequence[Segment], num_losses: int, device: torch.device) -> torch.Tensor:
    """The rule on ``device``, no host sync: a float32 vector ``[code per loss id] +
    [skip] + [1.0 per loss id absent from this step]`` (``2 * num_losses + 1``
    elements) whose element-wise MAX over ranks is the combined step's."""
    absent = torch.full((), _ABSENT, dtype=torch.float32, device=device)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    found = [(i, zero if f is None else (f.to(device, non_blocking=True) > 0).to(torch.float32)) for i, f in segments]
    values = _codes(found, num_losses, torch.maximum, absent)
    # 1.0 where a loss id's code is still _ABSENT: the MAX over ranks then tells a loss
    # id scaled on some ranks but not on others.
    return torch.stack(values + [torch.maximum(c * 0.0, -c) for c in values[:num_losses]])


def decide(
    segments: Sequence[Segment], num_losses: int, agreement: Agreement | None = None
) -> tuple[dict[int, bool | None], bool]:
    """The step's events and skip: ``({loss_id: True overflow / False clean / None
    unknown}, skip)`` for the loss ids the step (on any rank) scaled. Alone, the flags
    are read with one host sync and the rule runs on the host; with an ``agreement``,
    the rule runs on the device (:func:`encode`), the vector is all-reduced and read
    (the step's one host sync), and loss ids scaled on some ranks but not on others
    raise :class:`~ampkit.DistributedError` on every rank."""
    absent: list[float] = []  # alone, every loss id with a code is present
    if agreement is None:
        flags = _read(segments)
        if 1.0 not in flags:  # nothing overflowed: the rule finds every scaled loss id clean
            return {loss_id: False for loss_id, _ in segments if loss_id is not None}, False
        values = _codes([(i, f) for (i, _), f in zip(segments, flags)], num_losses, max, _ABSENT)
    else:
        vector = encode(segments, num_losses, agreement.device)
        agreement.reduce(vector)
        values = vector.tolist()
        absent = values[num_losses + 1 :]
    events: dict[int, bool | None] = {}
    mismatched = []
    for loss_id in range(num_losses):
        code = values[loss_id]
        if code == _ABSENT:
            continue
        if absent and absent[loss_id] > 0:  # absent here, scaled on another rank
            mismatched.append(loss_id)
        events[loss_id] = None if code == _MASKED else code == _OVERFLOW
    if mismatched:
        raise DistributedError(
            f"loss id(s) {mismatched} were scaled on some ranks but not on others this step, "
            "so their loss scalers would drift apart. Run the same scale_loss calls (same "
            "loss ids) on every rank each step; scale a zero loss where a rank has none."
        )
    return events, values[num_losses] > 0


def _read(segments: Sequence[Segment]) -> list[float]:
    """The segments' flags as 1.0/0.0 on the host: one host sync for all of them."""
    if len(segments) == 1:  # the usual step: one segment, read on its own
        found = segments[0][1]
        return [0.0 if found is None else float(found.item() > 0)]
    tensors = [f for _, f in segments if f is not None]
    read: Iterator[float] = iter(())
    if tensors:
        device = tensors[0].device
        read = iter(torch.stack([t.to(device, non_blocking=True) for t in tensors]).tolist())
    return [0.0 if f is None else float(next(read) > 0) for _, f in segments]
