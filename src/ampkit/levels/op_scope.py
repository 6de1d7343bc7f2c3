"""The op-level scopes a cast model's forward hooks open (:mod:`.model_cast`'s
``OpCastingEnter``/``OpCastingExit``, ``EntryCasts``/``EntryExit``): in eager mode one
reusable ``ampkit.autocast`` per thread, device, dtype and policy, on a stack per thread;
inside code torch.compile traces, torch's own autocast state switched in the graph. Also
the per-thread stack of the cast models' and their entry points' calls in flight."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit.casting.engine import open_scope

__all__ = ["MODEL_POLICY", "compiled_enter", "compiled_exit", "enter_scope", "entry_stack", "exit_scope", "scope_for"]

# Per thread: the ampkit.autocast objects of model forwards in flight (entered by
# OpCastingEnter, left by OpCastingExit), and one reusable scope per (device, dtype,
# policy) -- autocast objects keep a stack, so a thread reuses its own.
_SCOPES = threading.local()
# Module state (weak keys): model -> the policy its forward runs under (None: the default lists of its dtype).
MODEL_POLICY: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def scope_for(device_type: str, dtype: torch.dtype, policy: Any, enabled: bool = True) -> Any:
    cache = getattr(_SCOPES, "cache", None)
    if cache is None:
        cache = _SCOPES.cache = {}
    key = (device_type, dtype, id(policy), enabled)
    entry = cache.get(key)
    if entry is None or entry[0] is not policy:
        # (without module rules, no global module hooks: the model's children start no
        # cast cache; fp32 weights are cast at each use, as in compiled code)
        scope = open_scope(policy, device_type, enabled=enabled, dtype=dtype if enabled else None,
                           in_module_call=True)  # fmt: skip
        entry = cache[key] = (policy, scope)
    return entry[1]


def enter_scope(module: nn.Module, device_type: str, dtype: torch.dtype, enabled: bool) -> None:
    """Open ``module``'s scope (its policy from :data:`MODEL_POLICY`) for this call."""
    scope = scope_for(device_type, dtype, MODEL_POLICY.get(module), enabled)
    stack = getattr(_SCOPES, "stack", None)
    if stack is None:
        stack = _SCOPES.stack = []
    scope.__enter__()
    stack.append((module, scope))


def exit_scope(module: nn.Module) -> None:
    """Close the scope :func:`enter_scope` opened for this call of ``module``."""
    stack = getattr(_SCOPES, "stack", None)
    if stack and stack[-1][0] is module:
        _, scope = stack.pop()
        scope.__exit__(None, None, None)


# Per thread: the calls in flight of cast models and of their entry points (EntryCasts):
# (module, the scope an entry opened, or None / True: none).
_ENTRIES = threading.local()


def entry_stack() -> list[tuple[nn.Module, Any]]:
    if not hasattr(_ENTRIES, "stack"):
        _ENTRIES.stack = []
    return _ENTRIES.stack


# Inside code torch.compile traces, the scope is torch's own autocast state, switched
# with calls dynamo records in the graph (the default lists: a custom policy's changes
# apply to eager calls only); what to restore is taken at trace time, on a stack per
# thread (module calls nest, so their scopes close in the reverse order they opened).
# The trace-time functions take constants only: dynamo before 2.12 refuses a module as
# an argument of a function it runs at trace time.
def compiled_enter(dtype: torch.dtype, device_type: str, enabled: bool = True) -> None:
    _trace_save(device_type)  # warns once where this torch cannot switch in the graph
    torch.set_autocast_enabled(device_type, enabled)
    if enabled:
        torch.set_autocast_dtype(device_type, dtype)


def compiled_exit() -> None:
    restore = _trace_restore()
    if restore is not None:
        device_type, enabled, dtype = restore
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, dtype)


def _trace_save(device_type: str) -> None:
    if not torch_compat.GRAPH_AUTOCAST_SWITCHES:
        torch_compat.warn_no_graph_switches()
    stack = _SCOPES.__dict__.setdefault("traced", [])
    stack.append((device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)))


def _trace_restore() -> tuple[str, bool, torch.dtype] | None:
    stack = _SCOPES.__dict__.setdefault("traced", [])
    return stack.pop() if stack else None


# run by dynamo at trace time, their results constants in the graph
torch_compat.mark_trace_constant(_trace_save)
torch_compat.mark_trace_constant(_trace_restore)
