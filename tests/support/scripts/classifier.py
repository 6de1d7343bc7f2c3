"""A plain torch.optim classifier: an MLP on synthetic Gaussian clusters, Adam, a
held-out accuracy at the end. Knows nothing of mixed precision."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--clip", type=float, default=None, help="clip the gradient norm to this")
parser.add_argument("--freeze-first", action="store_true", help="leave the first layer out of the optimizer")
args = parser.parse_args()

torch.manual_seed(args.seed)
classes, dim = 8, 16
centers = torch.randn(classes, dim) * 1.2


def sample(n, generator):
    y = torch.randint(0, classes, (n,), generator=generator)
    x = centers[y] + torch.randn(n, dim, generator=generator)
    return x, y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, classes)

    def forward(self, x):
        return self.head(self.body(x))


model = Net()
params = [p for name, p in model.named_parameters() if not (args.freeze_first and name.startswith("body.0."))]
optimizer = torch.optim.Adam(params, lr=args.lr)
train_gen = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x, y = sample(args.batch, train_gen)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if args.clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if step == 0:
            print(f"grad_norm {norm.item():.6f}")
    optimizer.step()
    if step % 100 == 0:
        print(f"step {step} loss {loss.item():.4f}")

model.eval()
x, y = sample(4000, torch.Generator().manual_seed(2))
with torch.no_grad():
    logits = model(x)
accuracy = (logits.argmax(1) == y).float().mean().item()
print(f"METRIC accuracy {accuracy:.5f}")
