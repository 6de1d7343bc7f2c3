"""The plan phase of :func:`ampkit.initialize`: every argument checked against the
models, the optimizers and the running session, nothing changed (:func:`make_plan`
returns a :class:`Plan`; :mod:`.setup` applies it). A refused ``initialize`` leaves the
models, the optimizers and the previous session as they were."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampkit._internal.dtypes import default_device_type
from ampkit._internal.env import dtype_from_env
from ampkit._internal.wrappers import unwrap_optimizers
from ampkit.casting.engine import model_name, unwrap_module
from ampkit.casting.policy import Policy, check_device_type
from ampkit.errors import AmpError, DistributedError, PolicyError, StateError
from ampkit.scaling.loss_scaler import LossScaler
from ampkit.trainer import api as optim

from . import fp8 as _fp8
from . import one_pass, sharding
from .master import MasterWeights
from .model_cast import check_keep_fp32, kept_fp32_modules, params_to_cast
from .opt_level import OptLevel, is_fp32_level, level_or_env, resolve_opt_level
from .sharding import is_fsdp2

__all__ = ["Plan", "make_plan", "masters_of", "CAST_MODELS", "MASTERS_ATTR", "is_managed"]

# Masters stay in an optimizer's param_groups after reset; a later initialize on the
# same optimizer reuses them instead of mastering the masters. Kept in the optimizer's
# own __dict__ (a MasterWeights refers to its optimizer, so a weak-keyed table would
# keep every O2 setup alive forever); the cycle goes with the optimizer.
MASTERS_ATTR = "_ampkit_master_weights"


def masters_of(optimizer: Any) -> MasterWeights | None:
    return getattr(optimizer, "__dict__", {}).get(MASTERS_ATTR)

# Module state (weak): models cast by initialize (a later initialize may cast them again).
CAST_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def is_managed(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` is set up by ampkit (``init_trainer`` or ``initialize``)."""
    try:
        optim.managed_state(opt)
    except StateError:
        return False
    return True


def _as_list(obj: Any, kind: type, what: str) -> tuple[list[Any], bool]:
    if isinstance(obj, kind):
        return [obj], True
    if isinstance(obj, (list, tuple)) and all(isinstance(o, kind) for o in obj) and obj:
        if len({id(o) for o in obj}) != len(obj):
            raise AmpError(f"the same {kind.__name__} appears twice in {what}.")
        return list(obj), False
    raise AmpError(
        f"{what} must be a {kind.__name__} or a non-empty list of them, got {type(obj).__name__}."
    )


def _device_type(models: Sequence[nn.Module], requested: Any = None) -> str:
    """The device type the models' tensors are on. ``requested`` (initialize's
    ``device_type``) must name that same type; for models without tensors it chooses
    (None: the default device type)."""
    if requested is not None:
        if not isinstance(requested, str):
            raise AmpError(f"device_type must be a string such as 'cpu' or 'cuda', got {requested!r}.")
        if ":" in requested:
            raise AmpError(
                f"device_type takes a device type such as {requested.split(':')[0]!r}, not a "
                f"device ({requested!r}); initialize sets the models up on the device they are on."
            )
    types = {t.device.type for m in models for t in list(m.parameters()) + list(m.buffers())}
    if len(types) > 1:
        raise AmpError(
            f"the models' tensors are on several device types {sorted(types)}; move each "
            "model to one device before initialize."
        )
    if not types:
        return requested if requested is not None else default_device_type()
    found = types.pop()
    if requested is not None and requested != found:
        raise AmpError(
            f"device_type={requested!r}, but the models' tensors are on {found!r}; initialize "
            f"sets the models up where they are: move them first (model.to({requested!r})) "
            "or drop device_type."
        )
    return found


def _make_scaler(level: OptLevel) -> LossScaler:
    if level.loss_scale == "dynamic":
        kw: dict[str, Any] = {}
        if level.min_loss_scale is not None:
            kw["min_scale"] = level.min_loss_scale
        if level.max_loss_scale is not None:
            kw["max_scale"] = level.max_loss_scale
        init = 2.0**16
        if "max_scale" in kw:
            init = min(init, kw["max_scale"])
        if "min_scale" in kw:
            init = max(init, kw["min_scale"])
        return LossScaler(init_scale=init, dynamic=True, **kw)
    return LossScaler(init_scale=float(level.loss_scale), dynamic=False)


#: optimizers whose second-moment state (``exp_avg_sq``) is kept in the parameters'
#: dtype and divides the update: in fp16 it underflows (a squared gradient below fp16's
#: smallest subnormal, about 6e-8, times ``1 - beta2`` is 0) and ``eps`` (1e-8) rounds to 0
ADAM_FAMILY: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
    torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta,
)  # fmt: skip


# The Adam family but Adadelta, whose eps goes inside the square root: eps is added to
# the square root of the second moment, and below float16's smallest normal number
# (6.1e-5) it cannot keep m/(sqrt(v)+eps) finite once v underflows to 0.
_EPS_IN_DENOMINATOR = tuple(c for c in ADAM_FAMILY if c is not torch.optim.Adadelta)


def _check_fp16_adam_state(level: OptLevel, opt_list: Sequence[torch.optim.Optimizer]) -> None:
    """O3 (pure 16 bits, no masters, no compensation) in fp16 with an Adam-like optimizer:
    its state is fp16, where the second moment of typical gradients (below about 1e-2)
    underflows to 0. An ``eps`` below fp16's smallest normal number (6.1e-5; the default
    1e-8 is 0 in fp16) then divides by ~0 and writes inf/NaN into the weights at the
    first step (seen with AdamW on an H200 and on the CPU): refused, naming ``eps``.
    With a larger ``eps`` the steps stay finite but small updates are lost: warned.
    Said before anything runs, once per call."""
    if level.cast_model_type is not torch.float16 or level.master_weights or level.compensation is not None:
        return
    tiny = torch.finfo(torch.float16).tiny
    for i, opt in enumerate(opt_list):
        if not isinstance(opt, _EPS_IN_DENOMINATOR):
            continue
        for j, group in enumerate(opt.param_groups):
            eps = group.get("eps")
            if isinstance(eps, (int, float)) and eps < tiny:
                in_fp16 = float(torch.tensor(eps, dtype=torch.float16))
                raise AmpError(
                    f"{level.name} with dtype=torch.float16 keeps optimizer {i}'s ({type(opt).__name__}) state "
                    f"and arithmetic in float16, where its eps={eps:g} (param group {j}) is {in_fp16:g}: "
                    "once the second moment of a small gradient underflows to 0, the step divides by "
                    "(almost) zero and writes inf/NaN into the weights. Use O2 (fp32 master weights and "
                    "state), dtype=torch.bfloat16, or eps >= 1e-4 in every param group."
                )
    adams = sorted({type(opt).__name__ for opt in opt_list if isinstance(opt, ADAM_FAMILY)})
    if adams:
        warnings.warn(
            f"ampkit: {level.name} keeps {', '.join(adams)}'s state in float16, where the second moment of "
            "gradients below about 1e-2 underflows to 0, so their updates are lost or jump by lr*grad/eps. "
            "Use O2 (fp32 master weights and state) or dtype=torch.bfloat16; O3 in fp16 suits SGD.",
            UserWarning,
            stacklevel=3,
        )


def _check_fp32(
    models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], level: OptLevel
) -> None:
    """Casting and masters start from fp32 weights. A model cast by an earlier
    ``initialize`` may be initialized again, as long as no new master would have to
    be built from its 16-bit weights."""
    if level.cast_model_type is None:
        return
    for i, model in enumerate(models):
        if is_fsdp2(model):  # ampkit.distributed.fully_shard stored it as the level does
            continue
        recast = model in CAST_MODELS
        for name, p in model.named_parameters():
            if not p.is_floating_point() or p.dtype == torch.float32:
                continue
            if _has_master(p, optimizers):
                continue
            if recast and not (level.master_weights and _in_optimizers(p, optimizers)):
                continue
            raise AmpError(
                f"model {i} parameter {name!r} is {p.dtype}: initialize expects fp32 "
                "models (it casts them itself, after building fp32 master weights); "
                "build the model in fp32."
            )


def _in_optimizers(p: nn.Parameter, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    return any(p is q for opt in optimizers for g in opt.param_groups for q in g["params"])


def _has_master(p: nn.Parameter, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    return any(
        (mw := masters_of(opt)) is not None and mw.master_of(p) is not None for opt in optimizers
    )


@dataclasses.dataclass
class Plan:
    """What :func:`initialize` will do, every argument checked and nothing changed yet
    (:func:`_plan`); :func:`.setup._apply` carries it out."""

    level: OptLevel
    policy: Policy | None
    device_type: str
    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    one_model: bool
    one_opt: bool
    fresh: bool
    scaler: Any
    shard_plan: Any = None
    fp8_plan: Any = None


def _check_fp32_rules(models: list[nn.Module], policy: Policy | None, level: OptLevel) -> None:
    """At a level that casts the model: refuse a module rule that would run a module's
    16-bit weights in fp32 (its ops would fail on them mid-forward). A module's rule is its
    own, else its enclosing module's (a rule applies to the calls inside, as the hooks
    apply it); names as the rules see them (relative to the model, wrappers left out)."""
    if policy is None or not any(d is torch.float32 for d in policy.module_rules.values()):
        return
    for model in models:
        cast = {id(p) for p in params_to_cast(model, level.keep_norm_fp32, keep_fp32=level.keep_fp32)}
        rule: dict[str, torch.dtype | None] = {}
        for name, module in unwrap_module(model).named_modules(remove_duplicate=False):  # parents first
            name = model_name(name)
            own = policy.module_dtype(module, name)
            rule[name] = own if own is not None else rule.get(name.rpartition(".")[0]) if name else None
            if rule[name] is torch.float32 and any(id(p) in cast for p in module.parameters(recurse=False)):
                raise PolicyError(
                    f"the policy's module rules pin {name or 'the model'!r} ({type(module).__name__}) to fp32, "
                    f"but {level.name} casts its weights to {level.cast_model_type}: its ops cannot run in fp32 on "
                    f"them. Keep the module in fp32 with initialize(keep_fp32=[...]) (module classes or name "
                    "globs, as module rules take them) instead of the rule, or pin it to a 16-bit dtype."
                )


def make_plan(
    models: Any, optimizers: Any, opt_level: str | None, device_type: str | None, fp8: Any, fresh: Any,
    overrides: dict[str, Any],
) -> Plan:
    """Check every argument of :func:`initialize` against the models, the optimizers and
    the running session; change nothing."""
    opt_level = level_or_env(opt_level)  # an argument > the environment > the default
    if overrides.get("dtype") is None:
        env_dtype = dtype_from_env()
        if env_dtype is not None:
            overrides["dtype"] = env_dtype
    if not isinstance(fresh, bool):
        raise AmpError(f"fresh must be True or False, got {fresh!r}.")
    if not fresh and fp8 not in (None, False):
        raise AmpError("fp8 needs a fresh session (its scale state is session-wide): pass fresh=True.")
    model_list, one_model = _as_list(models, nn.Module, "models")
    if optimizers is None:
        opt_list: list[torch.optim.Optimizer] = []
        one_opt = False
    else:
        # a framework's wrapper (AcceleratedOptimizer, LightningOptimizer): its optimizer
        opt_list, one_opt = _as_list(unwrap_optimizers(optimizers), torch.optim.Optimizer, "optimizers")
    policy = overrides.pop("policy", None)
    if policy is not None and not isinstance(policy, Policy):
        raise PolicyError(f"policy must be an ampkit.Policy, got {type(policy).__name__}.")
    device_type = _device_type(model_list, device_type)
    level = resolve_opt_level(opt_level, device_type, **overrides)
    if policy is not None and not (level.op_casting or level.model_op_casting):
        raise AmpError(
            f"a policy only applies with op-level casting, which {level.name} leaves off; "
            "use O1, O2, O2K or op_casting=True."
        )
    if level.op_casting or level.model_op_casting:
        check_device_type(device_type)
    _check_fp32(model_list, opt_list, level)
    _check_optimizers(opt_list, level, fresh)
    plan = Plan(level, policy, device_type, model_list, opt_list, one_model, one_opt, fresh, _make_scaler(level))
    if level.cast_model_type is not None:
        check_keep_fp32(model_list, level.keep_fp32)
        _check_fp32_rules(model_list, policy, level)
    sharding.check_models(model_list, level.name, level.cast_model_type is not None)
    if any(is_fsdp2(m) for m in model_list):
        _check_fsdp_optimizers(model_list, opt_list)
        if level.cast_model_type is not None:
            plan.shard_plan = _check_sharded(model_list, opt_list, level)
    recipe = _fp8.check_level(level.name, fp8, fp32=is_fp32_level(level.name))
    if recipe is not None:
        # a module the level keeps fp32 (keep_fp32, norm layers) stays out of fp8 too
        kept = [
            k for m in model_list for k in kept_fp32_modules(m, level.keep_norm_fp32, keep_fp32=level.keep_fp32)
        ] if level.cast_model_type is not None else []
        plan.fp8_plan = _fp8.plan(recipe, model_list, skip=kept)
    return plan


def _check_optimizers(opt_list: list[torch.optim.Optimizer], level: OptLevel, fresh: bool) -> None:
    """Refuse optimizers this level cannot take over as they are."""
    for opt in opt_list:
        if not fresh and is_managed(opt):
            raise AmpError(
                f"this {type(opt).__name__} is already set up in the current session; with "
                "fresh=False pass only optimizers not set up yet."
            )
        if masters_of(opt) is not None and not level.master_weights:
            where = "keeps the model in fp32" if level.cast_model_type is None else "has none"
            raise AmpError(
                "this optimizer holds fp32 master weights from an earlier O2 initialize, "
                f"but {level.name} {where}; build a fresh optimizer."
            )
        if level.compensation is not None and isinstance(opt, torch.optim.LBFGS):
            raise AmpError(
                "LBFGS mixes all parameters in one update and calls a closure many times "
                f"per step; {level.name}'s compensated updates need a per-parameter optimizer."
            )
    _check_fp16_adam_state(level, opt_list)


def _check_fsdp_optimizers(model_list: list[nn.Module], opt_list: list[torch.optim.Optimizer]) -> None:
    """Refuse an optimizer that holds none of an FSDP2 model's parameters: built before
    ``fully_shard``, which replaced them with sharded ones, it would step tensors the model
    no longer uses, and the model would never train."""
    params = {id(p) for m in model_list for p in m.parameters()}
    for opt in opt_list:
        held = [p for g in opt.param_groups for p in g["params"]]
        if held and not any(id(p) in params for p in held):
            raise DistributedError(
                f"this {type(opt).__name__} holds none of the sharded model's parameters: it was built "
                "before fully_shard, which replaced them with DTensor shards. Build the optimizer after "
                "fully_shard, on model.parameters()."
            )


def _check_sharded(model_list: list[nn.Module], opt_list: list[torch.optim.Optimizer], level: OptLevel) -> Any:
    """Validate a cast level on models :func:`ampkit.distributed.fully_shard` sharded for
    it (before anything is changed); returns the shard plan."""
    if len(model_list) != 1:
        raise AmpError("initialize takes one FSDP2 model at a time (one call per sharded model).")
    plan = sharding.check_plan(model_list[0], level)
    if level.compensation is not None:
        # each rank steps its local shards with the one-pass update; the generic path (the
        # optimizer on fp32 copies) and stochastic rounding's per-rank draws are not sharded
        if level.compensation != "kahan":
            raise DistributedError(
                f"compensation={level.compensation!r} is not supported under FSDP2: each rank would draw "
                "its own random numbers for its shard. Use the default compensation='kahan'."
            )
        for opt in opt_list:
            for group in opt.param_groups:
                if one_pass.rule_for(opt, group) is None:
                    raise DistributedError(
                        f"O2K under FSDP2 steps torch.optim.Adam, AdamW and SGD (plain numbers as "
                        f"hyperparameters, no amsgrad) on each rank's shards; this {type(opt).__name__} "
                        "param group is none of those. Use one of them, or O2 (fp32 shards as masters), "
                        "which steps any optimizer."
                    )
    return plan
