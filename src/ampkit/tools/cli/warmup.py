"""``ampkit warmup``: compile the O2/O2K optimizer update kernels into Inductor's on-disk
cache (``TORCHINDUCTOR_CACHE_DIR``) ahead of a job, so that its first step loads them
instead of compiling them (docs/benchmarks/first_step.md has recorded figures). Run it
with the job's torch, cache folder and machine, e.g. in a container image's build step;
Inductor keeps a CPU kernel per thread count, so it compiles at 1 thread and at this
machine's default unless ``--threads`` names the job's. Prints one line per
configuration and the cache folder; ``--json`` also writes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from ampkit._internal.files import write_text

from ._common import UsageError, add_command, check_writable, write_output

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from ampkit.tools.warmup import OPTIMIZERS, compiled_levels

    parser = add_command(sub, "warmup", "compile O2/O2K's update kernels into Inductor's cache ahead of a job", __doc__)
    parser.add_argument("--level", action="append", choices=compiled_levels(), default=None,
                        help=f"a level to warm, repeatable (default: {' and '.join(compiled_levels())}, "
                             "those that compute in --dtype)")
    parser.add_argument("--optimizer", action="append", choices=tuple(OPTIMIZERS), default=None,
                        help="an update rule to warm, repeatable (default: adamw; "
                             + "; ".join(f"{k}: {v}" for k, v in OPTIMIZERS.items()) + ")")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                        help="16-bit dtype of the job (default: bf16; fp16 warms O2 only)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device type of the job (default: cpu)")
    parser.add_argument("--threads", action="append", type=int, default=None, metavar="N",
                        help="torch's thread count in the job, repeatable (default: 1 and this machine's default; "
                             "torchrun and OMP_NUM_THREADS=1 give 1)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    return parser  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run ``ampkit warmup``; returns 0 (raises UsageError for bad input)."""
    from ampkit.errors import AmpError
    from ampkit.tools.warmup import cache_dir, warm

    check_writable(args.json, "the JSON results", "ampkit warmup")
    try:
        results = warm(args.level, args.dtype, args.optimizer or ["adamw"], args.device, args.threads)
    except AmpError as err:
        raise UsageError(f"ampkit warmup: {err}") from None
    folder = cache_dir()
    for r in results:
        how = "compiled" if r.compiled else "nothing compiled: this step runs torch's kernels (no C++ compiler, or a level that compiles none, e.g. fp16 at O2 with a dynamic loss scale)"
        print(f"{r.level} {r.dtype} {r.optimizer} on {r.device}, {r.threads} thread{'s' if r.threads > 1 else ''}: "
              f"{r.seconds:.1f} s ({how})")
    print(f"Inductor's cache: {folder}")
    if args.json is not None:
        doc = {"cache_dir": folder, "results": [dataclasses.asdict(r) for r in results]}
        text = json.dumps(doc, indent=2)
        write_output(args.json, lambda p: write_text(p, text, "the JSON results"), "the JSON results", "ampkit warmup")
    return 0
