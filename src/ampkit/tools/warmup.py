"""``ampkit warmup``: compile the optimizer update kernels into Inductor's on-disk cache
ahead of a job, so that the job's first O2/O2K step loads them instead of compiling.

O2 (master weights, one-pass update) and O2K (compensated bf16) step Adam, AdamW and
SGD through kernels that ``torch.compile`` builds at the first step: about 10-40 s on a
cold cache (gcc compiles the C++), seconds from a warm one. A kernel is compiled once per
process for each update rule (Adam/AdamW, SGD with momentum, SGD with Nesterov momentum,
plain SGD), 16-bit dtype and device type; parameter shapes and hyperparameter values do
not matter, but the thread count does: Inductor keeps a CPU kernel per thread count
(``torch.get_num_threads()``; ``torchrun`` and ``OMP_NUM_THREADS=1`` make it 1), so a
warm-up compiles at 1 thread and at this machine's default, or at the ``threads`` asked
for. The cache is Inductor's (``TORCHINDUCTOR_CACHE_DIR``, default
``/tmp/torchinductor_<user>``): warm up with the same variable, torch and machine as
the job, e.g. in a container image's build step. fp16 at O2 with a dynamic loss scale
(the default) steps with torch's kernels: nothing to compile, and the result says so.

Each warm-up trains one step of a small model (a 512x256 linear layer and a LayerNorm)
through the real ``initialize`` path, in this process, then resets ampkit: run it in a
process of its own (the command does), not inside a training script.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
from torch import nn

from ampkit._internal import inductor_compat
from ampkit._internal.dtypes import DTYPES_BY_NAME
from ampkit.errors import AmpError
from ampkit.levels.opt_level import level_names

__all__ = ["OPTIMIZERS", "WarmResult", "compiled_levels", "warm"]

#: the optimizer configurations with a kernel of their own
OPTIMIZERS: dict[str, str] = {
    "adamw": "torch.optim.AdamW (also Adam: the same kernel)",
    "sgd": "torch.optim.SGD with momentum",
    "nesterov": "torch.optim.SGD with Nesterov momentum",
    "sgd-plain": "torch.optim.SGD without momentum",
}


def compiled_levels(dtype: str = "bf16") -> tuple[str, ...]:
    """The levels whose step runs compiled update kernels, those that compute in
    ``dtype`` (``"bf16"``/``"fp16"``; a bf16-only level is no fp16 one)."""
    return level_names(lambda d: d.steps_compiled and (dtype == "bf16" or not d.bf16_only))


@dataclasses.dataclass(frozen=True)
class WarmResult:
    """One warmed configuration: ``level``, ``dtype`` (``"bf16"``/``"fp16"``),
    ``optimizer`` (a key of :data:`OPTIMIZERS`), ``device``, ``threads`` (torch's thread
    count it was compiled for), ``seconds`` (the step, compiles included) and
    ``compiled`` (whether the step compiled anything: False where no C++ compiler is
    found, or where the level steps with torch's kernels, e.g. fp16 at O2 with a
    dynamic loss scale)."""

    level: str
    dtype: str
    optimizer: str
    device: str
    threads: int
    seconds: float
    compiled: bool


def _optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "nesterov":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True)
    return torch.optim.SGD(params, lr=1e-2)


def _one(level: str, dtype: torch.dtype, optimizer: str, device: str) -> bool:
    """Train one step at ``level``; whether the step compiled anything (everything is
    compiled again: the warm-up writes what the job's first step will look up)."""
    import ampkit as amp
    from ampkit.levels import update_kernels

    torch.compiler.reset()
    update_kernels.forget_compiled()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 256), nn.LayerNorm(256)).to(device)  # 131k weights: every kernel
    opt = _optimizer(optimizer, list(model.parameters()))
    try:
        model, opt = amp.initialize(model, opt, opt_level=level, dtype=dtype)
        loss = model(torch.randn(8, 512, device=device)).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    finally:
        amp.reset()
    return update_kernels.compiled_functions() > 0


def warm(
    levels: Sequence[str] | None = None,
    dtype: str = "bf16",
    optimizers: Sequence[str] = ("adamw",),
    device: str = "cpu",
    threads: Sequence[int] | None = None,
) -> list[WarmResult]:
    """Compile the update kernels of ``levels`` (those of :func:`compiled_levels`, ``"O2"``
    and ``"O2K"``; None: all of them for ``dtype``) x ``optimizers`` (keys of
    :data:`OPTIMIZERS`) for ``dtype`` (``"bf16"`` default, or ``"fp16"``: not O2K) on
    ``device`` (``"cpu"`` default, or ``"cuda"``) at each of ``threads`` (torch thread
    counts; default None: 1 and this process's ``torch.get_num_threads()``) into
    Inductor's on-disk cache. Sets ampkit up and resets it for each configuration, and
    sets torch's thread count (restored at the end): call it in a process of its own.
    Raises :class:`ampkit.AmpError` for an unknown level, dtype, optimizer, thread count
    or an unavailable device, before anything is compiled."""
    if dtype not in ("bf16", "fp16"):
        raise AmpError(f"dtype {dtype!r}: choose bf16 or fp16.")
    levels = compiled_levels(dtype) if levels is None else levels
    bad = [x for x in levels if x not in compiled_levels()]
    if bad or not levels:
        raise AmpError(f"levels {list(levels)!r}: choose from {', '.join(compiled_levels())} (the levels that compile kernels).")
    bad = [x for x in optimizers if x not in OPTIMIZERS]
    if bad or not optimizers:
        raise AmpError(f"optimizers {list(optimizers)!r}: choose from {', '.join(OPTIMIZERS)}.")
    bf16_only = [x for x in levels if x not in compiled_levels(dtype)]
    if bf16_only:
        raise AmpError(f"{', '.join(bf16_only)} computes in bf16 only; drop it or use --dtype bf16.")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise AmpError(f"device {device!r} is not available here; use cpu" + (" or cuda." if torch.cuda.is_available() else "."))
    counts = sorted({1, torch.get_num_threads()} if threads is None else set(threads))
    if not counts or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in counts):
        raise AmpError(f"threads {list(threads or [])!r}: give thread counts of 1 or more.")
    out = []
    before = torch.get_num_threads()
    try:
        for n in counts:
            torch.set_num_threads(n)
            for level in levels:
                for name in optimizers:
                    start = time.perf_counter()
                    compiled = _one(level, DTYPES_BY_NAME[dtype], name, device)
                    out.append(WarmResult(level, dtype, name, device, n, time.perf_counter() - start, compiled))
    finally:
        torch.set_num_threads(before)
    return out


def cache_dir() -> str:
    """Inductor's on-disk cache folder in this process."""
    return inductor_compat.inductor_cache_dir()
