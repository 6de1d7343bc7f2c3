"""Every place ampkit relies on torch internals, behind one small name each.

Each function or constant here states what ampkit assumes of torch and what breaks if a
torch release changes it; ``tests/unit/_internal/test_torch_compat.py`` checks each
assumption against the installed torch, so a release that breaks one fails a test named
for it. Code elsewhere reaches torch's private modules, attributes and ops only through
this module (``ampkit run``'s process-wide patches stay with the launcher). Functions
that touch dynamo's internals import them lazily, only when dynamo is loaded already.
"""

from __future__ import annotations

import _ctypes
import contextlib
import functools
import json
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "TENSOR_BASE",
    "TorchDispatchMode",
    "add_graph_marker",
    "amp_unscale_and_check_",
    "FUSED_CHECK_DTYPES",
    "unscale_and_check_composite_",
    "autocast_device_index",
    "autograd_engine",
    "can_reinstall_global_forward_hooks",
    "compiled_code_entries",
    "compiled_frames_ok",
    "compiled_function_inner",
    "compiled_module_inner",
    "current_autograd_node",
    "current_graph_task_id",
    "current_trace_tx",
    "destroy_library",
    "dynamo_compile_lock",
    "dynamo_loaded",
    "exclude_dispatch_keys",
    "autocast_keyset",
    "forward_hook_dicts",
    "forward_pre_hooks_of",
    "forward_pre_hooks_with_kwargs",
    "flatten_dense", "unflatten_dense", "foreach_copy_", "foreach_mul_", "foreach_add_", "foreach_sub_",
    "global_autocast_enabled_in_guard",
    "guard_attr_equals",
    "guards_name",
    "has_composite_implicit_kernel",
    "is_dataparallel_replica",
    "is_fake_tensor",
    "is_parallel_apply_worker",
    "ModuleHookDicts",
    "mark_trace_constant",
    "module_hook_dicts",
    "overload_name",
    "overload_schema",
    "parallel_apply_worker_module",
    "raw_op",
    "composite_implicit_call",
    "reinstall_global_forward_hooks",
    "remove_global_forward_hooks",
    "reset_compiled_code",
    "run_outside_dynamo",
    "scaled_mm",
    "skip_code_in_dynamo",
    "WRAPPER_PATH_PARTS",
    "own_parameters",
    "replace_buffer",
    "replace_child",
    "submodules_of",
    "swap_module_class",
    "tensor_is_view",
    "tensor_version",
    "tree_flatten",
    "tree_map",
    "torch_function_mode_active",
    "skip_if_traced_alone",
    "skip_traced_frame",
    "traced_frame_code",
    "traced_object",
    "tracing_for_compile",
    "TORCH_RELEASE", "release_of", "GRAPH_AUTOCAST_SWITCHES", "warn_no_graph_switches",
    "BATCH_NORM_BASE", "INSTANCE_NORM_BASE", "CONV_TRANSPOSE_BASE",
    "dispatch_key_overloads",
    "wrapper_tensor",
    "is_optional_type",
    "aten_to_copy",
    "dispatch_key_registrations",
    "sparse_values", "tensor_hooks_of", "post_accumulate_hooks_first",
    "fused_optimizer_devices", "mark_step_supports_amp_scaling", "mark_optimizer_stepped",
    "step_wrapped_by_lr_scheduler", "mark_step_wrapped_by_lr_scheduler",
    "optimizer_step_hooks", "instance_step_hooks_suspended",
    "active_ddp_module", "cpu_has_native_16bit",
]

# ---------------------------------------------------------------------------
# The running torch release: the one constant version branches test
# ---------------------------------------------------------------------------
def release_of(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; ``"2.16.0a0+git1234"`` -> ``(2, 16)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_RELEASE: tuple[int, int] = release_of(torch.__version__)
"""``(major, minor)`` of the running torch (``"2.11.0+cu130"`` -> ``(2, 11)``)."""

GRAPH_AUTOCAST_SWITCHES: bool = TORCH_RELEASE >= (2, 12)
"""Whether dynamo records ``torch.set_autocast_enabled``/``set_autocast_dtype`` in a graph
(from torch 2.12; before, each call is a graph break and runs eagerly)."""

@functools.cache  # once per process (``warn_no_graph_switches.cache_clear()`` re-arms it)
def warn_no_graph_switches() -> None:
    """Called at trace time where :data:`GRAPH_AUTOCAST_SWITCHES` is False: a module rule or
    a cast model's scope inside compiled code then breaks the graph at each autocast
    switch (the switch runs eagerly between graphs; the dtypes are eager mode's). Warns
    once per process."""
    logging.getLogger("ampkit").warning(
        "ampkit: torch %s cannot switch autocast inside a compiled graph (torch.compile of torch 2.12 "
        "and newer can): each module rule and fp32-kept module of a cast model breaks the graph "
        "where it starts and ends. The layers compute in the dtypes of eager mode; the breaks cost "
        "speed. Use torch >= 2.12 for one graph.",
        torch.__version__,
    )


# ---------------------------------------------------------------------------
# Tensors, ops and the dispatcher
# ---------------------------------------------------------------------------
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

def tensor_version(t: torch.Tensor) -> int:
    """``t._version``: the counter torch bumps on every in-place change of ``t``'s data.
    The cast cache and the master-weight/grad bookkeeping compare it; if it stopped
    counting, stale casts or grads would be reused. A function (dynamo traces it)."""
    return t._version


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


def autocast_device_index(device_type: str) -> int:
    """The position of ``device_type`` in the ``enabled`` list of the autocast state
    that dynamo's global-state guard prints (``torch._C._autocast_supported_devices()``
    order)."""
    return torch._C._autocast_supported_devices().index(device_type)


# private ops with no public name (the fused kernels torch's own AMP and optimizers use)
foreach_copy_: Callable[..., Any] = torch._foreach_copy_
"""``torch._foreach_copy_(dst, src)``: copies lists of tensors in one kernel."""

foreach_mul_: Callable[..., Any] = torch._foreach_mul_
"""``torch._foreach_mul_(tensors, scalar)``: scales lists of tensors in one kernel."""
foreach_add_: Callable[..., Any] = torch._foreach_add_
"""``torch._foreach_add_(tensors, scalar)``: adds a number to lists of tensors in one kernel."""
foreach_sub_: Callable[..., Any] = torch._foreach_sub_
"""``torch._foreach_sub_(tensors, others)``: subtracts a list of (0-dim) tensors, element by element."""
flatten_dense: Callable[..., Any] = torch._C._nn.flatten_dense_tensors
"""``flatten_dense(tensors)``: one 1-D tensor of their elements, each in logical order (one C++ call)."""
unflatten_dense: Callable[..., Any] = torch._C._nn.unflatten_dense_tensors
"""``unflatten_dense(flat, like)``: views of ``flat`` shaped as ``like`` (its inverse)."""

#: dtypes torch's fused unscale-and-check kernel takes, per device type (the CUDA kernel
#: dispatches float, double and half only: bf16 grads raise NotImplementedError there)
FUSED_CHECK_DTYPES: dict[str, frozenset[torch.dtype]] = {
    "cpu": frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16}),
}
_FUSED_CHECK_DEFAULT = frozenset({torch.float32, torch.float64, torch.float16})


def amp_unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``
    (what ``torch.amp.GradScaler.unscale_`` runs): sets ``found_inf`` (fp32, 0-dim) to
    1.0 if any of ``grads`` holds inf/NaN, then multiplies them by ``inv_scale`` in place.
    Grads of a dtype the device's kernel lacks (bf16 on CUDA) take
    :func:`unscale_and_check_composite_`, which computes the same without a host sync."""
    if not grads:
        return
    fused_dtypes = FUSED_CHECK_DTYPES.get(grads[0].device.type, _FUSED_CHECK_DEFAULT)
    fused = [g for g in grads if g.dtype in fused_dtypes]
    if len(fused) == len(grads):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return
    if fused:
        torch._amp_foreach_non_finite_check_and_unscale_(fused, found_inf, inv_scale)
    unscale_and_check_composite_([g for g in grads if g.dtype not in fused_dtypes], found_inf, inv_scale)


def unscale_and_check_composite_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """The fused unscale-and-check from foreach kernels, for any dtype: the L1 norm of
    each grad (fp32 accumulation) is inf or NaN when the grad holds an inf or a NaN, so
    ``found_inf`` becomes the maximum of itself and "the sum of the norms is not finite";
    then the grads are multiplied by ``inv_scale``. A sum of finite grads beyond fp32's
    range (about 3.4e38) also counts as non-finite: such a step is skipped."""
    norms = torch._foreach_norm(grads, 1)
    bad = torch.logical_not(torch.isfinite(torch.stack(norms).float().sum())).to(found_inf.dtype)
    torch.maximum(found_inf, bad.to(found_inf.device), out=found_inf)
    torch._foreach_mul_(grads, inv_scale.to(grads[0].device))


def scaled_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch._scaled_mm``: the fp8 matmul of ``ampkit``'s fp8 level (a private op; its
    layouts and arguments have changed between releases)."""
    return torch._scaled_mm(*args, **kwargs)


# ---------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------
def forward_hook_dicts() -> tuple[dict[int, Any], dict[int, Any], dict[int, bool] | None]:
    """torch's global forward hook dicts: ``(pre hooks, hooks, always-called flags)``
    of ``torch.nn.modules.module`` (``_global_forward_pre_hooks``,
    ``_global_forward_hooks``, ``_global_forward_hooks_always_called``; the last None on
    a torch without ``always_call``). ``nn.Module.__call__`` consults them on every
    call; the casting engine's module rules live in them."""
    reg = nn.modules.module
    return (
        reg._global_forward_pre_hooks,
        reg._global_forward_hooks,
        getattr(reg, "_global_forward_hooks_always_called", None),
    )


def can_reinstall_global_forward_hooks() -> bool:
    """Whether hooks can be put back under their old ids (:func:`reinstall_global_forward_hooks`)."""
    return forward_hook_dicts()[2] is not None


def reinstall_global_forward_hooks(pre_id: int, pre: Callable[..., Any], post_id: int, post: Callable[..., Any]) -> None:
    """Put a global forward pre hook and an always-called forward hook back under the ids
    they were first registered with. torch.compile guards compiled code on the global
    hook dicts' keys and values, so the same functions under the same keys keep code
    compiled under one scope valid under the next."""
    pres, posts, always = forward_hook_dicts()
    pres[pre_id] = pre
    posts[post_id] = post
    if always is not None:
        always[post_id] = True


def remove_global_forward_hooks(pre_id: int, post_id: int) -> None:
    """Remove the hooks :func:`reinstall_global_forward_hooks` put in (or that
    ``register_module_forward_*hook`` returned those ids for)."""
    pres, posts, always = forward_hook_dicts()
    pres.pop(pre_id, None)
    posts.pop(post_id, None)
    if always is not None:
        always.pop(post_id, None)


class ModuleHookDicts(NamedTuple):
    """A module's own hook dicts (hook id -> hook, or id -> flag), as ``nn.Module``
    stores them: ``_forward_pre_hooks``, ``_forward_pre_hooks_with_kwargs``,
    ``_forward_hooks``, ``_forward_hooks_with_kwargs``, ``_forward_hooks_always_called``.
    Hooks ampkit put on a model are found (and removed, also on a copy or an unpickled
    model, whose handles are gone) through them."""

    pre: dict[int, Any]
    pre_with_kwargs: dict[int, bool]
    post: dict[int, Any]
    post_with_kwargs: dict[int, bool]
    post_always_called: dict[int, bool]


def module_hook_dicts(module: nn.Module) -> ModuleHookDicts:
    """``module``'s hook dicts (:class:`ModuleHookDicts`)."""
    return ModuleHookDicts(
        module._forward_pre_hooks,
        module._forward_pre_hooks_with_kwargs,
        module._forward_hooks,
        module._forward_hooks_with_kwargs,
        module._forward_hooks_always_called,
    )


def forward_pre_hooks_of(module: nn.Module) -> dict[int, Any]:
    """``module._forward_pre_hooks`` (hook id -> hook), in registration order."""
    return module._forward_pre_hooks


def forward_pre_hooks_with_kwargs(module: nn.Module) -> dict[int, bool]:
    """``module._forward_pre_hooks_with_kwargs``: ids of pre hooks registered with
    ``with_kwargs=True``; a hook moved to another module must keep its entry."""
    return module._forward_pre_hooks_with_kwargs


def submodules_of(module: nn.Module) -> list[nn.Module | None]:
    """``module``'s direct children as stored (``module._modules.values()``, None for a
    child set to None): read without building ``named_children``'s generator."""
    return list(module._modules.values())


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module._parameters``: its own parameters by name, None for one set to None
    (``named_parameters(recurse=False)`` skips those)."""
    return module._parameters


def replace_buffer(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in place of ``module``'s buffer ``name`` (``module._buffers[name]``),
    keeping whether it is persistent (saved in the state_dict)."""
    module._buffers[name] = tensor


def replace_child(module: nn.Module, name: str, child: nn.Module) -> None:
    """Put ``child`` in place of ``module``'s submodule ``name`` (``module._modules[name]``),
    in the same position of the module's children."""
    module._modules[name] = child


WRAPPER_PATH_PARTS: tuple[str, ...] = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""The attribute names wrappers insert in qualified module names: ``torch.compile``'s
``OptimizedModule``, FSDP1's ``FullyShardedDataParallel``, ``checkpoint_wrapper``.
Name rules drop them, so ``block._orig_mod.norm`` matches a rule for ``block.norm``."""


def compiled_module_inner(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile(model)`` wrapper (``OptimizedModule``) wraps
    (``._orig_mod``), or None if ``module`` is no such wrapper. Module rules and name
    rules are written against the inner model."""
    if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        return module._orig_mod
    return None


def compiled_function_inner(fn: Any) -> Any:
    """The function a ``torch.compile(fn)`` wrapper wraps (``_torchdynamo_orig_callable``),
    or None if ``fn`` is no such wrapper."""
    return getattr(fn, "_torchdynamo_orig_callable", None)


def swap_module_class(module: nn.Module, cls: type[nn.Module]) -> None:
    """Change ``module``'s class in place (``module.__class__ = cls``): parameters,
    buffers, hooks and state_dict keys stay, only methods change. ``cls`` must be a
    subclass of (or the base of) ``type(module)`` with no ``__slots__`` of its own."""
    module.__class__ = cls


# ---------------------------------------------------------------------------
# nn.DataParallel replica threads
# ---------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------
# torch.compile (dynamo)
# ---------------------------------------------------------------------------
def mark_trace_constant(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make dynamo run ``fn`` at trace time and put its result in the graph as a constant
    (what ``torch._dynamo.assume_constant_result`` sets: ``fn._dynamo_marked_constant``),
    without importing dynamo. If dynamo stopped reading the attribute, it would trace
    into ``fn``: its bookkeeping would graph-break or be recorded."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def run_outside_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped so dynamo never traces it (``torch._compile._disable_dynamo``, which
    imports dynamo only when first called): called in traced code it runs eagerly at a
    graph break."""
    return torch._compile._disable_dynamo(fn)


if TORCH_RELEASE >= (2, 12):
    tracing_for_compile: Callable[[], bool] = torch.compiler.is_compiling
else:

    def tracing_for_compile() -> bool:
        return torch.compiler.is_compiling() or current_trace_tx() is not None


tracing_for_compile.__doc__ = """Whether this thread runs inside torch.compile's tracing (or its compiled code):
``torch.compiler.is_compiling()``, which before torch 2.12 is False while dynamo runs an
op's kernels on fake tensors, so there the thread's dynamo translator is asked too."""


def dynamo_loaded() -> bool:
    """Whether torch.compile's frame evaluation has been imported in this process."""
    return "torch._dynamo.eval_frame" in sys.modules


def current_trace_tx() -> Any:
    """The instruction translator of the frame dynamo is tracing in this thread
    (``torch._dynamo.symbolic_convert.tls.current_tx``), or None. Has ``.output`` (the
    graph being built) and ``.import_source(module_name)``."""
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    return getattr(getattr(convert, "tls", None), "current_tx", None)


def skip_if_traced_alone(code: Any, reason: str) -> bool:
    """At trace time (from a function marked with :func:`mark_trace_constant`): if dynamo
    is compiling ``code``'s frame as its own, not inlined into another frame, abandon it
    (:func:`skip_traced_frame`) so it runs eagerly; else False."""
    if traced_frame_code() is code:
        skip_traced_frame(reason)
    return False


def skip_traced_frame(reason: str) -> None:
    """Called at trace time (from a function dynamo runs then): dynamo abandons the frame
    it is compiling and runs it eagerly (``torch._dynamo.exc.SkipFrame``; no graph, no
    graph break)."""
    from torch._dynamo.exc import SkipFrame

    raise SkipFrame(reason)


def traced_object(object_id: int) -> Any:
    """The object whose ``id()`` traced code passed to a function dynamo runs at trace
    time (:func:`mark_trace_constant`). Such a function gets constants only: dynamo
    before 2.12 refuses a module as its argument (``AsPythonConstantNotImplementedError``),
    while ``id(module)`` is a constant on every release, guarded on the module's identity.
    Valid only while dynamo traces the call, which keeps the object alive."""
    return _ctypes.PyObj_FromPtr(object_id)


def traced_frame_code() -> Any:
    """The code object of the frame dynamo is compiling in this thread, as its own frame
    (``tls.current_tx.f_code``: the root translator's, not that of a function it inlines),
    or None when dynamo is not tracing."""
    return getattr(current_trace_tx(), "f_code", None)


def guard_attr_equals(tx: Any, module_name: str, *attrs: str) -> None:
    """Make dynamo guard the code ``tx`` traces on ``module_name.attr1.attr2...`` being
    equal to its value now (``install_guard`` of an ``AttrSource`` chain on
    ``tx.import_source``, ``GuardBuilder.EQUALS_MATCH``): the code is compiled again
    when that value changes. Raises if dynamo's guard API changed."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import AttrSource

    source = tx.import_source(module_name)
    for attr in attrs:
        source = AttrSource(source, attr)
    install_guard(source.make_guard(GuardBuilder.EQUALS_MATCH))


def add_graph_marker(output: Any, target: Any, arg: str) -> bool:
    """Add a ``call_function`` node ``target(arg)`` to the graph dynamo is building
    (``output``: ``tx.output``) unless one is there; False once tracing has ended
    (``output.should_exit``). The node's argument becomes part of the key torch.compile's
    caches (AOTAutograd's) store the graph under. Raises if dynamo's tracer changed."""
    if getattr(output, "should_exit", True):
        return False
    tracer = output.root_tracer
    if any(n.args == (arg,) for n in tracer.graph.find_nodes(op="call_function", target=target)):
        return True
    tracer.create_proxy("call_function", target, (arg,), {}).node.meta["example_value"] = None
    return True


def skip_code_in_dynamo(code: Any) -> None:
    """Tell dynamo never to compile ``code``'s frames nor what they call
    (``set_code_exec_strategy`` with ``FrameAction.SKIP``). Raises if the API changed."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def compiled_frames_ok() -> bool:
    """Whether dynamo has compiled any frame in this process
    (``torch._dynamo.utils.counters["frames"]["ok"]``); False if dynamo is not loaded."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and bool(utils.counters["frames"].get("ok"))


def dynamo_compile_lock() -> Any:
    """``torch._dynamo.convert_frame.compile_lock``: held while dynamo compiles a frame;
    hold it to read or reset its code cache."""
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


def reset_compiled_code(code: Any) -> None:
    """Drop the compiled code dynamo keeps for ``code`` (compiled anew on its next call;
    ``torch._C._dynamo.eval_frame.reset_code``)."""
    from torch._C._dynamo.eval_frame import reset_code as _reset_code

    _reset_code(code)


def compiled_code_entries() -> Iterator[tuple[Any, list[list[str]]]]:
    """Each code object dynamo compiled, with the guard code of each of its cache
    entries (``input_codes.seen``, ``_debug_get_cache_entry_list``,
    ``entry.guard_manager.code_parts``). Raises if dynamo's cache layout changed."""
    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    for ref in list(input_codes.seen):
        code = ref()
        if code is not None:
            yield code, [_entry_guard_parts(entry) for entry in _debug_get_cache_entry_list(code)]


def _entry_guard_parts(entry: Any) -> list[str]:
    """One cache entry's guard code. Before torch 2.11 dynamo prints its global-state guard
    as a bare ``___check_global_state()``, without the state it compares against; that
    part is then completed with the autocast ``enabled`` list asked of the guard itself
    (:func:`_probe_autocast_enabled`), so that :func:`global_autocast_enabled_in_guard`
    reads every release alike."""
    parts = list(entry.guard_manager.code_parts)
    if any(_GLOBAL_STATE in p for p in parts) or _BARE_GLOBAL_STATE not in parts:
        return parts
    for leaf in entry.guard_manager.root.get_leaf_guards():
        if type(leaf).__name__ == "GLOBAL_STATE":
            enabled = [_probe_autocast_enabled(leaf, d) for d in torch._C._autocast_supported_devices()]
            parts.append(_GLOBAL_STATE + json.dumps({"autocast_state": {"enabled": enabled}}))
            break
    return parts


def _probe_autocast_enabled(leaf: Any, device_type: str) -> bool:
    """Whether a global-state guard (``torch._C._dynamo.guards.GLOBAL_STATE``) may have
    been taken with autocast on ``device_type`` enabled: the guard is checked with that
    device's autocast switched off and everything else as it is now; it passes, or fails
    naming no autocast change, only if the guarded code was traced with it off. Any
    other answer counts as enabled (the caller then recompiles that code: safe)."""
    was = torch.is_autocast_enabled(device_type)
    torch.set_autocast_enabled(device_type, False)
    try:
        result = leaf.check_verbose(None)
    finally:
        torch.set_autocast_enabled(device_type, was)
    return not result.result and any("autocast" in p for p in result.verbose_code_parts)


_GLOBAL_STATE = "___check_global_state() against "
_BARE_GLOBAL_STATE = "___check_global_state()"


def global_autocast_enabled_in_guard(parts: list[str], device_type: str) -> bool | None:
    """From one cache entry's guard code: whether it was compiled with autocast on
    ``device_type`` enabled (dynamo's global-state guard prints the state as JSON after
    ``___check_global_state() against``), or None if the entry has no such guard."""
    states = [json.loads(p[p.index(_GLOBAL_STATE) + len(_GLOBAL_STATE):]) for p in parts if _GLOBAL_STATE in p]
    if not states:
        return None
    return bool(states[0]["autocast_state"]["enabled"][autocast_device_index(device_type)])


def guards_name(parts: list[str], text: str) -> bool:
    """Whether one cache entry's guard code mentions ``text`` (``"_state.compile_key"``:
    the entry is guarded on ampkit's scopes)."""
    return any(text in part for part in parts)


# ---------------------------------------------------------------------------
# Private classes and attributes of torch's modules, optimizers and schedulers
# ---------------------------------------------------------------------------
BATCH_NORM_BASE: type = nn.modules.batchnorm._BatchNorm
"""``nn.modules.batchnorm._BatchNorm``: the base of BatchNorm1d/2d/3d and SyncBatchNorm
(norm layers kept fp32, SyncBN conversion, BN folding)."""

INSTANCE_NORM_BASE: type = nn.modules.instancenorm._InstanceNorm
"""``nn.modules.instancenorm._InstanceNorm``: the base of InstanceNorm1d/2d/3d."""

CONV_TRANSPOSE_BASE: type = nn.modules.conv._ConvTransposeNd
"""``nn.modules.conv._ConvTransposeNd``: the base of ConvTranspose1d/2d/3d (their weight
is laid out ``(in, out, ...)``, which BN folding must know)."""


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


def fused_optimizer_devices() -> list[str]:
    """The device types torch's fused optimizer kernels run on
    (``torch.optim.optimizer._get_fused_kernels_supported_devices``)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def mark_step_supports_amp_scaling(optimizer: torch.optim.Optimizer) -> None:
    """Set ``optimizer._step_supports_amp_scaling``: its ``step`` takes ``grad_scale``
    and ``found_inf`` (what fused optimizers declare to ``torch.amp.GradScaler``)."""
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Set ``optimizer._opt_called``: LR schedulers read it to warn about a scheduler
    stepped before its optimizer."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> tuple[list[Callable[..., Any]], list[Callable[..., Any]]]:
    """The step pre- and post-hooks registered on ``optimizer`` itself, in order: the dicts
    ``_optimizer_step_pre_hooks``/``_post_hooks`` that torch's ``profile_hook_step`` reads
    at each ``step``; renamed, a managed step would run them twice or not at all."""
    pre = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    post = getattr(optimizer, "_optimizer_step_post_hooks", None)
    return (list(pre.values()) if pre else [], list(post.values()) if post else [])


def global_optimizer_step_hooks() -> int:
    """How many ``torch.optim.optimizer._global_optimizer_pre_hooks``/``_post_hooks`` are set."""
    from torch.optim import optimizer as o

    return len(getattr(o, "_global_optimizer_pre_hooks", ())) + len(getattr(o, "_global_optimizer_post_hooks", ()))


@contextlib.contextmanager
def instance_step_hooks_suspended(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within the block, ``optimizer.step`` runs none of the optimizer's own step hooks
    (the caller ran them); they come back after, new ones included. Global hooks are
    not suspended: they are process-wide, other threads may be stepping."""
    names = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
    saved = [optimizer.__dict__.get(name) for name in names]
    if not any(saved):
        yield
        return
    for name, hooks in zip(names, saved):
        if hooks is not None:
            optimizer.__dict__[name] = type(hooks)()
    try:
        yield
    finally:
        for name, hooks in zip(names, saved):
            if hooks is not None:
                added = optimizer.__dict__[name]
                hooks.update(added)  # registered while suspended: kept
                optimizer.__dict__[name] = hooks


def step_wrapped_by_lr_scheduler(step: Any) -> bool:
    """Whether an LR scheduler wrapped this ``optimizer.step`` (its ``_wrapped_by_lr_sched``
    marker: a scheduler created before wraps the step once and sets it)."""
    return hasattr(step, "_wrapped_by_lr_sched")


def mark_step_wrapped_by_lr_scheduler(step: Any) -> None:
    """Set the ``_wrapped_by_lr_sched`` marker on a step function that replaces one an
    LR scheduler wrapped, so the scheduler does not wrap it again."""
    step._wrapped_by_lr_sched = True


def active_ddp_module() -> nn.Module | None:
    """The DistributedDataParallel whose forward is running in this thread
    (``DistributedDataParallel._get_active_ddp_module()``), or None."""
    return nn.parallel.DistributedDataParallel._get_active_ddp_module()


def cpu_has_native_16bit(dtype: torch.dtype) -> bool | None:
    """Whether the CPU computes ``dtype`` (bf16: AVX-512-bf16 or AMX tiles; fp16:
    AMX-FP16) natively (``torch.cpu._is_avx512_bf16_supported`` and friends), or None
    when this torch cannot tell."""
    cpu = torch.cpu
    try:
        if dtype == torch.bfloat16:
            return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
        return bool(cpu._is_amx_fp16_supported())
    except AttributeError:
        return None
