"""Tensor memory figures for ``ampkit bench``.

CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``) during
training, minus what was allocated before the model was built (the dataset).

CPU has no allocator statistics, so the bench reports an estimate built from two
exact counts, both in distinct storages (views and shared tensors count once):

- *state*: every tensor alive in the worker process after training, found through
  Python's garbage collector (parameters, their gradients, optimizer state, fp32
  master copies, compensation buffers, loss-scaler state, cached casts), less the
  dataset's tensors;
- *activations*: the tensors autograd saved for backward during one training step
  (``torch.autograd.graph.saved_tensors_hooks``), less those already counted as
  state (parameters saved as they are).

Their sum bounds the peak tensor memory of a step from above (gradients and saved
activations are not all alive at once); allocator overhead and workspace buffers
are not included.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["storage_ptrs", "live_tensor_bytes", "SavedActivations", "MIB"]

MIB = float(2**20)


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of ``t``'s storage, or None for tensors without one."""
    try:
        if t.is_sparse or t.device.type == "meta":
            return None
        s = t.untyped_storage()
        ptr, nbytes = s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None
    if ptr == 0 or nbytes == 0:
        return None
    return ptr, nbytes


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Storage addresses of ``tensors`` (to exclude them from a count)."""
    out: set[int] = set()
    for t in tensors:
        key = _storage(t)
        if key is not None:
            out.add(key[0])
    return out


def live_tensor_bytes(device: torch.device, exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Bytes of the distinct storages of every tensor on ``device`` that Python can
    reach (and of their ``.grad``), except storages whose address is in ``exclude``."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if t is None or t.device.type != device.type:
            return
        key = _storage(t)
        if key is not None and key[0] not in exclude:
            seen[key[0]] = max(seen.get(key[0], 0), key[1])

    gc.collect()
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which some
        # deprecation proxies in torch's namespace answer with a warning.
        if issubclass(type(obj), torch.Tensor):
            add(obj)
            if obj.is_leaf and obj.requires_grad:
                add(obj.grad)
    return sum(seen.values())


class SavedActivations:
    """Context manager counting the distinct storages autograd saves for backward
    inside it, except those in ``exclude``. Read ``nbytes`` afterwards."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.seen: dict[int, int] = {}
        self.nbytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key is not None and key[0] not in self.exclude:
            self.seen[key[0]] = max(self.seen.get(key[0], 0), key[1])
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self.nbytes = sum(self.seen.values())
