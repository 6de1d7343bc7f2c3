"""What :func:`ampkit.initialize` checks of distributed wrappers before it changes
anything, here beside the levels it asks for (``ampkit.distributed`` re-exports these
names as its API):

- :func:`check_models`: refuse DDP/FSDP wrappers a level cannot run under, and guard a
  model a cast level prepared against a later ``fully_shard`` (:class:`FSDPGuard`);
- :func:`check_plan`: the :class:`ShardPlan` ``ampkit.distributed.fully_shard`` left on a
  model it sharded for a level, or refuse the model.

Whether a model is FSDP2-sharded at all is a plain torch check (:func:`is_fsdp2`)."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampkit._internal.dtypes import torch_class
from ampkit.errors import DistributedError

if TYPE_CHECKING:
    from .opt_level import OptLevel

__all__ = ["FSDPGuard", "SHARD_PLAN_ATTR", "ShardPlan", "UnitRule", "check_models", "check_plan", "is_fsdp2",
           "shard_plan"]  # fmt: skip

#: Where ``fully_shard`` keeps its :class:`ShardPlan`: the model's ``__dict__``.
SHARD_PLAN_ATTR = "_ampkit_shard_plan"

UnitRule = type[nn.Module] | str


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` or a module in it is an FSDP2 (``fully_shard``) module."""
    return _contains(model, torch_class("torch.distributed.fsdp", "FSDPModule"))


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How :func:`ampkit.distributed.fully_shard` sharded a model: ``level``, ``dtype``
    (the 16-bit compute dtype), ``units`` (qualified names of the FSDP2 units, root last:
    ``""``), ``kept`` (qualified names of the modules kept fp32, each a unit),
    ``keep_fp32`` (the rules it was given), ``keep_norm_fp32`` (whether the norm
    layers were kept fp32), ``cast_model_type`` (the 16-bit dtype the weights are
    stored or gathered in; None: fp32) and ``master_weights`` (fp32 shards as masters)."""

    level: str
    dtype: torch.dtype
    units: tuple[str, ...]
    kept: tuple[str, ...]
    keep_fp32: tuple[UnitRule, ...]
    keep_norm_fp32: bool = True
    cast_model_type: torch.dtype | None = None
    master_weights: bool = False


def shard_plan(model: nn.Module) -> ShardPlan | None:
    """The :class:`ShardPlan` :func:`ampkit.distributed.fully_shard` left on ``model``
    (None if it did not shard it)."""
    return model.__dict__.get(SHARD_PLAN_ATTR)


def _contains(model: nn.Module, cls: type | None) -> bool:
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def _is_fsdp1(model: nn.Module) -> bool:
    return _contains(model, torch_class("torch.distributed.fsdp", "FullyShardedDataParallel"))


def _fsdp_recipe(level_name: str) -> str:
    return (
        f"{level_name} stores the weights in other dtypes, and FSDP2 owns the sharded parameters, "
        "so the level must be part of the sharding: shard the fp32 model with "
        f"ampkit.distributed.fully_shard(model, opt_level={level_name!r}) (FSDP2 with the level's "
        "MixedPrecisionPolicy per module), then build the optimizer and call ampkit.initialize "
        "with the same level."
    )


def check_models(models: Iterable[nn.Module], level_name: str, casts_model: bool) -> None:
    """Refuse distributed wrappers of ``models`` that an opt level (``level_name``;
    ``casts_model``: whether it casts the model's weights) cannot work under (called by
    :func:`ampkit.initialize` before it touches anything).

    A level that casts the model (O2, O3, O2K) needs the plain model: wrap it in DDP
    *after* ``initialize``; FSDP2 and FSDP1 models are refused with a recipe. O0/O1
    (weights stay fp32) accept any wrapper. For cast levels, a forward pre-hook on each
    model raises :class:`~ampkit.DistributedError` if ``fully_shard`` is applied to it
    afterwards (its optimizer would be left training stale copies)."""
    models = list(models)
    if not casts_model:
        return
    ddp_cls = nn.parallel.DistributedDataParallel
    for model in models:
        if isinstance(model, ddp_cls):
            raise DistributedError(
                f"initialize got a DistributedDataParallel model at {level_name}, which casts "
                "the weights: DDP's gradient buckets were built for the fp32 weights. Call "
                "ampkit.initialize on the plain model first, then wrap it: "
                "model = ampkit.distributed.register_ddp(DDP(model))."
            )
        if is_fsdp2(model):
            if shard_plan(model) is None:
                raise DistributedError(f"initialize got an FSDP2 (fully_shard) model. {_fsdp_recipe(level_name)}")
            continue  # sharded for its level by ampkit.distributed.fully_shard (checked by initialize)
        if _is_fsdp1(model):
            raise DistributedError(
                f"initialize got a FullyShardedDataParallel (FSDP1) model at {level_name}; "
                "FSDP1 flattens and casts parameters itself. Use FSDP2 (fully_shard) with "
                "O0/O1 and FSDP2's MixedPrecisionPolicy, or DDP."
            )
    for model in models:
        if not is_fsdp2(model):
            _install_fsdp_guard(model, level_name)


def check_plan(model: nn.Module, level: OptLevel) -> ShardPlan:
    """The plan of an FSDP2 model ``initialize`` sets up at ``level`` (resolved): refuse
    one that :func:`ampkit.distributed.fully_shard` did not shard for this level, dtype
    and storage."""
    level_name, dtype, keep_norm_fp32 = level.name, level.dtype, level.keep_norm_fp32
    plan = shard_plan(model)
    if plan is None:  # check_models refuses it first, with the same recipe
        raise DistributedError(f"initialize got an FSDP2 (fully_shard) model. {_fsdp_recipe(level_name)}")
    if plan.level != level_name or plan.dtype != dtype:
        raise DistributedError(
            f"this model was sharded by ampkit.distributed.fully_shard for {plan.level} in {plan.dtype}; "
            f"initialize asked for {level_name} in {dtype}. Pass the same opt_level and dtype to both."
        )
    if (plan.cast_model_type, plan.master_weights) != (level.cast_model_type, level.master_weights):
        raise DistributedError(
            f"ampkit.distributed.fully_shard stored this model's weights as cast_model_type="
            f"{plan.cast_model_type}, master_weights={plan.master_weights}; initialize asked for "
            f"{level.cast_model_type}, {level.master_weights}. Pass the same overrides to both."
        )
    if plan.keep_norm_fp32 != keep_norm_fp32:
        raise DistributedError(
            f"keep_norm_fp32 is {plan.keep_norm_fp32} in ampkit.distributed.fully_shard and {keep_norm_fp32} "
            "in initialize; pass the same value to both (fully_shard decides which modules are fp32 units)."
        )
    if tuple(level.keep_fp32) and tuple(level.keep_fp32) != plan.keep_fp32:
        raise DistributedError(
            "keep_fp32 differs between ampkit.distributed.fully_shard and initialize; give it to "
            "fully_shard (it decides which modules are fp32 units) and leave it out of initialize."
        )
    return plan


# Module state: the FSDP guard hook of each model a cast level prepared (weak keys).
_GUARDS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _install_fsdp_guard(model: nn.Module, level_name: str) -> None:
    old = _GUARDS.pop(model, None)
    if old is not None:
        old.remove()

    _GUARDS[model] = model.register_forward_pre_hook(FSDPGuard(level_name))


class FSDPGuard:
    """Forward pre-hook of a model whose weights an opt level (``level_name``, named in
    the error) cast: refuse to run once ``fully_shard`` replaced its parameters. A plain
    object (picklable, copyable); files written by 0.3 name it
    ``ampkit.distributed.core.FSDPGuard``, by 0.2 ``ampkit.distributed.FSDPGuard``."""

    def __init__(self, level_name: str) -> None:
        self.level_name = level_name

    def __call__(self, module: nn.Module, args: Any) -> None:
        fsdp2 = torch_class("torch.distributed.fsdp", "FSDPModule")
        if fsdp2 is not None and isinstance(module, fsdp2):
            raise DistributedError(
                f"this model was set up by ampkit.initialize at {self.level_name} and then "
                f"sharded by fully_shard, which replaced its parameters. {_fsdp_recipe(self.level_name)}"
            )
