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
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import ampkit as amp
from ampkit import AmpError, LossScaler, ScalerError, StateError
from ampkit.distributed.core import fingerprint as freeze  # bitwise digest of nested state
from ampkit.levels.setup import compensation_of, master_weights_of
from ampkit.scaling import loss_scaler as scaling
from ampkit.trainer.api import managed_state

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
    # finite at the scale (1e38), 4e38 once unscaled: grads are unscaled as backward
    # produces them, so the overflow shows at once
    assert torch.isinf(w.grad).all()
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


def test_extra_state_checks_run_before_any_extra_state_is_set():
    """register_extra_state(check_fn=...): a check failing on the second optimizer's
    extra state keeps the first one's set_fn from running; a check that trips over a
    malformed value with a raw error becomes a StateError."""
    models, opts = [mlp(0), mlp(1)], []
    for model in models:
        opts.append(amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1)))
    loaded: list[Any] = []

    def check(value: Any) -> None:
        if value["v"] < 0:
            raise StateError("negative")

    for i, opt in enumerate(opts):
        managed_state(opt).register_extra_state(f"box{i}", lambda: {"v": 1}, loaded.append, check)
    sd = amp.state_dict()
    broken = copy.deepcopy(sd)
    broken["trainers"][1]["optimizers"][0]["extra"]["box1"] = {"v": -1}
    with pytest.raises(StateError, match="negative"):
        amp.load_state_dict(broken)
    broken["trainers"][1]["optimizers"][0]["extra"]["box1"] = {}  # check() raises KeyError
    with pytest.raises(StateError, match="'box1' is malformed"):
        amp.load_state_dict(broken)
    assert loaded == []
    amp.load_state_dict(sd)
    assert loaded == [{"v": 1}, {"v": 1}]


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
        ("O3", dict(policy=amp.Policy())),  # O3 casts no op: a policy has nothing to do
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


def test_scale_loss_after_unscale_without_dropping_the_grads_accumulates():
    """Grads are real at all times (ampkit.grads): a backward after unscale in the same
    step adds to them, as a second backward would in fp32."""
    model, ref = mlp(), mlp()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1))
    with amp.scale_loss(loss_of(model, 0), opt) as scaled:
        scaled.backward()
    amp.unscale(opt)
    with amp.scale_loss(loss_of(model, 1), opt) as scaled:
        scaled.backward()
    loss_of(ref, 0).backward()
    loss_of(ref, 1).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


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
        (lambda o, m: LossScaler(init_scale=10**400), ScalerError),  # beyond float64
        (lambda o, m: LossScaler(growth_factor=10**400), ScalerError),
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
        (lambda o, m: amp.master_params(None), StateError),
        (lambda o, m: amp.GradScaler("cpu").step("opt"), StateError),
        (lambda o, m: amp.GradScaler("cpu").scale(3), ScalerError),
        (lambda o, m: amp.MasterWeights("opt"), AmpError),
        (lambda o, m: amp.CompensatedUpdates(o, chunk_numel="big"), AmpError),
        (lambda o, m: amp.CompensatedUpdates("opt"), AmpError),
        (lambda o, m: amp.cast_model("model", torch.bfloat16), AmpError),
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

    for level in ("O0", "O1", "O2", "O3", "O2K"):
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


# --- hypothesis: malformed state dicts --------------------------------------------------------
#
# A mutation takes a valid state dict and breaks it in one place, with a value known to be
# invalid there (chosen by the key it sits under): a bad scale or count, a wrong type, a
# tensor of the wrong dtype or shape, a missing key, a container of the wrong kind or
# length. Every mutation must raise an AmpError and change nothing.

_SCALE_BAD = [NAN, INF, -INF, -4.0, 0.0, 1e-40, 2.0**30, 0.5, 10**400, "1", None, True, [2.0]]
_COUNT_BAD = [-1, 2.5, True, "3", None, 2**63, 2**70]  # counters are ints in [0, 2**63)
_FLAG_BAD = ["False", "True", 0, 1, None]
_BAD_BY_KEY: dict[str, list[Any]] = {
    "scale": _SCALE_BAD,
    "init_scale": _SCALE_BAD,
    "loss_scale": [NAN, INF, -4.0, 0.0, 1e-40, "1", None, True],
    "min_scale": [NAN, INF, -4.0, 0.0, 1e-40, 2.0**30, -(10**400), "1", None, True],
    "max_scale": [NAN, -4.0, 0.0, 1e-40, 1.0, "x", None, True],
    # factors are normal fp32 numbers: 1e-45 is subnormal, 1e39 beyond fp32's range
    "growth_factor": [1.0, 0.5, -2.0, NAN, INF, 1e39, 1e300, 10**400, "2", None, True],
    "backoff_factor": [0.0, 1.0, 1.5, -0.5, NAN, 1e-45, 2.0**-127, "x", None, True],
    "growth_interval": [0, *_COUNT_BAD],
    "hysteresis": [0, *_COUNT_BAD],
    "hysteresis_left": [0, 2, *_COUNT_BAD],
    "growth_tracker": _COUNT_BAD,
    "_growth_tracker": _COUNT_BAD,
    "unskipped": _COUNT_BAD,
    "num_events": _COUNT_BAD,
    "consecutive_skips": [10**9, *_COUNT_BAD],
    "num_overflows": [10**9, *_COUNT_BAD],
    "max_consecutive_skips": [-1, 2.5, True, "100", 2**63],
    "steps": _COUNT_BAD,
    "skipped": [10**9, *_COUNT_BAD],
    "dynamic": _FLAG_BAD,
    "consecutive_hysteresis": _FLAG_BAD,
    "last_skipped": _FLAG_BAD,
    "num_losses": [0, 3, 1.0, True, "1", None],
    "format": ["ampkit.session/2", 2, "1", None, True],
    "method": ["nearest", "x", None],
    # fp8 scale state (tensors below, by key too)
    "calls": _COUNT_BAD,
    "initialized": [True, False, *_FLAG_BAD],  # a flip contradicts the counters
    "recipe": ["e4m3 current tensorwise", "", None, 3],
    "num_buffers": [0, 99, *_COUNT_BAD],  # must count the buffer entries present
}
_POSITION_BAD = [99, -1, "0", None, 1.5, True]  # group / index inside a [group, index, tensor] entry


def _nodes(obj: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, value) of every node below the root, depth first."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    out = []
    for key, value in items:
        out.append((path + (key,), value))
        out += _nodes(value, path + (key,))
    return out


def _with_last(t: torch.Tensor, value: float) -> torch.Tensor:
    """A copy of ``t`` whose last element is ``value``."""
    out = t.detach().clone()
    out.reshape(-1)[-1] = value
    return out


def _bad_tensors(t: torch.Tensor, key: Any = None) -> list[Any]:
    """Invalid stand-ins for ``t``: another dtype or shape, no tensor, and for a floating
    tensor inf/NaN in it (no state ampkit saves holds them where they would be used);
    ``key`` adds the values out of range there (an fp8 scale <= 0 or beyond what a
    recipe derives, a negative abs-max, a saturation count above the calls)."""
    other = torch.float32 if t.dtype != torch.float32 else torch.float64
    ints = torch.int64 if t.dtype != torch.int64 else torch.int32
    out: list[Any] = [t.to(ints), t.to(other), t.unsqueeze(0), t.reshape(-1)[:0], "tensor", None]
    if t.dtype != torch.float16:
        out.append(t.to(torch.float16))
    if t.is_floating_point() and t.numel():
        out += [_with_last(t, v) for v in (NAN, INF, -INF)]
        out += [_with_last(t, v) for v in _BAD_TENSOR_VALUES.get(key, ())]
    elif key == "saturated":
        out += [torch.tensor(-1), torch.tensor(2**62)]
    return out


_BAD_TENSOR_VALUES: dict[str, list[float]] = {
    "scale": [0.0, -1.0, 1e38, 1e-45],
    "amax": [-1.0],
    "amax_history": [-1.0],
}


def _mutations(sd: Any, optional: frozenset[str], keep_lists: frozenset[str]) -> list[tuple[tuple, str, Any]]:
    """Every known-invalid mutation of ``sd``: (path, kind, value). ``optional``: keys a
    loader may do without; ``keep_lists``: lists whose length may change validly."""
    out: list[tuple[tuple, str, Any]] = [((), "root", bad) for bad in (None, [], "sd", 3)]
    out.append(((), "add_key", None))
    for path, value in _nodes(sd):
        key = path[-1]
        parent_key = next((k for k in reversed(path[:-1]) if isinstance(k, str)), None)
        if isinstance(key, str) and key not in optional and not (isinstance(value, dict) and not value):
            out.append((path, "delete", None))
        if isinstance(value, torch.Tensor):
            out += [(path, "set", bad) for bad in _bad_tensors(value, key)]
        elif isinstance(value, (dict, list)):
            out += [(path, "set", bad) for bad in (None, 3, "x")]
            if isinstance(value, dict):
                out.append((path, "add_key", None))  # an unknown key
            if isinstance(value, list) and value and key not in keep_lists and parent_key not in keep_lists:
                out += [(path, "drop_last", None), (path, "repeat_last", None)]
        elif isinstance(key, int) and len(path) >= 2 and isinstance(key, int) and key < 2:
            out += [(path, "set", bad) for bad in _POSITION_BAD]  # in a [group, index, tensor] entry
        elif isinstance(key, str) and key in _BAD_BY_KEY:
            bads = _BAD_BY_KEY[key]
            if key in _SCALE_KEYS and _holder(sd, path).get("dynamic") is False:
                bads = [bad for bad in bads if not _usable_scale(bad)]  # any usable scale is valid there
            out += [(path, "set", bad) for bad in bads if not _same(bad, value)]
    return out


_SCALE_KEYS = ("scale", "init_scale", "min_scale", "max_scale")


def _holder(sd: Any, path: tuple) -> Any:
    """The container holding the node at ``path``."""
    for key in path[:-1]:
        sd = sd[key]
    return sd


def _usable_scale(value: Any) -> bool:
    """A scale a static scaler may hold: a number whose fp32 value and reciprocal are finite."""
    try:
        scaling.check_scale(value, "scale")
    except ScalerError:
        return False
    return True


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _apply(sd: Any, mutation: tuple[tuple, str, Any]) -> Any:
    path, kind, value = mutation
    if kind == "root":
        return value
    broken = copy.deepcopy(sd)
    if kind == "add_key":
        target = broken
        for key in path:
            target = target[key]
        target["unknown_key"] = 0
        return broken
    parent = broken
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if kind == "delete":
        del parent[key]
    elif kind == "set":
        parent[key] = value
    elif kind == "drop_last":
        parent[key] = parent[key][:-1]
    elif kind == "repeat_last":
        parent[key] = parent[key] + [copy.deepcopy(parent[key][-1])]
    return broken


_CACHE: dict[str, Any] = {}


def _session_setup() -> tuple[list[nn.Module], list[torch.optim.Optimizer], dict]:
    """Two trainers (O2 with masters, and a plain one with two losses) and a checkpoint
    taken two steps before their current state. Built once per test (a refused load
    changes nothing, so the examples can share it; if one did, its test fails)."""
    session = amp.trainer.current_session()
    cached = _CACHE.get("session")
    if cached is None or cached[0] is not session or not session.members:
        models, opts = two_trainers()
        sd = amp.state_dict()
        for i in range(2, 4):
            train_step(models[0], opts[0], i)
            train_step(models[1], opts[1], i, loss_id=i % 2)
        cached = _CACHE["session"] = (amp.trainer.current_session(), models, opts, sd)
    return cached[1], cached[2], cached[3]


_EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def _check_refused(load: Callable[[Any], None], sd: Any, mutation: tuple, state: Callable[[], Any]) -> None:
    before = state()
    broken = _apply(sd, mutation)
    with pytest.raises(AmpError):
        load(broken)
    assert state() == before, mutation


@_EXAMPLES
@given(data=st.data())
def test_malformed_session_checkpoints_are_refused_and_change_nothing(data):
    models, opts, sd = _session_setup()
    mutations = _mutations(sd, optional=frozenset(), keep_lists=frozenset())
    mutation = data.draw(st.sampled_from(mutations))
    _check_refused(amp.load_state_dict, sd, mutation, lambda: snapshot(models, opts))


@_EXAMPLES
@given(data=st.data())
def test_malformed_scaler_states_are_refused_and_change_nothing(data):
    scaler = LossScaler(init_scale=2.0**10, hysteresis=1, growth_interval=3)
    for overflow in (False, True, False):
        scaler.update(overflow)
    grad_scaler = amp.GradScaler("cpu", init_scale=2.0**10)
    torch_format = {k: v for k, v in grad_scaler.state_dict().items() if k != "ampkit"}
    target, sd = data.draw(
        st.sampled_from(
            [
                (scaler, LossScaler(init_scale=8.0).state_dict()),
                (grad_scaler, grad_scaler.state_dict()),  # ampkit's format
                (grad_scaler, torch_format),  # torch.amp's format
            ]
        )
    )
    # without "ampkit" GradScaler reads torch.amp's keys (a valid dict either way); beside
    # it they may be left out, or must repeat its values
    optional = frozenset({"ampkit", *(torch_format if "ampkit" in sd else ())})
    mutations = _mutations(sd, optional, frozenset())
    mutation = data.draw(st.sampled_from(mutations))
    _check_refused(target.load_state_dict, sd, mutation, lambda: freeze(target.state_dict()))


@_EXAMPLES
@given(data=st.data())
def test_malformed_master_and_compensation_states_are_refused(data):
    kind = data.draw(st.sampled_from(["masters", "kahan", "stochastic", "apex"]))
    cached = _CACHE.get(kind)
    session = amp.trainer.current_session()
    if cached is None or cached[0] is not session or not session.members:
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if kind == "apex":
            from ampkit.compat.apex import amp as apex_amp

            model, opt = apex_amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", num_losses=2)
            train_step(model, opt, 0)
            sd = {k: v for k, v in apex_amp.state_dict().items() if k != "ampkit"}  # apex's format
            target: Any = apex_amp
        elif kind == "masters":
            model, opt = amp.initialize(model, opt, opt_level="O2")
            train_step(model, opt, 0)
            target = master_weights_of(opt)
            sd = target.state_dict()
        else:
            model, opt = amp.initialize(model, opt, opt_level="O2K", compensation=kind)
            train_step(model, opt, 0)
            target = compensation_of(opt)
            sd = target.state_dict()
        sd = copy.deepcopy(sd)
        train_step(model, opt, 1)
        cached = _CACHE[kind] = (amp.trainer.current_session(), model, opt, target, sd)
    _, model, opt, target, sd = cached
    # apex's growth counter may be absent, and 0.3's compensation state had no count of
    # its buffers (a buffer entry deleted is refused: the count no longer matches).
    optional = frozenset({"device_generators", "unskipped", "num_buffers"})
    mutations = _mutations(sd, optional, keep_lists=frozenset())
    if kind == "kahan":
        mutations.append((("buffers",), "repeat_last", None))  # a buffer given twice
    mutation = data.draw(st.sampled_from(mutations))

    def state() -> Any:
        extra = target.state_dict() if kind != "apex" else None
        return (snapshot([model], [opt]), freeze(extra), freeze(getattr(target, "_buffers", None)))

    _check_refused(target.load_state_dict, sd, mutation, state)


# --- non-finite and out-of-range values in checkpoints, at every level -----------------------
#
# Each level trains a model whose middle linear is an fp8 layer under the fp8 recipes; its
# checkpoint (model, optimizer, amp) is taken two steps before the current state. A value a
# run never saves must be refused with the model, the optimizer and ampkit's state as they
# were; a checkpoint that loads must train as the saved one does.

_LEVELS: dict[str, dict[str, Any]] = {
    "O1": dict(opt_level="O1", loss_scale="dynamic", num_losses=2),
    "O2": dict(opt_level="O2", loss_scale="dynamic"),
    "O3": dict(opt_level="O3"),
    "O2K-kahan": dict(opt_level="O2K", compensation="kahan"),
    "O2K-stochastic": dict(opt_level="O2K", compensation="stochastic"),
    "fp8-current": dict(opt_level="O2", fp8=amp.Fp8Recipe(min_features=16)),
    "fp8-delayed": dict(
        opt_level="O1", loss_scale="dynamic",
        fp8=amp.Fp8Recipe(scaling="delayed", amax_history_len=4, min_features=16),
    ),
    "fp8-rowwise": dict(opt_level="O1", fp8=amp.Fp8Recipe(format="e4m3", granularity="rowwise", min_features=16)),
}


def mlp16(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16))


def step16(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(200 + i)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()


def _load_model_and_optimizer(model: nn.Module, opt: torch.optim.Optimizer, ck: dict[str, Any]) -> None:
    model.load_state_dict(ck["model"])
    opt.load_state_dict(copy.deepcopy(ck["opt"]))  # Adam steps the loaded step tensors in place


def _resume(model: nn.Module, opt: torch.optim.Optimizer, ck: dict[str, Any], amp_sd: Any) -> None:
    _load_model_and_optimizer(model, opt, ck)
    amp.load_state_dict(amp_sd)


def _trained(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    """Two more steps; what the user sees of them: weights, optimizer state, skips and
    ampkit's state (without the init/min/max of a static scale, which it never reads)."""
    skipped = []
    for i in (2, 3):
        step16(model, opt, i)
        skipped.append(amp.step_skipped(opt))
    sd = amp.state_dict()
    for scaler in sd["trainers"][0]["scalers"]:
        if not scaler["dynamic"]:
            for key in ("init_scale", "min_scale", "max_scale"):
                del scaler[key]
    return freeze((list(model.parameters()), opt.state_dict()["state"], skipped, sd))


def _level_setup(level: str) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any], Any]:
    """The model and optimizer of ``level`` two steps past their checkpoint, the
    checkpoint, and what two steps from the checkpoint give. Cached per session."""
    session = amp.trainer.current_session()
    cached = _CACHE.get(("level", level))
    if cached is None or cached[0] is not session or not session.members:
        model = mlp16()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, **_LEVELS[level])
        for i in range(2):
            step16(model, opt, i)
        ck = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
        _resume(model, opt, ck, ck["amp"])
        reference = _trained(model, opt)
        cached = _CACHE[("level", level)] = (amp.trainer.current_session(), model, opt, ck, reference)
    return cached[1], cached[2], cached[3], cached[4]


def _amp_entry(sd: dict[str, Any], level: str, field: str) -> tuple[dict[str, Any], str]:
    """(the dict holding ``field``, the key) in an ``amp.state_dict()`` of ``level``."""
    opt = sd["trainers"][0]["optimizers"][0]
    if field == "master":
        return opt["extra"]["master_weights"]["masters"][0], 2
    if field == "compensation":
        return opt["extra"]["compensation"]["buffers"][0], 2
    if field.startswith("fp8 "):
        role, key = field.split()[1:]
        return sd["extra"]["fp8"]["layers"]["2"][role], key
    if field == "steps":
        return opt, "steps"
    return sd["trainers"][0]["scalers"][0], field


def _nan_at_last(t: torch.Tensor) -> torch.Tensor:
    return _with_last(t, NAN)


@pytest.mark.parametrize(
    "level, field, bad, match",
    [
        ("O2K-kahan", "compensation", _nan_at_last, "compensation buffer .* non-finite"),
        ("O2", "master", lambda t: _with_last(t, INF), "master weight .* non-finite"),
        ("fp8-delayed", "fp8 input scale", lambda t: torch.tensor(INF), "scale="),
        ("fp8-delayed", "fp8 input scale", lambda t: t.double(), "tensor of torch.float32"),
        ("fp8-delayed", "fp8 weight amax_history", _nan_at_last, "amax_history .* non-finite"),
        ("fp8-delayed", "fp8 grad_output saturated", lambda t: t.float(), "tensor of torch.int64"),
        ("fp8-current", "fp8 input calls", lambda v: None, "calls must be an int"),
        ("fp8-current", "fp8 input calls", lambda v: 2**70, "calls must be an int"),
        ("fp8-current", "fp8 weight scale", lambda t: torch.tensor(-1.0), "scale="),
        ("O1", "num_events", lambda v: 2**70, "num_events"),
        ("O1", "growth_tracker", lambda v: 2**63, "growth_tracker"),
        ("O1", "steps", lambda v: 2**70, "steps"),
        ("O1", "backoff_factor", lambda v: 1e-45, "backoff_factor"),
        ("O1", "growth_factor", lambda v: 1e300, "growth_factor"),
    ],
)
def test_a_checkpoint_value_no_run_saves_is_refused_and_changes_nothing(level, field, bad, match):
    model, opt, ck, _ = _level_setup(level)
    broken = copy.deepcopy(ck["amp"])
    holder, key = _amp_entry(broken, level, field)
    holder[key] = bad(holder[key])
    _load_model_and_optimizer(model, opt, ck)
    before = snapshot([model], [opt])
    with pytest.raises(AmpError, match=match):
        amp.load_state_dict(broken)
    assert snapshot([model], [opt]) == before


@pytest.mark.parametrize(
    "level, path",
    [
        ("O1", ()),
        ("O1", ("trainers", 0)),
        ("O1", ("trainers", 0, "scalers", 1)),
        ("O1", ("trainers", 0, "optimizers", 0)),
        ("O2", ("trainers", 0, "optimizers", 0, "extra", "master_weights")),
        ("O2K-kahan", ("trainers", 0, "optimizers", 0, "extra", "compensation")),
        ("fp8-delayed", ("extra", "fp8")),
        ("fp8-delayed", ("extra", "fp8", "layers", "2")),
        ("fp8-delayed", ("extra", "fp8", "layers", "2", "input")),
    ],
)
def test_an_unknown_key_is_refused_by_name(level, path):
    model, opt, ck, _ = _level_setup(level)
    broken = _apply(ck["amp"], (path, "add_key", None))
    before = snapshot([model], [opt])
    with pytest.raises(AmpError, match=r"unknown key\(s\) \[\"'unknown_key'\"\].*known"):
        amp.load_state_dict(broken)
    assert snapshot([model], [opt]) == before


def test_scaler_and_grad_scaler_refuse_unknown_keys_and_edited_torch_fields():
    scaler = LossScaler()
    with pytest.raises(ScalerError, match="unknown key.*'bogus'"):
        scaler.load_state_dict({**scaler.state_dict(), "bogus": 1})
    grad_scaler = amp.GradScaler("cpu", init_scale=8.0)
    sd = grad_scaler.state_dict()
    torch_sd = {k: v for k, v in sd.items() if k != "ampkit"}
    for broken in ({**sd, "bogus": 1}, {**torch_sd, "bogus": 1}, {**sd, "scale": 16.0}):
        with pytest.raises(ScalerError, match="unknown key|'ampkit' entry"):
            grad_scaler.load_state_dict(broken)
    assert freeze(grad_scaler.state_dict()) == freeze(sd)
    grad_scaler.load_state_dict({"ampkit": sd["ampkit"]})  # torch.amp's fields may be left out


def test_saved_scale_state_after_an_overflow_loads():
    """A current-scaling fp8 role records the scale derived from an inf/NaN abs-max (0 or
    NaN) on an overflowing step: a checkpoint saved right then is valid."""
    model = mlp16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", fp8=amp.Fp8Recipe(min_features=16))
    step16(model, opt, 0)
    x = torch.randn(8, 16)
    with amp.scale_loss(model(x).float().sum() * INF, opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_skipped(opt)
    sd = amp.state_dict()
    grad_out = sd["extra"]["fp8"]["layers"]["2"]["grad_output"]
    assert not torch.isfinite(grad_out["amax"]) and not float(grad_out["scale"]) > 0
    amp.load_state_dict(roundtrip(sd))
    assert freeze(amp.state_dict()) == freeze(sd)


_LEVEL_EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@_LEVEL_EXAMPLES
@given(data=st.data())
def test_corrupted_checkpoints_are_refused_whole_or_train_as_saved(data):
    """Every field of ``amp.state_dict()`` at every level (scalers, step counters, fp32
    masters, compensation, fp8 scale state) set to a non-finite or out-of-range value, a
    wrong dtype, shape or type, deleted, or joined by an unknown key: the load is refused
    with everything as it was, or it loads a state that trains exactly as the saved one."""
    level = data.draw(st.sampled_from(sorted(_LEVELS)))
    model, opt, ck, reference = _level_setup(level)
    optional = frozenset({"device_generators", "num_buffers"})
    mutation = data.draw(st.sampled_from(_mutations(ck["amp"], optional, keep_lists=frozenset())))
    broken = _apply(ck["amp"], mutation)
    _load_model_and_optimizer(model, opt, ck)
    before = snapshot([model], [opt])
    try:
        amp.load_state_dict(broken)
    except AmpError:
        assert snapshot([model], [opt]) == before, mutation
        return
    assert _trained(model, opt) == reference, mutation


# --- hypothesis: malformed arguments ----------------------------------------------------------

_SCALER_ARGS: dict[str, list[Any]] = {
    "init_scale": [NAN, INF, -1.0, 0.0, 1e-40, 10**400, "big", None, True, 2.0**30],
    "growth_factor": _BAD_BY_KEY["growth_factor"],
    "backoff_factor": _BAD_BY_KEY["backoff_factor"],
    "growth_interval": _BAD_BY_KEY["growth_interval"],
    "hysteresis": _BAD_BY_KEY["hysteresis"],
    "min_scale": [NAN, INF, -1.0, 0.0, 1e-40, "1", None, True, 2.0**20],
    "max_scale": [NAN, -1.0, 0.0, 1e-40, 1.0, "x", None, True],
    "dynamic": _FLAG_BAD,
    "consecutive_hysteresis": _FLAG_BAD,
    "max_consecutive_skips": _BAD_BY_KEY["max_consecutive_skips"],
}
_LEVEL_ARGS: dict[str, list[Any]] = {
    "dtype": [torch.float32, torch.int8, "bf16", 3],
    "cast_model_type": [torch.int8, "half", 3],
    "keep_norm_fp32": ["yes", 1],
    "master_weights": ["yes", 1],
    "op_casting": ["yes", 1],
    "compensation": ["kahn", True, 1],
    "loss_scale": [True, "big", 1e-40, NAN, INF, -1.0, 0.0, [1.0]],
    "num_losses": [0, True, 1.5, "2"],
    "min_loss_scale": ["a", 1e-40, NAN, -1.0, True],
    "max_loss_scale": ["a", NAN, -1.0, 0.0, True],
    "cast_model_outputs": [torch.int64, "fp32", 3],
    "policy": ["x", 3, torch.bfloat16],
    "bogus": [1],
}
_POLICY_ARGS: dict[str, list[Any]] = {
    "dtype": [torch.float32, "bf16", 3],
    "lower_ops": [[nn.Linear], "mm", [3], ["notanop"], [torch.mm, "mm", lambda x: x]],
    "fp32_ops": [[nn.Linear], torch.exp, [3.0], ["aten::nothing"]],
    "promote_ops": [[object()], ["torch.nothing"]],
    "conditional_fp32_ops": [[(F.normalize, lambda *a, **k: True)], [(torch.pow,)], [("pow", 3)], [torch.pow]],
    "module_rules": [{3: torch.float32}, {nn.Linear: torch.int8}, "x", {"": torch.float32}],
}


@_EXAMPLES
@given(field=st.sampled_from(sorted(_SCALER_ARGS)), data=st.data(), grad_scaler=st.booleans())
def test_bad_scaler_arguments_raise_scaler_errors(field, data, grad_scaler):
    bad = data.draw(st.sampled_from(_SCALER_ARGS[field]))
    if grad_scaler and field == "dynamic":
        field, bad = "enabled", bad  # GradScaler is always dynamic; its flag is enabled
    with pytest.raises(ScalerError):
        if grad_scaler:
            amp.GradScaler("cpu", **{field: bad})
        else:
            LossScaler(**{field: bad})


@_EXAMPLES
@given(data=st.data())
def test_bad_scaler_calls_change_nothing(data):
    scaler = LossScaler(init_scale=64.0, growth_interval=3)
    grad_scaler = amp.GradScaler("cpu", init_scale=64.0)
    scales = [NAN, INF, -1.0, 0.0, 1e-40, "x", True]
    call, bads = data.draw(
        st.sampled_from(
            [
                (scaler.set_scale, [*scales, None]),
                (lambda v: scaler.configure(growth_factor=v), _BAD_BY_KEY["growth_factor"]),
                (lambda v: scaler.configure(max_scale=v), _BAD_BY_KEY["max_scale"]),
                (lambda v: scaler.configure(bogus=v), [1]),
                (grad_scaler.update, [*scales, torch.ones(2), torch.tensor(2.0, requires_grad=True)]),
                (grad_scaler.set_growth_factor, _BAD_BY_KEY["growth_factor"]),
                (grad_scaler.set_backoff_factor, _BAD_BY_KEY["backoff_factor"]),
                (grad_scaler.set_growth_interval, _BAD_BY_KEY["growth_interval"]),
            ]
        )
    )
    bad = data.draw(st.sampled_from(bads))
    before = freeze([scaler.state_dict(), grad_scaler.state_dict()])
    with pytest.raises(AmpError):
        call(bad)
    assert freeze([scaler.state_dict(), grad_scaler.state_dict()]) == before


@_EXAMPLES
@given(data=st.data(), level=st.sampled_from(["O0", "O1", "O2", "O3", "O2K"]))
def test_bad_initialize_arguments_change_nothing(data, level):
    """A previous O2 session, a fresh fp32 model with Adam state: a refused initialize
    leaves all of it as it was."""
    old_models, old_opts, _ = _session_setup()
    model = mlp(7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_of(model, 0).backward()
    opt.step()
    field = data.draw(st.sampled_from(sorted(_LEVEL_ARGS) + ["opt_level", "models", "optimizers"]))
    kwargs: dict[str, Any] = {}
    args: list[Any] = [model, opt, level]
    if field == "opt_level":
        args[2] = data.draw(st.sampled_from(["O5", "o2x", 3, ""]))  # None: AMPKIT_LEVEL, else O1
    elif field == "models":
        args[0] = data.draw(st.sampled_from([[], "model", [model, model], [model, 3]]))
    elif field == "optimizers":
        args[1] = data.draw(st.sampled_from(["opt", [opt, opt], [opt, 3], []]))
    else:
        kwargs[field] = data.draw(st.sampled_from(_LEVEL_ARGS[field]))
    before = snapshot([*old_models, model], [*old_opts, opt])
    with pytest.raises(AmpError):
        amp.initialize(*args, **kwargs)
    assert snapshot([*old_models, model], [*old_opts, opt]) == before


def _is_managed(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` is under a trainer, asked publicly: ``amp.stats`` answers for
    managed optimizers only."""
    try:
        amp.stats(opt)
    except amp.StateError:
        return False
    return True


_FINISHES = ("step", "another loss", "unscale, clip", "zeroed, another loss")


def _begin_step(model: nn.Module, opt: torch.optim.Optimizer, overflow: bool) -> None:
    """A step in progress: loss 0's backward, with inf/NaN grads when ``overflow``."""
    opt.zero_grad()
    loss = loss_of(model, 5) * (INF if overflow else 1.0)
    with amp.scale_loss(loss, opt, loss_id=0) as scaled:
        scaled.backward()


def _finish_step(model: nn.Module, opt: torch.optim.Optimizer, how: str) -> Any:
    """Finish the step in progress the way ``how`` says (each idiom reads a different part
    of the step's bookkeeping: which loss the grads belong to, the inf/NaN flags so far,
    whether they were unscaled) and return what the user sees of it: params, grads,
    whether the step was skipped, the stats and the session's state."""
    if how == "zeroed, another loss":
        opt.zero_grad(set_to_none=False)
    if how in ("another loss", "zeroed, another loss"):
        with amp.scale_loss(loss_of(model, 6), opt, loss_id=1) as scaled:
            scaled.backward()
    if how == "unscale, clip":
        amp.unscale(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    params = list(model.parameters())
    return freeze((params, [p.grad for p in params], amp.step_skipped(opt), amp.stats(opt), amp.state_dict()))


@_EXAMPLES
@given(data=st.data())
def test_bad_trainer_calls_change_nothing(data):
    """init_trainer, scale_loss, unscale, set_sync, register_ddp, step_skipped and stats
    with nonsense: an AmpError, the session, params and grads as they were, and the step
    in progress finishes as it would have without the call."""
    models, opts, _ = _session_setup()
    model, opt = models[1], opts[1]
    start = (amp.state_dict(), copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))

    def restart() -> None:
        amp.load_state_dict(start[0])
        model.load_state_dict(start[1])
        opt.load_state_dict(start[2])

    fresh = torch.optim.SGD(mlp(3).parameters(), lr=0.1)
    attached = managed_state(opt).scalers[0]
    calls: list[Callable[[], Any]] = [
        lambda: amp.init_trainer(fresh, scaler=data.draw(st.sampled_from([1e-40, NAN, -1.0, "x", True, [LossScaler()] * 2, attached]))),
        lambda: amp.init_trainer(fresh, num_losses=data.draw(st.sampled_from([0, True, 1.5, "2"]))),
        lambda: amp.init_trainer([fresh, fresh]),
        lambda: amp.init_trainer(opt),  # already managed
        lambda: amp.init_trainer([]),
        lambda: amp.scale_loss(loss_of(model, 6), opt, loss_id=data.draw(st.sampled_from(["0", 2, -1, True, 1.0, None]))).__enter__(),
        lambda: amp.scale_loss(data.draw(st.sampled_from([1.0, None, "loss", torch.tensor(3), [], [loss_of(model, 6), 2.0]])), opt).__enter__(),
        lambda: amp.scale_loss(loss_of(model, 6), [opt, opts[0]]).__enter__(),  # two trainers' scalers
        lambda: amp.scale_loss(loss_of(model, 6), fresh).__enter__(),
        lambda: amp.unscale([opt, fresh]),
        lambda: amp.distributed.set_sync(opt, data.draw(st.sampled_from(["sometimes", None, True]))),
        lambda: amp.distributed.register_ddp(model),
        lambda: amp.step_skipped(fresh),
        lambda: amp.stats(fresh),
    ]
    call = data.draw(st.sampled_from(calls))

    def everything() -> Any:
        return (
            snapshot(models, opts),
            freeze([p.grad for m in models for p in m.parameters()]),
            amp.stats(opt),
            _is_managed(fresh),
        )

    for overflow in (False, True):
        for finish in _FINISHES:
            _begin_step(model, opt, overflow)  # its grads and flags must survive the call
            before = everything()
            with pytest.raises(AmpError):
                call()
            assert everything() == before
            finished = _finish_step(model, opt, finish)
            restart()  # the same step again, without the bad call
            _begin_step(model, opt, overflow)
            assert _finish_step(model, opt, finish) == finished, (overflow, finish)
            restart()  # the next one starts from the same state


@_EXAMPLES
@given(field=st.sampled_from(sorted(_POLICY_ARGS)), data=st.data(), how=st.sampled_from(["Policy", "override", "init"]))
def test_bad_policies_raise_policy_errors_and_keep_casting(field, data, how):
    bad = data.draw(st.sampled_from(_POLICY_ARGS[field]))
    amp.init(device_type="cpu", fp32_ops=["mm"])
    policy = amp.current_policy()
    with pytest.raises(amp.PolicyError):
        if how == "Policy":
            amp.Policy(**{field: bad})
        elif how == "override":
            amp.Policy().override(**{field: bad})
        else:
            amp.init(device_type="cpu", **{field: bad})
    assert amp.current_policy() is policy and amp.is_active()
    with amp.autocast(enabled=False):
        pass


# --- partial states and magnitudes no training writes ------------------------------------------


def _o2k_kahan_state() -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    amp.reset()
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2K", compensation="kahan")
    train_step(model, opt, 0)
    return model, opt, copy.deepcopy(amp.state_dict())


def _comp(sd: dict) -> dict:
    return sd["trainers"][0]["optimizers"][0]["extra"]["compensation"]


@pytest.mark.parametrize("corruption", ["deleted_entry", "absurd_value"])
def test_o2k_compensation_state_is_refused_whole(corruption):
    """An O2K checkpoint with one compensation buffer entry deleted (it was loaded in
    part), or a finite compensation no rounding leaves behind (3e38: the next output is
    non-finite), is refused with nothing changed."""
    model, opt, sd = _o2k_kahan_state()
    comp = _comp(sd)
    assert comp["num_buffers"] == len(comp["buffers"]) > 1
    if corruption == "deleted_entry":
        del comp["buffers"][0]
    else:
        comp["buffers"][0][2].view(-1)[0] = 3e38
    train_step(model, opt, 1)
    before = (snapshot([model], [opt]), freeze(amp.state_dict()))
    with pytest.raises(StateError, match="num_buffers|no training step writes"):
        amp.load_state_dict(sd)
    assert (snapshot([model], [opt]), freeze(amp.state_dict())) == before


def test_a_0_3_compensation_state_without_a_count_still_loads():
    model, opt, sd = _o2k_kahan_state()
    del _comp(sd)["num_buffers"]
    amp.load_state_dict(sd)
    assert freeze(_comp(amp.state_dict())["buffers"]) == freeze(_comp(sd)["buffers"])


def test_fp16_masters_beyond_fp16_range_are_refused():
    """A master that would round to inf in its fp16 model weight is no state training
    leaves (the step that made it would have been skipped)."""
    amp.reset()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16)
    train_step(model, opt, 0)
    sd = copy.deepcopy(amp.state_dict())
    sd["trainers"][0]["optimizers"][0]["extra"]["master_weights"]["masters"][0][2].view(-1)[0] = 1e5
    before = snapshot([model], [opt])
    with pytest.raises(StateError, match="beyond"):
        amp.load_state_dict(sd)
    assert snapshot([model], [opt]) == before
