"""One rank of a 2-process Accelerate DDP run on CPU (gloo), launched by
tests/integrations/test_integration_accelerate.py with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
MASTER_PORT in the environment: ``Accelerator(cpu=True)`` sees them and wraps the model in
DistributedDataParallel itself.

For each level of ``argv[2:]`` (``fp32``: Accelerate alone; ``O1``, ``O2``, ...: through
``ampkit.integrations.accelerate``), on each rank's own data, with each rank's model
seeded differently (DDP broadcasts rank 0's weights; O2's masters are built before the
wrap, so ``register_ddp`` must broadcast them too):

- ``train``: 30 steps; the mean loss over both ranks of the last 10 steps, and a hash of
  the parameters (and of O2's fp32 masters) to compare across ranks;
- ``nan``: 6 steps with a NaN in rank 1's batch at step 3: DDP's all-reduce spreads the
  NaN gradients to both ranks, and both skip that step;
- ``edit``: 6 steps with a NaN written through ``.data`` into one gradient on rank 1
  only, after the backward at step 3 (after DDP's all-reduce: only rank 1 sees it, and
  no version counter tells): the ranks agree on the skip through ampkit's one
  all-reduce of the overflow flags per step (the default ``set_sync``).

Each records ``accelerator.optimizer_step_was_skipped`` after every step.

Writes ``argv[1]`` (a JSON file per rank)."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

torch.set_num_threads(1)

import ampkit as amp  # noqa: E402
import ampkit.integrations.accelerate as amp_accelerate  # noqa: E402


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def run(accelerator: Accelerator, level: str, steps: int, nan_at: int | None = None, how: str = "") -> dict:
    rank = accelerator.process_index
    torch.manual_seed(100 + rank)  # different weights per rank: DDP's broadcast makes them one
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    if level == "fp32":
        model, opt, sched = accelerator.prepare(model, opt, sched)
    else:
        model, opt, sched = amp_accelerate.prepare(accelerator, model, opt, sched, opt_level=level)
    plans = []
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    gen = torch.Generator().manual_seed(rank)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    losses, skipped = [], []
    for step in range(steps):
        x = torch.randn(32, 16, generator=gen)
        y = torch.tanh(x @ w)
        if step == nan_at and rank == 1 and how == "input":
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        if level == "fp32":
            accelerator.backward(loss)
        else:
            amp_accelerate.backward(accelerator, loss, opt)
        if step == nan_at and rank == 1 and how == "edit":
            model.module[0].weight.grad.data[0, 0] = float("nan")
        if level != "fp32":
            plans.append(amp.distributed.sync_plan(opt).agree)
        opt.step()
        sched.step()
        skipped.append(bool(accelerator.optimizer_step_was_skipped))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    params = list(model.module.parameters())
    out = {
        "losses": losses,
        "skipped": skipped,
        "params": digest(params),
        "lr": sched.get_last_lr()[0],
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
    }
    if level != "fp32":
        out["masters"] = digest(amp.master_params(opt))
        out["stats"] = [amp.stats(opt).steps, amp.stats(opt).skipped]
        out["agree"] = plans
        amp.reset()
    return out


def main() -> None:
    out_path, levels = sys.argv[1], sys.argv[2:]
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2, accelerator.num_processes
    result = {"rank": accelerator.process_index, "distributed_type": str(accelerator.distributed_type)}
    for level in levels:
        result[level] = {"train": run(accelerator, level, 30), "nan": run(accelerator, level, 6, 3, "input")}
        if level != "fp32":
            result[level]["edit"] = run(accelerator, level, 6, 3, "edit")
    with open(out_path, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # With gloo, torch sometimes aborts while tearing the process down ("terminate called
    # without an active exception") after all work is done and written; leave without
    # that teardown so the test sees the real exit status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
