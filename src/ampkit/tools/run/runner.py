"""The run: :class:`_Runner` installs the pieces of ``ampkit run`` (the patches of
torch, the forward scopes, the scheduler hold), keeps the run's bookkeeping (steps,
iterations, backward calls, losses) and removes everything at the end. What it applies
is described in :mod:`ampkit.tools.run`."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ampkit._internal import registry as _reset
from ampkit.errors import AmpError
from ampkit.levels.opt_level import OPT_LEVELS

from .config import RunConfig, RunRefused, _Refusal, _StopScript
from .forward_scope import _ForwardScope
from .losses import _LossSeries
from .optimizers import _Optimizers, _OptRecord
from .patches import TorchPatches
from .report import is_rank_zero, run_report
from .scheduler_hold import _SchedulerHold
from .steps import _StepEvents, _StepWatch, _UnmanagedSteps
from .where import _user_site

_LOG = logging.getLogger("ampkit")


class _Runner:
    """The pieces :func:`~.script.run_script` installs, their bookkeeping and their removal."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.dtype = config.torch_dtype
        self.apply = config.level != "fp32"
        self.notes: list[str] = []
        self.losses = _LossSeries()
        self.iter_times: list[float] = []
        self._last_iter: float | None = None
        self.start = time.perf_counter()
        self.iterations = 0
        self.backwards = 0
        self.scaled_backwards = 0
        self.script_scales: bool | None = None  # an enabled GradScaler of the script's
        self._in_backward = threading.local()
        self.forward = _ForwardScope(self.dtype, config.plan) if self.apply else None
        self.schedulers = _SchedulerHold() if self.apply else None
        events = _StepEvents(self._update_starts, self._update_seconds, self._on_step)
        self.optimizers = _Optimizers(config, self._note, lambda opt: _StepWatch(events, opt), self.forward)
        self._unmanaged = _UnmanagedSteps(events)
        self._patches = TorchPatches(self._on_optimizer, self._on_backward)
        self.step_seconds = 0.0
        self.stopped_early: str | None = None
        self._events = 0
        self._managing = False
        self._scalers: list[weakref.ref] = []
        self._before: list[weakref.ref] = []  # GradScalers alive before the script ran
        self._main = threading.get_ident()  # the thread that runs the script
        self._excepthook = threading.excepthook
        # an optimizer built in another thread: the run stops with this (see _on_optimizer)
        self.refused: RunRefused | None = None

    # --- install / remove ------------------------------------------------------------
    def install(self) -> None:
        self._main = threading.get_ident()
        self._before = [weakref.ref(s) for s in _grad_scalers()]
        self._excepthook = threading.excepthook
        threading.excepthook = self._thread_excepthook
        self._patches.install()
        if self.forward is not None:
            self.forward.install()
        if self.schedulers is not None:
            self.schedulers.install()

    def remove(self) -> None:
        """Undo everything :meth:`install` and the management did (ampkit.reset)."""
        if threading.excepthook == self._thread_excepthook:
            threading.excepthook = self._excepthook
        self._patches.remove()
        self._unmanaged.remove()
        if self.forward is not None:
            self.forward.remove()
        if self.schedulers is not None:
            self.schedulers.remove()
        self.optimizers.collect_stats()
        _reset.reset()  # releases every managed optimizer (their own step() back), casting off

    def _thread_excepthook(self, args: Any) -> None:
        """A script thread stopped by a refusal ends quietly: the run reports it once,
        as one line, when the script ends."""
        if isinstance(args.exc_value, _Refusal):
            return
        self._excepthook(args)

    # --- optimizers ---------------------------------------------------------------------
    def _on_optimizer(self, opt: torch.optim.Optimizer) -> None:
        if self._managing:  # built by ampkit itself while setting up (a kernel probe)
            return
        opts = self.optimizers
        record = _OptRecord(
            ref=weakref.ref(opt), index=len(opts.records) + 1, kind=type(opt).__name__,
            site=_user_site(), level="fp32", born=self._events,
        )
        self._events += 1
        opts.records.append(record)
        opts.supersede(record)
        try:
            self._manage(record)
        finally:
            for other in opts.unmanaged():  # their steps are told by hooks of their own
                self._unmanaged.watch(other)

    def _manage(self, record: _OptRecord) -> None:
        """Put the new optimizer of ``record`` under ampkit (at a level that applies)."""
        opts = self.optimizers
        if not self.apply:
            return
        if threading.get_ident() != self._main:
            # Casting is per thread (ampkit's scopes, as torch's autocast state): the
            # script's main thread is the one ampkit run sets up. An optimizer another
            # thread builds would train unmanaged next to the managed ones.
            self.refused = RunRefused(
                f"the {record.kind} built at {record.site} was built in thread "
                f"{threading.current_thread().name!r}, not in the script's main thread: ampkit run "
                "sets up the main thread's training only (casting is per thread). Train in the main "
                "thread, or set ampkit up in that thread yourself (ampkit.init/init_trainer or "
                "ampkit.initialize) and run the script with python."
            )
            raise _Refusal(self.refused)
        self._managing = True
        try:
            opts.manage(record)
        except RunRefused as err:
            raise _Refusal(err) from None
        except AmpError as err:
            record.level = "fp32"
            self._note(f"optimizer {record.index} ({record.kind}, {record.site}) is not managed: {err}")
        finally:
            self._managing = False

    # --- steps and iterations ----------------------------------------------------------
    def _update_starts(self) -> None:
        """Right before an optimizer's own update (taken steps, and steps skipped on the
        device): refuses the run at the first one when a plan fits no model the script
        called."""
        if self.forward is not None and self.forward.plan_matched() is False:
            raise _Refusal(RunRefused(
                "the plan names modules that no model this script called has (e.g. "
                f"{self.config.plan.modules[0].name!r}): names are relative to the model ampkit.tune was given "
                "(or, for ampkit tune script.py, the outermost module the script calls); tune this script's model."))  # fmt: skip

    def _update_seconds(self, seconds: float) -> None:
        self.step_seconds += seconds

    def _on_step(self, ref: weakref.ref) -> None:
        """A ``step()`` of the optimizer ``ref`` refers to (see :mod:`.steps`); the steps
        of one ampkit does not manage are counted here (managed ones count their own)."""
        opt = ref()
        rec = next((r for r in self.optimizers.records if r.ref() is opt), None) if opt is not None else None
        if rec is None:
            return
        if rec.level not in OPT_LEVELS:  # (fp32, superseded: not managed)
            rec.steps += 1
        self._stepped(rec)

    def _stepped(self, rec: _OptRecord) -> None:
        """A step (taken or skipped) of ``rec``'s optimizer. The iterations are the
        steps of the first-built optimizer still in use: not superseded by a later one
        over its parameters, not gone, and not left behind: an optimizer built after
        its last step now steps (a model and optimizer rebuilt from a checkpoint). One
        that has not stepped yet keeps its place (a GAN's generator, stepped after
        several critic steps)."""
        in_use = [r for r in self.optimizers.records if r.level != "superseded" and r.ref() is not None]
        marker = next((r for r in in_use if r is rec or r.last_step < 0 or rec.born <= r.last_step), None)
        rec.last_step = self._events
        self._events += 1
        if self.backwards and rec.backwards_at_step == self.backwards:
            # a step again on the gradients of the step before (torchvision's reference
            # script at vision@017e9b99 with --amp: scaler.step(opt), then opt.step()):
            # counted as a step, not as an iteration
            rec.repeated += 1
            if rec.repeated_site is None:
                rec.repeated_site = _user_site()
            return
        rec.backwards_at_step = self.backwards
        if marker is rec:
            self._iteration()

    def _iteration(self) -> None:
        now = time.perf_counter()
        if self._last_iter is not None:
            self.iter_times.append(now - self._last_iter)
        self._last_iter = now
        self.iterations += 1
        cfg = self.config
        if cfg.max_steps is not None and self.iterations >= cfg.max_steps:
            self.stopped_early = f"max_steps={cfg.max_steps} reached"
            raise _StopScript
        if cfg.time_budget is not None and now - self.start >= cfg.time_budget:
            self.stopped_early = f"time budget of {cfg.time_budget:g} s reached"
            raise _StopScript

    # --- backward ----------------------------------------------------------------------
    def _on_backward(self, orig: Callable[..., Any], tensors: Any, args: tuple, kwargs: dict) -> Any:
        if getattr(self._in_backward, "active", False):
            return orig(tensors, *args, **kwargs)
        self._in_backward.active = True
        try:
            return self._backward(orig, tensors, args, kwargs)
        finally:
            self._in_backward.active = False

    def _backward(self, orig: Callable[..., Any], tensors: Any, args: tuple, kwargs: dict) -> Any:
        if self.refused is not None:  # refused in another thread: the script stops here too
            raise _Refusal(self.refused)
        self.backwards += 1
        if self.forward is not None:
            self.forward.pending.clear()
        site = _user_site()
        if self.script_scales is None:  # an enabled GradScaler the script built: it scales itself
            self._scalers = [
                weakref.ref(s) for s in _grad_scalers() if s.is_enabled() and not any(r() is s for r in self._before)
            ]
            self.script_scales = bool(self._scalers)
            if self.script_scales and self.apply and self.dtype == torch.float16:
                self._note("the script scales its loss itself (an enabled GradScaler): ampkit does not scale it again")
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1 and tensors.is_floating_point():
            self.losses.record(site, tensors, self._scalers[0]() if self._scalers else None)
        if not self.apply or self.dtype != torch.float16:
            return self._plain(orig, tensors, args, kwargs)
        return self._scaled_backward(orig, tensors, args, kwargs, site)

    def _scaled_backward(
        self, orig: Callable[..., Any], tensors: Any, args: tuple, kwargs: dict, site: str
    ) -> Any:
        from ampkit.trainer.api import managed_state, scale_loss

        if self.script_scales:
            return self._plain(orig, tensors, args, kwargs)
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        owners = self.optimizers.param_owners()
        reached, foreign = _reached(roots, owners)
        if foreign:
            raise _Refusal(RunRefused(
                f"fp16 needs loss scaling, but the backward() at {site} reaches {foreign} tensor(s) that "
                "no torch.optim optimizer steps (a manual p.data update, an input's .grad, or parameters "
                "of an optimizer built after this backward): their "
                "gradients could not be unscaled before the script reads them. Run with --dtype bf16 "
                "(fp32's exponent range: no loss scaling needed)."
            ))
        if not reached:
            return self._plain(orig, tensors, args, kwargs)
        create_graph = kwargs.get("create_graph", args[2] if len(args) > 2 else False)
        if create_graph:
            raise _Refusal(RunRefused(
                f"fp16 needs loss scaling, but the backward() at {site} builds a graph of its gradients "
                "(create_graph=True): scaled gradients would enter it. Run with --dtype bf16."
            ))
        opts = [o for o in reached if o is not None]
        try:
            for opt in opts:
                managed_state(opt)
        except AmpError as err:  # pragma: no cover - owners are managed ones
            raise _Refusal(RunRefused(f"fp16 loss scaling at {site}: {err}")) from None
        self.scaled_backwards += 1
        with scale_loss(roots if len(roots) > 1 else roots[0], opts) as scaled:
            result = orig(scaled, *args, **kwargs)
        self._backward_done()
        return result

    def _plain(self, orig: Callable[..., Any], tensors: Any, args: tuple, kwargs: dict) -> Any:
        result = orig(tensors, *args, **kwargs)
        self._backward_done()
        return result

    def _backward_done(self) -> None:
        if not self.optimizers.records:  # no optimizer (yet): each backward is an iteration
            self._iteration()

    # --- notes and the report ------------------------------------------------------------
    def _note(self, message: str) -> None:
        self.notes.append(message)
        if is_rank_zero():
            _LOG.warning("ampkit run: %s", message)

    def report(self, code: int, script: str, args: list[str], wall: float) -> dict[str, Any]:
        """The run's report (:func:`~.report.run_report`), once the script has ended."""
        self.losses.flush()
        return run_report(self, code, script, args, wall)


def _reached(
    roots: list[torch.Tensor], owners: dict[int, torch.optim.Optimizer]
) -> tuple[list[torch.optim.Optimizer], int]:
    """The managed optimizers whose parameters a backward from ``roots`` accumulates
    into, and how many other leaf tensors it reaches (a walk of the autograd graph)."""
    seen: set[Any] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    found: dict[int, torch.optim.Optimizer] = {}
    foreign = 0
    for t in roots:
        if t.grad_fn is None and t.requires_grad:
            if id(t) in owners:
                found[id(owners[id(t)])] = owners[id(t)]
            else:
                foreign += 1
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            opt = owners.get(id(var))
            if opt is not None:
                found[id(opt)] = opt
            else:
                foreign += 1
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return list(found.values()), foreign


def _grad_scalers() -> list[Any]:
    """The ``torch.amp.GradScaler`` and ``ampkit.GradScaler`` objects alive."""
    from torch.amp import GradScaler as TorchGradScaler

    from ampkit.trainer.grad_scaler import GradScaler

    return [obj for obj in gc.get_objects() if issubclass(type(obj), (TorchGradScaler, GradScaler))]
