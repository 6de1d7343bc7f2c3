"""The loss scale's state machine as a pure function: :func:`next_state` takes a
:class:`ScalerState`, the configuration and one step's event, checks all three, and
returns the next state and what happened (:class:`ScaleEvent`). :class:`~ampkit.LossScaler`
stores the result, logs and raises; the rules are written out in
:mod:`ampkit.scaling.loss_scaler`. The configuration's checks (:data:`CONFIG_KEYS`,
:func:`check_scale`) are here, below the ``LossScaler`` that applies them."""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import torch

from ampkit._internal.validate import (
    MAX_COUNT,
    brief,
    is_real,
    require_count,
    require_fields,
    require_flag,
)
from ampkit.errors import ScalerError

__all__ = ["CONFIG_KEYS", "EventKind", "ScaleEvent", "ScalerState", "check_scale", "next_state", "to_fp32"]


def to_fp32(x: float) -> float:
    """``x`` rounded to the nearest float32 value (round half to even), as a Python float.

    Values beyond float32's range (ints beyond float64's too) become ``±inf``."""
    try:
        return struct.unpack("f", struct.pack("f", float(x)))[0]
    except OverflowError:
        return math.inf if x > 0 else -math.inf


#: LossScaler's configuration: its constructor arguments, the keys of ``config()``.
CONFIG_KEYS = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "consecutive_hysteresis",
    "min_scale",
    "max_scale",
    "dynamic",
    "max_consecutive_skips",
)


#: The smallest normal float32 number. A scale factor must be a normal fp32 number: a
#: subnormal backoff factor (``1e-45``) takes any scale to the floor in one step, and a
#: growth factor beyond fp32's range (``1e300``) never grows it (no product is finite).
_FP32_TINY = 2.0**-126


def check_scale(value: Any, what: str, error: type[Exception] = ScalerError, allow_inf: bool = False) -> float:
    """``value`` rounded to fp32 if it is a usable loss scale, else ``error``.

    A usable scale is a real number (not a bool) whose fp32 value is finite and > 0
    and whose reciprocal -- what unscaling multiplies the grads by -- is finite in
    fp32 too (scales below about 2.9e-39 have none). ``allow_inf`` also accepts
    ``+inf`` (a cap that caps nothing)."""
    if not is_real(value):
        raise error(f"{what} must be a number, got {brief(value)} ({type(value).__name__}).")
    scale = to_fp32(value)
    if allow_inf and scale == math.inf:
        return scale
    if not (math.isfinite(scale) and scale > 0):
        raise error(f"{what} must be a finite number > 0, got {brief(value)}.")
    if not math.isfinite(to_fp32(1.0 / scale)):
        raise error(
            f"{what}={brief(value)} is too small: its reciprocal overflows float32, so unscaling "
            "would turn every gradient into inf/NaN. Use a scale of at least 1e-38 "
            "(scales below 1 are rarely useful)."
        )
    return scale


def _check_config(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """The scaler configuration in ``cfg`` (keys: ``CONFIG_KEYS``) validated and
    normalized (fp32 scales, Python ints and bools), or :class:`ScalerError`."""

    def bad(msg: str) -> ScalerError:
        return ScalerError(f"{name}: {msg}")

    def count(key: str, low: int) -> int:
        return require_count(cfg[key], f"{name}: {key}", ScalerError, low=low)

    out: dict[str, Any] = {}
    out["init_scale"] = check_scale(cfg["init_scale"], f"{name}: init_scale")
    out["min_scale"] = check_scale(cfg["min_scale"], f"{name}: min_scale")
    out["max_scale"] = check_scale(cfg["max_scale"], f"{name}: max_scale", allow_inf=True)
    growth, backoff = cfg["growth_factor"], cfg["backoff_factor"]
    if not (is_real(growth) and 1.0 < growth and math.isfinite(to_fp32(growth))):
        raise bad(
            f"growth_factor must be a number > 1 that is finite in float32 (at most about "
            f"3.4e38), got {brief(growth)}."
        )
    if not (is_real(backoff) and _FP32_TINY <= backoff < 1.0):
        raise bad(
            "backoff_factor must be a number in [2**-126, 1) (2**-126, about 1.2e-38, is "
            f"float32's smallest normal number), got {brief(backoff)}."
        )
    out["growth_factor"] = float(growth)
    out["backoff_factor"] = float(backoff)
    out["growth_interval"] = count("growth_interval", 1)
    out["hysteresis"] = count("hysteresis", 1)
    skips = cfg["max_consecutive_skips"]
    out["max_consecutive_skips"] = None if skips is None else count("max_consecutive_skips", 0)
    out["dynamic"] = require_flag(cfg["dynamic"], f"{name}: dynamic", ScalerError)
    out["consecutive_hysteresis"] = require_flag(
        cfg["consecutive_hysteresis"], f"{name}: consecutive_hysteresis", ScalerError
    )
    if out["dynamic"] and not out["min_scale"] <= out["init_scale"] <= out["max_scale"]:
        raise bad(
            f"need min_scale <= init_scale <= max_scale, got {out['min_scale']} <= "
            f"{out['init_scale']} <= {out['max_scale']}; adjust one of them."
        )
    return out


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


def next_state(
    state: ScalerState, config: Mapping[str, Any], found_inf: bool | torch.Tensor
) -> tuple[ScalerState, ScaleEvent]:
    """One event of the state machine (the module docstring), as a pure function: the
    state after a step whose gradients were finite (``found_inf=False``) or not, and
    what happened. Nothing is logged, and nothing is raised about the event itself;
    :meth:`ampkit.LossScaler.update` does both from the returned event.

    Args:
        state (ScalerState): the state before the event (:meth:`ampkit.LossScaler.state`):
            ``scale`` a float32 value, finite and > 0 (within ``[min_scale, max_scale]``
            when dynamic); the counters ints >= 0, ``hysteresis_left`` in
            ``1..hysteresis``, ``consecutive_skips <= num_overflows <= num_events``.
        config (Mapping): exactly the keys of :meth:`ampkit.LossScaler.config`, valid by
            the constructor's rules (factors, counts, flags, ``min_scale <= init_scale
            <= max_scale`` when dynamic); scales are taken rounded to float32, as
            :class:`~ampkit.LossScaler` stores them.
        found_inf (bool | Tensor): whether the step's gradients held an inf/NaN: a
            bool, or a 0-dim bool or real tensor (the flag ``unscale_`` returns; a
            value > 0 is an overflow).

    Raises:
        ScalerError: any of the three is not as described (a str ``"False"`` is no
            bool, a NaN or negative scale is no state); nothing was computed.
    """
    state, config, overflow = _checked_inputs(state, config, found_inf)
    return _transition(state, config, overflow)


def _checked_inputs(
    state: Any, config: Any, found_inf: Any
) -> tuple[ScalerState, dict[str, Any], bool]:
    """:func:`next_state`'s arguments validated and normalized (the state's numbers as
    Python ints and an fp32 float, the configuration as ``LossScaler`` stores it, the
    event as a bool), or :class:`ScalerError`."""
    where = "next_state"
    require_fields(config, CONFIG_KEYS, f"{where}: config", ScalerError, source="LossScaler.config()")
    cfg = _check_config(dict(config), f"{where}: config")
    if not isinstance(state, ScalerState):
        raise ScalerError(
            f"{where}: state must be an ampkit.scaling.ScalerState (LossScaler.state()), got "
            f"{brief(state)} ({type(state).__name__})."
        )
    scale = check_scale(state.scale, f"{where}: state.scale")
    if scale != state.scale:
        raise ScalerError(
            f"{where}: state.scale={state.scale!r} is not a float32 value (the scale is kept in "
            f"float32); pass ampkit.scaling.to_fp32(scale) = {scale!r}."
        )
    if cfg["dynamic"] and not cfg["min_scale"] <= scale <= cfg["max_scale"]:
        raise ScalerError(
            f"{where}: state.scale={scale} lies outside [min_scale, max_scale] = "
            f"[{cfg['min_scale']}, {cfg['max_scale']}] of a dynamic scale; pass the state and "
            "config of one LossScaler."
        )
    counts = {
        key: require_count(getattr(state, key), f"{where}: state.{key}", ScalerError,
                           high=MAX_COUNT - 1 if key.startswith("num_") else MAX_COUNT)
        for key in ScalerState._fields[1:]
    }  # fmt: skip
    if not 1 <= counts["hysteresis_left"] <= cfg["hysteresis"]:
        raise ScalerError(
            f"{where}: state.hysteresis_left={counts['hysteresis_left']} must lie in "
            f"1..hysteresis={cfg['hysteresis']}."
        )
    if not counts["consecutive_skips"] <= counts["num_overflows"] <= counts["num_events"]:
        raise ScalerError(
            f"{where}: the state's counters are inconsistent (need consecutive_skips <= "
            f"num_overflows <= num_events, got {counts['consecutive_skips']}, "
            f"{counts['num_overflows']}, {counts['num_events']})."
        )
    return ScalerState(scale, **counts), cfg, _overflow(found_inf, where)


def _overflow(found_inf: Any, where: str) -> bool:
    """``found_inf`` as a bool: a bool as it is, a 0-dim bool or real tensor as
    ``value > 0``, a numpy bool as the bool it holds; anything else (a str, a NaN or
    negative flag) is :class:`ScalerError`."""
    if isinstance(found_inf, bool):
        return found_inf
    numpy = sys.modules.get("numpy")  # a numpy bool can only exist once numpy is imported
    if numpy is not None and isinstance(found_inf, numpy.bool_):
        return bool(found_inf)
    hint = "pass a bool, or the 0-dim found-inf tensor unscale_ returns"
    if not isinstance(found_inf, torch.Tensor):
        raise ScalerError(
            f"{where}: found_inf must be a bool or a 0-dim tensor, got {brief(found_inf)} "
            f"({type(found_inf).__name__}); {hint} (a str such as 'False' is not a flag)."
        )
    if found_inf.dim() != 0 or found_inf.is_meta or found_inf.is_complex() or found_inf.layout != torch.strided:
        raise ScalerError(
            f"{where}: found_inf must be a 0-dim bool or real tensor with data, got a "
            f"{found_inf.dtype} {found_inf.layout} tensor of shape {tuple(found_inf.shape)} on "
            f"{found_inf.device}; {hint}."
        )
    value = found_inf.item()
    if isinstance(value, bool):
        return value
    if not (math.isfinite(value) and value >= 0):
        raise ScalerError(f"{where}: found_inf holds {value!r}, which is no flag (expected 0 or > 0); {hint}.")
    return value > 0


def _transition(state: ScalerState, config: Mapping[str, Any], found_inf: bool) -> tuple[ScalerState, ScaleEvent]:
    """:func:`next_state` on arguments already checked (a :class:`~ampkit.LossScaler`'s
    own state and configuration, validated whenever they are set)."""
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
