"""init_trainer / scale_loss / unscale / step skipping, schedulers, several losses and
optimizers, the session state dict and exact resume, the extension hooks."""

from __future__ import annotations

import copy
import io
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from _scaler_reference import RefScaler
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode, resolve_name

import ampkit as amp
from ampkit import LossScaler, NumericsError, StateError
from ampkit.trainer import session as amp_session
from ampkit.trainer import stats as amp_stats
from ampkit.trainer.api import managed_state
from ampkit.trainer.extensions import StepExtension

INF = float("inf")


# --- helpers ----------------------------------------------------------------------
def mlp(seed: int = 0, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)
    )


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)


def loss_of(model: torch.nn.Module, i: int) -> torch.Tensor:
    x, y = batch(i)
    return F.mse_loss(model(x), y)


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().numpy().tobytes()


def params_bits(model_or_params) -> list[bytes]:
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    return [bits(p) for p in params]


def opt_state_bits(opt: torch.optim.Optimizer) -> list:
    out = []
    for _, s in sorted(opt.state_dict()["state"].items()):
        out.append({k: bits(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()})
    return out


def no_sched_warnings(records) -> list[str]:
    return [str(w.message) for w in records if "lr_scheduler" in str(w.message) or "optimizer.step()" in str(w.message)]


# --- the headline: fp16 grads that underflow without scaling -------------------------
LOSS_WEIGHT = 1e-7  # makes fp16 activation grads (~1e-8) fall below fp16's smallest subnormal


def _underflow_params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(32, 16, generator=g) * 0.25),
        torch.nn.Parameter(torch.zeros(32)),
        torch.nn.Parameter(torch.randn(1, 32, generator=g) * 0.18),
        torch.nn.Parameter(torch.zeros(1)),
    ]


_gd = torch.Generator().manual_seed(1)
_X = torch.randn(64, 16, generator=_gd)
_T = torch.sin(_X[:, :1] * 2) + 0.5 * _X[:, 1:2]


def _forward(params, dtype) -> torch.Tensor:
    """fp32 parameters, compute in ``dtype`` (what autocast does), fp32 output."""
    w1, b1, w2, b2 = (p.to(dtype) for p in params)
    h = torch.tanh(F.linear(_X.to(dtype), w1, b1))
    return F.linear(h, w2, b2).float()


def _train(dtype: torch.dtype, scaled: bool, steps: int = 40) -> tuple[float, float]:
    params = _underflow_params()
    opt = torch.optim.Adam(params, lr=1e-2, eps=1e-12)
    if scaled:
        amp.init_trainer(opt)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(_forward(params, dtype), _T) * LOSS_WEIGHT
        if scaled:
            with amp.scale_loss(loss, opt) as s:
                s.backward()
        else:
            loss.backward()
        opt.step()
    with torch.no_grad():
        final = F.mse_loss(_forward(params, torch.float32), _T).item()
    skipped = amp.stats(opt).skipped if scaled else 0
    amp.reset()
    return final, skipped


def test_fp16_underflow_fails_without_scaling_and_matches_fp32_with_scale_loss():
    with torch.no_grad():
        initial = F.mse_loss(_forward(_underflow_params(), torch.float32), _T).item()
    fp32, _ = _train(torch.float32, scaled=False)
    fp16_plain, _ = _train(torch.float16, scaled=False)
    fp16_scaled, skipped = _train(torch.float16, scaled=True)
    assert fp32 < 0.1 * initial  # the task is learnable in 40 steps
    # Without scaling every fp16 grad underflows to zero: Adam never moves.
    assert fp16_plain > 0.9 * initial
    # With scale_loss the fp16 run matches fp32: final loss within 5% (measured ~0.2%).
    assert skipped == 0
    assert abs(fp16_scaled - fp32) <= 0.05 * fp32


# --- exactness and skipping -----------------------------------------------------------
@pytest.mark.parametrize("fast_kernels", [True, False])
def test_managed_run_without_overflow_is_bitwise_a_plain_fp32_run(fast_kernels):
    """Managed, AdamW built with torch's defaults steps with the fused kernel: bitwise
    a plain run of AdamW(fused=True); with fast_kernels=False, bitwise the plain
    per-parameter loop."""
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=fast_kernels or None)
    opt = amp.init_trainer(torch.optim.AdamW(model.parameters(), lr=1e-2), fast_kernels=fast_kernels)
    assert managed_state(opt).kernels == (["fused"] if fast_kernels else [])
    for i in range(6):
        ref_opt.zero_grad()
        loss_of(ref, i).backward()
        ref_opt.step()
        opt.zero_grad()
        with amp.scale_loss(loss_of(model, i), opt) as scaled:
            assert scaled.dtype == torch.float32
            scaled.backward()
        opt.step()
        assert not amp.step_skipped(opt)
    assert params_bits(model) == params_bits(ref)
    assert opt_state_bits(opt) == opt_state_bits(ref_opt)


@settings(max_examples=25, deadline=None)
@given(
    k=st.integers(2, 20),
    interval=st.integers(1, 3),
    hysteresis=st.integers(1, 3),
    plan=st.lists(
        st.one_of(
            st.none(),
            st.tuples(st.integers(0, 3), st.integers(0, 15), st.sampled_from([INF, -INF, float("nan")]),
                      st.sampled_from(["index", "data"])),  # fmt: skip
        ),
        min_size=1,
        max_size=10,
    ),
)
def test_injected_inf_nan_skips_bitwise_and_scale_follows_rules(k, interval, hysteresis, plan):
    """A twin plain-fp32 run steps only where no inf/NaN was injected (by indexing the
    grad, or through ``.data``, which no version counter sees): the managed run's params
    and Adam state are bitwise the twin's after every step, and the scale after every
    step is the reference model's."""
    cfg = dict(init_scale=2.0**k, growth_factor=2.0, backoff_factor=0.5, growth_interval=interval,
               hysteresis=hysteresis, min_scale=1.0, max_scale=2.0**24, dynamic=True,
               consecutive_hysteresis=False, max_consecutive_skips=100)
    ref_scaler = RefScaler(cfg)
    twin, model = mlp(), mlp()
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2, weight_decay=0.1, fused=True)  # ampkit's pick
    opt = amp.init_trainer(torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1), LossScaler(**cfg))
    for i, inject in enumerate(plan):
        opt.zero_grad()
        with amp.scale_loss(loss_of(model, i), opt) as scaled:
            scaled.backward()
        before_p, before_s = params_bits(model), opt_state_bits(opt)
        if inject is not None:
            p = list(model.parameters())[inject[0]]
            grad = p.grad.data if inject[3] == "data" else p.grad
            grad.view(-1)[inject[1] % p.numel()] = inject[2]
        expected = ref_scaler.event(inject is not None)
        if expected is not None:
            with pytest.raises(NumericsError):
                opt.step()
            assert params_bits(model) == before_p and opt_state_bits(opt) == before_s
            return
        opt.step()
        assert amp.step_skipped(opt) is (inject is not None)
        if inject is None:
            twin_opt.zero_grad()
            loss_of(twin, i).backward()
            twin_opt.step()
        else:
            assert params_bits(model) == before_p
            assert opt_state_bits(opt) == before_s
        assert params_bits(model) == params_bits(twin)
        assert amp.stats(opt).scales == (ref_scaler.scale,)
        assert managed_state(opt).scalers[0].scale_tensor("cpu").item() == ref_scaler.scale
    skipped = sum(x is not None for x in plan)
    s = amp.stats(opt)
    assert (s.steps, s.skipped, s.taken) == (len(plan), skipped, len(plan) - skipped)


def test_one_host_sync_per_step():
    class CountSyncs(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if resolve_name(func) in {"torch.Tensor.item", "torch.Tensor.tolist", "torch.Tensor.__bool__",
                                      "torch.Tensor.__float__", "torch.Tensor.__int__", "torch.Tensor.cpu"}:
                self.n += 1
            return func(*args, **(kwargs or {}))

    # (SGD with momentum: a foreach step, decided on the host; test_device_skip has the
    # steps the device decides, which read nothing)
    model = mlp()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), num_losses=2)
    for i in range(3):
        opt.zero_grad()
        with amp.scale_loss(loss_of(model, i), opt) as s:
            s.backward()
        with amp.scale_loss(loss_of(model, i + 10), opt, loss_id=1 if i else 0) as s:
            s.backward()
        amp.unscale(opt)
        with CountSyncs() as counter:
            opt.step()
        assert counter.n == 1


def test_gradient_accumulation_is_bitwise_plain_accumulation():
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=True)  # ampkit's pick
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for step in range(3):
        ref_opt.zero_grad()
        opt.zero_grad()
        for micro in range(3):
            (loss_of(ref, 3 * step + micro) / 3).backward()
            with amp.scale_loss(loss_of(model, 3 * step + micro) / 3, opt) as s:
                s.backward()
        ref_opt.step()
        opt.step()
    assert params_bits(model) == params_bits(ref)


def test_unscale_before_clipping_is_idempotent_and_exact():
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.5))
    for i in range(3):
        ref_opt.zero_grad()
        loss_of(ref, i).backward()
        opt.zero_grad()
        with amp.scale_loss(loss_of(model, i), opt) as s:
            s.backward()
        amp.unscale(opt)
        amp.unscale(opt)  # second call: no-op
        assert [bits(p.grad) for p in model.parameters()] == [bits(p.grad) for p in ref.parameters()]
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    assert params_bits(model) == params_bits(ref)


def test_grads_are_real_without_unscale_and_a_backward_after_unscale_accumulates():
    """The hooks unscale grads as backward produces them: clipping without
    amp.unscale clips the real grads, and another backward after unscale in the same
    step simply adds to them (bitwise plain fp32)."""
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.5))
    for i in range(3):
        ref_opt.zero_grad()
        opt.zero_grad()
        loss_of(ref, i).backward()
        with amp.scale_loss(loss_of(model, i), opt) as s:
            s.backward()
        assert [bits(p.grad) for p in model.parameters()] == [bits(p.grad) for p in ref.parameters()]
        amp.unscale(opt)
        loss_of(ref, i + 7).backward()
        with amp.scale_loss(loss_of(model, i + 7), opt) as s:
            s.backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        assert norm.item() == norm_ref.item()
        ref_opt.step()
        opt.step()
    assert params_bits(model) == params_bits(ref)


def test_closure_steps_and_skips():
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))

    evaluations = []

    def closure_for(i, poison=False):
        def closure():
            evaluations.append(i)
            opt.zero_grad()
            loss = loss_of(model, i)
            with amp.scale_loss(loss * INF if poison else loss, opt) as s:
                s.backward()
            return loss

        return closure

    for i in range(3):
        def ref_closure(i=i):
            ref_opt.zero_grad()
            loss = loss_of(ref, i)
            loss.backward()
            return loss

        expected = ref_opt.step(ref_closure)
        got = opt.step(closure_for(i))
        assert got.item() == expected.item()
    assert evaluations == [0, 1, 2]  # ampkit evaluates the closure once per step
    before = params_bits(model)
    returned = opt.step(closure=closure_for(5, poison=True))
    assert amp.step_skipped(opt) and returned is not None
    assert params_bits(model) == before == params_bits(ref)


def test_step_without_scale_loss_still_refuses_inf():
    model = mlp()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1))
    loss_of(model, 0).backward()
    before = params_bits(model)
    next(model.parameters()).grad[0, 0] = float("nan")
    opt.step()
    assert amp.step_skipped(opt) and params_bits(model) == before
    assert amp.stats(opt).scales == (2.0**16,)  # no scaler event: nothing was scaled


def test_fused_adam_goes_through_the_generic_path():
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, fused=True)
    opt = amp.init_trainer(torch.optim.Adam(model.parameters(), lr=1e-2, fused=True))
    assert opt._step_supports_amp_scaling
    for i in range(4):
        opt.zero_grad()
        with amp.scale_loss(loss_of(model, i) * (INF if i == 2 else 1.0), opt) as s:
            s.backward()
        before_p, before_s = params_bits(model), opt_state_bits(opt)
        opt.step()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        if i == 2:
            assert amp.step_skipped(opt)
            assert params_bits(model) == before_p and opt_state_bits(opt) == before_s
            continue
        ref_opt.zero_grad()
        loss_of(ref, i).backward()
        ref_opt.step()
        assert params_bits(model) == params_bits(ref)


def test_float16_params_warn_once():
    model = mlp().half()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = batch(0)[0].half()
    with pytest.warns(UserWarning, match="float16 parameters"):
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as s:
            s.backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as s:
            s.backward()
        opt.step()


# --- NumericsError ---------------------------------------------------------------------
def test_numerics_error_when_grads_stay_nan_at_the_floor():
    model = mlp()
    opt = amp.init_trainer(torch.optim.Adam(model.parameters(), lr=1e-2))
    start = params_bits(model)
    for i in range(16):  # 2**16 halves down to the floor 1.0 in 16 skipped steps
        opt.zero_grad()
        with amp.scale_loss(loss_of(model, i) * float("nan"), opt) as s:
            s.backward()
        opt.step()
    assert amp.stats(opt).scales == (1.0,) and amp.stats(opt).skipped == 16
    opt.zero_grad()
    with amp.scale_loss(loss_of(model, 99) * float("nan"), opt) as s:
        s.backward()
    with pytest.raises(NumericsError, match="floor min_scale=1") as err:
        opt.step()
    assert "17 step(s) skipped in a row" in str(err.value)
    assert params_bits(model) == start
    assert amp.stats(opt).skipped == 17


def test_numerics_error_after_too_many_skips_in_a_row():
    model = mlp()
    scaler = LossScaler(init_scale=2.0**10, hysteresis=1000, max_consecutive_skips=5)
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1), scaler)
    for i in range(6):
        opt.zero_grad()
        with amp.scale_loss(loss_of(model, i) * INF, opt) as s:
            s.backward()
        if i < 5:
            opt.step()
    with pytest.raises(NumericsError, match="6 optimizer steps skipped in a row"):
        opt.step()
    assert amp.stats(opt).scales == (2.0**10,)  # hysteresis absorbed them all


# --- schedulers ------------------------------------------------------------------------
def _run_with_schedulers(make_before: bool, mode: str, skip_at=(0, 3, 4), steps=8):
    """``mode``: "plain" (sched.step() every iteration), "passed" (init_trainer steps
    it: schedulers=[sched]) or "guarded" (if not amp.step_skipped(opt): sched.step())."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    lam = lambda epoch: 1.0 / (epoch + 1)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam) if make_before else None
    if mode == "passed":
        if sched is None:
            pytest.skip("schedulers= takes schedulers made before init_trainer")
        amp.init_trainer(opt, schedulers=[sched])
    else:
        amp.init_trainer(opt)
    if sched is None:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    used_lrs = []
    # a post-hook runs after taken steps only: the learning rates the updates used
    opt.register_step_post_hook(lambda o, a, k: used_lrs.append(o.param_groups[0]["lr"]))
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for i in range(steps):
            opt.zero_grad()
            with amp.scale_loss(loss_of(model, i) * (INF if i in skip_at else 1.0), opt) as s:
                s.backward()
            opt.step()
            assert amp.step_skipped(opt) is (i in skip_at)
            if mode == "plain" or (mode == "guarded" and not amp.step_skipped(opt)):
                sched.step()
    return sched, used_lrs, records


@pytest.mark.parametrize("make_before", [True, False], ids=["sched-before", "sched-after"])
def test_skipped_first_step_gives_no_scheduler_warning(make_before):
    sched, used, records = _run_with_schedulers(make_before, mode="plain")
    assert no_sched_warnings(records) == []
    assert sched.last_epoch == 8  # stepped by the loop on every step, skipped or not
    assert used == [1.0 / (e + 1) for e in (1, 2, 5, 6, 7)]


def test_torch_gradscaler_does_warn_in_the_same_situation():
    """The control: the check above can fail (pytorch#55585)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    gs = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        gs.scale(loss_of(model, 0) * INF).backward()
        gs.step(opt)
        gs.update()
        sched.step()
    assert no_sched_warnings(records)


def test_wrapper_keeps_scheduler_marker_and_stays_wrappable():
    opt = torch.optim.SGD(mlp().parameters(), lr=1.0)
    torch.optim.lr_scheduler.StepLR(opt, 1)
    amp.init_trainer(opt)
    assert hasattr(opt.step, "_wrapped_by_lr_sched") and hasattr(opt.step, "__func__")
    opt2 = amp.init_trainer(torch.optim.SGD(mlp().parameters(), lr=1.0))
    assert not hasattr(opt2.step, "_wrapped_by_lr_sched")
    torch.optim.lr_scheduler.StepLR(opt2, 1)  # wraps our bound method's __func__
    assert hasattr(opt2.step, "_wrapped_by_lr_sched")


@pytest.mark.parametrize(
    "make_before, mode",
    [(True, "passed"), (True, "guarded"), (False, "guarded")],
    ids=["passed", "guarded-sched-before", "guarded-sched-after"],
)
def test_schedules_advance_lr_only_on_real_steps(make_before, mode):
    sched, used, records = _run_with_schedulers(make_before, mode=mode)
    assert no_sched_warnings(records) == []
    assert [r for r in records if "ampkit" in str(r.message)] == []
    assert sched.last_epoch == 5  # 8 steps, 3 skipped
    assert used == [1.0 / (e + 1) for e in range(5)]  # no value of the schedule lost
    assert type(sched) is torch.optim.lr_scheduler.LambdaLR


def test_passed_scheduler_state_dict_pickles_and_resumes():
    """A checkpoint taken right after a skipped step: the scheduler's state_dict
    pickles, loads into a fresh scheduler, and the resumed one advances on real steps."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    amp.init_trainer(opt, schedulers=[sched])
    with amp.scale_loss(loss_of(model, 0) * INF, opt) as s:
        s.backward()
    opt.step()
    assert amp.step_skipped(opt) and sched.last_epoch == 0
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    model2 = mlp()
    opt2 = torch.optim.SGD(model2.parameters(), lr=1.0)
    fresh = torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.5)
    fresh.load_state_dict(torch.load(buf, weights_only=False))
    amp.init_trainer(opt2, schedulers=[fresh])
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for i in range(3):
            opt2.zero_grad()
            with amp.scale_loss(loss_of(model2, i) * (INF if i == 1 else 1.0), opt2) as s:
                s.backward()
            opt2.step()
    assert [r for r in records if "ampkit" in str(r.message)] == []
    assert fresh.last_epoch == 2 and opt2.param_groups[0]["lr"] == 0.5**2


def test_a_passed_scheduler_stepped_by_the_loop_too_is_warned_about_once():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    amp.init_trainer(opt, schedulers=[sched])
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for i in range(3):
            opt.zero_grad()
            with amp.scale_loss(loss_of(model, i), opt) as s:
                s.backward()
            opt.step()
            sched.step()  # the mistake: ampkit steps it already
    mine = [r for r in records if "init_trainer(schedulers=" in str(r.message)]
    assert len(mine) == 1 and "Remove your sched.step()" in str(mine[0].message)
    assert mine[0].filename == __file__
    assert sched.last_epoch == 6


def test_schedulers_argument_is_checked_before_anything_changes():
    opt = torch.optim.SGD(mlp().parameters(), lr=1.0)
    other = torch.optim.SGD(mlp().parameters(), lr=1.0)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, 1)
    cases = [
        ([torch.optim.lr_scheduler.ReduceLROnPlateau(opt)], "ReduceLROnPlateau steps on a metric"),
        ([torch.optim.lr_scheduler.StepLR(other, 1)], "not in this init_trainer call"),
        (["StepLR"], "must be torch.optim.lr_scheduler.LRScheduler"),
        ([step_lr, step_lr], "appears twice"),
    ]
    for schedulers, message in cases:
        with pytest.raises(StateError, match=message):
            amp.init_trainer(opt, schedulers=schedulers)
        with pytest.raises(StateError, match="not managed by ampkit"):
            amp.stats(opt)  # nothing done


# --- several losses, several optimizers ------------------------------------------------
def _two_loss_setup():
    model = mlp()
    scalers = [LossScaler(init_scale=2.0**10, growth_interval=2), LossScaler(init_scale=2.0**12, growth_interval=2)]
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1), scalers, num_losses=2)
    return model, opt, scalers


def _two_loss_step(model, opt, i, order=(0, 1), poison=()):
    opt.zero_grad()
    for loss_id in order:
        loss = loss_of(model, 2 * i + loss_id)
        with amp.scale_loss(loss * (INF if loss_id in poison else 1.0), opt, loss_id=loss_id) as s:
            s.backward()
    opt.step()


def test_two_losses_bitwise_equal_to_plain_two_backward_passes():
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1),
                           [LossScaler(init_scale=2.0**3), LossScaler(init_scale=2.0**14)], num_losses=2)
    for i in range(3):
        ref_opt.zero_grad()
        loss_of(ref, 2 * i).backward()
        loss_of(ref, 2 * i + 1).backward()
        ref_opt.step()
        _two_loss_step(model, opt, i)
    assert params_bits(model) == params_bits(ref)


def test_two_losses_two_scalers_evolve_independently():
    model, opt, (s0, s1) = _two_loss_setup()
    _two_loss_step(model, opt, 0)
    assert (s0.scale, s0.growth_tracker, s1.scale, s1.growth_tracker) == (2.0**10, 1, 2.0**12, 1)
    # Loss 1 overflows: step skipped, scaler 1 backs off, scaler 0 counts a clean step and grows.
    before = params_bits(model)
    _two_loss_step(model, opt, 1, poison=(1,))
    assert amp.step_skipped(opt) and params_bits(model) == before
    assert (s0.scale, s0.growth_tracker) == (2.0**11, 0)
    assert (s1.scale, s1.growth_tracker, s1.num_overflows) == (2.0**11, 0, 1)
    # Loss 0 overflows first: scaler 0 backs off; loss 1's check is masked -> unchanged.
    _two_loss_step(model, opt, 2)
    state1 = s1.state_dict()
    _two_loss_step(model, opt, 3, poison=(0,))
    assert s0.scale == 2.0**10 and s0.num_overflows == 1
    assert s1.state_dict() == state1
    # Order reversed: loss 1 first and overflowing; loss 0 after it is masked.
    state0 = s0.state_dict()
    _two_loss_step(model, opt, 4, order=(1, 0), poison=(1,))
    assert s0.state_dict() == state0 and s1.num_overflows == 2
    assert amp.stats(opt).scales == (s0.scale, s1.scale)
    assert amp.stats(opt).skipped == 3


def test_list_of_losses_and_loss_id_checks():
    model = mlp()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1))
    with amp.scale_loss([loss_of(model, 0), loss_of(model, 1)], opt) as scaled:
        assert isinstance(scaled, list) and len(scaled) == 2
        (scaled[0] + scaled[1]).backward()
    opt.step()
    with pytest.raises(StateError, match="num_losses=1"):
        with amp.scale_loss(loss_of(model, 0), opt, loss_id=1):
            pass


def test_optimizers_of_one_call_share_scalers_and_update_once_per_iteration():
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)
    oa, ob = amp.init_trainer([torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)],
                              LossScaler(init_scale=2.0**8, growth_interval=3))
    scaler = managed_state(oa).scalers[0]
    assert managed_state(ob).scalers[0] is scaler
    for i in range(2):
        x, y = batch(i)
        with amp.scale_loss(F.mse_loss(b(a(x)), y[:, :2]), [oa, ob]) as s:
            s.backward()
        oa.step()
        assert scaler.growth_tracker == i  # waits for ob
        ob.step()
        assert scaler.growth_tracker == i + 1
        oa.zero_grad()
        ob.zero_grad()
    # Overflow only in b's grads: a steps, b skips, the shared scaler backs off once.
    x, y = batch(5)
    with amp.scale_loss(F.mse_loss(b(a(x)), y[:, :2]), [oa, ob]) as s:
        s.backward()
    b.weight.grad[0, 0] = INF
    before_b = params_bits(b)
    oa.step()
    ob.step()
    assert not amp.step_skipped(oa) and amp.step_skipped(ob) and params_bits(b) == before_b
    assert scaler.scale == 2.0**7 and scaler.num_overflows == 1


def test_separate_trainers_cannot_share_a_loss():
    oa = amp.init_trainer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    ob = amp.init_trainer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(StateError, match="different loss scalers"):
        with amp.scale_loss(torch.ones(()), [oa, ob]):
            pass


# --- session, checkpoints, resume --------------------------------------------------------
def _resume_setup(seed: int):
    model = mlp(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scalers = [LossScaler(init_scale=2.0**8, growth_interval=3, hysteresis=2), LossScaler(init_scale=2.0**5, growth_interval=2)]
    amp.init_trainer(opt, scalers, num_losses=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.7)
    return model, opt, sched


_POISON = {1: (0,), 2: (0,), 4: (1,), 7: (0, 1), 8: (1,), 9: (0,)}


def _resume_steps(model, opt, sched, steps):
    for i in steps:
        _two_loss_step(model, opt, i, poison=_POISON.get(i, ()))
        sched.step()


def test_state_dict_round_trips_and_resume_is_bitwise():
    model, opt, sched = _resume_setup(0)
    _resume_steps(model, opt, sched, range(12))
    uninterrupted = (params_bits(model), opt_state_bits(opt), amp.state_dict(), amp.stats(opt))
    amp.reset()

    model, opt, sched = _resume_setup(0)
    _resume_steps(model, opt, sched, range(6))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "amp": amp.state_dict()}, buf)
    amp.reset()

    model, opt, sched = _resume_setup(123)  # a different init: everything must come from the checkpoint
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    amp.load_state_dict(ckpt["amp"])
    assert amp.state_dict() == ckpt["amp"]  # exact round trip
    _resume_steps(model, opt, sched, range(6, 12))
    assert params_bits(model) == uninterrupted[0]
    assert opt_state_bits(opt) == uninterrupted[1]
    assert amp.state_dict() == uninterrupted[2]
    assert amp.stats(opt) == uninterrupted[3]
    assert uninterrupted[3].skipped == len(_POISON)


def test_load_state_dict_into_a_different_setup_raises():
    _resume_setup(0)
    sd = amp.state_dict()
    amp.reset()
    amp.init_trainer(torch.optim.SGD(mlp().parameters(), lr=0.1))  # num_losses=1
    with pytest.raises(StateError, match="num_losses"):
        amp.load_state_dict(sd)
    amp.init_trainer(torch.optim.SGD(mlp().parameters(), lr=0.1))
    with pytest.raises(StateError, match=r"3 trainer\(s\) but this session has 2"):
        amp.load_state_dict(sd | {"trainers": sd["trainers"] * 3})
    with pytest.raises(StateError, match="not an ampkit session"):
        amp.load_state_dict({"scale": 1.0})


def test_new_session_releases_and_starts_empty():
    opt = amp.init_trainer(torch.optim.SGD(mlp().parameters(), lr=0.1))
    assert "step" in opt.__dict__ and "zero_grad" in opt.__dict__
    assert len(amp_session.current_session().members) == 1
    fresh = amp_session.new_session()
    assert fresh is amp_session.current_session() and fresh.members == ()
    assert "step" not in opt.__dict__  # the optimizer's own step is back
    assert "zero_grad" not in opt.__dict__
    with pytest.raises(StateError, match="not managed"):
        amp.stats(opt)
    amp.init_trainer(opt)  # can be managed again in the new session
    with pytest.raises(StateError, match="already managed"):
        amp.init_trainer(opt)


def test_unmanaged_optimizer_errors():
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(StateError, match="init_trainer"):
        with amp.scale_loss(torch.ones(()), opt):
            pass
    with pytest.raises(StateError):
        amp.step_skipped(opt)
    with pytest.raises(StateError):
        amp.unscale(opt)
    with pytest.raises(StateError):
        amp.init_trainer(opt, num_losses=0)


def test_release_restores_a_wrapper_that_was_there_before():
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, 1)
    scheduler_wrapper = opt.__dict__["step"]
    amp.init_trainer(opt)
    amp.trainer.release(opt)
    assert opt.__dict__["step"] is scheduler_wrapper
    assert amp_session.current_session().members == ()


# --- extension points (master weights build on these) -----------------------------------
def test_hooks_run_at_the_right_times_and_swapped_params_are_checked():
    """Simulated fp32 master weights: param_groups hold separate master tensors; a
    pre-unscale hook copies model grads into them; a post-step hook copies back."""
    model = mlp()
    masters = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = amp.init_trainer(torch.optim.SGD(masters, lr=0.1), num_losses=2)
    state = managed_state(opt)
    calls = []

    def copy_grads_in():
        calls.append("pre")
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.detach().clone()

    def copy_back():
        calls.append("post")
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)

    class Hooks(StepExtension):
        def before_check(self) -> None:
            copy_grads_in()

        def after_step(self, skipped: bool) -> None:
            if skipped:
                calls.append("skip")
            else:
                copy_back()

    state.add_extension(Hooks())
    state.backward_params = list(model.parameters())
    saved = {"v": 0}
    state.register_extra_state("masters", lambda: [m.detach().clone() for m in masters],
                               lambda v: saved.update(v=len(v)))

    for i in range(3):
        model.zero_grad()
        for loss_id in (0, 1):  # two losses: the transition rescales *model* grads
            with amp.scale_loss(loss_of(model, 2 * i + loss_id), opt, loss_id=loss_id) as s:
                s.backward()
        amp.unscale(opt)
        opt.step()  # hooks once per step even with an explicit unscale
        ref_opt.zero_grad()
        loss_of(ref, 2 * i).backward()
        loss_of(ref, 2 * i + 1).backward()
        ref_opt.step()
    assert calls == ["pre", "post"] * 3
    assert params_bits(model) == params_bits(ref)

    model.zero_grad()
    with amp.scale_loss(loss_of(model, 50), opt) as s:
        s.backward()
    model[0].weight.grad[0, 0] = INF  # lands in a master grad via the hook
    before = params_bits(model)
    opt.step()
    assert calls[-2:] == ["pre", "skip"] and params_bits(model) == before

    sd = amp.state_dict()
    assert len(sd["trainers"][0]["optimizers"][0]["extra"]["masters"]) == 4
    amp.load_state_dict(sd)
    assert saved["v"] == 4


def test_session_extra_state():
    box = {"x": 1}
    amp_session.register_extra_state("box", lambda: dict(box), lambda v: box.update(v))
    sd = amp.state_dict()
    box["x"] = 5
    amp.load_state_dict(sd)
    assert box == {"x": 1}
    with pytest.raises(StateError, match="already registered"):
        amp_session.register_extra_state("box", dict, print)


def test_overflow_logged_once_per_event_not_per_optimizer(caplog):
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)
    # (momentum: steps decided in step(), which logs; a step decided on the device logs
    # when its outcome is recorded)
    oa, ob = amp.init_trainer([torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9),
                               torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)])
    x, y = batch(0)
    with caplog.at_level(logging.INFO, logger="ampkit"):
        with amp.scale_loss(F.mse_loss(b(a(x)), y[:, :2]) * INF, [oa, ob]) as s:
            s.backward()
        oa.step()
        ob.step()
    records = [r for r in caplog.records if r.name == "ampkit" and r.levelno == logging.INFO]
    assert len(records) == 1 and "loss scaler 0" in records[0].getMessage()


def test_scaler_argument_forms():
    model = mlp()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=128.0)
    with amp.scale_loss(loss_of(model, 0) * INF, opt) as s:
        assert s.dtype == torch.float32
        s.backward()
    opt.step()
    assert amp.step_skipped(opt) and amp.stats(opt).scales == (128.0,)  # static: never moves

    template = LossScaler(init_scale=2.0**6, hysteresis=3)
    opt2 = amp.init_trainer(torch.optim.SGD(mlp().parameters(), lr=0.1), template, num_losses=3)
    scalers = managed_state(opt2).scalers
    assert scalers[0] is template and len({id(s) for s in scalers}) == 3
    assert [s.hysteresis for s in scalers] == [3, 3, 3] and amp.stats(opt2).scales == (64.0,) * 3
    with pytest.raises(StateError, match="already drives another trainer"):
        amp.init_trainer(torch.optim.SGD(mlp().parameters(), lr=0.1), template)
    with pytest.raises(StateError, match="one LossScaler per loss id"):
        amp.init_trainer(torch.optim.SGD(mlp().parameters(), lr=0.1), [LossScaler()], num_losses=2)


def test_scale_loss_after_unscale_accumulates_exactly():
    """Unscaling at each scale_loss exit (what ampkit.compat.apex does): a later
    scale_loss in the same step goes on accumulating into the real grads, exactly."""
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1),
                           [LossScaler(init_scale=2.0**4), LossScaler(init_scale=2.0**9)], num_losses=2)
    for i in range(2):
        ref_opt.zero_grad()
        opt.zero_grad()
        for loss_id in (0, 1):
            loss_of(ref, 2 * i + loss_id).backward()
            with amp.scale_loss(loss_of(model, 2 * i + loss_id), opt, loss_id=loss_id) as s:
                s.backward()
            amp.unscale(opt)
        ref_opt.step()
        opt.step()
    assert params_bits(model) == params_bits(ref)
    assert amp.stats(opt).skipped == 0


def test_init_trainer_default_scale_follows_the_compute_dtype():
    """bf16 (amp.init's CPU default, or bf16 params): a static 1, still skipping
    inf/NaN steps; fp16, or nothing known (fp32 params, no amp.init): dynamic 2**16."""
    def default_scale(setup) -> tuple[tuple[float, ...], bool]:
        model = mlp()
        setup(model)
        opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1))
        scaler = managed_state(opt).scalers[0]
        out = (amp.stats(opt).scales, scaler.dynamic)
        amp.reset()
        return out

    assert default_scale(lambda m: amp.init(device_type="cpu")) == ((1.0,), False)
    assert default_scale(lambda m: m.to(torch.bfloat16)) == ((1.0,), False)
    assert default_scale(lambda m: None) == ((2.0**16,), True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU warns, deliberately
        assert default_scale(lambda m: amp.init(device_type="cpu", dtype=torch.float16)) == ((2.0**16,), True)
    # static 1 still refuses to step on a non-finite grad
    model = mlp()
    amp.init(device_type="cpu")
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1))
    with amp.scale_loss(loss_of(model, 0) * INF, opt) as s:
        s.backward()
    before = params_bits(model)
    opt.step()
    assert amp.step_skipped(opt) and params_bits(model) == before


def test_skipped_steps_warn_once_then_in_rate_limited_summaries(caplog, monkeypatch):
    """The first skip at WARNING, pointing at the user's line; then at most one summary
    per SKIP_SUMMARY_SECONDS, never one line per step."""
    model = mlp()  # (momentum: decided in step(), the line the warning points at)
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), scaler=1.0)

    def skipped_step() -> None:
        with amp.scale_loss(loss_of(model, 0) * INF, opt) as s:
            s.backward()
        opt.step()  # the line the warning points at
        opt.zero_grad()

    with caplog.at_level(logging.WARNING, logger="ampkit"):
        for _ in range(20):
            skipped_step()
    warned = [r for r in caplog.records if r.name == "ampkit" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "step 1 skipped" in warned[0].getMessage()
    assert warned[0].pathname == __file__
    caplog.clear()
    monkeypatch.setattr(amp_stats, "SKIP_SUMMARY_SECONDS", 0.0)
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        skipped_step()
    warned = [r for r in caplog.records if r.name == "ampkit" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "20 more optimizer step(s) skipped" in warned[0].getMessage()
    assert "(21 of 21 steps so far)" in warned[0].getMessage()
