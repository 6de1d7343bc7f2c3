"""Prints, line by line, the dtype or autocast state at each place of a small training
loop: inside a forward, outside modules, in backward, in optimizer.step(), in a manual
update, and inside the script's own torch.autocast region. Knows nothing of ampkit."""

import torch
from torch import nn


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc(x)
        print("forward_linear", h.dtype)
        print("forward_autocast", torch.is_autocast_enabled("cpu"))
        return self.out(torch.relu(h))


class LoggingSGD(torch.optim.SGD):
    def step(self, closure=None):
        print("step_autocast", torch.is_autocast_enabled("cpu"))
        return super().step(closure)


torch.manual_seed(0)
model = Probe()
opt = LoggingSGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8)
out = model(x)
print("output", out.dtype)
print("outside_matmul", (x @ x.t()).dtype)
print("outside_autocast", torch.is_autocast_enabled("cpu"))
out.register_hook(lambda g: print("backward_autocast", torch.is_autocast_enabled("cpu")))
loss = out.pow(2).mean()
loss.backward()
print("grad", model.fc.weight.grad.dtype)
opt.step()
with torch.no_grad():
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.1)
    print("manual_update", (model.fc.weight.data @ x.t()).dtype)
with torch.autocast("cpu", dtype=torch.float16):
    y = model(x)
print("script_autocast_output", y.dtype)
print("weight", model.fc.weight.dtype)
