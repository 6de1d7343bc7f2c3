"""Per-thread scope state (:class:`_State`) and the records other threads may read of
it (:class:`_ThreadRecord`): how a replica thread of ``nn.DataParallel`` finds its
caller and enters the caller's scopes, or refuses to run when it cannot tell which
caller's they are (:func:`replica_caller`). The one instance of :class:`_State` is
``ampkit.casting._kernels._state``. See docs/concepts/casting.md."""

from __future__ import annotations

import contextlib
import threading
import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from torch import nn

from ampkit._internal import torch_compat
from ampkit.errors import StateError

from . import _scope_api
from ._resolve import _Frame

if TYPE_CHECKING:
    from ._scopes import autocast


class _State(threading.local):
    """Per-thread scope state, set up on a thread's first use of the engine. A thread
    that exits takes its state, and any scope it left open (``init`` in a worker
    thread), with it. A replica thread of ``torch.nn.parallel.parallel_apply``
    (``nn.DataParallel``) starts with its caller's scopes (:func:`_inherit_caller`); where
    its caller cannot be told, setting the state up raises (:func:`replica_caller`), so
    the replica's first module call or op fails and nothing runs under the wrong policy."""

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
        with _THREADS_LOCK:
            _THREADS[threading.get_ident()] = self.record
        self.inherited: AbstractContextManager[Any] | None = None
        caller = _replica_caller_once() if replica else None
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
# Held to add a record and to list them: DataParallel's replicas register and look for
# their caller at the same time. The listing goes through the dictionary's own items()
# (not its .data), which defers the removals of records whose thread is gone while it
# iterates: a garbage collection in the middle of the listing would otherwise change
# the dictionary's size under it ("dictionary changed size during iteration").
_THREADS_LOCK = threading.Lock()


# Replica threads that refused to run (their caller could not be told). The refusal is
# raised once, at the thread's first use of the engine (its module call's pre-hook);
# the next use -- that call's always-called post-hook, as torch unwinds it -- sets up a
# state with no scopes, so the hook does not raise the same error again (which torch
# would turn into a warning). Nothing else runs in the thread: parallel_apply's worker
# returns with the error. An entry goes with its thread.
_REFUSED: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def thread_records() -> list[tuple[int, _ThreadRecord]]:
    """``(thread id, record)`` of every thread with engine state, listed under the lock
    (safe while other threads register and finished threads' records go)."""
    with _THREADS_LOCK:
        return list(_THREADS.items())


def replica_caller() -> _ThreadRecord | None:
    """The record of the thread that started this one, if this is a replica thread of
    ``torch.nn.parallel.parallel_apply`` (``nn.DataParallel``, or any direct use).

    torch re-enters only its own autocast state in those threads. The caller is blocked
    in ``parallel_apply`` (joining the replicas) until they finish. It is found through
    ampkit's own records, never through other threads' frames (reading those races with
    the threads that own them and can crash the interpreter), nor by patching torch's
    threads: the thread whose current module call holds the replica (``nn.DataParallel``:
    a replica of its ``module``; ``parallel_apply`` in a module's ``forward``: a child),
    else, for a call outside any module, the one thread with open scopes.

    Several threads qualify when they run the same model (or ``parallel_apply`` outside
    any module) at once; the records cannot tell which of them started this thread. If
    their open scopes are the same (same policies, devices, switches), it does not
    matter: the replica takes those scopes. If they differ, the replica would run under
    another thread's policy: :class:`~ampkit.StateError` is raised instead (in the
    replica; ``parallel_apply`` raises it again in the caller). Threads with no ampkit
    scope open are not tracked, so one that runs the model beside a thread with scopes
    cannot be seen: run such calls one at a time too."""
    replica = torch_compat.parallel_apply_worker_module()
    me = threading.get_ident()
    others = [rec for ident, rec in thread_records() if ident != me and not rec.replica]
    holders = [rec for rec in others if replica is not None and _holds(rec.module_stack[-1:], replica)]
    candidates = holders or [rec for rec in others if rec.scopes]
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    # each list read once: a candidate that is not the caller may be changing its scopes
    scopes = [list(rec.scopes) for rec in candidates]
    if all(_same_scopes(scopes[0], other) for other in scopes[1:]):
        return _ThreadRecord(scopes[0], [])
    raise StateError(
        f"ampkit: {len(candidates)} threads are running the same model through "
        "torch.nn.parallel.parallel_apply (nn.DataParallel) at once under different ampkit "
        "casting scopes, and this replica thread cannot tell which of them started it, so "
        "it cannot run under its caller's policy; it refused to run. Run that model's "
        "DataParallel forwards one at a time (a lock around the call), open the same scope "
        "(policy, device, dtype) in every thread that calls it, or use "
        "DistributedDataParallel (one process per device)."
    )


def _replica_caller_once() -> _ThreadRecord | None:
    """:func:`replica_caller`, raising its refusal only the first time in this thread."""
    thread = threading.current_thread()
    with _THREADS_LOCK:
        if thread in _REFUSED:
            return None
    try:
        return replica_caller()
    except StateError:
        with _THREADS_LOCK:
            _REFUSED.add(thread)
        raise


def _same_scopes(a: list[_Frame], b: list[_Frame]) -> bool:
    """Whether replaying scope stack ``a`` casts as replaying ``b`` would: frame by frame
    the same compile key (the scopes below, the policy's decisions, the device, the
    switches) and cast-cache switch."""
    return len(a) == len(b) and all(
        (x.key, x.cache_enabled) == (y.key, y.cache_enabled) for x, y in zip(a, b)
    )


def _is_replica_thread() -> bool:
    """Whether this thread runs ``torch.nn.parallel.parallel_apply``'s worker."""
    return torch_compat.is_parallel_apply_worker()


def _holds(top: list[nn.Module], replica: nn.Module) -> bool:
    """Whether the module call ``top`` (another thread's innermost, or none) runs
    ``replica``: it is that module or a child of it, or a ``DataParallel`` replica of a
    child (``replicate`` copies a module's ``__dict__``, hook dicts included)."""
    if not top:
        return False
    hooks = torch_compat.forward_pre_hooks_of(replica)
    for module in [top[0], *torch_compat.submodules_of(top[0])]:
        if module is replica or (
            torch_compat.is_dataparallel_replica(replica)
            and module is not None
            and torch_compat.forward_pre_hooks_of(module) is hooks
        ):
            return True
    return False


def _inherit_caller(state: _State, caller: _ThreadRecord) -> None:
    """Enter the caller's scopes in this (replica) thread, for the thread's lifetime."""
    if not caller.scopes:
        return
    # names: a replica is a copy of ``dp.module``, which name rules see through ``dp``
    # to in the caller too (:func:`unwrap_module`), so the replica is its own root here
    replay = _scope_api.replay(caller.scopes)
    replay.__enter__()
    state.inherited = replay
