"""One command for a machine with a CUDA GPU: every CUDA path ampkit has, run and measured.

Stages, one after another, each in its own process with its own time limit (the
whole run is planned for under 8 minutes on one H200-class GPU):

==============  ==========================================================================
stage           what it runs
==============  ==========================================================================
``tests``       ``pytest -m cuda`` over tests/ (the suite's CUDA-marked tests)
``bench-fp16``  ``ampkit bench --device cuda --dtype fp16`` on cnn, lm and wide with fp32,
                torch-autocast, ampkit-O1/O2/O2K and bf16
``bench-bf16``  the same with ``--dtype bf16``
``step-limit``  ``benchmarks/step_limit.py --device cuda`` (both phases, every arm)
``fp8``         ``benchmarks/fp8.py --device cuda`` at its GPU sizes (d_model 4096)
==============  ==========================================================================

Written into ``--out`` (default ``gpu-check-out``): each stage's own output files
(junit XML, results.json + bench.png, JSON), the log of each stage, and
``gpu-check.json`` + ``gpu-check.md``: the machine, every stage's command, exit code,
seconds and its headline figures.

    make gpu-check                                 # or:
    python benchmarks/gpu_check.py --out gpu-check-out
    python benchmarks/gpu_check.py --dry-run       # the plan, on any machine

Without a CUDA GPU it says so in one line and exits 2 (``--dry-run`` works anywhere).
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


def plan(out: Path, python: str = sys.executable) -> list[Stage]:
    """The stages, in order, writing under ``out`` (time limits sum to 470 s)."""
    bench = (python, "-m", "ampkit", "bench", "--device", "cuda", "--precisions", PRECISIONS)
    return [
        Stage("tests", (python, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={out / 'cuda-tests.xml'}", str(ROOT / "tests")), 150, "cuda-tests.xml"),  # fmt: skip
        Stage("bench-fp16", (*bench, "--dtype", "fp16", "--out", str(out / "bench-fp16")), 80, "bench-fp16"),
        Stage("bench-bf16", (*bench, "--dtype", "bf16", "--out", str(out / "bench-bf16")), 80, "bench-bf16"),
        Stage("step-limit", (python, str(ROOT / "benchmarks" / "step_limit.py"), "--device", "cuda", "--phase", "both",
                             "--rounds", "3", "--json", str(out / "step_limit.json")), 100, "step_limit.json"),  # fmt: skip
        Stage("fp8", (python, str(ROOT / "benchmarks" / "fp8.py"), "--device", "cuda",
                      "--json", str(out / "fp8.json")), 60, "fp8.json"),  # fmt: skip
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-check-out", help="folder for every output (default gpu-check-out)")
    parser.add_argument("--stages", default=None, help="comma-separated subset of the stages (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit, on any machine")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    stages = plan(out)
    if args.stages:
        wanted = args.stages.split(",")
        unknown = sorted(set(wanted) - {s.name for s in stages})
        if unknown:
            parser.error(f"unknown stage(s) {unknown}; choose from {', '.join(s.name for s in stages)}")
        stages = [s for s in stages if s.name in wanted]
    if args.dry_run:
        for s in stages:
            print(f"{s.name} (limit {s.limit_s} s): {' '.join(s.argv)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is False); "
              "run it where one is, or see the plan with --dry-run", file=sys.stderr)  # fmt: skip
        return 2
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    from ampkit.tools.bench.machine import machine_info

    record: dict[str, Any] = {"machine": machine_info("cuda"), "cuda_version": torch.version.cuda, "stages": []}
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
