"""fp8 training (``amp.initialize(..., fp8=amp.Fp8Recipe(...))``): exactness of the fp8
linear against a dequantized fp32 reference, the layer choice, delayed scaling that
adapts, overflow that saturates or is detected, bitwise resume, explain/doctor output,
and an LM that trains as well as bf16."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp
from ampkit.errors import AmpError, PolicyError, StateError
from ampkit.levels import fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALL = amp.Fp8Recipe(module_filter=lambda name, m: True)


def _q(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference quantization: scale, clamp to the format's largest value, cast."""
    m = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-m, m).to(dtype)


def _unit(scale: torch.Tensor) -> torch.Tensor:
    """A scale with unit strides (a transposed ``(N, 1)`` row-wise scale), as ``_scaled_mm`` checks."""
    return scale.flatten().view(scale.shape)


def _ref_mm(a: torch.Tensor, sa: torch.Tensor, adt: torch.dtype, b: torch.Tensor, sb: torch.Tensor,
            bdt: torch.dtype) -> torch.Tensor:
    """``a @ b`` in fp32 from fp8 operands quantized here (``sa`` per tensor or per row of
    ``a``, ``sb`` per tensor or per column of ``b``): ``torch._scaled_mm``'s result on them.

    The GEMM is torch's: its accumulation order, and whether it applies ``1/scale``
    before or after summing, depend on the CPU (on AVX-512 CPUs torch runs oneDNN's fp8
    kernel, under ``ATEN_CPU_CAPABILITY=avx2`` it dequantizes and multiplies in fp32), so
    a bitwise reference computes it with the same kernel; what it is checked against is
    the dequantized fp32 product, within fp32 GEMM rounding (``|err| <= 2 k eps |a||b|``)."""
    qa, qb = _q(a, sa, adt), _q(b, sb, bdt)
    ia, ib = sa.reciprocal(), sb.reciprocal()
    da, db = qa.float() * ia, qb.float() * ib
    try:
        y = torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(), scale_a=_unit(ia), scale_b=_unit(ib),
                             out_dtype=torch.float32)
    except RuntimeError as e:  # torch before 2.12 has per-tensor scales only on CPU
        if "per-tensor scaling" not in str(e) or a.device.type != "cpu":
            raise
        return da @ db
    bound = 2 * a.shape[1] * torch.finfo(torch.float32).eps * (da.abs() @ db.abs())
    assert ((y - da @ db).abs() <= bound).all()
    return y


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, gy: torch.Tensor, rowwise: bool,
               gdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, grad_x, grad_w)`` of a linear in fp32 from fp8 operands (:func:`_ref_mm`), each
    scaled by ``fp8_max / abs-max`` derived here: per tensor, or (rowwise) per row of
    each matmul operand (``dim`` is the axis the abs-max runs over)."""

    def scale(t: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        amax = t.abs().amax(dim=dim, keepdim=True) if rowwise else t.abs().max()
        return torch.tensor(torch.finfo(dtype).max) / amax

    y = _ref_mm(x, scale(x, 1, E4M3), E4M3, w.t(), scale(w, 1, E4M3).t(), E4M3) + b
    gx = _ref_mm(gy, scale(gy, 1, gdt), gdt, w, scale(w, 0, E4M3), E4M3)
    gw = _ref_mm(gy.t(), scale(gy, 0, gdt).t(), gdt, x, scale(x, 0, E4M3), E4M3)
    return y, gx, gw


def _state(name: str = "") -> dict[str, dict[str, Any]]:
    """The scale state of fp8 layer ``name`` per role (input, weight, grad_output), as users
    read it: ``amp.state_dict()``'s fp8 entry (0-d fp32 ``scale`` and ``amax``, the fp32
    ``amax_history``, the int64 count ``saturated``, ``calls``)."""
    return amp.state_dict()["extra"]["fp8"]["layers"][name]


def _one_linear(recipe: amp.Fp8Recipe, in_f: int = 32, out_f: int = 48, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f)
    lin, _ = amp.initialize(lin, None, opt_level="O1", op_casting=False, fp8=recipe)
    assert type(lin) is fp8.Float8Linear
    return lin


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_tensorwise_forward_backward_equal_dequantized_fp32_reference(fmt):
    lin = _one_linear(amp.Fp8Recipe(format=fmt, module_filter=lambda n, m: True))
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 8, 32, generator=g) * 5).requires_grad_()
    gy = torch.randn(2, 8, 48, generator=g) * 1e-3
    y = lin(x)
    y.backward(gy)
    assert y.dtype == torch.float32 and x.grad.dtype == torch.float32

    # the scales the layer used, derived here independently: fp8_max / abs-max
    gdt = E5M2 if fmt == "hybrid" else E4M3
    sx = torch.tensor(448.0) / x.detach().abs().max()
    sw = torch.tensor(448.0) / lin.weight.detach().abs().max()
    sg = torch.tensor(torch.finfo(gdt).max) / gy.abs().max()
    st = _state()
    assert torch.equal(st["input"]["scale"], sx) and torch.equal(st["weight"]["scale"], sw)
    assert torch.equal(st["grad_output"]["scale"], sg)

    ry, rgx, rgw = _reference(x.detach().reshape(-1, 32), lin.weight.detach(), lin.bias.detach(),
                              gy.reshape(-1, 48), rowwise=False, gdt=gdt)
    assert torch.equal(y, ry.reshape(2, 8, 48))
    assert torch.equal(x.grad, rgx.reshape(2, 8, 32))
    assert torch.equal(lin.weight.grad, rgw)
    assert torch.equal(lin.bias.grad, gy.sum((0, 1)))
    # and the fp8 result is an approximation of fp32, not something else
    ref = F.linear(x.detach(), lin.weight.detach(), lin.bias.detach())
    assert (y - ref).abs().max() < 0.1 * ref.abs().max()


def test_rowwise_forward_backward_equal_dequantized_fp32_reference():
    lin = _one_linear(amp.Fp8Recipe(format="e4m3", granularity="rowwise", module_filter=lambda n, m: True))
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(16, 32, generator=g) * torch.logspace(-2, 2, 16).unsqueeze(1)).requires_grad_()
    gy = torch.randn(16, 48, generator=g)
    y = lin(x)
    y.backward(gy)
    w = lin.weight.detach()
    ry, rgx, rgw = _reference(x.detach(), w, lin.bias.detach(), gy, rowwise=True, gdt=E4M3)
    assert torch.equal(y, ry) and torch.equal(x.grad, rgx) and torch.equal(lin.weight.grad, rgw)
    # per-row scales keep the small rows accurate, unlike one scale for all
    ref = x.detach() @ w.t()
    assert ((y - lin.bias.detach() - ref)[0].abs().max() / ref[0].abs().max()) < 0.1


def test_delayed_scaling_uses_the_previous_calls_history_exactly():
    lin = _one_linear(amp.Fp8Recipe(scaling="delayed", amax_history_len=3, module_filter=lambda n, m: True))
    amaxes = []
    for step, mult in enumerate([1.0, 4.0, 2.0, 0.5, 0.25]):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step)) * mult
        used = _state()["input"]["scale"] if step else torch.tensor(448.0) / x.abs().max()  # first call: current scaling
        y = lin(x)
        st = _state()["input"]
        # the output is exactly the dequantized matmul with the scale fixed before this call
        wscale = _state()["weight"]["scale"] if step else torch.tensor(448.0) / lin.weight.detach().abs().max()
        ref = _ref_mm(x, used, E4M3, lin.weight.detach().t(), wscale, E4M3)
        assert torch.equal(y, ref + lin.bias.detach())
        amaxes.append(float(x.abs().max()))
        hist = amaxes[::-1][:3]
        assert st["amax_history"].tolist() == pytest.approx(hist + [0.0] * (3 - len(hist)), rel=0, abs=0)
        assert torch.equal(st["scale"], torch.tensor(448.0) / torch.tensor(max(hist)))


def test_most_recent_amax_and_margin_and_power_of_2():
    rec = amp.Fp8Recipe(scaling="delayed", amax_compute_algo="most_recent", margin=1, power_of_2_scales=True,
                        module_filter=lambda n, m: True)
    lin = _one_linear(rec)
    for mult in (8.0, 1.0):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)) * mult
        lin(x)
        expect = 448.0 / float(x.abs().max()) / 2
        assert float(_state()["input"]["scale"]) == 2.0 ** torch.floor(torch.log2(torch.tensor(expect))).item()


def test_delayed_scaling_adapts_when_activations_grow_100x_mid_run():
    """Training with delayed scaling: the activations entering the fp8 layer jump 100x at
    step 6. That one step saturates (finite values clamped, counted, no inf/NaN), the
    scale is 100x smaller from the next step on, and the loss follows an fp32 run of
    the same loop."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))
    ref_model = copy.deepcopy(base)
    # margin=1: 2x headroom, so batch-to-batch fluctuation does not saturate
    rec = amp.Fp8Recipe(scaling="delayed", amax_history_len=4, margin=1, min_features=16)
    model, opt = amp.initialize(base, torch.optim.SGD(base.parameters(), lr=0.01), opt_level="O1", op_casting=False, fp8=rec)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.01)
    assert [type(m) for m in model] == [nn.Linear, fp8.Float8Linear, nn.Tanh, fp8.Float8Linear, nn.Tanh, nn.Linear]
    g = torch.Generator().manual_seed(3)
    scales, sat, losses, ref_losses = [], [], [], []
    for step in range(10):
        x, t = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        x = x * (100.0 if step >= 6 else 1.0)
        loss = F.mse_loss(model(x), t)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = F.mse_loss(ref_model(x), t)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.isfinite(loss) and not amp.step_skipped(opt)
        st = _state("1")["input"]
        scales.append(float(st["scale"]))
        sat.append(int(st["saturated"]))
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    assert sat == [0] * 6 + [1] * 4  # the jump saturates once, then the scale has followed
    assert 50 < scales[5] / scales[7] < 200
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        if step != 6:
            assert abs(a - b) <= 0.05 * abs(b), (step, a, b)


def test_delayed_input_scale_follows_a_100x_jump_and_saturates_once():
    lin = _one_linear(amp.Fp8Recipe(scaling="delayed", amax_history_len=4, margin=1, module_filter=lambda n, m: True))
    g = torch.Generator().manual_seed(0)
    errs = []
    for step in range(8):
        x = torch.randn(16, 32, generator=g) * (100.0 if step >= 4 else 1.0)
        y = lin(x)
        ref = F.linear(x, lin.weight.detach(), lin.bias.detach())
        assert torch.isfinite(y).all()  # never inf/NaN: the stale scale clamps
        errs.append(float((y.detach() - ref).abs().max() / ref.abs().max()))
        st = _state()["input"]
        if step == 4:
            assert int(st["saturated"]) == 1  # the jump: values clamped to +-448, counted
            assert float(st["scale"]) == pytest.approx(224.0 / float(x.abs().max()))  # already adapted
    assert int(st["saturated"]) == 1
    assert errs[4] > 0.5  # the saturated call is badly off ...
    assert max(errs[5:]) < 0.1 and max(errs[:4]) < 0.1  # ... and the next ones are accurate again


def test_nonfinite_input_is_detected_not_clamped_and_stays_out_of_the_history():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                                op_casting=False, fp8=amp.Fp8Recipe(scaling="delayed", min_features=16))
    x = torch.randn(8, 32)
    with amp.scale_loss(model(x).pow(2).mean(), opt) as s:
        s.backward()
    opt.step()
    before = {r: (s["amax_history"], s["scale"]) for r, s in _state("1").items()}
    w0 = [p.detach().clone() for p in model.parameters()]
    bad = x.clone()
    bad[0, 0] = float("inf")
    out = model(bad)
    assert not torch.isfinite(out).all()  # an inf is not silently turned into 448
    with amp.scale_loss(out.pow(2).mean(), opt) as s:
        s.backward()
    opt.step()
    assert amp.step_skipped(opt)
    assert all(torch.equal(a, p) for a, p in zip(w0, model.parameters()))
    st = _state("1")
    for role in ("input",):
        assert torch.equal(st[role]["amax_history"], before[role][0]) and torch.equal(st[role]["scale"], before[role][1])
    # e5m2 has an inf; a huge finite gradient still saturates to e5m2's max, never inf
    q = fp8.saturate(torch.tensor([1e30, -1e30, 1.0]), torch.tensor(1.0), E5M2)
    assert q.float().tolist() == [57344.0, -57344.0, 1.0]


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_activation_checkpointing_and_no_grad_evaluation(scaling):
    """A checkpointed block recomputes its forward inside backward with the scales the
    first pass used (gradients and scale state bitwise equal to the run without
    checkpointing); evaluation under no_grad leaves the scale state alone."""
    from torch.utils.checkpoint import checkpoint

    rec = amp.Fp8Recipe(scaling=scaling, amax_history_len=4, min_features=16)

    def run(ckpt: bool) -> tuple[list[torch.Tensor], dict]:
        model = _lm_like()
        model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                                    op_casting=False, fp8=rec)
        g = torch.Generator().manual_seed(0)
        grads = []
        for _ in range(3):
            x = torch.randn(8, 32, generator=g)
            h = model[0](x)
            mid = checkpoint(model[1:5], h, use_reentrant=False) if ckpt else model[1:5](h)
            loss = model[5:](mid).pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            grads += [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # an evaluation between steps
                before = amp.state_dict()["extra"]["fp8"]
                model(torch.randn(8, 32, generator=g) * 50)
                after = amp.state_dict()["extra"]["fp8"]
            assert all(torch.equal(before["layers"][n][r][k], after["layers"][n][r][k])
                       for n in before["layers"] for r in before["layers"][n] for k in ("scale", "amax_history", "amax"))
        return grads, amp.state_dict()["extra"]["fp8"]

    plain, plain_state = run(False)
    ckpt, ckpt_state = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, ckpt))
    for name, roles in plain_state["layers"].items():
        for role, st in roles.items():
            assert st["calls"] == ckpt_state["layers"][name][role]["calls"] == 3
            assert torch.equal(st["amax_history"], ckpt_state["layers"][name][role]["amax_history"])
            assert torch.equal(st["scale"], ckpt_state["layers"][name][role]["scale"])


def test_layer_choice_default_filter_exclude_and_refusals():
    class Sub(nn.Linear):
        pass

    model = nn.Sequential(
        nn.Linear(2048, 2048), nn.Linear(2048, 1024), nn.Linear(1024, 512), Sub(1024, 1024),
        nn.Linear(1024, 1000), nn.Linear(1024, 1024), nn.Linear(1024, 16),
    )
    names = [n for n, _ in amp.Fp8Recipe().choose(model)]
    # first and last skipped, 512 below min_features, the subclass and 1000 (not /16) skipped
    assert names == ["1", "5"]
    assert [n for n, _ in amp.Fp8Recipe(exclude=("5",)).choose(model)] == ["1"]
    assert [n for n, _ in amp.Fp8Recipe(skip_first_last=False, min_features=16).choose(model)] == ["0", "1", "2", "5", "6"]
    assert [n for n, _ in amp.Fp8Recipe(module_filter=lambda n, m: n == "6").choose(model)] == ["6"]

    with pytest.raises(PolicyError, match="rowwise"):
        amp.Fp8Recipe(granularity="rowwise", scaling="delayed", format="e4m3")
    with pytest.raises(PolicyError, match="e4m3"):
        amp.Fp8Recipe(granularity="rowwise")
    with pytest.raises(PolicyError, match="amax_history_len"):
        amp.Fp8Recipe(amax_history_len=0)
    small = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    opt = torch.optim.SGD(small.parameters(), lr=0.1)
    with pytest.raises(AmpError, match="O0"):
        amp.initialize(small, opt, opt_level="O0", fp8=True)
    with pytest.raises(AmpError, match="Fp8Recipe"):
        amp.initialize(small, opt, opt_level="O1", fp8="yes")
    assert all(type(m) is nn.Linear for m in small)  # refused calls changed nothing
    with pytest.warns(UserWarning, match="chose no nn.Linear"):
        amp.initialize(small, opt, opt_level="O1", fp8=True)


@pytest.mark.parametrize("margin", [7, 20, 200, 10**6, -1, 1.5, True, "2"])
def test_recipe_refuses_a_margin_whose_scales_fp32_cannot_represent(margin):
    with pytest.raises(PolicyError, match=r"margin must be an int in \[0, 6\].*normal fp32"):
        amp.Fp8Recipe(margin=margin)


def test_the_margin_bound_is_derived_from_the_formats_and_is_tight():
    """``MAX_MARGIN`` is the largest margin whose scale of fp32's largest abs-max is a
    normal fp32 number (e4m3, the tighter format); one more and it is not. At the bound a
    layer fed values up to fp32's largest computes finite outputs equal to the reference."""
    tiny, big = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    for dt, bound in ((E4M3, 6), (E5M2, 13)):
        assert fp8.max_margin(dt) == bound
        assert torch.finfo(dt).max / big / 2.0**bound >= tiny > torch.finfo(dt).max / big / 2.0 ** (bound + 1)
    assert fp8.MAX_MARGIN == 6
    with pytest.warns(UserWarning, match="binades"):
        rec = amp.Fp8Recipe(margin=fp8.MAX_MARGIN, module_filter=lambda n, m: True)
    scale = fp8.scale_from_amax(torch.tensor(big), E4M3, rec)
    assert scale.dtype == torch.float32 and scale >= tiny and torch.isfinite(scale.reciprocal())
    lin = _one_linear(rec)
    x = torch.randn(16, 32)
    x[0, 0] = big / 64  # the product with weights stays finite; the abs-max is huge
    with torch.no_grad():
        y = lin(x)
    assert torch.isfinite(y).all()
    s = torch.tensor(torch.finfo(E4M3).max) / x.abs().max() / 2.0**fp8.MAX_MARGIN
    sw = torch.tensor(torch.finfo(E4M3).max) / lin.weight.abs().max() / 2.0**fp8.MAX_MARGIN
    assert torch.equal(y, _ref_mm(x, s, E4M3, lin.weight.detach().t(), sw, E4M3) + lin.bias.detach())


def test_a_margin_that_costs_accuracy_warns_once():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m in range(fp8.WARN_MARGIN):
            amp.Fp8Recipe(margin=m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = amp.Fp8Recipe(margin=fp8.WARN_MARGIN)
        amp.Fp8Recipe(margin=fp8.WARN_MARGIN, scaling="delayed")
        _one_linear(dataclasses.replace(rec, module_filter=lambda n, m: True))  # rebuilds the recipe
    msgs = [str(w.message) for w in caught if "margin" in str(w.message)]
    assert len(msgs) == 1 and "margin=4" in msgs[0] and "binades" in msgs[0]


@pytest.mark.parametrize("length", [0, 1025, 10**8, True, 4.0])
def test_recipe_refuses_an_amax_history_len_out_of_range(length):
    with pytest.raises(PolicyError, match=r"amax_history_len must be an int in \[1, 1024\]"):
        amp.Fp8Recipe(scaling="delayed", amax_history_len=length)


def test_the_longest_history_allowed_is_kept_in_full():
    lin = _one_linear(amp.Fp8Recipe(scaling="delayed", amax_history_len=fp8.MAX_AMAX_HISTORY_LEN,
                                    module_filter=lambda n, m: True))
    lin(torch.randn(4, 32)).sum().backward()
    for role in fp8.ROLES:
        history = _state()[role]["amax_history"]
        assert history.shape == (1024,) and history.dtype == torch.float32 and history[0] > 0


@pytest.mark.parametrize("field, value, match", [
    ("format", "e5m2", "format must be one of"),
    ("scaling", None, "scaling must be one of"),
    ("granularity", ["rowwise"], "granularity must be one of"),
    ("amax_compute_algo", "mean", "amax_compute_algo must be one of"),
    ("min_features", -1, r"min_features must be an int >= 0"),
    ("min_features", "16", r"min_features must be an int >= 0"),
    ("power_of_2_scales", 1, "True or False"),
    ("skip_first_last", "no", "True or False"),
    ("reduce_amax", None, "True or False"),
    ("module_filter", "*.fc", "callable"),
    ("exclude", 5, "tuple of name globs"),
    ("exclude", "*.fc", "tuple of name globs"),
    ("exclude", ("*.fc", 3), "tuple of name globs"),
])
def test_every_recipe_field_is_checked_at_construction(field, value, match):
    with pytest.raises(PolicyError, match=match):
        amp.Fp8Recipe(**{field: value})


def test_an_exclude_list_is_kept_as_a_tuple():
    rec = amp.Fp8Recipe(exclude=["*.fc", "0"])
    assert rec.exclude == ("*.fc", "0") and hash(rec) == hash(amp.Fp8Recipe(exclude=("*.fc", "0")))


def test_conversion_keeps_identity_and_state_dict_and_reset_reverts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 8))
    keys = list(model.state_dict())
    layer, weight = model[2], model[2].weight
    attrs = set(vars(layer))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                fp8=amp.Fp8Recipe(module_filter=lambda name, m: name == "2"))
    assert model[2] is layer and type(layer) is fp8.Float8Linear and layer.weight is weight
    assert layer.weight.dtype == torch.bfloat16  # O2 cast the model; masters stay fp32
    assert all(p.dtype == torch.float32 for p in amp.master_params(opt))
    assert list(model.state_dict()) == keys
    assert "fp8=hybrid current" in repr(model)
    pickle.loads(pickle.dumps(model))  # whole-model torch.save works
    moved = copy.deepcopy(model).to("meta")  # a layer away from its scale state says so
    with pytest.raises(AmpError, match="DataParallel"):
        moved[2](torch.randn(4, 32, device="meta", dtype=torch.bfloat16))
    out = model(torch.randn(4, 32))
    assert out.dtype == torch.float32  # O2's output cast
    assert [i.name for i in fp8.layers()] == ["2"]
    amp.reset()
    assert type(layer) is nn.Linear and set(vars(layer)) == attrs and fp8.layers() == []  # as it was

    # a linear the level keeps fp32 (keep_fp32) stays out of fp8
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                keep_fp32=["2"], fp8=amp.Fp8Recipe(min_features=16))
    assert [i.name for i in fp8.layers()] == ["1"] and model[2].weight.dtype == torch.float32



def test_copies_of_a_converted_model_have_their_own_scale_state_and_reset_reverts_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 8))
    attrs = set(vars(model[2]))
    model, _ = amp.initialize(model, None, opt_level="O1", op_casting=False,
                              fp8=amp.Fp8Recipe(scaling="delayed", module_filter=lambda name, m: name == "2"))
    copied = copy.deepcopy(model)
    unpickled = pickle.loads(pickle.dumps(model))
    x = torch.randn(4, 32)
    with torch.no_grad():
        ref = model(x)
    for other in (copied, unpickled):
        assert type(other[2]) is fp8.Float8Linear
        with torch.no_grad():
            assert torch.equal(other(x), ref)  # same weights, same (copied) scales
    # A training call of a copy advances that copy's scale state only -- compiled, where
    # the op finds the state by the copy's own handle, as in eager: its next call uses the
    # delayed scale of x * k, while the session's layer (the only one reports list) has
    # seen no call and computes as before.
    for k, other in ((4.0, copied), (0.25, unpickled)):
        torch.compile(other, backend="aot_eager")(x * k).sum().backward()
        assert [i.calls for i in fp8.layers()] == [0]
        with torch.no_grad():
            assert torch.equal(model(x), ref) and not torch.equal(other(x), ref)
    with torch.no_grad():
        assert not torch.equal(copied(x), unpickled(x))  # each copy its own state
    amp.reset()
    for m in (model, copied, unpickled):
        assert type(m[2]) is nn.Linear and set(vars(m[2])) == attrs  # as before initialize
        with torch.no_grad():
            h = F.relu(F.linear(x, m[0].weight, m[0].bias))
            plain = F.linear(F.linear(h, m[2].weight, m[2].bias), m[3].weight, m[3].bias)
            assert torch.equal(m(x), plain) and not torch.equal(m(x), ref)  # fp32 again, not fp8


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, t = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        loss = F.mse_loss(model(x).float(), t)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _lm_like(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 8))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_resume_is_bitwise(level, tmp_path):
    rec = amp.Fp8Recipe(scaling="delayed", amax_history_len=4, min_features=16)

    def setup():
        model = _lm_like()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        return amp.initialize(model, opt, opt_level=level, op_casting=False, fp8=rec) if level == "O1" else \
            amp.initialize(model, opt, opt_level=level, fp8=rec)

    model, opt = setup()
    _train(model, opt, 3, seed=0)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, tmp_path / "ck.pt")
    saved_fp8 = amp.state_dict()["extra"]["fp8"]
    assert set(saved_fp8["layers"]) == {"2", "4"}
    assert saved_fp8["layers"]["2"]["input"]["amax_history"].shape == (4,)
    after = _train(model, opt, 3, seed=1)
    final = [p.detach().clone() for p in model.parameters()]

    model2, opt2 = setup()
    ck = torch.load(tmp_path / "ck.pt", weights_only=False)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    amp.load_state_dict(ck["amp"])
    assert _train(model2, opt2, 3, seed=1) == after
    assert all(torch.equal(a, b) for a, b in zip(final, model2.parameters()))

    # a checkpoint of another recipe is refused whole, nothing loaded
    model3 = _lm_like()
    opt3 = torch.optim.Adam(model3.parameters(), lr=1e-3)
    amp.initialize(model3, opt3, opt_level=level, fp8=amp.Fp8Recipe(scaling="delayed", amax_history_len=8, min_features=16))
    before = amp.state_dict()
    with pytest.raises(StateError, match="recipe"):
        amp.load_state_dict(ck["amp"])
    broken = copy.deepcopy(before)
    broken["extra"]["fp8"]["layers"]["4"]["weight"]["scale"] = 1.0
    with pytest.raises(StateError, match="0-d tensor"):
        amp.load_state_dict(broken)
    assert torch.equal(amp.state_dict()["extra"]["fp8"]["layers"]["2"]["input"]["amax_history"],
                       before["extra"]["fp8"]["layers"]["2"]["input"]["amax_history"])


def test_explain_and_doctor_show_fp8_matmuls_and_scales():
    model = _lm_like()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), opt_level="O1",
                                fp8=amp.Fp8Recipe(scaling="delayed", min_features=16))
    x = torch.randn(4, 32)
    model(x)  # one call fixes the delayed scales
    hist = _state("2")["input"]["amax_history"]
    rep = amp.explain(model, x)
    st = _state("2")["input"]
    assert torch.equal(st["amax_history"], hist)  # explaining does not advance the history
    assert [(r.module, r.matmul) for r in rep.fp8] == [("2", "forward"), ("4", "forward")]
    r0 = rep.fp8[0]
    assert (r0.a_dtype, r0.b_dtype, r0.out_dtype) == (E4M3, E4M3, torch.bfloat16)
    assert r0.a_scale[0] == pytest.approx(1 / float(st["scale"]))
    assert rep.totals["matmuls_fp8"] == 2
    assert [r.op for r in rep.records].count("_scaled_mm") == 2
    assert "fp8 matmuls" in str(rep) and "2 forward: e4m3 x e4m3 -> bf16" in str(rep)
    # the backward's matmuls: e5m2 gradients
    with fp8.observe() as recs:
        model(x).float().sum().backward()
    assert {(r.module, r.matmul, r.a_dtype) for r in recs} >= {("2", "grad_input", E5M2), ("2", "grad_weight", E5M2)}

    with amp.doctor(opt) as doc:
        _train(model, opt, 2, seed=0)
    report = doc.report()
    assert [layer.name for layer in report.fp8] == ["2", "4"]
    assert report.fp8[0].scales["input"] == float(_state("2")["input"]["scale"]) and report.fp8[0].calls >= 3
    assert "fp8 matmuls" in str(report) and "grad_output scale" in str(report)
    assert report.to_dict()["fp8"][0]["name"] == "2"


@pytest.mark.slow  # a fresh interpreter: a few seconds
def test_fp8_training_needs_torch_alone():
    """Neither ``import ampkit`` nor an fp8 training step imports torchao (the extra)."""
    import subprocess
    import sys

    code = (
        "import sys, torch, ampkit as amp\n"
        "m = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])\n"
        "m, o = amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), fp8=amp.Fp8Recipe(min_features=16))\n"
        "m(torch.randn(4, 16)).float().sum().backward()\n"
        "assert len(amp.fp8.layers()) == 1 and 'torchao' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.fresh_process  # torchao's Float8Linear: another test's leftovers in this process broke it
def test_matches_torchao_float8_tensorwise():
    """torchao's Float8Linear (dynamic tensorwise, e4m3 forward, e5m2 grads) computes the
    same recipe: outputs and gradients agree to fp32 rounding of the scale."""
    ao = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 48))
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao.convert_to_float8_training(ref, module_filter_fn=lambda m, fqn: True)
    model, _ = amp.initialize(model, None, opt_level="O1", op_casting=False, fp8=ALL)
    x = torch.randn(8, 32) * 3
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1), model(x2)
    gy = torch.randn_like(y1)
    y1.backward(gy)
    y2.backward(gy)
    from torchao.float8.float8_utils import tensor_to_scale

    ours = _state("0")
    assert torch.equal(ours["input"]["scale"], tensor_to_scale(x, E4M3).float())  # bitwise the same scales
    assert torch.equal(ours["weight"]["scale"], tensor_to_scale(model[0].weight.detach(), E4M3).float())
    torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_cuda_fp8_linear_matches_dequantized_reference(granularity):
    """On a GPU the kernels are cuBLAS/CUTLASS: same scales, same fp8 operands; results
    agree with the dequantized fp32 reference to accumulation order (and bf16 rounding of
    row-wise outputs). 24 tokens: the grad-weight GEMM's inner size is padded to 16s."""
    fmt = "e4m3" if granularity == "rowwise" else "hybrid"
    torch.manual_seed(0)
    lin = nn.Linear(64, 48).cuda()
    lin, _ = amp.initialize(lin, None, opt_level="O1", op_casting=False,
                            fp8=amp.Fp8Recipe(format=fmt, granularity=granularity, module_filter=lambda n, m: True))
    x = torch.randn(24, 64, device="cuda", requires_grad=True)
    y = lin(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    ry, rgx, rgw = _reference(x.detach().cpu(), lin.weight.detach().cpu(), lin.bias.detach().cpu(), gy.cpu(),
                              rowwise=granularity == "rowwise", gdt=E4M3 if fmt == "e4m3" else E5M2)
    # row-wise GEMMs hand back bf16 (rounded by up to half a bf16 ulp, 2**-8 relative)
    rtol = 2.0**-7 if granularity == "rowwise" else 1e-3
    torch.testing.assert_close(y.detach().cpu(), ry, rtol=rtol, atol=1e-3)
    torch.testing.assert_close(x.grad.cpu(), rgx, rtol=rtol, atol=1e-3)
    torch.testing.assert_close(lin.weight.grad.cpu(), rgw, rtol=rtol, atol=1e-3)


@pytest.mark.slow
def test_char_lm_trains_under_fp8_within_2_percent_of_bf16():
    """The bench's character LM on the stdlib text, tiny: O1 bf16 against O1 + fp8
    (the blocks' linears in fp8, embeddings/head/attention matmuls in bf16)."""
    from ampkit.tools.bench.data import load_stdlib_text, text_batches
    from ampkit.tools.bench.workloads import CharTransformer

    data = load_stdlib_text(max_chars=60_000)
    vocab = int(data.train.max()) + 1

    def run(recipe: amp.Fp8Recipe | None) -> tuple[float, int]:
        torch.manual_seed(0)
        model = CharTransformer(vocab, d_model=32, n_layers=2, n_heads=2, max_len=32)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = amp.initialize(model, opt, opt_level="O1", fp8=recipe)
        batches = text_batches(data, 8, 32, torch.Generator().manual_seed(0))
        losses = []
        for _ in range(80):
            ids, target = next(batches)
            loss = F.cross_entropy(model(ids).float().flatten(0, 1), target.flatten())
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        n = len(fp8.layers())
        return sum(losses[-10:]) / 10, n

    bf16, none = run(None)
    f8, n = run(amp.Fp8Recipe(min_features=16, skip_first_last=False, exclude=("head",)))
    assert none == 0 and n == 8  # qkv, proj, fc1, fc2 of both blocks
    assert bf16 < 0.8 * 4.0  # it learned (uniform over the vocabulary is ~4.4 nats)
    assert abs(f8 - bf16) <= 0.02 * bf16, (f8, bf16)


@pytest.mark.distributed
def test_two_ranks_agree_on_the_amax_of_inputs_and_grads(tmp_path):
    """gloo, 2 processes, DDP + O1 + fp8; rank 1's data is 10x rank 0's. Every step both
    ranks quantize with the same scales, derived from the larger abs-max (MAX all-reduce),
    for current and delayed scaling; training stays in lockstep."""
    import _fp8_workers

    r0, r1 = _fp8_workers.launch("amax", tmp_path, world_size=2)
    for scaling in ("current", "delayed"):
        a, b = r0[scaling], r1[scaling]
        assert a["layers"] == ["1", "3"]
        # 3 steps x 2 layers x (input, grad_output), plus the step's found-inf agreement
        assert a["all_reduces"] == b["all_reduces"] == 3 * 2 * 2 + 3
        for step, (sa, sb) in enumerate(zip(a["steps"], b["steps"])):
            for role in ("input", "grad_output", "weight"):
                for x, y in zip(sa[role], sb[role]):
                    assert torch.equal(x, y), (scaling, step, role)
            expect_in = torch.maximum(a["local_in"][step], b["local_in"][step])
            expect_go = torch.maximum(a["local_go"][step], b["local_go"][step])
            assert torch.equal(sa["input"][0], expect_in) and torch.equal(sa["grad_output"][0], expect_go)
            assert b["local_in"][step] > a["local_in"][step]  # the ranks' own abs-maxes did differ
            if scaling == "current":
                assert torch.equal(sa["input"][1], torch.tensor(448.0) / expect_in)
            else:
                assert torch.equal(sa["input"][2][0], expect_in)  # the agreed value entered the history
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))
        assert a["solo_all_reduces"] == 0  # rank 0 evaluated and explained alone, no collective
