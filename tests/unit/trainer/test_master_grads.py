"""The gradient route reaches O2's masters through one declared interface,
:class:`ampkit.trainer.master_grads.MasterGrads`: ``MasterWeights.route`` implements
it, and a training run whose route is a proxy that refuses every other attribute trains
bitwise as the plain run (fp16 and bf16, accumulation, clipping through the model's
grads, ``zero_grad(set_to_none=False)``, a skipped step)."""

from __future__ import annotations

import collections
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp
import ampkit.levels.master as master_module
from ampkit.levels.grad_route import GradRoute
from ampkit.trainer.master_grads import MasterGrads

#: The interface's methods, read off the Protocol itself.
METHODS = sorted(name for name, v in vars(MasterGrads).items() if inspect.isfunction(v) and not name.startswith("_"))


def test_the_protocol_is_small_and_the_masters_route_implements_every_method_with_its_signature():
    assert 10 <= len(METHODS) <= 16, METHODS
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16)
    route = amp.levels.master_weights_of(opt).route
    assert isinstance(route, MasterGrads)
    for name in METHODS:
        ours, declared = inspect.signature(getattr(GradRoute, name)), inspect.signature(getattr(MasterGrads, name))
        assert list(ours.parameters) == list(declared.parameters), name
    assert not isinstance(object(), MasterGrads)  # the check can fail


class _OnlyTheProtocol:
    """A route that answers the interface's methods alone (counted) and refuses the rest."""

    def __init__(self, inner: GradRoute, calls: collections.Counter) -> None:
        self._inner, self._calls = inner, calls

    def __getattr__(self, name: str):
        if name not in METHODS:
            raise AttributeError(f"the gradient route reached {name!r}, which MasterGrads does not declare")
        self._calls[name] += 1
        return getattr(self._inner, name)


def _train(dtype: torch.dtype, calls: collections.Counter | None, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    if calls is not None:
        monkeypatch.setattr(master_module, "GradRoute", lambda masters: _OnlyTheProtocol(GradRoute(masters), calls))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype)
    if calls is not None:
        assert isinstance(amp.levels.master_weights_of(opt).route, _OnlyTheProtocol)
    out = []
    for step in range(5):
        for micro in range(2 if step % 2 else 1):  # odd steps accumulate two backward passes
            g = torch.Generator().manual_seed(10 * step + micro)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            loss = F.mse_loss(model(x).float(), y)
            if dtype == torch.float16 and step == 3 and micro == 0:
                loss = loss * 1e30  # inf grads: the step is skipped
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # through the model's 16-bit grads
        out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=step != 2)
    out += [p.detach().clone() for p in model.parameters()] + [m.detach().clone() for m in amp.master_params(opt)]
    out += [v for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:  # NaN grads of the skipped step included
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_route_reaches_the_masters_only_through_the_protocol(dtype, monkeypatch):
    reference = _train(dtype, None, monkeypatch)
    amp.reset()
    calls: collections.Counter = collections.Counter()
    got = _train(dtype, calls, monkeypatch)
    assert len(got) == len(reference)
    assert all(_same_bits(a, b) for a, b in zip(got, reference))
    # the events of these steps, each through the interface
    for name in ("before_forward", "before_accumulate", "show", "before_step", "after_zero_grad", "reconcile"):
        assert calls[name] > 0, (name, calls)
    assert calls["take_in_many"] + calls["take_in"] > 0, calls
    if dtype == torch.bfloat16:
        assert calls["held"] > 0, calls  # held grads (scale 1) are read by the step
