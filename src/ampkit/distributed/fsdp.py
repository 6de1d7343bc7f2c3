"""Every opt level under FSDP2: :func:`fully_shard` shards a model for a level, then
``ampkit.initialize`` sets the level up on the sharded model.

FSDP2 (``torch.distributed.fsdp.fully_shard``) stays the owner of sharding, prefetch and
collectives; ampkit owns the casting policy, the skip rule, loss scaling and its state.
What each level stores and computes, per FSDP2 unit:

- O0, O1: fp32 shards, no ``MixedPrecisionPolicy``; O1 adds op-level casting.
- O2: fp32 shards (they are the masters), ``MixedPrecisionPolicy(param_dtype=<16-bit>,
  reduce_dtype=float32)`` (fp32 outputs at the root), op-level casting inside the model.
- O3: 16-bit shards, no policy; the kept modules' cast hooks.
- O2K: bf16 shards, no policy; the compensated update steps each rank's local shards,
  the compensation sharded like the optimizer state.

Modules a level keeps in fp32 (norm layers at O2/O2K, ``keep_fp32=``) become FSDP2 units
of their own with fp32 parameters (``param_dtype=torch.float32`` at O2): FSDP2 gathers a
unit's parameters as one buffer of one dtype. Every level then steps with ampkit's
managed optimizer: the found-inf check of DTensor grads reduces over the mesh inside
torch's DTensor ops (the fused unscale, or the read of scale-1 grads), so every rank skips
together and the scalers stay equal (``tests/unit/distributed/test_fsdp.py`` puts a NaN in one rank's
shard at every level).

Order: ``fully_shard`` (this function) -> build the optimizer on the sharded parameters
-> ``ampkit.initialize(model, opt, opt_level=...)`` with the same level (and dtype).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn

from ampkit._internal.dtypes import torch_class
from ampkit._internal.env import dtype_from_env
from ampkit.errors import AmpError, DistributedError
from ampkit.levels.opt_level import OptLevel, resolve_opt_level
from ampkit.levels.sharding import SHARD_PLAN_ATTR, ShardPlan, UnitRule

__all__ = ["fully_shard"]


def _default_units(model: nn.Module) -> list[str]:
    """The children of every ``nn.ModuleList`` (transformer blocks, the usual FSDP2
    units), outermost lists only."""
    out: list[str] = []

    def visit(module: nn.Module, name: str) -> None:
        if isinstance(module, nn.ModuleList):
            out.extend(f"{name}.{child}" if name else child for child, _ in module.named_children())
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    return out


def _check_rules(what: str, rules: Iterable[Any]) -> tuple[UnitRule, ...]:
    out = tuple(rules)
    for rule in out:
        if not (isinstance(rule, str) or (isinstance(rule, type) and issubclass(rule, nn.Module))):
            raise DistributedError(
                f"{what} takes module classes or qualified-name globs (e.g. 'blocks.*'), got {rule!r}."
            )
    return out


def _check_model(model: Any, fsdp_module: type) -> None:
    """Refuse what is not an unsharded fp32 ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise DistributedError(f"fully_shard takes an nn.Module, got {type(model).__name__}.")
    if any(isinstance(m, fsdp_module) for m in model.modules()):
        raise DistributedError("this model is already sharded by fully_shard; pass the unsharded model.")
    if any(p.dtype != torch.float32 for p in model.parameters() if p.is_floating_point()):
        raise DistributedError(
            "fully_shard(opt_level=...) takes an fp32 model (the level decides what is stored in "
            "16 bits); this one has parameters in "
            f"{sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})}."
        )


def _level_for(model: nn.Module, opt_level: str, overrides: dict[str, Any]) -> OptLevel:
    """What ``opt_level`` with ``overrides`` means for ``model`` on its device:
    ``initialize``'s own answer (its default dtype there, its storage, its checks), as a
    :class:`DistributedError` if refused."""
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    dtype = overrides.get("dtype")
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        raise DistributedError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype!r}.")
    try:
        return resolve_opt_level(opt_level, device_type, **{**overrides, "dtype": dtype or dtype_from_env()})
    except AmpError as exc:
        raise DistributedError(str(exc)) from None


def _refuse_kept_whole(model: nn.Module, kept_roots: list[nn.Module], level: str) -> None:
    """Raise :class:`DistributedError` where the model itself is kept fp32 (torch would
    shard it twice: an assertion mid-way, the model's class already swapped)."""
    if any(m is model for m in kept_roots):
        raise DistributedError(
            f"fully_shard(opt_level={level!r}): keep_fp32 (or the level's rule for norm layers) "
            "keeps the whole model fp32, so the level has nothing to cast. Shard it with opt_level='O1' "
            "(fp32 weights, 16-bit compute by op), or keep submodules only (a glob like 'blocks.*.attn' "
            "matches names under the model; '*' matches the model itself too)."
        )


def fully_shard(
    model: nn.Module,
    *,
    opt_level: str,
    dtype: torch.dtype | None = None,
    keep_norm_fp32: bool | None = None,
    keep_fp32: Iterable[UnitRule] = (),
    units: Iterable[UnitRule] | None = None,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    cast_model_type: torch.dtype | Literal[False] | None = None,
    master_weights: bool | None = None,
    compensation: Literal["kahan", "stochastic", False] | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 for ``opt_level`` and return it (the same object,
    now an ``FSDPModule``); then build the optimizer on its parameters and call
    ``ampkit.initialize(model, opt, opt_level=opt_level)``.

    Args:
        model: an fp32 model on its device (before any ``initialize``).
        opt_level: ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"`` or ``"O2K"`` (see the module
            docstring for what each stores).
        dtype: the 16-bit dtype (default: ``AMPKIT_DTYPE``, else as ``initialize``
            chooses it: bf16 at O2K and on CPU, fp16 on CUDA; O2K is bf16 only).
        keep_norm_fp32: keep the norm layers fp32 (default None: as the level has it,
            True at O2/O2K); give ``initialize`` the same value.
        keep_fp32: module classes or qualified-name globs kept fp32 (O2/O3/O2K), on top
            of the norm layers O2/O2K keep; each becomes an FSDP2 unit of its own.
        units: module classes or qualified-name globs sharded as units of their own
            (default: the children of every ``nn.ModuleList``); the root is always one.
        mesh: the device mesh (default: FSDP2's, every rank of the default group).
        reshard_after_forward: passed to FSDP2's ``fully_shard`` (default True).
        cast_model_type, master_weights, compensation: the storage overrides of
            :func:`ampkit.initialize` (default None: the level's), checked as it checks
            them; give ``initialize`` the same values (it refuses a model sharded for
            another storage).

    Raises:
        DistributedError: no ``torch.distributed.fsdp`` in this torch, an unknown level,
            a dtype the level cannot use, a model that is already sharded or set up by
            ``initialize``, or a ``keep_fp32``/``units`` glob that matches no module.
    """
    from ampkit.levels.model_cast import (
        cast_model,
        check_keep_fp32,
        kept_fp32_modules,
        kept_fp32_roots,
        matches_rule,
    )

    shard = torch_class("torch.distributed.fsdp", "fully_shard")
    policy_cls = torch_class("torch.distributed.fsdp", "MixedPrecisionPolicy")
    fsdp_module = torch_class("torch.distributed.fsdp", "FSDPModule")
    if shard is None or policy_cls is None or fsdp_module is None:
        raise DistributedError("this torch has no torch.distributed.fsdp.fully_shard (FSDP2); use DDP.")
    _check_model(model, fsdp_module)
    keep = _check_rules("keep_fp32", keep_fp32)
    unit_rules = None if units is None else _check_rules("units", units)
    level = _level_for(model, opt_level, dict(
        dtype=dtype, keep_norm_fp32=keep_norm_fp32, keep_fp32=keep, cast_model_type=cast_model_type,
        master_weights=master_weights, compensation=compensation,
    ))  # fmt: skip
    dtype, cast = level.dtype, level.cast_model_type
    if keep:
        check_keep_fp32([model], [r for r in keep if isinstance(r, str)])
    names = {id(m): n for n, m in model.named_modules()}
    casts = cast is not None
    keep_norms = level.keep_norm_fp32
    masters = level.master_weights  # the fp32 shards are the masters; FSDP2 casts what it gathers
    kept = kept_fp32_modules(model, keep_norm_fp32=keep_norms, keep_fp32=keep) if casts else []
    kept_ids = {id(m) for m in kept}
    # the outermost kept modules are units; what is inside one stays in it
    kept_roots = kept_fp32_roots(model, keep_norm_fp32=keep_norms, keep_fp32=keep) if casts else []
    _refuse_kept_whole(model, kept_roots, level.name)
    if unit_rules is None:
        unit_names = _default_units(model)
    else:
        unit_names = [n for n, m in model.named_modules() if n and matches_rule(m, n, unit_rules)]
        for rule in unit_rules:
            if isinstance(rule, str) and not any(fnmatch.fnmatchcase(n, rule) for n in names.values() if n):
                raise DistributedError(f"units glob {rule!r} matches no module name of the model.")
    by_name = dict(model.named_modules())
    unit_modules = [by_name[n] for n in unit_names if id(by_name[n]) not in kept_ids]

    if casts and not masters:  # O3, O2K: the sharded parameters themselves are 16-bit
        cast_model(model, cast, keep_norm_fp32=keep_norms, cast_outputs=torch.float32, keep_fp32=keep)
    kw: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        kw["mesh"] = mesh
    # a kept unit computes in fp32 and hands its output back in the compute dtype, as O2's
    # kept modules do (activations stay 16-bit between layers)
    fp32_policy = policy_cls(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=dtype)
    low_policy = policy_cls(param_dtype=cast, reduce_dtype=torch.float32)
    root_policy = policy_cls(param_dtype=cast, reduce_dtype=torch.float32, output_dtype=torch.float32)
    # innermost first: kept modules, then the units, then the root
    for module in kept_roots:
        if any(True for _ in module.parameters()):
            shard(module, mp_policy=fp32_policy if masters else policy_cls(), **kw)
    for module in sorted(unit_modules, key=lambda m: -names[id(m)].count(".")):
        shard(module, **({"mp_policy": low_policy} if masters else {}), **kw)
    shard(model, **({"mp_policy": root_policy} if masters else {}), **kw)
    plan = ShardPlan(
        level=level.name,
        dtype=dtype,
        keep_norm_fp32=keep_norms,
        cast_model_type=cast,
        master_weights=masters,
        units=tuple(names[id(m)] for m in unit_modules) + ("",),
        kept=tuple(names[id(m)] for m in kept_roots),
        keep_fp32=keep,
    )
    model.__dict__[SHARD_PLAN_ATTR] = plan
    return model
