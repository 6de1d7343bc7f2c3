"""Data-parallel training with DistributedDataParallel and ampkit, on scikit-learn's digits.

    torchrun --nproc_per_node 2 examples/train_ddp.py                 # --amp O2, 2 processes
    torchrun --nproc_per_node 2 examples/train_ddp.py --amp O1 --dtype fp16
    torchrun --nproc_per_node 2 examples/train_ddp.py --accum 4       # no_sync accumulation
    torchrun --nproc_per_node 2 examples/train_ddp.py --inject-inf 50 # rank 1 overflows once
    python examples/train_ddp.py                                      # one process, same code

CPU processes talk over gloo; with GPUs, each process takes GPU ``LOCAL_RANK`` and NCCL
(picked automatically; ``--backend`` overrides). Rank 0 logs the loss, the loss scale and
the skipped steps; every rank skips the same steps (a step skipped on one rank only would
split the replicas), and the script checks at the end that the replicas are identical.

What ampkit adds to an ordinary DDP loop (lines marked ``# ampkit``)::

    model, opt = amp.initialize(model, opt, opt_level="O2")   # before wrapping
    model = amp.distributed.register_ddp(DDP(model))           # no extra collective per step
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()                                                 # skips on every rank together

Needs scikit-learn for the data (pip install scikit-learn, or ampkit's cli extra:
pip install -e '.[cli]' in ampkit's clone).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ampkit as amp

AMP_CHOICES = ("off", "O0", "O1", "O2", "O3", "O2K")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--amp", choices=AMP_CHOICES, default="O2", help="off: fp32 without ampkit")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="16-bit dtype (default: bf16 on CPU, fp16 on CUDA)")
    p.add_argument("--loss-scale", default=None,
                   help="'dynamic' or a number (default: the level's: dynamic for fp16 O1/O2, else 1)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64, help="per process and micro-batch")
    p.add_argument("--accum", type=int, default=1,
                   help="micro-batches per step; all but the last run under DDP's no_sync")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--sync-bn", action="store_true",
                   help="convert BatchNorm to SyncBatchNorm (GPU only, as in torch)")
    p.add_argument("--no-register", action="store_true",
                   help="do not register the DDP model with ampkit: the skip decision is then "
                        "all-reduced every step (one extra tiny collective)")
    p.add_argument("--inject-inf", type=int, default=None, metavar="STEP",
                   help="at this step the last rank's loss is multiplied by inf (demo of a "
                        "skip every rank agrees on)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--save", default=None, metavar="PATH", help="rank 0 saves a checkpoint here at the end")
    p.add_argument("--resume", default=None, metavar="PATH", help="every rank loads this checkpoint first")
    args = p.parse_args(argv)
    if args.steps < 1 or args.accum < 1:
        p.error("--steps and --accum must be at least 1")
    return args


# --- process group -----------------------------------------------------------------------


def init_distributed(backend: str) -> tuple[int, int, torch.device]:
    """Join the torchrun group (or make a one-process group under plain ``python``);
    return (rank, world size, this process's device)."""
    if "RANK" not in os.environ:  # plain `python`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), device


# --- data and model ----------------------------------------------------------------------


def load_data(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Digits (8x8 images, 10 classes), standardized, split 80/20 the same on every rank."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return x[train].to(device), y[train].to(device), x[test].to(device), y[test].to(device)


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.BatchNorm1d(hidden),  # fp32 under O2; SyncBatchNorm with --sync-bn on GPUs
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def batches(x: torch.Tensor, y: torch.Tensor, size: int, rank: int, world: int, seed: int):
    """Endless shuffled micro-batches; each rank takes its own slice of every epoch."""
    epoch = 0
    while True:
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        mine = order[rank::world].to(x.device)
        for start in range(0, len(mine) - size + 1, size):
            idx = mine[start : start + size]
            yield x[idx], y[idx]
        epoch += 1


def params_digest(model: nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


# --- training ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rank, world, device = init_distributed(args.backend)
    log = print if rank == 0 else (lambda *a, **k: None)
    if rank == 0:  # ampkit logs every overflow (on rank 0 only)
        logging.basicConfig(level=logging.INFO, format="  [ampkit] %(message)s")
    cuda_fp16 = device.type == "cuda" and args.amp != "O2K"  # O2K is bf16 by design
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float16 if cuda_fp16 else torch.bfloat16)

    torch.manual_seed(args.seed)  # the same start everywhere (DDP would broadcast it anyway)
    xtr, ytr, xte, yte = load_data(device)
    model = make_model(args.hidden).to(device)
    if args.sync_bn:
        model = amp.distributed.convert_sync_batchnorm(model)  # ampkit: clear error on CPU
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    if args.amp != "off":
        overrides = {"dtype": dtype}
        if args.loss_scale is not None:
            overrides["loss_scale"] = args.loss_scale if args.loss_scale == "dynamic" else float(args.loss_scale)
        model, opt = amp.initialize(model, opt, opt_level=args.amp, **overrides)  # ampkit
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.amp != "off" and not args.no_register:
        amp.distributed.register_ddp(net)  # ampkit: grads are all-reduced, no extra collective

    if args.resume:
        ckpt = torch.load(args.resume, map_location=device, weights_only=True)  # tensors and plain data only
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        if args.amp != "off":
            amp.load_state_dict(ckpt["amp"])  # scales, counters, fp32 masters
            amp.distributed.check_ranks_agree()
        log(f"resumed from {args.resume}")

    log(
        f"{world} process(es), backend {dist.get_backend()}, device {device.type}, amp {args.amp}"
        + (f" ({str(dtype).removeprefix('torch.')})" if args.amp != "off" else "")
        + f", accum {args.accum}"
    )
    data = batches(xtr, ytr, args.batch_size, rank, world, args.seed)
    skipped = 0
    loss_sum, since_log = torch.zeros((), device=device), 0
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        for micro in range(args.accum):
            xb, yb = next(data)
            last = micro == args.accum - 1
            with net.no_sync() if not last else contextlib.nullcontext():
                loss = F.cross_entropy(net(xb).float(), yb) / args.accum
                loss_sum += loss.detach()
                if args.inject_inf == step and rank == world - 1 and last:
                    loss = loss * float("inf")
                if args.amp == "off":
                    loss.backward()
                else:
                    with amp.scale_loss(loss, opt) as scaled:  # ampkit
                        scaled.backward()
        opt.step()  # ampkit: skipped on every rank if any rank's grads overflowed
        if args.amp != "off" and amp.step_skipped(opt):
            skipped += 1
        since_log += 1
        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(loss_sum)
            mean_loss = loss_sum.item() / (world * since_log)
            loss_sum.zero_()
            since_log = 0
            scale = amp.stats(opt).scales[0] if args.amp != "off" else 1.0
            log(f"step {step:5d}  loss {mean_loss:.4f}  scale {scale:g}  skipped {skipped}")
    elapsed = time.perf_counter() - start

    net.eval()
    with torch.no_grad():
        correct = (net(xte).float().argmax(1) == yte).sum()
    accuracy = correct.item() / len(yte)
    digests: list[str] = [""] * world
    dist.all_gather_object(digests, params_digest(model))
    if args.amp != "off":
        amp.distributed.check_ranks_agree()  # scales, counters and fp32 masters bitwise
    identical = len(set(digests)) == 1
    log(f"test accuracy {accuracy:.3f}  skipped steps {skipped}  {1000 * elapsed / args.steps:.1f} ms/step")
    log(f"replicas identical: {'yes' if identical else 'NO'} ({digests[0]})")
    if args.amp != "off":
        log(f"agreement: {amp.distributed.sync_plan(opt).reason}")

    if args.save and rank == 0:
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "amp": amp.state_dict() if args.amp != "off" else None},
            args.save,
        )
        log(f"saved {args.save}")
    dist.barrier()
    dist.destroy_process_group()
    if not identical:
        raise SystemExit("the replicas differ")
    return {"accuracy": accuracy, "skipped": skipped, "digest": digests[0]}


if __name__ == "__main__":
    main()
    # With the gloo backend, torch 2.13 sometimes aborts while tearing the process down
    # ("terminate called without an active exception"), after all work is done; leave
    # without that teardown so torchrun sees the real result.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
