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
  a disabled GradScaler (nanoGPT's, off unless the script trains in fp16) does neither,
  and goes straight to torch's own.

The optimizers' steps are watched per optimizer (:mod:`.steps`), not by torch's
process-wide optimizer step hooks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ampkit.trainer.outside_scalers import stepped_by_scaler, unscaled_in_place

__all__ = ["TorchPatches"]


class TorchPatches:
    """The patches above; :meth:`install` once, :meth:`remove` (idempotent) after."""

    def __init__(
        self,
        on_optimizer: Callable[[torch.optim.Optimizer], None],
        on_backward: Callable[[Callable[..., Any], Any, tuple, dict], Any],
    ) -> None:
        self._on_optimizer = on_optimizer
        self._on_backward = on_backward
        self._orig_opt_init: Callable[..., None] | None = None
        self._orig_backward: Callable[..., Any] | None = None
        self._orig_unscale: Callable[..., None] | None = None
        self._orig_scaler_step: Callable[..., Any] | None = None

    def install(self) -> None:
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
            if not scaler.is_enabled():  # it changes nothing (nanoGPT's scaler off in bf16)
                return orig_unscale(scaler, optimizer)
            with unscaled_in_place(optimizer):
                orig_unscale(scaler, optimizer)

        # ... and a step it skips (optimizer.step() not called) counts as skipped.
        orig_scaler_step = torch.amp.GradScaler.step
        self._orig_scaler_step = orig_scaler_step

        @functools.wraps(orig_scaler_step)
        def scaler_step(scaler: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if not scaler.is_enabled():  # it calls optimizer.step(): no step it skips
                return orig_scaler_step(scaler, optimizer, *args, **kwargs)
            with stepped_by_scaler(optimizer):
                return orig_scaler_step(scaler, optimizer, *args, **kwargs)

        torch.optim.Optimizer.__init__ = optimizer_init  # type: ignore[method-assign]
        torch.autograd.backward = backward
        torch.amp.GradScaler.unscale_ = unscale_  # type: ignore[method-assign]
        torch.amp.GradScaler.step = scaler_step  # type: ignore[method-assign]

    def remove(self) -> None:
        """Put back what :meth:`install` replaced."""
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
