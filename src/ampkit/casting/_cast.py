"""Casting an op's arguments as its category says (:func:`cast_arguments`), with the
cast cache of fp32 parameters: used by the kernels, the function mode and module rules.
See docs/concepts/casting.md."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ampkit._internal.torch_compat import tensor_is_view, tensor_version
from ampkit.errors import PolicyError

if TYPE_CHECKING:
    from ._resolve import _Frame


# ---------------------------------------------------------------------------
# Casting helpers (used by the kernels, the function mode and module rules)
# ---------------------------------------------------------------------------
_F32, _F64 = torch.float32, torch.float64
# Engine state: a memo of device tests, filled once per device type (the same test every time).
_ON_DEVICE: dict[str, Callable[[torch.Tensor], bool]] = {
    "cpu": operator.attrgetter("is_cpu"),
    "cuda": operator.attrgetter("is_cuda"),
}


def _on_device(device_type: str) -> Callable[[torch.Tensor], bool]:
    """A fast test for "this tensor is on ``device_type``" (``t.device`` builds an object)."""
    test = _ON_DEVICE.get(device_type)
    if test is None:
        def test(t: torch.Tensor) -> bool:
            return t.device.type == device_type

        _ON_DEVICE[device_type] = test
    return test


def _cast_tensor(t: torch.Tensor, dtype: torch.dtype, frame: _Frame | None) -> torch.Tensor:
    if t.dtype is dtype:
        return t
    cacheable = (
        frame is not None
        and frame.cache_enabled
        and torch.is_autocast_cache_enabled()  # on only inside a module call: see _start_cache_epoch
        and t.requires_grad
        and t.is_leaf
        and not tensor_is_view(t)
        and torch.is_grad_enabled()
    )
    if not cacheable:
        return t.to(dtype)
    key = id(t)
    hit = frame.cache.get(key)
    if hit is not None:
        ref, version, hit_dtype, cast = hit
        if ref() is t and version == tensor_version(t) and hit_dtype is dtype:
            return cast
    cast = t.to(dtype)
    frame.cache[key] = (weakref.ref(t), tensor_version(t), dtype, cast)
    return cast


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(fn(v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _iter_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    yield v


def _widest(args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str, low: torch.dtype) -> torch.dtype:
    on = _on_device(device_type)
    for t in _iter_tensors(args, kwargs):
        if t.dtype is _F32 and on(t):
            return _F32
    return low


def _cast_value(
    v: Any, target: torch.dtype, on: Callable[[torch.Tensor], bool], frame: _Frame | None
) -> Any:
    """``v`` with its floating tensors on the device (also inside a list or tuple) cast
    to ``target``; float64 and other devices' tensors are left alone."""
    if isinstance(v, torch.Tensor):
        dt = v.dtype
        if dt is target or dt is _F64 or not dt.is_floating_point or not on(v):
            return v
        return _cast_tensor(v, target, frame)
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return type(v)([_cast_value(x, target, on, frame) for x in v])
    return v


def cast_arguments(
    category: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    dtype: torch.dtype,
    frame: _Frame | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast an op's floating ``device_type`` tensors as ``category`` says."""
    if category is None:
        return args, kwargs
    if category == "lower":
        target = dtype
    elif category == "fp32":
        target = _F32
    elif category == "promote":
        target = _widest(args, kwargs, device_type, dtype)
    else:  # pragma: no cover - categories are validated
        raise PolicyError(f"unknown category {category!r}")
    on = _on_device(device_type)
    args = tuple([_cast_value(a, target, on, frame) for a in args])
    if kwargs:
        kwargs = {k: _cast_value(v, target, on, frame) for k, v in kwargs.items()}
    return args, kwargs
