"""Model casting for the opt levels that store weights in 16 bits (O2, O3, O2K).

:func:`cast_model` converts a model's parameters and floating buffers to the
compute dtype in place (the ``Parameter`` objects keep their identity, so an
optimizer built before the cast still points at them), except normalization
layers, which keep fp32 weights and statistics by default: their reductions
(mean, variance) lose too much in 16 bits, and their parameters are few.

Casting is done with forward hooks, never by replacing ``forward``:

* the model gets a forward pre-hook that casts its floating inputs to the compute
  dtype and a forward hook that casts its 16-bit floating outputs to fp32, so a
  loss computed outside the model runs in fp32;
* the model's children with 16-bit weights (through ``ModuleList``/``ModuleDict``
  containers) are *entry points*: called directly, outside a call of the model (a
  LightningModule's ``training_step`` calling ``self.net(x)``), they cast their inputs,
  run under the model's op-level casting and hand back fp32, as the model's call would
  (:class:`EntryCasts`); inside the model's call they do nothing;
* every normalization layer kept in fp32 computes its statistics and weight
  grads in fp32 and hands the next layer the compute dtype. BatchNorm,
  InstanceNorm and (on CPU) GroupNorm kernels do this themselves from a 16-bit
  input (which is what they save for backward); the others (LayerNorm, RMSNorm,
  LocalResponseNorm) get a pre-hook casting their input to fp32 and a hook
  casting their output back.

Hooks live on the module objects themselves, so a wrapper built afterwards
(``DistributedDataParallel``, ``DataParallel`` replicas, ``torch.compile``) calls
the same hooks. Casting a model twice replaces its hooks instead of stacking them.

Here: the hooks (plain classes, pickled with a model under this module's path) and
what installs and removes them. Which modules stay fp32 and which parameters are cast:
:mod:`.kept_fp32` (its names are exported here too); the scopes the hooks open, eager
and compiled: :mod:`.op_scope`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit._internal.dtypes import LOW_PRECISION
from ampkit._internal.tree import map_leaves
from ampkit.errors import AmpError

from . import op_scope
from .kept_fp32 import (
    NORM_LAYER_TYPES,
    KeepRule,
    check_keep_fp32,
    is_norm_layer,
    kept_fp32_modules,
    kept_fp32_roots,
    kept_with_roots,
    looks_like_norm,
    matches_rule,
    params_to_cast,
    takes_low_precision_input,
)

__all__ = [
    "CastInputs",
    "CastOutputs",
    "EntryCasts",
    "EntryExit",
    "NORM_LAYER_TYPES",
    "is_norm_layer",
    "looks_like_norm",
    "kept_fp32_modules",
    "kept_fp32_roots",
    "matches_rule",
    "params_to_cast",
    "cast_model",
    "add_io_casts",
    "remove_io_casts",
    "add_op_casting",
    "remove_op_casting",
    "cast_tensors",
]


# Module state (weak keys): module -> hook handles installed by this file, so a second cast replaces them.
HANDLES: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def _is_cast_target(t: object, dtypes: tuple[torch.dtype, ...] | None) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and (dtypes is None or t.dtype in dtypes)


def cast_tensors(obj: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...] | None = None) -> Any:
    """Return ``obj`` with every floating tensor inside it (through tuples,
    named tuples, lists and dicts) cast to ``dtype``; with ``only``, just tensors
    of those dtypes. Integer and boolean tensors and other objects pass through."""
    def cast(x: Any) -> Any:
        return x.to(dtype) if _is_cast_target(x, only) and x.dtype != dtype else x

    # a module's usual inputs and outputs (run per module call): no walk of the tree
    if isinstance(obj, torch.Tensor):
        return cast(obj)
    if type(obj) is tuple and all(isinstance(x, torch.Tensor) for x in obj):
        return tuple([cast(x) for x in obj])
    if type(obj) is dict and not obj:
        return {}
    return map_leaves(obj, cast, keep_types=True, mapping=dict)


class CastInputs:
    """Forward pre-hook (with kwargs): cast the floating inputs to ``dtype``. A plain
    module-level object, so a model carrying it pickles (``torch.save(model)``) and
    deep-copies."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast_tensors(args, self.dtype), cast_tensors(kwargs, self.dtype)

    def __repr__(self) -> str:
        return f"CastInputs({self.dtype})"


class CastOutputs:
    """Forward hook: cast the floating outputs (of the dtypes in ``only``; None: all) to
    ``dtype``. Picklable, like :class:`CastInputs`."""

    def __init__(self, dtype: torch.dtype, only: tuple[torch.dtype, ...] | None) -> None:
        self.dtype = dtype
        self.only = only

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return cast_tensors(output, self.dtype, self.only)

    def __repr__(self) -> str:
        return f"CastOutputs({self.dtype}, only={self.only})"


class OpCastingEnter:
    """Forward pre-hook of a cast model (O2, O2K): its forward runs inside
    ``ampkit.autocast`` with the policy of its compute dtype, so the policy's fp32 ops
    (softmax, norms, losses computed inside ``forward``) run in fp32, as O1 runs them
    for an fp32 model; matmuls and convs see 16-bit weights and run in 16 bits. Left
    by :class:`OpCastingExit`. Picklable (stateless but for the dtype and device).
    Inside ``torch.compile``d code the scope is torch's autocast state, switched in the
    graph (no graph break): the device's default lists; a custom ``policy`` applies to
    eager calls."""

    def __init__(self, dtype: torch.dtype, device_type: str, enabled: bool = True) -> None:
        self.dtype = dtype
        self.device_type = device_type
        self.enabled = enabled

    def __setstate__(self, state: dict) -> None:  # models pickled before ``enabled`` existed
        self.__dict__.update({"enabled": True, **state})

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_dynamo_compiling():
            _traced_alone_enter()  # skips this frame if dynamo compiles the hook alone
            op_scope.compiled_enter(self.dtype, self.device_type, self.enabled)
            return
        if torch_compat.dynamo_loaded():  # what it calls must not become frames dynamo compiles
            _enter_outside_dynamo(self, module)
        else:
            self._enter(module)

    def _enter(self, module: nn.Module) -> None:
        op_scope.enter_scope(module, self.device_type, self.dtype, self.enabled)


class OpCastingExit:
    """Forward hook (always called, also when forward raises) closing the scope
    :class:`OpCastingEnter` opened for this call."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # which kind of OpCastingEnter this closes

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"enabled": True, **state})

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            _traced_alone_exit()  # skips this frame if dynamo compiles the hook alone
            op_scope.compiled_exit()
            return
        if torch_compat.dynamo_loaded():
            _exit_outside_dynamo(module)
        else:
            op_scope.exit_scope(module)


# ``torch.compile(module)`` runs the module's hooks outside its graph (always so while
# global module hooks exist), and dynamo then compiles each hook as a frame of its own: a
# graph that only switched autocast on would leave the switch to no graph that undoes
# it (AOTAutograd refuses such graphs). A hook traced as its own frame is therefore left
# to run eagerly (dynamo skips the frame: no graph, no graph break), opening or closing
# its scope as in eager mode; inlined into a traced module call (a compiled function
# calling the model) it switches in the graph.
def _skip_if_traced_alone(code: Any) -> bool:
    return torch_compat.skip_if_traced_alone(code, "ampkit's scope hook runs eagerly when compiled as a frame of its own")


def _traced_alone_enter() -> bool:
    return _skip_if_traced_alone(OpCastingEnter.__call__.__code__)


def _traced_alone_exit() -> bool:
    return _skip_if_traced_alone(OpCastingExit.__call__.__code__)


torch_compat.mark_trace_constant(_traced_alone_enter)
torch_compat.mark_trace_constant(_traced_alone_exit)
_enter_outside_dynamo = torch_compat.run_outside_dynamo(lambda hook, module: hook._enter(module))
_exit_outside_dynamo = torch_compat.run_outside_dynamo(op_scope.exit_scope)


class EntryCasts:
    """Forward pre-hook (with kwargs) of a cast model and of its *entry points*: the
    submodules with 16-bit weights a script may call directly, outside a call of the model
    (a LightningModule's ``training_step`` calling ``self.net(x)``): the model's children,
    through containers (``ModuleList``, ``ModuleDict``). Inside a call of the model (or of
    another entry point), or a checkpoint's recomputation of one in backward, it does
    nothing. Called from outside, the entry point is entered as the model would be: its
    floating inputs are cast to ``dtype``, its forward runs under the model's op-level
    casting (``device_type``; None: none, as at O3), and :class:`EntryExit` casts its 16-bit
    outputs to ``cast_outputs`` (None: left as they are). ``top``: the hook of the model
    itself, which only marks its calls. Picklable, like :class:`CastInputs`."""

    called_outside = False  # set by its first call from outside with grad enabled

    def __init__(
        self,
        dtype: torch.dtype,
        cast_outputs: torch.dtype | None,
        device_type: str | None = None,
        top: bool = False,
    ) -> None:
        self.dtype = dtype
        self.cast_outputs = cast_outputs
        self.device_type = device_type
        self.top = top

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if torch.compiler.is_dynamo_compiling():
            _traced_alone_entry()  # skips this frame if dynamo compiles the hook alone
            return None
        if torch_compat.dynamo_loaded():  # what it calls must not become frames dynamo compiles
            return _entry_outside_dynamo(self, module, args, kwargs)
        return self._enter(module, args, kwargs)

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        stack = op_scope.entry_stack()
        if self.top or stack:
            stack.append((module, None))
            return None
        if torch.is_grad_enabled() and not self.called_outside:
            if torch_compat.current_graph_task_id() != -1:  # in backward: a checkpoint recomputes
                stack.append((module, None))  # a call made inside the model, which cast nothing
                return None
            self.called_outside = True  # its recomputations take this path again
        scope: Any = True
        if self.device_type is not None:
            scope = op_scope.scope_for(self.device_type, self.dtype, op_scope.MODEL_POLICY.get(module))
            scope.__enter__()
        stack.append((module, scope))
        return cast_tensors(args, self.dtype), cast_tensors(kwargs, self.dtype)

    def __repr__(self) -> str:
        return f"EntryCasts({self.dtype}, top={self.top})"


class EntryExit:
    """Forward hook (always called) closing what :class:`EntryCasts` opened for this
    call; an entry point called from outside the model hands back its 16-bit outputs
    cast to ``cast_outputs``."""

    def __init__(self, cast_outputs: torch.dtype | None) -> None:
        self.cast_outputs = cast_outputs

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            _traced_alone_entry_exit()  # skips this frame if dynamo compiles the hook alone
            return None
        if torch_compat.dynamo_loaded():
            return _entry_exit_outside_dynamo(self, module, output)
        return self._exit(module, output)

    def _exit(self, module: nn.Module, output: Any) -> Any:
        stack = op_scope.entry_stack()
        if not stack or stack[-1][0] is not module:
            return None
        _, scope = stack.pop()
        if scope is None:
            return None
        if scope is not True:
            scope.__exit__(None, None, None)
        if self.cast_outputs is None:
            return None
        return cast_tensors(output, self.cast_outputs, LOW_PRECISION)

    def __repr__(self) -> str:
        return f"EntryExit({self.cast_outputs})"


def _traced_alone_entry() -> bool:
    return _skip_if_traced_alone(EntryCasts.__call__.__code__)


def _traced_alone_entry_exit() -> bool:
    return _skip_if_traced_alone(EntryExit.__call__.__code__)


torch_compat.mark_trace_constant(_traced_alone_entry)
torch_compat.mark_trace_constant(_traced_alone_entry_exit)
_entry_outside_dynamo = torch_compat.run_outside_dynamo(lambda hook, *a: hook._enter(*a))
_entry_exit_outside_dynamo = torch_compat.run_outside_dynamo(lambda hook, *a: hook._exit(*a))


def _entry_points(model: nn.Module, kept_ids: set[int]) -> list[nn.Module]:
    """The model's children that hold parameters and are not kept fp32, with the
    children of containers (modules without a ``forward`` of their own) in their place."""
    out = []
    for child in model.children():
        if id(child) in kept_ids or next(child.parameters(), None) is None:
            continue
        if type(child).forward is nn.Module.forward:
            out.extend(_entry_points(child, kept_ids))
        else:
            out.append(child)
    return out


def _add_entry_casts(model: nn.Module, dtype: torch.dtype, cast_outputs: torch.dtype | None, kept_ids: set[int]) -> None:
    for module, top in [(model, True), *((m, False) for m in _entry_points(model, kept_ids))]:
        module.register_forward_pre_hook(EntryCasts(dtype, cast_outputs, top=top), with_kwargs=True, prepend=True)
        module.register_forward_hook(EntryExit(cast_outputs), always_call=True)


def _set_entry_scope(model: nn.Module, device_type: str | None, policy: Any = None) -> None:
    """Entry points of ``model`` run under its op-level casting (``device_type``, with
    ``policy``) or none (None)."""
    for module in model.modules():
        for hook in torch_compat.module_hook_dicts(module).pre.values():
            if isinstance(hook, EntryCasts) and not hook.top:
                hook.device_type = device_type
                if device_type is not None and policy is not None:
                    op_scope.MODEL_POLICY[module] = policy
                elif device_type is None:
                    op_scope.MODEL_POLICY.pop(module, None)


def add_op_casting(model: nn.Module, dtype: torch.dtype, device_type: str, policy: Any = None) -> None:
    """Run ``model``'s forward under op-level casting in ``dtype`` (see
    :class:`OpCastingEnter`); ``policy``: an :class:`ampkit.Policy` (default: the
    device's lists). Replaces what an earlier call installed."""
    remove_op_casting(model)
    if policy is not None:
        op_scope.MODEL_POLICY[model] = policy
    _set_entry_scope(model, device_type, policy)
    # Outermost: the scope opens before the input casts and closes after the output casts.
    model.register_forward_pre_hook(OpCastingEnter(dtype, device_type), prepend=True)
    model.register_forward_hook(OpCastingExit(), always_call=True)


def remove_op_casting(model: nn.Module) -> None:
    op_scope.MODEL_POLICY.pop(model, None)
    _set_entry_scope(model, None)
    _remove_scope_hooks(model, enabled=True)


def add_fp32_scope(module: nn.Module, device_type: str) -> None:
    """Run ``module``'s forward with casting off (a kept-fp32 block inside a model whose
    forward runs under op-level casting: its matmuls stay fp32). Replaces an earlier one."""
    remove_fp32_scope(module)
    # On a module that carries the model's own op-level casting too (a model kept fp32 as
    # a whole, cast again after initialize): opened inside it, or its 16 bits would win.
    inside = any(isinstance(h, OpCastingEnter) and h.enabled for h in torch_compat.module_hook_dicts(module).pre.values())
    module.register_forward_pre_hook(OpCastingEnter(torch.float32, device_type, enabled=False), prepend=not inside)
    module.register_forward_hook(OpCastingExit(enabled=False), always_call=True, prepend=inside)


def remove_fp32_scope(module: nn.Module) -> None:
    _remove_scope_hooks(module, enabled=False)


def _remove_scope_hooks(module: nn.Module, enabled: bool) -> None:
    dicts = torch_compat.module_hook_dicts(module)
    for hooks in (dicts.pre, dicts.post):
        kinds = (OpCastingEnter, OpCastingExit)
        for key in [k for k, h in hooks.items() if isinstance(h, kinds) and h.enabled == enabled]:
            del hooks[key]
            dicts.post_always_called.pop(key, None)


def _device_type_of(module: nn.Module) -> str:
    for t in module.parameters():
        return t.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def remove_io_casts(module: nn.Module) -> None:
    """Remove the cast hooks :func:`add_io_casts` or :func:`cast_model` put on
    ``module`` itself (not on its children), also on a copy or an unpickled model."""
    for handle in HANDLES.pop(module, []):
        handle.remove()
    dicts = torch_compat.module_hook_dicts(module)
    for hooks in (dicts.pre, dicts.post):
        for key in [k for k, h in hooks.items() if isinstance(h, (CastInputs, CastOutputs, EntryCasts, EntryExit))]:
            del hooks[key]
            dicts.pre_with_kwargs.pop(key, None)
            dicts.post_with_kwargs.pop(key, None)
            dicts.post_always_called.pop(key, None)


def add_io_casts(
    module: nn.Module,
    input_dtype: torch.dtype,
    output_dtype: torch.dtype | None = torch.float32,
    output_only: tuple[torch.dtype, ...] | None = LOW_PRECISION,
) -> None:
    """Cast ``module``'s floating inputs to ``input_dtype`` with a forward
    pre-hook and its outputs to ``output_dtype`` with a forward hook.

    ``output_only`` restricts the output cast to tensors of those dtypes (default:
    fp16 and bf16, so an fp64 output stays fp64); ``output_dtype=None`` leaves
    outputs alone. Replaces hooks a previous call installed on ``module``.
    """
    remove_io_casts(module)
    handles = [module.register_forward_pre_hook(CastInputs(input_dtype), with_kwargs=True)]
    if output_dtype is not None:
        handles.append(module.register_forward_hook(CastOutputs(output_dtype, output_only)))
    HANDLES[module] = handles


def _cast_own_tensors(module: nn.Module, dtype: torch.dtype, keep: set[int]) -> None:
    """Convert ``module``'s own floating parameters (in place, keeping the
    ``Parameter`` objects; grads follow) and buffers, except parameters in ``keep``."""
    for p in module.parameters(recurse=False):
        if p.is_floating_point() and p.dtype != dtype and id(p) not in keep:
            with torch.no_grad():
                p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
    for name, b in module.named_buffers(recurse=False):
        if b is not None and b.is_floating_point() and b.dtype != dtype:
            torch_compat.replace_buffer(module, name, b.to(dtype))


def cast_model(
    model: nn.Module,
    dtype: torch.dtype,
    keep_norm_fp32: bool = True,
    cast_outputs: torch.dtype | None = torch.float32,
    extra_fp32_types: Iterable[type[nn.Module]] = (),
    keep_fp32: Iterable[KeepRule] = (),
) -> nn.Module:
    """Convert ``model`` in place to ``dtype`` (fp16 or bf16) and install the
    input/output cast hooks; return it.

    Args:
        model: an fp32 (or already cast) module.
        dtype: the storage and compute dtype of every cast parameter.
        keep_norm_fp32: keep every normalization layer (``ampkit.levels.model_cast.NORM_LAYER_TYPES``,
            ``extra_fp32_types`` and hand-written ones: a class named ``*Norm*`` holding
            only vector parameters) in
            fp32, with hooks that run it on fp32 inputs and hand its output back in
            ``dtype``. Default True.
        cast_outputs: dtype the model's fp16/bf16 outputs are cast to (default
            fp32); None leaves outputs in ``dtype``. A model kept fp32 as a whole
            (``keep_fp32`` matching the model itself, or a norm layer as the model)
            computes in fp32 on fp32 inputs; its 16-bit outputs are cast so too, its
            fp32 ones left as they are.
        extra_fp32_types: further module classes to keep in fp32 like norm layers.
        keep_fp32: module classes or qualified-name globs (``"blocks.*.ln_1"``) kept
            in fp32 like norm layers, also with ``keep_norm_fp32=False``.
    """
    if not isinstance(model, nn.Module):
        raise AmpError(f"cast_model expects an nn.Module, got {type(model).__name__}.")
    if dtype not in LOW_PRECISION:
        raise AmpError(
            f"cast_model casts to float16 or bfloat16, got {dtype}; "
            "for fp32 training leave the model as it is (opt level O0 or O1)."
        )
    rules = tuple(keep_fp32)
    check_keep_fp32([model], rules)
    extra = tuple(extra_fp32_types)
    for module in model.modules():  # a re-cast replaces the hooks of the previous one
        remove_io_casts(module)
        remove_fp32_scope(module)
    kept = kept_with_roots(model, keep_norm_fp32, extra, rules)
    kept_ids = {id(m) for m, _ in kept}
    kept_params = {id(p) for m, _ in kept for p in m.parameters(recurse=False)}
    for module in model.modules():
        if id(module) not in kept_ids:
            # A parameter shared with a kept module stays fp32.
            _cast_own_tensors(module, dtype, keep=kept_params)
    for m, root in kept:
        _cast_own_tensors(m, torch.float32, keep=set())
        if not root:
            continue  # runs inside its kept ancestor, on its fp32 inputs
        if m is model:
            # The model itself kept (a glob "*", which matches its empty name; its class; a
            # norm layer as the whole model): no cast model around it to hand 16 bits to.
            # It computes in fp32 on fp32 inputs, and its outputs are cast as a cast
            # model's are: 16-bit ones to ``cast_outputs``, fp32 ones left as they are.
            add_io_casts(m, torch.float32, output_dtype=cast_outputs)
        elif takes_low_precision_input(m):
            # The kernel accumulates in fp32 itself: feed it the 16-bit activation, so
            # the tensor it saves for backward is 16-bit too.
            add_io_casts(m, dtype, output_dtype=None)
            continue
        else:
            add_io_casts(m, torch.float32, output_dtype=dtype, output_only=(torch.float32,))
        if not is_norm_layer(m, extra) or any(True for _ in m.children()):
            # A kept block (linears inside): op-level casting of the model's forward
            # must not run its matmuls in 16 bits.
            add_fp32_scope(m, _device_type_of(m))
    if id(model) not in kept_ids:
        add_io_casts(model, dtype, output_dtype=cast_outputs)
        _add_entry_casts(model, dtype, cast_outputs, kept_ids)
    return model
