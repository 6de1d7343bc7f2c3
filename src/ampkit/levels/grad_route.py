""":class:`GradRoute`: the :class:`~ampkit.trainer.master_grads.MasterGrads` of one
:class:`~ampkit.levels.master.MasterWeights` (``MasterWeights.route``), which the
gradient route of its managed optimizer drives; each event is carried out by the
masters' :class:`~ampkit.levels.grad_mirror.GradMirror` and, for weights, by the
masters themselves."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ampkit.errors import StateError

if TYPE_CHECKING:
    from ampkit.trainer.master_grads import Unscale

    from .grad_mirror import GradMirror
    from .master import MasterWeights

__all__ = ["GradRoute"]


class GradRoute:
    """:class:`~ampkit.trainer.master_grads.MasterGrads` for ``masters`` (held weakly:
    the masters own their route)."""

    def __init__(self, masters: MasterWeights) -> None:
        self._owner = weakref.ref(masters)
        self._mirror: GradMirror = masters.grads

    @property
    def _weights(self) -> MasterWeights:
        mw = self._owner()
        if mw is None:
            raise StateError(
                "the fp32 master weights of this optimizer were released while its gradient route still "
                "ran; keep the optimizer ampkit.initialize returned (it holds them), or call ampkit.reset()."
            )
        return mw

    def refresh(self) -> None:
        self._weights.refresh()

    def model_param_of(self, stepped: torch.Tensor) -> torch.Tensor | None:
        return self._weights.model_param_of(stepped)  # type: ignore[arg-type]

    def may_hold(self, param: torch.Tensor) -> bool:
        return self._mirror.may_hold(param)

    def on_read(self, take_pending: Callable[[], None]) -> None:
        self._mirror.before_read = take_pending

    def before_forward(self) -> None:
        self._weights.publish_changed()
        self._mirror.drop_stale_views()

    def before_accumulate(self, param: torch.Tensor, raw: bool) -> bool:
        if raw:
            return self._mirror.settle_raw(param)
        self._mirror.settle(param)
        return True

    def take_in(self, param: torch.Tensor, unscale: Unscale, keep: bool) -> bool:
        return self._mirror.absorb(param, unscale, keep)

    def take_in_many(self, params: list[torch.Tensor], unscale: Unscale, keep: bool) -> list[bool]:
        return self._mirror.absorb_many(params, unscale, keep)

    def show(self, params: Sequence[torch.Tensor]) -> None:
        self._mirror.show(params)

    def held(self) -> list[torch.Tensor]:
        return [model_p for _, model_p in self._mirror.held()]

    def is_placeholder(self, stepped: torch.Tensor) -> bool:
        return self._mirror.is_placeholder(stepped)

    def reconcile(self, params: Sequence[torch.Tensor]) -> None:
        self._mirror.reconcile(params)

    def materialize(self) -> None:
        self._mirror.materialize()

    def follow(self, params: Sequence[torch.Tensor]) -> None:
        self._mirror.follow_masters(params)

    def before_step(self, params: Sequence[torch.Tensor]) -> None:
        self._mirror.hide(params)
        self._weights.sync_from_model()  # its per-tensor temporaries come after the copies are freed

    def after_zero_grad(self, params: Sequence[torch.Tensor]) -> None:
        self._mirror.after_zero_grad(params)
