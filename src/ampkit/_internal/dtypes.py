"""dtype and device facts every layer shares, in one place.

- :data:`LOW_PRECISION`: the 16-bit floating dtypes ampkit computes or stores in.
- :data:`DTYPE_NAMES` / :func:`dtype_name`: the short names ampkit prints (``"bf16"``).
- :data:`DTYPES_BY_NAME`: the dtype a short name given on a command line or in a
  config (``"bf16"``, ``"fp16"``, ``"fp32"``) stands for; :data:`LOW_PRECISION_BY_NAME`:
  the 16-bit ones under ampkit's names and torch's (``"bfloat16"``). The one name table:
  every other module imports these.
- :func:`default_device_type` / :func:`default_dtype`: what ampkit picks when the caller
  names no device or dtype (torch.autocast's own defaults).
- :func:`cast_optimizer_state`: how an optimizer's per-parameter state follows its
  parameter to another dtype, with one rule for the optimizer's scalars.
- :func:`torch_class`: classes of optional torch subpackages (DTensor, FSDP), or None.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Any

import torch

from ampkit._internal import torch_compat

__all__ = [
    "LOW_PRECISION",
    "DTYPE_NAMES",
    "DTYPES_BY_NAME",
    "LOW_PRECISION_BY_NAME",
    "dtype_name",
    "default_device_type",
    "default_dtype",
    "cast_optimizer_state",
    "torch_class",
]

#: The 16-bit floating dtypes: ampkit's compute dtypes, and the storage dtypes of the
#: O2/O3/O2K levels.
LOW_PRECISION: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)

#: The short name ampkit prints for each floating dtype it reports on.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
}

#: The dtype each short name accepted from a user (CLI flag, plan or spec field) stands
#: for: :data:`DTYPE_NAMES` reversed, fp64 aside (ampkit computes in none of it).
#: Callers that accept fewer names (16-bit only) check the name against their own
#: choices first.
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: d for d, name in DTYPE_NAMES.items() if d != torch.float64}

#: The 16-bit dtypes by ampkit's short names and torch's own (``"bf16"`` and
#: ``"bfloat16"``): what ``AMPKIT_DTYPE`` and the integrations' arguments accept.
LOW_PRECISION_BY_NAME: dict[str, torch.dtype] = {
    **{DTYPE_NAMES[d]: d for d in LOW_PRECISION},
    **{str(d).removeprefix("torch."): d for d in LOW_PRECISION},
}


def dtype_name(
    dtype: torch.dtype | None,
    *,
    none: str = "None",
    extra: Mapping[torch.dtype, str] | None = None,
) -> str:
    """The short name of ``dtype``: ``"fp32"``/``"fp16"``/``"bf16"``/``"fp64"``
    (:data:`DTYPE_NAMES`, then ``extra``'s names, e.g. ``{torch.int64: "i64"}``), else
    torch's own name without ``torch.`` (``"float8_e4m3fn"``).

    Args:
        dtype: the dtype to name, or None.
        none: what None is named (default ``"None"``).
        extra: further names, looked up after :data:`DTYPE_NAMES` (default none).
    """
    if dtype is None:
        return none
    name = DTYPE_NAMES.get(dtype)
    if name is None and extra is not None:
        name = extra.get(dtype)
    return name if name is not None else str(dtype).replace("torch.", "")


def default_device_type() -> str:
    """``"cuda"`` when a GPU is available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device_type: str) -> torch.dtype:
    """bf16 on CPU, fp16 on CUDA (torch.autocast's defaults)."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def cast_optimizer_state(state: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """A copy of one parameter's optimizer state for a parameter of ``dtype``.

    The rule: every floating-point tensor with at least one dimension (moments, momentum
    buffers, sums of squares) moves to ``dtype``; the optimizer's scalars -- ``"step"``
    and every other 0-dim tensor (NAdam's ``mu_product``, ASGD's ``eta``/``mu``) -- keep
    the dtype the optimizer gave them (torch makes them fp32), as do ints and non-tensors.
    Tensors already in ``dtype`` are kept, not copied."""
    return {
        key: value.to(dtype)
        if key != "step" and torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0
        else value
        for key, value in state.items()
    }


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard if it is a ``DTensor`` (FSDP2's sharded parameters, their
    grads and optimizer state; ``DTensor.to_local()``, sharing its memory), else ``t``.
    Called per tensor on the optimizer step: the class is looked up once."""
    dtensor = _dtensor_class()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


@functools.cache
def _dtensor_class() -> type | None:
    return torch_class("torch.distributed.tensor", "DTensor")


def torch_class(module: str, name: str) -> type | None:
    """``module.name`` (e.g. ``torch.distributed.fsdp``, ``FSDPModule``), or None when
    this torch build lacks it (no distributed support, an older torch). Cheap after the
    first call: the import is a lookup in ``sys.modules``."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


# Called inside module hooks that torch.compile traces (the FSDP guard, the gradient
# path): dynamo runs it at trace time and keeps the class as a constant of the graph,
# rather than breaking the graph at importlib.
torch_compat.mark_trace_constant(torch_class)
