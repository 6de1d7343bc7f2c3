"""DDP step time with 1 vs N processes per opt level, and the collectives ampkit adds.

Each opt level trains one of ``ampkit bench``'s workloads (``wide`` at size ``tiny`` by
default: the parameter-heavy MLP, small enough for emulated bf16) under
DistributedDataParallel with the workload's per-process batch (each rank its own: weak
scaling, N processes see N times the samples per step). The DDP model is passed to
``register_ddp``. Per level and process count the table gives the median step time and
samples/s with the default ``set_sync(opt, "auto")``, which agrees on the skip decision
with one all-reduce per step (a rank's grads can change after DDP's all-reduce, also
through ``.data``, which only the values show); for N processes also the step time with
``set_sync(opt, "never")`` (each rank decides alone: what the agreement costs), and how
many all-reduces ampkit itself added per step: "auto" -> target 1, "never" -> target 0.

Configurations run interleaved in blocks inside the same processes, so machine noise
hits them alike. On a machine with GPUs each process takes one GPU and NCCL; on CPU,
gloo with one thread per process (two processes need two free cores).

``--json FILE`` also writes the machine (CPU or GPU, the CPU's 16-bit flags, torch,
date, command), the settings and per level ``one_proc_ms``, ``n_procs_ms``,
``n_over_one``, ``samples_per_s_one_proc``, ``samples_per_s_n_procs``,
``n_procs_never_ms`` and the all-reduces ampkit added per step (``collectives_auto``,
``collectives_never``) with their ``targets``.

    python benchmarks/ddp.py [--nproc 2] [--steps 40] [--levels O0,O1,O2,O3,O2K] [--workload wide --size tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ampkit.tools.bench.machine import write_record
from ampkit.tools.bench.workloads import SIZES, WORKLOADS, make_workload

LEVELS = ("off", "O0", "O1", "O2", "O3", "O2K")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--nproc", type=int, default=2, help="processes of the multi-process run")
    p.add_argument("--steps", type=int, default=40, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per block")
    p.add_argument("--blocks", type=int, default=4, help="interleaved blocks the steps are split in")
    p.add_argument("--levels", default=",".join(LEVELS), help="comma-separated; 'off' is fp32 without ampkit")
    p.add_argument("--workload", default="wide", choices=sorted(WORKLOADS), help="the ampkit bench workload")
    p.add_argument("--size", default="tiny", choices=SIZES, help="its size (batch per process included)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default=None, help="default: bf16 on CPU, fp16 on CUDA")
    p.add_argument("--json", metavar="FILE", help="also write the machine, the settings and the table's rows to FILE")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- worker ------------------------------------------------------------------------------


class CountAllReduce:
    """Counts torch.distributed.all_reduce calls inside the block: ampkit's agreement goes
    through it; DDP's gradient buckets (C++ reducer) do not."""

    def __init__(self) -> None:
        self.calls = 0

    def __enter__(self) -> CountAllReduce:
        self._orig = dist.all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._orig


def worker(args: argparse.Namespace, out: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampkit as amp

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype or "", None)
    dtype = dtype or (torch.float16 if cuda else torch.bfloat16)
    workload = make_workload(args.workload, args.size, device=device)
    x, y = (t.to(device) for t in workload.example_batch(seed=rank))  # each rank its own batch

    def setup(level: str, sync: str = "auto"):
        amp.reset()
        torch.manual_seed(0)
        model = workload.build_model().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if level != "off":
            model, opt = amp.initialize(model, opt, opt_level=level, dtype=dtype)
        net = DDP(model, device_ids=[device.index] if cuda else None)
        if level != "off":
            amp.distributed.register_ddp(net)
            amp.distributed.set_sync(opt, sync)
        return net, opt

    def step(net, opt, level: str, counter: CountAllReduce) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = workload.loss(net(x), y)
        if level == "off":
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        with counter:
            opt.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    # initialize() starts a new AMP session, so configurations cannot coexist: each block
    # sets one up afresh; blocks of every level and configuration alternate.
    names = ["auto"] + (["never"] if world > 1 else [])
    levels = args.levels.split(",")
    times: dict[tuple[str, str], list[float]] = {}
    counts: dict[tuple[str, str], list[int]] = {}
    per_block = max(1, args.steps // args.blocks)
    for _ in range(args.blocks):
        for level in levels:
            for name in names if level != "off" else ["auto"]:
                net, opt = setup(level, sync=name)
                for _ in range(args.warmup):
                    step(net, opt, level, CountAllReduce())
                for _ in range(per_block):
                    counter = CountAllReduce()
                    times.setdefault((level, name), []).append(step(net, opt, level, counter))
                    counts.setdefault((level, name), []).append(counter.calls)
    results: dict[str, dict] = {}
    for (level, name), ts in times.items():
        results.setdefault(level, {})[name] = {
            "ms": 1000 * statistics.median(ts),
            "collectives": max(counts[(level, name)]),
        }
    amp.reset()
    if rank == 0:
        out.write_text(
            json.dumps(
                {"world": world, "device": device.type, "dtype": str(dtype), "batch": int(x.shape[0]), "results": results}
            )
        )
    dist.destroy_process_group()


# --- driver ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(nproc: int, argv: list[str], tmp: Path) -> dict:
    out = tmp / f"world{nproc}.json"
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                   WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(out)], env=env))
    if any(p.wait() for p in procs):
        raise SystemExit(f"a worker of the {nproc}-process run failed")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(args, Path(args.worker))
        # gloo in torch 2.13 sometimes aborts during interpreter teardown after all
        # work is done; skip the teardown so the driver sees the real exit status
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        one = run(1, argv, Path(tmp))
        many = run(args.nproc, argv, Path(tmp))
        wall = time.perf_counter() - t0
    n, batch = args.nproc, many["batch"]
    print(
        f"DDP, {many['device']}, {many['dtype'].removeprefix('torch.')}, {args.workload} ({args.size}), "
        f"batch {batch} per process, median of {args.steps} steps ({wall:.0f} s in all)"
    )
    head = (
        f"{'level':6} {'1 proc ms':>10} {f'{n} procs ms':>11} {f'{n}p/1p':>7} {'samples/s 1p':>13} "
        f"{f'samples/s {n}p':>13} {f'{n}p never ms':>13} {'collectives/step':>17}"
    )
    print(head)
    print("-" * len(head))
    rows = []
    for level, r1 in one["results"].items():
        rn = many["results"][level]
        t1, tn = r1["auto"]["ms"], rn["auto"]["ms"]
        off = level == "off"
        row = {"level": level, "one_proc_ms": t1, "n_procs_ms": tn, "n_over_one": tn / t1,
               "samples_per_s_one_proc": 1000 * batch / t1, "samples_per_s_n_procs": 1000 * n * batch / tn,
               "n_procs_never_ms": rn.get("never", {}).get("ms"),
               "collectives_auto": None if off else rn["auto"]["collectives"],
               "collectives_never": None if off else rn["never"]["collectives"]}  # fmt: skip
        rows.append(row)
        never_ms = "-" if row["n_procs_never_ms"] is None else f"{row['n_procs_never_ms']:.2f}"
        coll = "-" if off else f"{row['collectives_auto']} auto / {row['collectives_never']} never"
        print(
            f"{level:6} {t1:10.2f} {tn:11.2f} {row['n_over_one']:7.2f} {row['samples_per_s_one_proc']:13.0f} "
            f"{row['samples_per_s_n_procs']:13.0f} {never_ms:>13} {coll:>17}"
        )
    print(
        "collectives/step: all-reduces ampkit adds to a step with set_sync 'auto' (the default; "
        "target 1: the skip decision agreed) and 'never' (target 0). "
        f"'{n}p never ms': the {n}-process step with set_sync(opt, 'never'), each rank deciding alone."
    )
    if args.json:
        settings = {"nproc": n, "workload": args.workload, "size": args.size, "device": many["device"],
                    "dtype": many["dtype"].removeprefix("torch."), "batch_per_process": batch, "steps": args.steps,
                    "warmup": args.warmup, "blocks": args.blocks, "levels": args.levels.split(","),
                    "threads_per_process": 1, "wall_s": wall}  # fmt: skip
        targets = {"collectives_auto": 1, "collectives_never": 0}
        write_record(args.json, {"settings": settings, "rows": rows, "targets": targets},
                     device=many["device"], threads=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
