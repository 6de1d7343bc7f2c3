"""``ampkit.GradScaler``: torch.amp.GradScaler's interface on top of :class:`LossScaler`.

A torch.amp script changes one import::

    scaler = ampkit.GradScaler("cpu")          # was torch.amp.GradScaler("cpu")
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    stepped = scaler.step(opt)                 # True if the step ran, False if skipped
    scaler.update()

and gains hysteresis, a floor and a cap on the scale, a skipped-step signal (``step``'s
return value and ``ampkit.step_skipped(opt)``), schedulers that do not warn after a
skipped step, and :class:`~ampkit.NumericsError` instead of a scale that halves forever.

Differences from torch.amp.GradScaler: ``step`` returns whether it stepped (not the
optimizer's return value); the scale is floored at ``min_scale`` (default 1) and capped
at ``max_scale`` (default 2**24); optimizers with ``_step_supports_amp_scaling`` (fused
Adam/AdamW) take the generic path (ampkit unscales, checks and skips); errors are
ampkit's (:class:`~ampkit.StateError` is a RuntimeError, :class:`~ampkit.ScalerError` a
ValueError). With ``hysteresis=1`` and the scale inside [min_scale, max_scale], the
parameters and scales are bitwise those of torch.amp.GradScaler.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ampkit._internal.validate import require_fields, require_optimizer
from ampkit.errors import ScalerError, StateError
from ampkit.scaling.loss_scaler import CONFIG_KEYS, LossScaler, group_grads

from .managed import record_unmanaged_step
from .outside_scalers import unscaled_in_place
from .schedulers import mark_step_called

__all__ = ["GradScaler"]

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"
_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _check_device(device: Any) -> str:
    """``device`` as torch.amp.GradScaler takes it: a device type string, with a
    backend torch knows ("cuda" may be absent: the scaler then disables itself)."""
    if not isinstance(device, str):
        raise ScalerError(f"GradScaler: device must be a device type string such as 'cpu', got {device!r}.")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ScalerError(f"GradScaler: {device!r} is not a torch device type; use 'cpu' or 'cuda'.") from None
    if kind not in ("cpu", "cuda"):
        backend = getattr(torch, kind, None)
        available = getattr(backend, "is_available", None)
        if available is None or not available():
            raise ScalerError(
                f"GradScaler: device {device!r} is not available on this machine; use 'cpu' "
                "(or the device your model's parameters are on)."
            )
    return device


def _check_torch_fields_agree(state_dict: Mapping[str, Any]) -> None:
    """In ampkit's format the ``"ampkit"`` entry is loaded; torch.amp's keys beside it
    repeat its values, so one that differs from it means the dict was edited."""
    inner = state_dict["ampkit"]
    for key in _TORCH_KEYS:
        if key not in state_dict:
            continue
        value, saved = state_dict[key], inner[key.lstrip("_")]
        if type(value) is not type(saved) or value != saved:
            raise ScalerError(
                f"GradScaler: state dict field {key!r} is {value!r}, its 'ampkit' entry (what "
                f"is loaded) says {saved!r}; the two were saved equal. Pass the dict "
                "GradScaler.state_dict() returned as it was saved, or drop 'ampkit' to load "
                "torch.amp's fields alone."
            )


class _OptRecord:
    __slots__ = ("stage", "found", "found_host")

    def __init__(self) -> None:
        self.stage = _READY
        self.found: torch.Tensor | None = None  # fp32 0-dim, 1.0 if inf/NaN found
        self.found_host: bool | None = None


class GradScaler:
    """torch.amp.GradScaler's interface, driven by an ampkit :class:`LossScaler`.

    Args (defaults in brackets): ``device`` ["cuda"], ``init_scale`` [2**16],
    ``growth_factor`` [2.0], ``backoff_factor`` [0.5], ``growth_interval`` [2000],
    ``enabled`` [True] as in torch (``device="cuda"`` without CUDA warns and disables,
    like torch); and ampkit's ``hysteresis`` [1], ``min_scale`` [1.0], ``max_scale``
    [2**24], ``consecutive_hysteresis`` [False], ``max_consecutive_skips`` [100] (see
    :class:`LossScaler`).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        consecutive_hysteresis: bool = False,
        max_consecutive_skips: int | None = 100,
    ) -> None:
        device = _check_device(device)
        if not isinstance(enabled, bool):
            raise ScalerError(f"GradScaler: enabled must be True or False, got {enabled!r}.")
        arguments = locals()  # the LossScaler settings among them go to it by name
        settings = {key: arguments[key] for key in CONFIG_KEYS if key in arguments}
        self._scaler = LossScaler(**settings, name="GradScaler")
        self._device = device
        self._enabled = enabled
        if self._enabled and device == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "ampkit.GradScaler is enabled for device 'cuda', but CUDA is not available; "
                "disabling. Pass device='cpu' to scale on the CPU.",
                UserWarning,
                stacklevel=2,
            )
            self._enabled = False
        self._records: dict[int, _OptRecord] = {}

    @property
    def loss_scaler(self) -> LossScaler:
        """The :class:`LossScaler` holding the scale and its state machine."""
        return self._scaler

    def _record(self, optimizer: torch.optim.Optimizer) -> _OptRecord:
        require_optimizer(optimizer, "GradScaler", StateError)
        record = self._records.get(id(optimizer))
        if record is None:
            record = self._records[id(optimizer)] = _OptRecord()
        return record

    def scale(self, outputs: Any) -> Any:
        """``outputs * S`` for a tensor, or for each tensor of a (nested) list/tuple/iterable.
        Returned unchanged when disabled."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scaler.scale_tensor(outputs.device)

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value * self._scaler.scale_tensor(value.device)
            if isinstance(value, Iterable):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ScalerError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the optimizer's grads in place and check them for inf/NaN (one fused
        pass per device/dtype, no host sync). At most once per optimizer per ``update``.
        For an optimizer with fp32 masters (O2) the model's 16-bit grads show the
        unscaled values too, so ``clip_grad_norm_(model.parameters())`` reads them."""
        if not self._enabled:
            return
        record = self._record(optimizer)
        if record.stage == _UNSCALED:
            raise StateError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if record.stage == _STEPPED:
            raise StateError("unscale_() is being called after step().")
        scaler = self._scaler
        with unscaled_in_place(optimizer):
            params = (p for group in optimizer.param_groups for p in group["params"])
            groups = group_grads(params, allow_fp16=False)
            found = scaler.unscale_groups_(groups)
        if found is None:
            found = torch.zeros((), dtype=torch.float32, device=self._device)
        record.found = found
        record.stage = _UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """Unscale (unless :meth:`unscale_` did), then run ``optimizer.step(*args, **kwargs)``
        if every grad is finite. Returns True if the optimizer stepped, False if skipped.
        One host sync. A skipped step still marks the optimizer as stepped for LR
        schedulers (``optimizer._opt_called``), so they do not warn."""
        if not self._enabled:
            optimizer.step(*args, **kwargs)
            return True
        if "closure" in kwargs:
            raise StateError(
                "GradScaler.step does not take a closure; use ampkit.init_trainer and "
                "optimizer.step(closure) instead."
            )
        record = self._record(optimizer)
        if record.stage == _STEPPED:
            raise StateError("step() has already been called since the last update().")
        if record.stage == _READY:
            self.unscale_(optimizer)
        assert record.found is not None
        skipped = bool(record.found.item())
        record.found_host = skipped
        record.stage = _STEPPED
        if skipped:
            mark_step_called(optimizer)
        else:
            optimizer.step(*args, **kwargs)
        record_unmanaged_step(optimizer, skipped)
        return not skipped

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Feed this iteration's event (overflow if any optimizer's grads had inf/NaN) to
        the scaler, or set the scale to ``new_scale``. Call once per iteration, after
        ``step`` for every optimizer. May raise :class:`~ampkit.NumericsError`."""
        if not self._enabled:
            return
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad or new_scale.is_complex():
                    raise StateError(
                        "new_scale must be a float or a 1-element real tensor without requires_grad."
                    )
                new_scale = new_scale.item()
            self._scaler.set_scale(new_scale)  # validates before changing anything
            self._records = {}
            return
        records, self._records = self._records, {}
        if not records:
            raise StateError(
                "update(): no inf checks were recorded this iteration; call scaler.step(opt) "
                "(or unscale_) before update()."
            )
        pending = [r.found for r in records.values() if r.found_host is None]
        found_any = any(r.found_host for r in records.values() if r.found_host is not None)
        if pending and not found_any:
            found_any = bool(sum(f.to(pending[0].device) for f in pending).item())
        self._scaler.update(found_any)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled)."""
        return self._scaler.scale if self._enabled else 1.0

    def is_enabled(self) -> bool:
        """Whether this scaler scales at all."""
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._scaler.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._scaler.configure(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self._scaler.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._scaler.configure(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self._scaler.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._scaler.configure(growth_interval=new_interval)

    def state_dict(self) -> dict[str, Any]:
        """torch.amp.GradScaler's keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus ``ampkit``: the full
        :meth:`LossScaler.state_dict`. Empty when disabled."""
        if not self._enabled:
            return {}
        scaler = self._scaler
        return {
            "scale": scaler.scale,
            "growth_factor": scaler.growth_factor,
            "backoff_factor": scaler.backoff_factor,
            "growth_interval": scaler.growth_interval,
            "_growth_tracker": scaler.growth_tracker,
            "ampkit": scaler.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`, or a torch.amp.GradScaler state dict (then only its
        five fields change; hysteresis and the other ampkit fields keep their values).
        The dict is validated completely first: a rejected one raises
        :class:`~ampkit.ScalerError` (or :class:`~ampkit.StateError` when empty) and
        changes nothing."""
        if not self._enabled:
            return
        if not isinstance(state_dict, Mapping):
            raise ScalerError(
                f"GradScaler: expected a state dict (a dict returned by state_dict()), got "
                f"{type(state_dict).__name__}."
            )
        if len(state_dict) == 0:
            raise StateError(
                "The source state dict is empty, possibly because it was saved from a "
                "disabled GradScaler."
            )
        source = "GradScaler.state_dict() (ampkit's or torch.amp's)"
        if "ampkit" in state_dict:
            require_fields(state_dict, ("ampkit",), "GradScaler", ScalerError, optional=_TORCH_KEYS, source=source)
            apply = self._scaler.prepare_load(state_dict["ampkit"])
            _check_torch_fields_agree(state_dict)
            apply()
            return
        require_fields(state_dict, _TORCH_KEYS, "GradScaler", ScalerError, source=source)
        sd = self._scaler.state_dict()
        sd.update(
            scale=state_dict["scale"],
            growth_factor=state_dict["growth_factor"],
            backoff_factor=state_dict["backoff_factor"],
            growth_interval=state_dict["growth_interval"],
            growth_tracker=state_dict["_growth_tracker"],
        )
        self._scaler.load_state_dict(sd)

    def __repr__(self) -> str:
        return f"ampkit.GradScaler(device={self._device!r}, enabled={self._enabled}, {self._scaler!r})"
