"""The doctor's cheap, always-on recording: global module hooks and gradient hooks.

While a doctor is on, every module call (global forward pre/post hooks) records the
abs-max of its floating outputs, and every floating tensor that crosses a module
boundary and requires grad gets a tensor hook recording the abs-max and the count of
underflowing elements of its gradient; every parameter gets one too. Nothing is read
back on the host until the step ends: each record is a 0-dim/1-dim tensor, and the
step's records are stacked and read in one sync (:meth:`StepLog.resolve`).

Names are qualified names relative to the outermost module called (the model as the
user built it: ``nn.DataParallel``/DDP/``torch.compile`` wrappers are looked through,
as the casting engine's name rules do), so they paste into ``Policy.module_rules``.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ampkit._internal import torch_compat
from ampkit._internal.dtypes import LOW_PRECISION
from ampkit._internal.torch_compat import tree_flatten
from ampkit.casting.engine import model_name, unwrap_module

if TYPE_CHECKING:
    from ._checker import OpChecker

_MAX_TENSORS = 4  # floating tensors recorded per module input/output structure
MAX_RECORDS = 200_000  # module records kept between two steps


def abs_max(t: torch.Tensor) -> torch.Tensor:
    """``t.abs().amax()`` as fp32, in one pass without a temporary (inf/NaN propagate)."""
    lo, hi = torch.aminmax(t.detach())
    return torch.maximum(hi.float(), lo.float().neg())


def _floats(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    out = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0]
    return out[:_MAX_TENSORS]


@dataclasses.dataclass(eq=False)
class Tap:
    """A tensor that crossed module boundaries this step (hooked once): the modules
    that returned it, the modules that took it as input, and ``owner``: the module
    whose own ``forward`` code received it from its outermost producer (None when
    that producer is the model itself: the tensor is the model's output). Its grad
    comes from a consumer's backward, or else from the owner's own code."""

    producers: list[str]
    consumers: list[str]
    dtype: torch.dtype
    owner: str | None = None


@dataclasses.dataclass
class StepLog:
    """What the hooks recorded since the last step boundary (tensors, not yet read)."""

    seq: int = 0
    # (seq, module, dtype, amax tensor)
    acts: list[tuple[int, str, torch.dtype, torch.Tensor]] = dataclasses.field(default_factory=list)
    # module inputs no module returned this step: (seq, module, parent module or None, dtype, amax)
    inputs: list[tuple[int, str, str | None, torch.dtype, torch.Tensor]] = dataclasses.field(
        default_factory=list
    )
    # (seq, tap, dtype, amax tensor)
    grads: list[tuple[int, Tap, torch.dtype, torch.Tensor]] = dataclasses.field(default_factory=list)
    # (seq, param name, module, dtype, numel, [amax, zeros, zero-or-subnormal, sumsq] tensor, graph task)
    params: list[tuple[int, str, str, torch.dtype, int, torch.Tensor, int]] = dataclasses.field(
        default_factory=list
    )
    # modules called this step -> dtype of their first floating output
    module_dtype: dict[str, torch.dtype] = dataclasses.field(default_factory=dict)
    module_type: dict[str, str] = dataclasses.field(default_factory=dict)
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    scaled_losses: int = 0  # loss tensors scaled by scale_loss this step
    scaled_tasks: list[int] = dataclasses.field(default_factory=list)  # backward passes of scaled losses
    # id(param) -> (param ref, grad ref, sumsq tensor) when a scaled backward ended, for
    # grads that still hold the loss scale then
    scaled_grads: dict[int, tuple[Any, Any, torch.Tensor]] = dataclasses.field(default_factory=dict)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    @property
    def full(self) -> bool:
        """Enough forward records for one step (a loop that runs many forwards with grad
        between two steps): stop adding module records until the step."""
        return len(self.acts) + len(self.inputs) > MAX_RECORDS

    @property
    def empty(self) -> bool:
        return not (self.acts or self.inputs or self.grads or self.params or self.losses)

    def resolve(self) -> ResolvedStep:
        """Read every recorded value in one host sync (per device)."""
        tensors: list[torch.Tensor] = []
        for *_, t in self.acts:
            tensors.append(t.reshape(1))
        for *_, t in self.inputs:
            tensors.append(t.reshape(1))
        for *_, t in self.grads:
            tensors.append(t.reshape(1))
        for *_, t, _task in self.params:
            tensors.append(t)
        for t in self.losses:
            tensors.append(t.reshape(1))
        values = _read(tensors)
        it = iter(values)
        acts = [(seq, name, dt, next(it)[0]) for seq, name, dt, _ in self.acts]
        inputs = [(seq, name, parent, dt, next(it)[0]) for seq, name, parent, dt, _ in self.inputs]
        grads = [(seq, tap, dt, next(it)[0]) for seq, tap, dt, _ in self.grads]
        params = [(seq, pn, mn, dt, n, *next(it), task) for seq, pn, mn, dt, n, _, task in self.params]
        losses = [next(it)[0] for _ in self.losses]
        return ResolvedStep(acts, grads, params, losses, dict(self.module_dtype), dict(self.module_type), inputs)


def _read(tensors: list[torch.Tensor]) -> list[list[float]]:
    """``[t.tolist() for t in tensors]`` with one sync per device."""
    if not tensors:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[list[float]] = [[] for _ in tensors]
    for idx in by_device.values():
        parts = [tensors[i].detach().float().reshape(-1) for i in idx]
        flat = torch.cat(parts).tolist()
        pos = 0
        for i, part in zip(idx, parts):
            out[i] = flat[pos : pos + part.numel()]
            pos += part.numel()
    return out


@dataclasses.dataclass
class ResolvedStep:
    """One step's records as host values (see :class:`StepLog`)."""

    acts: list[tuple[int, str, torch.dtype, float]]
    grads: list[tuple[int, Tap, torch.dtype, float]]
    params: list[tuple[int, str, str, torch.dtype, int, float, float, float, float, int]]
    losses: list[float]
    module_dtype: dict[str, torch.dtype]
    module_type: dict[str, str]
    inputs: list[tuple[int, str, str | None, torch.dtype, float]]


class _Local(threading.local):
    def __init__(self) -> None:
        # (module, qualified name, stop set of input grad_fns or None)
        self.stack: list[tuple[nn.Module, str, set[int] | None]] = []


class Recorder:
    """Installs and runs the recording hooks (see the module docstring).

    ``checker``: the op-level checker of a diagnostic step, when one is armed; the
    recorder pushes it when the outermost module of a forward starts, tells it which
    module each autograd node belongs to, and pauses it around its own work."""

    def __init__(self) -> None:
        self.log = StepLog()
        self.checker: OpChecker | None = None
        self.arm_on_forward: Callable[[], None] | None = None
        self._local = _Local()
        self._handles: list[Any] = []
        self._names: weakref.WeakKeyDictionary[nn.Module, dict[int, str]] = weakref.WeakKeyDictionary()
        self._param_hooks: dict[int, tuple[weakref.ref[torch.Tensor], list[Any]]] = {}
        self._param_names: dict[int, str] = {}
        self._taps: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._known: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors already recorded this step
        self._own_hooks: set[int] = set()  # ids of hook functions the recorder registered
        self.on = False
        self.scale: Callable[[], float] = lambda: 1.0

    # --- install / remove ------------------------------------------------------------
    def install(self) -> None:
        if self._handles:
            return
        reg = nn.modules.module
        self._handles = [
            reg.register_module_forward_pre_hook(self._pre),
            reg.register_module_forward_hook(self._post, always_call=True),
        ]
        self.on = True

    def remove(self) -> None:
        self.on = False
        for h in self._handles:
            h.remove()
        self._handles = []
        for _, handles in self._param_hooks.values():
            for h in handles:
                h.remove()
        self._param_hooks.clear()
        self._own_hooks.clear()
        self._local.stack = []

    def take(self) -> StepLog:
        """The records since the last call; starts a new step log."""
        log, self.log = self.log, StepLog()
        self._taps = WeakIdKeyDictionary()
        self._known = WeakIdKeyDictionary()
        return log

    # --- names -----------------------------------------------------------------------
    def name_of(self, module: nn.Module, root: nn.Module) -> str:
        names = self._names.get(root)
        if names is None or id(module) not in names:
            names = {id(m): model_name(n) for n, m in unwrap_module(root).named_modules(remove_duplicate=False)}
            names.setdefault(id(root), "")
            self._names[root] = names
        return names.get(id(module), type(module).__name__)

    def param_name(self, p: torch.Tensor) -> str | None:
        return self._param_names.get(id(p))

    def hooked_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for pid, (ref, _) in list(self._param_hooks.items()):
            p = ref()
            if p is not None:
                yield self._param_names.get(pid, "?"), p

    def user_grad_hooks(self, p: torch.Tensor) -> int:
        """How many gradient hooks (``Tensor.register_hook``) other than the
        recorder's own are on parameter ``p``."""
        hooks = torch_compat.tensor_hooks_of(p)
        return sum(1 for h in hooks.values() if id(h) not in self._own_hooks)

    # --- the hooks ---------------------------------------------------------------------
    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self.on:
            return
        stack = self._local.stack
        root = stack[0][0] if stack else module
        if not stack and self.arm_on_forward is not None and torch.is_grad_enabled():
            self.arm_on_forward()  # a diagnostic step starts with this forward
        checker = self.checker
        with paused(checker):
            name = self.name_of(module, root)
            self._hook_params(module, name)
            stop: set[int] | None = None
            log = self.log
            # forwards without grad (evaluation) are not training steps: not recorded
            grad = torch.is_grad_enabled() and not log.full
            inputs = _floats(args) if grad else []
            parent = stack[-1][1] if stack else None
            for t in inputs:  # tensors no module returned: the batch, or made by a parent's own code
                if t not in self._known:
                    self._known[t] = True
                    log.inputs.append((log.next_seq(), name, parent, t.dtype, abs_max(t)))
            if checker is not None:
                stop = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
            for t in inputs:
                if grad and t.requires_grad:
                    self._tap(t).consumers.append(name)
            stack.append((module, name, stop))
            if checker is not None:
                checker.forward_module = name
                if len(stack) == 1:
                    checker.enter_forward()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.on:
            return
        stack = self._local.stack
        if not stack or stack[-1][0] is not module:
            return
        _, name, stop = stack.pop()
        checker = self.checker
        with paused(checker):
            log = self.log
            outputs = _floats(output) if torch.is_grad_enabled() and not log.full else []
            if outputs:
                log.module_dtype.setdefault(name, outputs[0].dtype)
                log.module_type.setdefault(name, type(module).__name__)
            owner = stack[-1][1] if stack else None  # the module whose code receives the outputs
            for t in outputs:
                self._known[t] = True
                log.acts.append((log.next_seq(), name, t.dtype, abs_max(t)))
                if t.requires_grad:
                    tap = self._tap(t)
                    tap.producers.append(name)
                    tap.owner = owner
            if checker is not None:
                checker.map_nodes([t for t in outputs if t.grad_fn is not None], stop or set(), name)
                checker.forward_module = stack[-1][1] if stack else None
                if not stack:
                    checker.exit_forward()

    def _tap(self, t: torch.Tensor) -> Tap:
        tap = self._taps.get(t)
        if tap is None:
            tap = Tap([], [], t.dtype)
            self._taps[t] = tap
            t.register_hook(self._grad_hook(tap))
        return tap

    def _grad_hook(self, tap: Tap) -> Callable[[torch.Tensor], None]:
        log = self.log

        def hook(grad: torch.Tensor) -> None:
            if not self.on or log is not self.log or grad is None or not grad.is_floating_point():
                return
            with paused(self.checker):
                log.grads.append((log.next_seq(), tap, grad.dtype, abs_max(grad)))

        return hook

    def _hook_params(self, module: nn.Module, module_name: str) -> None:
        for pname, p in torch_compat.own_parameters(module).items():
            if p is None or not p.requires_grad or id(p) in self._param_hooks:
                continue
            full = f"{module_name}.{pname}" if module_name else pname
            grad_hook = self._param_grad_hook(full, module_name)
            self._own_hooks.add(id(grad_hook))
            self._param_hooks[id(p)] = (weakref.ref(p), [p.register_hook(grad_hook)])
            self._param_names[id(p)] = full

    def _param_grad_hook(self, full: str, module_name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            log = self.log
            if not self.on or grad is None or not grad.is_floating_point() or grad.is_sparse:
                return
            with paused(self.checker):
                compute = log.module_dtype.get(module_name, grad.dtype)
                normal = torch.finfo(compute if compute in LOW_PRECISION else grad.dtype).smallest_normal
                g = grad.detach()
                below = (g.abs() < normal).sum()  # zero or subnormal in the compute dtype
                stats = torch.stack([
                    abs_max(g), g.numel() - torch.count_nonzero(g).float(), below.float(),
                    torch.linalg.vector_norm(g, dtype=torch.float32).square(),
                ])
                task = torch_compat.current_graph_task_id()
                log.params.append((log.next_seq(), full, module_name, grad.dtype, grad.numel(), stats, task))

        return hook


class paused:
    """Run the recorder's (and the doctor's) own tensor work unseen by an active op-level
    checker (``None``: no checker, nothing to do)."""

    __slots__ = ("checker", "was")

    def __init__(self, checker: OpChecker | None) -> None:
        self.checker = checker

    def __enter__(self) -> None:
        if self.checker is not None:
            self.was = self.checker.paused
            self.checker.paused = True

    def __exit__(self, *exc: Any) -> None:
        if self.checker is not None:
            self.checker.paused = self.was
