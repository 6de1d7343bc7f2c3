"""Step time of fp32, torch.autocast, ampkit's default policy and a custom policy.

All four run interleaved in one process (round-robin blocks of steps), on the same
model weights and batches, so machine noise hits them alike. Prints median step
times and ratios. Targets: ampkit default <= 1.02x torch.autocast, custom <= 1.05x.

ampkit keeps its dispatcher kernels and global module hooks once installed (they are
inert outside its scopes, but not free); before each fp32 / torch.autocast block
``amp.reset()`` takes them down, so those columns time torch alone. Each ampkit block
enters its scope once untimed first (re-installing them).

    python benchmarks/engine_overhead.py [--workloads cnn,lm] [--size full] [--rounds 8]
    python benchmarks/engine_overhead.py --micro   # the engine's own costs, in microseconds
    python benchmarks/engine_overhead.py --clock cpu  # process CPU time: on a shared machine

``--micro`` times what the engine adds per event, interleaved with the same thing
under plain torch.autocast: a module call (global hooks), a scope entry and exit, and
a call of an op a policy overrides (a Python kernel). A step's overhead is about
(module calls x the first) + the second + (overridden op calls x the third); on a
machine whose 16-bit kernels are slow (no native bf16) the step ratios below are
dominated by compute and noise, and these figures say more.

``--json FILE`` also writes the machine (CPU, its 16-bit flags, torch, date, command),
the settings and the table's rows: per workload ``fp32_ms``, ``autocast_ms``,
``default_ms``, ``custom_ms`` and the ratios ``autocast_over_fp32``,
``default_over_autocast``, ``custom_over_autocast``; with ``--micro``, per event
``torch_autocast_us``, ``ampkit_us``, ``added_us``.
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


def modes(device: str, dtype: torch.dtype):
    return {
        "fp32": contextlib.nullcontext,
        "torch.autocast": lambda: torch.autocast(device, dtype=dtype),
        "ampkit default": lambda: amp.autocast(amp.default_policy(device, dtype), device),
        "ampkit custom": lambda: amp.autocast(CUSTOM.override(dtype=dtype), device),
    }


CLOCK = time.perf_counter  # --clock cpu: time.process_time, blind to other processes' load


def bench(name: str, size: str, rounds: int, steps: int, device: str, dtype: torch.dtype) -> dict[str, float]:
    wl = make_workload(name, size, device=device)
    torch.manual_seed(0)
    base = wl.build_model()
    batch = wl.example_batch()
    runs = {}
    for mode, ctx in modes(device, dtype).items():
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        runs[mode] = (model, opt, ctx)
    times: dict[str, list[float]] = {m: [] for m in runs}

    def step(model, opt, ctx):
        with ctx():
            loss = wl.loss(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for model, opt, ctx in runs.values():  # warm-up
        for _ in range(2):
            step(model, opt, ctx)
    for _ in range(rounds):
        for mode, (model, opt, ctx) in runs.items():
            if mode.startswith("ampkit"):
                with ctx():
                    pass
            else:
                amp.reset()  # torch's own kernels and no global hooks
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = CLOCK()
            for _ in range(steps):
                step(model, opt, ctx)
            if device == "cuda":
                torch.cuda.synchronize()
            times[mode].append((CLOCK() - t0) / steps)
    return {m: statistics.median(v) for m, v in times.items()}


def micro(rounds: int, dtype: torch.dtype) -> list[dict[str, float | str]]:
    """Microseconds per event, ampkit vs torch.autocast, medians of interleaved rounds;
    prints the table and returns its rows."""
    torch.manual_seed(0)
    tiny = nn.Sequential(*[nn.Identity() for _ in range(64)])  # 65 module calls, no compute
    x = torch.randn(8, 8)
    default = amp.default_policy("cpu", dtype)
    over = amp.Policy(dtype=dtype, fp32_ops=["mm"], lower_ops=["softmax"])

    def per_call(fn, n):
        t0 = CLOCK()
        for _ in range(n):
            fn()
        return (CLOCK() - t0) / n * 1e6

    def in_scope(ctx, fn):
        def run():
            with ctx():
                fn()
        return run

    def calls(fn, n):
        def run():
            for _ in range(n):
                fn()
        return run

    cases = {  # name -> (label, calls per run, torch.autocast fn, ampkit fn, ampkit scope to restore first)
        "module call": (65, in_scope(lambda: torch.autocast("cpu", dtype=dtype), lambda: tiny(x)),
                        in_scope(lambda: amp.autocast(default, "cpu"), lambda: tiny(x))),
        "scope enter+exit": (1, in_scope(lambda: torch.autocast("cpu", dtype=dtype), lambda: None),
                             in_scope(lambda: amp.autocast(default, "cpu"), lambda: None)),
        "overridden mm (fp32)": (20, in_scope(lambda: torch.autocast("cpu", dtype=dtype), calls(lambda: torch.mm(x, x), 20)),
                                 in_scope(lambda: amp.autocast(over, "cpu"), calls(lambda: torch.mm(x, x), 20))),
        "overridden softmax (bf16)": (20, in_scope(lambda: torch.autocast("cpu", dtype=dtype), calls(lambda: F.softmax(x, -1), 20)),
                                      in_scope(lambda: amp.autocast(over, "cpu"), calls(lambda: F.softmax(x, -1), 20))),
    }
    print(f"{'event':<26} {'torch.autocast us':>18} {'ampkit us':>10} {'added us':>9}")
    rows: list[dict[str, float | str]] = []
    for name, (n_calls, native, ours) in cases.items():
        t_native, t_ours = [], []
        for _ in range(rounds):
            amp.reset()  # torch's own kernels, no global hooks
            t_native.append(per_call(native, 200) / n_calls)
            with amp.autocast(over, "cpu"):
                pass  # ampkit's kernels and hooks back
            t_ours.append(per_call(ours, 200) / n_calls)
        a, b = statistics.median(t_native), statistics.median(t_ours)
        print(f"{name:<26} {a:>18.2f} {b:>10.2f} {b - a:>9.2f}", flush=True)
        rows.append({"event": name, "calls_per_run": n_calls, "torch_autocast_us": a, "ampkit_us": b,
                     "added_us": b - a})  # fmt: skip
    amp.reset()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="cnn,lm", help="ampkit bench workloads: cnn, lm, wide")
    p.add_argument("--size", default="full", choices=SIZES, help="the workloads' size (tiny: a smoke run)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps per round per mode")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro", action="store_true", help="per-event engine costs (CPU) instead of steps")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: this process's CPU time (steady when other processes load the machine)")
    p.add_argument("--json", metavar="FILE", help="also write the machine, the settings and the table's rows to FILE")
    args = p.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.dtype]
    dtype = dtype or (torch.float16 if args.device == "cuda" else torch.bfloat16)
    settings = {"device": "cpu" if args.micro else args.device, "dtype": str(dtype).removeprefix("torch."),
                "threads": args.threads, "rounds": args.rounds, "clock": args.clock}
    if args.micro:
        print(f"device=cpu dtype={dtype} torch={torch.__version__} rounds={args.rounds}, median per event "
              f"({args.clock} clock)")
        rows = micro(args.rounds, dtype)
        if args.json:
            write_record(args.json, {"measurement": "micro", "settings": settings, "rows": rows}, threads=args.threads)
            print(f"wrote {args.json}")
        return
    print(f"device={args.device} dtype={dtype} threads={args.threads} torch={torch.__version__} "
          f"rounds={args.rounds}x{args.steps} steps, median step time ({args.clock} clock)")
    header = f"{'workload':<12} {'fp32 ms':>9} {'autocast ms':>12} {'default ms':>11} {'custom ms':>10} " \
             f"{'autocast/fp32':>14} {'default/autocast':>17} {'custom/autocast':>16}"
    print(header)
    print("-" * len(header))
    rows = []
    for name in args.workloads.split(","):
        r = bench(name, args.size, args.rounds, args.steps, args.device, dtype)
        ac = r["torch.autocast"]
        row = {"workload": name, "fp32_ms": r["fp32"] * 1e3, "autocast_ms": ac * 1e3,
               "default_ms": r["ampkit default"] * 1e3, "custom_ms": r["ampkit custom"] * 1e3,
               "autocast_over_fp32": ac / r["fp32"], "default_over_autocast": r["ampkit default"] / ac,
               "custom_over_autocast": r["ampkit custom"] / ac}  # fmt: skip
        rows.append(row)
        print(f"{name:<12} {row['fp32_ms']:>9.1f} {row['autocast_ms']:>12.1f} {row['default_ms']:>11.1f} "
              f"{row['custom_ms']:>10.1f} {row['autocast_over_fp32']:>14.2f} "
              f"{row['default_over_autocast']:>17.3f} {row['custom_over_autocast']:>16.3f}", flush=True)
    if args.json:
        settings.update(size=args.size, steps=args.steps)
        write_record(args.json, {"measurement": "steps", "settings": settings, "rows": rows},
                     device=args.device, threads=args.threads)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
