"""Where things are, for tests at any depth under ``tests/``: the repository root, the
support folder (workers, scripts, fixtures) that ``conftest.py`` puts on ``sys.path``."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent
#: unmodified training scripts (they know nothing of ampkit)
SCRIPTS = SUPPORT / "scripts"
#: files written by earlier releases
FIXTURES = SUPPORT / "fixtures"
