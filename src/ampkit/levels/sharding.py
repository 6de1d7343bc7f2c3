"""What :func:`ampkit.initialize` asks of :mod:`ampkit.distributed`, which sits above the
levels in the package's layers (it shards and wraps models the levels have set up) and
installs its answers here when it is imported (``import ampkit`` imports it).

- ``check_models(models, level_name, casts_model)``: refuse DDP/FSDP wrappers a level
  cannot run under (before anything is changed);
- ``check_plan(model, level_name, dtype, keep_fp32)``: the shard plan of a model
  ``ampkit.distributed.fully_shard`` sharded for this level, or refuse it.

Whether a model is FSDP2-sharded at all is a plain torch check (:func:`is_fsdp2`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampkit._internal.dtypes import torch_class
from ampkit.errors import StateError

__all__ = ["DistributedChecks", "checks", "install", "is_fsdp2"]


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` or a module in it is an FSDP2 (``fully_shard``) module."""
    cls = torch_class("torch.distributed.fsdp", "FSDPModule")
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


@dataclass(frozen=True)
class DistributedChecks:
    """The checks :mod:`ampkit.distributed` answers for :func:`ampkit.initialize`."""

    check_models: Callable[[Iterable[nn.Module], str, bool], None]
    check_plan: Callable[[nn.Module, str, torch.dtype, Sequence[Any]], Any]


# Module state: the checks ampkit.distributed installed when it was imported.
_INSTALLED: DistributedChecks | None = None


def install(answers: DistributedChecks) -> None:
    """Called once by :mod:`ampkit.distributed` at import."""
    global _INSTALLED
    _INSTALLED = answers


def checks() -> DistributedChecks:
    """The installed checks; ``import ampkit`` always installs them."""
    if _INSTALLED is None:
        raise StateError("ampkit.distributed was not imported; import ampkit (it imports ampkit.distributed).")
    return _INSTALLED
