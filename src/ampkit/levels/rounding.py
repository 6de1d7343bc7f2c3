"""Whether a 16-bit tensor is exactly an fp32 one rounded (a model grad and its master's
grad, a model weight and its master): how O2 finds edits made through ``.data``, which
leave version counters alone. :func:`rounds_to` compares; :func:`compared_ahead` makes
the comparisons of a whole step on a GPU in one host sync."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence

import torch

from ampkit._internal import torch_compat

from .update_kernels import rounds_to_bf16

__all__ = ["rounds_to", "unrounded", "compared_ahead", "COMPARED_ONE_BY_ONE"]

_COMPARE_CHUNK = 1 << 16

# Per thread: comparisons made ahead on the device (see compared_ahead), by
# (id, version) of both tensors.
_AHEAD = threading.local()
#: device types whose comparisons are not made ahead: on the CPU each one costs no wait,
#: and chunked comparisons need no full-size temporary
COMPARED_ONE_BY_ONE = frozenset({"cpu"})


@contextlib.contextmanager
def compared_ahead(pairs: Iterable[tuple[torch.Tensor | None, torch.Tensor | None]]) -> Iterator[None]:
    """Inside: :func:`rounds_to` answers for the dense, same-shaped ``pairs`` on a
    device other than the CPU from one comparison of all of them, read back in one
    host sync (each ``torch.equal`` there waits for the device: an O2 step of a
    135M-parameter model on an H200 made 200 of them). Pairs it was not given, or
    changed since (their version), are compared as before."""
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for low, g in pairs:
        if (low is not None and g is not None and low.device.type not in COMPARED_ONE_BY_ONE and low.device == g.device
                and low.shape == g.shape and not (low.is_sparse or g.is_sparse)):  # fmt: skip
            by_device.setdefault(low.device, []).append((low, g))
    if not by_device:
        yield
        return
    results: dict[tuple[int, int, int, int], bool] = {}
    with torch.no_grad():
        for group in by_device.values():
            # NaN != NaN: unequal, as torch.equal has it
            differs = torch.stack([torch.ne(low, g.to(low.dtype)).any() for low, g in group]).tolist()
            for (low, g), d in zip(group, differs):
                key = (id(low), torch_compat.tensor_version(low), id(g), torch_compat.tensor_version(g))
                results[key] = not d
    outer = getattr(_AHEAD, "results", None)
    _AHEAD.results = results
    try:
        yield
    finally:
        _AHEAD.results = outer


def rounds_to(low: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether 16-bit ``low`` is exactly fp32 ``g`` rounded to its dtype (a gradient
    copy and its master's gradient, a model weight and its master); on the CPU compared
    a chunk of ``_COMPARE_CHUNK`` elements at a time: no full-size temporary at the step
    (large bf16 tensors on CPU: :func:`ampkit.levels.update_kernels.rounds_to_bf16`, one compiled
    pass, several times faster)."""
    if low.shape != g.shape:
        return False
    ahead = getattr(_AHEAD, "results", None)
    if ahead:
        key = (id(low), torch_compat.tensor_version(low), id(g), torch_compat.tensor_version(g))
        known = ahead.get(key)
        if known is not None:
            return known
    with torch.no_grad():
        fast = rounds_to_bf16(low, g)  # large bf16 tensors: one compiled read pass
        if fast is not None:
            return fast
        if not (low.is_contiguous() and g.is_contiguous()) or low.device.type != "cpu":
            # off the CPU each comparison waits for the device: one per tensor, not one
            # per chunk (chunked, a 135M-parameter O2 model on an H200 spent 280 ms a
            # step in 2000 host syncs); the rounded copy is a transient of 2 bytes/element
            return torch.equal(low, g.to(low.dtype))
        a, b = low.view(-1), g.view(-1)
        return all(
            torch.equal(a[i : i + _COMPARE_CHUNK], b[i : i + _COMPARE_CHUNK].to(low.dtype))
            for i in range(0, a.numel(), _COMPARE_CHUNK)
        )


def unrounded(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """The positions of the ``(low, g)`` pairs for which :func:`rounds_to` is False.
    Small contiguous pairs on the CPU (below ``_COMPARE_CHUNK`` elements, a model's
    biases and norms) are compared together, up to ``_COMPARE_CHUNK`` elements per
    comparison of their concatenations: one call per batch instead of one per pair
    (a batch that differs is compared pair by pair to find which)."""
    out: list[int] = []
    on_cpu = "cpu" in COMPARED_ONE_BY_ONE  # else compared ahead (compared_ahead): rounds_to answers
    batches: dict[tuple[torch.dtype, torch.dtype], list[list[int]]] = {}
    sizes: dict[tuple[torch.dtype, torch.dtype], int] = {}
    for i, (low, g) in enumerate(pairs):
        n = low.numel()
        if (on_cpu and 0 < n < _COMPARE_CHUNK and low.is_cpu and g.is_cpu and not (low.is_sparse or g.is_sparse)
                and low.shape == g.shape and low.is_contiguous() and g.is_contiguous()):  # fmt: skip
            key = (low.dtype, g.dtype)
            batch = batches.setdefault(key, [[]])
            size = sizes.get(key, 0) + n
            if size > _COMPARE_CHUNK:
                batch.append([])
                size = n
            batch[-1].append(i)
            sizes[key] = size
        elif not rounds_to(low, g):
            out.append(i)
    with torch.no_grad():
        for (dtype, _), batch_list in batches.items():
            for batch in batch_list:
                if len(batch) > 1:  # (contiguous: each joined in one C++ call)
                    lows = torch_compat.flatten_dense([pairs[i][0] for i in batch])
                    highs = torch_compat.flatten_dense([pairs[i][1] for i in batch])
                    if torch.equal(lows, highs.to(dtype)):
                        continue
                out.extend(i for i in batch if not rounds_to(*pairs[i]))
    return sorted(out)
