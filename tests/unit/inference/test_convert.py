"""ampkit.convert / export_program / export_onnx and `ampkit convert`.

Stated tolerances (bench models trained a few steps, converted from real O1/O2
checkpoints): top-1 agreement with the fp32 model >= 99% on the digits test set, LM
bits/char within 1% of fp32's, for the PyTorch model and the ONNX file in onnxruntime.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit as amp
from ampkit.inference.conversion import (
    Budget,
    ConversionError,
    NonFiniteError,
    OutputError,
    output_error,
    run_batch,
)
from ampkit.tools.bench.inference import train_checkpoint

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _quiet_slow_cpu_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ampkit.convert: this CPU has no")
        yield


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_state(a, b):
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten())
        self.classifier = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        return self.classifier(self.features(x))


class SmallLM(nn.Module):
    def __init__(self, vocab=20, d=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.head = nn.Linear(4 * d, vocab)

    def forward(self, ids):
        x = self.tok(ids)
        return self.head(F.gelu(self.fc(self.ln(x))))


def _cnn():
    torch.manual_seed(0)
    return SmallCNN()


# ---------------------------------------------------------------------------
# the converted model
# ---------------------------------------------------------------------------
def test_convert_stores_weights_in_16_bits_and_leaves_the_model_alone():
    model = _cnn().train()
    before = _state(model)
    x = torch.randn(6, 1, 8, 8)
    conv = amp.convert(model)
    assert _same_state(model.state_dict(), before) and model.training  # input untouched
    assert type(conv) is SmallCNN and conv is not model and not conv.training
    assert all(p.dtype == BF16 for p in conv.parameters())
    for (name, p), (_, q) in zip(model.named_parameters(), conv.named_parameters()):
        assert torch.equal(p.detach().to(BF16), q.detach()), name  # round to nearest of the fp32 weights
    report = conv.ampkit_report
    assert report.weight_bytes * 2 == report.weight_bytes_fp32  # every weight 16-bit: exactly half
    with torch.no_grad():
        y, ref = conv(x), model.eval()(x)
    assert y.dtype == FP32
    assert output_error([ref], [y]).rel_error < 2e-2


class _CastLog(TorchDispatchMode):
    def __init__(self, params):
        super().__init__()
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and isinstance(out, torch.Tensor):
            src = args[0]
            self.casts.append((src.dtype, out.dtype, src.untyped_storage().data_ptr() in self.params))
        return out


def test_casts_happen_only_at_dtype_boundaries_never_on_weights():
    conv = amp.convert(_cnn())
    log = _CastLog(conv.parameters())
    with torch.no_grad(), log:
        conv(torch.randn(2, 1, 8, 8))
    # the fp32 input once into bf16, the bf16 logits once back: nothing else
    assert log.casts == [(FP32, BF16, False), (BF16, FP32, False)]

    torch.manual_seed(0)
    lm = amp.convert(SmallLM())
    log = _CastLog(lm.parameters())
    with torch.no_grad(), log:
        lm(torch.randint(0, 20, (2, 5)))
    # LayerNorm kept fp32: its input up, its output back; the logits to fp32
    assert log.casts == [(BF16, FP32, False), (FP32, BF16, False), (BF16, FP32, False)]


def test_norm_layers_stay_fp32_and_hand_back_the_16_bit_dtype():
    torch.manual_seed(0)
    conv = amp.convert(SmallLM())
    assert conv.ln.weight.dtype == FP32 and conv.fc.weight.dtype == BF16 and conv.tok.weight.dtype == BF16
    seen = {}
    conv.ln.register_forward_pre_hook(lambda m, a: seen.__setitem__("ln_in", a[0].dtype))
    conv.ln.register_forward_hook(lambda m, a, o: seen.__setitem__("ln_out", o.dtype))
    conv.fc.register_forward_pre_hook(lambda m, a: seen.__setitem__("fc_in", a[0].dtype))
    conv(torch.randint(0, 20, (2, 5)))
    assert seen == {"ln_in": FP32, "ln_out": BF16, "fc_in": BF16}
    assert conv.ampkit_report.decision("ln").reason == "norm layer"
    assert amp.convert(SmallLM(), keep_norm_fp32=False).ln.weight.dtype == BF16


def test_keep_fp32_by_name_and_class_and_policy_rules():
    model = _cnn()
    conv = amp.convert(model, keep_fp32=["classifier"])
    assert conv.classifier.weight.dtype == FP32 and conv.features[0].weight.dtype == BF16
    inputs = []
    conv.classifier.register_forward_pre_hook(lambda m, a: inputs.append(a[0].dtype) and None)
    assert conv(torch.randn(2, 1, 8, 8)).dtype == FP32 and inputs == [FP32]
    assert conv.ampkit_report.decision("classifier").reason == "keep_fp32"
    assert conv.ampkit_report.kept_fp32 == ["classifier"]

    conv = amp.convert(model, keep_fp32=[nn.Conv2d])
    assert [m.weight.dtype for m in conv.features if isinstance(m, nn.Conv2d)] == [FP32, FP32]
    assert conv.classifier.weight.dtype == BF16

    policy = amp.Policy(dtype=FP16, module_rules={nn.Linear: FP32, "features.3": FP32})
    conv = amp.convert(model, policy=policy)
    assert conv.features[0].weight.dtype == FP16  # the policy's dtype
    assert conv.features[3].weight.dtype == FP32 and conv.classifier.weight.dtype == FP32
    assert {d.name: d.reason for d in conv.ampkit_report.modules if d.dtype == FP32} == {
        "features.3": "policy rule",
        "classifier": "policy rule",
    }
    out = conv(torch.randn(2, 1, 8, 8))
    with torch.no_grad():
        assert output_error([model.eval()(torch.zeros(1, 1, 8, 8))], [conv(torch.zeros(1, 1, 8, 8))]).rel_error < 1e-2
    assert out.dtype == FP32


def test_shared_parameters_take_the_widest_dtype():
    torch.manual_seed(0)
    model = SmallLM(vocab=20, d=16)
    model.head = nn.Linear(16, 20, bias=False)
    model.fc = nn.Identity()
    model.head.weight = model.tok.weight  # tied embedding
    conv = amp.convert(model, keep_fp32=["head"])
    assert conv.tok.weight is conv.head.weight and conv.tok.weight.dtype == FP32
    assert conv.ampkit_report.decision("tok").reason == "shared parameter"
    conv(torch.randint(0, 20, (2, 3)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(keep_fp32=["clasifier"]), "matches no module"),
        (dict(keep_fp32=[3]), "module names/globs"),
        (dict(dtype=FP32), "full precision"),
        (dict(budget=0.01), "needs calibration batches"),
        (dict(calib=[]), "calib is empty"),
        (dict(calib=[torch.zeros(1, 1, 8, 8)], budget=-1.0), "finite number >= 0"),
        (dict(calib=[torch.zeros(1, 1, 8, 8)], budget="tight"), "budget must be"),
        (dict(policy="O2"), "ampkit.Policy"),
        (dict(output_dtype=torch.int8), "output_dtype"),
        (dict(checkpoint={"model": {"features.0.weight": torch.zeros(3)}}), "do not fit"),
        (dict(checkpoint={"opt": {}}), "no model weights"),
    ],
)
def test_bad_arguments_raise_conversion_error_and_change_nothing(kwargs, message):
    model = _cnn()
    before = _state(model)
    with pytest.raises(ConversionError, match=message):
        amp.convert(model, **kwargs)
    assert _same_state(model.state_dict(), before)
    with pytest.raises(ConversionError, match="at least one limit"):
        Budget()


def test_a_model_that_cannot_be_copied_is_refused():
    import threading

    model = _cnn()
    model.lock = threading.Lock()
    with pytest.raises(ConversionError, match="cannot be copied"):
        amp.convert(model)


def test_slow_cpu_warning_once_per_session(monkeypatch):
    from ampkit._internal import torch_compat

    monkeypatch.setattr(torch_compat, "cpu_has_native_16bit", lambda dtype: False)  # a CPU without bf16
    amp.reset()
    with pytest.warns(UserWarning, match="no bf16 instructions"):
        amp.convert(_cnn())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.convert(_cnn())  # once


# ---------------------------------------------------------------------------
# BatchNorm folding
# ---------------------------------------------------------------------------
def _randomize_bn(model, var=(0.5, 2.0)):
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g))
            m.running_var.copy_(torch.empty(n).uniform_(*var, generator=g))
            m.weight.data.copy_(torch.randn(n, generator=g))
            m.bias.data.copy_(torch.randn(n, generator=g))
    return model.eval()


class ResBlock(nn.Module):
    """Attributes, not a Sequential: the torch.fx path finds the pairs."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.shortcut = nn.Conv2d(4, 4, 1)
        self.bn_after_relu = nn.BatchNorm2d(4)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        s = self.shortcut(x)  # used twice: its BN must not be folded into it
        h = self.bn2(self.conv2(h)) + s
        return self.bn_after_relu(F.relu(h)) + s


def test_batchnorm_folds_into_the_layer_before_it_exactly():
    torch.manual_seed(0)
    model = _randomize_bn(ResBlock())
    x = torch.randn(3, 4, 6, 6)
    fp32 = amp.convert(model, keep_fp32=[nn.Conv2d])  # folding alone, no 16-bit rounding
    assert isinstance(fp32.bn1, nn.Identity) and isinstance(fp32.bn2, nn.Identity)
    assert isinstance(fp32.bn_after_relu, nn.BatchNorm2d)
    assert [(f.layer, f.norm, f.folded) for f in fp32.ampkit_report.folds] == [
        ("conv1", "bn1", True),
        ("conv2", "bn2", True),
    ]
    with torch.no_grad():
        err = output_error([model(x)], [fp32(x)])
    assert err.rel_error < 1e-6
    low = amp.convert(model)
    assert low.conv1.weight.dtype == BF16 and low.conv1.bias.dtype == BF16  # bias created by the fold
    assert low.bn_after_relu.weight.dtype == FP32
    with torch.no_grad():
        assert output_error([model(x)], [low(x)]).rel_error < 3e-2
    assert isinstance(amp.convert(model, fold_bn=False).bn1, nn.BatchNorm2d)


class Branchy(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it; Sequential pairs still fold."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5), nn.BatchNorm1d(5))

    def forward(self, x):
        h = self.body(x)
        if h.sum() > 0:
            h = h * 2
        return self.head(h)


def test_batchnorm_folding_without_fx_uses_sequential_neighbours():
    torch.manual_seed(0)
    model = _randomize_bn(Branchy())
    conv = amp.convert(model, keep_fp32=[nn.Conv2d, nn.Linear])
    assert isinstance(conv.body[1], nn.Identity) and isinstance(conv.head[2], nn.Identity)
    x = torch.randn(4, 2, 6, 6)
    with torch.no_grad():
        assert output_error([model(x)], [conv(x)]).rel_error < 1e-6


def test_batchnorm_not_folded_when_the_folded_weights_do_not_fit_the_dtype():
    torch.manual_seed(0)
    model = _randomize_bn(nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3)))
    model[1].running_var.fill_(1e-12)  # scale 1e6: folded fp16 weights overflow
    model[1].eps = 0.0
    model[1].weight.data.fill_(1.0)
    conv = amp.convert(model, dtype=FP16)
    (fold,) = conv.ampkit_report.folds
    assert not fold.folded and math.isinf(fold.weight_error_folded) and "coarsely" in fold.reason
    assert isinstance(conv[1], nn.BatchNorm2d) and conv[1].running_var.dtype == FP32
    assert amp.convert(model, dtype=BF16).ampkit_report.folds[0].folded  # bf16 has the range


# ---------------------------------------------------------------------------
# accuracy budget
# ---------------------------------------------------------------------------
class Offset(nn.Module):
    """``shift`` adds a large constant the next line takes away again: in bf16 the
    sum keeps 8 bits of 1000 + h, so h is lost unless ``shift`` computes in fp32."""

    def __init__(self, offset=1000.0):
        super().__init__()
        self.offset = offset
        self.fc1 = nn.Linear(16, 32)
        self.shift = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)
        with torch.no_grad():
            self.shift.bias.add_(offset)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        return self.head(self.shift(h) - self.offset)


def _calib(n=2, features=16):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(32, features, generator=g) for _ in range(n)]


def test_budget_keeps_the_one_layer_that_needs_fp32_and_says_why():
    torch.manual_seed(0)
    model = Offset().eval()
    calib = _calib()
    conv = amp.convert(model, calib=calib, budget=0.03)
    report = conv.ampkit_report
    assert report.kept_for_budget == ["shift"]
    assert conv.shift.weight.dtype == FP32 and conv.fc1.weight.dtype == BF16 and conv.head.weight.dtype == BF16
    assert report.error_all_16bit.rel_error > 0.1  # all-bf16 misses the budget by far
    assert report.error.rel_error <= 0.03
    shift = report.decision("shift")
    assert shift.isolated_error == max(d.isolated_error for d in report.modules if d.isolated_error is not None)
    assert "converting it too would give" in shift.detail
    # the same error again on fresh data: the kept layer is what matters, not the batches
    test = _calib(1)[0] + 0.5
    with torch.no_grad():
        assert output_error([model(test)], [conv(test)]).rel_error < 0.03


def test_budget_keeps_nothing_when_16_bits_are_enough():
    torch.manual_seed(0)
    model = Offset(offset=0.0).eval()
    conv = amp.convert(model, calib=_calib(), budget=Budget(max_rel_error=0.03, min_top1_agreement=0.9))
    report = conv.ampkit_report
    assert report.kept_for_budget == [] and report.kept_fp32 == []
    assert report.evaluations == 2  # the all-16-bit check and the final model, no search
    assert all(p.dtype == BF16 for p in conv.parameters())


class Loud(nn.Module):
    """``amp`` produces activations above fp16's 65504 from weights fp16 holds (3e4);
    the next line scales them down."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.amp = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.amp.weight.fill_(3e4)

    def forward(self, x):
        return self.head(self.amp(torch.relu(self.fc1(x)) + 1.0) / 1e5)


def test_budget_keeps_a_layer_whose_activations_overflow_fp16():
    torch.manual_seed(0)
    model = Loud().eval()
    calib = [torch.randn(4, 8, generator=torch.Generator().manual_seed(3))]
    with pytest.warns(UserWarning, match="NaN/inf value"):
        plain = amp.convert(model, dtype=FP16, calib=calib)
    assert math.isinf(plain.ampkit_report.error.rel_error)  # inf in the fp16 model
    assert plain.ampkit_report.error.nonfinite > 0
    conv = amp.convert(model, dtype=FP16, calib=calib, budget=Budget(max_rel_error=0.02, min_top1_agreement=1.0))
    assert conv.ampkit_report.kept_for_budget == ["amp"]
    assert math.isinf(conv.ampkit_report.decision("amp").isolated_error)
    assert conv.ampkit_report.error.rel_error < 0.02


def test_budget_that_cannot_be_met_raises():
    torch.manual_seed(0)
    model = Offset().eval()
    with pytest.raises(ConversionError, match="cannot be met"):
        amp.convert(model, calib=_calib(1), budget=0.03, candidates=["fc1", "head"])
    with pytest.raises(ConversionError, match="matches no module"):
        amp.convert(model, calib=_calib(1), budget=0.03, candidates=["shiftt"])


# ---------------------------------------------------------------------------
# non-finite weights and outputs
# ---------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_with_or_without_calib(value):
    model = _mlp()
    with torch.no_grad():
        model[0].weight[0, 0] = value
    before = _state(model)
    for kwargs in ({}, {"calib": _calib(1, 8)}, {"calib": _calib(1, 8), "budget": 1e-2}):
        with pytest.raises(NonFiniteError, match=r"0\.weight \(1 of 128\)"):
            amp.convert(model, **kwargs)
    after = model.state_dict()
    assert all(torch.equal(before[k].view(torch.int32), after[k].view(torch.int32)) for k in before)  # bitwise


def test_nan_buffer_and_nan_checkpoint_weights_are_refused_an_inf_mask_is_not():
    bn = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).eval()
    bn[1].running_var[3] = float("nan")
    with pytest.raises(NonFiniteError, match="1.running_var"):
        amp.convert(bn, fold_bn=False)
    model = _mlp()
    ckpt = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt["2.bias"][1] = float("nan")
    with pytest.raises(NonFiniteError, match="checkpoint's weights.*2.bias"):
        amp.convert(_mlp(), checkpoint=ckpt)

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.register_buffer("mask", torch.tensor([0.0, 0.0, float("-inf"), 0.0]))

        def forward(self, x):
            return self.fc(x) + self.mask

    torch.manual_seed(0)
    conv = amp.convert(Masked().eval(), calib=_calib(1, 8), budget=0.02)
    err = conv.ampkit_report.error
    assert err.nonfinite == 0 and err.rel_error < 0.02  # the reference's own -inf, matched exactly
    assert torch.isneginf(conv(_calib(1, 8)[0])[:, 2]).all()


def test_a_weight_beyond_the_16_bit_range_keeps_its_module_fp32_not_inf():
    model = _mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = 1e5  # finite in fp32 and bf16, inf in fp16
    conv = amp.convert(model, dtype=FP16)
    assert conv.ampkit_report.decision("2").reason == "range" and conv[2].weight.dtype == FP32
    assert conv[2].weight[0, 0].item() == 1e5 and conv[0].weight.dtype == FP16
    assert amp.convert(model, dtype=BF16).ampkit_report.decision("2").dtype == BF16  # bf16 holds it
    assert all(torch.isfinite(t).all() for t in conv.state_dict().values())


class MakesNaN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x).log()  # NaN for negative logits, in fp32 too


def test_nan_in_the_fp32_reference_outputs_is_refused():
    torch.manual_seed(0)
    for kwargs in ({}, {"budget": 1e-2}, {"budget": Budget(min_top1_agreement=0.5)}):
        with pytest.raises(NonFiniteError, match="reference outputs of batch 0 hold"):
            amp.convert(MakesNaN().eval(), calib=_calib(2, 8), **kwargs)


def test_non_finite_outputs_fail_every_budget_and_never_measure_as_zero_error():
    ref = [torch.tensor([[1.0, 2.0, 0.5], [3.0, 1.0, 0.0]])]
    nan_row = [torch.tensor([[1.0, 2.0, 0.5], [float("nan"), 1.0, 0.0]])]
    err = output_error(ref, nan_row)
    assert err.nonfinite == 1 and math.isinf(err.rel_error) and math.isinf(err.max_abs_error)
    assert err.top1_agreement == 0.5  # the row holding a NaN does not agree
    assert "1 non-finite output" in str(err)
    for budget in (Budget(max_rel_error=1e9), Budget(max_abs_error=1e9), Budget(min_top1_agreement=0.0)):
        assert not budget.met_by(err)
    inf_out = output_error(ref, [torch.tensor([[1.0, float("inf"), 0.5], [3.0, 1.0, 0.0]])])
    assert inf_out.nonfinite == 1 and not Budget(min_top1_agreement=0.0).met_by(inf_out)
    # a NaN measure (an OutputError built by hand) fails too
    assert not Budget(min_top1_agreement=0.0).met_by(OutputError(math.nan, 0.0, 1.0, 1))
    assert not Budget(min_top1_agreement=0.5).met_by(OutputError(0.0, 0.0, math.nan, 1))
    with pytest.raises(NonFiniteError, match="NaN"):
        output_error(nan_row, ref)
    both_inf = [torch.tensor([[float("-inf"), 2.0]])]
    assert output_error(both_inf, both_inf) == OutputError(0.0, 0.0, 1.0, 1, 0)


def test_calibration_batches_the_model_cannot_run_raise_conversion_error():
    model = _mlp()
    for calib, found in (([torch.randn(4, 5)], r"batch 0 \(tensor \[4, 5\] fp32\)"),
                         ([torch.randn(2, 8), (torch.randn(2, 8), torch.randn(2, 8))], "batch 1")):
        with pytest.raises(ConversionError, match=found) as info:
            amp.convert(model, calib=calib)
        assert "RuntimeError" in str(info.value) or "TypeError" in str(info.value)


# ---------------------------------------------------------------------------
# training checkpoints (real ampkit.initialize runs)
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cnn_runs():
    """The bench CNN (tiny) trained 40 steps at O1 and at O2 (same seed, same batches)."""
    return {lvl: train_checkpoint("cnn", lvl, steps=40, size="tiny") for lvl in ("O1", "O2")}


def _masters_via_training_api(wl, checkpoint):
    """Independent route to the fp32 masters: resume the run as a script would."""
    model = wl.build_model()
    opt = torch.optim.AdamW(model.named_parameters(), lr=wl.lr, weight_decay=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O2")
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    names = [n for g in opt.param_groups for n in g["param_names"]]
    masters = {n: m.detach().clone() for n, m in zip(names, amp.master_params(opt))}
    amp.reset()
    return masters


def test_o2_checkpoint_gives_the_fp32_masters(cnn_runs):
    _, ckpt, wl = cnn_runs["O2"]
    weights = amp.fp32_weights(wl.build_model(), ckpt)
    masters = _masters_via_training_api(wl, ckpt)
    assert set(masters) <= set(weights)
    for name, master in masters.items():
        assert weights[name].dtype == FP32 and torch.equal(weights[name], master), name
        assert torch.equal(master.to(BF16), ckpt["model"][name])  # the 16-bit weight is it rounded
    assert any(not torch.equal(w, ckpt["model"][n].float()) for n, w in weights.items())  # low bits kept

    conv = amp.convert(wl.build_model(), checkpoint=ckpt, keep_fp32=["classifier"])
    assert torch.equal(conv.classifier.weight, masters["classifier.weight"])  # fp32: the master itself
    assert torch.equal(conv.features[0].weight, masters["features.0.weight"].to(BF16))


def test_o2_checkpoint_with_an_unnamed_optimizer_and_a_wrong_order():
    model, ckpt, wl = train_checkpoint("cnn", "O2", steps=2, size="tiny", named_params=False)
    named = amp.fp32_weights(wl.build_model(), ckpt)  # positions follow model.parameters()
    assert all(v.dtype == FP32 for v in named.values())
    # an optimizer over the parameters in another order, without names: refused, then fixed
    torch.manual_seed(0)
    model = wl.build_model()
    params = list(model.named_parameters())[::-1]
    opt = torch.optim.AdamW([p for _, p in params], lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2")
    x, y = next(wl.batches(torch.Generator().manual_seed(0)))
    with amp.scale_loss(wl.loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    amp.reset()
    with pytest.raises(ConversionError, match="named_parameters"):
        amp.convert(wl.build_model(), checkpoint=ckpt)
    names = [[n for n, _ in params]]
    weights = amp.fp32_weights(wl.build_model(), ckpt, param_names=[names])
    assert all(torch.equal(weights[n], m) for (n, _), m in zip(params, masters))


def test_o2k_checkpoint_adds_the_kahan_compensation():
    model, ckpt, wl = train_checkpoint("cnn", "O2K", steps=5, size="tiny")
    weights = amp.fp32_weights(wl.build_model(), ckpt)
    w16 = ckpt["model"]["features.0.weight"]
    w32 = weights["features.0.weight"]
    assert w16.dtype == BF16 and w32.dtype == FP32
    assert not torch.equal(w32, w16.float())  # the compensation carries real bits
    # weight + compensation rounds back to the stored weight (|c| <= half an ulp)
    assert (w32.to(BF16) == w16).float().mean() > 0.99
    conv = amp.convert(wl.build_model(), checkpoint=ckpt)
    assert conv.features[0].weight.dtype == BF16


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c.__setitem__("amp", {"trainers": 3}),
        lambda c: c["amp"]["trainers"].__setitem__(0, "x"),
        lambda c: c["amp"]["trainers"][0]["optimizers"][0]["extra"]["master_weights"].__setitem__("masters", [[0, "a", 1]]),
        lambda c: c["amp"]["trainers"][0]["optimizers"][0]["extra"]["master_weights"]["masters"][0].__setitem__(1, 999),
        lambda c: c["optimizer"]["param_groups"][0].__setitem__("param_names", []),
    ],
)
def test_malformed_checkpoints_raise_conversion_errors(cnn_runs, mutate):
    import copy

    _, ckpt, wl = cnn_runs["O2"]
    bad = copy.deepcopy(ckpt)
    mutate(bad)
    with pytest.raises(ConversionError):
        amp.convert(wl.build_model(), checkpoint=bad)
    with pytest.raises(ConversionError, match="one list per optimizer"):
        amp.fp32_weights(wl.build_model(), ckpt, param_names=[])


def test_o1_checkpoint_is_the_fp32_weights(cnn_runs):
    _, ckpt, wl = cnn_runs["O1"]
    weights = amp.fp32_weights(wl.build_model(), ckpt)
    assert all(torch.equal(weights[k], v) for k, v in ckpt["model"].items())


def _fp32_model(wl, ckpt):
    """The fp32 reference: the workload's model with the checkpoint's best fp32 weights."""
    model = wl.build_model()
    model.load_state_dict(amp.fp32_weights(model, ckpt))
    return model.eval()


def _agreement(a, b, x):
    with torch.no_grad():
        return (a(x).argmax(-1) == b(x).argmax(-1)).float().mean().item()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bench_cnn_from_checkpoint_agrees_with_fp32(cnn_runs, level):
    _, ckpt, wl = cnn_runs[level]
    fp32 = _fp32_model(wl, ckpt)
    conv = amp.convert(wl.build_model(), checkpoint=ckpt)
    assert conv.ampkit_report.weight_bytes * 2 == conv.ampkit_report.weight_bytes_fp32
    test_x = wl.data.test_x
    assert _agreement(fp32, conv, test_x) >= 0.99
    assert abs(wl.evaluate(conv)["accuracy"] - wl.evaluate(fp32)["accuracy"]) <= 0.01


@pytest.fixture(scope="module")
def lm_runs():
    return {lvl: train_checkpoint("lm", lvl, steps=30, size="tiny") for lvl in ("O1", "O2")}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bench_lm_from_checkpoint_keeps_bits_per_char(lm_runs, level):
    _, ckpt, wl = lm_runs[level]
    fp32 = _fp32_model(wl, ckpt)
    conv = amp.convert(wl.build_model(), checkpoint=ckpt)
    ref_bpc = wl.evaluate(fp32)["bits_per_char"]
    bpc = wl.evaluate(conv)["bits_per_char"]
    assert abs(bpc - ref_bpc) / ref_bpc < 0.01
    ratio = conv.ampkit_report.weight_bytes / conv.ampkit_report.weight_bytes_fp32
    assert 0.5 < ratio < 0.52  # LayerNorm weights (a few hundred) stay fp32


# ---------------------------------------------------------------------------
# export: torch.export program, lazy deploy extra
# ---------------------------------------------------------------------------
@pytest.mark.fresh_process  # torch.export: another test's leftovers in this process broke it
def test_export_program_runs_the_converted_graph():
    conv = amp.convert(_cnn())
    x = torch.randn(4, 1, 8, 8)
    program = amp.export_program(conv, x)
    assert {t.dtype for t in program.state_dict.values()} == {BF16}
    with torch.no_grad():
        assert torch.equal(program.module()(x), conv(x))
        assert program.module()(x[:3]).shape == (3, 10)  # dynamic batch


@pytest.mark.slow  # a new interpreter
def test_core_import_does_not_import_the_deploy_extra():
    code = (
        "import sys, ampkit\n"
        "bad = [m for m in ('onnx', 'onnxruntime', 'onnxscript') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_export_onnx_without_the_extra_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(amp.AmpError, match=r"'onnx[^']*'.*pip install -e '\.\[deploy\]'"):
        amp.export_onnx(amp.convert(_cnn()), torch.randn(2, 1, 8, 8), tmp_path / "m.onnx")
    with pytest.raises(ConversionError, match="precision"):
        amp.export_onnx(_cnn(), torch.randn(2, 1, 8, 8), tmp_path / "m.onnx", precision="half")


# ---------------------------------------------------------------------------
# ONNX in onnxruntime (slow: the dynamo exporter takes seconds per model)
# ---------------------------------------------------------------------------
def _ort_logits(session, x, batch=128):
    from ampkit.inference.export import run_onnx

    return torch.cat([run_onnx(session, x[i : i + batch])[0] for i in range(0, x.shape[0], batch)])


@pytest.mark.slow
@pytest.mark.fresh_process  # torch.export: another test's leftovers in this process broke it
def test_onnx_cnn_from_o2_checkpoint_storage_and_fp16_compute(cnn_runs, tmp_path):
    pytest.importorskip("onnxruntime")
    from ampkit.inference.export import onnx_session

    _, ckpt, wl = cnn_runs["O2"]
    fp32 = _fp32_model(wl, ckpt)
    test_x = wl.data.test_x
    with torch.no_grad():
        ref = fp32(test_x)
    conv = amp.convert(wl.build_model(), checkpoint=ckpt)
    result = amp.export_onnx(conv, test_x[:8], tmp_path / "cnn.onnx")
    assert (result.exporter, result.precision) == ("dynamo", "storage")
    assert result.initializer_bytes["BFLOAT16"] == conv.ampkit_report.weight_bytes
    assert result.initializer_bytes.get("FLOAT", 0) < 1024
    assert result.error_vs_pytorch.top1_agreement == 1.0
    logits = _ort_logits(onnx_session(result.path), test_x)
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.99
    assert output_error([ref], [logits]).rel_error < 1e-2  # weights rounded, fp32 compute

    conv16 = amp.convert(wl.build_model(), checkpoint=ckpt, dtype=FP16)
    result16 = amp.export_onnx(conv16, test_x[:8], tmp_path / "cnn16.onnx")
    assert result16.precision == "compute"
    assert result16.op_types[("Conv", "FLOAT16")] == 5 and result16.op_types[("Gemm", "FLOAT16")] == 1
    assert result16.initializer_bytes["FLOAT16"] == conv16.ampkit_report.weight_bytes
    assert result16.error_vs_pytorch.rel_error < 1e-2
    logits16 = _ort_logits(onnx_session(result16.path), test_x)
    assert (logits16.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.99


@pytest.mark.slow
@pytest.mark.fresh_process  # torch.export: another test's leftovers in this process broke it
def test_onnx_lm_from_o1_checkpoint_keeps_bits_per_char(lm_runs, tmp_path):
    pytest.importorskip("onnxruntime")
    from ampkit.inference.export import onnx_session

    _, ckpt, wl = lm_runs["O1"]
    fp32 = _fp32_model(wl, ckpt)
    windows = wl.eval_windows()
    x, y = windows[:, :-1], windows[:, 1:]
    for dtype, precision in ((BF16, "storage"), (FP16, "compute")):
        conv = amp.convert(wl.build_model(), checkpoint=ckpt, dtype=dtype)
        result = amp.export_onnx(conv, x[:4], tmp_path / f"lm-{precision}.onnx")
        assert result.precision == precision
        logits = _ort_logits(onnx_session(result.path), x)
        with torch.no_grad():
            ref = fp32(x)
        bpc = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item() / math.log(2)
        ref_bpc = F.cross_entropy(ref.flatten(0, 1), y.flatten()).item() / math.log(2)
        assert abs(bpc - ref_bpc) / ref_bpc < 0.01, (precision, bpc, ref_bpc)


@pytest.mark.slow
def test_onnx_falls_back_to_torchscript_and_rejects_bf16_compute(tmp_path):
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = _randomize_bn(Branchy())
    conv = amp.convert(model, dtype=FP16)
    x = torch.rand(4, 2, 6, 6)  # positive: the branch taken in the trace
    with pytest.warns(UserWarning, match="TorchScript"):
        result = amp.export_onnx(conv, x, tmp_path / "branchy.onnx")
    assert result.exporter == "torchscript" and result.fallback_reason
    assert result.error_vs_pytorch.rel_error < 1e-2
    with pytest.raises(amp.AmpError, match="precision='storage'"):
        amp.export_onnx(amp.convert(_cnn()), torch.randn(2, 1, 8, 8), tmp_path / "bf16.onnx", precision="compute")


# ---------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_files(tmp_path_factory, cnn_runs):
    folder = tmp_path_factory.mktemp("convert-cli")
    _, ckpt, _ = cnn_runs["O2"]
    torch.save(ckpt, folder / "ckpt.pt")
    (folder / "factories.py").write_text(
        "from ampkit.tools.bench.inference import digits_calib, digits_cnn\n"
        "def model():\n    return digits_cnn('tiny')\n"
        "def calib():\n    return digits_calib('tiny', batches=1, batch_size=16)\n"
        "def not_a_model():\n    return 3\n"
        "def wrong():\n    return digits_cnn('quick')\n"
    )
    return folder


def _cli(args, capsys):
    from ampkit.tools.cli.main import main

    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.pt"], "no such file"),
        (["{d}/ckpt.pt", "--model", "nomodule"], "module:function"),
        (["{d}/ckpt.pt", "--model", "no_such_pkg_xyz:f"], "cannot import"),
        (["{d}/ckpt.pt", "--model", "{d}/factories.py:not_a_model"], "not an nn.Module"),
        (["{d}/ckpt.pt", "--model", "{d}/factories.py:nothing"], "has no function"),
        (["{d}/factories.py", "--model", "{d}/factories.py:model"], "cannot load"),
        (["{d}/ckpt.pt", "--model", "{d}/factories.py:wrong"], "lines up|do not fit"),
        (["{d}/ckpt.pt", "--keep-fp32", "nope"], "matches no module"),
        (["{d}/ckpt.pt", "--min-agreement", "2"], "between 0 and 1"),
        (["{d}/ckpt.pt", "--onnx", "/no/such/dir/m.onnx"], "cannot write"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(cli_files, capsys, args, message):
    d = str(cli_files)
    full = ["convert"] + [a.format(d=d) for a in args]
    if "--model" not in full:
        full += ["--model", f"{d}/factories.py:model"]
    full += ["--calib", f"{d}/factories.py:calib"]
    code, out, err = _cli(full, capsys)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_cli_converts_with_a_calibration_tensor_file(cli_files, capsys, tmp_path):
    d = str(cli_files)
    from ampkit.tools.bench.inference import digits_calib

    torch.save(torch.cat(digits_calib("tiny", batches=2, batch_size=8)), tmp_path / "calib.pt")
    code, out, err = _cli(
        ["convert", f"{d}/ckpt.pt", "--model", f"{d}/factories.py:model", "--calib", str(tmp_path / "calib.pt"),
         "--batch-size", "8", "--rounds", "1", "--keep-fp32", "classifier"],
        capsys,
    )
    assert code == 0, err
    assert "classifier (Linear): keep_fp32" in out
    rows = [line for line in out.splitlines() if "PyTorch" in line]
    assert len(rows) == 2 and "onnxruntime" not in out
    assert "(batch 8," in out


@pytest.mark.slow
@pytest.mark.fresh_process  # torch.export: another test's leftovers in this process broke it
def test_cli_converts_exports_and_prints_the_table(cli_files, capsys, tmp_path):
    pytest.importorskip("onnxruntime")
    d = str(cli_files)
    onnx_path, program_path = tmp_path / "cnn.onnx", tmp_path / "cnn.pt2"
    code, out, err = _cli(
        ["convert", f"{d}/ckpt.pt", "--model", f"{d}/factories.py:model", "--calib", f"{d}/factories.py:calib",
         "--onnx", str(onnx_path), "--program", str(program_path), "--rounds", "2", "--min-agreement", "0.99"],
        capsys,
    )
    assert code == 0, err
    assert onnx_path.is_file() and program_path.is_file()
    for text in ("fp32", "bf16", "PyTorch", "onnxruntime", "storage precision", "budget: top-1 agreement"):
        assert text in out, text
    program = torch.export.load(str(program_path))
    x = torch.randn(3, 1, 16, 16)
    assert program.module()(x).shape == (3, 10)
    assert run_batch(program.module(), x).dtype == FP32


def test_cli_refuses_nan_weights_and_fails_on_nan_outputs(capsys, tmp_path):
    (tmp_path / "f.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def model():\n    torch.manual_seed(0)\n    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))\n"
        "def loud():\n    m = model()\n    with torch.no_grad():\n        m[0].weight.mul_(1e6)\n    return m\n"
        "def calib():\n    return [torch.randn(4, 8, generator=torch.Generator().manual_seed(3))]\n"
    )
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("f", tmp_path / "f.py")
    f = module_from_spec(spec)
    spec.loader.exec_module(f)
    bad = f.model().state_dict()
    bad["0.weight"][2, 2] = float("nan")
    torch.save(bad, tmp_path / "nan.pt")
    torch.save(f.loud().state_dict(), tmp_path / "loud.pt")
    base = ["--calib", f"{tmp_path}/f.py:calib", "--rounds", "1"]
    code, out, err = _cli(["convert", str(tmp_path / "nan.pt"), "--model", f"{tmp_path}/f.py:model", *base], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "NaN/inf values: 0.weight" in err, err
    code, out, err = _cli(
        ["convert", str(tmp_path / "loud.pt"), "--model", f"{tmp_path}/f.py:model", "--dtype", "fp16", *base], capsys
    )
    assert code == 1, (out, err)
    assert "non-finite output(s)" in out and "ampkit convert: the converted model outputs" in err.splitlines()[-1]
