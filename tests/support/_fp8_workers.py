"""Worker processes for tests/test_fp8_distributed.py (gloo on 127.0.0.1):
``python tests/support/_fp8_workers.py JOB RANK WORLD PORT OUTDIR``; each rank saves what it saw
(``rank{r}.pt``); launched by ``_dist_workers.launch``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _dist_workers  # noqa: E402


def launch(job: str, outdir: Path, world_size: int, timeout: float = 120.0) -> list[dict]:
    return _dist_workers.launch(job, outdir, world_size, timeout, script=Path(__file__))


def job_amax(rank: int, world: int, outdir: Path) -> dict:
    """DDP + O1 + fp8 (``scaling`` from the environment-free job name suffix): each rank
    feeds data of a different magnitude; the scales must agree across ranks and be
    derived from the largest abs-max of all ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampkit as amp
    from ampkit.levels import fp8

    out: dict = {}
    for scaling in ("current", "delayed"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = amp.initialize(model, opt, opt_level="O1", fp8=amp.Fp8Recipe(scaling=scaling, min_features=16))
        net = DDP(model)
        layer = model[1]
        local_in: list[torch.Tensor] = []
        local_go: list[torch.Tensor] = []
        layer.register_forward_pre_hook(lambda m, a, seen=local_in: seen.append(a[0].detach().abs().max().float()))
        layer.register_full_backward_hook(lambda m, gi, go, seen=local_go: seen.append(go[0].detach().abs().max().float()))
        st = layer.__dict__["_ampkit_fp8"].roles
        steps = []
        with _dist_workers.CountAllReduce() as counter:
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + rank)
                x = torch.randn(8, 32, generator=g) * (1.0 + 9.0 * rank)  # rank 1's data is 10x larger
                t = torch.randn(8, 4, generator=g)
                loss = F.mse_loss(net(x).float(), t)
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
                opt.zero_grad()
                steps.append({r: (s.amax.clone(), s.scale.clone(), s.amax_history.clone()) for r, s in st.items()})
        solo = None
        if rank == 0:  # one rank evaluates alone: no collective may be called (it would hang)
            with _dist_workers.CountAllReduce() as alone:
                with torch.no_grad():
                    model(torch.randn(4, 32))
                amp.explain(model, torch.randn(4, 32))
            solo = alone.calls
        out[scaling] = {
            "solo_all_reduces": solo,
            "steps": steps,
            "local_in": torch.stack(local_in),
            "local_go": torch.stack(local_go),
            "all_reduces": counter.calls,
            "weights": [p.detach().clone() for p in model.parameters()],
            "layers": [i.name for i in fp8.layers()],
        }
        dist.barrier()
    return out


JOBS: dict[str, Callable[[int, int, Path], dict]] = {"amax": job_amax}


if __name__ == "__main__":
    _dist_workers.JOBS.update(JOBS)
    code = _dist_workers.main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    import os

    os._exit(code)
