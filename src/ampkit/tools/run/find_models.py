"""Finding the models an optimizer trains (O2/O2K cast models, not optimizers):
the smallest live modules that own its parameters (:func:`_models_of`)."""

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
    of its share. Returns (models, None) or ([], why not)."""
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
        descended = True
        while descended:
            descended = False
            for child in model.children():
                if own <= {id(p) for p in child.parameters()}:
                    model, descended = child, True
                    break
        models.append(model)
        covered |= own
    missing = len(wanted - covered)
    if missing:
        return [], (
            f"{missing} of its {len(wanted)} parameters belong to no nn.Module (bare tensors, or "
            "parameters re-created after the optimizer was built)"
        )
    return models, None
