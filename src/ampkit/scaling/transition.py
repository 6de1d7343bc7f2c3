"""The loss scale's state machine as a pure function: :func:`next_state` takes a
:class:`ScalerState`, the configuration and one step's event and returns the next state
and what happened (:class:`ScaleEvent`). :class:`~ampkit.LossScaler` stores the result,
logs and raises; the rules are written out in :mod:`ampkit.scaling.loss_scaler`."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

__all__ = ["EventKind", "ScaleEvent", "ScalerState", "next_state", "to_fp32"]


def to_fp32(x: float) -> float:
    """``x`` rounded to the nearest float32 value (round half to even), as a Python float.

    Values beyond float32's range (ints beyond float64's too) become ``±inf``."""
    try:
        return struct.unpack("f", struct.pack("f", float(x)))[0]
    except OverflowError:
        return math.inf if x > 0 else -math.inf


class ScalerState(NamedTuple):
    """The state of a :class:`~ampkit.LossScaler` (the fields of its state dict but the
    configuration): ``scale`` an fp32 value as a Python float, the rest counts."""

    scale: float
    growth_tracker: int = 0
    hysteresis_left: int = 1
    consecutive_skips: int = 0
    num_events: int = 0
    num_overflows: int = 0


#: What one event did to the scale: ``clean`` (kept), ``grown``, ``static`` (an overflow
#: under a static scale), ``tolerated`` (by hysteresis), ``backed_off``, ``at_floor`` (an
#: overflow that would back off from ``min_scale``).
EventKind = Literal["clean", "grown", "static", "tolerated", "backed_off", "at_floor"]


class ScaleEvent(NamedTuple):
    """The outcome of :func:`next_state`: what happened (``kind``: ``"clean"``,
    ``"grown"``, ``"static"``, ``"tolerated"``, ``"backed_off"`` or ``"at_floor"``), the
    scale before it (``old_scale``), and whether more than ``max_consecutive_skips``
    overflows have now happened in a row (``too_many_skips``; the caller raises)."""

    kind: str
    old_scale: float
    too_many_skips: bool = False


def next_state(state: ScalerState, config: Mapping[str, Any], found_inf: bool) -> tuple[ScalerState, ScaleEvent]:
    """One event of the state machine (the module docstring), as a pure function: the
    state after a step whose gradients were finite (``found_inf=False``) or not, and
    what happened. ``config`` holds the keys of :meth:`ampkit.LossScaler.config`
    (validated). Nothing is logged or raised here; :meth:`ampkit.LossScaler.update` does
    both from the returned event."""
    old = scale = state.scale
    tracker, left = state.growth_tracker, state.hysteresis_left
    skips, events, overflows = state.consecutive_skips, state.num_events + 1, state.num_overflows
    too_many = False
    if not found_inf:
        skips = 0
        kind: EventKind = "clean"
        if config["dynamic"]:
            if config["consecutive_hysteresis"]:
                left = config["hysteresis"]
            tracker += 1
            if tracker >= config["growth_interval"]:
                tracker, left = 0, config["hysteresis"]
                grown = to_fp32(old * config["growth_factor"])
                if math.isfinite(grown):
                    scale = min(grown, config["max_scale"])
                    kind = "grown" if scale != old else "clean"
    else:
        overflows, skips, tracker = overflows + 1, skips + 1, 0
        limit = config["max_consecutive_skips"]
        too_many = limit is not None and skips > limit
        if not config["dynamic"]:
            kind = "static"
        elif left > 1:
            left, kind = left - 1, "tolerated"
        elif old <= config["min_scale"]:
            kind = "at_floor"
        else:
            scale, kind = max(to_fp32(old * config["backoff_factor"]), config["min_scale"]), "backed_off"
    new = ScalerState(scale, tracker, left, skips, events, overflows)
    return new, ScaleEvent(kind, old, too_many)
