"""Optimizer integration: loss scaling, step skipping and the skipped-step signal.

The seed API::

    opt = ampkit.init_trainer(opt)                 # once
    for batch in data:
        opt.zero_grad()
        with ampkit.scale_loss(loss_fn(model(batch)), opt) as scaled:
            scaled.backward()
        ampkit.unscale(opt)                        # optional, before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()                                 # skips itself on inf/NaN grads
        if not ampkit.step_skipped(opt):           # or init_trainer(opt, schedulers=[sched])
            sched.step()

How a step runs -- gradients unscaled and checked as backward produces them
(:mod:`ampkit.trainer.grad_hooks`), the step's found-inf segments, the one skip rule
(:func:`ampkit.trainer.decision.decide`), a skipped step leaving parameters and optimizer
state bitwise unchanged, the loss scalers' updates (one per ``loss_id``, shared by the
optimizers of one ``init_trainer`` call) -- is ``docs/concepts/step-decision.md``, which
also maps each part to its module. Kernels: ``init_trainer`` switches param groups built
with ``foreach`` and ``fused`` unset to torch's fastest kernel for the same optimizer
(``docs/guides/opt-levels.md``; ``fast_kernels=False`` opts out). LR schedulers:
:mod:`ampkit.trainer.schedulers`; the skip wrapper is a bound method that schedulers can
wrap, keeps their ``_wrapped_by_lr_sched`` marker and sets ``optimizer._opt_called`` on
every call, so they never warn about the call order.

This module holds the public functions; the step wrapper is
:class:`ampkit.trainer.managed.ManagedOptimizer`, with its per-step gradient bookkeeping
in :class:`ampkit.trainer.step_grads.StepGrads`; what extends a step (levels, the doctor,
``ampkit run``) is a :class:`ampkit.trainer.extensions.StepExtension`; multi-process runs
plug in through :class:`ampkit.trainer.decision.StepAgreement` (the default one of
:func:`ampkit.trainer.extensions.set_default_agreement`, which ``ampkit.distributed``
installs, is given to every managed optimizer here).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch

from ampkit._internal.validate import is_count, is_real
from ampkit._internal.where import user_stacklevel
from ampkit._internal.wrappers import unwrap_optimizers
from ampkit.casting.engine import current_policy, entered_dtypes
from ampkit.errors import StateError
from ampkit.scaling.loss_scaler import LossScaler

from . import device_skip as _device_skip
from . import extensions as _extensions
from . import session as _session
from .loss_slots import LossSlot, Trainer
from .managed import _ATTR, ManagedOptimizer, last_skipped, managed_state
from .schedulers import SchedulerStepper, check_schedulers
from .stats import StepStats

__all__ = [
    "ManagedOptimizer",
    "StepStats",
    "init_trainer",
    "scale_loss",
    "unscale",
    "step_skipped",
    "stats",
    "managed_state",
    "release",
]

# An optimizer or a list/tuple of them: init_trainer returns what it was given.
_Opts = TypeVar("_Opts", bound="torch.optim.Optimizer | list[Any] | tuple[Any, ...]")


def _as_list(obj: Any) -> list[Any]:
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


#: ``_default_scale`` when the compute dtype cannot be told yet (fp32 parameters, no
#: ``amp.init``): a dynamic scale until the first ``scale_loss`` looks at the scopes.
_UNTOLD = "untold"


def _default_scale(optimizers: list[torch.optim.Optimizer], scopes: frozenset = frozenset()) -> float | str | None:
    """``init_trainer``'s default: 1.0 (static) when the compute dtype is bf16 (of the
    parameters, ``amp.init``, or the ``scopes`` entered), None (dynamic) for fp16,
    :data:`_UNTOLD` when it cannot be told."""
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    dtypes = {p.dtype for p in params if p.is_floating_point()} | scopes
    for device_type in {p.device.type for p in params}:
        try:
            policy = current_policy(device_type)
        except Exception:  # a device type ampkit's casting does not know
            policy = None
        if policy is not None:
            dtypes.add(policy.dtype)
    if torch.float16 in dtypes:
        return None
    return 1.0 if torch.bfloat16 in dtypes else _UNTOLD


def _follow_scopes(states: list[ManagedOptimizer], slots: list[LossSlot]) -> None:
    """The default scale of a trainer whose compute dtype ``init_trainer`` could not
    tell, settled by its first ``scale_loss`` from the ampkit scopes entered so far: bf16
    only, a static scale of 1 (as ``init_trainer`` picks for bf16); else the dynamic scale
    stays. A static scale chosen so becomes dynamic again (init 2**16, warned once) at the
    first ``scale_loss`` after an fp16 scope."""
    if all(slot.follow_scopes is None for slot in slots):
        return
    entered = entered_dtypes()
    for slot in slots:
        if slot.follow_scopes == "first":
            optimizers = [s.optimizer for s in states]
            slot.follow_scopes = None
            if entered and _default_scale(optimizers, entered) == 1.0:
                slot.scaler.configure(dynamic=False, init_scale=1.0)
                slot.scaler.set_scale(1.0)
                slot.follow_scopes = "watch"
        elif slot.follow_scopes == "watch" and torch.float16 in entered:
            slot.follow_scopes = None
            fresh = LossScaler()
            slot.scaler.configure(**fresh.config())
            slot.scaler.set_scale(fresh.scale)
            warnings.warn(
                f"ampkit: {slot.scaler.name} kept a static scale of 1 since the first scale_loss "
                "ran after bf16 scopes only; an fp16 scope has run since, so it scales "
                f"dynamically from now on (init {fresh.scale:g}). Pass scaler= to init_trainer "
                "to choose.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )


def _build_scalers(scaler: Any, num_losses: int) -> list[LossScaler]:
    if scaler is None:
        scalers = [LossScaler() for _ in range(num_losses)]
    elif isinstance(scaler, LossScaler):
        scalers = [scaler] + [scaler.new_like() for _ in range(num_losses - 1)]
    elif is_real(scaler):
        scalers = [LossScaler(init_scale=scaler, dynamic=False) for _ in range(num_losses)]
    elif isinstance(scaler, (list, tuple)) and all(isinstance(s, LossScaler) for s in scaler):
        if len(scaler) != num_losses:
            raise StateError(
                f"init_trainer: got {len(scaler)} scalers for num_losses={num_losses}; "
                "pass one LossScaler per loss id."
            )
        scalers = list(scaler)
    else:
        raise StateError(
            "init_trainer: scaler must be None, a LossScaler, a list of LossScalers (one per "
            f"loss id) or a number (static scale), got {type(scaler).__name__}."
        )
    if len({id(s) for s in scalers}) != len(scalers):
        raise StateError("init_trainer: the same LossScaler was given for two loss ids.")
    for s in scalers:
        s.check_free()  # all checked before any is attached
    return scalers


def init_trainer(
    optimizer_or_list: _Opts,
    scaler: LossScaler | Sequence[LossScaler] | float | None = None,
    num_losses: int = 1,
    *,
    schedulers: Sequence[Any] | None = None,
    fast_kernels: bool = True,
    doctor: bool | None = None,
) -> _Opts:
    """Put one or several optimizers under ampkit's loss scaling and step skipping.

    Args:
        optimizer_or_list: a ``torch.optim.Optimizer`` or a list/tuple of them. Optimizers
            passed together share one scaler per loss id. A framework's wrapper
            (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``)
            stands for the optimizer it holds, which is the one set up.
        scaler: ``None`` (the default, following the compute dtype: a static scale of
            1 when it is bf16 -- bf16 parameters in the optimizer, or ``amp.init``
            casting in bf16 -- since bf16 has fp32's range; otherwise a dynamic
            :class:`LossScaler` per loss: init 2**16, growth 2 every 2000 clean steps,
            backoff 0.5, floor 1, cap 2**24; every step skips on inf/NaN either way; fp32
            parameters, no ``amp.init``: the first ``scale_loss`` tells it from the scopes
            entered, bf16 only giving static 1 until an fp16 scope (warned)), a
            :class:`LossScaler` (used for loss 0; the other loss ids get fresh copies of
            its configuration), a list of ``num_losses`` LossScalers, or a number (a
            static scale for every loss).
        num_losses (int): how many losses get their own scaler (``loss_id`` in
            ``scale_loss``). Default: ``1``.
        schedulers (list of LRScheduler | None): per-step LR schedulers of these
            optimizers for ampkit to step right after each real (not skipped) step of
            their optimizer; the loop calls no ``sched.step()`` of its own (warned once
            if it does). Without it, write ``if not amp.step_skipped(opt): sched.step()``. ReduceLROnPlateau and
            epoch-level schedulers stay with the loop (a ReduceLROnPlateau here raises). Default: ``None``.
        fast_kernels (bool): param groups built with ``foreach`` and ``fused``
            both unset (torch's defaults) step with torch's fastest kernel for the same
            optimizer: ``fused=True`` for Adam, AdamW and Adagrad on fp32/fp64
            parameters, else ``foreach=True`` (``ampkit.trainer.fused_step``; again after
            ``optimizer.load_state_dict``); fused results may differ from the loop's in
            the last bits of a small fraction of the elements, by CPU (~0.15% of an
            AdamW step's elements on an AVX-512 CPU, 0.13% on an AVX2-only one). False leaves the optimizer exactly as built. Default: ``True``.
        doctor (bool | None): watch these optimizers with the process-wide
            :func:`ampkit.doctor` (``ampkit.doctor.current()`` returns it), the attacher
            registered as ``"doctor"`` (``ampkit.trainer.extensions.register_attacher``;
            ``ampkit.tools.diagnosis`` registers it when imported, a
            :class:`~ampkit.StateError` if it is not); ``None``: on when the environment
            variable it registers (``AMPKIT_DOCTOR``) is ``1``. Off installs nothing. Default: ``None``.

    Returns the same optimizer object(s); their ``step()`` now skips itself on inf/NaN
    grads. Registers into the current AMP session (``ampkit.state_dict()``).
    """
    optimizers = _as_list(unwrap_optimizers(optimizer_or_list))  # a framework's wrapper: its optimizer
    if not optimizers:
        raise StateError("init_trainer: got no optimizer.")
    if not is_count(num_losses) or num_losses < 1:
        raise StateError(f"init_trainer: num_losses must be an int >= 1, got {num_losses!r}.")
    if not isinstance(fast_kernels, bool):
        raise StateError(f"init_trainer: fast_kernels must be True or False, got {fast_kernels!r}.")
    if doctor is not None and not isinstance(doctor, bool):
        raise StateError(f"init_trainer: doctor must be True, False or None, got {doctor!r}.")
    attach_doctor = _extensions.attacher("doctor") if _extensions.attacher_requested("doctor", doctor) else None
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise StateError(
                f"init_trainer: expected torch.optim.Optimizer objects, got {type(opt).__name__}."
            )
        if _ATTR in opt.__dict__:
            raise StateError(
                f"init_trainer: this {type(opt).__name__} is already managed by ampkit; call it "
                "once per optimizer (ampkit.reset() or ampkit.trainer.release(opt) undoes it)."
            )
    if len({id(o) for o in optimizers}) != len(optimizers):
        raise StateError("init_trainer: the same optimizer appears twice in the list.")
    scheds = check_schedulers(schedulers, optimizers)
    default = _default_scale(optimizers) if scaler is None else scaler
    scalers = _build_scalers(None if default is _UNTOLD else default, int(num_losses))  # untold: dynamic so far
    for i, s in enumerate(scalers):  # everything checked: from here on nothing fails
        if s.name == "loss scaler":
            s.name = f"loss scaler {i}"
    slots = [LossSlot(s, follow_scopes=default is _UNTOLD) for s in scalers]
    states = []
    for opt in optimizers:
        state = ManagedOptimizer(opt, slots, _extensions.default_agreement(), fast_kernels)
        own = [s for s in scheds if s.optimizer is opt]
        if own:
            state.add_extension(SchedulerStepper(own))
        opt.__dict__[_ATTR] = state
        states.append(state)
    for slot in slots:
        slot.scaler.attach()
    _session.current_session().register(Trainer(states, slots))
    if attach_doctor is not None:
        attach_doctor(optimizers)
    return optimizer_or_list


def release(optimizer: torch.optim.Optimizer) -> None:
    """Stop managing ``optimizer`` (its own ``step`` comes back) and drop its trainer
    from the session. Other optimizers of the same ``init_trainer`` call are released too."""
    state = managed_state(optimizer)
    session = _session.current_session()
    for member in session.members:
        if isinstance(member, Trainer) and any(s is state for s in member.optimizers):
            member.release()
            session.unregister(member)
            return
    state.release()


@contextlib.contextmanager
def scale_loss(
    loss_or_losses: torch.Tensor | Sequence[torch.Tensor],
    optimizer_or_list: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_id: int = 0,
) -> Iterator[Any]:
    """Context manager yielding ``loss * S`` (S: the scale of ``loss_id``'s scaler, an
    fp32 0-dim tensor) for you to call ``backward()`` on; a list of losses yields a list.

    Args:
        loss_or_losses: the loss, a floating-point tensor, or a list of them (a list
            of scaled losses is yielded).
        optimizer_or_list: the optimizer (or a list of optimizers) set up by
            :func:`init_trainer` or :func:`ampkit.initialize` whose parameters the loss
            reaches.
        loss_id (int): which of the optimizer's ``num_losses`` scalers scales it. Default: ``0``.

    Nothing happens at exit: ampkit's gradient hooks unscale the grads as each backward
    pass ends (grads without hooks, FSDP2's sharded ones, at the step), so the grads your
    code reads after the block are real and several backward passes (gradient
    accumulation, DDP ``no_sync``) accumulate normally. All optimizers given must share
    ``loss_id``'s scaler (pass them to one ``init_trainer`` call).

    An abandoned iteration does not leak into the next: when a ``scale_loss`` finds
    that the grads of a step begun earlier were dropped (``optimizer.zero_grad()`` after
    an exception in backward or in clipping), it starts a fresh step. Raises
    :class:`~ampkit.StateError`, before changing anything, for a loss that is not a
    floating-point tensor or a ``loss_id`` that is not an int below ``num_losses``."""
    states = [managed_state(opt) for opt in _as_list(optimizer_or_list)]
    if not states:
        raise StateError("scale_loss: got no optimizer.")
    if not is_count(loss_id):
        raise StateError(f"scale_loss: loss_id must be an int, got {loss_id!r}.")
    losses = [loss_or_losses] if isinstance(loss_or_losses, torch.Tensor) else loss_or_losses
    if not isinstance(losses, (list, tuple)) or not losses:
        raise StateError(
            "scale_loss: expected a loss tensor or a list/tuple of them, got "
            f"{type(loss_or_losses).__name__}."
        )
    for loss in losses:
        if not (isinstance(loss, torch.Tensor) and (loss.is_floating_point() or loss.is_complex())):
            what = f"a {loss.dtype} tensor" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise StateError(
                f"scale_loss: a loss must be a floating-point torch.Tensor (the output of the "
                f"loss function), got {what}."
            )
    scalers = set()
    for state in states:
        if not 0 <= loss_id < len(state._slots):
            raise StateError(
                f"scale_loss: loss_id={loss_id} but the optimizer was set up with "
                f"num_losses={len(state._slots)}; pass num_losses to init_trainer."
            )
        scalers.add(id(state._slots[loss_id].scaler))
    if len(scalers) != 1:
        raise StateError(
            "scale_loss: these optimizers have different loss scalers for "
            f"loss_id={loss_id}; a loss can only be scaled once. Pass optimizers that share "
            "a loss to one ampkit.init_trainer call."
        )
    _follow_scopes(states, states[0]._slots)
    scaler = states[0]._slots[loss_id].scaler
    for state in states:
        _device_skip.settle(state)  # the previous step's outcome (its scale) first
    for state in states:
        state.step_grads.check_before_backward()
    for state in states:
        state.step_grads.before_backward(loss_id)
    if isinstance(loss_or_losses, torch.Tensor):
        scaled: Any = scaler.scale_loss(loss_or_losses)
    else:
        scaled = type(loss_or_losses)(scaler.scale_loss(loss) for loss in loss_or_losses)
    _tell_scale_loss(states, losses, loss_id, scaled)
    try:
        yield scaled
    except BaseException:
        # The backward may have stopped halfway; the next scale_loss checks whether the
        # user dropped the batch (see ManagedOptimizer._drop_abandoned_step).
        for state in states:
            state.step_grads.mark_aborted()
        raise


def _tell_scale_loss(
    states: list[ManagedOptimizer], losses: Sequence[torch.Tensor], loss_id: int, scaled: Any
) -> None:
    """``on_scale_loss`` of the global extensions, then of the extensions of ``states``
    (in their order), each extension once."""
    told: list[_extensions.StepExtension] = []
    for ext in (*_extensions.global_extensions(), *(e for s in states for e in s.extensions)):
        if any(t is ext for t in told):
            continue
        told.append(ext)
        ext.on_scale_loss(states, losses, loss_id, scaled)


def unscale(optimizer_or_list: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
    """Complete this step's inf/NaN check of the grads of ``optimizer_or_list`` (an
    optimizer set up by :func:`init_trainer`, or a list of them) now, as ``step()``
    would: the grads are real already (ampkit's hooks unscale them as backward produces
    them; grads without hooks, FSDP2's sharded ones, are unscaled here), so clipping
    needs no ``unscale`` first; scripts written for one keep working. Grads changed
    afterwards are checked again at ``step()``. Idempotent until the next ``step()``;
    no host sync."""
    states = [managed_state(opt) for opt in _as_list(optimizer_or_list)]
    for state in states:
        state.step_grads.unscale()


def step_skipped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's most recent step was skipped for inf/NaN grads (False
    before the first step). Works for optimizers managed by :func:`init_trainer` and
    for those stepped through :class:`ampkit.GradScaler`. The documented way to keep a
    per-step LR schedule on real steps: ``if not amp.step_skipped(opt): sched.step()``."""
    skipped = last_skipped(optimizer)
    if skipped is None:
        raise StateError(
            f"step_skipped: ampkit has no step record for this {type(optimizer).__name__}; "
            "pass it to ampkit.init_trainer or step it with ampkit.GradScaler."
        )
    return skipped


def stats(optimizer: torch.optim.Optimizer) -> StepStats:
    """The step counters and current scales of a managed optimizer (readable any time)."""
    return managed_state(optimizer).stats()

