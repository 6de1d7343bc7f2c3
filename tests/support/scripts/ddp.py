"""A DistributedDataParallel loop for torchrun (gloo): the model wrapped before its
optimizer is built, as most DDP scripts do. Prints each rank's last loss and whether the
ranks' weights agree. Knows nothing of mixed precision."""

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(rank)
for _ in range(30):
    x = torch.randn(32, 16, generator=gen)
    y = x[:, :4].argmax(1)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
weight = model.module[0].weight.detach().clone()
dist.all_reduce(weight)
print(f"rank {rank} loss {loss.item():.4f} weights_agree {torch.equal(weight / 2, model.module[0].weight)}")
dist.destroy_process_group()
