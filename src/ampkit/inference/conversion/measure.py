"""Measuring a model's outputs against the fp32 model's: :class:`OutputError`,
:func:`output_error`, the accuracy :class:`Budget`; running calibration batches
(:func:`run_batch`) and counting weight bytes (:func:`weight_bytes`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ampkit._internal.dtypes import dtype_name
from ampkit.errors import AmpError

from .errors import ConversionError, NonFiniteError

__all__ = ["Budget", "OutputError", "output_error", "run_batch", "weight_bytes"]


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
        return f"tensor {list(batch.shape)} {dtype_name(batch.dtype)}"
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in list(batch.items())[:4]) + "}"
    if isinstance(batch, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in list(batch)[:4]) + ")"
    return type(batch).__name__


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, Mapping):
        return {k: _detach(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_detach(v) for v in obj]
    return obj
