"""The one rule for optimizer state that follows its parameter to another dtype
(``ampkit._dtypes.cast_optimizer_state``), directly and where the levels apply it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit._internal.dtypes import LOW_PRECISION, cast_optimizer_state, default_dtype

BF16 = torch.bfloat16


def test_moments_follow_the_dtype_scalars_and_non_tensors_do_not():
    exp_avg = torch.randn(3, 2)
    state = {
        "step": torch.tensor(4.0),
        "mu_product": torch.tensor(0.9),  # NAdam's 0-dim scalar
        "exp_avg": exp_avg,
        "exp_avg_sq": torch.rand(3, 2, dtype=torch.float64),
        "count": torch.tensor([3]),
        "lr_factor": 0.5,
    }
    out = cast_optimizer_state(state, BF16)
    assert out.keys() == state.keys()
    assert out["exp_avg"].dtype == BF16 and torch.equal(out["exp_avg"], exp_avg.to(BF16))
    assert out["exp_avg_sq"].dtype == BF16
    for kept in ("step", "mu_product", "count", "lr_factor"):
        assert out[kept] is state[kept]
    assert state["exp_avg"] is exp_avg and exp_avg.dtype == torch.float32  # input untouched
    back = cast_optimizer_state(out, torch.float32)
    assert back["exp_avg"].dtype == torch.float32 and back["step"] is state["step"]
    same = cast_optimizer_state({"exp_avg": exp_avg}, torch.float32)
    assert same["exp_avg"] is exp_avg


def test_defaults():
    assert set(LOW_PRECISION) == {torch.bfloat16, torch.float16}
    assert default_dtype("cpu") == torch.bfloat16 and default_dtype("cuda") == torch.float16


@pytest.mark.parametrize("level", ["O2", "O2K"])
def test_state_made_before_initialize_follows_the_rule(level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.NAdam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 4)
    model(x).pow(2).mean().backward()
    opt.step()  # fp32 state exists before initialize
    opt.zero_grad()
    try:
        model, opt = amp.initialize(model, opt, opt_level=level)
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        assert not amp.step_skipped(opt)
        stepped = list(amp.master_params(opt))
        want = torch.float32 if level == "O2" else BF16
        for p in stepped:
            state = opt.state[p]
            assert state["exp_avg"].dtype == want == p.dtype
            assert state["exp_avg_sq"].dtype == want
            assert state["step"].dtype == torch.float32 and state["step"].item() == 2
            assert state["mu_product"].dtype == torch.float32
    finally:
        amp.reset()
