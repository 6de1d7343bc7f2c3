"""Loss scaling with no optimizer knowledge: :class:`LossScaler` (the scale, its
growth and backoff, its state dict) and the grouped unscale-and-check of gradients
(:func:`group_grads`, :func:`unscale_and_check_`)."""

from __future__ import annotations

from .loss_scaler import LossScaler, check_scale, group_grads, to_fp32, unscale_and_check_

__all__ = ["LossScaler", "check_scale", "group_grads", "to_fp32", "unscale_and_check_"]
