"""The managed step's one extension interface (ampkit.trainer.extensions): a
user-written StepExtension sees its hook points in order, removal works, extension
state is saved with the optimizer, the doctor attaches through the registry, and the
trainer's default step agreement is the one ampkit.distributed installs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit.trainer import extensions as ext_mod
from ampkit.trainer.api import managed_state
from ampkit.trainer.extensions import StepExtension
from ampkit.trainer.step_grads import StepStage


class Recorder(StepExtension):
    def __init__(self, calls: list, tag: str = "") -> None:
        self.calls = calls
        self.tag = tag

    def on_scale_loss(self, optimizers, losses, loss_id, scaled) -> None:
        self.calls.append(f"{self.tag}scale_loss:{loss_id}")

    def before_check(self) -> None:
        self.calls.append(f"{self.tag}before_check")

    def before_update(self, args, kwargs) -> None:
        self.calls.append(f"{self.tag}before_update")

    def after_update(self) -> None:
        self.calls.append(f"{self.tag}after_update")

    def after_step(self, skipped: bool) -> None:
        self.calls.append(f"{self.tag}after_step:{skipped}")

    def on_remove(self, optimizer) -> None:
        self.calls.append(f"{self.tag}removed")


def _setup():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=4.0)
    return model, opt


def _step(model, opt, poison: bool = False) -> None:
    opt.zero_grad()
    with amp.scale_loss(model(torch.randn(3, 4)).pow(2).mean(), opt) as scaled:
        scaled.backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")
    opt.step()


def test_hook_points_in_order_and_skip_flag():
    model, opt = _setup()
    state = managed_state(opt)
    calls: list[str] = []
    ext = state.add_extension(Recorder(calls))
    assert state.extensions == (ext,)
    _step(model, opt)
    assert calls == ["scale_loss:0", "before_check", "before_update", "after_update", "after_step:False"]
    calls.clear()
    before = model.weight.detach().clone()
    _step(model, opt, poison=True)
    assert amp.step_skipped(opt)
    assert calls == ["scale_loss:0", "before_check", "after_step:True"]
    assert torch.equal(model.weight, before)


def test_before_check_once_per_step_with_explicit_unscale():
    model, opt = _setup()
    state = managed_state(opt)
    calls: list[str] = []
    state.add_extension(Recorder(calls))
    opt.zero_grad()
    with amp.scale_loss(model(torch.randn(3, 4)).sum(), opt) as scaled:
        scaled.backward()
    assert state.stage is StepStage.GATHERING
    amp.unscale(opt)
    assert state.stage is StepStage.UNSCALED
    opt.step()
    assert state.stage is StepStage.READY
    assert calls.count("before_check") == 1
    assert calls[-1] == "after_step:False"


def test_registration_order_and_removal():
    model, opt = _setup()
    state = managed_state(opt)
    calls: list[str] = []
    a = state.add_extension(Recorder(calls, "a."))
    b = state.add_extension(Recorder(calls, "b."))
    assert state.add_extension(a) is a and state.extensions == (a, b)  # added once
    _step(model, opt)
    assert [c for c in calls if "after_step" in c] == ["a.after_step:False", "b.after_step:False"]
    assert calls.index("a.before_check") < calls.index("b.before_check")
    calls.clear()
    state.remove_extension(a)
    assert calls == ["a.removed"] and state.extensions == (b,)
    state.remove_extension(a)  # not there: nothing
    calls.clear()
    _step(model, opt)
    assert calls and all(c.startswith("b.") for c in calls)
    b.remove()
    assert state.extensions == ()
    calls.clear()
    _step(model, opt)
    assert calls == []


def test_not_an_extension_is_refused():
    _, opt = _setup()
    with pytest.raises(amp.StateError, match="StepExtension"):
        managed_state(opt).add_extension(lambda: None)  # type: ignore[arg-type]


def test_extension_state_is_saved_with_the_optimizer():
    model, opt = _setup()
    state = managed_state(opt)

    class Counter(StepExtension):
        state_name = "counter"

        def __init__(self) -> None:
            self.n = 0

        def after_step(self, skipped: bool) -> None:
            self.n += 1

        def state_dict(self):
            return {"n": self.n}

        def check_state_dict(self, sd) -> None:
            if not isinstance(sd, dict) or not isinstance(sd.get("n"), int):
                raise amp.StateError("counter: bad state")

        def load_state_dict(self, sd) -> None:
            self.n = sd["n"]

    counter = state.add_extension(Counter())
    _step(model, opt)
    _step(model, opt)
    sd = amp.state_dict()
    assert sd["trainers"][0]["optimizers"][0]["extra"]["counter"] == {"n": 2}
    counter.n = 7
    amp.load_state_dict(sd)
    assert counter.n == 2
    with pytest.raises(amp.StateError, match="already registered"):
        state.add_extension(Counter())
    state.remove_extension(counter)
    assert "counter" not in amp.state_dict()["trainers"][0]["optimizers"][0]["extra"]


def test_global_extension_told_of_every_scale_loss_once():
    model, opt = _setup()
    calls: list[str] = []
    glob = Recorder(calls, "g.")
    ext_mod.add_global_extension(glob)
    ext_mod.add_global_extension(glob)
    try:
        managed_state(opt).add_extension(glob)  # also on the optimizer: still told once
        _step(model, opt)
        assert calls.count("g.scale_loss:0") == 1
    finally:
        glob.remove()
    assert ext_mod.global_extensions() == ()
    assert managed_state(opt).extensions == ()


def test_doctor_attaches_through_the_registry(monkeypatch):
    from ampkit.tools.diagnosis import current

    monkeypatch.delenv("AMPKIT_DOCTOR", raising=False)
    _, opt = _setup()
    assert current() is None and managed_state(opt).extensions == ()
    # init_trainer(doctor=True) looks the attacher up by name
    attached: list = []
    original = ext_mod.attacher("doctor")
    ext_mod.register_attacher("doctor", lambda opts: attached.append(list(opts)) or original(opts), "AMPKIT_DOCTOR")
    try:
        opt2 = amp.init_trainer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), doctor=True)
    finally:
        ext_mod.register_attacher("doctor", original, "AMPKIT_DOCTOR")
    assert attached == [[opt2]]
    doc = current()
    assert doc is not None and doc.running
    assert len(managed_state(opt2).extensions) == 1
    assert any(e is doc._scale_loss_watch for e in ext_mod.global_extensions())
    amp.reset()
    assert current() is None and ext_mod.global_extensions() == ()
    monkeypatch.setenv("AMPKIT_DOCTOR", "1")
    assert ext_mod.attacher_requested("doctor", None)
    assert not ext_mod.attacher_requested("doctor", False)


def test_missing_attacher_is_a_state_error(monkeypatch):
    saved = ext_mod.unregister_attacher("doctor")
    assert saved is not None
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    try:
        with pytest.raises(amp.StateError, match="no 'doctor' is registered"):
            amp.init_trainer(opt, doctor=True)
    finally:
        ext_mod.register_attacher("doctor", *saved)
    amp.init_trainer(opt)  # nothing was changed by the refusal; env/None: no doctor
    assert managed_state(opt).extensions == ()


def test_default_agreement_is_installed_by_distributed():
    from ampkit.distributed.core import AGREEMENT

    assert ext_mod.default_agreement() is AGREEMENT
    _, opt = _setup()
    assert managed_state(opt).agreement is AGREEMENT


def test_public_members_for_other_layers():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1))  # dynamic scale
    state = managed_state(opt)
    assert list(state.grad_params()) == list(model.parameters())
    assert state.active
    opt.zero_grad()
    with amp.scale_loss(model(torch.randn(3, 4)).sum(), opt) as scaled:
        scaled.backward()
    amp.unscale(opt)
    flags = state.segment_flags()
    assert len(flags) == 1 and float(flags[0]) == 0.0
    state.add_segment(torch.ones(()))  # an inf/NaN elsewhere: skips without blaming a scaler
    scale = state.scalers[0].scale
    opt.step()
    assert amp.step_skipped(opt) and state.scalers[0].scale == scale
    scaler = amp.LossScaler()
    apply = scaler.prepare_load(amp.LossScaler(init_scale=8.0).state_dict())
    assert scaler.scale != 8.0
    apply()
    assert scaler.scale == 8.0


def test_aborted_stage_after_an_exception_in_scale_loss():
    model, opt = _setup()
    state = managed_state(opt)
    with pytest.raises(RuntimeError):
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), opt) as scaled:
            scaled.backward()
            raise RuntimeError("boom")
    assert state.stage is StepStage.ABORTED
    opt.zero_grad()
    _step(model, opt)
    assert not amp.step_skipped(opt) and state.stage is StepStage.READY
