"""Update kernels compiled in the background from ``initialize`` on
(``AMPKIT_COMPILE_AHEAD=1``): the first step takes the kernels built ahead (compiling
none itself, built under the same grad mode), with the results of a compile at the step;
off by default. ``torch.compile`` is replaced by a fake
that records where it ran and returns the eager function (the real compile has tests of
its own)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit.levels import update_kernels as uk


@pytest.fixture
def fake_compile(monkeypatch):
    """Nothing compiled yet, 'compiled' mode, and a ``torch.compile`` that records (the
    kernel function's name, the thread) and returns the op-by-op function."""
    calls: list[tuple[str, str]] = []

    def compile_(fn, **kwargs):
        assert not torch.is_grad_enabled()  # as the step runs them: no recompile for grad mode
        calls.append((fn.__name__, threading.current_thread().name))
        return lambda *args, **kw: fn(*args, **kw)

    uk.forget_compiled()
    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(uk, "resolve_mode", lambda mode: "compiled" if mode == "auto" else mode)
    threads: list[threading.Thread] = []
    real = uk.compile_ahead

    def recorded(jobs):
        thread = real(jobs)
        if thread is not None:
            threads.append(thread)
        return thread

    monkeypatch.setattr(uk, "compile_ahead", recorded)
    yield calls, threads
    for thread in threads:
        thread.join(timeout=60)
    uk.forget_compiled()  # nothing the fake built is left for later tests


def _train(level: str, opt_cls, steps: int = 3, **opt_kw) -> list[torch.Tensor]:
    amp.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    opt = opt_cls(model.parameters(), **opt_kw)
    model, opt = amp.initialize(model, opt, opt_level=level, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 16, generator=g)).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    out = [p.detach().clone() for p in model.parameters()]
    amp.reset()
    return out


CASES = [
    ("O2", torch.optim.AdamW, {"lr": 1e-2}, "_adam"),
    ("O2", torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}, "_sgd"),
    ("O2", torch.optim.SGD, {"lr": 1e-2}, "_sgd_plain"),
    ("O2K", torch.optim.AdamW, {"lr": 1e-2}, "_adam_kahan"),
    ("O2K", torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}, "_sgd_kahan"),
]


@pytest.mark.parametrize("level, opt_cls, kw, kernel", CASES)
def test_the_first_step_takes_the_kernels_compiled_ahead(monkeypatch, fake_compile, level, opt_cls, kw, kernel):
    calls, threads = fake_compile
    monkeypatch.setenv("AMPKIT_COMPILE_AHEAD", "0")
    at_step = _train(level, opt_cls, **kw)
    assert calls == [(kernel, threading.main_thread().name)]

    calls.clear()
    uk.forget_compiled()  # compiled again, ahead this time
    monkeypatch.setenv("AMPKIT_COMPILE_AHEAD", "1")
    ahead = _train(level, opt_cls, **kw)
    assert len(threads) == 1
    threads[0].join(timeout=60)
    assert calls == [(kernel, "ampkit-compile-ahead")]  # once, by the thread: the step compiled nothing
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ahead, at_step))


def test_nothing_is_compiled_ahead_where_the_first_step_compiles_nothing(monkeypatch, fake_compile):
    """fp16 O2 (a loss scale above 1: grads are not held, no one-pass step), O1 and
    O3, the switch unset or 0, and kernels compiled already: no thread."""
    calls, threads = fake_compile
    monkeypatch.setenv("AMPKIT_COMPILE_AHEAD", "1")
    for level, dtype in (("O2", torch.float16), ("O1", torch.bfloat16), ("O3", torch.bfloat16)):
        amp.reset()
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        amp.initialize(model, torch.optim.AdamW(model.parameters()), opt_level=level, dtype=dtype)
    amp.reset()
    assert threads == [] and calls == []
    _train("O2", torch.optim.AdamW, steps=1, lr=1e-2)  # compiled ahead once
    threads[0].join(timeout=60)
    _train("O2", torch.optim.AdamW, steps=1, lr=1e-2)  # compiled already: no second thread
    assert len(threads) == 1 and len(calls) == 1
    for switch in ("0", None):  # off, and off by default
        if switch is None:
            monkeypatch.delenv("AMPKIT_COMPILE_AHEAD")
        else:
            monkeypatch.setenv("AMPKIT_COMPILE_AHEAD", switch)
        uk.forget_compiled()
        _train("O2", torch.optim.AdamW, steps=1, lr=1e-2)
        assert len(threads) == 1 and calls[-1] == ("_adam", threading.main_thread().name)
