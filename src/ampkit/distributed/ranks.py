"""Checking that the ranks agree: :func:`check_ranks_agree` compares every rank's
ampkit state (loss scales, counters, masters, compensation) by a bitwise digest
(:func:`fingerprint`) and names what differs."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ampkit._internal.tree import map_leaves
from ampkit.errors import DistributedError
from ampkit.trainer import session as _session

__all__ = ["check_ranks_agree", "fingerprint"]

dist = torch.distributed


def fingerprint(obj: Any) -> Any:
    """A picklable digest of a state dict: numbers as they are, tensors by dtype, shape
    and a hash of their bytes (bitwise)."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            digest = hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()
            return ("tensor", str(t.dtype), tuple(t.shape), digest)
        return repr(x) if isinstance(x, float) else x

    return map_leaves(obj, leaf, mapping=dict)


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: present on one rank only")
            else:
                out += _differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path or '/'}: {a!r} vs {b!r}"]


def check_ranks_agree(group: Any = None) -> None:
    """Raise :class:`~ampkit.DistributedError` unless every rank of ``group`` holds the
    same AMP state (``ampkit.state_dict()``: scales, counters, fp32 masters bitwise).
    A collective: call it on every rank, e.g. after loading a checkpoint or in tests."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = fingerprint(_session.state_dict())
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        diffs = _differences(everyone[0], theirs)
        if diffs:
            shown = "; ".join(diffs[:5])
            raise DistributedError(
                f"the AMP state of group rank {rank} differs from group rank 0's in "
                f"{len(diffs)} place(s): {shown}."
            )
