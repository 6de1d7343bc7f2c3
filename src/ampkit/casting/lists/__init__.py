"""Default op categories, as data: one table per device type.

Each table maps a category to aten op names (base names; every overload of a base
name shares its category). The tables reproduce what ``torch.autocast`` does on
that device for one torch release (``aten/src/ATen/autocast_mode.cpp``), keyed by
that release in :data:`TABLES` (torch 2.11, 2.13, 2.15). The tests check the table in use
against the kernels registered on the ``Autocast<Device>`` dispatch keys of the
installed torch, and op by op against ``torch.autocast``'s output dtypes.

Under a torch release ampkit has no table for, the table of the newest older release
is used (the oldest for an older torch), less the ops that torch lacks, and a warning
at import says so (:func:`table_release`): a release that moved an op between
categories would then make ``default_policy()`` differ from ``torch.autocast`` for
that op. Adding a release: run ``python -m ampkit.casting.lists.check`` under it, add its
table here, and run ``tests/test_lists.py``.

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
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from ampkit.errors import PolicyError

from . import cpu, cuda

CATEGORIES: tuple[str, ...] = ("lower", "fp32", "promote")

def _edited(lists: Mapping[str, tuple[str, ...]], drop: tuple[str, ...] = (), **add: tuple[str, ...]) -> MappingProxyType:
    """``lists`` (category -> names) less ``drop``, plus ``add[category]`` names."""
    return MappingProxyType({c: tuple(n for n in names if n not in drop) + add.get(c, ()) for c, names in lists.items()})


# The CUDA builds of torch register an autocast kernel for cuDNN's RNN (a lower-precision
# cast of its input and weights, torch's aten/src/ATen/cudnn/AutocastRNN.cpp); the CPU
# builds do not have it.
_CUDNN: tuple[str, ...] = ("_cudnn_rnn",) if torch.backends.cudnn.is_available() else ()
_CUDA_213 = _edited(cuda.LISTS, lower=_CUDNN)

#: torch release (major, minor) -> device type -> category -> tuple of aten base names.
#: Each table reproduces ``torch.autocast`` of that release; the tests check the one
#: in use against the installed torch (``tests/test_lists.py``), and
#: ``python -m ampkit.casting.lists.check`` prints how a torch's registrations differ
#: from a table. 2.13 is written out (``cpu.py``, ``cuda.py``); the others are 2.13's
#: with the differences that check found on the PyPI wheels (2.11.0+cu130,
#: 2.15.0+cu132): 2.11's CUDA list has no ``rms_norm``; 2.15 removed ``aten::cholesky``
#: and ``aten::qr`` and added ``linalg_matrix_sqrth`` to both fp32 lists (probed against
#: ``torch.autocast`` on CPU; on CUDA from the CPU probe and its registration, not run on
#: a GPU).
TABLES = MappingProxyType({
    (2, 11): MappingProxyType({"cpu": cpu.LISTS, "cuda": _edited(_CUDA_213, drop=("rms_norm",))}),
    (2, 13): MappingProxyType({"cpu": cpu.LISTS, "cuda": _CUDA_213}),
    (2, 15): MappingProxyType({
        "cpu": _edited(cpu.LISTS, drop=("cholesky", "qr"), fp32=("linalg_matrix_sqrth",)),
        "cuda": _edited(_CUDA_213, fp32=("linalg_matrix_sqrth",)),
    }),
})  # fmt: skip

#: torch release -> device type -> aten base names torch.autocast refuses to run (it raises)
BANNED_TABLES = MappingProxyType({
    release: MappingProxyType({"cpu": cpu.BANNED, "cuda": cuda.BANNED}) for release in TABLES
})  # fmt: skip


def torch_release(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise PolicyError(f"cannot read a torch release from the version string {version!r}.")
    return int(match.group(1)), int(match.group(2))


def table_release(version: str) -> tuple[int, int]:
    """The release whose table ampkit uses under torch ``version``: its own when ampkit
    has one; otherwise the newest table of an older release (the oldest table for a
    torch older than all of them), with a warning (once per process, at import)
    that ``default_policy()`` may then differ from ``torch.autocast`` on ops that
    release moved between categories."""
    release = torch_release(version)
    if release in TABLES:
        return release
    older = [r for r in TABLES if r < release]
    newest = max(older) if older else min(TABLES)
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


def aten_has(name: str) -> bool:
    """Whether the running torch has an aten op of base name ``name``."""
    try:
        return bool(getattr(torch.ops.aten, name).overloads())
    except (AttributeError, RuntimeError):
        return False


def without_missing_ops(
    tables: Mapping[str, Mapping[str, tuple[str, ...]]], has_op: Callable[[str], bool] = aten_has
) -> tuple[MappingProxyType, tuple[str, ...]]:
    """``tables`` (device type -> category -> names) without the ops ``has_op`` says the
    running torch lacks, and the names left out (sorted): another release's table may
    name an op this torch removed (torch 2.15 removed ``aten::cholesky``, which the 2.13
    CPU table lists), and a policy naming it could not be built."""
    dropped: set[str] = set()
    out = {}
    for device, table in tables.items():
        kept = {}
        for category, names in table.items():
            kept[category] = tuple(n for n in names if has_op(n))
            dropped.update(n for n in names if n not in kept[category])
        out[device] = MappingProxyType(kept)
    return MappingProxyType(out), tuple(sorted(dropped))


#: The release of the tables in use (see :func:`table_release`).
RELEASE = table_release(torch.__version__)

#: device type -> category -> tuple of aten base names, for the installed torch; under a
#: release without a table of its own, the newest table less the ops this torch lacks
#: (:data:`DROPPED_OPS`, said in a warning at import)
DEFAULT_LISTS: Mapping[str, Mapping[str, tuple[str, ...]]]
DROPPED_OPS: tuple[str, ...]
if RELEASE == torch_release(torch.__version__):
    DEFAULT_LISTS, DROPPED_OPS = TABLES[RELEASE], ()
else:
    DEFAULT_LISTS, DROPPED_OPS = without_missing_ops(TABLES[RELEASE])
    if DROPPED_OPS:
        warnings.warn(
            f"ampkit: torch {torch.__version__} has no aten op named {', '.join(DROPPED_OPS)}; the "
            f"{RELEASE[0]}.{RELEASE[1]} tables list them, so the default lists leave them out: "
            "default_policy() builds, and differs from torch.autocast only on ops this release "
            "added or moved.",
            UserWarning,
            stacklevel=2,
        )

#: device type -> aten base names torch.autocast refuses to run (it raises)
BANNED_OPS = MappingProxyType({d: tuple(n for n in names if not DROPPED_OPS or aten_has(n))
                               for d, names in BANNED_TABLES[RELEASE].items()})  # fmt: skip

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
    "DROPPED_OPS",
    "RELEASE",
    "TABLES",
    "aten_has",
    "native_categories",
    "table_release",
    "torch_release",
    "without_missing_ops",
]
