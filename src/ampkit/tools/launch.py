"""``ampkit run``: mixed precision for an unmodified training script.

:func:`run_script` runs a script as ``__main__`` (``runpy``, with the ``sys.argv`` it
expects) with these pieces installed for the length of the run, and removed after:

- **Casting inside forward passes only.** A global forward pre-hook opens an
  :class:`ampkit.autocast` scope when a *model call* starts and a global forward hook
  (always called) closes it when that call returns. A model call is the outermost call
  of a module that has parameters (trained or frozen), made outside data loading.
  Modules without parameters -- torchvision's transforms, loss modules -- are not
  models: called on their own they run as written, in fp32 (a module with parameters
  they call is the model call). Nothing that loads data is cast: DataLoader worker
  processes, a DataLoader's batch fetch in the main process (``Dataset.__getitem__``,
  ``collate_fn``) and a Dataset's ``__getitem__``/``__iter__`` the script calls itself.
  The same rule holds with or without an optimizer, before and after it is built.
  Backward, optimizer steps, ``p.data`` updates and evaluation code outside modules
  run as the script wrote them. Inside a ``torch.autocast`` region the script opened itself (enabled)
  ampkit opens nothing: the script's choice stands. A model cast by O2/O2K runs under its
  own op-level scope (:func:`ampkit.model.add_op_casting`) instead.
- **Every torch.optim optimizer is managed.** ``torch.optim.Optimizer.__init__`` is
  wrapped for the run: when a script builds an optimizer, it is put under
  :func:`ampkit.init_trainer` (O1) or :func:`ampkit.initialize` (O2/O2K, the models found
  as the modules that own its parameters) right away, with LR schedulers held on skipped
  steps. All the run's optimizers share one trainer (one loss scaler), so a loss that
  reaches several of them (a GAN's generator loss flows through the discriminator) is
  scaled once. An optimizer built over the parameters of an earlier one supersedes it.
- **Loss scaling where ``backward()`` is called** (fp16 only; bf16 needs none).
  ``torch.autograd.backward`` (what ``Tensor.backward`` calls) is wrapped: a backward
  whose graph reaches managed parameters runs inside :func:`ampkit.scale_loss` for the
  optimizers it reaches, and ampkit's gradient path (:mod:`ampkit.grads`) unscales the
  grads as backward produces them, so code between backward and ``step()`` (clipping,
  logging) sees real gradients. Where that cannot be exact -- the backward reaches
  tensors no managed optimizer steps (a manual ``p.data`` update, an input's grad), or
  builds a graph of its grads (``create_graph=True``) -- fp16 is refused with
  :class:`RunRefused` (bf16 proposed). A script with its own enabled ``GradScaler``
  scales itself: ampkit does not scale again.
- **Observation.** Each backward on a one-element tensor records the loss (the value of
  that tensor), in one series per source line of the ``backward()`` call; each step of
  the first optimizer built marks an iteration (a script without optimizer: each
  backward). A step taken with no ``backward()`` since the same optimizer's previous
  step applies the same gradients again: it counts in that optimizer's steps, not as an
  iteration, and a note says so. Module calls are counted: ``model_calls`` (the model
  calls), of which ``forward_scopes`` ampkit cast, ``forward_calls_in_script_autocast``
  ran in the script's own enabled ``torch.autocast``, ``forward_calls_kept_fp32`` in
  its ``torch.autocast(enabled=False)`` and ``forward_calls_cast_model`` in the
  op-level scope of an O2/O2K model; ``module_calls_left_alone`` counts the other
  outermost module calls (no parameters, or data loading) of this process. The step and time limits (``max_steps``, ``time_budget``) end the script
  cleanly after such a step.

The ``fp32`` level installs the observation only (no casting, optimizers left alone):
the reference run of ``ampkit run --compare``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import logging
import os
import runpy
import statistics
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampkit._internal import registry as _reset
from ampkit._internal.script import check_script, exit_code, script_argv
from ampkit._internal.where import SKIPPED_PATHS
from ampkit.casting.engine import _hooks
from ampkit.errors import AmpError
from ampkit.levels.model_cast import EntryCasts, OpCastingEnter, cast_tensors
from ampkit.trainer.managed import stepped_by_scaler, unscaled_in_place

__all__ = ["LEVELS", "RunConfig", "RunRefused", "RunResult", "ScriptError", "run_script"]

_LOG = logging.getLogger("ampkit")

#: Levels ``ampkit run`` applies; ``fp32`` only observes (the ``--compare`` reference).
LEVELS = ("fp32", "O1", "O2", "O2K")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class RunRefused(AmpError):
    """``ampkit run`` cannot apply the requested precision exactly to this script (e.g.
    fp16 loss scaling for a manual ``p.data`` update): the run stops, one line, exit 2."""


class ScriptError(AmpError):
    """The script cannot be run (no such file, not a file): one line, exit 2."""


class _Refusal(BaseException):
    """Carries a :class:`RunRefused` out of the script (a BaseException, so a script's
    ``except Exception`` around its loop cannot swallow it)."""

    def __init__(self, error: RunRefused) -> None:
        super().__init__(str(error))
        self.error = error


class _StopScript(BaseException):
    """Raised after the step that reaches ``max_steps`` or the time budget: ends the
    script cleanly (a BaseException, so the script's ``except Exception`` lets it pass)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What :func:`run_script` applies.

    Attributes:
        level: ``"O1"`` (default; casting inside module forwards, fp32 weights),
            ``"O2"`` (16-bit models with fp32 masters), ``"O2K"`` (bf16 models with
            compensated updates) or ``"fp32"`` (nothing applied, observation only).
        dtype: ``"bf16"`` (default) or ``"fp16"``; O2K is bf16 only.
        max_steps: end the script after this many iterations (None: run it whole).
        time_budget: end the script at the first iteration after this many seconds.
    """

    level: str = "O1"
    dtype: str = "bf16"
    max_steps: int | None = None
    time_budget: float | None = None

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise AmpError(f"unknown level {self.level!r}; choose one of {', '.join(LEVELS)}.")
        if self.dtype not in _DTYPES:
            raise AmpError(f"unknown dtype {self.dtype!r}; choose bf16 or fp16.")
        if self.level == "O2K" and self.dtype != "bf16":
            raise AmpError("O2K keeps bf16 weights with compensated updates: it is bf16 only; use --dtype bf16 or O2.")
        if self.max_steps is not None and self.max_steps < 1:
            raise AmpError(f"max_steps must be at least 1, got {self.max_steps}.")
        if self.time_budget is not None and not self.time_budget > 0:
            raise AmpError(f"time_budget must be a positive number of seconds, got {self.time_budget}.")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclasses.dataclass
class RunResult:
    """What :func:`run_script` returns: the script's exit code and the run's report
    (a JSON-ready dict: level, dtype, optimizers with steps/skipped/scale, iterations
    and their times, loss series by ``backward()`` call site, notes)."""

    code: int
    report: dict[str, Any]

    def summary(self) -> str:
        """The exit summary, a few plain lines for stderr."""
        return format_summary(self.report)


# ---------------------------------------------------------------------------------
# Where in the script
# ---------------------------------------------------------------------------------
def _user_site() -> str:
    """``file:line`` of the first frame outside ampkit, torch and contextlib (the
    script's line that called into them)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(SKIPPED_PATHS):
        frame = frame.f_back
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


# ---------------------------------------------------------------------------------
# Casting inside module forwards
# ---------------------------------------------------------------------------------
_FETCH_FILE = str(Path(torch.utils.data.__file__).parent / "_utils" / "fetch.py")
_DATASET_METHODS = ("__getitem__", "__getitems__", "__iter__")


def _data_loading() -> bool:
    """Whether this call is part of loading data: in a DataLoader worker process, in a
    batch fetch of a DataLoader (``Dataset.__getitem__``/``__getitems__``, an
    IterableDataset's iterator, ``collate_fn``), or in a ``torch.utils.data.Dataset``'s
    ``__getitem__``/``__getitems__``/``__iter__`` the script calls itself. A walk of
    the calling frames, made only for a call that would otherwise be a model call."""
    if torch.utils.data.get_worker_info() is not None:
        return True
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _FETCH_FILE:
            return True
        if code.co_name in _DATASET_METHODS and isinstance(frame.f_locals.get("self"), torch.utils.data.Dataset):
            return True
        frame = frame.f_back
    return False


def _is_model(module: nn.Module) -> bool:
    """A module with parameters (its own or its submodules'): a model, trained or
    frozen. Data transforms (torchvision's GaussianBlur, Normalize), loss modules and
    other parameter-free modules are not models."""
    return next(module.parameters(), None) is not None


class _ForwardScope:
    """Global forward pre-hook / forward hook pair: a *model call* opens an
    :class:`ampkit.autocast` scope, its return closes it.

    A model call is the outermost call, on its thread, of a module with parameters
    (:func:`_is_model`) made outside data loading (:func:`_data_loading`). A call of a
    module without parameters is none: it runs as written, and a module with
    parameters that it calls is the model call. Calls inside a model call belong to it.
    Each model call is counted in one of: ``scopes_opened`` (ampkit cast it),
    ``in_script_autocast`` (inside the script's own enabled ``torch.autocast``: its
    choice stands), ``kept_fp32`` (inside the script's ``torch.autocast(enabled=False)``)
    or ``own_scope`` (a model O2/O2K cast, with its op-level scope). ``left_alone``
    counts the outermost calls of other modules (no parameters, or data loading: in
    this process; DataLoader worker processes count their own)."""

    def __init__(self, dtype: torch.dtype) -> None:
        from ampkit.casting.policy import default_policy

        self._dtype = dtype
        self._policies: dict[str, Any] = {}
        self._default_policy = default_policy
        self._local = threading.local()
        self._handles: list[Any] = []
        self._autocast_methods: tuple[Any, Any] | None = None
        self.model_calls = 0
        self.scopes_opened = 0
        self.in_script_autocast = 0
        self.own_scope = 0
        self.left_alone = 0
        self.kept_fp32 = 0
        self.kept_fp32_site: str | None = None
        # models called (grad enabled) since the last backward: their graph may still
        # be waiting for it
        self.pending: dict[int, weakref.ref] = {}

    def install(self) -> None:
        reg = nn.modules.module
        self._handles = [
            reg.register_module_forward_pre_hook(self._pre),
            reg.register_module_forward_hook(self._post, always_call=True),
        ]
        _hooks.hold()
        cls = torch.amp.autocast_mode.autocast
        self._autocast_methods = (cls.__enter__, cls.__exit__)
        cls.__enter__, cls.__exit__ = self._counting(*self._autocast_methods)  # type: ignore[method-assign]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._autocast_methods is not None:
            cls = torch.amp.autocast_mode.autocast
            cls.__enter__, cls.__exit__ = self._autocast_methods  # type: ignore[method-assign]
            self._autocast_methods = None
            _hooks.release()
        stack = getattr(self._local, "stack", None)
        while stack:  # a forward interrupted without its hook (never expected)
            _, scope, _ = stack.pop()
            if scope is not None:
                scope.__exit__(None, None, None)

    def _scope(self, module: nn.Module) -> Any:
        """The scope to open for a model call of ``module`` (None: none), counted."""
        from ampkit.casting.engine import autocast

        if _has_own_scope(module):
            self.own_scope += 1
            return None
        device_type = next(module.parameters()).device.type
        if device_type not in ("cpu", "cuda"):
            return None
        scope = self._policies.get(device_type)
        if scope is None:
            policy = self._default_policy(device_type, self._dtype)
            scope = self._policies[device_type] = autocast(policy, device_type=device_type)
        if torch.is_autocast_enabled(device_type):
            self.in_script_autocast += 1
            return None  # the script's own torch.autocast region: its choice stands
        if self._script_disabled(device_type):  # torch.autocast(enabled=False): it stands too
            self.kept_fp32 += 1
            if self.kept_fp32_site is None:
                self.kept_fp32_site = _user_site()
            return None
        self.scopes_opened += 1
        return scope

    def _script_disabled(self, device_type: str) -> bool:
        """Whether the script itself entered ``torch.autocast(device_type, enabled=False)``
        and is still inside it on this thread."""
        return getattr(self._local, "disabled", {}).get(device_type, 0) > 0

    def _counting(self, enter: Callable[..., Any], exit_: Callable[..., Any]) -> tuple[Callable[..., Any], ...]:
        """``torch.autocast`` enter/exit that count the disabled regions the script
        enters itself (not torch's own, such as a checkpoint's recomputation, nor
        ampkit's): per thread and device type."""
        local = self._local

        @functools.wraps(enter)
        def counted_enter(region: Any) -> Any:
            result = enter(region)
            if not region._enabled and not torch.compiler.is_dynamo_compiling() and _entered_by_script():
                counts = local.__dict__.setdefault("disabled", {})
                counts[region.device] = counts.get(region.device, 0) + 1
                region.__dict__["_ampkit_counted"] = region.__dict__.get("_ampkit_counted", 0) + 1
            return result

        @functools.wraps(exit_)
        def counted_exit(region: Any, *exc: Any) -> Any:
            if region.__dict__.get("_ampkit_counted"):
                region.__dict__["_ampkit_counted"] -= 1
                counts = local.__dict__.get("disabled", {})
                counts[region.device] = max(0, counts.get(region.device, 0) - 1)
            return exit_(region, *exc)

        return counted_enter, counted_exit

    def _pre(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            return
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        if stack and stack[-1][2]:
            stack.append((module, None, True))
            return
        model_call = _is_model(module) and not _data_loading()
        if not model_call and not stack:
            self.left_alone += 1
        # on the stack before the scope opens: module calls made while it opens (a
        # probe of the engine's) are inside this call, not model calls of their own
        stack.append((module, None, model_call))
        if model_call:
            self.model_calls += 1
            if torch.is_grad_enabled():
                self.pending[id(module)] = weakref.ref(module)
            scope = self._scope(module)
            if scope is not None:
                scope.__enter__()
                stack[-1] = (module, scope, True)

    def _post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return None
        stack = getattr(self._local, "stack", None)
        if stack and stack[-1][0] is module:
            _, scope, _ = stack.pop()
            if scope is not None:
                scope.__exit__(None, None, None)
                # what the script does with the outputs (loss, metrics, sampling) runs
                # outside the forward pass: in fp32, as it was written
                return cast_tensors(output, torch.float32, only=(self._dtype,))
        return None


_AUTOCAST_FILES = tuple(
    str(Path(torch.__file__).resolve().parent / sub / "autocast_mode.py") for sub in ("amp", "cpu/amp", "cuda/amp")
)


def _entered_by_script() -> bool:
    """Whether the ``torch.autocast`` being entered was entered by the script's own
    code (its ``with``, or a decorator on its function), not by torch or ampkit."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _AUTOCAST_FILES:
        frame = frame.f_back  # torch.cpu.amp.autocast / the decorator form
    return frame is not None and not frame.f_code.co_filename.startswith(SKIPPED_PATHS)


def _has_own_scope(module: nn.Module) -> bool:
    """A model cast by O2/O2K opens its own op-level scope (ampkit.model), and so does a
    submodule of it entered directly (its entry point's EntryCasts)."""
    return any(
        isinstance(h, OpCastingEnter) or isinstance(h, EntryCasts) and h.device_type is not None
        for h in module._forward_pre_hooks.values()
    )


# ---------------------------------------------------------------------------------
# LR schedulers held on skipped steps
# ---------------------------------------------------------------------------------
class _SchedulerHold:
    """For the run, ``step()`` of torch's LR schedulers (the base class and the
    subclasses with a ``step`` of their own; not ReduceLROnPlateau, which follows a
    metric) does nothing while the scheduler's optimizer is managed and its last step
    was skipped: the script's ``sched.step()`` after a skipped step leaves the schedule
    where the parameters are. Class attributes, restored at exit (nothing is stored on
    the schedulers: their ``state_dict()`` is their ``__dict__``)."""

    def __init__(self) -> None:
        self._saved: list[tuple[type, Any]] = []
        self.held = 0

    def install(self) -> None:
        lr = torch.optim.lr_scheduler
        classes = [lr.LRScheduler] + [
            c for c in vars(lr).values()
            if isinstance(c, type) and issubclass(c, lr.LRScheduler) and c is not lr.LRScheduler
            and not issubclass(c, lr.ReduceLROnPlateau) and "step" in c.__dict__
        ]
        for cls in classes:
            orig = cls.__dict__["step"]
            self._saved.append((cls, orig))
            cls.step = self._held(orig)  # type: ignore[method-assign]

    def remove(self) -> None:
        while self._saved:
            cls, orig = self._saved.pop()
            cls.step = orig  # type: ignore[method-assign]

    def _held(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        from ampkit.trainer.managed import last_skipped

        hold = self

        @functools.wraps(orig)
        def step(sched: Any, *args: Any, **kwargs: Any) -> Any:
            opt = getattr(sched, "optimizer", None)
            if opt is not None and last_skipped(opt) and "_ampkit_managed" in opt.__dict__:
                hold.held += 1
                return None
            return orig(sched, *args, **kwargs)

        return step


# ---------------------------------------------------------------------------------
# Finding the models an optimizer trains (O2/O2K)
# ---------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------
@dataclasses.dataclass
class _OptRecord:
    ref: weakref.ref
    index: int
    kind: str
    site: str
    level: str  # what ampkit applied: "O1", "O2", "O2K", "fp32" (left alone), "superseded"
    steps: int = 0
    skipped: int = 0
    scale: float | None = None
    born: int = 0  # the run's event count (builds and steps) when it was built
    last_step: int = -1  # ... at its last step
    backwards_at_step: int = -1  # the run's backward() count at its last step
    repeated: int = 0  # steps taken with no backward() since its previous step
    repeated_site: str | None = None  # the first of them


class _Runner:
    """The pieces :func:`run_script` installs, their bookkeeping and their removal."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.dtype = config.torch_dtype
        self.apply = config.level != "fp32"
        self.notes: list[str] = []
        self.optimizers: list[_OptRecord] = []
        self.series: dict[str, list[float]] = {}
        self._pending_losses: list[tuple[str, torch.Tensor]] = []
        self.iter_times: list[float] = []
        self._last_iter: float | None = None
        self.start = time.perf_counter()
        self.iterations = 0
        self.backwards = 0
        self.scaled_backwards = 0
        self.script_scales: bool | None = None  # an enabled GradScaler of the script's
        self.level_applied = config.level
        self._scaler: Any = None
        self._o2_models: list[nn.Module] = []
        self._in_backward = threading.local()
        self._forward = _ForwardScope(self.dtype) if self.apply else None
        self._schedulers = _SchedulerHold() if self.apply else None
        self._orig_opt_init: Callable[..., None] | None = None
        self._orig_backward: Callable[..., Any] | None = None
        self._orig_unscale: Callable[..., None] | None = None
        self._orig_scaler_step: Callable[..., Any] | None = None
        self._step_handle: Any = None
        self._pre_handle: Any = None
        self._step_started: float | None = None
        self.step_seconds = 0.0
        self.stopped_early: str | None = None
        self._events = 0
        self._managing = False
        self._scalers: list[weakref.ref] = []
        self._before: list[weakref.ref] = []  # GradScalers alive before the script ran

    # --- install / remove ------------------------------------------------------------
    def install(self) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        runner = self
        self._before = [weakref.ref(s) for s in _grad_scalers()]
        orig_init = torch.optim.Optimizer.__init__
        self._orig_opt_init = orig_init

        @functools.wraps(orig_init)
        def optimizer_init(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            orig_init(opt, *args, **kwargs)
            runner._on_optimizer(opt)

        orig_backward = torch.autograd.backward
        self._orig_backward = orig_backward

        @functools.wraps(orig_backward)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            return runner._on_backward(orig_backward, tensors, args, kwargs)

        # A script's torch.amp.GradScaler unscales the masters' grads (O2) with a kernel
        # that leaves version counters alone: ampkit is told, so the model shows them too.
        orig_unscale = torch.amp.GradScaler.unscale_
        self._orig_unscale = orig_unscale

        @functools.wraps(orig_unscale)
        def unscale_(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
            with unscaled_in_place(optimizer):
                orig_unscale(scaler, optimizer)

        # ... and a step it skips (optimizer.step() not called) counts as skipped.
        orig_scaler_step = torch.amp.GradScaler.step
        self._orig_scaler_step = orig_scaler_step

        @functools.wraps(orig_scaler_step)
        def scaler_step(scaler: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            with stepped_by_scaler(optimizer):
                return orig_scaler_step(scaler, optimizer, *args, **kwargs)

        torch.optim.Optimizer.__init__ = optimizer_init  # type: ignore[method-assign]
        torch.autograd.backward = backward
        torch.amp.GradScaler.unscale_ = unscale_  # type: ignore[method-assign]
        torch.amp.GradScaler.step = scaler_step  # type: ignore[method-assign]
        self._step_handle = register_optimizer_step_post_hook(self._on_unmanaged_step)
        self._pre_handle = register_optimizer_step_pre_hook(self._before_step)
        if self._forward is not None:
            self._forward.install()
        if self._schedulers is not None:
            self._schedulers.install()

    def remove(self) -> None:
        """Undo everything :meth:`install` and the management did (ampkit.reset)."""
        if self._orig_opt_init is not None:
            torch.optim.Optimizer.__init__ = self._orig_opt_init  # type: ignore[method-assign]
            self._orig_opt_init = None
        if self._orig_backward is not None:
            torch.autograd.backward = self._orig_backward
            self._orig_backward = None
        if self._orig_unscale is not None:
            torch.amp.GradScaler.unscale_ = self._orig_unscale  # type: ignore[method-assign]
            torch.amp.GradScaler.step = self._orig_scaler_step  # type: ignore[method-assign]
            self._orig_unscale = self._orig_scaler_step = None
        for handle in (self._step_handle, self._pre_handle):
            if handle is not None:
                handle.remove()
        self._step_handle = self._pre_handle = None
        if self._forward is not None:
            self._forward.remove()
        if self._schedulers is not None:
            self._schedulers.remove()
        self._collect_stats()
        _reset.reset()  # releases every managed optimizer (their own step() back), casting off

    # --- optimizers ---------------------------------------------------------------------
    def _on_optimizer(self, opt: torch.optim.Optimizer) -> None:
        if self._managing:  # built by ampkit itself while setting up (a kernel probe)
            return
        record = _OptRecord(
            ref=weakref.ref(opt), index=len(self.optimizers) + 1, kind=type(opt).__name__,
            site=_user_site(), level="fp32", born=self._events,
        )
        self._events += 1
        self.optimizers.append(record)
        self._supersede(record)
        if not self.apply:
            return
        self._managing = True
        try:
            self._manage(record)
        except RunRefused as err:
            raise _Refusal(err) from None
        except AmpError as err:
            record.level = "fp32"
            self._note(f"optimizer {record.index} ({record.kind}, {record.site}) is not managed: {err}")
        finally:
            self._managing = False

    def _params(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"]]

    def _live(self) -> list[_OptRecord]:
        return [r for r in self.optimizers if r.ref() is not None and r.level in ("O1", "O2", "O2K")]

    def _supersede(self, new: _OptRecord) -> None:
        """Earlier optimizers over the new one's parameters are dropped, managed ones
        released from the trainer (the script built a new optimizer for the same model:
        a new phase, or per epoch); the new one marks the iterations in their place."""
        new_ids = {id(p) for p in self._params(new.ref())}
        for rec in self.optimizers:
            opt = rec.ref()
            if rec is new or opt is None or rec.level == "superseded":
                continue
            if any(id(p) in new_ids for p in self._model_params(opt)):
                self._fold_stats(rec)
                rec.level = "superseded"

    def _model_params(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        from ampkit.levels.setup import master_weights_of

        mw = master_weights_of(opt)
        if mw is not None:
            return list(mw.backward_params())
        return self._params(opt)

    def _manage(self, record: _OptRecord) -> None:
        opt = record.ref()
        low = [p for p in self._params(opt) if p.is_floating_point() and p.dtype != torch.float32]
        if low and self._o2_models:
            raise RunRefused(
                f"the optimizer built at {record.site} steps {len(low)} 16-bit tensor(s): the weights "
                f"of a model {self.config.level} cast for an earlier optimizer, whose fp32 masters it "
                "cannot rebuild from them. Run with --level O1."
            )
        if self.level_applied in ("O2", "O2K"):
            why = self._setup_cast(record)
            if why is None:
                return
            self._note(
                f"{self.config.level} not applied: the optimizer built at {record.site} "
                f"({record.kind}) {why}; falling back to O1 for it (casting in forward passes, "
                "fp32 weights)"
            )
            record.level = "O1"
            if self._o2_models:  # earlier optimizers stay as they are; this one on its own
                self._manage_alone(record)
                return
            self.level_applied = "O1"
        record.level = "O1"
        self._setup_o1()

    def _manage_alone(self, record: _OptRecord) -> None:
        from ampkit.scaling.loss_scaler import LossScaler
        from ampkit.trainer.api import init_trainer

        opt = record.ref()
        scaler = LossScaler() if self.dtype == torch.float16 else LossScaler(init_scale=1.0, dynamic=False)
        init_trainer(opt, scaler=scaler)
        self._restore({}, [opt])

    def _carry(self) -> dict[int, tuple[int, int, bool]]:
        from ampkit.trainer.api import managed_state

        out = {}
        for rec in self._live():
            opt = rec.ref()
            try:
                st = managed_state(opt)
            except AmpError:
                continue
            out[id(opt)] = (st.steps, st.skipped, st.last_skipped)
        return out

    def _release_all(self) -> None:
        from ampkit.trainer.api import managed_state, release

        for rec in self.optimizers:
            opt = rec.ref()
            if opt is None:
                continue
            try:
                managed_state(opt)
            except AmpError:
                continue
            release(opt)

    def _restore(self, carried: dict[int, tuple[int, int, bool]], opts: list[torch.optim.Optimizer]) -> None:
        from ampkit.trainer.api import managed_state

        for opt in opts:
            st = managed_state(opt)
            if id(opt) in carried:
                st.steps, st.skipped, st.last_skipped = carried[id(opt)]
            st.post_step_hooks.append(functools.partial(self._on_step, weakref.ref(opt), False))
            st.skip_hooks.append(functools.partial(self._on_step, weakref.ref(opt), True))

    def _setup_o1(self) -> None:
        """One ``init_trainer`` over every live managed optimizer (one shared scaler)."""
        from ampkit.scaling.loss_scaler import LossScaler
        from ampkit.trainer.api import init_trainer

        carried = self._carry()
        self._release_all()
        opts = [r.ref() for r in self._live()]
        if self._scaler is None:
            self._scaler = LossScaler() if self.dtype == torch.float16 else LossScaler(init_scale=1.0, dynamic=False)
        init_trainer(opts, scaler=self._scaler)
        self._restore(carried, opts)

    def _setup_cast(self, record: _OptRecord) -> str | None:
        """O2/O2K for every live managed optimizer and the models that own their
        parameters (one ``initialize``); returns why not, changing nothing, or None."""
        from ampkit.levels.setup import initialize

        records = self._live()
        record.level = self.level_applied
        records = [*records, record] if record not in records else records
        opts = [r.ref() for r in records]
        params = [p for opt in opts for p in self._model_params(opt)]
        models, why = _models_of(params)
        if why is not None:
            record.level = "fp32"
            return why.format(level=self.config.level)
        stepped = {id(p) for p in params}
        if self._forward is not None and any(
            id(p) in stepped for ref in self._forward.pending.values() if ref() is not None for p in ref().parameters()
        ):
            record.level = "fp32"
            return (
                "comes after a forward pass of its model whose backward() has not run yet: that graph "
                f"holds the fp32 weights {self.config.level} would cast to 16 bits"
            )
        for model in models:
            trainable = [p for p in model.parameters() if p.requires_grad]
            extra = [p for p in trainable if id(p) not in stepped]
            if extra:
                record.level = "fp32"
                return (
                    f"steps {len(trainable) - len(extra)} of the {len(trainable)} trainable parameter "
                    f"tensors of {type(model).__name__}; {self.config.level} would cast the others to "
                    "16 bits without fp32 masters"
                )
        carried = self._carry()
        overrides: dict[str, Any] = {"dtype": self.dtype}
        try:
            initialize(models, opts, opt_level=self.config.level, **overrides)
        except AmpError as err:
            record.level = "fp32"
            return f"cannot be set up ({err})"
        self._o2_models = models
        self._restore(carried, opts)
        return None

    def _fold_stats(self, rec: _OptRecord) -> None:
        from ampkit.trainer.api import managed_state

        opt = rec.ref()
        if opt is None:
            return
        try:
            st = managed_state(opt)
        except AmpError:
            return
        rec.steps, rec.skipped = st.steps, st.skipped
        rec.scale = st.scalers[0].scale if st.scalers else None

    def _collect_stats(self) -> None:
        for rec in self.optimizers:
            if rec.level in ("O1", "O2", "O2K"):
                self._fold_stats(rec)

    # --- steps and iterations ----------------------------------------------------------
    def _before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step pre-hook (the optimizer's own update, taken steps only)."""
        self._step_started = time.perf_counter()

    def _on_unmanaged_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step post-hook: the time of the update; and the steps of
        optimizers ampkit does not manage (the fp32 run; managed ones report through
        their own hooks)."""
        if self._step_started is not None:
            self.step_seconds += time.perf_counter() - self._step_started
            self._step_started = None
        for rec in self.optimizers:
            if rec.ref() is opt:
                if rec.level in ("O1", "O2", "O2K"):
                    return
                rec.steps += 1
                self._stepped(rec)
                return

    def _on_step(self, ref: weakref.ref, skipped: bool) -> None:
        rec = next((r for r in self.optimizers if r.ref() is ref()), None)
        if rec is not None:
            self._stepped(rec)

    def _stepped(self, rec: _OptRecord) -> None:
        """A step (taken or skipped) of ``rec``'s optimizer. The iterations are the
        steps of the first-built optimizer still in use: not superseded by a later one
        over its parameters, not gone, and not left behind: an optimizer built after
        its last step now steps (a model and optimizer rebuilt from a checkpoint). One
        that has not stepped yet keeps its place (a GAN's generator, stepped after
        several critic steps)."""
        in_use = [r for r in self.optimizers if r.level != "superseded" and r.ref() is not None]
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
        self.backwards += 1
        if self._forward is not None:
            self._forward.pending.clear()
        site = _user_site()
        if self.script_scales is None:  # an enabled GradScaler the script built: it scales itself
            self._scalers = [
                weakref.ref(s) for s in _grad_scalers() if s.is_enabled() and not any(r() is s for r in self._before)
            ]
            self.script_scales = bool(self._scalers)
            if self.script_scales and self.apply and self.dtype == torch.float16:
                self._note("the script scales its loss itself (an enabled GradScaler): ampkit does not scale it again")
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1 and tensors.is_floating_point():
            self._record_loss(site, tensors)
        if not self.apply or self.dtype != torch.float16:
            return self._plain(orig, tensors, args, kwargs)
        return self._scaled_backward(orig, tensors, args, kwargs, site)

    def _record_loss(self, site: str, loss: torch.Tensor) -> None:
        value = loss.detach().reshape(())
        scaler = self._scalers[0]() if self._scalers else None
        if scaler is not None and scaler.is_enabled():  # the script's GradScaler scaled it
            value = value.float() / scaler.get_scale()
        self._pending_losses.append((site, value))
        if len(self._pending_losses) >= 64:
            self._flush_losses()

    def _flush_losses(self) -> None:
        pending, self._pending_losses = self._pending_losses, []
        if not pending:
            return
        values = torch.stack([t.float().cpu() for _, t in pending]).tolist()
        for (site, _), v in zip(pending, values):
            self.series.setdefault(site, []).append(float(v))

    def _scaled_backward(
        self, orig: Callable[..., Any], tensors: Any, args: tuple, kwargs: dict, site: str
    ) -> Any:
        from ampkit.trainer.api import managed_state, scale_loss

        if self.script_scales:
            return self._plain(orig, tensors, args, kwargs)
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        owners = self._param_owners()
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
        if not self.optimizers:  # no optimizer (yet): each backward is an iteration
            self._iteration()

    def _param_owners(self) -> dict[int, torch.optim.Optimizer]:
        owners: dict[int, torch.optim.Optimizer] = {}
        for rec in self._live():
            opt = rec.ref()
            for p in self._model_params(opt):
                owners[id(p)] = opt
        return owners

    # --- notes and the report ------------------------------------------------------------
    def _note(self, message: str) -> None:
        self.notes.append(message)
        if is_rank_zero():
            _LOG.warning("ampkit run: %s", message)

    def _forward_counts(self) -> dict[str, Any]:
        """The report's module-call counts (see :class:`_ForwardScope`); None where the
        fp32 level installed no module hooks."""
        fwd = self._forward
        return {
            "model_calls": fwd.model_calls if fwd is not None else None,
            "forward_scopes": fwd.scopes_opened if fwd is not None else 0,
            "forward_calls_in_script_autocast": fwd.in_script_autocast if fwd is not None else 0,
            "forward_calls_kept_fp32": fwd.kept_fp32 if fwd is not None else 0,
            "forward_calls_cast_model": fwd.own_scope if fwd is not None else 0,
            "module_calls_left_alone": fwd.left_alone if fwd is not None else None,
        }

    def _repeated_step_notes(self) -> None:
        for r in self.optimizers:
            if r.repeated:
                self.notes.append(
                    f"optimizer {r.index} ({r.kind}) stepped {r.repeated} time(s) with no backward() since "
                    f"its previous step (the first at {r.repeated_site}): each such step applies the same "
                    "gradients again; they count in its steps, not in the iterations"
                )

    def report(self, code: int, script: str, args: list[str], wall: float) -> dict[str, Any]:
        self._flush_losses()
        self._repeated_step_notes()
        if self._forward is not None and self._forward.kept_fp32:
            self.notes.append(
                f"{self._forward.kept_fp32} module call(s) ran inside the script's own "
                f"torch.autocast(enabled=False) (the first at {self._forward.kept_fp32_site}): kept in "
                "fp32 as written (if that is the script's own AMP switch, switch it on instead)"
            )
        times = self.iter_times
        if self.level_applied in ("O2", "O2K") and not any(r.level == self.level_applied for r in self.optimizers):
            self.level_applied = "O1"  # no optimizer: casting in forward passes only
        return {
            "script": script,
            "args": args,
            "exit_code": code,
            "level": self.config.level,
            "level_applied": self.level_applied,
            "dtype": self.config.dtype if self.config.level != "fp32" else "fp32",
            "wall_seconds": wall,
            "stopped_early": self.stopped_early,
            "iterations": self.iterations,
            "iteration_ms_median": statistics.median(times) * 1e3 if times else None,
            "iteration_seconds_total": sum(times),
            "optimizer_step_seconds": self.step_seconds,
            "backward_calls": self.backwards,
            "scaled_backward_calls": self.scaled_backwards,
            **self._forward_counts(),
            "script_grad_scaler": bool(self.script_scales),
            "scheduler_steps_held": self._schedulers.held if self._schedulers is not None else 0,
            "optimizers": [
                {
                    "index": r.index, "type": r.kind, "created_at": r.site, "managed": r.level,
                    "steps": r.steps, "skipped": r.skipped,
                    "loss_scale": None if self.script_scales else r.scale,
                }
                for r in self.optimizers
            ],
            "losses": self.series,
            "notes": self.notes,
        }


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


# ---------------------------------------------------------------------------------
# Running the script
# ---------------------------------------------------------------------------------
def run_script(path: str | Path, args: list[str] | None = None, config: RunConfig | None = None) -> RunResult:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]`` under ``config``
    (default :class:`RunConfig`: O1 bf16). Returns the script's exit code (0, its
    ``sys.exit`` code, 1 after an uncaught exception, whose traceback is printed on
    stderr, 130 on Ctrl-C) and the report.

    Raises :class:`ScriptError` for a path that is no file, and :class:`RunRefused`
    when the precision cannot be applied exactly (raised where the script reached
    that point; the run is undone first). ``sys.argv``, ``sys.path[0]``, the wrapped
    torch functions, the global hooks and every ampkit setup (``ampkit.reset``) are
    restored when the script ends, however it ends."""
    config = config or RunConfig()
    args = list(args or [])
    script = check_script(path, ScriptError)
    runner = _Runner(config)
    code = 0
    refused: RunRefused | None = None
    start = time.perf_counter()
    try:
        runner.install()
        with script_argv(script, args):
            runpy.run_path(str(script), run_name="__main__")
    except _StopScript:
        code = 0
    except _Refusal as stop:
        refused = stop.error
    except RunRefused as err:
        refused = err
    except SystemExit as exc:
        code = exit_code(exc.code)
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:  # the script failed: show it as Python would
        _print_script_traceback(exc, str(script))
        code = 1
    finally:
        runner.remove()
    if refused is not None:
        raise refused
    wall = time.perf_counter() - start
    return RunResult(code, runner.report(code, str(script), args, wall))


def _print_script_traceback(exc: BaseException, script: str) -> None:
    """The traceback from the script's own frame on (not ampkit's and runpy's frames
    that ran it), as ``python script.py`` prints it."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb if tb is not None else exc.__traceback__)


# ---------------------------------------------------------------------------------
# The exit summary
# ---------------------------------------------------------------------------------
def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def format_summary(report: dict[str, Any]) -> str:
    """Plain lines: level and dtype, steps and skips per optimizer, loss scale,
    iteration time, first/last loss per backward() call site, notes."""
    level = report["level_applied"]
    if level != report["level"]:
        level = f"{level} (asked {report['level']})"
    head = f"ampkit run: {level} {report['dtype']}, exit code {report['exit_code']}, {report['wall_seconds']:.1f} s"
    if report["stopped_early"]:
        head += f" (stopped: {report['stopped_early']})"
    lines = [head]
    for o in report["optimizers"]:
        scale = "" if o["loss_scale"] is None else f", loss scale {o['loss_scale']:g}"
        lines.append(
            f"  optimizer {o['index']} {o['type']} ({o['created_at']}): {o['managed']}, "
            f"{o['steps']} steps, {o['skipped']} skipped{scale}"
        )
    if not report["optimizers"]:
        lines.append("  no torch.optim optimizer: casting in forward passes only")
    if report["model_calls"] is not None:
        other = [
            (report["forward_calls_in_script_autocast"], "under the script's own torch.autocast"),
            (report["forward_calls_kept_fp32"], "kept fp32 by the script's torch.autocast(enabled=False)"),
            (report["forward_calls_cast_model"], "in the 16-bit model's own casting"),
        ]
        also = "".join(f", {n} {where}" for n, where in other if n)
        lines.append(
            f"  {report['model_calls']} model calls, {report['forward_scopes']} cast by ampkit{also}; "
            f"{report['module_calls_left_alone']} other module calls (no parameters, or data loading) left as written"
        )
    if report["iteration_ms_median"] is not None:
        lines.append(
            f"  {report['iterations']} iterations, median {report['iteration_ms_median']:.2f} ms, "
            f"{report['iteration_seconds_total']:.2f} s in iterations, "
            f"{report['optimizer_step_seconds']:.2f} s in optimizer updates"
        )
    for site, values in report["losses"].items():
        lines.append(f"  loss at {site}: {len(values)} values, first {_fmt(values[0])}, last {_fmt(values[-1])}")
    if report["scheduler_steps_held"]:
        lines.append(f"  {report['scheduler_steps_held']} LR scheduler step(s) held after skipped steps")
    if report["script_grad_scaler"]:
        lines.append("  the script's GradScaler scales the loss (ampkit does not)")
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def write_report(report: dict[str, Any], path: str | Path) -> None:
    """Write a :class:`RunResult` report as JSON."""
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def is_rank_zero() -> bool:
    """Rank 0 of a torchrun launch, or no launch at all (the summary is printed once)."""
    return os.environ.get("RANK", "0") == "0"
