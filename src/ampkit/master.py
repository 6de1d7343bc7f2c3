"""fp32 master weights for a model stored in 16 bits (opt level O2).

The optimizer never sees the model's fp16/bf16 parameters: each one is replaced,
at its position in ``optimizer.param_groups``, by an fp32 *master* copy. One step:

1. backward fills the model's 16-bit ``.grad`` (scaled by the loss scale);
2. :meth:`MasterWeights.gather_grads` (run before the grads are unscaled and
   checked) adds each model grad into its master's fp32 ``.grad`` and releases
   the 16-bit grad, so unscaling and the overflow check work in fp32;
3. the optimizer steps the masters (fp32 state, fp32 arithmetic);
4. after a real (not skipped) step, :meth:`MasterWeights.publish` rounds the
   masters into the model's 16-bit weights.

Masters are built from the fp32 weights *before* the model is cast, so no bit of
the initial weights is lost. Their values are saved by :meth:`state_dict` in
fp32; a resumed run loads them back instead of re-deriving them from the 16-bit
weights (which would lose the low bits, and with them exact resumption).
``Optimizer.load_state_dict`` casts floating state to the dtype of the parameter
at each position; as masters are fp32, the fp32 optimizer state survives it.

Parameters that are fp32 in the model (normalization layers under O2) are stepped
directly and have no master.

Known limit: the model's 16-bit grads are moved into the masters when the step
begins, so ``optimizer.zero_grad()`` (which only sees the masters) does not clear
model grads left by a backward pass whose step was never taken; call
:meth:`MasterWeights.zero_model_grads` (or ``model.zero_grad()``) when you drop
a batch between backward and step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .errors import AmpError, StateError

__all__ = ["MasterWeights"]

_STATE_FORMAT = 1


class MasterWeights:
    """fp32 master copies of an optimizer's 16-bit parameters.

    Args:
        optimizer: a ``torch.optim.Optimizer`` whose ``param_groups`` hold the
            model's parameters.
        params: the parameters that get a master. They must still be fp32 (the
            model is cast after this object is built), so masters start exact.
            Default: every floating parameter of the optimizer that is not fp32
            (masters then start from the 16-bit values; use this for a model
            that was cast before).

    After construction ``optimizer.param_groups`` holds the masters in place of
    those parameters, and any optimizer state held for a parameter is moved to
    its master (as fp32).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter] | None = None
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise AmpError(f"MasterWeights expects a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        self.optimizer = optimizer
        self._model_of: dict[int, nn.Parameter] = {}  # id(master) -> model param
        self._masters: dict[int, nn.Parameter] = {}  # id(model param) -> master
        self._layout: tuple[int, ...] = ()
        if params is None:
            wanted = None
        else:
            wanted = {id(p) for p in params}
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) in wanted and p.dtype != torch.float32:
                        raise AmpError(
                            f"a parameter of dtype {p.dtype} was given to MasterWeights "
                            "as fp32: build master weights from the fp32 model before "
                            "casting it (ampkit.initialize does this for you)."
                        )
        self._adopt(wanted)

    # -- which parameters have masters ------------------------------------------------

    def _adopt(self, wanted: set[int] | None) -> None:
        """Swap in masters for ``wanted`` params (None: every non-fp32 floating
        param not yet mastered) across all param groups."""
        for group in self.optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if id(p) in self._model_of:
                    continue
                if wanted is None:
                    if not p.is_floating_point() or p.dtype == torch.float32:
                        continue
                elif id(p) not in wanted:
                    continue
                params[i] = self._make_master(p)
        self._layout = self._current_layout()

    def _make_master(self, p: nn.Parameter) -> nn.Parameter:
        master = nn.Parameter(
            p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad
        )
        if p.grad is not None:
            master.grad = p.grad.detach().to(torch.float32)
            p.grad = None
        state = self.optimizer.state.pop(p, None)
        if state:
            self.optimizer.state[master] = {
                k: v.to(torch.float32) if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
                for k, v in state.items()
            }
        self._model_of[id(master)] = p
        self._masters[id(p)] = master
        return master

    def _current_layout(self) -> tuple[int, ...]:
        return tuple(len(g["params"]) for g in self.optimizer.param_groups)

    def refresh(self) -> None:
        """Give masters to 16-bit parameters added since (``add_param_group``).
        Their masters start from the 16-bit values, the only copy there is.
        Called by every method below; cheap when nothing changed."""
        if self._current_layout() != self._layout:
            self._adopt(None)

    # -- what users read -------------------------------------------------------------

    def pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(model parameter, fp32 master) for every mastered parameter, in
        ``param_groups`` order."""
        self.refresh()
        return [
            (self._model_of[id(p)], p)
            for g in self.optimizer.param_groups
            for p in g["params"]
            if id(p) in self._model_of
        ]

    def master_of(self, param: nn.Parameter) -> nn.Parameter | None:
        """The fp32 master of a model parameter, or None if it has none."""
        self.refresh()
        return self._masters.get(id(param))

    def model_param_of(self, master: nn.Parameter) -> nn.Parameter | None:
        """The model parameter a master stands for, or None."""
        return self._model_of.get(id(master))

    def params(self) -> Iterator[nn.Parameter]:
        """Every parameter the optimizer steps (masters and fp32 model params), in
        ``param_groups`` order: what to clip."""
        self.refresh()
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def backward_params(self) -> _BackwardParams:
        """A live view of the tensors backward accumulates into: the model parameter
        in place of each master, other parameters as they are (follows
        ``add_param_group``)."""
        return _BackwardParams(self)

    # -- the step --------------------------------------------------------------------

    def gather_grads(self) -> None:
        """Add each model grad into its master's fp32 grad and release the 16-bit
        grad. A master whose model param got no grad keeps its own."""
        self.refresh()
        with torch.no_grad():
            for model_p, master in self.pairs():
                g = model_p.grad
                if g is None:
                    continue
                if master.grad is None:
                    master.grad = g.to(torch.float32)
                else:
                    master.grad.add_(g)
                model_p.grad = None

    def publish(self) -> None:
        """Round every master into its model parameter (after a real step)."""
        pairs = self.pairs()
        if not pairs:
            return
        with torch.no_grad():
            torch._foreach_copy_([m for m, _ in pairs], [p for _, p in pairs])

    def sync_from_model(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Re-derive the master of each model parameter (of ``params``; default: all)
        whose 16-bit value is no longer its master rounded, i.e. that was changed
        outside ampkit (``model.load_state_dict`` after ``initialize``). Masters that
        still round to their model weight keep their low bits. ``initialize`` calls
        this from a load-state-dict hook on the model."""
        if params is None:
            pairs = self.pairs()
        else:
            pairs = [(p, m) for p in params if (m := self.master_of(p)) is not None]
        with torch.no_grad():
            for model_p, master in pairs:
                if not torch.equal(master.to(model_p.dtype), model_p):
                    master.copy_(model_p)

    def zero_model_grads(self) -> None:
        """Drop the model's 16-bit grads not yet moved into the masters."""
        for model_p, _ in self.pairs():
            model_p.grad = None

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"format": 1, "masters": [[group, index, fp32 tensor], ...]}``: the
        position in ``param_groups`` and the value of every master."""
        self.refresh()
        entries = [
            [gi, pi, p.detach()]
            for gi, g in enumerate(self.optimizer.param_groups)
            for pi, p in enumerate(g["params"])
            if id(p) in self._model_of
        ]
        return {"format": _STATE_FORMAT, "masters": entries}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore master values saved by :meth:`state_dict` and round them into
        the model. The optimizer must have the same param groups as when saved.
        Validated completely first (:meth:`check_state_dict`): a rejected state
        raises :class:`~ampkit.StateError` and changes nothing."""
        saved = self._checked(state)
        groups = self.optimizer.param_groups
        with torch.no_grad():
            for (gi, pi), t in saved.items():
                groups[gi]["params"][pi].copy_(t)
        self.publish()

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise :class:`~ampkit.StateError` unless :meth:`load_state_dict` would
        accept ``state``: format 1, one fp32 tensor per mastered position of
        ``param_groups``, each of its master's shape."""
        self._checked(state)

    def _checked(self, state: Any) -> dict[tuple[int, int], torch.Tensor]:
        self.refresh()
        if not isinstance(state, Mapping) or type(state.get("format")) is not int or state["format"] != _STATE_FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise StateError(
                f"master-weight state has format {found!r}, expected "
                f"{_STATE_FORMAT}: it was not written by MasterWeights.state_dict()."
            )
        entries = state.get("masters")
        if not isinstance(entries, (list, tuple)):
            raise StateError(f"master-weight state: 'masters' must be a list, got {entries!r:.80}.")
        saved: dict[tuple[int, int], torch.Tensor] = {}
        for entry in entries:
            if not (
                isinstance(entry, (list, tuple))
                and len(entry) == 3
                and all(isinstance(i, int) and not isinstance(i, bool) for i in entry[:2])
                and isinstance(entry[2], torch.Tensor)
            ):
                raise StateError(
                    f"master-weight state: each entry must be [group, index, tensor], got {entry!r:.80}."
                )
            gi, pi, t = entry
            if (gi, pi) in saved:
                raise StateError(f"master-weight state: position ({gi}, {pi}) appears twice.")
            saved[(gi, pi)] = t
        groups = self.optimizer.param_groups
        mine = {
            (gi, pi): p
            for gi, g in enumerate(groups)
            for pi, p in enumerate(g["params"])
            if id(p) in self._model_of
        }
        if set(saved) != set(mine):
            raise StateError(
                f"the checkpoint has master weights at {len(saved)} positions and this "
                f"optimizer at {len(mine)} ({sorted(set(saved) ^ set(mine))[:4]} differ): "
                "build the model, optimizer and param groups as in the saved run, and "
                "call initialize with the same opt level, before loading."
            )
        for (gi, pi), t in saved.items():
            master = mine[(gi, pi)]
            if t.dtype != torch.float32 or t.is_sparse or master.shape != t.shape:
                raise StateError(
                    f"saved master weight at group {gi}, index {pi} is a {t.dtype} tensor of "
                    f"shape {tuple(t.shape)}; the optimizer's is float32 {tuple(master.shape)}: "
                    "the model does not match the checkpoint (masters are saved in fp32)."
                )
        return saved


class _BackwardParams:
    """Iterable over the parameters backward writes grads to, re-read on every
    iteration (the loss scaler rescales these grads between two losses of a step)."""

    def __init__(self, masters: MasterWeights) -> None:
        self._masters = masters

    def __iter__(self) -> Iterator[nn.Parameter]:
        mw = self._masters
        mw.refresh()
        for group in mw.optimizer.param_groups:
            for p in group["params"]:
                yield mw._model_of.get(id(p), p)
