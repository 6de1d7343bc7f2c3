"""A plain Hugging Face Accelerate training loop (fp32, ``mixed_precision="no"``): a small
MLP regressing a random teacher, AdamW, a per-step LR schedule prepared by Accelerate,
``accelerator.backward`` and ``accelerator.clip_grad_norm_``. Knows nothing of mixed
precision; prints ``METRIC final_loss <mean of the last 10 losses>``.

``build()`` and ``train()`` are importable so the same loop can run under
``ampkit.integrations.accelerate`` (tests/integrations/test_integration_accelerate.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

STEPS = 60
BATCH = 32


def _make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """512 inputs and the standardized outputs of a random tanh teacher, computed once at
    import (before any mixed precision is set up: the targets are fp32 in every run)."""
    g = torch.Generator().manual_seed(123)
    x = torch.randn(512, 16, generator=g)
    w1, b1 = torch.randn(16, 32, generator=g), torch.randn(32, generator=g)
    w2, b2 = torch.randn(32, 4, generator=g), torch.randn(4, generator=g)
    y = torch.tanh(x @ w1 + b1) @ w2 + b2
    return x, (y - y.mean(0)) / y.std(0)


_DATA = _make_data()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    return _DATA


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.99**s)
    return model, opt, sched


def train(
    accelerator,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched,
    backward: Callable[[torch.Tensor], None],
    steps: int = STEPS,
) -> list[float]:
    x_all, y_all = data()
    losses = []
    for step in range(steps):
        i = (step * BATCH) % len(x_all)
        x, y = x_all[i : i + BATCH], y_all[i : i + BATCH]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    from accelerate import Accelerator

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    model, opt, sched = build()
    model, opt, sched = accelerator.prepare(model, opt, sched)
    losses = train(accelerator, model, opt, sched, accelerator.backward)
    print(f"METRIC final_loss {sum(losses[-10:]) / 10:.6f}")
