"""Training-step time of each precision against the pure-bf16 speed limit.

One interleaved run over ``ampkit bench``'s workloads (``wide``: the MLP
1024 -> 4096 -> 4096 -> 4096 -> 10, 38M parameters, batch 64; ``cnn``, ``lm``: the
small ones), every arm in its own process, the optimizer ``torch.optim.AdamW`` with
torch's defaults unless an arm says otherwise:

==================  ==================================================================
arm                 what it runs
==================  ==================================================================
``fp32``            fp32 model, AdamW as built
``torch-autocast``  ``torch.autocast(bf16)`` around the forward, AdamW as built
``autocast+fused``  the same with ``AdamW(fused=True)``: torch's fastest step for fp32
                    weights (what ampkit O1 is compared with at equal optimizer settings)
``ampkit-O1/O2/O2K``  ``ampkit.initialize(opt_level=...)``, AdamW as built (ampkit may
                    pick a faster kernel for the same optimizer)
``ampkit-O2-view``  O2 with ``model_grads="view"`` (the model's bf16 grads are views of
                    the fp32 ones: 18 bytes per parameter at the step)
``bf16``            model and AdamW in bf16, AdamW as built: the limit the targets use
``bf16+fused``      the same with ``AdamW(fused=True)``: the kernel-level limit
==================  ==================================================================

Two phases:

- ``full``: forward, backward and step on the workload's real batches.
- ``update``: a synthetic backward gives every parameter a fresh gradient in its
  own dtype (fixed random values times the loss's output gradient) through
  autograd, so gradient accumulation and every hook run as in a real backward;
  then the step. This leaves out the model's forward/backward compute, which is
  the same for every 16-bit arm, and isolates what the precisions differ in:
  gradient handling, unscale + overflow check, the optimizer step, the publish of
  16-bit weights.

``--phase auto`` (the default) runs both where the CPU computes bf16 natively,
and only ``update`` where a bf16 matmul is more than 1.5x slower than fp32 (no
avx512_bf16/AMX: bf16 there is emulated, 10-170x slower, and full-step times
would measure the emulation).

Each round every arm runs ``--steps`` steps in turn (the starting arm rotates);
reported: the minimum ms/step over all rounds (least disturbed by other load on
a shared machine) and the median, and the ratios of the minimum to ``bf16`` and
``bf16+fused``. One torch thread per process. Checks printed at the end (on
``wide``): O2 <= 1.15x bf16 and bf16+fused, O2K <= 1.10x bf16 and 1.05x bf16+fused,
O1 <= torch-autocast and 1.02x autocast+fused. ``--json FILE`` writes all of it
(machine: CPU, its bf16 flags, torch, date, command; per-arm times with min and
median; ratios; checks) for the docs' tables.

    python benchmarks/step_limit.py                     # all workloads (~3-6 min)
    python benchmarks/step_limit.py --workloads wide --rounds 3

``--baseline SRC`` adds arms ``ampkit-O1@base`` ... run with the ``ampkit`` package
found in ``SRC`` (e.g. an older checkout's ``src``, whose ``ampkit.bench`` must know
the same workloads and recipes), interleaved with the others: "no slower than
before" measured side by side.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from typing import Any

import torch

ARMS = (
    "fp32",
    "torch-autocast",
    "autocast+fused",
    "ampkit-O1",
    "ampkit-O2",
    "ampkit-O2-view",
    "ampkit-O2K",
    "bf16",
    "bf16+fused",
)
WORKLOADS = ("wide", "cnn", "lm")
WARMUP_STEPS = 2
# Targets of the wide workload (step time over the bf16 arm's).
TARGETS = {"ampkit-O2": 1.15, "ampkit-O2-view": 1.15, "ampkit-O2K": 1.10}
# Targets against torch's fastest 16-bit step (bf16 model + AdamW(fused=True)), and
# ampkit O1 against torch.autocast with the same fused kernel.
FUSED_TARGETS = {"ampkit-O2": 1.15, "ampkit-O2-view": 1.15, "ampkit-O2K": 1.05}
O1_FUSED_TARGET = 1.02


# --- the worker --------------------------------------------------------------------------


class _Arm:
    """One arm on one workload: model, optimizer and a step function."""

    def __init__(self, workload: str, arm: str, phase: str, device: str = "cpu") -> None:
        try:
            from ampkit.tools.bench.recipes import AmpkitLevel, make_recipe
            from ampkit.tools.bench.workloads import make_workload
        except ModuleNotFoundError:  # a --baseline tree of ampkit 0.2 (flat layout)
            from ampkit.bench.recipes import AmpkitLevel, make_recipe  # type: ignore[no-redef]
            from ampkit.bench.workloads import make_workload  # type: ignore[no-redef]

        self.device = torch.device(device)
        self.workload = make_workload(workload, "full", self.device)
        recipe_name = {"autocast+fused": "torch-autocast", "bf16+fused": "bf16"}.get(arm, arm)
        if recipe_name == "ampkit-O2-view":
            self.recipe = AmpkitLevel(self.device, torch.bfloat16, "O2", model_grads="view")
        else:
            self.recipe = make_recipe(recipe_name, self.device, torch.bfloat16)
        torch.manual_seed(0)
        model = self.workload.build_model()
        fused = arm.endswith("+fused")
        opt = torch.optim.AdamW(model.parameters(), fused=True) if fused else torch.optim.AdamW(model.parameters())
        self.model, self.optimizer = self.recipe.prepare(model, opt)
        self.batches = self.workload.batches(torch.Generator().manual_seed(0))
        self.phase = phase
        if phase == "update":
            g = torch.Generator().manual_seed(1)
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.params = params
            self.grads = [(torch.randn(p.shape, generator=g) * 1e-3).to(self.device, p.dtype) for p in params]

    def _loss(self) -> Any:
        if self.phase == "update":
            return _GradientsFor.apply(self.grads, *self.params)
        x, y = next(self.batches)
        with self.recipe.scope():
            return self.workload.loss(self.model(x), y)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> float:
        self._sync()
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.recipe.backward_step(self._loss(), self.optimizer)
        self._sync()
        return 1000.0 * (time.perf_counter() - start)

    def close(self) -> None:
        self.recipe.cleanup()


class _GradientsFor(torch.autograd.Function):
    """A scalar whose backward hands each parameter ``grads[i] * dL`` (a fresh tensor
    in the parameter's dtype), as a real backward's last op would."""

    @staticmethod
    def forward(ctx: Any, grads: list, *params: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return params[0].new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, out: torch.Tensor) -> tuple[Any, ...]:
        return (None, *[g * out.to(g.dtype) for g in ctx.grads])


def _hold_freed_memory() -> bool:
    """This tree's ``hold_freed_memory``, loaded from its file so that a baseline
    worker still imports the baseline's ampkit afterwards."""
    package = importlib.util.find_spec("ampkit")
    assert package is not None and package.submodule_search_locations
    path = f"{list(package.submodule_search_locations)[0]}/tools/bench/allocator.py"
    spec = importlib.util.spec_from_file_location("_step_limit_allocator", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return bool(module.hold_freed_memory())


def _worker(conn: Any, src: str | None = None, hold_memory: bool = True) -> None:
    if hold_memory:
        _hold_freed_memory()
    if src is not None:
        sys.path.insert(0, src)
    torch.set_num_threads(1)
    arm: _Arm | None = None
    while True:
        msg = conn.recv()
        try:
            if msg[0] == "close":
                return
            if msg[0] == "setup":
                if arm is not None:
                    arm.close()
                arm = None
                import ampkit

                ampkit.reset()
                workload, name, phase, device = msg[1:]
                arm = _Arm(workload, name.removesuffix("@base"), phase, device)
                for _ in range(WARMUP_STEPS):
                    arm.step()
                conn.send(("ready",))
            elif msg[0] == "run":
                assert arm is not None
                conn.send(("times", [arm.step() for _ in range(msg[1])]))
        except Exception as exc:  # reported in the table
            arm = None
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


# --- the driver --------------------------------------------------------------------------


def bf16_is_native(threshold: float = 1.5) -> tuple[bool, float]:
    """(whether a bf16 matmul runs at most ``threshold`` x an fp32 one, the ratio)."""
    torch.set_num_threads(1)
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            x @ y
            best = min(best, time.perf_counter() - start)
        times[dtype] = best
    ratio = times[torch.bfloat16] / times[torch.float32]
    return ratio <= threshold, ratio


def _measure(
    workload: str, phase: str, arms: list[str], pool: dict[str, Any], rounds: int, steps: int, device: str = "cpu"
) -> dict:
    ready: list[str] = []
    rows: dict[str, dict[str, Any]] = {}
    for arm in arms:
        pool[arm][0].send(("setup", workload, arm, phase, device))
    for arm in arms:
        reply = pool[arm][0].recv()
        if reply[0] == "ready":
            ready.append(arm)
            rows[arm] = {"times": []}
        else:
            rows[arm] = {"error": reply[1]}
            print(reply[2], file=sys.stderr)
    for r in range(rounds):
        order = ready[r % len(ready) :] + ready[: r % len(ready)] if ready else []
        for arm in order:
            pool[arm][0].send(("run", steps))
            reply = pool[arm][0].recv()
            if reply[0] == "times":
                rows[arm]["times"] += reply[1]
            else:
                rows[arm] = {"error": reply[1]}
                ready.remove(arm)
                print(reply[2], file=sys.stderr)
    for row in rows.values():
        if "times" in row:
            row["min"] = min(row["times"])
            row["median"] = statistics.median(row["times"])
    return rows


def _table(workload: str, phase: str, rows: dict, description: str) -> list[str]:
    lines = [
        f"{workload} [{phase}]: {description}",
        f"  {'arm':<16} {'min ms':>9} {'median ms':>10} {'/ bf16':>8} {'/ bf16+fused':>13}",
    ]
    for arm, row in rows.items():
        if "error" in row:
            lines.append(f"  {arm:<16} error: {row['error']}")
            continue
        r1, r2 = (f"{row[k]:.2f}" if row.get(k) is not None else "-" for k in ("vs_bf16", "vs_bf16_fused"))
        lines.append(f"  {arm:<16} {row['min']:>9.1f} {row['median']:>10.1f} {r1:>8} {r2:>13}")
    return lines


def _ratios(rows: dict) -> None:
    """Adds ``vs_bf16`` and ``vs_bf16_fused`` (min over min) to every measured row."""
    for ref, key in (("bf16", "vs_bf16"), ("bf16+fused", "vs_bf16_fused")):
        base = rows.get(ref, {}).get("min")
        for row in rows.values():
            if "min" in row:
                row[key] = row["min"] / base if base else None


def _checks(workload: str, phase: str, rows: dict) -> list[dict[str, Any]]:
    """The targets of ``wide``, each ``{"name", "ok", "value", "target"}``."""
    out: list[dict[str, Any]] = []

    def check(name: str, value: float, target: float, detail: str) -> None:
        out.append({"name": f"{workload} [{phase}]: {name}", "ok": value <= target, "value": value,
                    "target": target, "detail": detail})  # fmt: skip

    for ref, key, targets in (("bf16", "vs_bf16", TARGETS), ("bf16+fused", "vs_bf16_fused", FUSED_TARGETS)):
        for arm, target in targets.items():
            ratio = rows.get(arm, {}).get(key)
            if ratio is not None:
                check(f"{arm} <= {target:.2f} x {ref}", ratio, target, f"{ratio:.2f}")
    o1 = rows.get("ampkit-O1", {}).get("min")
    for ref, target in (("torch-autocast", 1.0), ("autocast+fused", O1_FUSED_TARGET)):
        other = rows.get(ref, {}).get("min")
        if o1 and other:
            check(f"ampkit-O1 <= {target:.2f} x {ref}", o1 / other, target, f"{o1:.1f} vs {other:.1f} ms")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--phase", choices=("auto", "full", "update", "both"), default="auto")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the arms train (default cpu; cuda: the GPU, phases full and update)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--steps", type=int, default=None, help="steps per arm per round (default: 2 wide, 5 others)")
    parser.add_argument("--baseline", help="an older ampkit source tree: adds its O1/O2/O2K arms")
    parser.add_argument("--json", help="also write machine, per-arm times, ratios and checks to this file")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's malloc at its defaults in the arms' processes (default: "
                             "freed memory stays in each process, so no arm pays page faults for "
                             "memory an earlier step gave back)")  # fmt: skip
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arm(s) {sorted(unknown)}; choose from {', '.join(ARMS)}")
    if args.baseline:
        arms += [f"{a}@base" for a in arms if a.startswith("ampkit-") and a != "ampkit-O2-view"]  # an option older trees lack
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False)")
    native, ratio = (True, float("nan")) if args.device == "cuda" else bf16_is_native()
    if args.phase == "auto":
        phases = ["full", "update"] if native else ["update"]
    else:
        phases = ["full", "update"] if args.phase == "both" else [args.phase]
    from ampkit.tools.bench.allocator import hold_freed_memory
    from ampkit.tools.bench.machine import machine_info
    from ampkit.tools.bench.workloads import make_workload

    if not args.system_malloc:
        hold_freed_memory()  # the arms do the same; so the record names their setting
    machine = machine_info(args.device, threads=1)
    print(
        f"torch {torch.__version__}, {machine['device_name']} ({', '.join(machine['cpu_flags']) or 'no listed flags'}), "
        f"CPU capability {machine['cpu_capability']}, 1 thread per arm; bf16 matmul / fp32 "
        f"matmul = {ratio:.1f}x" + ("" if native else " (no native bf16: full-step phase skipped unless asked)")
        + f"; allocator {machine['malloc']['allocator']}, freed memory {machine['malloc']['freed_memory']}"
    )
    ctx = mp.get_context("spawn")
    pool: dict[str, Any] = {}
    checks: list[dict[str, Any]] = []
    tables: list[dict[str, Any]] = []
    try:
        for arm in arms:
            parent, child = ctx.Pipe()
            src = args.baseline if arm.endswith("@base") else None
            proc = ctx.Process(target=_worker, args=(child, src, not args.system_malloc), daemon=True)
            proc.start()
            child.close()
            pool[arm] = (parent, proc)
        for workload in args.workloads.split(","):
            description = make_workload(workload, "full").description
            steps = args.steps or (2 if workload == "wide" else 5)
            for phase in phases:
                rows = _measure(workload, phase, arms, pool, args.rounds, steps, args.device)
                _ratios(rows)
                print("\n".join(_table(workload, phase, rows, description)), flush=True)
                tables.append({"workload": workload, "phase": phase, "description": description,
                               "steps_per_round": steps, "rows": rows})  # fmt: skip
                if workload == "wide":
                    checks += _checks(workload, phase, rows)
    finally:
        for conn, proc in pool.values():
            try:
                conn.send(("close",))
            except OSError:
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    for c in checks:
        print(f"[{'ok' if c['ok'] else 'MISS'}] {c['name']}: {c['detail']}")
    if args.json:
        import json

        record = {"machine": machine, "bf16_over_fp32_matmul": ratio, "bf16_native": native,
                  "rounds": args.rounds, "phases": phases, "arms": arms, "results": tables, "checks": checks}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
