"""Counting host reads in tests: the Tensor methods that copy a value to the host (on a
GPU each waits for the device), patched while a ``counting_reads`` block is open."""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Iterator

import torch

# Tensor methods that copy a value to the host: on a GPU each waits for the device.
READS = ("item", "__bool__", "tolist", "__float__", "__int__")


@contextlib.contextmanager
def counting_reads(counts: collections.Counter) -> Iterator[None]:
    """Count the host reads made while open, by the file of the calling frame; on exit
    torch.Tensor is as it was (a method it inherits is not left in its own dict)."""
    missing = object()
    own = {name: torch.Tensor.__dict__.get(name, missing) for name in READS}
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def reader(self, *args, **kwargs):
            counts[sys._getframe(1).f_code.co_filename.rsplit("/", 1)[-1]] += 1
            return original(self, *args, **kwargs)

        return reader

    for name, original in saved.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in own.items():
            if original is missing:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
