"""O2's gradient route takes a backward pass's 16-bit grads into the fp32 masters when the
pass ends, in a few multi-tensor calls (``GradPath.take_pending``,
``GradMirror.absorb_many``), not one absorb per post-accumulate hook. The results must be
the per-hook route's, bit for bit: the reference runs below force that route by giving
every parameter a no-op post-accumulate hook of its own after ampkit's (a later hook reads
``p.grad``, so ampkit's hook takes the grad in at once)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp
import ampkit.levels.grad_mirror as grad_mirror
import ampkit.trainer.grad_hooks as grad_hooks
from ampkit.levels.grad_mirror import GradMirror


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _setup(dtype: torch.dtype, master_grads: str, per_hook: bool, optimizer: str = "adamw"):
    model = _model()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))  # fmt: skip
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype, master_grads=master_grads)
    if per_hook:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: None)
    return model, opt


def _loss(model: nn.Module, i: int, blow_up: bool = False) -> torch.Tensor:
    x, y = _batch(i)
    loss = F.mse_loss(model(x).float(), y)
    return loss * 1e30 if blow_up else loss


def _run(dtype, master_grads, per_hook, micro, optimizer="adamw", steps=4):
    """Weights, masters, state and the grads shown after each step's backward passes."""
    model, opt = _setup(dtype, master_grads, per_hook, optimizer)
    seen = []
    for step in range(steps):
        for m in range(micro):
            # fp16 step 2: inf grads, skipped alike on both routes
            blow_up = dtype == torch.float16 and step == 2 and m == 0
            with amp.scale_loss(_loss(model, step * micro + m, blow_up) / micro, opt) as scaled:
                scaled.backward()
        seen += [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        seen += [None if p.grad is None else p.grad.clone() for p in amp.master_params(opt)]
        opt.step()
        opt.zero_grad()
    seen += [p.detach().clone() for p in model.parameters()]
    seen += [p.detach().clone() for p in amp.master_params(opt)]
    seen += [v.clone() for state in opt.state_dict()["state"].values() for v in state.values() if torch.is_tensor(v)]
    stats = amp.stats(opt)
    seen.append((stats.steps, stats.skipped, stats.scales))
    return seen


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if torch.is_tensor(x) and torch.is_tensor(y):  # bit for bit, a NaN where the other has one
            same_nan = torch.equal(x.isnan(), y.isnan())
            inf = float("inf")
            assert x.dtype == y.dtype and same_nan and torch.equal(x.nan_to_num(0.0, inf, -inf), y.nan_to_num(0.0, inf, -inf)), (
                f"item {i} differs")  # fmt: skip
        else:
            assert x == y, f"item {i}: {x} != {y}"


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("keep_aside", [True, False], ids=["cpu-route", "accelerator-route"])
@pytest.mark.parametrize("master_grads", ["on_demand", "always"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_batched_route_equals_the_per_hook_route_bit_for_bit(dtype, master_grads, keep_aside, micro, monkeypatch):
    """``accelerator-route``: no 16-bit grad kept aside (``KEEP_ASIDE_DEVICES`` empty, as
    on a GPU), so with ``master_grads="always"`` every grad is widened into a new fp32
    tensor: the path whose per-parameter casts and launches the batching removes."""
    if not keep_aside:
        monkeypatch.setattr(grad_mirror, "KEEP_ASIDE_DEVICES", ())
    calls = {"absorb": 0, "absorb_many": 0}
    absorb, absorb_many = GradMirror.absorb, GradMirror.absorb_many

    def count(name, fn):
        def spy(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return spy

    reference = _run(dtype, master_grads, per_hook=True, micro=micro)
    monkeypatch.setattr(GradMirror, "absorb", count("absorb", absorb))
    monkeypatch.setattr(GradMirror, "absorb_many", count("absorb_many", absorb_many))
    batched = _run(dtype, master_grads, per_hook=False, micro=micro)
    _same(reference, batched)
    assert calls["absorb_many"] == 4 * micro  # one per backward pass
    if not (keep_aside and master_grads == "always" and dtype == torch.bfloat16):
        assert calls["absorb"] == 0  # dense grads: none taken in one by one
    # (else a step's first bf16 grads are kept aside on the CPU, one by one, as before)


def test_the_batched_route_equals_the_per_hook_route_with_sgd_momentum():
    _same(_run(torch.bfloat16, "always", True, 2, "sgd"), _run(torch.bfloat16, "always", False, 2, "sgd"))


@pytest.mark.parametrize("master_grads", ["on_demand", "always"])
def test_masters_read_by_a_hook_during_backward_hold_the_grads_produced_so_far(master_grads):
    """A hook on the parameter whose grad backward produces last reads and clips every
    master's grad (``ampkit.master_params``): the grads produced before it are there and
    the clip reaches the step, as with the per-hook route."""

    def run(per_hook: bool) -> list[torch.Tensor]:
        model, opt = _setup(torch.bfloat16, master_grads, per_hook)
        present = []

        def clip_all(p: torch.Tensor) -> None:
            masters = list(amp.master_params(opt))
            present.append(sum(m.grad is not None for m in masters))
            torch.nn.utils.clip_grad_norm_(masters, 1e-3)

        model[0].weight.register_post_accumulate_grad_hook(clip_all)  # produced last
        with amp.scale_loss(_loss(model, 0), opt) as scaled:
            scaled.backward()
        opt.step()
        assert len(present) == 1 and present[0] >= len(list(model.parameters())) - 1  # (model[0].bias may come after)
        return [*present, *[p.detach().clone() for p in amp.master_params(opt)]]

    _same(run(True), run(False))


@pytest.mark.parametrize("master_grads", ["on_demand", "always"])
def test_masters_after_a_backward_that_raised_hold_the_grads_produced_before(master_grads):
    """Backward raises half-way (a hook on an activation): the masters' grads read right
    after are those of the parameters done before it, as with the per-hook route, and a
    clip of them reaches the step."""

    def run(per_hook: bool) -> list:
        model, opt = _setup(torch.bfloat16, master_grads, per_hook)
        x, y = _batch(0)
        h = model[2](model[1](model[0](x)))

        def boom(grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

        h.register_hook(boom)
        out = model[5](model[4](model[3](h)))
        with pytest.raises(RuntimeError, match="boom"), amp.scale_loss(F.mse_loss(out.float(), y), opt) as scaled:
            scaled.backward()
        grads = [None if m.grad is None else m.grad.clone() for m in amp.master_params(opt)]
        assert sum(g is not None for g in grads) == 4  # the last two Linear layers' weight and bias
        norm = torch.nn.utils.clip_grad_norm_([m for m in amp.master_params(opt) if m.grad is not None], 1e-3)
        opt.step()
        return [*grads, norm, *[p.detach().clone() for p in amp.master_params(opt)]]

    _same(run(True), run(False))


def test_pending_grads_are_taken_in_before_they_pass_the_byte_bound(monkeypatch):
    """At most ``PENDING_BYTES`` of 16-bit grads wait for the end of the pass (they are
    kept longer than the per-hook route keeps them): with a bound of 0 each is taken in
    by its own hook, with the same result."""
    monkeypatch.setattr(grad_mirror, "KEEP_ASIDE_DEVICES", ())
    reference = _run(torch.bfloat16, "always", per_hook=False, micro=2)
    sizes = []
    absorb_many = GradMirror.absorb_many

    def spy(self, params, unscale, keep):
        sizes.append(len(params))
        return absorb_many(self, params, unscale, keep)

    monkeypatch.setattr(GradMirror, "absorb_many", spy)
    monkeypatch.setattr(grad_hooks, "PENDING_BYTES", 0)
    _same(reference, _run(torch.bfloat16, "always", per_hook=False, micro=2))
    assert sizes and set(sizes) == {1}  # one grad at a time (LayerNorm's stay fp32: no master)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_parameter_accumulating_in_a_nested_pass_equals_the_per_hook_route(dtype):
    """A layer used both outside and inside a reentrant checkpoint accumulates in the outer
    pass and again in the checkpoint's inner one, before the outer pass ends: its pending
    grad is taken in first, as its hook used to."""
    import torch.utils.checkpoint as checkpoint

    def run(per_hook: bool) -> list:
        model, opt = _setup(dtype, "on_demand", per_hook)
        seen = []
        for step in range(3):
            for m in range(2):
                x, y = _batch(step * 2 + m)
                h = model[2](model[1](model[0](x)))
                inner = checkpoint.checkpoint(lambda t: torch.tanh(model[3](t)), h, use_reentrant=True)
                out = model[5](torch.relu(model[3](h)) + 0.1 * inner)
                with amp.scale_loss(F.mse_loss(out.float(), y) / 2, opt) as scaled:
                    scaled.backward()
            seen += [p.grad.clone() for p in model.parameters()] + [m.grad.clone() for m in amp.master_params(opt)]
            opt.step()
            opt.zero_grad()
        return seen + [p.detach().clone() for p in amp.master_params(opt)]

    _same(run(True), run(False))
