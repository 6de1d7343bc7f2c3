"""Which process this is in a distributed run: one answer for every layer.

- :func:`rank_and_world_size`: ``(rank, world size)`` of the default process group,
  ``(0, 1)`` when none is initialized.
- :func:`is_rank_zero`: whether this process is the one that logs and prints.
"""

from __future__ import annotations

import os

import torch

__all__ = ["rank_and_world_size", "is_rank_zero"]


def rank_and_world_size() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialized default process group; ``(0, 1)`` when
    torch has no distributed support or no process group is initialized."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_rank_zero(*, from_env: bool = False) -> bool:
    """Whether this process is rank 0.

    Args:
        from_env: False (default): ask the initialized default process group (True
            when none is initialized). True: read the launcher's ``RANK`` environment
            variable (torchrun sets it before any process group exists; unset means no
            launch at all, so rank 0).
    """
    if from_env:
        return os.environ.get("RANK", "0") == "0"
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True
