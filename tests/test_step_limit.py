"""benchmarks/step_limit.py: its synthetic backward, and a tiny interleaved run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_limit.py"


def _module():
    spec = importlib.util.spec_from_file_location("step_limit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
def test_step_limit_prints_a_table_with_ratios_to_bf16():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--workloads", "cnn", "--arms", "fp32,ampkit-O1,bf16", "--phase", "update",
         "--rounds", "1", "--steps", "1"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert float(lines["bf16"][3]) == 1.0  # its own ratio
    for arm in ("fp32", "ampkit-O1"):
        assert float(lines[arm][1]) > 0 and float(lines[arm][3]) > 0
