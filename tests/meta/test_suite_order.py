"""``make test``'s schedule: the files ``tests/conftest.py`` starts first (``LONGEST_FILES``)
exist, each named once; a renamed or removed file would silently leave the order."""

from __future__ import annotations

import ast

from locations import TESTS


def test_every_file_make_test_starts_first_exists_once() -> None:
    tree = ast.parse((TESTS / "conftest.py").read_text())
    (names,) = [ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["LONGEST_FILES"]]  # fmt: skip
    assert len(names) > 10 and len(set(names)) == len(names)
    assert [name for name in names if not (TESTS / name).is_file()] == []
