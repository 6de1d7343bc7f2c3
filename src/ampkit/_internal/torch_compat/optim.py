"""Private markers and hook dicts of torch's optimizers and LR schedulers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


def fused_optimizer_devices() -> list[str]:
    """The device types torch's fused optimizer kernels run on
    (``torch.optim.optimizer._get_fused_kernels_supported_devices``)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def mark_step_supports_amp_scaling(optimizer: torch.optim.Optimizer) -> None:
    """Set ``optimizer._step_supports_amp_scaling``: its ``step`` takes ``grad_scale``
    and ``found_inf`` (what fused optimizers declare to ``torch.amp.GradScaler``)."""
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Set ``optimizer._opt_called``: LR schedulers read it to warn about a scheduler
    stepped before its optimizer."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> tuple[list[Callable[..., Any]], list[Callable[..., Any]]]:
    """The step pre- and post-hooks registered on ``optimizer`` itself, in order: the dicts
    ``_optimizer_step_pre_hooks``/``_post_hooks`` that torch's ``profile_hook_step`` reads
    at each ``step``; renamed, a managed step would run them twice or not at all."""
    pre = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    post = getattr(optimizer, "_optimizer_step_post_hooks", None)
    return (list(pre.values()) if pre else [], list(post.values()) if post else [])


def global_optimizer_step_hooks() -> int:
    """How many ``torch.optim.optimizer._global_optimizer_pre_hooks``/``_post_hooks`` are set."""
    from torch.optim import optimizer as o

    return len(getattr(o, "_global_optimizer_pre_hooks", ())) + len(getattr(o, "_global_optimizer_post_hooks", ()))


@contextlib.contextmanager
def instance_step_hooks_suspended(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within the block, ``optimizer.step`` runs none of the optimizer's own step hooks
    (the caller ran them); they come back after, new ones included. Global hooks are
    not suspended: they are process-wide, other threads may be stepping."""
    names = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
    saved = [optimizer.__dict__.get(name) for name in names]
    if not any(saved):
        yield
        return
    for name, hooks in zip(names, saved):
        if hooks is not None:
            optimizer.__dict__[name] = type(hooks)()
    try:
        yield
    finally:
        for name, hooks in zip(names, saved):
            if hooks is not None:
                added = optimizer.__dict__[name]
                hooks.update(added)  # registered while suspended: kept
                optimizer.__dict__[name] = hooks


def step_wrapped_by_lr_scheduler(step: Any) -> bool:
    """Whether an LR scheduler wrapped this ``optimizer.step`` (its ``_wrapped_by_lr_sched``
    marker: a scheduler created before wraps the step once and sets it)."""
    return hasattr(step, "_wrapped_by_lr_sched")


def mark_step_wrapped_by_lr_scheduler(step: Any) -> None:
    """Set the ``_wrapped_by_lr_sched`` marker on a step function that replaces one an
    LR scheduler wrapped, so the scheduler does not wrap it again."""
    step._wrapped_by_lr_sched = True
