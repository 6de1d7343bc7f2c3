"""ampkit 0.2's module paths, for the files and imports written against them.

0.2 kept its modules flat in ``ampkit/``; they now live in concept subpackages. Two
things still name the old paths:

* pickles: a model saved whole with ``torch.save(model)`` names its hooks' classes by
  module path (``ampkit.model.CastInputs``, ``ampkit.fp8.Float8Linear``,
  ``ampkit.convert._Fp32Island``, ...). ``torch.load``'s weights-only unpickler finds
  them through the old names :mod:`ampkit.safe_globals` registers; the full unpickler
  imports the old module path, which :class:`LegacyFinder` answers with today's module;
* imports: ``ampkit.compat.apex`` (the documented drop-in for ``from apex import amp``),
  ``ampkit.fp8`` (the public fp8 module, ``ampkit.fp8.layers()``)
  and ``ampkit.bench`` keep working as import paths.

Importing one of the other old paths that is no name of today's (``ampkit.model``,
``ampkit.grads``) warns once (``DeprecationWarning``); ``ampkit.convert``,
``ampkit.levels`` and ``ampkit.distributed`` are today's names too and import without
one. Each gives today's module object itself, so a class loaded through it is today's
class.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

__all__ = ["LEGACY_MODULES", "LegacyFinder", "install"]

#: 0.2's module path -> today's.
LEGACY_MODULES: dict[str, str] = {
    "ampkit.model": "ampkit.levels.model_cast",
    "ampkit.grads": "ampkit.trainer.grad_hooks",
    "ampkit.fp8": "ampkit.levels.fp8",
    "ampkit.convert": "ampkit.inference.conversion",  # the package: it exports every class 0.2 pickled there
    "ampkit.levels": "ampkit.levels.setup",  # ampkit.levels is today's package; see below
    "ampkit.distributed": "ampkit.levels.sharding",  # likewise (its FSDPGuard lives there today)
    "ampkit.compat": "ampkit.tools.compat",
    "ampkit.compat.apex": "ampkit.tools.compat.apex",
    "ampkit.bench": "ampkit.tools.bench",
}
#: Old paths that are today's packages of the same name (their package exports the
#: classes 0.2 pickled there): the finder never sees them.
_SAME_NAME = frozenset({"ampkit.levels", "ampkit.distributed"})
#: Old paths kept as supported import paths: no warning.
_SUPPORTED = ("ampkit.compat", "ampkit.bench", "ampkit.fp8")
#: Old paths that are also the names of functions in ``ampkit`` (``ampkit.convert``):
#: put into ``sys.modules`` up front, so importing them never rebinds the function.
_SHADOWED = ("ampkit.convert",)


def _target(fullname: str) -> str | None:
    if fullname in _SAME_NAME:
        return None
    if fullname in LEGACY_MODULES:
        return LEGACY_MODULES[fullname]
    for old in _SUPPORTED:  # submodules of a moved package: ampkit.bench.memory
        if fullname.startswith(old + "."):
            return LEGACY_MODULES[old] + fullname[len(old):]
    return None


class LegacyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an import of a 0.2 module path with today's module object."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if _target(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = _target(spec.name)
        assert new is not None
        if not spec.name.startswith(_SUPPORTED):
            warnings.warn(
                f"{spec.name} is ampkit 0.2's path of {new}; import {new} (or the name from ampkit) instead. "
                "A model pickled by 0.2 loads through the old path; save it again to write today's.",
                DeprecationWarning,
                stacklevel=2,
            )
        return importlib.import_module(new)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is today's, already executed."""


def install() -> None:
    """Put :class:`LegacyFinder` first on ``sys.meta_path`` (idempotent) and the
    shadowed old paths into ``sys.modules``."""
    if not any(isinstance(f, LegacyFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, LegacyFinder())
    for old in _SHADOWED:
        sys.modules.setdefault(old, importlib.import_module(LEGACY_MODULES[old]))
