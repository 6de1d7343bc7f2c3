"""Step time and memory of bf16 against fp8 training on ``ampkit bench``'s char
transformer (the ``lm`` workload's model) made wide enough for fp8, on random tokens:
on CUDA ``d_model`` 4096 (qkv 4096x12288, proj 4096x4096, MLP 4096x16384); on CPU
``d_model`` 1024, whose MLP matmuls are 1024x4096 and 4096x1024.

Modes, each on a fresh copy of the same model and data, one after another in this
process:

- ``bf16``: ``amp.initialize(model, opt, opt_level=LEVEL)``;
- ``fp8-current``: the same plus ``fp8=Fp8Recipe()`` (e4m3/e5m2, current tensorwise scales);
- ``fp8-delayed``: ``fp8=Fp8Recipe(scaling="delayed")`` (amax history of 16).

The blocks' linears are converted (``skip_first_last=False``; the vocabulary head is
below ``min_features``); embeddings, attention's two batched matmuls, norms and the head
run as the level says (bf16). Reported per mode: the median step time, tokens/s, the
ratio to bf16; memory: on CUDA the allocator's peak during a step over what was
allocated before it; on CPU (no allocator statistics) the exact bytes autograd saves
for backward in one step (``saved``; fp8 layers save 1-byte operands) and the tensors
alive at the step (parameters, grads, optimizer state, masters; ``state``). The last
loss is printed as a sanity check (same data in every mode).

    python benchmarks/fp8.py                  # CUDA if present, else a short CPU run
    python benchmarks/fp8.py --device cuda --layers 4 --batch 8 --seq 1024 --steps 20

The default CPU run is short (d_model 1024, 1 block, 16 tokens, 2 timed steps; at
d_model 4096 a bf16 step takes minutes on a CPU without native bf16): a CPU without native
bf16 computes the bf16 baseline's matmuls in emulation, so the CPU ratio says nothing
about a GPU; torch._scaled_mm on CPU dequantizes to fp32 and multiplies in fp32.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp
from ampkit.tools.bench.machine import device_name
from ampkit.tools.bench.memory import MIB, SavedActivations, live_tensor_bytes, storage_ptrs
from ampkit.tools.bench.workloads import CharTransformer

VOCAB = 256


def run_mode(mode: str, base: nn.Module, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model = copy.deepcopy(base).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    recipe = None
    if mode != "bf16":
        recipe = amp.Fp8Recipe(scaling=mode.split("-")[1], skip_first_last=False)
    model, opt = amp.initialize(model, opt, opt_level=args.level, dtype=torch.bfloat16, fp8=recipe)
    converted = len(amp.fp8.layers())
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g).to(device) for _ in range(4)]
    cuda = device.type == "cuda"

    def step(i: int) -> float:
        ids = batches[i % len(batches)]
        loss = F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for i in range(args.warmup):
        step(i)
    times, loss = [], float("nan")
    peak = saved = state = 0.0
    for i in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        if not cuda and i == 0:
            exclude = storage_ptrs(batches) | storage_ptrs(base.parameters())  # the template stays alive
            state = live_tensor_bytes(device, exclude) / MIB
            with SavedActivations(exclude | storage_ptrs(model.parameters())) as sv:
                loss = step(args.warmup + i)
            saved = sv.nbytes / MIB
        else:
            loss = step(args.warmup + i)
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak, (torch.cuda.max_memory_allocated() - before) / MIB)
        times.append(time.perf_counter() - t0)
    profile = _profile(step, args.warmup + args.steps, cuda) if args.profile else None
    amp.reset()
    gc.collect()
    row = {"mode": mode, "layers": converted, "step_s": statistics.median(times), "loss": loss,
           "peak_mib": peak, "saved_mib": saved, "state_mib": state}  # fmt: skip
    if profile is not None:
        row["profile"] = profile
    return row


def _profile(step: Any, first: int, cuda: bool) -> list[dict[str, Any]]:
    """The 15 ops with the most device time of their own (CPU time without a GPU) over 2
    more steps, per step: where an fp8 step spends its time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(2):
            step(first + i)
    def own(e: Any) -> float:
        if not cuda:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    events = sorted(prof.key_averages(), key=own, reverse=True)[:15]
    return [{"op": e.key, "calls_per_step": e.count / 2, "self_ms_per_step": own(e) / 1e3 / 2} for e in events]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--d-model", type=int, default=None, help="default: 4096 on CUDA, 1024 on CPU")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: 4 on CUDA, 1 on CPU)")
    parser.add_argument("--batch", type=int, default=None, help="default: 8 on CUDA, 1 on CPU")
    parser.add_argument("--seq", type=int, default=None, help="default: 1024 on CUDA, 16 on CPU")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 20 on CUDA, 2 on CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="default: 5 on CUDA, 1 on CPU")
    parser.add_argument("--level", default="O1", choices=["O1", "O2"])
    parser.add_argument("--modes", default="bf16,fp8-current,fp8-delayed")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: shared machines)")
    parser.add_argument("--profile", action="store_true", help="profile 2 more steps per mode (top 15 ops, into --json)")
    parser.add_argument("--json", help="also write the machine, the settings and the rows to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA GPU here (torch.cuda.is_available() is False)")
    for name, gpu, cpu in (("d_model", 4096, 1024), ("layers", 4, 1), ("batch", 8, 1), ("seq", 1024, 16), ("steps", 20, 2), ("warmup", 5, 1)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    heads = max(1, args.d_model // 128)
    base = CharTransformer(VOCAB, args.d_model, args.layers, heads, args.seq)  # the lm workload's model, wider
    where = torch.cuda.get_device_name(device) if cuda else f"{device_name('cpu')}, {args.threads} thread(s)"
    params = sum(p.numel() for p in base.parameters())
    print(f"fp8 benchmark on {where}; torch {torch.__version__}")
    print(f"model: d_model {args.d_model}, {args.layers} block(s), {params / 1e6:.0f}M params; batch {args.batch} x "
          f"seq {args.seq}; level {args.level}; {args.warmup} warm-up + {args.steps} timed steps per mode")
    rows = [run_mode(mode, base, args, device) for mode in args.modes.split(",")]
    ref = rows[0]["step_s"]
    tokens = args.batch * args.seq
    mem = "peak MiB" if cuda else "saved MiB  state MiB"
    print(f"{'mode':<12} {'fp8 layers':>10} {'step s':>9} {'tokens/s':>10} {'vs ' + rows[0]['mode']:>8}  {mem}  last loss")
    for r in rows:
        m = f"{r['peak_mib']:8.0f}" if cuda else f"{r['saved_mib']:9.1f}  {r['state_mib']:9.0f}"
        print(f"{r['mode']:<12} {r['layers']:>10} {r['step_s']:>9.3f} {tokens / r['step_s']:>10.0f} "
              f"{ref / r['step_s']:>7.2f}x  {m}  {r['loss']:.4f}")
    if args.json:
        import json

        from ampkit.tools.bench.machine import machine_info

        settings = {k: getattr(args, k) for k in ("d_model", "layers", "batch", "seq", "steps", "warmup", "level")}
        for r in rows:
            r["tokens_per_s"], r["vs_first"] = tokens / r["step_s"], ref / r["step_s"]
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(device.type, args.threads), "settings": settings, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
