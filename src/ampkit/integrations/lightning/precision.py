"""The Lightning ``Trainer`` precision plugin: :class:`AmpkitPrecision`."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ampkit import Fp8Recipe, OptLevel, Policy, TunePlan, scale_loss
from ampkit.distributed import register_ddp
from ampkit.errors import AmpError
from ampkit.integrations import require

from ._core import hold, plugin_core, unwrap
from ._settings import device_type_of

require("lightning", "lightning")

from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

__all__ = ["AmpkitPrecision"]

_DDP = nn.parallel.DistributedDataParallel


class AmpkitPrecision(Precision):
    """ampkit's mixed precision as a Lightning ``Trainer`` precision plugin::

        trainer = Trainer(plugins=[AmpkitPrecision("O2")])           # one device
        trainer = Trainer(strategy="ampkit_ddp", devices=2,          # DDP, any level
                          plugins=[AmpkitPrecision("O2")])

    Args:
        opt_level (str | None): ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"`` or ``"O2K"``
            (see :func:`ampkit.initialize`); None: ``AMPKIT_LEVEL`` if set, else ``"O1"``. Default: ``None``.
        dtype (torch.dtype | None): the compute dtype, ``torch.bfloat16`` or
            ``torch.float16``; None: ``AMPKIT_DTYPE`` if set, else the level's default on
            the model's device (bf16 on CPU, fp16 on CUDA; O2K is always bf16). fp16 on CPU is emulated (slow). Default: ``None``.
        fp8 (ampkit.Fp8Recipe | bool | None): fp8 matmuls for the linears the
            recipe chooses (True: the default recipe), as ``ampkit.initialize(fp8=...)``. Default: ``None``.
        loss_scale (float | "dynamic" | None): ``"dynamic"`` or a static scale; None:
            the level's default (dynamic for fp16 at O1/O2, 1 otherwise). Default: ``None``.
        policy (ampkit.Policy | None): the op-level casting policy (O1, O2, O2K). Default: ``None``.
        options (Mapping[str, Any] | None): further ``ampkit.initialize`` options by
            name (``keep_fp32``, ``keep_norm_fp32``, ``cast_model_outputs``,
            ``master_weights``, ``compensation``, ``min_loss_scale``, ``max_loss_scale``,
            ``num_losses``, ``fast_kernels``, ``model_grads``, ...). Every argument is
            checked here: a bad one raises :class:`ampkit.AmpError` before any Trainer
            exists. Default: ``None``.
        plan (ampkit.TunePlan | str | os.PathLike | None): a per-module plan from
            :func:`ampkit.tune` (or the path of a saved one): its level and dtype where
            ``opt_level``/``dtype`` are None, its kept modules pinned to fp32 in the policy
            and, at O2/O3/O2K, in ``keep_fp32``, as ``ampkit.initialize(plan=...)``. Default: ``None``.

    What it does in the Trainer:

    - ``connect`` (after ``configure_optimizers``): :func:`ampkit.initialize` on the
      LightningModule and its optimizers, a fresh ampkit session (O2: fp32 masters built
      from the fp32 weights, then the model cast in place). Under ``strategy="ddp"`` the
      model arrives wrapped: O0/O1 are set up on the wrapped module; levels that cast
      the model need the cast before the wrap: ``strategy="ampkit_ddp"``
      (:class:`~ampkit.integrations.lightning.AmpkitDDPStrategy`). The DDP model is
      registered with :func:`ampkit.distributed.register_ddp` (O2's masters broadcast from
      rank 0). Without optimizers (``validate``/``test``/``predict`` on a model this
      plugin has not set up) the model is cast as the level says.
    - the step contexts (training, validation, test, predict): ampkit's casting scope in
      the level's dtype (O1; O2/O2K too, for code outside the model); nothing at O0/O3.
      O1's casting is this scope, never process-wide.
    - ``backward``: the loss scaled by :func:`ampkit.scale_loss` for the step's optimizer
      (manual optimization: the optimizers whose parameters require grad, as
      ``toggle_optimizer`` leaves them), then ``LightningModule.backward``. Hooks
      (``on_before_backward``) see the unscaled loss, ``on_after_backward`` real grads.
    - the optimizer step: Lightning's closure (training step, backward,
      ``on_before_optimizer_step``, clipping) runs first, then the managed ``step()``,
      which skips the update (params, optimizer state and ampkit's masters bitwise
      unchanged) on inf/NaN gradients; :func:`ampkit.step_skipped` tells. Schedulers configured with
      ``"interval": "step"`` are wrapped in a :class:`~ampkit.integrations.lightning.HeldScheduler`, held on skipped
      steps. Lightning's ``global_step`` counts skipped steps too (as with its own
      ``"16-mixed"``).
    - ``gradient_clip_val``/``gradient_clip_algorithm`` and ``self.clip_gradients``: after
      :func:`ampkit.unscale`, on :func:`ampkit.master_params` (O2: the fp32 masters, with
      grad edits made in ``on_after_backward`` merged in).
    - checkpoints: ``state_dict()`` holds :func:`ampkit.state_dict` (loss scales, step
      counters, O2's fp32 masters, O2K's compensation, fp8 scales), saved by Lightning
      under ``"AmpkitPrecision"``; ``trainer.fit(ckpt_path=...)`` restores it after the
      setup, so a resumed run continues bitwise.

    One ampkit session runs per process: a new ``fit`` (of any Trainer) starts a fresh
    one. After ``fit`` the session stays, so ``trainer.save_checkpoint`` still holds it.
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
        #: Lightning's name of what is computed ("bf16-mixed", "16-mixed", "bf16-true", ...)
        self.precision = self._core.precision  # type: ignore[assignment]

    @property
    def opt_level(self) -> OptLevel:
        """The level set up (before setup: as it resolves on the default device type)."""
        return self._core.level

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers ampkit manages for this plugin (empty before ``fit``)."""
        return list(self._core.optimizers)

    # --- Lightning's hooks ----------------------------------------------------------------

    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Set ampkit up on ``model`` (the LightningModule, or the DDP wrapping it) and
        ``optimizers`` (see the class docstring); return them with the configs in
        ``lr_schedulers`` whose interval is ``"step"`` holding their scheduler in a
        :class:`~ampkit.integrations.lightning.HeldScheduler`."""
        wrapped = model if isinstance(model, _DDP) else None
        module = wrapped.module if wrapped is not None else model
        raw = [unwrap(o) for o in optimizers]
        core = self._core
        if not core.is_set_up(module, raw):
            if wrapped is not None and core.settings.level(device_type_of(module)).cast_model_type is not None:
                raise AmpError(
                    f"AmpkitPrecision({core.settings.opt_level!r}) casts the model's weights, which "
                    "must happen before DistributedDataParallel wraps the model, but "
                    "strategy='ddp' wraps it before the precision plugin is set up. Use "
                    "Trainer(strategy='ampkit_ddp') or strategy=AmpkitDDPStrategy(...) "
                    "(from ampkit.integrations.lightning), which sets ampkit up first; O0 and "
                    "O1 also run under strategy='ddp'."
                )
            core.set_up(module, raw, manual=not getattr(module, "automatic_optimization", True))
            self.precision = core.precision  # type: ignore[assignment]
        if wrapped is not None:
            register_ddp(wrapped)
        return model, optimizers, [hold(config) for config in lr_schedulers]

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """ampkit's casting scope of the level (O1, O2, O2K), around Lightning's training,
        validation, test and predict steps."""
        with self._core.scope():
            yield

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: Any,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """``model.backward`` (the LightningModule's hook) on ``tensor``, the loss, scaled by
        :func:`ampkit.scale_loss` for ``optimizer`` (None, in manual optimization: the
        optimizers whose parameters require grad); ``*args``/``**kwargs`` go on to
        ``backward`` as Lightning passes them."""
        optimizers = self._core.backward_optimizers(optimizer)
        if not optimizers:
            super().backward(tensor, model, optimizer, *args, **kwargs)
            return
        with scale_loss(tensor, optimizers) as scaled:
            super().backward(scaled, model, optimizer, *args, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Lightning's ``closure`` (training step, backward, ``on_before_optimizer_step``,
        clipping, with ``model`` the LightningModule), then the managed
        ``optimizer.step(**kwargs)``, which skips itself on inf/NaN grads. Returns the
        closure's result. LBFGS, which evaluates the closure itself, gets it as with
        Lightning's own plugin."""
        if isinstance(unwrap(optimizer), torch.optim.LBFGS):
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        result = self._wrap_closure(model, optimizer, closure)
        optimizer.step(**kwargs)
        return result

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Lightning's clipping of ``optimizer``'s real gradients to ``clip_val`` (by norm or
        by value, as ``gradient_clip_algorithm`` says; 0 clips nothing): after
        :func:`ampkit.unscale`, on :meth:`main_params` (O2: the fp32 masters)."""
        if clip_val > 0:
            self._core.unscale(optimizer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def main_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The parameters ``optimizer`` steps: :func:`ampkit.master_params` (O2: the fp32
        masters and the fp32 norm parameters)."""
        params = self._core.main_params(optimizer)
        if params is None:
            yield from super().main_params(unwrap(optimizer))
        else:
            yield from params

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """:func:`ampkit.unscale` of ``optimizer`` (the grads are unscaled already when
        backward ends; this merges grad edits and closes the step's check)."""
        self._core.unscale(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """``{"format", "opt_level", "dtype", "ampkit": ampkit.state_dict()}`` while a fit's
        session is set up; ``{}`` otherwise (Lightning then saves nothing for the plugin)."""
        return self._core.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (Lightning calls it after the setup, before the
        optimizers' state). Outside ``fit`` (no optimizers) there is nothing to restore:
        the model's weights come from the checkpoint's ``state_dict``."""
        self._core.load_state_dict(state_dict, type(self).__name__)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Lightning passes the whole checkpoint first: one saved without this plugin's
        entry (another precision, or none) resumes a ``fit`` with a fresh loss scale and
        counters and fp32 state rebuilt from the 16-bit weights -- warned, as the HF and
        Accelerate integrations warn."""
        if self._core.optimizers and type(self).__qualname__ not in checkpoint:
            warnings.warn(
                f"ampkit: the checkpoint holds no {type(self).__qualname__} entry (saved without "
                "ampkit, or with another precision): the loss scale and step counters start afresh, "
                f"{self._core.level.name}'s fp32 master weights and compensation from the loaded "
                "weights, so the resume is not exact.",
                UserWarning,
                stacklevel=2,
            )

    def teardown(self) -> None:
        """The session stays (``trainer.save_checkpoint`` after ``fit`` saves it); a new
        ``fit`` replaces it."""
