"""Finding the models an optimizer trains (O2/O2K cast models, not optimizers):
the smallest live modules that own its parameters (:func:`_models_of`), whose names a
tuning plan uses."""

from __future__ import annotations

import gc

import torch
from torch import nn


def _live_modules() -> list[nn.Module]:
    # type(), not isinstance: some objects warn when their __class__ is read
    return [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]


def _is_wrapper(module: nn.Module) -> bool:
    """DDP / DataParallel / FSDP1: their buckets and flat parameters are built for the
    dtypes the model had when it was wrapped."""
    names = {c.__name__ for c in type(module).__mro__}
    return bool(names & {"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"})


def _models_of(params: list[torch.Tensor]) -> tuple[list[nn.Module], str | None]:
    """The smallest modules that together own ``params``: for each root module (no
    other module's child) owning some of them, its smallest descendant that owns all
    of its share and shares none with a sibling. A child holding every parameter is not
    the model when a sibling uses some of them too (GPT-2's ``lm_head`` tied to
    ``transformer.wte``): the script trains the parent, whose forward calls both.
    Returns (models, None) or ([], why not)."""
    wanted = {id(p) for p in params}
    modules = _live_modules()
    children = {id(c) for m in modules for c in m.children()}
    models: list[nn.Module] = []
    covered: set[int] = set()
    for root in modules:
        if id(root) in children:
            continue
        own = {id(p) for p in root.parameters()} & wanted
        if not own:
            continue
        if _is_wrapper(root):
            return [], (
                f"trains a model already wrapped in {type(root).__name__}: {{level}} casts the model "
                "before it is wrapped (build the optimizer before the wrapper to use it)"
            )
        model = root
        while (child := _sole_owner(model, own)) is not None:
            model = child
        models.append(model)
        covered |= own
    missing = len(wanted - covered)
    if missing:
        return [], (
            f"{missing} of its {len(wanted)} parameters belong to no nn.Module (bare tensors, or "
            "parameters re-created after the optimizer was built)"
        )
    return models, None


def _sole_owner(module: nn.Module, own: set[int]) -> nn.Module | None:
    """The child of ``module`` that owns all of ``own`` while no other child owns any of
    them (None: there is none)."""
    shares = [(child, {id(p) for p in child.parameters()} & own) for child in module.children()]
    holders = [(child, held) for child, held in shares if held]
    if len(holders) == 1 and holders[0][1] == own:
        return holders[0][0]
    return None
