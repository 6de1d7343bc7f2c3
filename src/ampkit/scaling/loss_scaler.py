"""Loss scaling: a static or dynamic loss scale written out as a plain state machine.

Why: float16 represents magnitudes from about 6e-8 (subnormal) to 65504. Gradients
of a small loss often fall below that range and become zero. Multiplying the loss by
a scale ``S`` multiplies every gradient by ``S`` (backward is linear), which moves
them into range; before the optimizer step the gradients are multiplied by ``1/S``
again ("unscaled") in fp32. A scale that is too large makes gradients overflow to
inf/NaN; that step is skipped and the scale is reduced.

The state machine (``dynamic=True``), one *event* per optimizer step:

- clean step (all gradients finite): ``growth_tracker += 1``; once it reaches
  ``growth_interval`` the scale grows, ``S <- min(S * growth_factor, max_scale)``
  (kept as is if the product is not finite in fp32), the tracker restarts at 0 and
  the hysteresis budget refills. With ``consecutive_hysteresis=True`` the budget
  refills on every clean step instead.
- overflow (some gradient inf/NaN): the step is skipped, the tracker restarts at 0.
  If the hysteresis budget is above 1 it is decremented and the scale stays (the
  overflow is tolerated); otherwise ``S <- max(S * backoff_factor, min_scale)``.
  This is DeepSpeed's meaning of ``hysteresis``: ``hysteresis=1`` backs off on every
  overflow (torch.amp.GradScaler's rule); ``hysteresis=h`` tolerates ``h - 1``
  overflows per growth window (or in a row, with ``consecutive_hysteresis``).
- no silent failure: an overflow that would back off while ``S`` already sits at
  ``min_scale``, or more than ``max_consecutive_skips`` overflows in a row, raises
  :class:`~ampkit.NumericsError` (the state is updated first, the step stays skipped).

With ``dynamic=False`` the scale never changes; overflows still skip the step and
count towards ``max_consecutive_skips``.

Arithmetic matches ``torch.amp.GradScaler`` bit for bit: the scale is an fp32 value,
every new scale is the float64 product rounded once to fp32 (as ``torch._amp_update_scale_``
does), and the inverse scale used for unscaling is the float64 reciprocal rounded to
fp32. The state machine runs on the host in Python numbers; the scale and its inverse
are mirrored into fp32 0-dim tensors per device (refreshed with ``fill_`` only when
the scale changes). Unscaling and the non-finite check are one fused
``torch._amp_foreach_non_finite_check_and_unscale_`` pass per (device, dtype) group
and need no host sync; the caller syncs once per step to read the flag.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ampkit._internal.dist import is_rank_zero
from ampkit._internal.validate import require_count, require_fields
from ampkit.errors import NumericsError, ScalerError, StateError

from .transition import (
    CONFIG_KEYS,
    ScaleEvent,
    ScalerState,
    _check_config,
    _overflow,
    _transition,
    check_scale,
    next_state,
    to_fp32,
)
from .unscale import group_grads, unscale_and_check_

__all__ = [
    "LossScaler",
    "ScalerState",
    "ScaleEvent",
    "next_state",
    "group_grads",
    "unscale_and_check_",
    "to_fp32",
    "check_scale",
]

_LOG = logging.getLogger("ampkit")


_STATE_KEYS = ScalerState._fields  # the state fields of a state dict
def _check_state(sd: dict[str, Any], cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """The state fields of a scaler state dict, validated against the (validated)
    configuration ``cfg``, or :class:`ScalerError`."""

    def bad(msg: str) -> ScalerError:
        return ScalerError(f"{name}: state dict {msg}; pass a dict returned by LossScaler.state_dict().")

    out: dict[str, Any] = {"scale": check_scale(sd["scale"], f"{name}: state dict scale")}
    if cfg["dynamic"] and not cfg["min_scale"] <= out["scale"] <= cfg["max_scale"]:
        raise bad(
            f"has scale {out['scale']} outside [min_scale, max_scale] = "
            f"[{cfg['min_scale']}, {cfg['max_scale']}]"
        )
    for key in _STATE_KEYS[1:]:  # the counters
        hint = "Pass a dict returned by LossScaler.state_dict()."
        out[key] = require_count(sd[key], f"{name}: state dict field {key!r}", ScalerError, hint=hint)
    if not 1 <= out["hysteresis_left"] <= cfg["hysteresis"]:
        raise bad(f"has hysteresis_left={out['hysteresis_left']}, expected 1..hysteresis={cfg['hysteresis']}")
    if not out["consecutive_skips"] <= out["num_overflows"] <= out["num_events"]:
        raise bad(
            "has inconsistent counters (need consecutive_skips <= num_overflows <= num_events, "
            f"got {out['consecutive_skips']}, {out['num_overflows']}, {out['num_events']})"
        )
    return out


class _ConfigField:
    """A configuration field of :class:`LossScaler` as an attribute: read from its
    configuration; assigning goes through :meth:`LossScaler.configure` (validated, the
    whole change refused if invalid)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else obj._config[self.name]

    def __set__(self, obj: Any, value: Any) -> None:
        obj.configure(**{self.name: value})


class LossScaler:
    """A loss scale for one loss: static or dynamic, with hysteresis, a floor and a cap.

    Args (defaults in brackets):
        init_scale (float): starting scale ``S``, rounded to fp32. Every scale
            (``init_scale``, ``min_scale``, ``max_scale``, a loaded or set scale) must be
            a finite number > 0 whose fp32 reciprocal is finite too (>= about 2.9e-39);
            ``max_scale`` may also be ``math.inf``. When dynamic, ``min_scale <=
            init_scale <= max_scale``; a static scale ignores ``min_scale``/``max_scale``. Default: ``2**16``.
        growth_factor (float): ``S *= growth_factor`` after ``growth_interval``
            clean steps in a row; must be > 1 and finite in fp32 (<= about 3.4e38). Default: ``2.0``.
        backoff_factor (float): ``S *= backoff_factor`` on an overflow that is not
            tolerated by hysteresis; must be in [2**-126, 1) (a normal fp32 number: a
            subnormal one takes any scale to the floor at once). Default: ``0.5``.
        growth_interval (int): clean steps in a row before the scale grows; >= 1. Default: ``2000``.
        hysteresis (int): overflows tolerated before backing off, DeepSpeed's
            meaning; 1 backs off on every overflow (torch.amp's rule); >= 1. Default: ``1``.
        min_scale (float): floor; the scale never goes below it, and an overflow
            that would back off from it raises :class:`~ampkit.NumericsError`. Default: ``1.0``.
        max_scale (float): cap; growth stops there (``math.inf`` for none). Default: ``2**24``.
        dynamic (bool): ``False`` keeps ``init_scale`` forever (static scaling). Default: ``True``.
        consecutive_hysteresis (bool): refill the hysteresis budget on every clean
            step (overflows must then be consecutive to back off) instead of only when the
            scale grows (DeepSpeed's ``consecutive_hysteresis``). Default: ``False``.
        max_consecutive_skips (int | None): raise :class:`~ampkit.NumericsError` when
            more than this many overflows happen in a row; ``None`` turns the check off. Default: ``100``.
        name (str): how log records and errors call this scaler. Default: ``"loss scaler"``.

    Counts (``growth_interval``, ``hysteresis``, ``max_consecutive_skips``) must be
    ints and flags (``dynamic``, ``consecutive_hysteresis``) bools; anything else
    raises :class:`~ampkit.ScalerError`.

    Use: ``scale(loss)`` before backward, ``unscale_(params)`` for the fused unscale and
    check (returns a 0-dim found-inf tensor, no sync), then ``update(found_inf)`` once
    per step with the host value. :func:`ampkit.init_trainer` and
    :class:`ampkit.GradScaler` drive these for you.
    """

    init_scale = _ConfigField()
    growth_factor = _ConfigField()
    backoff_factor = _ConfigField()
    growth_interval = _ConfigField()
    hysteresis = _ConfigField()
    min_scale = _ConfigField()
    max_scale = _ConfigField()
    dynamic = _ConfigField()
    consecutive_hysteresis = _ConfigField()
    max_consecutive_skips = _ConfigField()

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        dynamic: bool = True,
        *,
        consecutive_hysteresis: bool = False,
        max_consecutive_skips: int | None = 100,
        name: str = "loss scaler",
    ) -> None:
        if not isinstance(name, str):
            raise ScalerError(f"LossScaler: name must be a str, got {name!r}.")
        self.name = name
        arguments = locals()  # the constructor arguments are the configuration
        self._apply_config(_check_config({k: arguments[k] for k in CONFIG_KEYS}, "LossScaler"))
        # the state machine's state (transition.next_state); replaced whole, never mutated
        self._state = ScalerState(scale=self.init_scale, hysteresis_left=self.hysteresis)
        # Tensor mirrors of the scale and its inverse, per device; refreshed on change.
        self._scale_tensors: dict[torch.device, torch.Tensor] = {}
        self._inv_tensors: dict[torch.device, torch.Tensor] = {}
        self._inv_scale = to_fp32(1.0 / self.init_scale)
        # Set while a trainer (init_trainer) drives this scaler, so two cannot share it.
        self._attached = False
        self._on_read: Callable[[], None] | None = None  # see on_read

    @property
    def _state(self) -> ScalerState:
        """The state machine's state, after the reader of :meth:`on_read` ran."""
        self._before_read()
        return self._current

    @_state.setter
    def _state(self, value: ScalerState) -> None:
        self._current = value

    def _before_read(self) -> None:
        reader = self.__dict__.get("_on_read")
        if reader is not None:
            reader()

    def on_read(self, reader: Callable[[], None] | None) -> None:
        """Call ``reader()`` before every read of the scale, its tensors or the counters
        (a trainer records there the outcome of steps its optimizers skipped on the
        device, :mod:`ampkit.trainer.device_skip`); ``None`` removes it. Not pickled."""
        self._on_read = reader

    def __getstate__(self) -> dict[str, Any]:
        self._before_read()
        state = dict(self.__dict__)
        state.pop("_on_read", None)
        return state

    def _apply_config(self, cfg: dict[str, Any]) -> None:
        self._config = {key: cfg[key] for key in CONFIG_KEYS}  # read by every update()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a scaler pickled by 0.3 kept its configuration and state as plain attributes
        state = dict(state)
        if "_config" not in state:
            state["_config"] = {key: state.pop(key) for key in CONFIG_KEYS if key in state}
        if "_state" in state:
            state["_current"] = state.pop("_state")
        elif "_current" not in state:
            state["_current"] = ScalerState(*(state.pop(f"_{key}") for key in _STATE_KEYS))
        self.__dict__.update(state)

    def config(self) -> dict[str, Any]:
        """The constructor arguments (``init_scale`` ... ``max_consecutive_skips``), a
        copy. Each is also an attribute; assigning one (``scaler.growth_interval = 100``)
        is :meth:`configure` with that field."""
        return dict(self._config)

    def configure(self, **changes: Any) -> None:
        """Change configuration fields (constructor arguments), validated like the
        constructor's (a dynamic scale must also stay within the new ``min_scale`` and
        ``max_scale``); a rejected change raises :class:`~ampkit.ScalerError` and
        changes nothing. The state (scale, counters) is kept; a hysteresis budget
        above a lowered ``hysteresis`` is cut to it."""
        unknown = sorted(set(changes) - set(CONFIG_KEYS))
        if unknown:
            raise ScalerError(f"{self.name}: unknown setting(s) {unknown}; valid: {list(CONFIG_KEYS)}.")
        cfg = _check_config({**self.config(), **changes}, self.name)
        scale = self._state.scale
        if cfg["dynamic"] and not cfg["min_scale"] <= scale <= cfg["max_scale"]:
            raise ScalerError(
                f"{self.name}: the current scale {scale} would lie outside "
                f"[min_scale, max_scale] = [{cfg['min_scale']}, {cfg['max_scale']}]."
            )
        self._apply_config(cfg)
        self._state = self._state._replace(hysteresis_left=min(self._state.hysteresis_left, self.hysteresis))

    # --- reading the state -------------------------------------------------------
    @property
    def scale(self) -> float:
        """The current scale ``S`` (an fp32 value, as a Python float)."""
        return self._state.scale

    @property
    def inv_scale(self) -> float:
        """``1/S`` computed in float64 and rounded to fp32 (what unscaling multiplies by)."""
        self._before_read()
        return self._inv_scale

    @property
    def growth_tracker(self) -> int:
        """Clean steps since the last overflow or growth."""
        return self._state.growth_tracker

    @property
    def hysteresis_left(self) -> int:
        """Overflows the scale still absorbs before backing off (1: backs off on the next)."""
        return self._state.hysteresis_left

    @property
    def consecutive_skips(self) -> int:
        """Overflow events in a row (0 after a clean step)."""
        return self._state.consecutive_skips

    @property
    def num_overflows(self) -> int:
        """Overflow events since construction (or as loaded from a state dict)."""
        return self._state.num_overflows

    @property
    def num_events(self) -> int:
        """Events (clean or overflow) fed to :meth:`update` so far."""
        return self._state.num_events

    def scale_tensor(self, device: torch.device | str) -> torch.Tensor:
        """``S`` as a float32 0-dim tensor on ``device``. Cached: do not modify it."""
        self._before_read()
        device = torch.device(device)
        t = self._scale_tensors.get(device)
        if t is None:
            t = self._scale_tensors[device] = torch.full(
                (), self._state.scale, dtype=torch.float32, device=device
            )
        return t

    def inv_scale_tensor(self, device: torch.device | str) -> torch.Tensor:
        """``1/S`` (float64 reciprocal rounded to fp32) as a float32 0-dim tensor on
        ``device``. Cached: do not modify it."""
        self._before_read()
        device = torch.device(device)
        t = self._inv_tensors.get(device)
        if t is None:
            t = self._inv_tensors[device] = torch.full(
                (), self._inv_scale, dtype=torch.float32, device=device
            )
        return t

    # --- the three operations ------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` (out of place; the fp32 scale tensor on ``loss``'s device, so a
        0-dim fp16 loss becomes fp32, as with torch.amp.GradScaler)."""
        if not isinstance(loss, torch.Tensor):
            raise ScalerError(f"can only scale a torch.Tensor loss, got {type(loss).__name__}.")
        return loss * self.scale_tensor(loss.device)

    def unscale_(self, params: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """Multiply the grads of ``params`` in place by ``1/S`` and check them for
        inf/NaN, fused per (device, dtype). Returns a float32 0-dim tensor (1.0 when a
        non-finite value was found), or ``None`` when no param has a grad. No sync."""
        return self.unscale_groups_(group_grads(params))

    def unscale_groups_(self, groups: dict) -> torch.Tensor | None:
        """:meth:`unscale_` of gradients already grouped by ``group_grads`` (a caller
        that groups them itself, e.g. to refuse fp16 grads first): multiplies each by
        ``1/S`` in place and returns the float32 0-dim found-inf tensor, or ``None`` for
        no groups. No sync."""
        inv = {device: self.inv_scale_tensor(device) for device, _ in groups}
        return unscale_and_check_(groups, self._inv_scale, inv)

    # --- ownership: one trainer drives a scaler at a time ------------------------------
    @property
    def attached(self) -> bool:
        """Whether a trainer (:func:`ampkit.init_trainer`) drives this scaler now."""
        return self._attached

    def check_free(self) -> None:
        """Raise :class:`~ampkit.StateError` if a trainer drives this scaler already."""
        if self._attached:
            raise StateError(
                f"init_trainer: {self!r} already drives another trainer; give each init_trainer "
                "call its own LossScaler (LossScaler.new_like() copies the configuration)."
            )

    def attach(self) -> None:
        """Mark this scaler as driven by a trainer (:func:`ampkit.init_trainer` calls it).
        Raises :class:`~ampkit.StateError` if one drives it already."""
        self.check_free()
        self._attached = True

    def detach(self) -> None:
        """The trainer driving this scaler let it go (``amp.reset``, a new ``init_trainer``)."""
        self._attached = False
        self._on_read = None

    def update(self, found_inf: bool) -> None:
        """Feed one step's event to the state machine (see the module docstring):
        ``found_inf``, whether the step's gradients held an inf/NaN (the host value of
        :meth:`unscale_`'s flag). The transition is :func:`next_state`; this method
        stores its result, logs overflows and raises.

        Raises :class:`~ampkit.NumericsError` when an overflow would back off from
        ``min_scale`` or when more than ``max_consecutive_skips`` overflows happened in
        a row; the state is updated before raising."""
        # the state and configuration were validated when set: the unchecked transition
        flag = found_inf if type(found_inf) is bool else _overflow(found_inf, f"{self.name}.update")
        state, event = _transition(self._state, self._config, flag)
        self._set_state(state)
        if event.kind in ("clean", "grown"):
            return
        what = {
            "static": "static scale",
            "tolerated": f"tolerated by hysteresis, {state.hysteresis_left} left",
            "at_floor": "already at min_scale",
            "backed_off": "backing off",
        }[event.kind]
        self._log_overflow(event.old_scale, what)
        if event.kind == "at_floor":
            raise NumericsError(
                f"{self.name}: gradients are still inf/NaN with the loss scale at its floor "
                f"min_scale={self.min_scale:g} ({state.consecutive_skips} step(s) skipped in "
                "a row). Loss scaling cannot fix this: the loss or the model produces inf/NaN "
                "by itself. Check the inputs and the loss for inf/NaN, lower the learning "
                "rate, run the overflowing ops in float32 (or train in bfloat16), or lower "
                "min_scale if the gradients are merely large."
            )
        if event.too_many_skips:
            raise NumericsError(
                f"{self.name}: {state.consecutive_skips} optimizer steps skipped in a row "
                f"(more than max_consecutive_skips={self.max_consecutive_skips}); the gradients "
                f"keep overflowing at loss scale {state.scale:g}. Check the inputs and the loss "
                "for inf/NaN, lower the learning rate, lower the scale (init_scale, "
                "backoff_factor, hysteresis), or run the overflowing ops in float32 / bfloat16."
            )

    def overflow_raises(self) -> bool:
        """Whether an overflow event fed to :meth:`update` now would raise
        :class:`~ampkit.NumericsError` (the scale at its floor, or the overflow one more
        than ``max_consecutive_skips`` in a row); changes nothing. Judged on the state as
        last updated: a trainer's pending outcome and the step asking are one event."""
        event = _transition(self._current, self._config, True)[1]
        return event.kind == "at_floor" or event.too_many_skips

    def state(self) -> ScalerState:
        """The current state (what :meth:`state_dict` holds besides the configuration)."""
        return self._state

    def set_scale(self, value: float) -> None:
        """Set ``S`` to ``value`` by hand (rounded to fp32; clamped to [min_scale,
        max_scale] when dynamic). Counters and the growth tracker are kept."""
        value = check_scale(value, f"{self.name}: set_scale")
        if self.dynamic:
            value = min(max(value, self.min_scale), self.max_scale)
        self._set_scale(value)

    def _set_scale(self, value: float) -> None:
        self._set_state(self._state._replace(scale=value))

    def _set_state(self, state: ScalerState) -> None:
        """Make ``state`` current; the inverse scale and the tensor mirrors follow a
        changed scale."""
        changed = state.scale != self._state.scale
        self._state = state
        if not changed:
            return
        self._inv_scale = to_fp32(1.0 / state.scale)
        for t in self._scale_tensors.values():
            t.fill_(state.scale)
        for t in self._inv_tensors.values():
            t.fill_(self._inv_scale)

    def _log_overflow(self, old: float, what: str) -> None:
        if not _LOG.isEnabledFor(logging.INFO) or not is_rank_zero():
            return
        _LOG.info(
            "%s: inf/NaN gradients, optimizer step skipped; scale %g -> %g (%s)",
            self.name,
            old,
            self._state.scale,
            what,
        )

    # --- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every field of the scaler: its configuration and its state, as Python numbers.

        Keys: ``scale``, ``growth_tracker``, ``hysteresis_left``, ``consecutive_skips``,
        ``num_events``, ``num_overflows`` (state) and the constructor arguments
        (``init_scale`` ... ``max_consecutive_skips``)."""
        return {**self._state._asdict(), **self._config}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` exactly (configuration and state).

        The whole dict is validated first (exactly the keys :meth:`state_dict` writes,
        the configuration by the constructor's rules, scales usable and within
        ``[min_scale, max_scale]`` when dynamic, counters ints in [0, 2**63)); a rejected
        dict raises :class:`~ampkit.ScalerError` and leaves this scaler unchanged."""
        self.prepare_load(state_dict)()

    def prepare_load(self, state_dict: Any) -> Callable[[], None]:
        """Validate ``state_dict`` (a :meth:`state_dict`) completely, changing nothing;
        return the function that applies it (which cannot fail). Lets a caller validate
        several objects before changing any. Raises :class:`~ampkit.ScalerError` as
        :meth:`load_state_dict` does."""
        self._before_read()  # a pending outcome updates the state it had, not the loaded one
        require_fields(state_dict, (*_STATE_KEYS, *CONFIG_KEYS), self.name, ScalerError,
                       source="LossScaler.state_dict()")
        cfg = _check_config({k: state_dict[k] for k in CONFIG_KEYS}, self.name)
        state = _check_state(state_dict, cfg, self.name)

        def apply() -> None:
            self._apply_config(cfg)
            self._set_state(ScalerState(**state))

        return apply

    def new_like(self, name: str | None = None) -> LossScaler:
        """A fresh scaler with this one's configuration and its initial state, called
        ``name`` (default: this scaler's name)."""
        return LossScaler(**self._config, name=self.name if name is None else name)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return (
            f"LossScaler({self.name!r}, {kind}, scale={self.scale:g}, "
            f"growth_tracker={self.growth_tracker}, hysteresis_left={self.hysteresis_left}, "
            f"consecutive_skips={self.consecutive_skips})"
        )
