"""Scale state and quantization: a :class:`TensorScale` per tensor role, the :class:`LayerState`
of one fp8 linear, and the casts ``q = saturate(t * scale)`` (tensorwise and rowwise,
current and delayed scaling)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import weakref
from typing import Any, Literal

import torch

from ampkit._internal.validate import (
    CORRUPT_CHECKPOINT,
    require_count,
    require_fields,
    require_flag,
    require_tensor,
)
from ampkit.errors import StateError

from .recipe import _EPS, _FP32_MAX, _MAX, _SCALE_KEYS, ROLES, Fp8Recipe


class TensorScale:
    """The scale state of one tensor role (input, weight or grad_output) of one layer.

    ``scale`` (fp32, 0-d) is what the last cast used, or under delayed scaling what the
    next one will use; ``amax`` the last abs-max seen (after the cross-rank reduction);
    ``amax_history`` (delayed only) the last ``amax_history_len`` abs-maxes, newest
    first; ``saturated`` counts casts whose values exceeded fp8's range and were
    clamped (only delayed scaling can do that)."""

    def __init__(self, history_len: int) -> None:
        self.scale = torch.ones(())
        self.amax = torch.zeros(())
        self.amax_history = torch.zeros(history_len)
        self.saturated = torch.zeros((), dtype=torch.int64)
        self.initialized = False
        self.calls = 0
        #: the scale of the last forward cast, for a checkpointed forward's recomputation
        self.used: torch.Tensor | None = None

    def to(self, device: torch.device) -> None:
        for name in ("scale", "amax", "amax_history", "saturated"):
            setattr(self, name, getattr(self, name).to(device))

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale.clone(),
            "amax": self.amax.clone(),
            "amax_history": self.amax_history.clone(),
            "saturated": self.saturated.clone(),
            "initialized": self.initialized,
            "calls": self.calls,
        }

    def check_state_dict(self, sd: Any, where: str, recipe: Fp8Recipe, fp8: torch.dtype) -> None:
        """Raise :class:`~ampkit.StateError` unless ``sd`` holds what this role's casts
        under ``recipe`` (into ``fp8``) can leave behind:

        - types: ``scale``, ``amax`` 0-d float32; ``amax_history`` float32 of the
          recipe's length; ``saturated`` 0-d int64; ``initialized`` a bool; ``calls`` an
          int in [0, 2**63).
        - A role never recorded (no call yet, or rowwise, which keeps no per-tensor
          scale) is as constructed: scale 1, amax 0, history and saturated 0.
        - Recorded: ``amax`` (the last abs-max seen) >= 0, or inf/NaN after an overflow.
          Delayed: ``scale`` (what the next cast uses) finite, within a factor 2 of the
          scales the recipe derives (:func:`scale_from_amax` of fp32's largest value and
          of 0); the history finite and >= 0; ``saturated <= calls``; ``initialized``.
          Current: ``scale`` (what the last cast used) as delayed's when ``amax`` is
          finite, else 0 or NaN (derived from inf/NaN); history and saturated 0, not
          ``initialized``."""
        require_fields(sd, _SCALE_KEYS, where, StateError)
        calls = require_count(sd["calls"], f"{where}: calls", StateError)
        initialized = require_flag(sd["initialized"], f"{where}: initialized", StateError)
        scalar: tuple[int, ...] = ()
        scale = require_tensor(sd["scale"], f"{where}: scale", StateError, torch.float32, scalar)
        amax = require_tensor(
            sd["amax"], f"{where}: amax", StateError, torch.float32, scalar, low=0.0
        )
        history = require_tensor(
            sd["amax_history"],
            f"{where}: amax_history",
            StateError,
            torch.float32,
            self.amax_history.shape,
            finite=True,
            low=0.0,
            hint="Use the same Fp8Recipe.amax_history_len as the saved run.",
        )
        saturated = int(
            require_tensor(
                sd["saturated"], f"{where}: saturated", StateError, torch.int64, scalar, low=0
            )
        )
        delayed = recipe.scaling == "delayed"
        recorded = recipe.granularity == "tensorwise" and calls > 0

        def bad(msg: str) -> StateError:
            return StateError(f"{where}: {msg}. {CORRUPT_CHECKPOINT}")

        if initialized != (delayed and recorded):
            raise bad(
                f"initialized={initialized} with calls={calls} under {recipe.describe()} scaling"
            )
        if not recorded or not delayed:
            if saturated or bool(history.any()):
                raise bad(
                    f"saturated={saturated} and amax_history (largest entry {float(history.amax())}) "
                    "must be 0 here: only delayed scaling records them, once it has cast"
                )
        if not recorded:
            if float(scale) != 1.0 or float(amax) != 0.0:
                raise bad(
                    f"scale={float(scale)}, amax={float(amax)}, but a role never recorded keeps 1 and 0"
                )
            return
        if delayed and saturated > calls:
            raise bad(f"saturated={saturated} exceeds calls={calls}")
        if not delayed and not bool(torch.isfinite(amax)):
            if float(scale) == 0.0 or scale.isnan():
                return
            raise bad(
                f"scale={float(scale)} after a cast whose abs-max was {float(amax)} (its scale is 0 or NaN)"
            )
        low, high = (float(scale_from_amax(torch.tensor(a), fp8, recipe)) for a in (_FP32_MAX, 0.0))
        value = float(scale)
        if not (math.isfinite(value) and low / 2 <= value <= 2 * high):
            raise bad(
                f"scale={value} lies outside [{low / 2:g}, {2 * high:g}], the range of scales this recipe derives"
            )

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        dev = self.scale.device
        self.scale = sd["scale"].detach().to(dev, torch.float32).clone()
        self.amax = sd["amax"].detach().to(dev, torch.float32).clone()
        self.amax_history = sd["amax_history"].detach().to(dev, torch.float32).clone()
        self.saturated = sd["saturated"].detach().to(dev, torch.int64).clone()
        self.initialized = bool(sd["initialized"])
        self.calls = int(sd["calls"])


def scale_from_amax(amax: torch.Tensor, fp8: torch.dtype, recipe: Fp8Recipe) -> torch.Tensor:
    """``fp8_max / max(amax, eps) / 2**margin`` in fp32, optionally rounded down to a power of 2."""
    amax = amax.float().clamp(min=_EPS)
    scale = (
        torch.full_like(amax, _MAX[fp8]) / amax
    )  # a true division (float / tensor is reciprocal * float)
    if recipe.margin:
        scale = scale / 2.0**recipe.margin
    if recipe.power_of_2_scales:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _all_reduce_max(amax: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return amax


def saturate(t: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    limit = _MAX[fp8]
    return (t.float() * scale).clamp(-limit, limit).to(fp8)


def _dequant(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``1/scale`` for ``_scaled_mm``; NaN when the tensor held inf/NaN, so the matmul's
    result is non-finite (and the loss scaler skips the step) rather than clamped."""
    inv = scale.reciprocal()
    return torch.where(torch.isfinite(amax), inv, torch.full_like(inv, float("nan")))


#: How a forward call treats the scale state: ``"train"`` uses it and advances it (the
#: abs-max agreed across ranks); ``"frozen"`` (no_grad evaluation, ``explain``) uses it and
#: leaves it alone, and never calls a collective (one rank may evaluate alone);
#: ``"replay"`` (activation checkpointing recomputing a forward inside backward) reuses the
#: scale the recomputed call used, so the recomputed operands equal the originals.
Mode = Literal["train", "frozen", "replay"]


def quantize_tensorwise(
    t: torch.Tensor,
    fp8: torch.dtype,
    state: TensorScale,
    recipe: Fp8Recipe,
    reduce: bool,
    mode: Mode,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in ``fp8`` with one scale; returns ``(q, 1/scale)``. In ``"train"`` mode
    ``state`` (scale, abs-max, history, saturation count) advances; see :data:`Mode`."""
    amax = t.detach().abs().amax().float()
    if reduce and recipe.reduce_amax and mode == "train":
        amax = _all_reduce_max(amax)
    if mode == "replay" and state.used is not None:
        scale = state.used
    elif recipe.scaling == "current" or not state.initialized:
        scale = scale_from_amax(amax, fp8, recipe)
    else:
        scale = state.scale
    q = saturate(t, scale, fp8)
    inv = _dequant(scale, amax)
    if mode != "replay":
        state.used = scale.detach()
    if mode == "train":
        _record(state, amax, scale, fp8, recipe)
    return q, inv


def _record(
    state: TensorScale, amax: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype, recipe: Fp8Recipe
) -> None:
    finite = torch.isfinite(amax)
    state.calls += 1
    state.amax = amax.detach().clone()
    if recipe.scaling == "current":
        state.scale = scale.detach().clone()
        return
    state.saturated = state.saturated + (finite & (amax * scale > _MAX[fp8])).to(torch.int64)
    if state.initialized:
        rolled = torch.roll(state.amax_history, 1)
    else:
        rolled = torch.zeros_like(state.amax_history)
    rolled[0] = amax
    # a non-finite abs-max (an overflow upstream, skipped by the loss scaler) never
    # enters the history: it would pin the scale at 0 for amax_history_len calls
    history = torch.where(
        finite, rolled, state.amax_history if state.initialized else torch.zeros_like(rolled)
    )
    state.amax_history = history
    ref = history.amax() if recipe.amax_compute_algo == "max" else history[0]
    # nothing finite and non-zero seen yet: keep the scale just used (1 if it was not finite)
    kept = scale if state.initialized else torch.where(finite, scale, torch.ones_like(scale))
    state.scale = torch.where(ref > 0, scale_from_amax(ref, fp8, recipe), kept).detach()
    state.initialized = True


def quantize_rowwise(
    t: torch.Tensor, fp8: torch.dtype, dim: int, recipe: Fp8Recipe
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` in ``fp8`` with one scale per slice along ``dim`` (the abs-max over ``dim``);
    returns ``(q, 1/scale, amax)`` with the scale shapes ``keepdim`` gives."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float()
    scale = scale_from_amax(amax, fp8, recipe)
    return saturate(t, scale, fp8), _dequant(scale, amax), amax


class LayerState:
    """What one fp8 linear keeps: its recipe, name, and a :class:`TensorScale` per role."""

    def __init__(self, name: str, recipe: Fp8Recipe) -> None:
        self.name = name
        # the filter only chose the layers; without it the model pickles (a lambda would not)
        self.recipe = (
            dataclasses.replace(recipe, module_filter=None) if recipe.module_filter else recipe
        )
        self.roles = {r: TensorScale(recipe.amax_history_len) for r in ROLES}
        self.handle = _register(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a deep copy or an unpickled layer keeps its own scale state: a handle of its own
        self.__dict__.update(state)
        self.handle = _register(self)

    def state_dict(self) -> dict[str, Any]:
        return {r: s.state_dict() for r, s in self.roles.items()}


#: LayerStates by handle, for the compiled op (which takes no Python objects); weak, so
#: a dropped model's state goes with it. Process-wide like the models themselves.
_HANDLES: weakref.WeakValueDictionary[int, LayerState] = weakref.WeakValueDictionary()
#: The next handle: module state so that handles are unique in the process.
_NEXT_HANDLE = itertools.count()


def _register(state: LayerState) -> int:
    handle = next(_NEXT_HANDLE)
    _HANDLES[handle] = state
    return handle
