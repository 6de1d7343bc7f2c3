"""Under ``torch.compile`` an fp8 linear is one custom op (``ampkit::fp8_linear``) and one for
its backward, running the eager code at run time; :func:`fp8_linear` picks the path."""

from __future__ import annotations

from typing import Any

import torch

from ampkit.errors import AmpError

from .matmul import _backward, _forward, _Fp8Matmul
from .observing import _forward_mode
from .recipe import E4M3
from .scales import _HANDLES, LayerState, Mode

# --- one opaque op under torch.compile --------------------------------------------------------
#
# Traced by dynamo, the autograd Function of ``matmul.py`` would break the graph (it mutates the scale
# state, which a traced autograd.Function may not) and, where inductor fused its pieces,
# compute other values: inductor keeps a fused bf16/fp16 intermediate in fp32 without
# rounding it (``emulate_precision_casts=False``, its default), so an fp8 cast read an
# unrounded GELU output and ``y + bias.to(bf16)`` skipped two roundings. While compiling,
# the layer is therefore one custom op (and one for its backward): inductor calls it as an
# extern kernel on materialized inputs, and it runs the eager code of ``matmul.py`` at run time,
# scale state included -- compiled fp8 computes bitwise what eager computes, with no graph
# break. The op finds its :class:`LayerState` by an int handle (ops take no Python objects).

_MODES: tuple[Mode, ...] = ("train", "frozen", "replay")


@torch.library.custom_op("ampkit::fp8_linear", mutates_args=())
def _fp8_linear_op(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    handle: int,
    out_dtype: torch.dtype,
    grad: bool,
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
        saved = (
            x.new_empty(x.shape, dtype=E4M3),
            w.new_empty(w.shape, dtype=E4M3),
            scalar,
            scalar.clone(),
        )
    return (y, *saved, torch.empty((), dtype=torch.int64))


@torch.library.custom_op("ampkit::fp8_linear_backward", mutates_args=())
def _fp8_linear_backward_op(
    gy: torch.Tensor,
    x: torch.Tensor | None,
    w: torch.Tensor | None,
    xq: torch.Tensor,
    wq: torch.Tensor,
    xs: torch.Tensor,
    ws: torch.Tensor,
    mode: torch.Tensor,
    handle: int,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    b_dtype: torch.dtype | None,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(gy.device.type, enabled=False):
        grads = _backward(
            gy,
            x,
            w,
            (xq, wq, xs, ws),
            _HANDLES[handle],
            _MODES[int(mode)],
            (x_dtype, w_dtype, b_dtype),
            (need_x, need_w, need_b),
        )
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
    gx, gw, gb = torch.ops.ampkit.fp8_linear_backward(
        gy, x, w, xq, wq, xs, ws, mode, ctx.handle, *ctx.dtypes, *need
    )
    return (
        gx if need[0] else None,
        gw if need[1] else None,
        gb if need[2] else None,
        None,
        None,
        None,
        None,
    )


_fp8_linear_op.register_autograd(_backward_formula, setup_context=_setup_context)


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype an ``nn.Linear`` would produce here: autocast's when it is on, else the
    input's (the weight's for a 16-bit weight and fp32 input, as O2's cast model)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(x.dtype, w.dtype)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: LayerState
) -> torch.Tensor:
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
        y = torch.ops.ampkit.fp8_linear(
            x2d, weight, bias, state.handle, out_dtype, torch.is_grad_enabled(), rowwise
        )[0]
    else:
        with torch.autocast(x.device.type, enabled=False):
            y = _Fp8Matmul.apply(
                x2d, weight, bias, state, out_dtype, _forward_mode(torch.is_grad_enabled())
            )
    return y.reshape(*lead, weight.shape[0])
