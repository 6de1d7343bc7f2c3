"""How each optimizer family is stepped where ampkit steps it: one table of rules.

Each :class:`OptimizerRule` in :data:`RULES` describes one family of ``torch.optim``
classes: the group settings it supports, its per-parameter state, one step's scalars,
its elementwise updates (:class:`Update`: the one-pass kernel of O2,
:mod:`ampkit.levels.one_pass`, and the compensated kernel of O2K, ``CompensatedUpdates``)
and whether torch's fused kernel steps its fp32 groups (``ampkit.trainer.fused_step``).
Adding an optimizer family is one rule appended to :data:`RULES`; the readers look the
table up when a step runs (once per param group, never per parameter).
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ampkit._internal import registry as _reset
from ampkit._internal import torch_compat

__all__ = [
    "Update", "OptimizerRule", "RULES", "rule_for", "rule_of", "scalar", "Plan", "StepCounts", "counts_of",
    "zeros_tiled", "BATCHED_BELOW_NUMEL",
]

#: A step's bookkeeping for a list of parameters: their state dicts (None where the
#: update reads no state) and, per distinct scalar set, ``(update, positions, scalars)``
#: (positions None: every parameter).
Plan = tuple["list[dict[str, Any]] | None", "list[tuple[Update, list[int] | None, torch.Tensor]]"]


@dataclass(frozen=True, eq=False)
class Update:
    """One elementwise update of a family, as two kernels over 1-D tensors of equal length.

    Attributes:
        name: for messages (``"Adam/AdamW"``).
        one_pass: ``fn(w16, g16, p32, *state32, scalars, **static)``: the fp32 master
            ``p32`` and its fp32 state stepped from the 16-bit grad ``g16``, the 16-bit
            model weight ``w16`` set to the master rounded (all written in place).
        compensated: ``fn(w, c, g, *state, scalars, **static)`` on a bf16 weight ``w``
            with its Kahan compensation ``c``, bf16 grad ``g`` and bf16 state: ``w + c``
            is the value trained.
        state_keys: the state tensors both kernels read and write, in argument order.
        num_scalars: the length of the fp32 ``scalars`` tensor.
        static_keys: group settings passed as bool keyword arguments (one compiled kernel
            per value).
    """

    name: str
    one_pass: Callable[..., None]
    compensated: Callable[..., None]
    state_keys: tuple[str, ...]
    num_scalars: int
    static_keys: tuple[str, ...] = ()

    def static_args(self, group: dict[str, Any]) -> dict[str, bool]:
        """The static keyword arguments of the kernels for a param group."""
        return {key: bool(group.get(key)) for key in self.static_keys}


@dataclass(frozen=True, eq=False)
class OptimizerRule:
    """How one optimizer family is stepped outside its own ``step``.

    Attributes:
        name: the family (``"adam"``).
        classes: the optimizer classes of the family (exactly these).
        state_keys: the per-parameter state tensors (shaped like the parameter) its
            updates keep; a parameter whose state holds them in another dtype or layout
            steps as the optimizer does.
        counted: whether the state holds a ``"step"`` count from the first step (and,
            for the one-pass update, nothing beyond it and ``state_keys``); if not, a
            state tensor may be absent until an update creates it.
        updates_for: ``fn(group) -> updates | None``: the updates a param group's step
            takes, None where the group has a setting the kernels do not support (then
            the optimizer steps it). ``differentiable`` and ``capturable`` groups are
            never stepped by a rule.
        plan: ``fn(optimizer, group, params) -> Plan``: one step's bookkeeping for
            ``params`` of ``group`` (state created, counts advanced, the scalars).
        fused: the family's fp32/fp64 groups built with ``fused`` and ``foreach`` unset
            may take torch's fused kernel (where a probe per configuration finds it
            steps as the per-parameter loop does).
        fused_wide_part: the fused kernel also steps the fp32 rest of a group whose
            16-bit parameters something else steps (O2K's compensated updates).
        sparse_grads: the optimizer steps sparse grads (``nn.Embedding(sparse=True)``),
            which torch's fused kernel refuses: a group fused by ampkit goes back to
            torch's own kernel once one shows (``ampkit.trainer.fused_step.SparseWatch``).
    """

    name: str
    classes: tuple[type[torch.optim.Optimizer], ...]
    state_keys: tuple[str, ...] = ()
    counted: bool = False
    updates_for: Callable[[dict[str, Any]], tuple[Update, ...] | None] | None = None
    plan: Callable[[torch.optim.Optimizer, dict[str, Any], Sequence[torch.Tensor]], Plan] | None = None
    fused: bool = False
    fused_wide_part: bool = False
    sparse_grads: bool = False


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


#: The update kernels run a tensor of this many elements or more in a call of its own and
#: join smaller ones (``ampkit.levels.update_kernels.DIRECT_NUMEL`` is this value): the
#: tensors :func:`zeros_tiled` lays out one after another.
BATCHED_BELOW_NUMEL = 1 << 14


def zeros_tiled(likes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Zeros shaped as each of ``likes``, as ``torch.zeros_like`` makes them; those below
    :data:`BATCHED_BELOW_NUMEL` elements that are plain contiguous tensors of the first
    one's dtype and device are made as consecutive pieces of one buffer, in order, so
    that an update kernel runs on the buffer in place of copying them in and out
    (:func:`ampkit.levels.update_kernels.tiled`)."""
    out = [None] * len(likes)
    small = [i for i, t in enumerate(likes) if t.numel() < BATCHED_BELOW_NUMEL]
    if len(small) > 1:
        first = likes[small[0]]
        small = [i for i in small if _plain_contiguous(likes[i], first)]
    if len(small) > 1:
        first = likes[small[0]]
        flat = torch.zeros(sum(likes[i].numel() for i in small), dtype=first.dtype, device=first.device)
        for i, view in zip(small, torch_compat.unflatten_dense(flat, [likes[i] for i in small])):
            out[i] = view
    return [torch.zeros_like(t, memory_format=torch.preserve_format) if z is None else z for t, z in zip(likes, out)]


def _plain_contiguous(t: torch.Tensor, first: torch.Tensor) -> bool:
    """Whether ``torch.zeros_like(t)`` is a plain tensor with the strides a piece of a
    flat buffer has (contiguous ones: not those of a channels_last 1x1 kernel, which
    ``is_contiguous`` also accepts), of ``first``'s dtype and device."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.dtype != first.dtype or t.device != first.device:
        return False
    expected, stride = [], 1
    for size in reversed(t.shape):
        expected.append(stride)
        stride *= size
    return t.stride() == tuple(reversed(expected))


def rule_of(cls: type) -> OptimizerRule | None:
    """The rule of optimizer class ``cls`` (exactly one of its ``classes``), or None."""
    for rule in RULES:
        if cls in rule.classes:
            return rule
    return None


def rule_for(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> OptimizerRule | None:
    """The rule whose updates step this param group of ``optimizer`` (its class is one
    of the rule's, the rule has updates and supports the group's settings: plain-number
    hyperparameters, neither ``differentiable`` nor ``capturable``), or None: the
    optimizer steps the group as usual."""
    if group.get("differentiable") or group.get("capturable"):
        return None
    cls = type(optimizer)
    for rule in RULES:
        if cls in rule.classes:
            return rule if rule.updates_for is not None and rule.updates_for(group) is not None else None
    return None


# Module state: what the host knows of step counters it advanced, id(tensor) -> (the
# tensor, held weakly; its stamp when known: version and data pointer; its value then).
# A counter changed since (another version: a load, an edit; another pointer: a swap
# through ``.data``) is read again. Not seen: a write the version does not count
# (``step.data.fill_(n)``); such a counter's count is read only after a load.
_KNOWN: dict[int, tuple[Any, tuple[int, int], float]] = {}


# Module state: a cache of _KNOWN for the lists of counters remembered last (an update's
# counters are one list, step after step): (id of the first, length) -> (the counters,
# their stamps, their counts), written with _KNOWN's entries and valid while every
# counter is the same object with the same stamp (then _KNOWN says the same). At most
# _LISTS_KEPT lists (they hold their counters); both emptied by ``ampkit.reset()``.
_KNOWN_LISTS: OrderedDict[tuple[int, int], tuple[list[torch.Tensor], list[tuple[int, int]], list[float]]] = (
    OrderedDict()
)
_LISTS_KEPT = 16
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")


@_reset.on_reset
def _forget_counts() -> None:
    _KNOWN.clear()
    _KNOWN_LISTS.clear()


def _stamps(steps: list[Any]) -> list[tuple[int, int]] | None:
    """Each counter's version and data pointer, or None where one is not a tensor (a
    count the host cannot know)."""
    if not all(map(torch.is_tensor, steps)):
        return None
    return list(zip(torch_compat.tensor_versions(steps), map(torch.Tensor.data_ptr, steps)))


def _known(t: torch.Tensor) -> float | None:
    entry = _KNOWN.get(id(t))
    if entry is None or entry[0]() is not t or entry[1] != (torch_compat.tensor_version(t), t.data_ptr()):
        return None
    return entry[2]


def _known_all(steps: list[torch.Tensor]) -> list[float | None]:
    """:func:`_known` of each of ``steps``: for a list remembered together and unchanged
    since, in a few passes with no Python call per counter."""
    entry = _KNOWN_LISTS.get((id(steps[0]), len(steps))) if steps else None
    if entry is not None and all(map(operator.is_, entry[0], steps)) and _stamps(steps) == entry[1]:
        return list(entry[2])
    return [_known(t) for t in steps]


def _remember(steps: Sequence[torch.Tensor], values: Sequence[float]) -> None:
    if not steps:
        return
    if len(_KNOWN) > 4 * len(steps) + 4096:  # counters of optimizers since dropped
        for key in [k for k, entry in _KNOWN.items() if entry[0]() is None]:
            del _KNOWN[key]
    stamps = _stamps(list(steps))
    if stamps is None:
        return
    known = _KNOWN
    for t, stamp, v in zip(steps, stamps, values):
        entry = known.get(id(t))
        ref = entry[0] if entry is not None and entry[0]() is t else weakref.ref(t)
        known[id(t)] = (ref, stamp, v)
    key = (id(steps[0]), len(steps))
    _KNOWN_LISTS.pop(key, None)
    _KNOWN_LISTS[key] = (list(steps), stamps, list(values))
    while len(_KNOWN_LISTS) > _LISTS_KEPT:
        _KNOWN_LISTS.popitem(last=False)


def _advance_steps(states: Sequence[dict[str, Any]]) -> list[float]:
    """``state["step"] += 1`` for each of ``states``, and the new counts as floats. Where
    the steps are distinct 0-dim fp32 tensors on one device (torch's layout), one
    multi-tensor add and no read where the host knows the counts (it advanced them
    last and nothing changed them since), else one read of all counts (not one per
    parameter: each read waits for the device where the steps live there); otherwise
    one by one."""
    steps = [state["step"] for state in states]
    if (steps and set(map(type, steps)) == {torch.Tensor} and set(map(_DTYPE, steps)) == {torch.float32}
            and not any(map(torch.Tensor.dim, steps))):  # fmt: skip
        if len(set(map(_DEVICE, steps))) == 1 and len(set(map(id, steps))) == len(steps):
            known = _known_all(steps)
            torch_compat.foreach_add_(steps, 1.0)  # in place, one call (exact: integers in fp32)
            if None in known:
                values = torch.stack(steps).tolist()
            else:
                values = [v + 1.0 for v in known]  # type: ignore[operator]
            _remember(steps, values)
            return values
    for state in states:
        state["step"] += 1
    return [float(state["step"]) for state in states]


class StepCounts:
    """The step counters a step skipped or taken on the device advanced (see
    :func:`counts_of`): :meth:`settle` makes them right once the host knows the outcome."""

    __slots__ = ("steps", "values", "undone", "stamps")

    def __init__(self, steps: list[torch.Tensor], values: list[float], undone: bool) -> None:
        self.steps = steps
        self.values = values  # the counts of a taken step
        self.undone = undone  # already lowered on the device where the step was skipped
        self.stamps = _stamps(steps)  # as the step left them: a change since is not ours

    def settle(self, skipped: bool) -> None:
        """The step was ``skipped`` (or taken): a skip lowers the counts now where the
        device did not; the host knows the counts again, unless a counter was changed
        since the step (by anyone but ampkit: an edit between a step and the moment its
        outcome is settled), which is then read at its next step."""
        unchanged = self.stamps is not None and _stamps(self.steps) == self.stamps
        if skipped and not self.undone:
            torch_compat.foreach_add_(self.steps, -1.0)
        if unchanged:
            _remember(self.steps, [v - 1.0 for v in self.values] if skipped else self.values)


def counts_of(states: Sequence[dict[str, Any]] | None, skip: torch.Tensor) -> StepCounts | None:
    """After an update of ``states`` (those a rule's plan advanced) run with the
    found-inf flag ``skip`` (0-dim, > 0: the step is skipped): where their ``step``
    counters are tensors on ``skip``'s device, each is lowered by the flag there, as
    torch's fused optimizers do (exact on a skipped step, unchanged on a taken one: no
    host read); elsewhere (counters on the CPU, the flag on an accelerator) the counts
    stay advanced until :meth:`StepCounts.settle` runs. None where the states keep no
    counters."""
    if not states or "step" not in states[0]:
        return None
    steps = [state["step"] for state in states]
    tensors = all(map(torch.is_tensor, steps))
    known = _known_all(steps) if tensors else [_known(t) if torch.is_tensor(t) else None for t in steps]
    # where the host does not know a count (not advanced by _advance_steps: a state changed meanwhile): read
    values = [float(t) if v is None else v for t, v in zip(steps, known)]
    undone = tensors and set(map(_DEVICE, steps)) == {skip.device}
    if undone:
        torch_compat.foreach_sub_(steps, [skip] * len(steps))
    return StepCounts(steps, values, undone)


# --- Adam / AdamW ------------------------------------------------------------------------


def _adam(w: torch.Tensor, g: torch.Tensor, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
    """Adam/AdamW on fp32 master ``p`` with 16-bit grad ``g``; fp32 moments ``m``, ``v``;
    16-bit model weight ``w`` set to ``p`` rounded. ``s``: see :func:`_adam_plan`."""
    gf = g.float() * s[8] + p * s[7]
    mf = m + (gf - m) * s[0]
    vf = v * s[1] + gf * gf * s[2]
    denom = vf.sqrt() / s[5] + s[3]
    pf = p * s[6] - (mf / denom) * s[4]
    p.copy_(pf)
    m.copy_(mf)
    v.copy_(vf)
    w.copy_(pf)


def _split_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to 8 significant bits (a bf16 value, still in fp32), by
    Veltkamp splitting: ``t = x * (2**16 + 1); x - ... = t - (t - x)``.

    Arithmetic rather than ``x.to(bfloat16).float()``: Inductor folds that round
    trip away (it keeps intermediates in fp32), its ``emulate_precision_casts`` mode
    runs the kernel ~1.7x slower, and integer bit tricks cost ~2x (the bit casts go
    through memory). Exact for |x| < 2**112; the result is round-to-nearest (ties
    may go either way, unlike the cast's ties-to-even). Needs fp32 arithmetic
    without contraction into fused multiply-adds, which Inductor's default
    ``-ffp-contract=off`` gives; the compile probe in :mod:`ampkit.levels.update_kernels` checks."""
    t = x * 65537.0
    return t - (t - x)


def _kahan_store(w: torch.Tensor, c: torch.Tensor, total: torch.Tensor) -> None:
    """``w = round(total)``, ``c = round(total - w)`` (``total`` fp32, ``w`` and ``c``
    bf16; ``w``'s rounding is exact: the value is already a bf16 value)."""
    rounded = _split_bf16(total)
    c.copy_(total - rounded)
    w.copy_(rounded)


def _adam_kahan(
    w: torch.Tensor, c: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: torch.Tensor
) -> None:
    """Adam/AdamW on bf16 ``w`` (+ compensation ``c``) and bf16 moments ``m``, ``v``.
    ``s``: see :func:`_adam_plan`."""
    wf = w.float()
    gf = g.float() * s[8] + wf * s[7]
    mf = m.float()
    mf = mf + (gf - mf) * s[0]
    vf = v.float() * s[1] + gf * gf * s[2]
    denom = vf.sqrt() / s[5] + s[3]
    _kahan_store(w, c, wf * s[6] - (mf / denom) * s[4] + c.float())
    m.copy_(mf)
    v.copy_(vf)


ADAM = Update("Adam/AdamW", _adam, _adam_kahan, ("exp_avg", "exp_avg_sq"), 9)


def _adam_updates(group: dict[str, Any]) -> tuple[Update, ...] | None:
    """Not amsgrad, two betas, plain-number hyperparameters."""
    betas = group.get("betas", ())
    if group.get("amsgrad") or len(betas) != 2:
        return None
    values = [group.get("lr"), betas[0], betas[1], group.get("eps"), group.get("weight_decay")]
    return (ADAM,) if all(scalar(v) is not None for v in values) else None


def _adam_plan(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: Sequence[torch.Tensor]) -> Plan:
    """One Adam/AdamW step's bookkeeping: state created as torch creates it (``step`` a
    0-dim fp32 tensor, moments like the parameter), each ``step`` advanced, and per
    distinct step count (params of a group normally share one; computed once per count,
    not per parameter) the scalars: 1-beta1, beta2, 1-beta2, eps, lr/bias_correction1,
    sqrt(bias_correction2), 1-lr*wd (decoupled decay; else 1), wd (L2; else 0), -1 if
    maximize else 1."""
    beta1, beta2 = (scalar(b) for b in group["betas"])
    lr, eps, wd = scalar(group["lr"]), scalar(group["eps"]), scalar(group["weight_decay"])
    assert lr is not None and eps is not None and wd is not None and beta1 is not None and beta2 is not None
    decoupled = type(optimizer) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay"))
    states = [optimizer.state[p] for p in params]
    if not all(states):
        fresh = [i for i, state in enumerate(states) if not state]
        likes = [params[i] for i in fresh]
        for i, m, v in zip(fresh, zeros_tiled(likes), zeros_tiled(likes)):
            states[i].update(step=torch.tensor(0.0, dtype=torch.float32), exp_avg=m, exp_avg_sq=v)
    values = _advance_steps(states)
    by_step: dict[float, list[int] | None]
    if len(set(values)) == 1:
        by_step = {values[0]: None}
    else:
        by_step = {}
        for i, step in enumerate(values):
            by_step.setdefault(step, []).append(i)  # type: ignore[union-attr]
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
        out.append((ADAM, idx, scalars))
    return states, out


# --- SGD ---------------------------------------------------------------------------------


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


def _sgd_kahan(
    w: torch.Tensor, c: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, s: torch.Tensor, nesterov: bool
) -> None:
    """SGD with momentum on bf16 ``w`` (+ ``c``) and a bf16 momentum buffer. ``s``: as
    :func:`_sgd`'s."""
    wf = w.float()
    gf = g.float() * s[4] + wf * s[1]
    bf = buf.float() * s[2] + gf * s[3]
    update = gf + bf * s[5] if nesterov else bf
    _kahan_store(w, c, wf - update * s[0] + c.float())
    buf.copy_(bf)


def _sgd_plain_kahan(w: torch.Tensor, c: torch.Tensor, g: torch.Tensor, s: torch.Tensor) -> None:
    """SGD without momentum on bf16 ``w`` (+ ``c``). ``s``: lr, wd, -1 if maximize else 1."""
    wf = w.float()
    gf = g.float() * s[2] + wf * s[1]
    _kahan_store(w, c, wf - gf * s[0] + c.float())


SGD_MOMENTUM = Update("SGD", _sgd, _sgd_kahan, ("momentum_buffer",), 6, ("nesterov",))
SGD_PLAIN = Update("SGD", _sgd_plain, _sgd_plain_kahan, (), 3)


def _sgd_update(momentum: float | None) -> Update:
    """The SGD update for a group's momentum: without momentum no buffer is kept."""
    return SGD_PLAIN if momentum == 0 else SGD_MOMENTUM


def _sgd_updates(group: dict[str, Any]) -> tuple[Update, ...] | None:
    """Plain-number hyperparameters (nesterov, dampening, weight decay, maximize: all)."""
    values = [scalar(v) for v in (group.get("lr"), group.get("momentum"), group.get("dampening"),
                                  group.get("weight_decay"))]  # fmt: skip
    return None if None in values else (_sgd_update(values[1]),)


def _sgd_plan(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: Sequence[torch.Tensor]) -> Plan:
    """One SGD step's bookkeeping. Without momentum the plain update's scalars (lr, wd,
    -1 if maximize else 1); with momentum, buffers created as torch creates them and
    the scalars of first steps and later ones: lr, wd, buffer decay (momentum; 0 on the
    first step), buffer gain (1-dampening; 1 on the first step), -1 if maximize else 1,
    momentum."""
    lr, momentum = scalar(group["lr"]), scalar(group["momentum"])
    dampening, wd = scalar(group["dampening"]), scalar(group["weight_decay"])
    assert lr is not None and momentum is not None and dampening is not None and wd is not None
    sign = -1.0 if group.get("maximize") else 1.0
    update = _sgd_update(momentum)
    if not update.state_keys:
        return None, [(update, None, torch.tensor([lr, wd, sign], dtype=torch.float32))]
    states = [optimizer.state[p] for p in params]
    first: list[int] = []
    later: list[int] = []
    for i, state in enumerate(states):
        (first if state.get("momentum_buffer") is None else later).append(i)
    for i, buf in zip(first, zeros_tiled([params[i] for i in first])):
        states[i]["momentum_buffer"] = buf
    return states, [
        (update, idx if len(idx) < len(states) else None,
         torch.tensor([lr, wd, decay, gain, sign, momentum], dtype=torch.float32))
        for idx, decay, gain in ((first, 0.0, 1.0), (later, momentum, 1 - dampening))
        if idx
    ]  # fmt: skip


# --- the table ---------------------------------------------------------------------------

#: Every optimizer family ampkit steps itself or hands to torch's fused kernel (why SGD
#: has no ``fused`` and Adagrad no ``fused_wide_part``: ``ampkit.trainer.fused_step``).
RULES: tuple[OptimizerRule, ...] = (
    OptimizerRule("adam", (torch.optim.Adam, torch.optim.AdamW), ("exp_avg", "exp_avg_sq"), counted=True,
                  updates_for=_adam_updates, plan=_adam_plan, fused=True, fused_wide_part=True),
    OptimizerRule("sgd", (torch.optim.SGD,), ("momentum_buffer",), updates_for=_sgd_updates, plan=_sgd_plan),
    OptimizerRule("adagrad", (torch.optim.Adagrad,), fused=True, sparse_grads=True),
)  # fmt: skip
