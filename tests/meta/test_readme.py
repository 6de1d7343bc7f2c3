"""README.md stays a five-minute read (at most 250 lines) and every Python block in it
(``python``, ``py``, ``python3`` fences) runs as written; the guides in docs/ hold the rest
(their blocks run in tests/meta/test_docs.py)."""

from __future__ import annotations

import re

import pytest
from locations import ROOT

README = ROOT / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```(?:python|py|python3)\n(.*?)```", TEXT, flags=re.S)


def test_readme_is_short_and_has_a_runnable_quick_start():
    assert len(TEXT.splitlines()) <= 250
    assert BLOCKS and "amp.scale_loss" in BLOCKS[0]
    assert not re.search(r"```pycon\n", TEXT)  # no doctest blocks here: they would go unrun


def test_readme_links_into_the_docs_resolve():
    root = README.parent
    for target in re.findall(r"\]\(((?:docs|examples)/[^)#]*)", TEXT):
        assert (root / target).exists(), target


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index, capsys):
    code = BLOCKS[index]
    exec(compile(code, f"README.md[python block {index}]", "exec"), {"__name__": "__readme__"})


def test_the_quick_start_prints_what_the_readme_shows(capsys):
    """The quick start's output: the loss lines at the steps the README shows, falling
    (first at least three times the last), and the stats line exactly (no step skipped,
    scale 1); the README's numbers are this CPU kind's to the third decimal or near."""
    shown = re.search(r"It prints .*?```text\n(.*?)```", TEXT, re.S)
    assert shown, "the quick start's output block"
    expected = shown.group(1).strip().splitlines()
    exec(compile(BLOCKS[0], "README.md[quick start]", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == len(expected) and printed[-1] == expected[-1]
    losses = [float(line.split()[-1]) for line in printed[:-1]]
    assert [line.split()[1] for line in printed[:-1]] == [line.split()[1] for line in expected[:-1]]
    assert losses[0] > 3 * losses[-1]
    shown_losses = [float(line.split()[-1]) for line in expected[:-1]]
    assert all(abs(a - b) <= 0.05 for a, b in zip(losses, shown_losses)), (printed, expected)
