"""The tuner's measurements: which modules are candidates, which 16-bit dtypes this
hardware computes natively, what each module costs per dtype (forward + backward alone,
on the inputs it saw), and how much the loss and the gradient move when only that
module runs in 16 bits."""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit._internal.dtypes import DTYPES_BY_NAME as DTYPES
from ampkit.casting.engine import autocast
from ampkit.casting.policy import Policy, default_policy, exact_name
from ampkit.levels.fp8.recipe import Fp8Recipe, convertible
from ampkit.levels.fp8.training import converted
from ampkit.levels.precision_plan import FP8

from .progress import Progress

__all__ = ["Batch", "Call", "LossFn", "FP8_CAPABILITY", "output_energy", "candidate_modules", "fp8_linears",
           "native_dtypes", "module_times", "sensitivities", "loss_of", "scope", "seeded", "deviation", "sync"]  # fmt: skip

Batch = Any  # (inputs, targets); inputs a tensor or a tuple of positional arguments
LossFn = Callable[[Any, Any], torch.Tensor]


def candidate_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules the tuner decides on: every module below the root holding floating
    parameters of its own (linears, convolutions, embeddings, norms, attention's
    projections), in model order."""
    return [(name, m) for name, m in model.named_modules()
            if name and any(p.is_floating_point() for p in m.parameters(recurse=False))]  # fmt: skip


#: fp8 matmuls run on tensor cores from this CUDA compute capability on (Ada, Hopper, Blackwell).
FP8_CAPABILITY = (8, 9)


def fp8_linears(modules: Sequence[tuple[str, nn.Module]]) -> list[str]:
    """The candidate modules fp8 can convert, as :meth:`ampkit.Fp8Recipe.choose` sees
    them: ``nn.Linear`` exactly, feature sizes multiples of 16."""
    return [name for name, m in modules if convertible(m)]


def _fp8_unavailable(device_type: str, include_emulated: bool) -> str | None:
    """Why fp8 is not worth measuring here (None: it is)."""
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < FP8_CAPABILITY:
            return (f"this GPU (compute capability {major}.{minor}) has no fp8 tensor cores "
                    "(8.9 and up: Ada, Hopper, Blackwell)")  # fmt: skip
        return None
    if device_type == "cpu":
        if include_emulated:
            return None
        return ("this CPU has no fp8 arithmetic: torch's CPU fp8 matmul emulates it, slower than fp32 "
                "(include_emulated=True measures it anyway)")  # fmt: skip
    return f"fp8 is measured on CUDA GPUs (and emulated on CPUs), not on {device_type!r}"


def native_dtypes(candidates: Sequence[str], device_type: str, include_emulated: bool) -> tuple[list[str], dict[str, str]]:
    """The candidates worth measuring here, and the others with why not: the 16-bit
    ones first, then ``"fp8"`` (which needs one of them: its linears' outputs and the
    rest of the model compute in it). ``include_emulated`` tries bf16/fp16/fp8 even
    where the CPU emulates them."""
    tried: list[str] = []
    skipped: dict[str, str] = {}
    for name in candidates:
        if name == FP8:
            continue
        dtype = DTYPES[name]
        if device_type == "cuda":
            if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
                skipped[name] = "this GPU has no bf16 arithmetic"
                continue
        elif device_type == "cpu" and not include_emulated:
            native = torch_compat.cpu_has_native_16bit(dtype)
            if not native:
                need = "AVX-512-bf16 or AMX" if dtype == torch.bfloat16 else "AMX-FP16"
                skipped[name] = (f"this CPU emulates {name} (no {need}): slower than fp32 "
                                 "(include_emulated=True measures it anyway)")  # fmt: skip
                continue
        tried.append(name)
    if FP8 in candidates:
        why = _fp8_unavailable(device_type, include_emulated)
        if why is None and not tried:
            why = ("fp8 linears compute inside a 16-bit level (their outputs, and the rest of the model): "
                   "no 16-bit candidate is tried here; add 'bf16' or 'fp16' to candidates")  # fmt: skip
        if why is None:
            tried.append(FP8)
        else:
            skipped[FP8] = why
    return tried, skipped


class Call(NamedTuple):
    """A recorded model call (``ampkit tune script.py``): positional and keyword
    arguments, used as a batch without targets."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _inputs(batch: Batch) -> tuple[Any, ...]:
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def loss_of(model: nn.Module, batch: Batch, loss_fn: LossFn | None) -> torch.Tensor:
    """The training loss of ``model`` on ``batch``: ``loss_fn(model(*inputs), targets)``,
    or ``model(*inputs)`` itself when ``loss_fn`` is None; for a :class:`Call`,
    ``loss_fn(model(*args, **kwargs), None)``."""
    if isinstance(batch, Call):
        out = model(*batch.args, **batch.kwargs)
        return out if loss_fn is None else loss_fn(out, None)
    out = model(*_inputs(batch))
    return out if loss_fn is None else loss_fn(out, batch[1])


def output_energy(output: Any, _targets: Any = None) -> torch.Tensor:
    """A stand-in loss where the script's own is not known (``ampkit tune script.py``):
    the mean square of the model's floating outputs, in fp32. Its deviation tracks how
    far 16 bits move the outputs; its gradient reaches every parameter the outputs
    depend on."""
    leaves = [t for t in torch_compat.tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise TypeError("the model returned no floating tensor to tune on")
    return sum(t.float().pow(2).mean() for t in leaves) / len(leaves)


def scope(policy: Policy | None, device_type: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if policy is None else autocast(policy, device_type)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """The same random draws (dropout masks, a model's own ``random`` calls) in every run
    compared: torch's and Python's generators seeded, the caller's states put back after."""
    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            yield
    finally:
        random.setstate(state)


def _captured(model: nn.Module, modules: list[tuple[str, nn.Module]], batch: Batch, loss_fn: LossFn | None,
              ) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:  # fmt: skip
    """Each module's inputs on ``batch`` (the first call), detached."""
    seen: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in seen:
                seen[name] = torch_compat.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t,
                                                   (args, kwargs))  # fmt: skip
        return record

    handles = [m.register_forward_pre_hook(hook(name), with_kwargs=True) for name, m in modules]
    try:
        with torch.no_grad(), seeded(0):
            loss_of(model, batch, loss_fn)
    finally:
        for h in handles:
            h.remove()
    return seen


def _run_once(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """One forward and backward of ``module`` alone; input grads included."""
    args, kwargs = torch_compat.tree_map(
        lambda t: t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        (args, kwargs))  # fmt: skip
    leaves = [t for t in torch_compat.tree_flatten(module(*args, **kwargs))[0]
              if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip
    if leaves:
        torch.autograd.backward([t.float().sum() for t in leaves])


def sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def _fastest(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], policy: Policy | None,
             device_type: str, repeats: int) -> float:  # fmt: skip
    """The fastest of ``repeats`` forward + backward runs after one warm-up, in ms."""
    best = math.inf
    for i in range(repeats + 1):
        with scope(policy, device_type):
            sync(device_type)
            start = time.perf_counter()
            _run_once(module, args, kwargs)
            sync(device_type)
            took = time.perf_counter() - start
        if i:  # the first run warms caches up
            best = min(best, took)
    return 1e3 * best


def module_times(model: nn.Module, modules: list[tuple[str, nn.Module]], batch: Batch, loss_fn: LossFn | None,
                 dtypes: Sequence[str], device_type: str, repeats: int, deadline: float,
                 report: Progress | None = None) -> dict[str, dict[str, float]]:  # fmt: skip
    """``{name: {"fp32": ms, "bf16": ms, ..., "fp8": ms}}``: each module's forward +
    backward alone on the inputs it saw on ``batch``, the fastest of ``repeats`` runs
    after one warm-up, under ``ampkit.autocast`` in each 16-bit dtype of ``dtypes``; with
    ``"fp8"`` in ``dtypes``, each linear also converted to fp8 (default
    :class:`ampkit.Fp8Recipe`) under the first 16-bit dtype's autocast. A module the
    forward never calls (``nn.MultiheadAttention``'s ``out_proj``: its parent uses the
    weights directly) has an empty entry; modules not reached before ``deadline``
    (``time.perf_counter()``) are left out. ``report`` is told of each module and dtype
    as it is timed, and of each module done."""
    report = report if report is not None else Progress(False)
    report.now("the first batch, to record each module's inputs")
    inputs = _captured(model, modules, batch, loss_fn)
    policies: dict[str, Policy | None] = {"fp32": None}
    for name in dtypes:
        if name != FP8:
            policies[name] = default_policy(device_type, DTYPES[name])
    fp8 = set(fp8_linears(modules)) if FP8 in dtypes and len(policies) > 1 else set()
    companion = next((k for k in policies if k != "fp32"), None)
    out: dict[str, dict[str, float]] = {}
    for name, module in modules:
        if name not in inputs:  # never called: its parent uses its parameters directly
            out[name] = {}
            report.advance()
            continue
        if time.perf_counter() > deadline:
            continue
        args, kwargs = inputs[name]
        times = {}
        for key, policy in policies.items():
            report.now(f"{name} ({type(module).__name__}) in {key}")
            times[key] = _fastest(module, args, kwargs, policy, device_type, repeats)
        if name in fp8:
            report.now(f"{name} ({type(module).__name__}) in fp8")
            with converted(Fp8Recipe(), [(name, module)]):
                times[FP8] = _fastest(module, args, kwargs, policies[companion], device_type, repeats)
        module.zero_grad(set_to_none=True)
        out[name] = times
        report.advance()
    return out


def _loss_and_grad(model: nn.Module, batch: Batch, loss_fn: LossFn | None, policy: Policy | None,
                   device_type: str, seed: int) -> tuple[float, torch.Tensor]:  # fmt: skip
    model.zero_grad(set_to_none=True)
    with seeded(seed):
        with scope(policy, device_type):
            loss = loss_of(model, batch, loss_fn)
        loss.float().backward()
    grads = [p.grad.detach().double().reshape(-1) for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), torch.cat(grads) if grads else torch.zeros(0, dtype=torch.float64)


def deviation(value: float, ref: float) -> float:
    if not math.isfinite(value):
        return math.inf
    return abs(value - ref) / max(abs(ref), 1e-12)


def sensitivities(model: nn.Module, names: Sequence[str], batches: Sequence[Batch], loss_fn: LossFn | None,
                  dtype: str, device_type: str, deadline: float, companion: str = "bf16",
                  report: Progress | None = None) -> dict[str, tuple[float, float]]:  # fmt: skip
    """``{name: (loss deviation, grad deviation)}`` with only that module in ``dtype``
    (every other module pinned to fp32 by a module rule), against fp32, averaged over
    ``batches``. ``dtype`` ``"fp8"``: the module (a linear) converted to fp8, its output
    in ``companion``. Modules not reached before ``deadline`` are left out. ``report`` is
    told of each module as it is measured, and when it is done."""
    report = report if report is not None else Progress(False)
    low = DTYPES[companion if dtype == FP8 else dtype]
    base = default_policy(device_type, low)
    report.now(f"the fp32 reference over {len(batches)} batches")
    refs = [_loss_and_grad(model, b, loss_fn, None, device_type, seed) for seed, b in enumerate(batches)]
    out: dict[str, tuple[float, float]] = {}
    for name in names:
        if time.perf_counter() > deadline:
            break
        report.now(f"{name} ({type(model.get_submodule(name)).__name__}) alone in {dtype}")
        policy = base.override(module_rules={exact_name(name): low, "*": torch.float32})  # the name exactly
        loss_dev = grad_dev = 0.0
        lowered = (converted(Fp8Recipe(), [(name, model.get_submodule(name))]) if dtype == FP8
                   else contextlib.nullcontext())  # fmt: skip
        with lowered:
            runs = [_loss_and_grad(model, b, loss_fn, policy, device_type, seed) for seed, b in enumerate(batches)]
        for (loss, grad), (ref_loss, ref_grad) in zip(runs, refs):
            loss_dev += deviation(loss, ref_loss)
            finite = bool(torch.isfinite(grad).all()) and grad.shape == ref_grad.shape
            norm = float(ref_grad.norm())
            grad_dev += float((grad - ref_grad).norm()) / max(norm, 1e-30) if finite else math.inf
        out[name] = (loss_dev / len(batches), grad_dev / len(batches))
        report.advance()
    return out
