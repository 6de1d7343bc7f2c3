"""DDP and FSDP under ampkit: one skip decision across ranks, the grad-sync plan,
FSDP2 sharding for every opt level (:func:`~ampkit.distributed.fully_shard`), SyncBatchNorm conversion, and
the checks that refuse wrappers a level cannot run under. ``ampkit.distributed`` is public: these names are its API."""

from __future__ import annotations

from ampkit.levels.sharding import (
    FSDPGuard,  # also 0.2's pickled path ampkit.distributed.FSDPGuard
    ShardPlan,
    check_models,
    shard_plan,
)

from .checkpoint import AmpState, load_checkpoint, save_checkpoint
from .core import SyncMode, SyncPlan, register_ddp, set_sync, sync_plan
from .fsdp import fully_shard
from .ranks import check_ranks_agree
from .syncbn import convert_sync_batchnorm

__all__ = [
    "AmpState",
    "FSDPGuard",
    "ShardPlan",
    "fully_shard",
    "load_checkpoint",
    "save_checkpoint",
    "shard_plan",
    "SyncMode",
    "SyncPlan",
    "check_models",
    "check_ranks_agree",
    "convert_sync_batchnorm",
    "register_ddp",
    "set_sync",
    "sync_plan",
]
