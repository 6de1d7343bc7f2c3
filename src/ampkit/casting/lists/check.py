"""How the running torch's autocast registrations differ from one of ampkit's tables.

    python -m ampkit.casting.lists.check            # against the table ampkit uses here
    python -m ampkit.casting.lists.check --table 2.13

For each device type it prints the aten ops torch registers an autocast kernel for that
the table lacks, and the ones the table lists that torch no longer registers. A
registered op whose schema takes a single tensor is probed against ``torch.autocast``
on the CPU (a 16-bit input: fp32 out means the fp32 category, 16-bit out means lower);
the others are printed for the table's author to place. Exit code 1 when anything
differs. Nothing is written: the tables are checked in by hand from this report.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from ampkit._internal import torch_compat

from . import AUTOCAST_KEYS, BANNED_TABLES, TABLES, table_release, torch_release


def registered(dispatch_key: str) -> set[str]:
    """aten base names with a kernel on ``dispatch_key`` in the running torch."""
    return torch_compat.dispatch_key_registrations(dispatch_key)


def probe_cpu_category(name: str) -> str | None:
    """``"fp32"`` or ``"lower"`` for an op taking one tensor, from ``torch.autocast`` on
    the CPU with a bf16 symmetric positive definite input; None if it cannot be probed."""
    op = getattr(torch.ops.aten, name, None)
    overload = getattr(op, "default", None)
    if overload is None:
        return None
    tensor_args = [a for a in torch_compat.overload_schema(overload).arguments if a.kwarg_only is False]
    if len(tensor_args) != 1 or "Tensor" not in str(tensor_args[0].type):
        return None
    x = torch.randn(4, 4)
    x = (x @ x.T + 4 * torch.eye(4)).to(torch.bfloat16)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = overload(x)
    except Exception:  # noqa: BLE001 - an op the probe cannot run is reported unplaced
        return None
    out = out[0] if isinstance(out, (tuple, list)) else out
    return {torch.float32: "fp32", torch.bfloat16: "lower"}.get(out.dtype)


def report(release: tuple[int, int]) -> list[str]:
    lines = []
    for device, key in AUTOCAST_KEYS.items():
        table = TABLES[release][device]
        ours = {n for names in table.values() for n in names} | set(BANNED_TABLES[release][device])
        regs = registered(key)
        for name in sorted(regs - ours):
            where = probe_cpu_category(name) if device == "cpu" else None
            lines.append(f"{device}: registered, not in the table: {name}" + (f" (probed: {where})" if where else ""))
        lines += [f"{device}: in the table, not registered: {name}" for name in sorted(ours - regs)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default=None, help="the table's release, e.g. 2.13 (default: the one in use)")
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        release = torch_release(args.table) if args.table else table_release(torch.__version__)
    if release not in TABLES:
        parser.error(f"no table for {args.table}; ampkit has {sorted(TABLES)}")
    lines = report(release)
    print(f"torch {torch.__version__} against the {release[0]}.{release[1]} table:")
    print("\n".join(lines) if lines else "no difference")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
