"""``nn.DataParallel``'s replica threads and the running ``DistributedDataParallel``."""

from __future__ import annotations

import sys
import threading

from torch import nn


def is_parallel_apply_worker(thread: threading.Thread | None = None) -> bool:
    """Whether ``thread`` (default: this one) runs ``torch.nn.parallel.parallel_apply``'s
    worker: its target is the nested ``_worker`` function, found among
    ``parallel_apply``'s code constants."""
    thread = thread or threading.current_thread()
    apply_module = sys.modules.get("torch.nn.parallel.parallel_apply")
    worker_code = getattr(getattr(thread, "_target", None), "__code__", None)
    apply_code = getattr(getattr(apply_module, "parallel_apply", None), "__code__", None)
    return worker_code is not None and apply_code is not None and any(c is worker_code for c in apply_code.co_consts)


def parallel_apply_worker_module(thread: threading.Thread | None = None) -> nn.Module | None:
    """The module a ``parallel_apply`` worker thread runs: its ``_worker(i, module,
    input, ...)`` arguments are the thread's ``_args``."""
    args = getattr(thread or threading.current_thread(), "_args", ())
    return args[1] if len(args) > 1 and isinstance(args[1], nn.Module) else None


def is_dataparallel_replica(module: nn.Module) -> bool:
    """``module._is_replica``: set on the copies ``torch.nn.parallel.replicate`` makes
    (which share the original's hook dicts: ``replicate`` copies ``__dict__``)."""
    return bool(getattr(module, "_is_replica", False))


def active_ddp_module() -> nn.Module | None:
    """The DistributedDataParallel whose forward is running in this thread
    (``DistributedDataParallel._get_active_ddp_module()``), or None."""
    return nn.parallel.DistributedDataParallel._get_active_ddp_module()
