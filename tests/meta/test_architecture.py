"""The package's architecture, checked: the layers contract (import-linter) holds and
catches a violating import, no subpackage reaches into another's private names (module
names, ``sys.modules`` lookups, or the private attributes of another's objects),
torch's private names are reached only through ``_internal/torch_compat/`` (and ``inductor_compat.py``), and files
and functions keep to a size budget in code lines (docstrings, comments and blank lines
not counted) whose allow-list can only shrink, and the layers below ``levels`` name no
opt level.

Subpackages: ``_internal``, ``casting``, ``scaling``, ``trainer``, ``levels``,
``distributed``, ``inference`` and ``tools`` (its own subpackages count as one). The
package root files (``__init__.py``, ``errors.py``, ``legacy.py``, ``safe_globals.py``)
are outside the rule. ``_internal``'s module name is underscored, but its public names
are shared by design."""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest
from locations import ROOT

SRC = ROOT / "src" / "ampkit"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
SUBPACKAGES = frozenset(
    {"_internal", "casting", "scaling", "trainer", "levels", "distributed", "inference", "integrations", "tools"}
)
#: Private names that are part of a public API on purpose: apex's own spelling
#: (``from apex.amp import _amp_state``), which the drop-in answers as apex does.
ALLOWED = frozenset({"ampkit.compat.apex.amp._amp_state"})
CONTRACT = "layers: tools > integrations > inference | distributed > levels > trainer > scaling > casting > _internal"
FACE_CONTRACT = ("integrations use ampkit's public face: hf, lightning and accelerate import ampkit, ampkit.errors, "
                 "ampkit.distributed and the integrations' shared modules")
TORCH_COMPAT_FACE = "torch_compat has one import face: no module outside it imports its modules"
LEVELS_CONTRACT = "levels, acyclic: its modules in the layers below, each importing only those under it"

needs_import_linter = pytest.mark.skipif(
    not LINT_IMPORTS.exists(),
    reason="import-linter is not installed (no lint-imports next to this Python)",
)


# ---------------------------------------------------------------------------
# 1. the layers contract
# ---------------------------------------------------------------------------
def _lint_imports(config: Path, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(config)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
    )


@needs_import_linter
def test_layers_contract_is_kept():
    result = _lint_imports(ROOT / "pyproject.toml", ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@needs_import_linter
def test_layers_contract_catches_an_import_upwards(tmp_path):
    """And the integrations' contract an import past the public face, and torch_compat's
    an import of one of its modules (one run of the linter for all three)."""
    src = tmp_path / "src"
    shutil.copytree(SRC, src / "ampkit", ignore=shutil.ignore_patterns("__pycache__"))
    policy = src / "ampkit" / "casting" / "policy.py"
    policy.write_text(policy.read_text() + "\n\nimport ampkit.tools.run  # noqa: E402,F401\n")
    accelerate = src / "ampkit" / "integrations" / "accelerate.py"
    accelerate.write_text(accelerate.read_text() + "\n\nimport ampkit.trainer.session  # noqa: E402,F401\n")
    cast = src / "ampkit" / "casting" / "_cast.py"
    cast.write_text(cast.read_text() + "\n\nfrom ampkit._internal.torch_compat.dispatch import raw_op  # noqa: E402,F401\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    # The copy must be the package analysed: it comes first on the path, and the check
    # below proves it was read (the real tree has no such import).
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('ampkit').origin)"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True, timeout=60,
    )
    assert Path(probe.stdout.strip()).resolve() == (src / "ampkit" / "__init__.py").resolve(), probe.stderr

    rounding = src / "ampkit" / "levels" / "rounding.py"  # a subpackage's own layers
    rounding.write_text(rounding.read_text() + "\n\nimport ampkit.levels.master_step  # noqa: E402,F401\n")

    result = _lint_imports(tmp_path / "pyproject.toml", tmp_path, pythonpath=src)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert f"{LEVELS_CONTRACT} BROKEN" in " ".join(out.split()), out
    assert "- ampkit.levels.rounding -> ampkit.levels.master_step" in out, out
    assert f"{CONTRACT} BROKEN" in " ".join(out.split()), out
    assert "- ampkit.casting.policy -> ampkit.tools" in out, out
    assert f"{FACE_CONTRACT} BROKEN" in " ".join(out.split()), out
    assert "ampkit.integrations.accelerate is not allowed to import ampkit.trainer" in out, out
    assert f"{TORCH_COMPAT_FACE} BROKEN" in " ".join(out.split()), out
    assert "-   ampkit.casting._cast -> ampkit._internal.torch_compat.dispatch" in out, out


def test_every_subpackage_of_more_than_three_modules_has_a_layers_contract():
    """A package with more than three modules or subpackages is a container of a layers
    contract in pyproject.toml (acyclic inside, its layers named), so a new import inside
    it that closes a loop or climbs breaks ``lint-imports``."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layered = {c for contract in contracts if contract["type"] == "layers" for c in contract["containers"]}
    missing = []
    for init in sorted(SRC.rglob("__init__.py")):
        package = init.parent
        parts = [p for p in package.iterdir() if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()]
        name = ".".join(("ampkit", *package.relative_to(SRC).parts))
        if len(parts) > 3 and name not in layered:
            missing.append(f"{name} ({len(parts)} modules)")
    assert not missing, f"subpackages without a layers contract in pyproject.toml: {missing}"
    assert {"ampkit.levels", "ampkit.trainer", "ampkit.tools.run"} <= layered  # the check reads real contracts


# ---------------------------------------------------------------------------
# 2./3. no underscored names of another subpackage
# ---------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Use:
    """One use of a private name: where (file:line), what, and the module defining it."""

    file: str
    line: int
    name: str
    defined_in: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.name} (of {self.defined_in})"


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _is_module(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != "ampkit":
        return False
    path = SRC.joinpath(*parts[1:])
    return (path.with_suffix(".py")).is_file() or (path / "__init__.py").is_file()


def _subpackage(dotted: str) -> str | None:
    """The subpackage a dotted ampkit name lies in (None: the root files, not ampkit)."""
    parts = dotted.split(".")
    if parts[0] != "ampkit" or len(parts) < 2 or parts[1] not in SUBPACKAGES:
        return None
    return parts[1]


def _module_of(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _private_part(dotted: str) -> tuple[str, str] | None:
    """The first private component of a dotted ampkit name, after its subpackage (or
    after ``ampkit`` for the root files), as (name up to it, module defining it)."""
    parts = dotted.split(".")
    if parts[0] != "ampkit":
        return None
    start = 2 if len(parts) > 1 and parts[1] in SUBPACKAGES else 1
    for i in range(start, len(parts)):
        if _private(parts[i]):
            owner = ".".join(parts[:i])
            while owner.count(".") and not _is_module(owner):
                owner = owner.rsplit(".", 1)[0]
            return ".".join(parts[: i + 1]), owner
    return None


def _private_uses(path: Path, own: str | None, shown: str) -> list[Use]:
    """Uses, in ``path``, of private ampkit names of subpackages other than ``own``
    (``own`` None: of every subpackage and the root files)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_of(path) if path.is_relative_to(SRC) else ""
    if package and path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    aliases: dict[str, str] = {}  # local name -> ampkit module it is bound to
    found: set[Use] = set()

    def check(dotted: str, line: int) -> None:
        hit = _private_part(dotted)
        if hit is None:
            return
        name, owner = hit
        if name in ALLOWED:
            return
        if own is not None and _subpackage(name) in (own, None):
            return
        found.add(Use(shown, line, name, owner))

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "ampkit":
                    continue
                check(a.name, node.lineno)
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    aliases["ampkit"] = "ampkit"
        elif isinstance(node, ast.ImportFrom):
            module = resolve(node)
            if module.split(".")[0] != "ampkit":
                continue
            check(module, node.lineno)
            for a in node.names:
                if a.name == "*":
                    continue
                check(f"{module}.{a.name}", node.lineno)
                if _is_module(f"{module}.{a.name}"):
                    aliases[a.asname or a.name] = f"{module}.{a.name}"

    def dotted(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str) and node.slice.value.split(".")[0] == "ampkit"
                and isinstance(node.value, ast.Attribute) and node.value.attr == "modules"):
            return node.slice.value  # sys.modules["ampkit.x.y"]: the module itself
        return None

    for node in ast.walk(tree):  # m = sys.modules["ampkit.x.y"]: m names that module
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            bound = dotted(node.value) if isinstance(node.value, ast.Subscript) else None
            if bound is not None:
                aliases[node.targets[0].id] = bound
                check(bound, node.lineno)

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Load, ast.Store, ast.Del)):
            full = dotted(node)
            if full is not None:
                check(full, node.lineno)
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            # setattr(module, "_name", ...), getattr(...), monkeypatch.setattr(module, "_name", ...)
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            target, attr = node.args[0], node.args[1]
            if fname in ("setattr", "getattr", "delattr", "hasattr") and isinstance(attr, ast.Constant) \
                    and isinstance(attr.value, str):
                base = dotted(target)
                if base is not None:
                    check(f"{base}.{attr.value}", node.lineno)
    return sorted(found)


def _report(uses: list[Use]) -> str:
    by_owner: dict[str, list[Use]] = {}
    for u in uses:
        by_owner.setdefault(u.defined_in, []).append(u)
    lines = [f"{len(uses)} uses of private names:"]
    for owner in sorted(by_owner):
        lines.append(f"  defined in {owner}:")
        lines += [f"    {u.file}:{u.line} {u.name}" for u in by_owner[owner]]
    return "\n".join(lines)


def _src_uses() -> list[Use]:
    uses: list[Use] = []
    for path in sorted(SRC.rglob("*.py")):
        own = _subpackage(_module_of(path))
        if own is None:  # a package root file: outside the rule
            continue
        uses += _private_uses(path, own, str(path.relative_to(ROOT)))
    return uses


def _test_uses() -> list[Use]:
    uses: list[Use] = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        uses += _private_uses(path, None, str(path.relative_to(ROOT)))
    return uses


def test_the_walk_sees_each_kind_of_private_use(tmp_path):
    """The checker itself: each form of reaching a private name is found, the allowed
    ones are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import ampkit\n"
        "import ampkit.casting._threads\n"
        "from ampkit.casting.engine import _unwrap, autocast\n"
        "from ampkit.trainer import managed as step\n"
        "from ampkit._internal.dtypes import LOW_PRECISION, __all__\n"
        "from ampkit._internal import registry as _reset\n"
        "step._STATE\n"
        "ampkit.levels.model_cast._HANDLES\n"
        "setattr(step, '_x', 1)\n"
        "step.__name__\n"
        "api = sys.modules['ampkit.inference.conversion.api']\n"
        "monkeypatch.setattr(api, '_cpu_computes_fast', None)\n"
        "sys.modules['ampkit.trainer.managed']._STATE\n"
    )
    names = [u.name for u in _private_uses(sample, None, "sample.py")]
    assert names == [
        "ampkit.casting._threads",
        "ampkit.casting.engine._unwrap",
        "ampkit.trainer.managed._STATE",
        "ampkit.levels.model_cast._HANDLES",
        "ampkit.trainer.managed._x",
        "ampkit.inference.conversion.api._cpu_computes_fast",
        "ampkit.trainer.managed._STATE",
    ], names
    # the same uses from inside casting/: only those of other subpackages count
    names = [u.name for u in _private_uses(sample, "casting", "sample.py")]
    assert names == [
        "ampkit.trainer.managed._STATE",
        "ampkit.levels.model_cast._HANDLES",
        "ampkit.trainer.managed._x",
        "ampkit.inference.conversion.api._cpu_computes_fast",
        "ampkit.trainer.managed._STATE",
    ], names


def test_no_subpackage_uses_private_names_of_another():
    uses = _src_uses()
    assert not uses, _report(uses)


def test_tests_use_no_private_ampkit_names():
    uses = _test_uses()
    assert not uses, _report(uses)


# --- private attributes of another subpackage's objects ---------------------------------
#: (file under src/ampkit, attribute) reaches that are not another subpackage's: torch's
#: own privates, each at the one place that owns them.
ATTRIBUTE_REACH_ALLOWED: dict[tuple[str, str], str] = {
    ("_internal/torch_compat/modules.py", "_modules"): "nn.Module's child dict (the torch boundary)",
    ("_internal/torch_compat/modules.py", "_buffers"): "nn.Module's buffer dict (the torch boundary)",
    ("tools/run/forward_scope.py", "_enabled"): "torch.autocast's flag (the launcher's own patches)",
}


def _subpackage_of(path: Path, src: Path) -> str | None:
    parts = path.relative_to(src).parts
    return parts[0] if len(parts) > 1 else None


def _private_attributes(src: Path) -> dict[str | None, set[str]]:
    """Per subpackage, the private attributes its classes own: assigned as ``self._x``
    or ``cls._x``, or defined as ``_x`` methods."""
    owned: dict[str | None, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        names = owned.setdefault(_subpackage_of(path, src), set())
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                    and _private(node.attr)):
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                names.update(f.name for f in node.body
                             if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(f.name))
    return owned


def _attribute_reaches(src: Path) -> list[str]:
    """``obj._x`` (not ``self``/``cls``) in one subpackage where ``_x`` is a private
    attribute only another subpackage's classes own: one subpackage reaching into the
    state of another's objects (``slot.scaler._attached`` in trainer/ for scaling's
    LossScaler). A name both own is not counted (it cannot be told apart statically)."""
    owned = _private_attributes(src)
    found = []
    for path in sorted(src.rglob("*.py")):
        here = _subpackage_of(path, src)
        rel = path.relative_to(src).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in owned.get(here, set()) or (rel, node.attr) in ATTRIBUTE_REACH_ALLOWED:
                continue
            others = sorted(str(b) for b, names in owned.items() if b != here and node.attr in names)
            if others:
                found.append(f"{rel}:{node.lineno}: .{node.attr} (owned by {', '.join(others)})")
    return found


def test_no_subpackage_reaches_into_the_private_attributes_of_anothers_objects():
    found = _attribute_reaches(SRC)
    assert not found, "\n".join(found)


def test_the_attribute_check_catches_a_planted_reach(tmp_path):
    """A copy of the package with ``scaler._attached`` read in trainer/ (what init_trainer
    did before LossScaler.attached existed) fails the check, naming file and owner."""
    src = tmp_path / "ampkit"
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
    api = src / "trainer" / "api.py"
    api.write_text(api.read_text() + "\n\ndef _planted(scaler):\n    return scaler._attached\n")
    found = _attribute_reaches(src)
    assert len(found) == 1 and found[0].startswith("trainer/api.py:") and "._attached (owned by scaling)" in found[0]


# --- the torch boundary -------------------------------------------------------------------
#: Private names ampkit may reach outside ``_internal/torch_compat/``, each with why:
#: Python's own privates, the frameworks' (one integration module each), and the launcher
#: of ``ampkit run`` (its process-wide patches live with it by design).
BOUNDARY_ALLOWED: dict[str, str] = {
    "_getframe": "sys._getframe: Python's frame access (warning locations, the launcher)",
    "_fields": "a namedtuple's field names (Python)",
    "_replace": "a namedtuple's copy with fields changed (Python)",
    "_asdict": "a namedtuple as a dict (Python)",
    "_Unpickler": "Python's own unpickler, whose BUILD the DCP metadata reader refuses on classes (distributed/dcp_files.py)",
    "_is_overflow": "Accelerate's and HF Trainer's skip flag, set by integrations/accelerate.py and hf/callbacks.py",
    "_is_accelerate_prepared": "Accelerate's marker on prepared models (integrations/accelerate.py)",
    "_wrap_closure": "Lightning's Precision hook (integrations/lightning/precision.py)",
}
#: The modules allowed to reach torch's private names (each one documented and tested per release).
BOUNDARY_MODULES = (*sorted((SRC / "_internal" / "torch_compat").glob("*.py")), SRC / "_internal" / "inductor_compat.py")


def _own_names(paths: list[Path]) -> set[str]:
    """Names ampkit defines itself: functions, classes, module-level and local names,
    arguments, and attributes set on ``self``/``cls``."""
    own: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):  # fmt: skip
                own.add(node.attr)
    return own


def _other_private(name: str) -> bool:
    """A private name of another library: one leading underscore or more, not a dunder."""
    return name.startswith("_") and not name.endswith("__")


def torch_private_uses(path: Path, own: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of each private name of another library ``path`` reaches: an
    attribute (``x._name``, ``getattr(x, "_name")``) ampkit does not define itself, an
    import from a private torch module or of a private torch name."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _other_private(node.attr) and node.attr not in own:
            uses.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _other_private(node.args[1].value) and node.args[1].value not in own):  # fmt: skip
            uses.append((node.lineno, node.args[1].value))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".") + [a.name for a in node.names]
            uses += [(node.lineno, f"{node.module}.{p}") for p in parts if _other_private(p)][:1]
        elif isinstance(node, ast.Import):
            uses += [(node.lineno, a.name) for a in node.names
                     if a.name.split(".")[0] == "torch" and any(_other_private(p) for p in a.name.split("."))]  # fmt: skip
    return uses


def _boundary_violations(paths: list[Path], own: set[str]) -> list[str]:
    found = []
    for path in paths:
        if path in BOUNDARY_MODULES:
            continue
        for line, name in torch_private_uses(path, own):
            if name.split(".")[-1] not in BOUNDARY_ALLOWED:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found.append(f"{where}:{line} {name}")
    return found


def test_torch_private_names_are_reached_only_through_torch_compat():
    """Every private name of torch (``torch._*``, private modules, private attributes of
    torch's objects) is used in ``_internal/torch_compat/`` and ``inductor_compat.py`` alone, where each one is
    documented and tested per release; ``BOUNDARY_ALLOWED`` lists the few others."""
    paths = sorted(SRC.rglob("*.py"))
    found = _boundary_violations(paths, _own_names(paths))
    assert not found, "private names used outside the boundary modules:\n" + "\n".join(found)


def test_the_boundary_check_catches_a_planted_private_use(tmp_path):
    paths = sorted(SRC.rglob("*.py"))
    own = _own_names(paths)
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import torch\nfrom torch.optim.optimizer import _get_fused_kernels_supported_devices\n"
        "import torch._dynamo\n"
        "def f(opt, t):\n    opt._opt_called = True\n    return t._values(), getattr(t, '_backward_hooks', None)\n"
    )
    uses = {name for _, name in torch_private_uses(planted, own)}
    assert uses == {"torch.optim.optimizer._get_fused_kernels_supported_devices", "torch._dynamo", "_opt_called",
                    "_values", "_backward_hooks"}  # fmt: skip
    assert len(_boundary_violations([*paths, planted], own)) == 5


# --- size budget ----------------------------------------------------------------------------
# What counts is code: a line holding a token of code (a line continuing a multi-line string
# or bracket included). Docstrings (module, class, function), comment-only lines and blank
# lines do not count, so documenting a unit never pushes it over; a comment after code on
# the same line does not make the line count twice, it counts once as code.
FILE_BUDGET = 600  # code lines per source file
FUNCTION_BUDGET = 80  # code lines per function or method (its def line to its last line)
#: Files over the budget today, with their size: an entry may only shrink (a file that
#: grows past its recorded size fails, and one back within the budget must leave the list).
OVERSIZED_FILES: dict[str, int] = {}
#: Functions over the budget today (``path::Class.method``), the same rule.
OVERSIZED_FUNCTIONS: dict[str, int] = {
    "inference/conversion/api.py::convert": 100,
    "levels/compensated.py::CompensatedUpdates._checked": 86,
    "tools/cli/convert.py::run": 106,
}

_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENCODING, tokenize.ENDMARKER}  # fmt: skip


def _docstring_spans(tree: ast.AST) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """``((line, col), (end_line, end_col))`` of each module, class and function docstring."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):  # fmt: skip
                spans.append(((first.lineno, first.col_offset), (first.end_lineno, first.end_col_offset)))
    return spans


def code_lines(text: str, tree: ast.AST) -> set[int]:
    """The numbers of the lines of ``text`` that hold code: every line a token other than a
    comment, a line break or indentation touches, minus the tokens of docstrings."""
    docstrings = _docstring_spans(tree)
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in _NOT_CODE or any(start <= tok.start < end for start, end in docstrings):
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def _sizes(src: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Code lines (see :func:`code_lines`) per source file, and per function or method
    (``path::Qual.name``, nested functions counted in their outer one too)."""
    files: dict[str, int] = {}
    functions: dict[str, int] = {}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        text = path.read_text()
        tree = ast.parse(text)
        code = code_lines(text, tree)
        files[rel] = len(code)

        def walk(node: ast.AST, prefix: str, rel: str = rel, code: set[int] = code) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    functions[f"{rel}::{name}"] = sum(1 for n in range(child.lineno, child.end_lineno + 1) if n in code)
                    walk(child, name + ".")
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")

        walk(tree, "")
    return files, functions


def _over_budget(sizes: dict[str, int], budget: int, allowed: dict[str, int]) -> list[str]:
    problems = []
    for name, size in sizes.items():
        if name in allowed:
            if size > allowed[name]:
                problems.append(f"{name}: {size} lines, more than its recorded {allowed[name]}: cut it, do not grow it")
            elif size <= budget:
                problems.append(f"{name}: {size} lines, within the budget of {budget}: remove its allow-list entry")
        elif size > budget:
            problems.append(f"{name}: {size} lines, over the budget of {budget}")
    problems += [f"{name}: in the allow-list but gone: remove the entry" for name in allowed if name not in sizes]
    return problems


def test_files_and_functions_keep_to_the_size_budget():
    """Each source file holds at most ``FILE_BUDGET`` code lines and each function or method
    at most ``FUNCTION_BUDGET``, the allow-listed ones at most their recorded size. A code
    line holds a token of code; docstrings (module, class, function), comment-only lines
    and blank lines are not counted (see :func:`code_lines`)."""
    files, functions = _sizes(SRC)
    problems = _over_budget(files, FILE_BUDGET, OVERSIZED_FILES)
    problems += _over_budget(functions, FUNCTION_BUDGET, OVERSIZED_FUNCTIONS)
    assert not problems, "\n".join(problems)


def test_the_size_budget_catches_growth_and_new_oversized_units():
    """The rule itself: a new file or function over the budget, an allowed one grown past
    its record, and an allowed one back within the budget (its entry must go) all fail."""
    sizes = {"a.py": 700, "b.py": 650, "c.py": 500, "d.py": 601}
    allowed = {"a.py": 700, "b.py": 640, "c.py": 620, "gone.py": 900}
    problems = _over_budget(sizes, 600, allowed)
    assert [p.split(":")[0] for p in problems] == ["b.py", "c.py", "d.py", "gone.py"], problems
    files, functions = _sizes(SRC)
    assert files["scaling/loss_scaler.py"] > 100 and functions["levels/setup.py::initialize"] > 20


def test_the_size_budget_counts_code_lines_only(tmp_path):
    """Docstrings, comment-only lines and blank lines do not count; every line of a
    statement or string that spans lines does, and a line of code with a comment counts
    once. ``initialize`` with 100 more lines of docstring and 100 of comments and blank
    lines keeps its size; 100 more lines of code put it over the budget."""
    (tmp_path / "m.py").write_text(
        '"""Module docstring\nover two lines."""\n\nimport os  # a comment after code\n\n\n'
        'class C:\n    """Class docstring."""\n\n    def f(self):\n        """Method\n        docstring."""\n'
        '        # a comment\n        x = (1,\n             2)\n\n        return f"""{x}\ntext"""\n'
    )
    files, functions = _sizes(tmp_path)
    assert files == {"m.py": 7} and functions == {"m.py::C.f": 5}
    setup = (SRC / "levels" / "setup.py").read_text()
    doc = '    """Set up mixed precision for ``models`` and ``optimizers`` at ``opt_level``.\n'
    body = "    _apply(checked, named_by_models=plan is not None)\n"
    assert doc in setup and body in setup

    def sizes(text: str) -> tuple[dict[str, int], dict[str, int]]:
        (tmp_path / "m.py").write_text(text)
        return _sizes(tmp_path)

    files, functions = sizes(setup)
    key = "m.py::initialize"
    documented = setup.replace(doc, doc + "    More words.\n" * 100).replace(body, "    # why\n\n" * 50 + body)
    assert sizes(documented) == (files, functions) and _over_budget(functions, FUNCTION_BUDGET, {}) == []
    grown_files, grown = sizes(setup.replace(body, "    planted = 0\n" * 100 + body))
    assert grown_files["m.py"] == files["m.py"] + 100 and grown[key] == functions[key] + 100
    assert _over_budget(grown, FUNCTION_BUDGET, {}) == [f"{key}: {grown[key]} lines, over the budget of {FUNCTION_BUDGET}"]


# --- no runtime import cycle ----------------------------------------------------------------
# import-linter's layers see the module graph; an import inside a function runs later and can
# still close a loop (a needs b at call time, b imports a). Here every import statement
# counts, at module level or inside a function, except those under ``if TYPE_CHECKING:``
# (they never run). An edge goes to the module imported, or to the package whose name it
# imports; the import of a parent package that any submodule import runs first is not an
# edge (the root imports every layer). Allowed cycles would be listed with their reason:
#: ``frozenset({module, ...})`` of an allowed cycle -> why it must stay.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in (getattr(node.test, "id", None), getattr(node.test, "attr", None))
            for stmt in node.body for n in ast.walk(stmt)}  # fmt: skip


def import_graph(src: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported ampkit module: line}}`` from every import statement of ``src``
    (``src`` is a copy of ``src/ampkit`` or the real one), function-level ones included."""
    def is_module(dotted: str) -> bool:
        path = src.joinpath(*dotted.split(".")[1:])
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    graph: dict[str, dict[str, int]] = {}
    for path in sorted(src.rglob("*.py")):
        parts = ["ampkit", *path.relative_to(src).with_suffix("").parts]
        me = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        skip, out = _type_checking_nodes(tree), graph.setdefault(me, {})
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import) and id(node) not in skip:
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and id(node) not in skip:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{module}.{a.name}" if is_module(f"{module}.{a.name}") else module for a in node.names]
            for target in targets:
                while target.split(".")[0] == "ampkit" and not is_module(target):
                    target = target.rsplit(".", 1)[0]
                if target.split(".")[0] == "ampkit" and target != me:
                    out.setdefault(target, node.lineno)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _cycle_report(graph: dict[str, dict[str, int]], cycles: list[list[str]]) -> str:
    lines = []
    for cycle in cycles:
        lines.append(" <-> ".join(cycle))
        lines += [f"    {a} -> {b} (line {graph[a][b]})" for a in cycle for b in graph[a] if b in cycle]
    return "\n".join(lines)


def test_no_import_cycle_at_run_time():
    """No import, at module level or inside a function, closes a loop in ``src``; the
    allowed ones (none today) are listed with their reason."""
    graph = import_graph(SRC)
    cycles = [c for c in import_cycles(graph) if frozenset(c) not in ALLOWED_CYCLES]
    assert not cycles, "imports that close a loop (a function-level one included):\n" + _cycle_report(graph, cycles)
    assert graph["ampkit.distributed.fsdp"]["ampkit.levels.model_cast"]  # a function-level import is seen


def test_the_cycle_check_catches_a_planted_function_level_import(tmp_path):
    src = tmp_path / "ampkit"
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
    scaler = src / "scaling" / "transition.py"
    scaler.write_text(scaler.read_text() + "\n\ndef _planted():\n    from .loss_scaler import LossScaler\n")
    checking = src / "levels" / "model_cast.py"
    checking.write_text(checking.read_text() + "\nif TYPE_CHECKING:\n    from ampkit.levels.setup import initialize\n")
    graph = import_graph(src)
    assert import_cycles(graph) == [["ampkit.scaling.loss_scaler", "ampkit.scaling.transition"]], _cycle_report(
        graph, import_cycles(graph))


# Opt levels are the levels layer's: the layers below it (casting, scaling, trainer,
# _internal) name none in their code, so a level's meaning cannot be restated down there
# (the tuning plan, which names levels, lives in levels/precision_plan.py).
BELOW_LEVELS = ("_internal", "casting", "scaling", "trainer")


def level_names_below_levels(src: Path, names: set[str]) -> list[str]:
    """``path:line: 'O2'`` for each string constant in the code of the layers below
    ``levels`` that is an opt level's name."""
    found = []
    for layer in BELOW_LEVELS:
        for path in sorted((src / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                    found.append(f"{path.relative_to(src).as_posix()}:{node.lineno}: {node.value!r}")
    return found


def test_the_layers_below_levels_name_no_opt_level():
    from ampkit.levels import OPT_LEVELS

    assert level_names_below_levels(SRC, set(OPT_LEVELS)) == []


def test_the_level_name_check_catches_a_planted_name(tmp_path):
    src = tmp_path / "ampkit"
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
    policy = src / "casting" / "policy.py"
    policy.write_text(policy.read_text() + '\n\nLEVELS = ("O1", "O2K")  # planted\n')
    lines = len(policy.read_text().splitlines())
    assert level_names_below_levels(src, {"O1", "O2K"}) == [f"casting/policy.py:{lines}: 'O1'",
                                                             f"casting/policy.py:{lines}: 'O2K'"]  # fmt: skip


# One docstring convention: Google style as napoleon reads it (``Args:`` entries
# ``name (type): what it is. Default: ``x``.``). A default in brackets after the type,
# ``name (type) [x]:``, is dropped from the rendered page by napoleon's parser.
_BRACKET_DEFAULT = re.compile(r"^\s+`{0,2}\w+`{0,2} \([^)]*\) \[[^\]]*\]:", re.M)


def _bracket_defaults(src: Path) -> list[str]:
    found = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                found += [f"{path.relative_to(src)}: {m.group(0).strip()}" for m in _BRACKET_DEFAULT.finditer(doc)]
    return found


def test_docstrings_keep_one_convention():
    assert _bracket_defaults(SRC) == []


def test_the_docstring_check_catches_a_bracketed_default(tmp_path):
    (tmp_path / "m.py").write_text(
        'def f(n=1):\n    """F.\n\n    Args:\n        n (int) [1]: how many.\n    """\n'
    )
    assert _bracket_defaults(tmp_path) == ["m.py: n (int) [1]:"]


# Tests shaped like the source: a unit folder per subpackage, the rest by kind.
TEST_FOLDERS = {"unit", "scenarios", "integrations", "tools", "meta", "support"}


def test_tests_are_shaped_like_the_source():
    tests = ROOT / "tests"
    assert sorted(p.name for p in tests.glob("*.py")) == ["conftest.py"], "test files go into a folder"
    assert {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))} == TEST_FOLDERS
    subpackages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units = {p.name for p in (tests / "unit").iterdir() if p.is_dir() and not p.name.startswith("__")}
    expected = subpackages - {"tools", "integrations"} | {"package"}
    assert units == expected, units ^ expected
    # every test module outside support has a unique name (pytest imports them by name)
    names = [p.name for p in tests.rglob("test_*.py") if "support" not in p.parts]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert [u for u in sorted(units) if not list((tests / "unit" / u).glob("test_*.py"))] == []  # none empty


_IMPORT_CHECK = """
import sys, torch
before = set(sys.modules)
import ampkit
heavy = sorted(m for m in set(sys.modules) - before if m.startswith(("torch._dynamo", "torch._inductor")))
print(len(heavy), heavy[:5])
"""


def test_import_ampkit_loads_neither_dynamo_nor_inductor():
    """``import ampkit`` in a new interpreter (not a forked one: the tests' fork server has
    both loaded) loads no module of Dynamo or Inductor (about 1 s each): they load at the
    first compile or optimizer. A decorator of Dynamo's at import did once (0.3 -> 1.2 s)."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(SRC.parent)}).stdout  # fmt: skip
    assert out.startswith("0 "), out
    planted = subprocess.run([sys.executable, "-c", _IMPORT_CHECK.replace("import ampkit", "import ampkit, torch._dynamo")],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(SRC.parent)}).stdout  # fmt: skip
    assert not planted.startswith("0 "), planted  # the check sees a planted one
