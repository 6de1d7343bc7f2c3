"""Bytes per parameter per rank under FSDP2, at each ampkit level, beside FSDP2's own
mixed precision and fp32.

A causal transformer (``--d-model``, ``--layers``) is sharded over ``--world`` gloo
processes on this machine, trained two AdamW steps per arm, and each rank counts the
bytes of the tensors a training run keeps between steps, exactly (local shards of
DTensors): the sharded parameters, their grads, the optimizer state and ampkit's own
(O2K's compensation). Arms: ``fp32`` (FSDP2 alone), ``fsdp2-bf16`` (FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ampkit at O0 for the skip
rule), and ampkit's ``O1``, ``O2``, ``O2K``, ``O3`` through
``ampkit.distributed.fully_shard``. Reported: bytes per parameter of the whole model on
one rank (so about 16 / world for fp32 AdamW), and each arm against ``fsdp2-bf16``.
The gathered (unsharded) parameters of the unit being computed and the activations
come on top, per step, and are not counted.

    python benchmarks/fsdp_memory.py [--world 2] [--d-model 256] [--layers 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("fp32", "fsdp2-bf16", "O1", "O2", "O2K", "O3")


def _worker(rank: int, world: int, port: int, out: str, d_model: int, layers: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import ampkit
    from ampkit._internal.dtypes import local_tensor
    from ampkit.levels.setup import compensation_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    vocab, seq = 256, 32

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            return x + self.mlp(self.ln2(x))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d_model)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.emb(idx)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    rows = {}
    for arm in ARMS:
        torch.manual_seed(0)
        model = LM()
        n_params = sum(p.numel() for p in model.parameters())
        if arm in ("fp32", "fsdp2-bf16"):
            kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
                if arm == "fsdp2-bf16" else {}  # fmt: skip
            for block in model.blocks:
                torch_fully_shard(block, **kw)
            torch_fully_shard(model, **kw)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            if arm == "fsdp2-bf16":
                model, opt = ampkit.initialize(model, opt, opt_level="O0")
        else:
            ampkit.distributed.fully_shard(model, opt_level=arm)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model, opt = ampkit.initialize(model, opt, opt_level=arm)
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            idx = torch.randint(0, vocab, (4, seq + 1), generator=g)
            loss = F.cross_entropy(model(idx[:, :-1]).float().reshape(-1, vocab), idx[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=False)
            if arm == "fp32":
                loss.backward()
            else:
                with ampkit.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            opt.step()

        def nbytes(ts: list[torch.Tensor]) -> int:
            return sum(local_tensor(t).numel() * t.element_size() for t in ts)

        params = list(model.parameters())
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        comp = compensation_of(opt)
        extra = [comp.buffer(p) for p in params if comp.buffer(p) is not None] if comp is not None else []
        counts = {"params": nbytes([p.detach() for p in params]), "grads": nbytes([p.grad for p in params if p.grad is not None]),
                  "optimizer": nbytes(state), "ampkit": nbytes(extra)}  # fmt: skip
        total = sum(counts.values())
        rows[arm] = {**{k: v / n_params for k, v in counts.items()}, "total": total / n_params, "n_params": n_params,
                     "loss": loss.item()}  # fmt: skip
        ampkit.reset()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="gloo processes (default 2)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(int(args.worker[0]), args.world, int(args.worker[1]), args.worker[2], args.d_model, args.layers)
        sys.stdout.flush()
        os._exit(0)  # gloo may abort at interpreter teardown after all work is done
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        base = [sys.executable, __file__, "--world", str(args.world), "--d-model", str(args.d_model),
                "--layers", str(args.layers)]  # fmt: skip
        procs = [subprocess.Popen([*base, "--worker", str(r), str(port), out], env=env) for r in range(args.world)]
        codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            raise SystemExit(f"fsdp_memory: a worker failed (exit codes {codes})")
        rows = json.loads(Path(out).read_text())
    ref = rows["fsdp2-bf16"]["total"]
    n = rows["fp32"]["n_params"]
    print(f"FSDP2 over {args.world} gloo processes, d_model {args.d_model}, {args.layers} layers, {n:,} parameters, "
          "AdamW; bytes per parameter of the model held on one rank between steps")  # fmt: skip
    print(f"{'arm':11} {'params':>7} {'grads':>7} {'optim':>7} {'ampkit':>7} {'total':>7} {'vs fsdp2-bf16':>14}")
    out_rows = []
    for arm in ARMS:
        r = rows[arm]
        r["vs_fsdp2_bf16"] = r["total"] / ref
        out_rows.append({"arm": arm, **r})
        print(f"{arm:11} {r['params']:7.2f} {r['grads']:7.2f} {r['optimizer']:7.2f} {r['ampkit']:7.2f} "
              f"{r['total']:7.2f} {r['vs_fsdp2_bf16']:13.2f}x")  # fmt: skip
    if args.json:
        sys.path.insert(0, str(ROOT / "src"))
        from ampkit.tools.bench.machine import write_record

        write_record(args.json, {"world": args.world, "d_model": args.d_model, "layers": args.layers,
                                 "params": n, "rows": out_rows}, threads=1)  # fmt: skip
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
