"""The gradient path: the gradients user code can see are real ones.

A loss scale ``S`` multiplies every gradient backward produces. Code that runs between
backward and ``optimizer.step()`` (clipping, grad-norm logging, edits of ``p.grad``) was
written for real gradients: it must see them unscaled and, under O2, on the parameters
it names (the model's), with its changes reaching the fp32 masters the optimizer steps.

Each parameter backward accumulates into gets two hooks while its optimizer is managed
and a scaler of it is not at 1 or masters take its grads (otherwise they would do
nothing; each ``scale_loss`` puts them on or off): a pre-hook on its ``AccumulateGrad``
node (it runs only when backward adds into ``p.grad``, not for ``torch.autograd.grad``,
whose results stay scaled, as with ``torch.amp``), and a post-accumulate-grad hook moved
before the parameter's own ones, which read the real gradient (the sum so far) in
``p.grad``, unscaled or shown from the master at once (O2 under DDP: still scaled).

**Parameters stepped as they are** (fp32 under O0/O1, 16-bit under O3/O2K, fp32 norms
under O2). The pre-hook multiplies a gradient the parameter already holds by ``S`` (exact
for power-of-two scales), so backward adds ``S*g`` onto ``S*previous``. When the pass
ends -- in an autograd final callback queued behind DistributedDataParallel's, so DDP has
all-reduced the sums -- the gradients it touched are multiplied by ``1/S`` in one fused
pass per (device, dtype); accumulation pays one more pass per micro-batch and gets real
gradients between micro-batches. Under DDP's ``no_sync`` the local sums stay in
``p.grad`` as DDP requires.

**Parameters with an fp32 master** (O2; the masters plug in as a
:class:`~ampkit.trainer.master_grads.MasterGrads`, the only calls made to them): the
post-accumulate hook notes each 16-bit gradient as pending; when the pass ends, all of
them move into their masters' fp32 gradients (unscaled and checked in fp32) and are freed,
in a few multi-tensor calls per device (:meth:`GradPath.take_pending`), and the model
parameters get 16-bit copies to read and edit, merged back before the step. A gradient a
later hook of the parameter reads moves at once; one that anything asks the masters for
during the pass moves then (``MasterGrads.on_read``); at most ``PENDING_BYTES`` wait. Under DDP
(seen by a forward pre-hook on the model) the 16-bit gradients stay in ``p.grad`` until
DDP has reduced them, and move into the masters after the synchronized backward.

The overflow check reads the memory the optimizer steps when the step (or
``ampkit.unscale``) closes the grads: an edit through ``.data`` (``p.grad.data[i] = x``)
changes no version counter, so a check at the end of backward cannot vouch for it. The
step reads those grads once, in one fused pass per (device, dtype). A master's fp32 grad,
reached only through ``ampkit.master_params``, is checked as backward moves it in and
read again only when it was replaced or changed in place since.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit._internal.dtypes import torch_class
from ampkit.errors import AmpError, StateError
from ampkit.scaling.loss_scaler import group_grads

from .fused_step import unscale_and_flag
from .master_grads import MasterGrads

if TYPE_CHECKING:
    from .managed import ManagedOptimizer

__all__ = ["GradPath", "WatchDDP", "watch_ddp", "no_masters_guard"]

_ENGINE = torch_compat.autograd_engine()

# id(param) -> the GradPath whose hooks are on it (one managed optimizer per parameter).
# Module state: a parameter is hooked by at most one managed optimizer in the process.
_OWNER: dict[int, weakref.ref[GradPath]] = {}


def has_grad_path(param: torch.Tensor) -> bool:
    """Whether ``param``'s grads go through the hooks of a live :class:`GradPath`."""
    ref = _OWNER.get(id(param))
    return ref is not None and ref() is not None


_task = torch_compat.current_graph_task_id

#: The 16-bit grads the hooks leave pending within a backward pass before they take them
#: in (:meth:`GradPath.take_pending`): at most this many bytes kept longer than one hook
#: at a time would keep them (held grads, which stay on the model anyway, not counted).
PENDING_BYTES = 64 << 20


def _accumulator(p: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node of leaf ``p`` (kept alive by the caller)."""
    with torch.enable_grad():
        return p.view_as(p).grad_fn.next_functions[0][0]


def _stepped(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    return itertools.chain.from_iterable(group["params"] for group in opt.param_groups)


def _is_dtensor(p: torch.Tensor) -> bool:
    dtensor = torch_class("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(p, dtensor)


# --- DDP, as seen from the model's forward ------------------------------------------------

# model -> whether DDP will all-reduce the grads of the backward that follows its last
# forward with grad enabled (True), will not (``no_sync``: False); absent: not under DDP.
# Module state: DDP models are process-wide objects (weak keys: no model kept alive).
_DDP_SYNC: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
# model -> the MasterGrads of the masters it holds (weakly). Module state, like
# _DDP_SYNC: the model's forward hook finds its masters here (weak keys).
_WATCHED: weakref.WeakKeyDictionary[nn.Module, list[weakref.ref]] = weakref.WeakKeyDictionary()


class WatchDDP:
    """Forward pre-hook of a model set up with fp32 masters: rounds into the model the
    masters changed since the last step (``MasterGrads.before_forward``) and
    records whether the call runs inside ``DistributedDataParallel`` and whether DDP
    will reduce its grads. A plain, stateless object, so the model pickles and
    deep-copies (a copy is not watched: the registry is keyed by the module)."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            # torch.compile(module) runs hooks outside its graph and dynamo compiles this
            # one as a frame of its own: bookkeeping only, so the frame is skipped and
            # runs eagerly (dynamo would compile the version reads once per parameter)
            _watch_traced_alone()
        elif torch_compat.dynamo_loaded():  # what it calls must not become frames dynamo compiles
            _watch_outside_dynamo(self, module)
            return
        self._watch(module)

    def _watch(self, module: nn.Module) -> None:
        masters = _WATCHED.get(module)
        if masters is None:
            return
        for ref in masters:
            mw = ref()
            if mw is not None:
                mw.before_forward()
        if not torch.is_grad_enabled():
            return
        ddp = torch_compat.active_ddp_module()
        if ddp is None:
            _DDP_SYNC.pop(module, None)
        else:
            _DDP_SYNC[module] = bool(ddp.require_backward_grad_sync)


def _watch_traced_alone() -> bool:
    return torch_compat.skip_if_traced_alone(
        WatchDDP.__call__.__code__, "ampkit's master-watch hook runs eagerly when compiled as a frame of its own"
    )


torch_compat.mark_trace_constant(_watch_traced_alone)
_watch_outside_dynamo = torch_compat.run_outside_dynamo(lambda hook, module: hook._watch(module))


def watch_ddp(model: nn.Module, masters: MasterGrads) -> None:
    """Install :class:`WatchDDP` on ``model`` (once) for ``masters``."""
    refs = _WATCHED.setdefault(model, [])
    refs[:] = [r for r in refs if r() is not None and r() is not masters] + [weakref.ref(masters)]
    if not any(isinstance(h, WatchDDP) for h in torch_compat.module_hook_dicts(model).pre.values()):
        model.register_forward_pre_hook(WatchDDP())


def _ddp_sync_of(model_ref: weakref.ref[nn.Module] | None) -> bool | None:
    if not _DDP_SYNC:  # no model under DDP (every hook asks: no weak reference made for a lookup)
        return None
    model = model_ref() if model_ref is not None else None
    return None if model is None else _DDP_SYNC.get(model)


# --- levels that need an optimizer ----------------------------------------------------------

# Module state: the guards of models prepared by initialize; dropped by ampkit.reset.
_GUARDS: list[Any] = []


def no_masters_guard(params: list[nn.Parameter], level_name: str) -> None:
    """Make the first backward that accumulates into one of ``params`` raise: the level
    (O2/O2K) was set up without an optimizer, so nothing keeps the updates from being
    rounded away in 16 bits. Inference (no backward into the weights) is unaffected."""

    def refuse(p: torch.Tensor) -> None:
        raise AmpError(
            f"a backward pass accumulated gradients into the 16-bit weights of a model set "
            f"up by ampkit.initialize at {level_name} without an optimizer, so no fp32 master "
            "weights (or compensation) exist and a hand-written update would round small "
            "changes away. Pass the optimizer to ampkit.initialize(model, optimizer, ...); "
            "for pure 16-bit training use O3; for inference call model.requires_grad_(False) "
            "or run under torch.no_grad()."
        )

    for p in params:
        if p.requires_grad:
            _GUARDS.append(p.register_post_accumulate_grad_hook(refuse))


def drop_guards() -> None:
    for handle in _GUARDS:
        handle.remove()
    _GUARDS.clear()


# --- per-parameter state ------------------------------------------------------------------


class _Param:
    """One parameter backward accumulates into (the model's, for a mastered one)."""

    __slots__ = (
        "param", "stepped", "master", "node", "handles", "scale", "loss_id", "pre_task", "model", "hooks", "pending",
        "holds",
    )

    def __init__(self, param: nn.Parameter, stepped: nn.Parameter, model: weakref.ref | None) -> None:
        self.param = param
        self.stepped = stepped  # what the optimizer steps: the master, or param itself
        self.master = stepped if stepped is not param else None
        self.node: Any = None
        self.handles: list[Any] = []
        # p.grad holds `scale` (loss `loss_id`'s scale) times its real value; None: real
        self.scale: float | None = None
        self.loss_id: int | None = None
        self.pre_task = -2  # graph task in which the pre-hook last ran
        self.model = model
        self.hooks: dict[int, Any] = {}  # param's post-accumulate hooks, ampkit's first
        # a mastered grad taken in when the backward pass ends, with the pass's others
        # in a few multi-tensor calls: its loss id and scale
        self.pending: tuple[int | None, float] | None = None
        # the masters keep this parameter's first grad of a step on the model (held: no
        # fp32 copy, nothing freed), so taking it in can wait for the end of the pass
        self.holds = False


class GradPath:
    """The hooks of one managed optimizer (see the module docs). Created by
    :class:`ampkit.trainer.api.ManagedOptimizer`; master weights plug in with
    :meth:`set_masters`."""

    def __init__(self, state: ManagedOptimizer) -> None:
        self._state = weakref.ref(state)
        self.masters: MasterGrads | None = None
        self._params: dict[int, _Param] = {}  # id(backward param) -> record
        # ids of parameters left without hooks: FSDP2's sharded DTensor parameters (FSDP
        # assigns their grads, no accumulator runs); the step unscales their grads.
        self._unhooked: set[int] = set()
        self._model_of: dict[int, weakref.ref[nn.Module]] = {}
        # graph task -> records its backward touched, processed when the task ends.
        self._open: dict[int, list[_Param]] = {}
        self._stepping = False  # between before_step and after_step
        self._pass: tuple[int, int | None, float] = (-2, None, 1.0)  # graph task, its loss id and scale
        self._pending_bytes = 0  # of the 16-bit grads left pending that a hook would have freed
        # this step's inf/NaN flags from the hooks, per loss id and device
        self._found: dict[int, dict[torch.device, torch.Tensor]] = {}
        self._inv: dict[tuple[torch.device, float], torch.Tensor] = {}
        # id(stepped param) -> (weakref to its grad, version) when last checked
        self._checked: dict[int, tuple[weakref.ref, int]] = {}
        self._followed = False  # an unscale outside ampkit was followed (after_outside_unscale)
        self._active = True
        self._armed = False  # whether the records' hooks are on (see _arm)
        # refresh's last walk: the params it saw (none: walk again), those frozen then
        self._seen: list[torch.Tensor] = []
        self._frozen: list[torch.Tensor] = []

    # -- setup ------------------------------------------------------------------------
    def set_masters(self, masters: MasterGrads, models: list[nn.Module]) -> None:
        """Route gradients of mastered parameters into ``masters`` (O2)."""
        self.masters = masters
        me = weakref.ref(self)

        def before_read() -> None:
            path = me()
            if path is not None:
                path.take_pending()

        masters.on_read(before_read)
        for model in models:
            ref = weakref.ref(model)
            for p in model.parameters():
                self._model_of[id(p)] = ref
            watch_ddp(model, masters)
        self._reinstall()

    def held_params(self) -> list[nn.Parameter]:
        """The model parameters whose 16-bit grad is held as their master's gradient (O2,
        ``master_grads="on_demand"``): the step checks and reads these."""
        if self.masters is None:
            return []
        return self.masters.held()

    def _reinstall(self) -> None:
        for rec in list(self._params.values()):
            self._unhook(rec)
        self._params.clear()
        self._seen = []
        self.refresh()

    def refresh(self) -> None:
        """Hook the parameters now in the optimizer's param groups (one identity
        comparison when the groups and the frozen parameters did not change)."""
        state = self._state()
        if state is None or not self._active:
            return
        mw = self.masters
        if mw is not None:
            mw.refresh()
        self._arm(mw is not None or any(slot.scaler.scale != 1.0 for slot in state._slots))
        backward = state.backward_params if mw is None else None
        params = list(backward if backward is not None else _stepped(state.optimizer))
        same = len(params) == len(self._seen) and all(map(operator.is_, params, self._seen))
        if same and not any(p.requires_grad for p in self._frozen):
            return
        self._seen, frozen = [], []
        for stepped in params:
            model_p = mw.model_param_of(stepped) if mw is not None else None
            param = stepped if model_p is None else model_p
            if not param.requires_grad:  # frozen: looked at again by every refresh
                frozen.append(param)
            elif id(param) not in self._params:
                if _is_dtensor(param):
                    self._unhooked.add(id(stepped))
                else:
                    self._hook(param, stepped)
        self._frozen = frozen
        self._seen = params

    def _hook(self, param: nn.Parameter, stepped: nn.Parameter) -> None:
        if len(_OWNER) > 4096:  # optimizers dropped without ampkit.reset
            for key in [k for k, ref in _OWNER.items() if ref() is None]:
                del _OWNER[key]
        owner = _OWNER.get(id(param))
        other = owner() if owner is not None else None
        if other is not None and other is not self and other._active:
            raise StateError(
                "a parameter is in two optimizers managed by ampkit; its gradient can "
                "only be unscaled once. Give each parameter to one optimizer."
            )
        rec = self._params[id(param)] = _Param(param, stepped, self._model_of.get(id(param)))
        rec.holds = rec.master is not None and self.masters is not None and self.masters.may_hold(param)
        _OWNER[id(param)] = weakref.ref(self)
        if self._armed:
            self._attach(rec)

    def _arm(self, armed: bool) -> None:
        """Put the hooks of every record on (``armed``) or off; a record whose parameter
        was frozen meanwhile is dropped (refresh records it again once it needs grads)."""
        if armed == self._armed:
            return
        self._armed = armed
        self._seen = []
        for key, rec in list(self._params.items()):
            if not armed:
                self._detach(rec)
            elif rec.param.requires_grad:
                self._attach(rec)
            else:
                del self._params[key]

    def _attach(self, rec: _Param) -> None:
        pre, post = self._closures(rec)
        rec.node = _accumulator(rec.param)
        handle = rec.param.register_post_accumulate_grad_hook(post)
        rec.hooks = torch_compat.post_accumulate_hooks_first(rec.param, handle.id)
        rec.handles = [rec.node.register_prehook(pre), handle]

    def _closures(self, rec: _Param) -> tuple[Callable[[Any], None], Callable[[torch.Tensor], None]]:
        me = weakref.ref(self)

        def pre(grad_outputs: Any) -> None:
            path = me()
            if path is not None:
                path._before_accumulate(rec)

        def post(p: torch.Tensor) -> None:
            path = me()
            if path is not None:
                path._after_accumulate(rec)

        return pre, post

    def _detach(self, rec: _Param) -> None:
        for handle in rec.handles:
            handle.remove()
        rec.handles = []
        rec.node = None

    def _unhook(self, rec: _Param) -> None:
        self._detach(rec)
        if _OWNER.get(id(rec.param)) is not None and _OWNER[id(rec.param)]() is self:
            del _OWNER[id(rec.param)]

    def remove(self) -> None:
        """Detach: finish pending work, then remove every hook (the optimizer is no
        longer managed)."""
        if not self._active:
            return
        self.finish(absorb_raw=True)
        if self.masters is not None:
            self.masters.materialize()  # no hooks from now on: the masters hold the grads
        self._active = False
        for rec in self._params.values():
            self._unhook(rec)
        self._params.clear()
        self._open.clear()
        self._found.clear()

    # -- the current scale ----------------------------------------------------------------
    def _current(self) -> tuple[int | None, float]:
        state = self._state()
        loss_id = state.step_grads._pending if state is not None else None
        return (None, 1.0) if loss_id is None else (loss_id, state._slots[loss_id].scaler.scale)

    def _unscaler(self, loss_id: int | None, scale: float) -> Callable[[list[torch.Tensor]], None] | None:
        """In-place ``* (1/scale)`` and inf/NaN check of a list of same-device, same-dtype
        tensors, the flag going to this step's ``loss_id``; None when there is nothing
        to do (no loss scaled, scale 1)."""
        if loss_id is None:
            return None if scale == 1.0 else (lambda ts: torch_compat.foreach_mul_(ts, 1.0 / scale))
        flags = self._found.setdefault(loss_id, {})
        return functools.partial(unscale_and_flag, flags=flags, inv=1.0 / scale, constants=self._inv)

    # -- hooks ------------------------------------------------------------------------------
    def _before_accumulate(self, rec: _Param) -> None:
        rec.pre_task = task = _task()
        if rec.pending is not None:  # it accumulates again (a nested backward) before its pass ended
            self._absorb_pending([rec])
        p = rec.param
        if rec.master is None:
            if p.grad is None:  # backward assigns its (scaled) gradient: nothing to do
                return
            loss_id, scale = self._current()
            if scale == 1.0 and rec.scale is None:
                return
            with torch.no_grad():
                if rec.scale is None:
                    p.grad.mul_(scale)
                elif rec.scale != scale:
                    p.grad.mul_(scale / rec.scale)
            rec.scale, rec.loss_id = scale, loss_id
            self._touch(task, rec)
            return
        mw = self.masters
        assert mw is not None
        if rec.scale is not None:  # 16-bit grads held for DDP, still scaled
            loss_id, scale = self._current()
            if not mw.before_accumulate(p, raw=True):
                rec.scale = None
            elif scale != rec.scale:
                with torch.no_grad():
                    p.grad.mul_(scale / rec.scale)
                rec.scale, rec.loss_id = scale, loss_id
            return
        mw.before_accumulate(p, raw=False)

    def _after_accumulate(self, rec: _Param) -> None:
        task = _task()
        if rec.pre_task != task:
            self._replace_node(rec)
        if self._pass[0] != task or task < 0:  # one loss and scale for the whole backward pass
            self._pass = (task, *self._current())
        _, loss_id, scale = self._pass
        if rec.master is not None:
            self._touch(task, rec)
            if _ddp_sync_of(rec.model) is not None:
                rec.scale, rec.loss_id = scale, loss_id  # DDP reduces it first
                return
            assert self.masters is not None
            if len(rec.hooks) == 1:  # no later hook of the parameter reads p.grad
                # taken in with the pass's others when it ends (_process), in a few
                # multi-tensor calls, or before anything reads the masters' grads
                rec.pending = (loss_id, scale)
                g = rec.param.grad
                if g is not None and not (rec.holds and scale == 1.0 and rec.master.grad is None):
                    self._pending_bytes += g.numel() * g.element_size()  # (a held grad stays either way)
                    if self._pending_bytes > PENDING_BYTES:
                        self.take_pending()
                return
            before = self._before_take_in(rec)
            if not self.masters.take_in(rec.param, self._unscaler(loss_id, scale), keep=scale == 1.0):
                self._mark_checked(rec.stepped, loss_id, before)
            # else: held on the model or a view of the master's grad, checked by the step
            if len(rec.hooks) > 1:  # hooks after this one read p.grad: real, in 16 bits
                self.masters.show([rec.param])
            return
        if scale != 1.0:
            if len(rec.hooks) > 1 and _ddp_sync_of(rec.model) is None:  # hooks after this one read it
                torch_compat.foreach_mul_([rec.param.grad], 1.0 / scale)  # as the end of backward would
                rec.scale = None
                return
            rec.scale, rec.loss_id = scale, loss_id
            self._touch(task, rec)

    def _replace_node(self, rec: _Param) -> None:
        """The accumulator changed since the hooks were installed (``p.data`` replaced
        with another dtype or device): hook the new one."""
        if rec.master is not None:
            raise AmpError(
                "a 16-bit model parameter with an fp32 master changed its dtype or device "
                "after ampkit.initialize (e.g. model.to(...) afterwards): the masters would "
                "train a stale copy. Move the model to its device before initialize."
            )
        if rec.handles:
            rec.handles[0].remove()
        rec.node = _accumulator(rec.param)
        rec.handles[0] = rec.node.register_prehook(self._closures(rec)[0])

    def _touch(self, task: int, rec: _Param) -> None:
        touched = self._open.get(task)
        if touched is None:
            touched = self._open[task] = []
            me = weakref.ref(self)

            def end() -> None:
                path = me()
                if path is not None:
                    path._end_backward(task)

            # Queued from inside the final callbacks, so it runs after every callback
            # queued during the backward pass (DDP's finalize, which writes the reduced
            # grads into p.grad).
            _ENGINE.queue_callback(lambda: _ENGINE.queue_callback(end))
        touched.append(rec)

    def _end_backward(self, task: int) -> None:
        self._process(self._open.pop(task, []), absorb_raw=False)

    def _process(self, touched: list[_Param], absorb_raw: bool) -> None:
        """Unscale the scaled grads of ``touched`` (fused, per device and dtype; checked by
        the step), move reduced 16-bit grads into masters (checked as they move), show mirrors."""
        by_scale: dict[float, list[_Param]] = {}
        shown: list[nn.Parameter] = []
        unique = list(dict.fromkeys(touched))  # each once, in order
        pending = [rec for rec in unique if rec.pending is not None]
        if pending:
            self._absorb_pending(pending)
        for rec in unique:
            if rec.master is not None:
                if rec.scale is not None:
                    if not absorb_raw and _ddp_sync_of(rec.model) is False:
                        continue  # under no_sync: DDP reduces the whole sum later
                    assert self.masters is not None
                    before = self._before_take_in(rec)
                    self.masters.take_in(rec.param, self._unscaler(rec.loss_id, rec.scale), keep=False)
                    self._mark_checked(rec.stepped, rec.loss_id, before)
                    rec.scale = None
                shown.append(rec.param)
            elif rec.scale is not None:
                by_scale.setdefault(rec.scale, []).append(rec)
        for scale, recs in by_scale.items():
            # Multiplied only: these grads are the memory the optimizer steps, which code
            # can still change through ``.data`` before the step (no version counter
            # tells), so the step reads them for inf/NaN then (``unchecked``), once.
            params = [r.param for r in recs if r.param.grad is not None]
            if params and scale != 1.0:
                with torch.no_grad():
                    for grads in group_grads(params).values():
                        torch_compat.foreach_mul_(grads, 1.0 / scale)
            for r in recs:
                r.scale = None
        if shown and self.masters is not None:
            self.masters.show(shown)

    def take_pending(self) -> None:
        """Take in now the mastered grads the hooks left pending: for code that reads
        the masters' grads while a backward pass runs or after one that raised
        (``MasterGrads.on_read``), and when the pending 16-bit grads reach
        ``PENDING_BYTES``."""
        recs = [rec for touched in self._open.values() for rec in touched if rec.pending is not None]
        if recs:
            self._absorb_pending(list(dict.fromkeys(recs)))

    def _absorb_pending(self, recs: list[_Param]) -> None:
        """Move the 16-bit grads the hooks left pending into their masters, with the
        result the hooks' :meth:`MasterGrads.take_in` would have had: held on the model
        (checked by the step) or widened into the master's grad, unscaled and checked."""
        assert self.masters is not None
        self._pending_bytes = 0
        by_loss: dict[tuple[int | None, float], list[_Param]] = {}
        for rec in recs:
            assert rec.pending is not None
            by_loss.setdefault(rec.pending, []).append(rec)
            rec.pending = None
        for (loss_id, scale), group in by_loss.items():
            unscale = self._unscaler(loss_id, scale)
            befores = [self._before_take_in(rec) for rec in group]
            left = self.masters.take_in_many([rec.param for rec in group], unscale, keep=scale == 1.0)
            for rec, unchecked, before in zip(group, left, befores):
                if not unchecked:
                    self._mark_checked(rec.stepped, loss_id, before)

    def finish(self, absorb_raw: bool = False) -> None:
        """Process backward passes whose end was not seen (an exception inside backward)
        and, with ``absorb_raw``, 16-bit grads still held for DDP (a step after
        ``no_sync`` backward passes only)."""
        for task in list(self._open):
            self._end_backward(task)
        if absorb_raw:
            self._process([r for r in self._params.values() if r.scale is not None], absorb_raw=True)

    # -- the step's check -----------------------------------------------------------------
    @staticmethod
    def _before_take_in(rec: _Param) -> tuple[torch.Tensor | None, int]:
        """The master's grad a take-in adds to, and its version (:meth:`_mark_checked`)."""
        g = rec.stepped.grad
        return g, (0 if g is None else torch_compat.tensor_version(g))

    def _mark_checked(self, stepped: torch.Tensor, loss_id: int | None,
                      before: tuple[torch.Tensor | None, int]) -> None:  # fmt: skip
        """Record ``stepped``'s grad as checked by the take-in that just moved a checked
        16-bit grad into it, where that check covers all of it: the grad is new
        (``before``: the grad and its version right before the take-in; no grad), or it
        was added into a grad recorded checked and unchanged since. Else (an edit merged
        into the sum between two backward passes, a grad set from outside) the step
        checks it (:meth:`unchecked`)."""
        if loss_id is None:
            return
        g = stepped.grad
        if g is None:
            return
        old, version = before
        if old is not None:
            seen = self._checked.get(id(stepped))
            if old is not g or seen is None or seen[0]() is not old or seen[1] != version:
                return
        self._checked[id(stepped)] = (weakref.ref(g), torch_compat.tensor_version(g))

    def forget_flags(self) -> None:
        """A fresh step (the previous one was abandoned): drop the hooks' flags and what
        their checks vouched for (:meth:`forget_checks`)."""
        self._found.clear()
        self.forget_checks()

    def forget_checks(self) -> None:
        """A step was skipped: the checks at backward vouch for no grad any longer (one
        they found inf in, kept for the next step, would be vouched for again with what
        that step adds). The step checks each once more. The hooks' flags stay: this
        step's, where the skip is settled inside ``step()``."""
        self._checked.clear()

    def take_found(self, loss_id: int) -> list[torch.Tensor]:
        """The hooks' inf/NaN flags for ``loss_id`` since the last call (one per device)."""
        return list(self._found.pop(loss_id, {}).values())

    def unhooked(self, params: Iterator[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``params`` that have a grad and no hooks (still scaled)."""
        if not self._unhooked:
            return []
        return [p for p in params if id(p) in self._unhooked and p.grad is not None]

    def unchecked(self, params: Iterator[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``params`` whose grad the caller must check for inf/NaN now: every
        grad no check at backward vouches for (the stepped memory the hooks only
        multiplied, grads produced at a scale of 1, held 16-bit grads), and a master's
        fp32 grad checked when backward moved it in only if it was replaced or changed
        in place since (those count as checked again from now on)."""
        masters = self.masters
        if masters is None and not self._checked:  # no check at backward vouches for any
            return [p for p in params if p.grad is not None]
        out = []
        for p in params:
            g = p.grad
            if g is None or (masters is not None and masters.is_placeholder(p)):
                continue
            seen = self._checked.get(id(p))
            if seen is None:  # no check at backward vouches for it: read at every close
                out.append(p)
            elif seen[0]() is not g or seen[1] != torch_compat.tensor_version(g):
                out.append(p)
                self._checked[id(p)] = (weakref.ref(g), torch_compat.tensor_version(g))
        return out

    def reconcile(self) -> None:
        """Before the grads are checked (``unscale``/``step``): merge edits made through
        the model's 16-bit grads into the fp32 masters (O2)."""
        if self.masters is not None:
            self.masters.reconcile(self._mastered())

    def before_zero_grad(self) -> None:
        """Before ``optimizer.zero_grad()`` (O2): the grads of a backward whose end was not
        seen (an exception inside it) are taken in first, so the zeroing reaches them."""
        if self.masters is not None and self._open and not self._stepping:
            self.finish()

    def after_zero_grad(self, set_to_none: bool) -> None:
        """After ``optimizer.zero_grad(set_to_none)`` (O2): the model's grads show what it
        did to the masters' (cleared: None; zeroed in place: zeros), and 16-bit grads held
        for DDP to reduce (``no_sync`` backward passes the masters have not seen) are
        cleared or zeroed with them. Not while the step runs (a closure's ``zero_grad``)."""
        if self.masters is None or self._stepping:
            return
        raw = [r for r in self._params.values() if r.master is not None and r.scale is not None]
        with torch.no_grad():
            for rec in raw:
                if set_to_none or rec.param.grad is None:
                    rec.param.grad = None
                    rec.scale = rec.loss_id = None
                else:
                    rec.param.grad.zero_()
        self.masters.after_zero_grad(self._mastered())

    def _mastered(self) -> list[nn.Parameter]:
        """The model parameters whose grads are shown from a master (not held for DDP)."""
        return [r.param for r in self._params.values() if r.master is not None and r.scale is None]

    def before_outside_unscale(self) -> None:
        """Before code outside ampkit unscales the stepped grads in place (a GradScaler's
        ``unscale_``): finish pending work and, O2, merge the model's grad edits into the
        masters, so the unscale acts on the grads the step will use."""
        self.finish(absorb_raw=True)
        if self.masters is not None:
            self.masters.materialize()  # it unscales the masters' grads
        self.reconcile()

    def after_outside_unscale(self) -> None:
        """After it: O2, the model's 16-bit grads show the unscaled masters' grads
        (:meth:`ampkit.trainer.master_grads.MasterGrads.follow`)."""
        if self.masters is not None:
            self.masters.follow(self._mastered())
        self._followed = True

    def take_followed(self) -> bool:
        """Whether :meth:`after_outside_unscale` ran since the last call."""
        self._followed, followed = False, self._followed
        return followed

    def before_step(self) -> None:
        """Right before the optimizer runs (taken or skipped step), O2: masters take in
        model weights changed outside ampkit, and the 16-bit grad copies are freed so
        the step runs without them (:meth:`after_step` brings them back)."""
        mw = self.masters
        self._stepping = True
        if mw is not None:
            mw.before_step(self._mastered())

    def after_step(self) -> None:
        """After the step: the model's params show their (fp32) grads again, as 16-bit
        copies, for code that reads them after ``step()``."""
        mw = self.masters
        self._stepping = False
        if mw is not None:
            mw.show(self._mastered())
