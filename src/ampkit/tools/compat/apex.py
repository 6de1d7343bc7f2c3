"""``apex.amp``'s API on top of ampkit: change ``from apex import amp`` to
``from ampkit.compat.apex import amp`` and a legacy training script runs, on CPU
or GPU.

What maps to what:

- ``amp.initialize(...)`` -> :func:`ampkit.initialize` with apex's argument names
  (``keep_batchnorm_fp32`` keeps *every* normalization layer fp32;
  ``patch_torch_functions`` is op-level casting, done by ampkit's engine, not by
  patching torch). The compute dtype is fp16 on CUDA and bf16 on CPU unless
  ``cast_model_type`` names one; with bf16 the default loss scale is a static 1
  (see :mod:`ampkit.levels`).
- ``amp.scale_loss(loss, optimizers, loss_id=0, ...)`` -> :func:`ampkit.scale_loss`,
  then :func:`ampkit.unscale` at exit (unless ``delay_unscale``), as apex unscaled
  there: clipping between the block and ``step()`` sees true gradients. As in apex,
  a step whose grads overflowed is skipped.
- ``amp.state_dict()`` returns apex's ``{"loss_scaler0": {"loss_scale",
  "unskipped"}, ...}`` plus the full ampkit state (scalers, fp32 master weights)
  under ``"ampkit"``; ``amp.load_state_dict`` restores it exactly, and also accepts
  a checkpoint written by apex (scale and growth counter only).
- ``register_half_function/float_function/promote_function(module, name)`` add a
  torch function to the policy's ``lower_ops``/``fp32_ops``/``promote_ops`` used by
  O1. Call them before ``initialize``, as with apex. Functions that are not torch
  ops cannot be registered (ampkit does not patch modules): decorate them with
  ``amp.half_function``/``float_function``/``promote_function`` instead.
- ``amp.disable_casts()`` -> ``ampkit.autocast(enabled=False)``.
- ``scale_loss(loss, [opt_a, opt_b])``: an overflow in the grads this call's backward
  left in any of them skips the step of every optimizer passed, as apex did; grads
  already non-finite from an earlier loss skip only their own optimizer. (ampkit's own
  ``scale_loss`` skips only the optimizers whose grads overflowed; the shared loss
  scaler backs off once either way.)
- Under a cast level (O2, O3) ``model.state_dict()`` holds fp32 tensors, as apex's
  O2 state-dict hook made it (the native API keeps the model's 16-bit dtypes).
- ``cast_model_type=False`` at O2 keeps the model fp32: the optimizer steps the fp32
  weights (apex's masters of fp32 params were the params themselves).
  ``amp._amp_state.allow_incoming_model_not_fp32 = True`` accepts a 16-bit model at
  a cast level; its masters start from the 16-bit values, as in apex.
- After ``amp.initialize``: ``amp._amp_state.opt_properties`` (:class:`OptProperties`,
  the options under apex's names) and, at a level with op-level casting (O1),
  ``amp._amp_state.handle`` (an :class:`AmpHandle`: ``_deactivate()`` turns
  everything off, like :func:`ampkit.reset`).
- A later ``amp.initialize`` of a pair that shares no parameter with the earlier ones
  (a model and optimizer restored from a checkpoint) keeps the earlier pairs training,
  each with its own scalers, masters and counters (``ampkit.initialize(fresh=False)``;
  their trainers leave the AMP session, still managed, and are released on reset);
  ``amp.state_dict()``/``amp.load_state_dict`` follow the latest pair, as apex's loss
  scalers did. A pair over the same parameters replaces the earlier one.
- apex's older handle API: ``handle = amp.init(enabled=True, loss_scale="dynamic")``
  turns op-level casting on process-wide (with the functions registered by
  ``amp.register_*_function`` before it); ``handle.scale_loss(loss, optimizer)``
  scales, unscales at exit and makes ``optimizer.step()`` skip an overflowed step;
  ``handle.wrap_optimizer(optimizer, num_loss)`` returns apex's ``OptimWrapper``
  (``optimizer.scale_loss(loss)`` once per loss, then ``step()``);
  ``handle._disable_casts()``, ``handle.is_active()``, ``handle._deactivate()``
  (everything off, like :func:`ampkit.reset`). ``amp.init(enabled=False)`` returns a
  handle that does nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

import ampkit
from ampkit._internal import registry as _reset
from ampkit._internal.dtypes import default_device_type
from ampkit._internal.tree import iter_tensors
from ampkit._internal.validate import require_fields
from ampkit.casting.policy import canonical_op
from ampkit.errors import AmpError, PolicyError, StateError
from ampkit.levels import setup as _levels
from ampkit.levels.model_cast import cast_tensors
from ampkit.levels.opt_level import defaults_of, is_fp32_level
from ampkit.scaling.loss_scaler import LossScaler
from ampkit.trainer import api as optim
from ampkit.trainer.step_grads import sum_flags

__all__ = ["amp"]

F = TypeVar("F", bound=Callable[..., Any])

_APEX_DEFAULT_MAX_SCALE = 2.0**24


class _Registry:
    """Functions registered before ``initialize``, and whether it ran."""

    def __init__(self) -> None:
        self.lower: list[Callable[..., Any]] = []
        self.fp32: list[Callable[..., Any]] = []
        self.promote: list[Callable[..., Any]] = []
        self.initialized = False
        self.enabled = True
        self.device_type: str | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.param_ids: set[int] = set()  # parameters of every pair set up in this session
        self.handle_api = False  # amp.init ran: registrations go on after initialize


# Module state: apex.amp's API is process-global by design (registrations before init).
_state = _Registry()

# model -> handles of the fp32 state-dict hooks the compat initialize put on its modules.
# Module state, like _state (weak keys: no model kept alive); dropped by reset.
_STATE_DICT_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = weakref.WeakKeyDictionary()


# Optimizers of earlier initialize calls, still managed outside the session (weak).
# Module state, like _state; released by reset.
_DETACHED: list[weakref.ref] = []


@_reset.on_reset
def _forget() -> None:
    global _state
    _state = _Registry()
    for ref in _DETACHED:
        opt = ref()
        if opt is not None and _managed(opt):
            optim.release(opt)
    _DETACHED.clear()
    for handles in list(_STATE_DICT_HOOKS.values()):
        for handle in handles:
            handle.remove()
    _STATE_DICT_HOOKS.clear()
    _amp_state.handle = None
    _amp_state.__dict__.pop("opt_properties", None)


class Fp32StateDict:
    """State-dict post-hook (apex's O2StateDictHook): the 16-bit floating tensors of
    ``state_dict()`` come out as fp32. A plain object, so the model still pickles."""

    def __call__(self, module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
                state_dict[key] = value.to(torch.float32)


def _fp32_state_dicts(models: list[torch.nn.Module]) -> None:
    for model in models:
        for handle in _STATE_DICT_HOOKS.pop(model, []):
            handle.remove()
        _STATE_DICT_HOOKS[model] = [
            m.register_state_dict_post_hook(Fp32StateDict()) for m in model.modules()
        ]


class _ScalerView:
    """apex's ``LossScaler`` as its unit tests poke it: ``loss_scale()`` and a settable
    ``_loss_scale``, on top of the ampkit scaler."""

    def __init__(self, scaler: LossScaler) -> None:
        self._scaler = scaler

    def loss_scale(self) -> float:
        return self._scaler.scale

    @property
    def _loss_scale(self) -> float:
        return self._scaler.scale

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self._scaler.set_scale(value)

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic


@dataclasses.dataclass(frozen=True)
class OptProperties:
    """apex's ``_amp_state.opt_properties``: the options the last ``amp.initialize``
    set up, as apex named them (read-only: changing them after ``initialize`` changed
    nothing in apex either). ``cast_model_type`` is what the call passed, else the
    dtype the level stores the model in (None: the model stays as it is);
    ``keep_batchnorm_fp32`` and ``master_weights`` are None where the level casts no
    model (O1), as in apex; ``loss_scale`` is ``"dynamic"`` or the static scale (bf16
    levels default to a static 1, see :mod:`ampkit.levels`)."""

    enabled: bool
    opt_level: str | None = None
    cast_model_type: Any = None
    patch_torch_functions: bool = False
    keep_batchnorm_fp32: bool | None = None
    master_weights: bool | None = None
    loss_scale: float | str = 1.0

    @property
    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _opt_properties(level: Any, cast_model_type: Any) -> OptProperties:
    cast = level.cast_model_type is not None
    return OptProperties(
        enabled=True,
        opt_level=level.name,
        cast_model_type=cast_model_type if cast_model_type is not None else level.cast_model_type,
        patch_torch_functions=level.op_casting,
        keep_batchnorm_fp32=level.keep_norm_fp32 if cast else None,
        master_weights=level.master_weights if cast or is_fp32_level(level.name) else None,
        loss_scale=level.loss_scale,
    )


class _AmpState:
    """apex's ``amp._amp_state`` (``from apex.amp import _amp_state``), the switches
    legacy scripts and apex's own tests set. After ``amp.initialize``: ``handle`` (at
    a level with op-level casting, O1: the :class:`AmpHandle` whose ``_deactivate()``
    turns everything off) and ``opt_properties`` (:class:`OptProperties`; absent before
    the first ``initialize``, as in apex)."""

    def __init__(self) -> None:
        self.allow_incoming_model_not_fp32 = False
        self.hard_override = False
        self.verbosity = 1
        self.handle: Any = None

    @property
    def loss_scalers(self) -> list[_ScalerView]:
        return [_ScalerView(s) for s in _scalers()]


# Module state: apex.amp._amp_state, which legacy scripts read and set.
_amp_state = _AmpState()


def _as_bool(value: Any, what: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    raise AmpError(f"{what} must be True, False, 'True' or 'False', got {value!r}.")


def _as_loss_scale(value: Any) -> float | str | None:
    if value is None or value == "dynamic":
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise AmpError(f"loss_scale must be 'dynamic' or a number, got {value!r}.") from None


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = _APEX_DEFAULT_MAX_SCALE,
) -> Any:
    """apex's ``amp.initialize``. Returns ``models`` when ``optimizers`` is None,
    else ``(models, optimizers)``, in the shapes given. ``verbosity`` is accepted and
    ignored (ampkit reports through the ``ampkit`` logger). ``enabled=False`` returns
    the arguments untouched and makes ``scale_loss`` a pass-through."""
    registrations = (list(_state.lower), list(_state.fp32), list(_state.promote))
    if not enabled:
        _reset.reset()
        _state.enabled = False
        _state.initialized = True
        _amp_state.opt_properties = OptProperties(enabled=False)
        return models if optimizers is None else (models, optimizers)
    if cast_model_type is False or cast_model_type == torch.float32:
        # apex: nothing cast, so no masters either (the fp32 params are their own
        # masters) and keep_batchnorm_fp32 means nothing.
        master_weights = False
        keep_batchnorm_fp32 = None
    overrides: dict[str, Any] = {
        "cast_model_type": cast_model_type,
        "op_casting": patch_torch_functions,
        "keep_norm_fp32": _as_bool(keep_batchnorm_fp32, "keep_batchnorm_fp32"),
        "master_weights": master_weights,
        "loss_scale": _as_loss_scale(loss_scale),
        "num_losses": num_losses,
        "min_loss_scale": min_loss_scale,
    }
    if max_loss_scale != _APEX_DEFAULT_MAX_SCALE:  # apex's default cap is ampkit's too
        overrides["max_loss_scale"] = max_loss_scale
    if cast_model_outputs is not None:
        overrides["cast_model_outputs"] = cast_model_outputs
    if cast_model_type in (torch.float16, torch.bfloat16):
        overrides["dtype"] = cast_model_type
    # apex ignored keep_batchnorm_fp32 when nothing is cast (O0/O1 defaults).
    base = defaults_of(opt_level)
    if base is not None and not base.casts_model and cast_model_type is None:
        overrides.pop("keep_norm_fp32")
    lower, fp32, promote = registrations
    level = _levels.resolve_opt_level(
        opt_level, _device_of(models), **{k: v for k, v in overrides.items() if v is not None}
    )
    if any(registrations) and level.op_casting:
        overrides["policy"] = ampkit.Policy(
            dtype=level.dtype, lower_ops=lower, fp32_ops=fp32, promote_ops=promote
        )
    overrides = {k: v for k, v in overrides.items() if v is not None}
    model_list = list(models) if isinstance(models, (list, tuple)) else [models]
    if level.cast_model_type is not None and _amp_state.allow_incoming_model_not_fp32:
        for m in model_list:  # masters from the 16-bit values, as apex built them
            if any(p.is_floating_point() and p.dtype != torch.float32 for p in m.parameters()):
                m.float()
    # apex kept every initialized pair training (a restored model/optimizer pair next
    # to the original): a later initialize joins the session of the earlier one
    # (an optimizer or model passed again starts afresh, as before)
    join = (
        _state.initialized and _state.enabled and any(_managed(opt) for opt in _state.optimizers)
        and not _shares_with_earlier(model_list, optimizers)
    )
    if join:
        _detach_session()
    out_models, out_opts = ampkit.initialize(models, optimizers, opt_level, fresh=not join, **overrides)
    if level.cast_model_type is not None and level.compensation is None:  # (compensated weights: not apex's)
        _fp32_state_dicts(model_list)
    # a fresh ampkit.initialize reset the process-wide state; keep what was registered.
    _state.lower, _state.fp32, _state.promote = registrations
    _state.initialized = True
    _state.device_type = _device_of(models)
    _state.optimizers = [] if out_opts is None else (out_opts if isinstance(out_opts, list) else [out_opts])
    _state.param_ids |= _param_ids(model_list, out_opts)
    if level.op_casting:  # apex's O1 handle, which its scripts reach as _amp_state.handle
        _amp_state.handle = AmpHandle(level.loss_scale, True, False)
    _amp_state.opt_properties = _opt_properties(level, cast_model_type)
    return out_models if optimizers is None else (out_models, out_opts)


def _param_ids(models: list[torch.nn.Module], optimizers: Any) -> set[int]:
    opts = [] if optimizers is None else (list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers])
    ids = {id(p) for m in models for p in m.parameters()}
    ids |= {id(p) for o in opts if isinstance(o, torch.optim.Optimizer) for g in o.param_groups for p in g["params"]}
    return ids | {id(o) for o in opts}


def _shares_with_earlier(models: list[torch.nn.Module], optimizers: Any) -> bool:
    """Whether the new models or optimizers are, or hold a parameter of, a pair set
    up before in this session."""
    return not _state.param_ids.isdisjoint(_param_ids(models, optimizers))


def _detach_session() -> None:
    """Take the trainers of the earlier ``initialize`` calls out of the AMP session,
    still managed: they keep training with their own scalers, masters and counters,
    while ``amp.state_dict()`` and ``amp.load_state_dict`` follow the latest pair (as
    apex's did). They are released on :func:`ampkit.reset`, or go with their
    optimizers (held weakly here)."""
    from ampkit.trainer.session import current_session

    session = current_session()
    for member in session.members:
        session.unregister(member)
        _DETACHED.extend(weakref.ref(state.optimizer) for state in getattr(member, "optimizers", ()))
    _DETACHED[:] = [ref for ref in _DETACHED if ref() is not None]


def _device_of(models: Any) -> str:
    model_list = models if isinstance(models, (list, tuple)) else [models]
    for m in model_list:
        for p in m.parameters():
            return p.device.type
    return default_device_type()


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """apex's ``amp.scale_loss``: yields ``loss`` times the scale of ``loss_id``; at
    exit the grads are unscaled and checked (as apex did), unless ``delay_unscale``
    (gradient accumulation: the last block of the step unscales). Another
    ``scale_loss`` before ``step()`` brings the grads back to its own scale, so
    several losses and accumulation work either way. ``model`` and
    ``delay_overflow_check`` are accepted and unused, as in apex."""
    if not _state.enabled:
        yield loss
        return
    if not _state.initialized:
        raise StateError(
            "amp.scale_loss called before amp.initialize: call "
            "amp.initialize(model, optimizer, opt_level=...) first."
        )
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    before = _checked_so_far(opts)
    with ampkit.scale_loss(loss, optimizers, loss_id=loss_id) as scaled:
        yield scaled
    if not delay_unscale:
        # apex unscaled here, so code between this block and step() (clipping
        # amp.master_params or model.parameters()) sees true gradients.
        ampkit.unscale(opts)
        _skip_together([optim.managed_state(opt) for opt in opts], before)


def _checked_so_far(opts: list[Any]) -> list[int]:
    """How many checked segments each (managed) optimizer's step holds before a
    ``scale_loss`` call: the ones after it are that call's."""
    return [len(optim.managed_state(opt).segment_flags()) if _managed(opt) else 0 for opt in opts]


def _skip_together(states: list[Any], before: list[int]) -> None:
    """apex: an overflow in the grads one ``scale_loss`` call's backward left in any of
    its optimizers skips every optimizer of the call. Each gets the others' inf/NaN
    flags from this call (``before``: each one's segments before it) as one more
    segment of its step (no loss id: no scaler event of its own; no host sync).

    Grads already non-finite from an earlier loss of the step are that loss's overflow:
    they skip their own optimizer (its earlier segment), not the other optimizers of a
    later call -- apex checks each backward's own new grads, so a finite later loss
    steps an optimizer that only it reached (apex's test_3models2losses2optimizers)."""
    if len(states) < 2:
        return
    shares = []
    for state, n in zip(states, before):
        flags = state.segment_flags()
        new, earlier = flags[n:], flags[:n]
        if not new:
            continue
        share = sum_flags(new)
        if earlier:  # masked where an earlier loss already overflowed this optimizer's grads
            carried = sum_flags(earlier).to(share.device, non_blocking=True) > 0
            share = share * (~carried).to(share.dtype)
        shares.append(share)
    if not shares:
        return
    total = sum_flags(shares)
    for state in states:
        state.add_segment(total)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
    """apex's ``amp.master_params``: the parameters the optimizer steps (fp32
    masters under O2)."""
    return ampkit.master_params(optimizer)


def _scalers() -> list[Any]:
    if not _state.optimizers:
        return []
    return list(optim.managed_state(_state.optimizers[0]).scalers)


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """apex's ``amp.state_dict``: ``{"loss_scaler<i>": {"loss_scale": float,
    "unskipped": int}}`` per loss id, plus ``"ampkit"``: the complete
    :func:`ampkit.state_dict` (what exact resumption needs, master weights included)."""
    out: dict[str, Any] = {} if destination is None else destination
    if not _state.enabled or not _state.initialized:
        return out
    for i, scaler in enumerate(_scalers()):
        out[f"loss_scaler{i}"] = {"loss_scale": scaler.scale, "unskipped": scaler.growth_tracker}
    out["ampkit"] = ampkit.state_dict()
    return out


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """apex's ``amp.load_state_dict``: restores a dict from :func:`state_dict`
    exactly; from an apex checkpoint (no ``"ampkit"`` key) it restores each loss
    scale and growth counter."""
    if not _state.enabled:
        return
    if not _state.initialized:
        raise StateError("amp.load_state_dict called before amp.initialize; initialize first.")
    if not isinstance(state_dict, dict):
        raise StateError(f"amp.load_state_dict expects a dict from amp.state_dict(), got {type(state_dict).__name__}.")
    scalers = _scalers()
    names = [f"loss_scaler{i}" for i in range(len(scalers))]
    keys = sorted(k for k in state_dict if isinstance(k, str) and k.startswith("loss_scaler"))
    require_fields({k: v for k, v in state_dict.items() if k not in keys}, (), "amp.load_state_dict",
                   StateError, optional=("ampkit", *names), source="amp.state_dict()")
    if "ampkit" in state_dict:
        ampkit.load_state_dict(state_dict["ampkit"])
        return
    if keys != sorted(names):
        raise StateError(
            f"the checkpoint has loss scalers {keys}, this run {len(scalers)}: "
            "pass the same num_losses to amp.initialize."
        )
    loads = []  # every scaler's entry is validated before any is loaded
    for i, scaler in enumerate(scalers):
        entry = state_dict[f"loss_scaler{i}"]
        require_fields(entry, ("loss_scale",), f"loss_scaler{i}", StateError, optional=("unskipped",),
                       source="amp.state_dict()")
        sd = scaler.state_dict()
        sd["scale"] = entry["loss_scale"]
        sd["growth_tracker"] = entry.get("unskipped", 0)
        loads.append(scaler.prepare_load(sd))
    for load in loads:
        load()


# --- function registration (before initialize) --------------------------------------


def _register(bucket: list[Callable[..., Any]], module: Any, name: str, kind: str) -> None:
    if _state.initialized and not _state.handle_api:
        raise StateError(
            f"amp.register_{kind}_function must be called before amp.initialize, as with apex."
        )
    if not hasattr(module, name):
        raise AmpError(f"no function named {name!r} in {getattr(module, '__name__', module)!r}.")
    fn = getattr(module, name)
    try:
        canonical_op(fn)
    except PolicyError:
        raise AmpError(
            f"{getattr(module, '__name__', module)}.{name} is not a torch op, and ampkit does "
            f"not patch modules: decorate the function with amp.{kind}_function instead."
        ) from None
    bucket.append(fn)


def register_half_function(module: Any, name: str) -> None:
    """Run ``module.name`` (a torch function) in the 16-bit compute dtype under O1."""
    _register(_state.lower, module, name, "half")


def register_float_function(module: Any, name: str) -> None:
    """Run ``module.name`` (a torch function) in fp32 under O1."""
    _register(_state.fp32, module, name, "float")


def register_promote_function(module: Any, name: str) -> None:
    """Run ``module.name`` (a torch function) in the widest dtype of its inputs under O1."""
    _register(_state.promote, module, name, "promote")


# --- decorators -----------------------------------------------------------------------


def _first_device_type(args: list[Any]) -> str | None:
    """The device type of the first tensor in ``args`` (through lists and tuples, not
    dicts), or None."""
    return next((t.device.type for t in iter_tensors(args, mapping=None)), None)


def _widest(args: tuple[Any, ...]) -> torch.dtype | None:
    """The widest floating dtype in ``args`` (through lists, tuples and dicts); of two
    as wide (bf16, fp16) the last one found."""
    widest: torch.dtype | None = None
    for x in reversed(list(iter_tensors(args, mapping=dict))):
        if x.is_floating_point() and (widest is None or torch.finfo(x.dtype).bits > torch.finfo(widest).bits):
            widest = x.dtype
    return widest


def _casting_decorator(fn: F, target: Callable[[Any, str], torch.dtype | None]) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        device_type = _first_device_type(list(args) + list(kwargs.values()))
        if device_type is None or not ampkit.is_active(device_type):
            return fn(*args, **kwargs)
        dtype = target((args, kwargs), device_type)
        if dtype is not None:
            args, kwargs = cast_tensors(args, dtype), cast_tensors(kwargs, dtype)
        # Like torch.amp.custom_fwd(cast_inputs=...): the body runs uncast.
        with ampkit.autocast(device_type=device_type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _compute_dtype(_: Any, device_type: str) -> torch.dtype | None:
    policy = ampkit.current_policy(device_type)
    return None if policy is None else policy.dtype


def half_function(fn: F) -> F:
    """Decorator: while casting is on, run ``fn`` on inputs cast to the compute
    dtype (fp16/bf16), with casting off inside."""
    return _casting_decorator(fn, _compute_dtype)


def float_function(fn: F) -> F:
    """Decorator: while casting is on, run ``fn`` on fp32 inputs, casting off inside."""
    return _casting_decorator(fn, lambda _a, _d: torch.float32)


def promote_function(fn: F) -> F:
    """Decorator: while casting is on, run ``fn`` on inputs cast to the widest
    floating dtype among them, casting off inside."""
    return _casting_decorator(fn, lambda a, _d: _widest(a))


def disable_casts() -> contextlib.AbstractContextManager[Any]:
    """Context manager: no op-level casting inside (apex's ``amp.disable_casts``)."""
    return ampkit.autocast(device_type=_state.device_type, enabled=False)


# --- apex's older handle API ------------------------------------------------------------


def init(
    enabled: bool = True,
    loss_scale: float | str = "dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
) -> AmpHandle | NoOpHandle:
    """apex's ``amp.init``: op-level casting on for the whole process (bf16 on CPU, fp16
    on CUDA), with the functions registered by ``amp.register_*_function`` since the
    last ``init``; returns the handle. ``enabled=False``: a handle that does nothing.
    ``enable_caching``, ``verbose`` and ``allow_banned`` are accepted (ampkit's cast
    cache is always safe; it bans no function)."""
    scale = _as_loss_scale(loss_scale)
    if not enabled:
        handle: AmpHandle | NoOpHandle = NoOpHandle()
    else:
        lower, fp32, promote = list(_state.lower), list(_state.fp32), list(_state.promote)
        device_type = default_device_type()
        ampkit.init(device_type=device_type, lower_ops=lower, fp32_ops=fp32, promote_ops=promote)
        _state.lower, _state.fp32, _state.promote = [], [], []  # consumed, as apex did
        _state.device_type = device_type
        handle = AmpHandle(scale if scale is not None else "dynamic", enable_caching, verbose)
    _state.handle_api = True
    _amp_state.handle = handle
    return handle


def _scaler_for(loss_scale: float | str) -> LossScaler:
    if loss_scale == "dynamic":
        return LossScaler()
    return LossScaler(init_scale=float(loss_scale), dynamic=False)


class AmpHandle:
    """What apex's ``amp.init(enabled=True)`` returned."""

    def __init__(self, loss_scale: float | str, enable_caching: bool, verbose: bool) -> None:
        self._loss_scale = loss_scale
        self._enable_caching = enable_caching
        self._verbose = verbose
        self._is_active = True
        self._cache: dict[Any, Any] = {}

    def is_active(self) -> bool:
        return self._is_active

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        self._is_active = False
        try:
            with ampkit.autocast(device_type=_state.device_type, enabled=False):
                yield
        finally:
            self._is_active = True

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> OptimWrapper:
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        """Yields ``loss`` times the optimizer's loss scale; at exit the grads are
        unscaled and checked, and ``optimizer.step()`` skips itself on an overflow."""
        if not self._is_active:
            yield loss
            return
        opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        for opt in opts:
            if not _managed(opt):
                ampkit.init_trainer(opt, scaler=_scaler_for(self._loss_scale))
        before = _checked_so_far(opts)
        with ampkit.scale_loss(loss, opts[0] if len(opts) == 1 else opts) as scaled:
            yield scaled
        ampkit.unscale(opts)
        _skip_together([optim.managed_state(opt) for opt in opts], before)

    def _clear_cache(self) -> None:
        self._cache.clear()

    def remove_cache(self, param: Any) -> None:
        self._cache.pop(param, None)

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    @property
    def cache(self) -> dict[Any, Any]:
        return self._cache

    @property
    def verbose(self) -> bool:
        return self._verbose

    def _deactivate(self) -> None:
        """Casting off, optimizers released: :func:`ampkit.reset`."""
        ampkit.reset()


class NoOpHandle:
    """What apex's ``amp.init(enabled=False)`` returned: nothing happens."""

    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        yield

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> OptimWrapper:
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        yield loss

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass


_managed = _levels.is_managed


class OptimWrapper:
    """apex's ``handle.wrap_optimizer(optimizer, num_loss)``: one loss scaler per loss;
    ``scale_loss(loss)`` once per loss of the iteration, in order, then ``step()``,
    skipped when any loss's grads overflowed. Other attributes go to the optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, amp_handle: Any, num_loss: int) -> None:
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        if amp_handle.is_active() and not _managed(optimizer):
            scalers = [_scaler_for(amp_handle._loss_scale) for _ in range(num_loss)]
            ampkit.init_trainer(optimizer, scaler=scalers, num_losses=num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        if not self._amp_handle.is_active():
            yield loss
            return
        if not 0 <= self._loss_idx < self._num_loss:
            raise StateError(
                f"OptimWrapper.scale_loss called {self._loss_idx + 1} times before step(), but "
                f"wrap_optimizer was given num_loss={self._num_loss}."
            )
        with ampkit.scale_loss(loss, self._optimizer, loss_id=self._loss_idx) as scaled:
            yield scaled
        ampkit.unscale(self._optimizer)
        self._loss_idx += 1

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise NotImplementedError("The `closure` argument is unsupported by the amp optimizer wrapper.")
        self._loss_idx = 0
        return self._optimizer.step()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._optimizer, attr)

    def __repr__(self) -> str:
        return repr(self._optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)


#: The drop-in for ``from apex import amp``: a module object, so code that looks
#: for names in ``amp.__dict__`` (as some training libraries do) finds them.
amp = types.ModuleType("ampkit.compat.apex.amp", "apex.amp's API on top of ampkit.")
for _name in (
    "initialize",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
    "disable_casts",
    "init",
    "AmpHandle",
    "NoOpHandle",
    "OptimWrapper",
):
    setattr(amp, _name, globals()[_name])
del _name
amp._amp_state = _amp_state  # type: ignore[attr-defined]
# `from ampkit.compat.apex.amp import _amp_state` (apex: `from apex.amp import _amp_state`)
sys.modules.setdefault(amp.__name__, amp)
# a model saved whole with Fp32StateDict hooks loads with torch.load's defaults
from ampkit.safe_globals import register as _register_safe_globals  # noqa: E402

_register_safe_globals([__name__])
