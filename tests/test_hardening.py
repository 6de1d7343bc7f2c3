"""Hardening: no silent NaN from a tiny scale, all-or-nothing state loading and
initialize, no leaked O2 setups, recovery from an abandoned iteration, AmpError (never
a raw TypeError/KeyError) for nonsense arguments, checkpoints that load with
``weights_only=True``. One regression test per defect, then hypothesis-driven tests
that throw malformed arguments and state dicts at every public entry point and check
that each raises an AmpError and leaves every object involved bitwise unchanged."""

from __future__ import annotations

import copy
import gc
import io
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp
from ampkit import AmpError, LossScaler, ScalerError, StateError
from ampkit.distributed import _fingerprint as freeze  # bitwise digest of nested state
from ampkit.levels import compensation_of, master_weights_of

INF, NAN = float("inf"), float("nan")


# --- helpers -------------------------------------------------------------------------------


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def loss_of(model: nn.Module, i: int) -> torch.Tensor:
    x, y = batch(i)
    return F.mse_loss(model(x).float(), y)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, i: int, loss_id: int = 0) -> None:
    opt.zero_grad()
    with amp.scale_loss(loss_of(model, i), opt, loss_id=loss_id) as scaled:
        scaled.backward()
    opt.step()


def snapshot(models: list[nn.Module], opts: list[torch.optim.Optimizer]) -> Any:
    """Everything a refused call must leave alone: parameters (objects and bits), the
    optimizers' param groups (objects) and state, ampkit's session state and whether
    each optimizer is managed."""
    return freeze(
        {
            "params": [[(id(p), p) for p in m.parameters()] for m in models],
            "buffers": [list(m.buffers()) for m in models],
            "groups": [[[id(p) for p in g["params"]] for g in o.param_groups] for o in opts],
            "opt_state": [o.state_dict()["state"] for o in opts],
            "managed": [o.__dict__.get("_ampkit_managed") is not None for o in opts],
            "step": [o.__dict__.get("step") is not None for o in opts],
            "amp": amp.state_dict(),
            "level": repr(amp.levels.current_opt_level()),
            "casting": amp.is_active(),
        }
    )


def o2_setup(seed: int = 0, opt_cls: type = torch.optim.Adam, **kw: Any):
    model = mlp(seed)
    opt = opt_cls(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", **kw)
    return model, opt


# --- silent NaN from tiny scales ------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda m, o: amp.initialize(m, o, opt_level="O1", loss_scale=1e-40),
        lambda m, o: amp.initialize(m, o, opt_level="O1", loss_scale="dynamic", min_loss_scale=1e-40),
        lambda m, o: amp.init_trainer(o, scaler=1e-40),
        lambda m, o: amp.init_trainer(o, scaler=LossScaler(init_scale=1.0, min_scale=1e-40)),
        lambda m, o: amp.GradScaler("cpu", init_scale=1e-40, min_scale=1e-40),
    ],
    ids=["initialize", "min_loss_scale", "init_trainer", "LossScaler", "GradScaler"],
)
def test_a_scale_whose_reciprocal_overflows_fp32_is_refused(make):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ScalerError, match="reciprocal overflows float32"):
        make(model, opt)
    assert "_ampkit_managed" not in opt.__dict__


def test_smallest_usable_scale_trains_without_nan():
    """1e-38 has a finite fp32 reciprocal: steps stay finite (no NaN weights)."""
    model = mlp()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=1e-38)
    for i in range(3):
        train_step(model, opt, i)
        assert not amp.step_skipped(opt)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_unscaling_that_overflows_skips_the_step():
    """A scale below 1 multiplies grads by more than 1 when unscaling: a grad that is
    finite when scaled but not once unscaled must skip the step, not reach the weights."""
    w = nn.Parameter(torch.ones(2))
    opt = amp.init_trainer(torch.optim.SGD([w], lr=1e-40), scaler=0.25)
    with amp.scale_loss((w * 2e38).sum() * 2.0, opt) as scaled:
        scaled.backward()
    assert torch.equal(w.grad, torch.full((2,), 1e38))  # finite at the scale, 4e38 unscaled
    opt.step()
    assert amp.step_skipped(opt)
    assert torch.equal(w.detach(), torch.ones(2))


def test_loading_a_tiny_scale_is_refused_and_changes_nothing():
    model, opt = o2_setup(loss_scale="dynamic")
    train_step(model, opt, 0)
    sd = amp.state_dict()
    before = snapshot([model], [opt])
    for bad in (1e-40, NAN, INF, -4.0, 0.0, 2.0**30):
        broken = copy.deepcopy(sd)
        broken["trainers"][0]["scalers"][0]["scale"] = bad
        with pytest.raises(ScalerError):
            amp.load_state_dict(broken)
        assert snapshot([model], [opt]) == before


def test_grad_scaler_refuses_a_nan_scale_from_a_torch_state_dict():
    scaler = amp.GradScaler("cpu", init_scale=8.0)
    before = scaler.state_dict()
    torch_sd = torch.amp.GradScaler("cpu").state_dict()
    for key, bad in [("scale", NAN), ("scale", 1e-40), ("growth_interval", 2.5), ("_growth_tracker", -1)]:
        with pytest.raises(ScalerError):
            scaler.load_state_dict(dict(torch_sd, **{key: bad}))
        assert freeze(scaler.state_dict()) == freeze(before)
    with pytest.raises(ScalerError, match="lacks"):
        scaler.load_state_dict({"scale": 2.0})


# --- all-or-nothing state loading -------------------------------------------------------------


def two_trainers():
    """Two init_trainer calls in one session: an O2-like first (masters registered as
    extra state through initialize) is not possible twice, so: initialize O2 for one
    optimizer, then init_trainer for a second, plain one."""
    model_a, opt_a = o2_setup(0, loss_scale="dynamic")
    model_b = mlp(1)
    opt_b = amp.init_trainer(torch.optim.SGD(model_b.parameters(), lr=0.1), num_losses=2)
    for i in range(2):
        train_step(model_a, opt_a, i)
        train_step(model_b, opt_b, i, loss_id=i % 2)
    return [model_a, model_b], [opt_a, opt_b]


@pytest.mark.parametrize(
    "path, bad",
    [
        (("trainers", 1, "scalers", 1, "scale"), NAN),
        (("trainers", 1, "scalers", 0, "growth_tracker"), -1),
        (("trainers", 1, "scalers", 0, "num_overflows"), 2.5),
        (("trainers", 1, "scalers", 0, "dynamic"), "False"),
        (("trainers", 1, "scalers", 1, "hysteresis"), True),
        (("trainers", 1, "optimizers", 0, "steps"), -3),
        (("trainers", 1, "optimizers", 0, "last_skipped"), "no"),
        (("trainers", 1, "optimizers"), []),
        (("trainers", 1), None),
    ],
)
def test_a_bad_second_trainer_leaves_the_first_untouched(path, bad):
    models, opts = two_trainers()
    sd = amp.state_dict()
    for i in range(2, 4):  # move on, so that loading the old state would change things
        train_step(models[0], opts[0], i)
        train_step(models[1], opts[1], i)
    before = snapshot(models, opts)
    broken = copy.deepcopy(sd)
    target = broken
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = bad
    with pytest.raises(AmpError):
        amp.load_state_dict(broken)
    assert snapshot(models, opts) == before
    amp.load_state_dict(sd)  # the intact checkpoint still loads
    assert freeze(amp.state_dict()) == freeze(sd)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.__setitem__(0, [0, 0, m[0][2].to(torch.int64)]),
        lambda m: m.__setitem__(0, [0, 0, m[0][2][:1]]),
        lambda m: m.__setitem__(0, [0, 0, "tensor"]),
        lambda m: m.__setitem__(0, [0, 99, m[0][2]]),
        lambda m: m.append(list(m[0])),
        lambda m: m.pop(),
    ],
    ids=["int64", "shape", "not-a-tensor", "position", "twice", "missing"],
)
def test_bad_master_entries_are_refused_before_any_master_is_copied(mutate):
    model, opt = o2_setup()
    train_step(model, opt, 0)
    sd = amp.state_dict()
    train_step(model, opt, 1)
    before = snapshot([model], [opt])
    masters_before = freeze([p for p in amp.master_params(opt)])
    broken = copy.deepcopy(sd)
    entries = broken["trainers"][0]["optimizers"][0]["extra"]["master_weights"]["masters"]
    entries[:] = entries[::-1]  # the bad entry comes after good ones
    mutate(entries)
    with pytest.raises(StateError):
        amp.load_state_dict(broken)
    assert snapshot([model], [opt]) == before
    assert freeze(list(amp.master_params(opt))) == masters_before
    mw = master_weights_of(opt)
    with pytest.raises(StateError):
        mw.load_state_dict(broken["trainers"][0]["optimizers"][0]["extra"]["master_weights"])
    assert freeze(list(amp.master_params(opt))) == masters_before


def test_malformed_dicts_raise_amp_errors_not_raw_ones():
    model, opt = o2_setup()
    train_step(model, opt, 0)
    scaler = LossScaler()
    for bad in (None, [], {"format": "ampkit.session/1"}, {"format": "ampkit.session/1", "trainers": 3},
                {"format": "ampkit.session/1", "trainers": [{}], "extra": {}},
                {"format": "ampkit.session/1", "trainers": [{"num_losses": 1, "scalers": 1, "optimizers": []}]}):
        with pytest.raises(AmpError):
            amp.load_state_dict(bad)
    for bad in (None, {}, {**scaler.state_dict(), "scale": "1"}, {**scaler.state_dict(), "max_scale": None}):
        with pytest.raises(ScalerError):
            scaler.load_state_dict(bad)
    mw = master_weights_of(opt)
    for bad in (None, {"format": 1}, {"format": 1, "masters": 5}, {"format": 1, "masters": [[0]]}):
        with pytest.raises(StateError):
            mw.load_state_dict(bad)


def test_compensation_state_is_checked_before_loading():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2K", compensation="stochastic")
    train_step(model, opt, 0)
    comp = compensation_of(opt)
    sd = comp.state_dict()
    gen_before = comp._generator.get_state().clone()
    train_step(model, opt, 1)
    gen_after = comp._generator.get_state().clone()
    assert not torch.equal(gen_before, gen_after)
    for key, bad in [("generator", torch.zeros(3, dtype=torch.uint8)), ("generator", "seed"),
                     ("buffers", [[0, 0, torch.zeros(1)]]), ("buffers", None), ("method", "kahan"),
                     ("device_generators", {"nodevice": gen_before})]:
        with pytest.raises(StateError):
            comp.load_state_dict(dict(sd, **{key: bad}))
        assert torch.equal(comp._generator.get_state(), gen_after)
    comp.load_state_dict(sd)
    assert torch.equal(comp._generator.get_state(), gen_before)


# --- initialize validates everything first ----------------------------------------------------


@pytest.mark.parametrize(
    "level, kw",
    [
        ("O2", dict(policy=amp.Policy())),
        ("O2", dict(policy="fp32")),
        ("O2", dict(loss_scale=True)),
        ("O2", dict(num_losses=True)),
        ("O2", dict(min_loss_scale="a", loss_scale="dynamic")),
        ("O2", dict(keep_norm_fp32="yes")),
        ("O2K", dict(compensation="kahn")),
        ("O3", dict(loss_scale=1e-40)),
        ("O1", dict(master_weights=True)),
        ("O5", dict()),
        ("O2", dict(bogus=1)),
    ],
)
def test_a_refused_initialize_changes_nothing(level, kw):
    """The previous session (an O2 run) keeps working; the new model stays fp32 and its
    optimizer keeps its params and state."""
    old_model, old_opt = o2_setup(0, loss_scale="dynamic")
    train_step(old_model, old_opt, 0)
    model = mlp(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_of(model, 0).backward()
    opt.step()  # some Adam state to keep
    before = snapshot([old_model, model], [old_opt, opt])
    with pytest.raises(AmpError):
        amp.initialize(model, opt, opt_level=level, **kw)
    assert snapshot([old_model, model], [old_opt, opt]) == before
    assert all(p.dtype == torch.float32 for p in model.parameters())
    train_step(old_model, old_opt, 1)  # the old session still trains
    assert not amp.step_skipped(old_opt) and amp.stats(old_opt).steps == 2


def test_a_refused_initialize_keeps_global_casting():
    amp.initialize(mlp(), None, opt_level="O1")
    assert amp.is_active()
    with pytest.raises(AmpError):
        amp.initialize(mlp(), None, opt_level="O1", loss_scale="big")
    assert amp.is_active()


# --- leak -------------------------------------------------------------------------------------


def test_o2_setups_are_freed_after_reset():
    refs = []
    for i in range(40):
        model, opt = o2_setup(i)
        train_step(model, opt, i)
        refs.append((weakref.ref(model), weakref.ref(opt), weakref.ref(master_weights_of(opt))))
        del model, opt
    gc.collect()
    alive = [any(r() is not None for r in triple) for triple in refs]
    assert alive == [False] * 39 + [True]  # each initialize ended the session before it
    amp.reset()
    gc.collect()
    alive = [any(r() is not None for r in triple) for triple in refs]
    assert alive == [False] * 40


def test_masters_are_reused_by_a_second_initialize_of_the_same_optimizer():
    """The masters live on the optimizer now: a re-initialize still finds them."""
    model, opt = o2_setup()
    masters = list(amp.master_params(opt))
    amp.initialize(model, opt, opt_level="O2")
    assert [id(p) for p in amp.master_params(opt)] == [id(p) for p in masters]


# --- per-step state recovers from an abandoned iteration --------------------------------------


@pytest.mark.parametrize("set_to_none", [True, False])
def test_clip_error_after_unscale_then_dropped_batch(set_to_none):
    model = mlp()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=LossScaler(init_scale=4.0))
    with amp.scale_loss(loss_of(model, 0), opt) as scaled:
        scaled.backward()
    model[0].weight.grad[0, 0] = NAN
    amp.unscale(opt)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    opt.zero_grad(set_to_none=set_to_none)  # drop the batch
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i in range(1, 3):
        train_step(model, opt, i)
        assert not amp.step_skipped(opt)
        ref_opt.zero_grad()
        loss_of(reference, i).backward()
        ref_opt.step()
    assert freeze(list(model.parameters())) == freeze(list(reference.parameters()))
    assert amp.stats(opt).scales == (4.0,)


def test_scale_loss_after_unscale_without_dropping_the_grads_still_raises():
    model = mlp()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1))
    with amp.scale_loss(loss_of(model, 0), opt) as scaled:
        scaled.backward()
    amp.unscale(opt)
    with pytest.raises(StateError, match="zero_grad"):
        with amp.scale_loss(loss_of(model, 1), opt) as scaled:
            scaled.backward()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_two_losses_overflow_then_backward_error_does_not_skip_the_next_step(set_to_none):
    model = mlp()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1), num_losses=2)
    with amp.scale_loss(loss_of(model, 0) * INF, opt, loss_id=0) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="boom"):
        with amp.scale_loss(loss_of(model, 1), opt, loss_id=1) as scaled:
            raise RuntimeError("boom")  # e.g. a backward that fails
    opt.zero_grad(set_to_none=set_to_none)
    for i in range(2, 4):
        opt.zero_grad()
        with amp.scale_loss(loss_of(model, i), opt, loss_id=0) as scaled:
            scaled.backward()
        with amp.scale_loss(loss_of(model, i + 10), opt, loss_id=1) as scaled:
            scaled.backward()
        opt.step()
        assert not amp.step_skipped(opt)
    assert amp.stats(opt).overflows == (0, 0)


def test_grads_kept_after_an_error_still_count():
    """Not dropping the batch keeps its grads: an overflow in them still skips."""
    model = mlp()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1), num_losses=2)
    with amp.scale_loss(loss_of(model, 0) * INF, opt, loss_id=0) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError):
        with amp.scale_loss(loss_of(model, 1), opt, loss_id=1) as scaled:
            raise RuntimeError("boom")
    with amp.scale_loss(loss_of(model, 2), opt, loss_id=1) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_skipped(opt)


def test_o2_dropped_batch_after_unscale():
    model, opt = o2_setup(loss_scale="dynamic")
    with amp.scale_loss(loss_of(model, 0), opt) as scaled:
        scaled.backward()
    amp.unscale(opt)  # masters now hold the unscaled grads
    opt.zero_grad()
    train_step(model, opt, 1)
    assert not amp.step_skipped(opt)


# --- raw or missing errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda o, m: amp.scale_loss(loss_of(m, 0), o, loss_id="0").__enter__(), StateError),
        (lambda o, m: amp.scale_loss(loss_of(m, 0), o, loss_id=True).__enter__(), StateError),
        (lambda o, m: amp.scale_loss(1.0, o).__enter__(), StateError),
        (lambda o, m: amp.scale_loss(None, o).__enter__(), StateError),
        (lambda o, m: amp.scale_loss(torch.tensor(3), o).__enter__(), StateError),
        (lambda o, m: amp.init(bogus=1), amp.PolicyError),
        (lambda o, m: amp.init(policy="fp32"), amp.PolicyError),
        (lambda o, m: amp.initialize(m, o, opt_level="O1", min_loss_scale="a"), ScalerError),
        (lambda o, m: amp.Policy().override("x"), amp.PolicyError),
        (lambda o, m: amp.Policy().override(fp32ops=["mm"]), amp.PolicyError),
        (lambda o, m: LossScaler(init_scale="big"), ScalerError),
        (lambda o, m: amp.initialize(m, o, opt_level="O1", loss_scale=True), ScalerError),
        (lambda o, m: amp.initialize(m, o, opt_level="O1", num_losses=True), AmpError),
        (lambda o, m: amp.init_trainer(o, num_losses=True), StateError),
        (lambda o, m: amp.init_trainer(o, scaler=True), StateError),
        (lambda o, m: LossScaler(dynamic="no"), ScalerError),
        (lambda o, m: LossScaler(hysteresis=2.7), ScalerError),
        (lambda o, m: LossScaler(growth_interval=True), ScalerError),
        (lambda o, m: amp.Policy(fp32_ops=[nn.Linear]), amp.PolicyError),
        (lambda o, m: amp.GradScaler("mps"), ScalerError),
        (lambda o, m: amp.GradScaler("cpu", enabled="yes"), ScalerError),
        (lambda o, m: amp.Policy(conditional_fp32_ops=[(F.normalize, lambda *a, **k: True)]), amp.PolicyError),
    ],
)
def test_nonsense_arguments_raise_amp_errors(call, error):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if "scale_loss" in call.__code__.co_names:
        amp.init_trainer(opt)
    with pytest.raises(error):
        call(opt, model)


def test_complex_parameters_train_and_overflows_skip():
    class Rotor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.phase = nn.Parameter(torch.randn(4, dtype=torch.complex64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.lin(x) * self.phase).abs().sum()

    for level in ("O0", "O1", "O2"):
        amp.reset()
        model = Rotor()
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level=level, loss_scale="dynamic")
        phase = model.phase.detach().clone()
        with amp.scale_loss(model(torch.randn(2, 4)).float(), opt) as scaled:
            scaled.backward()
        opt.step()
        assert not amp.step_skipped(opt) and not torch.equal(model.phase.detach(), phase)
        assert model.phase.dtype == torch.complex64
        phase = model.phase.detach().clone()
        opt.zero_grad()
        with amp.scale_loss(model(torch.randn(2, 4)).float(), opt) as scaled:
            scaled.backward()
        model.phase.grad[1] = complex(0, INF)
        opt.step()
        assert amp.step_skipped(opt) and torch.equal(model.phase.detach(), phase), level


# --- checkpoints load with weights_only=True --------------------------------------------------


def roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O2K"])
def test_every_checkpoint_loads_with_weights_only(level):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kw = {"compensation": "stochastic"} if level == "O2K" else {"loss_scale": "dynamic", "num_losses": 2}
    model, opt = amp.initialize(model, opt, opt_level=level, **kw)
    for i in range(3):
        train_step(model, opt, i, loss_id=i % 2 if level != "O2K" else 0)
    sd = amp.state_dict()
    loaded = roundtrip({"amp": sd, "model": model.state_dict(), "opt": opt.state_dict()})
    assert freeze(loaded["amp"]) == freeze(sd)
    amp.load_state_dict(loaded["amp"])


def test_apex_compat_checkpoint_loads_with_weights_only():
    from ampkit.compat.apex import amp as apex_amp

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = apex_amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic")
    with apex_amp.scale_loss(loss_of(model, 0), opt) as scaled:
        scaled.backward()
    opt.step()
    sd = apex_amp.state_dict()
    assert "loss_scaler0" in sd
    loaded = roundtrip(sd)
    assert freeze(loaded) == freeze(sd)
    apex_amp.load_state_dict(loaded)


def test_scaler_checkpoints_load_with_weights_only():
    scaler = amp.GradScaler("cpu", hysteresis=2)
    loss_scaler = LossScaler(init_scale=3.0, max_consecutive_skips=None)
    for sd in (scaler.state_dict(), loss_scaler.state_dict()):
        assert freeze(roundtrip(sd)) == freeze(sd)
    scaler.load_state_dict(roundtrip(scaler.state_dict()))
