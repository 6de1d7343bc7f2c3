"""The core of the casting engine: the per-thread scope state (``_state``) and the
kernels ampkit puts on the ``Autocast*`` dispatch keys, with the guard they add to code
torch.compile traces. These three stay together (dynamo's guard names this module's
``_state``, and its skip finds the kernels through ``_make_kernel``). The scopes, module
rules and Python-op mode beside it build on this module; :mod:`.engine` is the public
face of them all. How it works: docs/concepts/casting.md.
"""

from __future__ import annotations

import logging
import threading
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ampkit._internal import torch_compat

from ._cast import cast_arguments
from ._resolve import _NATIVE, _Frame
from ._resolve import probe_rnn as probe_rnn
from ._threads import _State
from ._threads import replica_caller as replica_caller
from .lists import AUTOCAST_KEYS
from .policy import Policy

__all__ = ["is_active", "current_policy", "active_scopes"]

logger = logging.getLogger("ampkit")

# The one per-thread scope state every part of the engine reads (imported from here).
_state = _State()


def top_frame(device_type: str) -> _Frame | None:
    frames = _state.frames.get(device_type)
    return frames[-1] if frames else None


def is_active(device_type: str | None = None) -> bool:
    """Whether an enabled ampkit scope (or ``ampkit.init``) is active in this thread
    (for ``device_type`` when given, else the innermost scope of any device type)."""
    if device_type is not None:
        top = top_frame(device_type)
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
# Kernels on the Autocast dispatch keys
# ---------------------------------------------------------------------------
_EXCLUDE = torch_compat.autocast_keyset()


def _overloads(base: str) -> list[Any]:
    packet = getattr(torch.ops.aten, base)
    out = []
    for name in packet.overloads():
        overload = getattr(packet, name)
        schema = torch_compat.overload_schema(overload)
        if name.endswith("out") or any(a.is_out for a in schema.arguments):
            continue
        if not any("Tensor" in str(a.type) for a in schema.arguments):
            continue
        out.append(overload)
    return out


# Engine state: the warning that the policy guard could not be added is given once; the
# code compiled without it, with the compile key it was traced under (dropped as soon as
# a scope changes the key: see drop_code_of_other_keys).
_guard_failed = False
_UNGUARDED: dict[Any, str] = {}


def _guard_compiled_code() -> None:
    """A kernel of ours runs while torch.compile traces (dynamo's fake run of an op, or
    AOTAutograd's): the graph's dtypes then depend on this thread's scopes, so make
    dynamo guard the code being compiled on ``_state.compile_key``. Module calls get
    this guard from the hooks; a compiled function calling no module gets it here.
    Uses dynamo's guard API (internal; checked by tests/unit/casting/test_compile.py)."""
    _skip_kernel_frames()
    tx = torch_compat.current_trace_tx()
    if tx is None:
        return
    try:
        # the guard's source is this module's ``_state`` (tx.import_source(__name__))
        torch_compat.guard_attr_equals(tx, __name__, "_state", "compile_key")
    except Exception:  # noqa: BLE001 - another torch's internals: compile without the guard
        global _guard_failed
        code = torch_compat.traced_frame_code()
        if code is not None:
            _UNGUARDED[code] = _state.compile_key
        if not _guard_failed:
            _guard_failed = True
            logger.warning(
                "ampkit: could not make torch.compile guard compiled code on the casting policy "
                "(torch %s); such code is now compiled again whenever a scope changes the policy "
                "(slower, never in another policy's dtypes). Enter one policy per compiled "
                "function to avoid the recompiles.",
                torch.__version__, exc_info=True,
            )
    _mark_graph(tx.output)


def drop_code_of_other_keys(key: str) -> None:
    """A scope was entered or left and this thread's compile key is now ``key``: code
    compiled without the policy guard (:func:`_guard_compiled_code` could not add it) under
    another key is dropped, so its next call compiles under the policy in force instead
    of running in the dtypes of the one it was traced under. Nothing to do (one dict
    lookup) wherever the guard was added."""
    if not _UNGUARDED or torch.compiler.is_compiling():
        return
    stale = [code for code, traced in _UNGUARDED.items() if traced != key]
    if not stale:
        return
    with torch_compat.dynamo_compile_lock():
        for code in stale:
            torch_compat.reset_compiled_code(code)
            del _UNGUARDED[code]


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
GRAPH_MARKER = torch.ops.ampkit.casting_decisions.default

# Engine state: compile key -> its kernel decisions (a cache: the key names the scopes by
# value), and the predicates of conditional rules by serial number (held, so the number is
# never another object's; ``_PROCESS`` keeps two processes' numbers apart).
_DECISIONS: dict[str, str] = {}
_PREDICATES: dict[Callable[..., bool], int] = {}
_PROCESS = uuid.uuid4().hex[:12]  # os.urandom: no generator a user can observe
_PREDICATES_LOCK = threading.Lock()


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
        with _PREDICATES_LOCK:
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
        torch_compat.add_graph_marker(output, GRAPH_MARKER, decisions)
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
    if _kernel_frames_skipped or not torch_compat.dynamo_loaded():
        return
    _kernel_frames_skipped = True
    try:
        code = _make_kernel.__code__.co_consts
        for c in code:
            if getattr(c, "co_name", None) == "kernel":
                torch_compat.skip_code_in_dynamo(c)
    except Exception:  # noqa: BLE001 - another torch's internals: dynamo may compile them
        logger.debug("ampkit: could not mark kernel frames as skipped for dynamo", exc_info=True)


def _drop_compiled_code(device_type: str) -> None:
    """A policy overrides an op on ``device_type`` for the first time in this process:
    code torch.compile traced before under autocast on that device, with no guard on
    ampkit's scopes (nothing of ampkit ran while it was traced), holds the op as torch's
    own kernel cast it, and would run so under the policy. Only that code is dropped
    (compiled anew on its next call); code traced without autocast (an optimizer step,
    a model compiled outside any scope) or guarded on the scopes stays as it is."""
    if not torch_compat.compiled_frames_ok() or torch.compiler.is_compiling():
        return
    try:
        with torch_compat.dynamo_compile_lock():
            stale = _unguarded_autocast_code(device_type)
            for code in stale:
                torch_compat.reset_compiled_code(code)
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
    checked by tests/unit/casting/test_compile.py and tests/unit/_internal/test_torch_compat.py)."""
    stale = []
    for code, entries in torch_compat.compiled_code_entries():
        for parts in entries:
            if torch_compat.guards_name(parts, "_state.compile_key"):
                continue
            if torch_compat.global_autocast_enabled_in_guard(parts, device_type) is not False:
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
                torch_compat.destroy_library(lib)

    def registered(self, device_type: str) -> frozenset[str]:
        return self._done.get(device_type, frozenset())

    def verify(self) -> list[str]:
        """Register again every ampkit kernel that no longer runs: a later registration on
        the same op and key (another library's kernel, a C++ extension imported after
        ampkit) replaces ampkit's, and removing that one leaves torch's, not ampkit's --
        either way ampkit's policy would silently stop applying to the op. Warns once
        per op naming what took its place; returns the ``"aten::op"`` names fixed.
        Called where a session starts (:func:`ampkit.init`) and by
        :func:`ampkit.explain`; it reads the dispatcher's table (~0.1 ms per op)."""
        lost: list[tuple[str, str, str | None]] = []
        for device_type, names in list(self._done.items()):
            key = AUTOCAST_KEYS[device_type]
            for base in names:
                overloads = _overloads(base)
                if not overloads:
                    continue
                site = torch_compat.kernel_site(f"aten::{base}", key) if _has_default(overloads) else _first_site(base, overloads, key)
                if site is None or _ENGINE_FILE not in site:
                    lost.append((device_type, base, site))
        if not lost:
            return []
        with self._lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for device_type, base, _ in lost:
                self._libs[(device_type, base)] = _register(device_type, base)
        fixed = []
        for device_type, base, site in lost:
            fixed.append(f"aten::{base}")
            if (device_type, base) not in _WARNED_LOST:
                _WARNED_LOST.add((device_type, base))
                warnings.warn(
                    f"ampkit: its kernel for aten::{base} on {AUTOCAST_KEYS[device_type]} had been "
                    f"{'removed' if site is None else 'replaced by one ' + site}; ampkit registered "
                    "it again so its policy applies to the op. If another library needs its own "
                    "kernel there, the two cannot both be active.",
                    RuntimeWarning, stacklevel=2,
                )
        for device_type in {d for d, _, _ in lost}:
            _drop_compiled_code(device_type)
        return fixed


_ENGINE_FILE = __file__
_WARNED_LOST: set[tuple[str, str]] = set()


def _has_default(overloads: list[Any]) -> bool:
    return any(torch_compat.overload_name(o) == "default" for o in overloads)


def _first_site(base: str, overloads: list[Any], key: str) -> str | None:
    return torch_compat.kernel_site(f"aten::{base}.{torch_compat.overload_name(overloads[0])}", key)


def _register(device_type: str, base: str) -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    for overload in _overloads(base):
        overload_name = torch_compat.overload_name(overload)
        name = base if overload_name == "default" else f"{base}.{overload_name}"
        lib.impl(name, _make_kernel(device_type, base, overload), AUTOCAST_KEYS[device_type])
    return lib


kernel_registry = _KernelRegistry()


def _make_kernel(device_type: str, base: str, overload: Any) -> Callable[..., Any]:
    native = _NATIVE[device_type].get(base)
    decompose = torch_compat.composite_implicit_call(overload)
    composite = torch_compat.has_composite_implicit_kernel(overload)
    op = torch_compat.raw_op(overload)  # the C++ callable: skips OpOverload.__call__'s Python layer
    get_dtype = torch.get_autocast_dtype
    exclude = torch_compat.exclude_dispatch_keys

    tracing = torch_compat.tracing_for_compile

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if tracing():
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
            return decompose(*args, **kwargs)
        with exclude(_EXCLUDE):
            if category is not None:
                args, kwargs = cast_arguments(category, args, kwargs, device_type, dtype, frame)
            return op(*args, **kwargs)

    kernel.__name__ = f"ampkit_autocast_{base}"
    return kernel
