"""O2's step: the fp32 masters of :class:`~ampkit.levels.master.MasterWeights` on a
managed optimizer (:class:`MasterStep`, the one step extension of the level), stepped in
one pass from the model's 16-bit grads where :mod:`ampkit.levels.one_pass` has a kernel
for their param group."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ampkit.trainer.extensions import StepExtension
from ampkit.trainer.optimizer_rules import StepCounts

from . import one_pass
from .master import MasterWeights

__all__ = ["MasterStep"]


class _GroupPlan(NamedTuple):
    """One param group's part of an O2 step that ampkit's kernels take (:class:`MasterStep`)."""

    group: dict
    rule: Any
    items: list  # (master, model parameter, 16-bit grad): one_pass.select
    own: bool  # every grad of the group is stepped here


class MasterStep(StepExtension):
    """fp32 master weights (O2) on a managed step. Right before the optimizer's own
    step, the masters whose grads are held in 16 bits (``master_grads="on_demand"``)
    are stepped in one pass where :mod:`ampkit.levels.one_pass` has a kernel for their
    param group (their placeholder grads are taken off for the optimizer's step, which
    then skips them, and put back after it); the other held grads get their fp32
    copies for the optimizer. Right after the optimizer's step the masters not written
    by the one pass are copied back into the model. Saved as ``"master_weights"`` with
    the optimizer. Added to the optimizer, it routes the model's gradients into the
    masters (:meth:`on_add`).

    Right on a step skipped on the device (:mod:`ampkit.trainer.device_skip`): the
    one-pass kernels take the step's found-inf flag and leave masters, state and model
    weights as they were where it is set; the optimizer's own (fused) step takes the
    same flag; copying an unchanged master back writes the model weight it already
    holds (the model weights are the masters rounded when the step starts: the masters
    take in edits of the model first); the step counters the one pass advanced are
    settled when the outcome is known."""

    state_name = "master_weights"
    steps_grads_itself = True  # the one-pass kernels read the model's grads

    def __init__(self, masters: MasterWeights, models: list[nn.Module]) -> None:
        self.masters = masters
        self.models = models
        self._written: set[int] = set()
        self._lifted: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._counts: list[StepCounts] = []
        self._managed: Callable[[], Any] = lambda: None
        self._plan: list[_GroupPlan] | None = None  # made by device_skip for the update right after
        self._held = 0  # how many held grads the last plan saw
        self._load_hook: Any = None

    def on_add(self, optimizer: Any) -> None:
        # backward accumulates into the model's parameters, which the masters stand for;
        # the gradient path routes their grads into the masters' (grad_hooks)
        optimizer.backward_params = self.masters.backward_params()
        optimizer.grad_path.set_masters(self.masters.route, self.models)
        self._managed = weakref.ref(optimizer)
        # parameters added since (add_param_group) get their masters before torch's
        # load_state_dict casts the saved state to the dtype of the parameters it finds:
        # found 16-bit, the fp32 moments would be rounded on the way in
        masters, managed = weakref.ref(self.masters), self._managed

        def masters_first(opt: torch.optim.Optimizer, state_dict: Any) -> None:
            mw, state = masters(), managed()
            if mw is not None and state is not None and state.active:  # not after a release
                mw.refresh()

        self._load_hook = self.masters.optimizer.register_load_state_dict_pre_hook(masters_first)
        # a model parameter that has a master already, added again (add_param_group): torch's
        # own check compares it with the masters and lets it through, and a second master
        # would be made for it, the first one still stepped; refused before torch adds the group
        optimizer.group_checks.append(self.masters.check_new_params)

    def on_remove(self, optimizer: Any) -> None:
        if self._load_hook is not None:
            self._load_hook.remove()
            self._load_hook = None
        optimizer.group_checks[:] = [c for c in optimizer.group_checks if c != self.masters.check_new_params]

    @property  # type: ignore[override]
    def device_skip(self) -> bool:  # asked once per step, right before the update
        self._plan = self._make_plan()
        return True

    def own_groups(self) -> set[int]:
        return {id(gp.group) for gp in self._plan or () if gp.own}

    def _make_plan(self) -> list[_GroupPlan]:
        """Per param group with an optimizer rule: the held grads its one pass steps;
        whether that is every grad of the group."""
        mw = self.masters
        held = mw.grads.held()
        self._held = len(held)
        if not held:
            return []
        opt = mw.optimizer
        model_of = {id(m): p for m, p in held}
        plan = []
        for group in opt.param_groups:
            rule = one_pass.rule_for(opt, group)
            if rule is None:
                continue
            items = one_pass.select(opt, group, rule, model_of)
            stepped = {id(m) for m, _, _ in items}
            own = bool(items) and all(p.grad is None or id(p) in stepped for p in group["params"])
            plan.append(_GroupPlan(group, rule, items, own))
        return plan

    def before_update(self, args: tuple, kwargs: dict) -> None:
        self._written = set()
        plan, self._plan = self._plan, None
        mw = self.masters
        if args or kwargs:  # a closure (or other arguments): the optimizer steps everything
            mw.grads.materialize()
            return
        managed = self._managed()
        skip = managed.skip_flag if managed is not None else None
        if skip is None or plan is None:  # decided on the host: the plan of now
            plan = self._make_plan()
        opt = mw.optimizer
        written: list[tuple[nn.Parameter, torch.Tensor]] = []
        for gp in plan:
            self._counts += one_pass.step_params(opt, gp.group, gp.rule, gp.items, skip=skip)
            written.extend((m, p) for m, p, _ in gp.items)
        self._written = {id(m) for m, _ in written}
        mw.consumed(written)
        if len(written) < self._held:  # held grads no kernel took: fp32 copies for the optimizer
            mw.grads.materialize_except(self._written)
        self._lifted = mw.grads.lift(written)

    def after_update(self) -> None:
        """Right after the optimizer's update, also where it raised: the lifted grads
        put back and the masters not written by the one pass copied into the model."""
        # Also where the optimizer raised mid-step (some masters may have moved): the
        # model shows them (the one-pass ones wrote their weights already).
        self.masters.grads.restore(self._lifted)
        self._lifted = []
        self.masters.publish(skip=self._written)
        self._written = set()

    def after_step(self, skipped: bool) -> None:
        counts, self._counts = self._counts, []
        for c in counts:
            c.settle(skipped)

    def state_dict(self) -> Any:
        """The masters' state (:meth:`MasterWeights.state_dict`), saved as ``"master_weights"``."""
        return self.masters.state_dict()

    def check_state_dict(self, state: Any) -> None:
        self.masters.check_state_dict(state)

    def load_state_dict(self, state: Any) -> None:
        self.masters.load_state_dict(state)
