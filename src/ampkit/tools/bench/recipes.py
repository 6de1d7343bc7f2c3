"""Precisions compared by ``ampkit bench``, each a small recipe object.

A recipe turns an fp32 model and optimizer into what the precision trains
(``prepare``), gives the scope the forward pass runs in (``scope``), and does
backward + optimizer step (``backward_step``), reporting whether the step was
skipped and the current loss scale. The training loop itself is shared
(:mod:`ampkit.tools.bench.worker`), so the only difference between two runs is the
recipe.

======================  ==================================================================
name                    what it runs
======================  ==================================================================
``fp32``                plain fp32 training
``torch-autocast``      ``torch.autocast`` around the forward; ``torch.amp.GradScaler``
                        when the dtype is fp16 (bf16 needs no loss scaling)
``ampkit-O1``           ``ampkit.initialize(opt_level="O1")``: op-level casting, fp32 weights
``ampkit-O2``           ``opt_level="O2"``: 16-bit model (norm layers fp32), fp32 master weights
``ampkit-O2K``          ``opt_level="O2K"``: bf16 model and bf16 weight updates with Kahan
                        compensation (no fp32 copy of the weights)
``bf16``                plain torch, no ampkit: the model (norm layers too), its inputs and
                        the optimizer's state in bf16, whatever ``--dtype`` says. The speed
                        limit of a 16-bit step and the accuracy floor (updates smaller than
                        half a bf16 unit of a weight are lost)
======================  ==================================================================

The ampkit recipes use only the public verbs a user would: ``initialize``,
``scale_loss``, ``step_skipped`` (and ``stats`` for the loss scale).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
from torch import nn

__all__ = [
    "PRECISIONS",
    "Recipe",
    "RecipeUnavailable",
    "FP32",
    "TorchAutocast",
    "AmpkitLevel",
    "PureBF16",
    "make_recipe",
]


class RecipeUnavailable(RuntimeError):
    """This precision cannot run here (e.g. the level does not support the dtype);
    the bench shows the message and carries on."""


class Recipe:
    """How one precision trains. Subclasses override the methods that differ."""

    name: str = ""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Return the model and optimizer to train (may change them in place)."""
        return model, optimizer

    def scope(self) -> ContextManager[Any]:
        """Context manager the forward pass and loss run in."""
        return contextlib.nullcontext()

    def backward_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        """Backward of ``loss`` and one optimizer step. Returns True if the step was
        skipped (non-finite gradients)."""
        loss.backward()
        optimizer.step()
        return False

    def loss_scale(self) -> float | None:
        """Current loss scale, or None when this precision does not scale the loss."""
        return None

    def cleanup(self) -> None:
        """Undo process-wide state (called between workloads)."""


class FP32(Recipe):
    """Plain fp32 training: the baseline."""

    name = "fp32"


class TorchAutocast(Recipe):
    """``torch.autocast`` in ``dtype`` around forward and loss; with fp16 also
    ``torch.amp.GradScaler`` (its default settings), as torch's AMP recipe says."""

    name = "torch-autocast"

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    def scope(self) -> ContextManager[Any]:
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is None:
            return super().backward_step(loss, optimizer)
        self.scaler.scale(loss).backward()
        self.scaler.step(optimizer)
        before = self.scaler.get_scale()
        self.scaler.update()
        # GradScaler skips exactly when it found inf/NaN grads, and then backs off.
        return self.scaler.get_scale() < before

    def loss_scale(self) -> float | None:
        return None if self.scaler is None else float(self.scaler.get_scale())


class AmpkitLevel(Recipe):
    """``ampkit.initialize(model, optimizer, opt_level=level, dtype=dtype, **overrides)``
    and the scale-loss training step."""

    def __init__(self, device: torch.device, dtype: torch.dtype, level: str, **overrides: Any) -> None:
        super().__init__(device, dtype)
        self.level = level
        self.overrides = overrides
        self.name = f"ampkit-{level}"
        self.optimizer: torch.optim.Optimizer | None = None
        import ampkit

        self.amp = ampkit

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        try:
            model, optimizer = self.amp.initialize(model, optimizer, opt_level=self.level, dtype=self.dtype, **self.overrides)
        except self.amp.AmpError as exc:
            raise RecipeUnavailable(f"{self.name}: {exc}") from exc
        self.optimizer = optimizer
        return model, optimizer

    def backward_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        with self.amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        return bool(self.amp.step_skipped(optimizer))

    def loss_scale(self) -> float | None:
        if self.optimizer is None:
            return None
        scales = self.amp.stats(self.optimizer).scales
        return float(scales[0]) if scales else None

    def cleanup(self) -> None:
        self.amp.reset()


class PureBF16(Recipe):
    """The whole model in bf16 (``model.to(torch.bfloat16)``), floating inputs cast
    to bf16 by a forward pre-hook, and the optimizer as built (its state follows
    the bf16 parameters). No loss scaling, no skipping."""

    name = "bf16"

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device, torch.bfloat16)
        self._handle: Any = None

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        if optimizer.state:
            raise RecipeUnavailable(f"{self.name}: the optimizer must not have state yet.")
        model.to(torch.bfloat16)  # in place: the optimizer holds the same Parameter objects
        self._handle = model.register_forward_pre_hook(_inputs_to_bf16)
        return model, optimizer

    def cleanup(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _inputs_to_bf16(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


# Every precision the bench knows, in the order it reports them.
PRECISIONS: tuple[str, ...] = ("fp32", "torch-autocast", "ampkit-O1", "ampkit-O2", "ampkit-O2K", "bf16")


def make_recipe(name: str, device: torch.device, dtype: torch.dtype) -> Recipe:
    """The recipe called ``name`` (one of :data:`PRECISIONS`); its ``prepare`` raises
    :class:`RecipeUnavailable` when the precision cannot run with this dtype."""
    if name == "fp32":
        return FP32(device, dtype)
    if name == "torch-autocast":
        return TorchAutocast(device, dtype)
    if name == "bf16":
        return PureBF16(device, dtype)
    if name.startswith("ampkit-") and name in PRECISIONS:
        return AmpkitLevel(device, dtype, name.removeprefix("ampkit-"))
    raise ValueError(f"unknown precision {name!r}; choose from {', '.join(PRECISIONS)}")
