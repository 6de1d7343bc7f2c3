"""``ampkit doctor SCRIPT [ARGS...]``: run a training script with :func:`ampkit.doctor`
watching every optimizer it passes to ``init_trainer``/``initialize``, then print the
report (rich on a terminal, plain text otherwise). The script's exit code is passed
through; bad input (no such script, an output path that cannot be written, --png
without matplotlib) prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from ampkit._internal.install import install_hint

from ._common import (
    UsageError,
    add_command,
    add_script_arguments,
    check_writable,
    launch_path,
    write_output,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = add_command(sub, "doctor", "run a training script with ampkit.doctor on and print its report", __doc__)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--png", type=Path, default=None, metavar="PATH",
                        help="also write the plot (loss scale, skipped steps, per-module margins); needs matplotlib")
    add_script_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``ampkit doctor``; returns the script's exit code (raises
    UsageError for bad input)."""
    from ampkit.tools.diagnosis._script import ScriptError, run_script

    check_writable(args.json, "the JSON report", "ampkit doctor", [args.script])
    check_writable(args.png, "the plot", "ampkit doctor", [args.script, args.json])
    if args.png is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"ampkit doctor: --png needs matplotlib; install the extra: {install_hint('cli')}")
    json_path, png_path = launch_path(args.json), launch_path(args.png)  # the script may change folder
    try:
        outcome = run_script(args.script, list(args.args))
    except ScriptError as exc:
        raise UsageError(f"ampkit doctor: {exc}") from None
    code, reports = outcome.code, outcome.reports
    sys.stdout.flush()
    if not reports:
        print(nothing_to_report(args.script, list(args.args), outcome.unmanaged), file=sys.stderr)
        return code
    for report in reports:
        report.print()
    last = reports[-1]
    if json_path is not None:
        write_output(json_path, last.to_json, "the JSON report", "ampkit doctor")
    if png_path is not None:
        write_output(png_path, last.save_png, "the plot", "ampkit doctor")
    return code


def nothing_to_report(script: str, args: list[str], unmanaged: list[str]) -> str:
    """What ``ampkit doctor`` says after a script that never set ampkit up: that the
    doctor had no step to watch, the optimizers it stepped outside ampkit, and the two
    ways to a report (``ampkit run --doctor``, or the lines to add)."""
    from ampkit.tools.diagnosis._script import run_doctor_command

    if unmanaged:
        stepped = (f"it stepped {len(unmanaged)} optimizer(s) outside ampkit: {', '.join(unmanaged[:4])}"
                   f"{' ...' if len(unmanaged) > 4 else ''}")  # fmt: skip
    else:
        stepped = "it stepped no optimizer ampkit manages"
    return "\n".join([
        "ampkit doctor: nothing to report: the script never set ampkit up (no optimizer was passed to "
        "ampkit.init_trainer or ampkit.initialize), and the doctor watches only the steps ampkit manages; "
        f"{stepped}.",
        "  To diagnose the script as it is, with ampkit applied by the command (O1 bf16; --level, --dtype "
        "to choose):",
        f"    {run_doctor_command(script, args)}",
        "  Or set ampkit up in the script, then run ampkit doctor again:",
        "    import ampkit as amp",
        "    amp.init()                    # once, before training: 16-bit compute",
        "    amp.init_trainer(optimizer)   # after building the optimizer: loss scale, skipped steps",
    ])
