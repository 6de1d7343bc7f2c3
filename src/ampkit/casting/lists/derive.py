"""torch.autocast's op categories, read from the running torch's own autocast kernels.

For each aten op overload with a kernel on an ``Autocast<Device>`` dispatch key, the
kernel is called under that device's autocast with stand-in tensors that own no memory
(so ``"cuda"`` works on a machine without a GPU): the casts it makes on its inputs and
the op it forwards to are recorded, and the op is stopped before anything runs. Three
calls place an op:

* all inputs fp32: a cast to the 16-bit dtype means ``lower``;
* all inputs 16-bit: a cast to fp32, or a forwarded call that asks for an fp32 result
  (torch's "set the optional dtype" and "append a dtype" policies, the CUDA softmax's
  ``half_to_float``), means ``fp32``;
* the first input 16-bit and the rest fp32: a cast of the 16-bit one to fp32 means
  ``promote``.

A kernel that raises torch's "unsafe to autocast" error is ``banned``. An overload whose
arguments cannot be stood in for (a named-tensor ``Dimname``, a kernel that checks its
inputs' layout before casting) is left unprobed; its base name is placed by the other
overloads, or by :data:`PLACED_BY_HAND` (with the source it was read from), or reported.

Used by ``python -m ampkit.casting.lists.generate`` to write the checked-in tables, by
the tests to check them, and at import under a torch release ampkit has no table for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ampkit._internal import torch_compat

#: dispatch key that torch.autocast uses for each device type ampkit has lists for
AUTOCAST_KEYS = MappingProxyType({"cpu": "AutocastCPU", "cuda": "AutocastCUDA"})

#: the 16-bit dtype each device's probe casts to (any 16-bit dtype the device's autocast
#: accepts gives the same categories)
PROBE_DTYPES = MappingProxyType({"cpu": torch.bfloat16, "cuda": torch.float16})

#: ops whose autocast kernel cannot be probed, placed from torch's source: device type ->
#: aten base name -> (category, where torch says so)
PLACED_BY_HAND: Mapping[str, Mapping[str, tuple[str, str]]] = MappingProxyType({
    "cuda": MappingProxyType({
        # checks the flat weight buffer's layout before it casts anything
        "_cudnn_rnn": ("lower", "aten/src/ATen/cudnn/AutocastRNN.cpp casts input and weights to fp16"),
    }),
})  # fmt: skip

_SHAPE = (2, 2)


class _Stop(Exception):
    """Raised from ``__torch_dispatch__`` once the kernel forwarded the op: nothing runs."""


@dataclass
class _Record:
    casts: list[tuple[torch.dtype, torch.dtype]] = field(default_factory=list)
    forwarded: Any = None  # (op, dtype arguments, half_to_float) of the first forwarded call
    error: str = ""


class _StandIn(torch.Tensor):
    """A tensor of a dtype and device that owns no memory; records what is done to it."""

    record: _Record = _Record()

    @staticmethod
    def __new__(cls, dtype: torch.dtype, device: str) -> _StandIn:
        return torch_compat.wrapper_tensor(cls, _SHAPE, dtype, device)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch_compat.aten_to_copy:
            src = args[0]
            dtype = kwargs.get("dtype") or src.dtype
            cls.record.casts.append((src.dtype, dtype))
            return _StandIn(dtype, src.device.type)
        flat, _ = torch_compat.tree_flatten((args, kwargs))
        names = [a.name for a in torch_compat.overload_schema(func).arguments]
        half_to_float = any(n == "half_to_float" and v is True for n, v in zip(names, args))
        cls.record.forwarded = (func, [a for a in flat if isinstance(a, torch.dtype)], half_to_float)
        raise _Stop


class Unprobeable(Exception):
    """An argument type the probe cannot stand in for."""


def _value(arg: Any, make: Any) -> Any:
    """A value of a schema argument's type: a stand-in tensor for tensors, else a small one."""
    if torch_compat.is_optional_type(arg.type):
        return None
    kind = str(arg.type)
    n = getattr(arg, "N", None) or 1
    simple = {"int": 1, "SymInt": 1, "float": 1.0, "number": 1.0, "bool": False, "ScalarType": torch.float32,
              "str": "ij"}  # fmt: skip
    if kind in simple:
        return simple[kind]
    if kind == "Tensor":
        return make()
    if kind in ("List[Tensor]", "List[Optional[Tensor]]"):
        return [make(), make()]
    if kind in ("List[int]", "List[SymInt]"):
        return [1] * n
    if kind == "List[bool]":
        return [False] * n
    if kind == "List[float]":
        return [1.0] * n
    raise Unprobeable(f"an argument of type {kind}")


@contextlib.contextmanager
def _autocast_on(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """This thread's autocast state for ``device_type`` switched on at ``dtype`` without a
    cache (and without ``torch.autocast``'s check that the device exists); restored after."""
    was = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled())
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, was[0])
        torch.set_autocast_dtype(device_type, was[1])
        torch.set_autocast_cache_enabled(was[2])


def _call(overload: Any, device_type: str, low: torch.dtype, mix: str) -> _Record | str:
    """The record of one call of ``overload`` under autocast with inputs of ``mix``
    (``"fp32"``, ``"low"``, ``"first-low"``); ``"banned"`` if the kernel refuses."""
    made = []

    def make() -> _StandIn:
        first = not made
        dtype = torch.float32 if mix == "fp32" or (mix == "first-low" and not first) else low
        made.append(_StandIn(dtype, device_type))
        return made[-1]

    args, kwargs = [], {}
    for arg in torch_compat.overload_schema(overload).arguments:
        if arg.has_default_value():
            continue
        if arg.kwarg_only:
            kwargs[arg.name] = _value(arg, make)
        else:
            args.append(_value(arg, make))
    record = _StandIn.record = _Record()
    with _autocast_on(device_type, low):
        try:
            overload(*args, **kwargs)
        except _Stop:
            pass
        except Exception as e:  # noqa: BLE001 - a composite's own checks after the casts
            if "unsafe to autocast" in str(e):
                return "banned"
            record.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return record


def probe(overload: Any, device_type: str) -> str:
    """The category (``"lower"``, ``"fp32"``, ``"promote"``), ``"banned"``, ``"none"``
    (the kernel neither casts nor forwards with a dtype) of ``overload``'s autocast
    kernel on ``device_type``; raises :class:`Unprobeable` with the reason if it cannot
    be told."""
    low = PROBE_DTYPES[device_type]
    calls = {mix: _call(overload, device_type, low, mix) for mix in ("fp32", "low", "first-low")}
    if "banned" in calls.values():
        return "banned"
    records: dict[str, _Record] = calls  # type: ignore[assignment]
    if all(not r.casts and r.forwarded is None for r in records.values()):
        raise Unprobeable(records["low"].error or "the kernel neither cast nor forwarded")
    if (torch.float32, low) in records["fp32"].casts:
        return "lower"
    fwd = records["low"].forwarded
    if (low, torch.float32) in records["low"].casts or (fwd is not None and (torch.float32 in fwd[1] or fwd[2])):
        return "fp32"
    if (low, torch.float32) in records["first-low"].casts:
        return "promote"
    return "none"


@dataclass(frozen=True)
class DerivedTables:
    """What :func:`derive` read from the running torch.

    ``lists``: device type -> category -> sorted aten base names; ``banned``: device
    type -> base names autocast refuses to run; ``unplaced``: device type -> base name
    -> why none of its overloads could be probed (not in ``lists``); ``conflicts``:
    device type -> base name -> the categories its overloads gave (placed by the first)."""

    torch_version: str
    lists: Mapping[str, Mapping[str, tuple[str, ...]]]
    banned: Mapping[str, tuple[str, ...]]
    unplaced: Mapping[str, Mapping[str, str]]
    conflicts: Mapping[str, Mapping[str, tuple[str, ...]]]


def derive(device_types: tuple[str, ...] = ("cpu", "cuda")) -> DerivedTables:
    """Read torch.autocast's categories for ``device_types`` from the running torch."""
    lists: dict[str, Any] = {}
    banned: dict[str, tuple[str, ...]] = {}
    unplaced: dict[str, Any] = {}
    conflicts: dict[str, Any] = {}
    for device in device_types:
        per_base: dict[str, list[str]] = {}
        why: dict[str, str] = {}
        for base, name in torch_compat.dispatch_key_overloads(AUTOCAST_KEYS[device]):
            overload = getattr(getattr(torch.ops.aten, base), name)
            try:
                per_base.setdefault(base, []).append(probe(overload, device))
            except Unprobeable as e:
                per_base.setdefault(base, [])
                why[base] = str(e)
        by_category: dict[str, list[str]] = {"lower": [], "fp32": [], "promote": [], "banned": []}
        unplaced[device], conflicts[device] = {}, {}
        for base, got in sorted(per_base.items()):
            got = [c for c in dict.fromkeys(got) if c != "none"]
            if not got and base in PLACED_BY_HAND.get(device, {}):
                got = [PLACED_BY_HAND[device][base][0]]
            if not got:
                unplaced[device][base] = why.get(base, "no overload casts")
                continue
            if len(got) > 1:
                conflicts[device][base] = tuple(got)
            by_category[got[0]].append(base)
        banned[device] = tuple(by_category.pop("banned"))
        lists[device] = MappingProxyType({c: tuple(v) for c, v in by_category.items()})
        unplaced[device] = MappingProxyType(unplaced[device])
        conflicts[device] = MappingProxyType(conflicts[device])
    return DerivedTables(
        torch.__version__,
        MappingProxyType(lists),
        MappingProxyType(banned),
        MappingProxyType(unplaced),
        MappingProxyType(conflicts),
    )


__all__ = ["AUTOCAST_KEYS", "PLACED_BY_HAND", "PROBE_DTYPES", "DerivedTables", "Unprobeable", "derive", "probe"]
