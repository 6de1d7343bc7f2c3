"""Worker processes for tests/unit/distributed/test_fsdp.py: every opt level under FSDP2 on a gloo group
of 2 (or 4) CPU processes, each rank on its own batches of a small causal transformer.

Run by ``_dist_workers.launch(job, outdir, world_size, script=<this file>)`` as
``python tests/support/_fsdp_workers.py JOB RANK WORLD PORT OUTDIR``; each rank saves what it saw
(``rankN.pt``) for the test to compare across ranks.
"""

from __future__ import annotations

import os
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _dist_workers import bitwise_equal, snapshot  # noqa: E402

VOCAB, D, SEQ, BATCH = 16, 32, 12, 8

# setup name -> (level, dtype); "fp32" is FSDP2 alone, the reference
SETUPS: dict[str, tuple[str | None, torch.dtype | None]] = {
    "fp32": (None, None),
    "O1": ("O1", torch.bfloat16),
    "O2": ("O2", torch.bfloat16),
    "O2K": ("O2K", torch.bfloat16),
    "O3": ("O3", torch.bfloat16),
    "O1-fp16": ("O1", torch.float16),
    "O2-fp16": ("O2", torch.float16),
    "O2-fp8": ("O2", torch.bfloat16),  # + fp8 linears (delayed scaling)
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences (next token = previous + 1) with 10% noise, per rank and step."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


def build(setup: str, lr: float = 3e-3) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model sharded for ``setup`` and its AdamW, set up by ampkit (not for fp32)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import ampkit

    level, dtype = SETUPS[setup]
    torch.manual_seed(0)
    model = TinyLM()
    if level is None:
        for block in model.blocks:
            torch_fully_shard(block)
        torch_fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    ampkit.distributed.fully_shard(model, opt_level=level, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    fp8 = ampkit.Fp8Recipe(scaling="delayed", min_features=16) if setup.endswith("fp8") else None
    model, opt = ampkit.initialize(model, opt, opt_level=level, dtype=dtype, fp8=fp8)
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, n: int, ampkit_on: bool,
         inject: bool = False) -> float:  # fmt: skip
    import ampkit

    x, y = batch(rank, n)
    opt.zero_grad()
    loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
    if ampkit_on:
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
    else:
        loss.backward()
    if inject:  # a NaN in this rank's shard of the first grad, after FSDP2's reduce-scatter
        g = next(p.grad for p in model.parameters() if p.grad is not None)
        g.to_local().view(-1)[0] = float("nan")
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def _local_state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of the parameters, the optimizer state and ampkit's
    compensation buffers."""
    from ampkit.levels.setup import compensation_of

    out = [p.detach().to_local() for p in model.parameters()]
    for state in opt.state.values():
        out += [v.to_local() if hasattr(v, "to_local") else v for v in state.values() if torch.is_tensor(v)]
    comp = compensation_of(opt)
    if comp is not None:
        out += [comp.buffer(p).to_local() for p in model.parameters() if comp.buffer(p) is not None]
    return snapshot(out)


def job_train(rank: int, world: int, outdir: Path) -> dict:
    """Every setup trains 40 steps; losses, the full weights at the end, the local
    bytes of parameters + optimizer state + ampkit's buffers."""
    import ampkit
    from ampkit.levels.setup import compensation_of

    res: dict[str, Any] = {}
    for setup in SETUPS:
        model, opt = build(setup)
        on = SETUPS[setup][0] is not None
        seen: dict[str, str] = {}

        def spy(name: str, what: str, seen: dict = seen) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple, out: Any) -> None:
                t = {"in": args[0], "out": out, "weight": getattr(module, "weight", None)}[what]
                seen.setdefault(f"{name} {what}", str(t.dtype).removeprefix("torch."))
            return hook

        block = model.blocks[0]
        hooks = [block.qkv.register_forward_hook(spy("qkv", "in")), block.qkv.register_forward_hook(spy("qkv", "weight")),
                 block.ln1.register_forward_hook(spy("ln1", "out")), block.ln1.register_forward_hook(spy("ln1", "weight")),
                 model.register_forward_hook(spy("model", "out"))]  # fmt: skip
        dedicated: list[int] = []
        comp = compensation_of(opt)
        if comp is not None:  # count the parameters the one-pass compensated update steps
            real = comp._step_dedicated

            def counting(optimizer: Any, group: dict, rule: str, params: list, skip: Any = None, *,
                         real: Any = real, dedicated: list = dedicated) -> Any:  # fmt: skip
                dedicated.append(len(params))
                return real(optimizer, group, rule, params, skip)

            comp._step_dedicated = counting
        losses = [step(model, opt, rank, n, on) for n in range(40)]
        for h in hooks:
            h.remove()
        fp8_layers = [(i.name, i.calls, i.scales["weight"] != 1.0) for i in ampkit.fp8.layers()]
        res[setup] = {
            "losses": losses,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "full": snapshot(p.full_tensor() for p in model.parameters()),
            "stats": (ampkit.stats(opt).steps, ampkit.stats(opt).skipped) if on else None,
            "seen": seen,
            "compensated": None if comp is None else sum(comp.buffer(p) is not None for p in model.parameters()),
            "dedicated": dedicated,
            "fp8": fp8_layers,
        }
        if on:
            ampkit.reset()
    return res


def job_skip(rank: int, world: int, outdir: Path) -> dict:
    """A NaN in rank 1's shard of one grad at step 3: every rank skips, its shards,
    optimizer state and compensation stay bitwise, the scalers stay equal."""
    import ampkit

    res: dict[str, Any] = {}
    for setup in ("O1", "O2", "O2K", "O3", "O1-fp16", "O2-fp16", "O2-fp8"):
        model, opt = build(setup)
        skipped, scales, kept = [], [], None
        for n in range(6):
            before = _local_state(model, opt)
            step(model, opt, rank, n, True, inject=(n == 3 and rank == 1))
            skipped.append(ampkit.step_skipped(opt))
            scales.append(ampkit.stats(opt).scales)
            if n == 3:
                kept = bitwise_equal(before, _local_state(model, opt))
        res[setup] = {
            "skipped": skipped,
            "scales": scales,
            "kept": kept,
            "finite": all(bool(torch.isfinite(p.detach().to_local()).all()) for p in model.parameters()),
        }
        ampkit.reset()
    return res


CKPT_SETUPS = ("O1-fp16", "O2", "O2K", "O3", "O2-fp8")
N = 4  # the checkpoint is taken after N steps; runs go on to 2N


def _dcp_load(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    import ampkit

    ampkit.distributed.load_checkpoint(path, model, opt)


def _amp_snapshot(local: bool = False) -> list[torch.Tensor]:
    """ampkit's state as AmpState saves it (every value a tensor): full tensors, to compare
    across world sizes, or with ``local`` this rank's part of each (to compare on one rank:
    no collective per tensor)."""
    import ampkit

    out = ampkit.distributed.AmpState().state_dict()
    part = "to_local" if local else "full_tensor"
    return [getattr(v, part)() if hasattr(v, part) else v for _, v in sorted(out.items())]


def job_dcp_save(rank: int, world: int, outdir: Path) -> dict:
    """N steps, a DCP save (model, optimizer, ampkit), N more: the weights and ampkit's
    state at N and at 2N (a skipped step at N + 1 on rank 1's NaN)."""

    import ampkit

    res: dict[str, Any] = {}
    for setup in CKPT_SETUPS:
        model, opt = build(setup)
        for n in range(N):
            step(model, opt, rank, n, True)
        ampkit.distributed.save_checkpoint(outdir / setup, model, opt)
        at_n = snapshot(p.full_tensor() for p in model.parameters())
        amp_n = _amp_snapshot()
        for n in range(N, 2 * N):
            step(model, opt, rank, n, True, inject=(n == N + 1 and rank == 1))
        res[setup] = {"at_n": at_n, "amp_n": amp_n, "at_2n": snapshot(p.full_tensor() for p in model.parameters()),
                      "amp_2n": _amp_snapshot(), "stats": (ampkit.stats(opt).steps, ampkit.stats(opt).skipped)}  # fmt: skip
        ampkit.reset()
    return res


def job_dcp_resume(rank: int, world: int, outdir: Path) -> dict:
    """Fresh processes (any world size): load the checkpoint of job_dcp_save, check the
    weights are those at N, run steps N..2N on this world's ranks."""
    import ampkit

    src = Path(os.environ["AMPKIT_TEST_CKPT"])
    res: dict[str, Any] = {}
    for setup in CKPT_SETUPS:
        model, opt = build(setup)
        _dcp_load(model, opt, src / setup)
        loaded = snapshot(p.full_tensor() for p in model.parameters())
        amp_loaded = _amp_snapshot()
        losses = [step(model, opt, rank, n, True, inject=(n == N + 1 and rank == 1 % world)) for n in range(N, 2 * N)]
        res[setup] = {"loaded": loaded, "amp_loaded": amp_loaded, "losses": losses,
                      "at_2n": snapshot(p.full_tensor() for p in model.parameters()), "amp_2n": _amp_snapshot(),
                      "stats": (ampkit.stats(opt).steps, ampkit.stats(opt).skipped)}  # fmt: skip
        ampkit.reset()
    return res


class Payload:
    """Creates the file ``marker`` when fully unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def _rehash(folder: Path) -> None:
    """What an attacker who edits files also does: every file's checksum anew."""
    import hashlib
    import json

    for f in folder.glob("ampkit_checksums_*.json"):
        f.unlink()
    sums = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in folder.iterdir()}
    (folder / "ampkit_checksums_0.json").write_text(json.dumps({"format": 1, "sha256": sums}))


def job_dcp_corrupt(rank: int, world: int, outdir: Path) -> dict:
    """Loading a checkpoint whose shard files are truncated or changed (a flipped bit in
    rank 1's file), whose ampkit entries hold a NaN compensation, whose rank-1 shard holds
    a NaN weight or a negative second moment, that another level saved, or that carries a
    pickled payload (in .metadata or as a hyperparameter) raises on every rank; the payload
    never runs; ampkit's state (scaler, counters, compensation) and the weights are as
    before the load."""
    import copy
    import pickle
    import shutil

    import torch.distributed.checkpoint as dcp

    import ampkit
    from ampkit.distributed.checkpoint import AmpState

    class Poisoned(AmpState):
        def state_dict(self) -> dict:
            out = super().state_dict()
            key = next(k for k in sorted(out) if "compensation/buffers" in k and k.endswith("/2"))
            out[key].to_local().view(-1)[0] = float("nan")
            return out

    res: dict[str, Any] = {}
    other, other_opt = build("O1-fp16")  # another level's and dtype's checkpoint
    step(other, other_opt, rank, 0, True)
    ampkit.distributed.save_checkpoint(outdir / "other_level", other, other_opt)
    ampkit.reset()
    model, opt = build("O2K")
    for n in range(2):
        step(model, opt, rank, n, True)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ampkit.distributed.dcp_files import write_checksums

    ampkit.distributed.save_checkpoint(outdir / "good", model, opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    marker = outdir / "payload_ran"
    hostile = copy.copy(optim_sd)
    hostile["param_groups"] = [dict(g, lr=Payload(marker)) for g in optim_sd["param_groups"]]
    dcp.save({"model": model_sd, "optim": hostile, "amp": AmpState()}, checkpoint_id=str(outdir / "payload_lr"))
    write_checksums(outdir / "payload_lr", rank, rank == 0)
    negative = {"state": {k: dict(v) for k, v in optim_sd["state"].items()}, "param_groups": optim_sd["param_groups"]}
    if rank == 1:  # one rank's shard only: every rank must refuse
        first = next(iter(negative["state"].values()))
        first["exp_avg_sq"] = first["exp_avg_sq"].clone()
        first["exp_avg_sq"].to_local().view(-1)[0] = -1.0
    dcp.save({"model": model_sd, "optim": negative, "amp": AmpState()}, checkpoint_id=str(outdir / "negative"))
    write_checksums(outdir / "negative", rank, rank == 0)
    dist.barrier()
    if rank == 0:
        shutil.copytree(outdir / "good", outdir / "flipped")
        data = outdir / "flipped" / "__1_0.distcp"  # read by rank 1 alone
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
        shutil.copytree(outdir / "good", outdir / "payload_meta")
        meta = outdir / "payload_meta" / ".metadata"
        md = pickle.loads(meta.read_bytes())
        md.planner_data = {**md.planner_data, "x": Payload(marker)}
        meta.write_bytes(pickle.dumps(md))
        _rehash(outdir / "payload_meta")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "amp": Poisoned()}, checkpoint_id=str(outdir / "nan"))
    poisoned_weight = {k: v.clone() for k, v in model_sd.items()}
    if rank == 1:  # in one rank's shard only: every rank must refuse
        poisoned_weight["head.weight"].to_local().view(-1)[0] = float("nan")
    dcp.save({"model": poisoned_weight, "optim": optim_sd, "amp": AmpState()}, checkpoint_id=str(outdir / "nan_weight"))
    if rank == 0:
        shutil.copytree(outdir / "good", outdir / "truncated")
        for f in (outdir / "truncated").glob("*.distcp"):
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    dist.barrier()
    step(model, opt, rank, 2, True)  # the state differs from every checkpoint now
    before = _amp_snapshot()
    weights = snapshot(p.detach().to_local() for p in model.parameters())
    for name in ("truncated", "nan", "nan_weight", "other_level", "payload_lr", "negative", "flipped", "payload_meta"):
        try:
            _dcp_load(model, opt, outdir / name)
            res[name] = "loaded"
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            res[name] = f"{type(e).__name__}: {str(e)[:600]}"
        res[f"{name}_kept"] = bitwise_equal(before, _amp_snapshot())
        res[f"{name}_weights_kept"] = bitwise_equal(weights, snapshot(p.detach().to_local() for p in model.parameters()))
    res["payload_ran"] = marker.exists()
    _dcp_load(model, opt, outdir / "good")  # a good one still loads
    res["good_loaded"] = (ampkit.stats(opt).steps, ampkit.stats(opt).skipped)
    ampkit.reset()
    return res


def job_doctor(rank: int, world: int, outdir: Path) -> dict:
    """fp16 O2 under FSDP2 with the doctor on: from step 2, rank 1's second block's first
    MLP layer overflows fp16. Every rank skips those steps; rank 0's report names the
    module and rank 1."""
    import ampkit

    model, opt = build("O2-fp16")
    layer = model.blocks[1].mlp[0]

    def blow_up(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out * 1e6

    with ampkit.doctor(opt, every=1) as doctor:
        for n in range(4):
            handle = layer.register_forward_hook(blow_up) if (rank == 1 and n >= 2) else None
            step(model, opt, rank, n, True)
            if handle is not None:
                handle.remove()
    doc = doctor.report().to_dict()
    stats = (ampkit.stats(opt).steps, ampkit.stats(opt).skipped)
    ampkit.reset()
    return {"report": doc, "stats": stats}


def _sweep_cases(state: dict, rank: int, model: nn.Module) -> list[tuple[str, str, Any]]:
    """(name, kind, mutated state) per corruption of one entry: a tensor's first element (in
    rank 1's shard alone for a sharded one) set to -1, 1e38, NaN or inf in turn; a non-tensor
    entry replaced by a string, NaN or -1. The kind (:func:`_sweep_kind`) is what the case
    exercises."""
    out: list[tuple[str, str, Any]] = []

    def walk(tree: Any, path: tuple) -> None:
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, (*path, k))
            return
        if isinstance(tree, list) and not all(isinstance(v, (int, float, str)) for v in tree):
            for i, v in enumerate(tree):
                walk(v, (*path, i))
            return
        if path[-1] == "params":
            return
        if isinstance(tree, torch.Tensor):
            if not tree.is_floating_point():
                return
            bad = (-1.0, 1e38, float("nan"), float("inf"))[len(out) % 4]  # one a tensor, in turn: the suite's time
            out.append((f"{'.'.join(map(str, path))}={bad}", _sweep_kind(model, path, bad),
                        _replaced(state, path, _poisoned(tree, bad, rank))))  # fmt: skip
        else:  # the same on every rank: one case per entry name (the single-process sweep
            # of test_checkpoint_sweep.py tries each bad value of each), its bad value drawn
            for bad in ("0.1", float("nan"), -1.0):
                out.append((f"{'.'.join(map(str, path))}={bad!r}", _sweep_kind(model, path, None),
                            _replaced(state, path, bad)))  # fmt: skip

    walk(state, ())
    return out


def _sweep_kind(model: nn.Module, path: tuple, bad: Any) -> str:
    """What a corruption exercises: the section (model, optim, amp), the type of the layer
    a model entry or optimizer state belongs to (Linear, LayerNorm, Embedding), the entry's
    own name with its indices dropped (``weight``, ``exp_avg_sq``, ``lr``,
    ``trainers/#/scalers/#/scale``) and the bad value (``None``: any). Entries that differ
    only in which layer of a type or which index they belong to are the same kind."""
    fqn = path[1] if path[0] == "model" else path[2] if path[:2] == ("optim", "state") else None
    layer = type(model.get_submodule(fqn.rsplit(".", 1)[0])).__name__ if fqn else "-"
    entry = re.sub(r"\d+", "#", str(path[-1]).rsplit(".", 1)[-1])
    return f"{path[0]} {layer} {entry}={bad!r}"


def _sampled(cases: list[tuple[str, str, Any]], seed: int = 0) -> list[tuple[str, str, Any]]:
    """One case of every kind, drawn with a fixed seed (the same on every rank): the sweep's
    time goes to kinds, not to the layers that repeat one."""
    by_kind: dict[str, list[tuple[str, str, Any]]] = {}
    for case in cases:
        by_kind.setdefault(case[1], []).append(case)
    rng = random.Random(seed)
    return [rng.choice(group) for group in by_kind.values()]


def _poisoned(t: torch.Tensor, bad: float, rank: int) -> torch.Tensor:
    out = t.clone()
    local = out.to_local() if hasattr(out, "to_local") else out
    if local.numel() and (rank == 1 or not hasattr(out, "to_local")):
        local.view(-1)[0] = bad
    return out


def _replaced(tree: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {**tree, head: _replaced(tree[head], rest, value)}
    items = list(tree)
    items[head] = _replaced(items[head], rest, value)
    return items


def job_dcp_sweep(rank: int, world: int, outdir: Path) -> dict:
    """The floating entries of an O2K checkpoint (model, optimizer, ampkit) corrupted (in
    rank 1's shard alone where sharded) and the non-tensor entries replaced, one case of
    every kind (:func:`_sweep_kind`, drawn with a fixed seed), saved with fresh checksums,
    loaded on both ranks: each is refused by every rank with nothing changed, or accepted
    and the next step leaves every value finite."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ampkit
    from ampkit.distributed.checkpoint import AmpState
    from ampkit.distributed.dcp_files import write_checksums

    model, opt = build("O2K")
    for n in range(2):
        step(model, opt, rank, n, True)
    ampkit.distributed.save_checkpoint(outdir / "good", model, opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "amp": AmpState().state_dict()}
    every = _sweep_cases(state, rank, model)
    cases = _sampled(every)
    counts = {"cases": 0, "refused": 0, "accepted": 0, "entries": len(every)}
    raw, changed, harmful = [], [], []
    for i, (name, _, mutated) in enumerate(cases):
        folder = outdir / f"case{i}"
        dcp.save(mutated, checkpoint_id=str(folder))
        write_checksums(folder, rank, rank == 0)
        dist.barrier()
        counts["cases"] += 1
        before = _local_state(model, opt) + _amp_snapshot(local=True)
        try:
            _dcp_load(model, opt, folder)
        except ampkit.AmpError:
            counts["refused"] += 1
            if not bitwise_equal(before, _local_state(model, opt) + _amp_snapshot(local=True)):
                changed.append(name)
            continue
        except BaseException as e:  # noqa: BLE001 - counted: must be none
            raw.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
            continue
        counts["accepted"] += 1
        step(model, opt, rank, 9, True)
        if not all(bool(torch.isfinite(t).all()) for t in _local_state(model, opt) if t.is_floating_point()):
            harmful.append(name)
        _dcp_load(model, opt, outdir / "good")
    ampkit.reset()
    return {**counts, "raw": raw, "changed": changed, "harmful": harmful, "kinds": sorted({k for _, k, _ in every}),
            "swept": sorted(k for _, k, _ in cases)}  # fmt: skip


def job_refusals(rank: int, world: int, outdir: Path) -> dict:
    """What FSDP2 cannot do is refused before anything changes: O2K's stochastic rounding
    and optimizers without a one-pass update; torch's own fully_shard at O2; a level other
    than the one the model was sharded for; and a DCP save while ampkit's state differs
    between ranks (DCP would keep one rank's copy for all)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import ampkit

    def sharded(level: str = "O2K") -> nn.Module:
        torch.manual_seed(0)
        return ampkit.distributed.fully_shard(TinyLM(), opt_level=level)

    def refused(fn: Callable[[], Any]) -> str:
        try:
            fn()
        except ampkit.AmpError as e:
            return f"{type(e).__name__}: {e}"
        return "accepted"

    res: dict[str, Any] = {}
    m = sharded()
    res["stochastic"] = refused(lambda: ampkit.initialize(m, torch.optim.AdamW(m.parameters()), opt_level="O2K",
                                                          compensation="stochastic"))  # fmt: skip
    m = sharded()
    res["rmsprop"] = refused(lambda: ampkit.initialize(m, torch.optim.RMSprop(m.parameters()), opt_level="O2K"))
    m = sharded("O2")
    res["other_level"] = refused(lambda: ampkit.initialize(m, torch.optim.AdamW(m.parameters()), opt_level="O3"))
    torch.manual_seed(0)
    m = TinyLM()
    for block in m.blocks:
        torch_fully_shard(block)
    torch_fully_shard(m)
    res["torch_sharded"] = refused(lambda: ampkit.initialize(m, torch.optim.AdamW(m.parameters()), opt_level="O2"))
    res["fp32_only"] = refused(lambda: ampkit.distributed.fully_shard(TinyLM().bfloat16(), opt_level="O2"))
    for level in ("O1", "O2"):  # an optimizer built before sharding would step stale tensors
        m = TinyLM()
        early = torch.optim.AdamW(m.parameters())
        ampkit.distributed.fully_shard(m, opt_level=level)
        res[f"opt_first_{level}"] = refused(lambda m=m, early=early, level=level: ampkit.initialize(
            m, early, opt_level=level))  # fmt: skip
    ampkit.reset()
    # rank 0's ampkit.state_dict() file loaded on every rank: O2K's DTensor compensation is
    # rank 0's shards; rank 1 refuses it (DCP checkpoints reshard)
    model, opt = build("O2K")
    step(model, opt, rank, 0, True)
    if rank == 0:
        torch.save(ampkit.state_dict(), outdir / "amp0.pt")
    dist.barrier()
    try:
        loaded = torch.load(outdir / "amp0.pt", weights_only=True)
        res["rank0_file"] = refused(lambda: ampkit.load_state_dict(loaded))
    except Exception as e:  # noqa: BLE001 - what torch.load says about a DTensor, for the record
        res["rank0_file"] = f"torch.load: {type(e).__name__}: {str(e)[:200]}"
    ampkit.reset()
    model, opt = build("O2-fp16")
    step(model, opt, rank, 0, True)
    if rank == 1:  # ampkit's state now differs between the ranks
        state = ampkit.state_dict()
        state["trainers"][0]["scalers"][0]["scale"] = 1024.0
        ampkit.load_state_dict(state)
    res["differing_state"] = refused(lambda: ampkit.distributed.save_checkpoint(outdir / "ckpt", model, opt))
    ampkit.reset()
    return res


def job_accumulate(rank: int, world: int, outdir: Path) -> dict:
    """Two micro-batches per step, the first without FSDP2's reduce-scatter
    (``set_requires_gradient_sync(False)``): each level against FSDP2's fp32 run doing the
    same, and a NaN loss in rank 1's unsynced micro-batch skips the step on both ranks."""
    import ampkit

    res: dict[str, Any] = {}
    for setup in ("fp32", "O1", "O2", "O2K", "O2-fp16"):
        model, opt = build(setup)
        on = SETUPS[setup][0] is not None
        losses, skipped = [], []
        for n in range(20):
            opt.zero_grad()
            total = 0.0
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)
                x, y = batch(rank, 2 * n + micro)
                loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1)) / 2
                if on and n == 5 and micro == 0 and rank == 1:  # a NaN in the unsynced micro-batch
                    loss = loss * float("nan")
                if on:
                    with ampkit.scale_loss(loss, opt) as scaled:
                        scaled.backward()
                else:
                    loss.backward()
                total += loss.item()
            if on or n != 5:  # the fp32 reference leaves out the step the others skip
                opt.step()
            skipped.append(ampkit.step_skipped(opt) if on else False)
            losses.append(total)
        res[setup] = {"losses": losses, "skipped": skipped,
                      "finite": all(bool(torch.isfinite(p.detach().to_local()).all()) for p in model.parameters())}  # fmt: skip
        if on:
            ampkit.reset()
    return res


def job_unscale(rank: int, world: int, outdir: Path) -> dict:
    """fp16 O2 under FSDP2: the sharded grads hold scale x grad after backward;
    ``amp.unscale`` makes them real (their norm that of FSDP2's fp32 run, to fp16
    rounding), and stepping after it is bitwise stepping without it."""
    import ampkit

    def grad_norm(model: nn.Module) -> float:
        return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))

    res: dict[str, Any] = {}
    ref, ref_opt = build("fp32")
    x, y = batch(rank, 0)
    F.cross_entropy(ref(x).float().reshape(-1, VOCAB), y.reshape(-1)).backward()
    res["fp32_norm"] = grad_norm(ref)
    finals = []
    for unscale_first in (False, True):
        model, opt = build("O2-fp16")
        for n in range(3):
            x, y = batch(rank, n)
            opt.zero_grad()
            with ampkit.scale_loss(F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1)), opt) as s:
                s.backward()
            if n == 0:
                res["scaled_norm" if not unscale_first else "before_unscale"] = grad_norm(model)
            if unscale_first:
                ampkit.unscale(opt)
                if n == 0:
                    res["unscaled_norm"] = grad_norm(model)
            opt.step()
        finals.append(snapshot(p.detach().to_local() for p in model.parameters()))
        ampkit.reset()
    res["same_steps"] = bitwise_equal(finals[0], finals[1])
    return res


JOBS: dict[str, Callable[[int, int, Path], dict]] = {
    "unscale": job_unscale,
    "accumulate": job_accumulate,
    "refusals": job_refusals,
    "doctor": job_doctor,
    "train": job_train, "skip": job_skip, "dcp_save": job_dcp_save, "dcp_resume": job_dcp_resume,
    "dcp_corrupt": job_dcp_corrupt,
    "dcp_sweep": job_dcp_sweep,
}  # fmt: skip


if __name__ == "__main__":
    import _dist_workers

    _dist_workers.JOBS.update(JOBS)
    # a longer collective timeout than the DDP jobs': 4 ranks compiling O2K's kernel on 2 cores
    code = _dist_workers.main(sys.argv[1:], timeout_s=90)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo may abort at interpreter teardown after all work is done
