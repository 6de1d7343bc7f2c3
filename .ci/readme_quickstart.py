"""The README's quick start, run as a user runs it: the first ``python`` block of the
"## Quick start" section is written to ``quickstart.py`` in ``--workdir`` and run there
by ``--python`` (PYTHONPATH unset), and what it prints is compared with the ``text``
block the section shows after "It prints". Lines must match in number and in every word;
numbers with a decimal point may differ by at most ``--tolerance`` (the README says its
last loss digits depend on the CPU kind; tests/meta/test_readme.py allows the same).
Prints one line; exit status 1 on a difference.

    python .ci/readme_quickstart.py README.md --python VENV/bin/python --workdir DIR
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def extract(readme: str) -> tuple[str, list[str]]:
    """``(code, expected lines)`` of the README's quick start section."""
    section = re.search(r"^## Quick start.*?(?=^## )", readme, re.S | re.M)
    if section is None:
        raise SystemExit("readme-quickstart: README.md has no '## Quick start' section")
    code = re.search(r"```python\n(.*?)```", section.group(0), re.S)
    shown = re.search(r"It prints.*?```text\n(.*?)```", section.group(0), re.S)
    if code is None or shown is None:
        raise SystemExit("readme-quickstart: the quick start section lacks its python block "
                         "or the 'It prints' text block after it")
    return code.group(1), shown.group(1).strip().splitlines()


def compare(printed: list[str], expected: list[str], tolerance: float) -> tuple[list[str], float]:
    """``(differences, largest deviation of a decimal number)``."""
    problems: list[str] = []
    worst = 0.0
    if len(printed) != len(expected):
        problems.append(f"{len(printed)} lines printed, the README shows {len(expected)}")
    for n, (got, want) in enumerate(zip(printed, expected), 1):
        if NUMBER.split(got) != NUMBER.split(want):
            problems.append(f"line {n}: {got!r} where the README shows {want!r}")
            continue
        for a, b in zip(NUMBER.findall(got), NUMBER.findall(want)):
            if "." not in a + b:
                if a != b:
                    problems.append(f"line {n}: {a} where the README shows {b}")
                continue
            worst = max(worst, abs(float(a) - float(b)))
            if abs(float(a) - float(b)) > tolerance:
                problems.append(f"line {n}: {a} where the README shows {b} (more than {tolerance} apart)")
    return problems, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("readme", type=Path)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs it")
    parser.add_argument("--workdir", type=Path, required=True, help="where quickstart.py is written and run")
    parser.add_argument("--tolerance", type=float, default=0.05)
    args = parser.parse_args()
    code, expected = extract(args.readme.read_text())
    script = args.workdir / "quickstart.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([args.python, script.name], cwd=args.workdir, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    if proc.returncode != 0:
        print(f"readme-quickstart: FAILED: the quick start exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
        return 1
    printed = proc.stdout.strip().splitlines()
    problems, worst = compare(printed, expected, args.tolerance)
    if problems:
        print("readme-quickstart: FAILED: it printed\n  " + "\n  ".join(printed)
              + "\n" + "\n".join(problems))  # fmt: skip
        return 1
    print(f"readme-quickstart: printed the README's {len(expected)} lines (numbers within {worst:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
