"""Bad input to ampkit's tools is an AmpError (or, on the command line, one line and
exit code 2) raised before any work: output paths that are folders or in missing
folders, calls that cannot run, unknown or mistyped options; exit codes as Python
computes them."""

from __future__ import annotations

import inspect

import pytest
import torch
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
