"""The doctor on the command line beyond ``ampkit doctor`` on an ampkit script:
``ampkit run --doctor`` (and ``AMPKIT_DOCTOR=1`` under ``ampkit run``) on a script that
never mentions ampkit, and ``ampkit doctor`` on such a script, which says what to run
instead of reporting nothing."""

from __future__ import annotations

import json
import logging

import pytest

from ampkit.tools.cli.main import main
from ampkit.tools.diagnosis import current

# A plain fp32 script: one batch 1e6 times larger (step 3) overflows fp16 in the first layer.
PLAIN = """
import sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(5):
    x = torch.randn(4, 8) * (1e6 if step == 2 else 1.0)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("trained", sys.argv[1:])
"""


@pytest.fixture
def plain(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(PLAIN)
    return script


def test_run_doctor_prints_the_report_of_the_run(plain, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("AMPKIT_DOCTOR", raising=False)
    report = tmp_path / "run.json"
    code = main(["run", "--doctor", "--dtype", "fp16", "--report", str(report), str(plain), "x"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "trained ['x']" in out
    assert "ampkit run: O1 fp16, exit code 0" in err  # the run's summary, as without --doctor
    # the doctor's report, as `ampkit doctor` prints it (plain text off a terminal)
    assert "ampkit doctor: 5 steps, 1 skipped, compute dtype fp16" in out
    assert "step 3: first non-finite value at 0 (Linear), forward" in out
    assert "module_rules={'0': torch.float32}" in out
    data = json.loads(report.read_text())
    assert data["doctor"]["steps"] == 5 and data["doctor"]["skipped"] == 1
    assert data["optimizers"][0]["skipped"] == 1
    assert current() is None  # stopped with the run
    assert "AMPKIT_DOCTOR" not in __import__("os").environ  # the run's switch is undone


def test_run_honours_the_environment_switch(plain, capsys, monkeypatch):
    monkeypatch.setenv("AMPKIT_DOCTOR", "1")
    assert main(["run", "--dtype", "fp16", str(plain)]) == 0
    out = capsys.readouterr().out
    assert "ampkit doctor: 5 steps, 1 skipped" in out
    monkeypatch.setenv("AMPKIT_DOCTOR", "0")
    assert main(["run", "--dtype", "fp16", str(plain)]) == 0
    assert "ampkit doctor:" not in capsys.readouterr().out


def test_run_doctor_refuses_what_it_cannot_watch(plain, capsys, monkeypatch):
    monkeypatch.delenv("AMPKIT_DOCTOR", raising=False)
    assert main(["run", "--doctor", "--level", "fp32", str(plain)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--level fp32 manages none" in line and "--level O1" in line
    assert main(["run", "--doctor", "--compare", str(plain)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--doctor goes without --compare" in line and "ampkit run --doctor --level O1" in line


def test_doctor_on_a_script_without_ampkit_says_what_to_run(plain, capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="ampkit.doctor"):
        code = main(["doctor", str(plain), "a b"])
    out, err = capsys.readouterr()
    assert code == 0 and "trained ['a b']" in out
    # early, at the first step outside ampkit: this run will have nothing to report
    [early] = [r.getMessage() for r in caplog.records if r.name == "ampkit.doctor"]
    assert "the SGD stepped at train.py:11 is not managed by ampkit" in early
    assert f"stop it (Ctrl-C) and run: ampkit run --doctor {plain} 'a b'" in early
    # at the end: why nothing, and the two ways to a report
    assert "ampkit doctor: nothing to report: the script never set ampkit up" in err
    assert "it stepped 1 optimizer(s) outside ampkit: SGD (train.py:11)" in err
    assert f"ampkit run --doctor {plain} 'a b'" in err
    assert "amp.init_trainer(optimizer)" in err and "amp.init()" in err
    assert current() is None


def test_the_suggested_command_reports(plain, capsys):
    """What ``ampkit doctor`` proposes for a plain script gives a report."""
    main(["doctor", str(plain)])
    suggested = next(line.split() for line in capsys.readouterr().err.splitlines() if "ampkit run --doctor" in line)
    assert suggested[:3] == ["ampkit", "run", "--doctor"]
    assert main([*suggested[1:3], "--dtype", "fp16", *suggested[3:]]) == 0
    assert "ampkit doctor: 5 steps, 1 skipped" in capsys.readouterr().out
