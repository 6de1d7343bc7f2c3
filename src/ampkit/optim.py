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
        sched.step()

How a step runs. ``scale_loss`` multiplies the loss by its loss scaler's scale ``S`` and
leaves the gradients alone afterwards: several backward passes (gradient accumulation,
DDP ``no_sync``) simply accumulate scaled gradients in place. ``optimizer.step()`` (after
``init_trainer``, an instance attribute wrapping the optimizer's own ``step``):

1. runs the ``pre_unscale_hooks`` (once per step),
2. unscales the grads of the params in ``optimizer.param_groups`` by ``1/S`` and checks
   them for inf/NaN, one fused kernel per (device, dtype) -- unless ``ampkit.unscale``
   already did this step,
3. reads the found-inf flag(s) with one host sync (in a multi-process run, after one
   all-reduce that makes every rank reach the same decision when they could disagree;
   see :mod:`ampkit.distributed`),
4. if every grad is finite, calls the optimizer's own ``step`` and then the
   ``post_step_hooks``; otherwise it returns without touching params or optimizer
   state (bitwise) and runs the ``skip_hooks``,
5. feeds the event to the loss scaler(s), which may raise :class:`~ampkit.NumericsError`.

Several losses (``num_losses > 1``): each ``loss_id`` has its own :class:`LossScaler`.
When one step mixes loss ids, ``scale_loss`` for a new loss id first rescales the grads
already accumulated from ``S_old`` to ``S_new`` in place, checking them for inf/NaN in
the same fused pass, so each loss's overflow is known separately without moving grads
aside. The step is skipped if any loss's grads overflowed. Each scaler updates on its own
events only: an overflow found in loss ``k``'s grads backs off scaler ``k``; clean grads
count as a clean step for it; if an earlier loss already overflowed in the same step, the
grads of later losses are necessarily non-finite too, so their scalers are left unchanged
for that step (their event is unknown).

Several optimizers in one ``init_trainer`` call share one scaler per ``loss_id`` (one
backward fills all their grads with the same scale); the scaler updates once all the
optimizers that received that loss's grads have stepped. Optimizers passed to separate
``init_trainer`` calls have separate scalers.

Kernels and passes. ``init_trainer`` switches param groups built with ``foreach`` and
``fused`` unset to torch's fastest kernel for the same optimizer (see
:mod:`ampkit.fast_step`; ``fast_kernels=False`` opts out). Grads the step checks
without unscaling them (scale 1, bf16's default, or edited since the end-of-backward
unscale of :mod:`ampkit.grads`) are read once by a min/max reduction
(:func:`ampkit.fast_step.nonfinite_flag`), not rewritten times 1. The skip decision
stays on the host (ampkit needs the one host sync anyway: hysteresis, NumericsError
and schedulers act there), so fused kernels never need ``grad_scale``/``found_inf``.

LR schedulers: the skip wrapper is a bound method whose function LR schedulers can wrap,
it keeps the ``_wrapped_by_lr_sched`` marker of a scheduler created earlier, and sets
``optimizer._opt_called`` on every call, skipped or not, so schedulers never warn that
``lr_scheduler.step()`` came before ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import os
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch

from . import session as _session
from ._where import user_stacklevel
from .errors import AmpError, DistributedError, NumericsError, StateError
from .fast_step import nonfinite_flag, use_fastest_kernel
from .grads import GradPath
from .scaling import LossScaler, group_grads, is_count, is_real, to_fp32, unscale_and_check_
from .scaling import _is_rank_zero as is_rank_zero

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

_ATTR = "_ampkit_managed"
_ON = ("1", "true", "yes", "on")
_MISSING = object()

# Last skip decision of optimizers stepped through ampkit.GradScaler (not managed).
_GRADSCALER_SKIPS: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = (
    weakref.WeakKeyDictionary()
)

_Opt = TypeVar("_Opt", bound=torch.optim.Optimizer)

# Cross-rank agreement on the skip decision (installed by ampkit.distributed on import).
# Called once per step with the step's segments, before their flags are read: returns
# None when this rank decides alone, else an object with ``device`` and
# ``reduce(tensor)`` (an in-place all-reduce MAX over the ranks that must agree).
_agreement_hook: Callable[[ManagedOptimizer, list], Any] | None = None


# Called once per step before the grads are first touched (before the pre-unscale
# hooks), with the grads as backward left them (installed by ampkit.distributed).
_before_check_hook: Callable[[ManagedOptimizer], None] | None = None


# Observers of ``scale_loss`` (``ampkit.doctor`` subscribes here): each is called as
# ``fn(states, losses, loss_id, scaled)`` once the loss is scaled, before the block runs
# (``states``: the ManagedOptimizers of the call; ``losses``: the unscaled loss tensors;
# ``scaled``: what the block yields). Empty unless the doctor is on: no cost otherwise.
scale_loss_observers: list[Callable[[Sequence[ManagedOptimizer], Sequence[torch.Tensor], int, Any], None]] = []


def set_agreement_hook(
    hook: Callable[[ManagedOptimizer, list], Any] | None,
    before_check: Callable[[ManagedOptimizer], None] | None = None,
) -> None:
    """Install the cross-rank agreement hook and the hook that sees the grads before
    ampkit touches them (see ``ampkit.distributed``)."""
    global _agreement_hook, _before_check_hook
    _agreement_hook = hook
    _before_check_hook = before_check


# Extra state of an optimizer or a session: (get_fn, set_fn, check_fn or None).
_Extra = tuple[Callable[[], Any], Callable[[Any], None], "Callable[[Any], None] | None"]


def _require_keys(state_dict: Any, keys: Sequence[str], where: str) -> None:
    if not isinstance(state_dict, Mapping):
        raise StateError(
            f"{where}: expected a dict (from ampkit.state_dict()), got {type(state_dict).__name__}."
        )
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise StateError(
            f"{where}: the state dict lacks {missing}; pass the dict returned by ampkit.state_dict()."
        )


def _check_extra(registered: Mapping[str, _Extra], saved: Mapping[str, Any], where: str) -> None:
    """Run the ``check_fn`` of each registered extra state on its saved value. Errors
    other than AmpError (a check tripping over a malformed value) become StateError."""
    for name, (_, _, check_fn) in registered.items():
        if check_fn is None:
            continue
        try:
            check_fn(saved[name])
        except AmpError:
            raise
        except Exception as err:
            raise StateError(f"{where}: extra state {name!r} is malformed ({type(err).__name__}: {err}).") from err


@dataclass(frozen=True)
class StepStats:
    """Counters of one managed optimizer, as returned by :func:`stats`.

    Attributes:
        steps: calls to ``optimizer.step()`` since ``init_trainer`` (taken or skipped).
        skipped: steps skipped because grads were inf/NaN.
        last_skipped: whether the most recent step was skipped.
        scales: current scale of each loss's scaler, by ``loss_id``.
        overflows: overflow events seen by each loss's scaler, by ``loss_id``.
    """

    steps: int
    skipped: int
    last_skipped: bool
    scales: tuple[float, ...]
    overflows: tuple[int, ...]

    @property
    def taken(self) -> int:
        """Steps that updated the parameters."""
        return self.steps - self.skipped


#: Skipped steps after the first are reported at most this often (seconds).
SKIP_SUMMARY_SECONDS = 60.0

_LOG = logging.getLogger("ampkit")


class SkipReport:
    """Skipped steps on the ``ampkit`` logger at WARNING, rank 0 only (one report per
    ``init_trainer`` call): the first skip at once, later ones as a count at most every
    :data:`SKIP_SUMMARY_SECONDS`, never one line per step. Points at the user's line."""

    def __init__(self) -> None:
        self.first_done = False
        self.pending = 0
        self.last = 0.0

    def note(self, state: ManagedOptimizer, skipped: bool) -> None:
        if skipped and not self.first_done:
            self.first_done = True
            self.last = time.monotonic()
            self._emit(
                "ampkit: optimizer step %d skipped: inf/NaN gradients; loss scale now %s. "
                "Later skips are summarized at most every %g s.",
                state.steps, _scales(state), SKIP_SUMMARY_SECONDS,
            )
            return
        if skipped:
            self.pending += 1
        if self.pending and time.monotonic() - self.last >= SKIP_SUMMARY_SECONDS:
            elapsed = time.monotonic() - self.last
            count, self.pending, self.last = self.pending, 0, time.monotonic()
            self._emit(
                "ampkit: %d more optimizer step(s) skipped in the last %.0f s (%d of %d "
                "steps so far); loss scale now %s.",
                count, elapsed, state.skipped, state.steps, _scales(state),
            )

    @staticmethod
    def _emit(msg: str, *args: Any) -> None:
        if _LOG.isEnabledFor(logging.WARNING) and is_rank_zero():
            _LOG.warning(msg, *args, stacklevel=user_stacklevel())


def _scales(state: ManagedOptimizer) -> str:
    return ", ".join(f"{s.scale:g}" for s in state.scalers)


class _LossSlot:
    """One loss id of a trainer: its scaler and the optimizers that owe it an event
    for the current iteration (those that received this loss's grads and have not
    stepped yet). The scaler updates when the last of them steps."""

    def __init__(self, scaler: LossScaler) -> None:
        self.scaler = scaler
        self.owed: list[ManagedOptimizer] = []
        self.reports: list[bool | None] = []
        self.skips = SkipReport()

    def expect(self, state: ManagedOptimizer) -> None:
        if not any(s is state for s in self.owed):
            self.owed.append(state)

    def report(self, state: ManagedOptimizer, event: bool | None) -> None:
        """``event``: True overflow, False clean, None unknown (masked by another loss)."""
        if not any(s is state for s in self.owed):
            return
        self.owed = [s for s in self.owed if s is not state]
        self.reports.append(event)
        if self.owed:
            return
        reports, self.reports = self.reports, []
        if any(r is True for r in reports):
            self.scaler.update(True)
        elif all(r is False for r in reports):
            self.scaler.update(False)

    def clear(self) -> None:
        self.owed = []
        self.reports = []


class ManagedOptimizer:
    """ampkit's state for one managed optimizer; get it with :func:`managed_state`.

    Extension points (used by fp32 master weights):

    - ``scalers``: ``list[LossScaler]``, one per ``loss_id`` (shared with the other
      optimizers of the same ``init_trainer`` call).
    - ``grad_path``: the :class:`ampkit.grads.GradPath` whose hooks keep grads real
      (unscaled) as backward produces them; fp32 master weights plug in there.
    - ``pre_unscale_hooks``: ``list[Callable[[], None]]``, called once per step before
      the grads are checked (by ``ampkit.unscale`` or by ``step``).
    - ``post_step_hooks``: ``list[Callable[[], None]]``, called after a real (not
      skipped) step. Master weights copy the masters back into the model here.
    - ``skip_hooks``: ``list[Callable[[], None]]``, called after a skipped step.
    - ``scale_loss_observers`` (module level): callables told of every ``scale_loss``
      (``ampkit.doctor`` counts scaled losses and backward passes there).
    - Unscaling and the check act on the grads of the params *currently* in
      ``optimizer.param_groups``: swap master params in there and their grads are what
      gets checked and stepped.
    - ``backward_params``: ``Iterable[Tensor] | None``, the tensors whose ``.grad``
      backward accumulates into, when these are not the params in ``param_groups``
      (master weights: the model's params). Iterated afresh each time it is needed, so a
      live view is fine. The gradient hooks go on these (set it before the first
      ``scale_loss``); ``None``: the params in ``param_groups``.
    - ``rescale_after_unscale``: kept for compatibility, no effect: grads are real at
      all times, so a ``scale_loss`` after ``unscale`` in the same step simply goes on
      accumulating.
    - :meth:`register_extra_state`: extra per-optimizer state saved in and restored from
      ``ampkit.state_dict()``.

    Counters: ``steps``, ``skipped``, ``last_skipped`` (see :class:`StepStats`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        slots: list[_LossSlot],
        hold_schedulers_on_skip: bool,
        fast_kernels: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self._slots = slots
        self.scalers: list[LossScaler] = [slot.scaler for slot in slots]
        self.pre_unscale_hooks: list[Callable[[], None]] = []
        self.post_step_hooks: list[Callable[[], None]] = []
        self.skip_hooks: list[Callable[[], None]] = []
        self.backward_params: Iterable[torch.Tensor] | None = None
        self.rescale_after_unscale = False
        self.hold_schedulers_on_skip = hold_schedulers_on_skip
        self.steps = 0
        self.skipped = 0
        self.last_skipped = False
        self._extra: dict[str, _Extra] = {}
        self._active = True
        self._fp16_warned = False
        # Per-step state: the loss id whose scale the grads carry (not yet unscaled),
        # the found-inf flags of this step's segments in order, whether the grads
        # were already unscaled this step, and whether a scale_loss block of this
        # step was left by an exception (the step may have been abandoned).
        self._pending: int | None = None
        self._segments: list[tuple[int | None, torch.Tensor | None]] = []
        self._unscaled = False
        self._aborted = False
        # Schedulers held after a skipped step: (scheduler, its own class).
        self._held: list[tuple[Any, Any]] = []
        self._previous_step: Any = _MISSING
        self._install_step()
        # Hooks that make grads real as backward produces them (ampkit.grads).
        self.grad_path = GradPath(self)
        self.grad_path.refresh()
        # torch's fastest kernel for groups left at foreach=None/fused=None, again after
        # a load_state_dict brings back groups saved with both unset.
        self.kernels: list[str] = []
        self._kernel_hook: Any = None
        if fast_kernels:
            self.kernels = use_fastest_kernel(optimizer)
            self._kernel_hook = optimizer.register_load_state_dict_post_hook(use_fastest_kernel)

    # --- extension API ---------------------------------------------------------------
    def register_extra_state(
        self,
        name: str,
        get_fn: Callable[[], Any],
        set_fn: Callable[[Any], None],
        check_fn: Callable[[Any], None] | None = None,
    ) -> None:
        """Save ``get_fn()`` under ``name`` with this optimizer in ``ampkit.state_dict()``;
        ``ampkit.load_state_dict`` passes the saved value to ``set_fn``.

        ``check_fn(value)``, if given, validates a saved value without changing anything
        (raising an :class:`~ampkit.AmpError`); ``ampkit.load_state_dict`` runs every
        check of the checkpoint before any ``set_fn``, so a rejected checkpoint leaves
        everything as it was. ``set_fn`` must then not fail."""
        if name in self._extra:
            raise StateError(f"extra state {name!r} is already registered for this optimizer.")
        self._extra[name] = (get_fn, set_fn, check_fn)

    # --- the step wrapper ------------------------------------------------------------
    def _install_step(self) -> None:
        opt = self.optimizer
        self._previous_step = opt.__dict__.get("step", _MISSING)
        inner = opt.step  # the class's step (bound) or a wrapper set on the instance
        state = self

        def step(self_opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return state._step(inner, args, kwargs)

        functools.update_wrapper(
            step, type(opt).step, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=()
        )
        if hasattr(inner, "_wrapped_by_lr_sched"):
            # A scheduler created before us wrapped `step`; keep its marker. We set
            # `_opt_called` ourselves on every call, so the marker stays truthful.
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self._step_function = step
        opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]

    def release(self) -> None:
        """Stop managing the optimizer: its previous ``step`` comes back (if something
        wrapped ours since, ours stays but only forwards)."""
        if not self._active:
            return
        self._active = False
        self.grad_path.remove()
        self._release_held_schedulers()
        if self._kernel_hook is not None:
            self._kernel_hook.remove()
        opt = self.optimizer
        current = opt.__dict__.get("step")
        if getattr(current, "__func__", None) is self._step_function:
            if self._previous_step is _MISSING:
                del opt.__dict__["step"]
            else:
                opt.step = self._previous_step  # type: ignore[method-assign]
        if opt.__dict__.get(_ATTR) is self:
            del opt.__dict__[_ATTR]
        for slot in self._slots:
            slot.owed = [s for s in slot.owed if s is not self]

    def _step(self, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self._release_held_schedulers()
        opt = self.optimizer
        opt._opt_called = True  # type: ignore[attr-defined]
        if not self._active:
            return inner(*args, **kwargs)
        closure, args, kwargs = _pop_closure(args, kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        was_unscaled = self._unscaled
        self._unscale()
        if was_unscaled:
            self._check_edits()
        events, skip = self._resolve_step()
        self.grad_path.before_step()
        try:
            return self._take_or_skip(inner, args, kwargs, closure, loss, events, skip)
        finally:
            self.grad_path.after_step()

    def _take_or_skip(
        self,
        inner: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        closure: Callable[[], Any] | None,
        loss: Any,
        events: dict[int, bool | None],
        skip: bool,
    ) -> Any:
        self.steps += 1
        report = self._slots[0].skips
        if skip:
            self.skipped += 1
            self.last_skipped = True
            for hook in self.skip_hooks:
                hook()
            if self.hold_schedulers_on_skip:
                self._hold_schedulers()
            try:
                self._report(events)  # may raise NumericsError; the step stays skipped
            finally:
                report.note(self, skipped=True)
            return loss
        self.last_skipped = False
        self._report(events)  # clean events never raise
        report.note(self, skipped=False)
        if closure is None:
            result = inner(*args, **kwargs)
        else:
            result = inner(*args, closure=self._replay_closure(closure, loss), **kwargs)
        for hook in self.post_step_hooks:
            hook()
        return result

    def _replay_closure(self, closure: Callable[[], Any], first_loss: Any) -> Callable[[], Any]:
        """The closure handed to the optimizer: its first call returns the loss ampkit
        already computed (grads in place, unscaled); later calls (LBFGS) evaluate the
        closure again and unscale its grads. Such a re-evaluation cannot be skipped, so
        inf/NaN grads there raise NumericsError."""
        calls = 0

        def replay() -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return first_loss
            with torch.enable_grad():
                loss = closure()
            self._unscale()
            events, overflow = self._resolve_step()
            self._report(events)
            if overflow:
                raise NumericsError(
                    "inf/NaN gradients in a re-evaluation of the step closure: the optimizer "
                    "is mid-step and cannot skip it. Use a lower or static loss scale with "
                    "optimizers that evaluate the closure several times (LBFGS)."
                )
            return loss

        return replay

    # --- per-step gradient bookkeeping -----------------------------------------------
    def _grad_params(self) -> Iterator[torch.Tensor]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def _tracked_grads(self) -> list[torch.Tensor]:
        """The grads this step holds: of the params in ``param_groups`` and of the
        ``backward_params`` (each tensor once; sparse grads by their values)."""
        params = itertools.chain(self._grad_params(), self.backward_params or ())
        grads: dict[int, torch.Tensor] = {}
        for p in params:
            g = p.grad
            if g is not None:
                grads[id(g)] = g._values() if g.is_sparse else g
        return list(grads.values())

    def _start_fresh_step(self) -> None:
        self._segments = []
        self._pending = None
        self._unscaled = False
        self._aborted = False
        self.grad_path.forget_flags()

    def _drop_abandoned_step(self) -> None:
        """At a ``scale_loss``: if this step's grads were dropped since ampkit last
        looked at them (``zero_grad()`` after an exception in backward, in a clip, or
        any abandoned batch), forget the old step's flags and start a fresh one.

        The grads count as dropped when every one is None (``zero_grad()``), or -- only
        after ``unscale`` or an exception inside a ``scale_loss`` block, at the cost of
        one host sync -- when every one is zero (``zero_grad(set_to_none=False)``)."""
        self.grad_path.finish()  # a backward pass that raised: settle its hooks' work
        flagged = self._unscaled or any(f is not None for _, f in self._segments)
        aborted, self._aborted = self._aborted, False
        if not flagged:
            return
        self.grad_path.reconcile()  # O2: the model's and the masters' grads agree
        params = itertools.chain(self._grad_params(), self.backward_params or ())
        if all(p.grad is None for p in params):
            self._start_fresh_step()
            return
        if aborted or (self._unscaled and not self.rescale_after_unscale):
            grads = self._tracked_grads()
            nonzero = torch.stack([g.ne(0).any().to(grads[0].device) for g in grads]).any()
            if not bool(nonzero):
                self._start_fresh_step()

    def _check_before_backward(self) -> None:
        """Raise (changing nothing but dropping an abandoned step) if ``scale_loss``
        cannot start a backward pass now."""
        self._drop_abandoned_step()
        if self._unscaled and self.grad_path.unhooked(self._grad_params()):
            raise StateError(
                "this optimizer's grads were already unscaled this step (ampkit.unscale) "
                "and some of them (FSDP2's sharded parameters) are only unscaled at the "
                "step: run every scale_loss/backward of the step before unscale, then "
                "step(). To drop a batch after unscale, call optimizer.zero_grad() first."
            )

    def _before_backward(self, loss_id: int) -> None:
        """Called by ``scale_loss`` before the backward of ``loss_id`` (after
        :meth:`_check_before_backward` passed for every optimizer of the call)."""
        path = self.grad_path
        path.refresh()
        path.finish()
        # The hooks keep grads real: a backward after ``unscale`` in the same step just
        # reopens the step.
        self._unscaled = False
        pending = self._pending
        if pending is not None and pending != loss_id:
            path.reconcile()
            ratio = _ratio(self._slots[loss_id].scaler.scale, self._slots[pending].scaler.scale)
            self._segments.append((pending, self._close(pending, ratio)))
        self._pending = loss_id
        self._slots[loss_id].expect(self)

    def _close(self, loss_id: int | None, unhooked_factor: float = 1.0) -> torch.Tensor | None:
        """The inf/NaN flag of the grads gathered since the last close: the hooks'
        flags for ``loss_id``, one fused check of grads they did not check (edited,
        assigned, or produced with a scale of 1), and the fused multiply by
        ``unhooked_factor`` and check of grads without hooks. No host sync."""
        path = self.grad_path
        flags = path.take_found(loss_id) if loss_id is not None else []
        params = list(self._grad_params())
        raw = path.unhooked(params)
        if raw:
            raw_groups = group_grads(raw)
            found = (
                nonfinite_flag(raw_groups) if unhooked_factor == 1.0 else unscale_and_check_(raw_groups, unhooked_factor)
            )
            if found is not None:
                flags.append(found)
            path.unchecked(raw)  # checked just now
        unchecked = path.unchecked(params)
        if unchecked:
            found = nonfinite_flag(group_grads(unchecked))  # reads only: nothing to multiply
            if found is not None:
                flags.append(found)
        if not flags:
            return None
        total = flags[0]
        for other in flags[1:]:
            total = total + other.to(total.device, non_blocking=True)
        return total

    def _unscale(self) -> None:
        """Hooks, then close this step's pending grads: their inf/NaN flag (no sync).
        The grads are unscaled already (ampkit.grads). Idempotent within a step."""
        if self._unscaled:
            return
        if _before_check_hook is not None:
            _before_check_hook(self)
        for hook in self.pre_unscale_hooks:
            hook()
        path = self.grad_path
        path.finish(absorb_raw=True)
        path.reconcile()
        if self._pending is not None:
            scaler = self._slots[self._pending].scaler
            if not self._fp16_warned and scaler.scale != 1.0:
                self._warn_fp16(group_grads(self._grad_params()))
            self._segments.append((self._pending, self._close(self._pending, scaler.inv_scale)))
            self._pending = None
        elif not self._segments:
            # No scale_loss this step: still refuse to step on inf/NaN grads.
            self._segments.append((None, self._close(None)))
        self._unscaled = True

    def _check_edits(self) -> None:
        """At ``step`` after an explicit ``unscale``: check grads changed since (e.g.
        clipped); an inf/NaN there skips the step without blaming a loss scaler."""
        self.grad_path.reconcile()
        found = self._close(None)
        if found is not None:
            self._segments.append((None, found))

    def _warn_fp16(self, groups: dict) -> None:
        if any(dtype == torch.float16 for _, dtype in groups):
            self._fp16_warned = True
            warnings.warn(
                "ampkit: this optimizer holds float16 parameters; unscaling their grads in "
                "float16 loses the small values loss scaling preserved. Keep the parameters "
                "in float32 (casting in the forward pass) or use fp32 master weights.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def _resolve_step(self) -> tuple[dict[int, bool | None], bool]:
        """Read this step's found-inf flags (the step's one host sync) and attribute them
        to loss ids. Returns ({loss_id: True/False/None(unknown)}, skip)."""
        segments, self._segments = self._segments, []
        self._pending = None
        self._unscaled = False
        hook = _agreement_hook
        agreement = hook(self, segments) if hook is not None else None
        if agreement is not None:
            return _resolve_agreed(segments, len(self._slots), agreement)
        tensors = [f for _, f in segments if f is not None]
        if not tensors:
            flags_iter = iter(())
        elif len(tensors) == 1:
            flags_iter = iter([bool(tensors[0].item())])
        else:
            device = tensors[0].device
            stacked = torch.stack([t.to(device, non_blocking=True) for t in tensors])
            flags_iter = iter(bool(v) for v in stacked.tolist())
        events: dict[int, bool | None] = {}
        masked = False
        skip = False
        for loss_id, found in segments:
            flag = bool(next(flags_iter)) if found is not None else False
            skip = skip or flag
            if loss_id is None:
                masked = masked or flag
            elif masked:
                if events.get(loss_id) is not True:
                    events[loss_id] = None
            elif flag:
                events[loss_id] = True
                masked = True
            else:
                events.setdefault(loss_id, False)
        return events, skip

    def _report(self, events: dict[int, bool | None]) -> None:
        errors: list[NumericsError] = []
        for loss_id, slot in enumerate(self._slots):
            if loss_id in events or any(s is self for s in slot.owed):
                try:
                    slot.report(self, events.get(loss_id))
                except NumericsError as err:  # let every scaler see its event first
                    errors.append(err)
        if errors:
            raise errors[0]

    # --- schedulers ---------------------------------------------------------------
    def _hold_schedulers(self) -> None:
        """Make the next ``step()`` of each LR scheduler attached to this optimizer a
        no-op (until the optimizer steps again). Schedulers are found by a scan of the
        garbage collector's objects, on skipped steps only; ReduceLROnPlateau (driven
        by a metric, usually per epoch) is never held."""
        lr_sched = torch.optim.lr_scheduler
        opt = self.optimizer
        for obj in gc.get_objects():
            cls = type(obj)  # not isinstance: some objects warn when __class__ is read
            if (
                issubclass(cls, lr_sched.LRScheduler)
                and not issubclass(cls, lr_sched.ReduceLROnPlateau)
                and obj.__dict__.get("optimizer") is opt
                and not any(s is obj for s, _ in self._held)
            ):
                self._hold(obj)

    def _hold(self, scheduler: Any) -> None:
        # The hold is a class swap, not an instance attribute: a scheduler's state_dict()
        # is its __dict__, and a hold stored there would fail to pickle and, loaded into
        # a scheduler, swallow its steps forever.
        previous = type(scheduler)
        scheduler.__class__ = _held_class(previous)
        _HELD_BY[scheduler] = self
        self._held.append((scheduler, previous))

    def _unhold(self, scheduler: Any) -> None:
        for i, (sched, previous) in enumerate(self._held):
            if sched is scheduler:
                del self._held[i]
                _HELD_BY.pop(sched, None)
                sched.__class__ = previous
                return

    def _release_held_schedulers(self) -> None:
        while self._held:
            self._unhold(self._held[0][0])

    # --- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "skipped": self.skipped,
            "last_skipped": self.last_skipped,
            "extra": {name: get() for name, (get, _, _) in self._extra.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any], where: str) -> None:
        self.prepare_load(state_dict, where)()

    def prepare_load(self, state_dict: Any, where: str) -> Callable[[], None]:
        """Validate a :meth:`state_dict` (counters, extra state via the ``check_fn`` of
        each :meth:`register_extra_state`); return the function that loads it."""
        _require_keys(state_dict, ("steps", "skipped", "last_skipped"), where)
        steps, skipped, last = state_dict["steps"], state_dict["skipped"], state_dict["last_skipped"]
        if not (is_count(steps) and is_count(skipped) and 0 <= skipped <= steps):
            raise StateError(
                f"{where}: steps={steps!r}, skipped={skipped!r} are not step counters (ints, "
                "0 <= skipped <= steps); pass the dict returned by ampkit.state_dict()."
            )
        if not isinstance(last, bool):
            raise StateError(f"{where}: last_skipped must be True or False, got {last!r}.")
        extra = state_dict.get("extra", {})
        if not isinstance(extra, Mapping) or set(extra) != set(self._extra):
            shown = sorted(extra) if isinstance(extra, Mapping) else repr(extra)
            raise StateError(
                f"{where}: extra optimizer state differs: checkpoint has {shown}, "
                f"this run registers {sorted(self._extra)}; set the run up the same way "
                "(e.g. master weights on or off) before loading."
            )
        _check_extra(self._extra, extra, where)

        def apply() -> None:
            self.steps = int(steps)
            self.skipped = int(skipped)
            self.last_skipped = last
            self._start_fresh_step()
            for name, (_, set_fn, _) in self._extra.items():
                set_fn(extra[name])

        return apply

    def stats(self) -> StepStats:
        return StepStats(
            steps=self.steps,
            skipped=self.skipped,
            last_skipped=self.last_skipped,
            scales=tuple(s.scale for s in self.scalers),
            overflows=tuple(s.num_overflows for s in self.scalers),
        )


class Trainer:
    """What one ``init_trainer`` call registers in the session: its optimizers and
    their shared scalers (one per loss id)."""

    def __init__(self, optimizers: list[ManagedOptimizer], slots: list[_LossSlot]) -> None:
        self.optimizers = optimizers
        self.slots = slots

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_losses": len(self.slots),
            "scalers": [slot.scaler.state_dict() for slot in self.slots],
            "optimizers": [state.state_dict() for state in self.optimizers],
        }

    def load_state_dict(self, state_dict: dict[str, Any], where: str) -> None:
        self.prepare_load(state_dict, where)()

    def prepare_load(self, state_dict: Any, where: str) -> Callable[[], None]:
        """Validate a :meth:`state_dict` completely (every scaler and optimizer entry);
        return the function that loads it."""
        _require_keys(state_dict, ("num_losses", "scalers", "optimizers"), where)
        num_losses, scalers, opts = (
            state_dict["num_losses"], state_dict["scalers"], state_dict["optimizers"]
        )
        if not is_count(num_losses) or num_losses != len(self.slots):
            raise StateError(
                f"{where}: the checkpoint has num_losses={num_losses!r}, this run "
                f"{len(self.slots)}; pass the same num_losses to init_trainer."
            )
        if not isinstance(scalers, (list, tuple)) or len(scalers) != len(self.slots):
            raise StateError(
                f"{where}: expected a list of {len(self.slots)} scaler state(s), got {scalers!r:.80}."
            )
        if not isinstance(opts, (list, tuple)) or len(opts) != len(self.optimizers):
            count = len(opts) if isinstance(opts, (list, tuple)) else repr(opts)
            raise StateError(
                f"{where}: the checkpoint has {count} optimizer(s), "
                f"this run {len(self.optimizers)}; pass the same optimizers to init_trainer."
            )
        steps = [slot.scaler._prepare_load(sd) for slot, sd in zip(self.slots, scalers)]
        steps += [state.prepare_load(sd, where) for state, sd in zip(self.optimizers, opts)]

        def apply() -> None:
            for slot in self.slots:
                slot.clear()
            for step in steps:
                step()

        return apply

    def release(self) -> None:
        for state in self.optimizers:
            state.release()
        for slot in self.slots:
            slot.clear()
            slot.scaler._attached = False


# Per-loss event codes of an agreed step, ordered so that MAX across ranks combines
# them: an overflow on any rank is an overflow; a loss masked by an earlier overflow
# on some rank (and overflowing on none) is unknown; clean means clean everywhere.
_ABSENT, _CLEAN, _MASKED, _OVERFLOW = -1.0, 0.0, 1.0, 2.0


def _encode_events(
    segments: list[tuple[int | None, torch.Tensor | None]], num_losses: int, device: torch.device
) -> torch.Tensor:
    """On ``device``, no host sync: ``[code per loss id] + [skip] + [1.0 per loss id
    absent on this rank]``, the same meaning as the local path of ``_resolve_step``."""
    zero = torch.zeros((), dtype=torch.float32, device=device)
    flags = [zero if f is None else f.to(device, non_blocking=True) for _, f in segments]
    found = (torch.stack(flags) > 0).to(torch.float32) if flags else zero.view(1)
    if found.numel() > 1:  # masked: an earlier segment of this step overflowed
        before = torch.cummax(found, 0).values[:-1]
        masked = torch.cat([zero.view(1), before])
    else:
        masked = torch.zeros_like(found)
    status = torch.where(masked > 0, _MASKED, found * _OVERFLOW)
    codes = torch.full((num_losses,), _ABSENT, dtype=torch.float32, device=device)
    picked = [i for i, (loss_id, _) in enumerate(segments) if loss_id is not None]
    if picked:
        index = torch.tensor([segments[i][0] for i in picked], device=device)
        codes.scatter_reduce_(0, index, status[picked], reduce="amax")
    absent = (codes < 0).to(torch.float32)
    return torch.cat([codes, found.max().view(1), absent])


def _resolve_agreed(
    segments: list[tuple[int | None, torch.Tensor | None]], num_losses: int, agreement: Any
) -> tuple[dict[int, bool | None], bool]:
    """``_resolve_step`` with the events combined across ranks: one all-reduce (MAX) of
    the encoded events, then the step's one host sync."""
    vector = _encode_events(segments, num_losses, agreement.device)
    agreement.reduce(vector)
    values = vector.tolist()
    codes, skip, absent = values[:num_losses], values[num_losses] > 0, values[num_losses + 1 :]
    events: dict[int, bool | None] = {}
    mismatched = []
    for loss_id, code in enumerate(codes):
        if code == _ABSENT:
            continue
        if absent[loss_id] > 0:
            mismatched.append(loss_id)
        events[loss_id] = None if code == _MASKED else code == _OVERFLOW
    if mismatched:
        raise DistributedError(
            f"loss id(s) {mismatched} were scaled on some ranks but not on others this step, "
            "so their loss scalers would drift apart. Run the same scale_loss calls (same "
            "loss ids) on every rank each step; scale a zero loss where a rank has none."
        )
    return events, skip


# LR schedulers held after a skipped step -> the ManagedOptimizer holding them.
_HELD_BY: weakref.WeakKeyDictionary[Any, ManagedOptimizer] = weakref.WeakKeyDictionary()
# Scheduler class -> its held twin (same name; ``step`` swallows one call).
_HELD_CLASSES: dict[type, type] = {}


def _held_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``step`` does nothing once and then gives the
    scheduler its own class back (see ``ManagedOptimizer._hold``)."""
    held = _HELD_CLASSES.get(cls)
    if held is None:

        def step(self: Any, *args: Any, **kwargs: Any) -> None:
            state = _HELD_BY.get(self)
            if state is None:  # a copy of a held scheduler: not held itself
                self.__class__ = cls
                return cls.step(self, *args, **kwargs)
            state._unhold(self)
            return None

        namespace = {"__slots__": (), "step": step, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        held = _HELD_CLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return held


def _ratio(new: float, old: float) -> float:
    return to_fp32(new / old)


def _pop_closure(args: tuple, kwargs: dict) -> tuple[Callable[[], Any] | None, tuple, dict]:
    if "closure" in kwargs:
        kwargs = dict(kwargs)
        return kwargs.pop("closure"), args, kwargs
    if args:
        return args[0], args[1:], kwargs
    return None, args, kwargs


def _as_list(obj: Any) -> list[Any]:
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def _default_scale(optimizers: list[torch.optim.Optimizer]) -> float | None:
    """``init_trainer``'s default: 1.0 (static) when the compute dtype is bf16, None
    (dynamic) for fp16 or when it cannot be told (fp32 parameters, no ``amp.init``)."""
    from .casting import current_policy

    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    for device_type in {p.device.type for p in params}:
        try:
            policy = current_policy(device_type)
        except Exception:  # a device type ampkit's casting does not know
            policy = None
        if policy is not None:
            dtypes.add(policy.dtype)
    if torch.float16 in dtypes or torch.bfloat16 not in dtypes:
        return None
    return 1.0


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
        if s._attached:
            raise StateError(
                f"init_trainer: {s!r} already drives another trainer; give each init_trainer "
                "call its own LossScaler (LossScaler.new_like() copies the configuration)."
            )
    return scalers


@overload
def init_trainer(
    optimizer_or_list: _Opt,
    scaler: LossScaler | Sequence[LossScaler] | float | None = ...,
    num_losses: int = ...,
    *,
    hold_schedulers_on_skip: bool = ...,
    fast_kernels: bool = ...,
    doctor: bool | None = ...,
) -> _Opt: ...


@overload
def init_trainer(
    optimizer_or_list: list[_Opt],
    scaler: LossScaler | Sequence[LossScaler] | float | None = ...,
    num_losses: int = ...,
    *,
    hold_schedulers_on_skip: bool = ...,
    fast_kernels: bool = ...,
    doctor: bool | None = ...,
) -> list[_Opt]: ...


def init_trainer(
    optimizer_or_list: Any,
    scaler: LossScaler | Sequence[LossScaler] | float | None = None,
    num_losses: int = 1,
    *,
    hold_schedulers_on_skip: bool = False,
    fast_kernels: bool = True,
    doctor: bool | None = None,
) -> Any:
    """Put one or several optimizers under ampkit's loss scaling and step skipping.

    Args:
        optimizer_or_list: a ``torch.optim.Optimizer`` or a list/tuple of them. Optimizers
            passed together share one scaler per loss id.
        scaler: ``None`` (the default, following the compute dtype: a static scale of
            1 when it is bf16 -- bf16 parameters in the optimizer, or ``amp.init``
            casting in bf16 -- since bf16 has fp32's range; otherwise a dynamic
            :class:`LossScaler` per loss: init 2**16, growth 2 every 2000 clean steps,
            backoff 0.5, floor 1, cap 2**24; every step skips on inf/NaN either way), a
            :class:`LossScaler` (used for loss 0; the other loss ids get fresh copies of
            its configuration), a list of ``num_losses`` LossScalers, or a number (a
            static scale for every loss).
        num_losses (int) [1]: how many losses get their own scaler (``loss_id`` in
            ``scale_loss``).
        hold_schedulers_on_skip (bool) [False]: when a step is skipped, the next
            ``step()`` of each LR scheduler attached to the optimizer does nothing, so the
            LR schedule advances only on real steps. Found by a garbage-collector scan
            (a few ms to tens of ms) on skipped steps only; ReduceLROnPlateau is never held.
            While held, a scheduler's class is a same-named subclass (``type(s)`` differs,
            ``isinstance`` holds); its ``state_dict()`` carries no trace of the hold.
        fast_kernels (bool) [True]: param groups built with ``foreach`` and ``fused``
            both unset (torch's defaults) step with torch's fastest kernel for the same
            optimizer: ``fused=True`` for Adam, AdamW, SGD and Adagrad, else
            ``foreach=True`` (see :mod:`ampkit.fast_step`); re-applied after
            ``optimizer.load_state_dict``. Results may differ from the per-parameter
            loop in the last bits. False leaves the optimizer exactly as built.
        doctor (bool | None) [None]: watch these optimizers with the process-wide
            :func:`ampkit.doctor` (``ampkit.doctor.current()`` returns it); ``None``: on
            when the environment variable ``AMPKIT_DOCTOR`` is ``1``. Off installs nothing.

    Returns the same optimizer object(s); their ``step()`` now skips itself on inf/NaN
    grads. Registers into the current AMP session (``ampkit.state_dict()``).
    """
    optimizers = _as_list(optimizer_or_list)
    if not optimizers:
        raise StateError("init_trainer: got no optimizer.")
    if not is_count(num_losses) or num_losses < 1:
        raise StateError(f"init_trainer: num_losses must be an int >= 1, got {num_losses!r}.")
    for flag, value in (("hold_schedulers_on_skip", hold_schedulers_on_skip), ("fast_kernels", fast_kernels)):
        if not isinstance(value, bool):
            raise StateError(f"init_trainer: {flag} must be True or False, got {value!r}.")
    if doctor is not None and not isinstance(doctor, bool):
        raise StateError(f"init_trainer: doctor must be True, False or None, got {doctor!r}.")
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise StateError(
                f"init_trainer: expected torch.optim.Optimizer objects, got {type(opt).__name__}."
            )
        if _ATTR in opt.__dict__:
            raise StateError(
                f"init_trainer: this {type(opt).__name__} is already managed by ampkit; call it "
                "once per optimizer (ampkit.reset() or ampkit.optim.release(opt) undoes it)."
            )
    if len({id(o) for o in optimizers}) != len(optimizers):
        raise StateError("init_trainer: the same optimizer appears twice in the list.")
    scalers = _build_scalers(_default_scale(optimizers) if scaler is None else scaler, int(num_losses))
    for i, s in enumerate(scalers):  # everything checked: from here on nothing fails
        if s.name == "loss scaler":
            s.name = f"loss scaler {i}"
    slots = [_LossSlot(s) for s in scalers]
    states = []
    for opt in optimizers:
        state = ManagedOptimizer(opt, slots, hold_schedulers_on_skip, fast_kernels)
        opt.__dict__[_ATTR] = state
        states.append(state)
    for slot in slots:
        slot.scaler._attached = True
    _session.current_session().register(Trainer(states, slots))
    if doctor or (doctor is None and os.environ.get("AMPKIT_DOCTOR", "").strip().lower() in _ON):
        from .doctor import attach_global

        attach_global(optimizers)
    return optimizer_or_list


def managed_state(optimizer: torch.optim.Optimizer) -> ManagedOptimizer:
    """The :class:`ManagedOptimizer` of an optimizer passed to :func:`init_trainer`;
    raises :class:`~ampkit.StateError` if ampkit does not manage it."""
    state = getattr(optimizer, "__dict__", {}).get(_ATTR)
    if state is None or not state._active:
        raise StateError(
            f"this {type(optimizer).__name__} is not managed by ampkit: pass it to "
            "ampkit.init_trainer (or ampkit.initialize) first."
        )
    return state


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

    Nothing happens at exit: grads stay scaled until ``ampkit.unscale`` or the
    optimizer's ``step()``, so several backward passes (gradient accumulation, DDP
    ``no_sync``) accumulate normally. All optimizers given must share ``loss_id``'s
    scaler (pass them to one ``init_trainer`` call).

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
    scaler = states[0]._slots[loss_id].scaler
    for state in states:
        state._check_before_backward()
    for state in states:
        state._before_backward(loss_id)
    if isinstance(loss_or_losses, torch.Tensor):
        scaled: Any = scaler.scale_loss(loss_or_losses)
    else:
        scaled = type(loss_or_losses)(scaler.scale_loss(loss) for loss in loss_or_losses)
    for observer in scale_loss_observers:
        observer(states, losses, loss_id, scaled)
    try:
        yield scaled
    except BaseException:
        # The backward may have stopped halfway; the next scale_loss checks whether the
        # user dropped the batch (see ManagedOptimizer._drop_abandoned_step).
        for state in states:
            state._aborted = True
        raise


def unscale(optimizer_or_list: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
    """Unscale the optimizer's grads now (in place, and check them for inf/NaN), e.g.
    before clipping. Idempotent until the next ``step()``; no host sync."""
    states = [managed_state(opt) for opt in _as_list(optimizer_or_list)]
    for state in states:
        state._unscale()


def step_skipped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's most recent step was skipped for inf/NaN grads (False
    before the first step). Works for optimizers managed by :func:`init_trainer` and
    for those stepped through :class:`ampkit.GradScaler`."""
    state = getattr(optimizer, "__dict__", {}).get(_ATTR)
    if state is not None and state._active:
        return state.last_skipped
    try:
        return _GRADSCALER_SKIPS[optimizer]
    except (KeyError, TypeError):
        raise StateError(
            f"step_skipped: ampkit has no step record for this {type(optimizer).__name__}; "
            "pass it to ampkit.init_trainer or step it with ampkit.GradScaler."
        ) from None


def stats(optimizer: torch.optim.Optimizer) -> StepStats:
    """The step counters and current scales of a managed optimizer (readable any time)."""
    return managed_state(optimizer).stats()


def _record_gradscaler_step(optimizer: torch.optim.Optimizer, skipped: bool) -> None:
    _GRADSCALER_SKIPS[optimizer] = skipped
