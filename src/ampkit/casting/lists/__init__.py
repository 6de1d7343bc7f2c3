"""Default op categories, as data: one table per device type.

Each table maps a category to aten op names (base names; every overload of a base
name shares its category). The tables reproduce what ``torch.autocast`` does on
that device for one torch release (``aten/src/ATen/autocast_mode.cpp``), keyed by
that release in :data:`TABLES` (today: torch 2.13). The tests check the table in use
against the kernels registered on the ``Autocast<Device>`` dispatch keys of the
installed torch, and op by op against ``torch.autocast``'s output dtypes.

Under a torch release ampkit has no table for, the newest table is used and a warning
at import says so (:func:`table_release`): a release that moved an op between
categories would then make ``default_policy()`` differ from ``torch.autocast`` for
that op. Adding a release is adding its table here and running ``tests/test_lists.py``.

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

import re
import warnings
from types import MappingProxyType

import torch

from ampkit.errors import PolicyError

from . import cpu, cuda

CATEGORIES: tuple[str, ...] = ("lower", "fp32", "promote")

#: torch release (major, minor) -> device type -> category -> tuple of aten base names.
#: Each table reproduces ``torch.autocast`` of that release; the tests check the one
#: in use against the installed torch.
TABLES = MappingProxyType({(2, 13): MappingProxyType({"cpu": cpu.LISTS, "cuda": cuda.LISTS})})

#: torch release -> device type -> aten base names torch.autocast refuses to run (it raises)
BANNED_TABLES = MappingProxyType({(2, 13): MappingProxyType({"cpu": cpu.BANNED, "cuda": cuda.BANNED})})


def torch_release(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise PolicyError(f"cannot read a torch release from the version string {version!r}.")
    return int(match.group(1)), int(match.group(2))


def table_release(version: str) -> tuple[int, int]:
    """The release whose table ampkit uses under torch ``version``: its own when ampkit
    has one; otherwise the newest table, with a warning (once per process, at import)
    that ``default_policy()`` may then differ from ``torch.autocast`` on ops that
    release moved between categories."""
    release = torch_release(version)
    if release in TABLES:
        return release
    newest = max(TABLES)
    known = ", ".join(f"{major}.{minor}" for major, minor in sorted(TABLES))
    warnings.warn(
        f"ampkit: its op tables are written for torch {known}; "
        f"this is torch {version}, so the {newest[0]}.{newest[1]} tables are used. "
        "default_policy() may differ from torch.autocast on ops this release moved; "
        "install a torch ampkit has tables for, or run ampkit's tests/test_lists.py to see "
        "which ops differ.",
        UserWarning,
        stacklevel=2,
    )
    return newest


#: The release of the tables in use (see :func:`table_release`).
RELEASE = table_release(torch.__version__)

#: device type -> category -> tuple of aten base names, for the installed torch
DEFAULT_LISTS = TABLES[RELEASE]

#: device type -> aten base names torch.autocast refuses to run (it raises)
BANNED_OPS = BANNED_TABLES[RELEASE]

#: dispatch key that torch.autocast uses for each device type we have lists for
AUTOCAST_KEYS = MappingProxyType({"cpu": "AutocastCPU", "cuda": "AutocastCUDA"})


def native_categories(device_type: str) -> dict[str, str]:
    """``{aten base name: category}`` for ``device_type``'s default lists."""
    out: dict[str, str] = {}
    for category, names in DEFAULT_LISTS[device_type].items():
        for name in names:
            out[name] = category
    return out


__all__ = [
    "AUTOCAST_KEYS",
    "BANNED_OPS",
    "BANNED_TABLES",
    "CATEGORIES",
    "DEFAULT_LISTS",
    "RELEASE",
    "TABLES",
    "native_categories",
    "table_release",
    "torch_release",
]
