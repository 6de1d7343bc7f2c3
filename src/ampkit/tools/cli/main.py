"""``ampkit`` command: ``ampkit bench`` trains the built-in workloads under fp32,
torch.autocast and ampkit's opt levels, interleaved, and reports speed, memory and
accuracy side by side; ``ampkit convert`` turns a training checkpoint into a 16-bit
inference model (and ONNX) and reports size, speed and error against fp32; ``ampkit
doctor script.py [args]`` runs a training script with :func:`ampkit.doctor` on and
prints its report; ``ampkit run script.py [args]`` trains an unmodified script in mixed
precision (``--compare``: side by side with fp32); ``ampkit warmup`` compiles O2/O2K's
update kernels into Inductor's on-disk cache ahead of a job; ``ampkit tune script.py
[args]`` writes the fastest per-module precision plan within a loss budget.

Exit codes: 0 success, 1 a precision failed while training, 2 bad input or
environment (one line on stderr), 130 interrupted; ``ampkit doctor`` and ``ampkit run`` pass the
script's own exit code through.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from ampkit._internal.install import install_hint
from ampkit._internal.paths import unwritable_reason

from ._common import UsageError, int_between, positive_int, thread_count, write_output

__all__ = ["main", "build_parser", "bench_config"]

PROG = "ampkit"
CLI_EXTRA = ("rich", "matplotlib", "sklearn")


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def _version() -> str:
    """``ampkit X (torch Y, python Z)``: what ``ampkit --version`` prints."""
    import platform

    import torch

    from ampkit import __version__

    return f"{PROG} {__version__} (torch {torch.__version__}, python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    """The ``ampkit`` argument parser (sub-commands ``bench``, ``convert``, ``doctor``, ``run``,
    ``warmup`` and ``tune``)."""
    from ampkit.tools.bench.recipes import PRECISIONS

    parser = _Parser(prog=PROG, description="ampkit: automatic mixed precision for PyTorch.")
    parser.add_argument("--version", action="version", version=_version(),
                        help="print ampkit's version and the torch it runs on, then exit")  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    bench = sub.add_parser(
        "bench",
        help="benchmark mixed precision on built-in workloads",
        description=(
            "Train the built-in workloads (a CNN on sklearn digits, a character transformer "
            "on the Python standard library's source, a wide 38M-parameter MLP on the digits) "
            "under each precision, interleaved in one run, and print step time, speedup and "
            "memory vs fp32, step time vs pure bf16, final loss and accuracy, skipped steps "
            "and loss scale. Writes results.json and bench.png into --out."
        ),
    )
    bench.add_argument("--workload", choices=("cnn", "lm", "wide", "all"), default="all",
                       help="which workload to train (default: all three)")
    bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto = cuda when a GPU is available, else cpu (default: auto)")
    bench.add_argument("--dtype", choices=("bf16", "fp16"), default=None,
                       help="16-bit compute dtype (default: bf16 on cpu, fp16 on cuda)")
    bench.add_argument("--steps", type=positive_int, default=None,
                       help="training steps per workload and precision (default: per workload)")
    bench.add_argument("--quick", action="store_true",
                       help="smaller models and fewer steps: 84 s on one thread of a CPU with native bf16 "
                            "(the recorded run); longer where bf16 is emulated")
    bench.add_argument("--precisions", default=",".join(PRECISIONS),
                       help=f"comma-separated subset of: {', '.join(PRECISIONS)} (default: all)")
    bench.add_argument("--out", type=Path, default=Path("bench-out"),
                       help="folder for results.json and bench.png (default: bench-out)")
    bench.add_argument("--seed", type=int_between(0, 2**32 - 1), default=0,
                       help="seed of weights and batch order, 0 to 2**32-1 (default: 0)")
    bench.add_argument("--threads", type=thread_count, default=1,
                       help="torch CPU threads per training process, 1 to the CPU count (default: 1)")
    bench.add_argument("--system-malloc", action="store_true",
                       help="leave glibc's malloc at its defaults in the training processes: freed "
                            "blocks go back to the OS and are faulted in again by later steps, by an "
                            "amount that varies from process to process (default: freed memory is "
                            "kept in each process, so step times compare the precisions)")
    # Internal knobs (tests, experiments): model size preset and interleaving block.
    bench.add_argument("--size", choices=("full", "quick", "tiny"), default=None, help=argparse.SUPPRESS)
    bench.add_argument("--block", type=positive_int, default=None, help=argparse.SUPPRESS)
    bench.add_argument("--no-progress", action="store_true", help=argparse.SUPPRESS)
    from .convert import add_parser as add_convert_parser

    add_convert_parser(sub)
    from .doctor import add_parser as add_doctor_parser

    add_doctor_parser(sub)
    from .run import add_parser as add_run_parser

    add_run_parser(sub)
    from .warmup import add_parser as add_warmup_parser

    add_warmup_parser(sub)
    from .tune import add_parser as add_tune_parser

    add_tune_parser(sub)
    return parser


def _check_cli_extra() -> None:
    missing = [m for m in CLI_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        names = ", ".join("scikit-learn" if m == "sklearn" else m for m in missing)
        raise UsageError(
            f"{PROG} bench: missing {names}; install the command-line extra: {install_hint('cli')}"
        )


BENCH_FILES = ("results.json", "bench.png")


def _check_out_dir(out: Path) -> Path:
    """Create ``out`` and check, before minutes of training, that the files it gets
    (:data:`BENCH_FILES`) can be written there: a new file can be created in it, and
    neither name is taken by a folder, a symlink, a FIFO or a device."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
    else:
        problems = ((name, unwritable_reason(out / name)) for name in BENCH_FILES)
        reason = next((f"{name}: {why}" for name, why in problems if why is not None), None)
        if reason is None:
            return out
    raise UsageError(
        f"{PROG} bench: cannot write to output folder {str(out)!r} ({reason}); pass a writable folder with --out"
    )


def bench_config(args: argparse.Namespace) -> Any:
    """The :class:`~ampkit.tools.bench.runner.BenchConfig` of parsed ``ampkit bench``
    arguments (the device resolved); a bad setting raises ``UsageError``."""
    from ampkit.tools.bench.runner import BenchConfig, BenchError, resolve_device

    try:
        device = resolve_device(args.device)
        precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
        return BenchConfig(
            workloads=("cnn", "lm", "wide") if args.workload == "all" else (args.workload,),
            precisions=precisions,
            device=device,
            dtype=args.dtype or ("fp16" if device == "cuda" else "bf16"),
            size=args.size or ("quick" if args.quick else "full"),
            steps=args.steps,
            seed=args.seed,
            threads=args.threads,
            block=args.block,
            hold_freed_memory=not args.system_malloc,
        )
    except BenchError as exc:
        raise UsageError(f"{PROG} bench: {exc}") from None


def _bench(args: argparse.Namespace) -> int:
    _check_cli_extra()
    config = bench_config(args)
    out = _check_out_dir(args.out)

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ampkit.tools.bench.report import render_tables, write_json, write_plot
    from ampkit.tools.bench.runner import run_bench

    torch.set_num_threads(1)  # the parent only coordinates; workers set --threads
    err = Console(stderr=True)
    if config.device == "cpu" and config.dtype == "fp16":
        err.print(
            "[yellow]note:[/] fp16 on CPU has no fast matmul/conv kernels on most CPUs and "
            "runs many times slower than fp32; bf16 is the CPU default"
        )
    tasks: dict[str, Any] = {}
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, refresh_per_second=4, disable=args.no_progress,
    )

    def on_progress(workload: str, done: int, total: int) -> None:
        if workload not in tasks:
            tasks[workload] = progress.add_task(f"{workload}: training steps", total=total)
        progress.update(tasks[workload], completed=done, total=total)

    def announce(workload: str, description: str) -> None:
        progress.console.print(f"[bold]{workload}[/]: {description}")

    with progress:
        results = run_bench(config, progress=on_progress, announce=announce)

    render_tables(results)
    json_path, png_path = out / "results.json", out / "bench.png"
    write_output(json_path, lambda path: write_json(results, path), "the results", f"{PROG} bench")
    write_output(png_path, lambda path: write_plot(results, path), "the plot", f"{PROG} bench")
    print(f"wrote {json_path} and {png_path} ({results['wall_seconds']:.0f} s)")
    failed = [
        f"{w}/{p}"
        for w, wl in results["workloads"].items()
        for p, e in wl["precisions"].items()
        if e.get("status") == "error"
    ]
    if failed:
        print(f"{PROG} bench: training failed for {', '.join(failed)}; see 'note' in the table "
              f"and the traceback in {json_path}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ampkit`` command with ``argv`` (default ``sys.argv[1:]``); returns
    the exit code."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        if args.command == "convert":
            from .convert import run as run_convert

            return run_convert(args)
        if args.command == "doctor":
            from .doctor import run as run_doctor

            return run_doctor(args)
        if args.command == "run":
            from .run import run as run_script

            return run_script(args)
        if args.command == "warmup":
            from .warmup import run as run_warmup

            return run_warmup(args)
        if args.command == "tune":
            from .tune import run as run_tune

            return run_tune(args)
        return _bench(args)
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
