"""``nn.Module``'s private state: the global and per-module forward hook dicts, its
children, parameters and buffers as stored, the names wrappers insert, and the private
base classes of torch's norm and transposed-conv layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn


def forward_hook_dicts() -> tuple[dict[int, Any], dict[int, Any], dict[int, bool] | None]:
    """torch's global forward hook dicts: ``(pre hooks, hooks, always-called flags)``
    of ``torch.nn.modules.module`` (``_global_forward_pre_hooks``,
    ``_global_forward_hooks``, ``_global_forward_hooks_always_called``; the last None on
    a torch without ``always_call``). ``nn.Module.__call__`` consults them on every
    call; the casting engine's module rules live in them."""
    reg = nn.modules.module
    return (
        reg._global_forward_pre_hooks,
        reg._global_forward_hooks,
        getattr(reg, "_global_forward_hooks_always_called", None),
    )


def can_reinstall_global_forward_hooks() -> bool:
    """Whether hooks can be put back under their old ids (:func:`reinstall_global_forward_hooks`)."""
    return forward_hook_dicts()[2] is not None


def reinstall_global_forward_hooks(pre_id: int, pre: Callable[..., Any], post_id: int, post: Callable[..., Any]) -> None:
    """Put a global forward pre hook and an always-called forward hook back under the ids
    they were first registered with. torch.compile guards compiled code on the global
    hook dicts' keys and values, so the same functions under the same keys keep code
    compiled under one scope valid under the next."""
    pres, posts, always = forward_hook_dicts()
    pres[pre_id] = pre
    posts[post_id] = post
    if always is not None:
        always[post_id] = True


def remove_global_forward_hooks(pre_id: int, post_id: int) -> None:
    """Remove the hooks :func:`reinstall_global_forward_hooks` put in (or that
    ``register_module_forward_*hook`` returned those ids for)."""
    pres, posts, always = forward_hook_dicts()
    pres.pop(pre_id, None)
    posts.pop(post_id, None)
    if always is not None:
        always.pop(post_id, None)


class ModuleHookDicts(NamedTuple):
    """A module's own hook dicts (hook id -> hook, or id -> flag), as ``nn.Module``
    stores them: ``_forward_pre_hooks``, ``_forward_pre_hooks_with_kwargs``,
    ``_forward_hooks``, ``_forward_hooks_with_kwargs``, ``_forward_hooks_always_called``.
    Hooks ampkit put on a model are found (and removed, also on a copy or an unpickled
    model, whose handles are gone) through them."""

    pre: dict[int, Any]
    pre_with_kwargs: dict[int, bool]
    post: dict[int, Any]
    post_with_kwargs: dict[int, bool]
    post_always_called: dict[int, bool]


def module_hook_dicts(module: nn.Module) -> ModuleHookDicts:
    """``module``'s hook dicts (:class:`ModuleHookDicts`)."""
    return ModuleHookDicts(
        module._forward_pre_hooks,
        module._forward_pre_hooks_with_kwargs,
        module._forward_hooks,
        module._forward_hooks_with_kwargs,
        module._forward_hooks_always_called,
    )


def forward_pre_hooks_of(module: nn.Module) -> dict[int, Any]:
    """``module._forward_pre_hooks`` (hook id -> hook), in registration order."""
    return module._forward_pre_hooks


def forward_pre_hooks_with_kwargs(module: nn.Module) -> dict[int, bool]:
    """``module._forward_pre_hooks_with_kwargs``: ids of pre hooks registered with
    ``with_kwargs=True``; a hook moved to another module must keep its entry."""
    return module._forward_pre_hooks_with_kwargs


def submodules_of(module: nn.Module) -> list[nn.Module | None]:
    """``module``'s direct children as stored (``module._modules.values()``, None for a
    child set to None): read without building ``named_children``'s generator."""
    return list(module._modules.values())


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module._parameters``: its own parameters by name, None for one set to None
    (``named_parameters(recurse=False)`` skips those)."""
    return module._parameters


def replace_buffer(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in place of ``module``'s buffer ``name`` (``module._buffers[name]``),
    keeping whether it is persistent (saved in the state_dict)."""
    module._buffers[name] = tensor


def replace_child(module: nn.Module, name: str, child: nn.Module) -> None:
    """Put ``child`` in place of ``module``'s submodule ``name`` (``module._modules[name]``),
    in the same position of the module's children."""
    module._modules[name] = child


WRAPPER_PATH_PARTS: tuple[str, ...] = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""The attribute names wrappers insert in qualified module names: ``torch.compile``'s
``OptimizedModule``, FSDP1's ``FullyShardedDataParallel``, ``checkpoint_wrapper``.
Name rules drop them, so ``block._orig_mod.norm`` matches a rule for ``block.norm``."""


def swap_module_class(module: nn.Module, cls: type[nn.Module]) -> None:
    """Change ``module``'s class in place (``module.__class__ = cls``): parameters,
    buffers, hooks and state_dict keys stay, only methods change. ``cls`` must be a
    subclass of (or the base of) ``type(module)`` with no ``__slots__`` of its own."""
    module.__class__ = cls


BATCH_NORM_BASE: type = nn.modules.batchnorm._BatchNorm
"""``nn.modules.batchnorm._BatchNorm``: the base of BatchNorm1d/2d/3d and SyncBatchNorm
(norm layers kept fp32, SyncBN conversion, BN folding)."""

INSTANCE_NORM_BASE: type = nn.modules.instancenorm._InstanceNorm
"""``nn.modules.instancenorm._InstanceNorm``: the base of InstanceNorm1d/2d/3d."""

CONV_TRANSPOSE_BASE: type = nn.modules.conv._ConvTransposeNd
"""``nn.modules.conv._ConvTransposeNd``: the base of ConvTranspose1d/2d/3d (their weight
is laid out ``(in, out, ...)``, which BN folding must know)."""
