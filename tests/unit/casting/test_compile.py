"""ampkit under torch.compile: every policy kind, every level, the loss scaler and
explain on compiled models; dtypes inside compiled code equal eager's op for op; no
graph break of ampkit's making; another policy or no scope never reuses a graph.

Compiling is slow on 2 cores, so models are tiny. Every dtype-parity test runs with
``aot_eager`` (dynamo and AOTAutograd trace as with the default backend: that is where
ampkit's hooks, kernels and guards act; it computes bitwise what eager does) and with
inductor, the default backend users get (its caches and fused kernels are where a
policy was once lost; values agree within the rounding of the dtype computed in).
"""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp
from ampkit._internal import torch_compat
from ampkit.tools.bench.workloads import CharTransformer, DigitsCNN

pytestmark = pytest.mark.slow

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FAST = "aot_eager"
BACKENDS = pytest.mark.parametrize("backend", [FAST, "inductor"])
#: Before torch 2.12 dynamo cannot record torch.set_autocast_* in a graph: module rules and
#: cast models' scopes inside compiled code graph-break there, and the tests below allow
#: those breaks (and only those) on such a torch; dtypes and values are checked alike.
SWITCH_BREAK = re.compile(r"`[\w.]*autocast[\w.]*`")  # torch.set_autocast_dtype, autocast._enter, ...

def _assert_breaks(at_most: int = 0) -> None:
    """No more than ``at_most`` graph breaks, where dynamo records autocast switches in
    the graph (torch >= 2.12); before, any number, each at an autocast switch."""
    breaks = _breaks()
    if torch_compat.GRAPH_AUTOCAST_SWITCHES:
        assert sum(breaks.values()) <= at_most, breaks
    else:
        assert all(SWITCH_BREAK.search(reason) for reason in breaks), list(breaks)


def _assert_same(got, want, backend):
    """Bitwise under aot_eager; under inductor the same dtype and values within the
    rounding of bf16 (its fused kernels round intermediates differently)."""
    assert got.dtype == want.dtype
    if backend == FAST:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    _counters().clear()  # graph breaks and graph counts of this test only
    yield
    torch._dynamo.reset()


def _counters():
    from torch._dynamo.utils import counters

    return counters


def _graphs() -> int:
    return _counters()["stats"]["unique_graphs"]


def _breaks() -> dict:
    return dict(_counters()["graph_break"])


class Probe(nn.Module):
    """Records the dtype of every intermediate it computes (a side effect dynamo
    replays after compiled code, so compiled and eager runs can be compared)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        self.seen: list[tuple[str, torch.dtype]] = []

    def forward(self, x):
        def rec(name, t):
            self.seen.append((name, t.dtype))
            return t

        h = rec("fc", self.fc(x))
        h = rec("gelu", F.gelu(h))
        h = rec("norm", self.norm(h))
        p = rec("pow3", torch.pow(h.float().abs() + 1, 3)) + rec("pow2", torch.pow(h.float(), 2))
        s = rec("softmax", torch.softmax(h, -1))
        n = rec("normalize", F.normalize(x))
        return rec("head", self.head(s)) + p.sum() + n.sum()


def _cube(x, e, **kw):
    return isinstance(e, (int, float)) and e > 2


POLICIES = {
    "default": amp.default_policy("cpu"),
    "ops": amp.Policy(fp32_ops=[F.linear], lower_ops=["softmax"]),
    "conditional": amp.Policy(lower_ops=[torch.pow], conditional_fp32_ops=[(torch.pow, _cube)]),
    "python_op": amp.Policy(lower_ops=[F.normalize]),
    "rules": amp.Policy(module_rules={nn.LayerNorm: FP32, "head": FP32}),
    "by_name": amp.Policy(fp32_ops=["linear", "gelu"]),  # aten names, not the functions
    "promote": amp.Policy(promote_ops=["linear"], fp32_ops=[F.softmax]),
}


def _run(fn, model, policy, x):
    model.seen.clear()
    if policy is None:
        out = fn(x)
    else:
        with amp.autocast(policy, "cpu"):
            out = fn(x)
    return out, list(model.seen)


@BACKENDS
def test_every_policy_kind_compiles_to_the_eager_dtypes_and_switching_recompiles(backend):
    torch.manual_seed(0)
    model, x = Probe(), torch.randn(4, 8)
    for policy in POLICIES.values():
        with amp.autocast(policy, "cpu"):  # register the kernels first: a policy that first
            pass  # overrides an op after compiling drops unguarded compiled code
    compiled = torch.compile(model, backend=backend)
    for name, policy in [*POLICIES.items(), ("no scope", None)]:
        before = _graphs()
        out, seen = _run(compiled, model, policy, x)
        ref, want = _run(model, model, policy, x)
        assert seen == want, name  # the dtype of every intermediate, op by op
        _assert_same(out, ref, backend)
        assert _graphs() > before, name  # each policy compiles its own code ...
    for name in ("ops", "rules", "default"):  # ... reused when it comes back
        before = _graphs()
        out, seen = _run(compiled, model, POLICIES[name], x)
        assert seen == _run(model, model, POLICIES[name], x)[1] and _graphs() == before, name
    # with the python-level rule a TorchFunctionMode is traced: still no graph break
    _assert_breaks()
    # the differences the probe sees are real: each policy changed some dtype
    dtypes = {name: _run(model, model, p, x)[1] for name, p in POLICIES.items()}
    for name in ("ops", "conditional", "python_op", "rules", "by_name", "promote"):
        assert dtypes[name] != dtypes["default"], name


@BACKENDS
def test_module_compile_in_place_applies_name_rules_like_eager(backend):
    """``model.compile()`` compiles the top module's call itself (no wrapper called
    eagerly): name rules still resolve against the model."""
    torch.manual_seed(0)
    model, x = Probe(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    model.compile(backend=backend)
    policy = amp.Policy(module_rules={"head": FP32, "norm": BF16}, fp32_ops=[F.gelu])
    out, seen = _run(model, model, policy, x)
    want_out, want = _run(ref, ref, policy, x)
    assert seen == want and ("head", FP32) in seen
    _assert_same(out, want_out, backend)


def test_policies_built_anew_share_compiled_code():
    """``amp.autocast()`` builds its Policy on each entry; equal policies must not
    recompile (the guard is on the policy's value, not its identity)."""
    torch.manual_seed(0)
    model, x = Probe(), torch.randn(4, 8)
    compiled = torch.compile(model, backend=FAST)
    with amp.autocast(amp.Policy(fp32_ops=[F.linear]), "cpu"):
        pass  # kernels registered before compiling
    counts = []
    for _ in range(3):
        model.seen.clear()
        with amp.autocast(device_type="cpu"):
            compiled(x)
        model.seen.clear()
        with amp.autocast(amp.Policy(fp32_ops=[F.linear]), "cpu"):
            compiled(x)
        counts.append(_graphs())
    assert counts[0] > 0 and counts[0] == counts[1] == counts[2]


@BACKENDS
def test_threads_with_different_policies_get_their_own_compiled_code(backend):
    import threading

    torch.manual_seed(0)
    model, x = Probe(), torch.randn(4, 8)
    compiled = torch.compile(model, backend=backend)
    _run(compiled, model, POLICIES["ops"], x)  # compiled in this thread
    got = {}

    def other():
        with amp.autocast(POLICIES["default"], "cpu"):
            got["out"] = compiled(x)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    with torch.autocast("cpu", dtype=BF16):
        want = model(x)
    _assert_same(got["out"], want, backend)  # the default policy's graph, not this thread's


@BACKENDS
def test_compiled_function_without_modules_follows_the_policy(backend):
    """No module call: the guard comes from ampkit's kernel while the function is
    traced, and a policy that first overrides an op drops older unguarded code."""
    w = torch.randn(8, 8)

    def fn(x):
        return torch.mm(x, w), F.normalize(x)

    compiled = torch.compile(fn, backend=backend)
    x = torch.randn(4, 8)
    for policy in (POLICIES["default"], amp.Policy(fp32_ops=["mm"]), POLICIES["python_op"],
                   POLICIES["default"], amp.Policy(fp32_ops=["mm"])):
        with amp.autocast(policy, "cpu"):
            got, want = compiled(x), fn(x)
        for a, b in zip(got, want):
            _assert_same(a, b, backend)
    _assert_breaks()
    got = compiled(x)  # no scope
    assert got[0].dtype == FP32
    _assert_same(got[0], fn(x)[0], backend)


@BACKENDS
def test_scope_entered_inside_compiled_code(backend):
    """``with amp.autocast(...)`` inside the compiled function: the scope is entered and
    left eagerly at a graph break (the only ones), and the code in it is compiled
    under it: the eager dtypes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    policy = amp.Policy(fp32_ops=[F.gelu], module_rules={nn.Sequential: FP32, nn.Linear: BF16})

    def fn(x):
        with amp.autocast(policy, "cpu"):
            h = model[0](x)
            g = F.gelu(h)
            return model(x), h.dtype, g.dtype

    x = torch.randn(2, 8)
    got, want = torch.compile(fn, backend=backend)(x), fn(x)
    assert got[1:] == want[1:] == (BF16, FP32)
    _assert_same(got[0], want[0], backend)
    _assert_breaks(at_most=2)
    assert amp.casting.active_scopes() == 0
    assert not torch.is_autocast_enabled("cpu")


def test_explain_on_a_compiled_model_explains_the_eager_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(3, 8)
    policy = amp.Policy(fp32_ops=[F.gelu])
    rep = amp.explain(torch.compile(model, backend=FAST), x, policy=policy, device_type="cpu")
    ref = amp.explain(model, x, policy=policy, device_type="cpu")
    assert rep.records == ref.records and rep.note is not None and "eager Sequential" in str(rep)
    fn_rep = amp.explain(torch.compile(lambda t: model(t), backend=FAST), x, policy=policy, device_type="cpu")
    assert fn_rep.records == ref.records and fn_rep.note is not None


# --- training: every level, the bench CNN and a small transformer ---------------------
def _cnn():
    # three input channels: a one-channel image meets an inductor layout bug on more torch
    # releases and CPUs (see the test of it below), which is torch's and not under test here
    return DigitsCNN(width=4, in_channels=3), lambda g: (torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g))


def _transformer():
    model = CharTransformer(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_len=8)

    def batch(g):
        ids = torch.randint(0, 16, (4, 9), generator=g)
        return ids[:, :-1], ids[:, 1:]

    return model, batch


def _train(make, level, compiled, steps=2, policy=None, backend=FAST):
    amp.reset()
    torch.manual_seed(0)
    model, batch = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    overrides = {"policy": policy} if policy is not None else {}
    if level == "init":
        amp.init(device_type="cpu", policy=policy)
        amp.init_trainer(opt)
    else:
        model, opt = amp.initialize(model, opt, opt_level=level, **overrides)
    seen: list[tuple[str, torch.dtype]] = []
    for name, m in model.named_modules():
        if not list(m.children()):
            m.register_forward_hook(lambda mod, i, o, n=name: seen.append((n, o.dtype)))
    run = torch.compile(model, backend=backend) if compiled else model
    g = torch.Generator().manual_seed(1)
    losses, dtypes = [], None
    for step in range(steps):
        x, y = batch(g)
        out = run(x)
        loss = F.cross_entropy(out.float().flatten(0, -2) if out.dim() > 2 else out.float(), y.flatten())
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            dtypes = list(seen)
    amp.reset()
    return losses, dtypes


LEVELS = ["O0", "O1", "O2", "O3", "O2K", "init"]


# The exact check (aot_eager computes what eager does) on the CNN; the transformer under
# inductor, the backend users get (aot_eager there would add ~35 s for the same check).
@pytest.mark.parametrize("make,backend", [
    pytest.param(_cnn, FAST, id="cnn-" + FAST),
    pytest.param(_cnn, "inductor", id="cnn-inductor"),
    pytest.param(_transformer, "inductor", id="transformer-inductor"),
])
def test_compiled_models_train_as_eager_at_every_level(make, backend):
    custom = amp.Policy(fp32_ops=[F.gelu, "softmax"], module_rules={nn.LayerNorm: FP32})
    # Under inductor the levels whose compiled graphs differ in what ampkit decides
    # (op-level casting, a cast model with fp32 norms, the process-wide init, a custom
    # policy); O0 (fp32), O3 (all 16-bit) and O2K (O2's forward) add compile time only.
    levels = LEVELS if backend == FAST else ["O1", "O2", "init"]
    runs = [*((lv, None) for lv in levels), ("O1", custom)]
    torch_bug = []
    for level, policy in runs:
        eager, want = _train(make, level, compiled=False, policy=policy)
        try:
            comp, got = _train(make, level, compiled=True, policy=policy, backend=backend)
        except AssertionError as err:
            # Inductor's own stride check on a bf16 CPU convolution (torch's bug on some
            # releases and CPU kinds): acceptable only where torch's own bf16 paths hit it too
            if not (_is_stride_check(err) and make is _cnn and _torch_hits_stride_check(in_channels=3)):
                raise
            torch_bug.append(level if policy is None else f"{level}+custom")
            continue
        assert got == want, (level, policy)  # each layer's output dtype, op for op
        if backend == FAST:
            assert eager == comp, (level, policy)  # aot_eager computes what eager does
        else:  # fused kernels round differently: within bf16 noise
            assert all(abs(a - b) <= 0.02 * abs(a) for a, b in zip(eager, comp)), (level, policy, eager, comp)
    _assert_breaks()
    if torch_bug:
        pytest.skip(
            f"torch {torch.__version__}'s Inductor fails its own stride check on this CPU's bf16 "
            f"convolution under torch.autocast or in a bf16 model too; levels {torch_bug} not compared")


def _is_stride_check(err: AssertionError) -> bool:
    return "expected size" in str(err) and "stride" in str(err)


def _first_compiled_step(use_ampkit: bool, in_channels: int = 1, cast_model: bool = False) -> str:
    """What a compiled CNN's first bf16 forward does under a scope (ampkit's or torch's),
    or as a bf16 model without one: "ok" or the error's class."""
    amp.reset()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DigitsCNN(width=4, in_channels=in_channels)
    x = torch.randn(8, in_channels, 16, 16)
    if cast_model:
        model, x, scope = model.to(BF16), x.to(BF16), contextlib.nullcontext()
    else:
        scope = amp.autocast(device_type="cpu") if use_ampkit else torch.autocast("cpu", dtype=BF16)
    compiled = torch.compile(model)
    try:
        with scope:
            out = compiled(x)
        assert out.dtype == BF16
        return "ok"
    except AssertionError as err:
        assert _is_stride_check(err), err
        return type(err).__name__
    finally:
        amp.reset()
        torch._dynamo.reset()


def _torch_hits_stride_check(in_channels: int) -> bool:
    """Whether torch's own bf16 paths (torch.autocast, a bf16 model) fail Inductor's
    stride check on the CNN here."""
    return any(_first_compiled_step(False, in_channels, cast) != "ok" for cast in (False, True))


@pytest.mark.parametrize("in_channels", [1, 3])
def test_a_cnn_compiles_under_op_level_casting_as_under_torch_autocast(in_channels):
    """On some torch releases and CPU kinds (2.10 and 2.11 with a one-channel input, 2.15
    with three, on CPUs with native bf16 convolutions) Inductor predicts the layout of a
    bf16 convolution's output wrongly and its own stride check fails, under plain
    ``torch.autocast``. ampkit's op-level casting (O1, ``amp.init``) fares exactly as
    torch's autocast does on this torch and CPU: both compile and run, or both hit torch's
    check. (The training test above compares levels only where torch's paths compile.)"""
    assert _first_compiled_step(True, in_channels) == _first_compiled_step(False, in_channels)


def test_fp16_scaler_skips_an_overflowing_step_of_a_compiled_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", dtype=FP16, loss_scale=128.0)
    run = torch.compile(model, backend=FAST)
    x = torch.randn(4, 4)
    with amp.scale_loss(run(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not amp.step_skipped(opt)
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(run(x * 1e30).float().sum(), opt) as scaled:  # inf in fp16
        scaled.backward()
    opt.step()
    assert amp.step_skipped(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# --- the default backend ---------------------------------------------------------
def test_inductor_default_policy_equals_compiled_torch_autocast_without_graph_breaks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    ref_model = copy.deepcopy(model)
    x = torch.randn(4, 8)
    compiled, ref_compiled = torch.compile(model), torch.compile(ref_model)
    with torch.autocast("cpu", dtype=BF16):
        want = ref_compiled(x)
    with amp.autocast(device_type="cpu"):
        got = compiled(x)
    assert got.dtype == BF16 and torch.equal(got, want)
    _assert_breaks()
    with amp.autocast(device_type="cpu"):
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_inductor_custom_policy_trains_the_transformer_like_eager():
    custom = amp.Policy(fp32_ops=[F.gelu, "softmax"], module_rules={nn.LayerNorm: FP32, "head": FP32})
    eager, want = _train(_transformer, "O1", compiled=False, policy=custom, steps=3)
    comp, got = _train(_transformer, "O1", compiled=True, policy=custom, steps=3, backend="inductor")
    assert got == want
    assert ("head", FP32) in got and ("ln", FP32) in got and ("blocks.0.fc1", BF16) in got
    for a, b in zip(eager, comp):  # fused kernels round differently: within bf16 noise
        assert abs(a - b) <= 0.02 * abs(a)
    _assert_breaks()


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_inductor_caches_never_serve_a_graph_under_another_policy(grad, tmp_path, monkeypatch):
    """torch.compile's AOTAutograd cache keys code on dynamo's graph and torch's autocast
    state; ampkit's kernels cast later, while that graph is traced. A graph compiled under
    one policy is not served under another (another process, after a reset, or a
    recompile of the guard), and one compiled under the same policy is served again."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # no entries of other runs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    x = torch.randn(4, 16)
    custom = [amp.Policy(fp32_ops=["linear"]), amp.Policy(fp32_ops=[F.linear]), amp.Policy(promote_ops=["linear"])]
    for policy in custom:
        with amp.autocast(policy, "cpu"):
            pass  # kernels registered before compiling
    compiled = torch.compile(model)
    context = contextlib.nullcontext if grad else torch.no_grad
    for reset in (False, True):  # a recompile of the guard, then fresh compiles
        for policy in [None, *custom, None]:  # None: the default policy
            if reset:
                torch._dynamo.reset()
            with context(), amp.autocast(policy, "cpu"):
                got, want = compiled(x), model(x)
            assert got.dtype == want.dtype == (BF16 if policy is None else FP32)
            _assert_same(got, want, "inductor")
    if not grad:  # inference graphs are cached: the same policy's graph was served again
        assert _counters()["aot_autograd"]["autograd_cache_hit"] > 0


@pytest.mark.fresh_process
def test_a_policy_first_overriding_an_op_keeps_compiled_code_it_cannot_affect(caplog):
    """Code compiled without autocast (an optimizer step) or guarded on ampkit's scopes
    (a model compiled under a scope) is kept when a policy first overrides an op; code
    traced under autocast with no ampkit guard is compiled again (it would run the op as
    torch's own kernel cast it) and a warning says so, once."""
    import logging

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch.manual_seed(0)
    model, w, x = nn.Sequential(nn.Linear(8, 8), nn.GELU()), torch.randn(8, 8), torch.randn(4, 8)

    def step(t):
        return (t * 2).sum()

    def matmul(t):
        return torch.mm(t, w)

    run_model, run_step, run_matmul = (torch.compile(f, backend=FAST) for f in (model, step, matmul))
    run_step(x)
    with amp.autocast(device_type="cpu"):
        run_model(x)
    with torch.autocast("cpu", dtype=BF16):
        assert run_matmul(x).dtype == BF16
    compiled = _counters()["stats"]["unique_graphs"]
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        with amp.autocast(amp.Policy(fp32_ops=["mm"]), "cpu"):
            pass
        with amp.autocast(amp.Policy(fp32_ops=["mm", "gelu"]), "cpu"):
            pass
    assert len(_debug_get_cache_entry_list(step)) == 1
    assert not _debug_get_cache_entry_list(matmul)
    run_step(x)
    with amp.autocast(device_type="cpu"):
        run_model(x)
    assert _counters()["stats"]["unique_graphs"] == compiled  # nothing kept was compiled again
    with amp.autocast(amp.Policy(fp32_ops=["mm"]), "cpu"):
        got = run_matmul(x)
    assert got.dtype == FP32 and torch.equal(got, matmul(x))
    dropped = [r for r in caplog.records if "compiled again" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelno == logging.WARNING and "matmul" in dropped[0].getMessage()


class Record(nn.Module):
    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def forward(self, h):
        self.seen.append(h.dtype)
        return h


class KeptBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen: list[torch.dtype] = []
        self.inp = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), Record(self.seen))
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        self.seen.append(h.dtype)
        return self.out(self.block(h))


@BACKENDS
@pytest.mark.parametrize("level", ["O2", "O2K"])
def test_a_kept_fp32_block_computes_fp32_in_compiled_code_without_graph_breaks(level, backend):
    """initialize(keep_fp32=["block"]): the block's matmuls run fp32 inside the O2
    model's op-level casting, compiled as eager, with no graph break (the FSDP guard
    and the gradient path's class lookups are constants of the graph)."""
    torch.manual_seed(0)
    model = KeptBlock()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, keep_fp32=["block"])
    x = torch.randn(4, 8)
    eager = model(x)
    want = list(model.seen)
    assert want == [BF16, FP32]
    model.seen.clear()
    compiled = torch.compile(model, backend=backend)
    out = compiled(x)
    assert model.seen == want
    _assert_same(out, eager, backend)
    with amp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not amp.step_skipped(opt)
    _assert_breaks()


@pytest.mark.fresh_process
def test_without_the_policy_guard_code_is_compiled_again_at_a_policy_change_never_run_stale(monkeypatch, caplog):
    """On a torch where dynamo's guard API refuses ampkit's policy guard, compiled code
    that calls no module (so no hook guards it) would run under a later policy in the
    dtypes of the one it was traced under. ampkit warns once and drops that code when a
    scope changes the policy: every call computes in its own policy's dtypes."""
    import logging

    def refuse(*args, **kwargs):
        raise RuntimeError("no guard API on this torch")

    monkeypatch.setattr(torch_compat, "guard_attr_equals", refuse)
    torch.manual_seed(0)
    w, x = torch.randn(8, 8), torch.randn(4, 8)

    def matmul(t):
        return torch.mm(t, w)

    run = torch.compile(matmul, backend=FAST)
    fp32_mm = amp.Policy(fp32_ops=["mm"])
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        for policy, want in [(fp32_mm, FP32), (None, BF16), (fp32_mm, FP32), (None, BF16)]:
            with amp.autocast(policy, "cpu"):
                got = run(x)
                assert got.dtype == want and torch.equal(got, matmul(x))
    said = [r for r in caplog.records if "could not make torch.compile guard" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
