"""The torch version matrix's record and its docs page.

    python .ci/matrix_report.py record --release 2.11.0 --summary torch-matrix-summary.json \\
        --check-log C --subset-log S --smoke-json J --integrations-log I --seconds N
    python .ci/matrix_report.py render SUMMARY.json PAGE.md

``record`` runs with the matrix venv's python: it reads the versions of torch and the
frameworks installed there and the outcome of each check (the last summary line of each
pytest log, the op-table check's verdicts, the smoke's counts), and adds them under the
release in the summary JSON. ``render`` writes the supported-versions page from it
(``docs/versions.md`` from ``docs/data/versions.json``, a copy of a run's summary).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from importlib import metadata
from pathlib import Path

FRAMEWORKS = ("lightning", "transformers", "accelerate")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pytest_outcome(log: str) -> str:
    """The counts of pytest's last summary line ("89 passed, 4 skipped, 10 xfailed"), or
    "no summary" when pytest did not get that far."""
    lines = [line.strip("= ").strip() for line in log.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if not lines:
        return "no summary"
    return re.sub(r",? \d+ warnings?", "", re.sub(r" in [\d.]+s.*$", "", lines[-1]))


def check_outcome(log: str) -> str:
    """The op-table check's verdict per device type ("no difference", or the count of
    lines that differ)."""
    verdicts = re.findall(r"^no difference$", log, re.M)
    against = re.findall(r"against the ([\d.]+) table", log)
    if verdicts and len(verdicts) >= len(against):
        return f"no difference (tables {', '.join(sorted(set(against))) or '?'})"
    return "differences: see the CI log"


def record(args: argparse.Namespace) -> None:
    import torch

    smoke = json.loads(Path(args.smoke_json).read_text()) if Path(args.smoke_json).exists() else {}
    counts = smoke.get("counts", {})
    entry = {
        "torch": torch.__version__,
        "frameworks": {name: _version(name) for name in FRAMEWORKS},
        "op_tables": check_outcome(Path(args.check_log).read_text()),
        "subset": pytest_outcome(Path(args.subset_log).read_text()),
        "smoke": ", ".join(f"{v} {k}" for k, v in counts.items() if v) or "no summary",
        "integrations": pytest_outcome(Path(args.integrations_log).read_text()),
        "seconds": int(args.seconds),
        "ok": bool(args.ok),
    }
    path = Path(args.summary)
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary[args.release] = entry
    path.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")


def render(summary: dict) -> str:
    """The supported-versions page: one row per release of the matrix."""
    out = [
        "# Supported versions",
        "",
        "Written by `python .ci/matrix_report.py render docs/data/versions.json docs/versions.md` from a",
        "run of `.ci/torch_matrix.sh` (CI runs it after `make test`; `docs/data/versions.json` is a copy",
        "of that run's `torch-matrix-summary.json`). Each release is the package registry's torch wheel",
        "in a fresh venv, with one end of the integrations' supported ranges.",
        "",
        "| torch | lightning | transformers | accelerate | op tables | torch-boundary tests (`test_lists`, "
        "`test_torch_compat`, ...: see `.ci/torch_matrix.sh`) | every level trains (CPU smoke) | integration tests | outcome |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for release in sorted(summary, key=lambda r: tuple(int(x) for x in r.split(".")[:3])):
        e = summary[release]
        fw = e.get("frameworks", {})
        out.append(
            f"| {e['torch']} | {fw.get('lightning') or '-'} | {fw.get('transformers') or '-'} | "
            f"{fw.get('accelerate') or '-'} | {e['op_tables']} | {e['subset']} | {e['smoke']} | "
            f"{e['integrations']} | {'passed' if e['ok'] else 'FAILED'} ({e['seconds']} s) |"
        )
    out += [
        "",
        "`make test` runs the whole suite on the pinned torch 2.13.0 with the test extra's",
        "framework pins (lightning 2.6.6, transformers 5.24.0, accelerate 1.15.0).",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    for name in ("release", "summary", "check_log", "subset_log", "smoke_json", "integrations_log"):
        rec.add_argument("--" + name.replace("_", "-"), dest=name, required=True)
    rec.add_argument("--seconds", type=int, required=True)
    rec.add_argument("--ok", type=int, choices=(0, 1), required=True)
    ren = sub.add_parser("render")
    ren.add_argument("summary")
    ren.add_argument("page")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args)
    else:
        Path(args.page).write_text(render(json.loads(Path(args.summary).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
