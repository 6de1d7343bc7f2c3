"""Choosing torch's fastest kernel for an optimizer the user built with defaults.

``torch.optim`` optimizers built without ``foreach``/``fused`` step with a Python
loop over parameters on CPU (one op per parameter and formula term). Most have a
``foreach`` implementation (a few multi-tensor ops per step) and Adam, AdamW, SGD
and Adagrad have a ``fused`` one (one kernel pass per tensor; on a 38M-parameter
AdamW, 1 CPU thread: ~10x faster than the loop). They compute the same optimizer
(the same formulas; results can differ from the loop in the last bits).

:func:`use_fastest_kernel` sets ``fused=True`` (where torch has a fused kernel for
every parameter's device and dtype) or else ``foreach=True`` on each param group
whose ``foreach`` and ``fused`` are both unset (None), and leaves every group the
user pinned as it is. ``ampkit.init_trainer`` (hence ``ampkit.initialize``) calls it
unless ``fast_kernels=False``.

Memory: fused kernels allocate nothing; foreach implementations allocate
full-size temporaries during the step (e.g. Adam's denominator), as on CUDA where
foreach is torch's default.
"""

from __future__ import annotations

import torch

__all__ = ["use_fastest_kernel", "FUSED_OPTIMIZERS"]

#: Optimizer classes (exactly these, not subclasses that may override ``step``)
#: with a fused implementation in torch.
FUSED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
)
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_devices() -> list[str]:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def _fused_fits(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    if type(optimizer) not in FUSED_OPTIMIZERS or "fused" not in group:
        return False
    if group.get("differentiable") or group.get("capturable"):
        return False
    devices = _fused_devices()
    return all(
        p.device.type in devices and p.dtype in _FUSED_DTYPES and not p.is_sparse for p in group["params"]
    )


def _foreach_fits(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    if "foreach" not in group or group.get("differentiable"):
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
    if optimizer.param_groups and all(bool(g.get("fused")) for g in optimizer.param_groups):
        optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    return choices
