"""Choosing torch's fastest kernel for an optimizer the user built with defaults.

``torch.optim`` optimizers built without ``foreach``/``fused`` step with a Python
loop over parameters on CPU (one op per parameter and formula term). Most have a
``foreach`` implementation (a few multi-tensor ops per step) and Adam, AdamW and
Adagrad a ``fused`` one (one kernel pass per tensor; AdamW on 38M fp32 parameters,
1 CPU thread: ~10x faster than the loop).

:func:`use_fastest_kernel` sets ``fused=True`` or else ``foreach=True`` on each param
group whose ``foreach`` and ``fused`` are both unset (None), and leaves every group
the user pinned as it is. ``ampkit.init_trainer`` (hence ``ampkit.initialize``,
except at O0) calls it unless ``fast_kernels=False``.

Fused only where it is the same optimizer: the class has a rule with ``fused`` in
:mod:`ampkit.trainer.optimizer_rules` (Adam, AdamW or Adagrad, exactly), every parameter is fp32 or fp64 on a device torch has fused kernels
for, and a probe (the fused and the per-parameter step on the same random
tensors, the group's own hyperparameters, run once per configuration) gives the
same result within 1e-5 of the update. It is not bitwise the loop's: the fused
kernel's vectorized arithmetic leaves the last bits of a small fraction of the elements
different, by CPU (torch 2.13, AdamW: ~0.15% by up to 2.4e-7, an ulp of a weight near 1,
on an AVX-512-bf16 CPU; 0.13% on an AVX2-only AMD EPYC; none on another AVX2 CPU); ``fast_kernels=False`` keeps the loop
where its bits matter. Left out on purpose, as measured on torch 2.13 (CPU): fused SGD on
bf16/fp16 leaves most elements unchanged, and fused SGD with momentum fails when
only some parameters have a momentum buffer (a layer unfrozen mid-training);
fused Adam on fp16 gives NaN where the loop does not. Those groups, and 16-bit
parameters generally, get ``foreach`` (the same per-element arithmetic as the
loop); where something else steps a group's 16-bit parameters (O2K's compensated
updates), its fp32 rest is fused on the CPU under the same conditions
(:func:`fuse_wide_part`). Adagrad steps sparse grads (``nn.Embedding(sparse=True)``),
which its fused kernel refuses: :class:`SparseWatch` hands a group ampkit fused back to
torch's own kernel at the first step that shows one.

Memory: fused kernels allocate nothing; foreach implementations allocate
full-size temporaries during the step (e.g. Adam's denominator), as on CUDA where
foreach is torch's default.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ampkit._internal import torch_compat

from .optimizer_rules import rule_of

__all__ = ["use_fastest_kernel", "SparseWatch", "fuse_wide_part", "fuse_wide_parts", "nonfinite_flag",
           "unscale_and_flag"]

_FUSED_DTYPES = (torch.float32, torch.float64)
# (class, dtype, device type, hyperparameters) -> whether fused matches the loop.
# Module state: a memo of probe results, the same answer every time in a process.
_PROBED: dict[tuple, bool] = {}


def forget_probes() -> None:
    """Forget which fused kernels agreed with the loop kernel: the next optimizer set
    up probes again (after a kernel of torch's was replaced, e.g. in a test)."""
    _PROBED.clear()
_PROBE_SKIP = ("params", "fused", "foreach", "differentiable", "capturable")


def _fused_devices() -> list[str]:
    return torch_compat.fused_optimizer_devices()


def _fused_fits(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    rule = rule_of(type(optimizer))
    if rule is None or not rule.fused or "fused" not in group:
        return False
    devices = _fused_devices()
    params = group["params"]
    if not all(p.device.type in devices and p.dtype in _FUSED_DTYPES and not p.is_sparse for p in params):
        return False
    return _fused_steps_like_the_loop(optimizer, group, params)


def _fused_steps_like_the_loop(optimizer: torch.optim.Optimizer, group: dict, params: list) -> bool:
    """Whether ``group``'s fused step is the loop's for ``params`` (fp32/fp64): neither
    ``differentiable`` nor ``capturable``, and the probe agrees for each of their (dtype,
    device) kinds."""
    if group.get("differentiable") or group.get("capturable"):
        return False
    kinds = {(p.dtype, p.device) for p in params}
    return all(_fused_agrees(type(optimizer), optimizer.defaults, group, d, dev) for d, dev in kinds)


def _fused_agrees(
    cls: type[torch.optim.Optimizer], defaults: dict, group: dict, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether ``cls(fused=True)`` steps like ``cls(foreach=False)`` with this group's
    hyperparameters: two steps on 1031 random elements, within 1e-5 of the update."""
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: group[k] for k in defaults if k in group and k in accepted and k not in _PROBE_SKIP}
    key = (cls, dtype, device.type, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    known = _PROBED.get(key)
    if known is not None:
        return known
    try:
        g = torch.Generator().manual_seed(0)
        start = torch.randn(1031, generator=g).to(device, dtype)
        grads = [torch.randn(1031, generator=g).to(device, dtype) for _ in range(2)]
        results = []
        for mode in ({"fused": True}, {"foreach": False}):
            p = torch.nn.Parameter(start.clone())
            opt = cls([p], **kwargs, **mode)
            for grad in grads:
                p.grad = grad.clone()
                opt.step()
            results.append(p.detach().double())
        scale = (results[1] - start.double()).abs().max().item()
        agrees = bool((results[0] - results[1]).abs().max().item() <= 1e-5 * scale + 1e-30)
    except Exception:  # a hyperparameter the fused kernel refuses, ...
        agrees = False
    _PROBED[key] = agrees
    return agrees


def _foreach_fits(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    if "foreach" not in group or group.get("differentiable") or group.get("fused"):
        return False
    if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        return False  # a third-party class may read ``foreach`` differently
    return all(not p.is_sparse for p in group["params"])


def use_fastest_kernel(optimizer: torch.optim.Optimizer) -> list[str]:
    """Switch every param group of ``optimizer`` with ``foreach`` and ``fused`` both
    unset to torch's fused kernel, or else its foreach kernel, where torch has one
    for the group's parameters. Returns, per group, ``"fused"``, ``"foreach"`` or
    ``"as built"``. Sets ``optimizer._step_supports_amp_scaling`` when every group
    ends up fused (torch's marker for optimizers that take ``grad_scale`` and
    ``found_inf``)."""
    choices: list[str] = []
    for group in optimizer.param_groups:
        if group.get("foreach") is not None or group.get("fused") is not None:
            choices.append("as built")
        elif _fused_fits(optimizer, group):
            group["fused"] = True
            choices.append("fused")
        elif _foreach_fits(optimizer, group):
            group["foreach"] = True
            choices.append("foreach")
        else:
            choices.append("as built")
    # torch's marker: every group fused over parameters the fused kernel steps (not a group
    # whose 16-bit parameters O2K's own kernel steps: they would miss grad_scale/found_inf)
    if optimizer.param_groups and all(
        bool(g.get("fused")) and all(p.dtype in _FUSED_DTYPES for p in g["params"]) for g in optimizer.param_groups
    ):
        torch_compat.mark_step_supports_amp_scaling(optimizer)
    return choices


class SparseWatch:
    """The param groups :func:`use_fastest_kernel` fused for an optimizer whose rule
    steps sparse grads (``OptimizerRule.sparse_grads``: Adagrad), watched until each of
    their parameters has had a grad once (a module gives its parameter grads of one
    layout: no cost per step after the first that sees them all). A group where a
    sparse grad shows goes back to torch's own choice (``fused`` unset again: its
    per-parameter loop takes sparse grads) before the optimizer steps, and its entry
    in ``kernels`` (:func:`use_fastest_kernel`'s choices) becomes ``"as built"``."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[dict, list[torch.Tensor]]] = {}  # id(group) -> (group, unseen params)

    def arm(self, optimizer: torch.optim.Optimizer, kernels: list[str]) -> None:
        """Watch the groups ``kernels`` says are fused (again after a load, which brings
        groups back with ``fused`` unset for :func:`use_fastest_kernel` to fuse)."""
        rule = rule_of(type(optimizer))
        if rule is None or not rule.sparse_grads:
            return
        self._pending = {id(g): (g, list(g["params"])) for g, choice in zip(optimizer.param_groups, kernels)
                         if choice == "fused"}  # fmt: skip

    def check(self, optimizer: torch.optim.Optimizer, kernels: list[str]) -> None:
        """Right before a step: unfuse each watched group with a sparse grad; stop
        watching the parameters that have had a dense one."""
        if not self._pending:
            return
        for key, (group, params) in list(self._pending.items()):
            left = [p for p in params if p.grad is None]
            if any(p.grad is not None and p.grad.is_sparse for p in params):
                group["fused"] = None
                optimizer.__dict__.pop("_step_supports_amp_scaling", None)  # not every group is fused now
                for i, g in enumerate(optimizer.param_groups):
                    if g is group and i < len(kernels):
                        kernels[i] = "as built"
                left = []
            if left:
                self._pending[key] = (group, left)
            else:
                del self._pending[key]


def fuse_wide_part(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Switch to torch's fused kernel a param group that :func:`use_fastest_kernel` set
    to ``foreach`` because it holds 16-bit parameters, when something else steps those
    and takes their grads off before torch's step (O2K's compensated updates): torch's
    step then sees only the group's fp32/fp64 parameters (normalization layers), which
    get the fused kernel under the same conditions as a wholly fp32 group (class,
    device, the probe). Parameters on the CPU only: the step counters ``foreach`` kept
    on the host would not follow a CUDA group to the device. Returns whether it switched
    (``foreach`` back to unset, ``fused=True``). Rules with ``fused_wide_part`` only
    (Adam, AdamW): Adagrad steps sparse grads (``nn.Embedding(sparse=True)``), which its
    fused kernel refuses."""
    rule = rule_of(type(optimizer))
    if rule is None or not rule.fused_wide_part or group.get("foreach") is not True or group.get("fused"):
        return False
    params = group["params"]
    if not all(p.device.type == "cpu" and not p.is_sparse for p in params) or "cpu" not in _fused_devices():
        return False
    wide = [p for p in params if p.dtype in _FUSED_DTYPES]
    if not wide or not _fused_steps_like_the_loop(optimizer, group, wide):
        return False
    group["foreach"], group["fused"] = None, True
    return True


def fuse_wide_parts(
    optimizer: torch.optim.Optimizer, kernels: list[str],
    listeners: list[Callable[[torch.optim.Optimizer, list[int]], None]] | None = None,
) -> list[Any]:
    """:func:`fuse_wide_part` for each group that ``kernels`` (:func:`use_fastest_kernel`'s
    choices, updated in place) says was set to ``foreach``, now, after every
    ``load_state_dict`` that brings back groups saved with ``foreach`` and ``fused``
    unset (which :func:`use_fastest_kernel`, hooked first, sets to ``foreach`` again),
    and, given the managed optimizer's ``listeners``, for groups added later when their
    kernel is chosen (their first step). Returns handles whose ``remove()`` removes the
    hooks and puts ``foreach`` back on the groups still fused this way (the optimizer
    then steps its 16-bit parameters itself)."""
    fused: list[dict] = []  # the groups switched here

    def fuse(opt: torch.optim.Optimizer, indices: Iterable[int]) -> None:
        for i in indices:
            if i < len(kernels) and kernels[i] == "foreach" and fuse_wide_part(opt, opt.param_groups[i]):
                kernels[i] = "fused"
                fused.append(opt.param_groups[i])

    fuse(optimizer, range(len(kernels)))
    if listeners is not None:
        listeners.append(fuse)
    unset: list[int] = []

    def before_load(opt: torch.optim.Optimizer, state_dict: dict) -> None:
        groups = state_dict.get("param_groups", []) if isinstance(state_dict, dict) else []
        unset[:] = [i for i, g in enumerate(groups) if isinstance(g, dict) and g.get("foreach") is None
                    and g.get("fused") is None]  # fmt: skip

    def after_load(opt: torch.optim.Optimizer) -> None:
        fused[:] = [g for g in fused if any(g is h for h in opt.param_groups)]
        for i in unset:
            if i < len(opt.param_groups) and fuse_wide_part(opt, opt.param_groups[i]):
                fused.append(opt.param_groups[i])
                if i < len(kernels):
                    kernels[i] = "fused"
        unset.clear()

    def unfuse() -> None:
        if listeners is not None and fuse in listeners:
            listeners.remove(fuse)
        for group in fused:
            if group.get("fused") and any(group is g for g in optimizer.param_groups):
                group["foreach"], group["fused"] = True, None
        fused.clear()

    return [optimizer.register_load_state_dict_pre_hook(before_load),
            optimizer.register_load_state_dict_post_hook(after_load), _Undo(unfuse)]  # fmt: skip


class _Undo:
    """A handle whose ``remove()`` runs a function once."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn

    def remove(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


# --- the overflow check when nothing needs unscaling ------------------------------------

#: Tensors from this size on are only read; smaller ones go through torch's fused check
#: (which also writes them back, times 1). A reduction and its flag cost a fixed ~15-25 us
#: on CPU: measured per bf16 tensor, the fused check took 9 / 27 / 114 / 458 us at
#: 32k / 128k / 512k / 2M elements, a sum 14 / 23 / 53 / ~150 us and ``aminmax``
#: 21 / 38 / 93 / 294 us.
READ_ONLY_NUMEL = 1 << 19

# Dtypes whose CPU sum is a superset test for inf/NaN: the sum is finite unless an
# element is inf/NaN or the finite elements overflow the dtype's range (fp32, bf16 and
# fp64 share or exceed fp32's, so only at |x| ~ 3e38 / numel); fp16's sum overflows at
# 65504 and is left to ``aminmax``.
_SUM_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _extremes_flag(tensors: list[torch.Tensor]) -> torch.Tensor:
    """1.0 if any tensor holds inf/NaN (``aminmax`` propagates NaN and shows +-inf)."""
    extremes = torch.stack([v.float() for t in tensors for v in torch.aminmax(t)])
    return (~torch.isfinite(extremes)).any().float()


def _read_only_flag(tensors: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The flag of tensors that must not be written. On CPU, for fp32/bf16/fp64, one sum
    per tensor (a single read at memory speed, ~2x faster than ``aminmax``): a sum is
    inf/NaN whenever an element is; when one is, the exact ``aminmax`` test decides for
    those tensors (a finite sum overflow is not an overflow of the grads). The host sync
    this needs is free on CPU; other devices, fp16 and code being traced by
    ``torch.compile`` (no host sync there) take ``aminmax`` directly."""
    if device.type != "cpu" or dtype not in _SUM_DTYPES or torch.compiler.is_compiling():
        return _extremes_flag(tensors)
    sums = torch.stack([t.sum() for t in tensors])
    finite = torch.isfinite(sums)
    if bool(finite.all()):
        return torch.zeros((), dtype=torch.float32, device=device)
    return _extremes_flag([t for t, ok in zip(tensors, finite.tolist()) if not ok])


def nonfinite_flag(
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]],
) -> torch.Tensor | None:
    """Like ``scaling.unscale_and_check_(groups, 1.0)``: a float32 0-dim tensor, 1.0 if
    any tensor holds inf/NaN, else 0.0 (``None`` for no tensors). Tensors from
    ``READ_ONLY_NUMEL`` elements are only read (on CPU a sum per tensor, confirmed by
    ``aminmax`` where a sum is not finite, with one host sync; elsewhere ``aminmax``,
    no host sync); smaller ones go through torch's fused check, which writes them back
    times 1 (the same values; a NaN may come back with other bits)."""
    total: torch.Tensor | None = None
    for (device, dtype), tensors in groups.items():
        sizes = [t.numel() for t in tensors]
        small = [t for t, n in zip(tensors, sizes) if 0 < n < READ_ONLY_NUMEL]
        large = [t for t, n in zip(tensors, sizes) if n >= READ_ONLY_NUMEL] if max(sizes, default=0) >= READ_ONLY_NUMEL else []
        flags = []
        if small or not large:
            found = torch.zeros((), dtype=torch.float32, device=device)
            if small:
                one = torch.ones((), dtype=torch.float32, device=device)
                torch_compat.amp_unscale_and_check_(small, found, one)
            flags.append(found)
        if large:
            flags.append(_read_only_flag(large, device, dtype))
        for flag in flags:
            total = flag if total is None else torch.maximum(total, flag.to(total.device))
    return total


def unscale_and_flag(
    tensors: list[torch.Tensor],
    flags: dict[torch.device, torch.Tensor],
    inv: float,
    constants: dict[tuple[torch.device, float], torch.Tensor],
) -> None:
    """In-place ``* inv`` and inf/NaN check of same-device, same-dtype ``tensors``, the
    flag kept (as a maximum) in ``flags[device]``; ``constants`` caches the 0-dim factor
    tensors. With ``inv == 1`` tensors from ``READ_ONLY_NUMEL`` elements are only read;
    with ``inv > 1`` (a scale below 1, where finite grads can overflow once unscaled)
    the products are checked again. No host sync but the CPU read-only check's."""
    device = tensors[0].device
    found = flags.get(device)
    if found is None:
        found = flags[device] = torch.zeros((), dtype=torch.float32, device=device)
    if inv == 1.0:  # nothing to multiply: large tensors are only read
        large = [t for t in tensors if t.numel() >= READ_ONLY_NUMEL]
        if large:
            flag = nonfinite_flag({(device, tensors[0].dtype): large})
            if flag is not None:
                torch.maximum(found, flag, out=found)
            tensors = [t for t in tensors if t.numel() < READ_ONLY_NUMEL]
            if not tensors:
                return
    for factor in (inv, 1.0) if inv > 1.0 else (inv,):
        factor_t = constants.get((device, factor))
        if factor_t is None:
            if len(constants) > 16:
                constants.clear()
            factor_t = constants[(device, factor)] = torch.full((), factor, dtype=torch.float32, device=device)
        torch_compat.amp_unscale_and_check_(tensors, found, factor_t)
