"""A plain PyTorch Lightning classifier: an MLP (with a LayerNorm) on synthetic Gaussian
clusters, AdamW with a per-step warm-up/decay schedule, fp32 ``Trainer`` on the CPU, the
cross-entropy on a held-out set at the end. Knows nothing of mixed precision.

Importable too: :func:`build` (the model and the loaders) and :func:`heldout_loss` let a
test train the same model under another precision plugin."""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CLASSES, DIM = 8, 16


def clusters(n: int, seed: int) -> TensorDataset:
    centers = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(1234)) * 1.2
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = centers[y] + torch.randn(n, DIM, generator=g)
    return TensorDataset(x, y)


class Classifier(pl.LightningModule):
    def __init__(self, lr: float = 3e-3, warmup: int = 10, total: int = 200):
        super().__init__()
        self.lr, self.warmup, self.total = lr, warmup, total
        self.net = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

        def schedule(step):
            return min(1.0, (step + 1) / self.warmup) * max(0.1, 1 - step / self.total)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def build(seed: int = 0, batch: int = 32, total: int = 200):
    """(model, train loader, held-out set) for ``seed``."""
    torch.manual_seed(seed)
    model = Classifier(total=total)
    train = DataLoader(clusters(2048, seed=1), batch_size=batch, shuffle=False)
    return model, train, clusters(2000, seed=2)


def heldout_loss(model, data) -> float:
    x, y = data.tensors
    model.eval()
    with torch.no_grad():
        return F.cross_entropy(model(x).float(), y).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--root", default=None, help="the Trainer's default_root_dir")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, train, heldout = build(total=args.steps)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.root,
    )
    trainer.fit(model, train)
    print(f"METRIC heldout_loss {heldout_loss(model, heldout):.6f}")


if __name__ == "__main__":
    main()
