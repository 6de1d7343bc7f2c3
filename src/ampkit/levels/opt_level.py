"""The opt levels as data: :class:`OptLevel` (what ``initialize`` sets up, after
overrides), the base settings of each level (:data:`OPT_LEVELS`, one
:class:`LevelDefaults` each, named as the fields of :class:`OptLevel`), and
:func:`resolve_opt_level`, which checks every override before anything is set up. What
each level does: docs/guides/opt-levels.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

from ampkit._internal.dtypes import LOW_PRECISION, default_dtype
from ampkit._internal.env import level_from_env
from ampkit._internal.validate import require_choice
from ampkit.errors import AmpError, ScalerError
from ampkit.scaling.loss_scaler import check_scale

from .master import MASTER_GRADS, MODEL_GRADS
from .precision_plan import PlanError, TunePlan

__all__ = [
    "DEFAULT_LEVEL", "LevelDefaults", "LossScale", "OPT_LEVELS", "OVERRIDES", "OptLevel", "check_override_names",
    "checked_plan", "defaults_of", "is_fp32_level", "level_choices", "level_name", "level_names", "level_or_env", "resolve_opt_level",
]  # fmt: skip

LossScale = float | Literal["dynamic"]


@dataclasses.dataclass(frozen=True)
class OptLevel:
    """What an opt level sets up, after overrides.

    Attributes:
        name: ``"O0"`` ... ``"O3"``, ``"O2K"``.
        dtype: compute dtype of casting and of the 16-bit weights.
        op_casting: turn on op-level casting (``ampkit.init``) in ``dtype``.
        model_op_casting: run the cast model's forward under op-level casting in
            ``dtype`` (the policy's fp32 ops in fp32 inside the model; O2, O2K).
        cast_model_type: dtype the model's weights are stored in (None: left fp32).
        keep_norm_fp32: keep normalization layers in fp32 when casting the model.
        master_weights: step fp32 master copies of the 16-bit weights.
        compensation: ``"kahan"``/``"stochastic"`` updates of bf16 weights, or None.
        loss_scale: ``"dynamic"`` or a static scale.
        num_losses: loss scalers per optimizer (one per ``loss_id``).
        min_loss_scale / max_loss_scale: floor and cap of a dynamic scale (None:
            the :class:`ampkit.LossScaler` defaults, 1 and 2**24).
        cast_model_outputs: dtype a cast model's 16-bit outputs are cast to
            (default fp32; None keeps them 16-bit).
        fast_kernels: step param groups left at ``foreach=None, fused=None`` with
            torch's fused (else foreach) kernel (see ``fast_kernels`` of :func:`ampkit.init_trainer`);
            default True except at O0, which runs the script's fp32 bit for bit.
        model_grads: ``"copy"`` or ``"view"``: how a model with fp32 masters shows
            its grads (see :class:`ampkit.levels.master.MasterWeights`).
        master_grads: ``"on_demand"`` or ``"always"``: when a master's fp32 grad is
            made (see :class:`ampkit.levels.master.MasterWeights`).
        keep_fp32: module classes and qualified-name globs kept in fp32 like norm
            layers in a cast model (O2/O3/O2K), each with its whole subtree.
    """

    name: str
    dtype: torch.dtype
    op_casting: bool
    cast_model_type: torch.dtype | None
    keep_norm_fp32: bool
    master_weights: bool
    compensation: str | None
    loss_scale: LossScale
    num_losses: int = 1
    min_loss_scale: float | None = None
    max_loss_scale: float | None = None
    cast_model_outputs: torch.dtype | None = torch.float32
    fast_kernels: bool = True
    keep_fp32: tuple[type[nn.Module] | str, ...] = ()
    model_op_casting: bool = False
    model_grads: str = "copy"
    master_grads: str = "on_demand"


@dataclasses.dataclass(frozen=True)
class LevelDefaults:
    """The base settings of one level, named as :class:`OptLevel`'s fields; ``dtype``
    and the loss scale are filled per device by :func:`resolve_opt_level`. Every entry
    point (``initialize``, ``fully_shard``, the framework integrations, tuning plans,
    ``ampkit run``, ``ampkit warmup``) asks these, never a level's name.

    Attributes:
        description: what the level is, in a few words (listed where a level is refused).
        op_casting: op-level casting (``ampkit.init``) on.
        casts_model: the weights are stored in the compute dtype (``cast_model_type``);
            such a level honours ``keep_fp32``.
        keep_norm_fp32: normalization layers stay fp32 in the cast model.
        master_weights: fp32 master copies are stepped.
        compensation: ``"kahan"`` compensated bf16 updates, or None.
        fp16_loss_scale: the loss scale when the compute dtype is float16 (bf16: 1).
        model_op_casting: the cast model's forward runs under op-level casting (the
            policy's fp32 ops in fp32 inside the model).
        bf16_only: the level computes in bf16 on every device (its default dtype; an
            entry point given fp16 by name refuses it).
    """

    description: str
    op_casting: bool
    casts_model: bool
    keep_norm_fp32: bool
    master_weights: bool
    compensation: str | None
    fp16_loss_scale: LossScale
    model_op_casting: bool = False
    bf16_only: bool = False

    @property
    def fp32(self) -> bool:
        """Nothing in 16 bits (no op-level casting, no cast model): the script's fp32 as
        written, with no compute dtype, no fp8 and the optimizer's own kernel."""
        return not (self.op_casting or self.casts_model)

    @property
    def mixed(self) -> bool:
        """Ops run under a casting policy, fp32 where it says: a policy and a tuning
        plan apply, ``ampkit run`` and the tuner use the level (Lightning: ``-mixed``;
        a cast model without it is pure 16-bit, ``-true``)."""
        return self.op_casting or self.model_op_casting

    @property
    def steps_compiled(self) -> bool:
        """The step runs ampkit's compiled update kernels (fp32 masters or compensation)."""
        return self.master_weights or self.compensation is not None


#: The base settings of each level; a level added here is one every entry point takes.
OPT_LEVELS: dict[str, LevelDefaults] = {
    "O0": LevelDefaults("fp32 with inf/NaN steps skipped", op_casting=False, casts_model=False, keep_norm_fp32=False, master_weights=False, compensation=None, fp16_loss_scale=1.0),
    "O1": LevelDefaults("op-level casting, fp32 weights", op_casting=True, casts_model=False, keep_norm_fp32=False, master_weights=False, compensation=None, fp16_loss_scale="dynamic"),
    "O2": LevelDefaults("16-bit model with fp32 masters", op_casting=False, casts_model=True, keep_norm_fp32=True, master_weights=True, compensation=None, fp16_loss_scale="dynamic", model_op_casting=True),
    "O3": LevelDefaults("pure 16-bit", op_casting=False, casts_model=True, keep_norm_fp32=False, master_weights=False, compensation=None, fp16_loss_scale=1.0),
    "O2K": LevelDefaults("bf16 model with compensated updates", op_casting=False, casts_model=True, keep_norm_fp32=True, master_weights=False, compensation="kahan", fp16_loss_scale=1.0, model_op_casting=True, bf16_only=True),
}  # fmt: skip

#: The level when none is given and ``AMPKIT_LEVEL`` is unset.
DEFAULT_LEVEL = "O1"


def level_names(which: Callable[[LevelDefaults], bool] = lambda d: True) -> tuple[str, ...]:
    """The names of the levels (of those ``which`` accepts), in :data:`OPT_LEVELS`' order."""
    return tuple(name for name, d in OPT_LEVELS.items() if which(d))


def level_choices(names: Iterable[str] | None = None) -> str:
    """``"O0 (fp32 ...), O1 (...), ..."``: the levels (or ``names``) with what each is."""
    return ", ".join(f"{n} ({OPT_LEVELS[n].description})" for n in (level_names() if names is None else names))


def defaults_of(value: Any) -> LevelDefaults | None:
    """The :class:`LevelDefaults` of the level ``value`` names (any case), None if none."""
    return OPT_LEVELS.get(value.upper()) if isinstance(value, str) else None


def is_fp32_level(value: Any) -> bool:
    """Whether ``value`` names a level that computes nothing in 16 bits (False for a
    name that is no level: that is refused where the level is resolved)."""
    base = defaults_of(value)
    return base is not None and base.fp32


def level_name(value: Any, what: str = "opt_level", error: type[AmpError] = AmpError) -> str:
    """``value`` as the name of a level (upper case); ``error`` naming every level
    otherwise."""
    if isinstance(value, str) and value.upper() in OPT_LEVELS:
        return value.upper()
    raise error(f"unknown {what} {value!r}: not an ampkit opt level; choose one of {level_choices()}.")


def checked_plan(plan: Any, owner: str = "plan") -> TunePlan:
    """``plan`` (an :class:`ampkit.TunePlan`, or the path of a saved one) with its level
    checked: :class:`PlanError` unless it is a level whose ops run under a casting policy
    (which pins the kept modules) lowering some modules, in bf16 where the level is
    bf16-only, or an fp32 level lowering none."""
    plan = TunePlan.coerce(plan, owner)
    base = OPT_LEVELS.get(plan.level)
    if base is None or not (base.fp32 or base.mixed) or base.fp32 == bool(plan.lowered) or (
        base.bf16_only and plan.dtype != "bf16"
    ):
        raise PlanError(
            f"tuning plan: level {plan.level!r} with {len(plan.lowered)} modules lowered in {plan.dtype}; "
            f"{'/'.join(level_names(lambda d: d.fp32))} lowers nothing, "
            f"{'/'.join(level_names(lambda d: d.mixed))} lower some, "
            f"{'/'.join(level_names(lambda d: d.mixed and d.bf16_only))} in bf16 only."
        )
    return plan


def level_or_env(value: str | None) -> str:
    """``value``, else ``AMPKIT_LEVEL`` if set, else :data:`DEFAULT_LEVEL` (an argument >
    the environment > the default); the level is not checked here."""
    return level_from_env(DEFAULT_LEVEL, level_names()) if value is None else value


#: The settings ``initialize`` takes beyond the level, in the order of its signature (a
#: test holds its keyword parameters to this list).
OVERRIDES = (
    "dtype",
    "cast_model_type",
    "keep_norm_fp32",
    "master_weights",
    "compensation",
    "op_casting",
    "policy",
    "loss_scale",
    "num_losses",
    "min_loss_scale",
    "max_loss_scale",
    "cast_model_outputs",
    "model_op_casting",
    "keep_fp32",
    "fast_kernels",
    "model_grads",
    "master_grads",
)

_COMPENSATIONS = ("kahan", "stochastic")


def _check_dtype(value: Any, what: str) -> torch.dtype:
    if value not in LOW_PRECISION:
        raise AmpError(f"{what} must be torch.float16 or torch.bfloat16, got {value!r}.")
    return value


def check_override_names(names: Iterable[str]) -> None:
    """Raise :class:`AmpError` naming those of ``names`` that are no setting of
    ``initialize``, with the list of valid ones."""
    unknown = sorted(set(names) - set(OVERRIDES))
    if unknown:
        raise AmpError(f"initialize got unknown option(s) {unknown}; valid: {list(OVERRIDES)}.")


def resolve_opt_level(
    opt_level: str, device_type: str = "cpu", **overrides: Any
) -> OptLevel:
    """The :class:`OptLevel` that ``initialize(..., opt_level, **overrides)`` sets up
    for models on ``device_type``; raises :class:`AmpError` on nonsense (nothing is set
    up here)."""
    name = level_name(opt_level)
    check_override_names(overrides)
    base = OPT_LEVELS[name]
    ov = {k: v for k, v in overrides.items() if v is not None}
    for flag in ("keep_norm_fp32", "master_weights", "op_casting", "fast_kernels", "model_op_casting"):
        if flag in ov and not isinstance(ov[flag], bool):
            raise AmpError(f"{flag} must be True or False, got {ov[flag]!r}.")
    storage = _storage(name, base, ov, device_type)
    dtype, cast, master = storage["dtype"], storage["cast_model_type"], storage["master_weights"]
    # None is meaningful here: keep a cast model's outputs 16-bit.
    outputs = overrides.get("cast_model_outputs", torch.float32)
    if outputs is not None and outputs not in (torch.float32, *LOW_PRECISION):
        raise AmpError(f"cast_model_outputs must be a float dtype or None, got {outputs!r}.")
    model_op_casting = ov.get("model_op_casting", cast is not None and base.model_op_casting)
    if model_op_casting and cast is None:
        raise AmpError(
            f"model_op_casting runs a cast model's forward under op-level casting; {name} "
            "keeps the model in fp32 (use op_casting=True, or O1)."
        )
    return OptLevel(
        name=name,
        op_casting=bool(ov.get("op_casting", base.op_casting)),
        **storage,
        **_scaling(base, ov, dtype),
        cast_model_outputs=outputs,
        # an fp32 level runs the script exactly as written: the optimizer's kernel too
        fast_kernels=ov.get("fast_kernels", not base.fp32),
        keep_fp32=_check_keep_fp32(ov.get("keep_fp32", ()), name, cast),
        model_op_casting=bool(model_op_casting),
        **_grads(name, ov, cast, master),
    )


def _storage(name: str, base: LevelDefaults, ov: dict[str, Any], device_type: str) -> dict[str, Any]:
    """How the weights are stored and stepped: ``dtype``, ``cast_model_type``,
    ``keep_norm_fp32``, ``compensation``, ``master_weights``."""
    default = torch.bfloat16 if base.bf16_only else default_dtype(device_type)
    dtype = _check_dtype(ov.get("dtype", default), "dtype")
    cast = ov.get("cast_model_type", dtype if base.casts_model else None)
    if cast is False or cast == torch.float32:
        cast = None
    if cast is not None:
        cast = _check_dtype(cast, "cast_model_type")
    keep_norm = ov.get("keep_norm_fp32", base.keep_norm_fp32 if cast is not None else False)
    if "keep_norm_fp32" in ov and cast is None:
        raise AmpError(
            f"keep_norm_fp32 only applies when the model is cast to 16 bits; {name} keeps "
            "the whole model in fp32. Drop the option or use O2/O3."
        )
    compensation = ov.get("compensation", base.compensation if cast is not None else None)
    if compensation is False:
        compensation = None
    if compensation is not None:
        if compensation not in _COMPENSATIONS:
            raise AmpError(f"compensation must be one of {_COMPENSATIONS} or None, got {compensation!r}.")
        if cast is not torch.bfloat16:
            raise AmpError(
                f"compensated updates need bf16 weights, but {name} stores the model in "
                f"{cast}; use dtype=torch.bfloat16, or master weights (O2) for fp16."
            )
    master = bool(ov.get("master_weights", base.master_weights and compensation is None))
    if master and cast is None:
        raise AmpError(
            f"master_weights=True needs a 16-bit model, but {name} keeps the model in "
            "fp32 (its weights are already the masters); use O2 or set cast_model_type."
        )
    if master and compensation is not None:
        raise AmpError(
            "master_weights and compensation both keep updates from being rounded away; "
            "choose one (O2: fp32 masters, O2K: compensated bf16 weights)."
        )
    return dict(dtype=dtype, cast_model_type=cast, keep_norm_fp32=bool(keep_norm),
                compensation=compensation, master_weights=master)


def _scaling(base: LevelDefaults, ov: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The loss scaling: ``loss_scale``, ``min_loss_scale``, ``max_loss_scale``,
    ``num_losses``."""
    loss_scale = ov.get("loss_scale", base.fp16_loss_scale if dtype == torch.float16 else 1.0)
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ScalerError(f"loss_scale must be 'dynamic' or a number > 0, got {loss_scale!r}.")
    else:
        loss_scale = check_scale(loss_scale, "loss_scale")
    min_s, max_s = ov.get("min_loss_scale"), ov.get("max_loss_scale")
    if min_s is not None:
        min_s = check_scale(min_s, "min_loss_scale")
    if max_s is not None:
        max_s = check_scale(max_s, "max_loss_scale", allow_inf=True)
    if loss_scale != "dynamic" and (min_s is not None or max_s is not None):
        raise AmpError(
            f"min_loss_scale/max_loss_scale bound a dynamic scale, but the loss scale is a "
            f"static {loss_scale}; pass loss_scale='dynamic' or drop the bounds."
        )
    if min_s is not None and max_s is not None and min_s > max_s:
        raise AmpError(f"min_loss_scale {min_s} is above max_loss_scale {max_s}.")
    num_losses = ov.get("num_losses", 1)
    if not isinstance(num_losses, int) or isinstance(num_losses, bool) or num_losses < 1:
        raise AmpError(f"num_losses must be an int >= 1, got {num_losses!r}.")
    return dict(loss_scale=loss_scale, min_loss_scale=min_s, max_loss_scale=max_s, num_losses=num_losses)


def _grads(name: str, ov: dict[str, Any], cast: torch.dtype | None, master: bool) -> dict[str, Any]:
    """How a model with fp32 masters shows its grads: ``model_grads``, ``master_grads``."""
    model_grads = ov.get("model_grads", "copy")
    require_choice(model_grads, MODEL_GRADS, "model_grads")
    if model_grads != "copy" and not master:
        raise AmpError(
            f"model_grads={model_grads!r} sets how a 16-bit model shows the grads of its fp32 "
            f"master weights; {name} has no master weights (use O2)."
        )
    if model_grads == "view" and cast is not torch.bfloat16:
        raise AmpError(
            f"model_grads='view' shows each grad as the high half of its fp32 grad, which "
            f"is a bf16 number; the model is stored in {cast}. Use dtype=torch.bfloat16, "
            "or model_grads='copy'."
        )
    # views of the fp32 grads need the fp32 grads
    master_grads = ov.get("master_grads", "always" if model_grads == "view" else "on_demand")
    require_choice(master_grads, MASTER_GRADS, "master_grads")
    if model_grads == "view" and master_grads != "always":
        raise AmpError(
            "model_grads='view' shows each grad as a view of its fp32 grad, which "
            "master_grads='on_demand' does not make until needed: use one of the two."
        )
    if "master_grads" in ov and not master:
        raise AmpError(
            f"master_grads={master_grads!r} sets when the fp32 grads of master weights are "
            f"made; {name} has no master weights (use O2)."
        )
    return dict(model_grads=model_grads, master_grads=master_grads)


def _check_keep_fp32(value: Any, name: str, cast: torch.dtype | None) -> tuple[type[nn.Module] | str, ...]:
    """``keep_fp32``: a module class, a qualified-name glob, or a list/tuple of them."""
    rules = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    for rule in rules:
        if not (isinstance(rule, str) or (isinstance(rule, type) and issubclass(rule, nn.Module))):
            raise AmpError(
                f"keep_fp32 takes nn.Module subclasses and module-name globs (e.g. "
                f"[MyLayerNorm, 'blocks.*.ln_1']), got {rule!r}."
            )
    if rules and cast is None:
        raise AmpError(
            f"keep_fp32 keeps modules fp32 in a model cast to 16 bits; {name} keeps the "
            "whole model in fp32. Drop the option or use O2/O3/O2K."
        )
    return rules
