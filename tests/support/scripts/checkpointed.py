"""torch.utils.checkpoint around a whole model call, both kinds (the non-reentrant one
stops its recomputation early by raising through the module calls). Knows nothing of
ampkit."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for reentrant in (False, True, False):
    x = torch.randn(4, 8, requires_grad=reentrant)
    out = checkpoint(model, x, use_reentrant=reentrant)
    out.pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    print("out", out.dtype)
