"""ampkit.GradScaler: bitwise parity with torch.amp.GradScaler, and what it adds."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import ampkit as amp
from ampkit import NumericsError, ScalerError, StateError

INF = float("inf")


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + i)
    return torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)


def bits(model: torch.nn.Module) -> list[bytes]:
    return [p.detach().cpu().numpy().tobytes() for p in model.parameters()]


DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.cuda)]


def _amp_loop_step(model, opt, scaler, i, poison):
    """nanoGPT-style: fp16 forward under autocast-like casts, scale, unscale_, clip, step, update."""
    x, y = (t.to(model[0].weight.device) for t in batch(i))
    opt.zero_grad(set_to_none=True)
    out = torch.nn.functional.linear(
        torch.tanh(F.linear(x.half(), model[0].weight.half(), model[0].bias.half())),
        model[2].weight.half(),
        model[2].bias.half(),
    ).float()
    loss = F.mse_loss(out, y)
    scaler.scale(loss).backward()
    if i in poison:
        model[0].weight.grad[1, 2] = poison[i]
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    result = scaler.step(opt)
    scaler.update()
    return result


@pytest.mark.parametrize("device", DEVICES)
def test_bitwise_parity_with_torch_gradscaler_over_a_run_with_overflows(device):
    poison = {0: INF, 3: float("nan"), 4: -INF, 9: INF}
    ours_m, torch_m = mlp().to(device), mlp().to(device)
    ours_o = torch.optim.AdamW(ours_m.parameters(), lr=1e-2)
    torch_o = torch.optim.AdamW(torch_m.parameters(), lr=1e-2)
    ours = amp.GradScaler(device, init_scale=2.0**12, growth_interval=3, hysteresis=1)
    ref = torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=3)
    scales = []
    for i in range(14):
        stepped = _amp_loop_step(ours_m, ours_o, ours, i, poison)
        _amp_loop_step(torch_m, torch_o, ref, i, poison)
        assert stepped is (i not in poison)
        assert amp.step_skipped(ours_o) is (i in poison)
        assert bits(ours_m) == bits(torch_m), i
        assert ours.get_scale() == ref.get_scale()
        assert ours.state_dict()["_growth_tracker"] == ref._get_growth_tracker()
        scales.append(ours.get_scale())
    pairs = list(zip(scales, scales[1:]))
    assert any(b > a for a, b in pairs) and any(b < a for a, b in pairs)  # grew and backed off
    for a, b in zip(ours_o.state_dict()["state"].values(), torch_o.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_power_of_two_factors_stay_bitwise_equal():
    ours_m, torch_m = mlp(1), mlp(1)
    ours_o = torch.optim.SGD(ours_m.parameters(), lr=0.1)
    torch_o = torch.optim.SGD(torch_m.parameters(), lr=0.1)
    kw = dict(init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=2)
    ours = amp.GradScaler("cpu", **kw)
    ref = torch.amp.GradScaler("cpu", **kw)
    poison = {1: INF, 6: INF}
    for i in range(10):
        _amp_loop_step(ours_m, ours_o, ours, i, poison)
        _amp_loop_step(torch_m, torch_o, ref, i, poison)
        assert ours.get_scale() == ref.get_scale()
        assert bits(ours_m) == bits(torch_m)


def test_state_dicts_interchange_with_torch():
    ref = torch.amp.GradScaler("cpu", init_scale=300.0, growth_interval=7)
    ref.scale(torch.ones(()))
    ref._growth_tracker.fill_(5)
    ours = amp.GradScaler("cpu", hysteresis=3)
    ours.load_state_dict(ref.state_dict())
    assert ours.get_scale() == 300.0 and ours.get_growth_interval() == 7
    assert ours.loss_scaler.growth_tracker == 5 and ours.loss_scaler.hysteresis == 3
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.get_scale() == 300.0 and back.get_growth_interval() == 7
    again = amp.GradScaler("cpu")
    again.load_state_dict(ours.state_dict())
    assert again.state_dict() == ours.state_dict()


def test_skipped_step_does_not_make_schedulers_warn():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    scaler = amp.GradScaler("cpu")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        x, y = batch(0)
        scaler.scale(F.mse_loss(model(x), y) * INF).backward()
        assert scaler.step(opt) is False
        scaler.update()
        sched.step()
    assert not [w for w in records if "lr_scheduler" in str(w.message)]


def test_hysteresis_and_numerics_error_through_the_torch_interface():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler("cpu", init_scale=4.0, hysteresis=2, min_scale=2.0)
    start = bits(model)
    expected_scales = [4.0, 2.0]  # tolerated, then backed off to the floor
    for i in range(2):
        x, y = batch(i)
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y) * float("nan")).backward()
        assert scaler.step(opt) is False
        scaler.update()
        assert scaler.get_scale() == expected_scales[i]
    x, y = batch(3)
    opt.zero_grad()
    scaler.scale(F.mse_loss(model(x), y) * float("nan")).backward()
    scaler.step(opt)
    with pytest.raises(NumericsError, match=r"min_scale=2 \(3 step\(s\) skipped in a row"):
        scaler.update()
    assert bits(model) == start


def test_order_errors_and_fp16_grads():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler("cpu")
    x, y = batch(0)
    with pytest.raises(StateError, match="no inf checks"):
        scaler.update()
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(StateError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(StateError, match="already been called since the last update"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(StateError, match="closure"):
        scaler.step(opt, closure=lambda: None)
    half = mlp().half()
    hopt = torch.optim.SGD(half.parameters(), lr=0.1)
    scaler.scale(half(x.half()).float().sum()).backward()
    with pytest.raises(ScalerError, match="FP16"):
        scaler.unscale_(hopt)
    assert isinstance(ScalerError("x"), ValueError)


def test_scale_of_nested_outputs_and_update_with_new_scale():
    scaler = amp.GradScaler("cpu", init_scale=8.0)
    out = scaler.scale([torch.ones(2), (torch.full((), 2.0), torch.ones(1, dtype=torch.float16))])
    assert out[0].tolist() == [8.0, 8.0] and out[1][0].item() == 16.0
    assert out[1][1].dtype == torch.float16
    scaler.update(new_scale=32.0)
    assert scaler.get_scale() == 32.0
    scaler.update(new_scale=torch.tensor(64.0))
    assert scaler.scale(torch.ones(())).item() == 64.0


def test_disabled_and_missing_cuda():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    off = amp.GradScaler("cpu", enabled=False)
    x, y = batch(0)
    loss = F.mse_loss(model(x), y)
    assert off.scale(loss) is loss
    loss.backward()
    before = bits(model)
    assert off.step(opt) is True and bits(model) != before
    off.update()
    assert off.get_scale() == 1.0 and not off.is_enabled() and off.state_dict() == {}
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            assert not amp.GradScaler().is_enabled()


def test_fused_adam_through_gradscaler_matches_unscaled_fused_adam():
    ours_m, ref_m = mlp(), mlp()
    ours_o = torch.optim.Adam(ours_m.parameters(), lr=1e-2, fused=True)
    ref_o = torch.optim.Adam(ref_m.parameters(), lr=1e-2, fused=True)
    scaler = amp.GradScaler("cpu", init_scale=2.0**10)
    for i in range(3):
        x, y = batch(i)
        ours_o.zero_grad()
        scaler.scale(F.mse_loss(ours_m(x), y)).backward()
        assert scaler.step(ours_o)
        scaler.update()
        ref_o.zero_grad()
        F.mse_loss(ref_m(x), y).backward()
        ref_o.step()
    assert bits(ours_m) == bits(ref_m)


def test_setters_validate_like_the_constructor():
    scaler = amp.GradScaler("cpu")
    with pytest.raises(ScalerError):
        scaler.set_growth_factor(0.5)
    with pytest.raises(ScalerError):
        scaler.set_backoff_factor(2.0)
    with pytest.raises(ScalerError):
        scaler.set_growth_interval(0)
    assert scaler.get_growth_factor() == 2.0
    assert scaler.get_backoff_factor() == 0.5
    assert scaler.get_growth_interval() == 2000
    scaler.set_growth_factor(4.0)
    assert scaler.get_growth_factor() == 4.0
