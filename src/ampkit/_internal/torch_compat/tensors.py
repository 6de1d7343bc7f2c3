"""A tensor's private state (version counter, view, fake and sparse tensors, its grad
hooks) and the autograd engine running a backward pass."""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch


def tensor_version(t: torch.Tensor) -> int:
    """``t._version``: the counter torch bumps on every in-place change of ``t``'s data.
    The cast cache and the master-weight/grad bookkeeping compare it; if it stopped
    counting, stale casts or grads would be reused. A function (dynamo traces it)."""
    return t._version


_VERSION = operator.attrgetter("_version")


def tensor_versions(ts: Sequence[torch.Tensor]) -> list[int]:
    """:func:`tensor_version` of each of ``ts``, in one pass with no Python call per tensor."""
    return list(map(_VERSION, ts))


def is_fake_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch._subclasses.fake_tensor.FakeTensor``: the shape-only
    tensors torch.compile traces with, which a compiled function's caches keep alive
    after the compile. Their storage holds no data: reading its pointer answers 0 and
    warns ("Accessing the data pointer of FakeTensor is deprecated", once per process),
    so the bench's walk over every live tensor skips them first. By type (``issubclass``,
    not ``isinstance``: nothing of the tensor is read). No FakeTensor exists before that
    module is imported, so it is not imported here. If the class moved, fake tensors
    would be read again and the warning would come back (the test says so)."""
    module = sys.modules.get("torch._subclasses.fake_tensor")
    cls = getattr(module, "FakeTensor", None)
    return cls is not None and issubclass(type(t), cls)


def tensor_is_view(t: torch.Tensor) -> bool:
    """``t._is_view()``: whether ``t`` shares another tensor's storage as a view. The
    cast cache never caches views (their base may change them); if gone, the cache
    cannot tell."""
    return t._is_view()


def autograd_engine() -> Any:
    """``torch.autograd.Variable._execution_engine``: the engine whose
    ``queue_callback`` runs a function when the current backward pass ends."""
    return torch.autograd.Variable._execution_engine


current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""``current_graph_task_id()``: the id of the backward pass running in this thread, -1
outside one (a forward run inside backward is a recomputation); torch's own function."""


def current_autograd_node() -> Any:
    """``torch._C._current_autograd_node()``: the autograd node being executed in this
    thread's backward, None outside one."""
    return torch._C._current_autograd_node()


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """``t._values()``: the stored values of a sparse COO tensor (no copy; coalesce
    first for unique indices)."""
    return t._values()


def tensor_hooks_of(t: torch.Tensor) -> dict[int, Any]:
    """``t._backward_hooks``: the hooks ``Tensor.register_hook`` added (empty if none)."""
    return getattr(t, "_backward_hooks", None) or {}


def post_accumulate_hooks_first(t: torch.Tensor, hook_id: int) -> dict[int, Any]:
    """Put ``t``'s post-accumulate-grad hook ``hook_id`` before its others (kept in order)
    and return ``t._post_accumulate_grad_hooks``, which torch runs in storage order
    (``PyDict_Next``; ``move_to_end`` would not do): the others are popped and put back
    (their handles delete by id). If it changes, user hooks may run before ampkit's."""
    hooks = t._post_accumulate_grad_hooks
    for key in [k for k in hooks if k != hook_id]:
        hooks[key] = hooks.pop(key)
    return hooks
