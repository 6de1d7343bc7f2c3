"""Walking nested containers of tensors (model inputs, outputs, state dicts).

The containers walked are lists, tuples (named tuples too) and mappings; anything
else is a leaf. Unlike :mod:`torch.utils._pytree`, which knows only the container
types registered with it, these walkers treat every ``dict`` (or ``Mapping``)
subclass as a mapping, and say exactly how each container is rebuilt.

- :func:`iter_tensors`: the tensors inside, in order.
- :func:`map_leaves`: the same structure with a function applied to every leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["iter_tensors", "map_leaves"]

#: What counts as a mapping: ``Mapping`` (every mapping), ``dict`` (dicts and their
#: subclasses only), or None (mappings are leaves).
MappingKind = type | None


def iter_tensors(obj: Any, *, mapping: MappingKind = Mapping) -> Iterator[torch.Tensor]:
    """The tensors inside ``obj`` (``obj`` itself when it is one), depth first in
    container order: through lists, tuples and the values of mappings.

    Args:
        obj: the (nested) value.
        mapping: which objects are mappings whose values are walked (default
            ``Mapping``; ``dict`` for dicts only; None for no mappings).
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item, mapping=mapping)
    elif mapping is not None and isinstance(obj, mapping):
        for item in obj.values():
            yield from iter_tensors(item, mapping=mapping)


def map_leaves(
    obj: Any, fn: Callable[[Any], Any], *, keep_types: bool = False, mapping: MappingKind = Mapping
) -> Any:
    """``obj`` with ``fn`` applied to every leaf (every object that is not a list,
    tuple or mapping: tensors, numbers, None, ...).

    Args:
        obj: the (nested) value.
        fn: called on each leaf; its result replaces the leaf.
        keep_types: False (default): lists and tuples come back as lists, mappings as
            dicts (JSON-like). True: tuples come back as their own type (a named
            tuple as that named tuple), mappings as their own type (built from
            ``(key, value)`` pairs), lists as lists.
        mapping: which objects are mappings (default ``Mapping``; ``dict`` for dicts
            only; None: mappings are leaves).
    """
    if isinstance(obj, tuple):
        items = [map_leaves(x, fn, keep_types=keep_types, mapping=mapping) for x in obj]
        if not keep_types:
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [map_leaves(x, fn, keep_types=keep_types, mapping=mapping) for x in obj]
    if mapping is not None and isinstance(obj, mapping):
        pairs = ((k, map_leaves(v, fn, keep_types=keep_types, mapping=mapping)) for k, v in obj.items())
        return type(obj)(pairs) if keep_types else dict(pairs)
    return fn(obj)
