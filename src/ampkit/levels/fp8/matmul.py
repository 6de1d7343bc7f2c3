"""The three fp8 matmuls of a linear (forward, grad of the input, grad of the weight) on
``torch._scaled_mm``, as an autograd Function."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ampkit._internal import torch_compat

from .observing import _observe
from .recipe import E4M3
from .scales import LayerState, Mode, quantize_rowwise, quantize_tensorwise


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what ``_scaled_mm`` wants for its second operand)."""
    return t.t().contiguous().t()


def _mm(
    a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
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
    return torch_compat.scaled_mm(
        a.contiguous(), _col_major(b), scale_a=_dense(sa), scale_b=_dense(sb), out_dtype=out_dtype
    )


def _dense(scale: torch.Tensor) -> torch.Tensor:
    """A row-wise scale (``(M, 1)`` or ``(1, N)``) with unit strides, as ``_scaled_mm`` checks."""
    return scale.flatten().view(scale.shape) if scale.dim() == 2 else scale


def _mm_bias(
    a: torch.Tensor,
    b: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`_mm`, plus ``bias`` (cast to ``out_dtype``) added in ``out_dtype``."""
    y = _mm(a, b, sa, sb, out_dtype)
    return y if bias is None else y + bias.to(out_dtype)


def _forward(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, state: LayerState, out_dtype: torch.dtype, mode: Mode
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
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
        wq, ws = quantize_tensorwise(
            w, E4M3, state.roles["weight"], recipe, reduce=False, mode=mode
        )
        saved = (xq, wq, xs, ws)
    y = _mm_bias(xq, wq.t(), xs, ws, out_dtype, bias)
    _observe(state, "forward", xq, wq, xs, ws, out_dtype)
    return y, saved


def _backward(
    gy: torch.Tensor,
    x: torch.Tensor | None,
    w: torch.Tensor | None,
    saved: Sequence[torch.Tensor],
    state: LayerState,
    mode: Mode,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype | None],
    needs: Sequence[bool],
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
    gq, gs = quantize_tensorwise(
        gy, gdt, state.roles["grad_output"], recipe, reduce=True, mode=mode
    )
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
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        state: LayerState,
        out_dtype: torch.dtype,
        mode: Mode,
    ) -> torch.Tensor:  # type: ignore[override]
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
            grads = _backward(
                gy, x, w, saved, ctx.state, ctx.mode, ctx.dtypes, ctx.needs_input_grad[:3]
            )
        return (*grads, None, None, None)
