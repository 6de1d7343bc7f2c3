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

# The public names; and the `_`-names models converted by ampkit 0.2 name under
# ``ampkit.convert`` (ampkit.legacy answers that path with this package): hook classes
# and the hook functions 0.2 pickled as ``functools.partial``.
from .api import convert
from .checkpoint import fp32_weights, load_fp32_checkpoint
from .errors import ConversionError, NonFiniteError
from .hooks import _BoundaryInputs as _BoundaryInputs
from .hooks import _BoundaryOutputs as _BoundaryOutputs
from .hooks import _cast_inputs as _cast_inputs
from .hooks import _cast_outputs as _cast_outputs
from .hooks import _Fp32Island as _Fp32Island
from .hooks import _IslandEnter as _IslandEnter
from .hooks import _IslandExit as _IslandExit
from .hooks import dequantized, iter_boundary_modules
from .measure import Budget, OutputError, output_error, run_batch, weight_bytes
from .report import ConversionReport, FoldRecord, ModuleDecision

__all__ = [
    "Budget",
    "ConversionError",
    "ConversionReport",
    "FoldRecord",
    "ModuleDecision",
    "NonFiniteError",
    "OutputError",
    "convert",
    "dequantized",
    "fp32_weights",
    "iter_boundary_modules",
    "load_fp32_checkpoint",
    "output_error",
    "run_batch",
    "weight_bytes",
]
