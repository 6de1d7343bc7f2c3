"""``ampkit.tune`` and its plans against what a hostile user does: module names that are
globs (``nn.ModuleDict`` keys such as ``"x*"``), a tuner that must leave the process as
it found it, and ``ampkit tune script.py`` on scripts that sleep, ``os._exit``, fork,
fail only under a plan, or call their model with keyword-only arguments."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.modules.module as module_globals
import torch.optim.optimizer as optimizer_globals
from torch import nn

import ampkit as amp
from ampkit.levels.precision_plan import PlanError, TunePlan
from ampkit.tools.tune import measure, search
from ampkit.tools.tune.script import capture, tune_script

NAMES = ("a[0]", "a0", "x*", "x1")  # "a[0]" as a glob matches "a0"; "x*" matches "x1"


class Keyed(nn.Module):
    """Linears in a ModuleDict whose keys are globs of one another's names."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.d = nn.ModuleDict({k: nn.Linear(8, 8) for k in NAMES})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.d.values():
            x = m(x)
        return x


def _watch(model: Keyed) -> dict[str, torch.dtype]:
    """The dtype each linear computes in, as its output says (hooked before ampkit's own)."""
    seen: dict[str, torch.dtype] = {}
    for key, m in model.d.items():
        m.register_forward_hook(lambda mod, args, out, key=key: seen.__setitem__(key, out.dtype))
    return seen


KEPT = {"x*", "a[0]"}
PLANS = pytest.mark.parametrize("kept", [KEPT, set(NAMES) - KEPT], ids=["glob-names-kept", "glob-names-lowered"])


def _plan(kept: set[str], level: str) -> TunePlan:
    return TunePlan.by_hand([f"d.{k}" for k in NAMES if k not in kept], [f"d.{k}" for k in NAMES if k in kept],
                            level=level)  # fmt: skip


def _expected(kept: set[str]) -> dict[str, torch.dtype]:
    return {k: torch.float32 if k in kept else torch.bfloat16 for k in NAMES}


@PLANS
@pytest.mark.parametrize("with_model", [True, False], ids=["model-given", "no-model"])
def test_o1_init_applies_plan_names_exactly_not_as_globs(kept, with_model):
    model = Keyed()
    seen = _watch(model)
    amp.init(plan=_plan(kept, "O1"), **({"model": model} if with_model else {}))
    try:
        model(torch.randn(2, 8))
    finally:
        amp.reset()
    assert seen == _expected(kept)


@PLANS
def test_o2_initialize_applies_plan_names_exactly_not_as_globs(kept):
    model = Keyed()
    seen = _watch(model)
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=_plan(kept, "O2"))
    try:
        model(torch.randn(2, 8))
        weights = {k: m.weight.dtype for k, m in model.d.items()}
    finally:
        amp.reset()
    assert seen == _expected(kept) and weights == _expected(kept)


def test_a_plan_naming_a_module_the_model_lacks_is_refused_before_anything_changes():
    """``"*"`` is no module of this model: refused by ``initialize`` and by ``init`` given
    the model, nothing changed; ``init`` without a model pins no module with it."""
    model = Keyed()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    star = TunePlan.by_hand(["d.a0"], ["*"], level="O2")
    with pytest.raises(PlanError, match=r"not have: \['\*'\]"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=star)
    with pytest.raises(PlanError, match=r"not have: \['\*'\]"):
        amp.init(plan=star, model=model)
    assert not amp.is_active() and all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    seen = _watch(model)
    amp.init(plan=TunePlan.by_hand(list(map("d.{}".format, NAMES)), ["*"]))
    try:
        model(torch.randn(2, 8))
    finally:
        amp.reset()
    assert seen == dict.fromkeys(NAMES, torch.bfloat16)
    with pytest.raises(PlanError, match="beside plan="):
        amp.init(model=model)


def test_init_checks_its_own_arguments_before_the_plan():
    """``ampkit.init`` applies a plan above the casting layer: a Policy given as the dtype
    is still refused as such (a :class:`ampkit.PolicyError`, not the plan's dtype mismatch),
    a policy that is no Policy likewise, and nothing is switched on."""
    plan = TunePlan.by_hand(["d.a0"], ["d.x1"])
    with pytest.raises(amp.PolicyError, match="a Policy goes by keyword"):
        amp.init(amp.Policy(), plan=plan)
    with pytest.raises(amp.PolicyError, match="policy must be an ampkit.Policy, got str"):
        amp.init(plan=plan, policy="fp32")
    assert not amp.is_active()
    policy = amp.init(plan=plan, model=Keyed(), fp32_ops=["gelu"])  # a policy field on top of the plan's policy
    try:
        assert policy.dtype == torch.bfloat16 and policy.module_rules == {"d.x1": torch.float32}
        assert "gelu" in policy.fp32_ops and amp.current_policy() == policy
    finally:
        amp.reset()


# --- the tuner leaves no trace ---------------------------------------------------------------
def _global_hooks() -> dict[str, dict]:
    """Every global hook dict of torch's modules and optimizers, copied."""
    out = {}
    for owner in (module_globals, optimizer_globals):
        for name in dir(owner):
            if name.startswith("_global_") and isinstance(getattr(owner, name), dict):
                out[name] = dict(getattr(owner, name))
    return out


class Jitter(nn.Module):
    """A layer drawing from Python's and numpy's random streams, as some models do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 + 0.01 * random.random()) + 0.01 * float(np.random.rand())


def _streams() -> tuple:
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()


def _same_streams(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and torch.equal(a[2], b[2])


@pytest.mark.parametrize("raises", [False, True])
def test_tune_leaves_the_global_hooks_and_every_random_stream_as_it_found_them(raises):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Jitter(), nn.Linear(16, 4))
    batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(2)]

    def loss(out, y):  # with raises: fails once casting is on (the hooks are in by then)
        if raises and amp.is_active():
            raise RuntimeError("boom")
        return nn.functional.mse_loss(out.float(), y)

    random.seed(3)
    np.random.seed(3)
    hooks, streams = _global_hooks(), _streams()
    if raises:
        with pytest.raises(RuntimeError, match="boom"):
            amp.tune(model, batches, loss, include_emulated=True, candidates=("bf16",), probe_steps=2, repeats=1)
    else:
        amp.tune(model, batches, loss, include_emulated=True, candidates=("bf16",), probe_steps=2, repeats=1)
    assert _global_hooks() == hooks
    assert _same_streams(_streams(), streams)
    seen = []  # the hooks come back with the next scope: a module rule applies as before
    model[2].register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    with amp.autocast(amp.Policy(module_rules={"2": torch.float32}), "cpu"):
        model(batches[0][0])
    assert seen == [torch.float32]


# --- ampkit tune script.py -------------------------------------------------------------------
BASE = """
import os, sys, time
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def train(steps=6):
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
"""


def _script(tmp_path, tail: str):
    path = tmp_path / "train.py"
    path.write_text(BASE + textwrap.dedent(tail))
    return path


def _cli(tmp_path, script, *argv):
    from ampkit.tools.cli.main import main

    out = tmp_path / "plan.json"
    return main(["tune", *argv, "--out", str(out), str(script)]), out


@pytest.mark.timeout(180)
def test_ampkit_tune_stops_a_script_past_its_timeout_and_what_it_started(tmp_path, capsys):
    pid_file = tmp_path / "pid"
    script = _script(tmp_path, f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    code, out = _cli(tmp_path, script, "--timeout", "8")  # the capture's child writes its pid ~3 s in
    err = capsys.readouterr().err
    assert code == 2 and "ran past its time limit of 8 s" in err and "--timeout" in err, err
    assert not out.exists()
    if pid_file.exists():  # (it got that far within the limit): the sleeping script is gone
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


def test_ampkit_tune_refuses_a_script_that_os_exits_before_training_finished(tmp_path, capsys):
    script = _script(tmp_path, "train(2)\nos._exit(0)\n")
    code, out = _cli(tmp_path, script)
    err = capsys.readouterr().err
    assert code == 2 and "exited (exit code 0) before training finished" in err, err
    assert not out.exists()


def test_only_the_process_that_captures_goes_on_when_the_script_forks(tmp_path):
    """The script forks and both copies train: the child's copy ends where its script
    does, and only the original process returns from the capture (to tune)."""
    script = _script(tmp_path, "child = os.fork() == 0\nos.write(1, b'FORKED child\\n' if child else b'FORKED parent\\n')\n"
                               "train()\n")  # (one write each: the two processes share the pipe)
    code = (f"import os\nfrom ampkit.tools.tune.script import capture\nmodel, calls = capture({str(script)!r}, [], 3)\n"
            "print('CAPTURED', len(calls), flush=True)\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line for line in lines if line.startswith("CAPTURED")] == ["CAPTURED 3"], proc.stdout
    assert sorted(line for line in lines if line.startswith("FORKED")) == ["FORKED child", "FORKED parent"], proc.stdout


@pytest.mark.timeout(300)
def test_a_plan_is_refused_when_every_probe_run_in_16_bits_failed(tmp_path):
    """The script fails whenever it runs under a plan: fp32's run succeeds, every 16-bit
    run fails; an O0 plan would pass the failures off as a verdict on 16 bits.
    ``max_seconds=0`` measures no module: the 16-bit runs are each level's with
    everything lowered, one a level (measuring the modules decides nothing here)."""
    script = _script(tmp_path, "if '--plan' in sys.orig_argv:\n    raise RuntimeError('no 16 bits here')\ntrain()\n")
    with pytest.raises(amp.AmpError, match=r"no probe run succeeded: .*the first: .*RuntimeError: no 16 bits here"):
        tune_script(script, steps=4, candidates=("bf16",), include_emulated=True, repeats=1, max_backoffs=0,
                    max_seconds=0.0)  # fmt: skip


KEYWORDS = """
import torch
from torch import nn
torch.manual_seed(0)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
    def forward(self, x, *, scale):
        return self.b(torch.relu(self.a(x))) * scale
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(6):
    model(torch.randn(4, 8), scale=2.0).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_model_taking_keyword_only_arguments_is_captured_with_them_and_measured(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(KEYWORDS)
    model, calls = capture(script, [], 3)
    assert type(model).__name__ == "Net" and len(calls) == 3
    assert all(set(c.kwargs) == {"scale"} and c.kwargs["scale"] == 2.0 for c in calls)
    dtype, choices, _ = search.measure_and_choose(
        model, calls, measure.output_energy, candidates=["bf16"], device_type="cpu", include_emulated=True,
        repeats=1, budget=0.05, grad_limit=0.1, deadline=float("inf"))  # fmt: skip
    assert dtype == "bf16" and [c.name for c in choices] == ["a", "b"]
    assert all(c.fp32_ms > 0 and c.loss_deviation >= 0 for c in choices)


def test_the_timeout_must_be_a_positive_number(tmp_path):
    script = _script(tmp_path, "train()\n")
    for bad in (0, -1.0, float("nan"), True, "10"):
        with pytest.raises(amp.AmpError, match="timeout"):
            tune_script(script, timeout=bad)
