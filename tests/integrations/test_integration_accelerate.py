"""ampkit inside Hugging Face Accelerate (accelerate 1.15, CPU): ``ampkit.integrations.accelerate``
against Accelerate's own fp32 loop and its own ``mixed_precision``; ampkit's calls given
Accelerate's ``AcceleratedOptimizer`` (and Lightning's ``LightningOptimizer``) in place
of the optimizer they wrap; ``save_state``/``load_state`` resume; DDP with 2 gloo
processes; ``ampkit run`` on the unmodified Accelerate script.

Tiny models and synthetic data; the loop is tests/support/scripts/accelerate_train.py's."""

from __future__ import annotations

import json
import os
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from locations import SCRIPTS
from torch import nn

import ampkit as amp

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import ampkit.integrations.accelerate as amp_accelerate  # noqa: E402
from ampkit._internal.wrappers import unwrap_optimizer, unwrap_optimizers  # noqa: E402
from ampkit.trainer.api import managed_state  # noqa: E402

LOOP = runpy.run_path(str(SCRIPTS / "accelerate_train.py"), run_name="accelerate_train")
build, train, data = LOOP["build"], LOOP["train"], LOOP["data"]


def _reset_accelerate() -> None:
    # Accelerate keeps its state in process-wide singletons; its own tests reset them
    # the same way between tests (accelerate.test_utils.AccelerateTestCase).
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    _reset_accelerate()
    yield
    _reset_accelerate()


def _accelerator(**kwargs) -> Accelerator:
    _reset_accelerate()
    return Accelerator(cpu=True, **kwargs)


def _mean_last(losses: list[float]) -> float:
    return sum(losses[-10:]) / 10


def _fp32_run(steps: int = 60, **accelerator_kwargs) -> list[float]:
    acc = _accelerator(**accelerator_kwargs)
    model, opt, sched = acc.prepare(*build())
    return train(acc, model, opt, sched, acc.backward, steps)


def _amp_run(opt_level: str, dtype: torch.dtype | None = None, steps: int = 60):
    acc = _accelerator()
    model, opt, sched = amp_accelerate.prepare(acc, *build(), opt_level=opt_level, dtype=dtype)
    losses = train(acc, model, opt, sched, lambda loss: amp_accelerate.backward(acc, loss, opt), steps)
    return losses, acc, model, opt, sched


@pytest.fixture(scope="module")
def fp32_losses() -> list[float]:
    try:
        return _fp32_run()
    finally:
        _reset_accelerate()


# --- ampkit's calls take a framework's optimizer wrapper ---------------------------------------


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    inner = unwrap_optimizer(opt)
    state = [t.clone() for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in model.parameters()] + [m.detach().clone() for m in amp.master_params(opt)] + state


def _steps_with(opt_level: str, wrap: bool) -> list[torch.Tensor]:
    """Four steps through every ampkit call, given the AcceleratedOptimizer (``wrap``) or
    the raw optimizer; the second step carries a NaN gradient."""
    _accelerator()
    model, raw, _ = build()
    wrapper = AcceleratedOptimizer(raw)
    opt = wrapper if wrap else raw
    amp.initialize(model, opt, opt_level, dtype=torch.float16 if opt_level == "O1" else None)
    x, y = data()
    for step in range(4):
        opt.zero_grad()
        with amp.scale_loss(nn.functional.mse_loss(model(x[:32]).float(), y[:32]), opt) as scaled:
            scaled.backward()
        if step == 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        amp.unscale(opt)
        nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
        assert amp.distributed.sync_plan(opt).agree is False  # one process
        amp.distributed.set_sync(opt, "auto")
        opt.step()
        assert amp.step_skipped(opt) is (step == 1)
    st = amp.stats(opt)
    assert (st.steps, st.skipped) == (4, 1)
    assert amp.stats(raw) == st  # one managed optimizer: the raw one
    assert managed_state(wrapper).optimizer is raw  # the wrapper stands for it
    return _snapshot(model, raw)


@pytest.mark.parametrize(
    "opt_level", ["O1", "O2", pytest.param("O2K", marks=pytest.mark.slow)]  # O2K: its update kernel compiles once
)
def test_every_call_takes_the_accelerated_optimizer(opt_level):
    wrapped = _steps_with(opt_level, wrap=True)
    amp.reset()
    plain = _steps_with(opt_level, wrap=False)
    assert len(wrapped) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(wrapped, plain))


def test_init_trainer_takes_the_accelerated_optimizer():
    _accelerator()
    model, raw, _ = build()
    wrapper = AcceleratedOptimizer(raw)
    assert amp.init_trainer(wrapper) is wrapper  # returns what it was given
    assert amp.stats(raw).steps == 0 and managed_state(wrapper).optimizer is raw
    with pytest.raises(amp.StateError, match="the same optimizer appears twice"):
        amp.reset()
        amp.init_trainer([wrapper, raw])


def test_unwrap_is_strict():
    _accelerator()
    raw = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    wrapper = AcceleratedOptimizer(raw)
    assert unwrap_optimizer(wrapper) is raw
    assert unwrap_optimizer(AcceleratedOptimizer(wrapper)) is raw  # wrapper of a wrapper
    assert unwrap_optimizers((wrapper, raw)) == (raw, raw)
    assert unwrap_optimizer(raw) is raw

    class NotAWrapper:  # holds an optimizer as .optimizer but is no known wrapper class
        optimizer = raw

    other = NotAWrapper()
    assert unwrap_optimizer(other) is other
    assert unwrap_optimizer("opt") == "opt"
    # the errors of today for what is neither an optimizer nor a known wrapper
    with pytest.raises(amp.StateError, match=r"^init_trainer: expected torch.optim.Optimizer objects, got NotAWrapper\.$"):
        amp.init_trainer(other)
    with pytest.raises(amp.AmpError, match=r"^optimizers must be a Optimizer or a non-empty list of them, got str\.$"):
        amp.initialize(nn.Linear(2, 2), "opt")
    with pytest.raises(amp.AmpError, match=r"^optimizers must be a Optimizer or a non-empty list of them, got list\.$"):
        amp.initialize(nn.Linear(2, 2), [wrapper, other])
    with pytest.raises(amp.StateError, match="master_params expects a torch.optim.Optimizer, got str"):
        list(amp.master_params("opt"))
    with pytest.raises(amp.StateError, match="not managed by ampkit"):
        amp.stats(wrapper)


@pytest.mark.slow  # importing lightning takes several seconds
def test_lightning_optimizer_is_unwrapped():
    optimizer_module = pytest.importorskip("lightning.pytorch.core.optimizer")
    model, raw, _ = build()
    wrapper = optimizer_module.LightningOptimizer(raw)
    assert isinstance(wrapper, torch.optim.Optimizer) and unwrap_optimizer(wrapper) is raw
    _, out = amp.initialize(model, wrapper, "O2")
    assert out is wrapper and managed_state(wrapper).optimizer is raw
    x, y = data()
    with amp.scale_loss(nn.functional.mse_loss(model(x[:32]).float(), y[:32]), wrapper) as scaled:
        scaled.backward()
    raw.step()
    assert amp.stats(wrapper).steps == 1 and not amp.step_skipped(wrapper)
    assert all(m.dtype == torch.float32 for m in amp.master_params(wrapper))


def test_fabric_optimizer_is_unwrapped():
    """Fabric's wrapper swaps its class too (an isinstance check lets it through)."""
    wrappers = pytest.importorskip("lightning.fabric.wrappers")
    model, raw, _ = build()
    wrapper = wrappers._FabricOptimizer(raw, strategy=object())
    assert isinstance(wrapper, torch.optim.Optimizer) and unwrap_optimizer(wrapper) is raw
    _, out = amp.initialize(model, wrapper, "O2")
    assert out is wrapper and managed_state(wrapper).optimizer is raw


# --- training against Accelerate's fp32 loop ----------------------------------------------------


@pytest.mark.parametrize(
    ("opt_level", "dtype"),
    [("O1", None), ("O2", None), ("O2K", None), ("O1", torch.float16), ("O3", None)],
    ids=["O1", "O2", "O2K", "O1-fp16", "O3"],
)
def test_trains_like_accelerate_fp32(opt_level, dtype, fp32_losses):
    losses, acc, model, opt, sched = _amp_run(opt_level, dtype)
    ref = _mean_last(fp32_losses)
    assert abs(_mean_last(losses) - ref) / ref < 0.01, (opt_level, _mean_last(losses), ref)
    assert _mean_last(losses) < 0.2 * fp32_losses[0]
    assert isinstance(opt, AcceleratedOptimizer) and amp.stats(opt).steps == 60
    assert amp.stats(opt).skipped == 0 and not acc.optimizer_step_was_skipped
    linear, norm = model[0], model[1]
    compute = dtype or torch.bfloat16
    if opt_level == "O1":
        assert linear.weight.dtype == torch.float32 and model(data()[0][:4]).dtype == compute
    else:
        assert linear.weight.dtype == torch.bfloat16
        assert norm.weight.dtype == (torch.bfloat16 if opt_level == "O3" else torch.float32)
    masters = list(amp.master_params(opt))
    assert masters[0].dtype == (torch.float32 if opt_level in ("O1", "O2") else torch.bfloat16)
    assert amp.stats(opt).scales == ((2.0**16,) if dtype == torch.float16 else (1.0,))


def test_gradient_accumulation_like_fp32():
    """``accelerator.accumulate`` (no_sync-style micro-batches, the loss divided by the
    accumulation steps, the optimizer stepped every second batch) at O2."""

    def run(use_amp: bool) -> tuple[list[float], torch.optim.Optimizer]:
        acc = _accelerator(gradient_accumulation_steps=2)
        if use_amp:
            model, opt, sched = amp_accelerate.prepare(acc, *build(), opt_level="O2")
        else:
            model, opt, sched = acc.prepare(*build())
        x_all, y_all = data()
        losses = []
        for step in range(40):
            i = (16 * step) % len(x_all)
            x, y = x_all[i : i + 16], y_all[i : i + 16]
            with acc.accumulate(model):
                loss = nn.functional.mse_loss(model(x).float(), y)
                amp_accelerate.backward(acc, loss, opt) if use_amp else acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.item())
        return losses, opt

    ref, _ = run(False)
    losses, opt = run(True)
    assert abs(_mean_last(losses) - _mean_last(ref)) / _mean_last(ref) < 0.01
    assert amp.stats(opt).steps == 20  # one optimizer step per two micro-batches


# --- skipped steps --------------------------------------------------------------------------------


def _nan_step(acc: Accelerator, model, opt, sched, backward, nan_at: int = 2, steps: int = 4):
    """Steps with a NaN in the first weight's gradient at step ``nan_at``; returns the
    snapshots (params, inner optimizer state, LR) around that step and the skip flags."""
    x_all, y_all = data()
    before = after = None
    flags, lrs = [], []
    for step in range(steps):
        x, y = x_all[32 * step : 32 * step + 32], y_all[32 * step : 32 * step + 32]
        opt.zero_grad()
        backward(nn.functional.mse_loss(model(x).float(), y))
        if step == nan_at:
            model[0].weight.grad[0, 0] = float("nan")
            before = _snapshot(model, opt)
        opt.step()
        sched.step()
        if step == nan_at:
            after = _snapshot(model, opt)
        flags.append(acc.optimizer_step_was_skipped)
        lrs.append(sched.get_last_lr()[0])
    return before, after, flags, lrs


def test_nan_gradient_skipped_and_scheduler_held():
    acc = _accelerator()
    model, opt, sched = amp_accelerate.prepare(acc, *build(), opt_level="O2")
    before, after, flags, lrs = _nan_step(acc, model, opt, sched, lambda loss: amp_accelerate.backward(acc, loss, opt))
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # params, masters, Adam state
    assert flags == [False, False, True, False]  # accelerator.optimizer_step_was_skipped
    assert lrs[2] == lrs[1] and lrs[3] < lrs[2]  # the prepared scheduler held on the skip
    assert (amp.stats(opt).steps, amp.stats(opt).skipped) == (4, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_accelerate_bf16_does_not_skip():
    """Accelerate's own mixed_precision="bf16" (autocast in forward) steps on the NaN
    gradient: the weights are NaN after, and its skip signal stays False."""
    acc = _accelerator(mixed_precision="bf16")
    assert acc.native_amp and acc.scaler is None
    model, opt, sched = acc.prepare(*build())
    assert model(data()[0][:4]).dtype == torch.float32  # its autocast, outputs cast back
    _, _, flags, lrs = _nan_step(acc, model, opt, sched, acc.backward)
    assert flags == [False] * 4 and lrs[2] < lrs[1]
    assert torch.isnan(model[0].weight).any()


def test_accelerate_fp16_on_cpu_is_plain_fp32():
    """Accelerator(cpu=True, mixed_precision="fp16") says fp16 but runs plain fp32: no
    autocast, no GradScaler, no warning; the losses are bitwise those of "no". ampkit's
    prepare refuses it (as every mixed_precision but "no")."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = _accelerator(mixed_precision="fp16")
    assert not [w for w in caught if "fp16" in str(w.message) or "precision" in str(w.message)]
    assert acc.mixed_precision == "fp16" and not acc.native_amp and acc.scaler is None
    model, opt, sched = acc.prepare(*build())
    assert model(data()[0][:4]).dtype == torch.float32
    with acc.autocast():
        assert not torch.is_autocast_enabled("cpu")
    fp16 = train(acc, model, opt, sched, acc.backward, 10)
    assert fp16 == _fp32_run(10)
    acc = _accelerator(mixed_precision="fp16")
    with pytest.raises(amp_accelerate.AccelerateSetupError, match=r"mixed_precision='fp16'.*mixed_precision='no'"):
        amp_accelerate.prepare(acc, *build(), opt_level="O1", dtype=torch.float16)


# --- refusals and setup ---------------------------------------------------------------------


def test_refusals():
    acc = _accelerator(mixed_precision="bf16")
    with pytest.raises(amp_accelerate.AccelerateSetupError, match="would run its own autocast"):
        amp_accelerate.prepare(acc, *build())
    with pytest.raises(amp_accelerate.AccelerateSetupError, match="mixed_precision='bf16'"):
        amp_accelerate.backward(acc, torch.ones((), requires_grad=True), torch.optim.SGD([nn.Parameter(torch.zeros(1))]))
    acc = _accelerator()
    model, opt, sched = build()
    model, opt = acc.prepare(model, opt)
    with pytest.raises(amp_accelerate.AccelerateSetupError, match="already prepared by accelerator.prepare"):
        amp_accelerate.prepare(acc, model, opt)
    with pytest.raises(amp_accelerate.AccelerateSetupError, match="optimizer.*but no model"):
        amp_accelerate.prepare(acc, build()[1])
    with pytest.raises(amp_accelerate.AccelerateSetupError, match="expected an accelerate.Accelerator"):
        amp_accelerate.prepare(object(), *build())
    with pytest.raises(amp.AmpError, match="unknown option"):
        amp_accelerate.prepare(acc, *build(), opt_level="O2", master_weight=True)
    model, opt, _ = build()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(amp.AmpError, match="unknown opt_level"):
        amp_accelerate.prepare(acc, model, opt, opt_level="O4")
    assert all(p.dtype == torch.float32 and torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_skip_signal_falls_back_with_a_warning(monkeypatch):
    """Where AcceleratedOptimizer.step_was_skipped would not follow the flag ampkit sets,
    prepare says to use ampkit.step_skipped instead."""
    monkeypatch.setattr(AcceleratedOptimizer, "step_was_skipped", property(lambda self: False))
    acc = _accelerator()
    with pytest.warns(UserWarning, match=r"Use `if not ampkit.step_skipped\(optimizer\)"):
        amp_accelerate.prepare(acc, *build(), opt_level="O2")


def test_two_prepare_calls_share_one_session(tmp_path):
    """A second prepare for the same Accelerator adds to the session (a GAN's two models
    prepared one by one); state_dict holds both; save_state writes one ampkit state."""
    acc = _accelerator()
    g_model, g_opt, _ = build()
    d_model, d_opt, _ = build()
    g_model, g_opt = amp_accelerate.prepare(acc, g_model, g_opt, opt_level="O2")
    d_model, d_opt = amp_accelerate.prepare(acc, d_model, d_opt, opt_level="O2")
    assert len(amp.state_dict()["trainers"]) == 2
    assert amp.stats(g_opt).steps == 0 and amp.stats(d_opt).steps == 0
    acc.save_state(str(tmp_path / "ckpt"))
    assert not list((tmp_path / "ckpt").glob("custom_checkpoint_*.pkl"))  # nothing Accelerate unpickles fully
    ampkit_state = torch.load(tmp_path / "ckpt" / amp_accelerate.STATE_NAME, weights_only=True)
    assert len(ampkit_state["trainers"]) == 2


# --- accelerator.backward, hooked by prepare ----------------------------------------------------


def test_prepare_hooks_this_accelerators_backward_once_and_release_undoes_it(monkeypatch):
    """After prepare, the Accelerator's own ``backward(loss)`` gets ``loss * S`` (fp16 O1:
    S = 2**16) on this instance only; a loss already scaled (the old ``amp_accelerate.backward``,
    or a loop's own ``amp.scale_loss`` block) is passed on as it is: the same grads all
    three ways. ``release`` and ``ampkit.reset`` put the Accelerator's method back."""
    seen = []
    original = Accelerator.backward

    def recording(self, loss, **kwargs):
        seen.append(loss.detach().clone())
        return original(self, loss, **kwargs)

    monkeypatch.setattr(Accelerator, "backward", recording)
    acc = _accelerator()
    other = Accelerator(cpu=True)
    model, opt, _ = amp_accelerate.prepare(acc, *build(), opt_level="O1", dtype=torch.float16)
    assert "backward" in vars(acc) and "backward" not in vars(other)
    assert Accelerator.backward is recording  # the class is untouched
    x, y = data()

    def grads(backward) -> tuple[torch.Tensor, list[torch.Tensor]]:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[:32]).float(), y[:32])
        backward(loss, opt)
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    def own_block(loss, opt):
        with amp.scale_loss(loss, opt) as scaled:
            acc.backward(scaled)

    ways = [lambda loss, opt: acc.backward(loss), lambda loss, opt: amp_accelerate.backward(acc, loss, opt), own_block]
    results = [grads(way) for way in ways]
    assert len(seen) == 3
    for (loss, g), passed in zip(results, seen):
        assert torch.equal(passed, loss * 2.0**16)  # scaled once, never twice
        assert all(torch.equal(a, b) for a, b in zip(g, results[0][1]))
    assert all(torch.isfinite(t).all() for t in results[0][1])

    amp_accelerate.release(acc)
    assert "backward" not in vars(acc)
    seen.clear()
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x[:32]).float(), y[:32])
    acc.backward(loss)
    assert torch.equal(seen[0], loss.detach())  # Accelerate's own backward again: unscaled
    amp_accelerate.release(acc)  # twice: nothing

    amp.reset()
    acc2 = _accelerator()
    amp_accelerate.prepare(acc2, *build(), opt_level="O2")
    assert "backward" in vars(acc2)
    amp.reset()
    assert "backward" not in vars(acc2)


def test_gradient_accumulation_with_the_hooked_backward():
    """``accelerator.accumulate`` with the plain ``accelerator.backward(loss)`` (fp16 O1,
    dynamic scale) trains bitwise as the old ``amp_accelerate.backward`` did: Accelerate
    divides the scaled loss by its accumulation steps, ampkit steps once per two batches."""

    def run(hooked: bool) -> tuple[list[float], list[torch.Tensor], amp.StepStats]:
        acc = _accelerator(gradient_accumulation_steps=2)
        model, opt, sched = amp_accelerate.prepare(acc, *build(), opt_level="O1", dtype=torch.float16)
        x_all, y_all = data()
        losses = []
        for step in range(16):
            i = (16 * step) % len(x_all)
            with acc.accumulate(model):
                loss = nn.functional.mse_loss(model(x_all[i : i + 16]).float(), y_all[i : i + 16])
                acc.backward(loss) if hooked else amp_accelerate.backward(acc, loss, opt)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.item())
        out = ([p.detach().clone() for p in model.parameters()], amp.stats(opt))
        amp.reset()
        return losses, *out

    old_losses, old_params, old_stats = run(hooked=False)
    losses, params, stats = run(hooked=True)
    assert losses == old_losses
    assert all(torch.equal(a, b) for a, b in zip(params, old_params))
    assert stats == old_stats and stats.steps == 8 and stats.scales == (2.0**16,)


def test_optimizers_of_two_prepare_calls_need_the_explicit_backward():
    """Two prepare calls with optimizers: two loss scalers, so the hooked backward refuses
    a loss (it cannot tell which optimizer it trains); the explicit function names it."""
    acc = _accelerator()
    g_model, g_opt = amp_accelerate.prepare(acc, *build()[:2], opt_level="O2")
    d_model, d_opt = amp_accelerate.prepare(acc, *build()[:2], opt_level="O2")
    x, y = data()
    loss = nn.functional.mse_loss(g_model(x[:8]).float(), y[:8])
    with pytest.raises(amp_accelerate.AccelerateSetupError, match=r"amp_accelerate.backward\(accelerator, loss, optimizer\)"):
        acc.backward(loss)
    assert all(p.grad is None for p in g_model.parameters())
    amp_accelerate.backward(acc, loss, g_opt)
    g_opt.step()
    assert amp.stats(g_opt).steps == 1 and amp.stats(d_opt).steps == 0


# --- untrusted checkpoint folders ----------------------------------------------------------------


class _Payload:
    """A pickle that writes a marker file when unpickled (what a planted file could do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "ran"))


def _saved_checkpoint(tmp_path: Path) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer, Path]:
    """An O2 run saved after two steps, then trained one more step (so a load must change
    the model back): the Accelerator, model, optimizer and the folder."""
    acc = _accelerator()
    model, opt, _ = amp_accelerate.prepare(acc, *build(), opt_level="O2")
    x, y = data()
    for step in range(3):
        if step == 2:
            acc.save_state(str(tmp_path / "ckpt"))
        opt.zero_grad()
        amp_accelerate.backward(acc, nn.functional.mse_loss(model(x[:32]).float(), y[:32]), opt)
        opt.step()
    return acc, model, opt, tmp_path / "ckpt"


def _everything(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return _snapshot(model, opt) + [torch.tensor(amp.stats(opt).scales + (amp.stats(opt).steps,))]


def test_a_planted_custom_checkpoint_pickle_is_never_unpickled(tmp_path):
    """ampkit registers nothing with register_for_checkpointing (Accelerate loads those
    files with weights_only=False): a custom_checkpoint_0.pkl carrying a payload in
    the folder is not run by load_state."""
    acc, model, opt, folder = _saved_checkpoint(tmp_path)
    marker = tmp_path / "payload_ran"
    torch.save(_Payload(marker), folder / "custom_checkpoint_0.pkl")
    with pytest.raises(RuntimeError, match="custom checkpoints"):  # Accelerate counts, unpickles nothing
        acc.load_state(str(folder))
    assert not marker.exists()


@pytest.mark.parametrize(
    "corruption",
    ["payload", "truncated", "empty", "not_a_state", "nan_master", "missing_entry", "fifo", "devzero", "folder"],
)
def test_a_bad_ampkit_state_file_is_refused_before_anything_is_loaded(tmp_path, corruption):
    """load_state reads and validates ampkit's file before Accelerate loads the models:
    a file with a pickle payload (never run), truncated, empty, not ampkit's, with a
    NaN fp32 master or an entry deleted, or no regular file at all (a FIFO, which would
    block, a link to /dev/zero, which never ends, a folder) raises
    AccelerateCheckpointError and leaves the model, masters, optimizer state and loss
    scale as they were."""
    acc, model, opt, folder = _saved_checkpoint(tmp_path)
    path = folder / amp_accelerate.STATE_NAME
    marker = tmp_path / "payload_ran"
    good = torch.load(path, weights_only=True)
    if corruption == "payload":
        torch.save({"format": good["format"], "x": _Payload(marker)}, path)
    elif corruption == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif corruption == "empty":
        path.write_bytes(b"")
    elif corruption == "not_a_state":
        torch.save({"weights": torch.zeros(3)}, path)
    elif corruption == "nan_master":
        good["trainers"][0]["optimizers"][0]["extra"]["master_weights"]["masters"][0][2].view(-1)[0] = float("nan")
        torch.save(good, path)
    elif corruption in ("fifo", "devzero", "folder"):
        path.unlink()
        if corruption == "fifo":
            os.mkfifo(path)
        elif corruption == "devzero":
            path.symlink_to("/dev/zero")
        else:
            path.mkdir()
    else:
        del good["trainers"][0]["optimizers"][0]["extra"]
        torch.save(good, path)
    before = _everything(model, opt)
    says = {"fifo": r"a FIFO \(named pipe\)", "devzero": "a character device", "folder": "a folder"}.get(corruption)
    match = amp_accelerate.STATE_NAME + ("" if says is None else f" is {says}, not a regular file")
    with pytest.raises(amp_accelerate.AccelerateCheckpointError, match=match) as err:
        acc.load_state(str(folder))
    if corruption == "empty":  # the message docs/guides/troubleshooting.md shows
        assert str(err.value) == (
            f"{path} is not a readable checkpoint file (EOFError: truncated or empty); it may be truncated "
            "(an interrupted save) or another file. Resume from an earlier checkpoint."
        )
    assert not marker.exists()
    after = _everything(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_save_state_refuses_a_symlink_at_its_file_and_leaves_its_target_alone(tmp_path):
    """A symlink planted where save_state writes ampkit's state: refused
    (AccelerateCheckpointError naming the file) before Accelerate writes anything, and
    the file it points to is untouched (ampkit writes regular files, never through a link)."""
    acc, model, opt, folder = _saved_checkpoint(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("VICTIM")
    again = tmp_path / "again"
    again.mkdir()
    (again / amp_accelerate.STATE_NAME).symlink_to(victim)
    with pytest.raises(amp_accelerate.AccelerateCheckpointError, match=f"{amp_accelerate.STATE_NAME}.*symbolic link"):
        acc.save_state(str(again))
    assert victim.read_text() == "VICTIM"
    assert (again / amp_accelerate.STATE_NAME).is_symlink()
    assert sorted(p.name for p in again.iterdir()) == [amp_accelerate.STATE_NAME]


def test_a_checkpoint_without_ampkit_state_warns(tmp_path):
    acc, model, opt, folder = _saved_checkpoint(tmp_path)
    (folder / amp_accelerate.STATE_NAME).unlink()
    with pytest.warns(UserWarning, match=f"holds no {amp_accelerate.STATE_NAME}.*not exact"):
        acc.load_state(str(folder))


# --- resume through accelerator.save_state / load_state ---------------------------------------------


def _resume_run(tmp_path: Path, opt_level: str, dtype, checkpoint: bool, resume: bool) -> list[torch.Tensor]:
    """Eight steps; the uninterrupted run saves at step 4, the resumed one loads there
    and runs steps 4..7 in new objects (a new Accelerator, model and optimizer)."""
    acc = _accelerator()
    model, opt, sched = amp_accelerate.prepare(acc, *build(), opt_level=opt_level, dtype=dtype, checkpoint=checkpoint)
    if resume:
        acc.load_state(str(tmp_path / "ckpt"))
    x_all, y_all = data()
    for step in range(4 if resume else 0, 8):
        if step == 4 and not resume:
            acc.save_state(str(tmp_path / "ckpt"))
        x, y = x_all[32 * step : 32 * step + 32], y_all[32 * step : 32 * step + 32]
        opt.zero_grad()
        amp_accelerate.backward(acc, nn.functional.mse_loss(model(x).float(), y), opt)
        if step == 5:
            model[0].weight.grad[0, 0] = float("inf")  # a skipped step after the resume
        opt.step()
        sched.step()
    st = amp.stats(opt)
    assert (st.steps, st.skipped) == ((8, 1) if checkpoint or not resume else (4, 1))
    out = _snapshot(model, opt) + [torch.tensor(sched.get_last_lr()), torch.tensor(st.scales)]
    amp.reset()
    return out


@pytest.mark.parametrize(
    ("opt_level", "dtype"), [("O2", None), ("O2K", None), ("O1", torch.float16)], ids=["O2", "O2K", "O1-fp16"]
)
def test_save_state_load_state_resume_bitwise(tmp_path, opt_level, dtype):
    whole = _resume_run(tmp_path, opt_level, dtype, checkpoint=True, resume=False)
    resumed = _resume_run(tmp_path, opt_level, dtype, checkpoint=True, resume=True)
    assert len(whole) == len(resumed)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))


def test_resume_without_ampkit_state_is_not_bitwise(tmp_path):
    """Without ampkit's state in the checkpoint (checkpoint=False), O2's masters come back
    from the bf16 weights Accelerate saved: the resumed run drifts from the whole one."""
    whole = _resume_run(tmp_path, "O2", None, checkpoint=False, resume=False)
    resumed = _resume_run(tmp_path, "O2", None, checkpoint=False, resume=True)
    assert not all(torch.equal(a, b) for a, b in zip(whole, resumed))


# --- DDP: 2 gloo processes ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("accelerate_ddp")
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
        )  # fmt: skip
        cmd = [sys.executable, str(SCRIPTS / "accelerate_ddp.py"), str(out / f"rank{rank}.json"), "fp32", "O1", "O2"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_ddp_two_processes(ddp_results, opt_level):
    r0, r1 = ddp_results
    assert r0["distributed_type"] == "DistributedType.MULTI_CPU"
    ref = _mean_last(r0["fp32"]["train"]["losses"])
    run0, run1 = r0[opt_level]["train"], r1[opt_level]["train"]
    assert abs(_mean_last(run0["losses"]) - ref) / ref < 0.01
    assert run0["params"] == run1["params"] and run0["masters"] == run1["masters"]  # replicas
    assert run0["agree"] == [True] * 30  # the skip decision agreed on every step
    for case in ("nan", "edit"):  # a NaN in rank 1's batch; a NaN written through .data on rank 1 only
        a, b = r0[opt_level][case], r1[opt_level][case]
        assert a["skipped"] == b["skipped"] == [False, False, False, True, False, False], case
        assert a["stats"] == b["stats"] == [6, 1] and a["finite"] and b["finite"]
        assert a["params"] == b["params"] and a["masters"] == b["masters"], case
        assert a["lr"] == b["lr"] == r0[opt_level]["nan"]["lr"]
    fp32_nan = r0["fp32"]["nan"]
    assert not fp32_nan["finite"] and fp32_nan["skipped"] == [False] * 6  # Accelerate alone
    assert a["lr"] > fp32_nan["lr"]  # the skipped step held the scheduler


# --- ampkit run on the unmodified Accelerate script ---------------------------------------------------


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_ampkit_run_agrees_with_the_integration(opt_level, tmp_path, capsys, fp32_losses):
    from ampkit.tools.cli.main import main

    report = tmp_path / "report.json"
    code = main(["run", "--level", opt_level, "--report", str(report), str(SCRIPTS / "accelerate_train.py")])
    out = capsys.readouterr().out
    assert code == 0, out
    run_loss = float([line for line in out.splitlines() if line.startswith("METRIC final_loss")][-1].split()[2])
    rep = json.loads(report.read_text())
    assert rep["level_applied"] == opt_level and rep["optimizers"][0]["managed"] == opt_level
    assert rep["optimizers"][0]["steps"] == 60 and rep["optimizers"][0]["skipped"] == 0
    (run_losses,) = rep["losses"].values()  # one backward() site: Accelerate's own
    _reset_accelerate()
    amp.reset()
    integration = _amp_run(opt_level)[0]
    assert run_losses == integration  # the same 60 losses, bitwise
    assert run_loss == float(f"{_mean_last(integration):.6f}")
    assert abs(run_loss - _mean_last(fp32_losses)) / _mean_last(fp32_losses) < 0.01


def test_a_folder_saved_by_0_3_says_how_to_reuse_its_state_and_unpickles_nothing(tmp_path):
    """0.3 saved ampkit's state as a registered custom_checkpoint_0.pkl. Loading such a
    folder warns (naming the rename that lets ampkit read it weights-only); Accelerate
    then refuses the unregistered file by counting, before unpickling anything."""
    acc, model, opt, folder = _saved_checkpoint(tmp_path)
    state = folder / amp_accelerate.STATE_NAME
    marker = tmp_path / "payload_ran"
    torch.save(_Payload(marker), folder / "custom_checkpoint_0.pkl")
    state.unlink()
    with pytest.warns(UserWarning, match=f"custom_checkpoint_0.pkl.*rename it to {amp_accelerate.STATE_NAME}"):
        with pytest.raises(RuntimeError, match="custom checkpoints"):
            acc.load_state(str(folder))
    assert not marker.exists()


# --- a tuning plan (ampkit.tune) ---------------------------------------------------------------


@pytest.mark.parametrize("level", ["O1", "O2K"])
def test_prepare_takes_a_tuning_plan(level, tmp_path):
    path = tmp_path / "plan.json"
    amp.TunePlan.by_hand(lowered=["0"], kept_fp32=["3"], level=level).save(path)
    acc = _accelerator()
    model, opt, sched = build()
    seen = {}
    for name in ("0", "3"):
        model.get_submodule(name).register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
    model, opt, sched = amp_accelerate.prepare(acc, model, opt, sched, plan=str(path))
    train(acc, model, opt, sched, lambda loss: amp_accelerate.backward(acc, loss, opt), 2)
    assert seen == {"0": torch.bfloat16, "3": torch.float32}
    raw = acc.unwrap_model(model)
    assert raw[3].weight.dtype == torch.float32
    assert raw[0].weight.dtype == (torch.bfloat16 if level == "O2K" else torch.float32)
