"""``ampkit run`` and the optimizers' steps: it trains as the script edited to call
``amp.initialize`` does (nanoGPT's disabled ``GradScaler`` included), watches steps per
optimizer (no process-wide optimizer hook, so a managed step may be skipped on the
device, as in the edited script), and counts steps, skips, held schedules and the step
limit the same on either path. Runs go through ``ampkit.tools.cli.main.main(["run",
...])`` in this process."""

from __future__ import annotations

import builtins
import json
import runpy
import sys
from pathlib import Path

import pytest
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ampkit
from ampkit.tools.cli.main import main
from ampkit.trainer import device_skip

# nanoGPT's loop (train.py): a GradScaler that is off unless the dtype is fp16,
# unscale_ before clipping model.parameters(), scaler.step and update. With argv[1] ==
# "edited", the same script edited to call amp.initialize and amp.scale_loss.
NANOGPT_LOOP = """\
import sys

import torch
import torch.nn.functional as F
from torch import nn

EDITED = sys.argv[1:] == ["edited"]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
if EDITED:
    import ampkit as amp

    model, opt = amp.initialize(model, opt, opt_level="O2")
scaler = torch.amp.GradScaler("cpu", enabled=False)
gen = torch.Generator().manual_seed(1)
for step in range(12):
    x = torch.randn(16, 8, generator=gen)
    y = torch.randint(0, 4, (16,), generator=gen)
    loss = F.cross_entropy(model(x).float(), y)
    if EDITED:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    else:
        scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
print("weights", [p.double().sum().item() for p in model.parameters()])
"""

# AdamW (ampkit makes it fused at O1, whose kernel takes the found-inf flag) and a
# StepLR stepped by the loop; INF_AT=K makes step K's loss infinite.
SCHEDULED = """\
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import optimizer as optim_module

inf_at = int(os.environ.get("INF_AT", "-1"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
gen = torch.Generator().manual_seed(1)
for step in range(20):
    x = torch.randn(16, 8, generator=gen)
    y = torch.randint(0, 4, (16,), generator=gen)
    loss = F.cross_entropy(model(x), y)
    if step == inf_at:
        loss = loss * float("inf")
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
print("global_step_hooks", len(optim_module._global_optimizer_pre_hooks) + len(optim_module._global_optimizer_post_hooks))
print(f"final_lr {sched.get_last_lr()[0]:.6g}")
print("weights", [p.double().sum().item() for p in model.parameters()])
"""


def _run(options: list[str], script: Path, capsys, tmp_path: Path, args: list[str] | None = None):
    """``ampkit run [options] --report R script``: (exit code, stdout, stderr, report)."""
    report = tmp_path / "report.json"
    code = main(["run", *options, "--report", str(report), str(script), *(args or [])])
    out, err = capsys.readouterr()
    return code, out, err, json.loads(report.read_text())


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def device_steps(monkeypatch) -> list[int]:
    """Counts the managed steps run on the device path (one entry per step)."""
    calls: list[int] = []
    original = device_skip.step

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(device_skip, "step", counted)
    return calls


def _line(out: str, key: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(key + " "))


def test_o2_with_a_disabled_grad_scaler_trains_as_initialize_does(capsys, tmp_path):
    """nanoGPT's GradScaler is off in bf16: its unscale_ and step go straight to torch's
    (which do nothing but call optimizer.step()), and the run's weights are bit for bit
    those of the script edited to call amp.initialize(..., opt_level="O2")."""
    script = _script(tmp_path, "nanogpt_loop.py", NANOGPT_LOOP)
    code, out, err, report = _run(["--level", "O2"], script, capsys, tmp_path)
    assert code == 0, err
    assert report["optimizers"][0]["managed"] == "O2" and report["optimizers"][0]["steps"] == 12
    saved = sys.argv[:]
    sys.argv = [str(script), "edited"]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
        ampkit.reset()
    edited = capsys.readouterr().out
    assert _line(out, "weights") == _line(edited, "weights")


def test_managed_steps_are_skipped_on_the_device_as_without_the_run(capsys, tmp_path, monkeypatch, device_steps):
    """No process-wide optimizer hook during the run: at O1 the fused AdamW's steps after
    the first are decided on the device, as in a script calling init_trainer itself. The
    skipped step, the held schedule, the counts and the weights are those of the same run
    with every step decided on the host (a process-wide hook of the test's forces that)."""
    script = _script(tmp_path, "scheduled.py", SCHEDULED)
    monkeypatch.setenv("INF_AT", "5")
    code, out, err, report = _run([], script, capsys, tmp_path)
    assert code == 0, err
    # at most the casting engine's own (it drops cached casts; the device path allows it)
    assert _line(out, "global_step_hooks") in ("global_step_hooks 0", "global_step_hooks 1")
    assert len(device_steps) == 19  # the first step creates AdamW's state: on the host
    opt = report["optimizers"][0]
    assert (opt["managed"], opt["steps"], opt["skipped"]) == ("O1", 20, 1)
    assert report["iterations"] == 20 and report["scheduler_steps_held"] == 1
    assert "final_lr 0.00125\n" in out  # 19 real steps of StepLR(5, 0.5): three halvings

    device_steps.clear()
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: None)
    try:
        code, host_out, err, host_report = _run([], script, capsys, tmp_path)
    finally:
        handle.remove()
    assert code == 0, err
    assert device_steps == []
    assert _line(host_out, "weights") == _line(out, "weights")
    assert _line(host_out, "final_lr") == _line(out, "final_lr")
    for key in ("iterations", "scheduler_steps_held", "optimizers", "backward_calls", "losses"):
        assert host_report[key] == report[key], key


def test_the_step_limit_stops_after_a_step_decided_on_the_device(capsys, tmp_path, device_steps):
    """``--steps 7``: the script ends right after its 7th step, also when that step's
    outcome is left for the host to record later."""
    script = _script(tmp_path, "scheduled.py", SCHEDULED)
    code, out, err, report = _run(["--steps", "7"], script, capsys, tmp_path)
    assert code == 0, err
    assert len(device_steps) == 6
    assert report["iterations"] == 7 and report["optimizers"][0]["steps"] == 7
    assert report["stopped_early"] == "max_steps=7 reached"
    assert "final_lr" not in out


@pytest.mark.parametrize("level", ["fp32", "O1"])
def test_steps_of_unmanaged_optimizers_are_counted_by_their_own_hooks(level, capsys, tmp_path):
    """The fp32 run's optimizers, and one superseded by a new optimizer over the same
    parameters, are counted through step hooks of their own, taken off when the run
    ends (the script keeps both optimizers)."""
    script = _script(tmp_path, "two_optimizers.py", (
        "import builtins, torch\n"
        "model = torch.nn.Linear(4, 2)\n"
        "def train(opt, steps):\n"
        "    for _ in range(steps):\n"
        "        model(torch.randn(3, 4)).sum().backward()\n"
        "        opt.step()\n"
        "        opt.zero_grad()\n"
        "first = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "train(first, 3)\n"
        "second = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "train(second, 4)\n"
        "train(first, 2)\n"
        "builtins._ampkit_test_kept = (first, second)\n"
    ))  # fmt: skip
    try:
        code, out, err, report = _run(["--level", level], script, capsys, tmp_path)
        kept = builtins._ampkit_test_kept
    finally:
        builtins.__dict__.pop("_ampkit_test_kept", None)
    assert code == 0, err
    first, second = report["optimizers"]
    assert (first["managed"], first["steps"]) == ("superseded", 5)
    assert (second["managed"], second["steps"]) == (level, 4)
    assert report["iterations"] == 7  # the first optimizer's steps, then the second's
    for opt in kept:
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
        assert "_ampkit_managed" not in opt.__dict__
