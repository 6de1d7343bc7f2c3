"""Per-thread scope state (:class:`_State`) and the records other threads may read of
it (:class:`_ThreadRecord`): how a replica thread of ``nn.DataParallel`` finds its
caller and enters the caller's scopes. The one instance of :class:`_State` is
``ampkit.casting._kernels._state``. See docs/concepts/casting.md."""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from torch import nn

from ampkit._internal import torch_compat

from . import _scope_api
from ._resolve import _Frame

if TYPE_CHECKING:
    from ._scopes import autocast


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
        with _THREADS_LOCK:
            _THREADS[threading.get_ident()] = self.record
        self.inherited: AbstractContextManager[Any] | None = None
        caller = replica_caller() if replica else None
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
    the threads that own them and can crash the interpreter): the thread whose current
    module call holds the replica (``nn.DataParallel``: a replica of its ``module``;
    ``parallel_apply`` in a module's ``forward``: a child), else, for a call outside any
    module, the one thread with open scopes. When that leaves several candidates, the
    replica inherits nothing and a warning says so."""
    replica = torch_compat.parallel_apply_worker_module()
    me = threading.get_ident()
    others = [rec for ident, rec in thread_records() if ident != me and not rec.replica]
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
