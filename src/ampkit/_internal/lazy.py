"""Names of a package resolved on first use (PEP 562), so importing one module of the
package does not import the rest: ``__getattr__, __dir__ = lazy_exports(__name__, {...})``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` for ``exports``
    (name -> the submodule, relative to ``package``, that defines it)."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        import sys

        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
