"""Casting inside module forwards: :class:`_ForwardScope`, the global forward
(pre-)hooks that open an :class:`ampkit.autocast` scope for each *model call* and
close it when the call returns, and count every model call by what cast it."""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit._internal.where import SKIPPED_PATHS
from ampkit.casting.engine import module_hooks
from ampkit.levels.model_cast import EntryCasts, OpCastingEnter, cast_tensors

from .where import _user_site

_FETCH_FILE = str(Path(torch.utils.data.__file__).parent / "_utils" / "fetch.py")
_DATASET_METHODS = ("__getitem__", "__getitems__", "__iter__")


def _data_loading() -> bool:
    """Whether this call is part of loading data: in a DataLoader worker process, in a
    batch fetch of a DataLoader (``Dataset.__getitem__``/``__getitems__``, an
    IterableDataset's iterator, ``collate_fn``), or in a ``torch.utils.data.Dataset``'s
    ``__getitem__``/``__getitems__``/``__iter__`` the script calls itself. A walk of
    the calling frames, made only for a call that would otherwise be a model call."""
    if torch.utils.data.get_worker_info() is not None:
        return True
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _FETCH_FILE:
            return True
        if code.co_name in _DATASET_METHODS and isinstance(frame.f_locals.get("self"), torch.utils.data.Dataset):
            return True
        frame = frame.f_back
    return False


def _is_model(module: nn.Module) -> bool:
    """A module with parameters (its own or its submodules'): a model, trained or
    frozen. Data transforms (torchvision's GaussianBlur, Normalize), loss modules and
    other parameter-free modules are not models."""
    return next(module.parameters(), None) is not None


class _ForwardScope:
    """Global forward pre-hook / forward hook pair: a *model call* opens an
    :class:`ampkit.autocast` scope, its return closes it.

    A model call is the outermost call, on its thread, of a module with parameters
    (:func:`_is_model`) made outside data loading (:func:`_data_loading`). A call of a
    module without parameters is none: it runs as written, and a module with
    parameters that it calls is the model call. Calls inside a model call belong to it.
    Each model call is counted in one of: ``scopes_opened`` (ampkit cast it),
    ``in_script_autocast`` (inside the script's own enabled ``torch.autocast``: its
    choice stands), ``kept_fp32`` (inside the script's ``torch.autocast(enabled=False)``)
    or ``own_scope`` (a model O2/O2K cast, with its op-level scope). ``left_alone``
    counts the outermost calls of other modules (no parameters, or data loading: in
    this process; DataLoader worker processes count their own)."""

    def __init__(self, dtype: torch.dtype, plan: Any = None) -> None:
        from ampkit.casting.policy import default_policy

        self._dtype = dtype
        self._plan = plan  # an ampkit.TunePlan: its module rules join the device's defaults
        self._plan_fits: dict[int, bool] = {}  # id(model) -> whether it has every module the plan names
        self._policies: dict[str, Any] = {}
        self._default_policy = default_policy
        self._local = threading.local()
        self._handles: list[Any] = []
        self._autocast_methods: tuple[Any, Any] | None = None
        self.model_calls = 0
        self.scopes_opened = 0
        self.in_script_autocast = 0
        self.own_scope = 0
        self.left_alone = 0
        self.kept_fp32 = 0
        self.kept_fp32_site: str | None = None
        # models called (grad enabled) since the last backward: their graph may still
        # be waiting for it
        self.pending: dict[int, weakref.ref] = {}

    def install(self) -> None:
        reg = nn.modules.module
        self._handles = [
            reg.register_module_forward_pre_hook(self._pre),
            reg.register_module_forward_hook(self._post, always_call=True),
        ]
        module_hooks.hold()
        cls = torch.amp.autocast_mode.autocast
        self._autocast_methods = (cls.__enter__, cls.__exit__)
        cls.__enter__, cls.__exit__ = self._counting(*self._autocast_methods)  # type: ignore[method-assign]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._autocast_methods is not None:
            cls = torch.amp.autocast_mode.autocast
            cls.__enter__, cls.__exit__ = self._autocast_methods  # type: ignore[method-assign]
            self._autocast_methods = None
            module_hooks.release()
        stack = getattr(self._local, "stack", None)
        while stack:  # a forward interrupted without its hook (never expected)
            _, scope, _ = stack.pop()
            if scope is not None:
                scope.__exit__(None, None, None)

    def plan_fits(self, module: nn.Module) -> bool:
        """Whether ``module`` (a model the script calls) has every module the plan names:
        the plan's rules apply inside it only (a second model, e.g. a GAN's
        discriminator, keeps the defaults)."""
        fits = self._plan_fits.get(id(module))
        if fits is None:
            names = {n for n, _ in module.named_modules()}
            fits = self._plan_fits[id(module)] = all(m.name in names for m in self._plan.modules)
        return fits

    def plan_matched(self) -> bool | None:
        """None without a plan or before any model call; else whether some model called
        had every module the plan names."""
        if self._plan is None or not self._plan_fits:
            return None
        return any(self._plan_fits.values())

    def _scope(self, module: nn.Module) -> Any:
        """The scope to open for a model call of ``module`` (None: none), counted."""
        from ampkit.casting.engine import autocast

        if _has_own_scope(module):
            self.own_scope += 1
            return None
        device_type = next(module.parameters()).device.type
        if device_type not in ("cpu", "cuda"):
            return None
        planned = self._plan is not None and self.plan_fits(module)
        key = f"{device_type}+plan" if planned else device_type
        scope = self._policies.get(key)
        if scope is None:
            policy = self._default_policy(device_type, self._dtype)
            if planned:
                policy = self._plan.policy(base=policy)
            scope = self._policies[key] = autocast(policy, device_type=device_type)
        if torch.is_autocast_enabled(device_type):
            self.in_script_autocast += 1
            return None  # the script's own torch.autocast region: its choice stands
        if self._script_disabled(device_type):  # torch.autocast(enabled=False): it stands too
            self.kept_fp32 += 1
            if self.kept_fp32_site is None:
                self.kept_fp32_site = _user_site()
            return None
        self.scopes_opened += 1
        return scope

    def _script_disabled(self, device_type: str) -> bool:
        """Whether the script itself entered ``torch.autocast(device_type, enabled=False)``
        and is still inside it on this thread."""
        return getattr(self._local, "disabled", {}).get(device_type, 0) > 0

    def _counting(self, enter: Callable[..., Any], exit_: Callable[..., Any]) -> tuple[Callable[..., Any], ...]:
        """``torch.autocast`` enter/exit that count the disabled regions the script
        enters itself (not torch's own, such as a checkpoint's recomputation, nor
        ampkit's): per thread and device type."""
        local = self._local

        @functools.wraps(enter)
        def counted_enter(region: Any) -> Any:
            result = enter(region)
            if not region._enabled and not torch.compiler.is_dynamo_compiling() and _entered_by_script():
                counts = local.__dict__.setdefault("disabled", {})
                counts[region.device] = counts.get(region.device, 0) + 1
                region.__dict__["_ampkit_counted"] = region.__dict__.get("_ampkit_counted", 0) + 1
            return result

        @functools.wraps(exit_)
        def counted_exit(region: Any, *exc: Any) -> Any:
            if region.__dict__.get("_ampkit_counted"):
                region.__dict__["_ampkit_counted"] -= 1
                counts = local.__dict__.get("disabled", {})
                counts[region.device] = max(0, counts.get(region.device, 0) - 1)
            return exit_(region, *exc)

        return counted_enter, counted_exit

    def _pre(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            return
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        if stack and stack[-1][2]:
            stack.append((module, None, True))
            return
        model_call = _is_model(module) and not _data_loading()
        if not model_call and not stack:
            self.left_alone += 1
        # on the stack before the scope opens: module calls made while it opens (a
        # probe of the engine's) are inside this call, not model calls of their own
        stack.append((module, None, model_call))
        if model_call:
            self.model_calls += 1
            if torch.is_grad_enabled():
                self.pending[id(module)] = weakref.ref(module)
            scope = self._scope(module)
            if scope is not None:
                scope.__enter__()
                stack[-1] = (module, scope, True)

    def _post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return None
        stack = getattr(self._local, "stack", None)
        if stack and stack[-1][0] is module:
            _, scope, _ = stack.pop()
            if scope is not None:
                scope.__exit__(None, None, None)
                # what the script does with the outputs (loss, metrics, sampling) runs
                # outside the forward pass: in fp32, as it was written
                return cast_tensors(output, torch.float32, only=(self._dtype,))
        return None


_AUTOCAST_FILES = tuple(
    str(Path(torch.__file__).resolve().parent / sub / "autocast_mode.py") for sub in ("amp", "cpu/amp", "cuda/amp")
)


def _entered_by_script() -> bool:
    """Whether the ``torch.autocast`` being entered was entered by the script's own
    code (its ``with``, or a decorator on its function), not by torch or ampkit."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _AUTOCAST_FILES:
        frame = frame.f_back  # torch.cpu.amp.autocast / the decorator form
    return frame is not None and not frame.f_code.co_filename.startswith(SKIPPED_PATHS)


def _has_own_scope(module: nn.Module) -> bool:
    """A model cast by O2/O2K opens its own op-level scope (ampkit.levels.model_cast), and so does a
    submodule of it entered directly (its entry point's EntryCasts)."""
    return any(
        isinstance(h, OpCastingEnter) or isinstance(h, EntryCasts) and h.device_type is not None
        for h in torch_compat.forward_pre_hooks_of(module).values()
    )
