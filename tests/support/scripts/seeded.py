"""A seeded script: seeds torch, random and numpy, trains a few steps on data drawn from
the three global generators (and a dropout layer), then prints a digest of each
generator's state. Knows nothing of ampkit."""

import hashlib
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    x = torch.randn(8, 16) + torch.from_numpy(np.random.standard_normal((8, 16)).astype(np.float32))
    y = torch.tensor([random.randrange(4) for _ in range(8)])
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


state = np.random.get_state()
print("RNG torch", digest(torch.get_rng_state().numpy().tobytes()))
print("RNG random", digest(repr(random.getstate()).encode()))
print("RNG numpy", digest(state[1].tobytes() + repr(state[2:]).encode()))
print(f"METRIC loss {loss.item():.6g}")
