"""Update kernels compiled in the background from ``initialize`` on: the first step
takes the kernels built ahead (compiling none itself), with the results of a compile at
the step; ``AMPKIT_COMPILE_AHEAD=0`` turns it off. The compile is replaced by a fake that
records where it ran and returns the eager function (the real compile has its own tests)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit.levels import compensated, one_pass
from ampkit.levels import update_kernels as uk


@pytest.fixture
def fake_compile(monkeypatch):
    """Fresh kernels (nothing compiled yet), 'compiled' mode, and a compile that records
    (kernel name, static, thread name) and returns the op-by-op function."""
    calls: list[tuple[str, tuple, str]] = []

    def compile_and_probe(self, static, num_scalars, device, scalars_device):
        calls.append((self.name, tuple(sorted(static.items())), threading.current_thread().name))
        fn = self.fn
        return lambda *args, **kw: fn(*args, **kw)

    monkeypatch.setattr(uk.Kernel, "_compile_and_probe", compile_and_probe)
    monkeypatch.setitem(uk._PROCESS_MODE, "auto", "compiled")
    monkeypatch.setattr(one_pass, "_KERNELS", {})
    for name in ("_ADAM", "_SGD", "SGD_PLAIN"):
        old = getattr(compensated, name)
        monkeypatch.setattr(compensated, name, uk.Kernel(old.name, old.fn, old.mutated, old.example_dtypes, old.exact))
    monkeypatch.setattr(uk, "_round_check", [None])  # the rounding check: not under test here
    threads: list[threading.Thread] = []
    real = uk.compile_ahead

    def recorded(jobs):
        thread = real(jobs)
        if thread is not None:
            threads.append(thread)
        return thread

    monkeypatch.setattr(uk, "compile_ahead", recorded)
    return calls, threads


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
    ("O2", torch.optim.AdamW, {"lr": 1e-2}, ("O2 Adam/AdamW", ())),
    ("O2", torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}, ("O2 SGD", (("nesterov", True),))),
    ("O2", torch.optim.SGD, {"lr": 1e-2}, ("O2 SGD", ())),
    ("O2K", torch.optim.AdamW, {"lr": 1e-2}, ("Adam/AdamW", ())),
    ("O2K", torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}, ("SGD", (("nesterov", False),))),
]


@pytest.mark.parametrize("level, opt_cls, kw, kernel", CASES)
def test_the_first_step_takes_the_kernels_compiled_ahead(monkeypatch, fake_compile, level, opt_cls, kw, kernel):
    calls, threads = fake_compile
    monkeypatch.setenv("AMPKIT_COMPILE_AHEAD", "0")
    at_step = _train(level, opt_cls, **kw)
    assert [c[:2] for c in calls] == [kernel] and calls[0][2] == threading.main_thread().name

    calls.clear()
    monkeypatch.setattr(one_pass, "_KERNELS", {})  # nothing compiled: compiled again, ahead this time
    for name in ("_ADAM", "_SGD", "SGD_PLAIN"):
        old = getattr(compensated, name)
        monkeypatch.setattr(compensated, name, uk.Kernel(old.name, old.fn, old.mutated, old.example_dtypes, old.exact))
    monkeypatch.setenv("AMPKIT_COMPILE_AHEAD", "1")
    ahead = _train(level, opt_cls, **kw)
    assert len(threads) == 1
    threads[0].join(timeout=60)
    assert [c[:2] for c in calls] == [kernel]  # once, by the thread: the step compiled nothing
    assert calls[0][2] == "ampkit-compile-ahead"
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ahead, at_step))


def test_nothing_is_compiled_ahead_where_the_first_step_compiles_nothing(monkeypatch, fake_compile):
    """fp16 O2 (a loss scale above 1: grads are not held, no one-pass step), O1 and
    O3, ``AMPKIT_COMPILE_AHEAD=0``, and kernels compiled already: no thread."""
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
    monkeypatch.setenv("AMPKIT_COMPILE_AHEAD", "0")
    monkeypatch.setattr(one_pass, "_KERNELS", {})
    _train("O2", torch.optim.AdamW, steps=1, lr=1e-2)
    assert len(threads) == 1 and calls[-1][2] == threading.main_thread().name
