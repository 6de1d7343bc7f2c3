"""The hooks a converted model carries (casts at dtype boundaries, fp32 islands
around normalization layers), recognising them (also those of models converted by
ampkit 0.2), and the fp32 copy of a model without them (:func:`dequantized`)."""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit.levels import model_cast
from ampkit.levels.model_cast import CastInputs, CastOutputs, cast_tensors

from .errors import ConversionError
from .measure import _floating_leaves

__all__ = ["dequantized", "iter_boundary_modules"]


# Every hook convert installs is an instance of a plain ampkit class (never a
# functools.partial or a bound method), so a converted model loads with torch.load's
# defaults: see ampkit.safe_globals.
class _BoundaryInputs(CastInputs):
    """Forward pre-hook (with kwargs) of a converted module: cast its floating inputs
    to the dtype its weights are stored in."""


class _BoundaryOutputs(CastOutputs):
    """Forward hook of a converted module (or model): cast its floating outputs of the
    dtypes in ``only`` to ``dtype``."""


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # the hook of models converted by ampkit 0.2 (pickled as functools.partial of it)
    return cast_tensors(args, dtype), cast_tensors(kwargs, dtype)


def _cast_outputs(
    dtype: torch.dtype, only: tuple[torch.dtype, ...], module: nn.Module, args: tuple, output: Any
) -> Any:
    # the hook of models converted by ampkit 0.2 (pickled as functools.partial of it)
    return cast_tensors(output, dtype, only)


class _IslandEnter:
    """Forward pre-hook of a norm layer kept in fp32: :meth:`_Fp32Island.pre`."""

    def __init__(self, island: _Fp32Island) -> None:
        self.island = island

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self.island.pre(module, args, kwargs)


class _IslandExit:
    """Forward hook (always called) of a norm layer kept in fp32: :meth:`_Fp32Island.post`."""

    def __init__(self, island: _Fp32Island) -> None:
        self.island = island

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return self.island.post(module, args, output)


class _Fp32Island:
    """Hooks of a normalization layer kept in fp32: the pre-hook casts its floating
    inputs to fp32 and remembers the dtype they came in, the forward hook (always
    called, even when ``forward`` raises) hands the fp32 outputs back in that dtype.
    So the layer is transparent: a bf16 residual stream stays bf16, an fp32 one fp32.
    The remembered dtypes are a per-thread stack (re-entrant, DataParallel-safe); a
    copy of the model gets fresh hooks."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __reduce__(self) -> tuple[type, tuple]:
        return (_Fp32Island, ())

    def _stack(self) -> list[torch.dtype | None]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves = _floating_leaves([args, kwargs])
        self._stack().append(leaves[0].dtype if leaves else None)
        return cast_tensors(args, torch.float32), cast_tensors(kwargs, torch.float32)

    def post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        stack = self._stack()
        dtype = stack.pop() if stack else None
        if dtype is None or dtype == torch.float32:
            return output
        return cast_tensors(output, dtype, (torch.float32,))


def _is_convert_hook(fn: Any) -> bool:
    if isinstance(fn, (_BoundaryInputs, _BoundaryOutputs, _IslandEnter, _IslandExit)):
        return True
    # hooks of models converted by ampkit 0.2 and loaded with weights_only=False
    return (isinstance(fn, functools.partial) and fn.func in (_cast_inputs, _cast_outputs)) or isinstance(
        getattr(fn, "__self__", None), _Fp32Island
    )


def _is_ampkit_cast_hook(fn: Any) -> bool:
    """Hooks of :func:`ampkit.levels.model_cast.cast_model` (O2/O3/O2K) or of :func:`convert`."""
    return _is_convert_hook(fn) or getattr(fn, "__module__", None) == model_cast.__name__


def _drop_hooks(module: nn.Module, predicate: Any) -> None:
    """Remove the forward (pre-)hooks of ``module`` for which ``predicate(fn)``."""
    d = torch_compat.module_hook_dicts(module)
    for hooks, extra in ((d.pre, (d.pre_with_kwargs,)), (d.post, (d.post_with_kwargs, d.post_always_called))):
        for key in [k for k, fn in hooks.items() if predicate(fn)]:
            del hooks[key]
            for flags in extra:
                flags.pop(key, None)


def _fp32_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in eval mode with every floating parameter and buffer
    in fp32, no grads, and no ampkit cast hooks."""
    try:
        ref = copy.deepcopy(model)
    except Exception as exc:
        raise ConversionError(
            f"convert works on a copy (copy.deepcopy) and the model cannot be copied: "
            f"{type(exc).__name__}: {exc}. Move what cannot be copied (locks, open files, "
            "generators) out of the module."
        ) from None
    for m in ref.modules():
        _drop_hooks(m, _is_ampkit_cast_hook)
        for p in m.parameters(recurse=False):
            p.grad = None
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        for name, b in m.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dtype != torch.float32:
                torch_compat.replace_buffer(m, name, b.float())
    ref.eval()
    if hasattr(ref, "ampkit_report"):
        del ref.ampkit_report
    return ref


def dequantized(model: nn.Module) -> nn.Module:
    """A copy of a converted model with every weight in fp32 (values unchanged: the
    16-bit weights widened) and no cast hooks: the converted model's weights with
    fp32 compute. ``export_onnx(precision="storage")`` exports this."""
    return _fp32_copy(model)


def iter_boundary_modules(model: nn.Module) -> Iterator[tuple[str, torch.dtype]]:
    """(name, dtype) of each module of a converted model that casts its inputs."""
    for name, m in model.named_modules():
        for fn in torch_compat.forward_pre_hooks_of(m).values():
            if isinstance(fn, _BoundaryInputs):
                yield name, fn.dtype
            elif isinstance(fn, _IslandEnter):
                yield name, torch.float32
            elif isinstance(fn, functools.partial) and fn.func is _cast_inputs:  # ampkit 0.2
                yield name, fn.args[0]
            elif isinstance(getattr(fn, "__self__", None), _Fp32Island):  # ampkit 0.2
                yield name, torch.float32
