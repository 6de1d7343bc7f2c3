"""A small fp16 training run that goes wrong, for ``ampkit doctor``.

    ampkit doctor examples/doctor_demo.py                 # the report: which op overflowed, and the fix
    ampkit doctor --png docs/doctor-example.png examples/doctor_demo.py
    python examples/doctor_demo.py --fix                   # the advice applied: trains without skips

The last attention block attends to the raw residual stream (no LayerNorm in front):
from step ``--shift`` on the inputs come 30x larger (a feature whose units changed) and
its attention scores ``q @ k.T`` exceed fp16's 65504, so every step overflows and is
skipped. The script itself is an ordinary ampkit loop (no doctor
code): run it under ``ampkit doctor`` (or with ``AMPKIT_DOCTOR=1``) to see why.
fp16 on CPU is slow, so the model is tiny.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        return self.out(torch.softmax(scores, dim=-1) @ v)


class Block(nn.Module):
    def __init__(self, d: int, prenorm: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d) if prenorm else nn.Identity()
        self.attn = Attention(d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        # the last block attends to the raw residual stream (no LayerNorm in front)
        self.blocks = nn.ModuleList(Block(d, prenorm=i < layers - 1) for i in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)
        with torch.no_grad():  # and sharply: queries and keys start out aligned and large
            attn = self.blocks[-1].attn
            attn.q.weight.mul_(8.0)
            attn.k.weight.copy_(attn.q.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(1))


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--shift", type=int, default=20, help="step from which the inputs are 30x larger")
    p.add_argument("--fix", action="store_true", help="run the attention module in fp32 (the doctor's advice)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="ampkit: float16 on CPU")
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp.init_trainer(opt)  # dynamic loss scale, starting at 2**16
    rules = {"blocks.1.attn": torch.float32} if args.fix else {}  # the doctor's advice
    policy = amp.Policy(dtype=torch.float16, module_rules=rules)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(args.steps):
        scale = 30.0 if step >= args.shift else 1.0  # e.g. a feature whose units changed
        x = torch.randn(8, 6, 8, generator=g)
        y = x[:, :, :4].mean(1)
        x = x * scale
        with amp.autocast(policy, device_type="cpu"):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    stats = amp.stats(opt)
    print(f"{stats.steps} steps, {stats.skipped} skipped, loss scale {stats.scales[0]:g}, "
          f"last loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
