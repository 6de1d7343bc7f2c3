"""One command for a machine with a CUDA GPU: every CUDA path ampkit has, run and measured,
offline, with the machine's own python (``PYTHONPATH=src``, no venv, nothing installed).

Stages, cheap and telling first, each in its own process with its own time limit (a
stage that fails or times out does not stop the next); the default plan's limits sum to
6 minutes 15 s on one H200-class GPU:

==============  ==========================================================================
stage           what it runs
==============  ==========================================================================
``smoke``       ``benchmarks/gpu_smoke.py``: every level x fp16/bf16 x AdamW/SGD on a small
                transformer (trains as fp32 does, an inf gradient skipped bitwise,
                ``amp.state_dict`` resumes bitwise), ``explain``, fp8 (current and delayed
                scaling), ``torch.compile`` at O1 and O2
``tests``       ``pytest -m cuda`` over tests/ (the suite's CUDA-marked tests)
``speed``       ``benchmarks/gpu_speed.py``: a GPT-2-small-class decoder under fp32,
                torch.autocast fp16/bf16, ampkit O1 fp16/bf16, O2, O2K and pure bf16; a
                channels_last conv net; step time, peak memory, host time, loss
``fp8``         ``benchmarks/fp8.py --device cuda`` (d_model 4096): fp8 against bf16
==============  ==========================================================================

Named with ``--stages`` only (not in the default plan): ``bench-fp16`` / ``bench-bf16``
(``ampkit bench --device cuda``), ``step-limit``, ``tune`` (``benchmarks/tune.py
--device cuda`` on ``wide`` and ``lm``: ``ampkit.tune`` with bf16 and fp8 as
candidates, the plan against every uniform level; how many linears it puts in fp8) and
``host`` (``benchmarks/host_overhead.py --device cuda``: the host time of a step of a
tiny transformer and of the bench's ``lm`` at each ampkit level against torch's own AMP,
the host reads per step and where ampkit's host time goes).

Written into ``--out`` (default ``gpu-check-out``): each stage's own files, the log of
each stage, and ``gpu-check.json`` + ``gpu-check.md``: the machine, every stage's
command, exit code, seconds and its headline figures. ``--render JSON`` records such a
``gpu-check.json`` for the docs and writes its page, ``docs/benchmarks/gpu_check.md``.

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out gpu-check-out
    python benchmarks/gpu_check.py --dry-run             # the plan, on any machine
    python benchmarks/gpu_check.py --device cpu --out o  # the CPU stand-in: tiny sizes
    python benchmarks/gpu_check.py --render gpu-check-out/gpu-check.json

Without a CUDA GPU (and without ``--device cpu``) it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = "fp32,torch-autocast,ampkit-O1,ampkit-O2,ampkit-O2K,bf16"
# the figures of each precision in ampkit bench's results.json that the summary keeps
HEADLINE_KEYS = ("step_ms", "speedup", "time_vs_bf16", "peak_mib", "memory_vs_fp32", "final_train_loss",
                 "accuracy", "skipped_steps")  # fmt: skip


@dataclass(frozen=True)
class Stage:
    """One step of the check: a command, the seconds it may take, what it writes."""

    name: str
    argv: tuple[str, ...]
    limit_s: int
    output: str  # file or folder under --out that holds the stage's figures
    default: bool = True  # in the plan unless --stages names others


def plan(out: Path, python: str = sys.executable, device: str = "cuda") -> list[Stage]:
    """Every stage, in order, writing under ``out``; the default ones first (their limits
    sum to 375 s), then the optional ones. ``device="cpu"``: the CPU stand-in (tiny
    sizes, the same scripts and files)."""
    bench = (python, "-m", "ampkit", "bench", "--device", device, "--precisions", PRECISIONS)
    cpu = device == "cpu"
    smoke = (python, str(ROOT / "benchmarks" / "gpu_smoke.py"), "--device", device, "--json", str(out / "smoke.json"))
    speed = (python, str(ROOT / "benchmarks" / "gpu_speed.py"), "--device", device, "--json", str(out / "speed.json"),
             "--profile", "ampkit-O1-fp16,ampkit-O2")  # fmt: skip
    fp8 = (python, str(ROOT / "benchmarks" / "fp8.py"), "--device", device, "--json", str(out / "fp8.json"), "--profile")
    host = (python, str(ROOT / "benchmarks" / "host_overhead.py"), "--device", device, "--workload", "tiny,lm",
            "--json", str(out / "host_overhead.json"))  # fmt: skip
    host += (("--rounds", "1", "--steps", "2", "--warmup", "2", "--count-steps", "1", "--profile-steps", "1") if cpu
             else ("--rounds", "3", "--steps", "10"))  # fmt: skip
    if cpu:
        smoke += ("--steps", "12", "--only", "train/O1/bf16,explain,fp8/current")
        speed += ("--tiny", "--steps", "2", "--warmup", "1", "--arms", "fp32,autocast-bf16,ampkit-O1-bf16",
                  "--conv-arms", "fp32")  # fmt: skip
        fp8 += ("--d-model", "64", "--steps", "1", "--warmup", "1", "--modes", "bf16,fp8-current")
    return [
        Stage("smoke", smoke, 130, "smoke.json"),
        Stage("tests", (python, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                        f"--junitxml={out / 'cuda-tests.xml'}", str(ROOT / "tests")), 90, "cuda-tests.xml"),  # fmt: skip
        Stage("speed", speed, 110, "speed.json"),
        Stage("fp8", fp8, 45, "fp8.json"),
        Stage("bench-fp16", (*bench, "--dtype", "fp16", "--out", str(out / "bench-fp16")), 80, "bench-fp16", False),
        Stage("bench-bf16", (*bench, "--dtype", "bf16", "--out", str(out / "bench-bf16")), 80, "bench-bf16", False),
        Stage("step-limit", (python, str(ROOT / "benchmarks" / "step_limit.py"), "--device", device, "--phase", "both",
                             "--rounds", "3", "--json", str(out / "step_limit.json")), 100, "step_limit.json", False),  # fmt: skip
        Stage("tune", (python, str(ROOT / "benchmarks" / "tune.py"), "--device", device, "--workloads", "wide,lm",
                       "--size", "tiny" if cpu else "quick", "--candidates", "bf16,fp8", "--json",
                       str(out / "tune.json")), 150, "tune.json", False),  # fmt: skip
        Stage("host", host, 150, "host_overhead.json", False),
    ]


def run_stage(stage: Stage, out: Path) -> dict[str, Any]:
    """Runs one stage with its limit; its stdout and stderr go to ``out/<name>.log``."""
    log = out / f"{stage.name}.log"
    start = time.monotonic()
    with log.open("w") as f:
        try:
            code: int | None = subprocess.run(stage.argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                              timeout=stage.limit_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = None
    return {"name": stage.name, "command": " ".join(stage.argv), "exit_code": code, "timed_out": code is None,
            "seconds": round(time.monotonic() - start, 1), "log": log.name, "output": stage.output}  # fmt: skip


def headline(name: str, out: Path) -> dict[str, Any]:
    """The figures a stage's own files hold (empty where it wrote none)."""
    try:
        if name == "smoke":
            record = json.loads((out / "smoke.json").read_text())
            bad = {c["name"]: c.get("problems", []) for c in record["cases"] if c["status"] in ("failed", "error")}
            refused = {c["name"]: c.get("problems", []) for c in record["cases"] if c["status"] == "refused"}
            known = {c["name"]: [c.get("known_because", "")] + c.get("problems", [])
                     for c in record["cases"] if c["status"] == "known"}  # fmt: skip
            return {"counts": record["counts"], "not_passed": bad, "refused": refused, "known": known}
        if name == "speed":
            record = json.loads((out / "speed.json").read_text())
            keys = ("step_ms", "host_ms", "peak_mib", "speedup_vs_fp32", "memory_vs_fp32", "tail_loss", "first_step_s")
            return {
                "size": record["size"], "params": record["params"],
                **{sec: {arm: {k: r.get(k) for k in keys} for arm, r in record[sec].items()} for sec in ("lm", "conv")},
                "checks": record["checks"], "errors": record["errors"],
            }  # fmt: skip
        if name == "tests":
            root = ET.parse(out / "cuda-tests.xml").getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
            keys = ("tests", "failures", "errors", "skipped")
            return {k: int(suite.get(k, 0)) for k in keys} if suite is not None else {}
        if name.startswith("bench-"):
            results = json.loads((out / name / "results.json").read_text())
            return {
                wl: {p: {k: e.get(k) for k in HEADLINE_KEYS}
                     for p, e in entry["precisions"].items()}  # fmt: skip
                for wl, entry in results["workloads"].items()
            }
        if name == "step-limit":
            record = json.loads((out / "step_limit.json").read_text())
            tables = {f"{t['workload']} [{t['phase']}]": {a: r.get("min") for a, r in t["rows"].items()}
                      for t in record["results"]}  # fmt: skip
            return {"min_ms": tables, "checks": {c["name"]: c["ok"] for c in record["checks"]}}
        if name == "tune":
            results = json.loads((out / "tune.json").read_text())["results"]
            return {r["workload"]: {"plan": {k: r["plan"][k] for k in ("level", "dtype", "lowered", "modules", "fp8",
                                                                        "skipped", "tune_seconds")},
                                    "plan_speed_vs_fastest_uniform": r["plan_speed_vs_fastest_uniform"],
                                    "fastest_uniform_within_budget": r["fastest_uniform_within_budget"],
                                    "speed_vs_fp32": {a: v["speed_vs_fp32"] for a, v in r["arms"].items()},
                                    "deviation": {a: v["deviation"] for a, v in r["arms"].items()}}
                    for r in results}  # fmt: skip
        if name == "host":
            record = json.loads((out / "host_overhead.json").read_text())
            keys = ("cpu_ms", "vs_torch_amp", "host_reads", "host_ms", "wall_ms", "met")
            return {wl["workload"]: {r["arm"]: {k: r.get(k) for k in keys} for r in wl["rows"]}
                    for wl in record["workloads"]}  # fmt: skip
        if name == "fp8":
            rows = json.loads((out / "fp8.json").read_text())["rows"]
            return {r["mode"]: {"step_s": r["step_s"], "vs_first": r.get("vs_first"), "peak_mib": r.get("peak_mib")} for r in rows}
    except (OSError, ValueError, KeyError, TypeError, ET.ParseError):
        return {}
    return {}


def summary_markdown(record: dict[str, Any]) -> str:
    """``gpu-check.md``: the machine, then one row per stage and its figures."""
    m = record["machine"]
    lines = [
        "# ampkit GPU check",
        "",
        f"{m['device_name']}; torch {m['torch']}; CUDA {record.get('cuda_version')}; {m['date_utc']}; `{m['command']}`",
        "",
        "| stage | exit code | seconds | output |",
        "|---|---:|---:|---|",
    ]
    for s in record["stages"]:
        code = "timed out" if s["timed_out"] else s["exit_code"]
        lines.append(f"| {s['name']} | {code} | {s['seconds']} | `{s['output']}` (log `{s['log']}`) |")
    for s in record["stages"]:
        if s.get("figures"):
            lines += ["", f"## {s['name']}", "", "```json", json.dumps(s["figures"], indent=1), "```"]
    return "\n".join(lines) + "\n"


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def docs_page(record: dict[str, Any], source: str) -> str:
    """A standalone page of one ``gpu-check.json``: the machine, then :func:`docs_body`."""
    m = record["machine"]
    return (f"<!-- generated by benchmarks/gpu_check.py from {source}: do not edit -->\n\n# GPU check\n\n"
            f"Recorded on **{m.get('device_name')}**, torch {m.get('torch')}, CUDA {record.get('cuda_version')}, "
            f"{m.get('date_utc')}, with the machine's own python (no venv): "
            "`PYTHONPATH=src python3 benchmarks/gpu_check.py --out gpu-check-out`.\n\n" + docs_body(record))


def docs_body(record: dict[str, Any]) -> str:
    """Each stage's outcome, then the speed, memory, fp8, smoke and test figures, all read
    from one ``gpu-check.json`` (the docs page ``docs/benchmarks/gpu_check.md`` shows it)."""
    stages = {s["name"]: s for s in record["stages"]}
    lines = [
        f"CUDA {record.get('cuda_version')}.",
        "",
        "| stage | outcome | seconds |",
        "|---|---|---:|",
    ]
    for s in record["stages"]:
        outcome = "timed out" if s["timed_out"] else ("passed" if s["exit_code"] == 0 else f"exit {s['exit_code']}")
        lines.append(f"| {s['name']} | {outcome} | {s['seconds']} |")
    speed = stages.get("speed", {}).get("figures") or {}
    if speed.get("lm"):
        size = speed["size"]
        lines += [
            "",
            "## Speed and memory: GPT-2-small-class decoder",
            "",
            f"{speed['params'] / 1e6:.0f}M parameters ({size['layers']} blocks, d_model {size['d_model']}, "
            f"vocabulary {size['vocab']}), sequence {size['seq']}, batch {size['batch']}; AdamW. Step: median of the "
            "timed steps (CUDA events: forward, backward, optimizer); host: Python time of a step up to the return "
            "of `optimizer.step()`, queue drained first; loss: mean of the last 3 steps.",
            "",
            "| arm | step ms | × fp32 speed | host ms | peak MiB | × fp32 memory | loss | first step s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for arm, r in speed["lm"].items():
            lines.append(f"| {arm} | {_fmt(r['step_ms'])} | {_fmt(r.get('speedup_vs_fp32'))} | {_fmt(r['host_ms'])} | "
                         f"{_fmt(r['peak_mib'], 0)} | {_fmt(r.get('memory_vs_fp32'))} | {_fmt(r['tail_loss'], 4)} | "
                         f"{_fmt(r['first_step_s'])} |")  # fmt: skip
        if speed.get("conv"):
            lines += ["", f"Conv net, channels_last, batch {size['conv_batch']} at {size['conv_hw']}×{size['conv_hw']}:",
                      "", "| arm | step ms | × fp32 speed | peak MiB |", "|---|---:|---:|---:|"]  # fmt: skip
            for arm, r in speed["conv"].items():
                lines.append(f"| {arm} | {_fmt(r['step_ms'])} | {_fmt(r.get('speedup_vs_fp32'))} | {_fmt(r['peak_mib'], 0)} |")
        lines += ["", "| check | value | met |", "|---|---:|---|"]
        lines += [f"| {c['name']} | {c['value']} | {'yes' if c['ok'] else '**no**'} |" for c in speed.get("checks", [])]
        for arm, err in (speed.get("errors") or {}).items():
            lines.append(f"\n{arm} failed: `{err[:300]}`")
    fp8 = stages.get("fp8", {}).get("figures") or {}
    if fp8:
        lines += ["", "## fp8 against bf16 (`benchmarks/fp8.py`, d_model 4096)", "",
                  "| mode | step s | × first mode | peak MiB |", "|---|---:|---:|---:|"]  # fmt: skip
        for mode, r in fp8.items():
            lines.append(f"| {mode} | {_fmt(r.get('step_s'), 4)} | {_fmt(r.get('vs_first'))} | {_fmt(r.get('peak_mib'), 0)} |")
    smoke = stages.get("smoke", {}).get("figures") or {}
    if smoke:
        c = smoke["counts"]
        lines += ["", "## Smoke: every level, fp16 and bf16, AdamW and SGD", "",
                  f"{c['passed']} cases passed, {c['failed']} failed, {c['error']} raised, {c.get('known', 0)} failed "
                  f"for a known reason, {c['refused']} refused with an `AmpError` (by design):", ""]  # fmt: skip
        for name, problems in {**smoke.get("not_passed", {}), **smoke.get("known", {}), **smoke.get("refused", {})}.items():
            lines.append(f"- `{name}`: {'; '.join(problems)[:400]}")
    tests = stages.get("tests", {}).get("figures") or {}
    if tests:
        lines += ["", "## CUDA-marked tests", "",
                  f"{tests['tests']} tests: {tests['failures']} failed, {tests['errors']} errors, "
                  f"{tests['skipped']} skipped."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-check-out", help="folder for every output (default gpu-check-out)")
    parser.add_argument("--stages", default=None, help="comma-separated subset of the stages (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit, on any machine")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (default); cpu: the CPU stand-in, tiny sizes, to check the check itself")
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="record this gpu-check.json for the docs (docs/benchmarks/data/gpu_check.json) and write its page")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    if args.render:
        record = json.loads(Path(args.render).read_text())
        data = ROOT / "docs" / "benchmarks" / "data" / "gpu_check.json"
        entry = {"benchmark": "gpu_check", "script": "gpu_check.py", "command": record["machine"].get("command", ""),
                 "machine": record["machine"], "wall_seconds": sum(s["seconds"] for s in record["stages"]),
                 "kind": "json", "result": record}  # fmt: skip
        data.write_text(json.dumps(entry, indent=1) + "\n")
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import docs_pages

        page = docs_pages.DOCS / "gpu_check.md"
        page.write_text(docs_pages.render_page(docs_pages.BY_NAME["gpu_check"]))
        (docs_pages.DOCS / "index.md").write_text(docs_pages.render_index())
        print(f"gpu-check: wrote {data}, {page} and the benchmarks index")
        return 0
    stages = plan(out, device=args.device)
    if args.stages:
        wanted = args.stages.split(",")
        unknown = sorted(set(wanted) - {s.name for s in stages})
        if unknown:
            parser.error(f"unknown stage(s) {unknown}; choose from {', '.join(s.name for s in stages)}")
        stages = [s for s in stages if s.name in wanted]
    else:
        stages = [s for s in stages if s.default]
    if args.dry_run:
        for s in stages:
            print(f"{s.name} (limit {s.limit_s} s): {' '.join(s.argv)}")
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is False); "
              "run it where one is, see the plan with --dry-run, or run the CPU stand-in with --device cpu",
              file=sys.stderr)  # fmt: skip
        return 2
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    from ampkit.tools.bench.machine import machine_info

    record: dict[str, Any] = {"machine": machine_info(args.device), "cuda_version": torch.version.cuda, "stages": []}
    for stage in stages:
        print(f"gpu-check: {stage.name} (limit {stage.limit_s} s) ...", flush=True)
        result = run_stage(stage, out)
        result["figures"] = headline(stage.name, out)
        record["stages"].append(result)
        print(f"gpu-check: {stage.name}: exit {result['exit_code']} in {result['seconds']} s", flush=True)
    (out / "gpu-check.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "gpu-check.md").write_text(summary_markdown(record))
    print(f"gpu-check: wrote {out / 'gpu-check.json'} and {out / 'gpu-check.md'}")
    return 0 if all(s["exit_code"] == 0 for s in record["stages"]) else 1


if __name__ == "__main__":
    sys.exit(main())
