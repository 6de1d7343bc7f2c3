"""What :func:`ampkit.convert` did, kept as ``converted.ampkit_report``:
:class:`ConversionReport`, one :class:`ModuleDecision` per module, one
:class:`FoldRecord` per BatchNorm considered for folding."""

from __future__ import annotations

import dataclasses

import torch

from ampkit._internal.dtypes import dtype_name

from .measure import Budget, OutputError

__all__ = ["ConversionReport", "FoldRecord", "ModuleDecision"]


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
    """One BatchNorm (``norm``) considered for folding into the layer before it
    (``layer``); ``folded`` says whether it was, ``reason`` why not.

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
            f"ampkit.convert: {dtype_name(self.dtype, none='-')} weights, outputs "
            f"{dtype_name(self.output_dtype) if self.output_dtype else 'as computed'}; "
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
