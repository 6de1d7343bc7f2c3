"""``ampkit tune``: a per-module precision plan for an unmodified training script, measured
on this machine (``ampkit.tune``'s steps: capture the model and its first calls in a
short fp32 run, measure each module's time and sensitivity, then confirm candidates by
running the script with ``ampkit run --plan`` and comparing its own loss with fp32's).
Writes the plan as JSON (``--out``), prints its table, and ``--png`` draws it; run the
script with it by ``ampkit run --plan PLAN.json script.py``. While it works it says on
stderr what it measures: a line as each stage begins and ends, and a status line (done
so far, time left, what is measured now) at least every 5 s (a rich progress bar on a
terminal where rich is installed); ``--no-progress`` turns that off.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from ampkit._internal.install import install_hint

from ._common import (
    UsageError,
    add_command,
    add_script_arguments,
    check_writable,
    float_between,
    launch_path,
    positive_int,
    write_output,
)

__all__ = ["add_parser", "run"]

OUT_DEFAULT = Path("ampkit-plan.json")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = add_command(sub, "tune", "find the fastest per-module precision plan for a script within a loss budget",
                         __doc__)  # fmt: skip
    parser.add_argument("--steps", type=positive_int, default=50, metavar="N",
                        help="steps of each confirming run of the script (default: 50; at least 4)")
    parser.add_argument("--budget", type=float_between(1e-9, 10.0), default=0.01, metavar="FRACTION",
                        help="how much worse than fp32's the final loss may be, relative (default: 0.01)")
    parser.add_argument("--out", type=Path, default=OUT_DEFAULT, metavar="PLAN.json",
                        help=f"where to write the plan (default: {OUT_DEFAULT})")
    parser.add_argument("--png", type=Path, default=None, metavar="PATH", help="also draw the plan (matplotlib)")
    parser.add_argument("--max-seconds", type=float_between(0.0, 1e9), default=300.0, metavar="SECONDS",
                        help="bound on measuring the modules (default: 300); the confirming runs go in full")
    parser.add_argument("--timeout", type=float_between(1.0, 1e9), default=600.0, metavar="SECONDS",
                        help="bound on each run of the script: the capture of its first steps and each confirming "
                             "run (default: 600); a run past it is stopped and the tuning ends with an error")
    parser.add_argument("--include-emulated", action="store_true",
                        help="measure bf16/fp16 even where this CPU emulates them")
    parser.add_argument("--no-progress", action="store_true",
                        help="say nothing on stderr while tuning (default: a line per stage and a status "
                             "line at least every 5 s)")
    add_script_arguments(parser)
    return parser  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run ``ampkit tune``; returns 0 (raises UsageError for bad input)."""
    from ampkit.errors import AmpError
    from ampkit.tools.tune.script import tune_script

    check_writable(args.out, "the plan", "ampkit tune", [args.script])
    check_writable(args.png, "the plan's plot", "ampkit tune", [args.script, args.out])
    if not Path(args.script).is_file():
        what = "no such file" if not Path(args.script).exists() else "not a file"
        raise UsageError(f"ampkit tune: {what}: {args.script!r}")
    if args.png is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"ampkit tune: --png needs matplotlib; install the extra: {install_hint('cli')}")
    out, png = launch_path(args.out), launch_path(args.png)  # the script may change folder while it is watched
    try:
        plan = tune_script(args.script, list(args.args), steps=args.steps, budget=args.budget,
                           max_seconds=args.max_seconds, include_emulated=args.include_emulated,
                           timeout=args.timeout, progress=not args.no_progress)  # fmt: skip
    except AmpError as err:
        raise UsageError(f"ampkit tune: {err}") from None
    print(plan.report())
    write_output(out, plan.save, "the plan", "ampkit tune")
    print(f"wrote {args.out}: run the script with it by `ampkit run --plan {args.out} {args.script}`")
    if png is not None:
        write_output(png, plan.save_png, "the plan's plot", "ampkit tune")
        print(f"wrote {args.png}")
    return 0
