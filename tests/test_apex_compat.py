"""ampkit.compat.apex: a legacy apex.amp script with one import changed, and the
amp object's verbs one by one."""

from __future__ import annotations

import copy
import difflib
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit
from ampkit.compat.apex import amp
from ampkit.errors import AmpError, StateError

SCRIPT = Path(__file__).with_name("legacy_apex_script.py")
APEX_IMPORT = "from apex import amp"
OUR_IMPORT = "from ampkit.compat.apex import amp"


def _ported_script(tmp_path: Path) -> Path:
    source = SCRIPT.read_text()
    assert source.count(APEX_IMPORT + "\n") == 1
    ported = source.replace(APEX_IMPORT + "\n", OUR_IMPORT + "\n")
    changed = [
        line
        for line in difflib.unified_diff(source.splitlines(), ported.splitlines(), lineterm="", n=0)
        if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
    ]
    assert changed == ["-" + APEX_IMPORT, "+" + OUR_IMPORT]
    path = tmp_path / "train.py"
    path.write_text(ported)
    return path


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_legacy_apex_script_runs_with_only_the_import_changed(tmp_path, monkeypatch, opt_level):
    script = _ported_script(tmp_path)
    out = tmp_path / "result.pt"
    monkeypatch.setattr(sys, "argv", [str(script), "--opt-level", opt_level, "--out", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    result = torch.load(out)
    losses = [entry[0] for entry in result["log"]]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < 0.85 * sum(losses[:3])  # it learns the small data set
    # Clipping saw unscaled grads (apex unscaled at scale_loss exit): norms of order 1,
    # not 65536 times that.
    assert all(0.01 < entry[2] < 100 for entry in result["log"])
    # register_float_function(torch, "sigmoid"): fp32 under O1 although its input is
    # bf16; under O2 the model's outputs are cast to fp32 by its output hook.
    assert {entry[3] for entry in result["log"]} == {"torch.float32"}
    assert result["eval_dtype"] == "torch.float32"
    # The documented checkpoint recipe resumes bitwise.
    for name, value in result["final"].items():
        assert torch.equal(value, result["resumed"][name]), name
    state = result["amp_state"]
    assert state["loss_scaler0"]["loss_scale"] == 2.0**16
    assert state["loss_scaler1"]["unskipped"] == 12


@pytest.mark.slow
def test_legacy_apex_script_runs_as_a_program(tmp_path):
    script = _ported_script(tmp_path)
    out = tmp_path / "result.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(script), "--opt-level", "O2", "--steps", "4", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(torch.load(out)["log"]) == 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_initialize_returns_the_shapes_apex_returned():
    model = _model()
    assert amp.initialize(model, opt_level="O2") is model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    models, opts = amp.initialize([_model()], [torch.optim.SGD(_model().parameters(), lr=0.1)])
    assert isinstance(models, list) and isinstance(opts, list)
    m, o = amp.initialize(model, opt, enabled=False)
    assert m is model and o is opt


def test_keep_batchnorm_fp32_accepts_apex_strings():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32="False")
    assert model[1].weight.dtype == torch.bfloat16
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32=True)
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    with pytest.raises(AmpError, match="keep_batchnorm_fp32"):
        amp.initialize(_model(), opt_level="O2", keep_batchnorm_fp32="yes")


def test_scale_loss_unscales_at_exit_unless_delayed():
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale=128.0)
    x = torch.randn(6, 4)
    ref(x).pow(2).sum().backward()
    with amp.scale_loss(model(x).float().pow(2).sum(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    delayed = model[0].weight.grad.clone()
    # ampkit's grads are real even inside a delay_unscale block (apex left them scaled
    # there, unreadable; nothing can rely on that): the fp32 grads up to bf16 compute.
    assert torch.allclose(delayed, ref[0].weight.grad, rtol=0.05, atol=0.02 * ref[0].weight.grad.abs().max())
    with amp.scale_loss(model(x).float().pow(2).sum(), opt) as scaled:
        scaled.backward()
    # The second block accumulated onto the first: the plain sum of both grads.
    assert torch.allclose(model[0].weight.grad, 2 * delayed, rtol=1e-5)
    # A third loss after the unscale is accumulated too, not refused.
    with amp.scale_loss(model(x).float().pow(2).sum(), opt) as scaled:
        scaled.backward()
    assert torch.allclose(model[0].weight.grad, 3 * delayed, rtol=1e-5)
    before = model[0].weight.detach().clone()
    opt.step()
    assert torch.allclose(model[0].weight, before - 0.1 * 3 * delayed, rtol=1e-5)


def test_state_dict_has_apex_keys_and_loads_an_apex_checkpoint():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", num_losses=2)
    state = amp.state_dict()
    assert state["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 0}
    assert set(state) == {"loss_scaler0", "loss_scaler1", "ampkit"}
    # A checkpoint written by apex itself: scale and growth counter only.
    amp.load_state_dict(
        {
            "loss_scaler0": {"loss_scale": 512.0, "unskipped": 7},
            "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0},
        }
    )
    scalers = ampkit.optim.managed_state(opt).scalers
    assert [s.scale for s in scalers] == [512.0, 8.0]
    assert scalers[0].growth_tracker == 7
    with pytest.raises(StateError, match="loss scaler"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})


def test_register_functions_rules():
    with pytest.raises(AmpError, match="no function named"):
        amp.register_float_function(torch, "not_a_function")

    def my_op(x):
        return x * 2

    holder = type("M", (), {"my_op": staticmethod(my_op)})
    with pytest.raises(AmpError, match="decorate"):
        amp.register_half_function(holder, "my_op")
    amp.register_float_function(torch, "mm")
    model = _model()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1")
    a = torch.randn(3, 3)
    assert torch.mm(a, a).dtype == torch.float32  # registered: fp32 under O1
    assert torch.matmul(a, a).dtype == torch.bfloat16  # not registered: lowered
    with pytest.raises(StateError, match="before amp.initialize"):
        amp.register_promote_function(torch, "add")


def test_decorators_cast_only_while_casting_is_on():
    seen = []

    @amp.half_function
    def half(x, y):
        seen.append((x.dtype, y.dtype, torch.is_autocast_enabled("cpu")))
        return x @ y

    @amp.float_function
    def full(x):
        return x

    @amp.promote_function
    def promote(x, y):
        return x, y

    a = torch.randn(2, 2)
    half(a, a)
    assert seen[-1][:2] == (torch.float32, torch.float32)  # amp off: untouched
    model = _model()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1")
    out = half(a, a)
    assert seen[-1] == (torch.bfloat16, torch.bfloat16, False) and out.dtype == torch.bfloat16
    assert full(a.bfloat16()).dtype == torch.float32
    x, y = promote(a.bfloat16(), a)
    assert x.dtype == y.dtype == torch.float32
    with amp.disable_casts():
        assert (a @ a).dtype == torch.float32
    assert (a @ a).dtype == torch.bfloat16


def test_scale_loss_before_initialize_is_refused():
    with pytest.raises(StateError, match="initialize"):
        with amp.scale_loss(torch.tensor(1.0, requires_grad=True), None):
            pass
