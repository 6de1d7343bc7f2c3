"""A script that keeps one computation in fp32 on purpose, as numerically careful code
does: a head whose logits are large and nearly equal (a big constant offset added
before a log-softmax over many classes), called from the training loop inside
torch.autocast("cpu", enabled=False); the body is an ordinary MLP. In bf16 the offset
swallows the logits' differences (8 bits of mantissa), so the script asks for fp32
there. --island-inside moves the disabled region into the model's forward instead.
Knows nothing of ampkit."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=120)
parser.add_argument("--island-inside", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
classes, dim = 10, 16
centers = torch.randn(classes, dim)


def sample(n, gen):
    y = torch.randint(0, classes, (n,), generator=gen)
    return centers[y] + 0.8 * torch.randn(n, dim, generator=gen), y


class Head(nn.Module):
    """Logits around a large offset (a calibrated energy, in the bias): fp32 keeps their
    spread; a bf16 matmul rounds them to steps of 2."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, classes)
        nn.init.constant_(self.proj.bias, 300.0)

    def forward(self, h):
        return self.proj(h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 32), nn.Tanh())
        self.head = Head()

    def forward(self, x):
        h = self.body(x)
        if args.island_inside:
            with torch.autocast("cpu", enabled=False):
                return self.head(h.float())
        return h


model = Net()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
gen = torch.Generator().manual_seed(1)


def logits_of(x):
    h = model(x)
    if args.island_inside:
        return h
    with torch.autocast("cpu", enabled=False):
        return model.head(h.float())


for _ in range(args.steps):
    x, y = sample(64, gen)
    loss = F.cross_entropy(logits_of(x) - 300.0, y)
    opt.zero_grad()
    loss.backward()
    opt.step()

x, y = sample(2000, torch.Generator().manual_seed(2))
with torch.no_grad():
    test_loss = F.cross_entropy(logits_of(x) - 300.0, y).item()
print(f"METRIC test_loss {test_loss:.5f}")
