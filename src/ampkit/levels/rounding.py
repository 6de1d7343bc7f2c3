"""Whether a 16-bit tensor is exactly an fp32 one rounded (a model grad and its master's
grad, a model weight and its master): how O2 finds edits made through ``.data``, which
leave version counters alone. :func:`rounds_to` compares; :func:`compared_ahead` makes
the comparisons of a whole step on a GPU in one host sync, and those of a step's small
tensors on the CPU in a few multi-tensor calls (:func:`unrounded` the same for a list)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import operator
import threading
from collections.abc import Iterable, Iterator, Sequence

import torch

from ampkit._internal import registry as _reset
from ampkit._internal import torch_compat

from .update_kernels import rounds_to_bf16

__all__ = ["rounds_to", "unrounded", "compared_ahead", "COMPARED_ONE_BY_ONE"]

_COMPARE_CHUNK = 1 << 16

# Per thread: comparisons made ahead on the device (see compared_ahead), by
# (id, version) of both tensors.
_AHEAD = threading.local()
#: device types whose comparisons are not made ahead: on the CPU each one costs no wait,
#: and chunked comparisons need no full-size temporary
COMPARED_ONE_BY_ONE = frozenset({"cpu"})


@contextlib.contextmanager
def compared_ahead(pairs: Iterable[tuple[torch.Tensor | None, torch.Tensor | None]], cpu: bool = True) -> Iterator[None]:
    """Inside: :func:`rounds_to` answers for the dense, same-shaped ``pairs`` on a
    device other than the CPU from one comparison of all of them, read back in one
    host sync (each ``torch.equal`` there waits for the device: an O2 step of a
    135M-parameter model on an H200 made 200 of them). On the CPU, the small pairs
    :func:`unrounded` compares at once are compared so too, bit for bit: those whose
    bits agree and hold no NaN are answered True (a pair whose bits differ, or with a
    NaN, is compared by :func:`rounds_to` when asked, as one by one: ``-0.0`` against
    ``0.0``, NaN unequal to itself); ``cpu=False`` leaves the
    CPU's pairs alone (a caller that passes them to :func:`unrounded`, which batches
    them itself). Pairs it was not given, or changed since (their version), are
    compared as before."""
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    on_cpu: list[tuple[torch.Tensor, torch.Tensor]] = []
    if "cpu" in COMPARED_ONE_BY_ONE:  # the CPU's pairs set apart at once (no per-pair check below)
        pairs = list(pairs)
        on_cpu = [(low, g) for low, g in pairs if low is not None and g is not None and low.is_cpu] if cpu else []
        pairs = [(low, g) for low, g in pairs if low is not None and not low.is_cpu]
    for low, g in pairs:
        if (low is not None and g is not None and low.device.type not in COMPARED_ONE_BY_ONE and low.device == g.device
                and low.shape == g.shape and not (low.is_sparse or g.is_sparse)):  # fmt: skip
            by_device.setdefault(low.device, []).append((low, g))
    results: dict[tuple[int, int, int, int], bool] = _equal_bits_on_cpu(on_cpu) if len(on_cpu) > 1 else {}
    if not by_device and not results:
        yield
        return
    with torch.no_grad():
        for group in by_device.values():
            # NaN != NaN: unequal, as torch.equal has it
            differs = torch.stack([torch.ne(low, g.to(low.dtype)).any() for low, g in group]).tolist()
            for (low, g), d in zip(group, differs):
                key = (id(low), torch_compat.tensor_version(low), id(g), torch_compat.tensor_version(g))
                results[key] = not d
    outer = getattr(_AHEAD, "results", None)
    _AHEAD.results = results
    try:
        yield
    finally:
        _AHEAD.results = outer


def rounds_to(low: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether 16-bit ``low`` is exactly fp32 ``g`` rounded to its dtype (a gradient
    copy and its master's gradient, a model weight and its master); on the CPU compared
    a chunk of ``_COMPARE_CHUNK`` elements at a time: no full-size temporary at the step
    (large bf16 tensors on CPU: :func:`ampkit.levels.update_kernels.rounds_to_bf16`, one compiled
    pass, several times faster)."""
    if low.shape != g.shape:
        return False
    ahead = getattr(_AHEAD, "results", None)
    if ahead:
        key = (id(low), torch_compat.tensor_version(low), id(g), torch_compat.tensor_version(g))
        known = ahead.get(key)
        if known is not None:
            return known
    with torch.no_grad():
        fast = rounds_to_bf16(low, g)  # large bf16 tensors: one compiled read pass
        if fast is not None:
            return fast
        if not (low.is_contiguous() and g.is_contiguous()) or low.device.type != "cpu":
            # off the CPU each comparison waits for the device: one per tensor, not one
            # per chunk (chunked, a 135M-parameter O2 model on an H200 spent 280 ms a
            # step in 2000 host syncs); the rounded copy is a transient of 2 bytes/element
            return torch.equal(low, g.to(low.dtype))
        a, b = low.view(-1), g.view(-1)
        return all(
            torch.equal(a[i : i + _COMPARE_CHUNK], b[i : i + _COMPARE_CHUNK].to(low.dtype))
            for i in range(0, a.numel(), _COMPARE_CHUNK)
        )


def unrounded(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """The positions of the ``(low, g)`` pairs for which :func:`rounds_to` is False.
    Small dense pairs on the CPU (below ``_COMPARE_CHUNK`` elements: a model's biases,
    norms and small weights) of a 2-byte 16-bit dtype are compared all at once: each
    side copied into a flat buffer kept for the next call (``g`` rounded on the way),
    one multi-tensor copy per side, and the two buffers compared bit for bit; only where
    they differ are the pairs concerned compared with :func:`rounds_to`. Which pairs
    take that way is read for all of them at once (no Python call per pair)."""
    if not pairs:
        return []
    lows, highs = zip(*pairs)
    n = len(pairs)
    # else compared ahead (compared_ahead): rounds_to answers
    batched = _batchable(lows, highs) if "cpu" in COMPARED_ONE_BY_ONE else {}
    in_batch = set().union(*batched.values()) if batched else set()
    out = [] if len(in_batch) == n else [i for i in range(n) if i not in in_batch and not rounds_to(*pairs[i])]
    with torch.no_grad():
        for (low_dtype, _), idx in batched.items():
            if len(idx) == 1:
                out.extend(i for i in idx if not rounds_to(*pairs[i]))
                continue
            candidates = _differing_bits([lows[i] for i in idx], [highs[i] for i in idx], low_dtype)
            out.extend(idx[j] for j in candidates if not rounds_to(*pairs[idx[j]]))
    return sorted(out)


def _batchable(lows: Sequence[torch.Tensor], highs: Sequence[torch.Tensor]) -> dict[tuple[torch.dtype, torch.dtype], list[int]]:
    """The positions of the ``(lows[i], highs[i])`` pairs that :func:`_differing_bits`
    compares at once (small dense CPU pairs of one shape, a 2-byte 16-bit ``lows[i]``),
    by their two dtypes; read for all of them at once (no Python call per pair)."""
    n = len(lows)
    ok = list(map(all, zip(
        map(operator.lt, map(torch.Tensor.numel, lows), itertools.repeat(_COMPARE_CHUNK)),
        map(_IS_CPU, lows), map(_IS_CPU, highs),
        map(operator.is_, map(_LAYOUT, lows), itertools.repeat(torch.strided)),
        map(operator.is_, map(_LAYOUT, highs), itertools.repeat(torch.strided)),
        map(operator.eq, map(_SHAPE, lows), map(_SHAPE, highs)),
        map(operator.eq, map(torch.Tensor.element_size, lows), itertools.repeat(2)))))  # fmt: skip
    keys = list(zip(map(_DTYPE, lows), map(_DTYPE, highs)))
    if all(ok) and keys.count(keys[0]) == n:  # the usual case: one model, one 16-bit dtype
        return {keys[0]: list(range(n))}
    batched: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, key in enumerate(keys):
        if ok[i]:
            batched.setdefault(key, []).append(i)
    return batched


def _equal_bits_on_cpu(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[tuple[int, int, int, int], bool]:
    """:func:`compared_ahead`'s answers for CPU ``pairs``: True, by the key
    :func:`rounds_to` looks up, for each pair :func:`_batchable` takes whose bits agree
    (:func:`_differing_bits`, a few multi-tensor calls for all of them) and that holds
    no NaN (``torch.equal``'s answer there is False: a NaN counts as an edit)."""
    lows, highs = zip(*pairs)
    results: dict[tuple[int, int, int, int], bool] = {}
    with torch.no_grad():
        for (low_dtype, _), idx in _batchable(lows, highs).items():
            if len(idx) < 2:
                continue
            some_lows = [lows[i] for i in idx]
            differ = set(_differing_bits(some_lows, [highs[i] for i in idx], low_dtype))
            differ.update(_with_nan(some_lows, low_dtype))  # NaN != NaN, as torch.equal has it
            version = torch_compat.tensor_version
            for j, i in enumerate(idx):
                if j not in differ:
                    low, g = pairs[i]
                    results[(id(low), version(low), id(g), version(g))] = True
    return results


def _with_nan(lows: list[torch.Tensor], dtype: torch.dtype) -> list[int]:
    """Positions of the ``lows`` holding a NaN, read from the flat buffer
    :func:`_differing_bits` has just filled with them (one check for all)."""
    (low_buf, _), _, ends = _compare_buffers(lows, dtype)
    nan = torch.isnan(low_buf)
    if not bool(nan.any()):
        return []
    return torch.searchsorted(ends, nan.nonzero().view(-1), right=True).unique().tolist()


def _differing_bits(lows: list[torch.Tensor], highs: list[torch.Tensor], dtype: torch.dtype) -> list[int]:
    """Positions where 2-byte ``lows[i]`` (of ``dtype``, on the CPU) is not bit for bit
    ``highs[i]`` rounded to ``dtype``: both sides copied (rounded) into flat buffers of
    ``dtype`` (:func:`_compare_buffers`), compared bit for bit (as 64-bit words; where
    they differ, as 16-bit integers to find which tensors). A position listed
    may still round to it (``-0.0`` against ``0.0``): the caller confirms with
    :func:`rounds_to`; NaNs of the same bits count as equal here and get no copy."""
    (low_buf, low_views), (high_buf, high_views), ends = _compare_buffers(lows, dtype)
    torch_compat.foreach_copy_(low_views, lows)
    torch_compat.foreach_copy_(high_views, highs)
    if torch.equal(low_buf.view(torch.int64), high_buf.view(torch.int64)):  # 4 elements a word: 3x faster
        return []
    where = torch.ne(low_buf.view(torch.int16), high_buf.view(torch.int16)).nonzero().view(-1)
    return torch.searchsorted(ends, where, right=True).unique().tolist()


def _compare_buffers(
    like: list[torch.Tensor], dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, list[torch.Tensor]], tuple[torch.Tensor, list[torch.Tensor]], torch.Tensor]:
    """Two flat CPU buffers of 2-byte ``dtype`` sized for ``like`` (zero-padded to a
    multiple of 4 elements, compared as 64-bit words), their views shaped as ``like``'s
    tensors, and the cumulative sizes (each tensor's end): kept per thread and list of
    shapes (the least recently used dropped beyond ``_BUFFER_SETS``)."""
    key = (threading.get_ident(), dtype, tuple([t.shape for t in like]))
    with _buffers_lock:
        found = _BUFFERS.get(key)
        if found is not None:
            _BUFFERS.move_to_end(key)
            return found
    total = sum(t.numel() for t in like)
    sides = []
    # plain CPU tensors whatever the caller's mode: a set made inside torch.inference_mode()
    # or under a default device (meta) would refuse or fail every later call that reuses it
    with torch.inference_mode(False), torch.no_grad():
        for _ in range(2):
            buf = torch.zeros(-(-total // 4) * 4, dtype=dtype, device="cpu")  # the padding stays zero
            views, at = [], 0
            for t in like:
                views.append(buf[at : at + t.numel()].view(t.shape))
                at += t.numel()
            sides.append((buf, views))
        ends = torch.tensor(list(itertools.accumulate(t.numel() for t in like)), dtype=torch.int64, device="cpu")
    made = (sides[0], sides[1], ends)
    with _buffers_lock:
        _BUFFERS[key] = made
        while len(_BUFFERS) > _BUFFER_SETS:
            _BUFFERS.popitem(last=False)
    return made


#: Sets of comparison buffers kept (one per thread and list of shapes: a model's masters,
#: and a second model's): each holds 4 bytes per element of the small tensors compared.
_BUFFER_SETS = 4
_BUFFERS: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
_buffers_lock = threading.Lock()


@_reset.on_reset
def release_buffers() -> None:
    """Drop the comparison buffers (``ampkit.reset()``)."""
    with _buffers_lock:
        _BUFFERS.clear()


_LAYOUT = operator.attrgetter("layout")
_IS_CPU = operator.attrgetter("is_cpu")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
