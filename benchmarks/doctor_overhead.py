"""What ``ampkit.doctor`` costs per training step: off, on (module hooks, the default
between checks), and a step under the op-level check.

Each workload (``ampkit bench``'s, from :func:`ampkit.bench.make_workload`, on its
example batch) trains with ``init_trainer`` (under ``amp.autocast`` in ``--dtype``
bf16/fp16, or in plain fp32, the default); the three modes run interleaved in one
process (round-robin blocks, medians), each on its own copy of the model. "off" runs
with no doctor in the process (the doctor of the "on" block is stopped before it:
nothing is installed); "on" is a running doctor whose op-level check never fires
(``max_checks=0``); "check" is a step whose forward and backward run under the
op-level checker (``doctor.diagnose``).

``--json FILE`` also writes the machine (CPU, its 16-bit flags, torch, date, command),
the settings and per workload ``off_ms``, ``on_ms``, ``check_ms``, ``on_over_off``
and ``check_over_off``.

    python benchmarks/doctor_overhead.py [--workloads cnn,lm] [--size full] [--dtype fp32] [--rounds 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from collections.abc import Callable

import torch

import ampkit as amp
from ampkit.tools.bench.machine import write_record
from ampkit.tools.bench.workloads import SIZES, make_workload
from ampkit.tools.diagnosis import Doctor

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure(name: str, size: str, rounds: int, steps: int, dtype: torch.dtype | None) -> dict[str, float]:
    wl = make_workload(name, size)
    torch.manual_seed(0)
    base = wl.build_model()
    inputs, target = wl.example_batch()
    policy = amp.default_policy("cpu", dtype) if dtype is not None else None

    def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        amp.init_trainer(opt)
        return model, opt

    def forward_backward(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        with amp.autocast(policy, device_type="cpu", enabled=policy is not None):
            loss = wl.loss(model(inputs), target)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        t = time.perf_counter()
        opt.zero_grad()
        forward_backward(model, opt)
        opt.step()
        return time.perf_counter() - t

    m_off, o_off = setup()
    m_on, o_on = setup()
    m_chk, o_chk = setup()

    def off() -> Callable[[], float]:
        return lambda: step(m_off, o_off)

    def on() -> Callable[[], float]:
        return lambda: step(m_on, o_on)

    def check(doc: Doctor) -> Callable[[], float]:
        def run() -> float:
            t = time.perf_counter()
            o_chk.zero_grad()
            doc.diagnose(forward_backward, m_chk, o_chk)
            o_chk.step()
            return time.perf_counter() - t

        return run

    samples: dict[str, list[float]] = {"off": [], "on": [], "check": []}
    for r in range(rounds + 1):  # round 0 warms up
        for mode in samples:
            doc = None
            if mode == "on":
                doc = amp.doctor(o_on, max_checks=0, log=False).start()
                fn = on()
            elif mode == "check":
                doc = amp.doctor(o_chk, log=False).start()
                fn = check(doc)
            else:
                fn = off()
            times = [fn() for _ in range(steps)]
            if doc is not None:
                doc.stop()
            if r:
                samples[mode].extend(times)
    amp.reset()
    return {mode: statistics.median(v) for mode, v in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="cnn,lm", help="comma-separated ampkit bench workloads: cnn, lm, wide")
    parser.add_argument("--size", default="full", choices=SIZES, help="the workloads' size (tiny: a smoke run)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="compute dtype (fp32: no autocast)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaving rounds")
    parser.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--json", metavar="FILE", help="also write the machine, the settings and the table's rows to FILE")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    print(f"{args.dtype} on CPU, {torch.get_num_threads()} thread(s), torch {torch.__version__}; "
          f"medians of {args.rounds} interleaved rounds x {args.steps} steps")
    head = f"{'workload':12s} {'off ms':>9s} {'on ms':>9s} {'on / off':>9s} {'check ms':>9s} {'check / off':>12s}"
    print(head)
    print("-" * len(head))
    rows = []
    for name in args.workloads.split(","):
        res = measure(name.strip(), args.size, args.rounds, args.steps, DTYPES[args.dtype])
        off, on, chk = res["off"], res["on"], res["check"]
        row = {"workload": name, "off_ms": off * 1e3, "on_ms": on * 1e3, "on_over_off": on / off,
               "check_ms": chk * 1e3, "check_over_off": chk / off}  # fmt: skip
        rows.append(row)
        print(f"{name:12s} {row['off_ms']:9.1f} {row['on_ms']:9.1f} {row['on_over_off']:9.2f} {row['check_ms']:9.1f} "
              f"{row['check_over_off']:12.2f}")  # fmt: skip
    if args.json:
        settings = {"dtype": args.dtype, "size": args.size, "threads": torch.get_num_threads(), "rounds": args.rounds,
                    "steps": args.steps}  # fmt: skip
        write_record(args.json, {"settings": settings, "rows": rows})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
