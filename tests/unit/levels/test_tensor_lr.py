"""A tensor learning rate (``Adam(lr=torch.tensor(1e-3))``, which plain torch trains with)
at the levels whose fast kernels step Adam with ``foreach=True`` (O3, and O2K off the CPU;
on the CPU O2K's fp32 rest is fused): torch's foreach Adam refuses a tensor lr, so the
update runs with the lr's value as a float, bitwise the run built with that float, and the
user's tensor stays in the param group."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from torch import nn

import ampkit


def _train(level: str, opt_cls: type[torch.optim.Optimizer], lr: float | torch.Tensor, steps: int = 3):
    ampkit.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))  # the norm stays fp32 at O2K
    opt = opt_cls(model.parameters(), lr=lr, weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = ampkit.initialize(model, opt, opt_level=level, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        opt.zero_grad()
        with ampkit.scale_loss(model(x).float().pow(2).mean(), opt) as loss:
            loss.backward()
        opt.step()
    state = [v for _, s in sorted(opt.state_dict()["state"].items()) for _, v in sorted(s.items())]
    return [p.detach().clone() for p in model.parameters()] + state, opt


@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("level", ["O2K", "O3"])
def test_a_tensor_lr_trains_bitwise_like_its_float(level, opt_cls, lr_dtype):
    lr = torch.tensor(1e-3, dtype=lr_dtype)
    got, opt = _train(level, opt_cls, lr)
    # O3: foreach, the kernel that refuses a tensor lr; O2K on the CPU: its fp32 rest fused
    kernel = "fused" if level == "O2K" and opt.param_groups[0]["params"][0].device.type == "cpu" else "foreach"
    assert all(g.get(kernel) for g in opt.param_groups), [(g.get("foreach"), g.get("fused")) for g in opt.param_groups]
    assert all(g["lr"] is lr for g in opt.param_groups)  # the user's tensor, after every step
    want, _ = _train(level, opt_cls, lr.item())
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_step_sees_a_float_the_tensor_is_put_back_when_it_raises_and_a_scheduler_moves_it(monkeypatch):
    lr = torch.tensor(1e-2)
    ampkit.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = ampkit.initialize(model, opt, opt_level="O3", dtype=torch.bfloat16)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(4, 8)
    seen = []

    def refuse(*args, lr, **kwargs):
        seen.append(lr)
        raise RuntimeError("this update fails")

    monkeypatch.setattr(importlib.import_module("torch.optim.adam"), "_multi_tensor_adam", refuse)
    opt.zero_grad()
    with ampkit.scale_loss(model(x).float().sum(), opt) as loss:
        loss.backward()
    with pytest.raises(RuntimeError, match="this update fails"):
        opt.step()
    assert seen == [lr.item()] and type(seen[0]) is float  # torch's foreach Adam got a float
    assert opt.param_groups[0]["lr"] is lr
    monkeypatch.undo()
    opt.zero_grad()
    with ampkit.scale_loss(model(x).float().sum(), opt) as loss:
        loss.backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(5e-3)
