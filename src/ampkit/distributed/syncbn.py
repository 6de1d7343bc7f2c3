"""SyncBatchNorm under ampkit: :func:`convert_sync_batchnorm` replaces BatchNorm layers
by ``torch.nn.SyncBatchNorm`` in a model an opt level may already have cast, keeping the
layers' dtypes and ampkit's cast hooks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit.errors import DistributedError
from ampkit.levels import model_cast as _model

__all__ = ["convert_sync_batchnorm", "convert_bn"]


def convert_sync_batchnorm(model: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every BatchNorm layer of ``model`` by ``torch.nn.SyncBatchNorm`` (batch
    statistics computed over the ranks of ``process_group``, default None: all ranks)
    and return the model (a new object if ``model``
    itself is a BatchNorm layer).

    The new layers keep the same ``Parameter`` and buffer objects (so optimizers and
    fp32 master weights still point at them) and ampkit's cast hooks: under O2 they stay
    fp32, run on fp32 inputs and hand their output back in the compute dtype. Call it
    before or after ``ampkit.initialize`` and before wrapping in DDP.

    Raises :class:`~ampkit.DistributedError` without a GPU: torch's SyncBatchNorm only
    runs on CUDA (and a few other accelerators), not on CPU.
    """
    if not torch.cuda.is_available():
        raise DistributedError(
            "SyncBatchNorm is GPU-only in torch: its training forward needs CUDA tensors, "
            "and this machine has no CUDA device. On CPU keep plain BatchNorm (each rank "
            "normalizes with its own batch statistics; DDP broadcasts rank 0's running "
            "statistics every forward), or use GroupNorm/LayerNorm, which need no syncing."
        )
    return convert_bn(model, process_group)


def convert_bn(module: nn.Module, process_group: Any) -> nn.Module:
    if isinstance(module, torch_compat.BATCH_NORM_BASE):
        new = nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
        _move_cast_hooks(module, new)
        return new
    for name, child in list(module.named_children()):
        converted = convert_bn(child, process_group)
        if converted is not child:
            torch_compat.replace_child(module, name, converted)
    return module


def _move_cast_hooks(old: nn.Module, new: nn.Module) -> None:
    """Re-register on ``new`` the input/output cast hooks ampkit put on ``old`` (a layer
    replaced by another, e.g. BatchNorm by SyncBatchNorm)."""
    handles = _model.HANDLES.pop(old, [])
    moved = []
    for handle in handles:
        hid = handle.id
        old_hooks = torch_compat.module_hook_dicts(old)
        if hid in old_hooks.pre:
            fn = old_hooks.pre[hid]
            with_kwargs = hid in old_hooks.pre_with_kwargs
            moved.append(new.register_forward_pre_hook(fn, with_kwargs=with_kwargs))
        elif hid in old_hooks.post:
            moved.append(new.register_forward_hook(old_hooks.post[hid]))
        handle.remove()
    if moved:
        _model.HANDLES[new] = moved


