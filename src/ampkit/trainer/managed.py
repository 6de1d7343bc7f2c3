"""The step wrapper of one managed optimizer (:class:`ManagedOptimizer`): it takes or
skips each step on the skip decision (:mod:`ampkit.trainer.decision`), feeds the loss
scalers, runs its extensions (:mod:`ampkit.trainer.extensions`), and keeps the counters
and checkpoints. The per-step gradient bookkeeping it decides on is in
:mod:`ampkit.trainer.step_grads`; the public functions are in :mod:`ampkit.trainer.api`,
where how a step runs is told."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ampkit._internal import torch_compat
from ampkit._internal.validate import MAX_COUNT, is_count, require_flag
from ampkit.errors import NumericsError, StateError
from ampkit.scaling.loss_scaler import LossScaler

from . import device_skip
from .decision import Agreement, Segment, StepAgreement, decide
from .extensions import StepExtension, _owners, update_with
from .fused_step import SparseWatch, use_fastest_kernel
from .grad_hooks import GradPath
from .schedulers import mark_step_called
from .session import ExtraRegister, ExtraState, require_keys
from .stats import StepStats
from .step_grads import StepGrads, StepStage
from .torch_scaler import refuse_scaled_handoff, refuse_unseen_torch_unscale

__all__ = [
    "ManagedOptimizer",
    "StepStage",
    "last_skipped",
    "managed_state",
    "record_unmanaged_step",
    "resolve_optimizer",
]

if TYPE_CHECKING:
    from .loss_slots import LossSlot

_ATTR = "_ampkit_managed"
_MISSING = object()


def _settled(name: str, doc: str) -> Any:
    """A counter of :class:`ManagedOptimizer` kept in attribute ``name``, read and set
    after a step skipped on the device is settled (``device_skip.settle``)."""

    def get(self: ManagedOptimizer) -> Any:
        device_skip.settle(self)
        return getattr(self, name)

    def put(self: ManagedOptimizer, value: Any) -> None:
        device_skip.settle(self)
        setattr(self, name, value)

    return property(get, put, doc=doc + " Settles a step skipped on the device first.")


# A managed step is ampkit's bookkeeping around the optimizer's own: never traced. Under
# ``torch.compile(opt.step)`` (or a compiled function calling it) it runs eagerly at a
# graph break, as on every torch release (torch 2.9's Dynamo failed inside it).
_step_outside_dynamo = torch_compat.run_outside_dynamo(
    lambda state, inner, args, kwargs: state._step(inner, args, kwargs))  # fmt: skip


class ManagedOptimizer:
    """ampkit's state for one managed optimizer; get it with :func:`managed_state`.

    Extension points (used by fp32 master weights, compensated updates, scheduler
    holds, the doctor, ``ampkit run``):

    - :meth:`add_extension` / :meth:`remove_extension` / :attr:`extensions`: the
      :class:`~ampkit.trainer.extensions.StepExtension` objects that join every step,
      in registration order, at their named hook points (``on_scale_loss``,
      ``before_check``, ``before_update``, ``after_update``, ``after_step(skipped)``).
    - ``scalers``: ``list[LossScaler]``, one per ``loss_id`` (shared with the other
      optimizers of the same ``init_trainer`` call).
    - ``grad_path``: the :class:`ampkit.trainer.grad_hooks.GradPath` whose hooks keep
      grads real (unscaled) as backward produces them; fp32 master weights plug in there.
    - ``agreement``: the :class:`ampkit.trainer.decision.StepAgreement` that makes the
      ranks of a multi-process run decide alike (the default one of
      :func:`ampkit.trainer.extensions.set_default_agreement`, which
      ``ampkit.distributed`` installs; set by ``init_trainer``); ``None``: this process
      decides alone.
    - ``step_grads``: the step's gradient bookkeeping
      (:class:`~ampkit.trainer.step_grads.StepGrads`); unscaling and the check act on the
      grads of the params *currently* in ``optimizer.param_groups`` (:meth:`grad_params`):
      swap master params in there and their grads are what gets checked and stepped.
    - ``backward_params``: ``Iterable[Tensor] | None``, the tensors whose ``.grad``
      backward accumulates into, when these are not the params in ``param_groups``
      (master weights: the model's params). Iterated afresh each time it is needed, so a
      live view is fine. The gradient hooks go on these (set it before the first
      ``scale_loss``); ``None``: the params in ``param_groups``.
    - :meth:`register_extra_state`: extra per-optimizer state saved in and restored from
      ``ampkit.state_dict()``.
    - :attr:`stage`: where the current step stands (:class:`~ampkit.trainer.step_grads.StepStage`).

    Counters: ``steps``, ``skipped``, ``last_skipped`` (see :class:`StepStats`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        slots: list[LossSlot],
        agreement: StepAgreement | None = None,
        fast_kernels: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self._slots = slots
        self.scalers: list[LossScaler] = [slot.scaler for slot in slots]
        self._extensions: list[StepExtension] = []
        self.backward_params: Iterable[torch.Tensor] | None = None
        self.agreement = agreement
        self.steps = 0
        self._skipped = 0
        self._last_skipped = False
        #: the segments of a step skipped on the device whose outcome the host has not
        #: recorded yet (:mod:`ampkit.trainer.device_skip`)
        self.pending_outcome: list[Segment] | None = None
        #: while the update of a step decided on the device runs: its found-inf flag
        #: (0-dim float32, > 0: skipped), for extensions that run kernels of their own
        #: (``before_update``); None otherwise
        self.skip_flag: torch.Tensor | None = None
        self._extra = ExtraState("extra optimizer state", "this run")
        self._active = True
        self.step_grads = StepGrads(self, slots)
        self._previous_step: Any = _MISSING
        self._previous_zero_grad: Any = _MISSING
        self._previous_add_param_group: Any = _MISSING
        #: called with the params of a group ``add_param_group`` is about to add (a list),
        #: before torch adds it; one that raises refuses the group (O2's masters: a
        #: parameter they stand for already)
        self.group_checks: list[Callable[[list[torch.Tensor]], None]] = []
        self._install_step()
        self._install_zero_grad()
        self._install_add_param_group()
        # Hooks that make grads real as backward produces them (ampkit.trainer.grad_hooks).
        self.grad_path = GradPath(self)
        self.grad_path.refresh()
        # torch's fastest kernel for groups left at foreach=None/fused=None, again after
        # a load_state_dict brings back groups saved with both unset.
        self.kernels: list[str] = []
        #: called with the optimizer and the indices of the groups a choice just covered
        #: (at the first step of groups added later): O2K fuses their fp32 rest
        self.kernel_listeners: list[Callable[[torch.optim.Optimizer, list[int]], None]] = []
        self._kernel_hook: Any = None
        self._kernel_pre_hook: Any = None
        self._owned: list[bool] | None = None  # per group, before a load: whether ampkit chooses its kernel
        self._sparse = SparseWatch()  # Adagrad: a fused group with sparse grads goes back to torch's kernel
        if fast_kernels:
            self._choose_kernels(optimizer)
            self._kernel_pre_hook = optimizer.register_load_state_dict_pre_hook(self._before_load)
            self._kernel_hook = optimizer.register_load_state_dict_post_hook(self._after_load)
        # groups added later (add_param_group) get it at their first step, as a load
        # would give it to them: a resumed run steps them with the kernel the first run used
        self._kernel_groups = len(optimizer.param_groups)
        # the optimizer's own state_dict/load_state_dict see a pending outcome recorded
        self._settle_hooks = device_skip.settle_on_state_dict(self)

    skipped = _settled("_skipped", "Steps skipped so far (int).")
    last_skipped = _settled("_last_skipped", "Whether the last step was skipped (bool).")

    # --- the step's grads (step_grads), for extensions -------------------------------
    @property
    def stage(self) -> StepStage:
        """Where the current step stands (:class:`~ampkit.trainer.step_grads.StepStage`)."""
        return self.step_grads.stage

    def grad_params(self) -> Iterator[torch.Tensor]:
        """The params whose grads the step unscales, checks and steps (``param_groups``)."""
        return self.step_grads.grad_params()

    def segment_flags(self) -> list[torch.Tensor]:
        """The found-inf flags of this step's segments checked so far (no host sync)."""
        return self.step_grads.segment_flags()

    def add_segment(self, found: torch.Tensor) -> None:
        """Add a found-inf flag (0-dim, > 0 skips the step) blaming no loss scaler."""
        self.step_grads.add_segment(found)

    # --- extension API ---------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether ampkit still manages the optimizer (False after :meth:`release`)."""
        return self._active

    @property
    def extensions(self) -> tuple[StepExtension, ...]:
        """The extensions of this optimizer, in registration (and running) order."""
        return tuple(self._extensions)

    def add_extension(self, ext: StepExtension) -> StepExtension:
        """Run ``ext`` at the named points of every step of this optimizer, after the
        extensions added before it; with a ``state_name``, its state is saved with the
        optimizer (raises :class:`~ampkit.StateError` if that name is taken); then call
        its ``on_add``. Adding one extension twice adds it once. Returns ``ext``."""
        if not isinstance(ext, StepExtension):
            raise StateError(f"add_extension: expected a StepExtension, got {type(ext).__name__}.")
        if any(e is ext for e in self._extensions):
            return ext
        device_skip.settle(self)  # a step before it is none of its business
        if ext.state_name is not None:
            self._extra.register(ext.state_name, ext.state_dict, ext.load_state_dict, ext.check_state_dict)
        self._extensions.append(ext)
        _owners(ext).append(self)
        ext.on_add(self)
        return ext

    def remove_extension(self, ext: StepExtension) -> None:
        """Stop running ``ext`` here (its saved state goes too) and call its
        ``on_remove``; nothing if it is not an extension of this optimizer."""
        if not any(e is ext for e in self._extensions):
            return
        self._extensions = [e for e in self._extensions if e is not ext]
        owners = _owners(ext)
        owners[:] = [s for s in owners if s is not self]
        name = ext.state_name
        if name is not None:
            self._extra.items.pop(name, None)
        ext.on_remove(self)

    def _after_step(self, skipped: bool) -> None:
        for ext in tuple(self._extensions):
            ext.after_step(skipped)

    @property
    def register_extra_state(self) -> ExtraRegister:
        """``register_extra_state(name, get_fn, set_fn, check_fn=None)``: save
        ``get_fn()`` under ``name`` with this optimizer in ``ampkit.state_dict()``
        (:meth:`ampkit.trainer.session.ExtraState.register`)."""
        return self._extra.register

    # --- the step wrapper ------------------------------------------------------------
    def _install_step(self) -> None:
        opt = self.optimizer
        self._previous_step = opt.__dict__.get("step", _MISSING)
        inner = opt.step  # the class's step (bound) or a wrapper set on the instance
        state = self

        def step(self_opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return _step_outside_dynamo(state, inner, args, kwargs)

        functools.update_wrapper(
            step, type(opt).step, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=()
        )
        if torch_compat.step_wrapped_by_lr_scheduler(inner):
            # A scheduler created before us wrapped `step`; keep its marker. We set
            # `_opt_called` ourselves on every call, so the marker stays truthful.
            torch_compat.mark_step_wrapped_by_lr_scheduler(step)
        self._step_function = step
        opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]

    def _install_zero_grad(self) -> None:
        """``optimizer.zero_grad()`` clears (or zeroes) the masters' grads under O2; the
        wrapper then shows the same on the model's 16-bit grads at once, as torch's
        own ``zero_grad`` would, instead of at the next backward or step (code that
        reads ``model.parameters()`` grads in between would see the old gradient)."""
        opt = self.optimizer
        self._previous_zero_grad = opt.__dict__.get("zero_grad", _MISSING)
        inner = opt.zero_grad
        state = self

        def zero_grad(self_opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if not state._active:
                return inner(*args, **kwargs)
            state.grad_path.before_zero_grad()
            result = inner(*args, **kwargs)
            set_to_none = kwargs.get("set_to_none", args[0] if args else True)
            state.grad_path.after_zero_grad(bool(set_to_none))
            return result

        functools.update_wrapper(
            zero_grad, type(opt).zero_grad, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=()
        )
        self._zero_grad_function = zero_grad
        opt.zero_grad = types.MethodType(zero_grad, opt)  # type: ignore[method-assign]

    def _install_add_param_group(self) -> None:
        """``add_param_group`` runs :attr:`group_checks` on the new group's params first
        (each may refuse it: nothing is added). A group added gets its kernel at its
        first step (:meth:`_choose_kernels`); until then the optimizer does not say it takes
        ``grad_scale``/``found_inf`` (torch's ``_step_supports_amp_scaling``, set by
        :func:`~ampkit.trainer.fused_step.use_fastest_kernel` when every group is fused):
        a ``torch.amp.GradScaler`` would hand them to a group not fused (torch's
        for-loop kernel refuses them)."""
        opt = self.optimizer
        self._previous_add_param_group = opt.__dict__.get("add_param_group", _MISSING)
        inner = opt.add_param_group
        state = self

        def add_param_group(self_opt: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
            params = param_group.get("params") if isinstance(param_group, dict) else None
            if state._active and state.group_checks and params is not None and not isinstance(params, set):
                # (a set: torch's own TypeError) a list, as torch makes it, for the checks to read
                params = param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
                for check in state.group_checks:
                    check(params)
            inner(param_group)
            if state._active:
                self_opt.__dict__.pop("_step_supports_amp_scaling", None)  # set again once every group is fused

        functools.update_wrapper(add_param_group, type(opt).add_param_group,
                                 assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())  # fmt: skip
        self._add_param_group_function = add_param_group
        opt.add_param_group = types.MethodType(add_param_group, opt)  # type: ignore[method-assign]

    def release(self) -> None:
        """Stop managing the optimizer: its previous ``step``, ``zero_grad`` and ``add_param_group`` come back
        (if something wrapped ours since, ours stays but only forwards)."""
        if not self._active:
            return
        device_skip.settle(self)
        self._active = False
        self.grad_path.remove()
        for hook in (self._kernel_hook, self._kernel_pre_hook, *self._settle_hooks):
            if hook is not None:
                hook.remove()
        opt = self.optimizer
        for name, ours, previous in (
            ("step", self._step_function, self._previous_step),
            ("zero_grad", self._zero_grad_function, self._previous_zero_grad),
            ("add_param_group", self._add_param_group_function, self._previous_add_param_group),
        ):
            if getattr(opt.__dict__.get(name), "__func__", None) is ours:
                if previous is _MISSING:
                    del opt.__dict__[name]
                else:
                    setattr(opt, name, previous)
        if opt.__dict__.get(_ATTR) is self:
            del opt.__dict__[_ATTR]
        for slot in self._slots:
            slot.owed = [s for s in slot.owed if s is not self]

    def _choose_kernels(self, optimizer: torch.optim.Optimizer, owned: list[bool] | None = None) -> None:
        """torch's fastest kernel for the groups with ``foreach`` and ``fused`` unset
        (:func:`~ampkit.trainer.fused_step.use_fastest_kernel`), recorded in ``kernels``
        (in place); a group whose kernel is ampkit's (``owned``, by default
        :meth:`_ampkit_groups` of now) but was set before reads what its flags hold.
        The listeners are told of the groups new since the last choice."""
        if owned is None:
            owned = self._ampkit_groups(optimizer)
        known = len(self.kernels)
        choices = use_fastest_kernel(optimizer)
        for i, group in enumerate(optimizer.param_groups):
            if choices[i] == "as built" and i < len(owned) and owned[i]:
                choices[i] = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "as built"
        self.kernels[:] = choices
        if known and len(choices) > known:  # groups added since (add_param_group)
            for listener in self.kernel_listeners:
                listener(optimizer, list(range(known, len(choices))))
        self._kernel_groups = len(choices)
        self._sparse.arm(optimizer, self.kernels)

    def _ampkit_groups(self, optimizer: torch.optim.Optimizer) -> list[bool]:
        """Per param group, whether its kernel is ampkit's to choose: chosen by it
        before, or ``foreach`` and ``fused`` still unset as built."""
        kernels = self.kernels
        return [(i < len(kernels) and kernels[i] in ("fused", "foreach"))
                or (g.get("fused") is None and g.get("foreach") is None)
                for i, g in enumerate(optimizer.param_groups)]  # fmt: skip

    def _before_load(self, optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        self._owned = self._ampkit_groups(optimizer)  # before the load overwrites the flags

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        # the loaded groups bring their saved flags: those saved unset get the choice
        # again; ampkit's groups read what they hold now (a group saved fused is fused)
        owned, self._owned = self._owned or [], None
        self._choose_kernels(optimizer, owned)

    def _step(self, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        opt = self.optimizer
        device_skip.settle(self)  # the previous step's outcome, if still pending
        mark_step_called(opt)
        if not self._active:
            return inner(*args, **kwargs)
        if self._kernel_hook is not None and len(opt.param_groups) != self._kernel_groups:
            self._choose_kernels(opt)
        if self.grad_path.masters is not None:
            refuse_unseen_torch_unscale(self.grad_path, opt)
        if "grad_scale" in opt.__dict__ and any(ext.steps_grads_itself for ext in self._extensions):
            refuse_scaled_handoff(opt)  # torch's GradScaler without unscale_: the grads still scaled
        # The optimizer's own step hooks keep torch's contract around ampkit's work:
        # pre-hooks run first, on every call as torch runs them, before anything is
        # checked or updated -- what they do to the grads (on the model or the
        # optimizer's params) is what the check reads and the step uses, on every rank
        # in the one agreed decision; one that raises leaves everything as it was.
        # Post-hooks run after a taken step, with the grads shown as the step used them.
        # Inside, the optimizer's step runs without them.
        pre_hooks, post_hooks = torch_compat.optimizer_step_hooks(opt)
        if pre_hooks:
            args, kwargs = _run_pre_hooks(opt, pre_hooks, args, kwargs)
        closure, args, kwargs = _pop_closure(args, kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sparse.check(opt, self.kernels)  # the grads of this step are there now
        grads = self.step_grads
        was_unscaled = grads.unscaled
        grads.unscale()
        if was_unscaled:
            grads.check_edits()
        segments, agreement = self._segments()
        if agreement is None and device_skip.fits(self, closure, post_hooks):
            self.grad_path.before_step()
            try:
                with torch_compat.instance_step_hooks_suspended(opt):
                    return device_skip.step(self, inner, args, kwargs, segments)
            finally:
                self.grad_path.after_step()
        events, skip = decide(segments, len(self._slots), agreement)
        shown = False

        def updated() -> None:
            # right after the update, before the held schedulers step: the grads shown
            # again (O2), then the post-hooks, as torch runs them inside step()
            nonlocal shown
            self.grad_path.after_step()
            shown = True
            hook_kwargs = kwargs if closure is None else {**kwargs, "closure": closure}
            for hook in post_hooks:
                hook(opt, args, hook_kwargs)

        try:
            self.grad_path.before_step()
            with torch_compat.instance_step_hooks_suspended(opt):
                return self._take_or_skip(inner, args, kwargs, closure, loss, events, skip, updated if post_hooks else None)
        finally:
            if not shown:
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
        updated: Callable[[], None] | None = None,
    ) -> Any:
        self.steps += 1
        if skip:
            self.record_outcome(events, True)
            return loss
        self.record_outcome(events, False, after_step=False)
        if closure is not None:
            kwargs = {**kwargs, "closure": self._replay_closure(closure, loss)}
        result = update_with(tuple(self._extensions), inner, args, kwargs)
        if updated is not None:
            updated()
        self._after_step(False)
        return result

    def record_outcome(self, events: dict[int, bool | None], skipped: bool, after_step: bool = True) -> None:
        """Record a decided step (already counted in ``steps``): the skip counters, the
        loss ids' events to their scalers (may raise :class:`~ampkit.NumericsError`; the
        step stays as decided), the skip log, and unless ``after_step=False`` the
        extensions' ``after_step(skipped)`` (first, for a skipped step)."""
        self._skipped += skipped
        self._last_skipped = skipped
        if skipped:  # its grads, if kept for the next step, hold what the check found
            self.grad_path.forget_checks()
        if skipped and after_step:
            self._after_step(True)
        try:
            self._report(events)  # clean events never raise
        finally:
            self._slots[0].skips.note(self, skipped=skipped)
        if not skipped and after_step:
            self._after_step(False)

    def skipped_elsewhere(self) -> None:
        """A step that a GradScaler outside ampkit skipped without calling
        ``optimizer.step()`` (torch.amp.GradScaler found inf/NaN grads): counted as a
        skipped step, as if ampkit had decided it (counters, skip hooks; LR schedulers
        see a called step), and the next backward starts a fresh step."""
        device_skip.settle(self)
        mark_step_called(self.optimizer)
        self.step_grads.start_fresh_step()
        self.steps += 1
        self._skipped += 1
        self._last_skipped = True
        self._after_step(True)

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
            self.step_grads.unscale()
            masters = self.grad_path.masters
            if masters is not None:
                # The optimizer reads its (fp32 master) params' grads right after this
                # call: held 16-bit grads (master_grads="on_demand") become fp32 ones now.
                masters.materialize()
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

    def _resolve_step(self) -> tuple[dict[int, bool | None], bool]:
        """Read this step's found-inf flags (the step's one host sync) and attribute them
        to loss ids (:func:`ampkit.trainer.decision.decide`, agreed across ranks when the
        ``agreement`` asks). Returns ({loss_id: True/False/None(unknown)}, skip)."""
        segments, agreement = self._segments()
        return decide(segments, len(self._slots), agreement)

    def _segments(self) -> tuple[list[Segment], Agreement | None]:
        """This step's checked segments (taken off the step's grads) and the agreement
        the ranks run over them (None: this process decides alone)."""
        segments = self.step_grads.take_segments()
        plugin = self.agreement
        return segments, plugin.agreement(self, segments) if plugin is not None else None

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

    # --- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "skipped": self.skipped,
            "last_skipped": self.last_skipped,
            "extra": self._extra.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any], where: str) -> None:
        self.prepare_load(state_dict, where)()

    def prepare_load(self, state_dict: Any, where: str) -> Callable[[], None]:
        """Validate a :meth:`state_dict` (counters, extra state via the ``check_fn`` of
        each :meth:`register_extra_state`); return the function that loads it."""
        device_skip.settle(self)  # a pending outcome belongs to the run before the load
        require_keys(state_dict, ("steps", "skipped", "last_skipped"), where, optional=("extra",))
        steps, skipped, last = state_dict["steps"], state_dict["skipped"], state_dict["last_skipped"]
        if not (is_count(steps) and is_count(skipped) and 0 <= skipped <= steps <= MAX_COUNT):
            raise StateError(
                f"{where}: steps={steps!r}, skipped={skipped!r} are not step counters (ints, "
                "0 <= skipped <= steps < 2**63); pass the dict returned by ampkit.state_dict()."
            )
        require_flag(last, f"{where}: last_skipped", StateError)
        extra = state_dict.get("extra", {})
        self._extra.check_names(extra, f"{where}: ", " (e.g. master weights on or off)")
        self._extra.check_values(extra, where)

        def apply() -> None:
            self.steps = int(steps)
            self._skipped, self._last_skipped = int(skipped), last
            self.step_grads.start_fresh_step()
            self._extra.load(extra)

        return apply

    def stats(self) -> StepStats:
        return StepStats(
            steps=self.steps,
            skipped=self.skipped,
            last_skipped=self.last_skipped,
            scales=tuple(s.scale for s in self.scalers),
            overflows=tuple(s.num_overflows for s in self.scalers),
        )


#: How many ``.optimizer`` links :func:`resolve_optimizer` follows at most.
_WRAPPER_DEPTH = 8


def _chain(obj: Any) -> list[Any]:
    """``obj`` and the objects down its ``.optimizer`` links (at most ``_WRAPPER_DEPTH``)."""
    chain = [obj]
    for _ in range(_WRAPPER_DEPTH):
        inner = getattr(chain[-1], "optimizer", None)
        if inner is None or any(inner is c for c in chain):
            break
        chain.append(inner)
    return chain


def resolve_optimizer(obj: Any) -> Any:
    """The optimizer ampkit knows behind ``obj``: ``obj`` itself, or, for a framework's
    wrapper that exposes the optimizer it wraps as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``; wrappers of wrappers
    too), the first object down that chain that ampkit manages, else the first with a
    step record of :class:`ampkit.GradScaler`, else the innermost
    ``torch.optim.Optimizer`` (``obj`` if the chain holds none), so errors name the
    optimizer ampkit looked at. Every public function that takes a managed optimizer
    resolves it here."""
    chain = _chain(obj)
    dicts = [getattr(c, "__dict__", None) for c in chain]
    dicts = [d if isinstance(d, dict) else {} for d in dicts]
    for c, d in zip(chain, dicts):
        state = d.get(_ATTR)
        if state is not None and state._active:
            return c
    for c, d in zip(chain, dicts):
        if _GRADSCALER_ATTR in d:
            return c
    optimizers = [c for c in chain if isinstance(c, torch.optim.Optimizer)]
    return optimizers[-1] if optimizers else obj


def _active_state(optimizer: Any) -> ManagedOptimizer | None:
    """The active :class:`ManagedOptimizer` of ``optimizer`` (or of the optimizer its
    wrapper holds), or None."""
    state = getattr(resolve_optimizer(optimizer), "__dict__", {}).get(_ATTR)
    return state if state is not None and state._active else None


def managed_state(optimizer: torch.optim.Optimizer) -> ManagedOptimizer:
    """The :class:`ManagedOptimizer` of an optimizer passed to :func:`init_trainer`, or
    of the optimizer a framework's wrapper holds (:func:`resolve_optimizer`); raises
    :class:`~ampkit.StateError` if ampkit does not manage it."""
    state = _active_state(optimizer)
    if state is None:
        resolved = resolve_optimizer(optimizer)
        what = type(optimizer).__name__
        if resolved is not optimizer:
            what += f" (and the {type(resolved).__name__} it wraps as .optimizer)"
        raise StateError(
            f"this {what} is not managed by ampkit: pass the optimizer to "
            "ampkit.init_trainer (or ampkit.initialize) first."
        )
    return state


_GRADSCALER_ATTR = "_ampkit_gradscaler_skipped"


def record_unmanaged_step(optimizer: torch.optim.Optimizer, skipped: bool) -> None:
    """Note the skip decision of an optimizer ampkit does not manage but stepped
    (:class:`ampkit.GradScaler`), for :func:`last_skipped`. Kept on the optimizer."""
    optimizer.__dict__[_GRADSCALER_ATTR] = skipped


def last_skipped(optimizer: torch.optim.Optimizer) -> bool | None:
    """Whether the last step of ``optimizer`` was skipped: from its managed state, or
    from :func:`record_unmanaged_step`; None when ampkit has no record of it."""
    found = getattr(resolve_optimizer(optimizer), "__dict__", {})
    state = found.get(_ATTR)
    if state is not None and state._active:
        return state.last_skipped
    return found.get(_GRADSCALER_ATTR)


def _run_pre_hooks(
    opt: torch.optim.Optimizer, hooks: list[Callable[..., Any]], args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """Run the optimizer's step pre-hooks as torch's step wrapper does: each may return
    ``(new_args, new_kwargs)``."""
    for hook in hooks:
        result = hook(opt, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"{hook} must return None or a tuple of (new_args, new_kwargs), but got {result}.")
            args, kwargs = result
    return args, kwargs


def _pop_closure(args: tuple, kwargs: dict) -> tuple[Callable[[], Any] | None, tuple, dict]:
    if "closure" in kwargs:
        kwargs = dict(kwargs)
        return kwargs.pop("closure"), args, kwargs
    if args:
        return args[0], args[1:], kwargs
    return None, args, kwargs
