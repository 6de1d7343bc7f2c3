"""A script that already does mixed precision itself, as the PyTorch AMP recipe writes it:
torch.autocast around the forward and the loss, torch.amp.GradScaler around backward and
step, switched by --amp. Knows nothing of ampkit."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--amp", action="store_true", help="torch.autocast(bf16) + GradScaler")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
device = "cpu"
w_true = torch.randn(24, 1)


def batch(n, gen):
    x = torch.randn(n, 24, generator=gen)
    y = (x @ w_true + 0.1 * torch.randn(n, 1, generator=gen) > 0).float()
    return x, y


model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scaler = torch.amp.GradScaler(device, enabled=args.amp)
gen = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = batch(128, gen)
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=args.amp):
        out = model(x)
        loss = F.binary_cross_entropy_with_logits(out, y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    scaler.step(opt)
    scaler.update()
    if step % 100 == 0:
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale() if args.amp else 1.0}")

x, y = batch(4000, torch.Generator().manual_seed(2))
with torch.no_grad():
    accuracy = ((model(x) > 0).float() == y).float().mean().item()
print(f"METRIC accuracy {accuracy:.5f}")
