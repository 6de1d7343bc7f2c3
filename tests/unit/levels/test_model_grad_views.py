"""O2 with ``model_grads="view"``: the model's bf16 grads are views of the fp32 master
grads' high halves (no memory of their own), and every gradient idiom of an fp32
script still reaches the step: read, clip, edit, clear (through the model or the
optimizer), accumulate, after the step."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit import AmpError


@pytest.fixture(autouse=True)
def _clean():
    amp.reset()
    yield
    amp.reset()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(i))


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    return model(_batch(i)).float().pow(2).mean()


def _setup(mode: str, **kw):
    """O2 with ``model_grads=mode``; copies with fp32 grads made as backward produces
    them (``master_grads="always"``, what views imply), so the two differ only in how
    the model shows its grads."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw.setdefault("master_grads", "always")
    return amp.initialize(model, opt, opt_level="O2", model_grads=mode, **kw)


def _train(mode: str, steps: int = 4, edit=None, micro: int = 1):
    model, opt = _setup(mode)
    for i in range(steps):
        opt.zero_grad()
        for j in range(micro):
            _loss(model, 10 * i + j).backward()
        if edit is not None:
            edit(model, opt)
        opt.step()
    out = [p.detach().clone() for p in amp.master_params(opt)]
    amp.reset()
    return out


def _shares_memory(view: torch.Tensor, g32: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == g32.untyped_storage().data_ptr()


def test_the_model_grads_are_views_of_the_fp32_grads_and_read_the_same_values():
    model, opt = _setup("view")
    _loss(model, 0).backward()
    views = [p.grad for p in model.parameters()]
    masters = list(amp.master_params(opt))
    for v, m in zip(views, masters):
        assert v.dtype == torch.bfloat16 and v.shape == m.shape
        assert _shares_memory(v, m.grad)
        assert torch.equal(v.float(), m.grad)  # the fp32 grad holds bf16 values exactly
    amp.reset()
    copy_model, copy_opt = _setup("copy")
    _loss(copy_model, 0).backward()
    for v, p, m in zip(views, copy_model.parameters(), amp.master_params(copy_opt)):
        assert torch.equal(v, p.grad)
        assert p.grad.is_contiguous() and not _shares_memory(p.grad, m.grad)


def test_without_edits_training_is_bitwise_the_copy_mode():
    a, b = _train("copy"), _train("view")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_accumulated_micro_batches_are_shown_as_copies_and_train_bitwise_as_copy_mode():
    model, opt = _setup("view")
    _loss(model, 0).backward()
    _loss(model, 1).backward()
    w = model[0].weight
    assert w.grad.is_contiguous()  # a sum in fp32: shown rounded, as a copy
    master = next(iter(amp.master_params(opt)))
    assert torch.equal(w.grad, master.grad.to(torch.bfloat16))
    amp.reset()
    a, b = _train("copy", micro=2), _train("view", micro=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _clip(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def test_clip_grad_norm_through_the_model_reaches_the_step_in_bf16_precision():
    model, opt = _setup("view")
    _loss(model, 0).backward()
    masters = list(amp.master_params(opt))
    before = [m.grad.clone() for m in masters]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    coef = 0.05 / (norm.float().item() + 1e-6)
    assert coef < 0.5  # the clip really scales down
    for b, m, p in zip(before, masters, model.parameters()):
        assert torch.equal(m.grad, p.grad.float())  # one memory: the fp32 grad is the clipped view
        # one factor, the clip's coefficient, up to the bf16 rounding of each product
        ratio = m.grad[b != 0] / b[b != 0]
        assert (ratio.max() - ratio.min()).item() <= 2**-7 * ratio.mean().item()
        assert ratio.mean().item() == pytest.approx(coef, rel=0.01)
    amp.reset()
    ref = _train("copy", edit=_clip)
    got = _train("view", edit=_clip)
    unclipped = _train("view")
    for x, y, z in zip(got, ref, unclipped):
        # the clip took effect, and as in copy mode up to bf16 rounding of the clipped grads
        assert (x - y).abs().max() < 0.05 * (y - z).abs().max()


def test_edits_through_data_and_in_place_reach_the_fp32_grads():
    model, opt = _setup("view")
    _loss(model, 0).backward()
    masters = list(amp.master_params(opt))
    before = [m.grad.clone() for m in masters]
    model[0].weight.grad.data.mul_(0.5)
    model[0].bias.grad[3] = 7.0
    assert torch.equal(masters[0].grad, before[0] * 0.5)  # halving is exact in bf16
    assert masters[1].grad[3].item() == 7.0
    assert torch.equal(masters[1].grad[:3], before[1][:3])


@pytest.mark.parametrize("how", ["model.zero_grad", "p.grad=None", "set_to_none=False", "optimizer.zero_grad"])
def test_clearing_grads_either_way_clears_the_step(how):
    model, opt = _setup("view")
    _loss(model, 0).backward()
    opt.step()
    before = [p.detach().clone() for p in amp.master_params(opt)]
    _loss(model, 1).backward()
    if how == "model.zero_grad":
        model.zero_grad()
    elif how == "p.grad=None":
        for p in model.parameters():
            p.grad = None
    elif how == "set_to_none=False":
        model.zero_grad(set_to_none=False)
    else:
        opt.zero_grad()
    masters = list(amp.master_params(opt))
    state = [opt.state[m]["exp_avg"].clone() for m in masters]
    opt.step()
    for m, b, s in zip(masters, before, state):
        if how == "set_to_none=False":
            assert torch.equal(m.grad, torch.zeros_like(m.grad))
            # zero grads still step (AdamW's decay and moments move), as in fp32
            assert not torch.equal(opt.state[m]["exp_avg"], s)
        else:
            assert m.grad is None
            assert torch.equal(m.detach(), b) and torch.equal(opt.state[m]["exp_avg"], s)


def test_a_replaced_model_grad_replaces_the_fp32_grad():
    model, opt = _setup("view")
    _loss(model, 0).backward()
    w = model[0].weight
    w.grad = torch.full_like(w.grad, 0.25)
    opt.step()
    master = next(iter(amp.master_params(opt)))
    assert torch.equal(master.grad, torch.full_like(master.grad, 0.25))


def test_optimizer_zero_grad_frees_the_fp32_grads_at_the_next_forward():
    model, opt = _setup("view")
    _loss(model, 0).backward()
    opt.step()
    refs = [weakref.ref(m.grad) for m in amp.master_params(opt)]
    opt.zero_grad()  # the masters drop their grads; the model still holds views of them
    model(_batch(1))  # the forward takes the stale views off
    gc.collect()
    assert all(p.grad is None for p in model.parameters())
    assert all(r() is None for r in refs)


def test_grads_are_shown_again_after_the_step():
    model, opt = _setup("view")
    _loss(model, 0).backward()
    seen = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for s, p, m in zip(seen, model.parameters(), amp.master_params(opt)):
        assert torch.equal(p.grad, s) and _shares_memory(p.grad, m.grad)


def test_clipping_through_both_sides_applies_both():
    """One memory: a clip through the masters after one through the model scales the
    same grads again (as two clips of an fp32 model's grads would)."""
    model, opt = _setup("view")
    _loss(model, 0).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.01)
    total = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in amp.master_params(opt)]))
    assert total.item() == pytest.approx(0.01, rel=1e-3)
    opt.step()  # no "changed both ways" error


def test_an_inf_written_into_a_view_skips_the_step_bitwise():
    model, opt = _setup("view", loss_scale=1.0)
    _loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in amp.master_params(opt)]
    state = str(opt.state_dict())
    _loss(model, 1).backward()
    model[0].weight.grad[1, 2] = float("inf")
    opt.step()
    assert amp.step_skipped(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))
    assert str(opt.state_dict()) == state


def test_a_dynamic_loss_scale_shows_copies():
    model, opt = _setup("view", loss_scale="dynamic")
    with amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()  # grads times 2**16, unscaled in fp32: not bf16 values any more
    assert all(p.grad.is_contiguous() for p in model.parameters())
    masters = list(amp.master_params(opt))
    assert all(torch.equal(p.grad, m.grad.to(torch.bfloat16)) for p, m in zip(model.parameters(), masters))


@pytest.mark.parametrize(
    "level, kw, match",
    [
        ("O2", {"model_grads": "views"}, "model_grads must be one of"),
        ("O1", {"model_grads": "view"}, "no master weights"),
        ("O2K", {"model_grads": "view"}, "no master weights"),
        ("O2", {"model_grads": "view", "dtype": torch.float16}, "bf16"),
    ],
)
def test_bad_settings_are_refused_before_anything_changes(level, kw, match):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(AmpError, match=match):
        amp.initialize(model, opt, opt_level=level, **kw)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert opt.param_groups[0]["params"][0] is model[0].weight


def test_flattening_and_concatenating_the_strided_grads_works():
    """Gradient-vector idioms (PCGrad, GEM, grad-similarity logging) on the views."""
    model, opt = _setup("view")
    _loss(model, 0).backward()
    grads = [p.grad for p in model.parameters()]
    assert not grads[0].is_contiguous()
    flat = torch.cat([g.view(-1) for g in grads])
    masters = torch.cat([m.grad.view(-1) for m in amp.master_params(opt)])
    assert flat.dtype == torch.bfloat16 and torch.equal(flat.float(), masters)
    assert torch.equal(torch.cat([g.flatten() for g in grads]), flat)
