"""The first training step of a process, per precision, on a cold and on a warmed
Inductor cache: what a user waits for before the first progress line.

Each arm is a fresh Python process (imports done before the clock starts) that builds
a model, sets the precision up and times its first three steps. The models: the bench's
``lm`` workload at ``--size``, and ``chargpt``, a 6-layer, 384-wide character GPT (6
heads, context 64, batch 4: the size of nanoGPT's Shakespeare-character model, with a
short context so the step itself stays short). The arms run side by side in one
invocation:

- ``cold``: an empty ``TORCHINDUCTOR_CACHE_DIR`` per arm (a new machine or container);
- ``warm``: one cache folder filled by ``ampkit warmup`` before the arms run.

fp32 and O1 compile nothing; O2 and O2K compile their optimizer update kernels at the
first step; each arm also records whether ampkit printed its "compiling the update
kernels" notice (it does when the compile takes over 2 s). Targets (issue "the first
hour"): cold, O2/O2K's first step at most 10 s more than fp32's; warm, under 2 s more,
with no notice.

    python benchmarks/first_step.py [--size quick] [--workloads lm,chargpt] [--json first_step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LEVELS = ("fp32", "O1", "O2", "O2K")
WORKLOADS = ("lm", "chargpt")
CHARGPT = {"d_model": 384, "n_layers": 6, "n_heads": 6, "seq_len": 64, "batch_size": 4}
NOTICE = "ampkit: compiling the "  # update_kernels' notice after 2 s of a compile
COMPILED = ("O2", "O2K")  # the levels `ampkit warmup` warms

ARM = """
import dataclasses, json, sys, time
import torch
torch.set_num_threads(1)
import ampkit as amp
from ampkit.tools.bench import make_workload
level, workload, size = sys.argv[1], sys.argv[2], sys.argv[3]
if workload == "chargpt":
    w = make_workload("lm", "tiny")
    w.cfg = dataclasses.replace(w.cfg, **json.loads(sys.argv[4]))
else:
    w = make_workload("lm", size)
torch.manual_seed(0)
model = w.build_model()
opt = w.build_optimizer(model)
if level != "fp32":
    model, opt = amp.initialize(model, opt, opt_level=level)
batches = w.batches(torch.Generator().manual_seed(0))
times = []
for _ in range(3):
    x, y = next(batches)
    start = time.perf_counter()
    loss = w.loss(model(x), y)
    if level == "fp32":
        loss.backward()
    else:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def _env(cache: Path) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), PYTHONPATH=path, OMP_NUM_THREADS="1")


def _arm(level: str, workload: str, size: str, cache: Path) -> tuple[list[float], bool]:
    """The first three steps' seconds of one arm, and whether it printed the notice."""
    out = subprocess.run([sys.executable, "-c", ARM, level, workload, size, json.dumps(CHARGPT)], env=_env(cache),
                         capture_output=True, text=True, check=True, timeout=900)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1]), NOTICE in out.stderr


def _run(workload: str, size: str, levels: list[str], tmp: Path, warm_cache: Path) -> dict[str, Any]:
    """Every level's arms on one model, cold then warm; the figures of one table."""
    rows = []
    for level in levels:
        (cold, cold_notice), (warm, warm_notice) = (_arm(level, workload, size, tmp / f"cold-{workload}-{level}"),
                                                    _arm(level, workload, size, warm_cache))  # fmt: skip
        rows.append({"level": level, "cold_first_s": cold[0], "warm_first_s": warm[0],
                     "later_step_s": min(cold[1:] + warm[1:]), "cold_notice": cold_notice,
                     "warm_notice": warm_notice})  # fmt: skip
    for r in rows:
        r["cold_over_fp32_s"] = r["cold_first_s"] - rows[0]["cold_first_s"]
        r["warm_over_fp32_s"] = r["warm_first_s"] - rows[0]["warm_first_s"]
    shape = f"{CHARGPT['n_layers']} layers × {CHARGPT['d_model']}" if workload == "chargpt" else size
    return {"workload": workload, "size": shape, "rows": rows}


def _print(run: dict[str, Any]) -> None:
    print(f"{run['workload']} ({run['size']})")
    print(f"{'level':6} {'cold first s':>13} {'vs fp32':>8} {'warm first s':>13} {'vs fp32':>8} {'later step s':>13} "
          f"{'notice cold/warm':>17}")  # fmt: skip
    for r in run["rows"]:
        notice = f"{'yes' if r['cold_notice'] else 'no'}/{'yes' if r['warm_notice'] else 'no'}"
        print(f"{r['level']:6} {r['cold_first_s']:13.2f} {r['cold_over_fp32_s']:+8.2f} "
              f"{r['warm_first_s']:13.2f} {r['warm_over_fp32_s']:+8.2f} {r['later_step_s']:13.3f} {notice:>17}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="quick", choices=("full", "quick", "tiny"), help="lm workload size")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--levels", default=",".join(LEVELS),
                        help=f"comma-separated, fp32 first (default: {','.join(LEVELS)}); `ampkit warmup` warms "
                             "the compiled ones among them (both where none is)")  # fmt: skip
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated models, of {', '.join(WORKLOADS)} (default: both)")  # fmt: skip
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if not workloads or not set(workloads) <= set(WORKLOADS) or len(set(workloads)) != len(workloads):
        parser.error(f"--workloads {args.workloads!r}: distinct names of {', '.join(WORKLOADS)}")
    levels = args.levels.split(",")
    if levels[0] != "fp32" or len(set(levels)) != len(levels) or not set(levels) <= set(LEVELS):
        parser.error(f"--levels {args.levels!r}: distinct levels of {', '.join(LEVELS)}, fp32 first")
    warmed = [level for level in COMPILED if level in levels] or list(COMPILED)
    with tempfile.TemporaryDirectory() as tmp:
        warm_cache = Path(tmp) / "warm"
        start = time.perf_counter()
        only = [] if warmed == list(COMPILED) else [a for level in warmed for a in ("--level", level)]
        subprocess.run([sys.executable, "-m", "ampkit", "warmup", *only], env=_env(warm_cache), check=True,
                       capture_output=True, timeout=900)  # fmt: skip
        warmup_s = time.perf_counter() - start
        runs = [_run(workload, args.size, levels, Path(tmp), warm_cache) for workload in workloads]
    print(f"1 thread; `ampkit warmup` ({' + '.join(warmed)}, AdamW) took {warmup_s:.1f} s")
    for run in runs:
        _print(run)
    if args.json:
        sys.path.insert(0, str(ROOT / "src"))
        from ampkit.tools.bench.machine import write_record

        # the first model's table at the top level, the others under "more"
        write_record(args.json, {**runs[0], "warmup_s": warmup_s, "more": runs[1:]}, threads=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
