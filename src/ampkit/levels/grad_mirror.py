"""One gradient, two views: the 16-bit grads a model stored in 16 bits shows, and the
fp32 grads of its masters (:class:`~ampkit.levels.master.MasterWeights`), kept one
gradient whatever user code does to either side.

:class:`GradMirror` runs the steps of an O2 iteration that concern grads (the hooks of
:mod:`ampkit.trainer.grad_hooks` call it): a 16-bit grad moved into its master's fp32
grad when the backward pass ends, or held on the model (:meth:`GradMirror.absorb`, for a
pass's grads together :meth:`GradMirror.absorb_many`); a copy
shown to the model when backward ends (:meth:`GradMirror.show`); edits through either
side merged (:meth:`GradMirror.reconcile`), including edits through ``.data``, found by
comparing values (:func:`~ampkit.levels.rounding.rounds_to`); the copies taken off while the optimizer steps
(:meth:`GradMirror.hide`). The whole cycle: ``docs/concepts/fp32.md`` and the module
docstring of :mod:`ampkit.levels.master`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit.errors import AmpError

from .rounding import compared_ahead, rounds_to

__all__ = ["GradMirror"]

#: Device types where ampkit keeps 16-bit grads it would otherwise free and allocate again
#: (:meth:`GradMirror.absorb`, :meth:`GradMirror.hide`): CPU, where every fresh large tensor
#: is page-faulted in (no caching allocator); up to 2 bytes per parameter during backward
#: and the step. Elsewhere they are freed at once.
KEEP_ASIDE_DEVICES: tuple[str, ...] = ("cpu",)
#: Device types where ``master_grads="on_demand"`` holds grads in 16 bits (measured on
#: CPU; elsewhere every grad gets its fp32 copy as with ``"always"``).
ON_DEMAND_DEVICES: tuple[str, ...] = ("cpu",)


class GradMirror:
    """The grads of one :class:`~ampkit.levels.master.MasterWeights`: per mastered model
    parameter, what was last left on each side (a ``_Link``), and the operations
    that keep the model's 16-bit grad and the master's fp32 grad one gradient.

    Args:
        masters: ``id(model parameter) -> master``, the masters' own table (shared:
            parameters added later are seen).
        model_of: ``id(master) -> model parameter``, likewise.
        pairs: returns ``(model parameter, master)`` in ``param_groups`` order (held weakly).
        model_grads, master_grads: see :class:`~ampkit.levels.master.MasterWeights`."""

    def __init__(
        self,
        masters: dict[int, nn.Parameter],
        model_of: dict[int, nn.Parameter],
        pairs: Callable[[], list[tuple[nn.Parameter, nn.Parameter]]],
        model_grads: str,
        master_grads: str,
    ) -> None:
        self._masters = masters
        self._model_of = model_of
        self._pairs_of = weakref.WeakMethod(pairs)  # type: ignore[arg-type]
        self.model_grads = model_grads
        self.master_grads = master_grads
        self._links: dict[int, _Link] = {}  # id(model param) -> its two-views bookkeeping
        # set by the gradient route (ampkit.trainer.grad_hooks): takes in the grads its
        # hooks left pending, before anything reads which grads are held or derives them
        self.before_read: Callable[[], None] | None = None

    def _pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        pairs = self._pairs_of()
        return pairs() if pairs is not None else []

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
        if fresh and self.may_hold(model_p):
            # The whole gradient, in 16 bits: it stays on the model (held), checked by
            # the step; the fp32 grad is its exact widening, derived only when needed.
            link.hold(g, master)
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

    def may_hold(self, model_p: torch.Tensor) -> bool:
        """Whether :meth:`absorb` with ``keep`` can hold ``model_p``'s grad on the model
        (``master_grads="on_demand"``, ``model_grads="copy"``, on ``ON_DEMAND_DEVICES``)."""
        return (self.master_grads == "on_demand" and self.model_grads == "copy"
                and model_p.device.type in ON_DEMAND_DEVICES)  # fmt: skip

    def absorb_many(
        self, model_params: list[torch.Tensor], unscale: Callable[[list[torch.Tensor]], None] | None, keep: bool
    ) -> list[bool]:
        """:meth:`absorb` for each of ``model_params`` (grads of one backward pass, one
        loss and scale), with the same result, in a few multi-tensor calls instead of a
        few per parameter: fresh grads held on the model in one loop; dense 16-bit grads
        widened into new fp32 tensors in one copy, unscaled and checked in one call per
        device, and added to the masters' grads they accumulate into in one more (the
        same operations per element as :meth:`absorb`, bit for bit). Other grads (sparse,
        kept aside, shown as views, fp32) go through :meth:`absorb`. ``unscale`` and
        ``keep`` are :meth:`absorb`'s (the pass's unscaling, ``None`` leaving grads as
        they are; the promise that it only checks, so a fresh grad may stay in 16 bits). Returns :meth:`absorb`'s answer per parameter."""
        masters, links = self._masters, self._links
        out: list[bool] = [False] * len(model_params)
        batch: dict[torch.device, list[tuple[int, torch.Tensor, nn.Parameter, _Link, torch.Tensor]]] = {}
        for i, model_p in enumerate(model_params):
            g = model_p.grad
            master = masters[id(model_p)]
            link = links.get(id(model_p))
            if (link is None or g is None or g.layout != torch.strided or g.grad_fn is not None
                    or g.dtype == torch.float32):  # fmt: skip
                out[i] = self.absorb(model_p, unscale, keep)
                continue
            mg = master.grad
            if keep and mg is None:  # fresh: held, kept aside or viewed, as absorb decides
                if self.may_hold(model_p):
                    link.viewable = False
                    link.hold(g, master)
                    out[i] = True
                    continue
                if self.model_grads == "view" or g.device.type in KEEP_ASIDE_DEVICES:
                    out[i] = self.absorb(model_p, unscale, keep)
                    continue
            elif mg is not None and (mg.layout != torch.strided or mg.dtype != torch.float32 or mg.shape != g.shape
                                     or mg.device != g.device):  # fmt: skip
                out[i] = self.absorb(model_p, unscale, keep)
                continue
            batch.setdefault(g.device, []).append((i, model_p, master, link, g))
        with torch.no_grad():
            for items in batch.values():
                grads = [g for *_, g in items]
                wide = [torch.empty_like(g, dtype=torch.float32) for g in grads]
                torch_compat.foreach_copy_(wide, grads)
                del grads
                for _, model_p, _, link, _ in items:
                    link.viewable = False
                    model_p.grad = None
                    link.show(None)
                items = [(i, model_p, master, link, None) for i, model_p, master, link, _ in items]  # 16-bit grads freed
                if unscale is not None:
                    unscale(wide)
                sums = [(master.grad, w) for (_, _, master, _, _), w in zip(items, wide) if master.grad is not None]
                if sums:
                    torch_compat.foreach_add_([mg for mg, _ in sums], [w for _, w in sums])
                for (_, _, master, link, _), w in zip(items, wide):
                    if master.grad is None:
                        master.grad = w
                    link.keep(master.grad)
        return out

    def show(self, model_params: Iterable[torch.Tensor]) -> None:
        """Give each of ``model_params`` a 16-bit copy of its master's grad (or no grad
        when the master has none), to be read and edited as the model's own."""
        copies: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, _Link, torch.Tensor]]] = {}
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
                if g is not None and model_p.grad is not None and not g.is_sparse:
                    continue  # shown already (a hook read it), kept in line by the merge
                if g is not None and g.layout == torch.strided:  # copied below, with the others
                    copies.setdefault((g.device, model_p.dtype), []).append((model_p, link, g))
                    continue
                model_p.grad = None if g is None else g.detach().to(model_p.dtype)
                link.show(model_p.grad)
                link.keep(g)
            for (_, dtype), items in copies.items():  # one multi-tensor copy per device and dtype
                lows = [torch.empty_like(g, dtype=dtype) for _, _, g in items]
                torch_compat.foreach_copy_(lows, [g for _, _, g in items])
                for (model_p, link, g), low in zip(items, lows):
                    model_p.grad = low
                    link.show(low)
                    link.keep(g)

    def settle(self, model_p: torch.Tensor) -> None:
        """Before backward adds into ``model_p.grad``: merge what was done to either
        gradient since it was shown, then free the 16-bit copy."""
        master = self._masters.get(id(model_p))
        if master is None:
            return
        link = self._link(model_p)
        if model_p.grad is None and master.grad is None and link.clear():
            return  # nothing on either side, none left there (the usual case after zero_grad)
        if link.held and master.grad is None:  # cleared through the optimizer: both sides go
            self._release(model_p, master, link)
            return
        if link.held and self._still_held(model_p, master, link, zeroed_clears=True):
            self.materialize_one(model_p, master, read=False)  # a second backward: the sum runs in fp32
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
        # held grads (the master's grad a placeholder) are not compared: their model grad
        # is the gradient (a device that holds grads and compares ahead would otherwise
        # run a comparison kernel per grad and read the results for nothing)
        ahead = [(p.grad, m.grad) for p, m in pairs if not self.is_placeholder(m)]
        with torch.no_grad(), compared_ahead(ahead):
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
        if self.before_read is not None:
            self.before_read()
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
                self.materialize_one(model_p, master, read=False)

    def materialize(self) -> None:
        """Give every held grad its fp32 copy on the master (the exact widening of the
        model's 16-bit grad, with any edits made to it since): from then on the two
        grads are linked as under ``master_grads="always"``."""
        for master, model_p in self.held():
            self.materialize_one(model_p, master, read=False)  # (held() took them in)

    def materialize_one(self, model_p: torch.Tensor, master: nn.Parameter, read: bool = True) -> None:
        """:meth:`materialize` for ``model_p`` (and its ``master``) alone; ``read=False``
        from the gradient route's own hooks (no pending grads to take in first)."""
        if read and self.before_read is not None:
            self.before_read()
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

    def clear(self) -> bool:  # nothing was left on either side
        return self._shown is None and self._kept is None and not self.held and self.aside is None and not self.viewing

    def hold(self, g: torch.Tensor, master: nn.Parameter) -> None:
        """Hold ``g``, the model's grad, as the gradient: shown, no fp32 grad kept, and
        the master given a placeholder grad (the last one again where it still fits: it
        has no memory to share)."""
        self.show(g)
        self.keep(None)
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
