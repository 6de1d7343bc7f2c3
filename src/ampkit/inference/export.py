"""Exporting a converted model: ``torch.export`` programs and ONNX files.

:func:`export_program` gives a :class:`torch.export.ExportedProgram` of a model
made by :func:`ampkit.convert` (its cast hooks are traced into the graph), for
users who stay in PyTorch (``torch.export.save``, AOTInductor).

:func:`export_onnx` writes an ONNX file, checks it with ``onnx.checker`` and runs it
with onnxruntime against the PyTorch model. Two precisions:

``"compute"``
    the converted model's own graph: 16-bit weights and 16-bit ops where the
    PyTorch model computes in 16 bits, fp32 where it keeps fp32, ``Cast`` nodes at
    the boundaries. For fp16 models: ONNX's ``Conv``/``Gemm`` have no bf16 type and
    onnxruntime's CPU provider has no bf16 kernels for most ops (``Add``, ``MatMul``),
    so a bf16 graph does not load there. fp16 graphs run on onnxruntime CPU (measured
    about 10-20% *slower* than fp32 there: its CPU kernels widen fp16 internally) and
    are what GPU providers (CUDA, TensorRT, DirectML) run fast.
``"storage"``
    weights stored in 16 bits in the file (bf16 or fp16 initializers, bit for bit the
    converted model's weights), each widened by a ``Cast`` node that onnxruntime
    folds when the session is created; compute in fp32. Half the file size, fp32
    speed, and accuracy at least that of the converted model (only the weights were
    rounded). Runs on every provider.
``"auto"`` (default)
    ``"compute"`` for a model whose 16-bit weights are fp16, ``"storage"`` for bf16.

Exporter: ``torch.onnx.export(..., dynamo=True)`` (torch.export, then the ONNX
translation of onnxscript), the exporter torch maintains; with ``exporter="auto"`` a
model it cannot capture (e.g. data-dependent Python control flow) falls back to the
TorchScript exporter (``dynamo=False``, tracing, which bakes the branch taken for the
example inputs into the graph), and the result says why.

Needs the ``deploy`` extra (``pip install -e '.[deploy]'``: onnx, onnxruntime,
onnxscript); imported only when these functions run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ampkit._internal.dtypes import LOW_PRECISION, dtype_name
from ampkit._internal.install import install_hint
from ampkit._internal.paths import output_path
from ampkit._internal.tree import iter_tensors
from ampkit.errors import AmpError

from .conversion import ConversionError, OutputError, dequantized, output_error, run_batch

__all__ = [
    "OnnxExport",
    "export_onnx",
    "export_program",
    "onnx_session",
    "run_onnx",
]

Precision = Literal["auto", "compute", "storage"]
Exporter = Literal["auto", "dynamo", "torchscript"]

# Opset of the TorchScript fallback (the dynamo exporter picks its own, currently 18+).
_TORCHSCRIPT_OPSET = 17
# Initializers smaller than this stay fp32 in "storage" mode (the exporter's scalar constants).
_MIN_STORED = 2
# Above this the protobuf limit (2 GiB) is near: weights go to an external data file.
_EXTERNAL_DATA_BYTES = 1 << 30


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise AmpError(
            f"exporting to ONNX needs {module}: {install_hint('deploy')} "
            "(onnx, onnxruntime, onnxscript)."
        ) from None


@dataclasses.dataclass
class OnnxExport:
    """What :func:`export_onnx` wrote.

    Attributes:
        path: the ONNX file.
        exporter: ``"dynamo"`` or ``"torchscript"``.
        precision: ``"compute"`` or ``"storage"``.
        file_bytes: size of the file (plus its external data file, if any).
        initializer_bytes: bytes of the graph's initializers per ONNX type name
            (``{"FLOAT16": ..., "FLOAT": ...}``).
        op_types: count of nodes per ``(op type, output type)``, e.g.
            ``{("MatMul", "FLOAT16"): 4, ("Cast", "FLOAT"): 2}``.
        fallback_reason: why the dynamo exporter was not used (None if it was).
        error_vs_pytorch: onnxruntime's outputs against the PyTorch model's on the
            example inputs (None with ``check=False``).
    """

    path: Path
    exporter: str
    precision: str
    file_bytes: int
    initializer_bytes: dict[str, int]
    op_types: dict[tuple[str, str], int]
    fallback_reason: str | None = None
    error_vs_pytorch: OutputError | None = None

    def __str__(self) -> str:
        inits = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(self.initializer_bytes.items()))
        lines = [
            f"{self.path}: {self.file_bytes / 2**20:.2f} MiB, {self.precision} precision, "
            f"{self.exporter} exporter; initializers {inits}"
        ]
        if self.fallback_reason:
            lines.append(f"  dynamo exporter failed, used TorchScript: {self.fallback_reason}")
        if self.error_vs_pytorch is not None:
            lines.append(f"  onnxruntime vs PyTorch: {self.error_vs_pytorch}")
        return "\n".join(lines)


def _as_args(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise ConversionError(
        "example_inputs must be a tensor or a tuple of positional inputs, got "
        f"{type(example_inputs).__name__}."
    )


def _dynamic_shapes(args: tuple[Any, ...], dynamic_batch: bool) -> tuple[Any, ...] | None:
    if not dynamic_batch:
        return None
    auto = torch.export.Dim.AUTO
    return tuple({0: auto} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in args)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporters' progress prints and deprecation chatter."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_program(
    model: nn.Module, example_inputs: Any, *, dynamic_batch: bool = True, strict: bool = False
) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``model`` (e.g. from :func:`ampkit.convert`) in eval
    mode on ``example_inputs`` (a tensor or a tuple of positional inputs).

    ``strict`` is ``torch.export.export``'s (default False: non-strict tracing).
    With ``dynamic_batch`` (default) dimension 0 of every tensor input is left to
    torch to make dynamic (``Dim.AUTO``; give an example batch of at least 2). The
    cast hooks of a converted model become ``_to_copy`` nodes of the graph; weights
    are stored in the program in their converted dtypes. Save it with
    ``torch.export.save(program, "model.pt2")``; run it with ``program.module()(x)``.
    """
    if not isinstance(model, nn.Module):
        raise ConversionError(f"export_program takes an nn.Module, got {type(model).__name__}.")
    args = _as_args(example_inputs)
    model.eval()
    with _quiet_exporter():
        return torch.export.export(
            model, args, dynamic_shapes=_dynamic_shapes(args, dynamic_batch), strict=strict
        )


def _low_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {t.dtype for t in list(model.parameters()) + list(model.buffers()) if t.dtype in LOW_PRECISION}


def _resolve_precision(model: nn.Module, precision: str) -> tuple[str, torch.dtype | None]:
    lows = _low_dtypes(model)
    storage_dtype = torch.bfloat16 if torch.bfloat16 in lows else (torch.float16 if lows else None)
    if precision == "auto":
        return ("storage" if torch.bfloat16 in lows else "compute"), storage_dtype
    return precision, storage_dtype


def _export_dynamo(target: nn.Module, args: tuple[Any, ...], dynamic_batch: bool, opset: int | None) -> Any:
    _require("onnxscript")
    with _quiet_exporter():
        program = torch.onnx.export(
            target,
            args,
            None,
            dynamo=True,
            dynamic_shapes=_dynamic_shapes(args, dynamic_batch),
            opset_version=opset,
            optimize=True,
        )
    return program.model_proto


def _export_torchscript(target: nn.Module, args: tuple[Any, ...], dynamic_batch: bool, opset: int | None) -> Any:
    onnx = _require("onnx")
    tensor_args = [a for a in args if isinstance(a, torch.Tensor)]
    input_names = [f"input_{i}" for i in range(len(tensor_args))]
    with torch.no_grad():
        out = target(*args)
    n_out = len(list(iter_tensors(out)))
    output_names = [f"output_{i}" for i in range(n_out)]
    axes = {n: {0: "batch"} for n in input_names + output_names} if dynamic_batch else None
    buf = io.BytesIO()
    with _quiet_exporter():
        torch.onnx.export(
            target,
            args,
            buf,
            dynamo=False,
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=axes,
            opset_version=opset or _TORCHSCRIPT_OPSET,
        )
    return onnx.load_model_from_string(buf.getvalue())


def _store_16bit(proto: Any, dtype: torch.dtype) -> None:
    """Replace every fp32 initializer whose values ``dtype`` holds exactly by a
    ``dtype`` initializer and a ``Cast`` to fp32 of the original name (in place)."""
    onnx = _require("onnx")
    import ml_dtypes
    import numpy as np
    from onnx import numpy_helper

    np_dtype = ml_dtypes.bfloat16 if dtype == torch.bfloat16 else np.float16
    suffix = dtype_name(dtype)
    graph = proto.graph
    kept, casts = [], []
    for init in graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT or int(np.prod(init.dims)) < _MIN_STORED:
            kept.append(init)
            continue
        arr = numpy_helper.to_array(init)
        with np.errstate(over="ignore"):
            low = arr.astype(np_dtype)
        if not np.array_equal(low.astype(np.float32).view(np.uint32), arr.view(np.uint32)):
            kept.append(init)
            continue
        name = f"{init.name}__{suffix}"
        kept.append(numpy_helper.from_array(low, name))
        casts.append(onnx.helper.make_node("Cast", [name], [init.name], to=onnx.TensorProto.FLOAT, name=f"{name}_cast"))
    del graph.initializer[:]
    graph.initializer.extend(kept)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(casts + nodes)


def _census(proto: Any) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    onnx = _require("onnx")
    import numpy as np

    names = {v: k for k, v in onnx.TensorProto.DataType.items()}
    inits: dict[str, int] = {}
    for init in proto.graph.initializer:
        key = names.get(init.data_type, str(init.data_type))
        size = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        inits[key] = inits.get(key, 0) + int(np.prod(init.dims)) * size
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
        types = {
            v.name: names.get(v.type.tensor_type.elem_type, "?")
            for v in list(inferred.graph.value_info) + list(inferred.graph.output)
        }
    except Exception:
        types = {}
    ops: dict[tuple[str, str], int] = {}
    for node in proto.graph.node:
        key = (node.op_type, types.get(node.output[0], "?") if node.output else "?")
        ops[key] = ops.get(key, 0) + 1
    return inits, ops


def export_onnx(
    model: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike[str],
    *,
    precision: Precision = "auto",
    exporter: Exporter = "auto",
    dynamic_batch: bool = True,
    opset: int | None = None,
    check: bool = True,
    threads: int = 1,
) -> OnnxExport:
    """Write ``model`` (from :func:`ampkit.convert`) as an ONNX file, check it with
    ``onnx.checker`` and, with ``check``, run it in onnxruntime (CPU) on
    ``example_inputs`` against the PyTorch model.

    Args:
        model: the converted model (any module works; a plain fp32 model exports fp32).
        example_inputs: a tensor or a tuple of positional inputs (fp32, as the
            converted model takes them). Non-tensor arguments are baked in.
        path: the ``.onnx`` file to write.
        precision: ``"compute"``, ``"storage"`` or ``"auto"`` (see
            ``ampkit.inference.export``; auto: compute for fp16 weights, storage for bf16).
        exporter: ``"dynamo"`` (torch.onnx.export(dynamo=True)), ``"torchscript"``,
            or ``"auto"``: dynamo, falling back to TorchScript when dynamo fails.
        dynamic_batch: make dimension 0 of inputs (and outputs) dynamic. Default True.
        opset: ONNX opset; default the exporter's own choice (17 for TorchScript).
        check: run the file in onnxruntime and compare with ``model`` (default True).
        threads: onnxruntime intra-op threads for the check (default 1).

    Returns:
        An :class:`OnnxExport` (sizes, node dtypes, exporter used, errors).

    Raises:
        OutputPathError: ``path`` is not a str/PathLike, is a folder, or its folder is
            missing or not writable (checked before exporting).
        AmpError: the deploy extra is missing, the export fails, the file does not pass
            ``onnx.checker`` or does not run in onnxruntime (with what to do).
    """
    if not isinstance(model, nn.Module):
        raise ConversionError(f"export_onnx takes an nn.Module, got {type(model).__name__}.")
    if precision not in ("auto", "compute", "storage"):
        raise ConversionError(f"precision must be 'auto', 'compute' or 'storage', got {precision!r}.")
    if exporter not in ("auto", "dynamo", "torchscript"):
        raise ConversionError(f"exporter must be 'auto', 'dynamo' or 'torchscript', got {exporter!r}.")
    args = _as_args(example_inputs)
    path = output_path(path, "the ONNX file")
    onnx = _require("onnx")
    if check:
        _require("onnxruntime")

    mode, storage_dtype = _resolve_precision(model, precision)
    model.eval()
    target = dequantized(model) if mode == "storage" else model
    fallback = None
    proto = None
    if exporter in ("auto", "dynamo"):
        try:
            proto = _export_dynamo(target, args, dynamic_batch, opset)
            used = "dynamo"
        except AmpError:
            raise
        except Exception as exc:
            if exporter == "dynamo":
                raise AmpError(
                    f"torch.onnx.export(dynamo=True) failed: {_first_line(exc)}; try exporter='torchscript'."
                ) from exc
            fallback = _first_line(exc)
            warnings.warn(
                f"ampkit.export_onnx: the dynamo exporter failed ({fallback}); using the "
                "TorchScript exporter (it traces: control flow is fixed to the example inputs' path).",
                stacklevel=2,
            )
    if proto is None:
        try:
            proto = _export_torchscript(target, args, dynamic_batch, opset)
            used = "torchscript"
        except Exception as exc:
            raise AmpError(f"the TorchScript ONNX exporter failed: {_first_line(exc)}") from exc
    if mode == "storage" and storage_dtype is not None:
        _store_16bit(proto, storage_dtype)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:
        raise AmpError(
            f"the exported graph fails onnx.checker: {_first_line(exc)}. A bf16 graph in "
            "'compute' precision is not valid ONNX for Conv/Gemm: use precision='storage' or "
            "convert with dtype=torch.float16."
        ) from exc
    large = proto.ByteSize() > _EXTERNAL_DATA_BYTES
    onnx.save_model(proto, str(path), save_as_external_data=large, location=f"{path.name}.data" if large else None)
    size = path.stat().st_size + (path.with_name(f"{path.name}.data").stat().st_size if large else 0)
    inits, ops = _census(proto)
    result = OnnxExport(path, used, mode, size, inits, ops, fallback)
    if check:
        try:
            session = onnx_session(path, threads=threads)
            got = run_onnx(session, args)
        except Exception as exc:
            raise AmpError(
                f"onnxruntime cannot run {str(path)!r}: {_first_line(exc)}. onnxruntime's CPU "
                "provider has no bf16 kernels: use precision='storage' or convert with "
                "dtype=torch.float16."
            ) from exc
        with torch.inference_mode():
            want = run_batch(model, args)
        result.error_vs_pytorch = output_error([want], [got])
    return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def onnx_session(path: str | os.PathLike[str], threads: int = 1) -> Any:
    """An onnxruntime CPU ``InferenceSession`` for ``path`` with ``threads``
    intra-op threads and one inter-op thread (all graph optimizations on)."""
    ort = _require("onnxruntime")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64"}


def run_onnx(session: Any, inputs: Any) -> list[torch.Tensor]:
    """Run an onnxruntime ``session`` on ``inputs`` (a tensor or a tuple of
    positional inputs, as given to the PyTorch model; non-tensors are skipped, as the
    exporter baked them in) and return its outputs as torch tensors."""
    import numpy as np

    tensors = [a for a in _as_args(inputs) if isinstance(a, torch.Tensor)]
    specs = session.get_inputs()
    if len(specs) != len(tensors):
        raise ConversionError(f"the ONNX graph takes {len(specs)} inputs, got {len(tensors)} tensors.")
    feeds = {}
    for spec, t in zip(specs, tensors):
        arr = t.detach().cpu()
        if arr.is_floating_point():
            want = _ORT_TYPES.get(spec.type)
            if want is None and spec.type == "tensor(bfloat16)":
                import ml_dtypes

                feeds[spec.name] = arr.float().numpy().astype(ml_dtypes.bfloat16)
                continue
            feeds[spec.name] = arr.float().numpy().astype(want or "float32")
        else:
            feeds[spec.name] = arr.numpy()
    outs = session.run(None, feeds)
    result = []
    for o in outs:
        o = np.asarray(o)
        if o.dtype.name == "bfloat16":
            result.append(torch.from_numpy(o.view(np.int16).copy()).view(torch.bfloat16))
        else:
            result.append(torch.from_numpy(np.ascontiguousarray(o)))
    return result


def onnx_output_error(session: Any, reference: Sequence[Any], batches: Sequence[Any]) -> OutputError:
    """onnxruntime's outputs on ``batches`` against ``reference`` (one output per
    batch, e.g. an fp32 model's): :class:`ampkit.inference.conversion.OutputError`."""
    return output_error(list(reference), [run_onnx(session, b) for b in batches])
