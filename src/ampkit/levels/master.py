"""fp32 master weights for a model stored in 16 bits (opt level O2).

The optimizer never sees the model's fp16/bf16 parameters: each is replaced, at its
position in ``optimizer.param_groups``, by an fp32 master built from the fp32 weights
*before* the model is cast (no bit of the initial weights is lost). :class:`MasterWeights`
holds the pairs, rounds the masters into the model after a taken step
(:meth:`MasterWeights.publish`), takes model weights changed outside ampkit into their
masters (:meth:`MasterWeights.sync_from_model`) and masters changed outside the managed
step into the model (:meth:`MasterWeights.publish_changed`), and saves the masters in
fp32 (:meth:`MasterWeights.state_dict`: a resumed run continues from the exact values;
``Optimizer.load_state_dict`` casts state to each position's dtype, fp32 here). The
model's 16-bit grads and the masters' fp32 grads are kept one gradient by its
:class:`~ampkit.levels.grad_mirror.GradMirror` (``MasterWeights.grads``), under the
trainer's hooks (:mod:`ampkit.trainer.grad_hooks`); without the trainer,
:meth:`MasterWeights.gather_grads` moves the grads by hand. Edits made through ``.data``
are found by value (:func:`ampkit.levels.rounding.rounds_to`).

Parameters that are fp32 in the model (normalization layers under O2) are stepped
directly and have no master. The whole cycle of a step: ``docs/concepts/fp32.md``
("Master weights").
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit._internal.dtypes import cast_optimizer_state
from ampkit._internal.validate import (
    ABSURD_MAGNITUDE,
    CORRUPT_CHECKPOINT,
    require_choice,
    require_fields,
    require_optimizer,
    require_tensor,
)
from ampkit.errors import AmpError, StateError

from .grad_mirror import GradMirror
from .grad_route import GradRoute
from .rounding import compared_ahead, unrounded

__all__ = ["MasterWeights", "MODEL_GRADS", "MASTER_GRADS"]

_STATE_FORMAT = 1
#: Methods of 0.3's ``MasterWeights`` that are :class:`GradMirror`'s today.
_MIRROR_METHODS_OF_0_3 = frozenset({
    "absorb", "show", "settle", "settle_raw", "reconcile", "after_zero_grad", "follow_masters", "hide",
    "drop_stale_views", "materialize_except", "lift", "restore",
})  # fmt: skip


#: How the model's parameters show their grads (``MasterWeights(model_grads=...)``):
#: ``"copy"``, a 16-bit tensor of its own rounded from the fp32 grad; ``"view"``, where
#: the fp32 grad holds bf16 values exactly, a bf16 view of its high halves (no memory).
MODEL_GRADS: tuple[str, ...] = ("copy", "view")

#: When a master's fp32 grad exists (``MasterWeights(master_grads=...)``): ``"on_demand"``,
#: only once something needs it (see :class:`MasterWeights`); ``"always"``, from the
#: moment backward produces each grad.
MASTER_GRADS: tuple[str, ...] = ("on_demand", "always")



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
        model_grads: how model parameters show their grads between backward and
            the next backward. ``"copy"`` (default): a 16-bit tensor of their own,
            the fp32 grad rounded (contiguous; a uniform rescale of it, as
            ``clip_grad_norm_`` does, rescales the fp32 grad by the same factor in
            fp32). ``"view"``: for bf16 parameters whose fp32 grad holds bf16 values
            exactly (a loss scale of 1, one backward per step, outside DDP), a bf16
            view of the fp32 grad's high halves: the two share memory, so the model's
            grads cost nothing (AdamW under O2: 18 bytes per parameter at the step
            instead of 20) and edits made through them land in the fp32 grad directly,
            rounded to bf16 (a clipped grad is bf16(c * g) rather than c * g in fp32);
            the view is strided (stride 2 in its last dim: not ``is_contiguous()``),
            and after fp32-side edits it shows the fp32 grad truncated to bf16. Any
            other grad is shown as a copy.
        master_grads: ``"on_demand"`` (default) or ``"always"``. With
            ``"on_demand"``, a 16-bit grad that is the whole gradient of its step (the
            first backward into the parameter since its grads were cleared, loss scale
            1, outside DDP, dense, on ``grad_mirror.ON_DEMAND_DEVICES``) stays on the model
            parameter as backward produced it and the master's ``.grad`` is a
            placeholder (a zero-strided fp32 zero, no memory; :meth:`is_placeholder`),
            through which clearing or zeroing by the optimizer's ``zero_grad`` shows
            (*held*): the step reads the 16-bit grad directly
            (:mod:`ampkit.levels.one_pass`; no fp32 grad is ever allocated for
            Adam, AdamW and SGD), and the fp32 grad, its exact widening, is derived
            the moment anything else needs it: a second backward into the parameter
            (accumulation then runs in fp32), :func:`ampkit.master_params`,
            :meth:`pairs`, :meth:`master_of`, reading ``optimizer.param_groups`` from
            code outside ampkit and ``torch.optim`` (e.g. ``clip_grad_norm_`` over
            them), an unscale by a ``torch.amp.GradScaler``, or a step of an optimizer
            without a one-pass kernel. ``"always"``: the fp32 grad is made as each
            grad is produced. ``model_grads="view"`` needs the fp32 grads, so it
            implies ``"always"``.

    After construction ``optimizer.param_groups`` holds the masters in place of
    those parameters, and any optimizer state held for a parameter is moved to
    its master (as fp32).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Iterable[nn.Parameter] | None = None,
        *,
        model_grads: str = "copy",
        master_grads: str = "on_demand",
    ) -> None:
        require_optimizer(optimizer, "MasterWeights")
        require_choice(model_grads, MODEL_GRADS, "model_grads")
        require_choice(master_grads, MASTER_GRADS, "master_grads")
        self.optimizer = optimizer
        self.model_grads = model_grads
        self.master_grads = master_grads
        self._model_of: dict[int, nn.Parameter] = {}  # id(master) -> model param
        self._masters: dict[int, nn.Parameter] = {}  # id(model param) -> master
        self._layout: tuple[int, ...] = ()
        self._published: dict[int, int] = {}  # id(master) -> its version when last published
        #: the model's 16-bit grads and the masters' fp32 grads, one gradient
        self.grads = GradMirror(self._masters, self._model_of, self._pairs, model_grads, master_grads)
        #: what the gradient route of a managed optimizer drives (a
        #: :class:`~ampkit.trainer.master_grads.MasterGrads`; ampkit's own)
        self.route = GradRoute(self)
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
        for group in self.optimizer.param_groups:
            if self._model_of and type(group["params"]) is list:
                group["params"] = _MasterList(group["params"], self)
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
            self.optimizer.state[master] = cast_optimizer_state(state, torch.float32)
        self._model_of[id(master)] = p
        self._masters[id(p)] = master
        self._published[id(master)] = torch_compat.tensor_version(master)
        return master

    def check_new_params(self, params: list[torch.Tensor]) -> None:
        """Raise :class:`~ampkit.StateError` if ``params`` (a param group about to be
        added) holds a model parameter that has a master already, or a 16-bit one twice:
        it would get a second master, both stepped."""
        seen: set[int] = set()
        for p in params:
            if id(p) in self._masters or (id(p) in seen and p.is_floating_point() and p.dtype != torch.float32):
                raise StateError(
                    "add_param_group: a model parameter is in the new param group twice, or already in another "
                    "group of this optimizer (whose fp32 master stands for it); each parameter must be in one "
                    "group, once. Change the existing group's options instead (optimizer.param_groups[i])."
                )  # fmt: skip
            seen.add(id(p))

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
        ``param_groups`` order. Held grads (``master_grads="on_demand"``) get their
        fp32 copies first: the masters' ``.grad`` are what the step will use."""
        self.materialize()
        return self._pairs()

    def _pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """:meth:`pairs` without deriving held grads (ampkit's own bookkeeping)."""
        self.refresh()
        return [
            (self._model_of[id(p)], p)
            for g in self.optimizer.param_groups
            for p in g["params"]
            if id(p) in self._model_of
        ]

    def master_of(self, param: nn.Parameter) -> nn.Parameter | None:
        """The fp32 master of model parameter ``param``, or None if it has none (with
        its fp32 grad derived if it was held)."""
        self.refresh()
        master = self._masters.get(id(param))
        if master is not None:
            self.grads.materialize_one(param, master)
        return master

    def model_param_of(self, master: nn.Parameter) -> nn.Parameter | None:
        """The model parameter a master stands for, or None."""
        return self._model_of.get(id(master))

    def params(self) -> Iterator[nn.Parameter]:
        """Every parameter the optimizer steps (masters and fp32 model params), in
        ``param_groups`` order: what to clip (held grads derived first)."""
        self.materialize()
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
            for model_p, master in self._pairs():
                g = model_p.grad
                if g is None:
                    continue
                if master.grad is None:
                    master.grad = g.to(torch.float32)
                else:
                    master.grad.add_(g)
                model_p.grad = None

    def publish(self, skip: set[int] | None = None) -> None:
        """Round every master (but those whose ``id`` is in ``skip``: written by the
        one-pass step already) into its model parameter (after a real step)."""
        pairs = self._pairs()
        if skip:
            pairs = [(m, p) for m, p in pairs if id(p) not in skip]
        if not pairs:
            return
        with torch.no_grad():
            torch_compat.foreach_copy_([m for m, _ in pairs], [p for _, p in pairs])
        for _, p in pairs:
            self._published[id(p)] = torch_compat.tensor_version(p)

    def publish_changed(self) -> None:
        """Round into the model the masters changed since the last publish (by anything
        but the managed step: an optimizer wrapper that steps its base optimizer itself,
        hand edits). Cheap when none changed: version counters only."""
        changed = [
            (m, p) for m, p in self._pairs() if self._published.get(id(p)) != torch_compat.tensor_version(p)
        ]
        if changed:
            with torch.no_grad():
                torch_compat.foreach_copy_([m for m, _ in changed], [p for _, p in changed])
            for _, p in changed:
                self._published[id(p)] = torch_compat.tensor_version(p)

    def reset_from_model(self) -> None:
        """Every master set to its model weight (widened), low bits and all: after the
        model's weights were loaded from elsewhere while these masters stood (a resume
        with no fp32 state of ampkit's for them)."""
        pairs = self._pairs()
        with torch.no_grad():
            if pairs:
                torch_compat.foreach_copy_([m for _, m in pairs], [p for p, _ in pairs])
            for _, master in pairs:
                self._published[id(master)] = torch_compat.tensor_version(master)

    def sync_from_model(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Re-derive the master of each model parameter (of ``params``; default: all)
        whose 16-bit value is no longer its master rounded, i.e. that was changed
        outside ampkit (``model.load_state_dict`` after ``initialize``). Masters that
        still round to their model weight keep their low bits. ``initialize`` calls
        this from a load-state-dict hook on the model."""
        if params is None:
            pairs = self._pairs()
        else:
            pairs = [(p, m) for p in params if (m := self._masters.get(id(p))) is not None]
        with torch.no_grad(), compared_ahead(pairs, cpu=False):  # the CPU's: unrounded batches them
            for i in unrounded(pairs):
                model_p, master = pairs[i]
                master.copy_(model_p)
                self._published[id(master)] = torch_compat.tensor_version(master)

    # -- the grads (the mirror's, for code that holds the masters) -----------------------

    def __getattr__(self, name: str) -> Any:
        # 0.3's MasterWeights ran the grad mirror itself: its methods, forwarded once a warning
        if name in _MIRROR_METHODS_OF_0_3 and "grads" in self.__dict__:
            warnings.warn(
                f"MasterWeights.{name} moved to MasterWeights.grads.{name} (a GradMirror); "
                "the old name will be removed in 0.5.",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(self.__dict__["grads"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def materialize(self) -> None:
        """Give every held grad its fp32 copy on the master (the exact widening of the
        model's 16-bit grad, with any edits made to it since)."""
        self.grads.materialize()

    def held(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """``(master, model parameter)`` for every held grad (the model's 16-bit grad is
        the gradient; the master's ``.grad`` is a placeholder), in ``param_groups`` order."""
        return self.grads.held()

    def is_placeholder(self, master: torch.Tensor) -> bool:
        """Whether ``master.grad`` is the placeholder of a held grad (no values of its own)."""
        return self.grads.is_placeholder(master)

    def consumed(self, pairs: Iterable[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """The one-pass step updated these ``(master, model parameter)`` pairs and wrote
        the model weights: they count as published. Their grads stay held (the model
        keeps showing the grad the step used, as torch leaves grads after a step)."""
        for master, _ in pairs:
            self._published[id(master)] = torch_compat.tensor_version(master)

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
        require_fields(state, ("format", "masters"), "master-weight state", StateError,
                       source="MasterWeights.state_dict()")
        entries = state["masters"]
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
            # a master beyond its 16-bit weight's range would round to inf in the model
            model_dtype = self._model_of[id(master)].dtype
            require_tensor(t, f"saved master weight at group {gi}, index {pi}", StateError, torch.float32,
                           finite=True, hint=CORRUPT_CHECKPOINT,
                           max_abs=min(torch.finfo(model_dtype).max, ABSURD_MAGNITUDE))  # its square: fp32
        return saved


class _MasterList(list):
    """A param group's ``"params"`` list under O2: iterating or indexing it from code
    outside ampkit and ``torch.optim`` (a user's loop over ``optimizer.param_groups``,
    ``clip_grad_norm_`` over them) first derives the held grads' fp32 copies
    (:meth:`MasterWeights.materialize`), so such code reads the masters' real grads.
    Pickles and copies as a plain list."""

    __slots__ = ("_owner",)

    def __init__(self, items: Iterable[Any], owner: MasterWeights) -> None:
        super().__init__(items)
        self._owner = weakref.ref(owner)

    def _reader(self) -> None:
        if torch.compiler.is_compiling():  # traced code (a compiled optimizer step): bookkeeping
            return
        name = sys._getframe(2).f_globals.get("__name__", "")
        if name.startswith(_QUIET_READERS) or name in ("ampkit", "torch.optim"):
            return
        owner = self._owner()
        if owner is not None:
            owner.materialize()

    def __iter__(self) -> Iterator[Any]:
        self._reader()
        return super().__iter__()

    def __getitem__(self, index: Any) -> Any:
        self._reader()
        return super().__getitem__(index)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (list, (list(super().__iter__()),))


# Modules whose reads of the params lists are bookkeeping, not gradient reads.
_QUIET_READERS = ("ampkit.", "torch.optim.")


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
