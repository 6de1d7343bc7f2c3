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
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from .. import _reset
from ..errors import AmpError, PolicyError, StateError
from ..model import cast_tensors

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


_state = _Registry()


@_reset.on_reset
def _forget() -> None:
    global _state
    _state = _Registry()


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
    import ampkit

    registrations = (list(_state.lower), list(_state.fp32), list(_state.promote))
    if not enabled:
        _reset.reset()
        _state.enabled = False
        _state.initialized = True
        return models if optimizers is None else (models, optimizers)
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
    if opt_level.upper() in ("O0", "O1") and cast_model_type is None:
        overrides.pop("keep_norm_fp32")
    lower, fp32, promote = registrations
    if any(registrations):
        level = ampkit.levels.resolve_opt_level(
            opt_level, _device_of(models), **{k: v for k, v in overrides.items() if v is not None}
        )
        if level.op_casting:
            overrides["policy"] = ampkit.Policy(
                dtype=level.dtype, lower_ops=lower, fp32_ops=fp32, promote_ops=promote
            )
    overrides = {k: v for k, v in overrides.items() if v is not None}
    out_models, out_opts = ampkit.initialize(models, optimizers, opt_level, **overrides)
    # ampkit.initialize reset the process-wide state; keep what was registered.
    _state.lower, _state.fp32, _state.promote = registrations
    _state.initialized = True
    _state.device_type = _device_of(models)
    _state.optimizers = [] if out_opts is None else (out_opts if isinstance(out_opts, list) else [out_opts])
    return out_models if optimizers is None else (out_models, out_opts)


def _device_of(models: Any) -> str:
    model_list = models if isinstance(models, (list, tuple)) else [models]
    for m in model_list:
        for p in m.parameters():
            return p.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


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
    import ampkit

    if not _state.enabled:
        yield loss
        return
    if not _state.initialized:
        raise StateError(
            "amp.scale_loss called before amp.initialize: call "
            "amp.initialize(model, optimizer, opt_level=...) first."
        )
    from .. import optim

    opts = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    for opt in opts:
        optim.managed_state(opt).rescale_after_unscale = True
    with ampkit.scale_loss(loss, optimizers, loss_id=loss_id) as scaled:
        yield scaled
    if not delay_unscale:
        # apex unscaled here, so code between this block and step() (clipping
        # amp.master_params or model.parameters()) sees true gradients.
        ampkit.unscale(opts)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
    """apex's ``amp.master_params``: the parameters the optimizer steps (fp32
    masters under O2)."""
    import ampkit

    return ampkit.master_params(optimizer)


def _scalers() -> list[Any]:
    from .. import optim

    if not _state.optimizers:
        return []
    return list(optim.managed_state(_state.optimizers[0]).scalers)


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """apex's ``amp.state_dict``: ``{"loss_scaler<i>": {"loss_scale": float,
    "unskipped": int}}`` per loss id, plus ``"ampkit"``: the complete
    :func:`ampkit.state_dict` (what exact resumption needs, master weights included)."""
    import ampkit

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
    import ampkit

    if not _state.enabled:
        return
    if not _state.initialized:
        raise StateError("amp.load_state_dict called before amp.initialize; initialize first.")
    if not isinstance(state_dict, dict):
        raise StateError(f"amp.load_state_dict expects a dict from amp.state_dict(), got {type(state_dict).__name__}.")
    if "ampkit" in state_dict:
        ampkit.load_state_dict(state_dict["ampkit"])
        return
    scalers = _scalers()
    keys = sorted(k for k in state_dict if k.startswith("loss_scaler"))
    if keys != sorted(f"loss_scaler{i}" for i in range(len(scalers))):
        raise StateError(
            f"the checkpoint has loss scalers {keys}, this run {len(scalers)}: "
            "pass the same num_losses to amp.initialize."
        )
    loads = []  # every scaler's entry is validated before any is loaded
    for i, scaler in enumerate(scalers):
        entry = state_dict[f"loss_scaler{i}"]
        if not isinstance(entry, dict) or "loss_scale" not in entry:
            raise StateError(f"loss_scaler{i} must be a dict with 'loss_scale' and 'unskipped', got {entry!r:.80}.")
        sd = scaler.state_dict()
        sd["scale"] = entry["loss_scale"]
        sd["growth_tracker"] = entry.get("unskipped", 0)
        loads.append(scaler._prepare_load(sd))
    for load in loads:
        load()


# --- function registration (before initialize) --------------------------------------


def _register(bucket: list[Callable[..., Any]], module: Any, name: str, kind: str) -> None:
    from ..policy import canonical_op

    if _state.initialized:
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


def _first_device_type(args: Any) -> str | None:
    for x in args:
        if isinstance(x, torch.Tensor):
            return x.device.type
        if isinstance(x, (list, tuple)):
            found = _first_device_type(x)
            if found:
                return found
    return None


def _widest(args: Any) -> torch.dtype | None:
    widest: torch.dtype | None = None
    stack = list(args)
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, torch.Tensor) and x.is_floating_point():
            if widest is None or torch.finfo(x.dtype).bits > torch.finfo(widest).bits:
                widest = x.dtype
    return widest


def _casting_decorator(fn: F, target: Callable[[Any, str], torch.dtype | None]) -> F:
    import ampkit

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
    import ampkit

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
    import ampkit

    return ampkit.autocast(device_type=_state.device_type, enabled=False)


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
):
    setattr(amp, _name, globals()[_name])
del _name
