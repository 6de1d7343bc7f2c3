"""ampkit with Hugging Face Accelerate: set up before ``accelerator.prepare``, the loss
scaled in ``accelerator.backward``.

Accelerate's own loop, with one call changed::

    import ampkit.integrations.accelerate as amp_accelerate

    accelerator = Accelerator()                    # mixed_precision="no" (the default)
    model, optimizer, loader, scheduler = amp_accelerate.prepare(
        accelerator, model, optimizer, loader, scheduler, opt_level="O2"
    )
    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)                               # the loss scaled by ampkit
        accelerator.clip_grad_norm_(model.parameters(), 1.0)     # real grads, every level
        optimizer.step()                                         # skips itself on inf/NaN
        scheduler.step()                                         # held on skipped steps

:func:`prepare` runs, in this order: the models moved to ``accelerator.device`` (where
Accelerate would move them), :func:`ampkit.initialize` on the raw models and optimizers
(any level, bf16 or fp16, fp8 recipes), ``accelerator.prepare`` on everything, and
:func:`ampkit.distributed.register_ddp` on each model Accelerate wrapped in
``DistributedDataParallel``. It returns what ``accelerator.prepare`` returns. It also

- reports ampkit's skipped steps through Accelerate's own signal: the prepared
  ``AcceleratedOptimizer``'s ``step_was_skipped`` (and so
  ``accelerator.optimizer_step_was_skipped``) is True after a step ampkit skipped, so
  the schedulers Accelerate prepared (``AcceleratedScheduler``) are not stepped then;
- makes ``accelerator.save_state`` / ``load_state`` carry ampkit's state (loss scales,
  step counters, O2's fp32 masters, O2K's compensation, fp8 scales), so a resume is
  bitwise: ``save_state`` writes it as :data:`STATE_NAME` in the checkpoint folder (its
  save pre-hook), ``load_state`` reads that file with ``torch.load(weights_only=True)``
  and validates it against the session before Accelerate loads anything (its load
  pre-hook), and loads it after the models and optimizers. Not through
  ``register_for_checkpointing``: Accelerate unpickles registered objects' files fully
  (``weights_only=False``), so a planted ``custom_checkpoint_0.pkl`` could run code.
  ``checkpoint=False`` leaves that to you: save :func:`ampkit.state_dict` yourself;
- makes this Accelerator's own ``backward(loss)`` scale the loss as
  :func:`ampkit.scale_loss` does (loss id 0 of the optimizers set up): an attribute of
  this instance wraps its method, the class untouched; :func:`release` (and
  ``ampkit.reset``) puts the method back. A loss already scaled -- by :func:`backward`
  or a loop's own ``ampkit.scale_loss`` block -- is passed on as it is.

:func:`backward` is ``accelerator.backward`` inside :func:`ampkit.scale_loss`, for a
loss id other than 0 or optimizers of several :func:`prepare` calls; it keeps working
where the hooked ``accelerator.backward`` would do (the loss is scaled once). Every
ampkit call (``amp.step_skipped``, ``amp.stats``, ``amp.unscale``, ``amp.master_params``)
takes the prepared ``AcceleratedOptimizer`` in place of the optimizer it wraps.

Refused, with an :class:`AccelerateSetupError` saying what to do: an Accelerator with
a ``mixed_precision`` of its own (``"fp16"``, ``"bf16"``, ``"fp8"``: its autocast and
GradScaler would run on top of ampkit's), and DeepSpeed, FSDP, Megatron-LM and XLA,
which shard or cast the model themselves. Supported: one process and DDP (Accelerate's
``MULTI_CPU``/``MULTI_GPU``/... types).
"""

from __future__ import annotations

import functools
import os
import re
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ampkit import Fp8Recipe, initialize, scale_loss, state_dict
from ampkit.distributed import register_ddp
from ampkit.errors import AmpError, StateError

from . import require
from ._files import (
    checkpoint_file_present,
    checkpoint_read_limit,
    prepare_state_load,
    read_checkpoint_file,
    write_checkpoint_file,
)
from ._shared import AfterStep, StepExtension, applied_level, managed_state, torch_compat
from ._shared import registry as _reset
from .banner import announce

_accelerate = require("accelerate", "accelerate")
_optimizer_module = require("accelerate.optimizer", "accelerate")
_utils = require("accelerate.utils", "accelerate")

Accelerator = _accelerate.Accelerator
AcceleratedOptimizer = _optimizer_module.AcceleratedOptimizer
DistributedType = _utils.DistributedType

__all__ = [
    "STATE_NAME",
    "AccelerateSetupError",
    "AccelerateCheckpointError",
    "backward",
    "check_accelerator",
    "prepare",
    "release",
]

#: The file ``accelerator.save_state`` writes ampkit's state to, in the checkpoint folder.
STATE_NAME = "ampkit_state.pt"


class AccelerateSetupError(AmpError, ValueError):
    """An Accelerator, or objects given to :func:`prepare`, that ampkit cannot set up."""


class AccelerateCheckpointError(AmpError, ValueError):
    """``accelerator.load_state`` found ampkit's state in the checkpoint folder unreadable
    or not matching this run; raised before Accelerate loaded anything."""


#: The distributed types whose models Accelerate wraps in DistributedDataParallel (or
#: not at all): ampkit sets the models up before the wrap and registers the DDP.
_SUPPORTED = frozenset(
    getattr(DistributedType, name)
    for name in (
        "NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU",
        "MULTI_MUSA", "MULTI_HPU", "MULTI_SDAA", "MULTI_NEURON",
    )
    if hasattr(DistributedType, name)
)  # fmt: skip


def check_accelerator(accelerator: Any) -> None:
    """Raise :class:`AccelerateSetupError` unless ``accelerator`` is an
    ``accelerate.Accelerator`` that ampkit can run under: ``mixed_precision="no"`` (its
    default) and a single process or DDP."""
    if not isinstance(accelerator, Accelerator):
        raise AccelerateSetupError(
            f"expected an accelerate.Accelerator, got {type(accelerator).__name__}; pass the "
            "Accelerator the training loop uses."
        )
    mixed = accelerator.mixed_precision
    if mixed != "no":
        raise AccelerateSetupError(
            f"this Accelerator has mixed_precision={mixed!r}: Accelerate would run its own "
            "autocast (and, for fp16, its GradScaler) on top of ampkit's casting and loss "
            "scaling. Build it with Accelerator(mixed_precision='no') (the default; also "
            "check ACCELERATE_MIXED_PRECISION and the mixed_precision of `accelerate "
            "config`/`accelerate launch`) and choose the precision here: "
            "prepare(accelerator, ..., opt_level='O2', dtype=torch.bfloat16)."
        )
    kind = accelerator.distributed_type
    if kind not in _SUPPORTED:
        raise AccelerateSetupError(
            f"ampkit's Accelerate integration runs in one process or under DDP; this "
            f"Accelerator uses {kind}, which shards or casts the model itself. Use that "
            "backend's own mixed precision (FSDP's MixedPrecision policy, DeepSpeed's "
            "bf16/fp16 config) instead of ampkit, or train with DDP."
        )


def _save_hook(accelerator: Any) -> Any:
    """Accelerate's save pre-hook (``hook(models, weights, output_dir)``): ampkit's state
    into ``output_dir/STATE_NAME``, written by the process that writes the models, before
    Accelerate writes anything; never through a link (a symlink, FIFO or folder at that
    name refuses the save with :class:`AccelerateCheckpointError`)."""
    ref = weakref.ref(accelerator)

    def hook(models: Any, weights: Any, output_dir: str) -> None:
        acc = ref()
        if acc is None:
            return
        each_node = bool(getattr(acc.project_configuration, "save_on_each_node", False))
        if acc.is_local_main_process if each_node else acc.is_main_process:
            write_checkpoint_file(os.path.join(output_dir, STATE_NAME), state_dict(), AccelerateCheckpointError)

    return hook


def _load_hook(record: _Prepared) -> Any:
    """Accelerate's load pre-hook (``hook(models, input_dir)``): read (a regular file of
    a size the session's state can take; a FIFO, device, folder or link to one is
    refused) and validate the whole of ampkit's state before Accelerate loads the
    models; keep its loader for after the models and optimizers are loaded."""
    rec = weakref.ref(record)

    def hook(models: Any, input_dir: str) -> None:
        record = rec()
        if record is None:
            return
        record.pending = None
        path = os.path.join(input_dir, STATE_NAME)
        if not checkpoint_file_present(path):
            legacy = sorted(f for f in os.listdir(input_dir) if re.fullmatch(r"custom_checkpoint_\d+\.pkl", f))
            warnings.warn(
                f"ampkit: {input_dir} holds no {STATE_NAME} (saved without ampkit's state, or with "
                "checkpoint=False): the loss scale and step counters start afresh, fp32 master weights "
                "and compensation from the loaded weights, so the resume is not exact."
                + (
                    f" It holds {', '.join(legacy)}: ampkit 0.3 saved its state as custom_checkpoint_0.pkl, "
                    "which Accelerate unpickles fully (it can run code). If that file is ampkit's and you "
                    f"trust it, rename it to {STATE_NAME}: ampkit reads it as weights only."
                    if legacy else ""
                ),
                UserWarning,
                stacklevel=3,
            )
            return
        saved = read_checkpoint_file(path, AccelerateCheckpointError, limit=checkpoint_read_limit(record.tensors()))
        record.pending = prepare_state_load(saved, path, AccelerateCheckpointError)

    return hook


def _load_after(accelerator: Any, record: _Prepared) -> None:
    """Make ``accelerator.load_state`` load ampkit's state (validated by the pre-hook)
    after Accelerate loaded the models and optimizers, so O2's exact fp32 masters are
    what the 16-bit weights' reload leaves."""
    original = accelerator.load_state
    rec = weakref.ref(record)

    @functools.wraps(original)
    def load_state(*args: Any, **kwargs: Any) -> Any:
        record = rec()
        try:
            result = original(*args, **kwargs)
            pending = record.pending if record is not None else None
            if pending is not None:
                pending()
            return result
        finally:
            if record is not None:
                record.pending = None

    accelerator.load_state = load_state


class _Prepared:
    """What :func:`prepare` did for one Accelerator: the optimizers it set up (weakly)
    and whether ampkit's state is registered for its checkpoints."""

    def __init__(self) -> None:
        self.optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self.checkpointed = False
        # the loader of the ampkit state load_state's pre-hook validated, until applied
        self.pending: Callable[[], None] | None = None
        # prepare calls of this session that brought optimizers (more than one: the hooked
        # backward cannot tell which optimizers a loss trains)
        self.groups = 0
        self.scaled = _ScaledLosses()
        # accelerator.backward as it was before the hook (None: not hooked)
        self.unhooked: Callable[..., Any] | None = None

    def live_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers set up for this Accelerator that ampkit still manages."""
        out = []
        for ref in self.optimizers:
            opt = ref()
            if opt is None:
                continue
            try:
                managed_state(opt)
            except StateError:
                continue
            out.append(opt)
        return out

    def tensors(self) -> list[torch.Tensor]:
        """The parameters of the optimizers set up (those still alive): what bounds the
        size of ampkit's state in a checkpoint."""
        return [p for ref in self.optimizers if (opt := ref()) is not None for g in opt.param_groups for p in g["params"]]

    def session_alive(self) -> bool:
        """Whether an optimizer set up by an earlier call is still managed (the
        session it joined was not ended by ``ampkit.reset`` or another initialize)."""
        return bool(self.live_optimizers())


class _ScaledLosses(StepExtension):
    """On the optimizers :func:`prepare` set up: the tensors their ``scale_loss`` blocks
    yielded (weakly, the last few), so the hooked ``accelerator.backward`` passes an
    already scaled loss on as it is (:func:`backward`, or a loop's own
    ``with amp.scale_loss(...)``) instead of scaling it twice."""

    device_skip = True  # it only listens to scale_loss: right on a step skipped on the device too

    def __init__(self) -> None:
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def on_scale_loss(self, optimizers: Sequence[Any], losses: Sequence[torch.Tensor], loss_id: int, scaled: Any) -> None:
        items = scaled if isinstance(scaled, (list, tuple)) else [scaled]
        alive = [r for r in self.refs if r() is not None][-15:]
        self.refs = alive + [weakref.ref(t) for t in items if isinstance(t, torch.Tensor)]

    def holds(self, tensor: Any) -> bool:
        return any(r() is tensor for r in self.refs)


# Module state: what prepare did per Accelerator (weak keys: no Accelerator kept alive).
_PREPARED: weakref.WeakKeyDictionary[Any, _Prepared] = weakref.WeakKeyDictionary()


def _placements(accelerator: Any, objects: Sequence[Any], device_placement: Sequence[bool] | None) -> list[bool]:
    if device_placement is None:
        return [bool(accelerator.device_placement)] * len(objects)
    if not isinstance(device_placement, (list, tuple)) or len(device_placement) != len(objects):
        raise AccelerateSetupError(
            f"device_placement must be a list of {len(objects)} bools (one per object "
            f"passed), got {device_placement!r}."
        )
    return [bool(accelerator.device_placement) if d is None else bool(d) for d in device_placement]


def _check_objects(models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    for obj in (*models, *optimizers):
        if isinstance(obj, AcceleratedOptimizer) or getattr(obj, "_is_accelerate_prepared", False):
            raise AccelerateSetupError(
                f"this {type(obj).__name__} was already prepared by accelerator.prepare; "
                "pass the model and optimizer as built to ampkit's prepare, which calls "
                "accelerator.prepare itself after setting them up."
            )
        if isinstance(obj, nn.parallel.DistributedDataParallel):
            raise AccelerateSetupError(
                "the model is already wrapped in DistributedDataParallel; pass the plain "
                "model: Accelerate wraps it in prepare, after ampkit set it up."
            )
    if optimizers and not models:
        raise AccelerateSetupError(
            "prepare got optimizer(s) but no model; pass the model(s) with their "
            "optimizer(s) in one prepare call (ampkit casts the models and builds the "
            "optimizers' masters together)."
        )


def _report_skips(wrapper: Any) -> None:
    """Make ``wrapper.step_was_skipped`` (an ``AcceleratedOptimizer``) report ampkit's
    decision after each step of the optimizer it wraps.

    Accelerate's ``step_was_skipped`` property reads the wrapper's ``_is_overflow``,
    which only its own GradScaler path sets; an extension on the managed optimizer sets
    it after every step, taken or skipped. Checked here: where the property does not
    follow that attribute, a warning says to use ``ampkit.step_skipped`` instead."""
    if not _skip_flag_works(wrapper):
        warnings.warn(
            "ampkit: this accelerate version's AcceleratedOptimizer.step_was_skipped does not "
            "follow _is_overflow; accelerator.optimizer_step_was_skipped will not see "
            "ampkit's skipped steps and prepared schedulers step on them. Use "
            "`if not ampkit.step_skipped(optimizer): scheduler.step()` instead.",
            UserWarning,
            stacklevel=3,
        )
        return
    ref = weakref.ref(wrapper)

    def note(skipped: bool) -> None:
        w = ref()
        if w is not None:
            w._is_overflow = bool(skipped)

    managed_state(wrapper).add_extension(AfterStep(note))


def _skip_flag_works(wrapper: Any) -> bool:
    if "_is_overflow" not in wrapper.__dict__:
        return False
    before = wrapper._is_overflow
    try:
        wrapper._is_overflow = True
        on = wrapper.step_was_skipped is True
        wrapper._is_overflow = False
        off = wrapper.step_was_skipped is False
    finally:
        wrapper._is_overflow = before
    return on and off


def _ddp_of(model: Any) -> nn.parallel.DistributedDataParallel | None:
    """The DistributedDataParallel Accelerate made of a model (under ``torch.compile``'s
    wrapper too), or None."""
    ddp_cls = nn.parallel.DistributedDataParallel
    for candidate in (model, torch_compat.compiled_module_inner(model)):
        if isinstance(candidate, ddp_cls):
            return candidate
    return None


def _hook_backward(accelerator: Any, record: _Prepared) -> None:
    """Make this Accelerator's own ``backward`` (an attribute of this instance; the class
    is untouched) scale the loss as :func:`ampkit.scale_loss` does for the optimizers
    :func:`prepare` set up; :func:`release` (or ``ampkit.reset``) puts it back."""
    original = accelerator.backward
    rec = weakref.ref(record)

    @functools.wraps(original)
    def backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        record = rec()
        optimizers = [] if record is None else record.live_optimizers()
        if record is None or not optimizers or record.scaled.holds(loss):
            return original(loss, **kwargs)  # no session, or scaled by a scale_loss block already
        if record.groups > 1:
            raise AccelerateSetupError(
                f"this Accelerator's optimizers were set up by {record.groups} prepare calls, each "
                "with its own loss scaler, so accelerator.backward cannot tell which of them a loss "
                "trains; call amp_accelerate.backward(accelerator, loss, optimizer) with the "
                "optimizer(s) of the loss (or prepare all models and optimizers in one call)."
            )
        with scale_loss(loss, optimizers) as scaled:
            return original(scaled, **kwargs)

    record.unhooked = original
    accelerator.backward = backward


def _unhook(accelerator: Any, record: _Prepared) -> None:
    original, record.unhooked = record.unhooked, None
    if original is None:
        return
    if getattr(original, "__self__", None) is accelerator and getattr(original, "__func__", None) is getattr(
        type(accelerator), "backward", None
    ):
        vars(accelerator).pop("backward", None)  # the class's own method again
    else:
        accelerator.backward = original  # what was there before (another instance attribute)
    for opt in record.live_optimizers():
        managed_state(opt).remove_extension(record.scaled)


def release(accelerator: Accelerator) -> None:
    """Undo :func:`prepare`'s hook of ``accelerator.backward``: the Accelerator's own
    method (or what stood there before) again, the loss no longer scaled by it. Nothing
    else changes (ampkit's session and its checkpoint hooks stay; ``ampkit.reset`` ends
    the session and releases every Accelerator). Nothing happens for an Accelerator
    :func:`prepare` did not hook.

    Args:
        accelerator: the Accelerator given to :func:`prepare`."""
    record = _PREPARED.get(accelerator)
    if record is not None:
        _unhook(accelerator, record)


@_reset.on_reset
def _release_all() -> None:
    for accelerator, record in list(_PREPARED.items()):
        _unhook(accelerator, record)


def prepare(
    accelerator: Accelerator,
    *objects: Any,
    opt_level: str | None = None,
    dtype: torch.dtype | None = None,
    fp8: Fp8Recipe | bool | None = None,
    device_placement: Sequence[bool] | None = None,
    checkpoint: bool = True,
    **overrides: Any,
) -> Any:
    """Set up ampkit for the models and optimizers among ``objects``, then
    ``accelerator.prepare(*objects)``; returns what that returns (one object, or a tuple in
    the order given).

    Args:
        accelerator: an ``accelerate.Accelerator`` built with ``mixed_precision="no"``
            (the default), in one process or under DDP (see :func:`check_accelerator`).
        *objects: what ``accelerator.prepare`` takes: models (``nn.Module``, fp32, not yet
            prepared), optimizers (``torch.optim.Optimizer`` over those models'
            parameters), DataLoaders, LR schedulers. All models and optimizers are set
            up by one :func:`ampkit.initialize` call (optimizers given together share one
            loss scaler per loss id).
        opt_level (str | None): ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"`` or ``"O2K"``
            (see :func:`ampkit.initialize`); None: ``AMPKIT_LEVEL`` if set, else ``"O1"``. Default: ``None``.
        dtype (torch.dtype | None): compute dtype, ``torch.bfloat16`` or
            ``torch.float16``; None: ``AMPKIT_DTYPE`` if set, else the level's default
            for the device (bf16 on CPU, fp16 on CUDA; always bf16 for O2K). Default: ``None``.
        fp8 (Fp8Recipe | bool | None): fp8 matmuls for the linears the recipe
            chooses (any level but O0); see :func:`ampkit.initialize`. Default: ``None``.
        device_placement (list of bool | None): as for ``accelerator.prepare``;
            models placed there are moved to ``accelerator.device`` *before* ampkit sets
            them up (so casting and masters live where the model trains). Default: ``None``.
        checkpoint (bool): make ``save_state``/``load_state`` carry ampkit's
            state as :data:`STATE_NAME` (once per Accelerator; see the module docs).
            False: save :func:`ampkit.state_dict` yourself. Default: ``True``.
        **overrides: more settings of :func:`ampkit.initialize` (``loss_scale``,
            ``keep_fp32``, ``compensation``, ``master_weights``, ``model_grads``, ...),
            passed to it as they are; an unknown one raises :class:`ampkit.AmpError`.

    The first call for an Accelerator starts a fresh ampkit session (like
    :func:`ampkit.initialize`); a later call for the same Accelerator adds its models and
    optimizers to that session (``initialize(..., fresh=False)``, which takes no ``fp8``).
    From then on ``accelerator.backward(loss)`` scales the loss for the optimizers set up
    (see the module docs; :func:`release` undoes it), and the first call of the process
    says the one line of :mod:`ampkit.integrations.banner` (on stderr by default).

    Raises:
        AccelerateSetupError: an Accelerator with its own ``mixed_precision``, a
            sharding backend, objects already prepared, optimizers without models.
        AmpError: what :func:`ampkit.initialize` refuses (before anything changed).
    """
    check_accelerator(accelerator)
    if not isinstance(checkpoint, bool):
        raise AccelerateSetupError(f"checkpoint must be True or False, got {checkpoint!r}.")
    placements = _placements(accelerator, objects, device_placement)
    models = [o for o in objects if isinstance(o, nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    _check_objects(models, optimizers)
    record = _PREPARED.get(accelerator)
    if models:
        for obj, place in zip(objects, placements):
            if isinstance(obj, nn.Module) and place and getattr(obj, "hf_device_map", None) is None:
                obj.to(accelerator.device)
        fresh = record is None or not record.session_alive()
        initialize(
            models[0] if len(models) == 1 else models,
            None if not optimizers else (optimizers[0] if len(optimizers) == 1 else optimizers),
            opt_level,
            fp8=fp8,
            fresh=fresh,
            dtype=dtype,
            **overrides,
        )
        if record is None:
            record = _PREPARED[accelerator] = _Prepared()
        elif fresh:
            record.optimizers, record.groups = [], 0
        record.optimizers.extend(weakref.ref(o) for o in optimizers)
        record.groups += 1 if optimizers else 0
        for opt in optimizers:
            managed_state(opt).add_extension(record.scaled)
        level = applied_level()
        if level is not None:
            announce("Accelerate", "Accelerator", level.name, level.dtype)
    result = accelerator.prepare(*objects, device_placement=list(placements) if device_placement is not None else None)
    if not models:
        return result
    prepared = result if isinstance(result, tuple) else (result,)
    for out in prepared:
        if isinstance(out, AcceleratedOptimizer) and any(out.optimizer is o for o in optimizers):
            _report_skips(out)
        ddp = _ddp_of(out) if isinstance(out, nn.Module) else None
        if ddp is not None and any(ddp.module is m for m in models):
            register_ddp(ddp)
    if record is not None and record.unhooked is None:
        _hook_backward(accelerator, record)
    if checkpoint and record is not None and not record.checkpointed:
        accelerator.register_save_state_pre_hook(_save_hook(accelerator))
        accelerator.register_load_state_pre_hook(_load_hook(record))
        _load_after(accelerator, record)
        record.checkpointed = True
    return result


def backward(
    accelerator: Accelerator,
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    *,
    loss_id: int = 0,
    retain_graph: bool = False,
) -> None:
    """``accelerator.backward(loss)`` with ampkit's loss scale: ``accelerator.backward``
    on ``loss * S`` inside :func:`ampkit.scale_loss` (``S``: the scale of ``loss_id``'s
    scaler, 1 for bf16 unless ``loss_scale="dynamic"``). Accelerate still divides the
    loss by its ``gradient_accumulation_steps``; ampkit's gradient path unscales the
    grads when backward ends, so ``accelerator.clip_grad_norm_`` sees real ones. Since
    :func:`prepare` scales the loss in ``accelerator.backward`` itself, this is needed
    only for a ``loss_id`` other than 0 or the optimizers of one of several
    :func:`prepare` calls; called anyway, it runs the Accelerator's own backward on the
    loss it scaled (never scaled twice).

    Args:
        accelerator: the Accelerator of :func:`prepare` (``mixed_precision="no"``).
        loss: the loss, a floating-point tensor.
        optimizer: the optimizer(s) the loss trains, as prepared (an
            ``AcceleratedOptimizer``) or as built; several must share a scaler (be set
            up by one :func:`prepare` call).
        loss_id (int): which loss scaler (``num_losses`` passed to :func:`prepare`). Default: ``0``.
        retain_graph (bool): keep the graph for another backward. Default: ``False``.
    """
    check_accelerator(accelerator)
    if not isinstance(retain_graph, bool):
        raise AccelerateSetupError(f"retain_graph must be True or False, got {retain_graph!r}.")
    record = _PREPARED.get(accelerator)
    own = accelerator.backward if record is None or record.unhooked is None else record.unhooked
    with scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
        if retain_graph:
            own(scaled, retain_graph=True)
        else:
            own(scaled)
