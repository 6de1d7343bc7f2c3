"""fp32 master weights for a model stored in 16 bits (opt level O2).

The optimizer never sees the model's fp16/bf16 parameters: each one is replaced,
at its position in ``optimizer.param_groups``, by an fp32 *master* copy. One step
under ampkit's trainer (hooks installed by :mod:`ampkit.trainer.grad_hooks`):

1. backward produces each 16-bit gradient (times the loss scale); as soon as it is
   accumulated, a hook moves it into the master's fp32 ``.grad`` -- unscaled and
   checked for inf/NaN in fp32, summed in fp32 over micro-batches -- and frees it
   (:meth:`MasterWeights.absorb`). With ``master_grads="on_demand"`` (the default) a
   grad that is its step's whole gradient at a scale of 1 on CPU is only checked and
   stays on the model (*held*; the master gets a placeholder grad), the step reads it
   in one pass (:mod:`ampkit.levels.one_pass`) and the fp32 grad is derived only when
   something needs it (see :class:`MasterWeights`); steps 2-4 then concern the other
   grads;
2. when the backward pass ends, each model parameter gets a 16-bit copy of its
   master's gradient (:meth:`MasterWeights.show`), so code that reads or edits
   ``model.parameters()`` grads (``clip_grad_norm_``, logging, hand edits) sees the
   real gradient. On CPU, with a scale of 1 (bf16's default) and no earlier grad in
   the master, that copy is the 16-bit grad backward produced (the fp32 one is its
   exact widening), kept aside by :meth:`MasterWeights.absorb` until then: no copy is
   rounded, no second 16-bit buffer allocated (see ``KEEP_ASIDE_DEVICES``). With
   ``model_grads="view"`` such a grad is shown as a bf16 view of the fp32 grad's high
   halves instead (the two share memory; see :class:`MasterWeights`);
3. before the grads are checked and before the step, changes made through either
   side are merged (:meth:`MasterWeights.reconcile`): clearing grads through the model
   (``model.zero_grad()``, ``p.grad = None``, ``set_to_none=False``) or through the
   optimizer (``optimizer.zero_grad()``, the masters' grads) clears the one gradient;
   a uniform rescale of the copy (``clip_grad_norm_``) rescales the fp32 gradient by
   the same factor; other edits replace the elements they changed;
4. while the optimizer steps, the model holds no 16-bit grad (:meth:`MasterWeights.hide`
   before, :meth:`MasterWeights.show` after: on CUDA no 16-bit gradient beside the fp32
   one at the step's peak; on CPU, where re-allocating costs page faults, unchanged
   copies are kept aside and put back); the optimizer steps the masters (fp32 state,
   fp32 arithmetic);
   after a real (not skipped) step, :meth:`MasterWeights.publish` rounds the masters
   into the model's 16-bit weights.

The two copies of the weights stay one as well: before each step, model weights
changed outside ampkit (``p.data.clamp_``, manual weight decay, ``copy_``) are taken
into their masters (:meth:`MasterWeights.sync_from_model`); masters changed outside the
managed step (an optimizer wrapper stepping its base optimizer, e.g. SAM) are rounded
into the model at its next forward (:meth:`MasterWeights.publish_changed`).

Edits made through ``.data`` bypass the version counter: on the model's grads they
are found by comparing values (a grad held on the model or shown as a view is the
memory the step reads: it is checked for inf/NaN at the step, not when backward made
it); on the masters' grads use in-place tensor ops (as
``torch.nn.utils`` does). The comparisons (16-bit copy against its fp32 source
rounded, for grads and weights) read each element once; large bf16 tensors on CPU
use a compiled kernel (:func:`ampkit.levels.update_kernels.rounds_to_bf16`, ~4-5x faster than
comparing chunk by chunk), falling back to the exact chunked comparison whenever
it finds a difference or where it cannot compile.

Masters are built from the fp32 weights *before* the model is cast, so no bit of
the initial weights is lost. Their values are saved by :meth:`state_dict` in
fp32; a resumed run loads them back instead of re-deriving them from the 16-bit
weights (which would lose the low bits, and with them exact resumption).
``Optimizer.load_state_dict`` casts floating state to the dtype of the parameter
at each position; as masters are fp32, the fp32 optimizer state survives it.

Parameters that are fp32 in the model (normalization layers under O2) are stepped
directly and have no master.

Without the trainer (a bare :class:`MasterWeights`), :meth:`MasterWeights.gather_grads`
moves the model's grads into the masters by hand.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit._internal.dtypes import cast_optimizer_state
from ampkit._internal.validate import (
    CORRUPT_CHECKPOINT,
    require_choice,
    require_fields,
    require_optimizer,
    require_tensor,
)
from ampkit.errors import AmpError, StateError

from .update_kernels import rounds_to_bf16

__all__ = ["MasterWeights"]

_STATE_FORMAT = 1

#: Device types where ampkit keeps 16-bit grads it would otherwise free and allocate
#: again (:meth:`MasterWeights.absorb`, :meth:`MasterWeights.hide`): CPU, where every
#: fresh large tensor is page-faulted in (no caching allocator). Costs up to 2 bytes
#: per parameter during backward and the step; elsewhere they are freed at once.
KEEP_ASIDE_DEVICES: tuple[str, ...] = ("cpu",)

#: How the model's parameters show their grads (``MasterWeights(model_grads=...)``):
#: ``"copy"``, a 16-bit tensor of its own rounded from the fp32 grad; ``"view"``, where
#: the fp32 grad holds bf16 values exactly, a bf16 view of its high halves (no memory).
MODEL_GRADS: tuple[str, ...] = ("copy", "view")

#: When a master's fp32 grad exists (``MasterWeights(master_grads=...)``): ``"on_demand"``,
#: only once something needs it (see :class:`MasterWeights`); ``"always"``, from the
#: moment backward produces each grad.
MASTER_GRADS: tuple[str, ...] = ("on_demand", "always")

#: Device types where ``master_grads="on_demand"`` holds grads in 16 bits (measured on
#: CPU; elsewhere every grad gets its fp32 copy as with ``"always"``).
ON_DEMAND_DEVICES: tuple[str, ...] = ("cpu",)


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
            1, outside DDP, dense, on ``ON_DEMAND_DEVICES``) stays on the model
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
        self._links: dict[int, _Link] = {}  # id(model param) -> its two-views bookkeeping
        self._published: dict[int, int] = {}  # id(master) -> its version when last published
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
            self._materialize_one(param, master)
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
        with torch.no_grad(), _compared_ahead(pairs):
            for model_p, master in pairs:
                if not rounds_to(model_p, master):
                    master.copy_(model_p)
                    self._published[id(master)] = torch_compat.tensor_version(master)

    # -- one gradient, two views (used by ampkit.trainer.grad_hooks' hooks) ---------------------------

    def _linked(self, model_params: Iterable[torch.Tensor]) -> Iterator[tuple[torch.Tensor, nn.Parameter, _Link]]:
        """(model param, its master, their link) for those of ``model_params`` with a master."""
        for model_p in model_params:
            master = self._masters.get(id(model_p))
            if master is not None:
                yield model_p, master, self._link(model_p)

    def _link(self, model_p: torch.Tensor) -> _Link:
        link = self._links.get(id(model_p))
        if link is None:
            link = self._links[id(model_p)] = _Link()
        return link

    def absorb(
        self, model_p: torch.Tensor, unscale: Callable[[list[torch.Tensor]], None] | None, keep: bool = False
    ) -> bool:
        """Move ``model_p``'s 16-bit grad into its master's fp32 grad and free it.
        ``unscale`` multiplies (and checks) the fp32 copy in place before it is added;
        None leaves it as it is.

        ``keep`` (the caller's promise that ``unscale`` multiplies by 1, i.e. only
        checks): where the master has no grad yet, the fp32 grad is the 16-bit one
        widened, exactly, so the 16-bit grad already is the copy :meth:`show` would
        make when the backward pass ends. On ``KEEP_ASIDE_DEVICES`` (CPU) it is taken
        off ``model_p`` and kept aside until then (:meth:`show` puts it back instead of
        allocating and rounding a copy: one pass and one page-faulted allocation less,
        for up to 2 bytes per parameter more during backward).

        Returns True when the grad was left unchecked for the step to check: with
        ``keep``, a grad held on the model (``master_grads="on_demand"``) or shown as
        a view of its fp32 grad (``model_grads="view"``). Both are the memory the step
        reads, which user code may still change through ``.data`` (no version counter
        tells): a check now could not vouch for it."""
        g = model_p.grad
        master = self._masters[id(model_p)]
        link = self._link(model_p)
        link.viewable = False
        fresh = (
            g is not None and keep and master.grad is None and g.layout == torch.strided and g.grad_fn is None
            and g.dtype != torch.float32
        )
        if fresh and self.master_grads == "on_demand" and self.model_grads == "copy" and g.device.type in ON_DEMAND_DEVICES:
            # The whole gradient, in 16 bits: it stays on the model (held), checked by
            # the step; the fp32 grad is its exact widening, derived only when needed.
            link.show(g)
            link.keep(None)
            link.hold(master)
            return True
        model_p.grad = None
        link.show(None)
        if g is None:
            return False
        if fresh:
            view = self.model_grads == "view" and g.dtype == torch.bfloat16 and g.dim() > 0 and g.is_contiguous()
            if view or g.device.type in KEEP_ASIDE_DEVICES:
                with torch.no_grad():
                    if unscale is not None and not view:
                        unscale([g])
                    master.grad = g.to(torch.float32)
                link.keep(master.grad)
                if view:
                    link.viewable = True  # show() gives the model a view of it; g is freed
                else:
                    link.aside = g
                return view
        with torch.no_grad():
            g32 = g.detach().to(torch.float32, copy=True)
            del g
            if g32.is_sparse:  # nn.Embedding(sparse=True): duplicates summed in fp32
                g32 = g32.coalesce()
            if unscale is not None:
                unscale([torch_compat.sparse_values(g32) if g32.is_sparse else g32])
            if master.grad is None:
                master.grad = g32
            else:
                master.grad.add_(g32)
        link.keep(master.grad)
        return False

    def show(self, model_params: Iterable[torch.Tensor]) -> None:
        """Give each of ``model_params`` a 16-bit copy of its master's grad (or no grad
        when the master has none), to be read and edited as the model's own."""
        with torch.no_grad():
            for model_p, master, link in self._linked(model_params):
                if link.held and self._still_held(model_p, master, link):
                    continue  # the model's grad is the gradient
                if link.viewable and model_p.grad is None and link.holds(master.grad):
                    model_p.grad = _high_halves(master.grad)  # shares the fp32 grad's memory
                    link.show(model_p.grad)
                    link.viewing = True
                    continue
                aside = link.aside
                if aside is not None and model_p.grad is None and not link.master_changed(master.grad):
                    model_p.grad = aside  # the produced grad, which the fp32 one widens exactly
                    link.show(aside)
                    continue
                self._reconcile_one(model_p, master, link)
                g = master.grad
                model_p.grad = None if g is None else g.detach().to(model_p.dtype)
                link.show(model_p.grad)
                link.keep(g)

    def settle(self, model_p: torch.Tensor) -> None:
        """Before backward adds into ``model_p.grad``: merge what was done to either
        gradient since it was shown, then free the 16-bit copy."""
        master = self._masters.get(id(model_p))
        if master is None:
            return
        link = self._link(model_p)
        if link.held and master.grad is None:  # cleared through the optimizer: both sides go
            self._release(model_p, master, link)
            return
        if link.held and self._still_held(model_p, master, link, zeroed_clears=True):
            self._materialize_one(model_p, master)  # a second backward: the sum runs in fp32
        self._reconcile_one(model_p, master, link)
        model_p.grad = None
        link.show(None)

    def settle_raw(self, model_p: torch.Tensor) -> bool:
        """Before backward adds into the 16-bit grad of ``model_p`` held for DDP to
        reduce: if either side was cleared since, clear both. Returns whether grads are
        still held."""
        master = self._masters.get(id(model_p))
        if master is None:
            return False
        link = self._link(model_p)
        if model_p.grad is None or link.master_changed(master.grad):
            model_p.grad = None
            master.grad = None
            link.keep(None)
            return False
        return True

    def reconcile(self, model_params: Iterable[torch.Tensor]) -> None:
        """Merge changes made through the model's 16-bit grads (of ``model_params``)
        into the masters'."""
        pairs = [(p, m) for p in model_params if (m := self._masters.get(id(p))) is not None]
        with torch.no_grad(), _compared_ahead([(p.grad, m.grad) for p, m in pairs]):
            for model_p, master in pairs:
                self._reconcile_one(model_p, master, self._link(model_p))

    def after_zero_grad(self, model_params: Iterable[torch.Tensor]) -> None:
        """``optimizer.zero_grad()`` just ran: the model's grads of ``model_params`` show
        what it did to the masters' (a master's grad set to None clears the model's,
        whatever was done to it since; one zeroed in place is merged by
        :meth:`reconcile`)."""
        with torch.no_grad():
            for model_p, master, link in self._linked(model_params):
                if master.grad is not None:
                    self._reconcile_one(model_p, master, link)
                elif model_p.grad is not None:
                    model_p.grad = None
                    link.show(None)
                    link.keep(None)

    def follow_masters(self, model_params: Iterable[torch.Tensor]) -> None:
        """The masters' grads of ``model_params`` were just changed in place by an
        operation that leaves version counters alone (the fused unscale a GradScaler
        runs, ``torch._amp_foreach_non_finite_check_and_unscale_``): each model grad that
        still shows its master's grad (as :meth:`reconcile` left them) takes the values
        the master's grad holds now, in place; a grad view (``model_grads="view"``)
        shares their memory already. Without this the change is invisible: the model
        would keep showing the old values and :meth:`reconcile` would take them for an
        edit of the model's grads."""
        with torch.no_grad():
            for model_p, master, link in self._linked(model_params):
                cur, g = model_p.grad, master.grad
                if g is None or cur is None or not (link.holds(g) and link.is_shown(cur)):
                    continue
                if link.viewing:
                    continue
                if g.is_sparse or cur.is_sparse:
                    model_p.grad = cur = g.detach().to(model_p.dtype)
                else:
                    cur.copy_(g)
                link.show(cur)
                link.keep(g)

    def hide(self, model_params: Iterable[torch.Tensor]) -> None:
        """Take the 16-bit copies of ``model_params`` off the model while the optimizer
        steps (:meth:`show` brings them back). On devices outside ``KEEP_ASIDE_DEVICES`` they are freed, so
        no 16-bit gradient sits beside the fp32 one at the step's peak. On CPU a copy
        that still shows its master's grad (reconciled, unchanged since) is kept aside
        and put back as it is: without a caching allocator every fresh large tensor
        is page-faulted in again (on the 38M-parameter MLP of ``benchmarks/step_limit.py``
        ~75 ms a step, a third of it), at the cost of 2 bytes per parameter at the
        step's peak (20 instead of 18 with AdamW)."""
        for model_p in model_params:
            master = self._masters.get(id(model_p))
            if master is None:
                continue
            g = model_p.grad
            link = self._link(model_p)
            if link.held and self._still_held(model_p, master, link):
                continue  # the step reads it
            # a grad view (model_grads="view") costs nothing: show() makes it again
            keep = (
                g is not None
                and g.device.type in KEEP_ASIDE_DEVICES
                and link.is_shown(g)
                and torch_compat.tensor_version(g) == link._shown_version
                and not link.master_changed(master.grad)
            )
            model_p.grad = None
            link.show(None)
            if keep:
                link.aside = g

    def _reconcile_one(self, model_p: torch.Tensor, master: nn.Parameter, link: _Link) -> None:
        if link.held and self._still_held(model_p, master, link):
            return  # held: the model's grad (edited or not) is the gradient
        cur = model_p.grad
        g = master.grad
        if link.viewing:
            self._reconcile_view(model_p, master, link, cur, g)
            return
        model_changed = link.model_changed(cur, g)
        master_changed = link.master_changed(g)
        if model_changed and master_changed:
            _clear_both(model_p, master, cur, g)
            cur = model_p.grad
        elif model_changed:
            with torch.no_grad():
                if cur is None:
                    master.grad = None
                elif g is not None and link.is_shown(cur) and not (g.is_sparse or cur.is_sparse):
                    _merge(g, cur)
                    cur.copy_(g)  # the copy now shows exactly what the step will use
                else:
                    master.grad = cur.detach().to(torch.float32, copy=True)
        elif master_changed:
            # The masters' grads were cleared or edited: the model shows the same.
            if g is None:
                model_p.grad = cur = None
            else:
                with torch.no_grad():
                    if cur is None or cur.is_sparse or g.is_sparse:
                        model_p.grad = cur = g.detach().to(model_p.dtype)
                    else:
                        cur.copy_(g)
        link.show(cur)
        link.keep(master.grad)

    def _reconcile_view(
        self, model_p: torch.Tensor, master: nn.Parameter, link: _Link, cur: torch.Tensor | None, g: torch.Tensor | None
    ) -> None:
        """:meth:`_reconcile_one` for a model grad shown as a view of the fp32 grad: an
        in-place edit of either is one edit of their shared memory, already merged;
        only a grad replaced or cleared on one side has to be carried to the other."""
        model_same, master_same = link.is_shown(cur), link.holds(g)
        if model_same and master_same:
            return
        link.viewing = link.viewable = False
        if not model_same and not master_same:
            _clear_both(model_p, master, cur, g)
        elif not model_same:  # p.grad = None / replaced through the model
            with torch.no_grad():
                master.grad = None if cur is None else cur.detach().to(torch.float32, copy=True)
        else:  # the masters' grads were cleared or replaced: the model shows the same
            with torch.no_grad():
                model_p.grad = None if g is None else g.detach().to(model_p.dtype)
        link.show(model_p.grad)
        link.keep(master.grad)

    def drop_stale_views(self) -> None:
        """Take off the model the grad views whose fp32 grad the masters no longer hold
        (``optimizer.zero_grad()``): a view would keep that fp32 memory alive."""
        if self.model_grads != "view":
            return
        for model_p, master in self._pairs():
            link = self._links.get(id(model_p))
            if link is not None and link.viewing and not link.holds(master.grad):
                self._reconcile_one(model_p, master, link)

    # -- held grads (master_grads="on_demand") ------------------------------------------

    def held(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """``(master, model parameter)`` for every held grad (the model's 16-bit grad is
        the gradient; the master's ``.grad`` is a placeholder), in ``param_groups``
        order, after applying what was done to either side since (clearing or zeroing
        through the optimizer or the model, a grad set on the master)."""
        out = []
        for model_p, master in self._pairs():
            link = self._links.get(id(model_p))
            if link is not None and link.held and self._still_held(model_p, master, link):
                out.append((master, model_p))
        return out

    def is_placeholder(self, master: torch.Tensor) -> bool:
        """Whether ``master.grad`` is the placeholder of a held grad (no values of its
        own: a zero-strided fp32 zero)."""
        model_p = self._model_of.get(id(master))
        link = self._links.get(id(model_p)) if model_p is not None else None
        return link is not None and link.held and link.placeholder is not None and master.grad is link.placeholder

    def _still_held(self, model_p: torch.Tensor, master: nn.Parameter, link: _Link, zeroed_clears: bool = False) -> bool:
        """Apply to a held grad what was done to either side since it was held, and
        return whether it is still held. The master's ``.grad`` is a placeholder while
        held, so that clearing through the optimizer shows: set to None
        (``zero_grad()``) clears the model's grad too; zeroed in place
        (``zero_grad(set_to_none=False)``) zeroes it (or, with ``zeroed_clears``, before
        a backward adds into it, clears both); cleared through the model clears the
        placeholder; any other grad set on the master ends the hold (it is merged
        like an edit: :meth:`_reconcile_one`)."""
        g = master.grad
        holder = link.placeholder
        cur = model_p.grad
        if g is None or cur is None:  # cleared through either side
            self._release(model_p, master, link)
            return False
        if g is not holder:  # a grad set on the master itself
            link.held = False
            link.placeholder = None
            return False
        zeroed = torch_compat.tensor_version(holder) != link.placeholder_version
        if zeroed_clears and (zeroed or (link.zeroed and link.is_shown(cur)
                                         and torch_compat.tensor_version(cur) == link._shown_version)):
            self._release(model_p, master, link)  # the backward's grad is the whole gradient
            return False
        if zeroed:  # zeroed in place
            with torch.no_grad():
                cur.zero_()
            link.show(cur)
            link.held = True
            link.placeholder = holder
            link.placeholder_version = torch_compat.tensor_version(holder)
            link.zeroed = True
        return True

    def _release(self, model_p: torch.Tensor, master: nn.Parameter, link: _Link) -> None:
        model_p.grad = None
        master.grad = None
        link.show(None)
        link.keep(None)

    def materialize_except(self, skip: set[int]) -> None:
        """:meth:`materialize` for the held grads of masters whose ``id`` is not in ``skip``."""
        for master, model_p in self.held():
            if id(master) not in skip:
                self._materialize_one(model_p, master)

    def materialize(self) -> None:
        """Give every held grad its fp32 copy on the master (the exact widening of the
        model's 16-bit grad, with any edits made to it since): from then on the two
        grads are linked as under ``master_grads="always"``."""
        for master, model_p in self.held():
            self._materialize_one(model_p, master)

    def _materialize_one(self, model_p: torch.Tensor, master: nn.Parameter) -> None:
        link = self._links.get(id(model_p))
        if link is None or not link.held or not self._still_held(model_p, master, link):
            return
        cur = model_p.grad
        with torch.no_grad():
            master.grad = cur.detach().to(torch.float32)
        link.show(cur)
        link.keep(master.grad)

    def lift(self, pairs: Iterable[tuple[nn.Parameter, torch.Tensor]]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Take the placeholders off the masters of ``pairs`` (``(master, model
        parameter)``, as :meth:`held` gives them): the optimizer's own step then skips
        them (no ``.grad``); :meth:`restore` puts them back. Returns what to restore."""
        lifted = []
        for master, _ in pairs:
            g = master.grad
            master.grad = None
            lifted.append((master, g))
        return lifted

    def restore(self, lifted: Iterable[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Undo :meth:`lift` (after the optimizer's step): ``lifted`` is what it returned."""
        for master, g in lifted:
            if master.grad is None:
                master.grad = g

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
                           finite=True, hint=CORRUPT_CHECKPOINT, max_abs=torch.finfo(model_dtype).max)
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


_COMPARE_CHUNK = 1 << 16

def _clear_both(model_p: torch.Tensor, master: nn.Parameter, cur: torch.Tensor | None, g: torch.Tensor | None) -> None:
    """Grads changed through both the model (``cur``) and the master (``g``) since the
    last backward. A side that was cleared (``zero_grad()``: None or all zeros) wins,
    whatever was done to the other (an edit before an iteration was dropped, such as a
    grad set to inf that made a clip raise): both end up cleared, None unless both are
    zero tensors. Both edited otherwise: an :class:`AmpError` (no telling which change
    the step should use)."""
    if not (_cleared(cur) or _cleared(g)):
        raise AmpError(
            "gradients were changed both through the model's 16-bit parameters and "
            "through the optimizer's fp32 master parameters since the last backward, "
            "in different ways; ampkit cannot tell which change the step should use. "
            "Clip, edit or clear them through one of the two (model.parameters() or "
            "ampkit.master_params(optimizer))."
        )
    if cur is None or g is None:
        model_p.grad = master.grad = None
        return
    with torch.no_grad():
        g.zero_()
        cur.zero_()


def _high_halves(g: torch.Tensor) -> torch.Tensor:
    """A bf16 view of contiguous fp32 ``g``'s high 16 bits, element by element: ``g``
    truncated to bf16 (exactly ``g`` where it holds bf16 values), sharing its memory."""
    halves = g.view(torch.bfloat16)  # the last dim doubled: (low, high) pairs
    return halves[..., 1::2] if _LITTLE_ENDIAN else halves[..., 0::2]


_LITTLE_ENDIAN = sys.byteorder == "little"


# Per thread: comparisons made ahead on the device (see _compared_ahead), by
# (id, version) of both tensors.
_AHEAD = threading.local()
#: device types whose comparisons are not made ahead: on the CPU each one costs no wait,
#: and chunked comparisons need no full-size temporary
COMPARED_ONE_BY_ONE = frozenset({"cpu"})


@contextlib.contextmanager
def _compared_ahead(pairs: Iterable[tuple[torch.Tensor | None, torch.Tensor | None]]) -> Iterator[None]:
    """Inside: :func:`rounds_to` answers for the dense, same-shaped ``pairs`` on a
    device other than the CPU from one comparison of all of them, read back in one
    host sync (each ``torch.equal`` there waits for the device: an O2 step of a
    135M-parameter model on an H200 made 200 of them). Pairs it was not given, or
    changed since (their version), are compared as before."""
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for low, g in pairs:
        if (low is not None and g is not None and low.device.type not in COMPARED_ONE_BY_ONE and low.device == g.device
                and low.shape == g.shape and not (low.is_sparse or g.is_sparse)):  # fmt: skip
            by_device.setdefault(low.device, []).append((low, g))
    if not by_device:
        yield
        return
    results: dict[tuple[int, int, int, int], bool] = {}
    with torch.no_grad():
        for group in by_device.values():
            # NaN != NaN: unequal, as torch.equal has it
            differs = torch.stack([torch.ne(low, g.to(low.dtype)).any() for low, g in group]).tolist()
            for (low, g), d in zip(group, differs):
                key = (id(low), torch_compat.tensor_version(low), id(g), torch_compat.tensor_version(g))
                results[key] = not d
    outer = getattr(_AHEAD, "results", None)
    _AHEAD.results = results
    try:
        yield
    finally:
        _AHEAD.results = outer


def rounds_to(low: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether 16-bit ``low`` is exactly fp32 ``g`` rounded to its dtype (a gradient
    copy and its master's gradient, a model weight and its master); on the CPU compared
    a chunk of ``_COMPARE_CHUNK`` elements at a time: no full-size temporary at the step
    (large bf16 tensors on CPU: :func:`ampkit.levels.update_kernels.rounds_to_bf16`, one compiled
    pass, several times faster)."""
    if low.shape != g.shape:
        return False
    ahead = getattr(_AHEAD, "results", None)
    if ahead:
        key = (id(low), torch_compat.tensor_version(low), id(g), torch_compat.tensor_version(g))
        known = ahead.get(key)
        if known is not None:
            return known
    with torch.no_grad():
        fast = rounds_to_bf16(low, g)  # large bf16 tensors: one compiled read pass
        if fast is not None:
            return fast
        if not (low.is_contiguous() and g.is_contiguous()) or low.device.type != "cpu":
            # off the CPU each comparison waits for the device: one per tensor, not one
            # per chunk (chunked, a 135M-parameter O2 model on an H200 spent 280 ms a
            # step in 2000 host syncs); the rounded copy is a transient of 2 bytes/element
            return torch.equal(low, g.to(low.dtype))
        a, b = low.view(-1), g.view(-1)
        return all(
            torch.equal(a[i : i + _COMPARE_CHUNK], b[i : i + _COMPARE_CHUNK].to(low.dtype))
            for i in range(0, a.numel(), _COMPARE_CHUNK)
        )


def _cleared(t: torch.Tensor | None) -> bool:
    if t is not None and t.is_sparse:
        t = torch_compat.sparse_values(t.coalesce())
    return t is None or not bool(t.any())


def _merge(g: torch.Tensor, edited: torch.Tensor) -> None:
    """Bring fp32 ``g`` in line with ``edited``, a 16-bit copy of it that user code
    changed in place. All zeros: zeros. A uniform rescale (what ``clip_grad_norm_``
    does): ``g`` times the same factor, in fp32. Anything else: the changed elements
    take the edited values, the others keep their fp32 bits."""
    if not bool(edited.any()):
        g.zero_()
        return
    old = g.to(edited.dtype)
    changed = edited != old
    if not bool(changed.any()):
        return
    new32, old32 = edited.float(), old.float()
    den = (old32 * old32).sum()
    if bool(den > 0):
        factor = (new32 * old32).sum() / den
        info = torch.finfo(edited.dtype)
        if bool(torch.isfinite(factor)) and torch.allclose(
            new32, old32 * factor, rtol=info.eps, atol=info.smallest_normal
        ):
            g.mul_(factor)
            return
    g.copy_(torch.where(changed, new32, g))


class _Link:
    """What ampkit last left on each side of one mastered gradient: the tensor set as
    the model parameter's ``.grad`` (a 16-bit copy) and the master's ``.grad``, each
    with its version, held weakly (a cleared grad is freed)."""

    __slots__ = (
        "_shown", "_shown_version", "_kept", "_kept_version", "aside", "viewable", "viewing", "held",
        "placeholder", "placeholder_version", "zeroed", "_holder",
    )

    def __init__(self) -> None:
        self._shown: weakref.ref | None = None
        self._shown_version = 0
        self._kept: weakref.ref | None = None
        self._kept_version = 0
        # The 16-bit grad backward produced, kept by MasterWeights.absorb while the kept
        # fp32 grad is its exact widening, for show() to put back (dropped by show()).
        self.aside: torch.Tensor | None = None
        # model_grads="view": the kept fp32 grad holds bf16 values exactly (show() may
        # give the model a view of it), and the model's shown grad is such a view.
        self.viewable = False
        self.viewing = False
        # master_grads="on_demand": the model's grad is the gradient; the master's .grad
        # is `placeholder` (a zero-strided fp32 zero, no memory), whose clearing or
        # zeroing (version) tells that the optimizer's zero_grad ran.
        self.held = False
        self.placeholder: torch.Tensor | None = None
        self.placeholder_version = 0
        self.zeroed = False  # the held grad was zeroed in place through the optimizer
        self._holder: torch.Tensor | None = None  # the last placeholder, reused by hold()

    def show(self, t: torch.Tensor | None) -> None:
        self._shown = None if t is None else weakref.ref(t)
        self._shown_version = 0 if t is None else torch_compat.tensor_version(t)
        self.aside = None
        self.viewing = False
        self.held = False
        self.placeholder = None
        self.zeroed = False

    def hold(self, master: nn.Parameter) -> None:
        """Hold the gradient the model shows: the master gets a placeholder grad (the
        last one again where it still fits: it has no memory to share)."""
        holder = self._holder
        if holder is None or holder.shape != master.shape or holder.dtype != master.dtype or holder.device != master.device:
            holder = self._holder = torch.zeros((), dtype=master.dtype, device=master.device).expand_as(master)
        master.grad = holder
        self.held = True
        self.placeholder = holder
        self.placeholder_version = torch_compat.tensor_version(holder)

    def holds(self, g: torch.Tensor | None) -> bool:
        """Whether ``g`` is the fp32 grad last kept (any version)."""
        return g is not None and self._kept is not None and self._kept() is g

    def keep(self, g: torch.Tensor | None) -> None:
        self._kept = None if g is None else weakref.ref(g)
        self._kept_version = 0 if g is None else torch_compat.tensor_version(g)

    def is_shown(self, t: torch.Tensor | None) -> bool:
        if self._shown is None:
            return t is None
        return t is not None and self._shown() is t

    def model_changed(self, cur: torch.Tensor | None, g: torch.Tensor | None) -> bool:
        if not self.is_shown(cur):
            return True
        if cur is None:
            return False
        if torch_compat.tensor_version(cur) != self._shown_version:
            return True
        # Edits through .data leave the version alone: compare values (dense grads).
        if g is None or self.master_changed(g) or g.is_sparse or cur.is_sparse:
            return False
        return not rounds_to(cur, g)

    def master_changed(self, g: torch.Tensor | None) -> bool:
        if self._kept is None:
            return g is not None
        return g is None or self._kept() is not g or torch_compat.tensor_version(g) != self._kept_version
