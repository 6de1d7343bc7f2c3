"""Default op categories, as data: one table per device type.

Each table maps a category to aten op names (base names; every overload of a base
name shares its category). The tables reproduce what ``torch.autocast`` does on
that device for torch 2.13 (``aten/src/ATen/autocast_mode.cpp``): the tests check
them against the kernels registered on the ``Autocast<Device>`` dispatch keys of
the installed torch, and op by op against ``torch.autocast``'s output dtypes.

Categories:

``lower``
    inputs cast to the compute dtype (bf16/fp16): matmul, conv, linear, ...
``fp32``
    inputs cast to float32: reductions, pointwise functions with a wide range,
    losses, norms, linear algebra.
``promote``
    inputs cast to the widest floating dtype among them (fp32 wins over 16-bit).

torch itself splits ``fp32`` into three C++ policies (plain, "set the optional
dtype argument", "append a dtype"); the dtypes that come out are the same, so
ampkit keeps one category.
"""

from __future__ import annotations

from types import MappingProxyType

from . import cpu, cuda

CATEGORIES: tuple[str, ...] = ("lower", "fp32", "promote")

#: device type -> category -> tuple of aten base names
DEFAULT_LISTS = MappingProxyType({"cpu": cpu.LISTS, "cuda": cuda.LISTS})

#: device type -> aten base names torch.autocast refuses to run (it raises)
BANNED_OPS = MappingProxyType({"cpu": cpu.BANNED, "cuda": cuda.BANNED})

#: dispatch key that torch.autocast uses for each device type we have lists for
AUTOCAST_KEYS = MappingProxyType({"cpu": "AutocastCPU", "cuda": "AutocastCUDA"})


def native_categories(device_type: str) -> dict[str, str]:
    """``{aten base name: category}`` for ``device_type``'s default lists."""
    out: dict[str, str] = {}
    for category, names in DEFAULT_LISTS[device_type].items():
        for name in names:
            out[name] = category
    return out


__all__ = ["AUTOCAST_KEYS", "BANNED_OPS", "CATEGORIES", "DEFAULT_LISTS", "native_categories"]
