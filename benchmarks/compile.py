"""Step time of torch.compile'd training: torch.autocast vs ampkit (default policy,
a custom policy, O2), each around a compiled model.

All modes run interleaved in one process (round-robin blocks of steps) on copies of
the same model and the same batches. Each mode compiles its own model first
(untimed warm-up: compilation takes minutes on a small CPU). Prints median step
times and ratios to compiled torch.autocast. Target: ampkit default <= 1.02x.

    python benchmarks/compile.py [--workloads cnn,lm] [--size full] [--rounds 6] [--clock cpu]
    python benchmarks/compile.py --micro   # what ampkit adds per compiled call, in microseconds

``--micro`` times one call of a compiled 4-layer MLP (tiny, so the call's fixed costs
show: guards, ampkit's hooks on the compiled module) under each mode, interleaved. On
a loaded or slow-bf16 machine the step ratios above are mostly noise; this says what
ampkit adds to a compiled step, whatever its size.

``--json FILE`` also writes the machine (CPU, its 16-bit flags, torch, date, command),
the settings and the table's rows: per workload ``autocast_ms``, ``default_ms``,
``custom_ms``, ``o2_ms``, their ratios to torch.autocast (``default_over_autocast``,
...), each mode's ``compile_warmup_s`` and, with ``--control``,
``control_over_autocast``; with ``--micro``, per mode ``us_per_call`` and ``added_us``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp
from ampkit.tools.bench.machine import write_record
from ampkit.tools.bench.workloads import SIZES, make_workload

CUSTOM = amp.Policy(
    fp32_ops=[F.softmax, F.log_softmax],
    lower_ops=[F.gelu],
    module_rules={nn.LayerNorm: torch.float32},
)


def bench(name: str, size: str, rounds: int, steps: int, dtype: torch.dtype, clock,
          control: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per compiled step of each mode, and the seconds each mode's
    compilation and warm-up took."""
    wl = make_workload(name, size)
    torch.manual_seed(0)
    base = wl.build_model()
    x, y = wl.example_batch()
    default, custom = amp.default_policy("cpu", dtype), CUSTOM.override(dtype=dtype)
    for policy in (default, custom):  # register ampkit's kernels before compiling anything
        with amp.autocast(policy, "cpu"):
            pass

    def plain(model, opt):
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs = {}
    modes = {
        "torch.autocast": lambda: torch.autocast("cpu", dtype=dtype),
        "ampkit default": lambda: amp.autocast(default, "cpu"),
        "ampkit custom": lambda: amp.autocast(custom, "cpu"),
    }
    if control:  # a second torch.autocast copy: its ratio to the first is the noise level
        modes["torch.autocast (2nd copy)"] = modes["torch.autocast"]
    for mode, ctx in modes.items():
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        runs[mode] = (torch.compile(model), opt, ctx)
    # O2: a bf16 model with fp32 masters (initialize starts the AMP session it steps in)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype)
    runs["ampkit O2"] = (torch.compile(model), opt, contextlib.nullcontext)

    def step(mode, model, opt, ctx):
        with ctx():
            loss = wl.loss(model(x), y).float()
        if mode == "ampkit O2":
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            plain(model, opt)
        else:
            loss.backward()
            plain(model, opt)

    warmup_s: dict[str, float] = {}
    for mode, (model, opt, ctx) in runs.items():  # compile (forward and backward)
        t0 = time.perf_counter()
        for _ in range(2):
            step(mode, model, opt, ctx)
        warmup_s[mode] = time.perf_counter() - t0
        print(f"  {name}: {mode} compiled and warmed up in {warmup_s[mode]:.0f} s", flush=True)
    times: dict[str, list[float]] = {m: [] for m in runs}
    for _ in range(rounds):
        for mode, (model, opt, ctx) in runs.items():
            t0 = clock()
            for _ in range(steps):
                step(mode, model, opt, ctx)
            times[mode].append((clock() - t0) / steps)
    amp.reset()
    return {m: statistics.median(v) for m, v in times.items()}, warmup_s


def micro(rounds: int, dtype: torch.dtype, clock) -> list[dict[str, float | str]]:
    """Microseconds per compiled call of each mode; prints the table and returns its rows."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16))
    x = torch.randn(4, 16)
    default, custom = amp.default_policy("cpu", dtype), CUSTOM.override(dtype=dtype)
    for policy in (default, custom):
        with amp.autocast(policy, "cpu"):
            pass
    modes = {
        "torch.autocast": (torch.compile(copy.deepcopy(base)), lambda: torch.autocast("cpu", dtype=dtype)),
        "ampkit default": (torch.compile(copy.deepcopy(base)), lambda: amp.autocast(default, "cpu")),
        "ampkit custom": (torch.compile(copy.deepcopy(base)), lambda: amp.autocast(custom, "cpu")),
    }
    n = 300

    def run(model, ctx):
        with torch.no_grad(), ctx():
            for _ in range(n):
                model(x)

    for model, ctx in modes.values():
        run(model, ctx)  # compile
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, (model, ctx) in modes.items():
            t0 = clock()
            run(model, ctx)
            times[mode].append((clock() - t0) / n * 1e6)
    ref = statistics.median(times["torch.autocast"])
    print(f"{'mode':<16} {'us per compiled call':>21} {'added us':>9}")
    rows: list[dict[str, float | str]] = []
    for mode, ts in times.items():
        t = statistics.median(ts)
        print(f"{mode:<16} {t:>21.1f} {t - ref:>9.1f}")
        rows.append({"mode": mode, "us_per_call": t, "added_us": t - ref})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="cnn,lm", help="ampkit bench workloads: cnn, lm, wide")
    p.add_argument("--size", default="full", choices=SIZES, help="the workloads' size (tiny: a smoke run)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="steps per round per mode")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: this process's CPU time (steady when other processes load the machine)")
    p.add_argument("--micro", action="store_true", help="per-call cost on a tiny compiled model")
    p.add_argument("--control", action="store_true",
                   help="also time a second torch.autocast copy (an A/A ratio: the noise level)")
    p.add_argument("--json", metavar="FILE", help="also write the machine, the settings and the table's rows to FILE")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    settings = {"device": "cpu", "dtype": args.dtype, "threads": args.threads, "rounds": args.rounds,
                "clock": args.clock}  # fmt: skip
    if args.micro:
        print(f"device=cpu dtype={dtype} torch={torch.__version__} rounds={args.rounds}, median ({args.clock} clock)")
        rows = micro(args.rounds, dtype, clock)
        if args.json:
            write_record(args.json, {"measurement": "micro", "settings": settings, "rows": rows}, threads=args.threads)
            print(f"wrote {args.json}")
        return
    print(f"device=cpu dtype={dtype} threads={args.threads} torch={torch.__version__} "
          f"rounds={args.rounds}x{args.steps} steps, median compiled step time ({args.clock} clock)")
    header = (f"{'workload':<12} {'autocast ms':>12} {'default ms':>11} {'custom ms':>10} {'O2 ms':>8} "
              f"{'default/autocast':>17} {'custom/autocast':>16} {'O2/autocast':>12}")
    rows = []
    for name in args.workloads.split(","):
        r, warmup_s = bench(name, args.size, args.rounds, args.steps, dtype, clock, args.control)
        ac = r["torch.autocast"]
        row = {"workload": name, "autocast_ms": ac * 1e3, "default_ms": r["ampkit default"] * 1e3,
               "custom_ms": r["ampkit custom"] * 1e3, "o2_ms": r["ampkit O2"] * 1e3,
               "default_over_autocast": r["ampkit default"] / ac, "custom_over_autocast": r["ampkit custom"] / ac,
               "o2_over_autocast": r["ampkit O2"] / ac, "compile_warmup_s": warmup_s}  # fmt: skip
        if args.control:
            row["control_over_autocast"] = r["torch.autocast (2nd copy)"] / ac
            print(f"  {name}: A/A control, 2nd torch.autocast copy / 1st = "
                  f"{row['control_over_autocast']:.3f}", flush=True)
        rows.append(row)
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['workload']:<12} {row['autocast_ms']:>12.1f} {row['default_ms']:>11.1f} "
              f"{row['custom_ms']:>10.1f} {row['o2_ms']:>8.1f} "
              f"{row['default_over_autocast']:>17.3f} {row['custom_over_autocast']:>16.3f} "
              f"{row['o2_over_autocast']:>12.3f}", flush=True)
    if args.json:
        settings.update(size=args.size, steps=args.steps, control=args.control)
        write_record(args.json, {"measurement": "steps", "settings": settings, "rows": rows}, threads=args.threads)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
