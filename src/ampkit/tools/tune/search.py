"""``ampkit.tune``: measure, choose, confirm.

1. **Measure** on this device: each candidate module's forward + backward time alone
   in fp32 and in each 16-bit dtype this hardware computes natively, and its
   sensitivity: the loss and gradient deviation from fp32 when only it runs in 16 bits.
2. **Choose** greedily by time saved per unit of loss deviation, adding modules while the
   sum of their deviations stays within the budget; a module that saves nothing, or
   whose gradient moves by more than ``grad_limit`` alone, stays fp32.
3. **Confirm** with a short training run of a copy of the model under the plan against
   fp32 from the same weights and batches; while it misses the budget, the most
   sensitive lowered module goes back to fp32 and the probe runs again.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ampkit.casting.policy import Policy
from ampkit.errors import AmpError
from ampkit.tools.bench.machine import machine_info

from . import measure
from .measure import Batch, LossFn
from .plan import DTYPES, ModuleChoice, TunePlan

__all__ = ["tune"]

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
    max_backoffs: int = 4,
    max_seconds: float = 300.0,
    include_emulated: bool = False,
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
        budget (float) [0.01]: the allowed relative deviation of the probe's final loss
            (mean over its last quarter of steps) from fp32's.
        candidates: 16-bit dtypes to try, of ``"bf16"``, ``"fp16"``, ``"fp8"``; those this
            hardware does not compute natively are skipped and named in
            :attr:`TunePlan.skipped`. The plan uses one 16-bit dtype: the candidate whose
            choice saves the most time.
        device_type: ``"cpu"``/``"cuda"``; default: the model's parameters' device.
        probe_steps (int) [30]: training steps of the confirming probe (and of fp32's).
        optimizer: ``factory(params) -> optimizer`` for the probe; default
            ``torch.optim.AdamW(params, lr=1e-3)``.
        repeats (int) [5]: timed runs per module and dtype (the fastest counts).
        grad_limit (float) [0.1]: a module whose gradient deviation alone exceeds this
            stays fp32, however little the loss moves.
        max_backoffs (int) [4]: probes rerun after putting a module back to fp32.
        max_seconds (float) [300.0]: a bound on the measuring phases; modules not measured
            in time stay fp32 (their reason says so). The probes run in full.
        include_emulated (bool) [False]: measure bf16/fp16 on a CPU that emulates them.

    Returns:
        A :class:`TunePlan`; ``plan.policy()`` applies it (``ampkit.init(policy=...)``).

    Raises:
        AmpError: no batches, an unknown candidate, a non-positive budget or a model
            without candidate modules, before anything is measured.
    """
    start = time.perf_counter()
    _validate(model, batches, budget, candidates, probe_steps)
    device_type = device_type or next((p.device.type for p in model.parameters()), "cpu")
    dtypes, skipped = measure.native_dtypes(candidates, device_type, include_emulated)
    work = copy.deepcopy(model)
    modules = measure.candidate_modules(work)
    deadline = start + max_seconds
    times = measure.module_times(work, modules, batches[0], loss_fn, dtypes, device_type, repeats, deadline)
    calib = list(batches[: min(len(batches), 4)])
    options = []
    for dtype in dtypes:
        sens = measure.sensitivities(work, [n for n, _ in modules if n in times], calib, loss_fn, dtype,
                                     device_type, deadline)  # fmt: skip
        options.append(_choose(dtype, modules, times, sens, budget, grad_limit))
    if not options:  # nothing to try: every module stays fp32
        options.append(_choose("fp32", modules, times, {}, budget, grad_limit))
    dtype, choices = max(options, key=lambda o: sum(c.saved_ms for c in o[1] if c.dtype != "fp32"))
    probe, choices, backed = _confirm(model, batches, loss_fn, dtype, choices, device_type, probe_steps,
                                      optimizer, budget, max_backoffs)  # fmt: skip
    lowered = [c for c in choices if c.dtype != "fp32"]
    return TunePlan(
        dtype=dtype if lowered or dtype != "fp32" else "fp32", device_type=device_type, budget=budget,
        modules=tuple(choices), skipped=skipped, predicted_deviation=sum(c.loss_deviation for c in lowered),
        probe=probe, backed_off=tuple(backed), seconds=time.perf_counter() - start,
        machine={k: v for k, v in machine_info(device_type).items() if k in ("device_name", "cpu_flags", "torch")},
    )  # fmt: skip


def _validate(model: nn.Module, batches: Sequence[Batch], budget: float, candidates: Sequence[str],
              probe_steps: int) -> None:  # fmt: skip
    if not isinstance(model, nn.Module):
        raise AmpError(f"ampkit.tune needs an nn.Module, got {type(model).__name__}.")
    if not isinstance(batches, Sequence) or len(batches) == 0:
        raise AmpError("ampkit.tune needs a non-empty list of calibration batches (inputs, targets).")
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise AmpError(f"budget {budget!r}: a positive relative loss deviation, e.g. 0.01 for 1%.")
    bad = [c for c in candidates if c not in ("bf16", "fp16", "fp8")]
    if bad or not candidates:
        raise AmpError(f"candidates {list(candidates)!r}: choose from 'bf16', 'fp16', 'fp8'.")
    if not isinstance(probe_steps, int) or probe_steps < 1:
        raise AmpError(f"probe_steps {probe_steps!r}: at least 1.")
    if not measure.candidate_modules(model):
        raise AmpError("this model has no module with parameters of its own below the root: nothing to tune.")


def _choose(dtype: str, modules: list[tuple[str, nn.Module]], times: dict[str, dict[str, float]],
            sens: dict[str, tuple[float, float]], budget: float, grad_limit: float,
            ) -> tuple[str, list[ModuleChoice]]:  # fmt: skip
    """Greedy: by time saved per unit of loss deviation, while the deviations' sum fits."""
    info: dict[str, tuple[str, float, float, float, float]] = {}  # name -> (reason, fp32, low, loss, grad)
    order = []
    for name, _m in modules:
        t = times.get(name, {})
        fp32, low = t.get("fp32", math.nan), t.get(dtype, math.nan)
        loss_dev, grad_dev = sens.get(name, (math.nan, math.nan))
        if name not in times or name not in sens:
            reason = "not measured within max_seconds" if dtype != "fp32" else "no 16-bit dtype to try here"
        elif not math.isfinite(loss_dev) or not math.isfinite(grad_dev):
            reason = f"non-finite loss or grads in {dtype}"
        elif grad_dev > grad_limit:
            reason = f"gradient moves {grad_dev:.1%} alone in {dtype} (limit {grad_limit:.0%})"
        elif low >= fp32:
            reason = f"no faster in {dtype} ({low:.3f} ms vs {fp32:.3f} ms)"
        else:
            reason = ""
            order.append(name)
        info[name] = (reason, fp32, low, loss_dev, grad_dev)
    order.sort(key=lambda n: -(info[n][1] - info[n][2]) / max(info[n][3], 1e-12))
    used, lowered = 0.0, set()
    for name in order:
        if used + info[name][3] <= budget:
            used += info[name][3]
            lowered.add(name)
    choices = []
    for name, m in modules:
        reason, fp32, low, loss_dev, grad_dev = info[name]
        if name in lowered:
            reason = f"saves {fp32 - low:.3f} ms for {loss_dev:.1e} of the budget"
        elif not reason:
            reason = "the budget is spent on modules that save more per unit of deviation"
        choices.append(ModuleChoice(name, type(m).__name__, dtype if name in lowered else "fp32", fp32, low,
                                    loss_dev, grad_dev, reason))  # fmt: skip
    return dtype, choices


def _probe_losses(model: nn.Module, batches: Sequence[Batch], loss_fn: LossFn | None, policy: Policy | None,
                  device_type: str, steps: int, optimizer: OptimizerFactory | None) -> list[float]:  # fmt: skip
    """Train a copy of ``model`` for ``steps`` steps (fp32 when ``policy`` is None)."""
    net = copy.deepcopy(model)
    opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3)))(list(net.parameters()))
    fp16 = policy is not None and policy.dtype == torch.float16
    scaler = torch.amp.GradScaler(device_type) if fp16 else None
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for step in range(steps):
            with measure.scope(policy, device_type):
                loss = measure.loss_of(net, batches[step % len(batches)], loss_fn)
            if scaler is not None:
                scaler.scale(loss.float()).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.float().backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    return losses


def _tail(losses: list[float]) -> float:
    k = max(1, len(losses) // 4)
    return sum(losses[-k:]) / k


def _confirm(model: nn.Module, batches: Sequence[Batch], loss_fn: LossFn | None, dtype: str,
             choices: list[ModuleChoice], device_type: str, steps: int, optimizer: OptimizerFactory | None,
             budget: float, max_backoffs: int) -> tuple[dict[str, float], list[ModuleChoice], list[str]]:  # fmt: skip
    """Probe the plan against fp32 (and everything lowered, for comparison); put the most
    sensitive lowered module back to fp32 while the probe misses the budget."""
    from ampkit.casting.policy import default_policy

    ref = _tail(_probe_losses(model, batches, loss_fn, None, device_type, steps, optimizer))
    probe = {"steps": float(steps), "fp32_loss": ref}
    if dtype == "fp32":
        return dict(probe, plan_loss=ref, deviation=0.0), choices, []
    base = default_policy(device_type, DTYPES[dtype])
    uniform = _tail(_probe_losses(model, batches, loss_fn, base, device_type, steps, optimizer))
    probe.update(uniform_loss=uniform, uniform_deviation=measure.deviation(uniform, ref))
    backed: list[str] = []
    while True:
        kept = {c.name: torch.float32 for c in choices if c.dtype == "fp32"}
        lowered = [c for c in choices if c.dtype != "fp32"]
        loss = ref if not lowered else _tail(_probe_losses(
            model, batches, loss_fn, base.override(module_rules=kept), device_type, steps, optimizer))  # fmt: skip
        deviation = measure.deviation(loss, ref)
        if deviation <= budget or not lowered or len(backed) >= max_backoffs:
            break
        worst = max(lowered, key=lambda c: c.loss_deviation)
        backed.append(worst.name)
        choices = [c if c is not worst else ModuleChoice(
            c.name, c.kind, "fp32", c.fp32_ms, c.low_ms, c.loss_deviation, c.grad_deviation,
            f"put back to fp32: the probe missed the budget ({deviation:.2e})") for c in choices]  # fmt: skip
    if deviation > budget and lowered:  # still over after max_backoffs: nothing lowered is confirmed
        backed += [c.name for c in lowered]
        choices = [c if c.dtype == "fp32" else ModuleChoice(
            c.name, c.kind, "fp32", c.fp32_ms, c.low_ms, c.loss_deviation, c.grad_deviation,
            f"put back to fp32: the probe still missed the budget after {max_backoffs} back-offs") for c in choices]  # fmt: skip
        loss, deviation = ref, 0.0
    return dict(probe, plan_loss=loss, deviation=deviation), choices, backed
