"""The :class:`Doctor`: ties the recording hooks (``_record``), the op-level checker
(``_checker``), the localization of a bad step (``_localize``), the misuse checks
(``_misuse``) and the advice (``_advice``) to the managed optimizers' steps."""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ampkit._internal import registry as _reset
from ampkit._internal import torch_compat
from ampkit._internal.dist import rank_and_world_size
from ampkit._internal.dtypes import LOW_PRECISION, dtype_name, local_tensor
from ampkit._internal.where import user_stacklevel
from ampkit.distributed import core as _distributed
from ampkit.errors import StateError
from ampkit.trainer import api as _optim
from ampkit.trainer import extensions as _extensions

from ._checker import OpChecker
from ._findings import Finding, Misuse, ModuleMargin, StepPoint, limit_of
from ._localize import graph_contains, localize, policy_op_of, underflow_fraction
from ._misuse import MisuseChecks
from ._record import Recorder, ResolvedStep, StepLog, paused
from ._report import DoctorReport

logger = logging.getLogger("ampkit.doctor")

ENV = "AMPKIT_DOCTOR"


class DoctorWarning(UserWarning):
    """A training-loop mistake found by :func:`ampkit.doctor` (see the message)."""


def env_enabled() -> bool:
    """Whether ``AMPKIT_DOCTOR`` asks for the doctor (``1``/``true``/``yes``/``on``;
    :func:`ampkit.trainer.extensions.env_enabled`)."""
    return _extensions.env_enabled(ENV)


class _Watch(_extensions.StepExtension):
    """The doctor on one managed optimizer's steps (a step extension): the misuse checks
    before the grads are checked, the step's analysis once it is taken or skipped."""

    def __init__(self, doctor: Doctor, state: _optim.ManagedOptimizer) -> None:
        self.doctor = doctor
        self.state = state

    def before_check(self) -> None:
        self.doctor._pre_unscale(self.state)

    def after_step(self, skipped: bool) -> None:
        self.doctor._end_step(self.state, skipped)


class _ScaleLossWatch(_extensions.StepExtension):
    """The doctor on every ``scale_loss`` of the process (a global extension)."""

    def __init__(self, doctor: Doctor) -> None:
        self.doctor = doctor

    def on_scale_loss(self, optimizers: Sequence[Any], losses: Sequence[torch.Tensor], loss_id: int, scaled: Any) -> None:
        self.doctor._on_scale_loss(optimizers, losses, loss_id, scaled)


class Doctor:
    """Watches the steps of ampkit-managed optimizers and says where non-finite values
    and underflows come from, how close each module runs to its dtype's limits, what
    to change, and which training-loop mistakes it saw. Create it with
    :func:`ampkit.doctor`; ``ampkit.tools.diagnosis`` says what it costs.

    Args:
        optimizers: managed optimizers to watch (``None``: every optimizer managed in
            the current AMP session when the doctor starts).
        every (int): at least this many steps between two op-level checks. Default: ``50``.
        max_checks (int): op-level checks in all. Default: ``10``.
        underflow_threshold (float): a step whose 16-bit parameter gradients have
            at least this fraction of elements below the smallest subnormal arms an
            op-level underflow check. Default: ``0.5``.
        log (bool): log findings on the ``ampkit.doctor`` logger (rank 0 only). Default: ``True``.
    """

    def __init__(
        self,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        every: int = 50,
        max_checks: int = 10,
        underflow_threshold: float = 0.5,
        log: bool = True,
    ) -> None:
        if optimizers is None:
            opts: list[torch.optim.Optimizer] | None = None
        elif isinstance(optimizers, torch.optim.Optimizer):
            opts = [optimizers]
        elif isinstance(optimizers, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            opts = list(optimizers)
        else:
            raise StateError(
                f"doctor: expected a torch.optim.Optimizer or a list of them, got {type(optimizers).__name__}."
            )
        if opts is not None:
            for opt in opts:
                _optim.managed_state(opt)  # raises StateError for an unmanaged optimizer
        if not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
            raise StateError(f"doctor: every must be an int >= 1, got {every!r}.")
        if not (isinstance(max_checks, int) and not isinstance(max_checks, bool) and max_checks >= 0):
            raise StateError(f"doctor: max_checks must be an int >= 0, got {max_checks!r}.")
        if not (
            isinstance(underflow_threshold, (int, float))
            and not isinstance(underflow_threshold, bool)
            and 0 < underflow_threshold <= 1
        ):
            raise StateError(f"doctor: underflow_threshold must be in (0, 1], got {underflow_threshold!r}.")
        if not isinstance(log, bool):
            raise StateError(f"doctor: log must be True or False, got {log!r}.")
        self._requested = opts
        self.every = every
        self.max_checks = max_checks
        self.underflow_threshold = float(underflow_threshold)
        self.log = bool(log)
        self.recorder = Recorder()
        self._states: list[_optim.ManagedOptimizer] = []
        self._watches: dict[int, _Watch] = {}
        self._scale_loss_watch = _ScaleLossWatch(self)
        self._running = False
        # results
        self.history: list[StepPoint] = []
        self.findings: list[Finding] = []
        self.events: list[Finding] = []
        self.events_total = 0
        self.misuse: list[Misuse] = []
        self.margins: dict[str, ModuleMargin] = {}
        self.compute_dtype: torch.dtype | None = None
        self.checks_run = 0
        self.lrs: list[float] = []
        self._warned: set[str] = set()
        # op-level checking
        self._checker: OpChecker | None = None
        self._armed_reason: str | None = None
        self._check_reason: str | None = None
        self._last_check_step: int | None = None
        self._pending_event: Finding | None = None
        self._ungathered: list[Finding] = []  # op-level findings not yet sent to the other ranks
        # per-step bookkeeping (misuse)
        self._scaled_nodes: list[Any] = []
        self._misuse_checks = MisuseChecks(self.misuse, self.recorder, self._warn_once)

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> Doctor:
        """Install the hooks and attach to the optimizers. Returns self."""
        if self._running:
            return self
        if self._requested is None:
            from ampkit.trainer.session import current_session

            opts = [
                s.optimizer
                for member in current_session().members
                for s in getattr(member, "optimizers", ())
                if getattr(s, "active", False)
            ]
            if not opts:
                raise StateError(
                    "doctor: no optimizer is managed by ampkit yet; call ampkit.init_trainer(opt) "
                    "or ampkit.initialize(...) first, or pass the optimizers: ampkit.doctor(opt)."
                )
        else:
            opts = self._requested
        self.recorder.install()
        _extensions.add_global_extension(self._scale_loss_watch)
        self._running = True
        for opt in opts:
            self.attach(opt)
        return self

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Watch one more managed optimizer (``init_trainer(..., doctor=True)`` calls this)."""
        state = _optim.managed_state(optimizer)
        if any(s is state for s in self._states):
            return
        self._watches[id(state)] = state.add_extension(_Watch(self, state))  # type: ignore[assignment]
        self._states.append(state)
        for group in optimizer.param_groups:
            if "lr" in group and isinstance(group["lr"], (int, float)):
                self.lrs.append(float(group["lr"]))
                break

    def stop(self) -> None:
        """Remove every hook (the report stays readable)."""
        if not self._running:
            return
        self._running = False
        self._stop_checker()
        self.recorder.arm_on_forward = None
        self.recorder.remove()
        _extensions.remove_global_extension(self._scale_loss_watch)
        for state in self._states:
            state.remove_extension(self._watches.pop(id(state)))
        # Whatever the last step recorded (e.g. a loss that never reached a step).
        if not self.recorder.log.empty:
            self.recorder.take()

    @property
    def running(self) -> bool:
        return self._running

    def __enter__(self) -> Doctor:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- the op-level checker ------------------------------------------------------------
    def _arm(self, reason: str, step: int) -> bool:
        """Run the op-level checker on the next forward+backward (rate-limited)."""
        if self._armed_reason is not None or self._checker is not None or not self._running:
            return False
        if self.checks_run >= self.max_checks:
            return False
        if self._last_check_step is not None and step < self._last_check_step + self.every:
            return False
        self._armed_reason = reason
        self.recorder.arm_on_forward = self._begin_check
        return True

    def _begin_check(self) -> None:
        self.recorder.arm_on_forward = None
        self._check_reason, self._armed_reason = self._armed_reason, None
        checker = OpChecker(self.recorder.param_name, track_underflow=True)
        checker.start()
        self._checker = checker
        self.recorder.checker = checker

    def _stop_checker(self) -> OpChecker | None:
        checker = self._checker
        if checker is not None and checker.active:
            checker.stop()
        self.recorder.checker = None
        return checker

    def diagnose(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Finding | None:
        """Run ``fn(*args, **kwargs)`` -- typically the forward and backward of the
        batch that failed -- under the op-level checker now, and return the finding
        (None when every value stayed finite and nothing underflowed). Nothing is
        stepped; the grads ``fn`` produces stay in ``.grad`` (zero them after)."""
        if not self._running:
            raise StateError("doctor.diagnose: the doctor is not running; use it inside `with ampkit.doctor(...)`.")
        if self._checker is not None:
            raise StateError("doctor.diagnose: an op-level check is already running (armed by a skipped step).")
        self._check_reason = "diagnose"
        checker = OpChecker(self.recorder.param_name, track_underflow=True)
        checker.start()
        self._checker = checker
        self.recorder.checker = checker
        try:
            fn(*args, **kwargs)
        finally:
            self._stop_checker()
            self._checker = None
        state = self._states[0] if self._states else None
        step = state.steps if state is not None else 0
        scale = state.scalers[0].scale if state is not None else 1.0
        self.recorder.take()
        return self._conclude(checker, step, scale, "diagnose")

    # --- optimizer hooks -------------------------------------------------------------------
    def _on_scale_loss(self, states: Sequence[Any], losses: Sequence[torch.Tensor], loss_id: int, scaled: Any) -> None:
        if not any(s is t for s in states for t in self._states):
            return
        log = self.recorder.log
        with torch.no_grad():
            for loss in losses:
                log.losses.append(loss.detach().float().sum())
        # the loss scaled twice: a loss whose graph holds the product of an earlier scale_loss
        if self._scaled_nodes:
            found = graph_contains([loss.grad_fn for loss in losses], self._scaled_nodes)
            if found:
                self._misuse_checks.record(
                    "loss_scaled_twice", states[0],
                    "the loss passed to ampkit.scale_loss was already multiplied by a loss scale "
                    "(it is computed from the tensor an earlier scale_loss yielded), so its grads "
                    "carry the scale twice and will overflow or be mis-scaled. Pass the unscaled "
                    "loss to scale_loss and call backward() on what it yields, once.",
                )
        scaled_list = [scaled] if isinstance(scaled, torch.Tensor) else list(scaled)
        log.scaled_losses += len(scaled_list)
        mine = [s for s in states if any(s is t for t in self._states)]
        for t in scaled_list:
            node = t.grad_fn
            if node is not None:
                self._scaled_nodes.append(node)
                node.register_prehook(self._scaled_backward_hook(log, mine))
        del self._scaled_nodes[:-8]

    def _scaled_backward_hook(self, log: StepLog, states: list[Any]) -> Callable[[Any], None]:
        """At the start of a scaled loss's backward: count the pass, and queue the
        snapshot of the grads that still hold the scale when it ends (queued from a
        final callback, so it runs after every callback the pass queues: DDP's and
        FSDP's, which write the grads)."""

        def hook(grad_outputs: Any) -> None:
            log.scaled_tasks.append(torch_compat.current_graph_task_id())
            engine = torch_compat.autograd_engine()
            engine.queue_callback(lambda: engine.queue_callback(lambda: self._snapshot_scaled(log, states)))

        return hook

    def _snapshot_scaled(self, log: StepLog, states: list[Any]) -> None:
        """Remember (grad, squared norm) of every grad that holds the loss scale
        after backward: with ampkit's gradient path, only those it does not hook (FSDP2's
        sharded parameters); without it, all."""
        if not self._running:
            return
        with paused(self._checker), torch.no_grad():  # the doctor's own reads are no ops of the step
            for state in states:
                if state.scalers[0].scale == 1.0:
                    continue
                params = [p for g in state.optimizer.param_groups for p in g["params"]]
                path = getattr(state, "grad_path", None)
                if path is not None:
                    params = path.unhooked(params)
                for p in params:
                    g = p.grad
                    if g is None or g.is_sparse:
                        continue
                    sumsq = local_tensor(g).detach().float().pow(2).sum()
                    log.scaled_grads[id(p)] = (weakref.ref(p), weakref.ref(g), sumsq)

    def _pre_unscale(self, state: _optim.ManagedOptimizer) -> None:
        """Before ampkit first touches this step's grads: end an op-level check, and
        look for grads changed while scaled, masters out of sync, a step without
        scale_loss."""
        checker = self._checker
        if checker is not None and checker.active:
            self._stop_checker()
        log = self.recorder.log
        try:
            self._misuse_checks.check_step(state, log, self.compute_dtype)
        except Exception as err:  # the doctor must never break a training step
            logger.debug("doctor: misuse check failed: %r", err)

    def _end_step(self, state: _optim.ManagedOptimizer, skipped: bool) -> None:
        if not self._running:
            return
        try:
            self._process_step(state, skipped)
        except Exception as err:  # never break a step; say so once
            self._warn_once("internal", f"ampkit.doctor: could not analyse step {state.steps} ({err!r}).")
        self._scaled_nodes.clear()

    # --- step analysis ---------------------------------------------------------------
    def _process_step(self, state: _optim.ManagedOptimizer, skipped: bool) -> None:
        checker = self._stop_checker()
        self._checker = None
        log = self.recorder.take()
        step = state.steps
        scale = float(state.scalers[0].scale)
        opt_index = next(i for i, s in enumerate(self._states) if s is state)
        res = log.resolve()
        loss = None
        finite_losses = [v for v in res.losses if math.isfinite(v)]
        nonfinite_loss = len(finite_losses) != len(res.losses)
        if res.losses:
            loss = res.losses[-1]
        sumsq = [p[8] for p in res.params]
        norm = math.sqrt(sum(sumsq)) / scale if sumsq and all(map(math.isfinite, sumsq)) else None
        self.history.append(StepPoint(opt_index, step, scale, skipped, loss, norm))
        self._update_margins(res, step)
        local = localize(res, step, scale)
        if nonfinite_loss and local is None:  # the loss itself, computed outside any module
            local = Finding(step, scale, "overflow", "module", direction="forward")
        if checker is not None:
            self._conclude(checker, step, scale, self._check_reason or "check")
        if skipped or local is not None:
            self.events_total += 1
            if local is None:
                local = Finding(step, scale, "overflow", "module")
            if skipped:
                self._gather(state, local)
            if local.module is not None and local.module in self.margins:
                self.margins[local.module].overflows += 1
            if len(self.events) < 100:
                self.events.append(local)
            if self.events_total == 1:
                self._log(f"ampkit.doctor: {'skipped ' if skipped else ''}{local.summary()}")
            if self._arm("overflow", step):
                self._pending_event = local
        elif self.compute_dtype is torch.float16:
            under = underflow_fraction(res, torch.float16)
            if under is not None and under >= self.underflow_threshold:
                self._arm("underflow", step)

    def _conclude(self, checker: OpChecker, step: int, scale: float, reason: str) -> Finding | None:
        self.checks_run += 1
        self._last_check_step = step
        finding: Finding | None = None
        origin, entered = checker.origin, checker.entered
        if origin is not None:
            policy_op = policy_op_of(origin.function)
            module_type = self._module_types.get(origin.module or "")
            finding = Finding(
                step=step, scale=scale, kind="overflow", level="op", direction=origin.direction,
                module=origin.module, module_type=module_type, op=origin.op, node=origin.node,
                torch_function=origin.torch_function, policy_op=policy_op, inputs=origin.inputs,
                outputs=origin.outputs, fp32_abs_max=origin.fp32_abs_max, consumer=origin.consumer,
                consumer_module=origin.consumer_module,
                dtype=origin.outputs[0].dtype if origin.outputs else None,
            )
            pending = self._pending_event
            if pending is not None and pending.direction == "backward" and origin.direction == "backward":
                finding.params = list(pending.params)
        elif entered is not None:
            finding = Finding(
                step=step, scale=scale, kind="nonfinite_input", level="op", direction=entered.direction,
                module=entered.module, module_type=self._module_types.get(entered.module or ""),
                op=entered.op, inputs=entered.inputs, params=entered.params,
            )
        flushed = checker.flush_summary()
        total_flushed = sum(v[0] for v in flushed.values())
        total_nz = sum(v[2] for v in flushed.values())
        if finding is None and total_nz and total_flushed / total_nz >= 0.05:
            finding = Finding(
                step=step, scale=scale, kind="underflow", level="op", flushed=flushed,
                magnitude_range=checker.magnitude_range(), dtype="fp16",
            )
        elif finding is not None and total_nz:
            finding.flushed = flushed
            finding.magnitude_range = checker.magnitude_range()
        pending, self._pending_event = self._pending_event, None
        if pending is not None and reason != "diagnose":
            pending.recurred = finding is not None and finding.kind != "underflow"
        if finding is not None:
            rank, world = rank_and_world_size()
            finding.ranks = [rank] if world > 1 else []
            self.findings.append(finding)
            if reason != "diagnose":
                self._ungathered.append(finding)
            self._log(f"ampkit.doctor: op-level check: {finding.summary()}")
        return finding

    @property
    def _module_types(self) -> dict[str, str]:
        return {name: m.module_type for name, m in self.margins.items()}

    def _update_margins(self, res: ResolvedStep, step: int) -> None:
        for name, dt in res.module_dtype.items():
            if dt in LOW_PRECISION and self.compute_dtype is None:
                self.compute_dtype = dt
            margin = self.margins.get(name)
            if margin is None:
                margin = self.margins[name] = ModuleMargin(name, res.module_type.get(name, "?"), dtype_name(dt))
                margin.act_limit = limit_of(dt)
                margin.grad_limit = limit_of(dt)
            margin.steps += 1
        act_step: dict[str, float] = {}
        bad: set[str] = set()
        for _, name, _dt, amax in res.acts:
            if math.isfinite(amax):
                act_step[name] = max(act_step.get(name, 0.0), amax)
            else:
                bad.add(name)
        for name, value in act_step.items():
            margin = self.margins[name]
            margin.act_abs_max = max(margin.act_abs_max, value)
            margin.act_history.append((step, value))
        for _, tap, dt, amax in res.grads:
            for name in tap.producers:
                margin = self.margins.get(name)
                if margin is None:
                    continue
                if math.isfinite(amax):
                    if amax / limit_of(dt) > margin.grad_abs_max / margin.grad_limit:
                        margin.grad_abs_max, margin.grad_limit = amax, limit_of(dt)
                else:
                    bad.add(name)
        under: dict[str, list[float]] = {}
        for _, _pn, mname, dt, n, amax, zeros, sub, _sq, _t in res.params:
            margin = self.margins.get(mname)
            if margin is None:
                continue
            if dt in LOW_PRECISION:
                if math.isfinite(amax):
                    if amax / limit_of(dt) > margin.grad_abs_max / margin.grad_limit:
                        margin.grad_abs_max, margin.grad_limit = amax, limit_of(dt)
                else:
                    bad.add(mname)
            acc = under.setdefault(mname, [0.0, 0.0, 0.0])
            acc[0] += zeros
            acc[1] += sub - zeros  # sub: zero or subnormal
            acc[2] += n
        for name, (zeros, sub, n) in under.items():
            compute = res.module_dtype.get(name)
            if n and compute in LOW_PRECISION:
                margin = self.margins[name]
                margin.zeros = zeros / n
                margin.underflow = sub / (n - zeros) if n > zeros else 0.0
        for name in bad:
            if name in self.margins:
                self.margins[name].nonfinite_steps += 1

    # --- distributed ---------------------------------------------------------------------
    def _gather(self, state: _optim.ManagedOptimizer, local: Finding) -> None:
        """Several processes, at a skipped step (every rank skips it together): one
        ``all_gather_object`` of each rank's module-level finding and of its op-level
        findings not sent yet. ``local.ranks`` becomes the ranks where the non-finite
        value appeared; a rank that saw only the aftermath (inf/NaN grads after the
        all-reduce) takes the origin rank's view; other ranks' op-level findings join
        this rank's list."""
        rank, world = rank_and_world_size()
        pending, self._ungathered = self._ungathered, []
        if world == 1:
            return
        # ampkit's agreement off ("never", or another group): ranks may skip different steps
        if not _distributed.agrees_over_world(state):
            local.ranks = [rank] if local.direction is not None else []
            return
        mine = local.to_dict() if local.direction is not None else None
        gathered: list[Any] = [None] * world
        torch.distributed.all_gather_object(gathered, (mine, [f.to_dict() for f in pending]))
        local.ranks = [r for r, (event, _) in enumerate(gathered) if event is not None]
        if mine is None and local.ranks:
            other = gathered[local.ranks[0]][0]
            for key in ("direction", "module", "module_type", "params", "dtype"):
                setattr(local, key, other.get(key))
        by_step = {(f.step, f.kind): f for f in self.findings}
        for r, (_, findings) in enumerate(gathered):
            for d in findings:
                own = by_step.get((d["step"], d["kind"]))
                if own is None:
                    f = Finding.from_dict(d)
                    f.ranks = [r]
                    self.findings.append(f)
                    by_step[(f.step, f.kind)] = f
                    for event in self.events:  # it did recur, on another rank
                        if event.recurred is False and event.step < f.step and f.kind != "underflow":
                            event.recurred = True
                elif r not in own.ranks and (own.module, own.op) == (d.get("module"), d.get("op")):
                    own.ranks = sorted({*own.ranks, r})

    # --- output --------------------------------------------------------------------------
    def _log(self, message: str) -> None:
        if self.log and rank_and_world_size()[0] == 0:
            logger.warning(message)

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        if rank_and_world_size()[0] == 0:
            warnings.warn(message, DoctorWarning, stacklevel=user_stacklevel())

    def report(self) -> Any:
        """The :class:`~ampkit.DoctorReport` of everything seen so far (also
        while running)."""
        return DoctorReport.build(self)


# --- the process-wide doctor (init_trainer(..., doctor=True), AMPKIT_DOCTOR=1) ----------
# Module state: the process-wide doctor is one per process by design.
_GLOBAL: Doctor | None = None
_FINISHED: list[Doctor] = []  # global doctors stopped by ampkit.reset(), for `ampkit doctor`
_KEEP_FINISHED = False


def current() -> Doctor | None:
    """The process-wide doctor started by ``init_trainer(..., doctor=True)`` or
    ``AMPKIT_DOCTOR=1`` (None when none runs)."""
    return _GLOBAL


def attach_global(optimizers: Sequence[torch.optim.Optimizer]) -> Doctor:
    """Start the process-wide doctor if needed and watch ``optimizers``."""
    global _GLOBAL
    if _GLOBAL is None or not _GLOBAL.running:
        _GLOBAL = Doctor(list(optimizers)).start()
    else:
        for opt in optimizers:
            _GLOBAL.attach(opt)
    return _GLOBAL


@_reset.on_reset
def _stop_global() -> None:
    global _GLOBAL
    doc, _GLOBAL = _GLOBAL, None
    if doc is not None:
        doc.stop()
        if _KEEP_FINISHED:
            _FINISHED.append(doc)


_extensions.register_attacher("doctor", attach_global, env=ENV)
