"""The package as the registry would get it: ``python -m build`` makes the sdist and,
from it, the wheel (no build isolation: the build-system's setuptools from this venv,
nothing downloaded); ``twine check --strict`` passes both; the wheel holds every file of
``src/ampkit`` (the op tables among them) and nothing else, and its metadata names the
package's version, its torch range and the ``ampkit`` command; the op tables load from the
unpacked wheel, away from the source tree. ``.ci/wheel_check.sh`` installs the wheel in a
fresh venv and runs ``ampkit --version`` and the README's quick start from it."""

from __future__ import annotations

import email
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from locations import ROOT

SRC = ROOT / "src" / "ampkit"
PYPROJECT = (ROOT / "pyproject.toml").read_text()
VERSION = re.search(r'^version = "([^"]+)"', PYPROJECT, re.M).group(1)
REQUIRES_PYTHON = re.search(r'^requires-python = "([^"]+)"', PYPROJECT, re.M).group(1)


def _package_files() -> set[str]:
    """Every file of ``src/ampkit`` as ``ampkit/...``: git's tracked and new files where
    this is a git checkout (not ignored ones: ``__pycache__``), else the tree less
    ``__pycache__``."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "src/ampkit"],
                                cwd=ROOT, capture_output=True, text=True, check=True).stdout  # fmt: skip
        files = {Path(name) for name in listed.split("\0") if name}
        files = {ROOT / f for f in files if (ROOT / f).is_file()}
    except (OSError, subprocess.CalledProcessError):
        files = {p for p in SRC.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    return {p.relative_to(SRC.parent).as_posix() for p in files}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("build", reason="build is not installed (the test extra has it)")
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_sdist_and_wheel_pass_twine_check(dist: Path) -> None:
    pytest.importorskip("twine", reason="twine is not installed (the test extra has it)")
    names = sorted(p.name for p in dist.iterdir())
    assert names == [f"ampkit-{VERSION}-py3-none-any.whl", f"ampkit-{VERSION}.tar.gz"], names
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *sorted(map(str, dist.iterdir()))],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_wheel_holds_every_package_file_and_nothing_else(dist: Path) -> None:
    with zipfile.ZipFile(dist / f"ampkit-{VERSION}-py3-none-any.whl") as wheel:
        names = set(wheel.namelist())
        metadata = email.message_from_bytes(wheel.read(f"ampkit-{VERSION}.dist-info/METADATA"))
        entry_points = wheel.read(f"ampkit-{VERSION}.dist-info/entry_points.txt").decode()
    package = {n for n in names if not n.startswith(f"ampkit-{VERSION}.dist-info/")}
    wanted = _package_files()
    assert any(n.startswith("ampkit/casting/lists/tables/") and n.endswith(".json") for n in wanted)
    assert sorted(wanted - package) == [], "files of src/ampkit missing from the wheel"
    assert sorted(package - wanted) == [], "files in the wheel that src/ampkit does not have"
    assert metadata["Name"] == "ampkit" and metadata["Version"] == VERSION
    assert metadata.get_all("Requires-Dist")[0].replace(" ", "") in ("torch<2.16,>=2.9", "torch>=2.9,<2.16")
    assert metadata["Requires-Python"] == REQUIRES_PYTHON
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().startswith("# ampkit\n")  # the README is the long description
    assert "ampkit = ampkit.tools.cli.main:main" in entry_points

    import ampkit

    assert ampkit.__version__ == VERSION, "ampkit.__version__ and pyproject.toml's version differ"


def test_sdist_holds_the_package_and_what_builds_it(dist: Path) -> None:
    prefix = f"ampkit-{VERSION}/"
    with tarfile.open(dist / f"ampkit-{VERSION}.tar.gz") as sdist:
        names = {m.name.removeprefix(prefix) for m in sdist.getmembers() if m.isfile()}
    assert {"pyproject.toml", "README.md", "PKG-INFO"} <= names
    assert sorted(f"src/{f}" for f in _package_files() if f"src/{f}" not in names) == []


def test_op_tables_load_from_the_unpacked_wheel(dist: Path, tmp_path: Path) -> None:
    """The installed layout, not the source tree's: every release's table is found."""
    with zipfile.ZipFile(dist / f"ampkit-{VERSION}-py3-none-any.whl") as wheel:
        wheel.extractall(tmp_path / "site")
    code = ("import ampkit; from ampkit.casting import lists; print(ampkit.__file__); "
            "print(sorted(set(lists.RELEASES) - set(lists.TABLES)))")  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path / "site"))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()  # fmt: skip
    assert Path(out[0]).is_relative_to(tmp_path / "site"), out
    assert out[1] == "[]", f"op tables missing from the wheel: {out[1]}"
