"""The one interface between the gradient route of a managed optimizer
(``ampkit.trainer.grad_hooks.GradPath``) and fp32 master weights (O2):
:class:`MasterGrads`.

The route owns the hooks and knows *when* something happens to a gradient (backward is
about to add into a parameter's grad, a backward pass ended, the step begins,
``zero_grad`` ran, code outside ampkit unscaled the grads); the masters know *what* that
means for the two views of one gradient (the model's 16-bit grad, the master's fp32
grad). Each method of :class:`MasterGrads` is one such event or one question the route
asks; nothing else of the masters is reached from this layer.
``ampkit.levels.grad_route.GradRoute`` implements it for
:class:`~ampkit.levels.master.MasterWeights` (``MasterWeights.route``).

Parameters named here are the model's (the 16-bit tensors backward accumulates into),
except where a method says *stepped* (the optimizer's parameter: a master, or a
parameter stepped as it is)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["MasterGrads", "Unscale"]

#: In-place ``* (1/scale)`` and inf/NaN check of a list of same-device, same-dtype
#: tensors (the route's unscaling of one loss); None where there is nothing to do.
Unscale = Callable[[list[torch.Tensor]], None] | None


@runtime_checkable
class MasterGrads(Protocol):
    """What the gradient route (``GradPath``) asks of fp32 master weights.

    Setup: :meth:`refresh`, :meth:`model_param_of`, :meth:`may_hold`, :meth:`on_read`. Forward:
    :meth:`before_forward`. Backward: :meth:`before_accumulate`, :meth:`take_in`,
    :meth:`take_in_many`, :meth:`show`. Between backward and the step: :meth:`held`,
    :meth:`is_placeholder`, :meth:`reconcile`, :meth:`materialize`, :meth:`follow`.
    The step and ``zero_grad``: :meth:`before_step`, :meth:`show` again after it,
    :meth:`after_zero_grad`."""

    def refresh(self) -> None:
        """Give masters to 16-bit parameters added to the optimizer since
        (``add_param_group``); cheap when none were."""
        ...

    def model_param_of(self, stepped: torch.Tensor) -> torch.Tensor | None:
        """The model parameter the optimizer's parameter ``stepped`` (a master) stands
        for; None where it has no master (it is stepped as it is)."""
        ...

    def may_hold(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s first grad of a step can stay on the model in 16 bits
        (held: no fp32 copy; the step reads it)."""
        ...

    def on_read(self, take_pending: Callable[[], None]) -> None:
        """Call ``take_pending`` before anything reads which grads are held or derives
        the fp32 grads (the route's pending grads are taken in first)."""
        ...

    def before_forward(self) -> None:
        """A forward of a model holding masters begins: masters changed outside the
        step are rounded into the model; stale grad views are dropped."""
        ...

    def before_accumulate(self, param: torch.Tensor, raw: bool) -> bool:
        """Backward is about to add into ``param.grad``: merge what was done to either
        view since, then free the 16-bit copy. ``raw``: the 16-bit grad is held
        unreduced for DDP; returns whether it still is (False: cleared through either
        view, or ``param`` has no master). Without ``raw``: True."""
        ...

    def take_in(self, param: torch.Tensor, unscale: Unscale, keep: bool) -> bool:
        """Move ``param``'s new 16-bit grad into its master (``unscale`` applied), or
        hold it on the model where ``keep`` (the promise that ``unscale`` only checks)
        allows. Returns True when the grad was left unchecked for the step to check."""
        ...

    def take_in_many(self, params: list[torch.Tensor], unscale: Unscale, keep: bool) -> list[bool]:
        """:meth:`take_in` for the grads of one backward pass, in a few multi-tensor
        calls; the same result per parameter."""
        ...

    def show(self, params: Sequence[torch.Tensor]) -> None:
        """Give each of ``params`` its master's grad as a 16-bit grad to read and edit
        (after backward, and after the step)."""
        ...

    def held(self) -> list[torch.Tensor]:
        """The model parameters whose 16-bit grad is held as the gradient (the step
        checks and reads these), in ``param_groups`` order."""
        ...

    def is_placeholder(self, stepped: torch.Tensor) -> bool:
        """Whether ``stepped.grad`` is the placeholder of a held grad (no values of its
        own: nothing to check there)."""
        ...

    def reconcile(self, params: Sequence[torch.Tensor]) -> None:
        """Before the grads are checked: merge edits made through the 16-bit grads of
        ``params`` into the masters' fp32 grads."""
        ...

    def materialize(self) -> None:
        """Give every held grad its fp32 copy on the master (something will read the
        masters' grads: code outside ampkit, a closure's step, the route's removal)."""
        ...

    def follow(self, params: Sequence[torch.Tensor]) -> None:
        """Code outside ampkit just unscaled the masters' grads in place (no version
        counter tells): the 16-bit grads of ``params`` take the new values."""
        ...

    def before_step(self, params: Sequence[torch.Tensor]) -> None:
        """The optimizer is about to step: the 16-bit copies of ``params`` come off the
        model (:meth:`show` brings them back) and the masters take in model weights
        changed outside ampkit."""
        ...

    def after_zero_grad(self, params: Sequence[torch.Tensor]) -> None:
        """``optimizer.zero_grad()`` just ran: the 16-bit grads of ``params`` show what
        it did to the masters'."""
        ...
