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
"""

from __future__ import annotations

import fnmatch
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit._internal.dtypes import LOW_PRECISION
from ampkit._internal.tree import map_leaves
from ampkit.casting.engine import autocast
from ampkit.errors import AmpError

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

#: Normalization layers kept in fp32 by :func:`cast_model` (subclasses included):
#: every BatchNorm (1d/2d/3d, lazy, SyncBatchNorm), InstanceNorm (1d/2d/3d, lazy),
#: LayerNorm, GroupNorm, RMSNorm and LocalResponseNorm.
NORM_LAYER_TYPES: tuple[type[nn.Module], ...] = tuple(
    t
    for t in (
        torch_compat.BATCH_NORM_BASE,
        torch_compat.INSTANCE_NORM_BASE,
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),
        nn.LocalResponseNorm,
        nn.CrossMapLRN2d,
    )
    if t is not None
)


# Module state (weak keys): module -> hook handles installed by this file, so a second cast replaces them.
HANDLES: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def is_norm_layer(module: nn.Module, extra_types: tuple[type[nn.Module], ...] = ()) -> bool:
    """True if ``module`` is a normalization layer: :data:`NORM_LAYER_TYPES`, one of
    ``extra_types``, or a hand-written one (see :func:`looks_like_norm`)."""
    return isinstance(module, NORM_LAYER_TYPES + tuple(extra_types)) or looks_like_norm(module)


def looks_like_norm(module: nn.Module) -> bool:
    """A hand-written normalization layer, as many codebases define their own
    (nanoGPT's ``LayerNorm``, LLaMA's ``RMSNorm``, T5's ``LayerNorm``): a module whose
    class name contains "norm" (any case), that holds parameters, all of them vectors
    (at most 1-D: scale, shift), and no submodule with parameters of its own."""
    if "norm" not in type(module).__name__.lower():
        return False
    own = list(module.parameters(recurse=False))
    if not own or any(p.dim() > 1 for p in own):
        return False
    return not any(any(True for _ in child.parameters()) for child in module.children())


KeepRule = type[nn.Module] | str


def matches_rule(module: nn.Module, name: str, rules: Sequence[KeepRule]) -> bool:
    """Whether ``module`` (qualified ``name``) matches one of ``rules``: a module class it
    is an instance of, or a glob its name matches (``"blocks.*.attn"``)."""
    return any(fnmatch.fnmatchcase(name, r) if isinstance(r, str) else isinstance(module, r) for r in rules)


def kept_fp32_modules(
    model: nn.Module,
    keep_norm_fp32: bool = True,
    extra_fp32_types: Iterable[type[nn.Module]] = (),
    keep_fp32: Iterable[KeepRule] = (),
) -> list[nn.Module]:
    """The modules :func:`cast_model` keeps in fp32, in ``model.modules()`` order:
    normalization layers (with ``keep_norm_fp32``; :func:`is_norm_layer` with
    ``extra_fp32_types``) and the modules matching ``keep_fp32`` (classes, or globs of
    qualified names such as ``"encoder.*.norm"``; kept whatever ``keep_norm_fp32``),
    each with its whole subtree: a kept block keeps every layer inside it fp32."""
    return [m for m, _ in _kept_with_roots(model, keep_norm_fp32, tuple(extra_fp32_types), tuple(keep_fp32))]


def kept_fp32_roots(
    model: nn.Module, keep_norm_fp32: bool = True, keep_fp32: Iterable[KeepRule] = ()
) -> list[nn.Module]:
    """The outermost of :func:`kept_fp32_modules`: kept modules with no kept ancestor
    (each keeps its whole subtree fp32), in ``model.modules()`` order."""
    return [m for m, root in _kept_with_roots(model, keep_norm_fp32, (), tuple(keep_fp32)) if root]


def _kept_with_roots(
    model: nn.Module,
    keep_norm_fp32: bool,
    extra: tuple[type[nn.Module], ...],
    rules: tuple[KeepRule, ...],
) -> list[tuple[nn.Module, bool]]:
    """(module, is_root) for every kept module; a root is a kept module with no kept
    ancestor (it gets the cast hooks; the modules under it run inside it in fp32)."""
    out: list[tuple[nn.Module, bool]] = []
    seen: set[int] = set()

    def visit(module: nn.Module, name: str, under_kept: bool) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        kept = under_kept or (keep_norm_fp32 and is_norm_layer(module, extra)) or matches_rule(module, name, rules)
        if kept:
            out.append((module, not under_kept))
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, kept)

    visit(model, "", False)
    return out


def check_keep_fp32(models: Iterable[nn.Module], keep_fp32: Iterable[KeepRule]) -> None:
    """Raise :class:`AmpError` if a qualified-name glob of ``keep_fp32`` matches no
    module of ``models`` (a typo would otherwise keep nothing fp32, silently). Classes
    need not occur: a list like ``[MyLayerNorm]`` may serve several models."""
    model_list = list(models)
    names = [name for m in model_list for name, _ in m.named_modules() if name]
    for rule in keep_fp32:
        if isinstance(rule, str) and not any(fnmatch.fnmatchcase(n, rule) for n in names):
            sample = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
            raise AmpError(
                f"keep_fp32 glob {rule!r} matches no module name of the model (its names "
                f"are qualified like {sample or 'none: the model has no submodules'}); fix the "
                "pattern, or pass the module class instead."
            )


def params_to_cast(
    model: nn.Module,
    keep_norm_fp32: bool = True,
    extra_fp32_types: tuple[type[nn.Module], ...] = (),
    keep_fp32: Iterable[KeepRule] = (),
) -> list[nn.Parameter]:
    """The floating parameters :func:`cast_model` would convert, in
    ``model.modules()`` order, each once (shared parameters are listed once; one
    shared with a module kept fp32 stays fp32)."""
    kept = kept_fp32_modules(model, keep_norm_fp32, extra_fp32_types, keep_fp32)
    kept_ids = {id(m) for m in kept}
    kept_params = {id(p) for m in kept for p in m.parameters(recurse=False)}
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for module in model.modules():
        if id(module) in kept_ids:
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and id(p) not in kept_params and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _takes_low_precision_input(module: nn.Module) -> bool:
    """Norm layers whose torch kernels take a 16-bit input with fp32 weights and
    compute statistics and weight grads in fp32 (checked against fp64: weight grads
    as accurate as with an fp32 input). BatchNorm and InstanceNorm (cudnn and CPU
    kernels), GroupNorm on CPU. LayerNorm is not among them: its CPU kernel
    accumulates the weight grads of a bf16 input in bf16 (4% off on a 64x16x256
    input), so it gets an fp32 input, as do RMSNorm and LocalResponseNorm."""
    if isinstance(module, (torch_compat.BATCH_NORM_BASE, torch_compat.INSTANCE_NORM_BASE)):
        return True
    if isinstance(module, nn.GroupNorm):
        devices = {t.device.type for t in module.parameters()} or {"cpu"}
        return devices == {"cpu"}
    return False


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


# Per thread: the ampkit.autocast objects of model forwards in flight (entered by
# OpCastingEnter, left by OpCastingExit), and one reusable scope per (device, dtype,
# policy) -- autocast objects keep a stack, so a thread reuses its own.
_SCOPES = threading.local()
# Module state (weak keys): model -> the policy its forward runs under (None: the default lists of its dtype).
_MODEL_POLICY: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _scope_for(device_type: str, dtype: torch.dtype, policy: Any, enabled: bool = True) -> Any:
    cache = getattr(_SCOPES, "cache", None)
    if cache is None:
        cache = _SCOPES.cache = {}
    key = (device_type, dtype, id(policy), enabled)
    entry = cache.get(key)
    if entry is None or entry[0] is not policy:
        scope = autocast(policy, device_type=device_type, dtype=dtype if enabled else None, enabled=enabled)
        entry = cache[key] = (policy, scope)
    return entry[1]


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
            _compiled_enter(self.dtype, self.device_type, self.enabled)
            return
        if torch_compat.dynamo_loaded():  # what it calls must not become frames dynamo compiles
            _enter_outside_dynamo(self, module)
        else:
            self._enter(module)

    def _enter(self, module: nn.Module) -> None:
        scope = _scope_for(self.device_type, self.dtype, _MODEL_POLICY.get(module), self.enabled)
        stack = getattr(_SCOPES, "stack", None)
        if stack is None:
            stack = _SCOPES.stack = []
        scope.__enter__()
        stack.append((module, scope))


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
            _compiled_exit()
            return
        if torch_compat.dynamo_loaded():
            _exit_outside_dynamo(module)
        else:
            _exit_scope(module)


def _exit_scope(module: nn.Module) -> None:
    stack = getattr(_SCOPES, "stack", None)
    if stack and stack[-1][0] is module:
        _, scope = stack.pop()
        scope.__exit__(None, None, None)


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
_exit_outside_dynamo = torch_compat.run_outside_dynamo(_exit_scope)


# Per thread: the calls in flight of cast models and of their entry points (EntryCasts):
# (module, the scope an entry opened, or None / True: none).
_ENTRIES = threading.local()


def _entry_stack() -> list[tuple[nn.Module, Any]]:
    if not hasattr(_ENTRIES, "stack"):
        _ENTRIES.stack = []
    return _ENTRIES.stack


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
        stack = _entry_stack()
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
            scope = _scope_for(self.device_type, self.dtype, _MODEL_POLICY.get(module))
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
        stack = _entry_stack()
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
                    _MODEL_POLICY[module] = policy
                elif device_type is None:
                    _MODEL_POLICY.pop(module, None)


# Inside code torch.compile traces, the scope is torch's own autocast state, switched
# with calls dynamo records in the graph (the default lists: a custom policy's changes
# apply to eager calls only); what to restore is taken at trace time, on a stack per
# thread (module calls nest, so their scopes close in the reverse order they opened).
# The trace-time functions take constants only: dynamo before 2.12 refuses a module as
# an argument of a function it runs at trace time.
def _compiled_enter(dtype: torch.dtype, device_type: str, enabled: bool = True) -> None:
    _trace_save(device_type)  # warns once where this torch cannot switch in the graph
    torch.set_autocast_enabled(device_type, enabled)
    if enabled:
        torch.set_autocast_dtype(device_type, dtype)


def _compiled_exit() -> None:
    restore = _trace_restore()
    if restore is not None:
        device_type, enabled, dtype = restore
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, dtype)


def _trace_save(device_type: str) -> None:
    if not torch_compat.GRAPH_AUTOCAST_SWITCHES:
        torch_compat.warn_no_graph_switches()
    stack = _SCOPES.__dict__.setdefault("traced", [])
    stack.append((device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)))


def _trace_restore() -> tuple[str, bool, torch.dtype] | None:
    stack = _SCOPES.__dict__.setdefault("traced", [])
    return stack.pop() if stack else None


# run by dynamo at trace time, their results constants in the graph
torch_compat.mark_trace_constant(_trace_save)
torch_compat.mark_trace_constant(_trace_restore)


def add_op_casting(model: nn.Module, dtype: torch.dtype, device_type: str, policy: Any = None) -> None:
    """Run ``model``'s forward under op-level casting in ``dtype`` (see
    :class:`OpCastingEnter`); ``policy``: an :class:`ampkit.Policy` (default: the
    device's lists). Replaces what an earlier call installed."""
    remove_op_casting(model)
    if policy is not None:
        _MODEL_POLICY[model] = policy
    _set_entry_scope(model, device_type, policy)
    # Outermost: the scope opens before the input casts and closes after the output casts.
    model.register_forward_pre_hook(OpCastingEnter(dtype, device_type), prepend=True)
    model.register_forward_hook(OpCastingExit(), always_call=True)


def remove_op_casting(model: nn.Module) -> None:
    _MODEL_POLICY.pop(model, None)
    _set_entry_scope(model, None)
    _remove_scope_hooks(model, enabled=True)


def add_fp32_scope(module: nn.Module, device_type: str) -> None:
    """Run ``module``'s forward with casting off (a kept-fp32 block inside a model whose
    forward runs under op-level casting: its matmuls stay fp32). Replaces an earlier one."""
    remove_fp32_scope(module)
    module.register_forward_pre_hook(OpCastingEnter(torch.float32, device_type, enabled=False), prepend=True)
    module.register_forward_hook(OpCastingExit(enabled=False), always_call=True)


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
            fp32); None leaves outputs in ``dtype``.
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
    kept = _kept_with_roots(model, keep_norm_fp32, extra, rules)
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
        if _takes_low_precision_input(m):
            # The kernel accumulates in fp32 itself: feed it the 16-bit activation, so
            # the tensor it saves for backward is 16-bit too.
            add_io_casts(m, dtype, output_dtype=None)
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
