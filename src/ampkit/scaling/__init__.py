"""Loss scaling with no optimizer knowledge: :class:`LossScaler` (the scale, its
growth and backoff, its state dict) and the grouped unscale-and-check of gradients
(:func:`group_grads`, :func:`unscale_and_check_`); the scale's state machine as a pure
function (:func:`next_state` of a :class:`ScalerState`)."""

from __future__ import annotations

from .loss_scaler import LossScaler, check_scale
from .transition import ScaleEvent, ScalerState, next_state, to_fp32
from .unscale import group_grads, unscale_and_check_

__all__ = [
    "LossScaler",
    "ScaleEvent",
    "ScalerState",
    "check_scale",
    "group_grads",
    "next_state",
    "to_fp32",
    "unscale_and_check_",
]
