"""Peak memory of one training step per opt level, against torch.autocast.

A developer script of the repository's ``benchmarks/`` tree (users run ``ampkit
bench``); it counts tensor bytes with the same code as ``ampkit bench``
(:mod:`ampkit.bench.memory`: exact storages plus ``torch.profiler``'s record of
every allocation and free) and adds the process's RSS.

The workloads are ``ampkit bench``'s (``cnn``, ``lm``, ``wide``; their ``quick`` size
with --quick, ``--size tiny`` for the test suite, else ``full``), each on its example batch.

Each (workload, mode) runs in its own process, so one measurement cannot inherit
another's allocations. In the worker: build the fp32 model and AdamW, set the mode
up, train two warm-up steps (optimizer state exists, caches are warm), then reset
the kernel's peak-RSS mark (Linux ``/proc/self/clear_refs``) and train one measured
step. Reported per mode:

- ``step peak``: peak RSS during the measured step minus the RSS of the same
  process before the model was built (torch and ampkit imported): parameters,
  masters, optimizer state, gradients and activations.
- ``param+opt``: bytes of parameters, fp32 masters, compensation buffers and
  optimizer state tensors, counted exactly (each storage once).
- ``opt.step B/param``: the exact peak of tensor memory during ``optimizer.step()``
  of the measured step, per model parameter: every tensor alive when the step
  begins (parameters, grads, optimizer state, masters, compensation; the batch
  left out), counted storage by storage, plus the peak of what the step itself
  allocates on top (every allocation and free of torch's CPU allocator, recorded
  by ``torch.profiler`` with ``profile_memory``). Unscaling, the overflow check,
  master-grad gathering and the publish of 16-bit weights run inside ``step()``
  and count. Targets for AdamW on the parameter-heavy ``wide`` MLP (no norm layers, so
  every parameter is cast): O2 <= 18 (fp32 master, fp32 grad, two fp32 moments,
  the bf16 weight; mode ``O2-view`` is O2 with ``model_grads="view"``, whose model
  grads share the fp32 grads' memory), O2K <= 10 (bf16 weight, compensation, grad,
  two moments).

glibc is told to serve every allocation above 64 KiB with mmap
(``MALLOC_MMAP_THRESHOLD_``) so freed tensors leave the RSS at once and the peak
reflects what the step holds. Targets checked at the end: O1 <= torch.autocast,
O2 <= 0.8 x O0 (step peak), O2K param+opt >= 30% below O2's, and the bytes per
parameter above.

    python benchmarks/memory.py            # every workload and mode (~2-4 min)
    python benchmarks/memory.py --quick    # smaller workloads, for a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

MODES = ("O0", "autocast", "O1", "O2", "O2-view", "O3", "O2K")
WORKLOADS = ("cnn", "lm", "wide")  # ampkit bench's (ampkit.bench.make_workload)
# Exact bytes per parameter at the peak of AdamW's step (wide workload).
STEP_TARGETS = {"O2": 18.0, "O2-view": 18.0, "O2K": 10.0}
MIB = 2.0**20


# --- workloads: ampkit bench's, built once per process ---------------------------------------


_WORKLOADS: dict[tuple[str, str], Any] = {}


def _workload(name: str, size: str) -> Any:
    """``ampkit bench``'s workload ``name`` at ``size`` (``full``, ``quick`` or ``tiny``),
    loaded once per process: its dataset is resident before the baseline RSS is read,
    so the step figures leave it out (as ``ampkit bench`` does)."""
    key = (name, size)
    if key not in _WORKLOADS:
        from ampkit.tools.bench.workloads import make_workload

        _WORKLOADS[key] = make_workload(name, size)
    return _WORKLOADS[key]


# --- measuring -------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _rss() -> float:
    kib = _status_kib("VmRSS")
    if kib is None:  # no procfs: the lifetime peak is all there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return kib / 1024.0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak() -> float:
    kib = _status_kib("VmHWM")
    if kib is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return kib / 1024.0


def _setup(workload: str, mode: str, size: str) -> tuple[Any, Any, Callable[..., float]]:
    """Build the workload in fp32, set ``mode`` up; return (model, optimizer, step).
    ``step(measure)`` trains one step; with a dict for ``measure`` it also records the
    exact tensor bytes of ``optimizer.step()`` in it."""
    import torch

    import ampkit
    from ampkit.tools.bench.memory import PeakMeter, storage_ptrs

    wl = _workload(workload, size)
    torch.manual_seed(0)
    model = wl.build_model()
    example = wl.example_batch()
    batch, loss_fn = lambda: example, wl.loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scope: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if mode == "autocast":
        scope = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    elif mode == "O2-view":
        model, opt = ampkit.initialize(model, opt, opt_level="O2", model_grads="view")
    else:
        model, opt = ampkit.initialize(model, opt, opt_level=mode)

    def train(meter: PeakMeter | None) -> float:
        opt.zero_grad(set_to_none=True)
        x, y = batch()
        with scope():
            out = model(x)
            loss = loss_fn(out.float(), y)
        with ampkit.scale_loss(loss, opt) if mode != "autocast" else _plain(loss) as scaled:
            scaled.backward()
        value = float(loss.detach())
        if meter is None:
            opt.step()
            return value
        del out, loss, scaled
        gc.collect()
        meter.exclude = storage_ptrs([x, y, *wl.data_tensors()])  # the batch and the dataset
        with meter.window():
            opt.step()
        return value

    def step(measure: dict[str, int] | None = None) -> float:
        if measure is None:
            return train(None)
        # Profiling covers the whole training step, so every block freed inside
        # optimizer.step() (16-bit grad copies, ...) was allocated under the profiler.
        meter = PeakMeter(torch.device("cpu"))
        with meter.profiling():
            value = train(meter)
        measure["live"], measure["extra"] = meter.live, meter.extra
        return value

    return model, opt, step


def worker(workload: str, mode: str, size: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    import ampkit
    from ampkit.tools.bench.memory import param_and_state_bytes

    # A throwaway pass first: it loads every kernel the step uses (code pages and
    # one-time buffers count as RSS), then its tensors are freed. What is resident
    # after that is the baseline the step is measured against.
    model, opt, step = _setup(workload, mode, size)
    step()
    del model, opt, step
    ampkit.reset()
    gc.collect()
    bare = _rss()
    model, opt, step = _setup(workload, mode, size)
    for _ in range(2):
        step()
    gc.collect()
    before = _rss()
    exact_peak = _reset_peak()
    loss = step()
    peak = _peak()
    measure: dict[str, int] = {}
    step(measure)
    params = sum(p.numel() for p in model.parameters())
    return {
        "workload": workload,
        "mode": mode,
        "step_peak_mib": peak - bare,
        "resident_before_step_mib": before - bare,
        "bare_mib": bare,
        "param_opt_mib": param_and_state_bytes(model, opt) / MIB,
        "params": params,
        "opt_step_bytes_per_param": (measure["live"] + measure["extra"]) / params,
        "opt_step_extra_bytes_per_param": measure["extra"] / params,
        "loss": loss,
        "peak_is_per_step": exact_peak,
    }


@contextlib.contextmanager
def _plain(loss: Any) -> Iterator[Any]:
    yield loss


# --- the driver ------------------------------------------------------------------------


def _run(workload: str, mode: str, size: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, __file__, "--worker", workload, mode, "--size", size]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{workload}/{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(rows: list[dict[str, Any]], markdown: bool = False) -> tuple[str, list[tuple[str, bool, str]]]:
    if markdown:
        lines = [
            "| workload | mode | step peak MiB | vs O0 | param+opt MiB | vs O2 | opt.step B/param |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
    else:
        lines = [
            f"{'workload':<12} {'mode':<9} {'step peak MiB':>14} {'vs O0':>7} {'param+opt MiB':>14} {'vs O2':>7}"
            f" {'opt.step B/param':>17}",
            "-" * 86,
        ]
    checks: list[tuple[str, bool, str]] = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        by_mode = {r["mode"]: r for r in rows if r["workload"] == workload}
        o0, o2 = by_mode.get("O0"), by_mode.get("O2")
        for mode, r in by_mode.items():
            vs_o0 = f"{r['step_peak_mib'] / o0['step_peak_mib']:.2f}" if o0 else "-"
            vs_o2 = f"{r['param_opt_mib'] / o2['param_opt_mib']:.2f}" if o2 else "-"
            if markdown:
                lines.append(
                    f"| {workload} | {mode} | {r['step_peak_mib']:.1f} | {vs_o0} | "
                    f"{r['param_opt_mib']:.2f} | {vs_o2} | {r['opt_step_bytes_per_param']:.2f} |"
                )
            else:
                lines.append(
                    f"{workload:<12} {mode:<9} {r['step_peak_mib']:>14.1f} {vs_o0:>7} "
                    f"{r['param_opt_mib']:>14.2f} {vs_o2:>7} {r['opt_step_bytes_per_param']:>17.2f}"
                )
        if "O1" in by_mode and "autocast" in by_mode:
            a, b = by_mode["O1"]["step_peak_mib"], by_mode["autocast"]["step_peak_mib"]
            # Same kernels underneath: equal up to page-level noise, hence 1% slack.
            checks.append(
                (f"{workload}: O1 step peak <= torch.autocast (1% slack)", a <= 1.01 * b, f"{a:.1f} vs {b:.1f} MiB")
            )
        if o0 and o2:
            ratio = o2["step_peak_mib"] / o0["step_peak_mib"]
            checks.append((f"{workload}: O2 step peak <= 0.8 x O0", ratio <= 0.8, f"ratio {ratio:.2f}"))
        if o2 and "O2K" in by_mode:
            saving = 1 - by_mode["O2K"]["param_opt_mib"] / o2["param_opt_mib"]
            checks.append(
                (f"{workload}: O2K param+opt >= 30% below O2", saving >= 0.30, f"{saving:.0%} less")
            )
        if workload == "wide":
            for mode, target in STEP_TARGETS.items():
                if mode in by_mode:
                    b = by_mode[mode]["opt_step_bytes_per_param"]
                    # To the figure's two decimals: a 4-byte step counter per tensor and
                    # the step's scalars add ~1e-5 B/param here.
                    checks.append((f"wide: {mode} opt.step peak <= {target:g} B/param", round(b, 2) <= target, f"{b:.4f}"))
        if not markdown:
            lines.append("")
    return "\n".join(lines), checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workloads (smoke run): --size quick")
    parser.add_argument("--size", choices=("full", "quick", "tiny"), default=None,
                        help="workload size (default: full; quick with --quick)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = args.size or ("quick" if args.quick else "full")
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], size)))
        return 0
    rows = []
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            rows.append(_run(workload, mode, size))
            print(f"  measured {workload}/{mode}", file=sys.stderr, flush=True)
    table, checks = _table(rows, args.markdown)
    print(table)
    if not all(r["peak_is_per_step"] for r in rows):
        print("note: no /proc/self/clear_refs here; peaks are lifetime peaks of each process")
    for name, ok, detail in checks:
        print(f"[{'ok' if ok else 'MISS'}] {name}: {detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
