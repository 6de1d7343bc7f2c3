"""The gradient path (ampkit.grads, ampkit.master): grads user code sees are real
gradients at every level, O2's fp32 master grads follow every way of clearing and
editing grads, and accumulate in fp32. Each loop runs the same script in fp32 as the
reference."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ampkit as amp
from ampkit.errors import AmpError

BF16 = torch.bfloat16


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    x, y = _batch(i)
    return F.mse_loss(model(x).float(), y)


def _backward(model: nn.Module, opt: torch.optim.Optimizer, i: int, managed: bool) -> None:
    if managed:
        with amp.scale_loss(_loss(model, i), opt) as scaled:
            scaled.backward()
    else:
        _loss(model, i).backward()


def _stepped(model: nn.Module, opt: torch.optim.Optimizer, managed: bool) -> list[torch.Tensor]:
    return [p.detach().float() for p in (amp.master_params(opt) if managed else model.parameters())]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float) -> bool:
    scale = max(t.abs().max().item() for t in b)
    return max((x - y).abs().max().item() for x, y in zip(a, b)) <= tol * scale


# --- the minimal case ------------------------------------------------------------


def test_o2_master_grads_do_not_pile_up_across_steps():
    m = nn.Linear(4, 1, bias=False)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = amp.initialize(m, o, opt_level="O2")
    seen = []
    for _ in range(3):
        m.zero_grad()
        with amp.scale_loss(m(torch.ones(2, 4)).float().sum(), o) as s:
            s.backward()
        seen.append(next(amp.master_params(o)).grad.clone())
        o.step()
    assert all(torch.equal(g, torch.full((1, 4), 2.0)) for g in seen)


# --- every way of clearing grads, O2 against fp32 ------------------------------------------


def _clear(idiom: str, model: nn.Module, opt: torch.optim.Optimizer, managed: bool) -> None:
    params = list(amp.master_params(opt)) if managed and idiom.startswith("master") else list(model.parameters())
    if idiom == "opt.zero_grad":
        opt.zero_grad()
    elif idiom == "opt.zero_grad(set_to_none=False)":
        opt.zero_grad(set_to_none=False)
    elif idiom == "model.zero_grad":
        model.zero_grad()
    elif idiom == "model.zero_grad(set_to_none=False)":
        model.zero_grad(set_to_none=False)
    elif idiom in ("p.grad = None", "master p.grad = None"):
        for p in params:
            p.grad = None
    elif idiom in ("p.grad.data.zero_()", "master p.grad.data.zero_()"):
        for p in params:
            if p.grad is not None:
                p.grad.data.zero_()
    elif idiom == "never":
        pass
    else:  # pragma: no cover
        raise AssertionError(idiom)


CLEARING = [
    "opt.zero_grad",
    "opt.zero_grad(set_to_none=False)",
    "model.zero_grad",
    "model.zero_grad(set_to_none=False)",
    "p.grad = None",
    "p.grad.data.zero_()",
    "master p.grad = None",
    "never",
]


def _train_clearing(idiom: str, where: str, level: str | None) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    managed = level is not None
    if managed:
        model, opt = amp.initialize(model, opt, opt_level=level)
    for i in range(5):
        if where == "before backward":
            _clear(idiom, model, opt, managed)
        _backward(model, opt, i, managed)
        opt.step()
        if where == "after step":
            _clear(idiom, model, opt, managed)
    out = _stepped(model, opt, managed)
    amp.reset()
    return out


@pytest.mark.parametrize("where", ["before backward", "after step"])
@pytest.mark.parametrize("idiom", CLEARING)
def test_o2_trains_as_fp32_whatever_way_grads_are_cleared(idiom, where):
    if idiom == "never" and where == "after step":
        pytest.skip("same as before backward")
    ref = _train_clearing(idiom if not idiom.startswith("master") else idiom[7:], where, None)
    got = _train_clearing(idiom, where, "O2")
    assert _close(got, ref, 0.02), idiom


def test_classic_data_zero_after_the_step_clears_the_master_grads():
    """The pre-1.0 idiom `p.grad.data.zero_()` changes no version counter: the
    placeholder left on the model after the step still shows it."""
    model = nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O2")
    for _ in range(2):
        with amp.scale_loss(model(torch.ones(1, 3)).float().sum(), opt) as s:
            s.backward()
        opt.step()
        model.weight.grad.data.zero_()
    assert torch.equal(next(amp.master_params(opt)).grad, torch.ones(1, 3))


# --- accumulation in fp32 -----------------------------------------------------------------


def test_o2_accumulates_micro_batches_in_fp32_and_frees_the_16_bit_grads(monkeypatch):
    from ampkit.levels.grad_mirror import GradMirror

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2")
    weight = model[0].weight
    master = amp.levels.master_weights_of(opt).master_of(weight)
    # Each micro-batch's bf16 grad, computed aside (autograd.grad never accumulates).
    singles = [torch.autograd.grad(_loss(model, i) / 64, weight)[0] for i in range(64)]
    assert all(g.dtype == BF16 for g in singles)
    fp32_sum = singles[0].float()
    bf16_sum = singles[0].clone()
    for g in singles[1:]:
        fp32_sum = fp32_sum + g.float()
        bf16_sum = bf16_sum + g
    assert not torch.equal(bf16_sum.float(), fp32_sum)  # bf16 accumulation loses bits
    freed = []
    # Seen right after ampkit's hook moved the grad: the first micro-batch's grad is held
    # on the model (master_grads="on_demand": it is the whole gradient so far, and the
    # master has no fp32 grad yet); from the second backward on the sum runs in fp32 and
    # each 16-bit grad is gone as soon as it was accumulated. (A hook of the user's on the
    # parameter would be shown the 16-bit sum at once: tests/unit/levels/test_o2_user_hooks.py.)
    # (Each is taken in when its backward pass ends, with the pass's others: absorb_many.)
    absorb, absorb_many = GradMirror.absorb, GradMirror.absorb_many

    def spy(self, p, unscale, keep=False):
        held = absorb(self, p, unscale, keep)
        if p is weight:
            freed.append(p.grad is None)
        return held

    def spy_many(self, params, unscale, keep):
        held = absorb_many(self, params, unscale, keep)
        freed.extend(weight.grad is None for p in params if p is weight)
        return held

    monkeypatch.setattr(GradMirror, "absorb", spy)
    monkeypatch.setattr(GradMirror, "absorb_many", spy_many)
    for i in range(64):
        with amp.scale_loss(_loss(model, i) / 64, opt) as s:
            s.backward()
        if i == 0:
            assert amp.levels.master_weights_of(opt).is_placeholder(master)
            assert torch.equal(weight.grad, singles[0])
    assert freed == [False] + [True] * 63
    assert torch.equal(master.grad, fp32_sum)
    # Between backward passes the model shows the sum rounded once to bf16.
    assert torch.equal(weight.grad, fp32_sum.to(BF16))


def test_o2_step_runs_without_a_16_bit_grad_beside_the_fp32_one():
    """AdamW under O2 with master_grads="always": while the optimizer steps, the model
    holds no 16-bit grad (bf16 weight + fp32 master, grad and two moments: 18 bytes per
    parameter); before and after the step the model's params show the real grads."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", master_grads="always")
    at_step = []
    # a global optimizer hook runs inside the optimizer's own step, after ampkit's work
    handle = register_optimizer_step_pre_hook(
        lambda o, a, k: at_step.extend(p.grad for p in model.parameters() if p.dtype == BF16)
    )
    with amp.scale_loss(_loss(model, 0), opt) as s:
        s.backward()
    masters = amp.levels.master_weights_of(opt)
    shown = [(p, p.grad.clone()) for p in model.parameters() if p.dtype == BF16]
    try:
        opt.step()
    finally:
        handle.remove()
    assert at_step and all(g is None for g in at_step)
    for p, before in shown:  # read after step(), before zero_grad: the step's grads
        assert torch.equal(p.grad, before) and torch.equal(p.grad, masters.master_of(p).grad.to(BF16))


def test_o2_on_demand_step_runs_without_any_fp32_grad():
    """AdamW under O2 (master_grads="on_demand", the default): no master ever gets an
    fp32 grad; at the step the model holds the grads backward produced (bf16 weight and
    grad + fp32 master and two moments: 16 bytes per parameter, fp32 training's count),
    and after it still shows them; the masters moved as AdamW on fp32 grads moves them."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2")
    masters = amp.levels.master_weights_of(opt)
    pairs = [(p, masters._masters[id(p)]) for p in model.parameters() if p.dtype == BF16]
    at_step = []
    # a global optimizer hook runs inside the optimizer's own step, after ampkit's work
    handle = register_optimizer_step_pre_hook(lambda o, a, k: at_step.extend(m.grad for _, m in pairs))
    with amp.scale_loss(_loss(model, 0), opt) as s:
        s.backward()
    assert all(masters.is_placeholder(m) for _, m in pairs)  # zero-strided: no memory
    produced = [p.grad for p, _ in pairs]
    assert all(g is not None and g.dtype == BF16 for g in produced)
    reference = [(m.detach().clone(), p.grad.float()) for p, m in pairs]
    try:
        opt.step()
    finally:
        handle.remove()
    assert at_step and all(g is None for g in at_step)
    assert all(p.grad is g for (p, _), g in zip(pairs, produced))
    for (p, m), (start, grad) in zip(pairs, reference):
        q = torch.nn.Parameter(start.clone())
        q.grad = grad
        torch.optim.AdamW([q], lr=1e-3, foreach=False).step()
        assert masters.is_placeholder(m)
        torch.testing.assert_close(m.detach(), q.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), m.detach().to(BF16))  # written by the same pass


# --- what user code sees between backward and step ------------------------------------------


def _train_clipping(
    level: str | None, clip: str, dtype: torch.dtype = BF16, steps: int = 6, unscale: bool = False
):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    managed = level is not None
    if level == "init":
        amp.init(dtype=dtype, device_type="cpu")
        amp.init_trainer(opt)
    elif managed:
        model, opt = amp.initialize(model, opt, opt_level=level, dtype=dtype)
    norms = []
    for i in range(steps):
        opt.zero_grad()
        _backward(model, opt, i, managed)
        if unscale and managed:
            amp.unscale(opt)  # the README's order: unscale, then clip
        if clip == "norm":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)
            norms.append(float(torch.stack([p.grad.float().norm() for p in model.parameters()]).norm()))
        elif clip == "edit":
            model[0].weight.grad[0].zero_()  # e.g. a masked row
            model[3].bias.grad.mul_(0.0)
        opt.step()
    out = _stepped(model, opt, managed)
    amp.reset()
    return out, norms


@pytest.mark.parametrize("clip", ["norm", "value", "edit"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O2K", "init"])
def test_clipping_and_editing_model_grads_works_as_in_fp32(level, clip):
    """clip_grad_norm_(model.parameters()) and friends, unchanged from an fp32 script,
    with no amp.unscale: same norms as fp32 (to bf16 precision), same training."""
    ref, ref_norms = _train_clipping(None, clip)
    got, norms = _train_clipping(level, clip)
    assert norms == pytest.approx(ref_norms, rel=0.03)
    tol = {"O3": 0.06, "O2K": 0.03}.get(level, 0.02)
    assert _close(got, ref, tol), level


@pytest.mark.parametrize("level", ["O2", "O2K"])
def test_clipping_model_params_after_unscale_clips_what_the_step_uses(level):
    """After amp.unscale the model's params still show the grads (O2: they used to move
    into the masters, and clip_grad_norm_(model.parameters()) saw a norm of 0)."""
    ref, ref_norms = _train_clipping(None, "norm")
    got, norms = _train_clipping(level, "norm", unscale=True)
    assert norms == pytest.approx(ref_norms, rel=0.03)
    assert _close(got, ref, 0.03)


def test_quick_start_with_fp16_and_dynamic_scale_clips_real_grads():
    """The 3-line quick start on fp16 (dynamic scale 2**16): an unchanged
    clip_grad_norm_ sees the real norm."""
    ref, ref_norms = _train_clipping(None, "norm", steps=3)
    got, norms = _train_clipping("init", "norm", dtype=torch.float16, steps=3)
    assert norms == pytest.approx(ref_norms, rel=0.03)
    assert _close(got, ref, 0.02)


def _o2_after_one_backward(master_grads: str = "on_demand") -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", master_grads=master_grads)
    with amp.scale_loss(_loss(model, 0), opt) as s:
        s.backward()
    return model, opt


def test_o2_clip_rescales_the_fp32_master_grads_by_the_same_factor():
    model, opt = _o2_after_one_backward()
    masters = [p for p in amp.master_params(opt)]
    before = [p.grad.clone() for p in masters]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    amp.unscale(opt)  # merges the clip into the masters
    for b, m in zip(before, masters):
        # one fp32 factor per tensor (not a bf16 rounding of each element): the clip
        # coefficient clip_grad_norm_ applied to the bf16 copy
        ratio = m.grad[b != 0] / b[b != 0]
        assert (ratio.max() - ratio.min()).item() <= 1e-6 * ratio.abs().max().item()
        assert ratio.mean().item() == pytest.approx(0.01 / norm.item(), rel=0.01)


def test_o2_inf_written_into_a_model_grad_skips_the_step_bitwise():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic")
    for i in range(2):
        opt.zero_grad()
        with amp.scale_loss(_loss(model, i), opt) as s:
            s.backward()
        opt.step()
    before = [p.detach().clone() for p in amp.master_params(opt)]
    state = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    with amp.scale_loss(_loss(model, 5), opt) as s:
        s.backward()
    model[0].weight.grad[1, 2] = float("inf")
    opt.step()
    assert amp.step_skipped(opt)
    assert amp.stats(opt).scales == (2.0**15,)
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))
    assert str(opt.state_dict()) == str(state)


def test_o2_edits_through_both_sides_that_disagree_raise():
    """With fp32 grads made at backward (master_grads="always") an edit through the
    model and another through the masters since are two versions of one gradient."""
    model, opt = _o2_after_one_backward("always")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
    with pytest.raises(AmpError, match="both through the model"):
        opt.step()


def test_o2_on_demand_edits_through_the_model_then_the_masters_compose():
    """master_grads="on_demand": the held grad is the model's until master_params asks
    for the fp32 one, which is then derived from the edited grad; the second clip acts
    on the first one's result, as two clips of one fp32 gradient would."""
    model, opt = _o2_after_one_backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    clipped = [p.grad.float() for p in model.parameters() if p.dtype == BF16]
    masters = [m for m in amp.master_params(opt) if amp.levels.master_weights_of(opt).model_param_of(m) is not None]
    assert all(torch.equal(m.grad, c) for m, c in zip(masters, clipped))
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
    assert float(norm) <= 0.01 * (1 + 1e-2)  # already clipped: nothing more to do
    start = [m.detach().clone() for m in masters]
    opt.step()
    for m, s0, c in zip(masters, start, clipped):
        torch.testing.assert_close(m.detach(), s0 - 0.1 * c)


def test_autograd_grad_of_a_scaled_loss_stays_scaled_and_leaves_grads_alone():
    """As with torch.amp: torch.autograd.grad(scaled_loss, params) returns scaled grads
    (gradient penalties unscale them by hand) and accumulates nothing."""
    model = _model()
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=2.0**8)
    with amp.scale_loss(_loss(model, 0), opt) as s:
        (g,) = torch.autograd.grad(s, model[0].weight)
    assert model[0].weight.grad is None
    ref = torch.autograd.grad(_loss(model, 0), model[0].weight)[0]
    assert torch.allclose(g, ref * 2.0**8)


def test_o2_without_an_optimizer_refuses_to_train_but_runs_inference():
    model = _model()
    model = amp.initialize(model, None, opt_level="O2")[0]
    with torch.no_grad():
        assert model(torch.randn(2, 6)).dtype == torch.float32
    with pytest.raises(AmpError, match="without an optimizer"):
        _loss(model, 0).backward()


def test_o2_sparse_embedding_grads_move_into_fp32_masters():
    """nn.Embedding(sparse=True) under O2: the sparse bf16 grad moves into the master
    (coalesced and summed in fp32) and the model shows it as a sparse bf16 copy."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    ref = copy.deepcopy(emb)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    emb, opt = amp.initialize(emb, opt, opt_level="O2", loss_scale="dynamic")
    idx = torch.tensor([[1, 3, 3, 7]])
    with amp.scale_loss(emb(idx).float().pow(2).sum(), opt) as s:
        s.backward()
    ref(idx).pow(2).sum().backward()
    master = next(amp.master_params(opt))
    assert master.grad.is_sparse and master.grad.dtype == torch.float32
    assert emb.weight.grad.is_sparse and emb.weight.grad.dtype == BF16
    assert torch.allclose(master.grad.to_dense(), ref.weight.grad.to_dense(), rtol=1e-2, atol=1e-3)
    opt.step()
    assert not amp.step_skipped(opt)
    assert torch.allclose(master, ref.weight - 0.5 * ref.weight.grad.to_dense(), atol=1e-2)


# --- optimizer.zero_grad() shows on the model at once -------------------------------------


class _Boom(torch.autograd.Function):
    """Identity forward; its backward raises (an exception halfway through backward)."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


@pytest.mark.parametrize("level,overrides", [("O2", {}), ("O2", {"model_grads": "view"}), ("O2K", {}), ("O1", {})])
def test_optimizer_zero_grad_clears_the_model_grads_at_once(level, overrides):
    """Right after ``optimizer.zero_grad()`` the model's grads are None (zeros with
    ``set_to_none=False``), as under torch, not the last backward's until the next
    backward; after an exception inside backward too. The run's weights then equal a
    twin's that never saw the dropped batches, bit for bit."""

    def run(drops: bool) -> list[torch.Tensor]:
        m = _model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m, opt = amp.initialize(m, opt, opt_level=level, **overrides)
        dtype = m[0].weight.dtype
        for i in range(4):
            if drops:
                _backward(m, opt, i, True)
                assert any(p.grad is not None for p in m.parameters())
                opt.zero_grad(set_to_none=False)
                assert all(p.grad is None or not p.grad.any() for p in m.parameters())
                _backward(m, opt, i, True)
                opt.zero_grad()
                assert all(p.grad is None for p in m.parameters())
                x, _ = _batch(i)
                out = m[3](_Boom.apply(m[2](m[1](m[0](x.to(dtype))))))
                with pytest.raises(RuntimeError, match="boom"):
                    with amp.scale_loss(out.float().square().mean(), opt) as scaled:
                        scaled.backward()
                opt.zero_grad()
                assert all(p.grad is None for p in m.parameters())
            _backward(m, opt, i, True)
            assert all(p.grad is not None for p in m.parameters())
            opt.step()
            opt.zero_grad()
            assert all(p.grad is None for p in m.parameters())
        out = [p.detach().clone() for p in m.parameters()] + [p.detach().clone() for p in amp.master_params(opt)]
        amp.reset()
        return out

    twin, dropped = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(twin, dropped))


# --- inf/NaN written into a grad after backward, by any route -----------------------------


@pytest.mark.parametrize(
    "level,overrides",
    [("O1", {}), ("O2", {}), ("O2", {"model_grads": "view"}), ("O2", {"master_grads": "always"}), ("O2K", {}),
     ("O3", {})],
)
@pytest.mark.parametrize("route", ["index", "data", "data_mul_inf", "detach"])
@pytest.mark.parametrize("layer", [0, 2])  # a small weight (fused check) and one of 1.2M elements (read-only sum)
@pytest.mark.parametrize("bad_step", [0, 1])
def test_a_nonfinite_grad_written_after_backward_skips_the_step(level, overrides, route, layer, bad_step):
    """An inf/NaN put into a model grad between backward and step skips the step, with
    weights and masters bitwise unchanged, whether written through the tensor (version
    counter) or through ``.data`` (no version counter: at O2 the step reads the held
    16-bit grad, or the fp32 grad a view shares, as it is then)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 2048), nn.Tanh(), nn.Linear(2048, 600))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, **overrides)
    dtype = model[0].weight.dtype
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for step in range(2):
        if step == bad_step:  # before backward: master_params() would derive fp32 grads
            weights = [p.detach().clone() for p in model.parameters()]
            masters = [p.detach().clone() for p in amp.master_params(opt)]
        opt.zero_grad()
        with amp.scale_loss(model(x.to(dtype)).float().square().mean(), opt) as scaled:
            scaled.backward()
        if step == bad_step:
            g = model[layer].weight.grad
            if route == "index":
                g[3, 3] = float("nan")
            elif route == "data":
                g.data[3, 3] = float("nan")
            elif route == "data_mul_inf":
                g.data.mul_(float("inf"))
            else:
                g.detach()[3, 3] = float("-inf")
        opt.step()
        assert amp.step_skipped(opt) == (step == bad_step)
        if step == bad_step:
            break
    assert all(torch.equal(a, p.detach()) for a, p in zip(weights, model.parameters()))
    assert all(torch.equal(a, p.detach()) for a, p in zip(masters, amp.master_params(opt)))


@pytest.mark.parametrize(
    "level,overrides",
    [("O1", {}), ("O2", {}), ("O2", {"model_grads": "view"}), ("O2K", {}),
     ("O1", {"dtype": torch.float16}), ("O2", {"dtype": torch.float16})],
)
@pytest.mark.parametrize("where", ["loss0", "data0", "loss1", "data1"])
def test_a_nonfinite_micro_batch_of_an_accumulated_step_skips_it(level, overrides, where):
    """Two backward passes per step: a NaN loss, or a NaN written through ``.data`` into
    the grads after the first or the second, skips the step (weights finite and
    unchanged)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 2048), nn.Tanh(), nn.Linear(2048, 600))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, **overrides)
    dtype = model[0].weight.dtype
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    for micro in range(2):
        loss = model(x.to(dtype)).float().square().mean()
        if where == f"loss{micro}":
            loss = loss * float("nan")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if where == f"data{micro}":
            model[2].weight.grad.data[1, 1] = float("nan")
    opt.step()
    assert amp.step_skipped(opt)
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize(
    "level,overrides",
    [("O1", {}), ("O2", {}), ("O2", {"master_grads": "always"}), ("O2", {"model_grads": "view"}), ("O2K", {}),
     ("O3", {}), ("O1", {"dtype": torch.float16}), ("O2", {"dtype": torch.float16})],
)  # fmt: skip
@pytest.mark.parametrize("edit", ["index", "data", "master"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_nonfinite_edit_between_accumulated_backwards_skips_the_step(level, overrides, edit, bad):
    """A grad edited to inf or NaN between two backward passes of one step (by index, through
    ``.data``, or on the optimizer's param, O2's master): the second pass adds into it, and
    the step is skipped with the weights as they were. At O2 the take-in of the second
    pass vouched for the whole sum, its check covering only the part it added: an inf was
    stepped into the weights (a NaN was caught only because ``torch.equal(nan, nan)`` is
    False)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, **overrides)
    dtype = model[0].weight.dtype
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    for micro in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp16 on a CPU
            loss = model(x.to(dtype)).float().square().mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if micro == 0:
            with torch.no_grad():
                if edit == "index":
                    model[0].bias.grad[0] = bad
                elif edit == "data":
                    model[0].bias.grad.data[0] = bad
                else:  # the optimizer's own param: O2's master, else the model's
                    opt.param_groups[0]["params"][1].grad[0] = bad
    opt.step()
    assert amp.step_skipped(opt)
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize(
    "level,overrides",
    [("O1", {}), ("O2", {}), ("O2", {"master_grads": "always"}), ("O2", {"model_grads": "view"}), ("O2K", {}),
     ("O1", {"dtype": torch.float16}), ("O2", {"dtype": torch.float16})],
)  # fmt: skip
def test_a_skipped_steps_grads_kept_for_the_next_step_skip_it_too(level, overrides):
    """No ``zero_grad()`` after a step skipped for inf grads: the next backward adds into
    them, and that step is skipped too, the weights as they were. At O2 the check of the
    next backward's part vouched for the whole sum (the grad unchanged since a check that
    had found inf in it): the second step wrote inf into the weights."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, **overrides)
    x = torch.ones(2, 4, dtype=model.weight.dtype)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp16 on a CPU
            loss = model(x).float().sum() * (1e39 if step == 0 else 1.0)  # inf grads, no NaN
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()  # no zero_grad() between the steps
        assert amp.step_skipped(opt), step
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


_FP16_SETUPS = {
    "init": None,
    "O1": {},
    "O2": {},
    "O2-always": {"master_grads": "always"},
    "O3-SGD": {},
    "O1-fp8": {"fp8": "delayed"},
}

_BF16_SETUPS = {
    "init": None,
    "O1": {},
    "O2": {},
    "O2-always": {"master_grads": "always"},
    "O2-view": {"model_grads": "view"},
    "O2K": {},
    "O3": {},
}

_SOAK_OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
}


def _soak_run(setup: str, overrides: dict | None, dtype: torch.dtype, opt_name: str, route: str, layer: int) -> tuple:
    """The soak's loop: ``setup`` (``"init"``: amp.init + init_trainer; else the level
    before its first ``-``, with ``overrides``) in ``dtype``, two steps; after the second
    backward an inf/NaN is written into ``model[layer].weight.grad`` by ``route``. Asserts
    the second step alone is skipped, with weights and masters bitwise unchanged; returns
    the optimizer and its loss scale before the second step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 8))
    opt = _SOAK_OPTIMIZERS[opt_name](model.parameters())
    if overrides is None:
        amp.init(dtype=dtype)
        amp.init_trainer(opt)
    else:
        overrides = dict(overrides)
        if "fp8" in overrides:
            overrides["fp8"] = amp.Fp8Recipe(scaling=overrides["fp8"], min_features=16)
        model, opt = amp.initialize(model, opt, opt_level=setup.split("-")[0], dtype=dtype, **overrides)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(model[0].weight.dtype)
    for step in range(2):
        if step == 1:
            weights = [p.detach().clone() for p in model.parameters()]
            masters = [p.detach().clone() for p in amp.master_params(opt)]
            scale = amp.stats(opt).scales[0]
        opt.zero_grad()
        with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
            scaled.backward()
        if step == 1:
            g = model[layer].weight.grad
            if route == "data":
                g.data[0] = float("nan")
            elif route == "data_div_0":
                g.data.div_(0)
            elif route == "index":
                g[0] = float("inf")
            else:  # after_unscale_data
                amp.unscale(opt)
                g.data[0] = float("inf")
        opt.step()
        assert amp.step_skipped(opt) == (step == 1), (setup, route, opt_name, step)
    assert all(torch.equal(a, p.detach()) for a, p in zip(weights, model.parameters()))
    assert all(torch.equal(a, p.detach()) for a, p in zip(masters, amp.master_params(opt)))
    return opt, scale


@pytest.mark.parametrize(
    "setup,opt_name",
    # O3 in fp16 with an Adam-like optimizer is refused at initialize (its eps)
    [(s, o) for s in _FP16_SETUPS for o in _SOAK_OPTIMIZERS if s != "O3-SGD" or o == "SGD"],
)
@pytest.mark.parametrize("route", ["data", "data_div_0", "index", "after_unscale_data"])
@pytest.mark.parametrize("layer", ["linear", "norm"])  # at O2 the norm is kept fp32, stepped as it is
def test_fp16_dynamic_scale_skips_a_nonfinite_grad_written_after_backward(setup, route, layer, opt_name):
    """fp16 with a dynamic loss scale (CUDA's default): the end of backward unscales the
    grads, and an inf/NaN written into one afterwards -- through ``.data``, which no
    version counter sees, or by indexing, or through ``.data`` after ``ampkit.unscale``
    -- skips the step: weights (and masters) bitwise unchanged, the scale backed off
    (kept after ``unscale``: that edit is no overflow of the loss scale)."""
    opt, scale = _soak_run(setup, _FP16_SETUPS[setup], torch.float16, opt_name, route, 0 if layer == "linear" else 1)
    # an edit after ampkit.unscale blames no loss scaler (the unscaled grads were finite);
    # O3's scale is static (1.0, as apex's)
    backs_off = route != "after_unscale_data" and setup != "O3-SGD"
    assert (amp.stats(opt).scales[0] < scale) if backs_off else (amp.stats(opt).scales[0] == scale)


@pytest.mark.parametrize("opt_name", list(_SOAK_OPTIMIZERS))
@pytest.mark.parametrize("setup", list(_BF16_SETUPS))
@pytest.mark.parametrize("route", ["data", "data_div_0", "index"])
def test_bf16_skips_a_nonfinite_grad_written_after_backward_with_every_optimizer(setup, route, opt_name):
    """The bf16 half of the soak: every level x AdamW/Adam/SGD, an inf/NaN written into
    a grad after backward (through ``.data`` or by indexing) skips the step, weights and
    masters bitwise unchanged."""
    _soak_run(setup, _BF16_SETUPS[setup], BF16, opt_name, route, 0)
