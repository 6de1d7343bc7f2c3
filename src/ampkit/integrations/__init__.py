"""ampkit inside the training loops of frameworks.

Each integration lives in its own module and imports its framework only when that
module is imported, so ``import ampkit`` still needs torch alone:

- :mod:`ampkit.integrations.lightning`: a Lightning ``Precision`` plugin
  (``pip install -e '.[lightning]'``).
- :mod:`ampkit.integrations.hf`: ``enable(trainer, "O2")`` for a stock Hugging Face
  ``Trainer``, or the ``AmpkitTrainer`` subclass and its mixin (``pip install -e '.[hf]'``).
- :mod:`ampkit.integrations.accelerate`: ampkit set up around ``accelerator.prepare``,
  the loss scaled in ``accelerator.backward`` (``pip install -e '.[accelerate]'``).

Each says one line when ampkit takes over its framework's precision, once per process:
on stderr by default, at INFO on the ``"ampkit"`` logger where logging is configured
(:mod:`ampkit.integrations.banner`).

A module whose framework is missing raises :class:`ampkit.integrations.MissingFramework`
(an :class:`ampkit.AmpError`) naming the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ampkit._internal.install import install_hint
from ampkit.errors import AmpError

__all__ = ["MissingFramework", "require"]


class MissingFramework(AmpError, ImportError):
    """An integration was used without its framework installed."""


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` (a framework an integration is built on) or raise
    :class:`MissingFramework` saying which ``ampkit[extra]`` installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingFramework(
            f"ampkit.integrations needs {module!r}, which is not installed ({exc}); "
            f"install it with: {install_hint(extra)}"
        ) from exc
