"""Steps skipped on the device: no host read of the step's found-inf flag inside ``step()``.

torch's fused optimizer kernels (Adam, AdamW, Adagrad, SGD with ``fused=True``) take the
step's found-inf flag as a tensor: when it is set, the kernel leaves the parameters and
the optimizer state as they were, on the device, with no host sync (the step counts are
raised and lowered again, an exact +1 - 1). ``fits`` tells whether a step can go that
way; ``step`` runs it so: the update with the flag, and the outcome (the skip
counters, the loss scalers' events, the extensions' ``after_step(skipped)``, the skip log)
left *pending*. ``settle`` records a pending outcome, reading the flag on the host
then: at the next ``scale_loss`` or ``step()`` of the optimizer (by then the device has
long passed the flag), or when anything asks for what it changes first (the
``skipped``/``last_skipped`` counters, ``amp.step_skipped``, ``amp.stats``, a loss
scaler's scale or state, a state dict, ``release``). What a reader sees is what the
host-decided step shows; only the moment the host learns it moves.

A step is decided on the host as before (one read of its flag in ``step()``) when any of
these holds: a parameter group is not fused (foreach and for-loop kernels take no flag),
the optimizer is not exactly one of the classes above, a parameter with a grad has no
optimizer state yet (a skipped first step must leave none, where the fused kernel would
create zeros), ``torch.amp.GradScaler`` steps it (it hands its own flag), the step is
compiled, process-wide optimizer step hooks are registered (they run on taken steps
only), the step has a closure or optimizer post-hooks, an extension acts around
the update or asks to be told at once (all but those with ``device_skip = True``: O2's
master weights and O2K's compensated updates hand the flag to their own kernels, and a
group they step entirely themselves need not be fused: ``StepExtension.own_groups``),
the ranks of a multi-process run agree on the step, or an overflow would make a loss
scaler raise
(:meth:`~ampkit.LossScaler.overflow_raises`: the scale at its floor, or the skip one past
``max_consecutive_skips``), so that :class:`~ampkit.NumericsError` comes from ``step()``
as always.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ampkit._internal import torch_compat
from ampkit.casting.engine import step_hook_installed

from .decision import Segment, decide
from .extensions import update_with
from .stats import flush_skip_reports

if TYPE_CHECKING:
    from .managed import ManagedOptimizer

__all__ = ["FOUND_INF_OPTIMIZERS", "fits", "step", "settle", "settle_on_state_dict"]

# Module state: the managed optimizers whose last step's outcome is pending (held weakly),
# recorded at interpreter exit if nothing asked before (a run whose last step was skipped).
_PENDING: weakref.WeakSet[ManagedOptimizer] = weakref.WeakSet()

#: Optimizer classes (exactly these) whose fused kernel takes a found-inf flag.
FOUND_INF_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.SGD,
)


def fits(state: ManagedOptimizer, closure: Callable[[], Any] | None, post_hooks: Sequence[Any]) -> bool:
    """Whether this step of ``state``'s optimizer can be skipped on the device (the
    module docstring lists what sends it to the host). No host sync."""
    opt = state.optimizer
    if closure is not None or post_hooks:
        return False
    if type(opt) not in FOUND_INF_OPTIMIZERS:  # their fused kernels take found_inf (torch >= 2.3)
        return False
    if "found_inf" in opt.__dict__ or "grad_scale" in opt.__dict__:
        return False  # torch.amp.GradScaler.step hands its own flag (and maybe the scale)
    if torch.compiler.is_compiling() or torch_compat.global_optimizer_step_hooks() > step_hook_installed():
        return False  # a compiled step; others' hooks of every step (taken ones only), not ours
    extensions = state.extensions
    if not all(ext.device_skip for ext in extensions):
        return False
    if any(scaler.overflow_raises() for scaler in state.scalers):
        return False  # the error is raised by the step that overflows, as on the host
    groups = opt.param_groups
    # torch's fused kernels take the flag; a group an extension steps entirely itself
    # needs none (but torch's foreach kernels refuse a flag: all one or all the other)
    if not all(group.get("fused") for group in groups):
        own: set[int] = set().union(*(ext.own_groups() for ext in extensions)) if extensions else set()
        if not all(id(group) in own for group in groups):
            return False
    # a parameter about to get its first state (an empty dict left by a read counts as
    # none) is stepped on the host: a skipped step must create none. SGD without
    # momentum keeps no state.
    have = opt.state
    return all(
        p.grad is None or have.get(p)
        for group in groups
        if not (type(opt) is torch.optim.SGD and group["momentum"] == 0)
        for p in group["params"]
    )


def _found(segments: Sequence[Segment]) -> torch.Tensor | None:
    """The step's found-inf flag as the fused kernels take it: a float32 0-dim tensor,
    1.0 when any segment overflowed, else 0.0; ``None`` when no segment has a flag."""
    flags = [flag for _, flag in segments if flag is not None]
    if not flags:
        return None
    if len(flags) == 1:
        return (flags[0] > 0).to(torch.float32)
    device = flags[0].device
    return (torch.stack([f.to(device, non_blocking=True).float() for f in flags]).amax() > 0).to(torch.float32)


def step(state: ManagedOptimizer, inner: Callable[..., Any], args: tuple, kwargs: dict, segments: list[Segment]) -> Any:
    """Run the optimizer's own step with the step's found-inf flag handed to its fused
    kernel (as ``torch.amp.GradScaler`` hands it: ``found_inf`` and ``grad_scale=None``,
    the grads being unscaled already) and leave the outcome pending on ``state``. If the
    step raises, the outcome is settled at once and the exception propagates."""
    opt = state.optimizer
    found = _found(segments)
    state.steps += 1
    state.pending_outcome = segments
    _PENDING.add(state)
    if found is not None:
        if all(group.get("fused") for group in opt.param_groups):  # else ampkit's kernels step every group
            opt.grad_scale, opt.found_inf = None, found  # type: ignore[attr-defined]
        state.skip_flag = found
    try:
        return update_with(state.extensions, inner, args, kwargs)
    except BaseException:
        settle(state)
        raise
    finally:
        state.skip_flag = None
        for name in ("grad_scale", "found_inf"):
            opt.__dict__.pop(name, None)


def settle(state: ManagedOptimizer) -> None:
    """Record ``state``'s pending outcome, if any: read the flag (one host read, of a
    step the device has finished by the time anything asks, in the usual loop), then
    count the step skipped or taken, report the loss ids' events to their scalers (may
    raise :class:`~ampkit.NumericsError`), note the skip log and run the extensions'
    ``after_step``. Nothing happens when nothing is pending."""
    segments = state.pending_outcome
    if segments is None:
        return
    state.pending_outcome = None
    _PENDING.discard(state)
    events, skipped = decide(segments, len(state.scalers))
    state.record_outcome(events, skipped)


@atexit.register
def _settle_at_exit() -> None:
    """At interpreter exit: record the outcomes still pending (a last step skipped on the
    device is counted and logged like any other), then log the skips no summary line has
    reported yet. Failures are logged, not raised: the process is ending."""
    for state in list(_PENDING):
        try:
            settle(state)
        except Exception as exc:  # NumericsError at the scale's floor, a device already gone
            logging.getLogger("ampkit").warning("ampkit: the last step's outcome at exit: %s", exc)
    flush_skip_reports()


def settle_on_state_dict(state: ManagedOptimizer) -> tuple[Any, Any]:
    """Hooks on ``state``'s optimizer that settle a pending outcome before its own
    ``state_dict()`` and ``load_state_dict()`` run (a scheduler held by ampkit may have
    stepped the learning rate ahead of a step that turns out skipped; a load must not
    be undone by the outcome of a step before it). Returns the two hook handles."""

    def before_save(optimizer: torch.optim.Optimizer) -> None:
        settle(state)

    def before_load(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        settle(state)

    opt = state.optimizer
    return opt.register_state_dict_pre_hook(before_save), opt.register_load_state_dict_pre_hook(before_load)
