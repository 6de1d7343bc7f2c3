"""O2 master weights under ``torch.amp.GradScaler``: its ``step`` unscales the masters'
grads with a fused kernel ampkit cannot see, before it calls the managed ``step()``."""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING, Any

import torch

from ampkit.errors import StateError

if TYPE_CHECKING:
    from .grad_hooks import GradPath

__all__ = ["refuse_unseen_torch_unscale", "refuse_scaled_handoff"]


def refuse_unseen_torch_unscale(grad_path: GradPath, optimizer: torch.optim.Optimizer) -> None:
    """O2: raise, before anything changes, when ``torch.amp.GradScaler.step`` calls
    this step (of ``optimizer``) after unscaling the masters' grads where ampkit could
    not see it (its fused kernel leaves version counters alone; ``ampkit run`` tells
    ampkit, a script's own ``initialize`` cannot): the model's grads would still show
    the scaled values and the step would take them for an edit. The scale and flag the
    scaler hands a fused optimizer for this one call are taken off it first (the raise
    skips the scaler's own removal: they would reach every later step's fused kernel)."""
    if grad_path.take_followed():
        return
    scaler = _torch_scaler_stepping()
    if scaler is None or not scaler.is_enabled():
        return
    raise _refusal(
        optimizer,
        "torch.amp.GradScaler.step() called the step of an optimizer with fp32 master "
        "weights (O2): its unscale_ changed the masters' grads where ampkit cannot see "
        "it, so the model's grads (what clip_grad_norm_(model.parameters()) reads) "
        "still held the scaled values and the step would mix the two. Use "
        "ampkit.GradScaler, which has torch.amp.GradScaler's interface (from ampkit "
        "import GradScaler), or ampkit.scale_loss and optimizer.step(); or run the "
        "unmodified script under `ampkit run --level O2`."
    )


def _torch_scaler_stepping() -> Any:
    """The ``torch.amp.GradScaler`` whose ``step`` is on the calling thread's stack a
    few frames up (it calls ``optimizer.step()``), or None."""
    code = inspect.unwrap(torch.amp.GradScaler.step).__code__  # under a wrapper (ampkit run) too
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def refuse_scaled_handoff(optimizer: torch.optim.Optimizer) -> None:
    """Raise, before anything changes, where ``torch.amp.GradScaler.step`` hands a fused
    ``optimizer`` its scale for torch's kernel to apply (the grads still scaled: no
    ``unscale_`` before ``step``) while kernels of ampkit's read the same grads (O2K's
    compensated updates; :attr:`StepExtension.steps_grads_itself
    <ampkit.trainer.extensions.StepExtension.steps_grads_itself>`): they would step with
    the scaled grads. After ``unscale_`` the scaler hands its inf flag alone
    (``grad_scale`` None), which is fine. The scale and flag, set for this one call, are
    taken off the optimizer first (the raise skips the scaler's own removal: they would
    reach every later step's fused kernel)."""
    if optimizer.__dict__.get("grad_scale") is None:
        return
    raise _refusal(
        optimizer,
        "compensated updates (O2K) on a fused optimizer stepped by torch.amp.GradScaler "
        "without its unscale_: the scaler leaves the grads scaled for torch's fused kernel, "
        "which the compensated 16-bit updates cannot take. Nothing was changed. Call "
        "scaler.unscale_(optimizer) before scaler.step(optimizer), or use ampkit's loss "
        "scaling (ampkit.scale_loss after ampkit.initialize or ampkit.init_trainer; "
        "ampkit.GradScaler has torch.amp.GradScaler's interface), or a non-fused optimizer "
        "with the scaler (it unscales the grads before step()); under `ampkit run`, another "
        "level or the script's scaler off (enabled=False)."
    )


def _refusal(optimizer: torch.optim.Optimizer, message: str) -> StateError:
    """The error refusing a step handed over by ``torch.amp.GradScaler.step``, after taking
    off ``optimizer`` the scale and flag the scaler set for this one call (the raise skips
    the scaler's own removal: they would reach every later step's fused kernel)."""
    optimizer.__dict__.pop("grad_scale", None)
    optimizer.__dict__.pop("found_inf", None)
    return StateError(message)
