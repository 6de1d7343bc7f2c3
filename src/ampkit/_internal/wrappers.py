"""Optimizers wrapped by training frameworks, unwrapped by class, without importing them.

Frameworks hand the training loop a wrapper around the ``torch.optim.Optimizer`` the
script built: Accelerate's ``AcceleratedOptimizer`` holds it as ``.optimizer``,
Lightning's ``LightningOptimizer`` and Fabric's ``_FabricOptimizer`` as ``._optimizer``.
These wrappers are themselves ``torch.optim.Optimizer`` instances
(``AcceleratedOptimizer`` subclasses it without running its ``__init__``; the two
Lightning wrappers swap their class for a subclass of the wrapped optimizer's), so an ``isinstance`` check lets them through and ampkit would set
up the wrapper instead of the optimizer that steps. :func:`unwrap_optimizer` follows the
known wrappers down to the optimizer they hold.

The wrappers are recognized by the module and name of a class in the object's MRO (no
framework is imported) and followed only when the attribute holds an optimizer: an object
that is neither a known wrapper nor wraps an optimizer is returned as it is, so callers
refuse it with the error they always gave.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KNOWN_WRAPPERS", "unwrap_optimizer", "unwrap_optimizers", "wrapper_attribute"]

#: (module of the wrapper class, its name, the instance attribute holding the wrapped
#: optimizer). A class matches when one class of an object's MRO has this module and name.
KNOWN_WRAPPERS: list[tuple[str, str, str]] = [
    ("accelerate.optimizer", "AcceleratedOptimizer", "optimizer"),
    ("lightning.pytorch.core.optimizer", "LightningOptimizer", "_optimizer"),
    ("pytorch_lightning.core.optimizer", "LightningOptimizer", "_optimizer"),
    ("lightning.fabric.wrappers", "_FabricOptimizer", "_optimizer"),
]

#: How many wrappers deep :func:`unwrap_optimizer` follows at most.
MAX_DEPTH = 8


def wrapper_attribute(obj: Any) -> str | None:
    """The attribute holding the wrapped optimizer if ``obj`` is an instance of a known
    wrapper class (:data:`KNOWN_WRAPPERS`), else None."""
    for cls in type(obj).__mro__:
        module, name = getattr(cls, "__module__", None), getattr(cls, "__name__", None)
        for w_module, w_name, attribute in KNOWN_WRAPPERS:
            if module == w_module and name == w_name:
                return attribute
    return None


def unwrap_optimizer(obj: Any) -> Any:
    """The ``torch.optim.Optimizer`` a framework's wrapper holds (through wrappers of
    wrappers), or ``obj`` itself: when it is no known wrapper, or when the chain does not
    end in a ``torch.optim.Optimizer`` (a framework's own optimizer engine)."""
    current = obj
    for _ in range(MAX_DEPTH):
        attribute = wrapper_attribute(current)
        if attribute is None:
            break
        inner = getattr(current, "__dict__", {}).get(attribute)
        if inner is None or inner is current:
            break
        current = inner
    if current is not obj and isinstance(current, torch.optim.Optimizer) and wrapper_attribute(current) is None:
        return current
    return obj


def unwrap_optimizers(obj: Any) -> Any:
    """:func:`unwrap_optimizer` of one object, or of each item of a list/tuple (a list or
    tuple back); anything else is returned as it is."""
    if isinstance(obj, list):
        return [unwrap_optimizer(o) for o in obj]
    if isinstance(obj, tuple):
        return tuple(unwrap_optimizer(o) for o in obj)
    return unwrap_optimizer(obj)
