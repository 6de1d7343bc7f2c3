"""Worker processes for tests/tools/test_doctor.py's multi-process cases (gloo on 127.0.0.1):
``python tests/support/_doctor_workers.py JOB RANK WORLD PORT OUTDIR``; each rank saves what it
saw (``rank{r}.pt``) for the test to check; launched by ``_dist_workers.launch``."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _dist_workers  # noqa: E402


def launch(job: str, outdir: Path, world_size: int, timeout: float = 120.0) -> list[dict]:
    """Run ``job`` of this file on ``world_size`` fresh processes (doctor switched off
    in the environment; the jobs turn it on themselves)."""
    saved = os.environ.pop("AMPKIT_DOCTOR", None)
    try:
        return _dist_workers.launch(job, outdir, world_size, timeout, script=Path(__file__))
    finally:
        if saved is not None:
            os.environ["AMPKIT_DOCTOR"] = saved


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


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # fp16 on CPU warns
    _dist_workers.JOBS.update(JOBS)
    code = _dist_workers.main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo's static destructors can abort at exit (see _dist_workers.py)
