"""Module rules and the cast cache: global forward pre/post hooks (eager and under
torch.compile), the names rules match, cache epochs and the optimizer step hook that
drops cached casts. See docs/concepts/casting.md."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import weakref
from typing import Any

import torch
from torch import nn

from ampkit._internal import torch_compat

from . import _scope_api
from ._cast import _map_tensors
from ._kernels import _state
from ._resolve import _Frame
from .policy import Policy

logger = logging.getLogger("ampkit")


# ---------------------------------------------------------------------------
# Module rules and cache invalidation (global module hooks)
# ---------------------------------------------------------------------------
class _ModuleHooks:
    """Global forward pre/post hooks (module rules, the cast cache).

    Installed when a scope is entered. torch iterates the global hook dicts in Python
    on a forward that raises, so hooks are not added or removed while another thread
    could be running a module: they are removed when the last scope of a process with
    one thread closes (or by :func:`ampkit.reset` under the same condition), and are
    otherwise kept. While installed they make every module call take torch's slower
    path with hooks; a thread with no ampkit scope pays two calls that return at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._installed = False
        # torch.compile guards compiled code on the global hook dicts' keys and values:
        # re-installing puts the same two functions back under the same keys, so code
        # compiled under a scope is reused under the next one
        self._fns = (self._pre, self._post)
        self._ids: tuple[int, int] | None = None
        self._held = 0
        self._names: weakref.WeakKeyDictionary[nn.Module, dict[int, str]] = weakref.WeakKeyDictionary()
        # models name rules are relative to, whichever of their modules is called first
        # (``initialize(plan=...)``): weak, cleared by ampkit.reset
        self.name_roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def name_rules_relative_to(self, model: nn.Module) -> None:
        """Name rules match ``model``'s own qualified names for every module inside it,
        also when the first module called is one of its children (Lightning's
        ``training_step`` calling ``self.net(x)``: ``"net.5"``, not ``"5"``)."""
        self.name_roots.add(unwrap_module(model))
        self._names.pop(model, None)

    def _root_for(self, outer: nn.Module) -> nn.Module:
        """The registered model containing ``outer`` (the first module called), else ``outer``."""
        for root in list(self.name_roots):
            if root is outer or id(outer) in self._names_in(root):  # (no re-walk: a cached tree)
                return root
        return outer

    def ensure(self) -> None:
        if self._installed:
            return
        with self._lock:
            if self._installed:
                return
            reg = nn.modules.module
            pre, post = self._fns
            if self._ids is None or not torch_compat.can_reinstall_global_forward_hooks():
                self._ids = (
                    reg.register_module_forward_pre_hook(pre).id,
                    reg.register_module_forward_hook(post, always_call=True).id,
                )
            else:
                pre_id, post_id = self._ids
                torch_compat.reinstall_global_forward_hooks(pre_id, pre, post_id, post)
            self._installed = True

    def hold(self) -> None:
        """Install the hooks and keep them until :meth:`release` (``ampkit run``: its
        scopes open and close inside module calls, where torch may be iterating the
        global hook dict -- a forward that raised unwinds through it)."""
        self.ensure()
        with self._lock:
            self._held += 1

    def release(self) -> None:
        with self._lock:
            self._held = max(0, self._held - 1)

    def remove(self) -> None:
        with self._lock:
            if not self._installed or self._held:
                return
            pre_id, post_id = self._ids
            torch_compat.remove_global_forward_hooks(pre_id, post_id)
            self._installed = False

    def installed(self) -> bool:
        return self._installed

    def _names_in(self, root: nn.Module) -> dict[int, str]:
        names = self._names.get(root)
        if names is None:
            names = {id(m): model_name(n) for n, m in unwrap_module(root).named_modules(remove_duplicate=False)}
            self._names[root] = names
        return names

    def contains(self, root: nn.Module, module: nn.Module) -> bool:
        if id(module) in self._names_in(root):
            return True
        self._names.pop(root, None)  # modules may have been added since: look again
        return id(module) in self._names_in(root)

    def _name_of(self, module: nn.Module, root: nn.Module | None = None) -> str | None:
        """``module``'s qualified name in ``root`` (default: the outermost module
        called), as the user's own model names it: wrappers are looked through
        (:func:`unwrap_module`)."""
        if root is None:
            root = _state.module_stack[0] if _state.module_stack else module
        if self.name_roots:
            root = self._root_for(root)
        return self._names_in(root).get(id(module)) if self.contains(root, module) else None

    def rule_dtype(self, module: nn.Module, frame: _Frame, root: nn.Module | None = None) -> torch.dtype | None:
        """The dtype ``frame``'s module rules pin ``module`` to, or None. Names are
        relative to ``root`` (default: the outermost module called in the scopes)."""
        policy = frame.policy
        if policy is None or not policy.module_rules or not frame.rules:
            return None
        # qualified names cost a walk of the module tree: only for name-glob rules
        by_name = any(isinstance(key, str) for key in policy.module_rules)
        return policy.module_dtype(module, self._name_of(module, root) if by_name else None)

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if torch.compiler.is_dynamo_compiling():  # True only in code dynamo traces
            return _compiled_pre(module, args)
        state = _state
        scopes = state.scopes
        if not scopes:
            return None
        frame = scopes[-1]
        modules = state.module_stack
        if not modules and not _is_compiled_module(module):
            # (a torch.compile'd module: compiled code keeps no cast cache, and with the
            # cache switch left off dynamo tells this scope from plain torch.autocast)
            _start_cache_epoch(module, frame)
        modules.append(module)
        if frame.policy is None or not frame.policy.module_rules or not frame.rules:
            return None  # no rule to look up (the common case: one check per module call)
        # a torch.compile'd module's own rule is the model's inside it, applied here,
        # eagerly, around the compiled call (compiled code then skips it)
        inner = torch_compat.compiled_module_inner(module)
        dtype = self.rule_dtype(module if inner is None else inner, frame)
        if dtype is None:
            return None
        policy = frame.policy
        stack = contextlib.ExitStack()
        if dtype is torch.float32:
            stack.enter_context(_scope_api.open_scope(policy, frame.device_type, enabled=False, from_rule=True))
            args = tuple(_map_tensors(a, _to_fp32) for a in args)
        else:
            stack.enter_context(
                _scope_api.open_scope(_with_dtype(policy, dtype), frame.device_type, cache_enabled=frame.cache_enabled)
            )
        _state.rule_stack.append((module, stack))
        return args

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            return _compiled_post(module)
        state = _state
        rules = state.rule_stack
        if rules and rules[-1][0] is module:
            rules.pop()[1].close()
        modules = state.module_stack
        if modules and modules[-1] is module:
            modules.pop()
            if not modules:
                _end_cache_epoch(module)
        return None


# ---------------------------------------------------------------------------
# Module hooks inside torch.compile
# ---------------------------------------------------------------------------
# When dynamo traces a module call it inlines the global hooks. There they must not
# touch the thread's stacks (dynamo would record list mutations holding modules) and
# must not graph-break: they read ``_state.compile_key`` (dynamo guards the compiled
# code on it, per thread, so another policy or no scope compiles anew), ask a function
# dynamo runs at trace time for the module's rule, and change the autocast state with
# the calls dynamo records in the graph.
def _compiled_pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    # the key's value becomes a guard; the module goes by id (dynamo guards its identity)
    rule = _trace_rule_enter(id(module), _state.compile_key)
    if rule is None:
        return None
    device_type, dtype = rule
    if dtype is torch.float32:
        torch.set_autocast_enabled(device_type, False)
        return tuple(_map_tensors(a, _to_fp32) for a in args)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    return None


def _compiled_post(module: nn.Module) -> None:
    restore = _trace_rule_exit(id(module), _state.compile_key)
    if restore is not None:
        device_type, enabled, dtype = restore
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, dtype)


# Trace-time bookkeeping (these run for real while dynamo traces; their results are
# constants in the graph). A module's pre and post hooks may be traced in different
# compiled frames (dynamo compiles a top module's forward apart from its hooks), so the
# state to restore after a module is kept per module, and the root that name rules are
# relative to is found among the modules traced first (not from a per-trace stack).
_trace = threading.local()
# Engine state: compiled modules traced under ampkit scopes (weak references).
_COMPILED_ROOTS: list[weakref.ref] = []


def _compiled_root(module: nn.Module) -> nn.Module:
    """The outermost module ``module`` belongs to, for name rules inside compiled code:
    the outermost module called eagerly (``torch.compile(model)``'s wrapper), else the
    first module traced in a compiled frame that contains it (``model.compile()``)."""
    if _state.module_stack:
        return _state.module_stack[0]
    for ref in list(_COMPILED_ROOTS):
        root = ref()
        if root is None:
            _COMPILED_ROOTS.remove(ref)
        elif root is module or module_hooks.contains(root, module):
            return root
    if len(_COMPILED_ROOTS) > 64:
        del _COMPILED_ROOTS[0]
    _COMPILED_ROOTS.append(weakref.ref(module))
    return module


def _trace_rule_enter(module_id: int, key: str) -> tuple[str, torch.dtype] | None:
    """At trace time, a module's call starts: its rule as ``(device type, dtype)``, or
    None; the autocast state to restore after it is recorded for
    :func:`_trace_rule_exit` (and any record left from an earlier module of that id
    dropped)."""
    restore = _trace.__dict__.setdefault("restore", {})
    restore.pop(module_id, None)
    module = torch_compat.traced_object(module_id)
    frame = _state.scopes[-1] if _state.scopes else None
    if frame is None or frame.policy is None or not frame.policy.module_rules or not frame.rules:
        return None
    stack = _state.module_stack
    if stack and torch_compat.compiled_module_inner(stack[-1]) is module:
        return None  # the compiled wrapper's hook applied this module's rule eagerly
    root = _compiled_root(module)
    dtype = module_hooks.rule_dtype(module, frame, root)
    if dtype is None:
        return None
    device_type = frame.device_type
    if dtype is not torch.float32 and dtype is not torch.get_autocast_dtype(device_type) and root is module:
        # the top module of model.compile(): its hooks are compiled apart from its
        # forward, and dynamo refuses a dtype switch left across compiled frames
        logger.warning(
            "ampkit: the rule pinning %s to %s is not applied under model.compile(); "
            "use torch.compile(model), whose wrapper applies it", type(module).__name__, dtype
        )
        return None
    if not torch_compat.GRAPH_AUTOCAST_SWITCHES:
        torch_compat.warn_no_graph_switches()
    restore[module_id] = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    return device_type, dtype


def _trace_rule_exit(module_id: int, key: str) -> tuple[str, bool, torch.dtype] | None:
    """At trace time, a module's call ends: the autocast state to restore, as recorded
    when its call started. The record is read, not taken: dynamo may trace the same
    hook again after a graph break (before torch 2.12 every autocast switch is one),
    and a record taken by the abandoned trace left the kept one without its restore
    (the layers after an fp32-ruled module then computed fp32)."""
    return _trace.__dict__.setdefault("restore", {}).get(module_id)


# dynamo runs these at trace time and puts their results in the graph as constants
torch_compat.mark_trace_constant(_trace_rule_enter)
torch_compat.mark_trace_constant(_trace_rule_exit)


# path components that wrappers insert: torch.compile, FSDP1, checkpoint_wrapper
_WRAPPER_PARTS = re.compile(r"(?:^|\.)(?:" + "|".join(torch_compat.WRAPPER_PATH_PARTS) + r")(?=\.|$)")


def model_name(name: str) -> str:
    """A qualified name without wrapper components (``block._orig_mod.norm`` is
    ``block.norm``; the wrapper and the module it wraps share a name)."""
    return _WRAPPER_PARTS.sub("", name).lstrip(".") if "_" in name else name


def _is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(model)``'s wrapper (``OptimizedModule``)."""
    return torch_compat.compiled_module_inner(module) is not None


def unwrap_module(module: nn.Module) -> nn.Module:
    """The model inside ``nn.DataParallel`` / ``DistributedDataParallel`` /
    ``torch.compile``'s module, however deep: name rules are written against it."""
    while True:
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            module = module.module
        elif (inner := torch_compat.compiled_module_inner(module)) is not None:
            module = inner
        else:
            return module


# Engine state: a cache of policies derived from immutable policies.
_DERIVED: dict[tuple[int, torch.dtype], tuple[Policy, Policy]] = {}


def _with_dtype(policy: Policy, dtype: torch.dtype) -> Policy:
    """``policy`` computing in ``dtype``; one object per pair, so a module rule does not
    build (and resolve) a new policy on every forward."""
    key = (id(policy), dtype)
    hit = _DERIVED.get(key)
    if hit is not None and hit[0] is policy:
        return hit[1]
    derived = policy if policy.dtype is dtype else policy.override(dtype=dtype)
    if len(_DERIVED) > 256:
        _DERIVED.clear()
    _DERIVED[key] = (policy, derived)
    return derived


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() and t.dtype is not torch.float64 else t


def _start_cache_epoch(module: nn.Module, frame: _Frame) -> None:
    """The outermost module call of a scope starts: casts cached from here on (torch's
    autocast cache and ours) are of the weights as they are now, and live until the
    call returns. Outside module calls nothing is cached (see :func:`_native_enter`)."""
    _clear_caches()
    _state.epoch = (module, torch.is_autocast_cache_enabled())
    torch.set_autocast_cache_enabled(frame.cache_enabled)


def _end_cache_epoch(module: nn.Module) -> None:
    epoch = _state.epoch
    if epoch is not None and epoch[0] is module:
        _state.epoch = None
        _clear_caches()
        torch.set_autocast_cache_enabled(epoch[1])


module_hooks = _ModuleHooks()


def _clear_caches() -> None:
    torch.clear_autocast_cache()
    for frame in _state.scopes:
        frame.cache.clear()


# Engine state: the one global optimizer step hook that drops the cast cache (its handle).
_step_hook_installed = False
_step_hook_lock = threading.Lock()
_step_hook_handle: Any = None


def _install_step_hook() -> None:
    """Cached casts go stale when an optimizer updates weights in place: drop them.
    Installed once per process; a step in a thread with no scope costs one check."""
    global _step_hook_installed, _step_hook_handle
    if _step_hook_installed:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if _state.scopes:
            _clear_caches()

    with _step_hook_lock:
        if not _step_hook_installed:
            _step_hook_handle = register_optimizer_step_post_hook(after_step)
            _step_hook_installed = True


def step_hook_installed() -> bool:
    """Whether the optimizer step hook that drops cached casts is installed."""
    return _step_hook_installed


def remove_step_hook() -> None:
    """Remove the optimizer step hook (``ampkit.tune`` leaves no global hook it added);
    the next scope installs it again."""
    global _step_hook_installed, _step_hook_handle
    with _step_hook_lock:
        if _step_hook_handle is not None:
            _step_hook_handle.remove()
        _step_hook_handle, _step_hook_installed = None, False
