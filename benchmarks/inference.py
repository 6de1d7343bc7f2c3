"""Inference latency and accuracy, fp32 vs ampkit.convert, in PyTorch and onnxruntime.

Trains the bench CNN (digits) and character LM briefly under an opt level (default
O2), converts the checkpoint with ``ampkit.convert`` (bf16 for PyTorch, and fp16 for an
fp16-compute ONNX graph), exports ONNX files, and prints per workload: size, median
latency per batch (interleaved rounds, one thread), throughput, speedup vs fp32 of the
same runtime, error vs fp32 on held-out data, and the task metric.

    python benchmarks/inference.py                   # ~5 min on 2 CPU cores
    python benchmarks/inference.py --workload cnn --steps 20 --rounds 5 --markdown

Rows: ``fp32`` (the checkpoint's fp32 weights: O2 masters), ``bf16``/``fp16`` (the
converted model), runtime PyTorch or onnxruntime (``storage``: bf16 weights in the file,
fp32 compute; ``compute``: fp16 ops).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import ampkit as amp
from ampkit.inference.conversion import load_fp32_checkpoint, output_error, weight_bytes
from ampkit.inference.export import onnx_session, run_onnx
from ampkit.tools.bench.inference import (
    LatencyRow,
    interleaved_latency,
    markdown,
    render,
    train_checkpoint,
)


def _logits_in_chunks(fn, x, chunk):
    with torch.inference_mode():
        return torch.cat([fn(x[i : i + chunk]).float() for i in range(0, x.shape[0], chunk)])


def _metric(name, logits, target):
    if name == "cnn":
        return f"acc {(logits.argmax(-1) == target).float().mean().item():.2%}"
    bpc = F.cross_entropy(logits.flatten(0, -2), target.flatten()).item() / math.log(2)
    return f"{bpc:.4f} bits/char"


def bench_workload(name, args, tmp):
    t0 = time.time()
    _, ckpt, wl = train_checkpoint(name, args.amp, steps=args.steps or (40 if name == "cnn" else 60))
    train_s = time.time() - t0
    fp32 = load_fp32_checkpoint(wl.build_model(), ckpt).eval()
    if name == "cnn":
        x_all, target = wl.data.test_x, wl.data.test_y
        batch = x_all[: args.batch]
        calib = [wl.data.train_x[:64]]
    else:
        windows = wl.eval_windows()
        x_all, target = windows[:, :-1], windows[:, 1:]
        batch = x_all[: args.batch // 8 or 1]
        calib = [next(wl.batches(torch.Generator().manual_seed(7)))[0][:8]]

    models = {
        "bf16": amp.convert(wl.build_model(), checkpoint=ckpt, calib=calib),
        "fp16": amp.convert(wl.build_model(), checkpoint=ckpt, dtype=torch.float16),
    }
    sessions = {}
    sizes = {("fp32", "PyTorch"): weight_bytes(fp32), ("bf16", "PyTorch"): models["bf16"].ampkit_report.weight_bytes}
    for key, model, precision in (("fp32", fp32, "compute"), ("bf16", models["bf16"], "storage"), ("fp16", models["fp16"], "compute")):
        result = amp.export_onnx(model, batch, Path(tmp) / f"{name}-{key}.onnx", precision=precision, check=False)
        sessions[key] = onnx_session(result.path, threads=args.threads)
        sizes[(key, f"onnxruntime {precision}" if key != "fp32" else "onnxruntime")] = result.file_bytes

    runners = {
        ("fp32", "PyTorch"): lambda: fp32(batch),
        ("bf16", "PyTorch"): lambda: models["bf16"](batch),
        ("fp32", "onnxruntime"): lambda: run_onnx(sessions["fp32"], batch),
        ("bf16", "onnxruntime storage"): lambda: run_onnx(sessions["bf16"], batch),
        ("fp16", "onnxruntime compute"): lambda: run_onnx(sessions["fp16"], batch),
    }
    times = interleaved_latency(runners, rounds=args.rounds, warmup=2)

    chunk = 128 if name == "cnn" else 16
    ref = _logits_in_chunks(fp32, x_all, chunk)
    outputs = {
        ("fp32", "PyTorch"): ref,
        ("bf16", "PyTorch"): _logits_in_chunks(models["bf16"], x_all, chunk),
        ("fp32", "onnxruntime"): _logits_in_chunks(lambda b: run_onnx(sessions["fp32"], b)[0], x_all, chunk),
        ("bf16", "onnxruntime storage"): _logits_in_chunks(lambda b: run_onnx(sessions["bf16"], b)[0], x_all, chunk),
        ("fp16", "onnxruntime compute"): _logits_in_chunks(lambda b: run_onnx(sessions["fp16"], b)[0], x_all, chunk),
    }
    rows = []
    for key, ms in times.items():
        model, runtime = key
        err = output_error([ref], [outputs[key]])
        rows.append(LatencyRow(
            model=model, runtime=runtime, weight_bytes=sizes[key], ms=ms, batch=int(batch.shape[0]),
            rel_error=err.rel_error, top1=err.top1_agreement, metric=_metric(name, outputs[key], target),
        ))
    title = f"{name}: {wl.description}; trained {train_s:.0f} s at {args.amp}; batch {batch.shape[0]}"
    return title, rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("cnn", "lm", "all"), default="all")
    p.add_argument("--amp", default="O2", help="opt level of the training run (default O2)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: cnn 40, lm 60)")
    p.add_argument("--batch", type=int, default=64, help="images per batch (LM: batch/8 sequences)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="ampkit.convert: this CPU has no")
    names = ("cnn", "lm") if args.workload == "all" else (args.workload,)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"bf16 instructions: {torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()}, "
          f"{args.threads} thread(s)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            title, rows = bench_workload(name, args, tmp)
            render(rows, title=title)
            if args.markdown:
                print(title)
                print(markdown(rows))


if __name__ == "__main__":
    main()
