"""Elementwise update kernels: one pass over every tensor an optimizer step touches.

A kernel is a plain function of 1-D tensors and a 1-D fp32 tensor of scalars,
written with torch ops. It runs in one of two modes:

``"compiled"``
    ``torch.compile(fn, dynamic=True, fullgraph=True)``: Inductor fuses the whole
    function into one loop that reads each input once and writes each output in
    place, with no full-size temporaries. One compilation per kernel, dtype combination
    and process; every tensor size of 2 elements or more reuses it (a one-element tensor
    runs op by op, so that no second copy is compiled). Seconds to a minute on an
    empty Inductor cache (gcc compiling the C++; Inductor's checks of the CPU's
    instruction sets run side by side), seconds from the on-disk cache, which ``ampkit
    warmup`` fills ahead of a job (docs/benchmarks/first_step.md has the recorded
    figures). Inductor's cache keeps a CPU kernel per thread count: warm up at the job's.
    Compiles run inside
    ``ampkit._internal.inductor_compat.known_cpu_isa``, which answers Inductor's
    instruction-set checks from the answers an earlier process recorded.
``"eager"``
    The same function run op by op on slices of at most ``chunk_numel`` elements,
    so its fp32 temporaries stay bounded. The fallback where compiling fails.

Inductor keeps intermediates in fp32: a round trip ``x.to(bfloat16).float()``
inside a kernel is folded away, so a kernel that needs a rounding error computes
the rounding explicitly (see ``ampkit.trainer.optimizer_rules``). Before first use, the
compiled kernel is run on random data beside the eager function and must match
it bit for bit; otherwise (and when compiling fails, or no C++ compiler is found) the
eager mode is used, with a warning.

Tensors are passed as they are (dense, one layout across a call's roles) or flattened
(see :func:`flat`). Each compiled call costs tens of microseconds of Python and guard
overhead, so when there are more than ``BATCH_MIN_COUNT`` tensors below
``DIRECT_NUMEL`` elements, those are gathered into flat staging buffers (one
multi-tensor copy per role), run in one call, and copied back (one multi-tensor copy
per written role; at most ``batch_numel`` elements per role and call). The staging
buffers and their views are kept for the next call with the same shapes (the views
cost more to make than the copies: about 2 us each), at most ``STAGING_ENTRIES`` sets
per kernel, dropped by :func:`ampkit.reset`. A role whose tensors are already the
consecutive pieces of one buffer (:func:`tiled`: the moments and compensation that
ampkit makes, :func:`~ampkit.trainer.optimizer_rules.zeros_tiled`) is run on that
buffer directly, with no copy in or out; a role of tensors made apart (a load, a swap
through ``.data``) is staged as before. Results are deterministic for a given mode;
the two modes may differ in the last bit (fused multiply-adds, evaluation order).
Scalars travel as a tensor so that a changing learning rate recompiles nothing.
Every kernel also takes a *skip flag*, one more scalar after the update's own: where it
is > 0 (a step found inf/NaN grads), every tensor the kernel writes keeps its value,
bit for bit, and nothing is read back to the host: a step can be skipped on the device
(:mod:`ampkit.trainer.device_skip`). The compiled kernel selects the old or new value of
each element in the same pass; op by op the old values are copied aside first (only when a
flag is given: a step decided on the host passes none and runs the update alone). Where
the compiled kernel with the select is not the eager update bit for bit (seen with the
exact Kahan update on torch 2.9's Inductor), the update is compiled without it, and a
call given a flag reads it on the host first (one sync; logged once at INFO).
With ``AMPKIT_COMPILE_AHEAD=1``, ``initialize`` compiles the kernels a level's first
step will take in a background thread (:func:`compile_ahead`).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import logging
import operator
import os
import threading
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch

from ampkit._internal import inductor_compat, torch_compat
from ampkit._internal import registry as _reset
from ampkit.trainer.optimizer_rules import BATCHED_BELOW_NUMEL

__all__ = [
    "Kernel", "KernelMode", "flat", "same_layout", "resolve_mode", "compile_ahead", "COMPILE_AHEAD_VAR",
    "forget_compiled", "compile_ahead_enabled", "compiled_functions", "compiled_without_flag", "tiled",
]

_LOG = logging.getLogger("ampkit")
# Kernel registry: the device types whose kernel compiling has been announced in this
# process (one message each: the first compiled step can take a minute).
ANNOUNCED_DEVICES: set[str] = set()
#: A compile still running after this many seconds is announced (at WARNING, once per
#: device type and process); every compile is logged when it ends, with its duration
#: (INFO; WARNING from ``SLOW_COMPILE_S`` and for the compile that was announced).
ANNOUNCE_AFTER_S = 2.0
SLOW_COMPILE_S = 5.0

KernelMode = Literal["auto", "compiled", "eager"]
# From this size on a tensor gets a call of its own: below it a call's overhead costs
# more than concatenating and copying back (measured on CPU: AdamW over 20 tensors of
# 16k-65k elements took 2.4 ms per step in own calls, 2.8-3.5 ms batched).
DIRECT_NUMEL = BATCHED_BELOW_NUMEL
# Small tensors are batched only when there are more than this many: below it the
# per-call overhead is small and batching's copies would cost memory for nothing.
BATCH_MIN_COUNT = 8
#: Sets of staging buffers a kernel keeps (one per list of shapes, dtypes, device and
#: thread; the least recently used dropped): a model's param groups times its 16-bit dtypes.
STAGING_ENTRIES = 4
_lock = threading.Lock()
_staging_lock = threading.Lock()
_WITH_STAGING: weakref.WeakSet[Kernel] = weakref.WeakSet()


# Kernel registry: every kernel made in this process (forget_compiled clears them).
_ALL: weakref.WeakSet[Kernel] = weakref.WeakSet()


def forget_compiled() -> None:
    """Drop every kernel's compiled functions and the compiled rounding check: each is
    compiled (and probed) again at its next use, e.g. after Inductor's settings changed
    in this process. Kernels being compiled meanwhile keep their result."""
    with _lock:
        for kernel in list(_ALL):
            kernel._compiled.clear()
        _round_check.clear()


@_reset.on_reset
def release_staging() -> None:
    """Drop every kernel's staging buffers (their memory goes back to the allocator)."""
    with _staging_lock:
        for kernel in list(_WITH_STAGING):
            kernel._staging.clear()


def _announce_later(device_type: str, what: str) -> threading.Timer | None:
    """Announce, once per device type and process, a compile still running after
    ``ANNOUNCE_AFTER_S`` (at once when that is 0): the first compiled step can take a
    minute on a cold cache, and a silent minute looks like a hang. Returns the timer to
    cancel when the compile ends (None when announced already or at once)."""
    if device_type in ANNOUNCED_DEVICES:
        return None

    def announce() -> None:
        if device_type in ANNOUNCED_DEVICES:
            return
        ANNOUNCED_DEVICES.add(device_type)
        _LOG.warning(
            "ampkit: compiling the %s for %s with torch.compile (once per process, at the first step that "
            "needs it: up to a minute while inductor's on-disk cache at %s is cold, seconds once `ampkit "
            "warmup` or an earlier process with the same torch and thread count filled it).",
            what, device_type, inductor_compat.inductor_cache_dir()
        )

    if ANNOUNCE_AFTER_S <= 0:
        announce()
        return None
    timer = threading.Timer(ANNOUNCE_AFTER_S, announce)
    timer.daemon = True
    timer.start()
    return timer


@contextlib.contextmanager
def _compile_notice(device_type: str, what: str) -> Iterator[None]:
    """Around one compile (and probe) of ``what`` for ``device_type``: announced once it
    runs for ``ANNOUNCE_AFTER_S`` (see :func:`_announce_later`); when it succeeds, logged
    with its duration, at WARNING where it was slow or the announcement was its own (a
    "compiling" line is always followed by its "compiled" line, or by the error)."""
    announced_before = device_type in ANNOUNCED_DEVICES
    timer = _announce_later(device_type, what)
    start = time.perf_counter()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()  # an announcement already under way is made before the end is logged
    took = time.perf_counter() - start
    announced = not announced_before and device_type in ANNOUNCED_DEVICES
    _LOG.log(
        logging.WARNING if took >= SLOW_COMPILE_S or announced else logging.INFO,
        "ampkit: compiled the %s for %s in %.1f s (inductor's on-disk cache: %s; a later process with the "
        "same cache compiles it in seconds).", what, device_type, took, inductor_compat.inductor_cache_dir(),
    )


def _failure_level() -> int:
    """WARNING for a compile that failed; DEBUG once the main thread has ended (a compile
    ahead still running at interpreter exit fails as Python shuts down: nothing to tell)."""
    return logging.WARNING if threading.main_thread().is_alive() else logging.DEBUG


def compiled_functions() -> int:
    """How many compiled functions the kernels (and the rounding check) hold now in this
    process: ``ampkit warmup`` tells a configuration that compiled something from one
    that ran torch's kernels only."""
    with _lock:
        return sum(f is not None for kernel in _ALL for f in kernel._compiled.values()) + sum(
            f is not None for f in _round_check)


def compiled_without_flag() -> list[str]:
    """The names of the kernels compiled in this process without the skip flag's select
    (its compiled form was not the eager update bit for bit): a step they run that was
    decided on the device reads its flag on the host."""
    with _lock:
        return sorted({kernel.name for kernel in _ALL for f in kernel._compiled.values() if f is not None and not f[1]})


def flat(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of every element of ``t`` in memory order, or None when ``t`` is
    not dense (gaps or overlaps between its elements)."""
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True)
    permuted = t.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else None


def same_layout(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the tensors have one shape, one set of strides and one device, so their
    flat views (:func:`flat`) correspond element by element."""
    first = tensors[0]
    return all(
        t.shape == first.shape and t.stride() == first.stride() and t.device == first.device
        for t in tensors[1:]
    )


class Kernel:
    """An elementwise update ``fn(*tensors, scalars, **static)`` that writes some of its
    tensor arguments in place.

    Args:
        name: for messages.
        fn: the update, on 1-D tensors of equal length.
        mutated: positions of the tensor arguments ``fn`` writes.
        example_dtypes: dtypes of the tensor arguments, for the compile probe.
        exact: whether the compiled kernel must match the op-by-op one bit for bit
            (default True: kernels that compute rounding errors need it). With False
            the probe allows 4 fp32 ulps (1 ulp in 16-bit outputs) of the larger of
            each element and the output's largest magnitude: ATen's vectorized
            ``sqrt`` is not correctly rounded on every CPU (e.g. AVX-512), while the
            compiled one is.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., None],
        mutated: Sequence[int],
        example_dtypes: Sequence[torch.dtype],
        exact: bool = True,
    ) -> None:
        self.name = name
        self.exact = exact
        self.fn = fn
        self.mutated = tuple(mutated)
        self.skippable = _skipping(fn, self.mutated)
        self.example_dtypes = tuple(example_dtypes)
        # key -> (the compiled kernel, whether it takes the skip flag), None: op by op
        self._compiled: dict[tuple, tuple[Callable[..., None], bool] | None] = {}
        # (thread, device, dtypes, shapes) -> per role (flat buffer, its views shaped as the tensors)
        self._staging: OrderedDict[tuple, list[tuple[torch.Tensor, list[torch.Tensor]]]] = OrderedDict()
        _ALL.add(self)

    def _compiled_fn(self, static: dict, num_scalars: int, device: torch.device, scalars_device: torch.device,
                     ) -> tuple[Callable[..., None], bool] | None:  # fmt: skip
        key = (device.type, scalars_device.type, *sorted(static.items()))
        if key in self._compiled:
            return self._compiled[key]
        with _lock:
            if key in self._compiled:
                return self._compiled[key]
            compiled: tuple[Callable[..., None], bool] | None
            try:
                with _compile_notice(device.type, f"{self.name} update kernel"):
                    with inductor_compat.known_cpu_isa() if device.type == "cpu" else contextlib.nullcontext():
                        compiled = self._compile_and_probe(static, num_scalars, device, scalars_device)
            except Exception as exc:  # no compiler, unsupported platform, ...
                _LOG.log(
                    _failure_level(), "ampkit: compiling the %s update kernel failed (%s: %s); using the "
                    "op-by-op version (same math, slower).", self.name, type(exc).__name__, exc
                )
                compiled = None
            self._compiled[key] = compiled
            return compiled

    def _compile_and_probe(self, static: dict, num_scalars: int, device: torch.device,
                           scalars_device: torch.device) -> tuple[Callable[..., None], bool]:  # fmt: skip
        """``torch.compile(fn)`` with the skip flag's select, run once on scratch tensors on
        the device the kernel will run on (a probe elsewhere would compile a second
        kernel): a compiler failure must not surface halfway through a real step, and the
        compiled arithmetic must be the eager one bit for bit (no contraction into fused
        multiply-adds, which would break the exact rounding-error computations). Where only
        the variant with the select fails that, the update is compiled alone (``False``:
        it takes no flag). Raises where the update alone fails too."""
        flagged = torch.compile(self.skippable, dynamic=True, fullgraph=True)
        g = torch.Generator().manual_seed(0)
        scalars = torch.rand(num_scalars, generator=g) * 0.5 + 0.25
        scalars[-1] = 0.0  # the skip flag: off
        scalars = scalars.to(scalars_device)
        probe = [(torch.randn(1031, generator=g) * 0.1).to(device, d) for d in self.example_dtypes]
        expected = [t.clone() for t in probe]
        self.fn(*expected, scalars, **static)
        same = _same_bits if self.exact else _close

        def matches_eager(compiled: Callable[..., None]) -> bool:
            out = [t.clone() for t in probe]
            compiled(*out, scalars, **static)
            return all(same(a, b) for a, b in zip(out, expected))

        if not matches_eager(flagged):
            alone = torch.compile(self.fn, dynamic=True, fullgraph=True)
            if not matches_eager(alone):
                raise RuntimeError("the compiled kernel's arithmetic differs from eager mode")
            _LOG.info("ampkit: the compiled %s update kernel with the skip flag's select is not the eager update bit "
                      "for bit on this torch; compiled without it, its steps read the flag on the host (one sync "
                      "each).", self.name)  # fmt: skip
            return alone, False
        skipped = [t.clone() for t in probe]
        scalars[-1] = 1.0  # the skip flag: on, with inf/NaN among the inputs
        for t in skipped:
            t[::7] = float("nan")
        kept = [t.clone() for t in skipped]
        flagged(*skipped, scalars, **static)
        if not all(_same_bits(a, b, nan_payload=True) for a, b in zip(skipped, kept)):
            raise RuntimeError("the compiled kernel writes tensors on a skipped step")
        return flagged, True

    def __call__(
        self,
        tensors: Sequence[Sequence[torch.Tensor]],
        scalars: torch.Tensor,
        *,
        mode: Literal["compiled", "eager"],
        chunk_numel: int,
        batch_numel: int,
        skip: torch.Tensor | None = None,
        **static: object,
    ) -> None:
        """Apply the kernel to ``tensors[role][i]`` for every ``i``: dense tensors with
        one shape and layout across roles (:func:`same_layout`), or their flat views
        (:func:`flat`). Small ones are joined per role in one C++ call each (no
        per-tensor Python), large ones flattened and run one by one. ``skip``: the
        step's found-inf flag (a 0-dim tensor on the tensors' device, > 0: leave every
        written tensor as it was; read on the device only); None: the step is taken."""
        if not tensors or not tensors[0]:
            return
        scalars = _with_flag(scalars, skip, tensors[0][0].device)
        run: Callable[..., None] | None = None
        if mode == "compiled":
            compiled = self._compiled_fn(static, scalars.numel(), tensors[0][0].device, scalars.device)
            if compiled is not None:
                run, takes_flag = compiled
                if skip is not None and not takes_flag:  # compiled without the select: read the flag here
                    if _skipped(skip):
                        return
                    skip = None  # taken: the update alone (it ignores the flag's scalar)
        eager = self.fn if skip is None else self.skippable
        small: list[int] = []
        total = 0  # elements of the small ones
        with torch.no_grad():
            for i, t in enumerate(tensors[0]):
                n = t.numel()
                if n == 0:
                    continue
                if n < DIRECT_NUMEL:
                    small.append(i)
                    total += n
                    continue
                args = [_flat(role[i]) for role in tensors]
                if run is not None:
                    run(*args, scalars, **static)
                else:
                    for start in range(0, n, chunk_numel):
                        eager(*[a[start : start + chunk_numel] for a in args], scalars, **static)
            if len(small) <= BATCH_MIN_COUNT:
                for i in small:
                    self._one(run, eager, [_flat(role[i]) for role in tensors], scalars, static)
                return
            if len(small) == len(tensors[0]) and total <= batch_numel:
                self._run_batch(run, eager, tensors, None, scalars, static)  # the usual case: all in one call
                return
            batch: list[int] = []
            size = 0
            for i in small + [-1]:
                n = tensors[0][i].numel() if i >= 0 else 0
                if batch and (i < 0 or size + n > batch_numel):
                    self._run_batch(run, eager, tensors, batch, scalars, static)
                    batch, size = [], 0
                if i >= 0:
                    batch.append(i)
                    size += n

    def _one(self, run: Callable[..., None] | None, eager: Callable[..., None], args: list[torch.Tensor],
             scalars: torch.Tensor, static: dict) -> None:  # fmt: skip
        """One call on one small tensor per role (flat). A one-element tensor runs op by
        op even in compiled mode: the compiled kernel is traced for sizes of 2 and more,
        and a size of 1 would compile (and cache) a second specialised copy."""
        (run if run is not None and args[0].numel() > 1 else eager)(*args, scalars, **static)

    def _run_batch(
        self,
        run: Callable[..., None] | None,
        eager: Callable[..., None],
        tensors: Sequence[Sequence[torch.Tensor]],
        batch: list[int] | None,
        scalars: torch.Tensor,
        static: dict,
    ) -> None:
        """The tensors at ``batch`` (None: all) joined per role, run in one call, and the
        mutated roles copied back."""
        roles = [list(role) if batch is None else [role[i] for i in batch] for role in tensors]
        if len(roles[0]) == 1:
            self._one(run, eager, [_flat(role[0]) for role in roles], scalars, static)
            return
        direct = _tiled_roles(roles)
        staging = self._staging_for(roles, [d is None for d in direct])
        args = []
        for tiled, staged, role in zip(direct, staging, roles):
            if tiled is None:
                torch_compat.foreach_copy_(staged[1], role)
                tiled = staged[0]
            args.append(tiled)
        (run or eager)(*args, scalars, **static)
        for pos in self.mutated:
            if direct[pos] is None:
                torch_compat.foreach_copy_(roles[pos], staging[pos][1])
            else:  # written through the buffer: autograd's in-place check must see each change
                torch.autograd.graph.increment_version(roles[pos])

    def _staging_for(
        self, roles: list[list[torch.Tensor]], staged: list[bool],
    ) -> list[tuple[torch.Tensor, list[torch.Tensor]] | None]:  # fmt: skip
        """A flat buffer per role where ``staged`` (None elsewhere) and its views shaped as
        the role's tensors (the roles share shapes; a role is of one dtype, as every caller
        groups them, and its first tensor's dtype keys it): kept from an earlier call with the
        same shapes, dtypes, staged roles, device and thread, else made (and the least recently
        used set dropped beyond ``STAGING_ENTRIES``)."""
        first = roles[0]
        key = (
            threading.get_ident(), first[0].device, tuple(role[0].dtype for role in roles), tuple(staged),
            tuple([t.shape for t in first]),
        )  # fmt: skip
        with _staging_lock:  # threads share the LRU (each stages into its own buffers)
            staging = self._staging.get(key)
            if staging is not None:
                self._staging.move_to_end(key)
                return staging
            staging = []
            for role, need in zip(roles, staged):
                if not need:
                    staging.append(None)
                    continue
                buf = torch_compat.flatten_dense(role)  # the role's size, dtype and device (values overwritten)
                staging.append((buf, list(torch_compat.unflatten_dense(buf, role))))
            self._staging[key] = staging
            while len(self._staging) > STAGING_ENTRIES:
                self._staging.popitem(last=False)
            _WITH_STAGING.add(self)
            return staging


def tiled(role: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D tensor of which ``role``'s tensors are the consecutive pieces, in order and
    with no gap (contiguous, of one dtype, inside the first one's storage: state made by
    :func:`~ampkit.trainer.optimizer_rules.zeros_tiled`), or None. A kernel runs on it
    in place of a staging copy. Checked at every call (a ``.data`` swap or a load replaces
    tensors): their addresses, sizes, contiguity and dtype, no per-tensor Python call."""
    if not _PLAIN.issuperset(map(type, role)):  # a subclass may have no storage of its own
        return None
    first = role[0]
    if role[1].data_ptr() != first.data_ptr() + first.nbytes:  # (the usual answer for tensors made apart)
        return None
    ptrs = list(map(torch.Tensor.data_ptr, role))
    sizes = list(map(_NBYTES, role))
    if list(itertools.accumulate(sizes[:-1], initial=ptrs[0])) != ptrs:
        return None
    dtype = first.dtype
    if not all(map(torch.Tensor.is_contiguous, role)) or set(map(_DTYPE, role)) != {dtype}:
        return None
    if any(map(torch.Tensor.is_neg, role)) or any(map(torch.Tensor.is_conj, role)):
        return None  # a lazily negated or conjugated view: its storage holds other values
    storage = first.untyped_storage()
    if ptrs[-1] + sizes[-1] > storage.data_ptr() + storage.nbytes():
        return None
    numel = (ptrs[-1] + sizes[-1] - ptrs[0]) // first.element_size()
    return torch.empty(0, dtype=dtype, device=first.device).set_(storage, first.storage_offset(), (numel,))


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_NBYTES = operator.attrgetter("nbytes")
_DTYPE = operator.attrgetter("dtype")


def _tiled_roles(roles: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor | None]:
    """:func:`tiled` per role; None also for a role whose memory overlaps an earlier
    tiled role's (it is staged: the kernel writes each role's buffer of its own), and
    None for every role where a staged tensor lies in the storage of a tiled one (roles
    that alias each other are written back in role order, as when all are staged)."""
    out: list[torch.Tensor | None] = []
    spans: list[tuple[int, int]] = []
    for role in roles:
        flat_role = tiled(role)
        if flat_role is not None:
            start = flat_role.data_ptr()
            end = start + flat_role.nbytes
            if any(start < e and s < end for s, e in spans):
                flat_role = None
            else:
                spans.append((start, end))
        out.append(flat_role)
    if spans and any(t is None for t in out):  # (identity: `in` would call Tensor.__eq__)
        storages = []
        for flat_role in out:
            if flat_role is not None:
                storage = flat_role.untyped_storage()
                storages.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        ptrs = sorted(itertools.chain.from_iterable(
            map(torch.Tensor.data_ptr, role) for role, flat_role in zip(roles, out) if flat_role is None))  # fmt: skip
        for start, end in storages:
            i = bisect.bisect_left(ptrs, start)
            if i < len(ptrs) and ptrs[i] < end:  # a staged tensor inside a tiled role's storage
                return [None] * len(roles)
    return out


def _skipping(fn: Callable[..., None], mutated: tuple[int, ...]) -> Callable[..., None]:
    """``fn`` with the skip flag (its scalars' last element): where it is > 0 the
    tensors at ``mutated`` keep their values (selected element by element, on the
    device: no host read)."""

    def skippable(*args: torch.Tensor, **static: object) -> None:
        keep = args[-1][-1] > 0
        before = [args[i].clone() for i in mutated]
        fn(*args, **static)
        for i, old in zip(mutated, before):
            args[i].copy_(torch.where(keep, old, args[i]))

    return functools.wraps(fn)(_own_code(skippable, fn.__name__))  # its name: what compiles report


def _own_code(fn: Callable[..., None], name: str) -> Callable[..., None]:
    """A copy of ``fn`` (a closure made by a wrapper) with a code object of its own,
    named ``name``: torch.compile keeps its compiled graphs (at most
    ``recompile_limit``) per code object, so wrappers of different updates must not
    share one."""
    return types.FunctionType(
        fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__,
    )  # fmt: skip


# Module state: a zero flag (a taken step's) per device, made once.
_NO_SKIP: dict[torch.device, torch.Tensor] = {}


# Module state: the skip flag last read on the host (a weak reference, its version, the
# answer): the kernels a step runs (one per param group and scalar set) read it once.
_last_read: tuple[weakref.ref, int, bool] | None = None


def _skipped(skip: torch.Tensor) -> bool:
    """Whether the step of flag ``skip`` is skipped, read on the host once per flag (for
    the kernels compiled without the flag's select)."""
    global _last_read
    last = _last_read
    version = torch_compat.tensor_version(skip)
    if last is not None and last[0]() is skip and last[1] == version:
        return last[2]
    answer = bool(skip > 0)
    _last_read = (weakref.ref(skip), version, answer)
    return answer


def _with_flag(scalars: torch.Tensor, skip: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``scalars`` with the skip flag appended (fp32; 0.0 when ``skip`` is None), on the
    CPU for CPU tensors, else on their ``device`` (where the kernel reads the flag: no
    host sync; one compiled kernel whether or not a flag is given)."""
    where = device if device.type != "cpu" else scalars.device
    flag = skip
    if flag is None:
        flag = _NO_SKIP.get(where)
        if flag is None:
            flag = _NO_SKIP[where] = torch.zeros(1, dtype=torch.float32, device=where)
    return torch.cat((scalars.to(where, non_blocking=True), flag.reshape(1).to(where, torch.float32)))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """:func:`flat` of ``t`` without autograd history (a compiled kernel traced for
    plain tensors would compile again for a parameter); ``t`` is dense."""
    view = flat(t.detach())
    assert view is not None, "update kernels take dense tensors"
    return view


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal within 4 fp32 ulps (1 ulp of a 16-bit dtype) of the larger of the element
    and the tensor's largest finite magnitude (a difference of two terms may cancel);
    NaN where the other is NaN."""
    eps = 4 * torch.finfo(torch.float32).eps if a.dtype == torch.float32 else torch.finfo(a.dtype).eps
    bf = b.float()
    finite = bf[torch.isfinite(bf)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return torch.allclose(a.float(), bf, rtol=eps, atol=eps * scale, equal_nan=True)


def _same_bits(a: torch.Tensor, b: torch.Tensor, nan_payload: bool = False) -> bool:
    """Bit for bit equal; with ``nan_payload``, a NaN may come back as another NaN (a
    16-bit NaN kept by a compiled kernel goes through fp32 and loses its payload)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    same = a.view(ints) == b.view(ints)
    if nan_payload:
        same |= a.isnan() & b.isnan()
    return bool(same.all())


# Kernel registry: which kernel flavour works in this process, per kernel (probed once).
_PROCESS_MODE: dict[str, Literal["compiled", "eager"]] = {}


def resolve_mode(mode: KernelMode) -> Literal["compiled", "eager"]:
    """``"auto"`` -> ``"compiled"`` where ``torch.compile`` can build CPU/accelerator
    code here (a C++ compiler is found), else ``"eager"``."""
    if mode != "auto":
        return mode
    cached = _PROCESS_MODE.get("auto")
    if cached is None:
        cached = "compiled" if _compiler_available() else "eager"
        _PROCESS_MODE["auto"] = cached
        if cached == "eager":
            _LOG.warning(
                "ampkit: torch.compile finds no C++ compiler here, so O2/O2K's update kernels run op by op "
                "(the same results, slower, more memory at the step); install gcc/g++ (or set CXX) to compile them."
            )
    return cached


#: ``AMPKIT_COMPILE_AHEAD=1``: ``initialize`` compiles the update kernels in the
#: background (off by default: on a warm cache it gains nothing measurable, and a process
#: that ends meanwhile waits for the compile to finish; on a cold cache the first step
#: waits only for what is left).
COMPILE_AHEAD_VAR = "AMPKIT_COMPILE_AHEAD"
#: A kernel to compile ahead: (kernel, its static arguments, the number of scalars,
#: the device of its tensors); ``None`` in place of the kernel: the bf16 rounding check.
AheadJob = tuple["Kernel | None", dict, int, torch.device]


def compile_ahead_enabled() -> bool:
    """Whether ``AMPKIT_COMPILE_AHEAD=1`` asks for compiling ahead (callers skip building
    the jobs when not)."""
    return os.environ.get(COMPILE_AHEAD_VAR, "").strip() == "1"


def compile_ahead(jobs: Sequence[AheadJob]) -> threading.Thread | None:
    """Start compiling ``jobs`` in a thread and return it (None: nothing to do -- not
    switched on by ``AMPKIT_COMPILE_AHEAD=1``, no job, each compiled already). The
    first step takes the very kernels this builds (a step that needs one still being
    compiled waits for it under the lock the compile holds, and compiles nothing
    twice), so results are those of a compile at the first step, bit for bit; a compile
    that fails is reported and falls back as it would at the step. Meanwhile the
    thread shares the interpreter with training (the step's Python runs slower while it
    compiles); what ``initialize``'s caller does before the first step -- the data
    loader, the first batch, the forward and backward -- overlaps the compile."""
    if not compile_ahead_enabled():
        return None
    todo: list[AheadJob] = []
    for job in jobs:
        kernel, static, _, device = job
        done = bool(_round_check) if kernel is None else (device.type, device.type, *sorted(static.items())) in kernel._compiled
        if not done and job not in todo:
            todo.append(job)
    if not todo:
        return None

    def run() -> None:
        if resolve_mode("auto") != "compiled":
            return
        for kernel, static, num_scalars, device in todo:
            try:
                with torch.no_grad():  # as the step calls them: one graph, no recompile there
                    if kernel is None:
                        compiled_round_check()
                    else:  # the update's scalars and the skip flag
                        scalars_at = device if device.type != "cpu" else torch.device("cpu")  # as _with_flag
                        kernel._compiled_fn(static, num_scalars + 1, device, scalars_at)
            except Exception as exc:  # reported by the compile itself; never raised in this thread
                _LOG.debug("ampkit: compiling ahead stopped: %s", exc)

    # not a daemon: a process ending mid-compile waits for it (a compile killed at exit
    # aborts the interpreter)
    thread = threading.Thread(target=run, name="ampkit-compile-ahead", daemon=False)
    thread.start()
    return thread


def _compiler_available() -> bool:
    return inductor_compat.cpp_compiler_available()


# --- is a 16-bit tensor its fp32 source rounded? (bf16, one read pass) -------------------

#: Tensors from this size on are compared by the compiled kernel (below it the exact
#: eager comparison is cheap and compiling would cost more than it saves).
ROUND_CHECK_NUMEL = 1 << 17


def _split(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` rounded to nearest with ``24 - log2(factor - 1)`` significant bits (Veltkamp
    splitting; see ``ampkit.trainer.optimizer_rules._split_bf16``; ties may go either way)."""
    t = x * factor
    return t - (t - x)


def _bf16_mismatch(low: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Whether some element of bf16 ``low`` is not fp32 ``g`` cast to bf16
    (round-to-nearest-even), as a 0-dim bool tensor; elements it cannot decide by
    arithmetic (|g| >= 2**112, inf/NaN, fp32 subnormals) count as mismatches, so a
    False is exact and a True is confirmed by the caller.

    ``r8`` is ``g`` rounded to bf16's 8 significant bits; where ``g`` is halfway
    between two bf16 values (it has 9 significant bits, the 9th set) the cast picks
    the even one (7 significant bits), which ``r8`` may not, so there ``low`` must be
    one of the two neighbours (as far from ``g`` as ``r8``) and even."""
    lowf = low.float()
    r8 = _split(g, 65537.0)
    tie = (_split(g, 32769.0) == g) & (r8 != g)
    even = _split(lowf, 131073.0) == lowf
    tie_ok = ((g - lowf).abs() == (g - r8).abs()) & even
    return (~torch.where(tie, tie_ok, r8 == lowf)).any()


# Kernel registry: the compiled rounding check, probed once per process (empty until then).
_round_check: list[Callable[..., torch.Tensor] | None] = []


def compiled_round_check() -> Callable[..., torch.Tensor] | None:
    """The compiled :func:`_bf16_mismatch`, probed once per process against the cast
    (random values, halfway cases, edited elements); None where compiling fails or
    the probe disagrees (a warning says so)."""
    if _round_check:
        return _round_check[0]
    with _lock:
        if _round_check:
            return _round_check[0]
        fn: Callable[..., torch.Tensor] | None = None
        if resolve_mode("auto") == "compiled":
            try:
                fn = torch.compile(_bf16_mismatch, dynamic=True, fullgraph=True)
                # the probes run on the CPU (and compile it there)
                with _compile_notice("cpu", "bf16 rounding check"), inductor_compat.known_cpu_isa():
                    for low, g in _round_probes():
                        expected = not torch.equal(low, g.to(torch.bfloat16))
                        if bool(fn(low, g)) != expected:
                            raise RuntimeError("the compiled comparison disagrees with the cast")
            except Exception as exc:  # no compiler, unsupported platform, ...
                _LOG.log(
                    _failure_level(), "ampkit: compiling the bf16 rounding check failed (%s: %s); comparing "
                    "op by op (same result, slower).", type(exc).__name__, exc
                )
                fn = None
        _round_check.append(fn)
        return fn


def _round_probes() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(4099, generator=gen) * 1e-3
    halfway = (g.to(torch.bfloat16).float().view(torch.int32) | 0x8000).view(torch.float32)
    probes = []
    for src in (g, halfway):
        low = src.to(torch.bfloat16)
        probes.append((low, src))
        for i in (0, 2048, 4098):  # one element one bf16 step off
            bits = low.view(torch.int16).clone()
            bits[i] += 1
            probes.append((bits.view(torch.bfloat16), src))
    return probes


def rounds_to_bf16(low: torch.Tensor, g: torch.Tensor) -> bool | None:
    """Whether contiguous bf16 ``low`` equals contiguous fp32 ``g`` cast to bf16, read
    in one compiled pass without temporaries; None when the kernel does not apply
    (small, other dtypes or devices, no compiler): compare some other way."""
    if (
        low.numel() < ROUND_CHECK_NUMEL  # first: the cheapest test, and most tensors fail it
        or low.dtype != torch.bfloat16
        or g.dtype != torch.float32
        or low.device.type != "cpu"
        or g.device != low.device
        or low.shape != g.shape
        or not (low.is_contiguous() and g.is_contiguous())
    ):
        return None
    fn = compiled_round_check()
    if fn is None:
        return None
    # Detached: the compiled check is traced for tensors without autograd history, and a
    # parameter's requires_grad would compile a second copy.
    if not bool(fn(low.detach().view(-1), g.detach().view(-1))):
        return True
    return None  # a mismatch, or an element arithmetic cannot decide: the exact path decides
