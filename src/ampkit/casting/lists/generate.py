"""Write, or check, the op table of the running torch release.

    python -m ampkit.casting.lists.generate            # writes tables/torch_<major>_<minor>.json
    python -m ampkit.casting.lists.generate --check    # compares, writes nothing

The table is read from the running torch's autocast kernels (:mod:`.derive`) for both
device types; the CUDA kernels are registered in every torch build, so a CPU-only machine
writes the CUDA table too. ``--check`` prints each op whose category differs between the
checked-in table of this release (or, without one, the table ampkit would use) and what
this torch does, and exits 1 if anything differs or an op could not be placed. Adding a
release: install it, run this without ``--check``, add the release to ``RELEASES`` in
``lists/__init__.py``, and run ``tests/unit/casting/test_lists.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from .derive import PLACED_BY_HAND, DerivedTables, derive

TABLES_DIR = Path(__file__).with_name("tables")
CATEGORY_ORDER = ("lower", "fp32", "promote")


def file_name(release: tuple[int, int]) -> str:
    """``(2, 13)`` -> ``"torch_2_13.json"``: the table file of a release."""
    return f"torch_{release[0]}_{release[1]}.json"


def render(derived: DerivedTables, release: tuple[int, int]) -> str:
    """The JSON text of the table file for ``derived``: the torch build it was read from,
    device type -> category -> sorted names, the banned names, and the names placed by
    hand (:data:`.derive.PLACED_BY_HAND`) rather than probed. One line per list."""
    by_hand = {
        d: [n for n in sorted(placed) if n in derived.lists[d].get(placed[n][0], ())]
        for d, placed in PLACED_BY_HAND.items()
    }
    doc = {
        "release": f"{release[0]}.{release[1]}",
        "torch": derived.torch_version,
        "written_by": "python -m ampkit.casting.lists.generate (regenerate rather than edit)",
        **{d: {c: list(derived.lists[d][c]) for c in CATEGORY_ORDER} for d in derived.lists},
        "banned": {d: list(names) for d, names in derived.banned.items()},
        "by_hand": {d: names for d, names in by_hand.items() if names},
    }
    lines = ["{"]
    for k, (key, value) in enumerate(doc.items()):
        comma = "," if k < len(doc) - 1 else ""
        if isinstance(value, dict):
            inner = [f"    {json.dumps(c)}: {json.dumps(v)}" for c, v in value.items()]
            lines.append(f"  {json.dumps(key)}: {{\n" + ",\n".join(inner) + f"\n  }}{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
    return "\n".join(lines) + "\n}\n"


def differences(
    table: Mapping[str, Mapping[str, tuple[str, ...]]],
    banned: Mapping[str, tuple[str, ...]],
    derived: DerivedTables,
) -> list[str]:
    """One line per op whose category differs between ``table``/``banned`` and ``derived``,
    and one per op ``derived`` could not place."""
    lines = []
    for device, lists in derived.lists.items():
        ours = {n: c for c, names in table[device].items() for n in names} | dict.fromkeys(banned[device], "banned")
        theirs = {n: c for c, names in lists.items() for n in names} | dict.fromkeys(derived.banned[device], "banned")
        for name in sorted(set(ours) | set(theirs)):
            if ours.get(name) != theirs.get(name):
                lines.append(f"{device}: {name}: table {ours.get(name, 'absent')}, this torch {theirs.get(name, 'absent')}")
        lines += [f"{device}: {name}: could not be placed ({why})" for name, why in derived.unplaced[device].items()]
        lines += [f"{device}: {name}: its overloads disagree {cats}" for name, cats in derived.conflicts[device].items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the checked-in table; write nothing")
    parser.add_argument("--out", type=Path, default=TABLES_DIR, help="folder to write the file to (default: tables/)")
    args = parser.parse_args(argv)
    from . import BANNED_TABLES, RELEASE, TABLES, torch_release

    release = torch_release(torch.__version__)
    derived = derive()
    if args.check:
        lines = differences(TABLES[RELEASE], BANNED_TABLES[RELEASE], derived)
        print(f"torch {torch.__version__} against the {RELEASE[0]}.{RELEASE[1]} table:")
        print("\n".join(lines) if lines else "no difference")
        return 1 if lines else 0
    unplaced = [f"{d}: {n} ({why})" for d, names in derived.unplaced.items() for n, why in names.items()]
    if unplaced:
        print("not written: ops no probe could place; add them to derive.PLACED_BY_HAND:\n" + "\n".join(unplaced))
        return 1
    path = args.out / file_name(release)
    path.write_text(render(derived, release))
    print(f"wrote {path} from torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
