"""benchmarks/gpu_check.py: its CPU-side parts (the plan, the refusal, the summary).

The stages themselves need a CUDA GPU; here each stage's command is shown to be one
its script accepts (each refuses ``--device cuda`` on this machine with its own
one-line reason, exit 2, instead of an unknown-argument error), and the summary is
built from files the real scripts write.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from locations import ROOT, load_file

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA GPU")


def _module():
    return load_file(SCRIPT)


def test_without_a_gpu_it_refuses_in_one_line_with_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "o")], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()  # nothing written


def test_the_default_plan_runs_the_cheap_stages_first_within_its_budget(tmp_path):
    gpu_check = _module()
    stages = gpu_check.plan(tmp_path)
    default = [s for s in stages if s.default]
    assert [s.name for s in default] == ["smoke", "tests", "speed", "fp8"]
    assert sum(s.limit_s for s in default) <= 375
    assert [s.name for s in stages if not s.default] == ["bench-fp16", "bench-bf16", "step-limit", "tune", "host"]
    (tune,) = [s for s in stages if s.name == "tune"]
    assert tune.argv[tune.argv.index("--candidates") + 1] == "bf16,fp8"
    assert all("cuda" in s.argv for s in stages)
    (speed,) = [s for s in stages if s.name == "speed"]
    assert "--profile" in speed.argv
    for dtype in ("fp16", "bf16"):
        (bench,) = [s for s in stages if s.name == f"bench-{dtype}"]
        assert bench.argv[bench.argv.index("--dtype") + 1] == dtype
        assert set(bench.argv[bench.argv.index("--precisions") + 1].split(",")) == {
            "fp32", "torch-autocast", "ampkit-O1", "ampkit-O2", "ampkit-O2K", "bf16"}  # fmt: skip


@pytest.mark.parametrize("stage", ["smoke", "speed", "bench-fp16", "step-limit", "fp8", "tune", "host"])
def test_each_stage_command_is_accepted_by_its_script(tmp_path, stage, forked_python):
    """On a CPU-only machine each command fails with its script's own "no CUDA GPU"
    line: proof that every option the plan passes exists. (Each command runs in a
    process forked from one that imported torch and ampkit: ``tests/support/forked.py``.)"""
    gpu_check = _module()
    (s,) = [s for s in gpu_check.plan(tmp_path) if s.name == stage]
    proc = forked_python.run_argv(list(s.argv), cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unrecognized arguments" not in proc.stderr and "invalid choice" not in proc.stderr
    assert "CUDA GPU" in proc.stderr


@pytest.mark.slow
def test_the_cpu_stand_in_runs_the_stages_and_the_docs_page_is_written_from_its_json(tmp_path, forked_python):
    """``--device cpu``: the same scripts at tiny sizes write the same files; the page
    generated from the record shows each stage, the speed table with every arm run, the
    checks and the smoke cases, from the figures in the JSON."""
    out = tmp_path / "o"
    proc = forked_python.run_script(SCRIPT, ["--device", "cpu", "--stages", "smoke,speed", "--out", str(out)], cwd=ROOT,
                                    timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "gpu-check.json").read_text())
    assert [s["name"] for s in record["stages"]] == ["smoke", "speed"]
    smoke = record["stages"][0]["figures"]
    assert smoke["counts"]["passed"] >= 3 and smoke["counts"]["failed"] == smoke["counts"]["error"] == 0
    speed = record["stages"][1]["figures"]
    assert set(speed["lm"]) == {"fp32", "autocast-bf16", "ampkit-O1-bf16"} and set(speed["conv"]) == {"fp32"}
    page = _module().docs_page(record, "gpu-check.json")
    assert "| smoke | passed |" in page and "| speed | passed |" in page
    step = speed["lm"]["ampkit-O1-bf16"]["step_ms"]
    assert f"| ampkit-O1-bf16 | {step:.2f} |" in page
    assert "ampkit-O1-bf16 loss within 1% of fp32" in page
    assert f"{smoke['counts']['passed']} cases passed" in page


def test_summary_is_built_from_the_stage_files(tmp_path):
    gpu_check = _module()
    (tmp_path / "cuda-tests.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="5" failures="1" errors="0" '
        'skipped="1"></testsuite></testsuites>'
    )
    (tmp_path / "bench-fp16").mkdir()
    entry = {"step_ms": 3.0, "speedup": 2.0, "time_vs_bf16": 1.1, "peak_mib": 10.0, "memory_vs_fp32": 0.6,
             "final_train_loss": 0.2, "accuracy": 0.9, "skipped_steps": 1, "losses": [1.0]}  # fmt: skip
    (tmp_path / "bench-fp16" / "results.json").write_text(
        json.dumps({"workloads": {"cnn": {"precisions": {"ampkit-O2": entry}}}})
    )
    (tmp_path / "step_limit.json").write_text(json.dumps({
        "results": [{"workload": "wide", "phase": "full", "rows": {"bf16": {"min": 2.0}, "ampkit-O2": {"min": 2.2}}}],
        "checks": [{"name": "wide [full]: ampkit-O2 <= 1.15 x bf16", "ok": True}]}))  # fmt: skip
    assert gpu_check.headline("tests", tmp_path) == {"tests": 5, "failures": 1, "errors": 0, "skipped": 1}
    bench = gpu_check.headline("bench-fp16", tmp_path)
    assert bench["cnn"]["ampkit-O2"]["skipped_steps"] == 1 and "losses" not in bench["cnn"]["ampkit-O2"]
    limit = gpu_check.headline("step-limit", tmp_path)
    assert limit["min_ms"]["wide [full]"]["ampkit-O2"] == 2.2
    assert gpu_check.headline("fp8", tmp_path) == {}  # no file: no figures, no crash
    from ampkit.tools.bench.machine import machine_info

    record = {"machine": machine_info("cpu"), "cuda_version": None, "stages": [
        {"name": "tests", "exit_code": 1, "timed_out": False, "seconds": 12.0, "log": "tests.log",
         "output": "cuda-tests.xml", "figures": gpu_check.headline("tests", tmp_path)},
        {"name": "fp8", "exit_code": None, "timed_out": True, "seconds": 60.0, "log": "fp8.log",
         "output": "fp8.json", "figures": {}}]}  # fmt: skip
    md = gpu_check.summary_markdown(record)
    assert "| tests | 1 | 12.0 |" in md and "| fp8 | timed out | 60.0 |" in md
    assert '"failures": 1' in md
