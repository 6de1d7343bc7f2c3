"""Gradient accumulation and an LR scheduler: micro-batches whose losses are divided by
the accumulation count, one optimizer step and one scheduler step per accumulation
cycle. Knows nothing of mixed precision. INJECT_INF_AT=K (environment) makes one
micro-batch loss of optimizer step K infinite, as a real overflow would."""

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=80, help="optimizer steps")
parser.add_argument("--accum", type=int, default=4)
parser.add_argument("--micro", type=int, default=32)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
inject = int(os.environ.get("INJECT_INF_AT", "-1"))

torch.manual_seed(args.seed)
classes, dim = 5, 12
centers = torch.randn(classes, dim)


def sample(n, gen):
    y = torch.randint(0, classes, (n,), generator=gen)
    return centers[y] + 0.9 * torch.randn(n, dim, generator=gen), y


model = nn.Sequential(nn.Linear(dim, 48), nn.GELU(), nn.Linear(48, classes))
optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-4)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
gen = torch.Generator().manual_seed(1)
opt_step = 0
micro_step = 0
optimizer.zero_grad()
while opt_step < args.steps:
    x, y = sample(args.micro, gen)
    loss = F.cross_entropy(model(x), y) / args.accum
    if opt_step == inject and micro_step % args.accum == 1:
        loss = loss * float("inf")
    loss.backward()
    micro_step += 1
    if micro_step % args.accum == 0:
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        opt_step += 1

x, y = sample(4000, torch.Generator().manual_seed(2))
with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
print(f"final_lr {scheduler.get_last_lr()[0]:.6g}")
print(f"METRIC accuracy {accuracy:.5f}")
