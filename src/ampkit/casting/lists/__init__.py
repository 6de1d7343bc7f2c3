"""Default op categories, as data: one table per torch release and device type.

Each table maps a category to aten op names (base names; every overload of a base
name shares its category) and reproduces what ``torch.autocast`` does on that device
in that release. The tables are generated, not typed: ``python -m
ampkit.casting.lists.generate`` reads them from the running torch's own autocast kernels
(:mod:`.derive`) and writes ``tables/torch_<major>_<minor>.json``; :data:`TABLES` holds
the releases in :data:`RELEASES`, and the one of the running torch is used. The tests
check the table in use against the kernels registered on the ``Autocast<Device>``
dispatch keys, against a fresh derivation, and op by op against ``torch.autocast``'s
output dtypes.

Under a torch release ampkit has no table for, the table of the newest older release
is used (the oldest for an older torch), less the ops that torch lacks, and a warning
at import says so and names the command that lists the differences (``python -m
ampkit.casting.lists.generate --check``): a release that moved an op between categories
would make ``default_policy()`` differ from ``torch.autocast`` for that op. (Deriving at
import instead would take about half a second and print torch's own deprecation notices
for the probed ops.) Adding a release: run the generator under it and add it to
:data:`RELEASES`.

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

import json
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from ampkit.errors import PolicyError

from .derive import AUTOCAST_KEYS, PLACED_BY_HAND

CATEGORIES: tuple[str, ...] = ("lower", "fp32", "promote")

#: the releases with a generated table (``tables/torch_<major>_<minor>.json``)
RELEASES: tuple[tuple[int, int], ...] = ((2, 9), (2, 10), (2, 11), (2, 13), (2, 15))


_TABLES_DIR = Path(__file__).with_name("tables")


def _path(release: tuple[int, int]) -> Path:
    return _TABLES_DIR / f"torch_{release[0]}_{release[1]}.json"


def _load(release: tuple[int, int]) -> tuple[MappingProxyType, MappingProxyType, str]:
    """``(device type -> category -> names, device type -> banned names, torch version)``
    of ``release``'s generated table file. A table written on a CPU-only build lacks the
    CUDA kernels only CUDA builds register (cuDNN's RNN, :data:`.derive.PLACED_BY_HAND`);
    under a torch with cuDNN they are added in their hand-placed category."""
    data = json.loads(_path(release).read_text())
    lists = {d: {c: tuple(data[d][c]) for c in CATEGORIES} for d in AUTOCAST_KEYS}
    if torch.backends.cudnn.is_available():
        for device, placed in PLACED_BY_HAND.items():
            for name, (category, _) in placed.items():
                if not any(name in names for names in lists[device].values()):
                    lists[device][category] = tuple(sorted((*lists[device][category], name)))
    tables = MappingProxyType({d: MappingProxyType(t) for d, t in lists.items()})
    banned = MappingProxyType({d: tuple(data["banned"][d]) for d in AUTOCAST_KEYS})
    return tables, banned, data["torch"]


# the generator runs under a release before its table exists
_LOADED = {release: _load(release) for release in RELEASES if _path(release).exists()}

#: torch release (major, minor) -> device type -> category -> tuple of aten base names,
#: generated from that release's wheel (:data:`TABLE_SOURCES` names the build)
TABLES = MappingProxyType({release: loaded[0] for release, loaded in _LOADED.items()})

#: torch release -> device type -> aten base names torch.autocast refuses to run (it raises)
BANNED_TABLES = MappingProxyType({release: loaded[1] for release, loaded in _LOADED.items()})

#: torch release -> the torch version its table was generated from ("2.11.0+cu130")
TABLE_SOURCES = MappingProxyType({release: loaded[2] for release, loaded in _LOADED.items()})


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
        "install a torch ampkit has tables for, or run `python -m ampkit.casting.lists.generate "
        "--check` to list the ops that differ.",
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
    "RELEASES",
    "TABLES",
    "TABLE_SOURCES",
    "aten_has",
    "native_categories",
    "table_release",
    "torch_release",
    "without_missing_ops",
]
