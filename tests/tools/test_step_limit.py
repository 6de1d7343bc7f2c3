"""benchmarks/step_limit.py: its synthetic backward, and a tiny interleaved run."""

from __future__ import annotations

import json

import pytest
import torch
from locations import ROOT, load_file

SCRIPT = ROOT / "benchmarks" / "step_limit.py"


def _module():
    return load_file(SCRIPT)


def test_synthetic_backward_gives_each_parameter_its_gradient_times_dl():
    step_limit = _module()
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))]
    grads = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16)]
    hooked = []
    params[1].register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad.dtype))
    loss = step_limit._GradientsFor.apply(grads, *params)
    assert loss.dtype == torch.float32 and loss.requires_grad
    (loss * 4.0).backward()
    assert torch.equal(params[0].grad, grads[0] * 4.0)
    assert params[1].grad.dtype == torch.bfloat16 and torch.equal(params[1].grad, grads[1] * 4.0)
    assert hooked == [torch.bfloat16]  # autograd's accumulation and hooks ran


@pytest.mark.slow
def test_step_limit_prints_a_table_with_ratios_to_bf16(tmp_path, forked_python):
    """The two references (bf16, bf16+fused) and one arm measured against them (ampkit-O1;
    every other arm's row is printed, recorded and checked alike), each a process."""
    out = tmp_path / "step_limit.json"
    proc = forked_python.run_script(SCRIPT, ["--workloads", "cnn", "--arms", "ampkit-O1,bf16,bf16+fused", "--phase",
                                             "update", "--rounds", "1", "--steps", "1", "--json", str(out)],
                                    timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert float(lines["bf16"][3]) == 1.0 and float(lines["bf16+fused"][4]) == 1.0  # their own ratios
    assert float(lines["ampkit-O1"][1]) > 0 and float(lines["ampkit-O1"][3]) > 0
    # the JSON holds what the table printed, and where it was measured
    record = json.loads(out.read_text())
    assert record["machine"]["torch"] == torch.__version__
    assert record["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(record["machine"]["cpu_flags"], list) and record["machine"]["date_utc"]
    (table,) = record["results"]
    assert (table["workload"], table["phase"]) == ("cnn", "update")
    rows = table["rows"]
    assert list(rows) == ["ampkit-O1", "bf16", "bf16+fused"]
    for arm, row in rows.items():
        assert len(row["times"]) == 1 and row["min"] == min(row["times"]) and row["median"] > 0
        assert row["vs_bf16"] == pytest.approx(row["min"] / rows["bf16"]["min"])
        assert row["vs_bf16_fused"] == pytest.approx(row["min"] / rows["bf16+fused"]["min"])
        assert f"{row['min']:.1f}" == lines[arm][1]
    assert record["checks"] == []  # the targets are checked on ``wide`` only


def test_checks_compare_against_bf16_fused_and_autocast_fused():
    step_limit = _module()
    rows = {arm: {"min": ms} for arm, ms in
            {"bf16": 100.0, "bf16+fused": 50.0, "ampkit-O2": 60.0, "ampkit-O2K": 52.0,
             "ampkit-O1": 103.0, "torch-autocast": 200.0, "autocast+fused": 100.0}.items()}  # fmt: skip
    step_limit._ratios(rows)
    checks = {c["name"].split(": ", 1)[1]: c for c in step_limit._checks("wide", "full", rows)}
    assert checks["ampkit-O2 <= 1.15 x bf16+fused"]["ok"] is False  # 1.20
    assert checks["ampkit-O2K <= 1.05 x bf16+fused"]["ok"] is True  # 1.04
    assert checks["ampkit-O1 <= 1.02 x autocast+fused"]["ok"] is False  # 1.03
    assert checks["ampkit-O1 <= 1.00 x torch-autocast"]["ok"] is True
