"""The first training step of a process, per precision, on a cold and on a warmed
Inductor cache: what a user waits for before the first progress line.

Each arm is a fresh Python process (imports done before the clock starts) that builds
the bench ``lm`` workload, sets the precision up and times its first three steps. The
arms run side by side in one invocation:

- ``cold``: an empty ``TORCHINDUCTOR_CACHE_DIR`` per arm (a new machine or container);
- ``warm``: one cache folder filled by ``ampkit warmup`` before the arms run.

fp32 and O1 compile nothing; O2 and O2K compile their optimizer update kernels at the
first step. Targets (issue "the first hour"): cold, O2/O2K's first step at most 10 s
more than fp32's; warm, under 2 s more.

    python benchmarks/first_step.py [--size quick] [--json first_step.json]
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

ROOT = Path(__file__).resolve().parents[1]
LEVELS = ("fp32", "O1", "O2", "O2K")
COMPILED = ("O2", "O2K")  # the levels `ampkit warmup` warms

ARM = """
import json, sys, time
import torch
torch.set_num_threads(1)
import ampkit as amp
from ampkit.tools.bench import make_workload
level, size = sys.argv[1], sys.argv[2]
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


def _arm(level: str, size: str, cache: Path) -> list[float]:
    out = subprocess.run([sys.executable, "-c", ARM, level, size], env=_env(cache), capture_output=True,
                         text=True, check=True, timeout=900)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="quick", choices=("full", "quick", "tiny"), help="lm workload size")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--levels", default=",".join(LEVELS),
                        help=f"comma-separated, fp32 first (default: {','.join(LEVELS)}); `ampkit warmup` warms "
                             "the compiled ones among them (both where none is)")  # fmt: skip
    args = parser.parse_args()
    levels = args.levels.split(",")
    if levels[0] != "fp32" or len(set(levels)) != len(levels) or not set(levels) <= set(LEVELS):
        parser.error(f"--levels {args.levels!r}: distinct levels of {', '.join(LEVELS)}, fp32 first")
    warmed = [level for level in COMPILED if level in levels] or list(COMPILED)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        warm_cache = Path(tmp) / "warm"
        start = time.perf_counter()
        only = [] if warmed == list(COMPILED) else [a for level in warmed for a in ("--level", level)]
        subprocess.run([sys.executable, "-m", "ampkit", "warmup", *only], env=_env(warm_cache), check=True,
                       capture_output=True, timeout=900)  # fmt: skip
        warmup_s = time.perf_counter() - start
        for level in levels:
            cold = _arm(level, args.size, Path(tmp) / f"cold-{level}")
            warm = _arm(level, args.size, warm_cache)
            rows.append({"level": level, "cold_first_s": cold[0], "warm_first_s": warm[0],
                         "later_step_s": min(cold[1:] + warm[1:])})  # fmt: skip
    fp32 = rows[0]
    print(f"lm ({args.size}), 1 thread; `ampkit warmup` ({' + '.join(warmed)}, AdamW) took {warmup_s:.1f} s")
    print(f"{'level':6} {'cold first s':>13} {'vs fp32':>8} {'warm first s':>13} {'vs fp32':>8} {'later step s':>13}")
    for r in rows:
        r["cold_over_fp32_s"] = r["cold_first_s"] - fp32["cold_first_s"]
        r["warm_over_fp32_s"] = r["warm_first_s"] - fp32["warm_first_s"]
        print(f"{r['level']:6} {r['cold_first_s']:13.2f} {r['cold_over_fp32_s']:+8.2f} "
              f"{r['warm_first_s']:13.2f} {r['warm_over_fp32_s']:+8.2f} {r['later_step_s']:13.3f}")  # fmt: skip
    if args.json:
        sys.path.insert(0, str(ROOT / "src"))
        from ampkit.tools.bench.machine import write_record

        write_record(args.json, {"workload": "lm", "size": args.size, "warmup_s": warmup_s, "rows": rows}, threads=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
