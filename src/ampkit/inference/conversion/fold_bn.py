"""BatchNorm folding: an eval-mode BatchNorm whose only input is a conv/linear
layer's output is folded into that layer where the folded weights round to the storage
dtype about as well as the plain ones (:class:`~.report.FoldRecord`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit._internal.dtypes import dtype_name

from .report import FoldRecord

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
        if node.op != "call_module" or not isinstance(modules.get(node.target), torch_compat.BATCH_NORM_BASE):
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
            if isinstance(la, _FOLDABLE) and isinstance(lb, torch_compat.BATCH_NORM_BASE):
                join = f"{prefix}." if prefix else ""
                pairs.append((f"{join}{a}", f"{join}{b}"))
    return pairs


def _folded_weights(layer: nn.Module, bn: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The folded (weight, bias) in fp64, or None if the pair cannot be folded
    (no running statistics, channel counts that differ, grouped transposed conv)."""
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return None
    w = layer.weight.detach().double()
    transposed = isinstance(layer, torch_compat.CONV_TRANSPOSE_BASE)
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
        reason = "" if ok else f"folded weights round too coarsely in {dtype_name(dtype)}"
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
