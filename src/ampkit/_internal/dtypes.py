"""dtype and device facts every layer shares, in one place.

- :data:`LOW_PRECISION`: the 16-bit floating dtypes ampkit computes or stores in.
- :func:`default_device_type` / :func:`default_dtype`: what ampkit picks when the caller
  names no device or dtype (torch.autocast's own defaults).
- :func:`cast_optimizer_state`: how an optimizer's per-parameter state follows its
  parameter to another dtype, with one rule for the optimizer's scalars.
- :func:`torch_class`: classes of optional torch subpackages (DTensor, FSDP), or None.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "LOW_PRECISION",
    "default_device_type",
    "default_dtype",
    "cast_optimizer_state",
    "torch_class",
]

#: The 16-bit floating dtypes: ampkit's compute dtypes, and the storage dtypes of the
#: O2/O3/O2K levels.
LOW_PRECISION: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


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
torch_class._dynamo_marked_constant = True  # type: ignore[attr-defined]
