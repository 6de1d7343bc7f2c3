"""Inference models from mixed-precision training: :func:`convert`.

``convert(model)`` returns a *new* module (the input is left untouched) for
inference:

* **weights stored in 16 bits** (bf16 by default on CPU, fp16 on CUDA), except the
  modules that stay fp32: normalization layers (``keep_norm_fp32``), modules a
  :class:`~ampkit.Policy`'s ``module_rules`` pin to fp32, modules named in
  ``keep_fp32``, and the ones an accuracy budget needs (below);
* **casts only at the boundaries**: each module that owns weights casts its floating
  inputs to its own dtype with a forward pre-hook (a no-op between two 16-bit
  modules), a module whose dtype differs from its parent's marks a boundary, and the
  model's 16-bit outputs are cast to fp32 (``output_dtype``). No weight is ever cast
  per call: every weight is stored in the dtype it computes in;
* **BatchNorm folded** into the convolution or linear layer before it (eval-mode
  running statistics), where the folded weights round to the storage dtype about as
  well as the unfolded ones do (measured per layer, see :class:`FoldRecord`);
* **fp32 in, fp32 out** by default.

How dtypes flow: ops written inside a ``forward`` (``F.gelu``, ``q @ k``, a residual
``+``) run in the dtype of the tensors that reach them, as under opt level O2/O3.
A module kept in fp32 receives fp32 inputs and hands its outputs on in fp32, so what
follows it until the next weighted module also runs in fp32 (which is what a layer
whose activations exceed the 16-bit range needs); a normalization layer kept in fp32
hands its (bounded) output back in the dtype its input came in. To keep an op of a
``forward`` in fp32, keep the module whose ``forward`` calls it (``keep_fp32=["blocks.0.attn"]``).

**From a training checkpoint.** ``convert(model, checkpoint=ckpt)`` loads the
weights first: a model ``state_dict`` (O0/O1/O3), or ``{"model": ..., "amp":
ampkit.state_dict(), "optimizer": opt.state_dict()}`` from an O2 run (the fp32 master
weights replace the 16-bit ones) or an O2K run (weight + Kahan compensation). See
:func:`fp32_weights`.

**Accuracy budget.** With ``calib=`` (batches of inputs) and ``budget=`` (a
:class:`Budget`, or a float: the largest relative error of the outputs), convert
measures the outputs against the fp32 model and keeps the fewest modules in fp32
that meet the budget:

1. every candidate module (default: each module owning 16-bit weights) is ranked by
   the error of the model when it *alone* runs in 16 bits;
2. the shortest prefix of that ranking that meets the budget when kept in fp32 is
   found by bisection;
3. each kept module is tried in 16 bits again, least sensitive first, and goes back
   to 16 bits if the budget still holds, so no single kept module is superfluous.

The result is in ``converted.ampkit_report`` (a :class:`ConversionReport`): each
module's dtype and why, the measured errors, the folds, the weight bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import math
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ampkit._internal import registry as _reset
from ampkit._internal.dtypes import LOW_PRECISION
from ampkit.casting.policy import Policy
from ampkit.errors import AmpError
from ampkit.levels.model_cast import CastInputs, CastOutputs, cast_tensors, is_norm_layer

__all__ = [
    "Budget",
    "ConversionError",
    "ConversionReport",
    "FoldRecord",
    "ModuleDecision",
    "NonFiniteError",
    "OutputError",
    "convert",
    "fp32_weights",
    "load_fp32_checkpoint",
    "output_error",
    "run_batch",
    "weight_bytes",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


class ConversionError(AmpError, ValueError):
    """:func:`convert` cannot do what was asked: bad arguments, a checkpoint that does
    not fit the model, or an accuracy budget no choice of fp32 modules meets."""


class NonFiniteError(ConversionError):
    """The model to convert holds NaN/inf weights, or the fp32 model's own outputs
    on the calibration batches are NaN: a conversion can neither be built from it nor
    measured against it."""


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else _NAMES.get(dtype, str(dtype).replace("torch.", ""))


# ---------------------------------------------------------------------------
# Measuring outputs against fp32
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OutputError:
    """How far a model's outputs are from the fp32 reference's, over all batches.

    Attributes:
        rel_error: ``||y - y_ref||_2 / ||y_ref||_2`` over every floating output
            element of every batch (``inf`` if any output element is non-finite where
            the reference's is not the same infinity).
        max_abs_error: largest ``|y - y_ref|`` (``inf`` likewise).
        top1_agreement: fraction of positions where ``argmax(-1)`` of the outputs
            equals the reference's (outputs with at least 2 dimensions; a position
            whose outputs hold a NaN never agrees), or None when no output has a
            class dimension.
        batches: how many batches were compared.
        nonfinite: output elements that are NaN or inf where the reference's is not
            that same infinity. A reference infinity matched exactly (a masked logit)
            counts as no error; a NaN in the reference is refused
            (:class:`NonFiniteError`). Any non-finite element fails every
            :class:`Budget`.
    """

    rel_error: float
    max_abs_error: float
    top1_agreement: float | None
    batches: int
    nonfinite: int = 0

    def __str__(self) -> str:
        top1 = "-" if self.top1_agreement is None else f"{self.top1_agreement:.2%}"
        line = f"rel error {self.rel_error:.3g}, max abs error {self.max_abs_error:.3g}, top-1 agreement {top1}"
        return line + (f", {self.nonfinite} non-finite output(s)" if self.nonfinite else "")


def _floating_leaves(obj: Any) -> list[torch.Tensor]:
    """The floating tensors in a (nested) output, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, Mapping):
        return [t for k in obj for t in _floating_leaves(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _floating_leaves(x)]
    return []


class _ErrorAccumulator:
    def __init__(self) -> None:
        self.diff_sq = 0.0
        self.ref_sq = 0.0
        self.max_abs = 0.0
        self.agree = 0
        self.positions = 0
        self.batches = 0
        self.nonfinite = 0

    def add(self, reference: Any, output: Any) -> None:
        refs, outs = _floating_leaves(reference), _floating_leaves(output)
        if len(refs) != len(outs) or any(r.shape != o.shape for r, o in zip(refs, outs)):
            raise ConversionError(
                "the converted model's outputs do not have the fp32 model's structure "
                f"({[tuple(r.shape) for r in refs]} vs {[tuple(o.shape) for o in outs]})."
            )
        batch = self.batches
        self.batches += 1
        for r, o in zip(refs, outs):
            r64, o64 = r.detach().double(), o.detach().double()
            nan_ref = int(torch.isnan(r64).sum())
            if nan_ref:
                raise NonFiniteError(
                    f"the reference outputs of batch {batch} hold {nan_ref} NaN value(s) (of "
                    f"{r64.numel()}): nothing can be measured against them. Find where the fp32 model "
                    "makes NaN (ampkit.doctor, torch.autograd.detect_anomaly) or calibrate on batches "
                    "where its outputs are finite."
                )
            both = torch.isfinite(o64) & torch.isfinite(r64)
            # non-finite anywhere counts unless it is the reference's own infinity, exactly
            self.nonfinite += int((~both & (o64 != r64)).sum())
            diff = torch.where(both, o64 - r64, torch.zeros_like(r64))
            self.diff_sq += float(diff.pow(2).sum())
            self.ref_sq += float(torch.where(both, r64, torch.zeros_like(r64)).pow(2).sum())
            if diff.numel():
                worst = float(diff.abs().max())
                if not worst <= self.max_abs:  # NaN-propagating max
                    self.max_abs = worst
            if r.dim() >= 2 and r.shape[-1] > 1:
                agree = (r.argmax(-1) == o.argmax(-1)) & ~torch.isnan(o).any(-1)
                self.agree += int(agree.sum())
                self.positions += r[..., 0].numel()

    def result(self) -> OutputError:
        if self.nonfinite:
            return OutputError(math.inf, math.inf, self._top1(), self.batches, self.nonfinite)
        if self.ref_sq == 0.0:
            rel = 0.0 if self.diff_sq == 0.0 else math.inf
        else:
            rel = math.sqrt(self.diff_sq / self.ref_sq)
        return OutputError(rel, self.max_abs, self._top1(), self.batches, 0)

    def _top1(self) -> float | None:
        return self.agree / self.positions if self.positions else None


def output_error(reference: Sequence[Any], outputs: Sequence[Any]) -> OutputError:
    """Compare per-batch outputs (tensors or nested tuples/lists/dicts of them) of a
    model against a reference's: relative and max abs error, top-1 agreement, the
    count of non-finite outputs. Raises :class:`NonFiniteError` when the reference
    holds a NaN."""
    if len(reference) != len(outputs):
        raise ConversionError(f"{len(outputs)} output batches against {len(reference)} reference batches.")
    acc = _ErrorAccumulator()
    for r, o in zip(reference, outputs):
        acc.add(r, o)
    return acc.result()


@dataclasses.dataclass(frozen=True)
class Budget:
    """How close to fp32 the converted model's outputs must stay (on the
    calibration batches). Give one or more limits; all must hold.

    Attributes:
        max_rel_error: largest :attr:`OutputError.rel_error` (e.g. ``1e-2``).
        min_top1_agreement: smallest fraction of ``argmax(-1)`` equal to fp32's
            (e.g. ``0.99``).
        max_abs_error: largest absolute difference of any output element.
    """

    max_rel_error: float | None = None
    min_top1_agreement: float | None = None
    max_abs_error: float | None = None

    def __post_init__(self) -> None:
        limits = (self.max_rel_error, self.min_top1_agreement, self.max_abs_error)
        if all(v is None for v in limits):
            raise ConversionError(
                "a Budget needs at least one limit: max_rel_error, min_top1_agreement or max_abs_error."
            )
        for name in ("max_rel_error", "max_abs_error"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v)):
                raise ConversionError(f"Budget.{name} must be a finite number >= 0, got {v!r}.")
        v = self.min_top1_agreement
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1):
            raise ConversionError(f"Budget.min_top1_agreement must be a fraction in [0, 1], got {v!r}.")

    def met_by(self, err: OutputError) -> bool:
        """Whether ``err`` is within every limit of this budget. Any non-finite output
        (``err.nonfinite``) fails it, whichever limits it sets; so does a NaN measure."""
        if err.nonfinite or any(math.isnan(v) for v in (err.rel_error, err.max_abs_error)):
            return False
        if self.max_rel_error is not None and not err.rel_error <= self.max_rel_error:
            return False
        if self.max_abs_error is not None and not err.max_abs_error <= self.max_abs_error:
            return False
        if self.min_top1_agreement is not None:
            top1 = err.top1_agreement
            if top1 is None or not top1 >= self.min_top1_agreement:
                return False
        return True

    def __str__(self) -> str:
        bounds = (
            ("rel error <= {:g}", self.max_rel_error),
            ("top-1 agreement >= {:.2%}", self.min_top1_agreement),
            ("max abs error <= {:g}", self.max_abs_error),
        )
        return ", ".join(text.format(value) for text, value in bounds if value is not None)


def _as_budget(budget: float | Budget | None) -> Budget | None:
    if budget is None or isinstance(budget, Budget):
        return budget
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        return Budget(max_rel_error=float(budget))
    raise ConversionError(
        f"budget must be a Budget or a float (the largest relative error), got {budget!r}."
    )


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class ModuleDecision:
    """The dtype :func:`convert` chose for one module, and why.

    Attributes:
        name: qualified name (``""`` is the model itself).
        kind: the module's class name.
        dtype: the dtype its own weights are stored and computed in.
        reason: ``"default"``, ``"inherited"``, ``"norm layer"``, ``"keep_fp32"``,
            ``"policy rule"``, ``"budget"``, ``"range"`` (its weights exceed the 16-bit
            dtype's range) or ``"shared parameter"``.
        params: number of elements of its own floating parameters and buffers.
        isolated_error: with a budget, the relative error of the model when this
            module alone runs in 16 bits (every other candidate in fp32), else None.
        detail: a sentence on the decision (budget measurements).
    """

    name: str
    kind: str
    dtype: torch.dtype
    reason: str
    params: int = 0
    isolated_error: float | None = None
    detail: str = ""


@dataclasses.dataclass
class FoldRecord:
    """One BatchNorm considered for folding.

    ``weight_error_folded`` and ``weight_error_plain`` are the relative rounding
    errors (``||round(w) - w|| / ||w||`` over weight and bias) of the folded and of
    the unfolded layer in its storage dtype; a fold is done when the folded weights
    are finite and round at most twice as badly (plus one unit of the dtype) as the
    plain ones.
    """

    layer: str
    norm: str
    folded: bool
    weight_error_folded: float
    weight_error_plain: float
    reason: str = ""


@dataclasses.dataclass
class ConversionReport:
    """What :func:`convert` did (``converted.ampkit_report``).

    Attributes:
        dtype: the 16-bit storage and compute dtype.
        output_dtype: dtype the model's 16-bit outputs are cast to (None: kept).
        modules: one :class:`ModuleDecision` per module owning weights or marking a
            dtype boundary, in ``named_modules()`` order.
        folds: the BatchNorm folds considered (:class:`FoldRecord`).
        budget: the accuracy budget, or None.
        error: outputs of the converted model against fp32 on the calibration
            batches (None without ``calib``).
        error_all_16bit: the same with no module kept for the budget (None without a
            budget).
        evaluations: how many candidate models were run on the calibration batches.
        weight_bytes: bytes of the converted model's ``state_dict`` tensors.
        weight_bytes_fp32: the same for the fp32 model.
    """

    dtype: torch.dtype
    output_dtype: torch.dtype | None
    modules: list[ModuleDecision]
    folds: list[FoldRecord]
    budget: Budget | None
    error: OutputError | None
    error_all_16bit: OutputError | None
    evaluations: int
    weight_bytes: int
    weight_bytes_fp32: int

    @property
    def kept_fp32(self) -> list[str]:
        """Names of the modules whose weights stay fp32, for any reason."""
        return [d.name for d in self.modules if d.dtype == torch.float32 and d.params]

    @property
    def kept_for_budget(self) -> list[str]:
        """Names of the modules kept in fp32 to meet the budget."""
        return [d.name for d in self.modules if d.reason == "budget"]

    def decision(self, name: str) -> ModuleDecision:
        """The decision for the module called ``name``."""
        for d in self.modules:
            if d.name == name:
                return d
        raise KeyError(name)

    def __str__(self) -> str:
        lines = [
            f"ampkit.convert: {_dtype_name(self.dtype)} weights, outputs "
            f"{_dtype_name(self.output_dtype) if self.output_dtype else 'as computed'}; "
            f"weights {self.weight_bytes / 2**20:.2f} MiB vs fp32 {self.weight_bytes_fp32 / 2**20:.2f} MiB "
            f"({self.weight_bytes / max(1, self.weight_bytes_fp32):.2f}x)"
        ]
        if self.budget is not None:
            lines.append(f"budget: {self.budget} ({self.evaluations} evaluations)")
            if self.error_all_16bit is not None:
                lines.append(f"  all 16-bit: {self.error_all_16bit}")
        if self.error is not None:
            lines.append(f"  converted:  {self.error}")
        fp32 = [d for d in self.modules if d.dtype == torch.float32 and d.params]
        lines.append(f"modules in fp32: {len(fp32)} of {sum(1 for d in self.modules if d.params)} with weights")
        for d in fp32:
            extra = f" - {d.detail}" if d.detail else ""
            lines.append(f"  {d.name or '<model>'} ({d.kind}): {d.reason}{extra}")
        for f in self.folds:
            state = "folded into" if f.folded else "not folded into"
            lines.append(
                f"batchnorm {f.norm} {state} {f.layer} (weight rounding {f.weight_error_folded:.2g} "
                f"folded vs {f.weight_error_plain:.2g} plain){' - ' + f.reason if f.reason else ''}"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------
_MODEL_KEYS = ("model", "model_state_dict", "state_dict")
_OPT_KEYS = ("optimizer", "optimizer_state_dict", "opt", "optimizers")


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    )


def _split_checkpoint(checkpoint: Any) -> tuple[Mapping[str, torch.Tensor], Any, list[Any]]:
    """(model state dict, amp state dict or None, optimizer state dicts)."""
    if _is_state_dict(checkpoint):
        return checkpoint, None, []
    if not isinstance(checkpoint, Mapping):
        raise ConversionError(
            f"checkpoint must be a model state_dict or a dict with a 'model' entry, got {type(checkpoint).__name__}."
        )
    model_sd = next((checkpoint[k] for k in _MODEL_KEYS if k in checkpoint), None)
    if not _is_state_dict(model_sd):
        raise ConversionError(
            "the checkpoint has no model weights: expected a state_dict, or a dict with one of "
            f"{list(_MODEL_KEYS)} holding model.state_dict() (it has {sorted(map(str, checkpoint))[:8]})."
        )
    amp_sd = checkpoint.get("amp")
    opts = next((checkpoint[k] for k in _OPT_KEYS if k in checkpoint), None)
    opt_list = [] if opts is None else list(opts) if isinstance(opts, (list, tuple)) else [opts]
    return model_sd, amp_sd, opt_list


Entry = tuple[int, int, torch.Tensor]


def _saved_weights(amp_sd: Any) -> list[tuple[list[Entry], list[Entry]]]:
    """Per optimizer of an ``ampkit.state_dict()`` (in session order): its master
    weights and compensation buffers as ``(group, index, tensor)`` entries."""
    what = "checkpoint['amp'] is not an ampkit.state_dict()"
    if not isinstance(amp_sd, Mapping) or not isinstance(amp_sd.get("trainers"), (list, tuple)):
        raise ConversionError(f"{what}; save amp.state_dict() under 'amp'.")
    out = []
    try:
        for trainer in amp_sd["trainers"]:
            for opt in trainer.get("optimizers", []):
                extra = opt.get("extra") or {}
                masters = (extra.get("master_weights") or {}).get("masters", [])
                comps = (extra.get("compensation") or {}).get("buffers", [])
                out.append(([_entry(e) for e in masters], [_entry(e) for e in comps]))
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConversionError(f"{what}: {exc}") from None
    return out


def _entry(e: Any) -> Entry:
    gi, pi, t = e
    if not (isinstance(gi, int) and isinstance(pi, int) and isinstance(t, torch.Tensor)):
        raise ValueError(f"expected [group, index, tensor] entries, got {e!r:.80}")
    return gi, pi, t


def _position_names(
    model_params: list[str], opt_sd: Any, names: Sequence[Sequence[str]] | None, which: int
) -> Any:
    """A function (group, index) -> parameter name for optimizer ``which``."""
    if names is not None:
        table = [list(g) for g in names]
        return lambda gi, pi: table[gi][pi]
    groups = opt_sd.get("param_groups") if isinstance(opt_sd, Mapping) else None
    if not (isinstance(groups, (list, tuple)) and all(isinstance(g, Mapping) for g in groups)):
        groups = None
    if groups and all("param_names" in g for g in groups):
        return lambda gi, pi: groups[gi]["param_names"][pi]
    if groups:
        # torch numbers parameters 0, 1, ... across the groups in order; with an
        # optimizer built over model.parameters() that is named_parameters() order.
        return lambda gi, pi: model_params[groups[gi]["params"][pi]]

    def first_group_only(gi: int, pi: int) -> str:
        if gi != 0:
            raise ConversionError(
                f"optimizer {which} has several param groups; put its state_dict in the "
                "checkpoint under 'optimizer' so master weights can be matched to parameters."
            )
        return model_params[pi]

    return first_group_only


def fp32_weights(
    model: nn.Module,
    checkpoint: Mapping[str, Any],
    param_names: Sequence[Sequence[Sequence[str]]] | None = None,
) -> dict[str, torch.Tensor]:
    """``model``'s state dict from a training checkpoint of any opt level, with every
    floating tensor in fp32 and each 16-bit weight replaced by the best fp32 value
    the checkpoint holds.

    Args:
        model: a module of the trained architecture (used for its parameter names
            and order; its values are not read).
        checkpoint: either ``model.state_dict()`` (O0/O1/O3: the weights as stored),
            or a dict ``{"model": model.state_dict(), "amp": ampkit.state_dict(),
            "optimizer": opt.state_dict()}`` (``"optimizer"`` may be a list, one per
            optimizer in the order given to ``initialize``). With O2 the fp32 master
            weights replace the 16-bit ones; with O2K each weight becomes
            ``weight + compensation`` summed in fp32.
        param_names: per optimizer, per param group, the parameter names in
            ``param_groups`` order. Needed only when the optimizer was built neither
            from ``model.named_parameters()`` (torch then saves the names) nor from
            ``model.parameters()`` in order.

    Returns:
        ``{name: tensor}`` ready for ``model.load_state_dict``, fp32 for floating
        entries, integer buffers unchanged.

    Raises:
        ConversionError: the checkpoint has no model weights, or master weights do not
            line up with the model's parameters (wrong order, shape or value).
    """
    model_sd, amp_sd, opt_sds = _split_checkpoint(checkpoint)
    out = {k: v.detach().float() if v.is_floating_point() else v for k, v in model_sd.items()}
    if amp_sd is None:
        return out
    params = [n for n, _ in model.named_parameters()]
    for j, (masters, comps) in enumerate(_saved_weights(amp_sd)):
        if not masters and not comps:
            continue
        if param_names is not None and j >= len(param_names):
            raise ConversionError(
                f"param_names has {len(param_names)} entries, but the checkpoint has master "
                f"weights or compensation for optimizer {j}: give one list per optimizer."
            )
        names = _position_names(
            params,
            opt_sds[j] if j < len(opt_sds) else None,
            None if param_names is None else param_names[j],
            j,
        )
        for gi, pi, value in masters:
            name = _checked_name(names, gi, pi, model_sd, value, j, "master weight")
            out[name] = value.detach().float()
        for gi, pi, comp in comps:
            name = _checked_name(names, gi, pi, model_sd, comp, j, "compensation buffer")
            out[name] = model_sd[name].detach().float() + comp.detach().float()
    return out


def load_fp32_checkpoint(
    model: nn.Module,
    checkpoint: Mapping[str, Any],
    param_names: Sequence[Sequence[Sequence[str]]] | None = None,
) -> nn.Module:
    """Load :func:`fp32_weights` of ``checkpoint`` into the fp32 ``model`` (strictly)
    and return it; a checkpoint that does not fit raises :class:`ConversionError`
    naming the first mismatches."""
    weights = fp32_weights(model, checkpoint, param_names)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        lines = [ln.strip() for ln in str(exc).strip().splitlines()[1:] if ln.strip()]
        detail = "; ".join(lines)[:300] or str(exc).strip()[:300]
        raise ConversionError(f"the checkpoint's model weights do not fit this model: {detail}") from None
    return model


def _checked_name(
    names: Any, gi: int, pi: int, model_sd: Mapping[str, torch.Tensor], value: torch.Tensor, j: int, what: str
) -> str:
    advice = (
        "build the optimizer from model.named_parameters() (torch saves the names), or pass "
        "param_names= to fp32_weights / convert."
    )
    try:
        name = names(gi, pi)
    except (IndexError, KeyError, TypeError):
        raise ConversionError(
            f"optimizer {j} has a {what} at group {gi}, index {pi}, which matches no model "
            f"parameter; {advice}"
        ) from None
    weight = model_sd.get(name)
    if weight is None or weight.shape != value.shape:
        raise ConversionError(
            f"the {what} at optimizer {j}, group {gi}, index {pi} has shape {tuple(value.shape)} "
            f"but it lines up with parameter {name!r} of shape "
            f"{None if weight is None else tuple(weight.shape)}; {advice}"
        )
    if what == "master weight" and weight.dtype in LOW_PRECISION and not torch.equal(value.to(weight.dtype), weight):
        raise ConversionError(
            f"the master weight at optimizer {j}, group {gi}, index {pi} does not round to the "
            f"saved 16-bit weight {name!r}: the optimizer's order is not the model's; {advice}"
        )
    return name


# ---------------------------------------------------------------------------
# Copies, hooks
# ---------------------------------------------------------------------------
# Every hook convert installs is an instance of a plain ampkit class (never a
# functools.partial or a bound method), so a converted model loads with torch.load's
# defaults: see ampkit._safe_globals.
class _BoundaryInputs(CastInputs):
    """Forward pre-hook (with kwargs) of a converted module: cast its floating inputs
    to the dtype its weights are stored in."""


class _BoundaryOutputs(CastOutputs):
    """Forward hook of a converted module (or model): cast its floating outputs of the
    dtypes in ``only`` to ``dtype``."""


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # the hook of models converted by ampkit 0.2 (pickled as functools.partial of it)
    return cast_tensors(args, dtype), cast_tensors(kwargs, dtype)


def _cast_outputs(
    dtype: torch.dtype, only: tuple[torch.dtype, ...], module: nn.Module, args: tuple, output: Any
) -> Any:
    # the hook of models converted by ampkit 0.2 (pickled as functools.partial of it)
    return cast_tensors(output, dtype, only)


class _IslandEnter:
    """Forward pre-hook of a norm layer kept in fp32: :meth:`_Fp32Island.pre`."""

    def __init__(self, island: _Fp32Island) -> None:
        self.island = island

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self.island.pre(module, args, kwargs)


class _IslandExit:
    """Forward hook (always called) of a norm layer kept in fp32: :meth:`_Fp32Island.post`."""

    def __init__(self, island: _Fp32Island) -> None:
        self.island = island

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return self.island.post(module, args, output)


class _Fp32Island:
    """Hooks of a normalization layer kept in fp32: the pre-hook casts its floating
    inputs to fp32 and remembers the dtype they came in, the forward hook (always
    called, even when ``forward`` raises) hands the fp32 outputs back in that dtype.
    So the layer is transparent: a bf16 residual stream stays bf16, an fp32 one fp32.
    The remembered dtypes are a per-thread stack (re-entrant, DataParallel-safe); a
    copy of the model gets fresh hooks."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __reduce__(self) -> tuple[type, tuple]:
        return (_Fp32Island, ())

    def _stack(self) -> list[torch.dtype | None]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves = _floating_leaves([args, kwargs])
        self._stack().append(leaves[0].dtype if leaves else None)
        return cast_tensors(args, torch.float32), cast_tensors(kwargs, torch.float32)

    def post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        stack = self._stack()
        dtype = stack.pop() if stack else None
        if dtype is None or dtype == torch.float32:
            return output
        return cast_tensors(output, dtype, (torch.float32,))


def _is_convert_hook(fn: Any) -> bool:
    if isinstance(fn, (_BoundaryInputs, _BoundaryOutputs, _IslandEnter, _IslandExit)):
        return True
    # hooks of models converted by ampkit 0.2 and loaded with weights_only=False
    return (isinstance(fn, functools.partial) and fn.func in (_cast_inputs, _cast_outputs)) or isinstance(
        getattr(fn, "__self__", None), _Fp32Island
    )


def _is_ampkit_cast_hook(fn: Any) -> bool:
    """Hooks of :func:`ampkit.model.cast_model` (O2/O3/O2K) or of :func:`convert`."""
    return _is_convert_hook(fn) or getattr(fn, "__module__", None) == "ampkit.levels.model_cast"


def _drop_hooks(module: nn.Module, predicate: Any) -> None:
    """Remove the forward (pre-)hooks of ``module`` for which ``predicate(fn)``."""
    for hooks, extra in (
        (module._forward_pre_hooks, ("_forward_pre_hooks_with_kwargs",)),
        (module._forward_hooks, ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    ):
        for key in [k for k, fn in hooks.items() if predicate(fn)]:
            del hooks[key]
            for attr in extra:
                getattr(module, attr, {}).pop(key, None)


def _fp32_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in eval mode with every floating parameter and buffer
    in fp32, no grads, and no ampkit cast hooks."""
    try:
        ref = copy.deepcopy(model)
    except Exception as exc:
        raise ConversionError(
            f"convert works on a copy (copy.deepcopy) and the model cannot be copied: "
            f"{type(exc).__name__}: {exc}. Move what cannot be copied (locks, open files, "
            "generators) out of the module."
        ) from None
    for m in ref.modules():
        _drop_hooks(m, _is_ampkit_cast_hook)
        for p in m.parameters(recurse=False):
            p.grad = None
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        for name, b in m.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dtype != torch.float32:
                m._buffers[name] = b.float()
    ref.eval()
    if hasattr(ref, "ampkit_report"):
        del ref.ampkit_report
    return ref


def _overflows(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a finite weight of ``module`` itself would round to inf in ``dtype``."""
    own = [t for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
           if t is not None and t.is_floating_point() and t.numel()]
    return any(bool((torch.isinf(t.detach().to(dtype)) & torch.isfinite(t.detach())).any()) for t in own)


def _owns_weights(module: nn.Module) -> bool:
    return any(p.is_floating_point() for p in module.parameters(recurse=False)) or any(
        b is not None and b.is_floating_point() for b in module.buffers(recurse=False)
    )


def _own_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False) if p.is_floating_point()) + sum(
        b.numel() for b in module.buffers(recurse=False) if b is not None and b.is_floating_point()
    )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the tensors in ``model.state_dict()``, each storage counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in model.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def run_batch(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on one calibration batch: a tensor is the one positional input,
    a tuple or list the positional inputs, a dict the keyword inputs."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    raise ConversionError(
        f"a calibration batch must be a tensor, a tuple of positional inputs or a dict of "
        f"keyword inputs, got {type(batch).__name__}."
    )


# Module state: warnings given once per process.
_WARNED: set[str] = set()
_reset.on_reset(_WARNED.clear)  # like the engine's fp16-on-CPU warning: once per session


def _cpu_computes_fast(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions for ``dtype`` matmuls (AVX512-BF16 or AMX for
    bf16, AMX-FP16 for fp16); True when torch cannot tell."""
    cpu = torch.cpu
    try:
        if dtype == torch.bfloat16:
            return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
        return bool(cpu._is_amx_fp16_supported())
    except AttributeError:
        return True


def _warn_slow_cpu(dtype: torch.dtype) -> None:
    key = f"cpu-{dtype}"
    if key in _WARNED or _cpu_computes_fast(dtype):
        return
    _WARNED.add(key)
    warnings.warn(
        f"ampkit.convert: this CPU has no {_dtype_name(dtype)} instructions (AVX512-BF16/AMX), so "
        f"the converted model computes slower than fp32 here (the weights still take half the "
        "memory). To serve on such a CPU, export with ampkit.export_onnx(..., precision='storage') "
        "(16-bit weights, fp32 compute) or run where the 16-bit kernels are native.",
        stacklevel=3,
    )


def _device_type(model: nn.Module) -> str:
    types = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    return types.pop() if len(types) == 1 else "cpu"


def _outputs(model: nn.Module, calib: Sequence[Any], device_type: str) -> list[Any]:
    from ampkit.casting.engine import autocast

    outs = []
    with torch.inference_mode(), autocast(enabled=False, device_type=device_type):
        for i, batch in enumerate(calib):
            try:
                outs.append(_detach(run_batch(model, batch)))
            except AmpError:
                raise
            except Exception as exc:  # the model's own error on this input: say which batch
                text = str(exc).strip().splitlines()
                raise ConversionError(
                    f"calibration batch {i} ({_describe(batch)}) does not run through the model: "
                    f"{type(exc).__name__}: {text[0] if text else ''}. Give batches the model takes, "
                    "as model(batch), model(*batch) or model(**batch) would."
                ) from exc
    return outs


def _describe(batch: Any) -> str:
    """A short description of a batch: tensor shapes and dtypes."""
    if isinstance(batch, torch.Tensor):
        return f"tensor {list(batch.shape)} {_dtype_name(batch.dtype)}"
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in list(batch.items())[:4]) + "}"
    if isinstance(batch, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in list(batch)[:4]) + ")"
    return type(batch).__name__


def _check_finite_weights(model: nn.Module, whose: str) -> None:
    """Raise :class:`NonFiniteError` for a parameter holding NaN/inf or a buffer
    holding NaN (an infinite buffer is a mask or a bound, not a broken weight)."""
    bad = [
        (name, int((~torch.isfinite(t)).sum()), t.numel())
        for name, t in model.named_parameters()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ] + [
        (name, int(torch.isnan(t).sum()), t.numel())
        for name, t in model.named_buffers()
        if t is not None and t.is_floating_point() and bool(torch.isnan(t).any())
    ]
    if bad:
        listed = ", ".join(f"{name} ({n} of {total})" for name, n, total in bad[:4])
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        raise NonFiniteError(
            f"{whose} weights hold NaN/inf values: {listed}{more}. A converted model would "
            "output NaN; convert the last checkpoint whose weights are finite."
        )


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, Mapping):
        return {k: _detach(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_detach(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------
# BatchNorm folding
# ---------------------------------------------------------------------------
_FOLDABLE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear)


def _fold_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(layer name, batchnorm name) pairs where the BatchNorm's only input is the
    layer's output and that output goes nowhere else. Found on a torch.fx trace of
    the model; when the model cannot be traced, on consecutive children of
    ``nn.Sequential`` containers."""
    modules = dict(model.named_modules())
    try:
        import torch.fx

        graph = torch.fx.symbolic_trace(model).graph
    except Exception:
        return _sequential_pairs(model)
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), nn.modules.batchnorm._BatchNorm):
            continue
        if len(node.args) != 1 or node.kwargs:
            continue
        src = node.args[0]
        if not (isinstance(src, torch.fx.Node) and src.op == "call_module"):
            continue
        if not isinstance(modules.get(src.target), _FOLDABLE) or len(src.users) != 1:
            continue
        if calls.get(src.target) == 1 and calls.get(node.target) == 1:
            pairs.append((src.target, node.target))
    return pairs


def _sequential_pairs(model: nn.Module) -> list[tuple[str, str]]:
    pairs = []
    for prefix, m in model.named_modules():
        if not isinstance(m, nn.Sequential):
            continue
        items = list(m.named_children())
        for (a, la), (b, lb) in zip(items, items[1:]):
            if isinstance(la, _FOLDABLE) and isinstance(lb, nn.modules.batchnorm._BatchNorm):
                join = f"{prefix}." if prefix else ""
                pairs.append((f"{join}{a}", f"{join}{b}"))
    return pairs


def _folded_weights(layer: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The folded (weight, bias) in fp64, or None if the pair cannot be folded
    (no running statistics, channel counts that differ, grouped transposed conv)."""
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return None
    w = layer.weight.detach().double()
    transposed = isinstance(layer, nn.modules.conv._ConvTransposeNd)
    if transposed and layer.groups != 1:
        return None
    out_dim = 1 if transposed else 0
    if w.shape[out_dim] != bn.num_features:
        return None
    scale = (bn.running_var.double() + bn.eps).rsqrt()
    if bn.weight is not None:
        scale = scale * bn.weight.detach().double()
    shift = -bn.running_mean.double() * scale
    if bn.bias is not None:
        shift = shift + bn.bias.detach().double()
    shape = [1] * w.dim()
    shape[out_dim] = -1
    b = layer.bias.detach().double() if layer.bias is not None else torch.zeros_like(scale)
    return w * scale.view(shape), b * scale + shift


def _rounding_error(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> float:
    flat = torch.cat([t.detach().double().flatten() for t in tensors])
    rounded = flat.to(dtype).double()
    if not bool(torch.isfinite(rounded).all()):
        return math.inf
    norm = float(flat.norm())
    return float((rounded - flat).norm()) / norm if norm > 0 else 0.0


def _fold_batchnorms(model: nn.Module, dtype_of: Mapping[str, torch.dtype]) -> list[FoldRecord]:
    """Fold every foldable eval-mode BatchNorm of ``model`` (fp32, in place) into the
    layer before it, where that is exact enough in the layer's storage dtype; the
    BatchNorm becomes ``nn.Identity``."""
    records = []
    modules = dict(model.named_modules())
    for layer_name, bn_name in _fold_pairs(model):
        layer, bn = modules[layer_name], modules[bn_name]
        folded = _folded_weights(layer, bn)
        if folded is None:
            records.append(FoldRecord(layer_name, bn_name, False, math.nan, math.nan, "no running statistics or channel mismatch"))
            continue
        dtype = dtype_of.get(layer_name, torch.float32)
        plain = [layer.weight] + ([layer.bias] if layer.bias is not None else [])
        err_plain = _rounding_error(plain, dtype)
        err_folded = _rounding_error(list(folded), dtype)
        unit = torch.finfo(dtype).eps / 2
        ok = math.isfinite(err_folded) and err_folded <= 2 * err_plain + unit
        reason = "" if ok else f"folded weights round too coarsely in {_dtype_name(dtype)}"
        records.append(FoldRecord(layer_name, bn_name, ok, err_folded, err_plain, reason))
        if not ok:
            continue
        w, b = folded
        with torch.no_grad():
            layer.weight.data = w.to(layer.weight.dtype)
            if layer.bias is None:
                layer.bias = nn.Parameter(b.to(layer.weight.dtype), requires_grad=layer.weight.requires_grad)
            else:
                layer.bias.data = b.to(layer.bias.dtype)
        parent_name, _, child = bn_name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, nn.Identity())
    return records


# ---------------------------------------------------------------------------
# Choosing dtypes
# ---------------------------------------------------------------------------
ModuleKey = str | type


def _check_keys(keys: Iterable[ModuleKey] | None, what: str, names: Sequence[str]) -> tuple[ModuleKey, ...]:
    if keys is None:
        return ()
    if isinstance(keys, (str, type)):
        keys = [keys]
    out = []
    for key in keys:
        if isinstance(key, str):
            if not key:
                raise ConversionError(f"{what} names must be non-empty module names or globs.")
            if not any(fnmatch.fnmatchcase(n, key) for n in names):
                sample = ", ".join(repr(n) for n in names[1:6])
                raise ConversionError(
                    f"{what} entry {key!r} matches no module of the model; module names look like {sample}."
                )
        elif not (isinstance(key, type) and issubclass(key, nn.Module)):
            raise ConversionError(f"{what} entries are module names/globs or nn.Module subclasses, got {key!r}.")
        out.append(key)
    return tuple(out)


def _matches(keys: Sequence[ModuleKey], name: str, module: nn.Module) -> bool:
    return any(
        fnmatch.fnmatchcase(name, k) if isinstance(k, str) else isinstance(module, k) for k in keys
    )


@dataclasses.dataclass
class _Plan:
    """dtype and reason per module name (every module of the model)."""

    dtype: dict[str, torch.dtype]
    reason: dict[str, str]


def _parent(name: str) -> str | None:
    if name == "":
        return None
    return name.rpartition(".")[0]


def _plan(
    model: nn.Module,
    dtype: torch.dtype,
    policy: Policy | None,
    keep_fp32: Sequence[ModuleKey],
    keep_norm_fp32: bool,
    forced: Mapping[str, tuple[torch.dtype, str]] | None = None,
) -> _Plan:
    """Each module's dtype: a forced choice (budget search), ``keep_fp32``, a policy
    module rule, the norm-layer rule, else its parent's dtype (the model: ``dtype``).
    A module whose own weights exceed its 16-bit dtype's range stays fp32 (its
    children still inherit the 16-bit dtype). Modules sharing a parameter are widened
    to the widest dtype among them."""
    forced = forced or {}
    dtypes: dict[str, torch.dtype] = {}
    passed_down: dict[str, torch.dtype] = {}  # what children inherit
    reasons: dict[str, str] = {}
    named = list(model.named_modules())
    for name, m in named:
        parent = _parent(name)
        if name in forced:
            d, why = forced[name]
        elif _matches(keep_fp32, name, m):
            d, why = torch.float32, "keep_fp32"
        elif policy is not None and (rule := policy.module_dtype(m, name)) is not None:
            d, why = rule, "policy rule"
        elif keep_norm_fp32 and is_norm_layer(m):
            d, why = torch.float32, "norm layer"
        elif parent is None:
            d, why = dtype, "default"
        else:
            d, why = passed_down[parent], "inherited" if passed_down[parent] != dtype else "default"
        passed_down[name] = d
        if d in LOW_PRECISION and _overflows(m, d):
            d, why = torch.float32, "range"
        dtypes[name], reasons[name] = d, why
    # A parameter shared by modules of different dtypes: widen them all.
    owners: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    changed = True
    while changed:
        changed = False
        for names in owners.values():
            names = [n for n in names if n in dtypes]
            kinds = {dtypes[n] for n in names}
            if len(kinds) > 1:
                for n in names:
                    if dtypes[n] != torch.float32:
                        dtypes[n], reasons[n] = torch.float32, "shared parameter"
                        changed = True
    return _Plan(dtypes, reasons)


def _build(ref: nn.Module, plan: _Plan, output_dtype: torch.dtype | None) -> nn.Module:
    """A copy of the fp32 ``ref`` with each module's own weights in its planned dtype
    and the boundary cast hooks installed."""
    model = copy.deepcopy(ref)
    names = dict(model.named_modules())
    for name, m in names.items():
        d = plan.dtype[name]
        for p in m.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != d:
                p.data = p.data.to(d)
        for bname, b in m.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dtype != d:
                m._buffers[bname] = b.to(d)
    for name, m in names.items():
        d = plan.dtype[name]
        parent = _parent(name)
        parent_d = None if parent is None else plan.dtype[parent]
        boundary = parent_d is not None and d != parent_d
        if boundary and d == torch.float32 and plan.reason[name] == "norm layer":
            # fp32 inside, the dtype it was given outside (a normalized output is bounded)
            island = _Fp32Island()
            m.register_forward_pre_hook(_IslandEnter(island), with_kwargs=True)
            m.register_forward_hook(_IslandExit(island), always_call=True)
            continue
        if _owns_weights(m) or boundary:
            m.register_forward_pre_hook(_BoundaryInputs(d), with_kwargs=True)
        if boundary and d != torch.float32:
            # a 16-bit module inside an fp32 (or other 16-bit) region: widen back
            m.register_forward_hook(_BoundaryOutputs(parent_d, (d,)))
    if output_dtype is not None:
        only = tuple(t for t in LOW_PRECISION if t != output_dtype)
        model.register_forward_hook(_BoundaryOutputs(output_dtype, only))
    model.eval()
    return model


def _decisions(model: nn.Module, plan: _Plan, isolated: Mapping[str, float], details: Mapping[str, str]) -> list[ModuleDecision]:
    out = []
    for name, m in model.named_modules():
        parent = _parent(name)
        boundary = parent is not None and plan.dtype[name] != plan.dtype[parent]
        if not (_owns_weights(m) or boundary or name == ""):
            continue
        out.append(
            ModuleDecision(
                name=name,
                kind=type(m).__name__,
                dtype=plan.dtype[name],
                reason=plan.reason[name],
                params=_own_numel(m),
                isolated_error=isolated.get(name),
                detail=details.get(name, ""),
            )
        )
    return out


# ---------------------------------------------------------------------------
# The budget search
# ---------------------------------------------------------------------------
class _Search:
    """Runs candidate models on the calibration batches against the fp32 outputs."""

    def __init__(
        self,
        ref: nn.Module,
        make_plan: Any,
        calib: Sequence[Any],
        reference: list[Any],
        output_dtype: torch.dtype | None,
        device_type: str,
    ) -> None:
        self.ref, self.make_plan, self.calib, self.reference = ref, make_plan, calib, reference
        self.output_dtype, self.device_type = output_dtype, device_type
        self.evaluations = 0
        self._cache: dict[frozenset[str], OutputError] = {}

    def error(self, fp32: Iterable[str]) -> OutputError:
        key = frozenset(fp32)
        if key not in self._cache:
            forced = {n: (torch.float32, "budget") for n in fp32}
            plan = self.make_plan(forced)
            model = _build(self.ref, plan, self.output_dtype)
            self.evaluations += 1
            self._cache[key] = output_error(self.reference, _outputs(model, self.calib, self.device_type))
        return self._cache[key]


def _search_budget(
    search: _Search, candidates: list[str], budget: Budget
) -> tuple[list[str], dict[str, float], dict[str, str], OutputError]:
    """The fp32 set (see the module docstring), the isolated error per candidate, a
    sentence per kept module, and the error with nothing kept."""
    base = search.error([])
    if budget.met_by(base) or not candidates:
        if not budget.met_by(base):
            raise ConversionError(
                f"the budget ({budget}) is not met ({base}) and no module is left to keep in fp32; "
                "loosen the budget or widen candidates."
            )
        return [], {}, {}, base
    everything = search.error(candidates)
    if not budget.met_by(everything):
        raise ConversionError(
            f"the budget ({budget}) cannot be met even with every candidate module in fp32 "
            f"({everything}); loosen the budget, turn off fold_bn, or check the calibration data."
        )
    isolated: dict[str, float] = {}
    for c in candidates:
        isolated[c] = search.error([n for n in candidates if n != c]).rel_error
    order = sorted(candidates, key=lambda c: (-_sort_key(isolated[c]), candidates.index(c)))
    lo, hi = 0, len(order)  # budget fails with order[:lo] kept (lo=0 checked), holds with order[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if budget.met_by(search.error(order[:mid])):
            hi = mid
        else:
            lo = mid
    kept = list(order[:hi])
    details: dict[str, str] = {}
    for c in reversed(list(kept)):  # least sensitive first
        trial = [n for n in kept if n != c]
        err = search.error(trial)
        if budget.met_by(err):
            kept = trial
        else:
            details[c] = (
                f"alone in 16 bits: rel error {isolated[c]:.3g}; converting it too would give {err}"
            )
    return kept, isolated, details, base


def _sort_key(x: float) -> float:
    return math.inf if math.isnan(x) else x


# ---------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------
def convert(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    policy: Policy | None = None,
    keep_fp32: Iterable[ModuleKey] = (),
    keep_norm_fp32: bool = True,
    checkpoint: Mapping[str, Any] | None = None,
    param_names: Sequence[Sequence[Sequence[str]]] | None = None,
    calib: Iterable[Any] | None = None,
    budget: float | Budget | None = None,
    candidates: Iterable[ModuleKey] | None = None,
    fold_bn: bool = True,
    output_dtype: torch.dtype | None = torch.float32,
) -> nn.Module:
    """An inference copy of ``model`` with 16-bit weights and casts only at dtype
    boundaries (see :mod:`ampkit.convert`). ``model`` itself is not changed.

    Args:
        model: the trained module: fp32 (O0/O1), or cast in place by
            ``ampkit.initialize`` (O2/O3/O2K; its 16-bit weights are used unless
            ``checkpoint`` gives better ones).
        dtype: 16-bit dtype of the weights, ``torch.bfloat16`` or ``torch.float16``;
            default ``policy.dtype``, else bf16 on CPU and fp16 on CUDA.
        policy: an :class:`ampkit.Policy` whose ``module_rules`` pin modules (by
            class or name glob) to a dtype, e.g. the policy the model trained with.
        keep_fp32: module names/globs (``"head"``, ``"blocks.*.attn"``) or classes to
            keep in fp32.
        keep_norm_fp32: keep normalization layers (BatchNorm not folded, LayerNorm,
            GroupNorm, RMSNorm, ...) in fp32. Default True.
        checkpoint: a training checkpoint to load first (see :func:`fp32_weights`):
            a model ``state_dict``, or ``{"model", "amp", "optimizer"}`` from O2/O2K.
        param_names: passed to :func:`fp32_weights` (rarely needed).
        calib: calibration batches (each a tensor, a tuple of positional inputs or a
            dict of keyword inputs; for a loader of ``(x, y)`` pairs pass
            ``[x for x, _ in loader]``). With them the report holds the converted
            model's error against fp32.
        budget: accuracy budget on ``calib`` (a :class:`Budget`, or a float: the
            largest relative error of the outputs). Modules are kept in fp32 until it
            is met. Needs ``calib``.
        candidates: module names/globs or classes the budget search may keep in
            fp32; default every module owning 16-bit weights.
        fold_bn: fold eval-mode BatchNorm into the conv/linear layer before it where
            the folded weights round well enough (default True).
        output_dtype: dtype the model's 16-bit floating outputs are cast to (default
            fp32); None leaves them 16-bit.

    Returns:
        A new module of the same class in eval mode, on the same device, with the
        :class:`ConversionReport` as ``ampkit_report``. Run it outside ampkit/torch
        autocast scopes (it needs none).

    Raises:
        ConversionError: bad arguments (checked before anything is built), a
            checkpoint that does not fit, calibration batches the model cannot run,
            or a budget that cannot be met.
        NonFiniteError: a NaN/inf parameter, a NaN buffer (infinite buffers such as
            attention masks are allowed), or NaN in the fp32 model's outputs on
            ``calib``.

    Warns:
        UserWarning: without a budget, when the converted model's outputs on
            ``calib`` are non-finite where fp32's are not (the report's
            ``error.nonfinite``).
    """
    from ampkit._internal.dtypes import default_dtype
    from ampkit.casting.policy import check_compute_dtype

    if not isinstance(model, nn.Module):
        raise ConversionError(f"convert takes an nn.Module, got {type(model).__name__}.")
    if policy is not None and not isinstance(policy, Policy):
        raise ConversionError(f"policy must be an ampkit.Policy, got {type(policy).__name__}.")
    device_type = _device_type(model)
    if dtype is None:
        dtype = policy.dtype if policy is not None else default_dtype(device_type)
    try:
        dtype = check_compute_dtype(dtype)
    except AmpError as exc:
        raise ConversionError(f"convert: {exc}") from None
    if output_dtype is not None and output_dtype not in _FLOAT_DTYPES + (torch.float64,):
        raise ConversionError(f"output_dtype must be a floating dtype or None, got {output_dtype!r}.")
    budget = _as_budget(budget)
    calib_list = None if calib is None else list(calib)
    if calib_list is not None and not calib_list:
        raise ConversionError("calib is empty: give at least one batch of inputs.")
    if budget is not None and calib_list is None:
        raise ConversionError("an accuracy budget needs calibration batches: pass calib=[...].")
    names = [n for n, _ in model.named_modules()]
    keep = _check_keys(keep_fp32, "keep_fp32", names)
    cand_keys = None if candidates is None else _check_keys(candidates, "candidates", names)
    if checkpoint is not None and not isinstance(checkpoint, Mapping):
        raise ConversionError(f"checkpoint must be a dict, got {type(checkpoint).__name__}.")

    if device_type == "cpu":
        _warn_slow_cpu(dtype)
    ref = _fp32_copy(model)
    if checkpoint is not None:
        load_fp32_checkpoint(ref, checkpoint, param_names)
    _check_finite_weights(ref, "the checkpoint's" if checkpoint is not None else "the model's")

    def make_plan(target: nn.Module, forced: Mapping[str, tuple[torch.dtype, str]] | None = None) -> _Plan:
        return _plan(target, dtype, policy, keep, keep_norm_fp32, forced)

    folded = ref
    folds: list[FoldRecord] = []
    if fold_bn:
        folded = copy.deepcopy(ref)
        folds = _fold_batchnorms(folded, make_plan(folded).dtype)
    reference = None if calib_list is None else _outputs(ref, calib_list, device_type)

    forced: dict[str, tuple[torch.dtype, str]] = {}
    isolated: dict[str, float] = {}
    details: dict[str, str] = {}
    base_error = None
    evaluations = 0
    if budget is not None:
        assert calib_list is not None and reference is not None
        base_plan = make_plan(folded)
        modules = dict(folded.named_modules())
        if cand_keys is None:
            cands = [n for n, m in modules.items() if base_plan.dtype[n] in LOW_PRECISION and _owns_weights(m)]
        else:
            cands = [n for n, m in modules.items() if _matches(cand_keys, n, m) and base_plan.dtype[n] in LOW_PRECISION]
        search = _Search(folded, lambda f: make_plan(folded, f), calib_list, reference, output_dtype, device_type)
        kept, isolated, details, base_error = _search_budget(search, cands, budget)
        evaluations = search.evaluations
        forced = {n: (torch.float32, "budget") for n in kept}

    plan = make_plan(folded, forced)
    converted = _build(folded, plan, output_dtype)
    error = None
    if calib_list is not None:
        assert reference is not None
        error = output_error(reference, _outputs(converted, calib_list, device_type))
        evaluations += 1
        if error.nonfinite and budget is None:
            warnings.warn(
                f"ampkit.convert: the converted model's outputs on the calibration batches hold "
                f"{error.nonfinite} NaN/inf value(s) where the fp32 model's are finite (a 16-bit "
                "overflow); keep the module that overflows in fp32 (keep_fp32=[...]) or pass a "
                "budget so that convert finds it.",
                stacklevel=2,
            )
    converted.ampkit_report = ConversionReport(
        dtype=dtype,
        output_dtype=output_dtype,
        modules=_decisions(converted, plan, isolated, details),
        folds=folds,
        budget=budget,
        error=error,
        error_all_16bit=base_error,
        evaluations=evaluations,
        weight_bytes=weight_bytes(converted),
        weight_bytes_fp32=weight_bytes(ref),
    )
    return converted


def dequantized(model: nn.Module) -> nn.Module:
    """A copy of a converted model with every weight in fp32 (values unchanged: the
    16-bit weights widened) and no cast hooks: the converted model's weights with
    fp32 compute. ``export_onnx(precision="storage")`` exports this."""
    return _fp32_copy(model)


def iter_boundary_modules(model: nn.Module) -> Iterator[tuple[str, torch.dtype]]:
    """(name, dtype) of each module of a converted model that casts its inputs."""
    for name, m in model.named_modules():
        for fn in m._forward_pre_hooks.values():
            if isinstance(fn, _BoundaryInputs):
                yield name, fn.dtype
            elif isinstance(fn, _IslandEnter):
                yield name, torch.float32
            elif isinstance(fn, functools.partial) and fn.func is _cast_inputs:  # ampkit 0.2
                yield name, fn.args[0]
            elif isinstance(getattr(fn, "__self__", None), _Fp32Island):  # ampkit 0.2
                yield name, torch.float32
