"""A plain fp32 training script -- no ampkit in it -- for ``ampkit run``:

    ampkit run examples/plain_digits.py                      # O1 bf16, summary on stderr
    ampkit run --level O2 --report run.json examples/plain_digits.py --steps 300
    ampkit run --compare examples/plain_digits.py --steps 300   # fp32 vs O1 side by side
    python examples/plain_digits.py                           # the script as it is

An MLP on scikit-learn's 8x8 digits with Adam, a cosine LR schedule and a held-out
accuracy at the end (needs scikit-learn: pip install scikit-learn, or ampkit's cli
extra: pip install -e '.[cli]' in ampkit's clone).
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
perm = torch.randperm(len(x))
train_idx, test_idx = perm[:1400], perm[1400:]

model = nn.Sequential(
    nn.Linear(64, 256), nn.ReLU(), nn.LayerNorm(256),
    nn.Linear(256, 256), nn.ReLU(),
    nn.Linear(256, 10),
)
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

for step in range(args.steps):
    idx = train_idx[torch.randint(len(train_idx), (args.batch_size,))]
    loss = F.cross_entropy(model(x[idx]), y[idx])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    if step % 100 == 0 or step == args.steps - 1:
        print(f"step {step:4d}  loss {loss.item():.4f}")

model.eval()
with torch.no_grad():
    accuracy = (model(x[test_idx]).argmax(1) == y[test_idx]).float().mean().item()
print(f"test accuracy {accuracy:.4f}")
