"""ampkit.compat.apex: a legacy apex.amp script with one import changed, and the
amp object's verbs one by one."""

from __future__ import annotations

import copy
import difflib
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ampkit.compat.apex import amp
from locations import SUPPORT
from torch import nn

import ampkit
from ampkit.errors import AmpError, StateError

SCRIPT = SUPPORT / "legacy_apex_script.py"
APEX_IMPORT = "from apex import amp"
OUR_IMPORT = "from ampkit.compat.apex import amp"


def _ported_script(tmp_path: Path) -> Path:
    source = SCRIPT.read_text()
    assert source.count(APEX_IMPORT + "\n") == 1
    ported = source.replace(APEX_IMPORT + "\n", OUR_IMPORT + "\n")
    changed = [
        line
        for line in difflib.unified_diff(source.splitlines(), ported.splitlines(), lineterm="", n=0)
        if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
    ]
    assert changed == ["-" + APEX_IMPORT, "+" + OUR_IMPORT]
    path = tmp_path / "train.py"
    path.write_text(ported)
    return path


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_legacy_apex_script_runs_with_only_the_import_changed(tmp_path, monkeypatch, opt_level):
    script = _ported_script(tmp_path)
    out = tmp_path / "result.pt"
    monkeypatch.setattr(sys, "argv", [str(script), "--opt-level", opt_level, "--out", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    result = torch.load(out)
    losses = [entry[0] for entry in result["log"]]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < 0.85 * sum(losses[:3])  # it learns the small data set
    # Clipping saw unscaled grads (apex unscaled at scale_loss exit): norms of order 1,
    # not 65536 times that.
    assert all(0.01 < entry[2] < 100 for entry in result["log"])
    # register_float_function(torch, "sigmoid"): fp32 under O1 although its input is
    # bf16; under O2 the model's outputs are cast to fp32 by its output hook.
    assert {entry[3] for entry in result["log"]} == {"torch.float32"}
    assert result["eval_dtype"] == "torch.float32"
    # The documented checkpoint recipe resumes bitwise.
    for name, value in result["final"].items():
        assert torch.equal(value, result["resumed"][name]), name
    state = result["amp_state"]
    assert state["loss_scaler0"]["loss_scale"] == 2.0**16
    assert state["loss_scaler1"]["unskipped"] == 12


@pytest.mark.slow
def test_legacy_apex_script_runs_as_a_program(tmp_path):
    script = _ported_script(tmp_path)
    out = tmp_path / "result.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(script), "--opt-level", "O2", "--steps", "4", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(torch.load(out)["log"]) == 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_initialize_returns_the_shapes_apex_returned():
    model = _model()
    assert amp.initialize(model, opt_level="O2") is model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    models, opts = amp.initialize([_model()], [torch.optim.SGD(_model().parameters(), lr=0.1)])
    assert isinstance(models, list) and isinstance(opts, list)
    m, o = amp.initialize(model, opt, enabled=False)
    assert m is model and o is opt


def test_keep_batchnorm_fp32_accepts_apex_strings():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32="False")
    assert model[1].weight.dtype == torch.bfloat16
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32=True)
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    with pytest.raises(AmpError, match="keep_batchnorm_fp32"):
        amp.initialize(_model(), opt_level="O2", keep_batchnorm_fp32="yes")


def test_scale_loss_unscales_at_exit_unless_delayed():
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale=128.0)
    x = torch.randn(6, 4)
    ref(x).pow(2).sum().backward()
    with amp.scale_loss(model(x).float().pow(2).sum(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    delayed = model[0].weight.grad.clone()
    # ampkit's grads are real even inside a delay_unscale block (apex left them scaled
    # there, unreadable; nothing can rely on that): the fp32 grads up to bf16 compute.
    assert torch.allclose(delayed, ref[0].weight.grad, rtol=0.05, atol=0.02 * ref[0].weight.grad.abs().max())
    with amp.scale_loss(model(x).float().pow(2).sum(), opt) as scaled:
        scaled.backward()
    # The second block accumulated onto the first: the plain sum of both grads.
    assert torch.allclose(model[0].weight.grad, 2 * delayed, rtol=1e-5)
    # A third loss after the unscale is accumulated too, not refused.
    with amp.scale_loss(model(x).float().pow(2).sum(), opt) as scaled:
        scaled.backward()
    assert torch.allclose(model[0].weight.grad, 3 * delayed, rtol=1e-5)
    before = model[0].weight.detach().clone()
    opt.step()
    assert torch.allclose(model[0].weight, before - 0.1 * 3 * delayed, rtol=1e-5)


def test_state_dict_has_apex_keys_and_loads_an_apex_checkpoint():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", num_losses=2)
    state = amp.state_dict()
    assert state["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 0}
    assert set(state) == {"loss_scaler0", "loss_scaler1", "ampkit"}
    # A checkpoint written by apex itself: scale and growth counter only.
    amp.load_state_dict(
        {
            "loss_scaler0": {"loss_scale": 512.0, "unskipped": 7},
            "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0},
        }
    )
    scalers = ampkit.trainer.managed_state(opt).scalers
    assert [s.scale for s in scalers] == [512.0, 8.0]
    assert scalers[0].growth_tracker == 7
    with pytest.raises(StateError, match="loss scaler"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})


def test_register_functions_rules():
    with pytest.raises(AmpError, match="no function named"):
        amp.register_float_function(torch, "not_a_function")

    def my_op(x):
        return x * 2

    holder = type("M", (), {"my_op": staticmethod(my_op)})
    with pytest.raises(AmpError, match="decorate"):
        amp.register_half_function(holder, "my_op")
    amp.register_float_function(torch, "mm")
    model = _model()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1")
    a = torch.randn(3, 3)
    assert torch.mm(a, a).dtype == torch.float32  # registered: fp32 under O1
    assert torch.matmul(a, a).dtype == torch.bfloat16  # not registered: lowered
    with pytest.raises(StateError, match="before amp.initialize"):
        amp.register_promote_function(torch, "add")


def test_decorators_cast_only_while_casting_is_on():
    seen = []

    @amp.half_function
    def half(x, y):
        seen.append((x.dtype, y.dtype, torch.is_autocast_enabled("cpu")))
        return x @ y

    @amp.float_function
    def full(x):
        return x

    @amp.promote_function
    def promote(x, y):
        return x, y

    a = torch.randn(2, 2)
    half(a, a)
    assert seen[-1][:2] == (torch.float32, torch.float32)  # amp off: untouched
    model = _model()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1")
    out = half(a, a)
    assert seen[-1] == (torch.bfloat16, torch.bfloat16, False) and out.dtype == torch.bfloat16
    assert full(a.bfloat16()).dtype == torch.float32
    x, y = promote(a.bfloat16(), a)
    assert x.dtype == y.dtype == torch.float32
    with amp.disable_casts():
        assert (a @ a).dtype == torch.float32
    assert (a @ a).dtype == torch.bfloat16


def test_scale_loss_before_initialize_is_refused():
    with pytest.raises(StateError, match="initialize"):
        with amp.scale_loss(torch.tensor(1.0, requires_grad=True), None):
            pass


# --- apex semantics the native API does differently (issue 9) -----------------------------


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _mse(model: nn.Module, i: int) -> torch.Tensor:
    x, y = _data(i)
    return nn.functional.mse_loss(model(x).float(), y)


def test_overflow_in_one_optimizers_grads_skips_every_optimizer_of_scale_loss():
    """apex: ``scale_loss(loss, [opt_a, opt_b])`` skips both when either overflowed (the
    native API skips only the one whose grads overflowed)."""
    def run(api: Any) -> tuple[bool, bool]:
        a, b = nn.Linear(4, 3), nn.Linear(3, 2)
        oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        (a, b), (oa, ob) = amp.initialize([a, b], [oa, ob], opt_level="O1", loss_scale="dynamic")
        b.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        with api.scale_loss(b(a(torch.randn(5, 4))).float().sum(), [oa, ob]) as scaled:
            scaled.backward()  # only b's grads overflow
        before = [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]
        oa.step()
        ob.step()
        after = list(a.parameters()) + list(b.parameters())
        assert ampkit.stats(oa).scales == (2.0**15,)  # the shared scaler backed off once
        return ampkit.step_skipped(oa), all(torch.equal(x, y) for x, y in zip(before[:2], after[:2]))

    assert run(amp) == (True, True)
    assert run(ampkit) == (False, False)


def test_an_overflow_carried_in_from_an_earlier_loss_skips_only_its_own_optimizer():
    """apex checks each backward's own new grads: loss 0 overflows opt0's grads, then
    loss 1 (finite) reaches opt0 and opt1 in one scale_loss call. opt0 skips (its grads
    hold loss 0's inf), opt1 steps (loss 1 left its grads finite); loss 0's scaler backs
    off, loss 1's keeps its scale (its event is masked in opt0, clean in opt1). apex's
    test_3models2losses2optimizers expects exactly this."""
    torch.manual_seed(0)
    m0, m1 = nn.Linear(4, 4), nn.Linear(4, 4)
    o0, o1 = torch.optim.SGD(m0.parameters(), lr=0.1), torch.optim.SGD(m1.parameters(), lr=0.1)
    [m0, m1], [o0, o1] = amp.initialize([m0, m1], [o0, o1], opt_level="O1", num_losses=2, loss_scale="dynamic")
    x = torch.randn(2, 4)
    before = [p.detach().clone() for p in [*m0.parameters(), *m1.parameters()]]
    with amp.scale_loss(m0(x).float().sum() * float("inf"), o0, loss_id=0) as scaled:
        scaled.backward()
    with amp.scale_loss((m0(x) + m1(x)).float().sum(), [o0, o1], loss_id=1) as scaled:
        scaled.backward()
    o0.step()
    o1.step()
    after = [p.detach() for p in [*m0.parameters(), *m1.parameters()]]
    assert ampkit.step_skipped(o0) and not ampkit.step_skipped(o1)
    assert all(torch.equal(b, a) for b, a in zip(before[:2], after[:2]))
    assert all(not torch.equal(b, a) for b, a in zip(before[2:], after[2:]))
    assert ampkit.stats(o0).scales == (2.0**15, 2.0**16)


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_cast_levels_state_dict_is_fp32_through_compat_and_16_bit_natively(opt_level, tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level)
    sd = model.state_dict()
    floats = {k: v.dtype for k, v in sd.items() if v.is_floating_point()}
    assert set(floats.values()) == {torch.float32}
    assert model[0].weight.dtype == torch.bfloat16
    assert torch.equal(sd["0.weight"], model[0].weight.float())
    assert model[0].state_dict()["weight"].dtype == torch.float32  # a submodule too
    # An fp32 checkpoint loads back into a fresh O2 model and resumes the same weights.
    fresh = _model()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    fresh, fresh_opt = amp.initialize(fresh, fresh_opt, opt_level=opt_level)
    fresh.load_state_dict(sd)
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
    torch.save(model, tmp_path / "m.pt")  # the hook does not stop whole-model pickling
    native = _model()
    native, _ = ampkit.initialize(native, torch.optim.SGD(native.parameters(), lr=0.1), opt_level=opt_level)
    assert native.state_dict()["0.weight"].dtype == torch.bfloat16


def test_o2_with_cast_model_type_false_trains_the_fp32_model_as_fp32_does():
    ref, model = _mlp(), _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=False, loss_scale="dynamic")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert list(amp.master_params(opt)) == list(model.parameters())  # the params are the masters
    for i in range(4):
        ref_opt.zero_grad()
        opt.zero_grad()
        _mse(ref, i).backward()
        with amp.scale_loss(_mse(model, i), opt) as scaled:
            scaled.backward()
        ref_opt.step()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_allow_incoming_model_not_fp32_builds_masters_from_the_16_bit_weights():
    from ampkit.compat.apex.amp import _amp_state  # apex: from apex.amp import _amp_state

    model = _mlp().to(torch.bfloat16)
    weights = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(AmpError, match="fp32"):
        amp.initialize(model, opt, opt_level="O2")
    _amp_state.allow_incoming_model_not_fp32 = True
    try:
        model, opt = amp.initialize(model, opt, opt_level="O2")
    finally:
        _amp_state.allow_incoming_model_not_fp32 = False
    masters = list(amp.master_params(opt))
    assert all(m.dtype == torch.float32 and torch.equal(m, w.float()) for m, w in zip(masters, weights))
    _amp_state.loss_scalers[0]._loss_scale = 4.0  # as apex's own tests set it
    assert ampkit.stats(opt).scales == (4.0,) and _amp_state.loss_scalers[0].loss_scale() == 4.0


# --- the older handle API ------------------------------------------------------------------


def test_handle_api_casts_scales_and_skips_like_apex_did():
    amp.register_float_function(torch, "sigmoid")  # before init, as apex required
    handle = amp.init(enabled=True, loss_scale="dynamic")
    assert handle.is_active()
    x = torch.randn(3, 4)
    w = torch.randn(5, 4)
    assert torch.nn.functional.linear(x, w).dtype == torch.bfloat16  # op-level casting on
    assert torch.sigmoid(x.to(torch.bfloat16)).dtype == torch.float32  # the registered rule
    with handle._disable_casts():
        assert torch.nn.functional.linear(x, w).dtype == torch.float32
    model, ref = _mlp(), _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(4):
        opt.zero_grad()
        with handle.scale_loss(_mse(model, i), opt) as scaled:
            assert scaled.item() == pytest.approx(_mse(model, i).item() * 2.0**16, rel=1e-2)
            scaled.backward()
        if i == 2:
            model[0].weight.grad[0, 0] = float("nan")
            before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        if i == 2:
            assert ampkit.step_skipped(opt) and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            continue
        ref_opt.zero_grad()
        _mse(ref, i).backward()
        ref_opt.step()
    assert all(torch.allclose(p, q, atol=2e-2) for p, q in zip(model.parameters(), ref.parameters()))
    handle._deactivate()
    assert torch.nn.functional.linear(x, w).dtype == torch.float32  # casting off


def test_wrap_optimizer_scales_each_loss_and_skips_when_any_overflowed():
    handle = amp.init(enabled=True)
    model = _mlp()
    opt = handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), num_loss=2)
    for i, poison in enumerate([None, 1, None]):
        opt.zero_grad()
        for k in range(2):
            loss = _mse(model, 2 * i + k) * (float("inf") if poison == k else 1.0)
            with opt.scale_loss(loss) as scaled:
                scaled.backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        skipped = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert skipped == (poison is not None)
    scales = ampkit.stats(opt._optimizer).scales
    assert scales == (2.0**16, 2.0**15)  # only loss 1's scaler backed off
    with pytest.raises(StateError, match="num_loss=2"):
        for k in range(3):
            with opt.scale_loss(_mse(model, k)) as scaled:
                scaled.backward()
    assert opt.param_groups is opt._optimizer.param_groups  # attributes forwarded
    handle._deactivate()


def test_disabled_handle_does_nothing():
    handle = amp.init(enabled=False)
    assert not handle.is_active()
    loss = torch.ones(())
    with handle.scale_loss(loss, None) as scaled:
        assert scaled is loss
    assert torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.float32
    opt = handle.wrap_optimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1))
    with opt.scale_loss(loss) as scaled:
        assert scaled is loss
    handle._deactivate()


@pytest.mark.parametrize("bad", [5, None, "O7"])
def test_apex_initialize_refuses_a_bad_opt_level_with_an_amp_error(bad):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(AmpError, match="unknown opt_level"):
        amp.initialize(model, opt, opt_level=bad)
    assert model.weight.dtype == torch.float32 and ampkit.levels.master_weights_of(opt) is None
    ampkit.reset()


class _CheckpointNet(nn.Module):
    """apex's tests/L0/run_amp/test_checkpointing.py model: a bare parameter, a conv, a
    batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, 1, 1)
        self.bn1 = nn.BatchNorm2d(6)
        self.param = nn.Parameter(torch.randn(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn1(torch.relu(self.conv1(x * self.param)))


def test_o1_initialize_sets_apex_handle_and_opt_properties():
    """apex's tests end an O1 test with ``_amp_state.handle._deactivate()`` and read
    ``_amp_state.opt_properties``."""
    state = amp._amp_state
    assert state.handle is None and not hasattr(state, "opt_properties")
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", verbosity=0)
    props = state.opt_properties
    assert (props.enabled, props.opt_level, props.patch_torch_functions) == (True, "O1", True)
    assert props.cast_model_type is None and props.keep_batchnorm_fp32 is None and props.master_weights is None
    assert props.loss_scale == "dynamic" and props.options["loss_scale"] == "dynamic"
    assert set(props.options) == {
        "enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
        "master_weights", "loss_scale",
    }
    handle = state.handle
    assert isinstance(handle, amp.AmpHandle) and handle.is_active()
    a = torch.randn(4, 4)
    assert torch.mm(a, a).dtype == torch.bfloat16
    handle._clear_cache()
    handle._deactivate()
    assert torch.mm(a, a).dtype == torch.float32
    assert state.handle is None and not hasattr(state, "opt_properties")
    # O2: apex's static defaults where the level casts the model; no O1 handle
    model, opt = nn.Linear(4, 4), None
    model = amp.initialize(model, opt_level="O2", verbosity=0)
    props = state.opt_properties
    assert props.opt_level == "O2" and props.cast_model_type == torch.bfloat16
    assert props.keep_batchnorm_fp32 is True and props.master_weights is True
    assert props.patch_torch_functions is False and props.loss_scale == 1.0
    assert state.handle is None
    amp.initialize(nn.Linear(2, 2), enabled=False)
    assert state.opt_properties.enabled is False


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("amp_before_load", [True, False])
def test_a_restored_pair_trains_next_to_the_first(opt_level, amp_before_load):
    """apex's test_restoring: train a pair, checkpoint it half way, initialize a
    restored pair (before or after loading its model and optimizer state) and train
    both on the same batches, each on its own loss ids. Both keep training, each with
    its own state: the restored pair equals the original bit for bit, amp state
    (masters included) loaded from the original's amp.state_dict()."""
    num_losses = 2
    torch.manual_seed(2809)

    def step(model, optimizer, x, loss_ids):
        optimizer.zero_grad()
        output = model(x)
        for idx in loss_ids:
            with amp.scale_loss(output.float().mean(), optimizer, loss_id=idx) as scaled:
                scaled.backward(retain_graph=True)
        optimizer.step()
        return output

    model = _CheckpointNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, num_losses=2 * num_losses, verbosity=0)
    batches = [torch.randn(16, 3, 24, 24) for _ in range(10)]
    for x in batches[:5]:
        step(model, optimizer, x, range(num_losses))
    checkpoint = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
    )
    restore_model = _CheckpointNet()
    restore_optimizer = torch.optim.SGD(restore_model.parameters(), lr=1e-3)

    def restore_initialize():
        return amp.initialize(restore_model, restore_optimizer, opt_level=opt_level,
                              num_losses=2 * num_losses, verbosity=0)

    if amp_before_load:
        restore_model, restore_optimizer = restore_initialize()
    restore_model.load_state_dict(checkpoint["model"])
    restore_optimizer.load_state_dict(checkpoint["optimizer"])
    if not amp_before_load:
        restore_model, restore_optimizer = restore_initialize()
    amp.load_state_dict(checkpoint["amp"])  # the restored pair's own state: the latest initialize's
    for x in batches[5:]:
        output = step(model, optimizer, x, range(num_losses))
        restore_output = step(restore_model, restore_optimizer, x, range(num_losses, 2 * num_losses))
        assert torch.equal(output, restore_output)
    for key, value in model.state_dict().items():
        assert torch.equal(value, restore_model.state_dict()[key]), key
    for a, b in zip(amp.master_params(optimizer), amp.master_params(restore_optimizer)):
        assert torch.equal(a, b)
    # the restored counters went on from the checkpoint's 5
    assert [(ampkit.stats(o).steps, ampkit.stats(o).skipped) for o in (optimizer, restore_optimizer)] == [(10, 0)] * 2
    # amp.state_dict() follows the latest pair, as apex's global loss scalers did
    assert len(amp.state_dict()["ampkit"]["trainers"]) == 1
    # a reset releases the earlier pair too: its own step() is back
    ampkit.reset()
    assert "_ampkit_managed" not in optimizer.__dict__ and "_ampkit_managed" not in restore_optimizer.__dict__


def test_initialize_of_the_same_model_with_a_new_optimizer_starts_afresh():
    """A pair that shares parameters with the earlier one replaces it (two optimizers
    managing one model's grads would unscale them twice): the earlier optimizer is
    released, the new one trains."""
    model = nn.Linear(4, 2)
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    model, first = amp.initialize(model, first, opt_level="O1", verbosity=0)
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    model, second = amp.initialize(model, second, opt_level="O1", verbosity=0)
    assert "_ampkit_managed" not in first.__dict__
    with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), second) as loss:
        loss.backward()
    second.step()
    assert ampkit.stats(second).steps == 1
