"""The op-level checker of a diagnostic step.

A ``TorchDispatchMode`` (below autocast and autograd, so it sees the aten ops that
actually computed, in the dtypes they computed in) checks every op's floating outputs
for inf/NaN, in the forward and in the backward pass. The first op whose outputs are
non-finite while its inputs are all finite is the *origin*. Its module is the
innermost module running it (forward) or the module whose forward created the
autograd node being executed (backward: ``torch._C._current_autograd_node()`` mapped
through the graph the forward built). It also records the next op that consumed the
non-finite value, what the origin op computes in fp32 (the same op re-run on fp32
copies of its inputs), and, in the backward pass, how many elements of each 16-bit
op's result flush to zero or to subnormals compared with the same op in fp32.

Cost: every op of the checked step is followed by a host sync (the finiteness test),
and every 16-bit backward op runs a second time in fp32. One step under the checker
costs a few times a plain step on CPU (far more on a GPU, where syncs stall the
stream); the doctor runs it on one step at a time, rate-limited.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from ampkit._internal import torch_compat
from ampkit._internal.dtypes import LOW_PRECISION, dtype_name
from ampkit._internal.torch_compat import TorchDispatchMode, tree_flatten, tree_map

# ops that create or copy values without computing them: never an origin
_SKIP = {
    "detach", "alias", "lift_fresh", "copy_", "clone", "empty_like", "empty",
    "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "fill_",
    "zero_", "zeros", "ones", "full", "scalar_tensor", "_local_scalar_dense", "empty_strided",
    "new_empty_strided", "_unsafe_view", "contiguous", "isfinite", "isinf", "isnan", "_amp_foreach_non_finite_check_and_unscale_",
    "_amp_update_scale_", "set_", "_has_compatible_shallow_copy_type", "resize_",
}
# Collectives (DDP's all-reduce, FSDP's gathers) move values between ranks and compute
# none: an inf they bring in began on another rank, whose own checker names it. Their
# outputs are not even final when the op returns (the work runs asynchronously), so
# whether one looked non-finite here would depend on timing.
# Collectives, and FSDP2's own ops around them (``fsdp::all_gather_copy_in`` copies the
# shards into a buffer torch.empty made: its "inputs" hold whatever that memory held).
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "fsdp"}
_HIST_OFFSET = 160  # frexp exponents of fp32 values lie in [-148, 129]
_HIST_BINS = 320


@dataclasses.dataclass(frozen=True)
class TensorStats:
    """Range of one tensor: ``dtype``, ``shape``, the largest and the smallest
    non-zero finite magnitude (``abs_max``, ``abs_min``), and how many elements are
    inf/NaN (``nonfinite``)."""

    dtype: str
    shape: tuple[int, ...]
    abs_max: float
    abs_min: float
    nonfinite: int

    @staticmethod
    def of(t: torch.Tensor) -> TensorStats:
        d = t.detach()
        if d.is_complex():
            d = torch.view_as_real(d)
        a = d.abs().float()
        finite = torch.isfinite(a)
        nonfinite = int((~finite).sum())
        fin = a[finite]
        nz = fin[fin > 0]
        abs_max = float(fin.max()) if fin.numel() else math.nan
        if nonfinite and (torch.isinf(a).any()):
            abs_max = math.inf
        abs_min = float(nz.min()) if nz.numel() else 0.0
        return TensorStats(dtype_name(t.dtype), tuple(t.shape), abs_max, abs_min, nonfinite)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"shape": list(self.shape)}


@dataclasses.dataclass
class OpOrigin:
    """The first op of a checked step that produced inf/NaN from finite inputs."""

    op: str
    direction: str  # "forward" | "backward"
    module: str | None
    node: str | None  # backward: the autograd node executing (e.g. "AddmmBackward0")
    torch_function: str | None  # forward: the outermost torch function being called
    function: Any  # that function object (for a Policy op), not serialized
    inputs: list[TensorStats]
    outputs: list[TensorStats]
    fp32_abs_max: float | None  # what the op computes in fp32 (None: not re-runnable)
    consumer: str | None = None
    consumer_module: str | None = None


@dataclasses.dataclass
class Entered:
    """Non-finite values that reached a checked op from outside (a parameter, a
    buffer, the input batch): no op of the step produced them."""

    op: str
    direction: str
    module: str | None
    inputs: list[TensorStats]
    params: list[str]


class _OfChecker:
    """Base of the two modes below: each serves one :class:`OpChecker`."""

    def __init__(self, checker: OpChecker) -> None:
        super().__init__()
        self.checker = checker


class _FunctionTracker(_OfChecker, TorchFunctionMode):
    """Remembers the outermost torch function running (only outermost calls reach a
    torch-function mode: it is disabled while it handles one)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        checker = self.checker
        if checker.paused:
            return func(*args, **kwargs)
        previous, checker.function = checker.function, func
        try:
            return func(*args, **kwargs)
        finally:
            checker.function = previous


class _CheckMode(_OfChecker, TorchDispatchMode):
    """Runs the aten ops through the checker (a cast also through its underflow check)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        checker = self.checker
        if checker.paused:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "_to_copy":  # a cast down can overflow (and, in backward, flush)
            out = checker.run(func, name, args, kwargs)
            checker.cast_underflow(args, out)
            return out
        if func.is_view or name in _SKIP or func.namespace in _COLLECTIVE_NAMESPACES:
            return func(*args, **kwargs)
        return checker.run(func, name, args, kwargs)


def _float_tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [
        t for t in leaves
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel() > 0
    ]


def _all_finite(ts: list[torch.Tensor]) -> bool:
    for t in ts:
        d = torch.view_as_real(t) if t.is_complex() else t
        if not bool(torch.isfinite(d).all()):
            return False
    return True


def _function_name(function: Any) -> str | None:
    """The public torch name of ``function`` (``torch.nn.functional.linear``), else its
    ``__name__``; None for None."""
    if function is None:
        return None
    try:
        return resolve_name(function) or getattr(function, "__name__", None)
    except Exception:
        return getattr(function, "__name__", None)


def _upcast(value: Any) -> Any:
    return tree_map(lambda x: x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION else x, value)


class OpChecker:
    """State of one diagnostic step (see the module docstring)."""

    def __init__(self, param_name: Any, track_underflow: bool = True) -> None:
        self.paused = False
        self.function: Any = None
        self.forward_module: str | None = None
        self.nodes: dict[int, tuple[Any, str]] = {}
        self.origin: OpOrigin | None = None
        self.entered: Entered | None = None
        self.ops = 0
        # tensors holding deliberate -inf (attention masks): id -> weak reference
        self._masks: dict[int, weakref.ref] = {}
        self.track_underflow = track_underflow
        self.hist = torch.zeros(_HIST_BINS, dtype=torch.int64)
        # module -> [flushed, subnormal, nonzero-in-fp32] counts of 16-bit backward results
        self.flush: dict[str, torch.Tensor] = {}
        self.flush_ops: dict[str, set[str]] = {}
        self._param_name = param_name
        self._mode = _CheckMode(self)
        self._functions = _FunctionTracker(self)
        self._in_forward = False
        self.active = False

    # --- enter / leave --------------------------------------------------------------
    def start(self) -> None:
        self._mode.__enter__()
        self.active = True

    def stop(self) -> None:
        if self._in_forward:
            self.exit_forward()
        if self.active:
            self.active = False
            self._mode.__exit__(None, None, None)

    def enter_forward(self) -> None:
        if not self._in_forward:
            self._functions.__enter__()
            self._in_forward = True

    def exit_forward(self) -> None:
        if self._in_forward:
            self._in_forward = False
            self._functions.__exit__(None, None, None)

    def map_nodes(self, outputs: list[torch.Tensor], stop: set[int], module: str) -> None:
        """Attribute the autograd nodes the forward of ``module`` created (those
        reachable from its outputs, up to its inputs' nodes) to ``module``; inner
        modules map theirs first. The walk goes on through the nodes of inner modules
        (they keep their module) to the ones this module's own code made before it
        called them: a custom autograd function applied in its ``forward``, say."""
        todo = [t.grad_fn for t in outputs]
        seen: set[int] = set()
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen or id(node) in stop:
                continue
            seen.add(id(node))
            self.nodes.setdefault(id(node), (node, module))
            todo.extend(n for n, _ in node.next_functions if n is not None)

    # --- per op ---------------------------------------------------------------------
    def _where(self) -> tuple[str, str | None, str | None]:
        node = torch_compat.current_autograd_node()
        if node is None:
            return "forward", self.forward_module, None
        hit = self.nodes.get(id(node))
        module = hit[1] if hit is not None else None
        if module is None and type(node).__name__ == "AccumulateGrad":
            module = self._param_name(getattr(node, "variable", None))
        return "backward", module, type(node).__name__

    def run(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        self.ops += 1
        mutable = torch_compat.overload_schema(func).is_mutable
        inputs = _float_tensors((args, kwargs))
        searching = self.origin is None and self.entered is None
        consumer_search = self.origin is not None and self.origin.consumer is None
        inputs_finite = None
        if mutable and (searching or consumer_search):
            inputs_finite = _all_finite(inputs)  # before the op writes into them
        out = func(*args, **kwargs)
        if not (searching or consumer_search or self.track_underflow):
            return out
        self.paused = True
        try:
            outputs = _float_tensors(out)
            if searching and outputs and not _all_finite(outputs):
                if self._is_mask(inputs, outputs):
                    for t in outputs:
                        self._masks[id(t)] = weakref.ref(t)
                    return out
                if inputs_finite is None:
                    inputs_finite = _all_finite(inputs)
                self._record(func, name, args, kwargs, inputs, outputs, inputs_finite)
            elif consumer_search and inputs:
                if inputs_finite is None:
                    inputs_finite = _all_finite(inputs)
                if not inputs_finite:
                    _, module, _ = self._where()
                    self.origin.consumer = name  # type: ignore[union-attr]
                    self.origin.consumer_module = module  # type: ignore[union-attr]
            if (
                self.track_underflow and not mutable and outputs and name != "_to_copy"
                and torch_compat.current_autograd_node() is not None
            ):
                self._underflow(func, args, kwargs, outputs)
        finally:
            self.paused = False
        return out

    def _is_mask(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
        """Whether the op's non-finite results are a deliberate mask (an attention mask's
        -inf): every non-finite output value is -inf, and every input holding a
        non-finite value is a constant (a 0-dim tensor: ``where(mask, 0, -inf)``) or a
        mask itself. Overflows give NaN or +inf somewhere, or come from finite inputs."""
        if not all(bool((torch.isfinite(t) | (t == float("-inf"))).all()) for t in outputs):
            return False
        nonfinite = [t for t in inputs if not _all_finite([t])]
        if not nonfinite:
            return False
        for t in nonfinite:
            ref = self._masks.get(id(t))
            if t.dim() != 0 and (ref is None or ref() is not t):
                return False
        return True

    def _record(
        self, func: Any, name: str, args: tuple, kwargs: dict,
        inputs: list[torch.Tensor], outputs: list[torch.Tensor], inputs_finite: bool,
    ) -> None:
        direction, module, node = self._where()
        in_stats = [TensorStats.of(t) for t in inputs]
        if not inputs_finite:
            params = []
            for t in inputs:
                pname = self._param_name(t)
                if pname is not None and not _all_finite([t]):
                    params.append(pname)
            self.entered = Entered(name, direction, module, in_stats, params)
            return
        fp32_max = None
        if name == "_to_copy":  # a cast: the value it could not hold is its input's
            fp32_max = max((s.abs_max for s in in_stats), default=None)
        elif any(t.dtype in LOW_PRECISION for t in inputs):
            try:
                ref = _float_tensors(func(*_upcast(args), **_upcast(kwargs)))
                fp32_max = max(float(r.detach().abs().float().max()) for r in ref) if ref else None
            except Exception:  # an op that cannot run on fp32 copies: no reference value
                fp32_max = None
        function = self.function if direction == "forward" else None
        self.origin = OpOrigin(
            op=name,
            direction=direction,
            module=module,
            node=node,
            torch_function=_function_name(function),
            function=function,
            inputs=in_stats,
            outputs=[TensorStats.of(t) for t in outputs],
            fp32_abs_max=fp32_max,
        )

    def cast_underflow(self, args: tuple, out: Any) -> None:
        """A backward cast down to 16 bits (autocast's cast of an fp32 grad): the
        values it flushes, against its fp32 input."""
        if self.paused or not isinstance(out, torch.Tensor) or out.dtype not in LOW_PRECISION:
            return
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is None or src.dtype in LOW_PRECISION or not src.is_floating_point():
            return
        if torch_compat.current_autograd_node() is None:
            return
        self.paused = True
        try:
            self._count_flushed("_to_copy", [out], [src])
        finally:
            self.paused = False

    def _underflow(self, func: Any, args: tuple, kwargs: dict, outputs: list[torch.Tensor]) -> None:
        low = [t for t in outputs if t.dtype in LOW_PRECISION]
        if not low:
            return
        try:
            refs = _float_tensors(func(*_upcast(args), **_upcast(kwargs)))
        except Exception:
            return
        if len(refs) != len(outputs):
            return
        self._count_flushed(func.overloadpacket.__name__, outputs, refs)

    def _count_flushed(self, op: str, outputs: list[torch.Tensor], refs: list[torch.Tensor]) -> None:
        _, module, _ = self._where()
        key = module or "(outside modules: the loss)"
        for out, ref in zip(outputs, refs):
            if out.dtype not in LOW_PRECISION or ref.shape != out.shape:
                continue
            r = ref.detach().float().abs()
            nz = (r > 0) & torch.isfinite(r)
            o = out.detach().abs()
            flushed = (nz & (o == 0)).sum()
            sub = (nz & (o > 0) & (o < torch.finfo(out.dtype).smallest_normal)).sum()
            counts = torch.stack([flushed, sub, nz.sum()]).to(torch.int64).cpu()
            self.flush[key] = self.flush.get(key, torch.zeros(3, dtype=torch.int64)) + counts
            self.flush_ops.setdefault(key, set()).add(op)
            values = r[nz]
            if values.numel():
                exps = torch.frexp(values).exponent.to(torch.int64).cpu() + _HIST_OFFSET
                self.hist += torch.bincount(exps.clamp_(0, _HIST_BINS - 1), minlength=_HIST_BINS)

    # --- results ----------------------------------------------------------------------
    def magnitude_range(self) -> tuple[float, float] | None:
        """(smallest, largest) non-zero magnitude of the 16-bit backward results as
        computed in fp32, to a factor of 2 (binary exponents), or None."""
        nz = torch.nonzero(self.hist).flatten().tolist()
        if not nz:
            return None
        return math.ldexp(0.5, nz[0] - _HIST_OFFSET), math.ldexp(1.0, nz[-1] - _HIST_OFFSET)

    def flush_summary(self) -> dict[str, tuple[int, int, int]]:
        return {k: tuple(int(x) for x in v.tolist()) for k, v in self.flush.items()}  # type: ignore[misc]
