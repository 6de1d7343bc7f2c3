"""The launcher's process-wide patches of torch, for the length of a run.

:class:`TorchPatches` replaces, and restores at :meth:`~TorchPatches.remove`:

* ``torch.optim.Optimizer.__init__``: every optimizer the script builds is reported
  (``on_optimizer(opt)``) once built;
* ``torch.autograd.backward`` (what ``Tensor.backward`` calls): each call is handed to
  ``on_backward(orig, tensors, args, kwargs)``, which runs ``orig``;
* ``torch.amp.GradScaler.unscale_`` and ``step``: a script's own GradScaler unscales
  O2 masters' grads with a kernel that leaves version counters alone, and skips a step
  by not calling ``optimizer.step()``; ampkit is told of both
  (:func:`ampkit.trainer.outside_scalers.unscaled_in_place`, ``stepped_by_scaler``);

and registers torch's global optimizer step pre/post hooks (``before_step``,
``after_step``: ``(opt, args, kwargs)``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ampkit.trainer.outside_scalers import stepped_by_scaler, unscaled_in_place

__all__ = ["TorchPatches"]

StepHook = Callable[[torch.optim.Optimizer, Any, Any], None]


class TorchPatches:
    """The patches above; :meth:`install` once, :meth:`remove` (idempotent) after."""

    def __init__(
        self,
        on_optimizer: Callable[[torch.optim.Optimizer], None],
        on_backward: Callable[[Callable[..., Any], Any, tuple, dict], Any],
        before_step: StepHook,
        after_step: StepHook,
    ) -> None:
        self._on_optimizer = on_optimizer
        self._on_backward = on_backward
        self._before_step = before_step
        self._after_step = after_step
        self._orig_opt_init: Callable[..., None] | None = None
        self._orig_backward: Callable[..., Any] | None = None
        self._orig_unscale: Callable[..., None] | None = None
        self._orig_scaler_step: Callable[..., Any] | None = None
        self._step_handle: Any = None
        self._pre_handle: Any = None

    def install(self) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        on_optimizer, on_backward = self._on_optimizer, self._on_backward
        orig_init = torch.optim.Optimizer.__init__
        self._orig_opt_init = orig_init

        @functools.wraps(orig_init)
        def optimizer_init(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            orig_init(opt, *args, **kwargs)
            on_optimizer(opt)

        orig_backward = torch.autograd.backward
        self._orig_backward = orig_backward

        @functools.wraps(orig_backward)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            return on_backward(orig_backward, tensors, args, kwargs)

        # A script's torch.amp.GradScaler unscales the masters' grads (O2) with a kernel
        # that leaves version counters alone: ampkit is told, so the model shows them too.
        orig_unscale = torch.amp.GradScaler.unscale_
        self._orig_unscale = orig_unscale

        @functools.wraps(orig_unscale)
        def unscale_(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
            with unscaled_in_place(optimizer):
                orig_unscale(scaler, optimizer)

        # ... and a step it skips (optimizer.step() not called) counts as skipped.
        orig_scaler_step = torch.amp.GradScaler.step
        self._orig_scaler_step = orig_scaler_step

        @functools.wraps(orig_scaler_step)
        def scaler_step(scaler: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            with stepped_by_scaler(optimizer):
                return orig_scaler_step(scaler, optimizer, *args, **kwargs)

        torch.optim.Optimizer.__init__ = optimizer_init  # type: ignore[method-assign]
        torch.autograd.backward = backward
        torch.amp.GradScaler.unscale_ = unscale_  # type: ignore[method-assign]
        torch.amp.GradScaler.step = scaler_step  # type: ignore[method-assign]
        self._step_handle = register_optimizer_step_post_hook(self._after_step)
        self._pre_handle = register_optimizer_step_pre_hook(self._before_step)

    def remove(self) -> None:
        """Put back what :meth:`install` replaced and remove its hooks."""
        if self._orig_opt_init is not None:
            torch.optim.Optimizer.__init__ = self._orig_opt_init  # type: ignore[method-assign]
            self._orig_opt_init = None
        if self._orig_backward is not None:
            torch.autograd.backward = self._orig_backward
            self._orig_backward = None
        if self._orig_unscale is not None:
            torch.amp.GradScaler.unscale_ = self._orig_unscale  # type: ignore[method-assign]
            torch.amp.GradScaler.step = self._orig_scaler_step  # type: ignore[method-assign]
            self._orig_unscale = self._orig_scaler_step = None
        for handle in (self._step_handle, self._pre_handle):
            if handle is not None:
                handle.remove()
        self._step_handle = self._pre_handle = None
