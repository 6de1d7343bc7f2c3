"""``ampkit.tune`` on the bench workloads: the tuned plan against every uniform level,
side by side in one run.

For each workload: tune with the run's own batches and length (``probe_steps`` = the
workload's steps; the probe trains with the workload's AdamW), then train a fresh model from the same seed for the
workload's steps in fp32, at O1, O2 and O2K (everything lowered) and through
``initialize(plan=)`` (the plan's level and module choices), on the
same batches; each arm runs twice (the second time in reverse order) and the faster
median step time counts. Per arm: that step time (steps after the third), the mean
training loss over the last quarter of steps and how much worse than fp32's it is
(relative; a lower loss counts 0), whether that is within the budget, and the
workload's held-out metric. The headline per workload: the
plan's speed against the fastest uniform level within the same budget.

Figures depend on the CPU: where it computes bf16 natively (AVX-512-bf16, AMX) large
matmuls gain from 16 bits and small ones may not; where it emulates bf16 (AVX2) the
tuner skips bf16 and the plan is fp32. On a CUDA GPU with fp8 (compute capability 8.9
and up) the tuner also tries each linear in fp8 (``--candidates``): the plan line says
how many linears it runs in fp8.

    python benchmarks/tune.py [--workloads wide,lm,cnn] [--size quick] [--budget 0.01] [--device cpu]
                              [--candidates bf16,fp16,fp8] [--json tune.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import ampkit as amp  # noqa: E402
from ampkit.tools.bench import make_workload  # noqa: E402
from ampkit.tools.bench.machine import write_record  # noqa: E402
from ampkit.tools.tune.measure import sync  # noqa: E402

UNIFORM = ("O1", "O2", "O2K")


def _train(w, steps: int, how: str | amp.TunePlan | None) -> dict[str, float]:
    """Train a fresh model: fp32 (``how`` None), at a level, or through ``initialize(plan=)``."""
    torch.manual_seed(0)
    model = w.build_model()
    opt = w.build_optimizer(model)
    level = how.level if isinstance(how, amp.TunePlan) else how
    if isinstance(how, amp.TunePlan):
        model, opt = amp.initialize(model, opt, plan=how)
    elif how is not None:
        model, opt = amp.initialize(model, opt, opt_level=how)
    batches = w.batches(torch.Generator().manual_seed(0))
    times, losses = [], []
    try:
        for _ in range(steps):
            x, y = next(batches)
            sync(torch.device(w.device).type)
            start = time.perf_counter()
            loss = w.loss(model(x), y)
            if level is None:
                loss.backward()
            else:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            opt.step()
            opt.zero_grad()
            sync(torch.device(w.device).type)
            times.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
        metric = w.evaluate(model)[w.metric]
    finally:
        amp.reset()
    k = max(1, steps // 4)
    return {"step_ms": 1e3 * statistics.median(times[3:] or times), "loss": sum(losses[-k:]) / k,
            "metric": float(metric)}  # fmt: skip


def run_workload(name: str, size: str, budget: float, device: str = "cpu",
                 candidates: tuple[str, ...] = ("bf16", "fp16", "fp8")) -> dict:  # fmt: skip
    w = make_workload(name, size, device=device)
    torch.manual_seed(0)
    model = w.build_model()
    it = w.batches(torch.Generator().manual_seed(0))
    batches = [next(it) for _ in range(w.steps)]  # the probe sees what the run sees
    plan = amp.tune(model, batches, w.loss, budget=budget, probe_steps=w.steps, candidates=candidates,
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=w.lr, weight_decay=0.01))  # fmt: skip
    setups = {"fp32": None, **{lv: lv for lv in UNIFORM}, "plan": plan}
    arms = {name: _train(w, w.steps, how) for name, how in setups.items()}
    for arm in reversed(list(setups)):  # again in reverse order: the faster run's step time counts
        arms[arm]["step_ms"] = min(arms[arm]["step_ms"], _train(w, w.steps, setups[arm])["step_ms"])
    ref = arms["fp32"]
    for arm in arms.values():
        arm["deviation"] = max(0.0, arm["loss"] - ref["loss"]) / abs(ref["loss"])  # worse than fp32 by
        arm["within_budget"] = arm["deviation"] <= budget
        arm["speed_vs_fp32"] = ref["step_ms"] / arm["step_ms"]
    fits = [a for a in ("fp32", *UNIFORM) if arms[a]["within_budget"]]
    best = min(fits, key=lambda a: arms[a]["step_ms"])
    return {"workload": name, "size": size, "steps": w.steps, "metric": w.metric, "arms": arms,
            "fastest_uniform_within_budget": best,
            "plan_speed_vs_fastest_uniform": arms[best]["step_ms"] / arms["plan"]["step_ms"],
            "plan": {"level": plan.level, "dtype": plan.dtype, "lowered": len(plan.lowered), "modules": len(plan.modules),
                     "fp8": plan.fp8,
                     "skipped": plan.skipped, "tune_seconds": plan.seconds, "probe": plan.probe,
                     "backed_off": list(plan.backed_off)}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="wide,lm,cnn", help="comma list of bench workloads")
    parser.add_argument("--size", default="quick", choices=("full", "quick", "tiny"))
    parser.add_argument("--budget", type=float, default=0.01, help="relative loss deviation allowed (0.01: 1%%)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--candidates", default="bf16,fp16,fp8", help="the tuner's candidates, comma-separated")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/tune.py --device cuda: no CUDA GPU here (torch.cuda.is_available() is False).",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    torch.set_num_threads(1)
    candidates = tuple(args.candidates.split(","))
    results = [run_workload(n, args.size, args.budget, args.device, candidates) for n in args.workloads.split(",")]
    for r in results:
        p = r["plan"]
        fp8 = f", {len(p['fp8'])} of them linears in fp8" if p["fp8"] else ""
        print(f"\n{r['workload']} ({r['size']}, {r['steps']} steps): plan {p['lowered']}/{p['modules']} modules in "
              f"{p['dtype']}{fp8} (run at {p['level']}), tuned in {p['tune_seconds']:.1f} s; budget {args.budget:.2%}")  # fmt: skip
        for dtype, why in p["skipped"].items():
            print(f"not tried: {dtype}: {why}")
        print(f"{'arm':10} {'step ms':>9} {'vs fp32':>8} {'loss':>8} {'deviation':>10} {'in budget':>9} {r['metric']:>10}")
        for arm, a in r["arms"].items():
            print(f"{arm:10} {a['step_ms']:9.2f} {a['speed_vs_fp32']:7.2f}x {a['loss']:8.4f} {a['deviation']:10.2%} "
                  f"{'yes' if a['within_budget'] else 'no':>9} {a['metric']:10.4f}")  # fmt: skip
        print(f"plan vs the fastest uniform level within budget ({r['fastest_uniform_within_budget']}): "
              f"{r['plan_speed_vs_fastest_uniform']:.2f}x")  # fmt: skip
    if args.json:
        write_record(args.json, {"budget": args.budget, "device": args.device, "candidates": list(candidates),
                                 "results": results}, threads=1, device=args.device)  # fmt: skip
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
