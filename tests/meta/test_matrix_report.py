"""The torch version matrix's report (.ci/matrix_report.py): the pytest and check
outcomes it reads from the logs, and the supported-versions page it writes, which
docs/versions.md must be (rendered from docs/data/versions.json, a recorded run)."""

from __future__ import annotations

import json
import runpy

from locations import ROOT

REPORT = runpy.run_path(str(ROOT / ".ci" / "matrix_report.py"), run_name="matrix_report")


def test_outcomes_are_read_from_the_logs():
    outcome = REPORT["pytest_outcome"]
    log = "....x\n=========== 89 passed, 4 skipped, 10 xfailed, 94 warnings in 58.17s ===========\n"
    assert outcome(log) == "89 passed, 4 skipped, 10 xfailed"
    assert outcome("115 passed in 43.81s\n") == "115 passed"
    assert outcome("Traceback ...\nImportError\n") == "no summary"
    check = REPORT["check_outcome"]
    assert check("torch 2.11.0+cu130 against the 2.11 table:\nno difference\n") == "no difference (tables 2.11)"
    assert check("torch 2.15.0 against the 2.15 table:\ncpu: 2 ops differ\n").startswith("differences")


def test_the_page_has_one_row_per_release_in_order():
    entry = {"torch": "2.15.0+cu132", "frameworks": {"lightning": "2.6.6", "transformers": "5.25.0", "accelerate": None},
             "op_tables": "no difference", "subset": "98 passed", "smoke": "31 passed", "integrations": "115 passed",
             "seconds": 219, "ok": True}  # fmt: skip
    page = REPORT["render"]({"2.15.0": entry, "2.11.0": {**entry, "torch": "2.11.0+cu130", "ok": False}})
    rows = [line for line in page.splitlines() if line.startswith("| 2.")]
    assert [r.split("|")[1].strip() for r in rows] == ["2.11.0+cu130", "2.15.0+cu132"]
    assert rows[0].rstrip("| ").endswith("FAILED (219 s)") and "| - |" in rows[1]


def test_the_docs_page_is_the_recorded_run_rendered():
    data = json.loads((ROOT / "docs" / "data" / "versions.json").read_text())
    assert set(data) >= {"2.11.0", "2.15.0"}
    assert (ROOT / "docs" / "versions.md").read_text() == REPORT["render"](data)
