"""One small classifier loop with the variations real scripts write, each behind a flag:
the optimizer built before the model is moved (--opt-first), a new optimizer every epoch
(--opt-per-epoch), the optimizer built lazily after the first backward
(--opt-after-backward), two param groups with different learning rates (--groups), a
checkpoint of model and optimizer saved, reloaded and continued mid-run (--checkpoint
PATH), batches from a torch.utils.data.DataLoader (--loader), model.forward(x) called
directly (--forward-direct), an exception raised in the loop (--raise-at STEP). Knows
nothing of mixed precision."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--opt-first", action="store_true")
parser.add_argument("--opt-per-epoch", action="store_true")
parser.add_argument("--opt-after-backward", action="store_true")
parser.add_argument("--groups", action="store_true")
parser.add_argument("--checkpoint", default=None)
parser.add_argument("--loader", action="store_true")
parser.add_argument("--forward-direct", action="store_true")
parser.add_argument("--raise-at", type=int, default=None)
args = parser.parse_args()

torch.manual_seed(0)
classes, dim, n = 6, 20, 1536
centers = torch.randn(classes, dim)
y_all = torch.randint(0, classes, (n + 2000,))
x_all = centers[y_all] + 1.1 * torch.randn(n + 2000, dim)
x_train, y_train, x_test, y_test = x_all[:n], y_all[:n], x_all[n:], y_all[n:]
device = torch.device("cpu")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.classifier = nn.Linear(64, classes)

    def forward(self, x):
        return self.classifier(self.features(x))


def make_optimizer(model):
    if args.groups:
        return torch.optim.SGD([
            {"params": model.features.parameters()},
            {"params": model.classifier.parameters(), "lr": 0.02},
        ], lr=0.1, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


model = Net()
if args.opt_after_backward:
    optimizer = None
    model.to(device)
elif args.opt_first:
    optimizer = make_optimizer(model)
    model.to(device)
else:
    model.to(device)
    optimizer = make_optimizer(model)

if args.loader:
    batches = DataLoader(TensorDataset(x_train, y_train), batch_size=64, shuffle=True, num_workers=0,
                         generator=torch.Generator().manual_seed(1))
else:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    batches = [(x_train[perm[i:i + 64]], y_train[perm[i:i + 64]]) for i in range(0, n, 64)]

step = 0
for epoch in range(args.epochs):
    if args.opt_per_epoch and epoch > 0:
        optimizer = make_optimizer(model)
    model.train()
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        logits = model.forward(x) if args.forward_direct else model(x)
        loss = F.cross_entropy(logits, y)
        if optimizer is not None:
            optimizer.zero_grad()
        loss.backward()
        if optimizer is None:
            optimizer = make_optimizer(model)
        optimizer.step()
        step += 1
        if args.raise_at is not None and step == args.raise_at:
            raise RuntimeError(f"loader broke at step {step}")
    if args.checkpoint and epoch == args.epochs // 2 - 1:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                   args.checkpoint)
        model = Net().to(device)
        optimizer = make_optimizer(model)
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    print(f"epoch {epoch} loss {loss.item():.4f}")

model.eval()
with torch.no_grad():
    test_loss = F.cross_entropy(model(x_test), y_test).item()
print(f"METRIC test_loss {test_loss:.5f}")
