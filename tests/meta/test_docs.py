"""The documentation site (docs/, ``make docs``): the reference covers the public API,
docstrings name their parameters, every Python code block on a page runs, the
generated pages are what their generators write, and the Sphinx build passes with
warnings as errors and nitpicky references.

Code blocks: a fence whose language is Python (``python``, ``py``, ``python3``,
``pycon``, also as ``{code-block}``) runs unless the line before it (blank lines
aside) is a marker with its reason, e.g. ``<!-- not-run: needs CUDA -->``. The runnable
blocks of one page run in order in one fresh process (one thread, a temporary
working folder; forked from one that imported torch and ampkit:
``tests/support/forked.py``), sharing their names as a reader's session would;
``pycon`` blocks are doctests (their printed output is compared).
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
from forked import Forker, fork_env
from locations import ROOT

import ampkit
import ampkit.casting
import ampkit.distributed
import ampkit.integrations

DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
SKIP_DIRS = {"_build", "generated", "data", "_ext"}

sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(ROOT / "benchmarks"))


# --- (1) the reference: every public name has an entry ------------------------------------

DIRECTIVE = re.compile(
    r"^\s*\.\. (?:auto(?:function|class|exception|data|module|method|attribute|property)|py:module)::\s*([\w.]+)",
    re.M,
)


def reference_entries() -> set[str]:
    """Every object the handwritten reference pages document (autodoc directives)."""
    names: set[str] = set()
    for page in REFERENCE.glob("*.md"):
        names.update(DIRECTIVE.findall(page.read_text()))
    return names


def public_names() -> list[str]:
    """The names the reference must cover: ``ampkit.__all__`` (modules included),
    ``ampkit.integrations.__all__``, ``ampkit.distributed.__all__`` and
    ``ampkit.casting.release_kernels``."""
    names = [f"ampkit.{n}" for n in ampkit.__all__]
    names += [f"ampkit.integrations.{n}" for n in ampkit.integrations.__all__]
    names += [f"ampkit.distributed.{n}" for n in ampkit.distributed.__all__]
    names += ["ampkit.casting.release_kernels", "ampkit.integrations"]
    return names


def test_every_public_name_has_a_reference_entry() -> None:
    entries = reference_entries()
    missing = [n for n in public_names() if n not in entries]
    assert not missing, (
        f"public names with no entry in docs/reference/*.md: {missing}; add an autodoc "
        "directive (e.g. '.. autofunction:: ampkit.NAME') to the page of its topic"
    )


def test_reference_entries_import() -> None:
    """A directive naming an object that no longer exists would only warn at build time."""
    broken = []
    for name in sorted(reference_entries()):
        try:
            _import(name)
        except (ImportError, AttributeError) as exc:
            broken.append(f"{name} ({exc})")
    assert not broken, f"reference entries that do not import: {broken}"


INTEGRATION_MODULES = ("ampkit.integrations.lightning", "ampkit.integrations.hf", "ampkit.integrations.accelerate")


@pytest.mark.parametrize("module", INTEGRATION_MODULES)
def test_integration_page_lists_every_public_name(module: str) -> None:
    """The generated page of each integration module documents all of its ``__all__``."""
    from ampkit_docs import INTEGRATIONS, integration_page

    try:
        mod = importlib.import_module(module)
    except ImportError:
        pytest.skip(f"{module} does not import here (its framework is not installed)")
    title, extra = INTEGRATIONS[module]
    page = integration_page(module, title, extra)
    documented = set(DIRECTIVE.findall(page))
    missing = [n for n in getattr(mod, "__all__", ()) if f"{module}.{n}" not in documented]
    assert not missing, f"{module}: names of __all__ missing from its generated page: {missing}"


# --- (1) docstrings mention each parameter -------------------------------------------------


def _import(name: str) -> object:
    parts = name.split(".")
    obj: object = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        try:
            obj = getattr(obj, parts[i])
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def _mentions(doc: str, name: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", doc) is not None


def _own(func: object) -> bool:
    return getattr(func, "__module__", "").startswith("ampkit")


def _parameters(obj: object) -> list[str]:
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p not in ("self", "cls")]


def undocumented_parameters(name: str, obj: object) -> list[str]:
    """``NAME: parameter`` for each parameter of ``obj`` (and of its own public methods,
    for a class) that its docstring does not mention."""
    out: list[str] = []
    if inspect.isclass(obj):
        if issubclass(obj, (BaseException, enum.Enum)):
            return out
        init = obj.__dict__.get("__init__")
        own_init = init is not None and _own(init) or "__dataclass_fields__" in obj.__dict__
        doc = (obj.__doc__ or "") + ((init.__doc__ or "") if init is not None else "")
        if own_init:
            out += [f"{name}: {p}" for p in _parameters(obj) if not _mentions(doc, p)]
        for attr, member in vars(obj).items():
            if attr.startswith("_"):
                continue
            func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            if inspect.isfunction(func) and _own(func) and func.__doc__:
                out += undocumented_parameters(f"{name}.{attr}", func)
        return out
    if callable(obj):
        doc = obj.__doc__ or ""
        out += [f"{name}: {p}" for p in _parameters(obj) if not _mentions(doc, p)]
    return out


def documented_callables() -> list[str]:
    names = []
    for name in sorted(reference_entries()):
        obj = _import(name)
        if inspect.ismodule(obj) or typing.get_origin(obj) is not None:
            continue
        if callable(obj):
            names.append(name)
    return names


def test_docstrings_mention_every_parameter() -> None:
    missing = [m for name in documented_callables() for m in undocumented_parameters(name, _import(name))]
    assert not missing, (
        "docstrings that do not mention a parameter (name it in Args:, or in the text): "
        + "; ".join(missing)
    )


# --- (1) the troubleshooting page names every error -----------------------------------------

TROUBLESHOOTING = DOCS / "guides" / "troubleshooting.md"


def amp_errors() -> list[type]:
    """Every :class:`ampkit.AmpError` subclass (and AmpError itself) defined once ampkit
    and all of its modules are imported; the modules of ``ampkit.integrations`` only
    where their framework imports."""
    import pkgutil

    for info in pkgutil.walk_packages(ampkit.__path__, "ampkit."):
        try:
            importlib.import_module(info.name)
        except ImportError:
            if not info.name.startswith("ampkit.integrations."):
                raise
    found: list[type] = [ampkit.AmpError]
    todo = [ampkit.AmpError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


def test_troubleshooting_page_names_every_error() -> None:
    """Each AmpError subclass has a section (a heading naming it) on the troubleshooting
    page: when it is raised, a real message, what to do."""
    errors = amp_errors()
    assert len(errors) > 10, errors  # the walk found the subpackages' errors too
    headings = [line for line in TROUBLESHOOTING.read_text().splitlines() if line.startswith("#")]
    missing = [f"{e.__module__}.{e.__qualname__}" for e in errors
               if not any(f"`{e.__name__}`" in h for h in headings)]  # fmt: skip
    assert not missing, (
        f"AmpError subclasses with no section on {TROUBLESHOOTING.relative_to(ROOT)}: {missing}; add "
        "a '## `Name`' section saying when it is raised, a real message and what to do"
    )


# --- (2) every Python code block on a page runs ---------------------------------------------

PYTHON = {"python", "py", "python3", "pycon"}
FENCE = re.compile(r"^(?P<indent>[ ]{0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\n`]*)$")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:(?P<reason>.*?)-->\s*$")


def pages() -> list[Path]:
    out = []
    for path in sorted(DOCS.rglob("*.md")):
        if not SKIP_DIRS.intersection(path.relative_to(DOCS).parts[:-1]):
            out.append(path)
    return out


def code_blocks(path: Path) -> list[dict]:
    """The fenced blocks of a Markdown page: ``{"lang", "code", "line", "not_run"}``
    (``not_run``: the reason of a marker before it, else None)."""
    lines = path.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").strip()
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        lang = info.split()[0] if info else ""
        if lang in ("{code-block}", "{code}", "{sourcecode}"):
            lang = info.split()[1] if len(info.split()) > 1 else ""
            body = [b for b in body if not b.startswith(":")]
        reason = None
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marker = NOT_RUN.match(lines[j]) if j >= 0 else None
        if marker:
            reason = marker.group("reason").strip()
        blocks.append({"lang": lang.lower(), "code": textwrap.dedent("\n".join(body)) + "\n",
                       "line": start + 2, "not_run": reason, "marker_line": j + 1 if marker else None})  # fmt: skip
    return blocks


def runnable_pages() -> list[Path]:
    return [p for p in pages() if any(b["lang"] in PYTHON and b["not_run"] is None for b in code_blocks(p))]


def test_not_run_markers_give_a_reason_and_precede_a_python_block() -> None:
    bad = []
    for path in pages():
        text = path.read_text().splitlines()
        blocks = code_blocks(path)
        marked = {b["marker_line"] for b in blocks if b["marker_line"]}
        for b in blocks:
            if b["not_run"] is not None and (not b["not_run"] or b["lang"] not in PYTHON):
                bad.append(f"{path.relative_to(ROOT)}:{b['marker_line']}: a not-run marker needs a reason "
                           "and a Python block right after it")  # fmt: skip
        for n, line in enumerate(text, 1):
            if NOT_RUN.match(line) and n not in marked:
                bad.append(f"{path.relative_to(ROOT)}:{n}: a not-run marker with no code block after it")
    assert not bad, "\n".join(bad)


RUNNER = r'''
import doctest, json, sys, traceback
import torch
torch.set_num_threads(1)
page, blocks = sys.argv[1], json.loads(sys.stdin.read())
ns = {"__name__": "__main__"}
for b in blocks:
    where = f"{page}:{b['line']}"
    if b["lang"] == "pycon":
        test = doctest.DocTestParser().get_doctest(b["code"], ns, where, page, b["line"] - 1)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test, clear_globs=False)
        ns.update(test.globs)  # a DocTest runs on a copy of the names: later blocks see its own
        if runner.failures:
            sys.exit(f"the pycon block at {where} printed something else (above)")
    else:
        try:
            exec(compile(b["code"], where, "exec"), ns)
        except BaseException:
            traceback.print_exc()
            sys.exit(f"the python block at {where} raised (above); mark it "
                     "'<!-- not-run: REASON -->' only if it cannot run here")
'''


@pytest.fixture
def page_process(forked_python: Forker) -> Forker:
    """A new process per page, forked from one that imported torch and ampkit (a reader's
    fresh interpreter, without paying ``import torch`` once a page)."""
    return forked_python


@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_blocks_run(page: Path, tmp_path: Path, page_process: Forker) -> None:
    blocks = [b for b in code_blocks(page) if b["lang"] in PYTHON and b["not_run"] is None]
    proc = page_process.run(RUNNER, [str(page.relative_to(ROOT))], input=json.dumps(blocks), cwd=tmp_path,
                             env=fork_env(), timeout=240)  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def test_code_block_collector_reads_fences_and_markers(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n<!-- not-run: needs CUDA -->\n\n```py\ncuda()\n```\n\n"
        "````pycon\n>>> 1 + 1\n2\n````\n\n```{code-block} python\n:caption: c\ny = 2\n```\n\n```text\nno\n```\n"
    )
    blocks = code_blocks(page)
    assert [(b["lang"], b["not_run"]) for b in blocks] == [
        ("python", None), ("py", "needs CUDA"), ("pycon", None), ("python", None), ("text", None),
    ]  # fmt: skip
    assert blocks[0]["code"] == "x = 1\n" and blocks[3]["code"] == "y = 2\n"


# --- generated pages ----------------------------------------------------------------------


def test_benchmark_pages_are_what_docs_pages_writes() -> None:
    """docs/benchmarks/*.md are generated from docs/benchmarks/data/ (never edited):
    ``python benchmarks/docs_pages.py --render`` rewrites them."""
    import docs_pages

    stale = [str(path.relative_to(ROOT)) for path, text in docs_pages.render().items()
             if not path.exists() or path.read_text() != text]  # fmt: skip
    assert not stale, f"stale benchmark pages {stale}: run python benchmarks/docs_pages.py --render"
    recorded = {p.stem for p in docs_pages.DATA.glob("*.json")}
    assert {b.name for b in docs_pages.BENCHMARKS if b.record} <= recorded, "run make bench-docs"
    pages_on_disk = {p.stem for p in docs_pages.DOCS.glob("*.md")} - {"index", "results"}
    assert pages_on_disk == {b.name for b in docs_pages.BENCHMARKS}, "a page without a benchmark (or the reverse)"


#: What a table of a page fits at 1280 pixels: furo's content column is 46em (736 px) wide
#: there and its tables set text at 14 px, about 7 px a character, so ~100 characters,
#: counting 3 a column for the padding and the rule.
TABLE_CHARS_AT_1280 = 100


def _md_tables(text: str) -> list[tuple[str, list[list[str]]]]:
    """The Markdown tables of ``text``: (the paragraph line before each, its rows of cells)."""
    tables, rows, before, last = [], [], "", ""
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            if not rows:
                before = last
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if not all(set(c) <= set("-:") for c in cells):
                rows.append(cells)
        else:
            if rows:
                tables.append((before, rows))
                rows = []
            if line.strip():
                last = line.strip()
    return tables


def test_benchmark_workload_tables_fit_a_1280_pixel_window() -> None:
    """The per-workload tables of the results page (and of the ampkit bench pages) fit
    furo's content column at 1280 pixels without wrapping a cell: each workload's
    figures come in two tables, time and memory, then training."""
    import docs_pages

    for page in ("results.md", "ampkit-bench.md", "ampkit-bench-quick.md"):
        tables = [(b, rows) for b, rows in _md_tables((docs_pages.DOCS / page).read_text())
                  if b in ("Time and memory:", "Training:")]  # fmt: skip
        assert tables, page
        for before, rows in tables:
            chars = sum(max(len(r[i]) for r in rows) + 3 for i in range(len(rows[0])))
            assert chars <= TABLE_CHARS_AT_1280, f"{page}: a {before!r} table {chars} characters wide: {rows[0]}"
    # what the rule catches: all the columns of a workload in one table
    rows = [["precision", "ms/step", "min ms", "speedup", "time vs bf16", "peak MiB", "mem vs fp32",
             "train loss", "eval loss", "test acc", "skipped", "loss scale"],
            ["torch-autocast", "26.7", "24.8", "1.54×", "1.00×", "24.1", "0.59×", "0.0003", "0.0406", "98.61%", "0", "—"]]  # fmt: skip
    assert sum(max(len(r[i]) for r in rows) + 3 for i in range(len(rows[0]))) > TABLE_CHARS_AT_1280


def test_benchmark_records_name_machine_and_command() -> None:
    import docs_pages

    for path in sorted(docs_pages.DATA.glob("*.json")):
        entry = json.loads(path.read_text())
        machine = entry["machine"]
        for key in ("cpu_name", "cpu_flags", "cpu_capability", "torch", "date_utc", "command", "threads"):
            assert key in machine, f"{path.name}: machine has no {key!r}"
        assert entry["command"] == machine["command"] and entry["kind"] in ("json", "text")


def test_op_lists_page_lists_every_default_op() -> None:
    from ampkit_docs import op_lists_page

    from ampkit.casting import lists

    page = op_lists_page()
    for device, table in lists.DEFAULT_LISTS.items():
        assert f"## {device}\n" in page
        for category, names in table.items():
            section = page.split(f"### {device}: `{category}`", 1)[1].split("###", 1)[0]
            assert all(f"`{n}`" in section for n in names), (device, category)


# --- (3) the Sphinx build ----------------------------------------------------------------


def _sphinx_missing() -> str | None:
    for module in ("sphinx", "myst_parser", "furo", "sphinxarg"):
        try:
            importlib.import_module(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[docs]')"
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sphinx_build_passes_with_warnings_as_errors(tmp_path: Path) -> None:
    """``make docs``: -W --keep-going -n; then every public name is in objects.inv."""
    reason = _sphinx_missing()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "html"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
           "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=880)
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0, "sphinx build failed:\n" + "\n".join(warnings or [proc.stderr[-4000:]])

    from sphinx.util.inventory import InventoryFile

    with open(out / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", os.path.join)
    built = {name for kind in inventory.data.values() for name in kind} if hasattr(inventory, "data") else {
        name for kind in inventory.values() for name in kind}  # fmt: skip
    missing = [n for n in public_names() if n not in built]
    assert not missing, f"public names missing from the built objects.inv: {missing}"
    cli = (out / "reference" / "cli.html").read_text()
    for command in ("bench", "convert", "doctor", "run"):
        assert f"ampkit {command}" in cli, f"the CLI page has no 'ampkit {command}'"


def test_every_guide_is_in_the_guides_reading_order() -> None:
    toc = (DOCS / "guides" / "index.md").read_text().split("```{toctree}", 1)[1].split("```", 1)[0]
    listed = [line.strip() for line in toc.splitlines()[1:] if line.strip() and not line.startswith(":")]
    on_disk = sorted(p.stem for p in (DOCS / "guides").glob("*.md") if p.stem != "index")
    assert sorted(listed) == on_disk and listed[0] == "getting-started"
    assert "## Install" in (DOCS / "guides" / "getting-started.md").read_text().split("## Three lines")[0]


def test_landing_page_has_install_example_chooser_and_generated_numbers(tmp_path: Path, page_process: Forker) -> None:
    """docs/index.md: the install lines, a runnable example whose printed loss is the
    one the text states, the chooser naming each framework, and the headline table as
    benchmarks/docs_pages.py writes it from the recorded full run."""
    import docs_pages

    text = (DOCS / "index.md").read_text()
    assert "pip install -e ." in text.split("## Install")[1].split("##")[0]
    chooser = text.split("## Which entry point?")[1].split("##")[0]
    for name in ("Lightning", "HF Trainer", "Accelerate", "ampkit run", "amp.initialize"):
        assert name in chooser, name
    assert docs_pages.render_landing(text) == text, "run python benchmarks/docs_pages.py --render"
    numbers = text.split(docs_pages.HEADLINE_START)[1].split(docs_pages.HEADLINE_END)[0]
    assert "| workload | precision | speed vs fp32 |" in numbers and "ampkit O2K" in numbers
    (block,) = [b for b in code_blocks(DOCS / "index.md") if b["lang"] in PYTHON]
    proc = page_process.run(block["code"], cwd=tmp_path, env=fork_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    first, last = (float(out.split(f"step {n}: loss ")[1].split()[0]) for n in (0, 59))
    assert abs(first - 1.41) < 0.006 and abs(last - 0.18) < 0.01 and "steps=60, skipped=0" in out, out
    assert "falling from 1.41 at step 0 to about 0.18 at step 59" in text


CLAIM = re.compile(r"bitwise|within \d[\d.]*\s*%", re.I)
TEST_REF = re.compile(r"tests/((?:\w+/)*test_\w+\.py)(?:::(\w+))?")
HISTORY_PAGES = {"changelog.md", "earlier-measurements.md", "versions.md"}


def _paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a Markdown page (code blocks left out), joined lines."""
    out, cur, fence = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        if line.strip():
            cur.append(line.strip())
        elif cur:
            out.append(" ".join(cur))
            cur = []
    if cur:
        out.append(" ".join(cur))
    return out


def _claim_pages() -> list[Path]:
    return [p for p in pages() if "benchmarks" not in p.relative_to(DOCS).parts and p.name not in HISTORY_PAGES] + [
        ROOT / "README.md"]  # fmt: skip


def test_every_exactness_claim_names_the_test_or_benchmark_behind_it() -> None:
    """A paragraph that says "bitwise" or "within x%" names the test (``tests/...``) or
    the benchmark script (``benchmarks/...``) that checks it, in itself or in the
    paragraph right after (a table's note); a named test exists."""
    bad, refs = [], []
    for page in _claim_pages():
        paras = _paragraphs(page.read_text())
        for i, para in enumerate(paras):
            refs += TEST_REF.findall(para)
            if not CLAIM.search(para):
                continue
            here = para + " " + (paras[i + 1] if i + 1 < len(paras) else "")
            if not re.search(r"tests/|test_\w+|benchmarks/", here):
                bad.append(f"{page.relative_to(ROOT)}: {para[:100]}")
    assert not bad, "claims with no test named beside them:\n" + "\n".join(bad)
    missing = []
    for file, name in refs:
        if "*" in file:
            continue
        path = ROOT / "tests" / file
        if not path.exists() or (name and not re.search(rf"^def {name}\(", path.read_text(), re.M)):
            missing.append(f"tests/{file}::{name}" if name else f"tests/{file}")
    assert not missing, f"docs name tests that do not exist: {sorted(set(missing))}"
