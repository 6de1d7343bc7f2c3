"""The one extension interface of a managed step (:class:`StepExtension`) and the
process-wide registries the layers above the trainer plug into.

A :class:`StepExtension` has a few named hook points, all no-ops by default;
:meth:`ampkit.trainer.managed.ManagedOptimizer.add_extension` adds one to a managed
optimizer, and every extension of that optimizer runs, in registration order, at:

- :meth:`StepExtension.on_scale_loss` -- once per ``scale_loss`` that names the
  optimizer, after the loss is scaled and before the block runs;
- :meth:`StepExtension.before_check` -- once per step, before ampkit unscales and checks
  the step's grads for inf/NaN (by ``ampkit.unscale`` or by ``step()``);
- :meth:`StepExtension.before_update` / :meth:`StepExtension.after_update` -- around the
  optimizer's own ``step`` of a step that is taken (never around a skipped one);
- :meth:`StepExtension.after_step` -- once the step is taken (``skipped=False``) or
  skipped (``skipped=True``, also for a step a GradScaler outside ampkit skipped).

An extension with a :attr:`StepExtension.state_name` saves :meth:`StepExtension.state_dict`
with its optimizer in ``ampkit.state_dict()`` (the optimizer's extra state).

Process-wide, for the layers above the trainer (which it must not import):

- global extensions (:func:`add_global_extension`): told of every ``scale_loss``
  (the doctor counts scaled losses and backward passes there);
- named attachers (:func:`register_attacher`): what ``init_trainer(doctor=True)`` looks
  up by name (``ampkit.tools.diagnosis`` registers ``"doctor"`` when imported), each
  with the environment variable that turns it on (parsed here, once:
  :func:`env_enabled`);
- the default step agreement (:func:`set_default_agreement`) every optimizer managed
  from then on gets (``ampkit.distributed`` installs its own when imported).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ampkit.errors import StateError

if TYPE_CHECKING:
    from .decision import StepAgreement
    from .managed import ManagedOptimizer

__all__ = [
    "StepExtension",
    "AfterStep",
    "add_global_extension",
    "remove_global_extension",
    "global_extensions",
    "register_attacher",
    "attacher",
    "attacher_requested",
    "env_enabled",
    "set_default_agreement",
    "default_agreement",
]

_ON = ("1", "true", "yes", "on")


class StepExtension:
    """Something that joins every step of the managed optimizers it is added to
    (:meth:`ManagedOptimizer.add_extension <ampkit.trainer.managed.ManagedOptimizer.add_extension>`).
    Override the hook points you need; each default does nothing.

    Attributes:
        state_name (str | None): when set, :meth:`state_dict` is saved under this name
            with the optimizer in ``ampkit.state_dict()``, :meth:`check_state_dict`
            validates a saved value (changing nothing) and :meth:`load_state_dict`
            restores it. Default: ``None``."""

    state_name: str | None = None
    #: True: this extension is right also on a step skipped on the device
    #: (:mod:`ampkit.trainer.device_skip`): its :meth:`before_update` and
    #: :meth:`after_update` then run around an update whose outcome is not known yet, and
    #: :meth:`after_step` runs when the host records the outcome (at the next
    #: ``scale_loss`` or ``step()`` at the latest). False (the default) keeps every step
    #: of its optimizers decided on the host.
    device_skip: bool = False
    #: True: this extension's kernels read the grads the optimizer's own step would (O2's
    #: one-pass update, O2K's compensated update), so a scale handed to the optimizer for
    #: torch's fused kernel to apply (``torch.amp.GradScaler.step`` without ``unscale_``)
    #: would not reach them: such a step is refused before anything changes. Default: False.
    steps_grads_itself: bool = False

    def own_groups(self) -> set[int]:
        """On a step about to be decided on the device (asked right after
        :attr:`device_skip`): the ``id`` of each param group whose every grad this
        extension steps itself, handing the step's flag to its own kernels, so the
        optimizer's own step finds nothing to do there (its kernel then need not take a
        found-inf flag). Default: none."""
        return set()

    # --- hook points ----------------------------------------------------------------
    def on_scale_loss(
        self,
        optimizers: Sequence[ManagedOptimizer],
        losses: Sequence[torch.Tensor],
        loss_id: int,
        scaled: Any,
    ) -> None:
        """A ``scale_loss`` of ``losses`` (the unscaled loss tensors) for ``optimizers``
        (the managed states of the call) with ``loss_id``; ``scaled`` is what the block
        yields. Runs once per call even when the extension is on several of them."""

    def before_check(self) -> None:
        """Once per step, before its grads are unscaled and checked for inf/NaN."""

    def before_update(self, args: tuple, kwargs: dict) -> None:
        """A step is taken: right before the optimizer's own ``step(*args, **kwargs)``
        (``kwargs["closure"]`` holds the closure of a closure step)."""

    def after_update(self) -> None:
        """Right after the optimizer's own ``step`` of a taken step returned, or raised
        (then :meth:`on_error` follows, and :meth:`after_step` does not run)."""

    def on_error(self) -> None:
        """The optimizer's own ``step`` (or a later extension's :meth:`before_update`)
        raised, after this extension's :meth:`before_update` and :meth:`after_update`:
        leave the parameters consistent with whatever was stepped (the exception then
        propagates)."""

    def after_step(self, skipped: bool) -> None:
        """The step is over: taken (``skipped=False``, after :meth:`after_update`) or
        skipped for inf/NaN grads (``skipped=True``)."""

    def on_add(self, optimizer: ManagedOptimizer) -> None:
        """This extension was just added to ``optimizer`` (its state name registered):
        plug into what the optimizer exposes for it, e.g. its ``grad_path`` (where O2's
        master weights route the model's gradients) or ``backward_params``."""

    def on_remove(self, optimizer: ManagedOptimizer) -> None:
        """This extension was removed from ``optimizer``."""

    # --- state ------------------------------------------------------------------------
    def state_dict(self) -> Any:
        """What to save under :attr:`state_name` (only called when it is set)."""
        return None

    def check_state_dict(self, state: Any) -> None:
        """Raise an :class:`~ampkit.AmpError` if ``state`` cannot be loaded; change nothing."""

    def load_state_dict(self, state: Any) -> None:
        """Restore a :meth:`state_dict` already checked by :meth:`check_state_dict`."""

    # --- detaching --------------------------------------------------------------------
    def remove(self) -> None:
        """Remove this extension from every managed optimizer it was added to and from
        the global extensions."""
        for state in list(self.__dict__.get("_ampkit_owners", ())):
            state.remove_extension(self)
        remove_global_extension(self)


class AfterStep(StepExtension):
    """The extension that calls ``fn(skipped)`` once every step is over (taken:
    ``skipped=False``; skipped: ``True``)."""

    def __init__(self, fn: Callable[[bool], None]) -> None:
        self.fn = fn

    def after_step(self, skipped: bool) -> None:
        self.fn(skipped)


def _owners(ext: StepExtension) -> list[ManagedOptimizer]:
    """The managed optimizers ``ext`` is added to (kept on the extension)."""
    return ext.__dict__.setdefault("_ampkit_owners", [])


# --- global extensions (told of every scale_loss) --------------------------------------
# Module state: process-wide by design (the doctor started by AMPKIT_DOCTOR=1 watches
# every managed optimizer of the process).
_GLOBAL: list[StepExtension] = []


def add_global_extension(ext: StepExtension) -> None:
    """Tell ``ext`` of every ``scale_loss`` of the process (:meth:`StepExtension.on_scale_loss`),
    before the extensions of the call's optimizers. Adding it twice adds it once."""
    if not isinstance(ext, StepExtension):
        raise StateError(f"add_global_extension: expected a StepExtension, got {type(ext).__name__}.")
    if not any(e is ext for e in _GLOBAL):
        _GLOBAL.append(ext)


def remove_global_extension(ext: StepExtension) -> None:
    """Undo :func:`add_global_extension` (nothing if ``ext`` is not there)."""
    _GLOBAL[:] = [e for e in _GLOBAL if e is not ext]


def global_extensions() -> tuple[StepExtension, ...]:
    """The global extensions, in registration order."""
    return tuple(_GLOBAL)


# --- named attachers (init_trainer(doctor=True)) ---------------------------------------
#: name -> (attach(optimizers), environment variable that turns it on or None).
_ATTACHERS: dict[str, tuple[Callable[[Sequence[torch.optim.Optimizer]], Any], str | None]] = {}


def env_enabled(variable: str) -> bool:
    """Whether the environment variable ``variable`` is on (``1``/``true``/``yes``/``on``,
    any case, spaces around ignored)."""
    return os.environ.get(variable, "").strip().lower() in _ON


def register_attacher(
    name: str, attach: Callable[[Sequence[torch.optim.Optimizer]], Any], env: str | None = None
) -> None:
    """Make ``init_trainer(<name>=True)`` call ``attach(optimizers)`` on the optimizers it
    sets up; ``env``: the environment variable that does the same when the option is
    left at None. Registering a name again replaces it."""
    _ATTACHERS[name] = (attach, env)


def unregister_attacher(name: str) -> tuple[Callable[[Sequence[torch.optim.Optimizer]], Any], str | None] | None:
    """Remove the attacher ``name``; returns what was registered (``(attach, env)``),
    or None if nothing was, so a caller can put it back with :func:`register_attacher`."""
    return _ATTACHERS.pop(name, None)


def attacher(name: str) -> Callable[[Sequence[torch.optim.Optimizer]], Any]:
    """The attacher registered as ``name``; raises :class:`~ampkit.StateError` if none is."""
    entry = _ATTACHERS.get(name)
    if entry is None:
        raise StateError(
            f"init_trainer: {name}=True, but no {name!r} is registered (the package that "
            f"provides it was not imported); import ampkit (the whole package) before "
            f"asking for the {name}, or leave {name} unset."
        )
    return entry[0]


def attacher_requested(name: str, option: bool | None) -> bool:
    """Whether the attacher ``name`` should run: ``option`` when it is a bool, else its
    environment variable (False when ``name`` is not registered)."""
    if option is not None:
        return option
    entry = _ATTACHERS.get(name)
    return entry is not None and entry[1] is not None and env_enabled(entry[1])


# --- the default step agreement ----------------------------------------------------------
_AGREEMENT: list[StepAgreement | None] = [None]


def set_default_agreement(agreement: StepAgreement | None) -> None:
    """The :class:`~ampkit.trainer.decision.StepAgreement` every optimizer managed from
    now on gets (``ampkit.distributed`` installs its own when imported); None: each
    process decides alone."""
    _AGREEMENT[0] = agreement


def default_agreement() -> StepAgreement | None:
    """What :func:`set_default_agreement` installed last (None before)."""
    return _AGREEMENT[0]


def update_with(extensions: Sequence[StepExtension], inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run the optimizer's own ``inner(*args, **kwargs)`` between the ``before_update``
    and ``after_update`` of ``extensions`` (in order); returns what it returns. When it,
    or a ``before_update``, raises halfway (an optimizer hook, a param group it refuses,
    ...), what the extensions took off goes back (``after_update`` of those started),
    each leaves the parameters consistent with what was stepped (``on_error``), and the
    exception propagates."""
    started: list[StepExtension] = []
    try:
        for ext in extensions:
            ext.before_update(args, kwargs)
            started.append(ext)
        result = inner(*args, **kwargs)
    except BaseException:
        for ext in started:
            ext.after_update()
        for ext in started:
            ext.on_error()
        raise
    for ext in extensions:
        ext.after_update()
    return result
