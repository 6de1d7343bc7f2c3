"""Policy -> what a scope consults: a policy's categories resolved on a device
(:func:`_resolve`), with the CPU repairs found by probing torch (:func:`_repairs`), and
the record of one open scope (:class:`_Frame`). See docs/concepts/casting.md."""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit.errors import PolicyError

from .lists import AUTOCAST_KEYS, native_categories
from .policy import Policy, is_python_op, python_callable

logger = logging.getLogger("ampkit")

# device type -> {aten op: category} of torch's own autocast lists
_NATIVE: dict[str, dict[str, str]] = {dev: native_categories(dev) for dev in AUTOCAST_KEYS}


# ---------------------------------------------------------------------------
# Resolved scope state
# ---------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Frame:
    """One active scope: what its kernels, mode and hooks consult."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    policy: Policy | None
    categories: dict[str, str]  # aten base name -> category, effective
    conditionals: dict[str, tuple[Callable[..., bool], ...]]
    python_ops: dict[Any, str]  # function object -> category
    cache_enabled: bool
    rules: bool = True  # module rules apply (False in a scope the user disabled)
    key: str = ""  # this scope stack's compile key (see _compile_key_of)
    cache: dict[int, tuple[weakref.ref, int, torch.dtype, torch.Tensor]] = dataclasses.field(
        default_factory=dict
    )


@dataclasses.dataclass(frozen=True)
class _Resolved:
    categories: dict[str, str]
    conditionals: dict[str, tuple[Callable[..., bool], ...]]
    python_ops: dict[Any, str]
    intercepted: frozenset[str]  # aten base names that need our kernel


# Engine state: policy -> resolved categories, a cache (a policy is an immutable value).
_RESOLVED: dict[tuple[int, str, bool], tuple[Policy, _Resolved]] = {}

# (device type, dtype) -> {aten op: category} for ops torch.autocast lowers but whose
# lowered kernel cannot run on this machine; filled by a probe the first time a scope
# for that pair resolves. Process-wide and only ever filled (same answer every time).
_REPAIRS: dict[tuple[str, torch.dtype], dict[str, str]] = {}
_REPAIRS_LOCK = threading.Lock()


def probe_rnn(dtype: torch.dtype) -> bool:
    """Whether ``nn.LSTM`` runs under CPU ``torch.autocast(dtype)`` here.

    torch 2.13 lowers ``mkldnn_rnn_layer`` to bf16/fp16 under CPU autocast, but oneDNN
    refuses that primitive on some CPUs ("could not create a primitive descriptor for the
    LSTM forward propagation primitive"), so plain ``torch.autocast`` cannot run an LSTM.

    The probe LSTM is built on the meta device and zero-filled on the CPU: its usual
    random init would draw from torch's default generator, and a seeded run must draw
    the same numbers with ampkit as without it.
    """
    lstm = nn.LSTM(2, 2, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        for param in lstm.parameters():
            param.zero_()
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            lstm(torch.zeros(1, 1, 2))
    except RuntimeError:
        return False
    return True


def _repairs(device_type: str, policy: Policy) -> dict[str, str]:
    """Ops to keep in fp32 because torch's lowered kernel fails here (unless the policy
    itself names them): today ``mkldnn_rnn_layer`` (``nn.LSTM``) on CPUs whose oneDNN has
    no 16-bit LSTM; it then runs in fp32, as ``nn.GRU`` and the RNN cells already do
    under CPU autocast."""
    if device_type != "cpu":
        return {}
    key = (device_type, policy.dtype)
    with _REPAIRS_LOCK:
        found = _REPAIRS.get(key)
        if found is None:
            found = {} if probe_rnn(policy.dtype) else {"mkldnn_rnn_layer": "fp32"}
            if found:
                logger.info(
                    "ampkit: nn.LSTM cannot run in %s on this CPU (oneDNN); it runs in fp32", policy.dtype
                )
            _REPAIRS[key] = found
    named = policy.categories()  # a policy may choose fp32/promote itself; 'lower' cannot run
    return {op: c for op, c in found.items() if named.get(op, "lower") == "lower"}


def _resolve(policy: Policy, device_type: str, intercept_all: bool = False) -> _Resolved:
    key = (id(policy), device_type, intercept_all)
    hit = _RESOLVED.get(key)
    if hit is not None and hit[0] is policy:
        return hit[1]
    native = _NATIVE[device_type]
    categories = dict(native)
    python_ops: dict[Any, str] = {}
    for name, category in policy.categories().items():
        if is_python_op(name):
            python_ops[python_callable(name)] = category
        else:
            categories[name] = category
    for name, category in _repairs(device_type, policy).items():
        categories[name] = category
    conditionals: dict[str, tuple[Callable[..., bool], ...]] = {}
    for name, preds in policy.conditionals().items():
        if is_python_op(name):
            raise PolicyError(
                f"conditional_fp32_ops: {name[3:]} has no aten op; conditional rules apply to "
                "aten ops (torch.pow, torch.exp, ...)."
            )
        conditionals[name] = preds
    if intercept_all:
        intercepted = frozenset(categories) | frozenset(conditionals)
    else:
        intercepted = frozenset(
            {n for n, c in categories.items() if native.get(n) != c}
            | set(conditionals)
        )
    resolved = _Resolved(categories, conditionals, python_ops, intercepted)
    if len(_RESOLVED) > 256:
        _RESOLVED.clear()
    _RESOLVED[key] = (policy, resolved)
    return resolved
