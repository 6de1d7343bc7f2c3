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

Kernels exist for ``torch.optim.Adam`` and ``AdamW`` (not amsgrad; weight decay,
maximize, decoupled or L2) and ``torch.optim.SGD`` (with or without momentum,
dampening, nesterov, weight decay, maximize), with plain-number hyperparameters and
neither ``capturable`` nor ``differentiable``; the formulas are the ones of torch's
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

from ampkit._internal import torch_compat

from . import update_kernels as _kernels
from .update_kernels import AheadJob, Kernel, flat, same_layout

__all__ = [
    "rule_for", "fits", "select", "step_params", "scalar", "adam_scalars", "adam_plan", "sgd_scalars",
    "kernels_ahead",
]


def _adam(w: torch.Tensor, g: torch.Tensor, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
    """Adam/AdamW on fp32 master ``p`` with 16-bit grad ``g``; fp32 moments ``m``, ``v``;
    16-bit model weight ``w`` set to ``p`` rounded. ``s``: 1-beta1, beta2, 1-beta2, eps,
    lr/bias_correction1, sqrt(bias_correction2), 1-lr*wd (decoupled decay; else 1),
    wd (L2 decay; else 0), -1 if maximize else 1."""
    gf = g.float() * s[8] + p * s[7]
    mf = m + (gf - m) * s[0]
    vf = v * s[1] + gf * gf * s[2]
    denom = vf.sqrt() / s[5] + s[3]
    pf = p * s[6] - (mf / denom) * s[4]
    p.copy_(pf)
    m.copy_(mf)
    v.copy_(vf)
    w.copy_(pf)


def _sgd(w: torch.Tensor, g: torch.Tensor, p: torch.Tensor, buf: torch.Tensor, s: torch.Tensor, nesterov: bool) -> None:
    """SGD with momentum. ``s``: lr, wd, buffer decay (momentum; 0 on the first step),
    buffer gain (1-dampening; 1 on the first step), -1 if maximize else 1, momentum."""
    gf = g.float() * s[4] + p * s[1]
    bf = buf * s[2] + gf * s[3]
    update = gf + bf * s[5] if nesterov else bf
    pf = p - update * s[0]
    p.copy_(pf)
    buf.copy_(bf)
    w.copy_(pf)


def _sgd_plain(w: torch.Tensor, g: torch.Tensor, p: torch.Tensor, s: torch.Tensor) -> None:
    """SGD without momentum. ``s``: lr, wd, -1 if maximize else 1."""
    gf = g.float() * s[2] + p * s[1]
    pf = p - gf * s[0]
    p.copy_(pf)
    w.copy_(pf)


_F32, _BF = torch.float32, torch.bfloat16
_KERNELS: dict[tuple[str, torch.dtype], Kernel] = {}


def _kernel(rule: str, low: torch.dtype) -> Kernel:
    key = (rule, low)
    k = _KERNELS.get(key)
    if k is None:
        if rule == "adam":
            k = Kernel("O2 Adam/AdamW", _adam, mutated=(0, 2, 3, 4), example_dtypes=(low, low, _F32, _F32, _F32), exact=False)
        elif rule == "sgd":
            k = Kernel("O2 SGD", _sgd, mutated=(0, 2, 3), example_dtypes=(low, low, _F32, _F32), exact=False)
        else:
            k = Kernel("O2 SGD", _sgd_plain, mutated=(0, 2), example_dtypes=(low, low, _F32), exact=False)
        _KERNELS[key] = k
    return k


def kernels_ahead(
    optimizer: torch.optim.Optimizer, low: torch.dtype, devices: Sequence[str] | None = None,
    kernels: Callable[[str, torch.dtype], Kernel] | None = None,
) -> list[AheadJob]:
    """The update kernels a one-pass step of ``optimizer`` runs for 16-bit grads of
    dtype ``low`` (per param group with a rule and device type of its parameters, in
    ``devices`` if given), as :func:`ampkit.levels.update_kernels.compile_ahead` takes
    them; ``kernels(rule, low)`` picks the kernel of a rule (``"adam"``, ``"sgd"``,
    ``"sgd_plain"``; default: this module's)."""
    pick = kernels or _kernel
    jobs: list[AheadJob] = []
    for group in optimizer.param_groups:
        rule = rule_for(optimizer, group)
        if rule is None:
            continue
        if rule == "adam":
            kernel, static, count = pick("adam", low), {}, 9
        elif scalar(group.get("momentum")) == 0:
            kernel, static, count = pick("sgd_plain", low), {}, 3
        else:
            kernel, static, count = pick("sgd", low), {"nesterov": bool(group.get("nesterov"))}, 6
        for device in {p.device for p in group["params"]}:
            if devices is None or device.type in devices:
                jobs.append((kernel, static, count, device))
    return jobs


def scalar(x: Any) -> float | None:
    """A hyperparameter as a float, or None if it is not a plain number (a CPU 0-dim
    tensor counts)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if torch.is_tensor(x) and x.numel() == 1 and not x.requires_grad and x.device.type == "cpu":
        return float(x.item())
    return None


def rule_for(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> str | None:
    """Which one-pass update computes this param group's step (``"adam"``, ``"sgd"``),
    or None (the optimizer steps its fp32 grads as usual). Exactly the classes
    ``torch.optim.Adam``, ``AdamW`` and ``SGD``: a subclass may change ``step``."""
    if group.get("differentiable") or group.get("capturable"):
        return None
    cls = type(optimizer)
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        betas = group.get("betas", ())
        if group.get("amsgrad") or len(betas) != 2:
            return None
        values = [group.get("lr"), betas[0], betas[1], group.get("eps"), group.get("weight_decay")]
        return "adam" if all(scalar(v) is not None for v in values) else None
    if cls is torch.optim.SGD:
        values = [group.get("lr"), group.get("momentum"), group.get("dampening"), group.get("weight_decay")]
        return "sgd" if all(scalar(v) is not None for v in values) else None
    return None


_STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def adam_scalars(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: Sequence[nn.Parameter]) -> list[tuple[list[int], torch.Tensor]]:
    """One Adam/AdamW step's bookkeeping for ``params`` of ``group``: state created as
    torch creates it (``step`` a 0-dim fp32 tensor, moments like the parameter), each
    ``step`` advanced, and per distinct step count ``(positions, scalars)`` with the
    kernels' scalars: 1-beta1, beta2, 1-beta2, eps, lr/bias_correction1,
    sqrt(bias_correction2), 1-lr*wd (decoupled decay; else 1), wd (L2; else 0),
    -1 if maximize else 1."""
    return adam_plan(optimizer, group, params)[1]


def adam_plan(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: Sequence[nn.Parameter],
              ) -> tuple[list[dict[str, Any]], list[tuple[list[int], torch.Tensor]]]:  # fmt: skip
    """:func:`adam_scalars`, with the state of each of ``params`` (in order) first. The
    scalars are computed once per distinct step count (params of a group normally
    share one), not once per parameter."""
    beta1, beta2 = (scalar(b) for b in group["betas"])
    lr, eps, wd = scalar(group["lr"]), scalar(group["eps"]), scalar(group["weight_decay"])
    assert lr is not None and eps is not None and wd is not None and beta1 is not None and beta2 is not None
    decoupled = type(optimizer) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay"))
    states = [optimizer.state[p] for p in params]
    if not all(states):
        for p, state in zip(params, states):
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    values = _advance_steps(states)
    by_step: dict[float, list[int]]
    if len(set(values)) == 1:
        by_step = {values[0]: list(range(len(values)))}
    else:
        by_step = {}
        for i, step in enumerate(values):
            by_step.setdefault(step, []).append(i)
    sign = -1.0 if group.get("maximize") else 1.0
    out = []
    for step, idx in by_step.items():
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        scalars = torch.tensor(
            [1 - beta1, beta2, 1 - beta2, eps, lr / bc1, bc2**0.5,
             1 - lr * wd if decoupled else 1.0, 0.0 if decoupled else wd, sign],
            dtype=torch.float32,
        )  # fmt: skip
        out.append((idx, scalars))
    return states, out


def _advance_steps(states: Sequence[dict[str, Any]]) -> list[float]:
    """``state["step"] += 1`` for each of ``states``, and the new counts as floats. Where
    the steps are distinct 0-dim fp32 tensors on one device (torch's layout), one
    stacked add, copied back, and one read of all counts (not one per parameter: each
    read waits for the device where the steps live there); otherwise one by one."""
    steps = [state["step"] for state in states]
    if steps and all(type(t) is torch.Tensor and t.dtype == torch.float32 and t.dim() == 0 for t in steps):
        devices = {t.device for t in steps}
        if len(devices) == 1 and len({id(t) for t in steps}) == len(steps):
            torch_compat.foreach_add_(steps, 1.0)  # in place, one call (exact: integers in fp32)
            return torch.stack(steps).tolist()
    for state in states:
        state["step"] += 1
    return [float(state["step"]) for state in states]


def sgd_scalars(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: Sequence[nn.Parameter]) -> list[tuple[list[int], torch.Tensor]] | torch.Tensor:
    """One SGD step's bookkeeping for ``params`` of ``group``. Without momentum the
    plain kernel's scalars (lr, wd, -1 if maximize else 1); with momentum, buffers
    created as torch creates them and ``(positions, scalars)`` for first steps and later
    ones: lr, wd, buffer decay (momentum; 0 on the first step), buffer gain
    (1-dampening; 1 on the first step), -1 if maximize else 1, momentum."""
    lr, momentum = scalar(group["lr"]), scalar(group["momentum"])
    dampening, wd = scalar(group["dampening"]), scalar(group["weight_decay"])
    assert lr is not None and momentum is not None and dampening is not None and wd is not None
    sign = -1.0 if group.get("maximize") else 1.0
    if momentum == 0:
        return torch.tensor([lr, wd, sign], dtype=torch.float32)
    first: list[int] = []
    later: list[int] = []
    for i, p in enumerate(params):
        state = optimizer.state[p]
        if state.get("momentum_buffer") is None:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            first.append(i)
        else:
            later.append(i)
    return [
        (idx, torch.tensor([lr, wd, decay, gain, sign, momentum], dtype=torch.float32))
        for idx, decay, gain in ((first, 0.0, 1.0), (later, momentum, 1 - dampening))
        if idx
    ]


def fits(optimizer: torch.optim.Optimizer, rule: str, master: nn.Parameter, model_p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the one-pass kernel can step ``master`` from 16-bit ``grad``: dense
    tensors of one layout, state absent (first step) or torch's fp32 state."""
    if grad.is_sparse or grad.dtype == torch.float32 or master.dtype != torch.float32:
        return False
    if flat(master) is None or grad.dtype != model_p.dtype:
        return False
    tensors = [master.detach(), grad, model_p.detach()]
    state = optimizer.state.get(master)
    if state:
        if rule == "adam" and ("step" not in state or set(state) - {"step", "exp_avg", "exp_avg_sq"}):
            return False
        for key in _STATE_KEYS[rule]:
            v = state.get(key)
            if v is None and rule == "sgd":
                continue
            if not torch.is_tensor(v) or v.dtype != torch.float32:
                return False
            tensors.append(v)
    return same_layout(tensors)


def select(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], rule: str, model_of: dict[int, torch.Tensor],
) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]:
    """``(master, model_param, grad16)`` for each master of ``group`` (in order) that
    has a model parameter in ``model_of`` (``id(master) ->`` it) whose grad :func:`fits`
    the one-pass kernel: the same checks in one loop over the group."""
    state_of = optimizer.state
    keys = _STATE_KEYS[rule]
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
        if state and not _state_fits(state, rule, keys, allowed, shape, stride, device):
            continue
        out.append((master, model_p, g))
    return out


def _state_fits(state: dict, rule: str, keys: tuple[str, ...], allowed: set[str], shape: torch.Size,
                stride: tuple[int, ...], device: torch.device) -> bool:  # fmt: skip
    """:func:`fits`'s check of existing optimizer state."""
    if rule == "adam" and ("step" not in state or not allowed.issuperset(state)):
        return False
    for key in keys:
        v = state.get(key)
        if v is None and rule == "sgd":
            continue
        if not (torch.is_tensor(v) and v.dtype == torch.float32 and v.shape == shape and v.stride() == stride
                and v.device == device):  # fmt: skip
            return False
    return True


def step_params(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    rule: str,
    items: Sequence[tuple[nn.Parameter, torch.Tensor, torch.Tensor]],
    *,
    mode: _kernels.KernelMode = "auto",
    chunk_numel: int = 1 << 20,
) -> None:
    """Step each ``(master, model_param, grad16)`` of ``group`` in one pass (see the
    module docs): the master and its state updated in fp32 and ``model_param`` set
    to the master rounded. State is created on first use as torch creates it."""
    if not items:
        return
    run = {"mode": _kernels.resolve_mode(mode), "chunk_numel": chunk_numel, "batch_numel": chunk_numel}
    by_dtype: dict[torch.dtype, list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]] = {}
    for it in items:
        by_dtype.setdefault(it[2].dtype, []).append(it)
    with torch.no_grad():
        for low, its in by_dtype.items():
            if rule == "adam":
                _step_adam(optimizer, group, its, _kernel("adam", low), run)
            else:
                _step_sgd(optimizer, group, its, low, run)


def _views(its: Sequence[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]) -> tuple[list, list, list]:
    """The model weights, grads and masters of ``its`` (same layout per item, as
    :func:`select` checked), as the kernels take them."""
    ws = [model_p for _, model_p, _ in its]
    gs = [g for _, _, g in its]
    ps = [master for master, _, _ in its]
    return ws, gs, ps


def _step_adam(optimizer: torch.optim.Optimizer, group: dict, its: Sequence, kernel: Kernel, run: dict) -> None:
    ws, gs, ps = _views(its)
    states, plan = adam_plan(optimizer, group, ps)
    for idx, scalars in plan:
        if len(idx) == len(its):  # one step count for all (the usual case): no reindexing
            ms = [state["exp_avg"] for state in states]
            vs = [state["exp_avg_sq"] for state in states]
            kernel([ws, gs, ps, ms, vs], scalars, **run)
            continue
        ms = [states[i]["exp_avg"] for i in idx]
        vs = [states[i]["exp_avg_sq"] for i in idx]
        kernel([[ws[i] for i in idx], [gs[i] for i in idx], [ps[i] for i in idx], ms, vs], scalars, **run)


def _step_sgd(optimizer: torch.optim.Optimizer, group: dict, its: Sequence, low: torch.dtype, run: dict) -> None:
    ws, gs, ps = _views(its)
    plan = sgd_scalars(optimizer, group, [master for master, _, _ in its])
    if isinstance(plan, torch.Tensor):
        _kernel("sgd_plain", low)([ws, gs, ps], plan, **run)
        return
    for idx, scalars in plan:
        bufs = [optimizer.state[its[i][0]]["momentum_buffer"] for i in idx]
        _kernel("sgd", low)([[ws[i] for i in idx], [gs[i] for i in idx], [ps[i] for i in idx], bufs], scalars,
                            nesterov=bool(group.get("nesterov")), **run)
