"""The files the ``ampkit`` commands write and read: an output name taken by a FIFO, a
symlink to a victim, a copy of ``/dev/null``'s node or in ``/proc`` is refused in one line
(exit code 2) before any work -- the script never starts -- and left as it was; relative
outputs land where the command was started even when the script changes folder; an
input that is a folder is called one. (``ampkit run``, ``tune`` and ``bench`` have their
own in test_run.py, test_tune.py and test_bench.py.)"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from ampkit.tools.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore:ampkit. float16 on CPU")

MARKER_SCRIPT = "import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('ran')\n"

DOCTOR_SCRIPT = """
import os, sys, torch, ampkit as amp
from torch import nn
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
amp.init_trainer(opt)
with amp.scale_loss(model(torch.randn(2, 4)).sum(), opt) as scaled:
    scaled.backward()
opt.step()
os.makedirs(sys.argv[1], exist_ok=True)
os.chdir(sys.argv[1])
"""


def _special(tmp_path: Path, kind: str) -> Path:
    """An output name taken by ``kind``: a FIFO, a symlink to ``victim.txt``, a copy of
    /dev/null's node, or a name in /proc (where root passes os.access and creates nothing)."""
    path = tmp_path / f"{kind}.out"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        (tmp_path / "victim.txt").write_text("mine")
        path.symlink_to(tmp_path / "victim.txt")
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("making a device node needs root")
    elif Path("/proc/self").exists():
        path = Path("/proc/ampkit-output.out")
    else:
        pytest.skip("needs Linux's /proc")
    return path


def _still_special(path: Path, kind: str, tmp_path: Path) -> bool:
    mode = os.lstat(path).st_mode if kind != "proc" else 0
    return {
        "fifo": lambda: stat.S_ISFIFO(mode),
        "symlink": lambda: stat.S_ISLNK(mode) and (tmp_path / "victim.txt").read_text() == "mine",
        "device": lambda: stat.S_ISCHR(mode),
        "proc": lambda: not path.exists(),
    }[kind]()


KINDS = [("fifo", "it is a FIFO"), ("symlink", "it is a symbolic link"), ("device", "it is a character device"),
         ("proc", "no file can be created")]  # fmt: skip


def _one_line_exit_2(argv: list[str], capsys, needle: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("kind", "needle"), KINDS)
@pytest.mark.parametrize("command", [["run", "--report"], ["run", "--compare", "--png"], ["doctor", "--json"],
                                     ["doctor", "--png"]])  # fmt: skip
def test_a_special_output_is_refused_before_the_script_runs(command, kind, needle, tmp_path, capsys):
    script, marker = tmp_path / "s.py", tmp_path / "ran.txt"
    script.write_text(MARKER_SCRIPT)
    target = _special(tmp_path, kind)
    _one_line_exit_2([*command, str(target), str(script), str(marker)], capsys, needle)
    assert not marker.exists() and _still_special(target, kind, tmp_path)


@pytest.mark.parametrize(("kind", "needle"), KINDS)
def test_warmup_refuses_a_special_json_before_compiling(kind, needle, tmp_path, capsys):
    target = _special(tmp_path, kind)
    _one_line_exit_2(["warmup", "--json", str(target)], capsys, needle)
    assert _still_special(target, kind, tmp_path)


@pytest.mark.parametrize("flag", ["--onnx", "--program"])
@pytest.mark.parametrize(("kind", "needle"), KINDS[:2])
def test_convert_refuses_a_special_output_before_loading(flag, kind, needle, tmp_path, capsys):
    target = _special(tmp_path, kind)
    _one_line_exit_2(["convert", str(tmp_path / "missing.pt"), "--model", "m:f", "--calib", "m:c", flag,
                      str(target)], capsys, needle)  # fmt: skip
    assert _still_special(target, kind, tmp_path)


def test_convert_says_a_folder_is_a_folder(tmp_path, capsys):
    folder = tmp_path / "adir"
    folder.mkdir()
    err = _one_line_exit_2(["convert", str(folder), "--model", "m:f", "--calib", "m:c"], capsys, "is a folder")
    assert "no such file" not in err and str(folder) in err
    torch.save(torch.zeros(1), tmp_path / "c.pt")
    _one_line_exit_2(["convert", str(tmp_path / "c.pt"), "--model", f"{folder}/m.py:f", "--calib", "m:c"], capsys,
                     "no such file")  # fmt: skip
    (folder / "m.py").mkdir()
    _one_line_exit_2(["convert", str(tmp_path / "c.pt"), "--model", f"{folder}/m.py:f", "--calib", "m:c"], capsys,
                     "is a folder")  # fmt: skip


def test_doctor_writes_relative_outputs_where_it_was_started(tmp_path, capsys, monkeypatch):
    """The script changes folder after training; ``--json``/``--png`` land beside the launch."""
    pytest.importorskip("matplotlib")
    (tmp_path / "s.py").write_text(DOCTOR_SCRIPT)
    monkeypatch.chdir(tmp_path)
    assert main(["doctor", "--json", "r.json", "--png", "r.png", "s.py", str(tmp_path / "away")]) == 0
    capsys.readouterr()
    assert "history" in json.loads((tmp_path / "r.json").read_text())
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "away" / "r.json").exists() and not (tmp_path / "away" / "r.png").exists()


def test_a_report_that_cannot_be_written_after_the_run_is_one_line(tmp_path, capsys, monkeypatch):
    """A write that fails after every up-front check passed (the disk fills up during the
    run; the script removes the report's folder): one line, exit 2, no traceback, no
    temp file left; the script did run."""
    import errno

    script, marker = tmp_path / "s.py", tmp_path / "ran.txt"
    script.write_text(MARKER_SCRIPT)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def last_line(argv: list[str]) -> str:
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        return err.strip().splitlines()[-1]  # after the run's summary

    monkeypatch.setattr(os, "fsync", full)
    report = tmp_path / "r.json"
    line = last_line(["run", "--report", str(report), str(script), str(marker)])
    assert line == f"ampkit run: cannot write the JSON report to {str(report)!r}: {os.strerror(errno.ENOSPC)}."
    assert marker.read_text() == "ran" and sorted(p.name for p in tmp_path.iterdir()) == ["ran.txt", "s.py"]
    monkeypatch.undo()

    out = tmp_path / "out"
    out.mkdir()
    script.write_text(f"import shutil\nshutil.rmtree({str(out)!r})\n" + MARKER_SCRIPT)
    marker.unlink()
    line = last_line(["run", "--report", str(out / "r.json"), str(script), str(marker)])
    assert line.startswith("ampkit run: cannot write the JSON report") and "does not exist" in line, line
    assert marker.read_text() == "ran"
