"""Policy: which ops run in which dtype. Pure data: building one changes no torch state.

A :class:`Policy` names a compute dtype (bf16 or fp16) and moves ops between the
categories of the device's default lists (:mod:`ampkit.casting.lists`):

- ``lower_ops`` run in the compute dtype,
- ``fp32_ops`` run in float32,
- ``promote_ops`` run in the widest floating dtype among their inputs,
- ``conditional_fp32_ops`` run in float32 when a predicate on their arguments says so
  (e.g. ``pow`` with a large exponent), and in their usual category otherwise,
- ``module_rules`` pin whole modules to a dtype, by class or by qualified-name glob.

Lists in a policy override the device defaults op by op: ``Policy(fp32_ops=[torch.mm])``
keeps every default and moves ``mm`` to fp32. Ops are given as callables
(``torch.exp``, ``F.gelu``, ``torch.Tensor.__matmul__``) or names (``"exp"``,
``"aten::mm"``, ``"torch.nn.functional.gelu"``); each is matched where
``torch.autocast`` sees ops, at the outermost aten op of a call (``F.cross_entropy``
is ``aten::cross_entropy_loss``). Python-level torch functions with no aten op of
their own (``F.normalize``) are matched by the function itself.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ampkit._internal.dtypes import LOW_PRECISION, default_dtype
from ampkit._internal.torch_compat import TENSOR_BASE
from ampkit.errors import PolicyError

from .lists import DEFAULT_LISTS

__all__ = ["Policy", "default_policy", "canonical_op", "exact_name"]

#: dtypes a policy can compute in
#: dtypes a module rule may pin a module to
MODULE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

OpSpec = str | Callable[..., Any]
ModuleKey = type | str
Predicate = Callable[..., bool]

# Python-level names whose aten op is spelled differently.
_ALIASES: dict[str, str] = {
    "cross_entropy": "cross_entropy_loss",
    "truediv": "div",
    "rtruediv": "div",
    "floordiv": "floor_divide",
    "rfloordiv": "floor_divide",
    "rmatmul": "matmul",
    "radd": "add",
    "rsub": "sub",
    "rmul": "mul",
    "rpow": "pow",
    "multi_head_attention_forward": "_native_multi_head_attention",
}

_PY_PREFIX = "py:"


def _aten_exists(name: str) -> bool:
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    return bool(getattr(packet, "overloads", lambda: [])())


def _is_torch_callable(fn: Callable[..., Any]) -> bool:
    objclass = getattr(fn, "__objclass__", None)
    if isinstance(objclass, type) and issubclass(objclass, TENSOR_BASE):
        return True
    module = getattr(fn, "__module__", None) or ""
    if module == "torch" or module.startswith("torch."):
        return True
    # builtins such as torch.exp report no module: look them up by name
    name = getattr(fn, "__name__", "")
    for ns in (torch, torch.nn.functional, torch.Tensor, torch.linalg, torch.fft, torch.special):
        if getattr(ns, name, None) is fn:
            return True
    return False


def _strip_dunder(name: str) -> str:
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return name


def _import_dotted(path: str) -> Any:
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def canonical_op(spec: OpSpec) -> str:
    """The name ampkit matches op ``spec`` by: an aten op name, an op overload or a
    Python function, as policies accept them (cached)."""
    try:
        return _canonical_cached(spec)
    except TypeError:  # unhashable spec
        return _canonical_op(spec)


def _canonical_op(spec: OpSpec) -> str:
    """The name ampkit matches an op by.

    Returns an aten base name (``"mm"``, ``"conv2d"``, ``"cross_entropy_loss"``) when
    the op has an aten counterpart, else ``"py:<module>.<name>"`` for a Python-level
    torch function. Raises :class:`PolicyError` for anything that is not a torch op.
    """
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("aten::"):
            text = text[len("aten::"):]
        if text.startswith(_PY_PREFIX):
            obj = _import_dotted(text[len(_PY_PREFIX):])
            if obj is None or not callable(obj):
                raise PolicyError(f"{spec!r} does not name a torch function.")
            return _canonical_op(obj)
        if "." in text:
            head = text.split(".", 1)[0]
            if head in ("torch", "F", "Tensor"):
                path = text.replace("F.", "torch.nn.functional.", 1) if head == "F" else text
                path = path.replace("Tensor.", "torch.Tensor.", 1) if head == "Tensor" else path
                obj = _import_dotted(path)
                if obj is None or not callable(obj):
                    raise PolicyError(
                        f"{spec!r} is not a torch function; give a callable such as "
                        "torch.exp or a name such as 'exp' or 'torch.nn.functional.gelu'."
                    )
                return _canonical_op(obj)
            # "pow.Tensor_Scalar": an overload name; ampkit works on base names
            text = head
        name = _ALIASES.get(_strip_dunder(text), _strip_dunder(text))
        if _aten_exists(name):
            return name
        raise PolicyError(
            f"{spec!r} is not the name of a torch op (no aten::{name}); use the aten base "
            "name ('mm', 'softmax') or pass the function itself (torch.mm, F.softmax)."
        )
    if not callable(spec):
        raise PolicyError(f"op {spec!r} is neither a callable nor a name.")
    if isinstance(spec, type):
        if issubclass(spec, nn.Module):
            raise PolicyError(
                f"{spec.__qualname__} is a module class, not an op; pin a module's dtype with "
                f"module_rules={{{spec.__qualname__}: torch.float32}} instead."
            )
        raise PolicyError(f"{spec.__qualname__} is a class, not a torch op.")
    if not _is_torch_callable(spec):
        raise PolicyError(
            f"{getattr(spec, '__qualname__', spec)!r} is not a torch function; ampkit "
            "casts torch ops only. Wrap your function's body in ampkit.autocast instead."
        )
    name = _strip_dunder(getattr(spec, "__name__", ""))
    name = _ALIASES.get(name, name)
    if _aten_exists(name):
        return name
    module = getattr(spec, "__module__", None) or "torch"
    return f"{_PY_PREFIX}{module}.{getattr(spec, '__qualname__', name)}"


_canonical_cached = functools.lru_cache(maxsize=8192)(_canonical_op)


def python_callable(canonical: str) -> Callable[..., Any]:
    """The function object behind a ``"py:..."`` canonical name."""
    obj = _import_dotted(canonical[len(_PY_PREFIX):])
    if obj is None:
        raise PolicyError(f"cannot import {canonical[len(_PY_PREFIX):]!r}.")
    return obj


def is_python_op(canonical: str) -> bool:
    return canonical.startswith(_PY_PREFIX)


def check_compute_dtype(dtype: Any, what: str = "dtype") -> torch.dtype:
    """Validate a compute dtype (bf16/fp16) and return it."""
    if not isinstance(dtype, torch.dtype):
        raise PolicyError(f"{what} must be a torch.dtype such as torch.bfloat16, got {dtype!r}.")
    if dtype in LOW_PRECISION:
        return dtype
    if "float8" in str(dtype):
        raise PolicyError(
            f"{dtype} is not a compute dtype yet: ampkit computes in torch.bfloat16 or "
            "torch.float16. fp8 support is planned."
        )
    if dtype in (torch.float32, torch.float64):
        raise PolicyError(
            f"{what}={dtype} is full precision; use torch.bfloat16 or torch.float16, or "
            "ampkit.autocast(enabled=False) to turn casting off."
        )
    raise PolicyError(f"{what}={dtype} is not supported; use torch.bfloat16 or torch.float16.")


def _check_module_dtype(dtype: Any, key: Any) -> torch.dtype:
    if dtype not in MODULE_DTYPES:
        raise PolicyError(
            f"module rule {key!r}: dtype must be torch.float32, torch.bfloat16 or "
            f"torch.float16, got {dtype!r}."
        )
    return dtype


def exact_name(name: str) -> str:
    """A module-rule key (or ``keep_fp32`` entry) that matches the qualified name ``name``
    exactly, never as a glob: the glob characters ``*``, ``?`` and ``[`` each bracketed
    (``"blocks[0]"`` gives ``"blocks[[]0]"``, ``"x*"`` gives ``"x[*]"``). Names read from a
    file (a tuning plan's) are applied through it; a glob written by hand is not."""
    return _GLOB_CHARS.sub(r"[\1]", name)


_GLOB_CHARS = re.compile(r"([*?[])")


def _check_module_key(key: Any) -> ModuleKey:
    if isinstance(key, str):
        if not key:
            raise PolicyError("module rule names must be non-empty globs such as 'head' or '*.norm*'.")
        return key
    if isinstance(key, type) and issubclass(key, nn.Module):
        return key
    raise PolicyError(
        f"module rule key {key!r} must be an nn.Module subclass or a qualified-name glob (str)."
    )


def _as_tuple(value: Any, field: str) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or callable(value):
        raise PolicyError(f"{field} must be a list of ops, got a single op {value!r}; wrap it in [].")
    try:
        return tuple(value)
    except TypeError:
        raise PolicyError(f"{field} must be a list of ops, got {value!r}.") from None


@dataclasses.dataclass(frozen=True)
class Policy:
    """What runs in which dtype. Immutable; combine with :meth:`override`.

    Args:
        dtype: compute dtype of ``lower`` ops, ``torch.bfloat16`` (default) or
            ``torch.float16``.
        lower_ops: ops to run in ``dtype``.
        fp32_ops: ops to run in ``torch.float32``.
        promote_ops: ops whose floating inputs are cast to the widest dtype among them.
        conditional_fp32_ops: ``(op, predicate)`` pairs; the op runs in fp32 when
            ``predicate(*args, **kwargs)`` (the op's own arguments) is true, and in its
            usual category otherwise.
        module_rules: ``{nn.Module subclass or qualified-name glob: dtype}``. A matching
            module's forward runs with casting in that dtype (``torch.float32``: casting
            off, floating positional inputs cast to fp32). Names are relative to the
            outermost module called (``"head"``, ``"encoder.layers.*.norm1"``), seen
            through ``nn.DataParallel``/``DistributedDataParallel``/``torch.compile``
            wrappers.

    Each list overrides the device's default lists op by op; an op may appear in one
    of ``lower_ops``/``fp32_ops``/``promote_ops`` only.
    """

    dtype: torch.dtype = torch.bfloat16
    lower_ops: tuple[OpSpec, ...] = ()
    fp32_ops: tuple[OpSpec, ...] = ()
    promote_ops: tuple[OpSpec, ...] = ()
    conditional_fp32_ops: tuple[tuple[OpSpec, Predicate], ...] = ()
    module_rules: Mapping[ModuleKey, torch.dtype] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_compute_dtype(self.dtype)
        seen: dict[str, str] = {}
        for field in ("lower_ops", "fp32_ops", "promote_ops"):
            ops = _as_tuple(getattr(self, field), field)
            object.__setattr__(self, field, ops)
            for op in ops:
                name = canonical_op(op)
                if name in seen and seen[name] != field:
                    raise PolicyError(
                        f"op {name!r} is in both {seen[name]} and {field}; an op belongs to "
                        "one category. Remove it from one of them."
                    )
                seen[name] = field
        conds = _as_tuple(self.conditional_fp32_ops, "conditional_fp32_ops")
        for entry in conds:
            if not (isinstance(entry, tuple) and len(entry) == 2 and callable(entry[1])):
                raise PolicyError(
                    "conditional_fp32_ops entries are (op, predicate) pairs, e.g. "
                    "(torch.pow, lambda x, e, **kw: abs(e) > 4); got "
                    f"{entry!r}."
                )
            if is_python_op(canonical_op(entry[0])):
                raise PolicyError(
                    f"conditional_fp32_ops: {canonical_op(entry[0])[len(_PY_PREFIX):]} has no "
                    "aten op; conditional rules apply to aten ops (torch.pow, torch.exp, ...). "
                    "Put a Python-level function in fp32_ops, or pin the module that calls it "
                    "with module_rules."
                )
        object.__setattr__(self, "conditional_fp32_ops", conds)
        if not isinstance(self.module_rules, Mapping):
            raise PolicyError("module_rules must be a mapping {module class or name glob: dtype}.")
        rules = {_check_module_key(k): _check_module_dtype(v, k) for k, v in self.module_rules.items()}
        object.__setattr__(self, "module_rules", MappingProxyType(rules))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its constructor's arguments (``module_rules`` as a plain dict), so a
        policy travels to spawned processes (``mp.spawn``, Lightning's ``ddp_spawn``) and
        is validated again where it is rebuilt. Ops and predicates must be picklable
        themselves (torch functions and module-level functions are; lambdas are not)."""
        return (
            _rebuild_policy,
            (self.dtype, self.lower_ops, self.fp32_ops, self.promote_ops,
             self.conditional_fp32_ops, dict(self.module_rules)),
        )

    # -- views -------------------------------------------------------------
    def categories(self) -> dict[str, str]:
        """``{canonical op name: "lower" | "fp32" | "promote"}`` for the listed ops."""
        out: dict[str, str] = {}
        for field, category in (("lower_ops", "lower"), ("fp32_ops", "fp32"), ("promote_ops", "promote")):
            for op in getattr(self, field):
                out[canonical_op(op)] = category
        return out

    def conditionals(self) -> dict[str, tuple[Predicate, ...]]:
        """``{canonical op name: predicates}``."""
        out: dict[str, tuple[Predicate, ...]] = {}
        for op, pred in self.conditional_fp32_ops:
            name = canonical_op(op)
            out[name] = out.get(name, ()) + (pred,)
        return out

    # -- combination -------------------------------------------------------
    def override(self, other: Policy | None = None, **fields: Any) -> Policy:
        """A new policy: this one with ``other``'s (or ``fields``') choices winning per op.

        ``dtype`` comes from ``other``/``fields`` when given there. Module rules merge,
        the newer rule winning per key; conditional predicates for the same op replace
        the older ones.
        """
        if other is not None and fields:
            raise PolicyError("pass either another Policy or keyword fields to override(), not both.")
        if other is not None and not isinstance(other, Policy):
            raise PolicyError(
                f"override() takes another Policy or keyword fields, got {type(other).__name__}."
            )
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(Policy)})
        if unknown:
            raise PolicyError(
                f"unknown Policy field(s) {unknown}; valid: "
                f"{[f.name for f in dataclasses.fields(Policy)]}."
            )
        if other is None:
            base = {"dtype": fields.pop("dtype", self.dtype)}
            other = Policy(**base, **fields)
            dtype = base["dtype"]
        else:
            dtype = other.dtype
        moved = other.categories()
        lists: dict[str, list[OpSpec]] = {"lower": [], "fp32": [], "promote": []}
        for field, category in (("lower_ops", "lower"), ("fp32_ops", "fp32"), ("promote_ops", "promote")):
            for op in getattr(self, field):
                if canonical_op(op) not in moved:
                    lists[category].append(op)
            lists[category].extend(getattr(other, field))
        new_conds = other.conditionals()
        conds = [c for c in self.conditional_fp32_ops if canonical_op(c[0]) not in new_conds]
        conds.extend(other.conditional_fp32_ops)
        rules = dict(self.module_rules)
        rules.update(other.module_rules)
        return Policy(
            dtype=dtype,
            lower_ops=tuple(lists["lower"]),
            fp32_ops=tuple(lists["fp32"]),
            promote_ops=tuple(lists["promote"]),
            conditional_fp32_ops=tuple(conds),
            module_rules=rules,
        )

    def module_dtype(self, module: nn.Module, name: str | None) -> torch.dtype | None:
        """The dtype a module rule pins ``module`` (called ``name``, its qualified name
        in the model, None if unknown) to, or None. Name globs win over classes; among classes the most specific (nearest in the MRO) wins."""
        if not self.module_rules:
            return None
        if name is not None:
            for key, dtype in self.module_rules.items():
                if isinstance(key, str) and fnmatch.fnmatchcase(name, key):
                    return dtype
        best: tuple[int, torch.dtype] | None = None
        mro = type(module).__mro__
        for key, dtype in self.module_rules.items():
            if isinstance(key, type) and key in mro:
                rank = mro.index(key)
                if best is None or rank < best[0]:
                    best = (rank, dtype)
        return None if best is None else best[1]


def check_device_type(device_type: str) -> str:
    """Validate a device type ampkit has lists for."""
    if not isinstance(device_type, str):
        raise PolicyError(f"device_type must be a string such as 'cpu' or 'cuda', got {device_type!r}.")
    try:
        available = torch.amp.is_autocast_available(device_type)
    except Exception:
        available = False
    if not available:
        raise PolicyError(f"torch cannot autocast on device type {device_type!r}; use 'cpu' or 'cuda'.")
    if device_type not in DEFAULT_LISTS:
        raise PolicyError(
            f"ampkit has op lists for {sorted(DEFAULT_LISTS)} only, not {device_type!r}; "
            "use torch.autocast directly on this device."
        )
    return device_type


def default_policy(device_type: str = "cpu", dtype: torch.dtype | None = None) -> Policy:
    """The policy that reproduces ``torch.autocast(device_type, dtype)`` op for op.

    Args:
        device_type: ``"cpu"`` (default) or ``"cuda"``.
        dtype: compute dtype; default ``torch.bfloat16`` on CPU, ``torch.float16`` on CUDA.
    """
    check_device_type(device_type)
    if dtype is None:
        dtype = default_dtype(device_type)
    lists = DEFAULT_LISTS[device_type]
    return Policy(
        dtype=check_compute_dtype(dtype),
        lower_ops=lists["lower"],
        fp32_ops=lists["fp32"],
        promote_ops=lists["promote"],
    )


def _rebuild_policy(
    dtype: torch.dtype,
    lower_ops: tuple[OpSpec, ...],
    fp32_ops: tuple[OpSpec, ...],
    promote_ops: tuple[OpSpec, ...],
    conditional_fp32_ops: tuple[tuple[OpSpec, Predicate], ...],
    module_rules: dict[ModuleKey, torch.dtype],
) -> Policy:
    """Unpickle a :class:`Policy` (see ``Policy.__reduce__``)."""
    return Policy(
        dtype=dtype, lower_ops=lower_ops, fp32_ops=fp32_ops, promote_ops=promote_ops,
        conditional_fp32_ops=conditional_fp32_ops, module_rules=module_rules,
    )
