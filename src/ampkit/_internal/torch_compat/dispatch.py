"""Tensors' C base, ops and the dispatcher: the overloads, kernels and dispatch keys
ampkit's casting kernels are registered on and read from, and the pytree walkers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

TENSOR_BASE: type = torch._C.TensorBase
"""The C base class of ``torch.Tensor``: methods defined in C (``Tensor.add``) have it as
their ``__objclass__``. If renamed, op names given as tensor methods stop resolving
(:func:`ampkit.canonical_op` of ``torch.Tensor.add``)."""

TorchDispatchMode = TorchDispatchMode
"""``torch.utils._python_dispatch.TorchDispatchMode``: ``ampkit.explain`` and the diagnosis
checker record aten ops below autograd and autocast with it (if it moves, they cannot import)."""

tree_flatten = tree_flatten
"""``torch.utils._pytree.tree_flatten``: the leaves of nested lists, tuples and dicts (as
torch flattens op arguments); used to find the tensors of a dispatched op."""

tree_map = tree_map
"""``torch.utils._pytree.tree_map``: ``fn`` applied to every leaf of a nested structure."""


def autocast_keyset() -> Any:
    """The dispatch key set of the CPU and CUDA ``Autocast*`` keys
    (``torch._C.DispatchKeySet``). ampkit's kernels run the op with these keys excluded,
    as torch's own autocast kernels do; if the keys are renamed the kernels would recurse
    into themselves."""
    keys = torch._C.DispatchKey
    return torch._C.DispatchKeySet(keys.AutocastCPU).add(keys.AutocastCUDA)


exclude_dispatch_keys: Callable[[Any], Any] = torch._C._ExcludeDispatchKeyGuard
"""``torch._C._ExcludeDispatchKeyGuard(keyset)``: a context manager under which the
dispatcher skips ``keyset`` for this thread. Used by every ampkit kernel around the
op it forwards to (see :func:`autocast_keyset`)."""


def overload_schema(overload: Any) -> Any:
    """``OpOverload._schema``: the op's ``torch._C.FunctionSchema`` (arguments with
    ``.type`` and ``.is_out``, ``.is_mutable``). ampkit picks the overloads to put kernels
    on, and the checker tells in-place ops, from it."""
    return overload._schema


def overload_name(overload: Any) -> str:
    """``OpOverload._overloadname``: ``"default"``, ``"Tensor"``, ``"Scalar"``, ... (the
    part after the dot of ``aten::pow.Tensor``). ``torch.library.Library.impl`` is given
    ``base.name`` with it; if renamed, kernels cannot be registered per overload."""
    return overload._overloadname


def kernel_site(qualified_name: str, dispatch_key: str) -> str | None:
    """Where the kernel that ``dispatch_key`` runs for ``qualified_name`` (``"aten::mm"``,
    ``"aten::pow.Tensor"``) was registered, as ``torch._C._dispatch_dump_table`` prints
    it (``"registered at <file>:<line> [kernel]"``; a Python registration names the
    Python file); None if that key has no kernel of the op's own (a fallthrough or the
    key's backend fallback). About 0.1 ms: for checks, not for every dispatch."""
    prefix = f"{dispatch_key}: "
    for line in torch._C._dispatch_dump_table(qualified_name).splitlines():
        if line.startswith(prefix):
            rest = line[len(prefix):]
            if "fallthrough" in rest or "[backend fallback]" in rest:
                return None
            return rest
    return None


def raw_op(overload: Any) -> Callable[..., Any]:
    """``OpOverload._op``: the C++ callable behind ``OpOverload.__call__``, skipping its
    Python layer (a kernel runs on every call of its op). If gone, kernels would call
    the overload itself, slower but the same."""
    return overload._op


def composite_implicit_call(overload: Any) -> Callable[..., Any]:
    """A callable running ``overload``'s ``CompositeImplicitAutograd`` kernel
    (``OpOverload._op_dk(DispatchKey.CompositeImplicitAutograd, ...)``): a kernel with
    nothing to cast decomposes the op as torch's autocast fallthrough would, so the ops
    inside (einsum's bmm) still meet autocast."""
    return functools.partial(overload._op_dk, torch._C.DispatchKey.CompositeImplicitAutograd)


def has_composite_implicit_kernel(overload: Any) -> bool:
    """Whether ``overload`` has a ``CompositeImplicitAutograd`` kernel
    (``torch._C._dispatch_has_kernel_for_dispatch_key``); False for an overload the
    dispatcher does not know by name (``einsum.sublist``)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), "CompositeImplicitAutograd")
    except RuntimeError:
        return False


def destroy_library(lib: torch.library.Library) -> None:
    """``Library._destroy()``: removes the kernels ``lib`` registered, so torch's own
    are back (``ampkit.reset``). If gone, kernels stay until the process ends (they
    then do what torch's own do outside an ampkit scope)."""
    lib._destroy()


def torch_function_mode_active() -> bool:
    """``torch._C._is_torch_function_mode_enabled()``: whether a ``TorchFunctionMode``
    is on this thread's stack (``torch.export`` records autocast through one). A scope
    then enters a real ``torch.autocast`` so the mode sees it."""
    return torch._C._is_torch_function_mode_enabled()


def dispatch_key_registrations(dispatch_key: str) -> set[str]:
    """aten base names with a kernel on ``dispatch_key`` (``"AutocastCPU"``) in the
    running torch (``torch._C._dispatch_get_registrations_for_dispatch_key``)."""
    return {base for base, _ in dispatch_key_overloads(dispatch_key)}


def dispatch_key_overloads(dispatch_key: str) -> list[tuple[str, str]]:
    """``(base name, overload name)`` of each aten op overload with a kernel on
    ``dispatch_key`` (``"AutocastCUDA"``), sorted; the overload name is ``"default"``
    for an op registered without one
    (``torch._C._dispatch_get_registrations_for_dispatch_key``)."""
    out = set()
    for r in torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key):
        if r.startswith("aten::"):
            base, _, overload = r.split("::", 1)[1].partition(".")
            out.add((base, overload or "default"))
    return sorted(out)


def wrapper_tensor(cls: type, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Any:
    """A ``cls`` (a ``torch.Tensor`` subclass with ``__torch_dispatch__``) of ``shape``,
    ``dtype`` and ``device`` that owns no memory (``torch.Tensor._make_wrapper_subclass``):
    every op on it goes to ``cls.__torch_dispatch__``. Its device may be one this machine
    lacks (``"cuda"`` without a GPU), which is how the op-table generator sees the CUDA
    autocast kernels. If renamed, the tables can be neither generated nor derived."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)


def is_optional_type(schema_type: Any) -> bool:
    """Whether a schema argument's ``.type`` is ``Optional[...]`` (``torch._C.OptionalType``)."""
    return isinstance(schema_type, torch._C.OptionalType)


#: ``aten::_to_copy.default``: the op a dtype cast (``Tensor.to(dtype)``) dispatches as;
#: an autocast kernel's input casts reach ``__torch_dispatch__`` as this op.
aten_to_copy: Any = torch.ops.aten._to_copy.default
