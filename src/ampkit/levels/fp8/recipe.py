"""The fp8 recipe (:class:`Fp8Recipe`: format, scaling, granularity, margin, which linears) and
the fp8 formats' bounds it is checked against."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from ampkit._internal.where import user_stacklevel
from ampkit.errors import AmpError, PolicyError

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

#: The classes :meth:`Fp8Recipe.choose` picks from: ``nn.Linear`` exactly (not its
#: subclasses) and the class it is switched to, which ``layer.py`` adds on import (this
#: module sits below it).
LINEAR_CLASSES: list[type[nn.Linear]] = [nn.Linear]

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
                raise PolicyError(
                    f"Fp8Recipe.{name} must be one of {options}, got {getattr(self, name)!r}."
                )

        one_of("format", ("hybrid", "e4m3"))
        one_of("scaling", ("current", "delayed"))
        one_of("granularity", ("tensorwise", "rowwise"))
        one_of("amax_compute_algo", ("max", "most_recent"))
        _check_int(
            "amax_history_len",
            self.amax_history_len,
            1,
            MAX_AMAX_HISTORY_LEN,
            f"each fp8 layer keeps and rolls 3 histories of this length on every call; "
            f"{MAX_AMAX_HISTORY_LEN} is TransformerEngine's default, the longest in common use",
        )
        _check_int("min_features", self.min_features, 0, None, "it is a size in features")
        _check_int(
            "margin",
            self.margin,
            0,
            MAX_MARGIN,
            f"scale = fp8_max / amax / 2**margin must be a normal fp32 number for every finite "
            f"abs-max (fp32's largest included), else casts round to 0 or their dequantization to "
            f"inf; e4m3's range allows margins up to {MAX_MARGIN}",
        )
        for name in ("power_of_2_scales", "skip_first_last", "reduce_amax"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(
                    f"Fp8Recipe.{name} must be True or False, got {getattr(self, name)!r}."
                )
        if self.module_filter is not None and not callable(self.module_filter):
            raise PolicyError("Fp8Recipe.module_filter must be a callable (name, linear) -> bool.")
        globs = self.exclude
        if isinstance(globs, list):
            globs = tuple(globs)
        if not isinstance(globs, tuple) or not all(isinstance(g, str) for g in globs):
            raise PolicyError(
                f"Fp8Recipe.exclude must be a tuple of name globs (str), got {self.exclude!r}."
            )
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
        linears = [(n, m) for n, m in model.named_modules() if type(m) in LINEAR_CLASSES]
        chosen = []
        for i, (name, m) in enumerate(linears):
            if any(fnmatch.fnmatchcase(name, g) for g in self.exclude):
                continue
            if not convertible(m):
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


def convertible(module: nn.Module) -> bool:
    """Whether fp8 can convert ``module``: an ``nn.Linear`` exactly (a subclass may change
    what ``forward`` does) whose feature sizes are multiples of 16 (fp8 GEMMs' tiles)."""
    return type(module) in LINEAR_CLASSES and not (module.in_features % 16 or module.out_features % 16)


def _check_int(name: str, value: Any, low: int, high: int | None, why: str) -> None:
    """Raise :class:`PolicyError` unless ``value`` is an int (not a bool) in ``[low, high]``."""
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and low <= value
        and (high is None or value <= high)
    ):
        return
    bound = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    raise PolicyError(f"Fp8Recipe.{name} must be {bound}, got {value!r}: {why}.")


def check_level(level_name: str, recipe: Any, *, fp32: bool) -> Fp8Recipe | None:
    """``initialize``'s ``fp8=`` argument: a recipe, True (the default recipe), or
    None/False; refused at a level computing nothing in 16 bits (``fp32``)."""
    if recipe is None or recipe is False:
        return None
    if recipe is True:
        recipe = Fp8Recipe()
    if not isinstance(recipe, Fp8Recipe):
        raise AmpError(
            f"fp8 must be an ampkit.Fp8Recipe, True or None, got {type(recipe).__name__}."
        )
    if fp32:
        raise AmpError(
            f"fp8 runs its chosen linears in 8 bits and every other op as the level says; {level_name} is "
            "fp32 exactly as written. Use O1 (fp32 weights) or O2 (16-bit model, fp32 masters)."
        )
    return recipe


class NamedLinears:
    """An :class:`Fp8Recipe` ``module_filter`` choosing linears by qualified name
    (picklable, comparable, printable): what a tuning plan's fp8 linears become."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def __call__(self, name: str, _linear: nn.Linear) -> bool:
        return name in self.names

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NamedLinears) and other.names == self.names

    def __hash__(self) -> int:
        return hash(self.names)

    def __repr__(self) -> str:
        return f"NamedLinears({sorted(self.names)!r})"


def for_modules(names: Sequence[str], base: Fp8Recipe | bool | None, owner: str) -> Fp8Recipe:
    """``base`` (None or True: ``Fp8Recipe()``) converting exactly the linears ``names``
    (a tuning plan's fp8 linears); :class:`PolicyError` naming ``owner`` when ``base`` is
    not a recipe or chooses its own linears."""
    if base is None or base is True:
        base = Fp8Recipe()
    if not isinstance(base, Fp8Recipe):
        raise PolicyError(f"{owner}: fp8= takes an ampkit.Fp8Recipe beside a plan with fp8 linears, "
                          f"got {type(base).__name__}.")  # fmt: skip
    if base.module_filter is not None:
        raise PolicyError(f"{owner}: the plan chooses its fp8 linears, and the Fp8Recipe passed has a "
                          "module_filter of its own; drop one of them (fp8=False runs the plan's fp8 linears "
                          "in its 16-bit dtype).")  # fmt: skip
    return dataclasses.replace(base, module_filter=NamedLinears(names))
