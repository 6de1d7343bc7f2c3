"""The casting engine: applies a :class:`~ampkit.Policy` in a scope.

How it works:

- Every scope runs under native ``torch.autocast(device_type, dtype)``. When the
  policy's categories equal torch's own lists (the default policy), that is all:
  no Python runs per op.
- Ops whose category differs from torch's get a kernel of ours on the device's
  ``Autocast*`` dispatch key (``torch.library``), so they are seen wherever they are
  called from, also inside other torch functions, and casts happen before autograd
  records the op (saved activations are 16-bit, as with torch.autocast). The kernel
  looks up the innermost ampkit scope of its thread; outside one it behaves like
  torch's own kernel (same category, so the same dtypes and values).
- Thread safety: a kernel is registered the first time a policy needs its op and
  kept, so the dispatcher's tables never change under threads dispatching through
  them; kernels go only on ``ampkit.reset()`` in a process with one thread and no
  scope open. The global module hooks below are installed while a scope is open and
  removed only when no other thread could be running a module (the last scope of a
  one-thread process closes, or that reset).
- Python-level torch functions without an aten op are intercepted by a
  ``TorchFunctionMode`` pushed only while a scope needs one.
- Module rules use global forward pre/post hooks (no forward replacement); in a
  thread with no ampkit scope they return at once.
- Casts of fp32 leaf tensors that require grad (parameters) are cached for one
  outermost module call in a scope (torch's autocast cache and ours: the cache switch
  is on only inside such a call, which starts and ends with an empty cache), and
  dropped when an optimizer steps; ours also checks the tensor's version counter.
  Weights changed through ``.data`` between forwards are therefore never stale.
  ``cache_enabled=False`` turns caching off.
- Replica threads of ``torch.nn.parallel.parallel_apply`` (``nn.DataParallel``) enter
  their caller's scopes when they first run a module or op (:func:`_replica_caller`).
- torch.compile: the hooks and the function mode have a branch for code dynamo traces
  (``torch.compiler.is_dynamo_compiling()``): no stack mutation, decisions taken at
  trace time (constants in the graph), module rules as autocast switches dynamo
  records; compiled code is guarded on ``_state.compile_key``, which names the
  thread's scopes by value. Kernels run while graphs are traced, so their casts are
  in the graph (see "Module hooks inside torch.compile" below); a graph whose kernels
  cast otherwise than torch's carries a no-op node naming their decisions, so torch's
  compile caches key it on them (:func:`_mark_graph`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import re
import sys
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ampkit._internal import registry as _reset
from ampkit._internal.dtypes import default_device_type, default_dtype
from ampkit._internal.where import user_stacklevel
from ampkit.errors import PolicyError

from .lists import AUTOCAST_KEYS, native_categories
from .policy import (
    Policy,
    check_compute_dtype,
    check_device_type,
    is_python_op,
    python_callable,
)

__all__ = ["autocast", "init", "is_active", "current_policy", "active_scopes", "checkpoint_context"]

logger = logging.getLogger("ampkit")

_NATIVE: dict[str, dict[str, str]] = {dev: native_categories(dev) for dev in AUTOCAST_KEYS}


# ---------------------------------------------------------------------------
# Resolved scope state
# ---------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Frame:
    """One active scope: what its kernels, mode and hooks consult."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    policy: Policy | None
    categories: dict[str, str]  # aten base name -> category, effective
    conditionals: dict[str, tuple[Callable[..., bool], ...]]
    python_ops: dict[Any, str]  # function object -> category
    cache_enabled: bool
    rules: bool = True  # module rules apply (False in a scope the user disabled)
    key: str = ""  # this scope stack's compile key (see _compile_key_of)
    cache: dict[int, tuple[weakref.ref, int, torch.dtype, torch.Tensor]] = dataclasses.field(
        default_factory=dict
    )


@dataclasses.dataclass(frozen=True)
class _Resolved:
    categories: dict[str, str]
    conditionals: dict[str, tuple[Callable[..., bool], ...]]
    python_ops: dict[Any, str]
    intercepted: frozenset[str]  # aten base names that need our kernel


# Engine state: policy -> resolved categories, a cache (a policy is an immutable value).
_RESOLVED: dict[tuple[int, str, bool], tuple[Policy, _Resolved]] = {}

# (device type, dtype) -> {aten op: category} for ops torch.autocast lowers but whose
# lowered kernel cannot run on this machine; filled by a probe the first time a scope
# for that pair resolves. Process-wide and only ever filled (same answer every time).
_REPAIRS: dict[tuple[str, torch.dtype], dict[str, str]] = {}
_REPAIRS_LOCK = threading.Lock()


def _probe_rnn(dtype: torch.dtype) -> bool:
    """Whether ``nn.LSTM`` runs under CPU ``torch.autocast(dtype)`` here.

    torch 2.13 lowers ``mkldnn_rnn_layer`` to bf16/fp16 under CPU autocast, but oneDNN
    refuses that primitive on some CPUs ("could not create a primitive descriptor for the
    LSTM forward propagation primitive"), so plain ``torch.autocast`` cannot run an LSTM.

    The probe LSTM is built on the meta device and zero-filled on the CPU: its usual
    random init would draw from torch's default generator, and a seeded run must draw
    the same numbers with ampkit as without it.
    """
    lstm = nn.LSTM(2, 2, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        for param in lstm.parameters():
            param.zero_()
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            lstm(torch.zeros(1, 1, 2))
    except RuntimeError:
        return False
    return True


def _repairs(device_type: str, policy: Policy) -> dict[str, str]:
    """Ops to keep in fp32 because torch's lowered kernel fails here (unless the policy
    itself names them): today ``mkldnn_rnn_layer`` (``nn.LSTM``) on CPUs whose oneDNN has
    no 16-bit LSTM; it then runs in fp32, as ``nn.GRU`` and the RNN cells already do
    under CPU autocast."""
    if device_type != "cpu":
        return {}
    key = (device_type, policy.dtype)
    with _REPAIRS_LOCK:
        found = _REPAIRS.get(key)
        if found is None:
            found = {} if _probe_rnn(policy.dtype) else {"mkldnn_rnn_layer": "fp32"}
            if found:
                logger.info(
                    "ampkit: nn.LSTM cannot run in %s on this CPU (oneDNN); it runs in fp32", policy.dtype
                )
            _REPAIRS[key] = found
    named = policy.categories()  # a policy may choose fp32/promote itself; 'lower' cannot run
    return {op: c for op, c in found.items() if named.get(op, "lower") == "lower"}


def _resolve(policy: Policy, device_type: str, intercept_all: bool = False) -> _Resolved:
    key = (id(policy), device_type, intercept_all)
    hit = _RESOLVED.get(key)
    if hit is not None and hit[0] is policy:
        return hit[1]
    native = _NATIVE[device_type]
    categories = dict(native)
    python_ops: dict[Any, str] = {}
    for name, category in policy.categories().items():
        if is_python_op(name):
            python_ops[python_callable(name)] = category
        else:
            categories[name] = category
    for name, category in _repairs(device_type, policy).items():
        categories[name] = category
    conditionals: dict[str, tuple[Callable[..., bool], ...]] = {}
    for name, preds in policy.conditionals().items():
        if is_python_op(name):
            raise PolicyError(
                f"conditional_fp32_ops: {name[3:]} has no aten op; conditional rules apply to "
                "aten ops (torch.pow, torch.exp, ...)."
            )
        conditionals[name] = preds
    if intercept_all:
        intercepted = frozenset(categories) | frozenset(conditionals)
    else:
        intercepted = frozenset(
            {n for n, c in categories.items() if native.get(n) != c}
            | set(conditionals)
        )
    resolved = _Resolved(categories, conditionals, python_ops, intercepted)
    if len(_RESOLVED) > 256:
        _RESOLVED.clear()
    _RESOLVED[key] = (policy, resolved)
    return resolved


class _State(threading.local):
    """Per-thread scope state, set up on a thread's first use of the engine. A thread
    that exits takes its state, and any scope it left open (``init`` in a worker
    thread), with it. A replica thread of ``torch.nn.parallel.parallel_apply``
    (``nn.DataParallel``) starts with its caller's scopes (:func:`_inherit_caller`)."""

    def __init__(self) -> None:
        self.frames: dict[str, list[_Frame]] = {}
        self.scopes: list[_Frame] = []  # all devices, entry order
        self.py_mode_depth = 0
        self.module_stack: list[nn.Module] = []
        self.rule_stack: list[tuple[nn.Module, contextlib.ExitStack]] = []
        self.global_scope: autocast | None = None  # ampkit.init's scope: per thread, as torch's autocast state
        # the outermost module call of the scopes, and the autocast cache switch before it
        self.epoch: tuple[nn.Module, bool] | None = None
        # names the open scopes' decisions for torch.compile ("": no scope); compiled
        # code reads it, so dynamo guards on it and recompiles when it changes (a str:
        # dynamo would make a changing int dynamic instead of guarding its value)
        self.compile_key = ""
        replica = _is_replica_thread()
        self.record = _ThreadRecord(self.scopes, self.module_stack, replica)
        _THREADS[threading.get_ident()] = self.record
        self.inherited: _Replay | None = None
        caller = _replica_caller() if replica else None
        if caller is not None:
            _inherit_caller(self, caller)


class _ThreadRecord:
    """What other threads may read of a thread's state (its own lists, shared)."""

    __slots__ = ("scopes", "module_stack", "replica", "__weakref__")

    def __init__(self, scopes: list[_Frame], module_stack: list[nn.Module], replica: bool = False) -> None:
        self.scopes = scopes
        self.module_stack = module_stack
        self.replica = replica  # a parallel_apply worker: never another replica's caller


# thread id -> its record; an entry goes with its thread's state (thread exit)
# Engine state: the threads with engine state (DataParallel replicas inherit from them).
_THREADS: weakref.WeakValueDictionary[int, _ThreadRecord] = weakref.WeakValueDictionary()


def _replica_caller() -> _ThreadRecord | None:
    """The record of the thread that started this one, if this is a replica thread of
    ``torch.nn.parallel.parallel_apply`` (``nn.DataParallel``, or any direct use).

    torch re-enters only its own autocast state in those threads. The caller is blocked
    in ``parallel_apply`` (joining the replicas) until they finish. It is found through
    ampkit's own records, never through other threads' frames (reading those races with
    the threads that own them and can crash the interpreter): the thread whose current
    module call holds the replica (``nn.DataParallel``: a replica of its ``module``;
    ``parallel_apply`` in a module's ``forward``: a child), else, for a call outside any
    module, the one thread with open scopes. When that leaves several candidates, the
    replica inherits nothing and a warning says so."""
    args = getattr(threading.current_thread(), "_args", ())  # _worker(i, module, input, ...)
    replica = args[1] if len(args) > 1 and isinstance(args[1], nn.Module) else None
    me = threading.get_ident()
    others = [
        rec for ident, ref in list(_THREADS.data.items()) if ident != me and (rec := ref()) is not None and not rec.replica
    ]
    holders = [rec for rec in others if replica is not None and _holds(rec.module_stack[-1:], replica)]
    if len(holders) == 1:
        return holders[0]
    scoped = [rec for rec in others if rec.scopes]
    if not holders and len(scoped) <= 1:
        return scoped[0] if scoped else None
    warnings.warn(
        "ampkit: several threads could have started this torch.nn.parallel.parallel_apply "
        "(nn.DataParallel) replica, so it cannot tell which caller's casting scopes to "
        "enter; it runs under the process-wide setting (ampkit.init) only. Run one "
        "DataParallel forward at a time, or use DistributedDataParallel.",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def _is_replica_thread() -> bool:
    """Whether this thread runs ``torch.nn.parallel.parallel_apply``'s worker."""
    apply_module = sys.modules.get("torch.nn.parallel.parallel_apply")
    worker_code = getattr(getattr(threading.current_thread(), "_target", None), "__code__", None)
    apply_code = getattr(getattr(apply_module, "parallel_apply", None), "__code__", None)
    return worker_code is not None and apply_code is not None and any(c is worker_code for c in apply_code.co_consts)


def _holds(top: list[nn.Module], replica: nn.Module) -> bool:
    """Whether the module call ``top`` (another thread's innermost, or none) runs
    ``replica``: it is that module or a child of it, or a ``DataParallel`` replica of a
    child (``replicate`` copies a module's ``__dict__``, hook dicts included)."""
    if not top:
        return False
    hooks = replica.__dict__.get("_forward_pre_hooks")
    for module in [top[0], *list(top[0]._modules.values())]:
        if module is replica or (
            getattr(replica, "_is_replica", False) and module is not None and module.__dict__.get("_forward_pre_hooks") is hooks
        ):
            return True
    return False


def _inherit_caller(state: _State, caller: _ThreadRecord) -> None:
    """Enter the caller's scopes in this (replica) thread, for the thread's lifetime."""
    if not caller.scopes:
        return
    # names: a replica is a copy of ``dp.module``, which name rules see through ``dp``
    # to in the caller too (:func:`_unwrap`), so the replica is its own root here
    replay = _Replay(_snapshot(caller.scopes), [])
    replay.__enter__()
    state.inherited = replay


_state = _State()


def _top(device_type: str) -> _Frame | None:
    frames = _state.frames.get(device_type)
    return frames[-1] if frames else None


def is_active(device_type: str | None = None) -> bool:
    """Whether an enabled ampkit scope (or ``ampkit.init``) is active in this thread."""
    if device_type is not None:
        top = _top(device_type)
        return top is not None and top.enabled
    return any(f.enabled for f in _state.scopes[-1:])


def current_policy(device_type: str | None = None) -> Policy | None:
    """The policy of the innermost enabled scope (for ``device_type`` if given)."""
    frames = _state.frames.get(device_type, []) if device_type else _state.scopes
    for frame in reversed(frames):
        if frame.policy is not None:
            return frame.policy if frame.enabled else None
    return None


def active_scopes() -> int:
    return len(_state.scopes)


# ---------------------------------------------------------------------------
# Casting helpers (used by the kernels, the function mode and module rules)
# ---------------------------------------------------------------------------
_F32, _F64 = torch.float32, torch.float64
# Engine state: a memo of device tests, filled once per device type (the same test every time).
_ON_DEVICE: dict[str, Callable[[torch.Tensor], bool]] = {
    "cpu": operator.attrgetter("is_cpu"),
    "cuda": operator.attrgetter("is_cuda"),
}


def _on_device(device_type: str) -> Callable[[torch.Tensor], bool]:
    """A fast test for "this tensor is on ``device_type``" (``t.device`` builds an object)."""
    test = _ON_DEVICE.get(device_type)
    if test is None:
        def test(t: torch.Tensor) -> bool:
            return t.device.type == device_type

        _ON_DEVICE[device_type] = test
    return test


def _cast_tensor(t: torch.Tensor, dtype: torch.dtype, frame: _Frame | None) -> torch.Tensor:
    if t.dtype is dtype:
        return t
    cacheable = (
        frame is not None
        and frame.cache_enabled
        and torch.is_autocast_cache_enabled()  # on only inside a module call: see _start_cache_epoch
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
        and torch.is_grad_enabled()
    )
    if not cacheable:
        return t.to(dtype)
    key = id(t)
    hit = frame.cache.get(key)
    if hit is not None:
        ref, version, hit_dtype, cast = hit
        if ref() is t and version == t._version and hit_dtype is dtype:
            return cast
    cast = t.to(dtype)
    frame.cache[key] = (weakref.ref(t), t._version, dtype, cast)
    return cast


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(fn(v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _iter_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    yield v


def _widest(args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str, low: torch.dtype) -> torch.dtype:
    on = _on_device(device_type)
    for t in _iter_tensors(args, kwargs):
        if t.dtype is _F32 and on(t):
            return _F32
    return low


def _cast_value(
    v: Any, target: torch.dtype, on: Callable[[torch.Tensor], bool], frame: _Frame | None
) -> Any:
    """``v`` with its floating tensors on the device (also inside a list or tuple) cast
    to ``target``; float64 and other devices' tensors are left alone."""
    if isinstance(v, torch.Tensor):
        dt = v.dtype
        if dt is target or dt is _F64 or not dt.is_floating_point or not on(v):
            return v
        return _cast_tensor(v, target, frame)
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return type(v)([_cast_value(x, target, on, frame) for x in v])
    return v


def cast_arguments(
    category: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    dtype: torch.dtype,
    frame: _Frame | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast an op's floating ``device_type`` tensors as ``category`` says."""
    if category is None:
        return args, kwargs
    if category == "lower":
        target = dtype
    elif category == "fp32":
        target = _F32
    elif category == "promote":
        target = _widest(args, kwargs, device_type, dtype)
    else:  # pragma: no cover - categories are validated
        raise PolicyError(f"unknown category {category!r}")
    on = _on_device(device_type)
    args = tuple([_cast_value(a, target, on, frame) for a in args])
    if kwargs:
        kwargs = {k: _cast_value(v, target, on, frame) for k, v in kwargs.items()}
    return args, kwargs


# ---------------------------------------------------------------------------
# Kernels on the Autocast dispatch keys
# ---------------------------------------------------------------------------
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU).add(
    torch._C.DispatchKey.AutocastCUDA
)


def _overloads(base: str) -> list[Any]:
    packet = getattr(torch.ops.aten, base)
    out = []
    for name in packet.overloads():
        overload = getattr(packet, name)
        schema = overload._schema
        if name.endswith("out") or any(a.is_out for a in schema.arguments):
            continue
        if not any("Tensor" in str(a.type) for a in schema.arguments):
            continue
        out.append(overload)
    return out


def _guard_compiled_code() -> None:
    """A kernel of ours runs while torch.compile traces (dynamo's fake run of an op, or
    AOTAutograd's): the graph's dtypes then depend on this thread's scopes, so make
    dynamo guard the code being compiled on ``_state.compile_key``. Module calls get
    this guard from the hooks; a compiled function calling no module gets it here.
    Uses dynamo's guard API (internal; checked by tests/test_compile.py)."""
    _skip_kernel_frames()
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    tx = getattr(getattr(convert, "tls", None), "current_tx", None)
    if tx is None:
        return
    try:
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.source import AttrSource

        source = AttrSource(AttrSource(tx.import_source(__name__), "_state"), "compile_key")
        install_guard(source.make_guard(GuardBuilder.EQUALS_MATCH))
    except Exception:  # noqa: BLE001 - another torch's internals: compile without the guard
        logger.debug("ampkit: could not add the policy guard to compiled code", exc_info=True)
    _mark_graph(tx.output)


# torch.compile's caches (AOTAutograd's, in memory and on disk, and the artifacts
# torch.compiler.save_cache_artifacts writes) key compiled code on dynamo's graph and on
# torch's autocast state. The casts of ampkit's kernels are made after that graph, while
# AOTAutograd traces it: a graph traced under one policy would be served under another
# (an inference graph of the default policy under fp32_ops=["linear"] ran linear in bf16).
# So a graph traced while the kernels decide otherwise than torch's own gets a node naming
# those decisions: a no-op (it decomposes to nothing when AOTAutograd traces it) whose
# argument is part of the key.
_marker_lib = torch.library.Library("ampkit", "FRAGMENT")
_marker_lib.define("casting_decisions(str decisions) -> ()")
_marker_lib.impl("casting_decisions", lambda decisions: None, "CompositeImplicitAutograd")
_MARKER = torch.ops.ampkit.casting_decisions.default

# Engine state: compile key -> its kernel decisions (a cache: the key names the scopes by
# value), and the predicates of conditional rules by serial number (held, so the number is
# never another object's; ``_PROCESS`` keeps two processes' numbers apart).
_DECISIONS: dict[str, str] = {}
_PREDICATES: dict[Callable[..., bool], int] = {}
_PROCESS = uuid.uuid4().hex[:12]  # os.urandom: no generator a user can observe


def _kernel_decisions() -> str:
    """What this thread's scopes make ampkit's kernels decide where torch's own would
    decide otherwise, as text ("" when nothing differs): per device, the compute dtype and
    the ops whose category changed; conditional rules by their predicate's identity."""
    key = _state.compile_key
    hit = _DECISIONS.get(key)
    if hit is not None:
        return hit
    parts = []
    for device_type, frames in sorted(_state.frames.items()):
        top = frames[-1] if frames else None
        if top is None or not top.enabled:
            continue
        native = _NATIVE[device_type]
        changed = sorted(f"{op}={c}" for op, c in top.categories.items() if native.get(op) != c)
        with _step_hook_lock:
            conditional = sorted(
                f"{op}?{_PROCESS}.{_PREDICATES.setdefault(p, len(_PREDICATES))}"
                for op, preds in top.conditionals.items()
                for p in preds
            )
        if changed or conditional:
            parts.append(f"{device_type}:{top.dtype}:{','.join(changed)}:{','.join(conditional)}")
    decisions = ";".join(parts)
    if len(_DECISIONS) > 1024:
        _DECISIONS.clear()
    _DECISIONS[key] = decisions
    return decisions


# Engine state: the warning that a graph could not be marked is given once per process.
_marker_failed = False


def _mark_graph(output: Any) -> None:
    """Put the marker of :func:`_kernel_decisions` in the graph dynamo is building (once;
    not after tracing ended: AOTAutograd runs the kernels again, under the same scopes)."""
    if getattr(output, "should_exit", True):
        return
    decisions = _kernel_decisions()
    if not decisions:
        return
    try:
        tracer = output.root_tracer
        if any(n.args == (decisions,) for n in tracer.graph.find_nodes(op="call_function", target=_MARKER)):
            return
        tracer.create_proxy("call_function", _MARKER, (decisions,), {}).node.meta["example_value"] = None
    except Exception:  # noqa: BLE001 - another torch's internals: the cache may serve this graph elsewhere
        global _marker_failed
        if _marker_failed:
            return
        _marker_failed = True
        logger.warning(
            "ampkit: could not name the casting policy in a graph torch.compile is building; "
            "its compile caches may serve it under another policy (set "
            "torch._functorch.config.enable_autograd_cache = False to be safe)",
            exc_info=True,
        )


# Engine state: set once, when dynamo is told to skip the kernel frames.
_kernel_frames_skipped = False


def _skip_kernel_frames() -> None:
    """Tell dynamo never to compile a kernel's frame (nor what it calls): run eagerly
    inside compiled code (after a graph break), the dispatcher calls our kernels, and
    dynamo would try to compile them like any Python frame it meets."""
    global _kernel_frames_skipped
    if _kernel_frames_skipped or "torch._dynamo.eval_frame" not in sys.modules:
        return
    _kernel_frames_skipped = True
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        code = _make_kernel.__code__.co_consts
        for c in code:
            if getattr(c, "co_name", None) == "kernel":
                set_code_exec_strategy(c, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except Exception:  # noqa: BLE001 - another torch's internals: dynamo may compile them
        logger.debug("ampkit: could not mark kernel frames as skipped for dynamo", exc_info=True)


def _drop_compiled_code(device_type: str) -> None:
    """A policy overrides an op on ``device_type`` for the first time in this process:
    code torch.compile traced before under autocast on that device, with no guard on
    ampkit's scopes (nothing of ampkit ran while it was traced), holds the op as torch's
    own kernel cast it, and would run so under the policy. Only that code is dropped
    (compiled anew on its next call); code traced without autocast (an optimizer step,
    a model compiled outside any scope) or guarded on the scopes stays as it is."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None or not utils.counters["frames"].get("ok") or torch.compiler.is_compiling():
        return
    try:
        from torch._C._dynamo.eval_frame import reset_code
        from torch._dynamo.convert_frame import compile_lock

        with compile_lock:
            stale = _unguarded_autocast_code(device_type)
            for code in stale:
                reset_code(code)
    except Exception:  # noqa: BLE001 - another torch's internals: only a full reset is safe
        logger.debug("ampkit: could not look into torch.compile's code cache", exc_info=True)
        _warn_dropped("every function torch.compile compiled in this process")
        torch.compiler.reset()
        return
    if stale:
        names = ", ".join(sorted({c.co_name for c in stale})[:5])
        _warn_dropped(f"{len(stale)} compiled function(s) ({names})")


# Engine state: the warning that compiled code was dropped is given once per process.
_warned_dropped = False


def _warn_dropped(what: str) -> None:
    global _warned_dropped
    if _warned_dropped:
        return
    _warned_dropped = True
    logger.warning(
        "ampkit: a policy overrides an op for the first time; %s traced under autocast "
        "before that, unguarded by ampkit's scopes, will be compiled again on the next call "
        "(enter your policies once before compiling to avoid it)",
        what,
    )


def _unguarded_autocast_code(device_type: str) -> list[Any]:
    """Code objects with compiled code traced under autocast on ``device_type`` and not
    guarded on ``_state.compile_key`` (read from dynamo's guards, a torch internal
    checked by tests/test_compile.py)."""
    import json

    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    index = torch._C._autocast_supported_devices().index(device_type)
    marker = "___check_global_state() against "
    stale = []
    for ref in list(input_codes.seen):
        code = ref()
        if code is None:
            continue
        for entry in _debug_get_cache_entry_list(code):
            parts = entry.guard_manager.code_parts
            if any("_state.compile_key" in part for part in parts):
                continue
            states = [json.loads(p[p.index(marker) + len(marker):]) for p in parts if marker in p]
            if not states or states[0]["autocast_state"]["enabled"][index]:
                stale.append(code)
                break
    return stale


class _KernelRegistry:
    """Puts ampkit kernels on ``Autocast<Device>`` for the ops policies need.

    A kernel is registered the first time a scope needs its op and then kept: the
    dispatcher's tables are not changed while other threads dispatch through them
    (registering and destroying kernels at every scope entry and exit crashed threads
    running concurrently). A kept kernel looks up the innermost ampkit scope of the
    calling thread; with none (plain ``torch.autocast``, or no scope at all) it does
    what torch's own kernel for that op does: the same category, so the same dtypes
    and values. Kernels are removed by :func:`ampkit.reset` only when it runs in the
    process's only thread and no scope is open (:meth:`clear`).
    """

    def __init__(self) -> None:
        self._libs: dict[tuple[str, str], torch.library.Library] = {}
        self._done: dict[str, frozenset[str]] = {}  # device type -> registered ops (read lock-free)
        self._lock = threading.Lock()

    def ensure(self, device_type: str, names: frozenset[str]) -> None:
        """Register kernels for those of ``names`` that have none yet."""
        if names <= self._done.get(device_type, frozenset()):
            return
        with self._lock, warnings.catch_warnings():
            # torch warns once that a registered kernel is being overridden
            warnings.simplefilter("ignore")
            done = self._done.get(device_type, frozenset())
            for base in names - done:
                self._libs[(device_type, base)] = _register(device_type, base)
            self._done[device_type] = done | names
        _drop_compiled_code(device_type)

    def clear(self) -> None:
        """Remove every kernel (torch's own are back). Only safe when no other thread
        can be dispatching: see :func:`_reset_engine`."""
        with self._lock:
            self._done = {}
            libs, self._libs = self._libs, {}
            for lib in libs.values():
                lib._destroy()

    def registered(self, device_type: str) -> frozenset[str]:
        return self._done.get(device_type, frozenset())


def _register(device_type: str, base: str) -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    for overload in _overloads(base):
        name = base if overload._overloadname == "default" else f"{base}.{overload._overloadname}"
        lib.impl(name, _make_kernel(device_type, base, overload), AUTOCAST_KEYS[device_type])
    return lib


_registry = _KernelRegistry()


def _is_composite(overload: Any) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), "CompositeImplicitAutograd")
    except RuntimeError:  # an overload the dispatcher does not know by name (einsum.sublist)
        return False


def _make_kernel(device_type: str, base: str, overload: Any) -> Callable[..., Any]:
    native = _NATIVE[device_type].get(base)
    composite = _is_composite(overload)
    op = overload._op  # the C++ callable: skips OpOverload.__call__'s Python layer
    get_dtype = torch.get_autocast_dtype
    exclude = torch._C._ExcludeDispatchKeyGuard

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            _guard_compiled_code()
        frames = _state.frames.get(device_type)
        frame = frames[-1] if frames else None
        dtype = get_dtype(device_type)
        if frame is not None and frame.enabled and frame.dtype is dtype:
            category = frame.categories.get(base)
            if frame.conditionals:
                preds = frame.conditionals.get(base)
                if preds and any(p(*args, **kwargs) for p in preds):
                    category = "fp32"
        else:  # no ampkit scope of this thread decides: torch's own category
            frame, category = None, native
        if category is None and composite:
            # Nothing to cast: decompose as torch's fallthrough would, so the ops
            # inside (einsum's bmm) still meet autocast instead of running excluded.
            return overload._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args, **kwargs)
        with exclude(_EXCLUDE):
            if category is not None:
                args, kwargs = cast_arguments(category, args, kwargs, device_type, dtype, frame)
            return op(*args, **kwargs)

    kernel.__name__ = f"ampkit_autocast_{base}"
    return kernel


# ---------------------------------------------------------------------------
# Python-level functions
# ---------------------------------------------------------------------------
class _PythonOpMode(TorchFunctionMode):
    """Casts the arguments of Python-level torch functions a policy lists."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():
            return _compiled_python_op(func, args, kwargs)
        frame = _state.scopes[-1] if _state.scopes else None
        if len(_state.frames) > 1:
            # scopes for several device types: the innermost one of the device the call
            # computes on (its first tensor's) decides, so a nested scope for another
            # device does not hide this device's rules
            frame = next((_top(t.device.type) for t in _iter_tensors(args, kwargs)), None)
        category = frame.python_ops.get(func) if (frame is not None and frame.enabled) else None
        if category is None:
            return func(*args, **kwargs)
        args, kwargs = cast_arguments(category, tuple(args), kwargs, frame.device_type, frame.dtype, frame)
        if category == "fp32":
            with torch.autocast(frame.device_type, enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _compiled_python_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_PythonOpMode`` while dynamo traces: the same casts, written so dynamo puts
    them in the graph (the decision is a trace-time constant guarded by the key)."""
    decision = _trace_python_op(func, _state.compile_key)
    if decision is None:
        return func(*args, **kwargs)
    category, device_type, dtype = decision
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if category == "promote" and any(t.dtype == torch.float32 and t.device.type == device_type for t in tensors):
        dtype = torch.float32
    elif category == "fp32":
        dtype = torch.float32

    def cast(v: Any) -> Any:
        if (
            isinstance(v, torch.Tensor)
            and v.is_floating_point()
            and v.dtype != torch.float64
            and v.device.type == device_type
        ):
            return v.to(dtype)
        return v

    args = tuple(cast(a) for a in args)
    kwargs = {k: cast(v) for k, v in kwargs.items()}
    if category == "fp32":
        with torch.autocast(device_type, enabled=False):
            return func(*args, **kwargs)
    return func(*args, **kwargs)


def _trace_python_op(func: Any, key: str) -> tuple[str, str, torch.dtype] | None:
    """At trace time: (category, device type, compute dtype) for a Python-level op
    under the innermost enabled scope, or None."""
    frame = _state.scopes[-1] if _state.scopes else None
    if frame is None or not frame.enabled:
        return None
    category = frame.python_ops.get(func)
    return None if category is None else (category, frame.device_type, frame.dtype)


_trace_python_op._dynamo_marked_constant = True  # type: ignore[attr-defined]


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

    def ensure(self) -> None:
        if self._installed:
            return
        with self._lock:
            if self._installed:
                return
            reg = nn.modules.module
            pre, post = self._fns
            if self._ids is None or not hasattr(reg, "_global_forward_hooks_always_called"):
                self._ids = (
                    reg.register_module_forward_pre_hook(pre).id,
                    reg.register_module_forward_hook(post, always_call=True).id,
                )
            else:
                pre_id, post_id = self._ids
                reg._global_forward_pre_hooks[pre_id] = pre
                reg._global_forward_hooks[post_id] = post
                reg._global_forward_hooks_always_called[post_id] = True
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
            reg = nn.modules.module
            pre_id, post_id = self._ids
            reg._global_forward_pre_hooks.pop(pre_id, None)
            reg._global_forward_hooks.pop(post_id, None)
            getattr(reg, "_global_forward_hooks_always_called", {}).pop(post_id, None)
            self._installed = False

    def installed(self) -> bool:
        return self._installed

    def _names_in(self, root: nn.Module) -> dict[int, str]:
        names = self._names.get(root)
        if names is None:
            names = {id(m): _model_name(n) for n, m in _unwrap(root).named_modules(remove_duplicate=False)}
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
        (:func:`_unwrap`)."""
        if root is None:
            root = _state.module_stack[0] if _state.module_stack else module
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
        if not _state.scopes:
            return None
        frame = _state.scopes[-1]
        if not _state.module_stack and not _is_compiled_module(module):
            # (a torch.compile'd module: compiled code keeps no cast cache, and with the
            # cache switch left off dynamo tells this scope from plain torch.autocast)
            _start_cache_epoch(module, frame)
        _state.module_stack.append(module)
        # a torch.compile'd module's own rule is the model's inside it, applied here,
        # eagerly, around the compiled call (compiled code then skips it)
        dtype = self.rule_dtype(module._orig_mod if _is_compiled_module(module) else module, frame)
        if dtype is None:
            return None
        policy = frame.policy
        stack = contextlib.ExitStack()
        if dtype is torch.float32:
            stack.enter_context(_scope(policy, frame.device_type, enabled=False, from_rule=True))
            args = tuple(_map_tensors(a, _to_fp32) for a in args)
        else:
            stack.enter_context(
                autocast(_with_dtype(policy, dtype), frame.device_type, cache_enabled=frame.cache_enabled)
            )
        _state.rule_stack.append((module, stack))
        return args

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            return _compiled_post(module)
        if _state.rule_stack and _state.rule_stack[-1][0] is module:
            _state.rule_stack.pop()[1].close()
        if _state.module_stack and _state.module_stack[-1] is module:
            _state.module_stack.pop()
            if not _state.module_stack:
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
    rule = _trace_rule_enter(module, _state.compile_key)  # the key's value becomes a guard
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
    restore = _trace_rule_exit(module, _state.compile_key)
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
        elif root is module or _hooks.contains(root, module):
            return root
    if len(_COMPILED_ROOTS) > 64:
        del _COMPILED_ROOTS[0]
    _COMPILED_ROOTS.append(weakref.ref(module))
    return module


def _trace_rule_enter(module: nn.Module, key: str) -> tuple[str, torch.dtype] | None:
    frame = _state.scopes[-1] if _state.scopes else None
    if frame is None or frame.policy is None or not frame.policy.module_rules or not frame.rules:
        return None
    stack = _state.module_stack
    if stack and _is_compiled_module(stack[-1]) and stack[-1]._orig_mod is module:
        return None  # the compiled wrapper's hook applied this module's rule eagerly
    root = _compiled_root(module)
    dtype = _hooks.rule_dtype(module, frame, root)
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
    restore = _trace.__dict__.setdefault("restore", {})
    restore[id(module)] = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    return device_type, dtype


def _trace_rule_exit(module: nn.Module, key: str) -> tuple[str, bool, torch.dtype] | None:
    return _trace.__dict__.setdefault("restore", {}).pop(id(module), None)


# dynamo runs these at trace time and puts their results in the graph as constants
# (what ``torch._dynamo.assume_constant_result`` marks; set here without importing dynamo)
_trace_rule_enter._dynamo_marked_constant = True  # type: ignore[attr-defined]
_trace_rule_exit._dynamo_marked_constant = True  # type: ignore[attr-defined]


# path components that wrappers insert: torch.compile, FSDP1, checkpoint_wrapper
_WRAPPER_PARTS = re.compile(r"(?:^|\.)(?:_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)(?=\.|$)")


def _model_name(name: str) -> str:
    """A qualified name without wrapper components (``block._orig_mod.norm`` is
    ``block.norm``; the wrapper and the module it wraps share a name)."""
    return _WRAPPER_PARTS.sub("", name).lstrip(".") if "_" in name else name


def _is_compiled_module(module: nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")


def _unwrap(module: nn.Module) -> nn.Module:
    """The model inside ``nn.DataParallel`` / ``DistributedDataParallel`` /
    ``torch.compile``'s module, however deep: name rules are written against it."""
    while True:
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            module = module.module
        elif _is_compiled_module(module):
            module = module._orig_mod
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


_hooks = _ModuleHooks()


def _clear_caches() -> None:
    torch.clear_autocast_cache()
    for frame in _state.scopes:
        frame.cache.clear()


# Engine state: the one global optimizer step hook that drops the cast cache.
_step_hook_installed = False
_step_hook_lock = threading.Lock()


def _install_step_hook() -> None:
    """Cached casts go stale when an optimizer updates weights in place: drop them.
    Installed once per process; a step in a thread with no scope costs one check."""
    global _step_hook_installed
    if _step_hook_installed:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if _state.scopes:
            _clear_caches()

    with _step_hook_lock:
        if not _step_hook_installed:
            register_optimizer_step_post_hook(after_step)
            _step_hook_installed = True


# ---------------------------------------------------------------------------
# The scope
# ---------------------------------------------------------------------------
# Engine state: the fp16-on-CPU warning is given once per process.
_warned_fp16_cpu = False


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
            policy = Policy(dtype=check_compute_dtype(dtype) if dtype else default_dtype(self.device_type))
        elif dtype is not None:
            policy = policy.override(dtype=check_compute_dtype(dtype))
        self.policy = policy
        self.enabled = bool(enabled)
        self.cache_enabled = bool(cache_enabled)
        # The engine's own switches (see _scope): every op through ampkit's kernels; an
        # fp32 module rule (casting off, the policy's module rules still on).
        self._intercept_all = False
        self._from_rule = False
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
        if not _kernel_frames_skipped:
            _skip_kernel_frames()
        resolved = _resolve(self.policy, self.device_type, self._intercept_all) if self.enabled else None
        frame = self._make_frame(resolved)
        if resolved is not None:
            _registry.ensure(self.device_type, resolved.intercepted)
        _hooks.ensure()
        _install_step_hook()
        # casts are cached only inside module calls (one outermost call at a time): a
        # scope that starts outside one leaves torch's autocast cache off until it does
        cache = self.cache_enabled and bool(_state.module_stack)
        native = _native_enter(self.device_type, self.enabled, self.policy.dtype, cache)
        frame.key = _compile_key_of(_state.compile_key, frame)
        _state.frames.setdefault(self.device_type, []).append(frame)
        _state.scopes.append(frame)
        _state.compile_key = frame.key
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


def _scope(
    policy: Policy | None,
    device_type: str,
    *,
    enabled: bool = True,
    cache_enabled: bool = True,
    from_rule: bool = False,
    intercept_all: bool = False,
) -> autocast:
    """An :class:`autocast` with the engine's own switches, which are no part of the
    public signature: ``from_rule`` (the disabled scope of an fp32 module rule: module
    rules stay on inside it) and ``intercept_all`` (every op of the policy's lists runs
    through ampkit's kernels, even where torch's own would do: for tests of the kernels)."""
    scope = autocast(policy, device_type, enabled=enabled, cache_enabled=cache_enabled)
    scope._from_rule = from_rule
    scope._intercept_all = intercept_all
    return scope


# A scope entered or left inside a function torch.compile traces runs eagerly, at a
# graph break (dynamo resumes tracing under the new state; its guards see it): the
# engine's bookkeeping is no graph material. ``_disable_dynamo`` imports dynamo lazily.
_enter_outside_dynamo = torch._compile._disable_dynamo(autocast._enter)
_exit_outside_dynamo = torch._compile._disable_dynamo(autocast._exit)


def _last_scope_closed() -> None:
    """No ampkit scope is open in this thread: module calls still on the stack (a scope
    closed inside a forward) are no longer tracked, and with no other thread the global
    hooks go (every module call is back on torch's fast path)."""
    if _state.module_stack:
        _end_cache_epoch(_state.module_stack[0])
        _state.module_stack.clear()
    if threading.active_count() == 1:
        _hooks.remove()


# Engine state: guard keys of torch.compile, the same for equal policies (a cache).
_COMPILE_KEYS: dict[tuple[Any, ...], str] = {}
_POLICY_KEYS: dict[int, tuple[weakref.ref, tuple[Any, ...]]] = {}


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
        with _step_hook_lock:
            key = _COMPILE_KEYS.setdefault(value, f"ampkit-{len(_COMPILE_KEYS) + 1}")
    return key


def _native_enter(device_type: str, enabled: bool, dtype: torch.dtype, cache_enabled: bool) -> Any:
    """Enter native autocast as ``torch.autocast.__enter__`` does; returns what
    :func:`_native_exit` needs. On CPU the thread-local switches are set directly (a
    ``torch.autocast`` object costs more to build than the rest of a scope); when a
    torch function mode is active (``torch.export`` records autocast through one) or on
    other devices (torch checks the device can autocast, and warns), a real
    ``torch.autocast`` is entered."""
    if device_type != "cpu" or torch._C._is_torch_function_mode_enabled():
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
                _scope(policy, device_type, enabled=enabled, cache_enabled=cache_enabled, from_rule=not enabled and rules)
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
def init(
    dtype: torch.dtype | None = None,
    device_type: str | None = None,
    *,
    policy: Policy | None = None,
    cache_enabled: bool = True,
    **policy_fields: Any,
) -> Policy:
    """Turn op-level casting on for this thread until :func:`ampkit.reset`.

    Equivalent to entering ``ampkit.autocast(policy, device_type)`` and never leaving.

    Args:
        dtype: compute dtype; default bf16 on CPU, fp16 on CUDA.
        device_type: ``"cpu"`` or ``"cuda"``; default ``"cuda"`` if available else ``"cpu"``.
        policy: a base policy (default: the device's defaults).
        cache_enabled: as in :class:`autocast`.
        **policy_fields: :class:`Policy` fields (``lower_ops``, ``fp32_ops``,
            ``promote_ops``, ``conditional_fp32_ops``, ``module_rules``) applied on top.

    Returns the policy in force. Calling ``init`` again in the thread replaces the
    previous one. Per thread, like ``torch.autocast``: see :func:`ampkit.reset` for
    what is per thread and what per process.
    """
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
    _state.global_scope = scope
    logger.info("ampkit: casting on for %s in %s", device, base.dtype)
    return base


def _stop_global() -> None:
    scope, _state.global_scope = _state.global_scope, None
    if scope is not None and scope._stacks:
        scope.__exit__(None, None, None)


@_reset.on_reset
def _reset_engine() -> None:
    global _warned_fp16_cpu
    _warned_fp16_cpu = False  # warn once per ampkit session (reset starts a new one)
    _stop_global()
    for stack in reversed(_state.rule_stack):
        stack[1].close()
    _state.rule_stack.clear()
    if _state.module_stack:
        _end_cache_epoch(_state.module_stack[0])
    _state.module_stack.clear()
    # Kernels and hooks are kept while anything could be running through them: only
    # the process's one thread, with no scope of its own open, may take them down.
    if threading.active_count() == 1 and not _state.scopes:
        _registry.clear()
        _hooks.remove()
