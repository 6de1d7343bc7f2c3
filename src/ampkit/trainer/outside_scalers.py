"""A GradScaler outside ampkit's own step around a managed optimizer: ``torch.amp``'s
(under ``ampkit run``, or a script's own) and :class:`ampkit.GradScaler`. Their unscale
runs a fused kernel that leaves version counters alone, and their ``step`` may skip
without calling ``optimizer.step()``; these context managers keep the managed state
right around both."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .managed import _active_state

__all__ = ["unscaled_in_place", "stepped_by_scaler"]


@contextlib.contextmanager
def unscaled_in_place(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around an unscale of ``optimizer``'s grads by a GradScaler (ampkit's or
    torch.amp's ``unscale_``, whose fused kernel leaves version counters alone). For a
    managed optimizer with fp32 masters (O2) the model's grad edits reach the masters
    first and the model's 16-bit grads show the unscaled values after, so code that
    reads ``model.parameters()`` grads next (``clip_grad_norm_``) sees what the step
    uses. Nothing for other optimizers. A framework's wrapper stands for the optimizer
    it holds (:func:`resolve_optimizer`)."""
    state = _active_state(optimizer)
    if state is None:
        yield
        return
    state.grad_path.before_outside_unscale()
    yield
    state.grad_path.after_outside_unscale()


@contextlib.contextmanager
def stepped_by_scaler(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around a GradScaler's ``step(optimizer)`` outside ampkit (torch.amp's): when it
    skips the step (``optimizer.step()`` not called), a managed optimizer counts a
    skipped step (:meth:`ManagedOptimizer.skipped_elsewhere`). Nothing for others."""
    state = _active_state(optimizer)
    steps = state.steps if state is not None else None
    yield
    if state is not None and state._active and state.steps == steps:
        state.skipped_elsewhere()
