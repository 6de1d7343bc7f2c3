"""ampkit.doctor on purpose-built failures: each names the module, op and direction,
gives the matching advice, and the advice -- applied from its structured form --
makes the run train like fp32. fp16 on CPU is slow: tiny models, few steps."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from locations import ROOT
from torch import nn

import ampkit as amp
from ampkit.tools.diagnosis import DoctorWarning, current
from ampkit.trainer.extensions import global_extensions

FP16 = amp.Policy(dtype=torch.float16)

pytestmark = pytest.mark.filterwarnings("ignore:ampkit. float16 on CPU")


def batch(step: int, d_in: int = 16, seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, *((seq,) if seq else ()), d_in, generator=g)
    return x, torch.randn(8, 4, generator=g)


def train(make, policy, scaler, steps, data, *, lr=0.05, loss_scale_fn=None, before_step=None,
          doctor=False, backward=None):
    """The loop as scripts write it; ``policy=None`` is plain fp32. Returns the losses,
    the step stats, the doctor's report (if on) and the model."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    amp.init_trainer(opt, scaler=scaler)
    doc = amp.doctor(opt).start() if doctor else None
    losses = []
    try:
        for step in range(steps):
            x, y = data(step)
            if policy is None:
                out = model(x)
            else:
                with amp.autocast(policy, device_type="cpu"):
                    out = model(x)
            loss = F.mse_loss(out.float(), y)
            if loss_scale_fn is not None:
                loss = loss * loss_scale_fn
            if backward is not None:
                backward(loss, opt)
            else:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            if before_step is not None:
                before_step(model, opt)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    except amp.NumericsError:  # the scale cannot recover: what the doctor is for
        pass
    stats = amp.stats(opt)
    if doc is not None:
        doc.stop()
    report = doc.report() if doc is not None else None
    amp.reset()
    return losses, stats, report, model


def assert_trains_like(losses, reference, rtol=2e-2):
    assert len(losses) == len(reference)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.9 * losses[0]
    for got, want in zip(losses, reference):
        assert got == pytest.approx(want, rel=rtol)


# --- 1. the 5th layer overflows in the forward from step k on --------------------------------
class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
        with torch.no_grad():
            self.layers[4].weight.mul_(1000.0)  # the 5th layer amplifies
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 4:
                x = self.norm(x)
        return self.head(x)


K = 3  # from step K on the inputs are 3000x larger (an unnormalized feature)
X0, Y0 = batch(0)


def shifted(step):
    return (X0 * 3000.0 if step >= K else X0), Y0


def test_forward_overflow_in_fifth_layer_named_and_fixed_by_module_rule():
    steps = 8
    losses, stats, report, _ = train(Deep, FP16, amp.LossScaler(init_scale=2.0**8), steps, shifted, doctor=True)
    assert stats.skipped >= steps - K  # every step from K on overflows
    first_event = report.events[0]
    assert (first_event.step, first_event.direction, first_event.module) == (K + 1, "forward", "layers.4")
    f = report.first
    assert (f.level, f.direction, f.module, f.module_type, f.op) == ("op", "forward", "layers.4", "Linear", "addmm")
    assert f.outputs[0].dtype == "fp16" and f.outputs[0].nonfinite > 0
    assert all(s.nonfinite == 0 for s in f.inputs)
    assert f.fp32_abs_max > 65504  # what the op computes in fp32
    assert f.consumer == "native_layer_norm" and f.consumer_module == "norm"
    assert report.margins[0].module == "layers.4"  # highest risk
    advice = report.advice_of("module_fp32")[0]
    assert advice.change == {"module_rules": {"layers.4": torch.float32}}
    assert "module_rules={'layers.4': torch.float32}" in advice.code
    assert report.advice_of("use_bf16")

    fixed, fixed_stats, _, _ = train(Deep, advice.apply_to(FP16), amp.LossScaler(init_scale=2.0**8), steps, shifted)
    reference, _, _, _ = train(Deep, None, 1.0, steps, shifted)
    assert fixed_stats.skipped == 0
    assert_trains_like(fixed, reference)


# --- 2. the attention softmax input overflows --------------------------------------------------
class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        return torch.softmax(scores, dim=-1) @ v


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.attn = Attention(8)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():  # sharp attention: scores beyond fp16's range
            self.attn.q.weight.mul_(150.0)
            self.attn.k.weight.mul_(150.0)

    def forward(self, x):
        return self.head(self.attn(self.inp(x)).mean(1))


XA, YA = batch(0, d_in=8, seq=6)


def tokens(step):
    return (XA * 4.0 if step >= 2 else XA), YA


def test_attention_softmax_input_overflow_named_and_fixed_by_fp32_matmul():
    steps = 7
    losses, stats, report, _ = train(Tiny, FP16, amp.LossScaler(init_scale=2.0**8), steps, tokens, doctor=True)
    assert stats.skipped >= 3
    f = report.first
    assert (f.level, f.direction, f.module, f.op) == ("op", "forward", "attn", "bmm")
    assert f.torch_function is not None and "matmul" in f.torch_function
    assert f.consumer == "_softmax" and f.consumer_module == "attn"  # the softmax input
    assert f.fp32_abs_max > 65504
    op_advice = report.advice_of("op_fp32")[0]
    assert op_advice.change == {"fp32_ops": ("matmul",)}
    assert report.advice_of("module_fp32")[0].change == {"module_rules": {"attn": torch.float32}}

    fixed, fixed_stats, _, _ = train(Tiny, op_advice.apply_to(FP16), amp.LossScaler(init_scale=2.0**8), steps, tokens)
    reference, _, _, _ = train(Tiny, None, 1.0, steps, tokens)
    assert fixed_stats.skipped == 0
    assert_trains_like(fixed, reference)


# --- 3. an overflow in the backward only (a custom autograd function) ---------------------------
class GradBoost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 4096.0  # a custom layer with a huge gradient


class Boost(nn.Module):
    def forward(self, x):
        return GradBoost.apply(x)


class Boosted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 16)
        self.boost = Boost()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.boost(self.fc1(x))))


def fixed_batch(step):
    return X0, Y0


def test_backward_only_overflow_named_and_fixed_by_lower_scale():
    static = amp.LossScaler(init_scale=2.0**10, dynamic=False)
    losses, stats, report, model = train(Boosted, FP16, static, 5, fixed_batch, lr=3e-5, doctor=True)
    assert stats.skipped == 5 and len(set(losses)) == 1  # never trains
    event = report.events[0]
    assert (event.direction, event.module) == ("backward", "boost")
    f = report.first
    assert (f.level, f.direction, f.module, f.op, f.node) == ("op", "backward", "boost", "mul", "GradBoostBackward")
    assert f.outputs[0].nonfinite > 0 and f.inputs[0].nonfinite == 0
    # the first parameter grads to go non-finite: fc1's weight and bias, made by one backward
    # node (autograd accumulates the two in an order it does not define)
    assert set(f.params[:2]) == {"fc1.weight", "fc1.bias"}
    assert not report.advice_of("module_fp32") or report.advice[0].kind == "init_scale"
    advice = report.advice_of("init_scale")[0]
    assert advice.change["dynamic"] is False and advice.change["init_scale"] < 2.0**10
    assert f.fp32_abs_max * advice.change["init_scale"] / f.scale < 65504 / 4

    steps = 10
    fixed, fixed_stats, _, _ = train(Boosted, FP16, advice.scaler(), steps, fixed_batch, lr=3e-5)
    reference, _, _, _ = train(Boosted, None, 1.0, steps, fixed_batch, lr=3e-5)
    assert fixed_stats.skipped == 0
    assert_trains_like(fixed, reference, rtol=1e-2)


class InlineBoost(nn.Module):
    """The custom function applied in the module's own forward, between its children."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(GradBoost.apply(self.fc1(x))))


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = InlineBoost()

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("make, module", [(Wrapped, "body"), (InlineBoost, "")])
def test_backward_overflow_in_a_modules_own_code_is_that_modules(make, module):
    static = amp.LossScaler(init_scale=2.0**10, dynamic=False)
    _, stats, report, _ = train(make, FP16, static, 2, fixed_batch, lr=3e-5, doctor=True)
    assert stats.skipped == 2
    event = report.events[0]
    assert (event.level, event.direction, event.module) == ("module", "backward", module)
    assert "model's output" not in event.summary()
    f = report.first
    assert (f.level, f.direction, f.module, f.op, f.node) == ("op", "backward", module, "mul", "GradBoostBackward")
    assert "in None" not in " ".join(a.evidence for a in report.advice)


def test_a_skipped_step_the_check_never_saw_again_gets_advice():
    static = amp.LossScaler(init_scale=2.0**10, dynamic=False)
    _, stats, report, _ = train(Wrapped, FP16, static, 1, fixed_batch, lr=3e-5, doctor=True)
    assert stats.skipped == 1 and report.checks_run == 0
    kinds = [a.kind for a in report.advice]
    assert kinds == ["module_fp32", "use_bf16", "diagnose"], kinds
    assert report.advice[0].change == {"module_rules": {"body": torch.float32}}
    assert "nothing overflowed" not in report.table()


def test_advice_none_says_why_when_the_skip_did_not_recur():
    def data(step):  # one batch with huge targets: its grads overflow at the first scale only
        x, y = batch(step)
        return x, (y * 1e3 if step == 0 else y)

    _, stats, report, _ = train(Mlp, FP16, amp.LossScaler(init_scale=2.0**16), 4, data, lr=1e-3, doctor=True)
    assert stats.skipped == 1 and [e.recurred for e in report.events] == [False] and report.advice == []
    table = report.table()
    assert "Advice: none needed (1 skipped step(s) did not recur" in table and "nothing overflowed" not in table


# --- 4. grads vanish in fp16 without loss scaling ----------------------------------------------
class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


WEIGHT = 1e-7  # a loss term weighted down (grads ~1e-8: below fp16's 6e-8)


def test_underflow_without_scaling_named_and_fixed_by_loss_scale():
    kw = dict(lr=0.05 / WEIGHT, loss_scale_fn=WEIGHT)
    losses, stats, report, _ = train(Mlp, FP16, 1.0, 4, fixed_batch, doctor=True, **kw)
    assert stats.skipped == 0 and len(set(losses)) == 1  # every grad flushed to zero: no training
    assert report.margins and max(m.zeros for m in report.margins) == 1.0
    f = report.findings[0]
    assert f.kind == "underflow" and f.level == "op"
    flushed, _, nonzero = map(sum, zip(*f.flushed.values()))
    assert nonzero > 0 and flushed == nonzero
    lo, hi = f.magnitude_range
    assert hi < 6e-8  # the fp32 values all lie below fp16's smallest subnormal
    advice = report.advice_of("init_scale")[0]
    assert advice.change["init_scale"] >= 2.0**16 and "raise" in advice.title

    steps = 8
    fixed, fixed_stats, _, _ = train(Mlp, FP16, advice.scaler(), steps, fixed_batch, **kw)
    reference, _, _, _ = train(Mlp, None, 1.0, steps, fixed_batch, **kw)
    assert fixed_stats.skipped == 0
    assert_trains_like(fixed, reference, rtol=1e-2)


# --- 5. clipping while the grads are still scaled ------------------------------------------------
class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def clip(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def unscale_then(fn):
    def step(model, opt):
        amp.unscale(opt)
        fn(model, opt)

    return step


def test_clip_before_unscale_is_right_with_the_gradient_path():
    """ampkit's gradient path unscales grads when backward ends, so a loop that clips
    before amp.unscale clips real grads: it trains like fp32 and the doctor stays
    quiet. (Where grads do stay scaled -- FSDP2's sharded parameters, gradient hooks --
    the doctor flags it: see the FSDP2 and gradient-hook tests.)"""
    steps = 6
    with warnings.catch_warnings():
        warnings.simplefilter("error", DoctorWarning)
        losses, _, report, _ = train(Small, FP16, amp.LossScaler(init_scale=2.0**12), steps, fixed_batch,
                                     lr=0.1, before_step=clip, doctor=True)
    reference, _, _, _ = train(Small, None, 1.0, steps, fixed_batch, lr=0.1, before_step=clip)
    assert report.misuse == [] and report.advice == []
    assert_trains_like(losses, reference)


def test_clamp_in_gradient_hook_detected_and_fixed():
    """A clamp in a Tensor.register_hook sees S*g under any gradient path."""

    def hooked():
        model = Small()
        for p in model.parameters():
            p.register_hook(lambda g: g.clamp(-0.01, 0.01))
        return model

    steps = 6
    with pytest.warns(DoctorWarning, match="has a gradient hook"):
        losses, _, report, _ = train(hooked, FP16, amp.LossScaler(init_scale=2.0**12), steps, fixed_batch,
                                     lr=0.5, doctor=True)
    reference, _, _, _ = train(hooked, None, 1.0, steps, fixed_batch, lr=0.5)
    assert losses[-1] > reference[-1] * 1.05  # the clamp bit 4096x harder than intended
    assert [m.kind for m in report.misuse] == ["grad_hook_sees_scaled_grads"]
    advice = report.advice_of("clip_after_backward")[0]
    assert "clip_grad_value_" in advice.code

    def clip_value(model, opt):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)

    fixed, _, _, _ = train(Small, FP16, amp.LossScaler(init_scale=2.0**12), steps, fixed_batch, lr=0.5,
                           before_step=unscale_then(clip_value))
    assert_trains_like(fixed, reference)


# --- misuse ------------------------------------------------------------------------------------
def _bf16_setup(level="O1"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt


def _kinds(doc):
    return [m.kind for m in doc.report().misuse]


def test_loss_scaled_twice_warns():
    model, opt = _bf16_setup()
    amp.init_trainer(opt, scaler=2.0**4)
    with amp.doctor(opt) as doc, pytest.warns(DoctorWarning, match="already multiplied by a loss scale"):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled, amp.scale_loss(scaled, opt) as twice:
            twice.backward()
        opt.step()
    assert _kinds(doc) == ["loss_scaled_twice"]


def test_step_without_scale_loss_warns():
    model, opt = _bf16_setup()
    amp.init_trainer(opt, scaler=2.0**4)
    with amp.doctor(opt) as doc, pytest.warns(DoctorWarning, match="outside ampkit.scale_loss"):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    assert _kinds(doc) == ["step_without_scale_loss"]
    assert doc.report().advice_of("scale_loss")


def test_two_backward_passes_one_scale_loss_warns():
    model, opt = _bf16_setup()
    amp.init_trainer(opt, scaler=2.0**4)
    with amp.doctor(opt) as doc, pytest.warns(DoctorWarning, match="more backward passes"):
        x = torch.randn(4, 8)
        with amp.scale_loss(model(x).pow(2).mean(), opt) as scaled:
            scaled.backward()
        model(x).abs().mean().backward()  # a second loss, never scaled
        opt.step()
    assert _kinds(doc) == ["two_backward_one_scale_loss"]
    # accumulation with one scale_loss per micro-batch is fine
    with amp.doctor(opt) as doc:
        for _ in range(2):
            with amp.scale_loss(model(torch.randn(4, 8)).pow(2).mean(), opt) as scaled:
                scaled.backward()
        opt.step()
    assert _kinds(doc) == []


def test_o2_masters_out_of_sync_warns():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16)

    def step():
        with amp.scale_loss(model(torch.randn(4, 8)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()

    with amp.doctor(opt) as doc:
        step()
        assert _kinds(doc) == []
        with torch.no_grad():
            model[0].weight.data.mul_(0.5)  # edited behind the masters' back
        with pytest.warns(DoctorWarning, match="differ from their fp32 masters"):
            step()
    [misuse] = doc.report().misuse
    assert misuse.kind == "masters_out_of_sync" and misuse.details["params"] == ["0.weight"]


# --- switches, hooks, reports --------------------------------------------------------------------
def _global_hook_counts():
    mod = nn.modules.module
    return len(mod._global_forward_pre_hooks), len(mod._global_forward_hooks)


def test_off_installs_nothing_and_stop_removes_everything(monkeypatch):
    monkeypatch.delenv("AMPKIT_DOCTOR", raising=False)
    before = _global_hook_counts()
    model, opt = _bf16_setup()
    amp.init_trainer(opt)
    state = amp.trainer.managed_state(opt)
    hooks = state.extensions

    def param_hooks():
        return [(len(p._backward_hooks or {}), len(p._post_accumulate_grad_hooks or {})) for p in model.parameters()]

    own = param_hooks()  # ampkit's gradient path may hook parameters itself
    assert current() is None and global_extensions() == ()
    assert _global_hook_counts() == before
    with amp.doctor(opt):
        assert _global_hook_counts() == (before[0] + 1, before[1] + 1)
        with amp.scale_loss(model(torch.randn(4, 8)).pow(2).mean(), opt) as scaled:
            scaled.backward()
        assert [h[0] for h in param_hooks()] == [n + 1 for n, _ in own]
        opt.step()
    assert _global_hook_counts() == before
    assert global_extensions() == ()
    assert param_hooks() == own
    assert state.extensions == hooks


def test_init_trainer_flag_and_env_switch(monkeypatch):
    model, opt = _bf16_setup()
    amp.init_trainer(opt, doctor=True)
    doc = current()
    assert doc is not None and doc.running
    amp.reset()
    assert current() is None and not doc.running
    monkeypatch.setenv("AMPKIT_DOCTOR", "1")
    model, opt = _bf16_setup()
    amp.init_trainer(opt)
    assert current() is not None and current().running
    amp.reset()
    monkeypatch.setenv("AMPKIT_DOCTOR", "0")
    amp.init_trainer(_bf16_setup()[1])
    assert current() is None
    with pytest.raises(amp.StateError, match="doctor must be"):
        amp.init_trainer(_bf16_setup()[1], doctor="yes")
    with pytest.raises(amp.StateError, match="not managed"):
        amp.doctor(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))
    amp.reset()
    with pytest.raises(amp.StateError, match="no optimizer is managed"):
        amp.doctor().start()


def test_report_formats_and_diagnose(tmp_path):
    model, opt = _bf16_setup()
    amp.init_trainer(opt, scaler=2.0**8)
    with amp.doctor(opt) as doc:
        for step in range(3):
            x = torch.randn(4, 8) * (1e6 if step == 1 else 1.0)
            with amp.autocast(FP16, device_type="cpu"):
                loss = model(x).float().pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()

        def replay():  # the batch that failed, on demand
            with amp.autocast(FP16, device_type="cpu"):
                model(torch.full((4, 8), 1e6)).float().pow(2).mean().backward()

        finding = doc.diagnose(replay)
        opt.zero_grad()
    assert (finding.level, finding.direction, finding.module, finding.op) == ("op", "forward", "0", "_to_copy")
    assert finding.fp32_abs_max == pytest.approx(1e6)  # the input cast to fp16 overflowed
    report = doc.report()
    assert report.steps == 3 and report.skipped == 1 and report.dtype == "fp16"
    assert [p.skipped for p in report.history] == [False, True, False]
    data = json.loads(report.to_json(tmp_path / "r.json"))
    assert data == json.loads((tmp_path / "r.json").read_text())
    assert data["findings"][-1]["op"] == "_to_copy" and data["events"][0]["module"] == "0"
    text = str(report)
    assert "Margins" in text and "Advice" in text and "module_rules={'0': torch.float32}" in text
    pytest.importorskip("matplotlib")
    png = report.save_png(tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


SCRIPT = """
import sys, torch, ampkit as amp
from torch import nn
torch.manual_seed(0)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
amp.init_trainer(opt, scaler=2.0**8)
for step in range(3):
    x = torch.randn(4, 8) * (1e6 if step == 1 else 1.0)
    with amp.autocast(amp.Policy(dtype=torch.float16), device_type="cpu"):
        loss = model(x).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
print("args", sys.argv[1:])
sys.exit(int(sys.argv[1]))
"""


def test_cli_runs_script_prints_report_and_passes_exit_code(tmp_path, capsys):
    from ampkit.tools.cli.main import main

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    code = main(["doctor", "--json", str(tmp_path / "r.json"), str(script), "3", "--steps", "5"])
    out = capsys.readouterr().out
    assert code == 3
    assert "args ['3', '--steps', '5']" in out
    assert "ampkit doctor: 3 steps, 1 skipped" in out
    assert json.loads((tmp_path / "r.json").read_text())["skipped"] == 1
    assert current() is None  # stopped when the script ended

    assert main(["doctor", str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file" in err[0]
    assert main(["doctor"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# --- multi-process -------------------------------------------------------------------------------
@pytest.mark.distributed
def test_ddp_rank0_reports_the_rank_where_the_overflow_appeared(tmp_path):
    import _doctor_workers as workers

    ranks = workers.launch("ddp", tmp_path, world_size=2)
    assert ranks[0]["stats"] == ranks[1]["stats"]  # both ranks skipped the same steps
    report = ranks[0]["report"]
    assert report["skipped"] == 2
    first = report["events"][0]
    assert (first["step"], first["direction"], first["module"], first["ranks"]) == (3, "forward", "0", [1])
    assert first["recurred"] is True
    [finding] = report["findings"]  # found by rank 1's op-level check, reported on rank 0
    assert (finding["level"], finding["direction"], finding["module"], finding["op"]) == ("op", "forward", "0", "addmm")
    assert finding["ranks"] == [1] and finding["fp32_abs_max"] > 65504


@pytest.mark.distributed
def test_clip_before_unscale_on_fsdp2_detected_and_fixed(tmp_path):
    """FSDP2's sharded grads stay scaled until the step (ampkit's gradient path does not
    hook them): clip_grad_norm_ before amp.unscale clips S*g."""
    import _doctor_workers as workers

    [res] = workers.launch("fsdp_clip", tmp_path, world_size=1)
    assert res["misused"][-1] > 0.99 * res["misused"][0]  # the update is ~1/scale too small
    [misuse] = res["misuse"]
    assert misuse["kind"] == "clip_before_unscale" and misuse["details"]["scale"] == 2.0**12
    assert misuse["details"]["norm_after"] == pytest.approx(1.0 / 2.0**12, rel=1e-3)
    [advice] = [a for a in res["advice"] if a["kind"] == "unscale_before_clip"]
    assert advice["code"].splitlines()[0] == "amp.unscale(optimizer)"
    assert_trains_like(res["fixed"], res["reference"])  # the advice applied


def test_example_demo_report_and_fix(capsys):
    """examples/doctor_demo.py under `ampkit doctor` names the attention's score matmul;
    with --fix (the advice) it trains without a skipped step."""

    from ampkit.tools.cli.main import main

    demo = ROOT / "examples" / "doctor_demo.py"
    assert main(["doctor", str(demo), "--steps", "24"]) == 0
    out = capsys.readouterr().out
    assert "first non-finite value at blocks.1.attn (Attention), op bmm, forward" in out
    assert "module_rules={'blocks.1.attn': torch.float32}" in out
    assert main(["doctor", str(demo), "--steps", "24", "--fix"]) == 0
    out = capsys.readouterr().out
    assert "24 steps, 0 skipped" in out and "Advice: none" in out


# --- masks: -inf on purpose is no overflow -------------------------------------------------------
class CausalAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(16, 48)
        self.mlp = nn.Sequential(nn.Linear(16, 16))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # a -inf mask inside (where)
        return self.out(self.mlp(h)).mean(1)


def test_a_causal_attention_mask_is_not_taken_for_the_overflow():
    """The causal mask of scaled_dot_product_attention (``where(mask, 0, -inf)``, then
    added to the scores) holds -inf by design: the op-level check names the layer that
    really overflows, not the mask's ``where``."""
    model = CausalAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with amp.doctor(opt, every=1) as doc:
            for step in range(3):
                hook = model.mlp[0].register_forward_hook(lambda m, a, out: out * 1e6) if step >= 1 else None
                x, y = torch.randn(2, 6, 16, generator=g), torch.randn(2, 4, generator=g)
                with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
                    scaled.backward()
                opt.step()
                opt.zero_grad()
                if hook is not None:
                    hook.remove()
    report = doc.report()
    amp.reset()
    assert amp_skipped(report) == 2
    assert [(f.module, f.op, f.kind) for f in report.findings] == [("mlp", "mul", "overflow")]


def amp_skipped(report) -> int:
    return report.to_dict()["skipped"]
