"""``ampkit.tune``: a per-module precision plan measured on this device.

The model has a layer known to break in 16 bits (its outputs sit on a large offset that
the next op removes: bf16's 8-bit mantissa loses the signal). The decisions are tested with the
measured sensitivities and probes of this CPU and with module times fixed (16 bits twice
as fast), so that they do not depend on whether this CPU computes bf16 natively; the
timing itself is tested for what it returns, not for speed (speed is the benchmark's)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit.tools.tune import measure
from ampkit.tools.tune.plan import PlanError, TunePlan

BUDGET = 0.01


class Offset(nn.Module):
    """A linear map whose outputs sit on a large offset (its bias starts at 1000) that the
    next op removes: in bf16 (8 bits of mantissa) the offset leaves steps of 4-8, and the
    signal, of size 1, is lost."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        with torch.no_grad():
            self.lin.bias.fill_(1000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) - 1000.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32), Offset(32),
                         nn.Linear(32, 10))  # fmt: skip


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(256, 32, generator=g), torch.randn(32, 10, generator=g)
    y = (x @ w + 4 * torch.randn(256, 10, generator=g)).argmax(1)  # noisy labels: the loss levels off
    return [(x[i : i + 32], y[i : i + 32]) for i in range(0, 256, 32)]


@pytest.fixture
def fixed_times(monkeypatch):
    """Every module 1 ms in fp32 and 0.5 ms in 16 bits."""
    real = measure.module_times

    def halved(model, modules, *args, **kwargs):
        out = real(model, modules, *args, **kwargs)
        return {n: {k: (1.0 if k == "fp32" else 0.5) for k in t} for n, t in out.items()}

    monkeypatch.setattr(measure, "module_times", halved)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _tune(**kw) -> TunePlan:
    kw.setdefault("include_emulated", True)
    kw.setdefault("optimizer", _sgd)
    kw.setdefault("candidates", ("bf16",))
    kw.setdefault("budget", BUDGET)
    return amp.tune(_model(), _batches(), nn.functional.cross_entropy, **kw)


def _train(policy, steps: int = 40) -> float:
    """Mean loss of the last 10 of ``steps`` SGD steps through ``initialize`` (O1) with
    ``policy`` (None: fp32)."""
    model = _model()
    opt = _sgd(model.parameters())
    if policy is not None:
        model, opt = amp.initialize(model, opt, opt_level="O1", policy=policy)
    losses = []
    try:
        for step in range(steps):
            x, y = _batches()[step % 8]
            loss = nn.functional.cross_entropy(model(x), y)
            if policy is None:
                loss.backward()
            else:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    finally:
        amp.reset()
    return sum(losses[-10:]) / 10


def test_the_plan_keeps_the_breaking_block_wide_lowers_the_rest_and_trains_within_budget(fixed_times):
    plan = _tune()
    assert plan.dtype == "bf16"
    assert plan.kept_fp32 == ["4.lin"], plan.report()
    assert {"0", "3", "5"} <= set(plan.lowered), plan.report()
    by = {m.name: m for m in plan.modules}
    assert "gradient moves" in by["4.lin"].reason and by["4.lin"].grad_deviation > 0.1
    assert plan.probe["deviation"] <= BUDGET < plan.probe["uniform_deviation"], plan.probe
    # Trained through initialize, as a user would: the plan within budget, lowering everything not.
    fp32 = _train(None)
    planned = _train(plan.policy())
    uniform = _train(amp.default_policy("cpu", torch.bfloat16))
    assert abs(planned - fp32) / fp32 <= BUDGET < abs(uniform - fp32) / fp32, (fp32, planned, uniform)


def test_the_plans_policy_runs_kept_modules_in_fp32_and_the_rest_in_bf16(fixed_times):
    plan = _tune()
    model = _model()
    seen = {}
    for name, m in model.named_modules():
        if name in ("0", "4.lin", "5"):
            m.register_forward_hook(lambda mod, a, out, name=name: seen.__setitem__(name, out.dtype))
    with amp.autocast(plan.policy(), "cpu"):
        model(_batches()[0][0])
    assert seen == {"0": torch.bfloat16, "4.lin": torch.float32, "5": torch.bfloat16}


def test_a_probe_over_budget_puts_the_most_sensitive_module_back(fixed_times):
    """With the gradient guard off and a budget the breaking layer's loss deviation fits,
    the prediction lets it through; the probe catches it and puts it back first."""
    plan = _tune(grad_limit=1e9, max_backoffs=6, budget=0.05)
    dev = {m.name: m.loss_deviation for m in plan.modules}
    assert max(dev, key=dev.get) == "4.lin"
    assert plan.backed_off == ("4.lin",) and plan.probe["deviation"] <= 0.05, plan.report()
    assert plan.lowered == ["0", "2", "3", "5"]


def test_the_users_model_and_rng_are_left_as_they_were():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    amp.tune(model, _batches()[:2], nn.functional.cross_entropy, include_emulated=True, candidates=("bf16",),
             probe_steps=2, repeats=1)  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_module_times_are_measured_for_every_module_and_dtype():
    model = _model()
    mods = measure.candidate_modules(model)
    assert [n for n, _ in mods] == ["0", "2", "3", "4.lin", "5"]
    times = measure.module_times(model, mods, _batches()[0], nn.functional.cross_entropy, ["bf16"], "cpu", 2,
                                 math.inf)  # fmt: skip
    assert set(times) == {n for n, _ in mods}
    assert all(set(t) == {"fp32", "bf16"} and all(0 < v < 1e3 for v in t.values()) for t in times.values())
    assert all(p.grad is None for p in model.parameters())


def test_dtypes_this_cpu_emulates_are_skipped_with_why(monkeypatch):
    from ampkit._internal import torch_compat

    monkeypatch.setattr(torch_compat, "cpu_has_native_16bit", lambda dtype: False)
    plan = amp.tune(_model(), _batches()[:2], nn.functional.cross_entropy, probe_steps=2, repeats=1)
    assert plan.dtype == "fp32" and plan.lowered == []
    assert set(plan.skipped) == {"bf16", "fp16", "fp8"}
    assert "emulates bf16" in plan.skipped["bf16"] and "AMX-FP16" in plan.skipped["fp16"]
    assert all(m.reason == "no 16-bit dtype to try here" for m in plan.modules)


def test_max_seconds_bounds_the_measuring():
    plan = _tune(max_seconds=0.0, probe_steps=2)
    assert plan.lowered == []
    assert all(m.reason == "not measured within max_seconds" for m in plan.modules)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"batches": []}, "non-empty list"),
        ({"budget": 0.0}, "positive relative"),
        ({"budget": math.nan}, "positive relative"),
        ({"candidates": ("int8",)}, "choose from"),
        ({"probe_steps": 0}, "at least 1"),
        ({"model": nn.Sequential(nn.ReLU())}, "nothing to tune"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_measured(kw, needle, monkeypatch):
    monkeypatch.setattr(measure, "module_times", lambda *a, **k: pytest.fail("measured"))
    args = {"model": _model(), "batches": _batches()}
    args.update({k: kw.pop(k) for k in ("model", "batches") if k in kw})
    with pytest.raises(amp.AmpError, match=needle):
        amp.tune(args["model"], args["batches"], nn.functional.cross_entropy, **kw)


def test_the_plan_round_trips_through_json(tmp_path, fixed_times):
    plan = _tune(probe_steps=4)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = TunePlan.load(path)
    assert again == plan
    assert again.policy().module_rules == plan.policy().module_rules
    again.check_model(_model())
    with pytest.raises(PlanError, match="does not have"):
        again.check_model(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: d.update(format="other"), "not an ampkit tuning plan"),
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d.update(dtype="int8"), "dtype 'int8'"),
        (lambda d: d.pop("modules"), "'modules' is missing"),
        (lambda d: d.update(budget="x"), "budget is str"),
        (lambda d: d["modules"][0].update(fp32_ms=[1]), "fp32_ms is \\[1\\]"),
        (lambda d: d["modules"].append(dict(d["modules"][0])), "named twice"),
        (lambda d: d["modules"][0].update(dtype="fp16"), "neither fp32 nor"),
        (lambda d: d["modules"].__setitem__(0, "x"), "not an object"),
    ],
)
def test_malformed_plans_are_refused_naming_the_field(tmp_path, fixed_times, edit, needle):
    doc = _tune(probe_steps=2).to_dict()
    edit(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=needle):
        TunePlan.load(path)


def test_missing_and_truncated_plan_files_are_refused(tmp_path, fixed_times):
    with pytest.raises(PlanError, match="cannot read"):
        TunePlan.load(tmp_path / "none.json")
    path = tmp_path / "plan.json"
    _tune(probe_steps=2).save(path)
    path.write_text(path.read_text()[:50])
    with pytest.raises(PlanError, match="truncated"):
        TunePlan.load(path)
