"""Where things are, for tests at any depth under ``tests/``: the repository root, the
support folder (workers, scripts, fixtures) that ``conftest.py`` puts on ``sys.path``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent
#: unmodified training scripts (they know nothing of ampkit)
SCRIPTS = SUPPORT / "scripts"
#: files written by earlier releases
FIXTURES = SUPPORT / "fixtures"


def load_file(path: Path, name: str | None = None) -> ModuleType:
    """The Python file at ``path`` (a benchmark, an example, a fixture maker) imported as a
    module named ``name`` (default: the file's stem), registered in ``sys.modules`` before
    it runs: a dataclass in it looks its module up by name."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
