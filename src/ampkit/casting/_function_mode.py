"""Python-level torch functions a policy lists (no aten op of their own, so no kernel
can see them): a ``TorchFunctionMode`` pushed while a scope needs one, and its form
under torch.compile. See docs/concepts/casting.md."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ampkit._internal import torch_compat

from ._cast import _iter_tensors, cast_arguments
from ._kernels import _state, top_frame


# ---------------------------------------------------------------------------
# Python-level functions
# ---------------------------------------------------------------------------
class _PythonOpMode(TorchFunctionMode):
    """Casts the arguments of Python-level torch functions a policy lists."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():
            return _compiled_python_op(func, args, kwargs)
        frame = _state.scopes[-1] if _state.scopes else None
        if len(_state.frames) > 1:
            # scopes for several device types: the innermost one of the device the call
            # computes on (its first tensor's) decides, so a nested scope for another
            # device does not hide this device's rules
            frame = next((top_frame(t.device.type) for t in _iter_tensors(args, kwargs)), None)
        category = frame.python_ops.get(func) if (frame is not None and frame.enabled) else None
        if category is None:
            return func(*args, **kwargs)
        args, kwargs = cast_arguments(category, tuple(args), kwargs, frame.device_type, frame.dtype, frame)
        if category == "fp32":
            with torch.autocast(frame.device_type, enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _compiled_python_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_PythonOpMode`` while dynamo traces: the same casts, written so dynamo puts
    them in the graph (the decision is a trace-time constant guarded by the key)."""
    decision = _trace_python_op(func, _state.compile_key)
    if decision is None:
        return func(*args, **kwargs)
    category, device_type, dtype = decision
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if category == "promote" and any(t.dtype == torch.float32 and t.device.type == device_type for t in tensors):
        dtype = torch.float32
    elif category == "fp32":
        dtype = torch.float32

    def cast(v: Any) -> Any:
        if (
            isinstance(v, torch.Tensor)
            and v.is_floating_point()
            and v.dtype != torch.float64
            and v.device.type == device_type
        ):
            return v.to(dtype)
        return v

    args = tuple(cast(a) for a in args)
    kwargs = {k: cast(v) for k, v in kwargs.items()}
    if category == "fp32":
        with torch.autocast(device_type, enabled=False):
            return func(*args, **kwargs)
    return func(*args, **kwargs)


def _trace_python_op(func: Any, key: str) -> tuple[str, str, torch.dtype] | None:
    """At trace time: (category, device type, compute dtype) for a Python-level op
    under the innermost enabled scope, or None."""
    frame = _state.scopes[-1] if _state.scopes else None
    if frame is None or not frame.enabled:
        return None
    category = frame.python_ops.get(func)
    return None if category is None else (category, frame.device_type, frame.dtype)


torch_compat.mark_trace_constant(_trace_python_op)
