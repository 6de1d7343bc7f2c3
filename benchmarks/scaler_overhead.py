"""Per-step cost of loss scaling: ampkit vs no scaler vs torch.amp.GradScaler.

Two measurements on one of ``ampkit bench``'s workloads (``lm`` by default, the char
transformer, on its example batch), fp32 compute on the CPU (the scaler's work does not
depend on the compute dtype: it touches the fp32 grads):

1. scaler only: the unscale + inf/NaN check + skip decision + scale update on fixed
   grads, with an optimizer whose step does nothing, so only the scaler is timed;
2. full training step: forward, backward, scaler, AdamW step.

Implementations run interleaved (round-robin blocks) in one process so machine noise
hits them alike; the table gives medians and ratios. Target: ampkit no slower than
torch.amp.GradScaler. ``--json FILE`` also writes the machine (CPU, its 16-bit flags,
torch, date, command), the settings and both tables' rows (``median_us`` /
``median_ms``, ``vs_no_scaler``, ``vs_torch_grad_scaler``).

    python benchmarks/scaler_overhead.py [--workload lm] [--size full] [--steps 24] [--rounds 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import ampkit as amp
from ampkit.tools.bench.machine import write_record
from ampkit.tools.bench.workloads import SIZES, WORKLOADS, make_workload


class NoStep(torch.optim.SGD):
    """An optimizer whose step does nothing: isolates the scaler's own cost."""

    def step(self, closure=None):  # noqa: D102
        return None


def _block_median(fns: dict[str, Callable[[], float]], rounds: int, per_block: int) -> dict[str, float]:
    """Round-robin over ``fns`` (each returns the seconds of one timed step)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(per_block):
                samples[name].append(fn())
    return {name: statistics.median(v) for name, v in samples.items()}


def scaler_only(model: torch.nn.Module, batch, loss_fn, rounds: int, steps: int) -> dict[str, float]:
    inputs, target = batch
    base = loss_fn(model(inputs), target)
    base.backward()
    saved = [p.grad.clone() for p in model.parameters()]
    params = list(model.parameters())

    def restore() -> None:
        with torch.no_grad():
            for p, g in zip(params, saved):
                p.grad.copy_(g)

    opt_plain = NoStep(params, lr=0.0)
    opt_managed = amp.init_trainer(NoStep(params, lr=0.0))
    state = amp.trainer.managed_state(opt_managed)
    opt_gs = NoStep(params, lr=0.0)
    gs = amp.GradScaler("cpu")
    opt_torch = NoStep(params, lr=0.0)
    tgs = torch.amp.GradScaler("cpu")
    one = torch.ones(())

    def plain() -> float:
        restore()
        t = time.perf_counter()
        opt_plain.step()
        return time.perf_counter() - t

    def managed() -> float:
        restore()
        state.step_grads.before_backward(0)  # what scale_loss records before a backward
        t = time.perf_counter()
        opt_managed.step()
        return time.perf_counter() - t

    def ampkit_gs() -> float:
        restore()
        gs.scale(one)
        t = time.perf_counter()
        gs.step(opt_gs)
        gs.update()
        return time.perf_counter() - t

    def torch_gs() -> float:
        restore()
        tgs.scale(one)
        t = time.perf_counter()
        tgs.step(opt_torch)
        tgs.update()
        return time.perf_counter() - t

    fns = {"no scaler": plain, "ampkit (init_trainer)": managed, "ampkit.GradScaler": ampkit_gs,
           "torch.amp.GradScaler": torch_gs}
    _block_median(fns, 1, 5)  # warm-up
    result = _block_median(fns, rounds, steps * 4)
    amp.reset()
    return result


def full_step(make_model, batch, loss_fn, rounds: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    base = make_model()
    inputs, target = batch

    def setup():
        model = copy.deepcopy(base)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    m0, o0 = setup()
    m1, o1 = setup()
    amp.init_trainer(o1)
    m2, o2 = setup()
    gs = amp.GradScaler("cpu")
    m3, o3 = setup()
    tgs = torch.amp.GradScaler("cpu")

    def plain() -> float:
        t = time.perf_counter()
        o0.zero_grad()
        loss_fn(m0(inputs), target).backward()
        o0.step()
        return time.perf_counter() - t

    def managed() -> float:
        t = time.perf_counter()
        o1.zero_grad()
        with amp.scale_loss(loss_fn(m1(inputs), target), o1) as scaled:
            scaled.backward()
        o1.step()
        return time.perf_counter() - t

    def with_scaler(model, opt, scaler) -> Callable[[], float]:
        def run() -> float:
            t = time.perf_counter()
            opt.zero_grad()
            scaler.scale(loss_fn(model(inputs), target)).backward()
            scaler.step(opt)
            scaler.update()
            return time.perf_counter() - t

        return run

    fns = {"no scaler": plain, "ampkit (init_trainer)": managed,
           "ampkit.GradScaler": with_scaler(m2, o2, gs), "torch.amp.GradScaler": with_scaler(m3, o3, tgs)}
    _block_median(fns, 1, 2)  # warm-up
    result = _block_median(fns, rounds, max(1, steps // rounds))
    amp.reset()
    return result


def table(name: str, title: str, medians: dict[str, float], unit: float, unit_name: str,
          subtract_plain: bool) -> dict[str, Any]:
    """One result set: per implementation its median step time in ``unit_name`` and its
    ratios to "no scaler" and to torch.amp.GradScaler (None where the reference is 0)."""
    plain = medians["no scaler"]
    ref = medians["torch.amp.GradScaler"]
    ref_cost = ref - plain if subtract_plain else ref
    rows = []
    for impl, value in medians.items():
        cost = value - plain if subtract_plain else value
        rows.append({
            "implementation": impl,
            f"median_{unit_name}": value / unit,
            "vs_no_scaler": value / plain if plain > 0 else float("nan"),
            "vs_torch_grad_scaler": cost / ref_cost if ref_cost > 0 else float("nan"),
        })  # fmt: skip
    return {"name": name, "title": title, "unit": unit_name, "rows": rows}


def print_table(result: dict[str, Any]) -> None:
    unit_name = result["unit"]
    print(f"\n{result['title']}")
    head = f"{'':24s} {('median ' + unit_name):>12s} {'vs no scaler':>13s} {'vs torch GradScaler':>20s}"
    print(head)
    print("-" * len(head))
    for row in result["rows"]:
        print(f"{row['implementation']:24s} {row['median_' + unit_name]:12.1f} {row['vs_no_scaler']:12.3f}x "
              f"{row['vs_torch_grad_scaler']:19.3f}x")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="lm", choices=sorted(WORKLOADS), help="the ampkit bench workload")
    parser.add_argument("--size", default="full", choices=SIZES, help="its size (tiny: a smoke run)")
    parser.add_argument("--steps", type=int, default=24, help="timed full training steps per implementation")
    parser.add_argument("--rounds", type=int, default=4, help="interleaving rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the machine, the settings and both tables' rows to FILE")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    wl = make_workload(args.workload, args.size)
    torch.manual_seed(0)
    model = wl.build_model()
    batch = wl.example_batch()
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = sum(1 for _ in model.parameters())
    print(f"workload: {wl.name} {args.size} ({n_tensors} param tensors, {n_params / 1e6:.2f}M params), "
          f"fp32, {torch.get_num_threads()} thread(s), torch {torch.__version__}")

    only = scaler_only(model, batch, wl.loss, args.rounds, args.steps)
    tables = [table("scaler_only", "scaler only (unscale + check + skip decision + update), per step;"
                    " 'vs torch' compares the scaler cost", only, 1e-6, "us", subtract_plain=False)]
    print_table(tables[0])
    full = full_step(wl.build_model, batch, wl.loss, args.rounds, args.steps)
    tables.append(table("full_step", "full training step (forward + backward + scaler + AdamW); ratios of step"
                        " times (the scaler's ~0.2 ms is within this machine's noise)", full, 1e-3, "ms",
                        subtract_plain=False))
    print_table(tables[1])
    if args.json:
        settings = {"workload": wl.name, "size": args.size, "compute_dtype": "fp32", "threads": torch.get_num_threads(),
                    "rounds": args.rounds, "steps": args.steps, "param_tensors": n_tensors, "params": n_params}
        write_record(args.json, {"settings": settings, "tables": tables})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
