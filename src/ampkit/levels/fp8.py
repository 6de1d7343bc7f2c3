"""fp8 training: chosen ``nn.Linear`` layers compute their matmuls in 8-bit floats.

``amp.initialize(model, opt, opt_level="O2", fp8=amp.Fp8Recipe(...))`` keeps the level
as it is (weights, masters, casting of every other op) and switches the linears the
recipe chooses to :class:`Float8Linear`, whose three matmuls run through
``torch._scaled_mm``:

- forward ``y = x @ w.T``: ``x`` and ``w`` in e4m3;
- backward ``grad_x = grad_y @ w`` and ``grad_w = grad_y.T @ x``: ``grad_y`` in e5m2
  (``format="hybrid"``, the default: e5m2's range suits gradients) or e4m3
  (``format="e4m3"``), against the e4m3 ``w`` and ``x`` saved by the forward.

Each 8-bit tensor carries a scale: ``q = saturate(t * scale)`` in fp8, and the matmul
multiplies by ``1/scale`` again (``_scaled_mm``'s ``scale_a``/``scale_b``). Scales:

- ``scaling="current"`` (torchao's default): from this tensor's own abs-max,
  ``scale = fp8_max / amax / 2**margin``, per tensor (``granularity="tensorwise"``) or
  per row of each matmul operand (``"rowwise"``).
- ``scaling="delayed"`` (TransformerEngine's ``DelayedScaling``): each tensor role
  (input, weight, grad_output) of each layer keeps a history of its last
  ``amax_history_len`` abs-maxes; the scale used now was computed from the history
  after the previous call (its max, or its most recent entry). A tensor that grows
  between two calls saturates once (values clamp to +-fp8_max, counted in
  ``saturated``), then the scale follows.

No fp8 cast turns a finite value into inf or NaN: values clamp to the largest finite
fp8 value. A non-finite tensor (a real overflow upstream) makes its matmul non-finite,
so the loss scaler sees it and skips the step; its abs-max never enters a history.

Under ``torch.distributed`` with more than one rank, the abs-max of each tensorwise
input and grad_output of a training step is all-reduced (MAX) before its scale is
derived, so every rank quantizes with the same scale; weights are the same on every rank
under DDP and are not reduced. Scales and histories are saved by ``amp.state_dict()``
(bitwise resume). Only training forwards (grad enabled) and their backward advance the
state: evaluation under ``no_grad`` and ``ampkit.explain`` use it as it is (and call no
collective), and a forward recomputed by activation checkpointing reuses the scales of
its first pass (the modes ``"train"``, ``"frozen"`` and ``"replay"``).

Under ``torch.compile`` each converted linear is one custom op (``ampkit::fp8_linear``
and its backward) that runs this module's eager code at run time: compiled fp8 computes
bitwise what eager fp8 computes, scale state included, with no graph break (see the
comment above ``_fp8_linear_op`` in ``ampkit/levels/fp8.py`` for why).

Implemented directly on ``torch._scaled_mm`` rather than on ``torchao.float8``:
torchao 0.15 runs on CPU but has no delayed scaling any more (only dynamic scaling),
keeps no scale state to checkpoint, and exposes no per-matmul scales to report; its
tensorwise numerics are the reference our tests compare against when it is installed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ampkit._internal import observe as _observe_mod
from ampkit._internal import registry as _reset
from ampkit._internal import torch_compat
from ampkit._internal.dtypes import dtype_name
from ampkit._internal.validate import (
    CORRUPT_CHECKPOINT,
    require_count,
    require_fields,
    require_flag,
    require_tensor,
)
from ampkit._internal.where import user_stacklevel
from ampkit.errors import AmpError, PolicyError, StateError

__all__ = [
    "Fp8Recipe",
    "Float8Linear",
    "Fp8LayerInfo",
    "Fp8MatmulRecord",
    "layers",
    "observe",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
_EPS = 1e-12  # abs-max floor: an all-zero tensor gets a large finite scale
ROLES = ("input", "weight", "grad_output")
_FP32 = torch.finfo(torch.float32)


def max_margin(fp8: torch.dtype) -> int:
    """The largest margin whose scales fp32 represents for every finite abs-max.

    ``scale = fp8_max / amax / 2**margin`` is smallest at fp32's largest abs-max; it must
    stay a normal fp32 number (a subnormal scale rounds ``t * scale``, a zero one turns
    the cast into 0 and its dequantization into inf: NaN outputs)::

        fp8_max / fp32_max / 2**margin >= fp32_tiny
        margin <= log2(fp8_max / (fp32_max * fp32_tiny))   # e4m3: 6.8, e5m2: 13.8

    Then ``1/scale`` is finite too (that needs only ``2**margin <= fp8_max``), and the
    abs-max lands at ``fp8_max / 2**margin`` (>= 7 for e4m3), inside fp8's normal range."""
    return int(math.floor(math.log2(torch.finfo(fp8).max / (_FP32.max * _FP32.tiny))))


#: ``Fp8Recipe.margin``'s upper bound: every recipe casts inputs and weights to e4m3,
#: whose range is the tighter (6; e5m2's alone would allow 13).
MAX_MARGIN = min(max_margin(E4M3), max_margin(E5M2))
#: Margins from this one up give away at least a quarter of e4m3's normal binades
#: (log2(448 / 2**-6) = 14.8): values more than ``14.8 - margin`` binades below a
#: tensor's abs-max become subnormal (fewer than 3 mantissa bits). Measured on 4096x64
#: tensors (e4m3 relative error, margin 0 / 4 / 6 / 8): Gaussian 0.026 / 0.026 / 0.026 /
#: 0.026, Student-t(3) 0.026 / 0.026 / 0.026 / 0.028, log-normal(sigma 2) 0.025 / 0.025 /
#: 0.026 / 0.039: heavy tails lose accuracy first.
WARN_MARGIN = 4
#: ``Fp8Recipe.amax_history_len``'s upper bound: TransformerEngine's default history
#: (``DelayedScaling(amax_history_len=1024)``), the longest in common use. Each fp8 layer
#: keeps 3 histories, rolled on every call: 12 KB and O(length) work a call at the bound
#: (at 10**8 it was 1.2 GB a layer and a copy of it every call).
MAX_AMAX_HISTORY_LEN = 1024
#: Margins already warned about (a recipe is rebuilt by ``dataclasses.replace``; warn
#: once a process per value); cleared by the reset hook below.
_WARNED_MARGINS: set[int] = set()
_SCALE_KEYS = ("scale", "amax", "amax_history", "saturated", "initialized", "calls")
_FP32_MAX = torch.finfo(torch.float32).max

Fp8Format = Literal["hybrid", "e4m3"]
Fp8Scaling = Literal["current", "delayed"]
Fp8Granularity = Literal["tensorwise", "rowwise"]
AmaxAlgo = Literal["max", "most_recent"]
ModuleFilter = Callable[[str, nn.Linear], bool]


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How fp8 training runs; pass it as ``amp.initialize(..., fp8=recipe)``.

    Attributes:
        format: ``"hybrid"`` (default; e4m3 forward, e5m2 gradients, TransformerEngine's
            HYBRID) or ``"e4m3"`` (e4m3 everywhere; required by ``"rowwise"``).
        scaling: ``"current"`` (default; scale from the tensor being cast) or
            ``"delayed"`` (scale from an abs-max history, updated after each call).
        granularity: ``"tensorwise"`` (default; one fp32 scale per tensor) or
            ``"rowwise"`` (one per row of each matmul operand; current scaling only).
        amax_history_len: abs-max entries kept per tensor role (delayed; default 16):
            an int in ``[1, MAX_AMAX_HISTORY_LEN]`` (1024, TransformerEngine's default).
        amax_compute_algo: ``"max"`` (default; max of the history) or
            ``"most_recent"`` (the latest entry) (delayed).
        margin: scale down by ``2**margin`` for headroom (default 0): an int in
            ``[0, MAX_MARGIN]`` (6, derived by ``max_margin``: beyond it fp32
            cannot represent the scale of every finite abs-max); from ``WARN_MARGIN``
            (4) on it warns once (small values of heavy-tailed tensors lose precision).
        power_of_2_scales: round each scale down to a power of two (default False), so
            scaling itself adds no rounding error.
        skip_first_last: leave the model's first and last ``nn.Linear`` (in module
            order) in the level's 16-bit dtype (default True): an LM's head and the
            input projection are the most sensitive layers.
        min_features: leave linears with ``in_features`` or ``out_features`` below this
            in 16 bits (default 1024; an int >= 0): below it an fp8 matmul's casts cost
            more than its faster multiply saves. Tiny test models pass e.g. 16.
        module_filter: ``fn(qualified_name, linear) -> bool``; when given it alone
            decides (``skip_first_last``/``min_features`` are not applied).
        exclude: qualified-name globs never converted (e.g. ``("*.attn.qkv",)``; a
            list is kept as a tuple).
        reduce_amax: all-reduce (MAX) the tensorwise abs-max of inputs and
            grad_outputs across ranks when ``torch.distributed`` runs more than one
            (default True).

    Only exact ``nn.Linear`` instances (not subclasses) whose ``in_features`` and
    ``out_features`` are multiples of 16 (what fp8 GEMM kernels require) are chosen.

    Every field is checked at construction: a wrong type or a value out of its range
    raises :class:`~ampkit.PolicyError` naming the range and why.
    """

    format: Fp8Format = "hybrid"
    scaling: Fp8Scaling = "current"
    granularity: Fp8Granularity = "tensorwise"
    amax_history_len: int = 16
    amax_compute_algo: AmaxAlgo = "max"
    margin: int = 0
    power_of_2_scales: bool = False
    skip_first_last: bool = True
    min_features: int = 1024
    module_filter: ModuleFilter | None = None
    exclude: tuple[str, ...] = ()
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        def one_of(name: str, options: tuple[str, ...]) -> None:
            if getattr(self, name) not in options:
                raise PolicyError(f"Fp8Recipe.{name} must be one of {options}, got {getattr(self, name)!r}.")

        one_of("format", ("hybrid", "e4m3"))
        one_of("scaling", ("current", "delayed"))
        one_of("granularity", ("tensorwise", "rowwise"))
        one_of("amax_compute_algo", ("max", "most_recent"))
        _check_int(
            "amax_history_len", self.amax_history_len, 1, MAX_AMAX_HISTORY_LEN,
            f"each fp8 layer keeps and rolls 3 histories of this length on every call; "
            f"{MAX_AMAX_HISTORY_LEN} is TransformerEngine's default, the longest in common use",
        )
        _check_int("min_features", self.min_features, 0, None, "it is a size in features")
        _check_int(
            "margin", self.margin, 0, MAX_MARGIN,
            f"scale = fp8_max / amax / 2**margin must be a normal fp32 number for every finite "
            f"abs-max (fp32's largest included), else casts round to 0 or their dequantization to "
            f"inf; e4m3's range allows margins up to {MAX_MARGIN}",
        )
        for name in ("power_of_2_scales", "skip_first_last", "reduce_amax"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(f"Fp8Recipe.{name} must be True or False, got {getattr(self, name)!r}.")
        if self.module_filter is not None and not callable(self.module_filter):
            raise PolicyError("Fp8Recipe.module_filter must be a callable (name, linear) -> bool.")
        globs = self.exclude
        if isinstance(globs, list):
            globs = tuple(globs)
        if not isinstance(globs, tuple) or not all(isinstance(g, str) for g in globs):
            raise PolicyError(f"Fp8Recipe.exclude must be a tuple of name globs (str), got {self.exclude!r}.")
        object.__setattr__(self, "exclude", globs)  # frozen: a list becomes the tuple it stands for
        if self.granularity == "rowwise":
            if self.scaling != "current":
                raise PolicyError(
                    "rowwise scales are derived from each call's own rows; delayed scaling keeps "
                    "one history per tensor. Use scaling='current' with rowwise, or tensorwise."
                )
            if self.format != "e4m3":
                raise PolicyError(
                    "row-wise scaled fp8 GEMMs take e4m3 operands only (as torchao's rowwise "
                    "recipe); use Fp8Recipe(format='e4m3', granularity='rowwise')."
                )
        if self.margin >= WARN_MARGIN and self.margin not in _WARNED_MARGINS:
            _WARNED_MARGINS.add(self.margin)
            warnings.warn(
                f"ampkit fp8: Fp8Recipe(margin={self.margin}) puts each tensor's abs-max at "
                f"fp8_max / 2**{self.margin} and gives away {self.margin} of e4m3's 14.8 normal binades: values "
                f"more than {14.8 - self.margin:.1f} binades below the abs-max lose precision (heavy-tailed "
                f"tensors lose accuracy first). Margins below {WARN_MARGIN} (TransformerEngine's default is 0) "
                "cost no measurable accuracy.",
                UserWarning,
                stacklevel=user_stacklevel() + 1,  # past the dataclass's generated __init__
            )

    @property
    def grad_dtype(self) -> torch.dtype:
        """The fp8 dtype of ``grad_output``: e5m2 (hybrid) or e4m3."""
        return E5M2 if self.format == "hybrid" else E4M3

    def describe(self) -> str:
        """One line, e.g. ``"hybrid current tensorwise"``."""
        extra = ""
        if self.scaling == "delayed":
            extra = f" (history {self.amax_history_len}, {self.amax_compute_algo})"
        return f"{self.format} {self.scaling}{extra} {self.granularity}"

    def choose(self, model: nn.Module) -> list[tuple[str, nn.Linear]]:
        """The ``(qualified name, linear)`` pairs of ``model`` this recipe converts."""
        linears = [(n, m) for n, m in model.named_modules() if type(m) in (nn.Linear, Float8Linear)]
        chosen = []
        for i, (name, m) in enumerate(linears):
            if any(fnmatch.fnmatchcase(name, g) for g in self.exclude):
                continue
            if m.in_features % 16 or m.out_features % 16:
                continue
            if self.module_filter is not None:
                if not self.module_filter(name, m):
                    continue
            else:
                if self.skip_first_last and i in (0, len(linears) - 1):
                    continue
                if min(m.in_features, m.out_features) < self.min_features:
                    continue
            chosen.append((name, m))
        return chosen


def _check_int(name: str, value: Any, low: int, high: int | None, why: str) -> None:
    """Raise :class:`PolicyError` unless ``value`` is an int (not a bool) in ``[low, high]``."""
    if isinstance(value, int) and not isinstance(value, bool) and low <= value and (high is None or value <= high):
        return
    bound = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    raise PolicyError(f"Fp8Recipe.{name} must be {bound}, got {value!r}: {why}.")


# --- scales -----------------------------------------------------------------------------------


class TensorScale:
    """The scale state of one tensor role (input, weight or grad_output) of one layer.

    ``scale`` (fp32, 0-d) is what the last cast used, or under delayed scaling what the
    next one will use; ``amax`` the last abs-max seen (after the cross-rank reduction);
    ``amax_history`` (delayed only) the last ``amax_history_len`` abs-maxes, newest
    first; ``saturated`` counts casts whose values exceeded fp8's range and were
    clamped (only delayed scaling can do that)."""

    def __init__(self, history_len: int) -> None:
        self.scale = torch.ones(())
        self.amax = torch.zeros(())
        self.amax_history = torch.zeros(history_len)
        self.saturated = torch.zeros((), dtype=torch.int64)
        self.initialized = False
        self.calls = 0
        #: the scale of the last forward cast, for a checkpointed forward's recomputation
        self.used: torch.Tensor | None = None

    def to(self, device: torch.device) -> None:
        for name in ("scale", "amax", "amax_history", "saturated"):
            setattr(self, name, getattr(self, name).to(device))

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale.clone(),
            "amax": self.amax.clone(),
            "amax_history": self.amax_history.clone(),
            "saturated": self.saturated.clone(),
            "initialized": self.initialized,
            "calls": self.calls,
        }

    def check_state_dict(self, sd: Any, where: str, recipe: Fp8Recipe, fp8: torch.dtype) -> None:
        """Raise :class:`~ampkit.StateError` unless ``sd`` holds what this role's casts
        under ``recipe`` (into ``fp8``) can leave behind:

        - types: ``scale``, ``amax`` 0-d float32; ``amax_history`` float32 of the
          recipe's length; ``saturated`` 0-d int64; ``initialized`` a bool; ``calls`` an
          int in [0, 2**63).
        - A role never recorded (no call yet, or rowwise, which keeps no per-tensor
          scale) is as constructed: scale 1, amax 0, history and saturated 0.
        - Recorded: ``amax`` (the last abs-max seen) >= 0, or inf/NaN after an overflow.
          Delayed: ``scale`` (what the next cast uses) finite, within a factor 2 of the
          scales the recipe derives (:func:`scale_from_amax` of fp32's largest value and
          of 0); the history finite and >= 0; ``saturated <= calls``; ``initialized``.
          Current: ``scale`` (what the last cast used) as delayed's when ``amax`` is
          finite, else 0 or NaN (derived from inf/NaN); history and saturated 0, not
          ``initialized``."""
        require_fields(sd, _SCALE_KEYS, where, StateError)
        calls = require_count(sd["calls"], f"{where}: calls", StateError)
        initialized = require_flag(sd["initialized"], f"{where}: initialized", StateError)
        scalar: tuple[int, ...] = ()
        scale = require_tensor(sd["scale"], f"{where}: scale", StateError, torch.float32, scalar)
        amax = require_tensor(sd["amax"], f"{where}: amax", StateError, torch.float32, scalar, low=0.0)
        history = require_tensor(
            sd["amax_history"], f"{where}: amax_history", StateError, torch.float32, self.amax_history.shape,
            finite=True, low=0.0, hint="Use the same Fp8Recipe.amax_history_len as the saved run.",
        )
        saturated = int(require_tensor(sd["saturated"], f"{where}: saturated", StateError, torch.int64, scalar, low=0))
        delayed = recipe.scaling == "delayed"
        recorded = recipe.granularity == "tensorwise" and calls > 0

        def bad(msg: str) -> StateError:
            return StateError(f"{where}: {msg}. {CORRUPT_CHECKPOINT}")

        if initialized != (delayed and recorded):
            raise bad(f"initialized={initialized} with calls={calls} under {recipe.describe()} scaling")
        if not recorded or not delayed:
            if saturated or bool(history.any()):
                raise bad(
                    f"saturated={saturated} and amax_history (largest entry {float(history.amax())}) "
                    "must be 0 here: only delayed scaling records them, once it has cast"
                )
        if not recorded:
            if float(scale) != 1.0 or float(amax) != 0.0:
                raise bad(f"scale={float(scale)}, amax={float(amax)}, but a role never recorded keeps 1 and 0")
            return
        if delayed and saturated > calls:
            raise bad(f"saturated={saturated} exceeds calls={calls}")
        if not delayed and not bool(torch.isfinite(amax)):
            if float(scale) == 0.0 or scale.isnan():
                return
            raise bad(f"scale={float(scale)} after a cast whose abs-max was {float(amax)} (its scale is 0 or NaN)")
        low, high = (float(scale_from_amax(torch.tensor(a), fp8, recipe)) for a in (_FP32_MAX, 0.0))
        value = float(scale)
        if not (math.isfinite(value) and low / 2 <= value <= 2 * high):
            raise bad(f"scale={value} lies outside [{low / 2:g}, {2 * high:g}], the range of scales this recipe derives")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        dev = self.scale.device
        self.scale = sd["scale"].detach().to(dev, torch.float32).clone()
        self.amax = sd["amax"].detach().to(dev, torch.float32).clone()
        self.amax_history = sd["amax_history"].detach().to(dev, torch.float32).clone()
        self.saturated = sd["saturated"].detach().to(dev, torch.int64).clone()
        self.initialized = bool(sd["initialized"])
        self.calls = int(sd["calls"])


def scale_from_amax(amax: torch.Tensor, fp8: torch.dtype, recipe: Fp8Recipe) -> torch.Tensor:
    """``fp8_max / max(amax, eps) / 2**margin`` in fp32, optionally rounded down to a power of 2."""
    amax = amax.float().clamp(min=_EPS)
    scale = torch.full_like(amax, _MAX[fp8]) / amax  # a true division (float / tensor is reciprocal * float)
    if recipe.margin:
        scale = scale / 2.0**recipe.margin
    if recipe.power_of_2_scales:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _all_reduce_max(amax: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return amax


def saturate(t: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    limit = _MAX[fp8]
    return (t.float() * scale).clamp(-limit, limit).to(fp8)


def _dequant(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``1/scale`` for ``_scaled_mm``; NaN when the tensor held inf/NaN, so the matmul's
    result is non-finite (and the loss scaler skips the step) rather than clamped."""
    inv = scale.reciprocal()
    return torch.where(torch.isfinite(amax), inv, torch.full_like(inv, float("nan")))


#: How a forward call treats the scale state: ``"train"`` uses it and advances it (the
#: abs-max agreed across ranks); ``"frozen"`` (no_grad evaluation, ``explain``) uses it and
#: leaves it alone, and never calls a collective (one rank may evaluate alone);
#: ``"replay"`` (activation checkpointing recomputing a forward inside backward) reuses the
#: scale the recomputed call used, so the recomputed operands equal the originals.
Mode = Literal["train", "frozen", "replay"]


def quantize_tensorwise(
    t: torch.Tensor, fp8: torch.dtype, state: TensorScale, recipe: Fp8Recipe, reduce: bool, mode: Mode
) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in ``fp8`` with one scale; returns ``(q, 1/scale)``. In ``"train"`` mode
    ``state`` (scale, abs-max, history, saturation count) advances; see :data:`Mode`."""
    amax = t.detach().abs().amax().float()
    if reduce and recipe.reduce_amax and mode == "train":
        amax = _all_reduce_max(amax)
    if mode == "replay" and state.used is not None:
        scale = state.used
    elif recipe.scaling == "current" or not state.initialized:
        scale = scale_from_amax(amax, fp8, recipe)
    else:
        scale = state.scale
    q = saturate(t, scale, fp8)
    inv = _dequant(scale, amax)
    if mode != "replay":
        state.used = scale.detach()
    if mode == "train":
        _record(state, amax, scale, fp8, recipe)
    return q, inv


def _record(state: TensorScale, amax: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype, recipe: Fp8Recipe) -> None:
    finite = torch.isfinite(amax)
    state.calls += 1
    state.amax = amax.detach().clone()
    if recipe.scaling == "current":
        state.scale = scale.detach().clone()
        return
    state.saturated = state.saturated + (finite & (amax * scale > _MAX[fp8])).to(torch.int64)
    if state.initialized:
        rolled = torch.roll(state.amax_history, 1)
    else:
        rolled = torch.zeros_like(state.amax_history)
    rolled[0] = amax
    # a non-finite abs-max (an overflow upstream, skipped by the loss scaler) never
    # enters the history: it would pin the scale at 0 for amax_history_len calls
    history = torch.where(finite, rolled, state.amax_history if state.initialized else torch.zeros_like(rolled))
    state.amax_history = history
    ref = history.amax() if recipe.amax_compute_algo == "max" else history[0]
    # nothing finite and non-zero seen yet: keep the scale just used (1 if it was not finite)
    kept = scale if state.initialized else torch.where(finite, scale, torch.ones_like(scale))
    state.scale = torch.where(ref > 0, scale_from_amax(ref, fp8, recipe), kept).detach()
    state.initialized = True


def quantize_rowwise(t: torch.Tensor, fp8: torch.dtype, dim: int, recipe: Fp8Recipe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` in ``fp8`` with one scale per slice along ``dim`` (the abs-max over ``dim``);
    returns ``(q, 1/scale, amax)`` with the scale shapes ``keepdim`` gives."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float()
    scale = scale_from_amax(amax, fp8, recipe)
    return saturate(t, scale, fp8), _dequant(scale, amax), amax


# --- the layer --------------------------------------------------------------------------------


class LayerState:
    """What one fp8 linear keeps: its recipe, name, and a :class:`TensorScale` per role."""

    def __init__(self, name: str, recipe: Fp8Recipe) -> None:
        self.name = name
        # the filter only chose the layers; without it the model pickles (a lambda would not)
        self.recipe = dataclasses.replace(recipe, module_filter=None) if recipe.module_filter else recipe
        self.roles = {r: TensorScale(recipe.amax_history_len) for r in ROLES}
        self.handle = _register(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a deep copy or an unpickled layer keeps its own scale state: a handle of its own
        self.__dict__.update(state)
        self.handle = _register(self)

    def state_dict(self) -> dict[str, Any]:
        return {r: s.state_dict() for r, s in self.roles.items()}


#: LayerStates by handle, for the compiled op (which takes no Python objects); weak, so
#: a dropped model's state goes with it. Process-wide like the models themselves.
_HANDLES: weakref.WeakValueDictionary[int, LayerState] = weakref.WeakValueDictionary()
#: The next handle: module state so that handles are unique in the process.
_NEXT_HANDLE = itertools.count()


def _register(state: LayerState) -> int:
    handle = next(_NEXT_HANDLE)
    _HANDLES[handle] = state
    return handle


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what ``_scaled_mm`` wants for its second operand)."""
    return t.t().contiguous().t()


def _mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * 1/sa) @ (b * 1/sb)`` by ``torch._scaled_mm``, in the layouts CUDA's kernels
    want: ``a`` row-major, ``b`` column-major, the inner size a multiple of 16 (zero
    padding, exact), and a row-wise GEMM's output in bf16 (cast to ``out_dtype`` after)."""
    if a.is_cuda:
        pad = -a.shape[1] % 16
        if pad:
            a = F.pad(a.float(), (0, pad)).to(a.dtype)  # fp8 has no pad kernel
            b = F.pad(b.float(), (0, 0, 0, pad)).to(b.dtype)
        if sa.dim() == 2 and out_dtype != torch.bfloat16:
            return _mm(a, b, sa, sb, torch.bfloat16).to(out_dtype)
    return torch_compat.scaled_mm(a.contiguous(), _col_major(b), scale_a=_dense(sa), scale_b=_dense(sb), out_dtype=out_dtype)


def _dense(scale: torch.Tensor) -> torch.Tensor:
    """A row-wise scale (``(M, 1)`` or ``(1, N)``) with unit strides, as ``_scaled_mm`` checks."""
    return scale.flatten().view(scale.shape) if scale.dim() == 2 else scale


def _mm_bias(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`_mm`, plus ``bias`` (cast to ``out_dtype``) added in ``out_dtype``."""
    y = _mm(a, b, sa, sb, out_dtype)
    return y if bias is None else y + bias.to(out_dtype)


def _forward(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, state: LayerState, out_dtype: torch.dtype, mode: Mode) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``x2d @ w.T + bias`` with fp8 operands; returns ``y`` and what backward needs:
    ``(xq, wq, xs, ws)`` (tensorwise) or ``()`` (rowwise: it re-quantizes ``x`` and ``w``)."""
    recipe = state.recipe
    if recipe.granularity == "rowwise":
        xq, xs, _ = quantize_rowwise(x, E4M3, -1, recipe)
        wq, ws, _ = quantize_rowwise(w, E4M3, -1, recipe)
        ws = ws.t()
        saved: tuple[torch.Tensor, ...] = ()
        if mode == "train":
            state.roles["input"].calls += 1
    else:
        xq, xs = quantize_tensorwise(x, E4M3, state.roles["input"], recipe, reduce=True, mode=mode)
        wq, ws = quantize_tensorwise(w, E4M3, state.roles["weight"], recipe, reduce=False, mode=mode)
        saved = (xq, wq, xs, ws)
    y = _mm_bias(xq, wq.t(), xs, ws, out_dtype, bias)
    _observe(state, "forward", xq, wq, xs, ws, out_dtype)
    return y, saved


def _backward(
    gy: torch.Tensor, x: torch.Tensor | None, w: torch.Tensor | None, saved: Sequence[torch.Tensor], state: LayerState,
    mode: Mode, dtypes: tuple[torch.dtype, torch.dtype, torch.dtype | None], needs: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(grad_x, grad_w, grad_bias)`` of :func:`_forward` (None where not needed)."""
    recipe = state.recipe
    gdt = recipe.grad_dtype
    x_dtype, w_dtype, b_dtype = dtypes
    need_x, need_w, need_b = needs
    gx = gw = None
    gb = gy.sum(0).to(b_dtype) if need_b and b_dtype is not None else None
    if recipe.granularity == "rowwise":
        assert x is not None and w is not None
        if need_x:
            gq, gs, _ = quantize_rowwise(gy, gdt, -1, recipe)
            wq, ws, _ = quantize_rowwise(w, E4M3, 0, recipe)
            gx = _mm(gq, wq, gs, ws, x_dtype)
            _observe(state, "grad_input", gq, wq, gs, ws, x_dtype)
        if need_w:
            gq, gs, _ = quantize_rowwise(gy, gdt, 0, recipe)
            xq, xs, _ = quantize_rowwise(x, E4M3, 0, recipe)
            gw = _mm(gq.t(), xq, gs.t(), xs, w_dtype)
            _observe(state, "grad_weight", gq.t(), xq, gs.t(), xs, w_dtype)
        return gx, gw, gb
    xq, wq, xs, ws = saved
    # the gradient is never recomputed: it advances the state when its forward did
    mode = "train" if mode == "train" else "frozen"
    gq, gs = quantize_tensorwise(gy, gdt, state.roles["grad_output"], recipe, reduce=True, mode=mode)
    if need_x:
        gx = _mm(gq, wq, gs, ws, x_dtype)
        _observe(state, "grad_input", gq, wq, gs, ws, x_dtype)
    if need_w:
        gw = _mm(gq.t(), xq, gs, xs, w_dtype)
        _observe(state, "grad_weight", gq.t(), xq, gs, xs, w_dtype)
    return gx, gw, gb


class _Fp8Matmul(torch.autograd.Function):
    """The eager fp8 linear: :func:`_forward` and :func:`_backward` under autograd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, state: LayerState, out_dtype: torch.dtype, mode: Mode) -> torch.Tensor:  # type: ignore[override]
        ctx.state, ctx.mode = state, mode
        ctx.dtypes = (x.dtype, w.dtype, bias.dtype if bias is not None else None)
        y, saved = _forward(x, w, bias, state, out_dtype, mode)
        ctx.save_for_backward(*(saved or (x, w)))
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        x, w = saved if ctx.state.recipe.granularity == "rowwise" else (None, None)
        # autocast off as in forward: the backward runs under the caller's autocast state
        # (on under O1's autocast), which would change _scaled_mm's result here
        with torch.autocast(gy.device.type, enabled=False):
            grads = _backward(gy, x, w, saved, ctx.state, ctx.mode, ctx.dtypes, ctx.needs_input_grad[:3])
        return (*grads, None, None, None)


# --- one opaque op under torch.compile --------------------------------------------------------
#
# Traced by dynamo, the autograd Function above would break the graph (it mutates the scale
# state, which a traced autograd.Function may not) and, where inductor fused its pieces,
# compute other values: inductor keeps a fused bf16/fp16 intermediate in fp32 without
# rounding it (``emulate_precision_casts=False``, its default), so an fp8 cast read an
# unrounded GELU output and ``y + bias.to(bf16)`` skipped two roundings. While compiling,
# the layer is therefore one custom op (and one for its backward): inductor calls it as an
# extern kernel on materialized inputs, and it runs the eager code above at run time,
# scale state included -- compiled fp8 computes bitwise what eager computes, with no graph
# break. The op finds its :class:`LayerState` by an int handle (ops take no Python objects).

_MODES: tuple[Mode, ...] = ("train", "frozen", "replay")


@torch.library.custom_op("ampkit::fp8_linear", mutates_args=())
def _fp8_linear_op(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, handle: int, out_dtype: torch.dtype, grad: bool,
    rowwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    state = _HANDLES[handle]
    if rowwise != (state.recipe.granularity == "rowwise"):
        raise AmpError(
            f"fp8 layer {state.name!r}: a compiled graph was built for {'rowwise' if rowwise else 'tensorwise'} "
            f"scaling but the layer's recipe is {state.recipe.granularity}; call torch._dynamo.reset() "
            "after changing a layer's fp8 recipe"
        )
    mode = _forward_mode(grad)
    with torch.autocast(x.device.type, enabled=False):
        y, saved = _forward(x, w, bias, state, out_dtype, mode)
    if not saved:
        saved = tuple(x.new_empty(0) for _ in range(4))
    # the backward's mode: a replay (the compiled graph recomputing a checkpointed region
    # inside backward) stands for the training forward it repeats, as in eager, where the
    # backward keeps the first pass's context
    mode_t = torch.tensor(_MODES.index("train" if mode == "replay" else mode), dtype=torch.int64)
    return (y.contiguous(), *(t.contiguous() for t in saved), mode_t)


@_fp8_linear_op.register_fake
def _(x, w, bias, handle, out_dtype, grad, rowwise):  # type: ignore[no-untyped-def]
    # the output shapes follow the arguments alone: a compiled graph cached on disk (inductor's
    # FX graph and AOT autograd caches) is reused by a later process whose same handle number
    # may name a layer of another granularity; ``rowwise`` keeps those graphs apart
    y = x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)
    if rowwise:
        saved = tuple(x.new_empty(0) for _ in range(4))
    else:
        scalar = x.new_empty((), dtype=torch.float32)
        saved = (x.new_empty(x.shape, dtype=E4M3), w.new_empty(w.shape, dtype=E4M3), scalar, scalar.clone())
    return (y, *saved, torch.empty((), dtype=torch.int64))


@torch.library.custom_op("ampkit::fp8_linear_backward", mutates_args=())
def _fp8_linear_backward_op(
    gy: torch.Tensor, x: torch.Tensor | None, w: torch.Tensor | None, xq: torch.Tensor, wq: torch.Tensor,
    xs: torch.Tensor, ws: torch.Tensor, mode: torch.Tensor, handle: int, x_dtype: torch.dtype, w_dtype: torch.dtype,
    b_dtype: torch.dtype | None, need_x: bool, need_w: bool, need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(gy.device.type, enabled=False):
        grads = _backward(gy, x, w, (xq, wq, xs, ws), _HANDLES[handle], _MODES[int(mode)],
                          (x_dtype, w_dtype, b_dtype), (need_x, need_w, need_b))
    gx, gw, gb = (g.contiguous() if g is not None else gy.new_empty(0) for g in grads)
    return gx, gw, gb


@_fp8_linear_backward_op.register_fake
def _(gy, x, w, xq, wq, xs, ws, mode, handle, x_dtype, w_dtype, b_dtype, need_x, need_w, need_b):  # type: ignore[no-untyped-def]
    n, k = wq.shape if x is None else w.shape
    gx = gy.new_empty((gy.shape[0], k), dtype=x_dtype) if need_x else gy.new_empty(0)
    gw = gy.new_empty((n, k), dtype=w_dtype) if need_w else gy.new_empty(0)
    gb = gy.new_empty((n,), dtype=b_dtype) if need_b and b_dtype is not None else gy.new_empty(0)
    return gx, gw, gb


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, w, bias, handle, _, _, rowwise = inputs
    ctx.handle = handle
    ctx.dtypes = (x.dtype, w.dtype, bias.dtype if bias is not None else None)
    ctx.save_for_backward(*((x, w) if rowwise else (None, None)), *output[1:])


def _backward_formula(ctx: Any, gy: torch.Tensor, *_: Any) -> tuple[Any, ...]:
    x, w, xq, wq, xs, ws, mode = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    gx, gw, gb = torch.ops.ampkit.fp8_linear_backward(gy, x, w, xq, wq, xs, ws, mode, ctx.handle, *ctx.dtypes, *need)
    return (gx if need[0] else None, gw if need[1] else None, gb if need[2] else None, None, None, None, None)


_fp8_linear_op.register_autograd(_backward_formula, setup_context=_setup_context)


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype an ``nn.Linear`` would produce here: autocast's when it is on, else the
    input's (the weight's for a 16-bit weight and fp32 input, as O2's cast model)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(x.dtype, w.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: LayerState) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the matmuls in fp8 per ``state.recipe``;
    the result (and ``bias``'s addition) in the compute dtype (autocast's, else the
    inputs'); gradients in ``x``'s and ``weight``'s dtypes."""
    home = state.roles["weight"].scale.device
    if weight.device != home:
        raise AmpError(
            f"fp8 layer {state.name!r} runs on {weight.device} but its scale state lives on {home}: "
            "a model moved after amp.initialize, or a DataParallel replica (whose copies share one "
            "scale state). Move the model before initialize; use DistributedDataParallel."
        )
    out_dtype = _compute_dtype(x, weight)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        rowwise = state.recipe.granularity == "rowwise"
        y = torch.ops.ampkit.fp8_linear(x2d, weight, bias, state.handle, out_dtype, torch.is_grad_enabled(), rowwise)[0]
    else:
        with torch.autocast(x.device.type, enabled=False):
            y = _Fp8Matmul.apply(x2d, weight, bias, state, out_dtype, _forward_mode(torch.is_grad_enabled()))
    return y.reshape(*lead, weight.shape[0])


_STATE_ATTR = "_ampkit_fp8"


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` converted by ``amp.initialize(..., fp8=...)``: same parameters, same
    ``state_dict``, its matmuls in fp8 (see the module docstring). The class of an
    existing ``nn.Linear`` is switched in place (identity, hooks, optimizer references and
    DDP wrapping are kept); :func:`ampkit.reset` switches it back.

    A deep copy (or an unpickled copy) of a converted layer is a ``Float8Linear`` with its
    own copy of the scale state, which ``amp.state_dict()`` does not save and
    ``amp.fp8.layers()`` does not list; :func:`ampkit.reset` switches copies back too."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if _STATE_ATTR in self.__dict__:
            _CONVERTED.add(self)  # reset switches a copy back as it does its original

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        state: LayerState | None = self.__dict__.get(_STATE_ATTR)
        if state is None:
            return super().forward(input)
        return fp8_linear(input, self.weight, self.bias, state)

    def extra_repr(self) -> str:
        state: LayerState | None = self.__dict__.get(_STATE_ATTR)
        tail = f", fp8={state.recipe.describe()}" if state is not None else ""
        return super().extra_repr() + tail


# --- conversion, state, reporting -----------------------------------------------------------


class Fp8Training:
    """The fp8 layers of one ``initialize``: converts them, saves and loads their scales
    (``amp.state_dict()["extra"]["fp8"]``), lists them for reports."""

    def __init__(self, recipe: Fp8Recipe, chosen: Sequence[tuple[str, nn.Linear]]) -> None:
        self.recipe = recipe
        self.layers: dict[str, tuple[weakref.ref[nn.Linear], LayerState]] = {}
        for name, module in chosen:
            state = LayerState(name, recipe)
            dev = module.weight.device
            for s in state.roles.values():
                s.to(dev)
            self.layers[name] = (weakref.ref(module), state)

    def apply(self) -> None:
        for ref, state in self.layers.values():
            module = ref()
            if module is not None:
                module.__dict__[_STATE_ATTR] = state
                torch_compat.swap_module_class(module, Float8Linear)
                _CONVERTED.add(module)

    def state_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe.describe(), "layers": {n: st.state_dict() for n, (_, st) in self.layers.items()}}

    def check_state_dict(self, sd: Any) -> None:
        """Raise :class:`~ampkit.StateError` unless ``sd`` is a :meth:`state_dict` of
        the same recipe and layers whose every role passes
        :meth:`TensorScale.check_state_dict`."""
        require_fields(sd, ("recipe", "layers"), "the checkpoint's fp8 state", StateError)
        if not isinstance(sd["layers"], dict):
            raise StateError("the checkpoint's fp8 state is not a dict from amp.state_dict().")
        if type(sd["recipe"]) is not str or sd["recipe"] != self.recipe.describe():
            raise StateError(
                f"the checkpoint was saved with the fp8 recipe {sd.get('recipe')!r}, this run uses "
                f"{self.recipe.describe()!r}; initialize with the same Fp8Recipe."
            )
        if set(sd["layers"]) != set(self.layers):
            raise StateError(
                f"the checkpoint's fp8 layers {sorted(sd['layers'])} differ from this run's "
                f"{sorted(self.layers)}; initialize the same model with the same Fp8Recipe."
            )
        for name, (_, st) in self.layers.items():
            roles = require_fields(sd["layers"][name], ROLES, f"fp8 layer {name!r}", StateError)
            for role, scale in st.roles.items():
                fp8 = st.recipe.grad_dtype if role == "grad_output" else E4M3
                scale.check_state_dict(roles[role], f"fp8 layer {name!r} {role}", st.recipe, fp8)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for name, (_, st) in self.layers.items():
            for role, scale in st.roles.items():
                scale.load_state_dict(sd["layers"][name][role])

    def info(self) -> list[Fp8LayerInfo]:
        out = []
        for name, (ref, st) in self.layers.items():
            module = ref()
            shape = (module.out_features, module.in_features) if module is not None else (0, 0)
            r = st.roles
            out.append(
                Fp8LayerInfo(
                    name=name,
                    shape=shape,
                    recipe=st.recipe.describe(),
                    calls=r["input"].calls,
                    scales={k: float(v.scale) for k, v in r.items()},
                    amax={k: float(v.amax) for k, v in r.items()},
                    saturated={k: int(v.saturated) for k, v in r.items()},
                )
            )
        return out


@dataclasses.dataclass(frozen=True)
class Fp8LayerInfo:
    """One fp8 linear as reports show it: its qualified ``name``, ``(out, in)``
    ``shape``, ``recipe``, forward ``calls`` seen, and per role (input, weight,
    grad_output) the last scale (``scales``), the last abs-max (``amax``) and the casts
    that saturated (``saturated``). Rowwise recipes keep no
    per-tensor scale (their entries stay 1.0 / 0.0; ``explain`` shows their ranges)."""

    name: str
    shape: tuple[int, int]
    recipe: str
    calls: int
    scales: dict[str, float]
    amax: dict[str, float]
    saturated: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: Every converted layer (originals and their copies), so that reset can switch them back
#: to ``nn.Linear``. Process-wide (a model is shared by the process's threads) and weak (a
#: dropped model is not kept alive); cleared by the ``_unconvert`` reset hook below.
_CONVERTED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


#: The fp8 setup of the current ``initialize`` (read by ``amp.state_dict``, ``layers``,
#: ``explain`` and the doctor). Process-wide like the AMP session it belongs to
#: (``session.py``); ``_unconvert`` drops it on reset and the next ``initialize``.
class _Current:
    training: Fp8Training | None = None


_CURRENT = _Current()


@_reset.on_reset
def _unconvert() -> None:
    """Back to plain ``nn.Linear`` on reset / the next ``initialize``."""
    for module in list(_CONVERTED):
        if type(module) is Float8Linear:
            torch_compat.swap_module_class(module, nn.Linear)
        module.__dict__.pop(_STATE_ATTR, None)
    _CONVERTED.clear()
    _CURRENT.training = None
    _WARNED_MARGINS.clear()


def plan(recipe: Fp8Recipe, models: Sequence[nn.Module], skip: Sequence[nn.Module] = ()) -> Fp8Training:
    """Choose the layers of ``models`` (validated, nothing changed yet), leaving out the
    modules in ``skip`` (those the level keeps fp32); names are prefixed ``"{i}."`` when
    there are several models."""
    chosen: list[tuple[str, nn.Linear]] = []
    skipped = {id(m) for m in skip}
    for i, model in enumerate(models):
        for name, m in recipe.choose(model):
            if id(m) not in skipped:
                chosen.append((f"{i}.{name}" if len(models) > 1 else name, m))
    if not chosen:
        warnings.warn(
            "ampkit fp8: the recipe chose no nn.Linear (by default it skips the first and last linear, "
            f"linears narrower than min_features={recipe.min_features} and sizes not divisible by "
            "16); lower Fp8Recipe.min_features or pass module_filter.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return Fp8Training(recipe, chosen)


def activate(training: Fp8Training) -> None:
    """Convert the planned layers and make ``training`` the current one (after reset)."""
    training.apply()
    _CURRENT.training = training


def current() -> Fp8Training | None:
    """The fp8 setup of the current ``initialize`` (None without ``fp8=``)."""
    return _CURRENT.training


def layers() -> list[Fp8LayerInfo]:
    """The current session's fp8 linears, with their last scales and abs-maxes."""
    t = _CURRENT.training
    return t.info() if t is not None else []


# --- observing (explain) ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fp8MatmulRecord:
    """One fp8 matmul: the layer (``module``), which of its matmuls (``matmul``:
    ``"forward"``, ``"grad_input"``, ``"grad_weight"``), the operands' fp8 dtypes
    (``a_dtype``, ``b_dtype``), their scales' range (``a_scale``, ``b_scale``:
    ``1/scale``, what dequantizes; one value for tensorwise) and the output dtype
    (``out_dtype``)."""

    module: str
    matmul: str
    a_dtype: torch.dtype
    b_dtype: torch.dtype
    a_scale: tuple[float, float]
    b_scale: tuple[float, float]
    out_dtype: torch.dtype

    def describe(self) -> str:
        def rng(s: tuple[float, float]) -> str:
            return f"{s[0]:.3g}" if s[0] == s[1] else f"{s[0]:.3g}..{s[1]:.3g}"

        def short(d: torch.dtype) -> str:
            return dtype_name(d, extra={E4M3: "e4m3", E5M2: "e5m2"})

        return (
            f"{self.module} {self.matmul}: {short(self.a_dtype)} x {short(self.b_dtype)} -> "
            f"{short(self.out_dtype)}, dequant scales {rng(self.a_scale)} / {rng(self.b_scale)}"
        )


def _forward_mode(grad: bool) -> Mode:
    """The :data:`Mode` of a forward call made now with the caller's grad mode ``grad``
    (read outside the autograd Function or op, where grad mode is still the caller's)."""
    if _observe_mod.collecting() or not grad:
        return "frozen"
    if torch_compat.current_graph_task_id() != -1:  # a forward run inside backward: recomputation
        return "replay"
    return "train"


class observe(_observe_mod.collector):
    """``with observe() as records:`` collects an :class:`Fp8MatmulRecord` per fp8 matmul
    run in this thread; scale state is left unchanged meanwhile (a diagnostic run does
    not advance delayed-scaling histories). Records of other kinds reported in the same
    block (``ampkit._internal.observe``) are left out."""

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.records[:] = [r for r in self.records if isinstance(r, Fp8MatmulRecord)]


def _observe(state: LayerState, matmul: str, a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out: torch.dtype) -> None:
    if not _observe_mod.collecting():
        return

    def rng(s: torch.Tensor) -> tuple[float, float]:
        return float(s.min()), float(s.max())

    _observe_mod.emit(Fp8MatmulRecord(state.name, matmul, a.dtype, b.dtype, rng(sa), rng(sb), out))


def check_level(level_name: str, recipe: Any) -> Fp8Recipe | None:
    """``initialize``'s ``fp8=`` argument: a recipe, True (the default recipe), or None/False."""
    if recipe is None or recipe is False:
        return None
    if recipe is True:
        recipe = Fp8Recipe()
    if not isinstance(recipe, Fp8Recipe):
        raise AmpError(f"fp8 must be an ampkit.Fp8Recipe, True or None, got {type(recipe).__name__}.")
    if level_name == "O0":
        raise AmpError(
            "fp8 runs its chosen linears in 8 bits and every other op as the level says; O0 is "
            "fp32 exactly as written. Use O1 (fp32 weights) or O2 (16-bit model, fp32 masters)."
        )
    return recipe
