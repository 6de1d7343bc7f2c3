"""Worker processes for tests/test_doctor.py's multi-process cases (gloo on 127.0.0.1):
``python tests/_doctor_workers.py JOB RANK WORLD PORT OUTDIR``; each rank saves what it
saw as JSON for the test to check."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _dist_workers import free_port  # noqa: E402


def launch(job: str, outdir: Path, world_size: int, timeout: float = 120.0) -> list[dict]:
    """Run ``job`` on ``world_size`` fresh processes and return each rank's results;
    fails with every rank's output on a non-zero exit or a timeout."""
    outdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("AMPKIT_DOCTOR", None)
    procs, logs = [], []
    for rank in range(world_size):
        log = open(outdir / f"rank{rank}.log", "w")
        logs.append(log)
        cmd = [sys.executable, __file__, job, str(rank), str(world_size), str(port), str(outdir)]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + timeout
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()
    codes = [p.returncode for p in procs]
    if timed_out or any(codes):
        outputs = "\n".join(
            f"--- rank {r} (exit {codes[r]}) ---\n{(outdir / f'rank{r}.log').read_text()[-4000:]}"
            for r in range(world_size)
        )
        raise AssertionError(f"job {job!r} {'timed out' if timed_out else 'failed'}:\n{outputs}")
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(world_size)]




def _loop(model: nn.Module, opt: torch.optim.Optimizer, batches: Callable[[int], tuple], steps: int,
          before_step: Callable[[], None] | None = None) -> list[float]:
    import ampkit as amp

    losses = []
    for step in range(steps):
        x, y = batches(step)
        with amp.autocast(amp.Policy(dtype=torch.float16), device_type="cpu"):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def job_fsdp_clip(rank: int, world: int, outdir: Path) -> dict:
    """FSDP2 leaves its sharded grads scaled until the step: clipping before
    amp.unscale clips S*g. The doctor says so; unscaling first trains like fp32."""
    from torch.distributed.fsdp import fully_shard

    import ampkit as amp

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)

    def setup(scale: float) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.init_trainer(opt, scaler=amp.LossScaler(init_scale=scale))
        return model, opt

    res: dict[str, Any] = {}
    model, opt = setup(2.0**12)
    with amp.doctor(opt) as doc:
        res["misused"] = _loop(model, opt, lambda s: (x, y), 6,
                               lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    report = doc.report()
    res["misuse"] = [m.to_dict() for m in report.misuse]
    res["advice"] = [a.to_dict() for a in report.advice]
    amp.reset()
    model, opt = setup(2.0**12)

    def unscale_then_clip() -> None:
        amp.unscale(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    res["fixed"] = _loop(model, opt, lambda s: (x, y), 6, unscale_then_clip)
    amp.reset()
    torch.manual_seed(0)  # the fp32 reference: no sharding, no scaling
    ref = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    res["reference"] = []
    for _ in range(6):
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        res["reference"].append(loss.item())
    return res


def job_ddp(rank: int, world: int, outdir: Path) -> dict:
    """Rank 1's batches overflow the first layer from step 3 on; every rank skips; rank 0
    reports, naming rank 1."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampkit as amp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.mul_(10.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    amp.init_trainer(opt, scaler=amp.LossScaler(init_scale=2.0**8), doctor=True)
    model = amp.distributed.register_ddp(DDP(model))

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        if rank == 1 and step >= 2:
            x = x * 1e4  # an outlier batch on one rank: the first layer overflows fp16
        return x, y

    _loop(model, opt, batches, 4)
    report = amp.doctor.current().report()
    return {"report": report.to_dict(), "stats": list(amp.stats(opt).__dict__.values())}


JOBS: dict[str, Callable[[int, int, Path], dict]] = {"fsdp_clip": job_fsdp_clip, "ddp": job_ddp}


def main(argv: list[str]) -> int:
    job, rank, world, port, outdir = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results = JOBS[job](rank, world, outdir)
        (outdir / f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo's static destructors can abort at exit (see _dist_workers.py)
