"""Ends badly on request: --exit N calls sys.exit(N) after one training step;
--raise-in-forward raises from inside a module's forward (a script bug)."""

import argparse
import sys

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--exit", type=int, default=None)
parser.add_argument("--raise-in-forward", action="store_true")
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.fc(x)
        if args.raise_in_forward and self.calls == 2:
            raise ValueError("bad batch")
        return y


model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if args.exit is not None:
        sys.exit(args.exit)
print("done")
