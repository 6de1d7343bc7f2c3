"""Compensated bf16 updates: Kahan summation and stochastic rounding against
plain bf16 weights and an fp32 reference."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from ampkit.compensated import CompensatedUpdates, kahan_round, stochastic_round
from ampkit.errors import AmpError, StateError
from ampkit.model import cast_model

BF16 = torch.bfloat16


def test_stochastic_round_is_unbiased_and_lands_on_neighbours():
    lo = torch.tensor(1.0, dtype=BF16)
    hi = torch.tensor(1.0 + 2**-7, dtype=BF16)  # the next bf16 after 1.0
    x = torch.full((20000,), 1.0 + 0.3 * 2**-7)
    g = torch.Generator().manual_seed(0)
    r = stochastic_round(x, BF16, g)
    assert set(r.float().unique().tolist()) == {lo.item(), hi.item()}
    frac_up = (r == hi).float().mean().item()
    assert abs(frac_up - 0.3) < 0.02
    # Negative values round symmetrically; representable values stay put.
    assert abs((stochastic_round(-x, BF16, g) == -hi).float().mean().item() - 0.3) < 0.02
    exact = torch.tensor([0.5, -3.0, 0.0, 2.0**-100])
    assert torch.equal(stochastic_round(exact, BF16, g).float(), exact)
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    out = stochastic_round(special, BF16, g).float()
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan()


def test_kahan_keeps_increments_that_bf16_rounds_away():
    # 1000 increments of ~1e-4 on weights of 1.0: each is below half a bf16 unit
    # (2**-8), so plain bf16 keeps none of them.
    g = torch.Generator().manual_seed(0)
    steps = torch.rand(1000, 4, generator=g) * 2e-4
    exact = 1.0 + steps.double().sum(0)
    w = torch.ones(4, dtype=BF16)
    plain = torch.ones(4, dtype=BF16)
    c = torch.zeros(4, dtype=BF16)
    for inc in steps:
        w = kahan_round(w.float() + inc, c)
        plain = (plain.float() + inc).to(BF16)
    assert torch.equal(plain, torch.ones(4, dtype=BF16))
    total = w.double() + c.double()
    # The bf16 buffer keeps ~16 significant bits of the sum: 0.5% of the growth.
    assert torch.all((total - exact).abs() < 0.005 * (exact - 1.0))
    assert w.dtype == BF16 and c.dtype == BF16


def _model(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))


@pytest.mark.parametrize(
    "opt_cls, kw",
    [
        (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
        (torch.optim.Adam, {"lr": 1e-3}),
        (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
        (torch.optim.RMSprop, {"lr": 1e-3}),
        (torch.optim.Adagrad, {"lr": 1e-2}),
        (torch.optim.NAdam, {"lr": 1e-3}),
    ],
)
def test_any_optimizer_keeps_bf16_params_state_and_grads(opt_cls, kw):
    model = cast_model(_model(), BF16)
    opt = opt_cls(model.parameters(), **kw)
    comp = CompensatedUpdates(opt, "kahan")
    x = torch.randn(8, 16)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    for p, b, g in zip(model.parameters(), before, grads):
        assert p.dtype == b.dtype and not torch.equal(p, b)
        assert p.grad is not None and p.grad.dtype == p.dtype and torch.equal(p.grad, g)
        for k, v in opt.state[p].items():
            if torch.is_tensor(v) and v.dim() > 0:
                assert v.dtype == p.dtype, (k, v.dtype)
    lin = model[0].weight
    assert comp.buffer(lin).dtype == BF16 and comp.buffer(lin).abs().sum() > 0
    assert comp.buffer(model[1].weight) is None  # fp32 LayerNorm: stepped as is


def test_fp32_params_step_exactly_as_without_compensation():
    torch.manual_seed(0)
    a = nn.Linear(4, 4)
    b = nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    low = nn.Parameter(torch.randn(3, dtype=BF16))
    opt_a = torch.optim.Adam([{"params": a.parameters()}, {"params": [low]}], lr=0.1)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.1)
    CompensatedUpdates(opt_a, "kahan", chunk_numel=2)
    for _ in range(3):
        g = [torch.randn_like(p) for p in a.parameters()]
        for pa, pb, gi in zip(a.parameters(), b.parameters(), g):
            pa.grad, pb.grad = gi.clone(), gi.clone()
        low.grad = torch.randn(3, dtype=BF16)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_chunking_does_not_change_the_result():
    results = []
    for chunk in (1, 1 << 20):
        model = cast_model(_model(), BF16)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        CompensatedUpdates(opt, "kahan", chunk_numel=chunk)
        torch.manual_seed(5)
        x = torch.randn(8, 16)
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results):
        assert torch.equal(p, q)


def test_closure_and_lbfgs_are_refused():
    p = nn.Parameter(torch.ones(2, dtype=BF16))
    with pytest.raises(AmpError, match="LBFGS"):
        CompensatedUpdates(torch.optim.LBFGS([p]))
    with pytest.raises(AmpError, match="method"):
        CompensatedUpdates(torch.optim.SGD([p], lr=1.0), "round-half-even")
    opt = torch.optim.SGD([p], lr=1.0)
    CompensatedUpdates(opt)
    p.grad = torch.ones(2, dtype=BF16)
    with pytest.raises(AmpError, match="closure"):
        opt.step(lambda: 0.0)
    assert p.grad is not None  # grads handed back on the error path


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_resume_is_bitwise(method):
    def build():
        model = cast_model(_model(), BF16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, CompensatedUpdates(opt, method, seed=3)

    def train(model, opt, steps, start):
        for i in range(start, start + steps):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(8, 16, generator=g)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    model, opt, comp = build()
    train(model, opt, 6, 0)
    model_a, opt_a, comp_a = build()
    train(model_a, opt_a, 3, 0)
    buf = io.BytesIO()
    torch.save({"m": model_a.state_dict(), "o": opt_a.state_dict(), "c": comp_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    model_b, opt_b, comp_b = build()
    model_b.load_state_dict(saved["m"])
    opt_b.load_state_dict(saved["o"])
    comp_b.load_state_dict(saved["c"])
    train(model_b, opt_b, 3, 3)
    for p, q in zip(model.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
    if method == "kahan":
        assert torch.equal(comp.buffer(model[0].weight), comp_b.buffer(model_b[0].weight))
    bad = dict(saved["c"], method="nearest")
    with pytest.raises(StateError, match="compensation"):
        comp_b.load_state_dict(bad)


# --- the real task: updates below bf16 resolution ------------------------------------


def _regression_task():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    w = torch.randn(64, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(512, 1, generator=g)
    return x, y


def _net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))


def _train(mode: str, steps: int = 300, lr: float = 1e-2) -> float:
    """Full-batch SGD; returns the final loss of the trained weights evaluated in
    fp32, so every mode is judged on the same arithmetic."""
    x, y = _regression_task()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if mode != "fp32":
        cast_model(model, BF16)
        if mode != "plain":
            CompensatedUpdates(opt, mode)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    evaluator = _net()
    evaluator.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        return nn.functional.mse_loss(evaluator(x), y).item()


@pytest.mark.slow
def test_compensated_bf16_matches_fp32_where_plain_bf16_stalls():
    fp32 = _train("fp32")
    plain = _train("plain")  # bf16 weights, the optimizer's own bf16 arithmetic
    nearest = _train("nearest")  # fp32 step, rounded to nearest bf16
    kahan = _train("kahan")
    stochastic = _train("stochastic")
    print(
        f"final loss: fp32 {fp32:.4f}  kahan {kahan:.4f}  stochastic {stochastic:.4f}  "
        f"nearest {nearest:.4f}  plain bf16 {plain:.4f}"
    )
    assert abs(kahan - fp32) <= 0.01 * fp32
    # Stochastic rounding is unbiased but noisy: close, not as close as Kahan.
    assert abs(stochastic - fp32) <= 0.03 * fp32
    assert abs(kahan - fp32) <= abs(stochastic - fp32)
    # Without compensation most updates are rounded away and training stalls.
    assert plain > 1.5 * fp32 and nearest > 1.5 * fp32
