"""Step time, peak memory and loss of ampkit's levels against torch's own mixed precision,
side by side in one process, on a GPT-2-small-class decoder and a channels_last conv net.

Arms on the decoder (12 blocks, d_model 768, 12 heads, vocabulary 32768, untied head:
135M parameters; sequence 1024; batch 16 on CUDA), each from the same initial weights
and data, one after another:

==================  ==========================================================================
``fp32``            plain fp32 (TF32 off, torch's default), AdamW(fused=True)
``autocast-fp16``   ``torch.autocast`` fp16 + ``torch.amp.GradScaler`` + AdamW(fused=True)
``autocast-bf16``   ``torch.autocast`` bf16 + AdamW(fused=True)
``ampkit-O1-fp16``  ``amp.initialize(..., "O1", dtype=fp16)`` (dynamic loss scale)
``ampkit-O1-bf16``  ``amp.initialize(..., "O1", dtype=bf16)``
``ampkit-O2``       ``amp.initialize(..., "O2")``: fp16 model, fp32 masters (CUDA's default)
``ampkit-O2K``      ``amp.initialize(..., "O2K")``: bf16 model, compensated updates
``pure-bf16``       ``model.to(bf16)`` + AdamW(fused=True): the memory floor, no masters
==================  ==========================================================================

The ampkit arms build a plain ``AdamW`` and let ampkit choose the kernel (fused on
CUDA). Per arm: the median step time over ``--steps`` timed steps after ``--warmup``
(CUDA events around each whole step: forward, backward, optimizer), the peak of
``torch.cuda.max_memory_allocated`` over the arm, the host-side time of a step (the
Python time from the step's start to the return of ``optimizer.step()``, with the GPU
queue drained before each step: what the step costs the CPU, or the GPU time where the
step waits for the GPU), and the mean loss of the last three steps, compared with fp32's.

The conv net (8 conv-BN-ReLU layers of 128-256 channels at 56x56, batch 128,
channels_last) runs ``fp32``, ``autocast-fp16`` and ``ampkit-O1-fp16``.

    PYTHONPATH=src python3 benchmarks/gpu_speed.py --json speed.json
    python benchmarks/gpu_speed.py --device cpu --tiny        # a CPU stand-in: tiny sizes

Checks written into the JSON (``checks``): every arm's loss within 1% of fp32's (pure
bf16 excepted: no fp32 masters); ampkit O1 fp16 within 3% of autocast fp16's step time;
O2 no slower than O1 (fp16) and lower in peak memory. A missed check is reported, not
raised: the exit code is 0 when every arm ran.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp

FP16, BF16 = torch.float16, torch.bfloat16
USED_TOKENS = 256
LR = 1e-3


@dataclass(frozen=True)
class Size:
    vocab: int
    d_model: int
    heads: int
    layers: int
    seq: int
    batch: int
    conv_batch: int
    conv_hw: int


CUDA_SIZE = Size(vocab=32768, d_model=768, heads=12, layers=12, seq=1024, batch=16, conv_batch=128, conv_hw=56)
TINY_SIZE = Size(vocab=512, d_model=64, heads=4, layers=2, seq=32, batch=2, conv_batch=2, conv_hw=8)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Decoder(nn.Module):
    """GPT-2-style decoder: learned positions, pre-norm blocks, untied head."""

    def __init__(self, s: Size) -> None:
        super().__init__()
        self.tok = nn.Embedding(s.vocab, s.d_model)
        self.pos = nn.Embedding(s.seq, s.d_model)
        self.blocks = nn.ModuleList(Block(s.d_model, s.heads) for _ in range(s.layers))
        self.ln = nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def conv_net() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU()]
    for c_in, c_out in [(128, 128), (128, 128), (128, 256), (256, 256), (256, 256), (256, 256), (256, 256)]:
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10)]
    return nn.Sequential(*layers)


def lm_batches(s: Size, n: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable stream: each sequence steps through the first ``USED_TOKENS`` tokens
    by its own stride (the loss falls within a few steps, so levels can be told apart)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        start = torch.randint(0, USED_TOKENS, (s.batch, 1), generator=g)
        stride = torch.randint(1, 8, (s.batch, 1), generator=g)
        seq = (start + stride * torch.arange(s.seq + 1)) % USED_TOKENS
        out.append((seq[:, :-1].to(device), seq[:, 1:].to(device)))
    return out


def conv_batches(s: Size, n: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(s.conv_batch, 3, s.conv_hw, s.conv_hw, generator=g)
        y = (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0].mean(dim=(1, 2)) > 0).long()
        out.append((x.to(device).contiguous(memory_format=torch.channels_last), y.to(device)))
    return out


class Timer:
    """Wall time of one step: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    @contextlib.contextmanager
    def step(self, out: list[float], host: list[float]) -> Iterator[Callable[[], None]]:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        host_end: list[float] = []
        yield lambda: host_end.append(time.perf_counter())
        if self.cuda:
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end))
        else:
            out.append((time.perf_counter() - t0) * 1e3)
        host.append(((host_end[0] if host_end else time.perf_counter()) - t0) * 1e3)


def make_arm(name: str, model: nn.Module, device: str) -> tuple[nn.Module, torch.optim.Optimizer, Callable[..., Any]]:
    """The model, optimizer and ``train_step(x, y, loss_fn, mark_host)`` of one arm."""
    fused = device == "cuda"
    if name == "pure-bf16":
        model = model.to(BF16)
    if name.startswith("ampkit-"):
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        level = name.split("-")[1]
        kw: dict[str, Any] = {}
        if level == "O1":
            kw["dtype"] = FP16 if name.endswith("fp16") else BF16
        model, opt = amp.initialize(model, opt, opt_level=level, **kw)

        def step(x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor], mark: Callable[[], None]) -> torch.Tensor:
            loss = loss_fn(model(x), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            mark()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return model, opt, step
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused)
    dtype = {"autocast-fp16": FP16, "autocast-bf16": BF16}.get(name)
    scaler = torch.amp.GradScaler(device) if dtype is FP16 else None

    def plain_step(x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor], mark: Callable[[], None]) -> torch.Tensor:
        with torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = loss_fn(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        mark()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return model, opt, plain_step


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def conv_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), y)


def run_arm(name: str, build: Callable[[], nn.Module], data: list[tuple[torch.Tensor, torch.Tensor]],
            loss_fn: Callable[..., torch.Tensor], device: str, warmup: int, profile: bool = False) -> dict[str, Any]:  # fmt: skip
    amp.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, opt, step = make_arm(name, build(), device)
    timer = Timer(device)
    times: list[float] = []
    host: list[float] = []
    losses: list[float] = []
    first_s = None
    for i, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        with timer.step(times, host) as mark:
            loss = step(x, y, loss_fn, mark)
        losses.append(float(loss))
        if i == 0:
            first_s = time.perf_counter() - t0
    if profile:
        result_profile = profile_steps(step, data[:2], loss_fn, device)
    timed, timed_host = times[warmup:], host[warmup:]
    skipped = amp.stats(opt).skipped if name.startswith("ampkit-") else None
    result = {
        "arm": name,
        "step_ms": statistics.median(timed),
        "step_ms_min": min(timed),
        "host_ms": statistics.median(timed_host),
        "first_step_s": round(first_s or 0.0, 2),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
        "losses": losses,
        "tail_loss": sum(losses[-3:]) / len(losses[-3:]),
        "skipped_steps": skipped,
    }
    if profile:
        result["profile"] = result_profile
    del model, opt, step
    amp.reset()
    return result


SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "cudaMemcpyAsync", "cudaEventSynchronize")


def profile_steps(step: Callable[..., Any], data: list[tuple[torch.Tensor, torch.Tensor]],
                  loss_fn: Callable[..., torch.Tensor], device: str) -> dict[str, Any]:  # fmt: skip
    """torch.profiler over ``len(data)`` further steps: the 25 ops with the most CPU time
    of their own, and how often each host-synchronizing call ran (per step)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for x, y in data:
            step(x, y, loss_fn, lambda: None)
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    n = len(data)
    return {
        "top_self_cpu": [{"op": e.key, "calls_per_step": e.count / n, "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / n}
                         for e in top],  # fmt: skip
        "sync_calls_per_step": {e.key: e.count / n for e in events if e.key in SYNC_OPS},
        "kernel_launches_per_step": sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                            "cudaLaunchKernelExC")) / n,  # fmt: skip
    }


LM_ARMS = ("fp32", "autocast-fp16", "autocast-bf16", "ampkit-O1-fp16", "ampkit-O1-bf16", "ampkit-O2", "ampkit-O2K",
           "pure-bf16")  # fmt: skip
CONV_ARMS = ("fp32", "autocast-fp16", "ampkit-O1-fp16")


def checks(lm: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    ref = lm.get("fp32", {}).get("tail_loss")
    for name, r in lm.items():
        if name in ("fp32", "pure-bf16") or ref is None:
            continue
        rel = abs(r["tail_loss"] - ref) / abs(ref)
        out.append({"name": f"{name} loss within 1% of fp32", "ok": rel <= 0.01, "value": round(rel, 5)})
    if "ampkit-O1-fp16" in lm and "autocast-fp16" in lm:
        ratio = lm["ampkit-O1-fp16"]["step_ms"] / lm["autocast-fp16"]["step_ms"]
        out.append({"name": "ampkit O1 fp16 step time within 3% of autocast+GradScaler+fused AdamW",
                    "ok": ratio <= 1.03, "value": round(ratio, 4)})  # fmt: skip
    if "ampkit-O2" in lm and "ampkit-O1-fp16" in lm:
        o2, o1 = lm["ampkit-O2"], lm["ampkit-O1-fp16"]
        out.append({"name": "O2 no slower than O1 (fp16)", "ok": o2["step_ms"] <= o1["step_ms"] * 1.01,
                    "value": round(o2["step_ms"] / o1["step_ms"], 4)})  # fmt: skip
        if o2["peak_mib"] is not None:
            out.append({"name": "O2 lower peak memory than O1 (fp16)", "ok": o2["peak_mib"] < o1["peak_mib"],
                        "value": round(o2["peak_mib"] / o1["peak_mib"], 4)})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU stand-in; default on CPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps per arm (default 3)")
    parser.add_argument("--arms", default=",".join(LM_ARMS), help="decoder arms, comma-separated")
    parser.add_argument("--conv-arms", default=",".join(CONV_ARMS), help="conv net arms ('' for none)")
    parser.add_argument("--profile", default="", help="decoder arms to profile over 2 extra steps, comma-separated")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{parser.prog}: --device cuda needs a CUDA GPU, and torch sees none here", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    size = TINY_SIZE if args.tiny or args.device != "cuda" else CUDA_SIZE
    device = args.device
    n = args.warmup + args.steps
    torch.manual_seed(0)
    init_lm = Decoder(size).state_dict()
    torch.manual_seed(0)
    init_conv = conv_net().state_dict()

    def build_lm() -> nn.Module:
        m = Decoder(size)
        m.load_state_dict(init_lm)
        return m.to(device)

    def build_conv() -> nn.Module:
        m = conv_net()
        m.load_state_dict(init_conv)
        return m.to(device).to(memory_format=torch.channels_last)

    lm_data, conv_data = lm_batches(size, n, device), conv_batches(size, n, device)
    record: dict[str, Any] = {"device": device, "torch": torch.__version__, "size": size.__dict__,
                              "params": sum(p.numel() for p in build_lm().parameters()),
                              "steps": args.steps, "warmup": args.warmup, "lm": {}, "conv": {}, "errors": {}}  # fmt: skip
    if device == "cuda":
        record["device_name"] = torch.cuda.get_device_name()
    for section, arms, build, data, loss_fn in (("lm", args.arms, build_lm, lm_data, lm_loss),
                                                ("conv", args.conv_arms, build_conv, conv_data, conv_loss)):  # fmt: skip
        for name in [a for a in arms.split(",") if a]:
            try:
                r = run_arm(name, build, data, loss_fn, device, args.warmup,
                            profile=section == "lm" and name in args.profile.split(","))  # fmt: skip
            except Exception as e:  # noqa: BLE001 (every arm runs; the error is recorded)
                record["errors"][f"{section}/{name}"] = f"{type(e).__name__}: {str(e)[:1000]}"
                print(f"{section:>4} {name:<16} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
                amp.reset()
                continue
            record[section][name] = r
            peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f} MiB"
            print(f"{section:>4} {name:<16} {r['step_ms']:9.2f} ms/step  host {r['host_ms']:8.2f} ms  peak {peak:>10}  "
                  f"first {r['first_step_s']:6.2f} s  loss {r['tail_loss']:.5f}", flush=True)  # fmt: skip
    for section in ("lm", "conv"):
        base = record[section].get("fp32")
        for r in record[section].values():
            if base is not None:
                r["speedup_vs_fp32"] = round(base["step_ms"] / r["step_ms"], 3)
                if r["peak_mib"] is not None and base["peak_mib"]:
                    r["memory_vs_fp32"] = round(r["peak_mib"] / base["peak_mib"], 3)
    record["checks"] = checks(record["lm"])
    for c in record["checks"]:
        print(f"{'ok  ' if c['ok'] else 'MISS'} {c['name']}: {c['value']}", flush=True)
    if not all(math.isfinite(r["tail_loss"]) for s in ("lm", "conv") for r in record[s].values()):
        print("a non-finite loss", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
