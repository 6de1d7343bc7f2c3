"""``ampkit.tune``: measure, choose, confirm.

1. **Measure** on this device: each candidate module's forward + backward time alone
   in fp32 and in each 16-bit dtype this hardware computes natively (each linear in
   fp8 too, where fp8 is native), and its sensitivity: the loss and gradient deviation
   from fp32 when only it runs lowered.
2. **Choose** greedily by time saved per unit of loss deviation, adding (module, dtype)
   options while the sum of their deviations stays within the budget (a linear's fp8
   option replaces its 16-bit one where it saves more); a module that saves nothing,
   or whose gradient moves by more than ``grad_limit`` alone, stays fp32.
3. **Confirm** with a short training run of a copy of the model under the plan against
   fp32 from the same weights and batches; while it misses the budget, the most
   sensitive lowered module goes back to fp32 and the probe runs again.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ampkit._internal.dtypes import DTYPES_BY_NAME as DTYPES
from ampkit._internal.registry import reset
from ampkit.casting.engine import is_active
from ampkit.casting.policy import Policy, exact_name
from ampkit.errors import AmpError, StateError
from ampkit.levels.fp8.recipe import for_modules
from ampkit.levels.opt_level import OPT_LEVELS, level_names
from ampkit.levels.precision_plan import FP8, ModuleChoice, TunePlan
from ampkit.levels.setup import initialize
from ampkit.tools.bench.machine import machine_info
from ampkit.trainer.api import scale_loss
from ampkit.trainer.session import current_session

from . import measure
from .measure import Batch, LossFn
from .process_state import as_found
from .progress import Progress, count

__all__ = ["Probe", "build_plan", "check_budget", "check_settings", "choose", "confirm", "expected_runs",
           "measure_and_choose", "probe", "tune", "worse_by"]  # fmt: skip

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def tune(
    model: nn.Module,
    batches: Sequence[Batch],
    loss_fn: LossFn | None = None,
    *,
    budget: float = 0.01,
    candidates: Sequence[str] = ("bf16", "fp16", "fp8"),
    device_type: str | None = None,
    probe_steps: int = 30,
    optimizer: OptimizerFactory | None = None,
    repeats: int = 5,
    grad_limit: float = 0.1,
    fp8_grad_limit: float = 0.25,
    max_backoffs: int = 4,
    max_seconds: float = 300.0,
    include_emulated: bool = False,
    progress: bool | None = None,
) -> TunePlan:
    """The fastest per-module precision plan whose training loss stays within ``budget``
    of fp32's, measured on this device.

    Args:
        model: the fp32 model, on its device; not changed (the tuner works on copies).
        batches: calibration batches, each ``(inputs, targets)`` (``inputs`` a tensor or a
            tuple of positional arguments); at least one. The sensitivities use the first
            ``min(len, 4)``, the probe cycles through all of them.
        loss_fn: ``loss_fn(model(*inputs), targets) -> scalar``; None: ``model(*inputs)``
            is the loss.
        budget (float): the allowed relative deviation of the probe's final loss
            (mean over its last quarter of steps) from fp32's. Default: ``0.01``.
        candidates: dtypes to try, of ``"bf16"``, ``"fp16"``, ``"fp8"``; those this
            hardware does not compute natively are skipped and named in
            :attr:`TunePlan.skipped` (fp8: CUDA compute capability 8.9 and up). The plan
            uses one 16-bit dtype: the candidate whose choice saves the most time; fp8
            is measured per ``nn.Linear`` beside the first 16-bit candidate tried (its
            outputs in that dtype) and chosen per linear where it saves more.
        device_type: ``"cpu"``/``"cuda"``; default: the model's parameters' device.
        probe_steps (int): training steps of the confirming probe (and of fp32's). Default: ``30``.
        optimizer: ``factory(params) -> optimizer`` for the probe; default
            ``torch.optim.AdamW(params, lr=1e-3)``.
        repeats (int): timed runs per module and dtype (the fastest counts). Default: ``5``.
        grad_limit (float): a module whose gradient deviation alone exceeds this
            stays fp32, however little the loss moves. Default: ``0.1``.
        fp8_grad_limit (float): the same for a linear in fp8, whose e5m2 gradients keep 2
            mantissa bits (measured on a 3-layer MLP: 4-12% for a linear in fp8 against
            0.3-4% in bf16). Default: ``0.25``.
        max_backoffs (int): probes rerun after putting a module back to fp32. Default: ``4``.
        max_seconds (float): a bound on the measuring phases; modules not measured
            in time stay fp32 (their reason says so). The probes run in full. Default: ``300.0``.
        include_emulated (bool): measure bf16/fp16/fp8 on a CPU that emulates them. Default: ``False``.
        progress (bool | None): a line per stage, a status line at least every 5 s: ``None``
            logs them on the ``"ampkit"`` logger at INFO where the application configured
            logging (a handler on that logger or the root), and shows them on stderr
            through logging's last-resort handler where it did not, so that by default
            they are seen; ``True`` shows them on stderr (a rich bar on a terminal, with
            rich installed), unlogged; ``False``: none. Default: ``None``.

    Returns:
        A :class:`TunePlan`; ``ampkit.initialize(model, optimizer, plan=plan)`` applies
        it (``plan.policy()``, the op-level part alone, where no linear is in fp8).

    Raises:
        AmpError: no batches, an unknown candidate, a non-positive budget, a setting out of range
            (``repeats`` < 1, ``max_backoffs`` < 0, a negative or NaN limit or ``max_seconds``, a
            ``progress`` not a bool or None) or a model without candidate modules, before anything is measured.

    The process is left as it was found, however the tuning ends: the random streams
    (torch's, CUDA's, Python's ``random``, numpy's) and torch's global module and
    optimizer hooks (``tools.tune.process_state.as_found``).
    """
    start = time.perf_counter()
    device_type = _validate(model, batches, budget, candidates, probe_steps, device_type, repeats=repeats,
                            max_backoffs=max_backoffs, grad_limit=grad_limit, fp8_grad_limit=fp8_grad_limit,
                            max_seconds=max_seconds)  # fmt: skip
    with Progress(progress, "ampkit.tune") as report, as_found():  # as_found: the random streams and hooks
        dtype, choices, skipped = measure_and_choose(
            model, batches[: min(len(batches), 4)], loss_fn, candidates=candidates, device_type=device_type,
            include_emulated=include_emulated, repeats=repeats, budget=budget, grad_limit=grad_limit,
            fp8_grad_limit=fp8_grad_limit, deadline=start + max_seconds, report=report)  # fmt: skip
        run = functools.partial(probe, model, batches, loss_fn, dtype=dtype, device_type=device_type,
                                steps=probe_steps, optimizer=optimizer)  # fmt: skip
        level, figures, choices, backed = confirm(run, dtype, choices, probe_steps, budget, max_backoffs, report=report)
    return build_plan(dtype, level, device_type, budget, choices, skipped, figures, backed, start)


def measure_and_choose(model: nn.Module, calib: Sequence[Batch], loss_fn: LossFn | None, *,
                       candidates: Sequence[str], device_type: str, include_emulated: bool, repeats: int,
                       budget: float, grad_limit: float, deadline: float, fp8_grad_limit: float = 0.25,
                       report: Progress | None = None) -> tuple[str, list[ModuleChoice], dict[str, str]]:  # fmt: skip
    """Steps 1 and 2 on a copy of ``model``: each candidate module timed on ``calib[0]``
    and its sensitivities over ``calib`` for each 16-bit dtype this hardware computes
    natively (and each linear's in fp8 where it does, beside the first 16-bit dtype),
    then :func:`choose`; the dtype whose choice saves the most time. Returns that dtype
    (``"fp32"`` when none was tried), the choices and the dtypes skipped. Each measuring
    stage is a stage of ``report``."""
    report = report if report is not None else Progress(False)
    dtypes, skipped = measure.native_dtypes(candidates, device_type, include_emulated)
    work = copy.deepcopy(model)
    modules = measure.candidate_modules(work)
    what = f"{count(len(modules), 'modules')} alone, forward + backward, in {', '.join(['fp32', *dtypes])}"
    with report.stage("timing", f"{what} ({_runs(repeats)} after a warm-up)", len(modules), "modules"):
        times = measure.module_times(work, modules, calib[0], loss_fn, dtypes, device_type, repeats, deadline,
                                     report=report)  # fmt: skip
    low_dtypes = [d for d in dtypes if d != FP8]
    fp8_sens: dict[str, tuple[float, float]] = {}
    if FP8 in dtypes:
        linears = [n for n in measure.fp8_linears(modules) if FP8 in times.get(n, {})]
        with _sensitivity_stage(report, FP8, len(linears), len(calib), "linears"):
            fp8_sens = measure.sensitivities(work, linears, calib, loss_fn, FP8, device_type, deadline,
                                             companion=low_dtypes[0], report=report)  # fmt: skip
    options = []
    for dtype in low_dtypes:
        names = [n for n, _ in modules if times.get(n)]
        with _sensitivity_stage(report, dtype, len(names), len(calib), "modules"):
            sens = measure.sensitivities(work, names, calib, loss_fn, dtype, device_type, deadline, report=report)
        options.append(choose(dtype, modules, times, sens, budget, grad_limit,
                              fp8_sens if dtype == low_dtypes[0] else None, fp8_grad_limit))  # fmt: skip
    if not options:  # nothing to try: every module stays fp32
        options.append(choose("fp32", modules, times, {}, budget, grad_limit))
    dtype, choices = max(options, key=lambda o: sum(c.saved_ms for c in o[1] if c.dtype != "fp32"))
    if FP8 in dtypes and dtype != low_dtypes[0]:
        skipped[FP8] = (f"measured beside {low_dtypes[0]}; the plan chose {dtype}, which saves more "
                        "without fp8")  # fmt: skip
    return dtype, choices, skipped


def _runs(repeats: int) -> str:
    return f"the fastest of {repeats} runs" if repeats > 1 else "1 run"


def _sensitivity_stage(report: Progress, dtype: str, n: int, batches: int, unit: str) -> Any:
    return report.stage(f"sensitivity in {dtype}", f"{count(n, unit)}, each alone in {dtype}: how far the loss and the "
                        f"gradient move from fp32's over {count(batches, 'batches')}", n, unit)  # fmt: skip


def build_plan(dtype: str, level: str, device_type: str, budget: float, choices: list[ModuleChoice],
               skipped: dict[str, str], figures: dict[str, float], backed: list[str], start: float) -> TunePlan:  # fmt: skip
    """The :class:`TunePlan` of a finished tuning that began at ``start`` (``perf_counter``)."""
    lowered = [c for c in choices if c.dtype != "fp32"]
    return TunePlan(
        dtype=dtype, level=level, device_type=device_type, budget=budget,
        modules=tuple(choices), skipped=skipped, predicted_deviation=sum(c.loss_deviation for c in lowered),
        probe=figures, backed_off=tuple(backed), seconds=time.perf_counter() - start,
        machine={k: v for k, v in machine_info(device_type).items() if k in ("device_name", "cpu_flags", "torch")},
    )  # fmt: skip


def check_budget(budget: Any) -> None:
    """Raise :class:`ampkit.AmpError` unless ``budget`` is a positive finite number (not a bool)."""
    if isinstance(budget, bool) or not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise AmpError(f"budget {budget!r}: a positive relative loss deviation, e.g. 0.01 for 1%.")


def check_settings(**settings: Any) -> None:
    """Raise :class:`ampkit.AmpError` naming the first of the tuner's numeric settings out
    of range: ``repeats`` an int >= 1, ``max_backoffs`` an int >= 0, ``grad_limit`` and
    ``fp8_grad_limit`` numbers >= 0 (0: any gradient change keeps a module fp32; inf: no
    limit), ``max_seconds`` a number >= 0 (0: measure nothing); no bools, no NaN."""
    for name, value in settings.items():
        if name in ("repeats", "max_backoffs"):
            low = 1 if name == "repeats" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise AmpError(f"{name} {value!r}: an integer of at least {low}.")
            continue
        number = not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)
        if not (number and value >= 0):
            what = ("a number of seconds >= 0" if name == "max_seconds"
                    else "a relative gradient change >= 0 (0.1 for 10%; inf for no limit)")  # fmt: skip
            raise AmpError(f"{name} {value!r}: {what}.")


def _validate(model: nn.Module, batches: Sequence[Batch], budget: float, candidates: Sequence[str],
              probe_steps: int, device_type: str | None, **settings: Any) -> str:  # fmt: skip
    """:func:`tune`'s arguments checked, then its numeric ``settings`` (:func:`check_settings`);
    returns the device type (default: the model's parameters')."""
    if not isinstance(model, nn.Module):
        raise AmpError(f"ampkit.tune needs an nn.Module, got {type(model).__name__}.")
    if not isinstance(batches, Sequence) or len(batches) == 0:
        raise AmpError("ampkit.tune needs a non-empty list of calibration batches (inputs, targets).")
    check_budget(budget)
    bad = [c for c in candidates if c not in ("bf16", "fp16", "fp8")]
    if bad or not candidates:
        raise AmpError(f"candidates {list(candidates)!r}: choose from 'bf16', 'fp16', 'fp8'.")
    if isinstance(probe_steps, bool) or not isinstance(probe_steps, int) or probe_steps < 1:
        raise AmpError(f"probe_steps {probe_steps!r}: at least 1.")
    if is_active() or not current_session().empty:
        raise StateError("ampkit.tune trains its probes through ampkit's own session, and one is set up "
                         "already: call ampkit.tune before ampkit.init/initialize/init_trainer (or after ampkit.reset()).")
    if not measure.candidate_modules(model):
        raise AmpError("this model has no module with parameters of its own below the root: nothing to tune.")
    check_settings(**settings)
    return device_type or next((p.device.type for p in model.parameters()), "cpu")


def _assess(name: str, dtype: str, times: dict[str, dict[str, float]], sens: dict[str, tuple[float, float]],
            grad_limit: float) -> tuple[str, float, float, float, float]:  # fmt: skip
    """``(why not, fp32 ms, ms in dtype, loss deviation, grad deviation)`` of one module
    in one dtype; ``why not`` is empty where lowering it is worth considering."""
    t = times.get(name, {})
    fp32, low = t.get("fp32", math.nan), t.get(dtype, math.nan)
    loss_dev, grad_dev = sens.get(name, (math.nan, math.nan))
    if name in times and not times[name]:
        reason = ("never called as a module (its parent uses its parameters directly): not measured, kept "
                  "(at O2/O2K its weights stay fp32; the parent's ops follow the parent's choice)")  # fmt: skip
    elif name not in times or name not in sens:
        reason = "not measured within max_seconds" if dtype != "fp32" else "no 16-bit dtype to try here"
    elif not math.isfinite(loss_dev) or not math.isfinite(grad_dev):
        reason = f"non-finite loss or grads in {dtype}"
    elif grad_dev > grad_limit:
        reason = f"gradient moves {grad_dev:.1%} alone in {dtype} (limit {grad_limit:.0%})"
    elif low >= fp32:
        reason = f"no faster in {dtype} ({low:.3f} ms vs {fp32:.3f} ms)"
    else:
        reason = ""
    return reason, fp32, low, loss_dev, grad_dev


def choose(dtype: str, modules: list[tuple[str, nn.Module]], times: dict[str, dict[str, float]],
           sens: dict[str, tuple[float, float]], budget: float, grad_limit: float,
           fp8_sens: dict[str, tuple[float, float]] | None = None, fp8_grad_limit: float = 0.25,
           ) -> tuple[str, list[ModuleChoice]]:  # fmt: skip
    """Greedy: each (module, dtype) option by time saved per unit of loss deviation,
    taken while the deviations' sum fits the budget; a module's fp8 option (``fp8_sens``:
    the linears measured in fp8 beside ``dtype``) replaces its ``dtype`` one where it
    saves more and the budget still holds (its gradient limit: ``fp8_grad_limit``)."""
    info = {name: _assess(name, dtype, times, sens, grad_limit) for name, _m in modules}
    info8 = {name: _assess(name, FP8, times, fp8_sens, fp8_grad_limit) for name in (fp8_sens or {})}
    options = [(name, dtype, info[name]) for name, _m in modules if not info[name][0]]
    options += [(name, FP8, a) for name, a in info8.items() if not a[0]]
    options.sort(key=lambda o: -(o[2][1] - o[2][2]) / max(o[2][3], 1e-12))
    used, lowered = 0.0, {}  # name -> (dtype, assessment)
    for name, kind, a in options:
        held = lowered.get(name)
        freed = held[1][3] if held else 0.0
        if (held is None or a[1] - a[2] > held[1][1] - held[1][2]) and used - freed + a[3] <= budget:
            used += a[3] - freed
            lowered[name] = (kind, a)
    choices = []
    for name, m in modules:
        kind, (reason, fp32, low, loss_dev, grad_dev) = lowered.get(name, (None, info[name]))
        if kind is not None:
            reason = f"saves {fp32 - low:.3f} ms for {loss_dev:.1e} of the budget"
            if kind == FP8 and not info[name][0]:
                reason += f" ({dtype} would save {info[name][1] - info[name][2]:.3f} ms for {info[name][3]:.1e})"
        elif not reason:
            reason = "the budget is spent on modules that save more per unit of deviation"
        if kind != FP8 and name in info8:
            why8 = info8[name][0] or "the budget is spent on modules that save more per unit of deviation"
            reason += f"; fp8: {why8}"
        choices.append(ModuleChoice(name, type(m).__name__, kind or "fp32", fp32, low, loss_dev, grad_dev, reason))
    return dtype, choices


@dataclasses.dataclass(frozen=True)
class Probe:
    """One confirming training run: its loss (mean of the last quarter of steps) and
    median step time in ms (after the first three steps)."""

    loss: float
    step_ms: float


def probe(model: nn.Module, batches: Sequence[Batch], loss_fn: LossFn | None, level: str | None, *, dtype: str,
          kept: list[str], device_type: str, steps: int, optimizer: OptimizerFactory | None,
          fp8: Sequence[str] = ()) -> Probe:  # fmt: skip
    """Train a copy of ``model`` for ``steps`` steps through :func:`ampkit.initialize` at
    ``level`` (None: plain fp32), the ``kept`` modules pinned to fp32 (by a module rule,
    and at O2/O2K by ``keep_fp32``), the ``fp8`` linears converted (default recipe)."""
    net = copy.deepcopy(model)
    opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3)))(list(net.parameters()))
    if level is not None:
        low = DTYPES[dtype]
        exact = [exact_name(name) for name in kept]  # names matched as they are, never as globs
        extra: dict[str, Any] = {"keep_fp32": exact} if OPT_LEVELS[level].casts_model and kept else {}
        policy = Policy(dtype=low, module_rules={name: torch.float32 for name in exact})
        recipe = for_modules(fp8, None, "ampkit.tune") if fp8 else None
        net, opt = initialize(net, opt, opt_level=level, dtype=low, policy=policy, fp8=recipe, **extra)
    losses, times = [], []
    try:
        with measure.seeded(0):
            for step in range(steps):
                measure.sync(device_type)
                start = time.perf_counter()
                loss = measure.loss_of(net, batches[step % len(batches)], loss_fn)
                if level is None:
                    loss.backward()
                else:
                    with scale_loss(loss, opt) as scaled:
                        scaled.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                measure.sync(device_type)
                times.append(time.perf_counter() - start)
                losses.append(float(loss.detach()))
    finally:
        if level is not None:
            reset()
    k = max(1, steps // 4)
    return Probe(sum(losses[-k:]) / k, 1e3 * statistics.median(times[3:] or times))


def worse_by(loss: float, ref: float) -> float:
    """How much worse than ``ref`` ``loss`` is, relative (0 when it is lower: a loss
    below fp32's spends no budget); inf when not finite."""
    if not math.isfinite(loss):
        return math.inf
    return max(0.0, loss - ref) / max(abs(ref), 1e-12)


def _backed(c: ModuleChoice, why: str) -> ModuleChoice:
    return dataclasses.replace(c, dtype="fp32", reason=why)


def _levels(dtype: str) -> tuple[str, ...]:
    """The levels the probe tries: those a plan runs at (ops under a casting policy) in ``dtype``."""
    return level_names(lambda d: d.mixed and (dtype == "bf16" or not d.bf16_only))


def expected_runs(dtype: str, choices: Sequence[ModuleChoice]) -> int:
    """How many runs :func:`confirm` makes when the plan needs no back-off and no
    timing again: fp32's; everything lowered at each level; the plan at each level
    where it lowers a module."""
    if dtype == "fp32":
        return 1
    return 1 + len(_levels(dtype)) * (2 if any(c.dtype != "fp32" for c in choices) else 1)


def _run_name(dtype: str, level: str | None, kept: Sequence[str], fp8: Sequence[str]) -> str:
    if level is None:
        return "fp32"
    return f"the plan at {level}" if kept or fp8 else f"everything in {dtype} at {level}"


def confirm(run: Callable[..., Probe], dtype: str, choices: list[ModuleChoice], steps: int, budget: float,
            max_backoffs: int, *, report: Progress | None = None, what: str = "training copies of the model",
            ) -> tuple[str, dict[str, float], list[ModuleChoice], list[str]]:  # fmt: skip
    """Probe the module plan at O1 against fp32, putting the most sensitive lowered module
    back to fp32 while it misses the budget; then run the settled plan, and everything
    lowered, at each level, and keep the fastest run within the budget (O0, nothing
    lowered, where fp32 is faster than every one). ``run(level, kept=names, fp8=names)`` trains
    (``level`` None: fp32) and returns a :class:`Probe`; a run that cannot go returns
    one with an infinite loss. Returns the level, the figures, the choices and the
    modules put back. The runs are a stage of ``report`` (``what``: how they run)."""
    report = report if report is not None else Progress(False)
    total = expected_runs(dtype, choices)
    lowered = "the plan and everything" if any(c.dtype != "fp32" for c in choices) else "everything"
    which = "fp32" if dtype == "fp32" else f"fp32, then {lowered} in {dtype} at {', '.join(_levels(dtype))}"
    with report.stage("confirming", f"{what}, {steps} steps a run: {which} (about {count(total, 'runs')})",
                      total, "runs"):  # fmt: skip

        def counted(level: str | None, kept: list[str], fp8: Sequence[str] = ()) -> Probe:
            report.now(_run_name(dtype, level, kept, fp8))
            result = run(level, kept=kept, fp8=fp8)
            report.advance()
            return result

        return _confirm(counted, dtype, choices, steps, budget, max_backoffs)


def _confirm(run: Callable[..., Probe], dtype: str, choices: list[ModuleChoice], steps: int, budget: float,
             max_backoffs: int) -> tuple[str, dict[str, float], list[ModuleChoice], list[str]]:  # fmt: skip
    """:func:`confirm`'s runs and choice."""
    ref = run(None, kept=[], fp8=[])
    figures = {"steps": float(steps), "fp32_loss": ref.loss, "fp32_ms": ref.step_ms}
    if dtype == "fp32":
        return "O0", dict(figures, plan_loss=ref.loss, deviation=0.0, plan_ms=ref.step_ms), choices, []
    runs = {("all", "O1"): run("O1", kept=[], fp8=[])}
    figures.update(uniform_loss=runs["all", "O1"].loss, uniform_deviation=worse_by(runs["all", "O1"].loss, ref.loss))
    choices, backed, settled = _back_off(run, ref, choices, budget, max_backoffs)
    kept = [c.name for c in choices if c.dtype == "fp32"]
    fp8 = [c.name for c in choices if c.dtype == FP8]
    for level in _levels(dtype):
        if settled is not None:
            runs["plan", level] = settled if level == "O1" else run(level, kept=kept, fp8=fp8)
        if level != "O1":
            runs["all", level] = run(level, kept=[], fp8=[])
    fits = [key for key, r in runs.items() if worse_by(r.loss, ref.loss) <= budget]
    ref = _retime_close(run, runs, fits, ref, kept, fp8)
    for (which, level), r in runs.items():
        prefix = level if which == "plan" else f"all_{level}"
        figures[f"{prefix}_ms"], figures[f"{prefix}_loss"] = r.step_ms, r.loss
    figures["fp32_ms"] = ref.step_ms
    best = min(fits, key=lambda key: runs[key].step_ms) if fits else None
    if best is None or runs[best].step_ms >= ref.step_ms:  # nothing within budget, or 16 bits no faster
        if best is not None:
            why = f"fp32 end to end is faster here ({ref.step_ms:.2f} ms a step against {runs[best].step_ms:.2f} ms)"
            choices = [c if c.dtype == "fp32" else _backed(c, why) for c in choices]
        return "O0", dict(figures, plan_loss=ref.loss, deviation=0.0, plan_ms=ref.step_ms), choices, backed
    which, level = best
    if which == "all":  # lowering every module was faster and within the budget too
        why = f"lowered: everything in {dtype} at {level} was the fastest within the budget"
        choices = [c if c.dtype == dtype else dataclasses.replace(
            c, dtype=dtype, reason=why + (" (the figures are fp8's)" if c.dtype == FP8 else "")) for c in choices]  # fmt: skip
    r = runs[best]
    figures.update(plan_loss=r.loss, deviation=worse_by(r.loss, ref.loss), plan_ms=r.step_ms)
    return level, figures, choices, backed


#: Candidates whose step times are within this factor of the fastest are timed again.
CLOSE = 1.1


def _retime_close(run: Callable[..., Probe], runs: dict[tuple[str, str], Probe], fits: list[tuple[str, str]],
                  ref: Probe, kept: list[str], fp8: list[str]) -> Probe:  # fmt: skip
    """Time again, in reverse order, the fastest runs within the budget that are within
    ``CLOSE`` of each other (and fp32 when it is that close): one run's step time moves
    by 5-10% from process state alone, which would decide between them. The faster of
    the two timings counts (``runs`` updated); returns fp32's run, updated alike."""
    if not fits:
        return ref
    order = sorted(fits, key=lambda key: runs[key].step_ms)
    fastest = runs[order[0]].step_ms
    close = [key for key in order if runs[key].step_ms <= CLOSE * fastest][:3]
    if ref.step_ms <= CLOSE * fastest:
        close.append(("fp32", ""))
    if len(close) < 2:
        return ref
    for key in reversed(close):
        if key[0] == "fp32":
            again = run(None, kept=[], fp8=[])
            ref = Probe(ref.loss, min(ref.step_ms, again.step_ms))
        else:
            again = run(key[1], kept=kept if key[0] == "plan" else [], fp8=fp8 if key[0] == "plan" else [])
            runs[key] = Probe(runs[key].loss, min(runs[key].step_ms, again.step_ms))
    return ref


def _back_off(run: Callable[..., Probe], ref: Probe, choices: list[ModuleChoice], budget: float,
              max_backoffs: int) -> tuple[list[ModuleChoice], list[str], Probe | None]:  # fmt: skip
    """The module plan probed at O1, its most sensitive lowered module put back to fp32
    while it misses the budget (all of them after ``max_backoffs``): the choices, the
    modules put back, and the last probe within budget (None: nothing lowered)."""
    backed: list[str] = []
    while True:
        lowered = [c for c in choices if c.dtype != "fp32"]
        if not lowered:
            return choices, backed, None
        result = run("O1", kept=[c.name for c in choices if c.dtype == "fp32"],
                     fp8=[c.name for c in choices if c.dtype == FP8])
        deviation = worse_by(result.loss, ref.loss)
        if deviation <= budget:
            return choices, backed, result
        if len(backed) >= max_backoffs:  # nothing lowered is confirmed
            why = f"put back to fp32: the probe still missed the budget after {max_backoffs} back-offs"
            backed += [c.name for c in lowered]
            choices = [c if c.dtype == "fp32" else _backed(c, why) for c in choices]
            continue
        worst = max(lowered, key=lambda c: c.loss_deviation)
        backed.append(worst.name)
        why = f"put back to fp32: the probe missed the budget ({deviation:.2e})"
        choices = [c if c is not worst else _backed(c, why) for c in choices]
