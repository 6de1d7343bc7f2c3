"""Every ```python block in README.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_snippets():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index, capsys):
    code = BLOCKS[index]
    exec(compile(code, f"README.md[python block {index}]", "exec"), {"__name__": "__readme__"})
