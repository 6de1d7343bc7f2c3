"""Plain data the doctor produces: findings, margins, steps, misuse warnings."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import torch

from ampkit._internal.dtypes import dtype_name

from ._checker import TensorStats


def _num(x: float | None) -> float | str | None:
    """A float for JSON: inf/NaN as strings."""
    if x is None:
        return None
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


@dataclasses.dataclass
class Finding:
    """Where a non-finite value (or an underflow) came from.

    Attributes:
        step: the optimizer step (``ampkit.stats(opt).steps``) it was seen at.
        scale: the loss scale of that step.
        kind: ``"overflow"`` (an op or module produced inf/NaN from finite inputs),
            ``"nonfinite_input"`` (inf/NaN reached the step from outside: a parameter,
            a buffer, the input batch) or ``"underflow"`` (16-bit gradients flushed
            to zero).
        level: ``"op"`` (from the op-level checker) or ``"module"`` (from the module
            hooks of the failing step itself).
        direction: ``"forward"`` or ``"backward"`` (None for underflow).
        module: qualified module name, relative to the outermost module called (as
            ``Policy.module_rules`` globs match it); ``module_type`` its class name.
        op: the aten op (op level), e.g. ``"addmm"``, ``"bmm"``, ``"mul"``.
        node: backward: the autograd node that ran the op (``"AddmmBackward0"``).
        torch_function: forward: the outermost torch function called (``"torch.matmul"``).
        policy_op: the name to list in ``Policy(fp32_ops=[...])`` for that function.
        inputs, outputs: :class:`TensorStats` of the op's floating inputs/outputs
            (dtype, shape, abs-max, smallest non-zero abs, non-finite count).
        fp32_abs_max: the largest magnitude the same op computes on fp32 copies of
            its inputs (what the value would have been without the 16-bit limit).
        consumer, consumer_module: the next op that read the non-finite value.
        params: backward: the parameter(s) whose gradient first went non-finite;
            ``nonfinite_input``: the non-finite parameter(s).
        ranks: the ranks where the value first appeared (multi-process runs).
        recurred: module level, after an op-level re-check: whether it happened again.
        flushed: underflow: per module, (flushed to zero, left subnormal, non-zero in
            fp32) element counts of its 16-bit backward results.
        magnitude_range: underflow: (smallest, largest) non-zero magnitude of the 16-bit
            backward results as fp32 computes them, at ``scale``.
    """

    step: int
    scale: float
    kind: str
    level: str
    direction: str | None = None
    module: str | None = None
    module_type: str | None = None
    op: str | None = None
    node: str | None = None
    torch_function: str | None = None
    policy_op: str | None = None
    inputs: list[TensorStats] = dataclasses.field(default_factory=list)
    outputs: list[TensorStats] = dataclasses.field(default_factory=list)
    fp32_abs_max: float | None = None
    consumer: str | None = None
    consumer_module: str | None = None
    params: list[str] = dataclasses.field(default_factory=list)
    ranks: list[int] = dataclasses.field(default_factory=list)
    recurred: bool | None = None
    flushed: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    magnitude_range: tuple[float, float] | None = None
    dtype: str | None = None

    def where(self) -> str:
        """``module (Type)``, ``op`` and direction in words."""
        parts = []
        if self.module is None and self.op is None and self.direction == "forward":
            parts.append("the loss (computed outside any module)")
        if self.module is None and self.op is None and self.direction == "backward":
            parts.append("the gradient of the model's output (the loss's backward, outside any module)")
        if self.module is not None:
            parts.append(f"{self.module or '<root>'}" + (f" ({self.module_type})" if self.module_type else ""))
        if self.op:
            parts.append(f"op {self.op}" + (f" [{self.node}]" if self.node else ""))
        if self.direction:
            parts.append(self.direction)
        return ", ".join(parts) or "unknown"

    def summary(self) -> str:
        """One line saying what happened where."""
        if self.kind == "underflow":
            total = sum(v[0] for v in self.flushed.values())
            nz = sum(v[2] for v in self.flushed.values())
            frac = total / nz if nz else 0.0
            return (
                f"step {self.step}: {frac:.0%} of the non-zero 16-bit backward values flush to zero "
                f"at loss scale {self.scale:g}"
            )
        if self.kind == "nonfinite_input":
            src = ", ".join(self.params) if self.params else "the input batch or a buffer"
            return f"step {self.step}: inf/NaN entered from outside ({src}) at {self.where()}"
        what = "inf/NaN"
        if self.outputs:
            o = self.outputs[0]
            what = f"{o.nonfinite} inf/NaN in {o.dtype} output {list(o.shape)}"
        line = f"step {self.step}: first non-finite value at {self.where()}: {what}"
        if self.fp32_abs_max is not None:
            line += f" (fp32 computes abs-max {self.fp32_abs_max:.3g})"
        if self.ranks:
            line += f" on rank {', '.join(map(str, self.ranks))}"
        if self.recurred is False:
            line += " (did not recur in the op-level check of a later step)"
        return line

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Finding:
        """The inverse of :meth:`to_dict`: the finding ``d`` describes (another rank's
        finding)."""

        def num(x: Any) -> float | None:
            return float(x) if isinstance(x, str) else x

        def stats(items: list[dict[str, Any]]) -> list[TensorStats]:
            return [
                TensorStats(s["dtype"], tuple(s["shape"]), num(s["abs_max"]), num(s["abs_min"]), s["nonfinite"])
                for s in items
            ]

        fields = {f.name for f in dataclasses.fields(Finding)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["inputs"], kw["outputs"] = stats(d.get("inputs", [])), stats(d.get("outputs", []))
        kw["fp32_abs_max"] = num(d.get("fp32_abs_max"))
        kw["flushed"] = {k: tuple(v) for k, v in (d.get("flushed") or {}).items()}
        kw["magnitude_range"] = tuple(d["magnitude_range"]) if d.get("magnitude_range") else None
        return Finding(**kw)

    def to_dict(self) -> dict[str, Any]:
        """This finding as plain JSON types (what :meth:`from_dict` reads back)."""
        d = dataclasses.asdict(self)
        d["inputs"] = [s.to_dict() | {"abs_max": _num(s.abs_max), "abs_min": _num(s.abs_min)} for s in self.inputs]
        d["outputs"] = [s.to_dict() | {"abs_max": _num(s.abs_max), "abs_min": _num(s.abs_min)} for s in self.outputs]
        d["fp32_abs_max"] = _num(self.fp32_abs_max)
        d["flushed"] = {k: list(v) for k, v in self.flushed.items()}
        d["magnitude_range"] = list(self.magnitude_range) if self.magnitude_range else None
        d["summary"] = self.summary()
        return d


@dataclasses.dataclass
class StepPoint:
    """One optimizer step as the doctor saw it: the ``optimizer`` (its index), the
    ``step``, the loss ``scale``, whether it was ``skipped``, the ``loss`` and the
    ``grad_norm`` of the grads backward produced (unscaled; None when not measured)."""

    optimizer: int
    step: int
    scale: float
    skipped: bool
    loss: float | None
    grad_norm: float | None  # of the grads backward produced, unscaled


@dataclasses.dataclass
class ModuleMargin:
    """How close one module runs to its dtype's limits (running over the steps seen).

    ``act_abs_max``: the largest finite abs-max of its floating outputs; ``grad_abs_max``:
    of the gradients at its outputs and of its 16-bit parameters' gradients, as held
    in memory (i.e. at the loss scale of the time); ``*_limit``: the largest finite
    value of the dtype they were in; ``overflows``: steps in which it was the first
    module to produce inf/NaN (forward or backward); ``underflow``: of its parameters' non-zero
    gradient elements at the last step, the fraction below the compute dtype's
    smallest normal (fp16: 6.1e-5) at the loss scale: subnormal, with fewer bits, and
    flushed to zero below 2**-24; ``zeros``: the fraction of exact zeros (flushed values
    and true zeros, e.g. of dead ReLU units, look alike here: the op-level check tells
    them apart by recomputing in fp32); ``risk`` = max(act/limit, grad/limit, underflow).
    Also: the module's qualified name (``module``), class (``module_type``) and compute
    ``dtype``; ``act_limit``/``grad_limit`` (the ``*_limit`` above);
    ``nonfinite_steps``: the steps in which its outputs, the gradients at them or its
    parameters' gradients held inf/NaN;
    ``steps``: the steps seen; ``act_history``: ``(step, act_abs_max)`` of the last 64
    checked steps."""

    module: str
    module_type: str
    dtype: str
    act_abs_max: float = 0.0
    act_limit: float = math.inf
    grad_abs_max: float = 0.0
    grad_limit: float = math.inf
    underflow: float = 0.0
    zeros: float = 0.0
    overflows: int = 0
    nonfinite_steps: int = 0
    steps: int = 0
    act_history: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=64))

    @property
    def risk(self) -> float:
        """max(act/limit, grad/limit, underflow); 1 or more once the module was the
        first to produce inf/NaN in a step (``overflows``)."""
        ratio = max(self.act_abs_max / self.act_limit, self.grad_abs_max / self.grad_limit, self.underflow)
        return max(ratio, 1.0 + self.overflows) if self.overflows else ratio

    @staticmethod
    def headroom(value: float, limit: float) -> float:
        """Binary orders of magnitude ``value`` is below ``limit`` (inf when nothing
        seen)."""
        if value <= 0 or math.isinf(limit):
            return math.inf
        return math.log2(limit / value)

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "type": self.module_type,
            "dtype": self.dtype,
            "act_abs_max": _num(self.act_abs_max),
            "act_limit": _num(self.act_limit),
            "act_headroom_bits": _num(self.headroom(self.act_abs_max, self.act_limit)),
            "grad_abs_max": _num(self.grad_abs_max),
            "grad_limit": _num(self.grad_limit),
            "grad_headroom_bits": _num(self.headroom(self.grad_abs_max, self.grad_limit)),
            "underflow": self.underflow,
            "zeros": self.zeros,
            "overflows": self.overflows,
            "nonfinite_steps": self.nonfinite_steps,
            "risk": _num(self.risk),
        }


def limit_of(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max) if dtype.is_floating_point else math.inf


@dataclasses.dataclass
class Misuse:
    """A training-loop mistake the doctor saw: ``kind``, the ``step``, a ``message``
    that says what to change, and ``details`` (the figures the message is built from)."""

    kind: str
    step: int
    message: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


__all__ = ["Finding", "StepPoint", "ModuleMargin", "Misuse", "TensorStats", "dtype_name", "limit_of"]
