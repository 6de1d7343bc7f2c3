"""The doctor on the command line beyond ``ampkit doctor`` on an ampkit script:
``ampkit run --doctor`` (and ``AMPKIT_DOCTOR=1`` under ``ampkit run``) on a script that
never mentions ampkit, ``ampkit doctor`` on such a script, which says what to run
instead of reporting nothing, and the report's width: 160 columns (a 1280-pixel
window), or ``$COLUMNS``, with no cell cut."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest
import torch
from torch import nn

import ampkit as amp
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


@pytest.mark.filterwarnings("ignore::ampkit.tools.diagnosis.DoctorWarning")  # its loss.backward(), on purpose
def test_doctor_on_an_ampkit_script_warns_of_no_unmanaged_step(tmp_path, capsys, caplog):
    """``init_trainer`` steps a throwaway AdamW of its own (the fused-kernel probe):
    that is no step of the script's outside ampkit."""
    script = tmp_path / "amp_train.py"
    script.write_text(PLAIN.replace("SGD(model.parameters(), lr=0.01)", "AdamW(model.parameters(), lr=0.01)")
                      .replace("for step", "import ampkit as amp\namp.init_trainer(opt)\nfor step"))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="ampkit.doctor"):
        assert main(["doctor", str(script)]) == 0
    out, err = capsys.readouterr()
    assert "ampkit doctor: 5 steps" in out and "nothing to report" not in err
    assert not [r for r in caplog.records if "not managed by ampkit" in r.getMessage()]


# --- width: the report fits a 160-column terminal (a 1280-pixel window) --------------------------
class ProjectionWithAVeryLongClassNameForTesting(nn.Linear):
    pass


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder_stack_with_a_long_name = nn.ModuleDict({
            "layer_00_self_attention_block": nn.Sequential(
                ProjectionWithAVeryLongClassNameForTesting(8, 8), nn.ReLU(), nn.Linear(8, 2)),
        })  # fmt: skip

    def forward(self, x):
        return self.encoder_stack_with_a_long_name["layer_00_self_attention_block"](x)


def _deep_report():
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.init_trainer(opt, scaler=2.0**8)
    policy = amp.Policy(dtype=torch.float16)
    with amp.doctor(opt, every=1) as doc:
        for step in range(4):
            x = torch.randn(4, 8) * (1e6 if step == 1 else 1.0)
            with amp.autocast(policy, device_type="cpu"):
                loss = model(x).float().pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    return doc.report()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _statement(line: str) -> bool:
    """A line of advice code that is no comment: it stays whole, whatever the width."""
    return line.startswith("     | ") and not line[7:].lstrip().startswith("#")


def _plain_names(text: str) -> list[str]:
    """The module names of the plain margins table, folded pieces joined (a row starts
    where the dtype column is filled)."""
    lines = text.split("Margins, per module")[1].split("act max, grad max:")[0].splitlines()[2:]
    rule = next(i for i, line in enumerate(lines) if line.strip().startswith("---"))
    groups = [m.span() for m in re.finditer(r"-+", lines[rule])]  # (start, end) of each column
    (name_at, name_end), dtype = groups[0], groups[2]
    names: list[str] = []
    for line in lines[rule + 1:]:
        if not line.strip():
            continue
        piece = line[name_at:name_end].strip()
        if line[dtype[0]:dtype[1]].strip():
            names.append(piece)
        else:
            names[-1] += piece
    return names


def test_a_report_fits_160_columns_and_cuts_no_cell(monkeypatch):
    report = _deep_report()
    names = [m.module for m in report.margins]
    longest = "encoder_stack_with_a_long_name.layer_00_self_attention_block.0"
    assert longest in names and report.skipped == 1 and report.advice
    # plain text (logs, pipes): at most 160 columns, every module name whole once unfolded
    text = report.table()
    assert max(map(len, text.splitlines())) <= 160, text
    assert _plain_names(text) == [n or "<root>" for n in names]
    assert "module_rules={'" + longest + "': torch.float32}" in text  # advice code stays whole
    # in a pipe, $COLUMNS sets the width: narrower, the margins table splits in two
    monkeypatch.setenv("COLUMNS", "88")
    piped = io.StringIO()
    report.print(piped)
    lines = piped.getvalue().splitlines()
    assert max(len(line) for line in lines if not _statement(line)) <= 88
    assert [line.split()[:2] for line in lines if line.startswith("  module ")] == [["module", "type"], ["module", "subnormal"]]
    # rich, on a terminal 160 columns wide (what `ampkit doctor` prints there)
    pytest.importorskip("rich")
    monkeypatch.setenv("COLUMNS", "160")
    out = _Terminal()
    report.print(out)
    shown = ANSI.sub("", out.getvalue())
    assert "┏" in shown  # the rich table, not plain text
    assert max(map(len, shown.splitlines())) <= 160, shown
    assert "…" not in shown  # no cell cut short: long names fold onto more lines
    assert "[module level] step 2" in shown  # text in brackets is no markup
    assert "ProjectionWithAVeryLongClassNameForTesting"[:20] in shown
