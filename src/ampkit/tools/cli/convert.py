"""``ampkit convert CHECKPOINT --model module:factory --calib ...``: convert a training
checkpoint into an inference model, optionally export it to ONNX, and print a table of
weight size, latency (PyTorch and onnxruntime, fp32 vs converted) and error against fp32.

Bad input (a file that is not there, a factory that cannot be imported or does not
build a module, a checkpoint that does not fit it or holds NaN/inf weights, calibration
batches the model cannot run or on which its fp32 outputs are NaN, an unmeetable
budget, a missing extra) prints one line and exits with code 2. A converted model whose
outputs are NaN/inf where fp32's are finite prints the report and one line, exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampkit._internal.dtypes import DTYPES_BY_NAME, LOW_PRECISION, dtype_name
from ampkit._internal.files import write_file
from ampkit._internal.install import install_hint

from ._common import (
    UsageError,
    add_command,
    check_writable,
    float_between,
    positive_int,
    thread_count,
    write_output,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``convert`` sub-command to ``sub`` (an argparse sub-parsers object)."""

    p = add_command(sub, "convert", "convert a training checkpoint into a 16-bit inference model (and ONNX)", __doc__)
    p.add_argument("checkpoint", type=Path, help="checkpoint file (torch.save)")
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                   help="function returning the (untrained) nn.Module, e.g. mypkg.models:build "
                        "or path/to/file.py:build")
    p.add_argument("--calib", required=True, metavar="MODULE:FUNCTION|FILE.pt",
                   help="calibration batches: a function returning a list of batches, or a "
                        "torch.save'd tensor (split by --batch-size) or list of batches")
    p.add_argument("--batch-size", type=positive_int, default=64,
                   help="batch size when --calib is one tensor (default: 64)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default=None,
                   help="16-bit dtype of the weights (default: bf16 on CPU)")
    p.add_argument("--budget", type=float_between(0.0, float("inf")), default=None, metavar="REL_ERROR",
                   help="largest relative error of the outputs vs fp32 on the calib batches; "
                        "modules are kept in fp32 until it holds")
    p.add_argument("--min-agreement", type=float_between(0.0, 1.0), default=None, metavar="FRACTION",
                   help="smallest top-1 agreement with fp32 (e.g. 0.99); a budget like --budget")
    p.add_argument("--keep-fp32", default="", metavar="NAMES",
                   help="comma-separated module names/globs to keep in fp32")
    p.add_argument("--no-fold-bn", action="store_true", help="do not fold BatchNorm into conv/linear")
    p.add_argument("--onnx", type=Path, default=None, metavar="OUT.onnx",
                   help="write the converted model as ONNX and time it in onnxruntime")
    p.add_argument("--onnx-precision", choices=("auto", "compute", "storage"), default="auto",
                   help="16-bit ONNX ops (compute) or 16-bit weights with fp32 ops (storage); "
                        "auto: compute for fp16, storage for bf16 (default)")
    p.add_argument("--program", type=Path, default=None, metavar="OUT.pt2",
                   help="also save a torch.export program of the converted model")
    p.add_argument("--rounds", type=positive_int, default=15,
                   help="timing rounds, interleaved across the models (default: 15)")
    p.add_argument("--threads", type=thread_count, default=1, help="CPU threads, 1 to the CPU count (default: 1)")
    return p


# --- loading ---------------------------------------------------------------------------
def _load_callable(spec: str, what: str) -> Callable[..., Any]:
    if ":" not in spec:
        raise UsageError(f"{what} must look like module:function or file.py:function, got {spec!r}")
    target, _, attr = spec.rpartition(":")
    try:
        if target.endswith(".py") or os.sep in target:
            path = Path(target)
            if not path.is_file():
                raise UsageError(_not_a_file(path, what))
            spec_obj = importlib.util.spec_from_file_location(path.stem, path)
            if spec_obj is None or spec_obj.loader is None:
                raise UsageError(f"{what}: cannot import {target!r}")
            module = importlib.util.module_from_spec(spec_obj)
            spec_obj.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"{what}: cannot import {target!r} ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(f"{what}: {target!r} has no function {attr!r}")
    return fn


def _not_a_file(path: Path, what: str) -> str:
    """The one line for an input ``path`` that is no regular file: missing, a folder,
    or something else (a FIFO, a device)."""
    if path.is_dir():
        return f"{what}: {str(path)!r} is a folder, not a file; give the file's path"
    if path.exists():
        return f"{what}: {str(path)!r} is not a regular file (a FIFO or a device?); give a file's path"
    return f"{what}: no such file {str(path)!r}"


def _load_file(path: Path, what: str) -> Any:
    import torch

    if not path.is_file():
        raise UsageError(_not_a_file(path, what))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{what}: cannot load {str(path)!r} with torch.load(weights_only=True): {first}") from None


def _calib(args: argparse.Namespace) -> list[Any]:
    import torch

    spec = args.calib
    if ":" in spec and not Path(spec).is_file():
        try:
            batches = _load_callable(spec, "--calib")()
        except UsageError:
            raise
        except Exception as exc:
            raise UsageError(f"--calib: {spec} raised {type(exc).__name__}: {exc}") from None
    else:
        batches = _load_file(Path(spec), "--calib")
    if isinstance(batches, torch.Tensor):
        batches = list(batches.split(args.batch_size))
    try:
        batches = list(batches)
    except TypeError:
        raise UsageError(f"--calib: expected a tensor or a list of batches, got {type(batches).__name__}") from None
    if not batches:
        raise UsageError("--calib: no batches")
    return batches


def _model(args: argparse.Namespace) -> Any:
    from torch import nn

    factory = _load_callable(args.model, "--model")
    try:
        model = factory()
    except Exception as exc:
        raise UsageError(f"--model: {args.model} raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model: {args.model} returned {type(model).__name__}, not an nn.Module")
    return model


def _check_outputs(args: argparse.Namespace) -> None:
    """``--onnx`` and ``--program`` can be written, are not an input (the checkpoint,
    a ``--calib`` file) and not each other."""
    calib = Path(args.calib) if args.calib.endswith(".pt") else None
    inputs = [args.checkpoint, calib]
    check_writable(args.onnx, "the ONNX model", "--onnx", inputs)
    check_writable(args.program, "the program", "--program", [*inputs, args.onnx])


# --- the command -----------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """Run ``ampkit convert``; returns the exit code (raises UsageError for bad input)."""
    import torch

    _check_outputs(args)
    torch.set_num_threads(args.threads)
    if args.onnx is not None:
        missing = [m for m in ("onnx", "onnxruntime", "onnxscript") if importlib.util.find_spec(m) is None]
        if missing:
            raise UsageError(
                f"--onnx needs {', '.join(missing)}: {install_hint('deploy')}"
            )
    checkpoint = _load_file(args.checkpoint, "checkpoint")
    model = _model(args)
    batches = _calib(args)

    import ampkit as amp
    from ampkit.inference.conversion import (
        Budget,
        ConversionError,
        load_fp32_checkpoint,
        output_error,
        run_batch,
        weight_bytes,
    )
    from ampkit.tools.bench.inference import LatencyRow, interleaved_latency, render

    dtype = None if args.dtype is None else DTYPES_BY_NAME[args.dtype]  # argparse: bf16/fp16
    budget = None
    if args.budget is not None or args.min_agreement is not None:
        budget = Budget(max_rel_error=args.budget, min_top1_agreement=args.min_agreement)
    keep = [k.strip() for k in args.keep_fp32.split(",") if k.strip()]
    try:
        ref = load_fp32_checkpoint(_model(args), checkpoint).eval()
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            converted = amp.convert(
                model, checkpoint=checkpoint, dtype=dtype, keep_fp32=keep, calib=batches,
                budget=budget, fold_bn=not args.no_fold_bn,
            )
        for note in notes:  # one line each, not a warning's source excerpt
            print(f"note: {str(note.message).removeprefix('ampkit.convert: ')}", file=sys.stderr)
    except (ConversionError, RuntimeError) as exc:
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"ampkit convert: {line}") from None
    report = converted.ampkit_report
    print(report)
    if report.error is not None and report.error.nonfinite:
        print(f"ampkit convert: the converted model outputs {report.error.nonfinite} NaN/inf value(s) on the "
              "calibration batches where fp32's are finite; keep the overflowing module in fp32 "
              "(--keep-fp32) or give a budget (--budget, --min-agreement)", file=sys.stderr)
        return 1

    example = batches[0]
    with torch.inference_mode():
        reference = [run_batch(ref, b) for b in batches]
    batch_n = _batch_size(example)
    runners: dict[str, Callable[[], Any]] = {
        "fp32/PyTorch": lambda: run_batch(ref, example),
        "converted/PyTorch": lambda: run_batch(converted, example),
    }
    errors: dict[str, Any] = {"converted/PyTorch": report.error}
    sizes = {"fp32/PyTorch": weight_bytes(ref), "converted/PyTorch": report.weight_bytes}
    if args.program is not None:
        program = amp.export_program(converted, example)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's pt2 writer chatters about weight groups
            write_output(args.program, lambda path: _save_program(program, path), "the program", "--program")
        print(f"wrote {args.program} (torch.export program)")
    if args.onnx is not None:
        from ampkit.inference.export import onnx_output_error, onnx_session

        with tempfile.TemporaryDirectory() as tmp:
            try:
                fp32_onnx = amp.export_onnx(ref, example, Path(tmp) / "fp32.onnx", check=False)
                result = amp.export_onnx(
                    converted, example, args.onnx, precision=args.onnx_precision, threads=args.threads
                )
            except amp.AmpError as exc:
                print(f"ampkit convert: {str(exc).splitlines()[0]}", file=sys.stderr)
                return 1
            print(result)
            fp32_sess = onnx_session(fp32_onnx.path, args.threads)
            conv_sess = onnx_session(result.path, args.threads)
            from ampkit.inference.export import run_onnx

            runners["fp32/onnxruntime"] = lambda: run_onnx(fp32_sess, example)
            runners["converted/onnxruntime"] = lambda: run_onnx(conv_sess, example)
            errors["fp32/onnxruntime"] = onnx_output_error(fp32_sess, reference, batches)
            errors["converted/onnxruntime"] = onnx_output_error(conv_sess, reference, batches)
            sizes["fp32/onnxruntime"] = fp32_onnx.file_bytes
            sizes["converted/onnxruntime"] = result.file_bytes
            times = interleaved_latency(runners, rounds=args.rounds)
    else:
        times = interleaved_latency(runners, rounds=args.rounds)
    errors.setdefault("fp32/PyTorch", output_error(reference, reference))
    rows = []
    for key, ms in times.items():
        name, runtime = key.split("/")
        err = errors.get(key)
        rows.append(LatencyRow(
            model=name if name == "fp32" else _dtype(report.dtype),
            runtime=runtime, weight_bytes=sizes[key], ms=ms, batch=batch_n,
            rel_error=None if err is None else err.rel_error,
            top1=None if err is None else err.top1_agreement,
        ))
    render(rows, title=f"ampkit convert: {args.checkpoint} (batch {batch_n}, {args.threads} thread(s))")
    bad = [key for key, err in errors.items() if err is not None and err.nonfinite]
    if bad:
        print(f"ampkit convert: {', '.join(bad)} outputs NaN/inf on the calibration batches where the fp32 "
              "model's are finite", file=sys.stderr)
        return 1
    return 0


def _save_program(program: Any, path: Path) -> None:
    """``torch.export.save`` of ``program`` through ampkit's file writer (a temp file
    moved into place; a symlink, FIFO or device at ``path`` is refused)."""
    import torch

    write_file(path, lambda f: torch.export.save(program, f), "the program")


#: ``"torch.bfloat16"`` -> ``"bf16"``, ``"torch.float16"`` -> ``"fp16"``.
_LOW_NAMES = {str(d): dtype_name(d) for d in LOW_PRECISION}


def _dtype(dtype: Any) -> str:
    """``"bf16"``/``"fp16"`` for the 16-bit dtypes (or their ``str``), else ``str(dtype)``."""
    return _LOW_NAMES.get(str(dtype), str(dtype))


def _batch_size(batch: Any) -> int:
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    return 1
