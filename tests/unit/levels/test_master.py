"""fp32 master weights (ampkit.master.MasterWeights), without the trainer around it."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from ampkit.errors import AmpError, StateError
from ampkit.levels.master import MasterWeights
from ampkit.levels.model_cast import cast_model, params_to_cast


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _o2(opt_cls=torch.optim.SGD, **kw):
    model = _model()
    fp32_weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt = opt_cls(model.parameters(), lr=0.1, **kw)
    masters = MasterWeights(opt, params_to_cast(model))
    cast_model(model, torch.bfloat16)
    return model, opt, masters, fp32_weights


def test_masters_replace_cast_params_and_start_from_the_fp32_weights():
    model, opt, masters, fp32 = _o2()
    stepped = list(opt.param_groups[0]["params"])
    assert [p.dtype for p in stepped] == [torch.float32] * 6
    # Linear params are masters (new objects); LayerNorm params stay the model's own.
    lin0, norm, lin1 = model[0], model[1], model[2]
    assert lin1.weight.dtype == torch.bfloat16 and stepped[4] is not lin1.weight
    assert stepped[0] is not lin0.weight and stepped[2] is norm.weight and stepped[3] is norm.bias
    assert lin0.weight.dtype == torch.bfloat16 and norm.weight.dtype == torch.float32
    # Bitwise the fp32 weights, not the bf16 round trip.
    assert torch.equal(masters.master_of(lin0.weight), fp32["0.weight"])
    assert not torch.equal(lin0.weight.float(), fp32["0.weight"])
    assert masters.model_param_of(stepped[0]) is lin0.weight
    assert len(masters.pairs()) == 4


def test_masters_refuse_params_that_are_already_16_bit():
    model = cast_model(_model(), torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(AmpError, match="before casting"):
        MasterWeights(opt, params_to_cast(model))


def test_gather_moves_grads_into_fp32_masters_and_accumulates():
    model, opt, masters, _ = _o2()
    x = torch.randn(4, 6)
    model(x).sum().backward()
    g1 = model[0].weight.grad.clone()
    assert g1.dtype == torch.bfloat16
    masters.gather_grads()
    m0 = masters.master_of(model[0].weight)
    assert model[0].weight.grad is None
    assert m0.grad.dtype == torch.float32 and torch.equal(m0.grad, g1.float())
    model(x).sum().backward()
    g2 = model[0].weight.grad.clone()
    masters.gather_grads()
    assert torch.equal(m0.grad, g1.float() + g2.float())


def test_step_on_masters_matches_fp32_sgd_and_publishes_rounded_weights():
    model, opt, masters, fp32 = _o2()
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(1)
    for _ in range(3):
        grads = [torch.randn_like(p, dtype=torch.float32) for p in ref.parameters()]
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone()
        ref_opt.step()
        # The model receives the same grads, rounded to its dtype.
        opt.zero_grad()
        for p, g in zip(model.parameters(), grads):
            p.grad = g.to(p.dtype)
        masters.gather_grads()
        opt.step()
        masters.publish()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        master = masters.master_of(p)
        if master is None:  # LayerNorm, fp32 in the model: grads were exact
            assert torch.equal(p, p_ref), name
        else:
            assert torch.equal(p, master.to(torch.bfloat16)), name
            # Same update as fp32 SGD up to the bf16 rounding of the grads.
            assert torch.allclose(master, p_ref, atol=2e-3), name


def test_add_param_group_after_construction_gets_masters():
    model, opt, masters, _ = _o2()
    extra = nn.Linear(3, 2).to(torch.bfloat16)
    opt.add_param_group({"params": list(extra.parameters()), "lr": 0.5})
    assert masters.master_of(extra.weight) is not None
    new = opt.param_groups[1]["params"]
    assert all(p.dtype == torch.float32 for p in new)
    assert torch.equal(new[0], extra.weight.float())
    before = new[0].detach().clone()
    extra.weight.grad = torch.ones_like(extra.weight)
    masters.gather_grads()
    assert extra.weight.grad is None and torch.equal(new[0].grad, torch.ones(2, 3))
    opt.step()
    masters.publish()
    assert torch.equal(new[0], before - 0.5)  # the group's lr times the grad
    assert torch.equal(extra.weight, new[0].to(torch.bfloat16))


def test_adam_state_stays_fp32_through_optimizer_load_state_dict():
    model, opt, masters, _ = _o2(torch.optim.Adam)
    model(torch.randn(2, 6)).sum().backward()
    masters.gather_grads()
    opt.step()
    masters.publish()
    buf = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "masters": masters.state_dict()},
        buf,
    )
    buf.seek(0)
    saved = torch.load(buf)
    model2, opt2, masters2, _ = _o2(torch.optim.Adam)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    masters2.load_state_dict(saved["masters"])
    for p1, p2 in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"]):
        assert p2.dtype == torch.float32 and torch.equal(p1, p2)
        s1, s2 = opt.state[p1], opt2.state[p2]
        assert s2["exp_avg"].dtype == torch.float32
        assert torch.equal(s1["exp_avg"], s2["exp_avg"])
    # load_state_dict also rounded the masters into the fresh model.
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)


def test_load_refuses_a_checkpoint_of_another_layout():
    _, _, masters, _ = _o2()
    state = masters.state_dict()
    state["masters"] = state["masters"][:-1]
    with pytest.raises(StateError, match="positions"):
        masters.load_state_dict(state)
    with pytest.raises(StateError, match="format"):
        masters.load_state_dict({"masters": []})


def test_existing_optimizer_state_moves_to_the_master():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    buf = opt.state[model[0].weight]["momentum_buffer"].clone()
    masters = MasterWeights(opt, params_to_cast(model))
    cast_model(model, torch.bfloat16)
    master = masters.master_of(model[0].weight)
    assert model[0].weight not in opt.state
    assert torch.equal(opt.state[master]["momentum_buffer"], buf)


# --- the model's weights and the masters stay one (through ampkit.initialize) -----------


def test_o2_model_weight_edits_survive_the_step():
    """WGAN's weight clipping, manual weight decay: p.data edits of the model's 16-bit
    weights (no version counter moves) are taken into the masters before the step,
    instead of being overwritten by the old masters."""
    import ampkit

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = ampkit.initialize(model, opt, opt_level="O2")
    for p in model.parameters():
        p.data.clamp_(-0.01, 0.01)
    clamped = [p.detach().clone() for p in model.parameters()]
    with ampkit.scale_loss(model(torch.randn(4, 6)).float().sum(), opt) as s:
        s.backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(clamped, model.parameters()))
    mw = ampkit.levels.master_weights_of(opt)
    assert all(torch.equal(m.to(p.dtype), p) for p, m in mw.pairs())
    ampkit.reset()


def test_o2_masters_changed_outside_the_managed_step_reach_the_model_at_its_forward():
    """An optimizer wrapper that steps its base optimizer itself (SAM's first_step and
    second_step) changes the masters without ampkit's step: the model's next forward
    computes with them."""
    import ampkit

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level="O2")
    x = torch.randn(4, 6)
    before = model(x)
    with torch.no_grad():
        for m in ampkit.master_params(opt):
            m.add_(0.5)  # e.g. SAM's ascent step e_w
    after = model(x)
    ref = _model()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.5)
    assert not torch.equal(before, after)
    assert torch.allclose(after, ref(x), atol=0.05)
    mw = ampkit.levels.master_weights_of(opt)
    assert all(torch.equal(m.to(p.dtype), p) for p, m in mw.pairs())
    ampkit.reset()


# --- through the trainer: an iteration abandoned after unscale ---------------------------


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def _trained_o2(model_grads: str, abort_first: bool, edit: str, set_to_none: bool = True) -> list[torch.Tensor]:
    """Two O2 steps; with ``abort_first``, before them an iteration the README's recovery
    path drops: backward, ``amp.unscale``, a model grad edited to inf, a clip with
    ``error_if_nonfinite=True`` that raises, ``opt.zero_grad(set_to_none)``."""
    import ampkit as amp

    amp.reset()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", model_grads=model_grads)

    def loss_of(i: int) -> torch.Tensor:
        x, y = _batch(i)
        return nn.functional.cross_entropy(model(x).float(), y)

    if abort_first:
        with amp.scale_loss(loss_of(0), opt) as scaled:
            scaled.backward()
        amp.unscale(opt)
        with torch.no_grad():
            if edit == "in_place":
                model[0].weight.grad[0, 0] = float("inf")
            else:
                model[0].weight.grad = torch.full_like(model[0].weight, float("inf"))
        with pytest.raises(RuntimeError, match="non-finite"):
            nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.zero_grad(set_to_none=set_to_none)
    for i in (1, 2):
        opt.zero_grad()
        with amp.scale_loss(loss_of(i), opt) as scaled:
            scaled.backward()
        opt.step()
        assert not amp.step_skipped(opt)
    weights = [p.detach().clone() for p in [*model.parameters(), *amp.master_params(opt)]]
    amp.reset()
    return weights


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("edit", ["in_place", "replaced"])
@pytest.mark.parametrize("model_grads", ["copy", "view"])
def test_optimizer_zero_grad_drops_an_iteration_abandoned_after_unscale(model_grads, edit, set_to_none):
    """``opt.zero_grad()`` after a clip raised on a model grad edited to inf: the batch
    is dropped, the next iterations train bitwise as if it had never been."""
    dropped = _trained_o2(model_grads, abort_first=True, edit=edit, set_to_none=set_to_none)
    clean = _trained_o2(model_grads, abort_first=False, edit=edit)
    assert all(torch.equal(a, b) for a, b in zip(dropped, clean))


def _o2_run_with_data_edits(edit: bool) -> tuple[list[float], list[torch.Tensor]]:
    """fp16 O2, AdamW, 4 steps; with ``edit``: a grad edited through ``.data`` after the
    second backward and a weight through ``.data`` before the third step (neither bumps a
    version counter: only a comparison of values sees them)."""
    import ampkit as amp

    amp.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16)
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(4):
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if edit and i == 1:
            model[0].weight.grad.data[0, :3] = 0.5
        if edit and i == 2:
            model[2].weight.data[0, 0] += 1.0
        opt.step()
        losses.append(loss.item())
    params = [p.detach().clone() for p in model.parameters()]
    amp.reset()
    return losses, params


def test_comparisons_made_ahead_on_the_device_decide_as_one_by_one(monkeypatch):
    """Off the CPU, O2 compares every 16-bit grad and weight with its master in one
    device pass and one host sync (one ``torch.equal`` each made an H200 wait 200 times
    a step). Made ahead here on the CPU too: ``.data`` edits of grads and weights are
    seen exactly as the one-by-one comparisons see them (bitwise the same run), with no
    ``torch.equal`` left in the step."""
    from ampkit.levels import rounding

    one_by_one = _o2_run_with_data_edits(edit=True)
    unedited = _o2_run_with_data_edits(edit=False)
    assert not all(torch.equal(a, b) for a, b in zip(one_by_one[1], unedited[1]))  # the edits count
    monkeypatch.setattr(rounding, "COMPARED_ONE_BY_ONE", frozenset())
    calls = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: (calls.append(1), real_equal(a, b))[1])
    ahead = _o2_run_with_data_edits(edit=True)
    monkeypatch.setattr(torch, "equal", real_equal)
    assert ahead[0] == one_by_one[0]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ahead[1], one_by_one[1]))
    assert calls == []


@pytest.mark.parametrize("route", ["fp16", "always"])
def test_on_the_cpu_the_shown_grads_are_compared_in_a_few_calls_whatever_the_model_size(monkeypatch, route):
    """On the CPU, O2's grads shown on the model and kept in fp32 on the masters (fp16's
    scaled grads; ``master_grads="always"``) are compared with their masters' at the
    step in a few multi-tensor calls, as the weights are, not one ``torch.equal`` per
    parameter: a step of a 6-layer model makes as many comparisons as one of a 2-layer
    model. (That ``.data`` edits are still seen, bitwise as compared one by one:
    ``test_comparisons_made_ahead_on_the_device_decide_as_one_by_one``.)"""
    import ampkit as amp

    def comparisons(depth: int) -> int:
        amp.reset()
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(depth)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        kw = {"dtype": torch.float16} if route == "fp16" else {"dtype": torch.bfloat16, "master_grads": "always"}
        model, opt = amp.initialize(model, opt, opt_level="O2", **kw)
        calls = []
        real_equal = torch.equal
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            if i == 2:  # past the first steps (state made, the scale settled)
                monkeypatch.setattr(torch, "equal", lambda a, b: (calls.append(1), real_equal(a, b))[1])
            opt.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fp16 on a CPU
                loss = model(torch.randn(4, 8, generator=g)).float().pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            assert not amp.step_skipped(opt)
        monkeypatch.setattr(torch, "equal", real_equal)
        amp.reset()
        return len(calls)

    small, large = comparisons(2), comparisons(6)
    assert small == large, (small, large)  # per parameter: 4 more grads and 4 more weights
    assert large <= 8, large


def test_held_grads_are_not_compared_ahead_only_the_weights_are(monkeypatch):
    """Made ahead (as off the CPU), an O2 step with its grads held on the model
    (``master_grads="on_demand"``, one backward) compares each weight with its master
    and no grad: a held grad is the gradient, with nothing to compare it with (on a GPU
    each comparison is a kernel, and their results one read that waits for the device).
    bf16: a loss scale of 1 holds the grads (fp16's scaled grads are not held)."""
    import ampkit as amp
    from ampkit.levels import rounding

    monkeypatch.setattr(rounding, "COMPARED_ONE_BY_ONE", frozenset())
    amp.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dtype = torch.bfloat16
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype)
    from ampkit.levels.setup import master_weights_of

    mw = master_weights_of(opt)
    mastered = [p for p in model.parameters() if p.dtype == dtype]
    assert len(mastered) == 4  # the linears' weights and biases; LayerNorm stays fp32
    real_ne = torch.ne
    compared: list[torch.dtype] = []

    def counting_ne(a, b, *args, **kwargs):
        compared.append(b.dtype)
        return real_ne(a, b, *args, **kwargs)

    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(16, 8, generator=g)).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        assert len(mw.grads.held()) == 4
        compared.clear()
        monkeypatch.setattr(torch, "ne", counting_ne)
        opt.step()
        monkeypatch.setattr(torch, "ne", real_ne)
        assert len(compared) == len(mastered), compared  # one per weight, none per grad
    amp.reset()


def test_the_grad_methods_of_0_3_forward_to_the_mirror_with_a_deprecation_warning():
    """0.3's ``MasterWeights.reconcile``/``show``/... are ``MasterWeights.grads``' today:
    the old names still run the same method, warning; unknown names still raise."""
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mw = MasterWeights(opt)  # the model is fp32: no masters, a mirror with nothing to do
    with pytest.warns(DeprecationWarning, match=r"MasterWeights.reconcile moved to MasterWeights.grads.reconcile"):
        bound = mw.reconcile
    assert bound.__self__ is mw.grads and bound.__func__ is type(mw.grads).reconcile
    with pytest.raises(AttributeError, match="no attribute 'no_such_method'"):
        mw.no_such_method  # noqa: B018
    assert mw.held() == [] and not mw.is_placeholder(next(model.parameters()))


@pytest.mark.parametrize("how", ["in another group", "twice in the new group", "a single tensor"])
def test_o2_refuses_a_param_group_repeating_a_mastered_parameter_before_anything_changes(how):
    """torch's own duplicate check compares a model parameter with the masters in the
    groups, so it let one with a master already through, and a second master was made
    for it (both stepped, the model showing one). At O2 ``add_param_group`` refuses it,
    and a 16-bit one twice in the new group, before torch adds anything; training then
    goes on bitwise as without the attempt. A new parameter is still added (and gets its
    master); after ``ampkit.reset`` the optimizer's ``add_param_group`` is torch's again."""
    import ampkit as amp

    def run(attempt: bool) -> list[torch.Tensor]:
        amp.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16)
        if attempt:
            bad = {"in another group": list(model[0].parameters()),
                   "twice in the new group": [model[2].weight, model[2].bias, model[2].weight],
                   "a single tensor": model[0].weight}[how]  # fmt: skip
            layout = [list(g["params"]) for g in opt.param_groups]
            with pytest.raises(StateError, match="twice, or already in another group"):
                opt.add_param_group({"params": bad, "lr": 1e-3})
            assert [list(g["params"]) for g in opt.param_groups] == layout
        with pytest.raises(TypeError, match="ordered collections"):  # torch's own refusal, as without ampkit
            opt.add_param_group({"params": set(model[2].parameters())})
        opt.add_param_group({"params": list(model[2].parameters())})
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 6, generator=g)
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        assert len(opt.param_groups) == 2 and all(p.dtype == torch.float32 for p in opt.param_groups[1]["params"])
        out = [p.detach().clone() for p in model.parameters()]
        out += [t.clone() for p in amp.master_params(opt) for t in opt.state[p].values()]
        amp.reset()
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})  # torch's own again
        assert "add_param_group" not in opt.__dict__
        return out

    refused, clean = run(True), run(False)
    assert len(refused) == len(clean) and all(torch.equal(a, b) for a, b in zip(refused, clean))
