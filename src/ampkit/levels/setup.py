"""Opt levels: apex-style one-call setup of casting, model dtype, master weights
and loss scaling, on top of ampkit's scoped pieces.

- ``O0``: fp32 weights, no casting, the optimizer steps the fp32 weights; scale 1.
- ``O1``: fp32 weights, op-level casting (``ampkit.init``) in the compute dtype;
  dynamic scale [*].
- ``O2``: weights in the compute dtype except normalization layers (fp32); the
  optimizer steps fp32 master copies; dynamic scale [*].
- ``O3``: every weight in the compute dtype, norm layers too; the optimizer steps
  the 16-bit weights; scale 1.
- ``O2K``: bf16 weights except norm layers (fp32), no master copy; the optimizer's
  updates are applied with Kahan compensation (``compensation="stochastic"`` for
  stochastic rounding), see :class:`ampkit.CompensatedUpdates`; scale 1. Always bf16.

[*] with ``dtype=torch.float16``. bf16 has fp32's exponent range, so gradients do
not underflow and the default scale is a static 1 for every level when the compute
dtype is bf16 (the default on CPU); pass ``loss_scale="dynamic"`` to get apex's
behaviour anyway. Every level, static scale included, skips a step whose gradients
are not finite (``ampkit.step_skipped``).

``initialize`` starts afresh: like :func:`ampkit.reset` it ends the previous AMP
session and any process-wide casting, then sets up the chosen level. Models are
cast in place and get input/output cast hooks (:func:`ampkit.cast_model`), never a new
``forward``, so they can be wrapped by ``DistributedDataParallel`` afterwards.
"""

from __future__ import annotations

import inspect
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NoReturn

import torch
from torch import nn

from ampkit._internal import registry as _reset
from ampkit._internal.dtypes import (
    LOW_PRECISION,
    cast_optimizer_state,
)
from ampkit._internal.validate import require_optimizer
from ampkit.casting import engine as casting
from ampkit.casting.policy import Policy
from ampkit.errors import AmpError, StateError
from ampkit.scaling.loss_scaler import LossScaler
from ampkit.trainer import api as optim
from ampkit.trainer.extensions import StepExtension
from ampkit.trainer.grad_hooks import drop_guards, no_masters_guard
from ampkit.trainer.managed import resolve_optimizer

from . import fp8 as _fp8
from . import one_pass
from . import update_kernels as _update_kernels
from .compensated import CompensatedUpdates
from .fp8 import Fp8Recipe
from .fp8.recipe import for_modules
from .grad_mirror import ON_DEMAND_DEVICES
from .master import MasterWeights
from .master_step import MasterStep
from .model_cast import (
    add_fp32_scope,
    add_op_casting,
    cast_model,
    params_to_cast,
    remove_op_casting,
)
from .opt_level import (
    OPT_LEVELS,
    OVERRIDES,
    OptLevel,
    checked_plan,
    defaults_of,
    resolve_opt_level,
)
from .plan import CAST_MODELS, MASTERS_ATTR, Plan, is_managed, make_plan, masters_of
from .precision_plan import PlanError, TunePlan

__all__ = ["OptLevel", "OPT_LEVELS", "initialize", "is_managed", "master_params", "resolve_opt_level"]

# --- objects that outlive a session: they describe how an optimizer was rebuilt -------

# Compensation hooks belong to a session: removed on reset / re-initialize.
_COMPENSATED: weakref.WeakKeyDictionary[torch.optim.Optimizer, CompensatedUpdates] = (
    weakref.WeakKeyDictionary()
)


_reset.on_reset(drop_guards)

# Session state: the level the last initialize set up (empty after a reset).
_APPLIED: list[OptLevel] = []
_reset.on_reset(_APPLIED.clear)


def applied_level() -> OptLevel | None:
    """The :class:`OptLevel` (after overrides and plans) that the last :func:`initialize`
    of the current session set up; None when none has since the last ``ampkit.reset``."""
    return _APPLIED[-1] if _APPLIED else None


@_reset.on_reset
def _drop_compensation() -> None:
    for comp in list(_COMPENSATED.values()):
        comp.remove()
    _COMPENSATED.clear()


# Load-state-dict hooks that resync masters from a model loaded after initialize (O2).
# module -> (its load-state-dict post-hook handle, the masters to resync, held weakly so
# the model does not keep optimizers alive).
_LOAD_HOOKS: weakref.WeakKeyDictionary[nn.Module, tuple[Any, list[weakref.ref]]] = (
    weakref.WeakKeyDictionary()
)


@_reset.on_reset
def _drop_load_hooks() -> None:
    for handle, _ in list(_LOAD_HOOKS.values()):
        handle.remove()
    _LOAD_HOOKS.clear()


class ResyncMasters:
    """Load-state-dict post-hook of an O2 model's modules: re-derive the masters of the
    module's own parameters from the loaded 16-bit weights. Stateless (what to resync
    is looked up by module), so the model pickles and deep-copies; a copy resyncs
    nothing."""

    def __call__(self, module: nn.Module, incompatible_keys: Any) -> None:
        entry = _LOAD_HOOKS.get(module)
        if entry is None:
            return
        own = list(module.parameters(recurse=False))
        for ref in entry[1]:
            mw = ref()
            if mw is not None:
                mw.sync_from_model(own)


def _watch_model_loads(model: nn.Module, masters: list[MasterWeights]) -> None:
    """After ``module.load_state_dict`` on any module of ``model``, re-derive the masters
    of that module's own parameters from the loaded 16-bit weights; otherwise the next
    step would publish the old masters over the loaded weights."""
    refs = [weakref.ref(mw) for mw in masters]
    for module in model.modules():
        old = _LOAD_HOOKS.pop(module, None)
        if old is not None:
            old[0].remove()
        if any(p.is_floating_point() for p in module.parameters(recurse=False)):
            handle = module.register_load_state_dict_post_hook(ResyncMasters())
            _LOAD_HOOKS[module] = (handle, refs)


def initialize(
    models: nn.Module | Sequence[nn.Module],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    opt_level: str | None = None,
    *,
    device_type: str | None = None,
    fp8: Fp8Recipe | bool | None = None,
    fresh: bool = True,
    plan: TunePlan | str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    cast_model_type: torch.dtype | Literal[False] | None = None,
    keep_norm_fp32: bool | None = None,
    master_weights: bool | None = None,
    compensation: Literal["kahan", "stochastic", False] | None = None,
    op_casting: bool | None = None,
    policy: Policy | None = None,
    loss_scale: float | Literal["dynamic"] | None = None,
    num_losses: int | None = None,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = None,
    cast_model_outputs: torch.dtype | None = torch.float32,
    model_op_casting: bool | None = None,
    keep_fp32: type[nn.Module] | str | list[type[nn.Module] | str] | tuple[type[nn.Module] | str, ...] | None = None,
    fast_kernels: bool | None = None,
    model_grads: Literal["copy", "view"] | None = None,
    master_grads: Literal["on_demand", "always"] | None = None,
    **unknown: NoReturn,
) -> tuple[Any, Any]:
    """Set up mixed precision for ``models`` and ``optimizers`` at ``opt_level``.

    The settings after ``plan`` change one thing of the level each; left at None (their
    default, ``cast_model_outputs`` aside) they take the level's own value, stated with each.

    Args:
        models: an ``nn.Module`` or a list of them, in fp32, already on their device.
        optimizers: a ``torch.optim.Optimizer``, a list of them, or None (inference). A
            framework's wrapper (Accelerate's ``AcceleratedOptimizer``, Lightning's
            ``LightningOptimizer``) stands for the optimizer it holds, which is set up.
        opt_level: ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"`` or ``"O2K"``; see the table in
            :mod:`ampkit.levels`. Default None: the ``AMPKIT_LEVEL`` environment
            variable if set, else ``"O1"``.
        device_type: ``"cpu"``, ``"cuda"``, ...: the device type the models are on,
            which sets the default ``dtype`` and where op-level casting applies.
            Default None: taken from the models' tensors (models without any: the
            default device type, ``"cuda"`` if available else ``"cpu"``). Given for
            models with tensors, it must name the type they are on (initialize does
            not move models).
        fp8: an :class:`ampkit.Fp8Recipe` (or True for the default one): the linears
            it chooses compute their matmuls in fp8 (e4m3 forward, e5m2 or e4m3
            gradients, through ``torch._scaled_mm``); everything else, weights and
            optimizer included, runs as ``opt_level`` says (any level but O0). Scales
            and abs-max histories are saved by :func:`ampkit.state_dict`. See
            :mod:`ampkit.fp8`. Default None: no fp8.
        fresh (bool): end the previous AMP session first, like
            :func:`ampkit.reset`. False adds these models and optimizers to the current
            session instead: the ones set up before keep training, each optimizer with
            its own scalers, masters and counters, and :func:`ampkit.state_dict` holds
            them all (apex's ``amp.initialize`` called again for a restored
            model/optimizer pair). Process-wide op-level casting (O1) is then set to this
            call's policy. ``fresh=False`` takes no ``fp8``. Default: ``True``.
        plan (ampkit.TunePlan | str | os.PathLike | None): a plan from
            :func:`ampkit.tune` (or a saved one's path): its level and dtype as defaults,
            its kept modules fp32 (module rules; ``keep_fp32`` at O2/O3/O2K), its fp8
            linears converted (with ``fp8``'s recipe if one is given, which must not have a
            ``module_filter``; ``fp8=False`` runs them in the plan's 16-bit dtype), name
            rules relative to these models until :func:`ampkit.reset` (docs: tuning
            guide). Default: ``None``.
        dtype (torch.dtype | None): the compute dtype, ``torch.bfloat16`` or
            ``torch.float16``. None: the ``AMPKIT_DTYPE`` environment variable
            (``bf16``/``fp16``) if set, else bf16 at O2K and on CPU, fp16 on CUDA.
            Default: ``None``.
        cast_model_type (torch.dtype | False | None): the dtype the model's weights are
            stored in, 16-bit, or ``False``/``torch.float32`` for fp32 (not cast). None:
            ``dtype`` at O2/O3/O2K, fp32 at O0/O1. Default: ``None``.
        keep_norm_fp32 (bool | None): keep normalization layers fp32 in a cast model
            (raises for a model kept fp32). None: True at O2/O2K, False at O3. Default: ``None``.
        master_weights (bool | None): step fp32 master copies of a 16-bit model's
            weights. None: True at O2 (without ``compensation``), else False. Default: ``None``.
        compensation (str | False | None): ``"kahan"`` or ``"stochastic"`` updates of
            bf16 weights (:class:`ampkit.CompensatedUpdates`); ``False``: none. None:
            ``"kahan"`` at O2K, else none. Default: ``None``.
        op_casting (bool | None): op-level casting process-wide (``ampkit.init``;
            apex's ``patch_torch_functions``). None: True at O1, else False. Default: ``None``.
        policy (ampkit.Policy | None): what op-level casting does (``op_casting`` or
            ``model_op_casting``; raises where neither is on). None: the default
            :class:`ampkit.Policy` of the device. Inside a cast model (O2, O2K) its
            module rules' name globs are relative to the models given; a rule pinning
            fp32 a module whose weights the level casts is refused (keep that module
            with ``keep_fp32``). Default: ``None``.
        loss_scale (float | str | None): ``"dynamic"`` or a static scale > 0. None: with
            fp16, ``"dynamic"`` at O1/O2 and 1.0 at O0/O3/O2K; with bf16, 1.0 at every
            level. Default: ``None``.
        num_losses (int | None): loss scalers per optimizer, one per ``loss_id``. None: 1.
            Default: ``None``.
        min_loss_scale (float | None): the floor of a dynamic scale (raises with a static
            one). None: :class:`ampkit.LossScaler`'s, 1. Default: ``None``.
        max_loss_scale (float | None): the cap of a dynamic scale, ``math.inf`` allowed
            (raises with a static one). None: :class:`ampkit.LossScaler`'s, 2**24.
            Default: ``None``.
        cast_model_outputs (torch.dtype | None): the dtype a cast model's floating-point
            outputs are cast to; None keeps them in the model's 16-bit dtype (here None
            is a value, not the level's default). Default: ``torch.float32``.
        model_op_casting (bool | None): run the cast model's forward under op-level
            casting in ``dtype``: the policy's fp32 ops (softmax, norms, a loss computed
            in ``forward``) run in fp32 inside the model; ``policy`` applies here too.
            None: True at O2/O2K with a cast model, else False (True raises for a model
            kept fp32).
            Default: ``None``.
        keep_fp32 (type[nn.Module] | str | list | tuple | None): module classes or
            qualified-name globs kept in fp32 like norm layers (O2/O3/O2K), e.g.
            ``[MyLayerNorm, "blocks.*.attn"]``, each with its whole subtree (weights
            fp32, matmuls in fp32); a glob matching no module name raises
            :class:`AmpError`. With ``keep_norm_fp32`` (O2/O2K) hand-written norm layers
            are found without it: a class named ``*Norm*`` holding only vector
            parameters. None: none beyond the norm layers. Default: ``None``.
        fast_kernels (bool | None): step with torch's fused (else foreach) kernel where
            the optimizer was built with neither pinned. None: True, False at O0 (fp32
            exactly as the script runs it). Default: ``None``.
        model_grads (str | None): ``"copy"`` or ``"view"`` (bf16): how a 16-bit model
            shows its grads under fp32 masters (O2;
            :class:`ampkit.levels.master.MasterWeights`). None: ``"copy"``. Default: ``None``.
        master_grads (str | None): ``"on_demand"`` or ``"always"``: when the masters'
            fp32 grads are made (O2). None: ``"on_demand"``, ``"always"`` with
            ``model_grads="view"``. Default: ``None``.
        **unknown: takes no value: a keyword not named above raises :class:`AmpError`
            listing the valid ones (and a type checker reports it, ``NoReturn`` admitting
            no value), so a misspelt setting never passes silently.

    Returns:
        ``(models, optimizers)`` in the shape given (one object or a list;
        ``optimizers`` is None when None was passed). The objects are the ones passed
        in, modified in place: weights cast, masters swapped into ``param_groups``,
        each optimizer registered with :func:`ampkit.init_trainer`.

    Raises:
        AmpError: unknown level or option, a combination that makes no sense
            (e.g. ``master_weights=True`` with O1), a value of the wrong type or out of
            range (``loss_scale=True``, a scale whose reciprocal overflows fp32), models
            not in fp32, a ``device_type`` other than the models'. Every argument is checked before anything changes: a refused
            call leaves the models, the optimizers and the previous session as they were.
    """
    given = locals()
    if unknown:  # every keyword initialize takes is named, not only the level's settings
        keywords = [n for n in inspect.signature(initialize).parameters if n not in ("models", "optimizers", "unknown")]
        raise AmpError(f"initialize got unknown option(s) {sorted(unknown)}; valid: {keywords}.")
    # None takes the level's value, except for cast_model_outputs, where it is a value.
    overrides = {
        name: given[name] for name in OVERRIDES if given[name] is not None or name == "cast_model_outputs"
    }
    # Everything is validated before anything changes: a refused initialize leaves the
    # models, the optimizers and the previous session as they were.
    if plan is not None:
        opt_level, fp8, overrides = _with_tune_plan(plan, models, opt_level, fp8, overrides)
    checked = make_plan(models, optimizers, opt_level, device_type, fp8, fresh, overrides)
    _apply(checked, named_by_models=plan is not None)
    out_models: Any = checked.models[0] if checked.one_model else checked.models
    out_opts: Any = None if optimizers is None else (optimizers if checked.one_opt else list(optimizers))
    return out_models, out_opts


def _with_tune_plan(
    plan: TunePlan | str | os.PathLike[str],
    models: nn.Module | Sequence[nn.Module],
    opt_level: str | None,
    fp8: Fp8Recipe | bool | None,
    overrides: dict[str, Any],
) -> tuple[str, Fp8Recipe | bool | None, dict[str, Any]]:
    """``initialize``'s level, fp8 recipe and overrides with a tuning plan applied
    (nothing changed yet): the plan's fp8 linears through ``fp8`` (None or True: the
    default recipe; a recipe: its format and scaling; False: none, they run in the
    plan's 16-bit dtype)."""
    plan = checked_plan(plan, "initialize(plan=...)")
    model_list = [models] if isinstance(models, nn.Module) else list(models)
    plan.check_model(model_list)
    level = plan.level if opt_level is None else opt_level
    out = dict(overrides)
    base = defaults_of(level)  # (None: an unknown level, refused later)
    if plan.lowered and base is not None:
        out["dtype"] = plan.compute_dtype(out.get("dtype"))
        if out.get("op_casting", base.op_casting) or (base.model_op_casting and out.get("model_op_casting", True)):
            out["policy"] = plan.policy(base=out.get("policy"))  # (else the caller's own scope casts)
        if base.casts_model and plan.kept_fp32:
            given = out.get("keep_fp32") or []
            given = [given] if isinstance(given, (str, type)) else list(given)  # one rule, or several
            out["keep_fp32"] = [*given, *plan.keep_fp32]
    if plan.fp8 and fp8 is not False:
        fp8 = for_modules(plan.fp8, fp8, "initialize(plan=...)")
        chosen = {name for m in model_list for name, _ in fp8.choose(m)}
        missing = [name for name in plan.fp8 if name not in chosen]
        if missing:
            raise PlanError(f"initialize(plan=...): the plan runs {missing[:5]} in fp8, which fp8 cannot convert "
                            "here (not an nn.Linear, feature sizes not multiples of 16, or excluded by the "
                            "recipe passed); tune this model again, or pass fp8=False.")  # fmt: skip
    return level, fp8, out


def _apply(plan: Plan, named_by_models: bool = False) -> None:
    """Carry out a checked :class:`~.plan.Plan`: a new session, the models cast (or sharded
    ones given op-level casting), masters built, casting turned on, fp8 activated and
    the optimizers handed to the trainer."""
    level, model_list, opt_list = plan.level, plan.models, plan.optimizers
    if plan.fresh:
        _reset.reset()  # a new session: no leftovers of a previous initialize or init
    _APPLIED[:] = [level]
    masters: list[MasterWeights | None] = [masters_of(opt) for opt in opt_list]
    if plan.shard_plan is not None:
        _setup_sharded(model_list[0], plan.shard_plan, level, plan.device_type, plan.policy)
    elif level.cast_model_type is not None:
        _cast_models(plan, masters)
    if level.op_casting:
        casting.init(dtype=level.dtype, device_type=plan.device_type, policy=plan.policy)
    # a tuning plan names modules as the models do; so do a policy's name rules inside a cast
    # model, whose scope opens inside its call (else its first child would be the root)
    named = named_by_models or (level.model_op_casting and plan.policy is not None
                                and any(isinstance(k, str) for k in plan.policy.module_rules))  # fmt: skip
    for m in model_list if named else ():
        casting.module_hooks.name_rules_relative_to(m)
    if plan.fp8_plan is not None:
        _fp8.activate(plan.fp8_plan)
    if opt_list:
        _attach_trainer(opt_list, masters, level, plan.scaler, model_list)
    elif level.master_weights or level.compensation is not None:
        no_masters_guard([p for m in model_list for p in m.parameters() if p.dtype in LOW_PRECISION], level.name)
    live_masters = [mw for mw in masters if mw is not None]
    if live_masters:
        for m in model_list:
            _watch_model_loads(m, live_masters)
    if plan.fp8_plan is not None:
        from ampkit.trainer.session import register_extra_state

        fp8_plan = plan.fp8_plan
        register_extra_state("fp8", fp8_plan.state_dict, fp8_plan.load_state_dict, fp8_plan.check_state_dict)


def _cast_models(plan: Plan, masters: list[MasterWeights | None]) -> None:
    """Masters first, from the fp32 weights (exact, and what a checkpoint restores), then
    the models cast to the level's storage, with op-level casting inside where the level
    has it; the optimizers' state follows the weights where there are no masters."""
    level, model_list, opt_list = plan.level, plan.models, plan.optimizers
    if level.master_weights:
        to_cast = [
            p for m in model_list for p in params_to_cast(m, level.keep_norm_fp32, keep_fp32=level.keep_fp32)
        ]
        for i, opt in enumerate(opt_list):
            if masters[i] is None:
                mw = MasterWeights(
                    opt, [p for p in to_cast if p.dtype == torch.float32], model_grads=level.model_grads,
                    master_grads=level.master_grads,
                )
                opt.__dict__[MASTERS_ATTR] = mw
                masters[i] = mw
    for m in model_list:
        cast_model(
            m,
            level.cast_model_type,
            keep_norm_fp32=level.keep_norm_fp32,
            cast_outputs=level.cast_model_outputs,
            keep_fp32=level.keep_fp32,
        )
        if level.model_op_casting:
            add_op_casting(m, level.cast_model_type, plan.device_type, plan.policy)
        else:
            remove_op_casting(m)
        CAST_MODELS.add(m)
    if not level.master_weights:
        for opt in opt_list:
            _cast_state_to_params(opt)


def _setup_sharded(model: nn.Module, plan: Any, level: OptLevel, device_type: str, policy: Policy | None) -> None:
    """A cast level on a model :func:`ampkit.distributed.fully_shard` sharded for it
    (checked by :func:`_check_sharded`): FSDP2 already stores the weights as the level
    does (O2: fp32 shards cast to 16 bits by its ``MixedPrecisionPolicy``, the shards
    being the masters; O3/O2K: 16-bit shards, kept modules fp32), so nothing is cast or
    copied here; O2/O2K add op-level casting inside the model, with the kept modules
    computing in fp32."""
    by_name = dict(model.named_modules())
    if level.model_op_casting:
        add_op_casting(model, level.dtype, device_type, policy)
        for name in plan.kept:  # their matmuls stay fp32 too
            add_fp32_scope(by_name[name], device_type)
    else:
        remove_op_casting(model)


def _attach_trainer(
    opt_list: list[torch.optim.Optimizer],
    masters: list[MasterWeights | None],
    level: OptLevel,
    scaler: LossScaler,
    models: list[nn.Module],
) -> None:
    """One ``init_trainer`` call for all optimizers, so they share one scaler per loss
    id (apex's semantics: ``scale_loss(loss, [opt_a, opt_b])`` scales once); then the
    master-weight or compensation extension of each optimizer."""
    optim.init_trainer(
        opt_list, scaler=scaler, num_losses=level.num_losses, fast_kernels=level.fast_kernels
    )
    ahead: list[_update_kernels.AheadJob] = []
    compiling_ahead = _update_kernels.compile_ahead_enabled()  # (no jobs built when off: the default)
    for opt, mw in zip(opt_list, masters):
        managed = optim.managed_state(opt)
        if level.fast_kernels and isinstance(opt, torch.optim.Adam):  # first: around every other extension
            managed.add_extension(_FloatLrForForeach(opt))
        if mw is not None:
            managed.add_extension(MasterStep(mw, models))
            if compiling_ahead:
                ahead += _master_kernels(mw, scaler)
        if level.compensation is not None:
            comp = CompensatedUpdates(opt, level.compensation)  # type: ignore[arg-type]
            _COMPENSATED[opt] = comp
            # its buffers saved as "compensation" with the optimizer (they step inside the
            # optimizer's own step: no extension of their own)
            managed.register_extra_state("compensation", comp.state_dict, comp.load_state_dict, comp.check_state_dict)
            if compiling_ahead:
                ahead += comp.kernels_ahead()
    if ahead:
        _update_kernels.compile_ahead(ahead)


def _master_kernels(mw: MasterWeights, scaler: LossScaler) -> list[_update_kernels.AheadJob]:
    """The kernels O2's first step will compile where it steps from held 16-bit grads
    (one backward at a loss scale of 1, on ``ON_DEMAND_DEVICES``): the one-pass updates
    and, for a large bf16 weight, the rounding check of the weight edits."""
    mirror = mw.grads
    if scaler.scale != 1.0 or mirror.master_grads != "on_demand" or mirror.model_grads != "copy":
        return []
    pairs = mw._pairs()
    lows = {p.dtype for p, _ in pairs}
    jobs = [job for low in lows for job in one_pass.kernels_ahead(mw.optimizer, low, ON_DEMAND_DEVICES)]
    if any(p.dtype == torch.bfloat16 and p.device.type == "cpu" and p.numel() >= _update_kernels.ROUND_CHECK_NUMEL
           for p, _ in pairs):  # fmt: skip
        jobs.append((None, {}, 0, torch.device("cpu")))
    return jobs


class _FloatLrForForeach(StepExtension):
    """A tensor ``lr`` (``Adam(lr=torch.tensor(1e-3))``) on an Adam/AdamW param group
    that ampkit's fast kernels switched to ``foreach=True``: torch's foreach Adam refuses
    a tensor lr unless ``capturable``, so for the update alone the group holds the lr's
    value as a float (what the step computes with is then exactly the run with
    ``lr=lr.item()``), and the user's tensor is put back right after, also when the step
    raises (schedulers and ``state_dict`` see it as before)."""

    device_skip = True  # acts on foreach groups only; a step skipped on the device has none

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._swapped: list[tuple[dict, torch.Tensor]] = []

    def before_update(self, args: tuple, kwargs: dict) -> None:
        for group in self.optimizer.param_groups:
            lr = group.get("lr")
            if group.get("foreach") and not group.get("capturable") and torch.is_tensor(lr) and lr.numel() == 1:
                self._swapped.append((group, lr))
                group["lr"] = float(lr.item())

    def after_update(self) -> None:
        for group, lr in self._swapped:
            group["lr"] = lr
        self._swapped = []


def _cast_state_to_params(opt: torch.optim.Optimizer) -> None:
    """Optimizer state created before the cast follows its parameter's dtype (as
    ``Optimizer.load_state_dict`` would do)."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if not state:
                continue
            state.update(cast_optimizer_state(state, p.dtype))


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[nn.Parameter]:
    """The parameters ``optimizer`` steps, in ``param_groups`` order: the fp32 masters
    under O2 (plus fp32 model parameters such as norm layers), the model's own
    parameters otherwise. Clip these, after ``ampkit.unscale(optimizer)``. A framework's
    wrapper that holds the optimizer as ``.optimizer`` stands for it."""
    optimizer = resolve_optimizer(optimizer)
    require_optimizer(optimizer, "master_params", StateError)
    return _stepped_params(optimizer)


def _stepped_params(optimizer: torch.optim.Optimizer) -> Iterator[nn.Parameter]:
    mw = masters_of(optimizer)
    if mw is not None:
        yield from mw.params()
        return
    for group in optimizer.param_groups:
        yield from group["params"]


def master_weights_of(optimizer: torch.optim.Optimizer) -> MasterWeights | None:
    """The :class:`~ampkit.levels.master.MasterWeights` of an optimizer set up by O2, or None."""
    return masters_of(optimizer)


def compensations() -> list[CompensatedUpdates]:
    """The compensated updates of every optimizer O2K set up in this session."""
    return list(_COMPENSATED.values())


def compensation_of(optimizer: torch.optim.Optimizer) -> CompensatedUpdates | None:
    """The :class:`~ampkit.levels.compensated.CompensatedUpdates` of an O2K optimizer, or None."""
    return _COMPENSATED.get(optimizer)
