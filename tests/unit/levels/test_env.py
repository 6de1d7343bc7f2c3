"""AMPKIT_LEVEL and AMPKIT_DTYPE: a launcher or sweep chooses the level and dtype without
editing code. Precedence: an argument > the environment > the default; a value that
names nothing raises, naming the variable, before anything changes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit.errors import AmpError
from ampkit.tools.cli.main import main


def _model_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_initialize_takes_the_level_and_dtype_from_the_environment(monkeypatch):
    monkeypatch.setenv("AMPKIT_LEVEL", "o2")
    monkeypatch.setenv("AMPKIT_DTYPE", "fp16")
    model, opt = amp.initialize(*_model_opt())
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in amp.master_params(opt))
    # an argument beats the environment
    model, opt = amp.initialize(*_model_opt(), opt_level="O1", dtype=torch.bfloat16)
    assert model[0].weight.dtype == torch.float32
    assert model(torch.randn(2, 8)).dtype == torch.bfloat16


@pytest.mark.parametrize("var,value", [("AMPKIT_LEVEL", "O9"), ("AMPKIT_DTYPE", "fp8")])
def test_a_bad_value_is_refused_naming_the_variable_and_nothing_changes(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    model, opt = _model_opt()
    with pytest.raises(AmpError, match=f"{var}={value!r}"):
        amp.initialize(model, opt)
    assert model[0].weight.dtype == torch.float32
    assert not amp.levels.setup.is_managed(opt)


def test_init_takes_the_dtype_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("AMPKIT_DTYPE", "float16")
    assert amp.init(device_type="cpu").dtype == torch.float16
    assert amp.init(torch.bfloat16, device_type="cpu").dtype == torch.bfloat16
    amp.reset()
    monkeypatch.setenv("AMPKIT_DTYPE", "half")
    with pytest.raises(AmpError, match="AMPKIT_DTYPE='half'"):
        amp.init(device_type="cpu")


def test_ampkit_run_honours_the_environment(monkeypatch, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    opt.zero_grad(); model(torch.randn(4, 8)).float().square().mean().backward(); opt.step()\n"
    )
    monkeypatch.setenv("AMPKIT_LEVEL", "O2")
    assert main(["run", "--report", str(tmp_path / "r.json"), str(script)]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["level_applied"] == "O2"
    assert main(["run", "--level", "O1", "--report", str(tmp_path / "r.json"), str(script)]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["level_applied"] == "O1"  # the option wins
    capsys.readouterr()
    monkeypatch.setenv("AMPKIT_LEVEL", "O3")  # not a level ampkit run offers
    assert main(["run", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "AMPKIT_LEVEL='O3'" in err[0] and "O1, O2, O2K, fp32" in err[0]


def test_the_integrations_honour_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_LEVEL", "O2")
    monkeypatch.setenv("AMPKIT_DTYPE", "bf16")
    lightning = pytest.importorskip("ampkit.integrations.lightning")
    assert lightning.AmpkitPrecision().opt_level.name == "O2"
    assert lightning.AmpkitPrecision("O1").opt_level.name == "O1"
    hf = pytest.importorskip("ampkit.integrations.hf")
    args = hf.AmpkitTrainingArguments(output_dir=str(tmp_path), report_to=[])
    assert (args.amp_level, args.amp_dtype) == ("O2", "bfloat16")
    acc_mod = pytest.importorskip("ampkit.integrations.accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        model, opt = _model_opt()
        model, opt = acc_mod.prepare(Accelerator(cpu=True), model, opt)
        assert model[0].weight.dtype == torch.bfloat16
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
