"""What an ampkit precision plugin sets up: the level and its options, checked when the
plugin is built, resolved for the device the model is on, applied by
:func:`ampkit.initialize`, and the casting scope of the step contexts."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ampkit import Fp8Recipe, OptLevel, Policy, autocast, initialize
from ampkit.errors import AmpError

from .._shared import OPT_LEVELS, default_device_type, is_fp32_level, level_names, resolve_opt_level

__all__ = ["Settings", "device_type_of"]

#: initialize() arguments the plugins take as parameters of their own.
_OWN = {
    "dtype": "AmpkitPrecision(dtype=...)",
    "policy": "AmpkitPrecision(policy=...)",
    "loss_scale": "AmpkitPrecision(loss_scale=...)",
    "fp8": "AmpkitPrecision(fp8=...)",
    "device_type": "nothing (it is the device type the Trainer puts the model on)",
    "fresh": "nothing (each fit starts a fresh ampkit session)",
    "plan": "AmpkitPrecision(plan=...)",
}


def device_type_of(module: nn.Module) -> str:
    """The device type of the module's first tensor (``"cpu"`` for a module without any)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device.type
    return "cpu"


@dataclasses.dataclass(frozen=True)
class Settings:
    """The arguments of an ampkit precision plugin, validated at construction
    (:meth:`check`), resolved per device type at setup (:meth:`level`)."""

    opt_level: str
    dtype: torch.dtype | None
    fp8: Any
    loss_scale: Any
    policy: Any
    options: Mapping[str, Any]
    owner: str  # the plugin's class name, for messages
    plan: Any = None  # an ampkit.TunePlan, passed on to initialize

    def check(self) -> OptLevel:
        """Raise :class:`ampkit.AmpError` (or its subclass) for an argument
        ``ampkit.initialize`` would refuse, before any Trainer exists. Returns the level
        as it resolves on the default device type."""
        if not isinstance(self.options, Mapping):
            raise AmpError(
                f"{self.owner}(options=...) takes a mapping of ampkit.initialize options "
                f"(e.g. {{'keep_fp32': ['head']}}), got {type(self.options).__name__}."
            )
        for name in self.options:
            if not isinstance(name, str):
                raise AmpError(f"{self.owner}(options=...): option names are strings, got {name!r}.")
            if name in _OWN:
                raise AmpError(
                    f"{self.owner}(options={{{name!r}: ...}}): {name!r} is not an option here; "
                    f"pass {_OWN[name].replace('AmpkitPrecision', self.owner)}."
                )
        if self.policy is not None and not isinstance(self.policy, Policy):
            raise AmpError(f"{self.owner}(policy=...) takes an ampkit.Policy, got {type(self.policy).__name__}.")
        if self.fp8 is not None and not isinstance(self.fp8, (bool, Fp8Recipe)):
            raise AmpError(f"{self.owner}(fp8=...) takes an ampkit.Fp8Recipe, True or None, got {self.fp8!r}.")
        if is_fp32_level(self.opt_level) and self.fp8 not in (None, False):
            raise AmpError(f"{self.owner}: fp8 needs a level that computes in 16 bits "
                           f"({', '.join(level_names(lambda d: not d.fp32))}), not {self.opt_level.upper()}.")
        level = self.level(default_device_type())
        if self.policy is not None and not (level.op_casting or level.model_op_casting):
            raise AmpError(
                f"{self.owner}(policy=...): a policy sets what op-level casting does, which "
                f"{level.name} leaves off; use O1, O2 or O2K, or drop the policy."
            )
        return level

    def _overrides(self) -> dict[str, Any]:
        out = dict(self.options)
        if self.dtype is not None:
            out["dtype"] = self.dtype
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale
        return out

    def level(self, device_type: str) -> OptLevel:
        """The :class:`ampkit.OptLevel` ``initialize`` sets up on ``device_type``."""
        try:
            return resolve_opt_level(self.opt_level, device_type, **self._overrides())
        except AmpError as err:
            raise type(err)(f"{self.owner}: {err}") from err

    def initialize(
        self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], device_type: str
    ) -> OptLevel:
        """:func:`ampkit.initialize` (a fresh session) on ``module`` and ``optimizers``
        (none: inference). O1's op-level casting is not turned on process-wide: the
        plugin opens it as a scope around each step (:meth:`scope`). Returns the level."""
        level = self.level(device_type)
        overrides = self._overrides()
        overrides["op_casting"] = False  # the plugin's scope casts instead (see scope())
        if self.policy is not None and level.model_op_casting:
            overrides["policy"] = self.policy
        initialize(
            module,
            list(optimizers) or None,
            self.opt_level,
            device_type=device_type,
            fp8=self.fp8,
            plan=self.plan,
            **overrides,
        )
        return level

    def scope(self, level: OptLevel, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """The casting scope of a training/validation/test/predict step: ampkit's
        op-level casting in the level's dtype (O1; and O2/O2K for code in the step
        outside the model, whose own forward runs under its op-level casting anyway);
        none at O0 and O3."""
        if not (level.op_casting or level.model_op_casting):
            return contextlib.nullcontext()
        return autocast(policy=self.policy, device_type=device_type, dtype=level.dtype)


def lightning_precision_name(level: OptLevel) -> str:
    """Lightning's name for what a level computes in: ``"32-true"`` (O0),
    ``"bf16-true"``/``"16-true"`` (O3: everything 16-bit), ``"bf16-mixed"``/``"16-mixed"``
    (O1, O2, O2K: 16-bit compute, fp32 where it matters), as the level's data says."""
    base = OPT_LEVELS[level.name]
    if base.fp32:
        return "32-true"
    prefix = "bf16" if level.dtype == torch.bfloat16 else "16"
    return f"{prefix}-mixed" if base.mixed else f"{prefix}-true"
