"""The converted layer: :class:`Float8Linear`, an ``nn.Linear`` whose class ``initialize``
switches in place."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .compiled import fp8_linear
from .recipe import LINEAR_CLASSES
from .scales import LayerState

_STATE_ATTR = "_ampkit_fp8"


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` converted by ``amp.initialize(..., fp8=...)``: same parameters, same
    ``state_dict``, its matmuls in fp8 (see :mod:`ampkit.levels.fp8`). The class of an
    existing ``nn.Linear`` is switched in place (identity, hooks, optimizer references and
    DDP wrapping are kept); :func:`ampkit.reset` switches it back.

    A deep copy (or an unpickled copy) of a converted layer is a ``Float8Linear`` with its
    own copy of the scale state, which ``amp.state_dict()`` does not save and
    ``amp.fp8.layers()`` does not list; :func:`ampkit.reset` switches copies back too."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if _STATE_ATTR in self.__dict__:
            _CONVERTED.add(self)  # reset switches a copy back as it does its original

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        state: LayerState | None = self.__dict__.get(_STATE_ATTR)
        if state is None:
            return super().forward(input)
        return fp8_linear(input, self.weight, self.bias, state)

    def extra_repr(self) -> str:
        state: LayerState | None = self.__dict__.get(_STATE_ATTR)
        tail = f", fp8={state.recipe.describe()}" if state is not None else ""
        return super().extra_repr() + tail


#: Every converted layer (originals and their copies), so that reset can switch them back
#: to ``nn.Linear``. Process-wide (a model is shared by the process's threads) and weak (a
#: dropped model is not kept alive); cleared by the ``_unconvert`` reset hook below.
_CONVERTED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


LINEAR_CLASSES.append(Float8Linear)  # a converted layer is chosen again by a later recipe
