"""Bad input to ampkit's tools is an AmpError (or, on the command line, one line and
exit code 2) raised before any work: output paths that are folders or in missing
folders, calls that cannot run, unknown or mistyped options; exit codes as Python
computes them."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from locations import ROOT
from torch import nn

import ampkit as amp
from ampkit.errors import OutputPathError
from ampkit.tools.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore:ampkit. float16 on CPU")

SCRIPT = """
import pathlib, sys
pathlib.Path(sys.argv[1]).write_text("ran")
"""


def _one_line_exit_2(argv, capsys, needle):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    return err


@pytest.mark.parametrize("command", [["run", "--report"], ["doctor", "--json"], ["doctor", "--png"]])
def test_a_folder_as_output_path_is_refused_before_the_script_runs(command, tmp_path, capsys):
    script, marker = tmp_path / "s.py", tmp_path / "ran.txt"
    script.write_text(SCRIPT)
    folder = tmp_path / "out"
    folder.mkdir()
    _one_line_exit_2([*command, str(folder), str(script), str(marker)], capsys, "it is a folder")
    assert not marker.exists()


def test_convert_onnx_and_program_into_a_folder_are_refused_first(tmp_path, capsys):
    for flag in ("--onnx", "--program"):
        _one_line_exit_2(["convert", str(tmp_path / "missing.pt"), "--model", "m:f", "--calib", "m:c", flag,
                          str(tmp_path)], capsys, f"{flag}: cannot write")


def test_export_onnx_path_must_be_a_writable_file_path(tmp_path):
    conv = amp.convert(nn.Linear(4, 4))
    x = torch.randn(2, 4)
    for path, found in ((tmp_path, "it is a folder"), (5, "expected a file path"),
                        (tmp_path / "no" / "m.onnx", "does not exist")):
        with pytest.raises(OutputPathError, match=found):
            amp.export_onnx(conv, x, path)


def _report():
    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.init_trainer(opt)
    with amp.doctor(opt) as doc:
        with amp.scale_loss(m(torch.randn(2, 4)).sum(), opt) as s:
            s.backward()
        opt.step()
    amp.reset()
    return doc.report()


def test_report_files_into_missing_folders_or_folders_are_refused(tmp_path):
    report = _report()
    for call in (report.save_png, report.to_json):
        with pytest.raises(OutputPathError, match="does not exist"):
            call(tmp_path / "missing" / "r.out")
        with pytest.raises(OutputPathError, match="it is a folder"):
            call(tmp_path)
    assert not any(tmp_path.iterdir())


def test_doctor_names_its_options_and_refuses_unknown_or_mistyped_ones():
    params = inspect.signature(amp.doctor).parameters
    assert {k: params[k].default for k in ("every", "max_checks", "underflow_threshold", "log")} == {
        "every": 50, "max_checks": 10, "underflow_threshold": 0.5, "log": True}
    assert params["log"].annotation in (bool, "bool")
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.init_trainer(opt)
    try:
        for kwargs, found in (({"foo": 1}, "unknown option.*'foo'.*every, max_checks"), ({"log": "yes"}, "log must be"),
                              ({"underflow_threshold": True}, "underflow_threshold"),
                              ({"every": 2.0}, "every must be")):
            with pytest.raises(amp.StateError, match=found):
                amp.doctor(opt, **kwargs)
    finally:
        amp.reset()


def test_explain_of_a_call_that_raises_is_an_explain_error():
    from ampkit.casting.explanation import ExplainError

    with pytest.raises(ExplainError, match=r"Linear\(str 'x'\) and it raised TypeError") as info:
        amp.explain(nn.Linear(4, 4), "x")
    assert isinstance(info.value.__cause__, TypeError) and isinstance(info.value, amp.AmpError)
    with pytest.raises(ExplainError, match=r"tensor\[2, 3\] float32.*RuntimeError"):
        amp.explain(nn.Linear(4, 4), torch.randn(2, 3))


def test_system_exit_true_is_exit_code_1(tmp_path, capsys):
    from ampkit._internal.script import exit_code

    assert exit_code(True) == 1 and type(exit_code(True)) is int and exit_code(False) == 0
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit(True)\n")
    assert main(["run", str(script)]) == 1
    err = capsys.readouterr().err
    assert "exit code 1," in err and "exit code True" not in err
    code = main(["doctor", str(script)])
    assert code == 1 and type(code) is int


def test_a_missing_framework_is_named_with_an_install_line_that_works_without_the_registry():
    """ampkit is not on the package registry: ``pip install 'ampkit[lightning]'`` would
    find nothing. The message names the extra's own requirements (from the installed
    metadata) and the line for ampkit's clone."""
    from ampkit._internal.install import extra_requirements
    from ampkit.integrations import MissingFramework, require

    with pytest.raises(MissingFramework) as caught:
        require("no_such_framework_for_ampkit", "lightning")
    message = str(caught.value)
    assert "pip install -e '.[lightning]'" in message and "ampkit[lightning]" not in message
    for requirement in extra_requirements("lightning"):  # empty only when ampkit is not installed
        assert f"'{requirement}'" in message
    assert any(r.startswith("lightning") for r in extra_requirements("lightning"))


# --- outputs never replace inputs; numbers are bounded; I/O errors are one line -----------


@pytest.mark.parametrize("command", [["run", "--report"], ["doctor", "--json"], ["doctor", "--png"]])
def test_an_output_that_is_the_script_is_refused_and_the_script_kept(command, tmp_path, capsys):
    script, marker = tmp_path / "s.py", tmp_path / "ran.txt"
    script.write_text(SCRIPT)
    _one_line_exit_2([*command, str(script), str(script), str(marker)], capsys, "would overwrite the input")
    assert script.read_text() == SCRIPT and not marker.exists()
    # the same file under another name (a relative path) is the same input
    _one_line_exit_2([*command, str(tmp_path / "." / "s.py"), str(script), str(marker)], capsys, "would overwrite")


def test_compare_png_that_is_the_script_or_the_report_is_refused(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    _one_line_exit_2(["run", "--compare", "--png", str(script), str(script), "x"], capsys, "would overwrite the input")
    _one_line_exit_2(["run", "--compare", "--report", str(tmp_path / "r.json"), "--png", str(tmp_path / "r.json"),
                      str(script), "x"], capsys, "would overwrite the input")  # fmt: skip
    assert script.read_text() == SCRIPT


@pytest.mark.parametrize("flag", ["--onnx", "--program"])
def test_convert_outputs_that_are_the_checkpoint_are_refused(flag, tmp_path, capsys):
    ckpt = tmp_path / "model.pt"
    torch.save({"weight": torch.zeros(2)}, ckpt)
    before = ckpt.read_bytes()
    _one_line_exit_2(["convert", str(ckpt), "--model", "m:f", "--calib", "m:c", flag, str(ckpt)], capsys,
                     "would overwrite the input")  # fmt: skip
    assert ckpt.read_bytes() == before
    calib = tmp_path / "calib.pt"
    torch.save([torch.zeros(2)], calib)
    _one_line_exit_2(["convert", str(ckpt), "--model", "m:f", "--calib", str(calib), flag, str(calib)], capsys,
                     "would overwrite the input")  # fmt: skip
    _one_line_exit_2(["convert", str(ckpt), "--model", "m:f", "--calib", "m:c", "--onnx", str(tmp_path / "o"),
                      "--program", str(tmp_path / "o")], capsys, "would overwrite the input")  # fmt: skip


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["convert", "c.pt", "--model", "m:f", "--calib", "m:c", "--threads", "100000"], "--threads: must be between 1"),
        (["convert", "c.pt", "--model", "m:f", "--calib", "m:c", "--threads", "0"], "--threads: must be between 1"),
        (["convert", "c.pt", "--model", "m:f", "--calib", "m:c", "--budget", "inf"], "--budget: must be a finite"),
        (["convert", "c.pt", "--model", "m:f", "--calib", "m:c", "--budget", "nan"], "--budget: must be a finite"),
        (["bench", "--seed", "-1"], "--seed: must be between 0 and 4294967295"),
        (["bench", "--threads", "100000"], "--threads: must be between 1"),
        (["run", "--time", "inf", "s.py"], "--time: must be between"),
    ],
)
def test_numeric_options_are_bounded(argv, needle, capsys):
    _one_line_exit_2(argv, capsys, needle)


def test_a_device_node_as_the_report_is_refused_before_the_run(tmp_path, capsys):
    """/dev/full is a character device: ampkit writes regular files only, so it is
    refused in one line before the script runs (exit 2, no traceback); the device is
    left as it was. (A write that fails after the run: tests/tools/test_cli_files.py.)"""
    script, marker = tmp_path / "s.py", tmp_path / "ran.txt"
    script.write_text(SCRIPT)
    code = main(["run", "--report", "/dev/full", str(script), str(marker)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ampkit run: cannot write the JSON report to '/dev/full'") and "character device" in last
    assert not marker.exists()
    import stat

    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_a_script_that_closes_stderr_keeps_its_exit_code(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "closes.py"
    script.write_text("import sys\nsys.stderr.close()\n")
    root = ROOT
    proc = subprocess.run([sys.executable, "-m", "ampkit", "run", str(script)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_version_names_the_packaged_version_and_the_torch_it_runs_on():
    """``ampkit --version`` (a fresh process, exit 0) prints pyproject's version, which is
    ``ampkit.__version__``, and the torch it imported."""
    import re
    import subprocess
    import sys

    packaged = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert amp.__version__ == packaged
    out = subprocess.run([sys.executable, "-m", "ampkit", "--version"], capture_output=True, text=True,
                         timeout=120, check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    assert out.stdout.startswith(f"ampkit {packaged} (torch {torch.__version__}, python ")
