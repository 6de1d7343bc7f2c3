"""One-pass O2 updates: the optimizer step of an fp32 master read straight from the
model's 16-bit gradient.

Under O2 with one backward per step and a loss scale of 1 (bf16's default), the
gradient backward produces in 16 bits widens exactly to fp32: an fp32 copy of it
holds no information the 16-bit one lacks. :class:`ampkit.levels.master.MasterWeights`
then leaves it on the model parameter (``master_grads="on_demand"``: the master's
``.grad`` is derived only when something asks for it), and the step runs one
elementwise kernel per tensor that reads the 16-bit grad, the fp32 master and the
optimizer state once, computes the optimizer's update in fp32, and writes master,
state and the rounded 16-bit model weight in place:

=========================  ==========================================================
optimizer                  bytes per parameter moved by the step (AdamW: read / write)
=========================  ==========================================================
torch's fused AdamW on     fp32 grad 4 + master 4 + moments 8 / master 4 + moments 8,
fp32 masters (before)      then the publish pass reads the master 4, writes 2
one pass                   16-bit grad 2 + master 4 + moments 8 / master 4 +
                           moments 8 + 16-bit weight 2
=========================  ==========================================================

and no fp32 gradient is allocated at all: AdamW at O2 holds 16 bytes per parameter
at the step (16-bit weight and grad, fp32 master and two moments), as fp32 training
does.

The optimizers, their state and their kernels are the rules of
:mod:`ampkit.trainer.optimizer_rules`: ``torch.optim.Adam`` and ``AdamW`` (not amsgrad;
weight decay, maximize, decoupled or L2) and ``torch.optim.SGD`` (with or without
momentum, dampening, nesterov, weight decay, maximize), with plain-number
hyperparameters and neither ``capturable`` nor ``differentiable``; the formulas are the ones of torch's
for-loop implementations, evaluated in fp32 (the last bit may differ from torch's
fused kernel, as torch's own implementations differ from each other). Other
optimizers and parameters get their fp32 grads and step as before.

The state layout is torch's (``step`` as a 0-dim fp32 tensor, ``exp_avg``,
``exp_avg_sq``, ``momentum_buffer`` in fp32, created at the first step as torch
creates them), so checkpoints load with either path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ampkit.trainer.optimizer_rules import OptimizerRule, StepCounts, Update, counts_of, rule_for

from . import update_kernels as _kernels
from .update_kernels import AheadJob, Kernel, flat, same_layout

__all__ = ["rule_for", "fits", "select", "step_params", "kernels_ahead"]

_F32 = torch.float32
_KERNELS: dict[tuple[Update, torch.dtype], Kernel] = {}


def _kernel(update: Update, low: torch.dtype) -> Kernel:
    """The one-pass kernel of ``update`` for 16-bit grads of dtype ``low`` (made once):
    roles model weight, grad (``low``), master and state (fp32); all but the grad written."""
    key = (update, low)
    k = _KERNELS.get(key)
    if k is None:
        n = len(update.state_keys)
        k = Kernel(f"O2 {update.name}", update.one_pass, mutated=(0, 2, *range(3, 3 + n)),
                   example_dtypes=(low, low, _F32, *(_F32,) * n), exact=False)  # fmt: skip
        _KERNELS[key] = k
    return k


def kernels_ahead(
    optimizer: torch.optim.Optimizer, low: torch.dtype, devices: Sequence[str] | None = None,
    kernels: Callable[[Update, torch.dtype], Kernel] | None = None,
) -> list[AheadJob]:
    """The update kernels a one-pass step of ``optimizer`` runs for 16-bit grads of
    dtype ``low`` (per param group with a rule and device type of its parameters, in
    ``devices`` if given), as :func:`ampkit.levels.update_kernels.compile_ahead` takes
    them; ``kernels(update, low)`` picks the kernel of an
    :class:`~ampkit.trainer.optimizer_rules.Update` (default: this module's)."""
    pick = kernels or _kernel
    jobs: list[AheadJob] = []
    for group in optimizer.param_groups:
        rule = rule_for(optimizer, group)
        if rule is None or rule.updates_for is None:
            continue
        for update in rule.updates_for(group) or ():
            kernel, static = pick(update, low), update.static_args(group)
            for device in {p.device for p in group["params"]}:
                if devices is None or device.type in devices:
                    jobs.append((kernel, static, update.num_scalars, device))
    return jobs


def fits(optimizer: torch.optim.Optimizer, rule: OptimizerRule, master: nn.Parameter, model_p: torch.Tensor,
         grad: torch.Tensor) -> bool:  # fmt: skip
    """Whether the one-pass kernel of ``rule``
    (:func:`~ampkit.trainer.optimizer_rules.rule_for`) can step ``master`` from 16-bit
    ``grad``: dense tensors of one layout, state absent (first step) or torch's fp32
    state."""
    if grad.is_sparse or grad.dtype == torch.float32 or master.dtype != torch.float32:
        return False
    if flat(master) is None or grad.dtype != model_p.dtype:
        return False
    tensors = [master.detach(), grad, model_p.detach()]
    state = optimizer.state.get(master)
    if state:
        if rule.counted and ("step" not in state or set(state) - {"step", *rule.state_keys}):
            return False
        for key in rule.state_keys:
            v = state.get(key)
            if v is None and not rule.counted:
                continue
            if not torch.is_tensor(v) or v.dtype != torch.float32:
                return False
            tensors.append(v)
    return same_layout(tensors)


def select(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], rule: OptimizerRule, model_of: dict[int, torch.Tensor],
) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]:
    """``(master, model_param, grad16)`` for each master of ``group`` (in order) that
    has a model parameter in ``model_of`` (``id(master) ->`` it) whose grad :func:`fits`
    the one-pass kernel: the same checks in one loop over the group."""
    state_of = optimizer.state
    keys = rule.state_keys
    allowed = {"step", *keys}
    out = []
    for master in list.__iter__(group["params"]):  # bookkeeping: no grads derived
        model_p = model_of.get(id(master))
        if model_p is None:
            continue
        g = model_p.grad
        if (g is None or g.is_sparse or g.dtype == torch.float32 or master.dtype != torch.float32
                or g.dtype != model_p.dtype):  # fmt: skip
            continue
        shape, stride, device = master.shape, master.stride(), master.device
        if not (g.shape == shape and g.stride() == stride and g.device == device and model_p.shape == shape
                and model_p.stride() == stride and model_p.device == device) or not (
                    master.is_contiguous() or flat(master) is not None):  # fmt: skip
            continue
        state = state_of.get(master)
        if state and not _state_fits(state, rule.counted, keys, allowed, shape, stride, device):
            continue
        out.append((master, model_p, g))
    return out


def _state_fits(state: dict, counted: bool, keys: tuple[str, ...], allowed: set[str], shape: torch.Size,
                stride: tuple[int, ...], device: torch.device) -> bool:  # fmt: skip
    """:func:`fits`'s check of existing optimizer state."""
    if counted and ("step" not in state or not allowed.issuperset(state)):
        return False
    for key in keys:
        v = state.get(key)
        if v is None and not counted:
            continue
        if not (torch.is_tensor(v) and v.dtype == torch.float32 and v.shape == shape and v.stride() == stride
                and v.device == device):  # fmt: skip
            return False
    return True


def step_params(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    rule: OptimizerRule,
    items: Sequence[tuple[nn.Parameter, torch.Tensor, torch.Tensor]],
    *,
    mode: _kernels.KernelMode = "auto",
    chunk_numel: int = 1 << 20,
    skip: torch.Tensor | None = None,
) -> list[StepCounts]:
    """Step each ``(master, model_param, grad16)`` of ``group`` in one pass with the
    kernels of ``rule`` (:func:`~ampkit.trainer.optimizer_rules.rule_for`; see the
    module docs): the master and its state updated in fp32 and ``model_param`` set to
    the master rounded. State is created on first use as torch creates it.

    ``skip``: the step's found-inf flag (0-dim, on the grads' device), for a step
    decided on the device: where it is > 0 the kernels leave masters, state and model
    weights as they were, and the step counters are lowered again where they live on
    the flag's device. Returns the counters to settle once the outcome is known
    (:meth:`~ampkit.trainer.optimizer_rules.StepCounts.settle`; empty without ``skip``)."""
    if not items:
        return []
    run = {"mode": _kernels.resolve_mode(mode), "chunk_numel": chunk_numel, "batch_numel": chunk_numel,
           "skip": skip}  # fmt: skip
    lows = [g.dtype for _, _, g in items]
    with torch.no_grad():
        if lows.count(lows[0]) == len(lows):  # one 16-bit dtype (the usual case)
            counts = [_step(optimizer, group, rule, items, lows[0], run)]
        else:
            counts = [_step(optimizer, group, rule, [it for it in items if it[2].dtype == low], low, run)
                      for low in dict.fromkeys(lows)]  # fmt: skip
    return [c for c in counts if c is not None]


def _step(optimizer: torch.optim.Optimizer, group: dict, rule: OptimizerRule, its: Sequence, low: torch.dtype,
          run: dict) -> StepCounts | None:  # fmt: skip
    """The step of ``its`` (16-bit grads of dtype ``low``; one layout per item, as
    :func:`select` checked): the rule's plan, then one kernel call per scalar set; the
    counters to settle where ``run["skip"]`` is a flag."""
    ws = [model_p for _, model_p, _ in its]
    gs = [g for _, _, g in its]
    ps = [master for master, _, _ in its]
    assert rule.plan is not None
    states, plan = rule.plan(optimizer, group, ps)
    for update, idx, scalars in plan:
        static = update.static_args(group) if update.static_keys else {}
        if idx is None:  # every item (the usual case): no reindexing
            tensors = [ws, gs, ps, *[[state[key] for state in states] for key in update.state_keys]]
        else:
            tensors = [[ws[i] for i in idx], [gs[i] for i in idx], [ps[i] for i in idx],
                       *[[states[i][key] for i in idx] for key in update.state_keys]]  # fmt: skip
        _kernel(update, low)(tensors, scalars, **static, **run)
    skip = run["skip"]
    return None if skip is None else counts_of(states, skip)
