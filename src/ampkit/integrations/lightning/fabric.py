"""The ``lightning.fabric`` precision plugin: :class:`AmpkitFabricPrecision`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ampkit import Fp8Recipe, OptLevel, Policy, TunePlan, scale_loss
from ampkit.distributed import register_ddp
from ampkit.errors import StateError
from ampkit.integrations import require

from ._core import plugin_core, unwrap
from .schedulers import HeldScheduler

require("lightning", "lightning")

from lightning.fabric.plugins import Precision as FabricPrecision  # noqa: E402

__all__ = ["AmpkitFabricPrecision"]

_DDP = nn.parallel.DistributedDataParallel


class AmpkitFabricPrecision(FabricPrecision):
    """ampkit's mixed precision as a ``lightning.fabric`` precision plugin. Fabric's
    precision hooks never see the optimizers together with the model, so the setup is
    one call of the plugin in place of ``fabric.setup``::

        precision = AmpkitFabricPrecision("O2")
        fabric = Fabric(accelerator="cpu", plugins=[precision])
        model, optimizer = precision.setup(fabric, model, optimizer)   # was fabric.setup(...)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)               # ampkit's casting scope
            fabric.backward(loss)                     # scaled by ampkit.scale_loss
            fabric.clip_gradients(model, optimizer, max_norm=1.0)   # real grads
            optimizer.step()                          # skips itself on inf/NaN
        fabric.save(path, {"model": model, "optimizer": optimizer, "amp": precision})

    Arguments (``opt_level``, ``dtype``, ``fp8``, ``loss_scale``, ``policy``, ``options``,
    ``plan``) as :class:`~ampkit.integrations.lightning.AmpkitPrecision`.

    :meth:`setup` moves the model to ``fabric.device``, runs :func:`ampkit.initialize`
    on it and the optimizers, then ``fabric.setup`` (which wraps DDP, after the cast),
    and registers a DDP model with :func:`ampkit.distributed.register_ddp`; a scheduler
    given comes back in a :class:`~ampkit.integrations.lightning.HeldScheduler`. The plugin itself is a stateful object
    for ``fabric.save``/``fabric.load``: put it in the state *after* the model and the
    optimizer (Fabric loads in that order; the plugin's fp32 masters come last).
    ``fabric.backward(loss)`` scales for the optimizers whose parameters require grad.
    """

    def __init__(
        self,
        opt_level: str | None = None,
        dtype: torch.dtype | None = None,
        fp8: Fp8Recipe | bool | None = None,
        *,
        loss_scale: float | str | None = None,
        policy: Policy | None = None,
        options: Mapping[str, Any] | None = None,
        plan: TunePlan | str | os.PathLike[str] | None = None,
    ) -> None:
        self._core = plugin_core(type(self).__name__, opt_level, dtype, fp8, loss_scale, policy, options, plan)
        self.precision = self._core.precision  # type: ignore[assignment]

    @property
    def opt_level(self) -> OptLevel:
        """The level set up (before setup: as it resolves on the default device type)."""
        return self._core.level

    def setup(
        self,
        fabric: Any,
        module: nn.Module,
        *optimizers: torch.optim.Optimizer,
        scheduler: Any = None,
    ) -> Any:
        """``fabric.setup(module, *optimizers, scheduler=scheduler)`` with ampkit set up
        first (see the class docstring). Returns what ``fabric.setup`` returns, the
        scheduler (if any) in a :class:`~ampkit.integrations.lightning.HeldScheduler`."""
        if getattr(getattr(fabric, "strategy", None), "precision", None) is not self:
            raise StateError(
                "AmpkitFabricPrecision.setup(fabric, ...) needs the Fabric this plugin was "
                "given to: Fabric(plugins=[precision]), then precision.setup(fabric, model, optimizer)."
            )
        module = fabric.to_device(module)
        self._core.set_up(module, [unwrap(o) for o in optimizers], manual=False)
        self.precision = self._core.precision  # type: ignore[assignment]
        kwargs = {"scheduler": scheduler} if scheduler is not None else {}
        out = fabric.setup(module, *optimizers, **kwargs)
        wrapped = out[0] if isinstance(out, tuple) else out
        for m in wrapped.modules():
            if isinstance(m, _DDP):
                register_ddp(m)
                break
        if scheduler is not None:
            out = (*out[:-1], HeldScheduler(out[-1]))
        return out

    # --- Fabric's hooks ---------------------------------------------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        """The module :meth:`setup` set up, as it is; any other raises
        :class:`ampkit.StateError` (``fabric.setup`` alone cannot give ampkit the
        optimizers)."""
        if self._core.module() is not module:
            raise StateError(
                "a Fabric with AmpkitFabricPrecision sets models up through the plugin, which "
                "needs the optimizers too: call precision.setup(fabric, model, optimizer) in "
                "place of fabric.setup(model, optimizer) (precision.setup(fabric, model) for "
                "inference)."
            )
        return module

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """ampkit's casting scope of the level around the set-up model's forward."""
        with self._core.scope():
            yield

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """``tensor.backward(*args, **kwargs)`` on the loss scaled by :func:`ampkit.scale_loss`
        (``model``, the module Fabric passes, is not needed)."""
        optimizers = self._core.backward_optimizers(None)
        if not optimizers:
            tensor.backward(*args, **kwargs)
            return
        with scale_loss(tensor, optimizers) as scaled:
            scaled.backward(*args, **kwargs)

    def main_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """:func:`ampkit.master_params` of ``optimizer`` (O2: the fp32 masters): what
        ``fabric.clip_gradients`` clips."""
        params = self._core.main_params(optimizer)
        if params is None:
            yield from super().main_params(unwrap(optimizer))
        else:
            yield from params

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """:func:`ampkit.unscale` of ``optimizer``, before Fabric clips."""
        self._core.unscale(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """``{"format", "opt_level", "dtype", "ampkit": ampkit.state_dict()}`` (``{}`` without optimizers)."""
        return self._core.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output into the session :meth:`setup` built."""
        self._core.load_state_dict(state_dict, type(self).__name__)
