"""The scope: :class:`autocast` (native autocast entered and left, the thread's
frames, compile keys), :func:`checkpoint_context`, :func:`init` and the engine's part of
:func:`ampkit.reset`. See docs/concepts/casting.md."""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from ampkit._internal import registry as _reset
from ampkit._internal import torch_compat
from ampkit._internal.dtypes import default_device_type, default_dtype
from ampkit._internal.env import dtype_from_env
from ampkit._internal.where import user_stacklevel
from ampkit.errors import PolicyError, StateError

from . import _scope_api
from ._function_mode import _PythonOpMode
from ._kernels import _skip_kernel_frames, _state, drop_code_of_other_keys, kernel_registry
from ._module_rules import _end_cache_epoch, _install_step_hook, module_hooks, remove_step_hook
from ._resolve import _Frame, _resolve, _Resolved
from ._threads import thread_records
from .policy import Policy, check_compute_dtype, check_device_type

logger = logging.getLogger("ampkit")


# ---------------------------------------------------------------------------
# The scope
# ---------------------------------------------------------------------------
# Engine state: the fp16-on-CPU warning is given once per process.
_warned_fp16_cpu = False
# Engine state: the policy of a scope given a dtype alone, one per dtype (a Policy is
# immutable): a scope entered every step then finds its resolution cached (by identity).
_DEFAULT_POLICIES: dict[torch.dtype, Policy] = {}


def _default_policy(dtype: torch.dtype) -> Policy:
    policy = _DEFAULT_POLICIES.get(dtype)
    if policy is None:
        policy = _DEFAULT_POLICIES.setdefault(dtype, Policy(dtype=dtype))
    return policy


def _warn_fp16_cpu() -> None:
    global _warned_fp16_cpu
    if not _warned_fp16_cpu:
        _warned_fp16_cpu = True
        warnings.warn(
            "ampkit: float16 on CPU computes far slower than float32 on most CPUs (no fp16 "
            "kernels); prefer dtype=torch.bfloat16 on CPU.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


class autocast(contextlib.ContextDecorator):  # noqa: N801 - mirrors torch.autocast
    """Run ops in the dtypes ``policy`` says, inside a ``with`` block or a decorated function.

    Args:
        policy: a :class:`Policy`; ``None`` means the device's defaults
            (:func:`default_policy`: bf16 on CPU, fp16 on CUDA, torch's own lists).
            The policy's lists override the defaults op by op.
        device_type: ``"cpu"`` or ``"cuda"``; default ``"cuda"`` when a GPU is
            available, else ``"cpu"``.
        enabled: ``False`` turns casting off inside the block (ops run in their
            inputs' dtypes), also inside an outer ampkit scope or ``ampkit.init``.
        cache_enabled: cache 16-bit casts of fp32 parameters for each outermost
            module call in the scope (default True), as ``torch.autocast`` around that
            call would; the cache is dropped when the call returns or an optimizer
            steps, and nothing is cached outside module calls.
        dtype: shorthand for ``policy.override(dtype=...)``.

    Scopes nest; the innermost wins. Gradients reach each parameter in its own dtype.
    Scopes belong to the thread that enters them (replica threads of
    ``nn.DataParallel`` / ``parallel_apply`` start under their caller's scopes). As a decorator the scope covers each
    call; on a generator function that is only the creation of the generator (as with
    ``torch.autocast``): enter the scope inside the generator's body instead.
    """

    def __init__(
        self,
        policy: Policy | None = None,
        device_type: str | None = None,
        enabled: bool = True,
        cache_enabled: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.device_type = check_device_type(device_type or default_device_type())
        if policy is not None and not isinstance(policy, Policy):
            raise PolicyError(f"policy must be an ampkit.Policy, got {type(policy).__name__}.")
        if policy is None:
            policy = _default_policy(check_compute_dtype(dtype) if dtype else default_dtype(self.device_type))
        elif dtype is not None:
            policy = policy.override(dtype=check_compute_dtype(dtype))
        self.policy = policy
        self.enabled = bool(enabled)
        self.cache_enabled = bool(cache_enabled)
        # The engine's own switches (see open_scope): every op through ampkit's kernels; an
        # fp32 module rule (casting off, the policy's module rules still on).
        self._intercept_all = False
        self._from_rule = False
        self._module_hooks = True  # the global module hooks on while it is open (see open_scope)
        self._stacks: list[contextlib.ExitStack] = []
        if self.enabled and self.device_type == "cpu" and policy.dtype is torch.float16:
            _warn_fp16_cpu()

    def _recreate_cm(self) -> autocast:
        return self  # __enter__/__exit__ keep a stack, so reuse and nesting are safe

    def _make_frame(self, resolved: _Resolved | None) -> _Frame:
        """This scope's frame: ``resolved`` is its policy's resolution (None: disabled)."""
        if resolved is None:
            return _Frame(
                self.device_type, False, self.policy.dtype, self.policy, {}, {}, {}, self.cache_enabled,
                rules=self._from_rule,
            )
        return _Frame(
            self.device_type,
            True,
            self.policy.dtype,
            self.policy,
            resolved.categories,
            resolved.conditionals,
            resolved.python_ops,
            self.cache_enabled,
        )

    def __enter__(self) -> autocast:
        if torch.compiler.is_dynamo_compiling():  # a scope entered inside compiled code
            _enter_outside_dynamo(self)
            return self
        return self._enter()

    def __exit__(self, *exc: Any) -> bool:
        if torch.compiler.is_dynamo_compiling():
            _exit_outside_dynamo(self)
            return False
        return self._exit()

    def _enter(self) -> autocast:
        _skip_kernel_frames()  # once per process; returns at once after
        resolved = _resolve(self.policy, self.device_type, self._intercept_all) if self.enabled else None
        if resolved is not None and self.policy.dtype not in _entered_dtypes:
            _entered_dtypes.add(self.policy.dtype)
        frame = self._make_frame(resolved)
        if resolved is not None:
            kernel_registry.ensure(self.device_type, resolved.intercepted)
        if self._module_hooks:
            module_hooks.ensure()
        _install_step_hook()
        # casts are cached only inside module calls (one outermost call at a time): a
        # scope that starts outside one leaves torch's autocast cache off until it does
        cache = self.cache_enabled and bool(_state.module_stack)
        native = _native_enter(self.device_type, self.enabled, self.policy.dtype, cache)
        frame.key = _compile_key_of(_state.compile_key, frame)
        _state.frames.setdefault(self.device_type, []).append(frame)
        _state.scopes.append(frame)
        _state.compile_key = frame.key
        drop_code_of_other_keys(frame.key)
        mode = None
        if frame.python_ops and _state.py_mode_depth == 0:
            mode = _PythonOpMode()
            try:
                mode.__enter__()
            except BaseException:
                self._pop(frame)
                _native_exit(native)
                raise
            _state.py_mode_depth += 1
        self._stacks.append((native, frame, mode))
        return self

    @staticmethod
    def _pop(frame: _Frame) -> None:
        frames = _state.frames[frame.device_type]
        if frames and frames[-1] is frame:
            frames.pop()
        else:  # exited out of order (a generator closed late): remove wherever it is
            frames.remove(frame)
        if _state.scopes and _state.scopes[-1] is frame:
            _state.scopes.pop()
        else:
            _state.scopes.remove(frame)
        _state.compile_key = _state.scopes[-1].key if _state.scopes else ""
        drop_code_of_other_keys(_state.compile_key)
        frame.cache.clear()

    def _exit(self) -> bool:
        native, frame, mode = self._stacks.pop()
        try:
            if mode is not None:
                _state.py_mode_depth -= 1
                mode.__exit__(None, None, None)
        finally:
            try:
                self._pop(frame)
                if not _state.scopes:
                    _last_scope_closed()
            finally:
                _native_exit(native)
        return False


def open_scope(
    policy: Policy | None,
    device_type: str,
    *,
    enabled: bool = True,
    cache_enabled: bool = True,
    from_rule: bool = False,
    intercept_all: bool = False,
    dtype: torch.dtype | None = None,
    in_module_call: bool = False,
) -> autocast:
    """An :class:`autocast` with the engine's own switches, which are no part of the
    public signature: ``from_rule`` (the disabled scope of an fp32 module rule: module
    rules stay on inside it), ``intercept_all`` (every op of the policy's lists runs
    through ampkit's kernels, even where torch's own would do: for tests of the kernels)
    and ``in_module_call`` (the scope opens inside a module's call, whose module stack is
    already what it is: a cast model's own scope, a checkpoint's recomputation; entering
    it puts the global module hooks on only where the policy has module rules to apply,
    as the hooks make every module call take torch's slower path, and without them the
    calls inside start no cast cache). ``dtype`` as :class:`autocast`'s."""
    scope = autocast(policy, device_type, enabled=enabled, cache_enabled=cache_enabled, dtype=dtype)
    scope._from_rule = from_rule
    scope._intercept_all = intercept_all
    scope._module_hooks = not in_module_call or bool(scope.policy.module_rules)
    return scope


# A scope entered or left inside a function torch.compile traces runs eagerly, at a
# graph break (dynamo resumes tracing under the new state; its guards see it): the
# engine's bookkeeping is no graph material.
_enter_outside_dynamo = torch_compat.run_outside_dynamo(autocast._enter)
_exit_outside_dynamo = torch_compat.run_outside_dynamo(autocast._exit)


def _last_scope_closed() -> None:
    """No ampkit scope is open in this thread: module calls still on the stack (a scope
    closed inside a forward) are no longer tracked, and with no other thread the global
    hooks go (every module call is back on torch's fast path)."""
    if _state.module_stack:
        _end_cache_epoch(_state.module_stack[0])
        _state.module_stack.clear()
    if threading.active_count() == 1:
        module_hooks.remove()


# Engine state: guard keys of torch.compile, the same for equal policies (a cache).
_COMPILE_KEYS: dict[tuple[Any, ...], str] = {}
_POLICY_KEYS: dict[int, tuple[weakref.ref, tuple[Any, ...]]] = {}
_COMPILE_KEYS_LOCK = threading.Lock()


def _policy_key(policy: Policy) -> tuple[Any, ...]:
    """What of ``policy`` decides dtypes, as a hashable value: equal policies built
    anew (``autocast()`` builds one per entry) share it, so they share compiled code."""
    hit = _POLICY_KEYS.get(id(policy))
    if hit is not None and hit[0]() is policy:
        return hit[1]
    key = (
        policy.dtype,
        frozenset(policy.categories().items()),
        tuple(sorted(policy.conditionals().items(), key=lambda kv: kv[0])),
        frozenset(policy.module_rules.items()),
    )
    if len(_POLICY_KEYS) > 1024:
        _POLICY_KEYS.clear()
    _POLICY_KEYS[id(policy)] = (weakref.ref(policy), key)
    return key


def _compile_key_of(parent: str, frame: _Frame) -> str:
    """A short name for (the scopes below, this scope's policy, device, switches)."""
    value = (parent, _policy_key(frame.policy) if frame.policy is not None else None,
             frame.device_type, frame.enabled, frame.rules)
    key = _COMPILE_KEYS.get(value)
    if key is None:
        with _COMPILE_KEYS_LOCK:
            key = _COMPILE_KEYS.setdefault(value, f"ampkit-{len(_COMPILE_KEYS) + 1}")
    return key


def _native_enter(device_type: str, enabled: bool, dtype: torch.dtype, cache_enabled: bool) -> Any:
    """Enter native autocast as ``torch.autocast.__enter__`` does; returns what
    :func:`_native_exit` needs. On CPU the thread-local switches are set directly (a
    ``torch.autocast`` object costs more to build than the rest of a scope); when a
    torch function mode is active (``torch.export`` records autocast through one) or on
    other devices (torch checks the device can autocast, and warns), a real
    ``torch.autocast`` is entered."""
    if device_type != "cpu" or torch_compat.torch_function_mode_active():
        cm = (
            torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled)
            if enabled
            else torch.autocast(device_type, enabled=False)
        )
        cm.__enter__()
        return cm
    prev = (
        device_type,
        torch.is_autocast_cache_enabled(),
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
    )
    torch.set_autocast_enabled(device_type, enabled)
    torch.autocast_increment_nesting()
    if enabled:  # a disabled scope leaves dtype and cache switch as they are
        torch.set_autocast_dtype(device_type, dtype)
        torch.set_autocast_cache_enabled(cache_enabled)
    return prev


def _native_exit(token: Any) -> None:
    if isinstance(token, torch.autocast):
        token.__exit__(None, None, None)
        return
    device_type, cache_enabled, enabled, dtype = token
    if torch.autocast_decrement_nesting() == 0:
        torch.clear_autocast_cache()  # leaving the outermost autocast scope, as torch does
    torch.set_autocast_enabled(device_type, enabled)
    torch.set_autocast_dtype(device_type, dtype)
    torch.set_autocast_cache_enabled(cache_enabled)


# ---------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------
def checkpoint_context() -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

    torch re-runs a checkpointed function during backward under plain ``torch.autocast``
    only; with a policy that differs from torch's lists the recomputation would run in
    other dtypes (torch then raises ``CheckpointError``). This records the ampkit scopes
    active now and re-enters them, in order, around the recomputation::

        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                              context_fn=ampkit.checkpoint_context)

    Returns ``(forward context, recompute context)``; the forward one does nothing.
    """
    return contextlib.nullcontext(), _Replay(_snapshot(_state.scopes), list(_state.module_stack))


def _snapshot(scopes: list[_Frame]) -> list[tuple[Policy | None, str, bool, bool, bool]]:
    """What :class:`_Replay` needs to enter ``scopes`` again."""
    return [(f.policy, f.device_type, f.enabled, f.cache_enabled, f.rules) for f in list(scopes)]


class _Replay:
    """Re-enters recorded ampkit scopes (checkpoint recomputation, replica threads)."""

    def __init__(
        self, frames: list[tuple[Policy | None, str, bool, bool, bool]], modules: list[nn.Module]
    ) -> None:
        self._frames = frames
        self._modules = modules  # the modules being called, so name rules see the same names
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> _Replay:
        stack = contextlib.ExitStack()
        saved = list(_state.module_stack)  # replaced in place: other code holds the list
        _state.module_stack[:] = self._modules
        stack.callback(_state.module_stack.__setitem__, slice(None), saved)
        for policy, device_type, enabled, cache_enabled, rules in self._frames:
            stack.enter_context(
                open_scope(policy, device_type, enabled=enabled, cache_enabled=cache_enabled,
                           from_rule=not enabled and rules, in_module_call=True)  # fmt: skip
            )
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        return False


# ---------------------------------------------------------------------------
# Process-wide switch
# ---------------------------------------------------------------------------
def check_init_dtype(dtype: Any) -> None:
    """:class:`ampkit.PolicyError` if ``dtype`` (:func:`ampkit.init`'s first argument) is a
    :class:`Policy`, which goes by keyword."""
    if isinstance(dtype, Policy):
        raise PolicyError(
            "ampkit.init's first argument is the compute dtype; a Policy goes by keyword: "
            "ampkit.init(policy=my_policy) (or ampkit.init(my_policy.dtype, policy=my_policy))."
        )


def init(
    dtype: torch.dtype | None = None,
    device_type: str | None = None,
    *,
    policy: Policy | None = None,
    cache_enabled: bool = True,
    **policy_fields: Any,
) -> Policy:
    """Turn op-level casting on for this thread until :func:`ampkit.reset`: the casting
    layer's part of :func:`ampkit.init`, which documents the arguments (a tuning plan,
    ``plan=`` and ``model=``, is applied there, above this layer). Returns the policy in
    force."""
    check_init_dtype(dtype)
    if dtype is None and policy is None:  # an argument > the environment > the default
        dtype = dtype_from_env()
    device = check_device_type(device_type or default_device_type())
    if policy is not None and not isinstance(policy, Policy):
        raise PolicyError(f"policy must be an ampkit.Policy, got {type(policy).__name__}.")
    base = policy if policy is not None else Policy(dtype=dtype or default_dtype(device))
    if dtype is not None and policy is not None:
        base = base.override(dtype=dtype)
    if policy_fields:
        base = base.override(dtype=base.dtype, **policy_fields)
    if _state.global_scope is not None:
        _stop_global()
    scope = autocast(base, device, cache_enabled=cache_enabled)
    scope.__enter__()
    kernel_registry.verify()  # a kernel registered over ampkit's since would silently win
    _state.global_scope = scope
    logger.info("ampkit: casting on for %s in %s", device, base.dtype)
    return base


def _stop_global() -> None:
    scope, _state.global_scope = _state.global_scope, None
    if scope is not None and scope._stacks:
        scope.__exit__(None, None, None)


#: The compute dtypes of the enabled scopes entered since the last reset (any thread).
_entered_dtypes: set[torch.dtype] = set()


def entered_dtypes() -> frozenset[torch.dtype]:
    """The compute dtypes of the enabled ``ampkit.autocast`` scopes entered in this
    process (any thread) since the last :func:`ampkit.reset`."""
    return frozenset(_entered_dtypes)


@_reset.on_reset
def _reset_engine() -> None:
    global _warned_fp16_cpu
    _warned_fp16_cpu = False  # warn once per ampkit session (reset starts a new one)
    _entered_dtypes.clear()
    _stop_global()
    for stack in reversed(_state.rule_stack):
        stack[1].close()
    _state.rule_stack.clear()
    if _state.module_stack:
        _end_cache_epoch(_state.module_stack[0])
    _state.module_stack.clear()
    module_hooks.name_roots.clear()
    # Kernels and hooks are kept while anything could be running through them: only
    # the process's one thread, with no scope of its own open, may take them down.
    if threading.active_count() == 1 and not _state.scopes:
        kernel_registry.clear()
        module_hooks.remove()
        remove_step_hook()  # the optimizer step hook too: no global hook of ampkit's stays


def release_kernels() -> None:
    """Remove ampkit's dispatcher kernels and global module hooks now, so that plain
    ``torch.autocast`` runs torch's own kernels again.

    :func:`ampkit.reset` does this by itself when it runs in a process's only thread.
    With other threads alive it keeps them (removing a kernel while another thread
    dispatches through it crashes that thread): while kept, they do what torch's own
    kernels do outside ampkit scopes -- the same dtype per op and the same values --
    except that they cast an fp32 weight at each use instead of once per
    ``torch.autocast`` region (torch's cast cache): a weight used twice in one forward
    may then get a gradient that differs in its last bits from torch's. Call this after
    :func:`ampkit.reset` when the other threads (a logger, a data-loading thread, a test
    runner's) run no torch ops at that moment. The next ampkit scope registers what it
    needs again.

    Raises:
        StateError: an ampkit scope (``ampkit.autocast``/``ampkit.init``) is open in
            this thread, or in another live thread (its ops would run with torch's
            kernels mid-scope, in the wrong dtypes, or crash): leave them (or call
            :func:`ampkit.reset`, and let the other threads finish their scopes) first.
    """
    if _state.scopes:
        raise StateError(
            f"ampkit.casting.release_kernels(): {len(_state.scopes)} ampkit scope(s) are open "
            "in this thread and run through the kernels; leave them (or call ampkit.reset()) first"
        )
    me = threading.get_ident()
    alive = {t.ident: t.name for t in threading.enumerate()}
    busy = sorted(alive[tid] for tid, rec in thread_records() if tid != me and tid in alive and rec.scopes)
    if busy:
        raise StateError(
            f"ampkit.casting.release_kernels(): ampkit scopes are open in {len(busy)} other thread(s) "
            f"({', '.join(busy[:4])}), whose ops run through the kernels now; release them once those "
            "threads have left their scopes (joined, or past their ampkit.autocast blocks)"
        )
    kernel_registry.clear()
    module_hooks.remove()
    remove_step_hook()


# the lower parts of the engine open and replay scopes through this (they cannot import it)
_scope_api.install(open_scope, lambda frames: _Replay(_snapshot(frames), []))
