"""torch's AMP recipe without autocast: a script that owns a torch.amp.GradScaler,
unscales before clipping and steps through the scaler; --opt sgd|adamw. Prints each
step's loss, the grad norm clip_grad_norm_ saw and whether the scaler skipped the step.
Knows nothing of ampkit."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--opt", choices=["sgd", "adamw"], default="sgd")
parser.add_argument("--init-scale", type=float, default=2.0**16)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
if args.opt == "sgd":
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale)
teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
gen = torch.Generator().manual_seed(1)
skips = 0
for step in range(args.steps):
    x = torch.randn(64, 16, generator=gen)
    y = (x @ teacher).argmax(1)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < before
    skips += skipped
    print(f"step {step} loss {loss.item():.6g} norm {norm.item():.6g} skipped {int(skipped)}")
print(f"SKIPS {skips}")
print(f"METRIC loss {loss.item():.6g}")
