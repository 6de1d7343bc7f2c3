"""``torch.load`` with its defaults and the objects ampkit puts into a model.

Since torch 2.6 ``torch.load(f)`` unpickles with ``weights_only=True``: only tensors,
plain containers and the classes on torch's allowlist may appear in the file. A whole
model saved with ``torch.save(model)`` after ampkit touched it also holds ampkit's
objects: the cast hooks of O2/O3/O2K, the fp8 linear and its scale state, the hooks and
report of a converted model. :func:`register` (run when ``ampkit`` is imported) adds
exactly those classes to torch's allowlist (``torch.serialization.add_safe_globals``),
so such a model loads with plain ``torch.load(f)`` whenever the same model would at
fp32.

What the user still does, as at fp32:

* allow the model's own classes (``nn.Sequential``, ``nn.Linear``, their ``nn.Module``
  subclass) with ``torch.serialization.add_safe_globals([...])`` or
  ``torch.serialization.safe_globals([...])``; torch allows no ``nn.Module`` by
  default, and ampkit does not allow classes that are not its own;
* ``import ampkit`` before ``torch.load``: the weights-only unpickler never imports a
  module, so in a process without ampkit imported the load fails naming an ampkit
  class (``Unsupported global: GLOBAL ampkit.levels.model_cast.CastInputs``).

Why these are safe to allow: the weights-only unpickler may create an allowed class
(``cls.__new__`` / ``cls(*args)``) and set its attributes (``__setstate__`` or
``__dict__.update``) from data in the file, nothing else. Each class here only stores
what it is given and, when the model runs, uses it as dtypes, strings, numbers and
tensors (casts, scales, messages); none calls, imports or looks up anything named by
its state. No function, ``functools.partial`` or bound method is on the list: ampkit's
hooks are instances of these classes for that reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import torch

__all__ = ["ON_THEIR_IMPORT", "SAFE_GLOBALS", "register", "safe_classes"]

#: module -> the names of its classes that ampkit puts into a model.
SAFE_GLOBALS: dict[str, tuple[str, ...]] = {
    # hooks of cast_model (O2, O3, O2K) and of initialize's O2 masters and guards
    "ampkit.levels.model_cast": (
        "CastInputs", "CastOutputs", "EntryCasts", "EntryExit", "OpCastingEnter", "OpCastingExit",
    ),
    "ampkit.levels.setup": ("ResyncMasters",),
    "ampkit.trainer.grad_hooks": ("WatchDDP",),
    "ampkit.levels.sharding": ("FSDPGuard",),
    # initialize(..., fp8=...): the switched class and its scale state
    "ampkit.levels.fp8.layer": ("Float8Linear",),
    "ampkit.levels.fp8.scales": ("LayerState", "TensorScale"),
    "ampkit.levels.fp8.recipe": ("Fp8Recipe",),
    # convert(): boundary hooks and the report kept as model.ampkit_report
    "ampkit.inference.conversion.hooks": (
        "_BoundaryInputs", "_BoundaryOutputs", "_IslandEnter", "_IslandExit", "_Fp32Island",
    ),
    "ampkit.inference.conversion.report": ("ConversionReport", "ModuleDecision", "FoldRecord"),
    "ampkit.inference.conversion.measure": ("Budget", "OutputError"),
    # apex's O2 state-dict hook (registered when ampkit.compat.apex is imported)
    "ampkit.tools.compat.apex": ("Fp32StateDict",),
}
#: Modules whose classes are allowed when they themselves are imported (importing
#: them does more than define classes).
ON_THEIR_IMPORT = frozenset({"ampkit.tools.compat.apex"})


#: Modules that were one file in 0.3 and are packages today: a file written by 0.3 names
#: their classes by the package (``ampkit.levels.fp8.Float8Linear``), which exports them.
SPLIT_SINCE_0_3 = ("ampkit.levels.fp8",)
#: Modules whose classes moved since 0.3: the module a file written by 0.3 names -> today's.
MOVED_SINCE_0_3 = {"ampkit.distributed.core": "ampkit.levels.sharding"}


def _legacy_names(cls: type) -> list[str]:
    """The paths under which ampkit 0.2 or 0.3 pickled ``cls``: ``<old>.<qualname>`` for
    each 0.2 module path whose module today is ``cls``'s own, or a package above it that
    exports ``cls`` (``ampkit.convert`` is the ``ampkit.inference.conversion`` package,
    its classes live in the package's modules), ``<package>.<qualname>`` for a 0.3
    module split into a package since (:data:`SPLIT_SINCE_0_3`), and ``<old>.<qualname>``
    for a class moved since 0.3 (:data:`MOVED_SINCE_0_3`)."""
    from .legacy import LEGACY_MODULES

    def exports(package: str) -> bool:
        inside = cls.__module__.startswith(package + ".")
        return inside and getattr(importlib.import_module(package), cls.__qualname__, None) is cls

    out = []
    for old, new in LEGACY_MODULES.items():
        if new == cls.__module__ or exports(new):
            out.append(f"{old}.{cls.__qualname__}")
    out.extend(f"{package}.{cls.__qualname__}" for package in SPLIT_SINCE_0_3 if exports(package))
    out.extend(f"{old}.{cls.__qualname__}" for old, new in MOVED_SINCE_0_3.items() if new == cls.__module__)
    return out


def safe_classes(modules: Iterable[str] | None = None) -> list[type]:
    """The classes :data:`SAFE_GLOBALS` lists for ``modules`` (default: every module
    but those of :data:`ON_THEIR_IMPORT`), imported."""
    names = [m for m in SAFE_GLOBALS if m not in ON_THEIR_IMPORT] if modules is None else list(modules)
    out = []
    for module_name in names:
        module = importlib.import_module(module_name)
        out.extend(getattr(module, name) for name in SAFE_GLOBALS[module_name])
    return out


def register(modules: Iterable[str] | None = None) -> None:
    """Add the classes of ``modules`` (see :func:`safe_classes`) to ``torch.load``'s
    weights-only allowlist (idempotent), under their module paths of today and of 0.2
    (:data:`ampkit.legacy.LEGACY_MODULES`: files written by 0.2 name those)."""
    classes = safe_classes(modules)
    entries: list = list(classes)
    for cls in classes:
        entries.extend((cls, name) for name in _legacy_names(cls))
    torch.serialization.add_safe_globals(entries)
