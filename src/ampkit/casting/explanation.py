"""``ampkit.explain``: which op ran in which dtype, and which casts were inserted.

The report is recorded below autocast and autograd with a ``TorchDispatchMode``, so
it shows the aten ops that actually computed, with the casts (``aten::_to_copy``)
that autocast or ampkit inserted in front of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit._internal import observe
from ampkit._internal.dtypes import dtype_name
from ampkit._internal.torch_compat import (
    TorchDispatchMode,
    compiled_function_inner,
    compiled_module_inner,
    tree_flatten,
)
from ampkit.errors import AmpError, PolicyError

from . import engine as casting
from .policy import Policy

__all__ = ["explain", "ExplainError", "ExplainReport", "OpRecord", "CastRecord"]


class ExplainError(AmpError, RuntimeError):
    """The call :func:`explain` was asked to run raised: typically inputs the model
    does not take. The original exception is its ``__cause__``."""

_CAST_OPS = {"_to_copy"}  # what .to(dtype) and autocast's casts reach the dispatcher as


@dataclasses.dataclass(frozen=True)
class CastRecord:
    """A dtype conversion of one tensor (``shape``) from ``src`` to ``dst``."""

    src: torch.dtype
    dst: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One aten op call: its name (``op``), the dtypes of its tensor inputs and outputs
    (``input_dtypes``, ``output_dtypes``), and the ``casts`` that were inserted for it
    (those recorded since the previous op)."""

    op: str
    input_dtypes: tuple[torch.dtype, ...]
    output_dtypes: tuple[torch.dtype, ...]
    casts: tuple[CastRecord, ...]

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The floating dtype the op produced (None when it produced no float tensor)."""
        for dt in self.output_dtypes:
            if dt.is_floating_point:
                return dt
        return None


@dataclasses.dataclass
class ExplainReport:
    """What :func:`explain` recorded. ``records`` holds every non-view aten op in call
    order; ``trailing_casts`` the casts recorded after the last op; ``note`` is set when
    the call given was torch.compile'd (what was run instead, and why); ``fp8`` holds
    each fp8 matmul (:class:`ampkit.fp8.Fp8MatmulRecord`). ``totals`` counts ops by the
    floating dtype they produced and the casts."""

    records: list[OpRecord]
    trailing_casts: list[CastRecord]
    #: set when the call given was torch.compile'd: what was run instead, and why
    note: str | None = None
    #: each fp8 matmul (``amp.initialize(..., fp8=...)``): layer, operand dtypes, scales
    fp8: list[Any] = dataclasses.field(default_factory=list)

    @property
    def casts(self) -> list[CastRecord]:
        out = [c for r in self.records for c in r.casts]
        out.extend(self.trailing_casts)
        return out

    @property
    def totals(self) -> dict[str, int]:
        counts = {"ops_bf16": 0, "ops_fp16": 0, "ops_fp32": 0, "ops_other": 0, "casts": len(self.casts)}
        counts["matmuls_fp8"] = sum(r.op == "_scaled_mm" for r in self.records)
        for r in self.records:
            dt = r.compute_dtype
            if dt is torch.bfloat16:
                counts["ops_bf16"] += 1
            elif dt is torch.float16:
                counts["ops_fp16"] += 1
            elif dt is torch.float32:
                counts["ops_fp32"] += 1
            else:
                counts["ops_other"] += 1
        return counts

    def ops_in(self, dtype: torch.dtype) -> list[str]:
        """Names of the ops that produced ``dtype``."""
        return [r.op for r in self.records if r.compute_dtype is dtype]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dtype names as strings), e.g. for JSON."""

        def names(dts: tuple[torch.dtype, ...]) -> list[str]:
            return [str(d).replace("torch.", "") for d in dts]

        return {
            "ops": [
                {
                    "op": r.op,
                    "inputs": names(r.input_dtypes),
                    "outputs": names(r.output_dtypes),
                    "casts": [
                        {"from": names((c.src,))[0], "to": names((c.dst,))[0], "shape": list(c.shape)}
                        for c in r.casts
                    ],
                }
                for r in self.records
            ],
            "totals": self.totals,
            "fp8": [
                {"module": m.module, "matmul": m.matmul, "a": names((m.a_dtype,))[0], "b": names((m.b_dtype,))[0],
                 "a_scale": list(m.a_scale), "b_scale": list(m.b_scale), "out": names((m.out_dtype,))[0]}
                for m in self.fp8
            ],
        }

    _COLUMNS = ("#", "op", "inputs", "outputs", "casts inserted")

    def _rows(self) -> list[tuple[str, str, str, str, str]]:
        return [
            (
                str(i),
                r.op,
                _short(r.input_dtypes),
                _short(r.output_dtypes),
                ", ".join(f"{_short((c.src,))}->{_short((c.dst,))}" for c in r.casts),
            )
            for i, r in enumerate(self.records)
        ]

    def _totals_line(self) -> str:
        t = self.totals
        fp8 = f", {t['matmuls_fp8']} fp8 matmuls" if t["matmuls_fp8"] else ""
        return (
            f"totals: {t['ops_bf16']} ops in bf16, {t['ops_fp16']} in fp16, {t['ops_fp32']} in fp32, "
            f"{t['ops_other']} other, {t['casts']} casts{fp8}"
        )

    def table(self) -> str:
        """The report as a fixed-width text table."""
        rows = [self._COLUMNS, *self._rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self._COLUMNS))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(self._totals_line())
        if self.fp8:
            lines.append("fp8 matmuls (dequant scales = 1/scale of each operand):")
            lines.extend("  " + m.describe() for m in self.fp8)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table() if self.note is None else f"{self.note}\n{self.table()}"

    def __rich__(self) -> Any:  # pragma: no cover - rendering only
        from rich.table import Table

        table = Table(title="ampkit.explain", caption=self._totals_line())
        for col in self._COLUMNS:
            table.add_column(col)
        for row in self._rows():
            table.add_row(*row)
        return table


_INT_NAMES = {torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}


def _short(dtypes: tuple[torch.dtype, ...]) -> str:
    return ",".join(dtype_name(d, extra=_INT_NAMES) for d in dtypes) or "-"


def _tensor_dtypes(value: Any) -> tuple[torch.dtype, ...]:
    leaves, _ = tree_flatten(value)
    return tuple(x.dtype for x in leaves if isinstance(x, torch.Tensor))


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[OpRecord] = []
        self.pending: list[CastRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _CAST_OPS:
            src = args[0].dtype if args and isinstance(args[0], torch.Tensor) else None
            if isinstance(out, torch.Tensor) and src is not None and src != out.dtype:
                self.pending.append(CastRecord(src, out.dtype, tuple(out.shape)))
            return out
        if func.is_view or name in ("detach", "alias", "lift_fresh"):
            return out
        self.records.append(
            OpRecord(name, _tensor_dtypes((args, kwargs)), _tensor_dtypes(out), tuple(self.pending))
        )
        self.pending = []
        return out


def explain(
    fn_or_module: Callable[..., Any] | nn.Module,
    *inputs: Any,
    policy: Policy | None = None,
    device_type: str | None = None,
    **kwargs: Any,
) -> ExplainReport:
    """Run ``fn_or_module(*inputs, **kwargs)`` once and report each op's dtypes.

    If ``policy`` is given, or no ampkit scope is active, the call runs under
    ``ampkit.autocast(policy, device_type)`` (the device's defaults when ``policy`` is
    None); otherwise under the scope already active (e.g. ``ampkit.init``). Runs under
    ``torch.no_grad`` only if the caller did; nothing is kept beyond the report.

    A ``torch.compile``'d module or function is explained through the eager code it
    wraps (``report.note`` says so): compiled code runs fused kernels that no dispatch
    mode sees, and its ops run in the same dtypes as the eager ones.

    fp8 linears (``amp.initialize(..., fp8=...)``) show as ``_scaled_mm`` records and,
    in ``report.fp8``, one :class:`ampkit.fp8.Fp8MatmulRecord` per matmul with its
    scales; their scale state is not advanced by the explained call.

    Returns an :class:`ExplainReport`; ``print(report)`` shows a table.

    Raises :class:`ExplainError` (chained to the original) when the call raises.
    """
    if not callable(fn_or_module):
        raise AmpError(
            f"explain expects a function or an nn.Module to run, got {type(fn_or_module).__name__}; "
            "call it as ampkit.explain(model, *example_inputs)."
        )
    if policy is not None and not isinstance(policy, Policy):
        raise PolicyError(f"policy must be an ampkit.Policy, got {type(policy).__name__}.")
    fn_or_module, note = _eager(fn_or_module)
    recorder = _Recorder()
    use_scope = policy is not None or not casting.is_active()
    scope = casting.autocast(policy, device_type) if use_scope else None
    if scope is not None:
        scope.__enter__()
    casting.kernel_registry.verify()  # report the dtypes ampkit's kernels give, not another's
    try:  # records reported by the levels above (fp8 matmuls) while the model runs
        with recorder, observe.collector() as fp8_records:
            fn_or_module(*inputs, **kwargs)
    except AmpError:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()
        given = ", ".join([_describe(x) for x in inputs] + [f"{k}={_describe(v)}" for k, v in kwargs.items()])
        raise ExplainError(
            f"explain ran {getattr(fn_or_module, '__name__', type(fn_or_module).__name__)}({given}) and it "
            f"raised {type(exc).__name__}: {text[0] if text else ''}. Pass the inputs the model takes: "
            "ampkit.explain(model, *example_inputs, **keyword_inputs)."
        ) from exc
    finally:
        if scope is not None:
            scope.__exit__(None, None, None)
    return ExplainReport(recorder.records, recorder.pending, note, fp8_records)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor{list(x.shape)} {str(x.dtype).replace('torch.', '')}"
    return f"{type(x).__name__} {x!r:.30}"


def _eager(fn: Any) -> tuple[Any, str | None]:
    """The eager module or function under ``torch.compile``'s wrapper, if any."""
    inner = compiled_module_inner(fn) if isinstance(fn, nn.Module) else None
    if inner is not None:
        return inner, f"(explained the eager {type(inner).__name__} that torch.compile wraps; compiled code uses the same dtypes)"
    inner = compiled_function_inner(fn)
    if inner is not None:
        name = getattr(inner, "__name__", type(inner).__name__)
        return inner, f"(explained the eager {name} that torch.compile wraps; compiled code uses the same dtypes)"
    return fn, None
