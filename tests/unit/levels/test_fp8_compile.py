"""fp8 under torch.compile with the default backend (inductor): compiled fp8 computes
bitwise what eager fp8 computes -- forward, backward, optimizer steps and the scale
state (delayed scaling's abs-max histories) -- with no graph break.

Inductor keeps fused bf16 intermediates in fp32 unless told otherwise, which once made
the fp8 casts read unrounded inputs; ampkit's fp8 steps run as custom ops while
compiling (see ``ampkit.fp8``). Inductor compiles slowly on 2 cores: the models are tiny.

Which CPU: the models' other ops are chosen so that the bitwise claims hold on every
x86-64 CPU torch supports, whatever vector ISA inductor and ATen use (AVX2, AVX-512):
LeakyReLU (a compare, a select and an IEEE multiply, correctly rounded everywhere; its
``x * 0.1`` needs rounding to bf16, so an fp8 cast that read an unrounded intermediate
would show), matmuls by the same ATen kernels in both runs, and bias sums over the rows
in row order. GELU is not such an op: inductor generates its own erf/exp vector code for
``gelu_backward``, which differs from ATen's kernel in the last fp32 bits (245 of 512
elements of one gradient on an AVX-512 CPU; after bf16 rounding a few elements, enough to
move 4 of 1,024 weights by 1.9e-9 after 3 AdamW steps). The GELU model is therefore
compared with an eager run whose GELU is inductor's too. Both CPU kinds are checked on
any AVX-512 machine by rerunning the checks in a subprocess under
``ATEN_CPU_CAPABILITY=avx2`` (see the last test).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from forked import fork_env
from locations import ROOT
from torch import nn

import ampkit as amp
from ampkit.levels import fp8

pytestmark = pytest.mark.slow

DELAYED = amp.Fp8Recipe(min_features=16, scaling="delayed", amax_history_len=4)
CASES = {  # (recipe, level)
    "O1-hybrid-current-tensorwise": (amp.Fp8Recipe(min_features=16), "O1"),
    "O1-hybrid-delayed-tensorwise": (DELAYED, "O1"),
    "O1-e4m3-current-rowwise": (amp.Fp8Recipe(min_features=16, format="e4m3", granularity="rowwise"), "O1"),
    "O2-hybrid-delayed-tensorwise": (DELAYED, "O2"),
}


def _model(act: nn.Module | None = None) -> nn.Module:
    """Linear, fp8 linear, ``act`` (default LeakyReLU(0.1), see the module docstring),
    fp8 linear, linear: the activation's bf16 output is what an fp8 cast reads."""
    torch.manual_seed(0)
    act = nn.LeakyReLU(0.1) if act is None else act
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), act, nn.Linear(32, 32), nn.Linear(32, 4))


@pytest.fixture(autouse=True)
def _fresh():
    import torch._dynamo

    torch._dynamo.reset()
    amp.reset()
    yield
    amp.reset()
    torch._dynamo.reset()


def _train(recipe: amp.Fp8Recipe, level: str, compiled: bool, steps: int = 3, act: nn.Module | None = None):
    """Build the model (with ``act``), train ``steps`` AdamW steps on fixed batches; returns
    the losses, the per-step input grads, the final parameters, the fp8 state and a
    no_grad output."""
    amp.reset()
    model = _model(act)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, fp8=recipe)
    run = torch.compile(model) if compiled else model
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 16, generator=g) * (1 + 3 * i) for i in range(steps)]
    losses, grads = [], []
    for x in batches:
        x = x.requires_grad_()
        opt.zero_grad()
        loss = run(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        grads.append(x.grad)
    with torch.no_grad():
        out = run(batches[0])
    params = [p.detach().clone() for p in model.parameters()]
    return losses, grads, params, amp.state_dict()["extra"]["fp8"], out


def _assert_same_fp8_state(a: dict, b: dict) -> None:
    assert a["recipe"] == b["recipe"] and set(a["layers"]) == set(b["layers"]) == {"1", "3"}
    for name, roles in a["layers"].items():
        for role, st in roles.items():
            other = b["layers"][name][role]
            for key, value in st.items():
                if torch.is_tensor(value):
                    assert torch.equal(value, other[key]), (name, role, key, value, other[key])
                else:
                    assert value == other[key], (name, role, key)


def _assert_same_training(eager: tuple, comp: tuple) -> None:
    for e, c in zip(eager[0], comp[0]):
        assert torch.equal(e, c)  # every step's loss
    for e, c in zip(eager[1], comp[1]):
        assert e.dtype == c.dtype and torch.equal(e, c)  # backward through fp8
    for e, c in zip(eager[2], comp[2]):
        assert torch.equal(e, c)  # weights after the optimizer steps
    assert eager[4].dtype == comp[4].dtype and torch.equal(eager[4], comp[4])
    _assert_same_fp8_state(eager[3], comp[3])


@pytest.mark.parametrize("name", list(CASES))
def test_inductor_fp8_training_equals_eager_bitwise_without_graph_breaks(name):
    from torch._dynamo.utils import counters

    recipe, level = CASES[name]
    eager = _train(recipe, level, compiled=False)
    counters.clear()
    comp = _train(recipe, level, compiled=True)
    assert dict(counters["graph_break"]) == {}
    _assert_same_training(eager, comp)
    roles = eager[3]["layers"]["1"]
    if recipe.scaling == "delayed":
        assert roles["input"]["calls"] == 3 and bool((roles["input"]["amax_history"][:3] > 0).all())
        assert int(roles["input"]["saturated"]) > 0  # the growing batches saturated once: a live history


@pytest.mark.parametrize("name", ["O1-hybrid-current-tensorwise", "O1-hybrid-delayed-tensorwise"])
def test_inductor_fp8_training_through_a_gelu_equals_eager_with_inductors_gelu(name):
    """Through a GELU, compiled fp8 training is bitwise the eager one whose GELU alone is
    compiled: the two part only where inductor's GELU (forward and backward) differs from
    ATen's (see the module docstring), not in the fp8 layers around it."""
    recipe, level = CASES[name]
    eager = _train(recipe, level, compiled=False, act=torch.compile(nn.GELU()))
    torch._dynamo.reset()
    comp = _train(recipe, level, compiled=True, act=nn.GELU())
    _assert_same_training(eager, comp)


def test_inductor_fp8_forward_of_the_reported_model_equals_eager():
    m, _ = amp.initialize(_model(), None, opt_level="O1", fp8=amp.Fp8Recipe(min_features=16))
    x = torch.randn(16, 16)
    with torch.no_grad():
        e = m(x)
        c = torch.compile(m)(x)
    assert torch.equal(e, c)


def test_a_compiled_deep_copy_advances_its_own_scale_state():
    """A compiled training call of a deep copy moves the copy's scales (input, weight and
    grad_output: its next forward and backward use them) and none of the session's
    layers' (``amp.state_dict()`` counts no call; they compute as before)."""
    # GELU: unlike LeakyReLU its gradient changes when the input is scaled, so each role's scale moves
    model, _ = amp.initialize(_model(nn.GELU()), None, opt_level="O1", fp8=DELAYED)
    copied = copy.deepcopy(model)
    x = torch.randn(16, 16)

    def run(m: nn.Module) -> tuple[torch.Tensor, list]:
        """Output and the dequant scales of every fp8 matmul of a forward and backward
        with the scale state frozen (observe), as explain shows them."""
        with fp8.observe() as records:
            y = m(x)
            y.float().sum().backward()
        return y.detach(), sorted((r.module, r.matmul, r.a_scale, r.b_scale) for r in records)

    before = run(model)
    torch.compile(copied, backend="aot_eager")(x * 4).float().sum().backward()
    layers = amp.state_dict()["extra"]["fp8"]["layers"]
    assert [layers[n][r]["calls"] for n in ("1", "3") for r in ("input", "weight", "grad_output")] == [0] * 6
    after, theirs = run(model), run(copied)
    assert torch.equal(after[0], before[0]) and after[1] == before[1]
    assert {m for m, *_ in theirs[1]} == {"1", "3"}
    moved = {(m, mm) for (m, mm, a, b), (_, _, a0, b0) in zip(theirs[1], before[1]) if (a, b) != (a0, b0)}
    assert {mm for _, mm in moved} == {"forward", "grad_input", "grad_weight"}  # input, weight, grad_output scales


def test_inductor_fp8_under_activation_checkpointing_equals_eager():
    from torch._dynamo.utils import counters
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = _model()

        def forward(self, x):
            s = self.seq
            h = checkpoint(lambda t: s[3](s[2](s[1](t))), s[0](x), use_reentrant=False)
            return s[4](h)

    def run(compiled):
        amp.reset()
        net, _ = amp.initialize(Net(), None, opt_level="O1", fp8=DELAYED)
        f = torch.compile(net) if compiled else net
        g = torch.Generator().manual_seed(1)
        for i in range(2):
            f(torch.randn(16, 16, generator=g) * (1 + i)).float().pow(2).mean().backward()
        return [p.grad for p in net.parameters()], amp.state_dict()["extra"]["fp8"]

    eager = run(False)
    counters.clear()
    comp = run(True)
    assert dict(counters["graph_break"]) == {}
    assert all(torch.equal(a, b) for a, b in zip(eager[0], comp[0]))
    for roles in (eager[1]["layers"]["seq.1"], comp[1]["layers"]["seq.1"]):
        assert [roles[r]["calls"] for r in fp8.ROLES] == [2, 2, 2]  # recomputation advanced nothing
    assert eager[1]["layers"].keys() == comp[1]["layers"].keys()
    for name, roles in eager[1]["layers"].items():
        for role, st in roles.items():
            assert all(torch.equal(v, comp[1]["layers"][name][role][k]) if torch.is_tensor(v)
                       else v == comp[1]["layers"][name][role][k] for k, v in st.items()), (name, role)


def _cpu_kinds() -> list:
    """The ATen CPU capabilities the checks above do not already run on here: on an
    AVX-512 CPU, AVX2 (what an AVX2-only CPU runs, emulated with ``ATEN_CPU_CAPABILITY``).
    The checks above run in this process on the machine's own capability."""
    own = torch.backends.cpu.get_cpu_capability()
    return [
        pytest.param("avx2", marks=pytest.mark.skipif(
            own != "AVX512", reason=f"this CPU runs {own}: the checks above already ran on it")),  # fmt: skip
    ]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("capability", _cpu_kinds())
def test_the_bitwise_checks_hold_under_each_cpu_kind(capability, tmp_path):
    """The bitwise checks above (the two hybrid O1 recipes, and through a GELU), rerun in a
    new interpreter with ATen's kernels and inductor's generated code on ``capability``.

    Each run gets its own inductor cache directory: torch 2.13's FX graph cache key
    leaves out the vector ISA, so a process under ``ATEN_CPU_CAPABILITY=avx2`` reusing a
    graph an AVX-512 process cached runs AVX-512-width code compiled for AVX2 (half of
    each vector loaded, the rest garbage: NaN from the first step, for plain
    ``torch.compile`` of an ``nn.Linear`` under ``torch.autocast`` as much as for fp8)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability != "default":
        env["ATEN_CPU_CAPABILITY"] = capability
    # One interpreter: what ATen and inductor run on there (its first line), then pytest.
    run = (
        "import sys, torch, pytest; from torch._inductor.cpu_vec_isa import pick_vec_isa; "
        "print('ISA', torch.backends.cpu.get_cpu_capability(), pick_vec_isa(), flush=True); "
        "sys.exit(pytest.main(sys.argv[1:]))"
    )
    checks = "(equals_eager_bitwise and O1-hybrid) or through_a_gelu"
    cmd = [sys.executable, "-c", run, "-q", "-p", "no:cacheprovider", __file__, "-k", checks]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=850)
    seen = next((line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("ISA ")), None)
    if capability == "avx2":
        assert seen == ["AVX2", "avx2"], proc.stdout[-2000:] + proc.stderr[-2000:]  # ATen and inductor both on AVX2
    assert proc.returncode == 0 and "\n4 passed" in proc.stdout, f"under {seen}:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"


_CACHED_RUN = """
import sys, torch
from torch import nn
import ampkit as amp
torch.set_num_threads(1)
recipe = amp.Fp8Recipe(min_features=16, format="e4m3", granularity=sys.argv[1])
def train(compiled):
    amp.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O1", fp8=recipe)
    run = torch.compile(model) if compiled else model
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        opt.zero_grad()
        run(x).float().pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]
comp = train(True)   # first: its layers get the process's first handles, as in the other run
eager = train(False)
assert all(torch.equal(a, b) for a, b in zip(eager, comp)), "compiled fp8 differs from eager"
print("same", sys.argv[1])
"""


def test_a_graph_cached_for_one_granularity_is_not_reused_for_another(tmp_path, forked_python):
    """Two scripts run one after the other share inductor's on-disk caches (on by default).
    Their fp8 layers get the same handle numbers, so a graph compiled for tensorwise
    scaling must not serve a rowwise layer of the same shapes: each run trains bitwise as
    its eager twin, whichever ran first. Each run is a new process (forked from one that
    imported torch and ampkit and compiled nothing: ``tests/support/forked.py``)."""
    env = fork_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    for granularity in ("tensorwise", "rowwise", "tensorwise"):
        proc = forked_python.run(_CACHED_RUN, [granularity], cwd=tmp_path, env=env, timeout=600)
        assert proc.returncode == 0 and f"same {granularity}" in proc.stdout, proc.stderr[-3000:]
