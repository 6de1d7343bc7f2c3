"""Worker processes for tests/unit/distributed/test_distributed.py: each job runs on every rank of a gloo
group on 127.0.0.1 and saves what it saw (per rank) for the test to compare.

Run by :func:`launch` as ``python tests/support/_dist_workers.py JOB RANK WORLD PORT OUTDIR``.
Checks that need both ranks' values (bitwise equality across ranks) are done by the
test on the saved results; each job also asserts what one rank can see on its own.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent


# --- launching (test side) -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    job: str, outdir: Path, world_size: int = 2, timeout: float = 90.0, script: Path = HERE / "_dist_workers.py",
    env: dict[str, str] | None = None,
) -> list[dict]:
    """Run ``job`` of ``script`` (this file, or another with the same command line and
    ``rank{r}.pt`` results) on ``world_size`` fresh processes, with ``env`` added to their
    environment; return each rank's results. Fails (with every rank's output) on a non-zero
    exit or after ``timeout`` seconds, killing the processes it started."""
    outdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    procs, logs = [], []
    for rank in range(world_size):
        log = open(outdir / f"rank{rank}.log", "w")
        logs.append(log)
        cmd = [sys.executable, str(script), job, str(rank), str(world_size), str(port), str(outdir)]
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
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def launch_several(jobs: Sequence[str], outdir: Path, **kwargs: Any) -> dict[str, list[dict]]:
    """Run ``jobs`` one after another in one :func:`launch` (:func:`job_several`: one
    process start, process group and set of compiled kernels for them all); return each
    job's per-rank results, to be read through :func:`ran`."""
    ranks = launch("several", outdir, env={"AMPKIT_TEST_JOBS": ",".join(jobs)}, **kwargs)
    return {job: [rank[job] for rank in ranks] for job in jobs}


def ran(parts: list[dict]) -> list[dict]:
    """A job's per-rank results from :func:`launch_several`, after checking that it ran:
    ``AssertionError`` with its traceback where it failed (or did not run after one that did)."""
    for part in parts:
        assert FAILED not in part, part[FAILED]
    return parts


# --- helpers (worker side) -------------------------------------------------------------------


class CountAllReduce:
    """Counts ``torch.distributed.all_reduce`` calls made inside the ``with`` block
    (ampkit's agreement goes through it; DDP's reducer and DTensor do not)."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig: Any = None

    def __enter__(self) -> CountAllReduce:
        self.calls = 0
        self._orig = dist.all_reduce

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self._orig


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def registered_o2(sync: str) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
    """An O2 model (dynamic scale) wrapped in a registered DDP, with ``sync`` set."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampkit

    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", loss_scale="dynamic")
    net = ampkit.distributed.register_ddp(DDP(model))
    ampkit.distributed.set_sync(opt, sync)
    return model, opt, net


def batch(rank: int, step: int, same_on_all_ranks: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + (0 if same_on_all_ranks else rank + 1))
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def inject_inf_into_grads(params: Any, route: str = "index") -> None:
    """Put an inf into the first existing grad (in place, whatever its dtype), by
    indexing (``route="index"``, a version counter sees it) or through ``.data``
    (``"data"``: nothing but the values shows it)."""
    for p in params:
        grad = p.grad
        if grad is not None:
            if hasattr(grad, "to_local"):  # a DTensor shard: poison this rank's piece
                grad = grad.to_local()
            if route == "data":
                grad.data.view(-1)[0] = float("inf")
            else:
                grad.view(-1)[0] = float("inf")
            return
    raise AssertionError("no grad to inject into")


def snapshot(tensors: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Same dtypes, shapes and bits (NaN-safe)."""

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
        for x, y in zip(a, b)
    )


def run_steps(
    rank: int,
    net: nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    inject: Callable[[int], bool] = lambda step: False,
    loss_inject: Callable[[int], bool] = lambda step: False,
    same_data: bool = False,
    route: str = "index",
) -> dict[str, list]:
    """Plain DDP-style steps; per step: skipped, scale, ampkit all-reduces during step()."""
    import ampkit

    out: dict[str, list] = {"skipped": [], "scale": [], "collectives": []}
    counter = CountAllReduce()
    for step in steps:
        x, y = batch(rank, step, same_data)
        opt.zero_grad()
        loss = F.mse_loss(net(x).float(), y)
        if loss_inject(step):
            loss = loss * float("inf")
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if inject(step):
            inject_inf_into_grads(_backward_params(opt), route)
        with counter:
            opt.step()
        out["skipped"].append(ampkit.step_skipped(opt))
        out["scale"].append(ampkit.stats(opt).scales[0])
        out["collectives"].append(counter.calls)
    return out


def _backward_params(opt: torch.optim.Optimizer) -> Any:
    from ampkit.trainer.api import managed_state

    state = managed_state(opt)
    return list(state.backward_params) if state.backward_params is not None else list(state.grad_params())


def fingerprint(state: dict) -> Any:
    """A bitwise digest of a state dict (tensors hashed), safe to keep and compare."""
    from ampkit.distributed.core import fingerprint as _fingerprint

    return _fingerprint(state)


def amp_state() -> dict:
    import ampkit

    return ampkit.state_dict()


def expect_error(fn: Callable[[], Any], error: type[BaseException]) -> str:
    try:
        fn()
    except error as e:
        return str(e)
    raise AssertionError(f"expected {error.__name__}")


# --- jobs ------------------------------------------------------------------------------------

LEVELS = ("O0", "O1", "O2", "O3", "O2K")


def job_ddp(rank: int, world: int, outdir: Path) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampkit
    from ampkit.distributed.core import check_ranks_agree, register_ddp, set_sync, sync_plan

    res: dict[str, Any] = {}

    # 1. Every level under DDP (wrapped after initialize, not registered: sync="auto"
    # agrees). An inf in rank 1's grads only, after the all-reduce, at step 1.
    for level in LEVELS:
        model = make_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, opt = ampkit.initialize(model, opt, opt_level=level, loss_scale="dynamic")
        net = DDP(model)
        assert sync_plan(opt).agree
        r = run_steps(rank, net, opt, range(4), inject=lambda s: s == 1 and rank == 1)
        r["params"] = snapshot(model.parameters())
        r["masters"] = snapshot(ampkit.master_params(opt))
        r["state"] = amp_state()
        check_ranks_agree()
        res[f"level_{level}"] = r

    # 2. Control: the same injection with sync="never" lets the ranks disagree, and
    # check_ranks_agree notices.
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", loss_scale="dynamic")
    net = DDP(model)
    set_sync(opt, "never")
    r = run_steps(rank, net, opt, range(3), inject=lambda s: s == 1 and rank == 1)
    r["params"] = snapshot(model.parameters())
    r["check_error"] = expect_error(check_ranks_agree, ampkit.DistributedError)
    res["never"] = r

    # 3. Registered DDP, O2, ranks seeded differently (register_ddp broadcasts the
    # masters): an overflow in rank 1's backward is an overflow everywhere after DDP's
    # all-reduce; one agreement collective per step.
    model = make_model(100 + rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", loss_scale="dynamic")
    net = register_ddp(DDP(model))
    r = run_steps(rank, net, opt, range(6), loss_inject=lambda s: s == 2 and rank == 1)
    r["plan"] = sync_plan(opt).reason
    r["params"] = snapshot(model.parameters())
    r["masters"] = snapshot(ampkit.master_params(opt))
    r["norm_dtypes"] = [str(t.dtype) for t in list(model[1].parameters()) + list(model[1].buffers())]
    r["state"] = amp_state()
    # sync="always" on the same setup: one collective per step.
    set_sync(opt, "always")
    r["always"] = run_steps(rank, net, opt, range(6, 8))
    check_ranks_agree()
    res["registered_o2"] = r

    # 4. Unregistered DDP with differently seeded ranks: the masters would drift apart,
    # so the first step raises, on every rank (rank 0's own masters are fine).
    model = make_model(200 + rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = ampkit.initialize(model, opt, opt_level="O2")
    net = DDP(model)
    x, y = batch(rank, 0)
    with ampkit.scale_loss(F.mse_loss(net(x), y), opt) as scaled:
        scaled.backward()
    res["unregistered_seeds"] = expect_error(opt.step, ampkit.DistributedError)

    # 5. Gradient accumulation with no_sync, registered DDP, O2: an inf in rank 1's
    # grads during a no_sync micro-batch reaches every rank through the synchronized
    # backward that ends the step.
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", loss_scale="dynamic")
    net = register_ddp(DDP(model))
    counter = CountAllReduce()
    acc: dict[str, list] = {"skipped": [], "scale": [], "collectives": []}
    for step in range(4):
        opt.zero_grad()
        for micro in range(3):
            x, y = batch(rank, 10 * step + micro)
            ctx = net.no_sync() if micro < 2 else contextlib.nullcontext()
            with ctx:
                with ampkit.scale_loss(F.mse_loss(net(x), y), opt) as scaled:
                    scaled.backward()
            if step == 2 and micro == 0 and rank == 1:
                inject_inf_into_grads(model.parameters())
        with counter:
            opt.step()
        acc["skipped"].append(ampkit.step_skipped(opt))
        acc["scale"].append(ampkit.stats(opt).scales[0])
        acc["collectives"].append(counter.calls)
    acc["params"] = snapshot(model.parameters())
    acc["masters"] = snapshot(ampkit.master_params(opt))
    res["accumulate"] = acc

    # 6. Stepping on grads accumulated under no_sync only (no DDP all-reduce at all),
    # the same data on both ranks: ranks could disagree, so one collective per step;
    # rank 1's inf makes both skip and the replicas stay bitwise equal. With
    # sync="never" they split.
    for mode in ("auto", "never"):
        model, opt, net = registered_o2(mode)
        local: dict[str, list] = {"skipped": [], "scale": [], "collectives": []}
        for step in range(3):
            opt.zero_grad()
            with net.no_sync():
                for micro in range(2):
                    x, y = batch(rank, 10 * step + micro, same_on_all_ranks=True)
                    with ampkit.scale_loss(F.mse_loss(net(x), y), opt) as scaled:
                        scaled.backward()
            if step == 1 and rank == 1:
                inject_inf_into_grads(model.parameters())
            local.setdefault("plan", []).append(sync_plan(opt).reason)
            with counter:
                opt.step()
            local["skipped"].append(ampkit.step_skipped(opt))
            local["scale"].append(ampkit.stats(opt).scales[0])
            local["collectives"].append(counter.calls)
        local["params"] = snapshot(model.parameters())
        local["masters"] = snapshot(ampkit.master_params(opt))
        res[f"no_sync_step_{mode}"] = local

    # 7. Several losses, per-rank models outside DDP (same seed and data everywhere):
    # the ranks must agree on which loss overflowed.
    res["multi_loss"] = _multi_loss(rank)

    # 9. Registered DDP, grads changed on one rank only after the synchronized backward
    # (rank 1 writes an inf at step 1, by indexing or through .data, which no version
    # counter sees): sync="auto" agrees on every step, so both ranks skip and stay
    # bitwise equal; sync="never" is the control, where the replicas split and
    # check_ranks_agree reports it on both ranks. Then amp.unscale and clipping.
    for mode, route in (("auto", "index"), ("auto", "data"), ("never", "data")):
        model, opt, net = registered_o2(mode)
        r = run_steps(rank, net, opt, range(4), inject=lambda s: s == 1 and rank == 1, route=route)
        opt.zero_grad()
        x, y = batch(rank, 9)
        with ampkit.scale_loss(F.mse_loss(net(x), y), opt) as scaled:
            scaled.backward()
        ampkit.unscale(opt)
        torch.nn.utils.clip_grad_norm_(ampkit.master_params(opt), 0.1)
        opt.step()
        r["params"] = snapshot(model.parameters())
        r["check_error"] = None
        try:
            check_ranks_agree()
        except ampkit.DistributedError as err:
            r["check_error"] = str(err)
        res[f"changed_after_allreduce_{mode}_{route}"] = r

    # 10. A micro-batch accumulated under no_sync, then dropped with the optimizer's
    # zero_grad (set_to_none or not): the next step equals one that never saw it.
    dropped: dict[str, list] = {}
    for drop in ("none", "set_to_none", "zeros"):
        model, opt, net = registered_o2("auto")
        for step in range(2):
            opt.zero_grad()
            if drop != "none" and step == 1:
                x, y = batch(rank, 50)
                with net.no_sync():
                    with ampkit.scale_loss(F.mse_loss(net(x), y), opt) as scaled:
                        scaled.backward()
                opt.zero_grad(set_to_none=drop == "set_to_none")
            x, y = batch(rank, 60 + step)
            with ampkit.scale_loss(F.mse_loss(net(x), y), opt) as scaled:
                scaled.backward()
            opt.step()
        dropped[drop] = snapshot(ampkit.master_params(opt)) + snapshot(model.parameters())
    res["dropped_no_sync"] = {k: bitwise_equal(v, dropped["none"]) for k, v in dropped.items()}

    # 8. A DDP model cannot be handed to initialize at a level that casts weights.
    wrapped = DDP(make_model(0))
    res["ddp_into_initialize"] = expect_error(
        lambda: ampkit.initialize(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), opt_level="O2"),
        ampkit.DistributedError,
    )
    ampkit.reset()
    return res


def _multi_loss(rank: int) -> dict:
    import ampkit
    from ampkit.distributed.core import check_ranks_agree

    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = ampkit.initialize(model, opt, opt_level="O1", loss_scale="dynamic", num_losses=2)
    counter = CountAllReduce()
    out: dict[str, Any] = {"skipped": [], "scales": [], "trackers": [], "collectives": []}
    # step -> loss id whose grads rank 1 poisons right after that loss's backward
    poison = {1: 1, 3: 0}
    for step in range(5):
        x, y = batch(rank, step, same_on_all_ranks=True)
        opt.zero_grad()
        out_ = model(x)
        for loss_id, loss in enumerate((F.mse_loss(out_, y), out_.pow(2).mean())):
            with ampkit.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward(retain_graph=loss_id == 0)
            if rank == 1 and poison.get(step) == loss_id:
                inject_inf_into_grads(model.parameters())
        with counter:
            opt.step()
        sd = ampkit.state_dict()["trainers"][0]["scalers"]
        out["skipped"].append(ampkit.step_skipped(opt))
        out["scales"].append([s["scale"] for s in sd])
        out["trackers"].append([s["growth_tracker"] for s in sd])
        out["collectives"].append(counter.calls)
    check_ranks_agree()
    out["params"] = snapshot(model.parameters())
    # Ranks that scale different loss ids in one step: a clear error on every rank.
    opt.zero_grad()
    out_ = model(batch(rank, 9, True)[0])
    with ampkit.scale_loss(out_.pow(2).mean(), opt, loss_id=0) as scaled:
        scaled.backward(retain_graph=True)
    if rank == 0:
        with ampkit.scale_loss(out_.abs().mean(), opt, loss_id=1) as scaled:
            scaled.backward()
    out["mismatch"] = expect_error(opt.step, ampkit.DistributedError)
    return out


def job_checkpoint(rank: int, world: int, outdir: Path) -> dict:
    """O2 + registered DDP: rank 0 saves model, optimizer and AMP state after 4 steps;
    every rank loads it into a fresh, differently seeded setup and the next 4 steps
    match an uninterrupted run bitwise."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampkit
    from ampkit.distributed.core import check_ranks_agree, register_ddp

    def setup(seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        model = make_model(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = ampkit.initialize(
            model, opt, opt_level="O2", loss_scale="dynamic", max_loss_scale=2.0**20
        )
        for s in ampkit.trainer.managed_state(opt).scalers:
            s.growth_interval = 2  # let the scale move within a few steps
        return model, register_ddp(DDP(model)), opt

    def poisoned(step: int) -> bool:
        return step in (1, 3, 5) and rank == 1

    path = outdir / "ckpt.pt"
    model, net, opt = setup(0)
    first = run_steps(rank, net, opt, range(4), loss_inject=poisoned)
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": ampkit.state_dict()}, path)
    dist.barrier()
    ref = run_steps(rank, net, opt, range(4, 8), loss_inject=poisoned)
    ref_params, ref_masters = snapshot(model.parameters()), snapshot(ampkit.master_params(opt))
    ref_state, ref_opt = fingerprint(amp_state()), copy.deepcopy(opt.state_dict())

    model, net, opt = setup(50 + rank)  # a different start: everything must come from the file
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    ampkit.load_state_dict(ckpt["amp"])
    check_ranks_agree()
    resumed = run_steps(rank, net, opt, range(4, 8), loss_inject=poisoned)
    res = {
        "first": first,
        "ref": ref,
        "resumed": resumed,
        "params_equal": bitwise_equal(ref_params, snapshot(model.parameters())),
        "masters_equal": bitwise_equal(ref_masters, snapshot(ampkit.master_params(opt))),
        "state_equal": ref_state == fingerprint(amp_state()),
        "opt_state_equal": _opt_states_equal(ref_opt, opt.state_dict()),
        "params": snapshot(model.parameters()),
        "masters": snapshot(ampkit.master_params(opt)),
    }
    ampkit.reset()
    return res


def _opt_states_equal(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        bitwise_equal([a["state"][k][n]], [b["state"][k][n]]) for k in a["state"] for n in a["state"][k]
    )


def job_fsdp(rank: int, world: int, outdir: Path) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import ampkit
    from ampkit.distributed.core import sync_plan

    res: dict[str, Any] = {}

    def sharded(mp: MixedPrecisionPolicy | None = None) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        kw = {} if mp is None else {"mp_policy": mp}
        fully_shard(model[0], **kw)
        fully_shard(model[2], **kw)
        fully_shard(model, **kw)
        return model

    bf16_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    setups = {
        "O0": (None, "O0"),
        "O1": (None, "O1"),
        "mp_O0": (bf16_mp, "O0"),  # the recipe for O2-style training under FSDP2
    }
    for name, (mp, level) in setups.items():
        model = sharded(mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = ampkit.initialize(model, opt, opt_level=level, loss_scale="dynamic")
        before: list[torch.Tensor] = []

        def inject(step: int, before: list = before, model: nn.Module = model) -> bool:
            before[:] = snapshot(p.to_local() for p in model.parameters())
            return step == 2 and rank == 1

        r = run_steps(rank, model, opt, range(3), inject=inject)
        r["skip_kept_shards"] = bitwise_equal(before, snapshot(p.to_local() for p in model.parameters()))
        r["grad_types"] = sorted({type(p.grad).__name__ for p in model.parameters() if p.grad is not None})
        r["plan"] = sync_plan(opt).reason
        more = run_steps(rank, model, opt, range(3, 5))
        for key, values in more.items():
            r[key] += values
        r["full"] = snapshot(p.full_tensor() for p in model.parameters())
        r["trained"] = not bitwise_equal(before, snapshot(p.to_local() for p in model.parameters()))
        res[name] = r

    # Levels that cast the weights are refused on a sharded model ...
    for level in ("O2", "O3", "O2K"):
        model = sharded()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        res[f"refused_{level}"] = expect_error(
            lambda model=model, opt=opt, level=level: ampkit.initialize(model, opt, opt_level=level),
            ampkit.DistributedError,
        )
    # ... and sharding after such an initialize fails at the first forward.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level="O2")
    fully_shard(model)
    res["shard_after_initialize"] = expect_error(lambda: model(torch.randn(2, 8)), ampkit.DistributedError)
    ampkit.reset()
    return res


def job_ddp_grads(rank: int, world: int, outdir: Path) -> dict:
    """DDP wrapped after initialize, each rank on its own data: the grads the optimizer
    steps (fp32 masters under O2) and the ones user code sees on the model are the
    average over ranks of the fp32 reference grads, with and without register_ddp,
    with and without no_sync accumulation."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampkit
    from ampkit.distributed.core import register_ddp

    def reference(micro_batches: int) -> list[torch.Tensor]:
        ref = make_model(0)
        for r in range(world):
            for micro in range(micro_batches):
                x, y = batch(r, micro)
                (F.mse_loss(ref(x), y) / world).backward()
        return [p.grad.detach().clone() for p in ref.parameters()]

    res: dict[str, Any] = {}
    variants = (
        ("O1", {"loss_scale": "dynamic"}),
        ("O2", {"loss_scale": "dynamic"}),
        ("O2", {}),
        ("O2", {"model_grads": "view"}),
    )
    for level, kw in variants:
        for registered in (False, True):
            for micro_batches in (1, 3):
                model = make_model(0)
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
                model, opt = ampkit.initialize(model, opt, opt_level=level, **kw)
                net = DDP(model)
                if registered:
                    net = register_ddp(net)
                opt.zero_grad()
                for micro in range(micro_batches):
                    x, y = batch(rank, micro)
                    ctx = net.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext()
                    with ctx:
                        with ampkit.scale_loss(F.mse_loss(net(x).float(), y), opt) as scaled:
                            scaled.backward()
                variant = "_static" if not kw else "_view" if "model_grads" in kw else ""
                key = f"{level}{variant}_{'reg' if registered else 'plain'}_{micro_batches}"
                res[key] = {
                    "stepped": snapshot(p.grad for p in ampkit.master_params(opt)),
                    "model": snapshot(p.grad.float() for p in model.parameters()),
                    "expected": reference(micro_batches),
                }
                opt.step()
                assert not ampkit.step_skipped(opt)
    ampkit.reset()
    return res


#: The key of a :func:`job_several` part whose job raised, or did not run after one that did.
FAILED = "__failed__"


def job_several(rank: int, world: int, outdir: Path) -> dict:
    """The jobs named in ``AMPKIT_TEST_JOBS`` (comma-separated), one after another in these
    processes, each in a folder of its own: ``{job: its results}``. A job that raises ends
    the run (the ranks may disagree on what comes next): its part holds the traceback under
    :data:`FAILED`, and each later job's part says it did not run."""
    out: dict[str, Any] = {}
    failed = None
    for name in os.environ["AMPKIT_TEST_JOBS"].split(","):
        if failed is not None:
            out[name] = {FAILED: f"not run: job {failed!r} failed before it"}
            continue
        folder = outdir / name
        folder.mkdir(exist_ok=True)
        try:
            out[name] = JOBS[name](rank, world, folder)
        except Exception:  # noqa: BLE001 - the test shows it as the job's failure
            out[name] = {FAILED: traceback.format_exc()}
            failed = name
    return out


JOBS: dict[str, Callable[[int, int, Path], dict]] = {
    "several": job_several,
    "ddp_grads": job_ddp_grads,
    "ddp": job_ddp,
    "checkpoint": job_checkpoint,
    "fsdp": job_fsdp,
}


def main(argv: list[str], timeout_s: float = 60) -> int:
    """Run ``JOBS[argv[0]]`` on this rank of a gloo group and save its results; 0 on
    success, 1 (with the traceback printed) on failure. ``timeout_s``: how long a
    collective may wait for the other ranks."""
    job, rank, world, port, outdir = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        results = JOBS[job](rank, world, outdir)
        torch.save(results, outdir / f"rank{rank}.pt")
        # leave together: rank 0 hosts the store, and tearing the group down while the
        # other rank still has work in flight can abort the process at exit
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
    # Skip interpreter teardown: with gloo, static destructors at exit sometimes abort
    # ("terminate called without an active exception") after all work is done and
    # saved, which would turn a passing job into a failure.
    os._exit(code)
