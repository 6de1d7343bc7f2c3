"""``ampkit.tune``: a per-module precision plan measured on this device.

The model has a layer known to break in 16 bits (its outputs sit on a large offset that
the next op removes: bf16's 8-bit mantissa loses the signal). The decisions are tested with the
measured sensitivities and probes of this CPU and with module times fixed (16 bits twice
as fast), so that they do not depend on whether this CPU computes bf16 natively; the
timing itself is tested for what it returns, not for speed (speed is the benchmark's)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import stat
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit.levels.precision_plan import PLAN_READ_LIMIT, PlanError, TunePlan
from ampkit.tools.tune import measure, search

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


#: Fixed step times of the probes, by level (None: fp32), in ms.
PROBE_MS = {None: 1.0, "O1": 0.5, "O2": 0.6, "O2K": 0.7, "all_faster_by": 0.05}


@pytest.fixture
def fixed_times(monkeypatch):
    """Every module 1 ms in fp32 and 0.5 ms in 16 bits; probe steps as ``PROBE_MS`` says
    (the losses are the real ones)."""
    real = measure.module_times

    def halved(model, modules, *args, **kwargs):
        out = real(model, modules, *args, **kwargs)
        return {n: {k: (1.0 if k == "fp32" else 0.5) for k in t} for n, t in out.items()}

    monkeypatch.setattr(measure, "module_times", halved)
    real_probe = search.probe
    times = dict(PROBE_MS)

    def probe(model, batches, loss_fn, level, **kw):
        ms = times[level] - (times["all_faster_by"] if level and not kw["kept"] else 0.0)
        return dataclasses.replace(real_probe(model, batches, loss_fn, level, **kw), step_ms=ms)

    monkeypatch.setattr(search, "probe", probe)
    return times


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _tune(**kw) -> TunePlan:
    kw.setdefault("include_emulated", True)
    kw.setdefault("optimizer", _sgd)
    kw.setdefault("candidates", ("bf16",))
    kw.setdefault("budget", BUDGET)
    return amp.tune(_model(), _batches(), nn.functional.cross_entropy, **kw)


def _train(how, steps: int = 40) -> float:
    """Mean loss of the last 10 of ``steps`` SGD steps: fp32 (``how`` None), through
    ``initialize(plan=how)`` (a plan) or at O1 everything lowered (``how="O1"``)."""
    model = _model()
    opt = _sgd(model.parameters())
    if isinstance(how, TunePlan):
        model, opt = amp.initialize(model, opt, plan=how)
    elif how is not None:
        model, opt = amp.initialize(model, opt, opt_level=how)
    losses = []
    try:
        for step in range(steps):
            x, y = _batches()[step % 8]
            loss = nn.functional.cross_entropy(model(x), y)
            if how is None:
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
    assert plan.dtype == "bf16" and plan.level == "O1"  # the fastest level within budget
    assert plan.kept_fp32 == ["4.lin"], plan.report()
    assert {"0", "3", "5"} <= set(plan.lowered), plan.report()
    by = {m.name: m for m in plan.modules}
    assert "gradient moves" in by["4.lin"].reason and by["4.lin"].grad_deviation > 0.1
    assert plan.probe["deviation"] <= BUDGET < plan.probe["uniform_deviation"], plan.probe
    assert {"O1_ms", "O2_ms", "O2K_ms", "fp32_ms"} <= set(plan.probe)
    # Trained through initialize(plan=), as a user would: within budget; lowering everything not.
    fp32 = _train(None)
    planned = _train(plan)
    uniform = _train("O1")
    assert abs(planned - fp32) / fp32 <= BUDGET < abs(uniform - fp32) / fp32, (fp32, planned, uniform)


def test_a_faster_level_over_budget_is_not_chosen(fixed_times):
    """O2 and O2K keep ``4.lin``'s weights and matmul in fp32 but hand its output on in
    bf16, which loses the signal again: fastest here, and over the budget."""
    fixed_times.update(O1=0.9, O2=0.5, O2K=0.4)
    plan = _tune()
    assert plan.level == "O1", plan.report()
    assert plan.probe["O2K_loss"] > plan.probe["fp32_loss"] * (1 + BUDGET)


def test_everything_lowered_is_chosen_where_the_probe_finds_it_faster_within_budget(fixed_times):
    """A gradient limit that keeps every module fp32 by its sensitivities alone: the
    probe of everything lowered at the fastest level, within the budget, wins."""
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10))
    plan = amp.tune(model, _batches(), nn.functional.cross_entropy, budget=BUDGET, candidates=("bf16",),
                    include_emulated=True, optimizer=_sgd, grad_limit=0.0)  # fmt: skip
    assert plan.level == "O1" and plan.kept_fp32 == [], plan.report()
    assert all(m.dtype == "bf16" for m in plan.modules)
    assert any("everything in bf16 at O1" in m.reason for m in plan.modules)  # those the gradient limit kept
    assert plan.probe["plan_ms"] == plan.probe["all_O1_ms"] == PROBE_MS["O1"] - PROBE_MS["all_faster_by"]


def test_a_plan_at_a_cast_level_keeps_its_modules_weights_in_fp32(fixed_times):
    fixed_times["all_faster_by"] = -0.05  # (short probes: lowering everything must not win)
    doc = _tune(probe_steps=4).to_dict()
    doc["level"] = "O2K"
    plan = TunePlan.from_dict(doc)
    assert plan.keep_fp32 == ["4.lin"]
    model = _model()
    model, _ = amp.initialize(model, _sgd(model.parameters()), plan=plan)
    try:
        assert model[4].lin.weight.dtype == torch.float32 and model[3].weight.dtype == torch.bfloat16
    finally:
        amp.reset()
    # a rule of the caller's own beside the plan's: one string or class, or a list
    for own in ("0", nn.Linear, ["0"]):
        model = _model()
        model, _ = amp.initialize(model, _sgd(model.parameters()), plan=plan, keep_fp32=own)
        try:
            assert model[4].lin.weight.dtype == torch.float32 and model[0].weight.dtype == torch.float32
        finally:
            amp.reset()


def test_a_plan_slower_than_fp32_end_to_end_runs_at_o0(fixed_times):
    fixed_times.update(O1=1.5, O2=1.5, O2K=1.5)
    plan = _tune()
    assert plan.level == "O0" and plan.lowered == []
    assert all("fp32 end to end is faster" in m.reason for m in plan.modules if m.name != "4.lin")


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
    seen.clear()
    amp.init(plan=plan)  # the same through init, the dtype taken from the plan
    try:
        model(_batches()[0][0])
    finally:
        amp.reset()
    assert seen == {"0": torch.bfloat16, "4.lin": torch.float32, "5": torch.bfloat16}


def test_initialize_and_init_take_a_saved_plan_and_refuse_a_mismatch(tmp_path, fixed_times):
    plan = _tune(probe_steps=4)
    path = tmp_path / "plan.json"
    plan.save(path)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlanError, match="lowers modules to bf16, and dtype=torch.float16"):
        amp.initialize(model, _sgd(model.parameters()), plan=str(path), dtype=torch.float16)
    with pytest.raises(PlanError, match="lowers modules to bf16"):
        amp.init(torch.float16, plan=path)
    with pytest.raises(PlanError, match="do not have"):
        amp.initialize(nn.Sequential(nn.Linear(32, 10)), plan=path)
    with pytest.raises(PlanError, match="not JSON"):
        path.write_text("{")
        amp.initialize(model, _sgd(model.parameters()), plan=path)
    assert not amp.is_active() and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tune_refuses_to_run_inside_a_session():
    amp.init()
    try:
        with pytest.raises(amp.StateError, match="before ampkit.init"):
            amp.tune(_model(), _batches(), nn.functional.cross_entropy)
    finally:
        amp.reset()


def test_a_probe_over_budget_puts_the_most_sensitive_module_back(fixed_times):
    """With the gradient guard off and a budget the breaking layer's loss deviation fits,
    the prediction lets it through; the probe (at O1) catches it and puts it back first."""
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
        ({"budget": True}, "positive relative"),
        ({"candidates": ("int8",)}, "choose from"),
        ({"probe_steps": 0}, "at least 1"),
        ({"probe_steps": True}, "at least 1"),
        ({"model": nn.Sequential(nn.ReLU())}, "nothing to tune"),
        ({"repeats": 0}, "repeats 0: an integer of at least 1"),
        ({"max_backoffs": -1}, "max_backoffs -1"),
        ({"grad_limit": -0.1}, "grad_limit -0.1: a relative gradient change >= 0"),
        ({"fp8_grad_limit": math.nan}, "fp8_grad_limit nan"),
        ({"max_seconds": -1.0}, "max_seconds -1.0: a number of seconds >= 0"),
        ({"max_seconds": "60"}, "max_seconds '60'"),
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
        (lambda d: d["modules"][0].update(dtype="fp16"), "neither fp32, fp8 nor"),
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


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"budget": math.nan}, "budget is nan"),
        ({"budget": -1}, "budget is -1"),
        ({"budget": "inf"}, "budget is str, not a number"),
        ({"seconds": math.inf}, "seconds is inf"),
        ({"seconds": -0.5}, "seconds is -0.5"),
        ({"version": 1.0}, "version 1.0"),
        ({"version": True}, "version True"),
        ({"device_type": "../../etc"}, "device_type '../../etc'; one of cpu, cuda"),
        ({"device_type": "meta"}, "device_type 'meta'; one of cpu, cuda"),
        ({"modules": [{"name": "", "kind": "", "dtype": "bf16", "fp32_ms": 1.0, "low_ms": 1.0, "loss_deviation": 0.0,
                       "grad_deviation": 0.0, "reason": ""}]}, "module's name is empty"),  # fmt: skip
    ],
)
def test_plan_values_no_tuner_writes_are_refused_in_one_line(tmp_path, edit, needle):
    doc = {**TunePlan.by_hand(["0"], ["2"], level="O2").to_dict(), **edit}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    for load in (lambda: TunePlan.load(path), lambda: TunePlan.from_dict(json.loads(path.read_text()))):
        with pytest.raises(PlanError, match=needle) as info:
            load()
        assert "\n" not in str(info.value)


def test_plans_for_each_device_with_zero_budget_and_time_still_load(tmp_path):
    for device_type in ("cpu", "cuda"):
        plan = TunePlan.by_hand(["0"], ["2"], level="O2", device_type=device_type)
        assert (plan.budget, plan.seconds) == (0.0, 0.0)
        plan.save(tmp_path / "plan.json")
        assert TunePlan.load(tmp_path / "plan.json").to_dict() == plan.to_dict()  # NaN times: compare as written


def test_missing_and_truncated_plan_files_are_refused(tmp_path, fixed_times):
    with pytest.raises(PlanError, match="cannot read"):
        TunePlan.load(tmp_path / "none.json")
    path = tmp_path / "plan.json"
    _tune(probe_steps=2).save(path)
    path.write_text(path.read_text()[:50])
    with pytest.raises(PlanError, match="truncated"):
        TunePlan.load(path)


def _quickly(fn, seconds: float = 10.0):
    """``fn()``'s exception (None if it returned), failing the test where it is still
    running after ``seconds`` (a read blocked on a FIFO)."""
    box: dict = {}

    def call() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return box.get("error")


def _plan_doc() -> dict:
    """A plan for :func:`_model`, as its JSON file holds it."""
    return TunePlan.by_hand(["0", "5"], ["4.lin"]).to_dict()


#: A hostile plan file: how to make it at a path, and what the one-line PlanError says.
HOSTILE_PLANS = {
    "binary": (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe"), "is not text"),
    "nested": (lambda p: p.write_bytes(b"[" * 200_000 + b"]" * 200_000), "nested too deeply"),
    "truncated": (lambda p: p.write_text(json.dumps(_plan_doc())[:60]), "not JSON"),
    "machine not an object": (lambda p: p.write_text(json.dumps({**_plan_doc(), "machine": "ab"})),
                              "machine is 'ab', not an object"),
    "machine entry an object": (lambda p: p.write_text(json.dumps({**_plan_doc(), "machine": {"torch": {"a": 1}}})),
                                "machine\\['torch'\\] is \\{'a': 1\\}"),
    "skipped not text": (lambda p: p.write_text(json.dumps({**_plan_doc(), "skipped": {"fp8": 3}})),
                         "skipped\\['fp8'\\] is 3, not a string"),
    "probe not a number": (lambda p: p.write_text(json.dumps({**_plan_doc(), "probe": {"a\nb": "x"}})),
                           "probe\\['a\\\\nb'\\] is 'x', not a number"),
    "backed_off not names": (lambda p: p.write_text(json.dumps({**_plan_doc(), "backed_off": [[1]]})),
                             "an entry of backed_off is \\[1\\], not a string"),
    "fifo": (os.mkfifo, "it is a FIFO"),
    "dev zero": (lambda p: p.symlink_to("/dev/zero"), "it is a character device"),
    "folder": (lambda p: p.mkdir(), "it is a folder"),
    "oversize": (lambda p: p.write_bytes(b" " * (PLAN_READ_LIMIT + 1)), "larger than"),
}


@pytest.mark.parametrize("kind", list(HOSTILE_PLANS))
def test_hostile_plan_files_are_one_line_plan_errors(tmp_path, kind):
    make, needle = HOSTILE_PLANS[kind]
    path = tmp_path / "plan.json"
    make(path)
    error = _quickly(lambda: TunePlan.load(path))
    assert isinstance(error, PlanError), error
    assert re.search(needle, str(error)) and "\n" not in str(error), str(error)


@pytest.mark.parametrize("kind", ["binary", "nested", "truncated", "machine not an object", "fifo", "dev zero"])
def test_hostile_plan_files_are_refused_by_initialize_and_init_untouched(tmp_path, kind):
    make, needle = HOSTILE_PLANS[kind]
    path = tmp_path / "plan.json"
    make(path)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for call in (lambda: amp.initialize(model, _sgd(model.parameters()), plan=path), lambda: amp.init(plan=str(path))):
        error = _quickly(call)
        assert isinstance(error, PlanError) and re.search(needle, str(error)), error
    assert not amp.is_active() and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_plan_is_saved_through_the_safe_writer(tmp_path):
    """A FIFO, a symlink to another file or a folder at the plan's name is refused (and
    left as it was); a regular file is replaced whole."""
    plan = TunePlan.by_hand(["0"], [])
    victim = tmp_path / "victim.json"
    victim.write_text("mine")
    fifo, link = tmp_path / "fifo.json", tmp_path / "link.json"
    os.mkfifo(fifo)
    link.symlink_to(victim)
    for save in (plan.save, plan.save_png):
        for path, needle in ((fifo, "FIFO"), (link, "symbolic link"), (tmp_path, "folder")):
            error = _quickly(lambda path=path, save=save: save(path))
            assert isinstance(error, amp.OutputPathError) and needle in str(error), error
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.path.islink(link) and victim.read_text() == "mine"
    plan.save(victim)
    assert TunePlan.load(victim).lowered == ["0"] and not os.path.islink(victim)
    if importlib.util.find_spec("matplotlib") is not None:
        assert plan.save_png(tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


RUN_SCRIPT = """
import json, sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
seen = {}
for name in ("0", "2"):
    model.get_submodule(name).register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, str(out.dtype)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(4, 8)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("DTYPES", json.dumps(seen), str(model[2].weight.dtype), str(model[0].weight.dtype))
"""


def _run_plan(level: str) -> dict:
    """A plan for RUN_SCRIPT's model: ``0`` lowered to bf16, ``2`` kept fp32, at ``level``."""
    keep = {"name": "2", "kind": "Linear", "dtype": "fp32", "fp32_ms": 1.0, "low_ms": 0.5, "loss_deviation": 0.1,
            "grad_deviation": 0.5, "reason": "test"}  # fmt: skip
    low = dict(keep, name="0", dtype="bf16", loss_deviation=0.0, grad_deviation=0.0)
    return {"format": "ampkit-tune-plan", "version": 1, "dtype": "bf16", "level": level, "device_type": "cpu",
            "budget": 0.01, "modules": [low, keep], "skipped": {}, "predicted_deviation": 0.0, "probe": {},
            "backed_off": [], "seconds": 1.0}  # fmt: skip


@pytest.mark.parametrize(("level", "weights"), [("O1", ("torch.float32", "torch.float32")),
                                                ("O2K", ("torch.float32", "torch.bfloat16"))])  # fmt: skip
def test_ampkit_run_applies_a_saved_plan_to_an_unmodified_script(level, weights, tmp_path, capsys):
    from ampkit.tools.cli.main import main

    script = tmp_path / "train.py"
    script.write_text(RUN_SCRIPT)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_run_plan(level)))
    assert main(["run", "--plan", str(path), str(script)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("DTYPES"))
    seen, kept_w, low_w = line.removeprefix("DTYPES ").rsplit(" ", 2)
    assert json.loads(seen) == {"0": "torch.bfloat16", "2": "torch.float32"}
    assert (kept_w, low_w) == weights


def test_ampkit_run_refuses_a_bad_plan_in_one_line(tmp_path, capsys):
    from ampkit.tools.cli.main import main

    script = tmp_path / "train.py"
    script.write_text(RUN_SCRIPT)
    path = tmp_path / "plan.json"
    path.write_text("{")
    assert main(["run", "--plan", str(path), str(script)]) == 2
    assert "is not JSON" in capsys.readouterr().err
    path.write_text(json.dumps(_run_plan("O1")))
    assert main(["run", "--plan", str(path), "--dtype", "fp16", str(script)]) == 2
    assert "run it with dtype bf16" in capsys.readouterr().err


def test_the_plans_picture_is_written_and_a_bad_path_refused_first(tmp_path, fixed_times):
    plan = _tune(probe_steps=2)
    out = plan.save_png(tmp_path / "plan.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    with pytest.raises(amp.OutputPathError):
        plan.save_png(tmp_path / "missing" / "dir" / "plan.png")


TUNE_SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
class Offset(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)
        with torch.no_grad():
            self.lin.bias.fill_(1000.0)
    def forward(self, x):
        return self.lin(x) - 1000.0
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32), Offset(32), nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(1)
x, w = torch.randn(256, 32, generator=g), torch.randn(32, 10, generator=g)
y = (x @ w + 4 * torch.randn(256, 10, generator=g)).argmax(1)
for step in range(1000):
    i = (step % 8) * 32
    loss = nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ampkit_tune_writes_a_plan_for_an_unmodified_script_that_keeps_the_breaking_layer(tmp_path, capsys):
    """Captured from the script, measured with the outputs standing in for its loss, and
    confirmed by running the script itself: the offset layer stays fp32 (its gradient
    moves alone in bf16), the plan loads and ``ampkit run --plan`` runs the script with it."""
    from ampkit.tools.cli.main import main

    script = tmp_path / "train.py"
    script.write_text(TUNE_SCRIPT)
    out = tmp_path / "plan.json"
    assert main(["tune", "--steps", "8", "--include-emulated", "--out", str(out), str(script)]) == 0
    printed = capsys.readouterr().out
    plan = TunePlan.load(out)
    assert "4.lin" in plan.kept_fp32 and "4.lin" in printed
    assert math.isfinite(plan.probe["fp32_loss"]) and plan.probe["fp32_ms"] > 0
    assert plan.level in ("O0", "O1", "O2", "O2K") and plan.seconds > 0
    assert main(["run", "--plan", str(out), "--steps", "3", str(script)]) == 0


@pytest.mark.parametrize(
    ("script", "argv", "needle"),
    [
        (None, [], "no such file"),
        ("import torch\nx = torch.ones(2)\n", [], "called no module with parameters"),
        ("raise SystemExit(3)\n", [], "exited with code 3"),
        ("x = 1\n", ["--budget", "0"], "--budget"),
        ("x = 1\n", ["--steps", "2"], "at least 4"),
    ],
)
def test_ampkit_tune_refuses_in_one_line(script, argv, needle, tmp_path, capsys):
    from ampkit.tools.cli.main import main

    path = tmp_path / "s.py"
    if script is not None:
        path.write_text(script)
    assert main(["tune", *argv, "--out", str(tmp_path / "p.json"), str(path)]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


MARKER_SCRIPT = "import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('ran')\n"


def _special(tmp_path, kind: str):
    """An output name taken by a FIFO, a symlink to a victim file, a copy of /dev/null's
    node, or one in /proc (root may write there by os.access, never create a file)."""
    path = tmp_path / f"{kind}.out"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        (tmp_path / "victim").write_text("mine")
        path.symlink_to(tmp_path / "victim")
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("making a device node needs root")
    else:
        path = Path("/proc/ampkit-plan.out")
    return path


@pytest.mark.parametrize("flag", ["--out", "--png"])
@pytest.mark.parametrize(("kind", "needle"), [("fifo", "FIFO"), ("symlink", "symbolic link"),
                                              ("device", "character device"), ("proc", "no file can be created")])
def test_ampkit_tune_refuses_a_special_output_before_the_script_runs(flag, kind, needle, tmp_path, capsys):
    from ampkit.tools.cli.main import main

    if kind == "proc" and not Path("/proc/self").exists():
        pytest.skip("needs Linux's /proc")
    script, marker = tmp_path / "s.py", tmp_path / "ran.txt"
    script.write_text(MARKER_SCRIPT)
    target = _special(tmp_path, kind)
    other = ["--png", str(tmp_path / "p.png")] if flag == "--out" else ["--out", str(tmp_path / "p.json")]
    assert main(["tune", flag, str(target), *other, str(script), str(marker)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and err.startswith("ampkit tune: cannot write"), err
    assert not marker.exists() and not (tmp_path / "p.json").exists()
    if kind == "symlink":
        assert os.path.islink(target) and (tmp_path / "victim").read_text() == "mine"


def test_ampkit_tune_writes_relative_outputs_where_it_was_started(tmp_path, monkeypatch, capsys):
    """A script that changes folder while it is watched does not move ``--out``/``--png``
    (the tuning itself stood in for: the paths are the command's)."""
    from ampkit.tools.cli.main import main
    from ampkit.tools.tune import script as tune_script

    away = tmp_path / "away"
    away.mkdir()

    def tune(path, args, **kwargs):
        os.chdir(away)
        return TunePlan.by_hand(["0"], ["1"])

    monkeypatch.setattr(tune_script, "tune_script", tune)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("x = 1\n")
    assert main(["tune", "--out", "plan.json", "--png", "plan.png", "s.py"]) == 0
    assert TunePlan.load(tmp_path / "plan.json").lowered == ["0"]
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any(away.iterdir())


def test_close_step_times_are_timed_again_and_the_faster_timing_counts():
    """``confirm`` with scripted runs: O1 with the plan (6.0 ms) and everything at O1
    (6.3 ms) are within 10%: both run again, and the second timings (7.0, 5.9) decide."""
    from ampkit.levels.precision_plan import ModuleChoice

    first = {(None, False): 10.0, ("O1", True): 6.0, ("O1", False): 6.3, ("O2", True): 9.0, ("O2", False): 9.0,
             ("O2K", True): 8.0, ("O2K", False): 8.0}  # fmt: skip
    second = {("O1", True): 7.0, ("O1", False): 5.9}
    calls = []

    def run(level, kept, fp8=()):
        key = (level, bool(kept))
        calls.append(key)
        ms = second[key] if calls.count(key) > 1 and key in second else first[key]
        return search.Probe(1.0, ms)

    choices = [ModuleChoice("a", "Linear", "bf16", 1.0, 0.5, 0.0, 0.0, ""),
               ModuleChoice("b", "Linear", "fp32", 1.0, 0.5, 0.5, 0.5, "kept")]  # fmt: skip
    level, figures, out, backed = search.confirm(run, "bf16", choices, 10, 0.01, 2)
    assert (level, backed) == ("O1", [])
    assert [c.dtype for c in out] == ["bf16", "bf16"]  # everything lowered won the second timing
    assert figures["plan_ms"] == figures["all_O1_ms"] == 5.9 and figures["O1_ms"] == 6.0
    assert calls.count(("O1", True)) == 2 and calls.count(("O1", False)) == 2 and calls.count((None, False)) == 1


CHILD_FIRST = """
import torch
from torch import nn
class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
model = Wrapper()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model.net(torch.randn(4, 8)).pow(2).mean().backward()   # the child is the first module called
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ampkit_run_refuses_a_plan_whose_names_fit_no_model_the_script_calls(level, tmp_path, capsys):
    """Tuned on ``Wrapper`` (names ``net.0``), while the script calls ``model.net``
    first (names ``0``) at O1, and O2 casts ``net`` (the smallest module owning the
    optimizer's parameters): refused in one line, not a silent run without the plan."""
    from ampkit.tools.cli.main import main

    script = tmp_path / "train.py"
    script.write_text(CHILD_FIRST)
    path = tmp_path / "plan.json"
    amp.TunePlan.by_hand(["net.0"], ["net.2"], level=level).save(path)
    assert main(["run", "--plan", str(path), str(script)]) == 2
    err = capsys.readouterr().err
    assert "plan" in err and ("no model this script called" in err or "cannot be applied" in err), err


# fp8 as a candidate. fp8 is measured where it is native (CUDA, compute capability 8.9 and
# up); on a CPU only with include_emulated=True (torch's CPU fp8 matmul emulates it, slower
# than fp32), which these tests use to run the whole path: the conversion, the sensitivities
# and the probes are real, and the times are fixed (fp8 faster than 16 bits, as on a GPU).


@pytest.fixture
def fp8_fast(monkeypatch):
    """Every module 1 ms in fp32, 0.5 ms in 16 bits and 0.2 ms as an fp8 linear; a probe
    step 0.5 ms at O1 (0.6 O2, 0.7 O2K), 0.3 ms less with fp8 linears, 1 ms in fp32."""
    real = measure.module_times

    def fixed(model, modules, *args, **kwargs):
        out = real(model, modules, *args, **kwargs)
        return {n: {k: {"fp32": 1.0, "fp8": 0.2}.get(k, 0.5) for k in t} for n, t in out.items()}

    monkeypatch.setattr(measure, "module_times", fixed)
    real_probe = search.probe

    def probe(model, batches, loss_fn, level, **kw):
        ms = PROBE_MS[level] - (0.3 if kw.get("fp8") else 0.0)
        return dataclasses.replace(real_probe(model, batches, loss_fn, level, **kw), step_ms=ms)

    monkeypatch.setattr(search, "probe", probe)


def test_fp8_is_tried_where_it_is_native_and_said_why_not_elsewhere(monkeypatch):
    tried, skipped = measure.native_dtypes(("bf16", "fp8"), "cpu", include_emulated=False)
    assert "fp8" not in tried and "emulates" in skipped["fp8"] and "include_emulated" in skipped["fp8"]
    assert measure.native_dtypes(("fp16", "fp8"), "cpu", include_emulated=True) == (["fp16", "fp8"], {})
    tried, skipped = measure.native_dtypes(("fp8",), "cpu", include_emulated=True)
    assert tried == [] and "add 'bf16' or 'fp16'" in skipped["fp8"]  # fp8 needs a 16-bit companion
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    for capability, native in [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        tried, skipped = measure.native_dtypes(("bf16", "fp8"), "cuda", include_emulated=False)
        assert ("fp8" in tried) is native, (capability, skipped)
        if not native:
            assert f"{capability[0]}.{capability[1]}" in skipped["fp8"]


def test_fp8_is_measured_on_the_linears_only_and_leaves_them_plain_linears():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = measure.candidate_modules(model)
    times = measure.module_times(model, modules, _batches()[0], nn.functional.cross_entropy, ["bf16", "fp8"],
                                 "cpu", 1, math.inf)  # fmt: skip
    # not the LayerNorm "2", nor "5" (32 -> 10: fp8 GEMMs take multiples of 16)
    assert {n for n, t in times.items() if "fp8" in t} == {"0", "3", "4.lin"}
    assert all(t["fp8"] > 0 for t in times.values() if "fp8" in t)
    names = ["0", "3"]
    fp8 = measure.sensitivities(model, names, _batches()[:2], nn.functional.cross_entropy, "fp8", "cpu", math.inf)
    bf16 = measure.sensitivities(model, names, _batches()[:2], nn.functional.cross_entropy, "bf16", "cpu", math.inf)
    for name in names:  # fp8's 3 (e4m3) and 2 (e5m2) mantissa bits move the gradient more than bf16's 8
        assert fp8[name][1] > bf16[name][1] > 0, (name, fp8, bf16)
    plain = set(vars(nn.Linear(16, 16)))
    for m in model.modules():  # nothing left on the linears: the class and the attributes of a plain one
        assert type(m) is not amp.fp8.Float8Linear
        if isinstance(m, nn.Linear):
            assert set(vars(m)) == plain, set(vars(m)) ^ plain
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert amp.fp8.layers() == []  # measured outside any session


def test_choose_takes_fp8_where_it_saves_more_and_the_budget_still_holds():
    modules = [(n, nn.Linear(4, 4)) for n in "abc"]
    times = {n: {"fp32": 10.0, "bf16": 6.0, "fp8": 3.0} for n in "abc"}
    sens = {n: (1e-3, 0.01) for n in "abc"}
    fp8 = {"a": (2e-3, 0.05), "b": (0.02, 0.05), "c": (1e-3, 0.3)}  # b: too much loss; c: its gradient
    _, out = search.choose("bf16", modules, times, sens, 0.01, 0.1, fp8, 0.25)
    assert [c.dtype for c in out] == ["fp8", "bf16", "bf16"], [c.reason for c in out]
    assert out[0].low_ms == 3.0 and out[0].loss_deviation == 2e-3 and "bf16 would save 4.000 ms" in out[0].reason
    assert "fp8: gradient moves 30.0%" in out[2].reason and "limit 25%" in out[2].reason
    assert "fp8: the budget is spent" in out[1].reason
    # a budget of 2.5e-3: two modules in bf16 (1e-3 each); a's move to fp8 (+1e-3) would not fit
    _, out = search.choose("bf16", modules, times, sens, 2.5e-3, 0.1, fp8, 0.25)
    assert [c.dtype for c in out] == ["bf16", "bf16", "fp32"]
    # without fp8 measured nothing is fp8
    _, out = search.choose("bf16", modules, times, sens, 0.01, 0.1)
    assert [c.dtype for c in out] == ["bf16"] * 3


def test_a_tuned_fp8_plan_converts_its_linears_through_initialize_and_trains_within_budget(fp8_fast, tmp_path):
    # measured here: the probe 1.4% worse than fp32 with "0" and "3" in fp8 (0.02% without)
    plan = _tune(candidates=("bf16", "fp8"), budget=0.03)
    assert plan.fp8 and set(plan.fp8) <= {"0", "3"}, plan.report()
    assert "4.lin" in plan.kept_fp32 and plan.skipped == {}
    assert f"{len(plan.fp8)} linear(s) in fp8" in plan.report().splitlines()[-1]
    assert plan.probe["deviation"] <= 0.03 and plan.probe["plan_ms"] < plan.probe["fp32_ms"]
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = TunePlan.load(path)
    assert loaded.fp8 == plan.fp8 and [m.dtype for m in loaded.modules] == [m.dtype for m in plan.modules]
    model = _model()
    opt = _sgd(model.parameters())
    model, opt = amp.initialize(model, opt, plan=path)
    try:
        converted = {n for n, m in model.named_modules() if type(m) is amp.fp8.Float8Linear}
        assert converted == set(plan.fp8)
        assert sorted(layer.name for layer in amp.fp8.layers()) == sorted(plan.fp8)
        losses = []
        for step in range(20):
            x, y = _batches()[step % 8]
            loss = nn.functional.cross_entropy(model(x), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        assert all(math.isfinite(v) for v in losses) and sum(losses[-5:]) < sum(losses[:5])
        assert all(layer.calls > 0 for layer in amp.fp8.layers())
    finally:
        amp.reset()
    assert not any(type(m) is amp.fp8.Float8Linear for m in model.modules())


def test_a_plan_with_fp8_linears_is_applied_only_where_they_can_be_converted(tmp_path):
    plan = TunePlan.by_hand(["0", "5"], ["2"], fp8=["3", "4.lin"])
    assert plan.fp8 == ["3", "4.lin"] and plan.lowered == ["0", "5", "3", "4.lin"]
    assert plan.policy().module_rules == {"2": torch.float32}
    # the caller's recipe gives the format and scaling; the plan chooses the linears
    model, _ = amp.initialize(_model(), None, plan=plan, fp8=amp.Fp8Recipe(format="e4m3"))
    try:
        assert {layer.name: layer.recipe.split()[0] for layer in amp.fp8.layers()} == {"3": "e4m3", "4.lin": "e4m3"}
    finally:
        amp.reset()
    model, _ = amp.initialize(_model(), None, plan=plan, fp8=False)  # fp8=False: those linears in bf16
    try:
        assert not any(type(m) is amp.fp8.Float8Linear for m in model.modules()) and amp.fp8.layers() == []
    finally:
        amp.reset()
    # refused before anything changes: a recipe choosing its own linears, a plan naming a
    # linear fp8 cannot convert (32 -> 10), or one the recipe passed excludes
    untouched = _model()
    state = {k: v.clone() for k, v in untouched.state_dict().items()}
    with pytest.raises(amp.AmpError, match="module_filter of its own"):
        amp.initialize(untouched, None, plan=plan, fp8=amp.Fp8Recipe(module_filter=lambda n, m: True))
    with pytest.raises(PlanError, match=r"\['5'\] in fp8"):
        amp.initialize(untouched, None, plan=TunePlan.by_hand(["0"], [], fp8=["5"]))
    with pytest.raises(PlanError, match=r"\['3'\] in fp8.*excluded"):
        amp.initialize(untouched, None, plan=plan, fp8=amp.Fp8Recipe(exclude=("3",)))
    assert not any(type(m) is amp.fp8.Float8Linear for m in untouched.modules())
    assert all(v.dtype == torch.float32 and torch.equal(state[k], v) for k, v in untouched.state_dict().items())
    with pytest.raises(PlanError, match="fp8.*ampkit.initialize"):
        amp.init(plan=plan)
    from ampkit.tools.run.config import RunConfig

    with pytest.raises(amp.AmpError, match="--level O2"):
        RunConfig(level="O1", plan=plan)
    assert RunConfig(level="O2", plan=plan).plan is plan
    doc = plan.to_dict()
    with pytest.raises(PlanError, match="dtype 'fp8'"):
        TunePlan.from_dict({**doc, "dtype": "fp8"})
    with pytest.raises(PlanError, match="16-bit dtype"):
        TunePlan.from_dict({**doc, "dtype": "fp32", "level": "O1",
                            "modules": [m for m in doc["modules"] if m["dtype"] != "bf16"]})  # fmt: skip


def test_a_module_its_parent_never_calls_is_said_so_and_the_time_shares_stay_finite():
    """``nn.MultiheadAttention`` uses ``out_proj``'s weights directly: ``out_proj`` is a
    candidate (parameters of its own) that is never called; the report says so, and the
    time shares of the others are numbers, not NaN."""

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mha, self.out = nn.Linear(16, 16), nn.MultiheadAttention(16, 2, batch_first=True), nn.Linear(16, 4)

        def forward(self, x):
            h = self.inp(x)
            return self.out(self.mha(h, h, h)[0]).pow(2).mean()

    torch.manual_seed(0)
    plan = amp.tune(Attn(), [(torch.randn(2, 4, 16),)], None, candidates=("bf16",), include_emulated=True,
                    probe_steps=4, budget=0.05, optimizer=_sgd)  # fmt: skip
    by = {m.name: m for m in plan.modules}
    assert "never called as a module" in by["mha.out_proj"].reason and math.isnan(by["mha.out_proj"].fp32_ms)
    rows = {line.split()[0]: line.split() for line in plan.report().splitlines()[1:6]}
    shares = [float(rows[name][5]) for name in ("inp", "mha", "out")]
    assert all(math.isfinite(v) and v > 0 for v in shares) and rows["mha.out_proj"][5] == "nan"
