"""What the Trainer and Fabric plugins share: :class:`PluginCore`, the ampkit session of
one plugin (the model and optimizers it set up, the level, the scope, the state)."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ampkit import OptLevel, Policy, TunePlan, master_params, stats, unscale
from ampkit import load_state_dict as amp_load_state_dict
from ampkit import state_dict as amp_state_dict
from ampkit.errors import AmpError, StateError

from .._shared import (
    checked_plan,
    dtype_from_env,
    is_fp32_level,
    level_or_env,
    master_weights_of,
    unwrap_optimizer,
)
from ..banner import announce
from ._settings import Settings, device_type_of, lightning_precision_name
from .schedulers import HeldScheduler

__all__ = ["PluginCore", "plugin_core", "STATE_FORMAT", "MirrorRequiresGrad", "hold", "managed", "unwrap"]

#: ``state_dict()["format"]`` of the plugins' state (in a Lightning checkpoint under
#: ``"AmpkitPrecision"``; in a Fabric checkpoint under the key the plugin is saved as).
STATE_FORMAT = "ampkit.lightning/1"


def unwrap(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` behind Lightning's ``LightningOptimizer`` or Fabric's
    ``_FabricOptimizer`` (both pass ``isinstance(x, torch.optim.Optimizer)``: they swap
    their class); others as they are (:func:`ampkit._internal.wrappers.unwrap_optimizer`)."""
    return unwrap_optimizer(optimizer)


def managed(optimizer: Any) -> bool:
    """Whether ampkit manages ``optimizer`` now (a later ``initialize`` or
    ``ampkit.reset`` ends that)."""
    try:
        stats(optimizer)
    except StateError:
        return False
    return True


def hold(config: Any) -> Any:
    """A Lightning ``LRSchedulerConfig`` stepped per optimizer step (``interval="step"``)
    with its scheduler in a :class:`~ampkit.integrations.lightning.HeldScheduler`; other configs as they are."""
    if getattr(config, "interval", None) != "step" or isinstance(config.scheduler, HeldScheduler):
        return config
    return dataclasses.replace(config, scheduler=HeldScheduler(config.scheduler))


def plugin_core(
    owner: str,
    opt_level: str | None,
    dtype: torch.dtype | None,
    fp8: Any,
    loss_scale: Any,
    policy: Any,
    options: Mapping[str, Any] | None,
    plan: Any = None,
) -> PluginCore:
    """The :class:`PluginCore` of a plugin built with these arguments (checked now);
    ``opt_level``/``dtype`` left None take the ``plan``'s if one is given, else
    ``AMPKIT_LEVEL``/``AMPKIT_DTYPE`` if set, else O1 and the level's default dtype."""
    if plan is not None:
        plan, opt_level, dtype, policy = _with_plan(owner, plan, opt_level, dtype, policy)
    opt_level = level_or_env(opt_level)
    if dtype is None and not is_fp32_level(opt_level):
        dtype = dtype_from_env()
    return PluginCore(
        Settings(
            opt_level=opt_level,
            dtype=dtype,
            fp8=fp8,
            loss_scale=loss_scale,
            policy=policy,
            options=dict(options) if isinstance(options, Mapping) else ({} if options is None else options),
            owner=owner,
            plan=plan,
        )
    )


def _with_plan(owner: str, plan: Any, opt_level: str | None, dtype: torch.dtype | None,
               policy: Any) -> tuple[TunePlan, Any, Any, Any]:  # fmt: skip
    """The plan (loaded), and the plugin's level, dtype and policy with it applied: its
    level and dtype where none is given, its kept modules pinned to fp32 in the policy
    of the plugin's step scope (``initialize(plan=...)`` does the rest at setup)."""
    plan = checked_plan(plan, f"{owner}(plan=...)")
    opt_level = plan.level if opt_level is None else opt_level
    if not plan.lowered:
        return plan, opt_level, dtype, policy
    low = plan.compute_dtype(dtype, owner)
    if policy is not None and not isinstance(policy, Policy):
        raise AmpError(f"{owner}(policy=...) takes an ampkit.Policy, got {type(policy).__name__}.")
    return plan, opt_level, low, plan.policy(base=policy)


class PluginCore:
    """The ampkit side of a precision plugin: :meth:`set_up` (``ampkit.initialize``),
    the step scope, the optimizers a backward scales for, the parameters clipping
    sees, and the state saved in checkpoints."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.level: OptLevel = settings.check()
        self.device_type: str | None = None
        self._module: weakref.ref[nn.Module] | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self._mirror: _RequiresGradMirror | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a spawned process's copy of the Trainer): the settings only; the copy
        sets up its own session."""
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])  # type: ignore[misc]

    @property
    def precision(self) -> str:
        return lightning_precision_name(self.level)

    def module(self) -> nn.Module | None:
        return self._module() if self._module is not None else None

    def is_set_up(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether ``module`` (and ``optimizers``, if any) is what this plugin set up last,
        still managed."""
        if self.module() is not module:
            return False
        if not optimizers:
            return True
        return (
            len(optimizers) == len(self.optimizers)
            and all(a is b for a, b in zip(optimizers, self.optimizers))
            and all(managed(o) for o in optimizers)
        )

    def set_up(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], manual: bool) -> None:
        """``ampkit.initialize(module, optimizers)`` at the plugin's level (a fresh session).
        ``manual``: the loop toggles ``requires_grad`` through the optimizers
        (Lightning's manual optimization), mirrored onto O2's model parameters."""
        optimizers = list(optimizers)
        device_type = device_type_of(module)
        if optimizers and self.module() is module and self.level.cast_model_type is not None:
            _widen(module, self.optimizers)  # a new fit of a model an earlier fit cast
        if self._mirror is not None:
            self._mirror.remove()
            self._mirror = None
        self.level = self.settings.initialize(module, optimizers, device_type)
        what = "Fabric" if "Fabric" in self.settings.owner else "Trainer"
        announce("Lightning", what, self.level.name, self.level.dtype)
        self.device_type = device_type
        self._module = weakref.ref(module)
        self.optimizers = optimizers
        if manual and self.level.master_weights and optimizers:
            self._mirror = _RequiresGradMirror(module, optimizers)

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        device_type = self.device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        return self.settings.scope(self.level, device_type)

    def backward_optimizers(self, optimizer: Any) -> list[torch.optim.Optimizer]:
        """The optimizers a backward's loss is scaled for: ``optimizer`` if given, else
        those with parameters that require grad (``toggle_optimizer`` leaves only the
        toggled one's), else all."""
        if optimizer is not None:
            raw = unwrap(optimizer)
            return [raw] if managed(raw) else []
        live = [o for o in self.optimizers if managed(o)]
        wanted = [o for o in live if any(p.requires_grad for g in o.param_groups for p in g["params"])]
        return wanted or live

    def main_params(self, optimizer: Any) -> Iterator[torch.Tensor] | None:
        """:func:`ampkit.master_params` of a managed optimizer, None for another."""
        raw = unwrap(optimizer)
        return master_params(raw) if managed(raw) else None

    def unscale(self, optimizer: Any) -> None:
        raw = unwrap(optimizer)
        if managed(raw):
            unscale(raw)

    def state_dict(self) -> dict[str, Any]:
        if not self.optimizers or not all(managed(o) for o in self.optimizers):
            return {}
        return {
            "format": STATE_FORMAT,
            "opt_level": self.level.name,
            "dtype": str(self.level.dtype).replace("torch.", ""),
            "ampkit": amp_state_dict(),
        }

    def load_state_dict(self, state_dict: Any, owner: str) -> None:
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != STATE_FORMAT:
            raise StateError(
                f"this is not the state of {owner} (expected a dict whose 'format' is "
                f"{STATE_FORMAT!r}, as {owner}.state_dict() returns); it was written by "
                "something else, or edited."
            )
        saved = state_dict.get("opt_level")
        if saved != self.level.name:
            raise StateError(
                f"the checkpoint was written at {saved}, this run is set up at {self.level.name}: "
                f"resume with {owner}({saved!r}), or load only the model's weights to change level."
            )
        if not self.optimizers:
            return  # inference: the weights come with the model's state dict
        amp_load_state_dict(state_dict["ampkit"])


def _widen(module: nn.Module, old_optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Before a second ``fit`` of a model an earlier ``fit`` cast to 16 bits: put its
    weights back in fp32, so ``ampkit.initialize`` builds the new masters from them. A
    weight whose fp32 master (of the earlier optimizers) still rounds to it takes the
    master's value (exact); any other (loaded since, or without a master) is widened."""
    masters = [mw for mw in (master_weights_of(o) for o in old_optimizers) if mw is not None]
    with torch.no_grad():
        for p in module.parameters():
            if not p.is_floating_point() or p.dtype == torch.float32:
                continue
            value = p.detach().float()
            for mw in masters:
                m = mw.master_of(p)
                if m is not None and torch.equal(m.detach().to(p.dtype), p.detach()):
                    value = m.detach().clone()
                    break
            p.data = value
        for b in module.buffers():
            if b.is_floating_point() and b.dtype != torch.float32:
                b.data = b.detach().float()


# Module state: per module, the [parameter, master, last seen flag] entries whose
# requires_grad MirrorRequiresGrad follows (weak keys; the hook is a plain object, so
# the model pickles and deep-copies).
_MIRRORED: weakref.WeakKeyDictionary[nn.Module, list[list[Any]]] = weakref.WeakKeyDictionary()


class MirrorRequiresGrad:
    """Forward pre-hook of a module whose parameters have fp32 masters (O2, manual
    optimization): ``LightningModule.toggle_optimizer`` sets ``requires_grad`` on the
    parameters in ``optimizer.param_groups``, which are the masters; a change there is
    carried to the module's own 16-bit parameters before its forward, so the toggled-off
    parameters get no gradient, as in fp32."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        for entry in _MIRRORED.get(module, ()):
            param, master = entry[0](), entry[1]()
            if param is None or master is None or master.requires_grad == entry[2]:
                continue
            entry[2] = master.requires_grad
            param.requires_grad_(master.requires_grad)


class _RequiresGradMirror:
    """The :class:`MirrorRequiresGrad` hooks of one setup."""

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        masters = [mw for mw in (master_weights_of(o) for o in optimizers) if mw is not None]
        self._handles: list[Any] = []
        self._modules: list[weakref.ref[nn.Module]] = []
        for module in model.modules():
            entries = []
            for p in module.parameters(recurse=False):
                for mw in masters:
                    m = mw.master_of(p)
                    if m is not None:
                        entries.append([weakref.ref(p), weakref.ref(m), m.requires_grad])
                        break
            if entries:
                _MIRRORED[module] = entries
                self._modules.append(weakref.ref(module))
                self._handles.append(module.register_forward_pre_hook(MirrorRequiresGrad()))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for ref in self._modules:
            module = ref()
            if module is not None:
                _MIRRORED.pop(module, None)
        self._handles = []
        self._modules = []
