"""Argument checks shared by ampkit's constructors and verbs: one message format for
each kind of bad argument, and the checks every state-dict loader runs on its fields
(the keys of a dict, counters, flags, tensors)."""

from __future__ import annotations

import numbers
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from ampkit.errors import AmpError

#: The largest counter a state dict may hold (steps, events, calls): counters are int64
#: wherever torch keeps them (``Optimizer`` steps, generator offsets), and one step a
#: nanosecond takes 292 years to get there. Larger values are corruption.
MAX_COUNT = 2**63 - 1

#: The largest magnitude a checkpoint's weight, master or first moment may hold: the
#: square root of fp32's largest value. Past it the value's square (weight decay's norm,
#: Adam's second moment of its gradient) overflows fp32, so no run that trains saves one.
ABSURD_MAGNITUDE = 2.0**64

#: What to do about a checkpoint tensor holding values training never produces (inf/NaN
#: in a master weight, a compensation buffer or an fp8 scale).
CORRUPT_CHECKPOINT = (
    "Nothing was loaded: the checkpoint is corrupt or was saved after training diverged; "
    "load an earlier one."
)


def require_optimizer(obj: Any, who: str, error: type[AmpError] = AmpError) -> None:
    """Raise ``error`` unless ``obj`` is a ``torch.optim.Optimizer`` (``who`` names the
    caller in the message)."""
    if not isinstance(obj, torch.optim.Optimizer):
        raise error(f"{who} expects a torch.optim.Optimizer, got {type(obj).__name__}.")


def require_choice(value: Any, choices: Sequence[Any], what: str, error: type[AmpError] = AmpError) -> None:
    """Raise ``error`` unless ``value`` is one of ``choices`` (``what`` names the argument)."""
    if value not in choices:
        raise error(f"{what} must be one of {tuple(choices)}, got {value!r}.")


def is_real(value: Any) -> bool:
    """A real number (int, float, numpy scalar), not a bool, str or tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, str))


def is_count(value: Any) -> bool:
    """An integer (int, numpy integer), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def brief(value: Any) -> str:
    """``repr(value)``, cut to 80 characters for a message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def require_count(
    value: Any, what: str, error: type[AmpError], low: int = 0, high: int = MAX_COUNT, hint: str = ""
) -> int:
    """``value`` as an int if it is an integer (not a bool) in ``[low, high]``, else
    ``error`` naming ``what`` and ending with ``hint`` (what to do)."""
    if not (is_count(value) and low <= value <= high):
        top = "2**63 - 1" if high == MAX_COUNT else str(high)
        tail = f" {hint}" if hint else ""
        raise error(f"{what} must be an int in [{low}, {top}], got {brief(value)}.{tail}")
    return int(value)


def require_flag(value: Any, what: str, error: type[AmpError], hint: str = "") -> bool:
    """``value`` if it is True or False (not 0/1 or a string), else ``error``."""
    if not isinstance(value, bool):
        tail = f" {hint}" if hint else ""
        raise error(f"{what} must be True or False, got {brief(value)} ({type(value).__name__}).{tail}")
    return value


def require_fields(
    state: Any,
    required: Collection[str],
    where: str,
    error: type[AmpError],
    optional: Collection[str] = (),
    source: str = "ampkit.state_dict()",
) -> Mapping[str, Any]:
    """``state`` if it is a dict holding every key of ``required`` and no key outside
    ``required`` and ``optional``; else ``error`` saying which keys are missing or
    unknown, which are known, and that ``source`` writes the dict to pass."""
    if not isinstance(state, Mapping):
        raise error(f"{where}: expected a dict (from {source}), got {type(state).__name__}.")
    missing = [k for k in required if k not in state]
    if missing:
        raise error(f"{where}: the state dict lacks {missing}; pass the dict returned by {source}.")
    known = [*required, *optional]
    unknown = [k for k in state if k not in known]
    if unknown:
        raise error(
            f"{where}: unknown key(s) {sorted(map(repr, unknown))} in the state dict (known: "
            f"{known}); pass the dict returned by {source} as it was saved, without added keys."
        )
    return state


def require_tensor(
    value: Any,
    what: str,
    error: type[AmpError],
    dtype: torch.dtype,
    shape: Sequence[int] | None = None,
    finite: bool = False,
    low: float | None = None,
    positive: bool = False,
    hint: str = "",
    max_abs: float | None = None,
) -> torch.Tensor:
    """``value`` if it is a dense tensor with data (not sparse, not on the meta device)
    of exactly ``dtype`` and, when given, ``shape``, whose elements are all finite
    (``finite``), >= ``low``, > 0 (``positive``) and at most ``max_abs`` in magnitude;
    else ``error`` naming ``what``, saying what was found, and ending with ``hint``
    (what to do)."""
    tail = f" {hint}" if hint else ""
    wanted = f"a tensor of {dtype}"
    if shape is not None:
        wanted = f"a 0-d tensor of {dtype}" if len(shape) == 0 else f"{wanted} and shape {tuple(shape)}"
    if not isinstance(value, torch.Tensor):
        raise error(f"{what} must be {wanted}, got {brief(value)} ({type(value).__name__}).{tail}")
    if value.layout != torch.strided or value.is_meta:
        raise error(f"{what} must be {wanted} with data, got a {value.layout} tensor on {value.device}.{tail}")
    if value.dtype != dtype or (shape is not None and tuple(value.shape) != tuple(shape)):
        raise error(f"{what} must be {wanted}, got a {value.dtype} tensor of shape {tuple(value.shape)}.{tail}")
    data = value.detach()
    checks = []
    if finite:
        checks.append((~torch.isfinite(data), "non-finite value(s) (inf/NaN)"))
    if low is not None:
        checks.append((data < low, f"value(s) below {low}"))
    if positive:
        checks.append((data <= 0, "value(s) <= 0"))
    if max_abs is not None:
        checks.append((data.abs() > max_abs, f"value(s) beyond +-{max_abs:g}, which no training step writes"))
    for bad, kind in checks:
        count = int(bad.sum())
        if count:
            index = tuple(int(i) for i in bad.nonzero()[0]) if data.dim() else ()
            first = data[index].item()
            at = f" (first: {first} at index {index})" if data.dim() else f" ({first})"
            raise error(f"{what} holds {count} {kind}{at}.{tail}")
    return value
