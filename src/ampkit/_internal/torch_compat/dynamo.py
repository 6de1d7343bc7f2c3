"""torch.compile's tracing (dynamo): what runs at trace time, what dynamo must skip or
never trace, its guards and graph markers, and the wrappers ``torch.compile`` returns.
Functions that touch dynamo's internals import them lazily, only when dynamo is loaded
already."""

from __future__ import annotations

import _ctypes
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .release import TORCH_RELEASE


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
