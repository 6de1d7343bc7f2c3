""":func:`convert`: the checks made before anything is built, then the steps of
:mod:`ampkit.inference.conversion` in order (fp32 copy, checkpoint, folding, budget
search, build, report)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ampkit._internal import registry as _reset
from ampkit._internal import torch_compat
from ampkit._internal.dtypes import LOW_PRECISION, dtype_name
from ampkit.casting.policy import Policy
from ampkit.errors import AmpError

from .checkpoint import load_fp32_checkpoint
from .errors import ConversionError, NonFiniteError
from .fold_bn import _fold_batchnorms
from .hooks import _fp32_copy
from .measure import (
    Budget,
    _as_budget,
    _device_type,
    _outputs,
    output_error,
    weight_bytes,
)
from .plan import ModuleKey, _build, _check_keys, _decisions, _matches, _owns_weights, _Plan, _plan
from .report import ConversionReport, FoldRecord
from .search import _Search, _search_budget

__all__ = ["convert"]


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# Module state: warnings given once per process.
_WARNED: set[str] = set()
_reset.on_reset(_WARNED.clear)  # like the engine's fp16-on-CPU warning: once per session


def _cpu_computes_fast(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions for ``dtype`` matmuls (AVX512-BF16 or AMX for
    bf16, AMX-FP16 for fp16); True when torch cannot tell."""
    native = torch_compat.cpu_has_native_16bit(dtype)
    return True if native is None else native


def _warn_slow_cpu(dtype: torch.dtype) -> None:
    key = f"cpu-{dtype}"
    if key in _WARNED or _cpu_computes_fast(dtype):
        return
    _WARNED.add(key)
    warnings.warn(
        f"ampkit.convert: this CPU has no {dtype_name(dtype)} instructions (AVX512-BF16/AMX), so "
        f"the converted model computes slower than fp32 here (the weights still take half the "
        "memory). To serve on such a CPU, export with ampkit.export_onnx(..., precision='storage') "
        "(16-bit weights, fp32 compute) or run where the 16-bit kernels are native.",
        stacklevel=3,
    )


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
    boundaries (see ``ampkit.inference.conversion``). ``model`` itself is not changed.

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
