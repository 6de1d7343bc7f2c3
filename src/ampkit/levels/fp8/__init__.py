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
comment above ``_fp8_linear_op`` in ``ampkit/levels/fp8/compiled.py`` for why).

Implemented directly on ``torch._scaled_mm`` rather than on ``torchao.float8``:
torchao 0.15 runs on CPU but has no delayed scaling any more (only dynamic scaling),
keeps no scale state to checkpoint, and exposes no per-matmul scales to report; its
tensorwise numerics are the reference our tests compare against when it is installed.

The package by layer of the feature: ``recipe`` (what to convert, how to scale),
``scales`` (scale state and the casts), ``matmul`` (the three scaled matmuls),
``compiled`` (the custom op under ``torch.compile``), ``layer`` (:class:`Float8Linear`),
``training`` (the layers of one ``initialize``: plan, convert, state, reset) and
``observing`` (what ``explain`` records). Concepts: ``docs/guides/fp8.md``.
"""

from __future__ import annotations

# besides the public names (``__all__``), 0.3's import paths (fp8 was one module:
# ``from ampkit.levels.fp8 import TensorScale``), imported for their names alone
# ruff: noqa: F401
from .layer import Float8Linear
from .observing import Fp8MatmulRecord, observe
from .recipe import (
    E4M3,
    E5M2,
    MAX_AMAX_HISTORY_LEN,
    MAX_MARGIN,
    ROLES,
    WARN_MARGIN,
    AmaxAlgo,
    Fp8Format,
    Fp8Granularity,
    Fp8Recipe,
    Fp8Scaling,
    ModuleFilter,
    check_level,
    max_margin,
)
from .scales import (
    LayerState,
    Mode,
    TensorScale,
    quantize_rowwise,
    quantize_tensorwise,
    saturate,
    scale_from_amax,
)
from .training import Fp8LayerInfo, Fp8Training, activate, current, layers, plan

__all__ = ["Fp8Recipe", "Float8Linear", "Fp8LayerInfo", "Fp8MatmulRecord", "layers", "observe"]
