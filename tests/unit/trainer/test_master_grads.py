"""The gradient route reaches O2's masters through one declared interface,
:class:`ampkit.trainer.master_grads.MasterGrads`: ``MasterWeights.route`` implements
it, and a training run whose route is a proxy that refuses every other attribute trains
bitwise as a reference route making the calls straight on the masters (fp16 and bf16,
accumulation, clipping through the model's grads, ``zero_grad(set_to_none=False)``,
skipped steps, edits through ``.data`` of a weight and of a grad, a master edited, the
masters' grads read inside backward)."""

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
    assert 10 <= len(METHODS) <= 16, f"keep the route's interface small: {METHODS}"
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16)
    route = amp.levels.master_weights_of(opt).route
    assert isinstance(route, MasterGrads)
    for name in METHODS:
        ours, declared = inspect.signature(getattr(GradRoute, name)), inspect.signature(getattr(MasterGrads, name))
        assert list(ours.parameters) == list(declared.parameters), name
    assert not isinstance(object(), MasterGrads)  # the check can fail


class _Direct:
    """The reference: each event as the route carried it out before the interface existed,
    straight on the masters' grad mirror and the masters (independent of ``GradRoute``)."""

    def __init__(self, masters) -> None:
        self.mw, self.mirror = masters, masters.grads

    def refresh(self):
        self.mw.refresh()

    def model_param_of(self, stepped):
        return self.mw.model_param_of(stepped)

    def may_hold(self, param):
        return self.mirror.may_hold(param)

    def on_read(self, take_pending):
        self.mirror.before_read = take_pending

    def before_forward(self):
        self.mw.publish_changed()
        self.mirror.drop_stale_views()

    def before_accumulate(self, param, raw):
        if raw:
            return self.mirror.settle_raw(param)
        self.mirror.settle(param)
        return True

    def take_in(self, param, unscale, keep):
        return self.mirror.absorb(param, unscale, keep)

    def take_in_many(self, params, unscale, keep):
        return self.mirror.absorb_many(params, unscale, keep)

    def show(self, params):
        self.mirror.show(params)

    def held(self):
        return [model_p for _, model_p in self.mirror.held()]

    def is_placeholder(self, stepped):
        return self.mirror.is_placeholder(stepped)

    def reconcile(self, params):
        self.mirror.reconcile(params)

    def materialize(self):
        self.mirror.materialize()

    def follow(self, params):
        self.mirror.follow_masters(params)

    def before_step(self, params):
        self.mirror.hide(params)
        self.mw.sync_from_model()

    def after_zero_grad(self, params):
        self.mirror.after_zero_grad(params)


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
    """Six steps through ``GradRoute`` behind a proxy that counts into ``calls``; with
    ``calls`` None, through :class:`_Direct` (the reference)."""
    if calls is None:
        monkeypatch.setattr(master_module, "GradRoute", _Direct)
    else:
        monkeypatch.setattr(master_module, "GradRoute", lambda masters: _OnlyTheProtocol(GradRoute(masters), calls))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype)
    if calls is not None:
        assert isinstance(amp.levels.master_weights_of(opt).route, _OnlyTheProtocol)
    out: list[torch.Tensor] = []

    def read_masters_mid_backward(module, args, output):  # the masters' grads read inside backward
        output.register_hook(lambda g: out.extend(m.grad.clone() for m in amp.master_params(opt) if m.grad is not None))

    reading = model[1].register_forward_hook(read_masters_mid_backward)
    for step in range(6):
        if step == 1:
            model[0].weight.data[0, 0] = 0.25  # an edit no version counter sees: the step takes it in
        for micro in range(2 if step % 2 else 1):  # odd steps accumulate two backward passes
            g = torch.Generator().manual_seed(10 * step + micro)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            loss = F.mse_loss(model(x).float(), y)
            if dtype == torch.float16 and step == 3 and micro == 0:
                loss = loss * 1e30  # inf grads: the step is skipped
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            reading.remove()
        if step == 4:
            model[3].weight.grad.data[0, 0] = float("inf")  # through .data: the step's check finds it
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # through the model's 16-bit grads
        out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=step != 2)
        out += [p.grad.clone() for p in model.parameters() if p.grad is not None]  # zeroed: the model's too
        if step == 2:
            with torch.no_grad():
                next(iter(amp.master_params(opt))).mul_(0.5)  # a master edited: the next forward rounds it in
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


def test_before_accumulate_of_a_grad_held_for_ddp_says_whether_it_still_is():
    """``raw``: True while the 16-bit grad stands (nothing cleared it), False once it was
    cleared through the model, and False for a parameter without a master."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16)
    route = amp.levels.master_weights_of(opt).route
    weight, norm_weight = model[0].weight, model[1].weight  # mastered; fp32 (no master)
    weight.grad = torch.ones_like(weight)
    assert route.before_accumulate(weight, raw=True) is True
    assert torch.equal(weight.grad, torch.ones_like(weight))  # left as it was
    weight.grad = None
    assert route.before_accumulate(weight, raw=True) is False
    norm_weight.grad = torch.ones_like(norm_weight)
    assert route.before_accumulate(norm_weight, raw=True) is False
    assert route.before_accumulate(norm_weight, raw=False) is True
