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

``--json FILE`` also writes the machine (CPU, its 16-bit flags, torch, date, command),
the settings and per workload its training run and rows: ``size_mib``,
``ms_per_batch``, ``items_per_s``, ``speedup_vs_fp32``, ``rel_error``,
``top1_agreement`` and the task metric (``accuracy`` for the CNN, ``bits_per_char``
for the LM).
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
    speedups,
    train_checkpoint,
)
from ampkit.tools.bench.machine import write_record


def _logits_in_chunks(fn, x, chunk):
    with torch.inference_mode():
        return torch.cat([fn(x[i : i + chunk]).float() for i in range(0, x.shape[0], chunk)])


def _metric(name, logits, target):
    """The task metric as the table prints it, and as a named figure for the JSON."""
    if name == "cnn":
        acc = (logits.argmax(-1) == target).float().mean().item()
        return f"acc {acc:.2%}", {"accuracy": acc}
    bpc = F.cross_entropy(logits.flatten(0, -2), target.flatten()).item() / math.log(2)
    return f"{bpc:.4f} bits/char", {"bits_per_char": bpc}


def bench_workload(name, args, tmp):
    t0 = time.time()
    steps = args.steps or (40 if name == "cnn" else 60)
    _, ckpt, wl = train_checkpoint(name, args.amp, steps=steps)
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
    rows, metrics = [], []
    for key, ms in times.items():
        model, runtime = key
        err = output_error([ref], [outputs[key]])
        text, figure = _metric(name, outputs[key], target)
        rows.append(LatencyRow(
            model=model, runtime=runtime, weight_bytes=sizes[key], ms=ms, batch=int(batch.shape[0]),
            rel_error=err.rel_error, top1=err.top1_agreement, metric=text,
        ))
        metrics.append(figure)
    title = f"{name}: {wl.description}; trained {train_s:.0f} s at {args.amp}; batch {batch.shape[0]}"
    result = {"workload": name, "description": wl.description, "opt_level": args.amp, "train_steps": steps,
              "train_s": train_s, "batch": int(batch.shape[0]), "title": title,
              "rows": [_row_record(r, speed, figure) for r, speed, figure in zip(rows, speedups(rows), metrics)]}  # fmt: skip
    return title, rows, result


def _row_record(row: LatencyRow, speedup: float | None, metric: dict[str, float]) -> dict:
    """One table row as named figures (units in the names)."""
    return {"model": row.model, "runtime": row.runtime, "weight_bytes": row.weight_bytes,
            "size_mib": row.weight_bytes / 2**20, "ms_per_batch": row.ms, "batch": row.batch,
            "items_per_s": row.per_second, "speedup_vs_fp32": speedup, "rel_error": row.rel_error,
            "top1_agreement": row.top1, **metric, "metric": row.metric}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("cnn", "lm", "all"), default="all")
    p.add_argument("--amp", default="O2", help="opt level of the training run (default O2)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: cnn 40, lm 60)")
    p.add_argument("--batch", type=int, default=64, help="images per batch (LM: batch/8 sequences)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    p.add_argument("--json", metavar="FILE", help="also write the machine, the settings and every table's rows to FILE")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="ampkit.convert: this CPU has no")
    names = ("cnn", "lm") if args.workload == "all" else (args.workload,)
    bf16_instructions = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"bf16 instructions: {bf16_instructions}, {args.threads} thread(s)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            title, rows, result = bench_workload(name, args, tmp)
            results.append(result)
            render(rows, title=title)
            if args.markdown:
                print(title)
                print(markdown(rows))
    if args.json:
        settings = {"opt_level": args.amp, "batch": args.batch, "rounds": args.rounds, "threads": args.threads,
                    "bf16_instructions": bf16_instructions}  # fmt: skip
        write_record(args.json, {"settings": settings, "workloads": results}, threads=args.threads)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
