"""``ampkit run [options] SCRIPT [ARGS...]``: mixed precision for an unmodified training
script (see :mod:`ampkit.tools.run`), a summary on stderr at exit, ``--report`` JSON, and
``--compare``: the script run twice, fp32 then the chosen level, each in its own
process, with the loss curves and iteration times side by side (a rich table and a PNG).
``--doctor`` (or ``AMPKIT_DOCTOR=1``): :func:`ampkit.doctor` watches every optimizer the
run manages, and its report is printed after the summary, as ``ampkit doctor`` prints it.

Exit codes: the script's own (0, its ``sys.exit`` code, 1 after an uncaught exception);
2 with one line on stderr for bad input (no such script, an unknown level, a combination
that cannot work, an output that cannot be written) and when the precision cannot be
applied exactly (fp16 loss scaling for a manual ``p.data`` update: bf16 is proposed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ampkit._internal.files import read_json, write_file, write_text
from ampkit._internal.install import install_hint
from ampkit.errors import AmpError

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

PNG_DEFAULT = Path("ampkit-compare.png")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from ampkit.levels.opt_level import DEFAULT_LEVEL, level_choices
    from ampkit.tools.run.config import FP32, run_levels

    parser = add_command(sub, "run", "train an unmodified script in mixed precision (and --compare it with fp32)", __doc__)
    parser.add_argument("--level", choices=run_levels(), default=None,
                        help=f"{level_choices(run_levels()[:-1])}, or {FP32} (nothing applied: the script as it "
                             f"is, observed); default: $AMPKIT_LEVEL, else {DEFAULT_LEVEL}")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default=None,
                        help="16-bit compute dtype (default: $AMPKIT_DTYPE, else bf16; fp16 on a GPU "
                             "without bf16)")
    parser.add_argument("--plan", type=Path, default=None, metavar="PLAN.json",
                        help="apply a per-module plan written by ampkit.tune / ampkit tune: its kept "
                             "modules stay fp32; its level and dtype are the defaults of --level/--dtype")
    parser.add_argument("--report", type=Path, default=None, metavar="PATH",
                        help="also write the summary as JSON (with the loss values)")
    parser.add_argument("--steps", type=positive_int, default=None, metavar="N",
                        help="end the script after N iterations (steps of the first optimizer it builds)")
    parser.add_argument("--time", type=float_between(1e-3, 1e9), default=None, metavar="SECONDS",
                        help="end the script at the first iteration after SECONDS")
    parser.add_argument("--compare", action="store_true",
                        help="run the script twice, fp32 then --level, and show the loss curves and "
                             "iteration times side by side (needs the cli extra)")
    parser.add_argument("--doctor", action="store_true",
                        help="watch the run's steps with ampkit.doctor and print its report at the end, as "
                             "ampkit doctor prints it (also on with AMPKIT_DOCTOR=1; not with --compare "
                             "or --level fp32); --report then holds it under \"doctor\"")
    parser.add_argument("--png", type=Path, default=None, metavar="PATH",
                        help=f"with --compare: where to write the plot (default: {PNG_DEFAULT})")
    add_script_arguments(parser)
    return parser


def _default_dtype() -> str:
    import torch

    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "fp16"
    return "bf16"


def _config(args: argparse.Namespace) -> Any:
    """The run's settings: the options, else ``AMPKIT_LEVEL``/``AMPKIT_DTYPE``, else the
    defaults (O1; bf16, or fp16 on a GPU without bf16)."""
    from ampkit._internal.dtypes import DTYPE_NAMES
    from ampkit._internal.env import dtype_from_env, level_from_env
    from ampkit.levels.opt_level import DEFAULT_LEVEL, checked_plan, is_fp32_level
    from ampkit.tools.run.config import FP32, RunConfig, run_levels

    try:
        plan = None
        if getattr(args, "plan", None) is not None:
            plan = checked_plan(args.plan, "--plan")
            args.level = args.level or (FP32 if is_fp32_level(plan.level) else plan.level)
            args.dtype = args.dtype or (plan.dtype if plan.dtype != "fp32" else None)
        args.level = args.level or level_from_env(DEFAULT_LEVEL, run_levels())
        env_dtype = None if args.dtype else dtype_from_env()
        dtype = args.dtype or DTYPE_NAMES.get(env_dtype) or _default_dtype()
        return RunConfig(level=args.level, dtype=dtype, max_steps=args.steps, time_budget=args.time, plan=plan)
    except AmpError as err:
        raise UsageError(f"ampkit run: {err}") from None


def run(args: argparse.Namespace) -> int:
    """Run ``ampkit run``; returns the exit code (raises UsageError for bad input)."""
    config = _config(args)
    check_writable(args.report, "the JSON report", "ampkit run", [args.script])
    if not Path(args.script).is_file():
        what = "no such file" if not Path(args.script).exists() else "not a file"
        raise UsageError(f"ampkit run: {what}: {args.script!r}")
    args.report = launch_path(args.report)  # where the command was started, wherever the script goes
    doctor = _doctor_asked(args, config)
    if args.compare:
        return _compare(args, config)
    if args.png is not None:
        raise UsageError("ampkit run: --png goes with --compare")
    from ampkit.tools.diagnosis._script import doctor_reports
    from ampkit.tools.run import RunRefused, ScriptError, is_rank_zero, run_script, write_report

    with doctor_reports() if doctor else contextlib.nullcontext([]) as reports:
        try:
            result = run_script(args.script, list(args.args), config)
        except (ScriptError, RunRefused) as err:
            raise UsageError(f"ampkit run: {err}") from None
    _flush(sys.stdout)
    if is_rank_zero():
        _print_summary(result.summary())
        if doctor:
            _print_doctor(reports)
            if reports:
                result.report["doctor"] = reports[-1].to_dict()
        if args.report is not None:
            write_output(args.report, lambda path: write_report(result.report, path), "the JSON report", "ampkit run")
    return result.code


def _doctor_asked(args: argparse.Namespace, config: Any) -> bool:
    """Whether the doctor watches this run: ``--doctor``, or ``AMPKIT_DOCTOR=1`` (which
    ``--compare`` leaves to neither of its runs: it says so)."""
    from ampkit.tools.diagnosis import ENV, env_enabled

    if args.doctor and args.compare:
        raise UsageError(
            "ampkit run: --doctor goes without --compare (the comparison runs the script twice, in child "
            f"processes); diagnose the {config.level} run on its own: ampkit run --doctor --level {config.level} "
            f"--dtype {config.dtype} SCRIPT"
        )
    if args.doctor and config.level == "fp32":
        raise UsageError(
            "ampkit run: --doctor watches the steps ampkit manages, and --level fp32 manages none; "
            "choose a 16-bit level (--level O1, O2 or O2K)"
        )
    if args.doctor:
        return True
    if not env_enabled():
        return False
    if args.compare:
        print(f"ampkit run --compare: {ENV}=1 is left out of both runs; for the doctor's report run "
              f"ampkit run --doctor --level {config.level} SCRIPT", file=sys.stderr)  # fmt: skip
        return False
    return config.level != "fp32"


def _print_doctor(reports: list[Any]) -> None:
    """The doctor's report(s) on stdout (rich on a terminal), or one line on stderr
    saying why there is none."""
    if not reports:
        _print_summary("ampkit run: the doctor saw no step (no optimizer was stepped under ampkit): nothing to report")
        return
    for report in reports:
        try:
            report.print()
        except (OSError, ValueError):  # the script closed stdout
            pass
    _flush(sys.stdout)


def _flush(stream: Any) -> None:
    try:
        stream.flush()
    except (OSError, ValueError):  # the script closed it
        pass


def _print_summary(text: str) -> None:
    """The exit summary on stderr; a script that closed (or broke) stderr keeps its own
    exit code: the summary is lost, not the run's outcome."""
    try:
        print(text, file=sys.stderr)
    except (OSError, ValueError):
        pass


# ---------------------------------------------------------------------------------
# --compare
# ---------------------------------------------------------------------------------
def _child(args: argparse.Namespace, level: str, dtype: str, report: Path) -> tuple[int, str, str]:
    cmd = [sys.executable, "-m", "ampkit", "run", "--level", level, "--dtype", dtype, "--report", str(report)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    if args.time is not None:
        cmd += ["--time", repr(args.time)]
    cmd += [args.script, *args.args]
    from ampkit.tools.diagnosis import ENV

    env = {k: v for k, v in os.environ.items() if k != ENV}  # the comparison has no doctor
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def _compare(args: argparse.Namespace, config: Any) -> int:
    missing = [m for m in ("rich", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(
            f"ampkit run --compare: missing {', '.join(missing)}; install the command-line extra: "
            f"{install_hint('cli')}"
        )
    png = launch_path(args.png or PNG_DEFAULT)
    check_writable(png, "the plot", "ampkit run", [args.script, args.report])
    from rich.console import Console

    err = Console(stderr=True)
    reports = []
    label = f"{config.level} {config.dtype}"
    with tempfile.TemporaryDirectory(prefix="ampkit-compare-") as tmp:
        for level, name in (("fp32", "fp32"), (config.level, label)):
            err.print(f"[bold]ampkit run --compare[/]: running {args.script} under {name} ...")
            path = Path(tmp) / f"{level}.json"
            code, stdout, stderr = _child(args, level, config.dtype, path)
            if code != 0 or not path.exists():
                tail = "\n".join((stdout + stderr).strip().splitlines()[-15:])
                print(f"{tail}\nampkit run --compare: the {name} run exited with code {code}", file=sys.stderr)
                return code if code != 0 else 1
            try:
                report = read_json(path, f"the {name} run's report", AmpError)
            except AmpError as err:
                raise UsageError(f"ampkit run --compare: {err}") from None
            if not isinstance(report, dict):
                raise UsageError(f"ampkit run --compare: the {name} run's report is not a JSON object")
            report["last_line"] = _last_line(stdout)
            reports.append(report)
    render_compare(reports[0], reports[1], label)
    write_output(png, lambda path: write_compare_png(reports[0], reports[1], label, path), "the plot", "ampkit run")
    print(f"wrote {png}")
    if args.report is not None:
        text = json.dumps({"fp32": reports[0], label: reports[1]}, indent=1) + "\n"
        write_output(args.report, lambda path: write_text(path, text, "the JSON report"), "the JSON report", "ampkit run")
    return 0


def _tail_mean(values: list[float]) -> float | None:
    """The mean of the last tenth of a series (at least one value): the final loss."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return None
    n = max(1, len(finite) // 10)
    return sum(finite[-n:]) / n


def compare_rows(ref: list[float], amp: list[float], rows: int = 10) -> list[tuple[int, int, float, float]]:
    """The two series cut into ``rows`` consecutive windows of backward() calls: (first
    call, last call, fp32 mean, level mean) per window (one mini-batch's loss is noisy;
    a window's mean is what training moved)."""
    n = min(len(ref), len(amp))
    if n == 0:
        return []
    rows = min(rows, n)
    bounds = [round(i * n / rows) for i in range(rows + 1)]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        out.append((lo + 1, hi, sum(ref[lo:hi]) / (hi - lo), sum(amp[lo:hi]) / (hi - lo)))
    return out


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:60] if lines else ""


def render_compare(ref: dict[str, Any], amp: dict[str, Any], label: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for site, ref_values in ref["losses"].items():
        amp_values = amp["losses"].get(site, [])
        table = Table(title=f"loss at {site}", caption="window means of backward()'s loss")
        table.add_column("calls", justify="right")
        table.add_column("fp32", justify="right")
        table.add_column(label, justify="right")
        table.add_column("diff", justify="right")
        for lo, hi, a, b in compare_rows(ref_values, amp_values):
            diff = f"{(b - a) / abs(a) * 100:+.1f}%" if a != 0.0 and a == a and b == b else "-"
            table.add_row(f"{lo}-{hi}", f"{a:.4f}", f"{b:.4f}", diff)
        console.print(table)
    summary = Table(title="fp32 vs " + label)
    for col in ("run", "iterations", "ms/iter", "vs fp32", "final loss*", "skipped", "script's last line"):
        summary.add_column(col, justify="left" if col in ("run", "script's last line") else "right")
    base = ref["iteration_ms_median"]
    for name, rep in (("fp32", ref), (label, amp)):
        ms = rep["iteration_ms_median"]
        speed = f"{base / ms:.2f}x" if ms and base else "-"
        first_site = next(iter(rep["losses"]), None)
        final = _tail_mean(rep["losses"][first_site]) if first_site else None
        skipped = sum(o["skipped"] for o in rep["optimizers"])
        summary.add_row(
            name, str(rep["iterations"]), "-" if ms is None else f"{ms:.2f}", speed,
            "-" if final is None else f"{final:.4f}", str(skipped), rep.get("last_line", ""),
        )
    console.print(summary)
    console.print(
        "ms/iter: median time between steps of the first optimizer; vs fp32: fp32's ms/iter over "
        "the run's; * mean of the last tenth of the first loss series"
    )
    for note in amp["notes"]:
        console.print(f"note: {note}")


def _running_mean(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_compare_png(ref: dict[str, Any], amp: dict[str, Any], label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sites = list(ref["losses"])
    fig, axes = plt.subplots(1, max(1, len(sites)), figsize=(5.5 * max(1, len(sites)), 3.6), squeeze=False)
    for ax, site in zip(axes[0], sites):
        for name, values, color in (("fp32", ref["losses"][site], "C0"), (label, amp["losses"].get(site, []), "C1")):
            xs = range(1, len(values) + 1)
            ax.plot(xs, values, color=color, lw=0.6, alpha=0.3)
            ax.plot(xs, _running_mean(values), color=color, lw=1.5, label=f"{name} (running mean)")
        ax.set_yscale("log" if all(v > 0 for v in ref["losses"][site]) else "linear")
        ax.set_title(f"loss at {site}", fontsize=9)
        ax.set_xlabel("backward() call")
        ax.legend(fontsize=8)
    fig.suptitle(f"ampkit run --compare: {Path(ref['script']).name}", fontsize=10)
    fig.tight_layout()
    try:
        write_file(path, lambda f: fig.savefig(f, dpi=110, format="png"), "the plot")
    finally:
        plt.close(fig)
