"""The casting engine: overrides, module rules, scopes, the cast cache, training."""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp
from ampkit.casting import engine as casting

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def x44(dtype=FP32, seed=0):
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- op-level overrides --------------------------------------------------------
def test_op_moved_to_fp32_others_untouched():
    a = x44()
    with amp.autocast(amp.Policy(fp32_ops=[torch.mm]), "cpu"):
        assert torch.mm(a, a).dtype == FP32
        assert torch.mm(a.bfloat16(), a.bfloat16()).dtype == FP32  # inputs cast up
        assert torch.matmul(a, a).dtype == BF16
        assert F.linear(a, a).dtype == BF16
    # the value is the fp32 result, not a rounded one
    with amp.autocast(amp.Policy(fp32_ops=["mm"]), "cpu"):
        got = torch.mm(a, a)
    assert torch.equal(got, torch.mm(a, a))


def test_op_moved_to_lower_precision():
    a = x44()
    with amp.autocast(amp.Policy(lower_ops=[torch.exp, F.gelu]), "cpu"):
        assert torch.exp(a).dtype == BF16
        assert F.gelu(a).dtype == BF16
        assert torch.tanh(a).dtype == FP32  # not listed: input dtype
    with amp.autocast(amp.Policy(lower_ops=["torch.nn.functional.softmax"]), "cpu"):
        assert F.softmax(a, -1).dtype == BF16
        ref = F.softmax(a.bfloat16(), -1)
        assert torch.equal(F.softmax(a, -1), ref)


def test_promote_op():
    a = x44()
    policy = amp.Policy(promote_ops=[torch.mm])
    with amp.autocast(policy, "cpu"):
        assert torch.mm(a.bfloat16(), a).dtype == FP32
        assert torch.mm(a.bfloat16(), a.bfloat16()).dtype == BF16
    with torch.autocast("cpu", dtype=BF16):  # natively mm is lower
        assert torch.mm(a.bfloat16(), a).dtype == BF16


def test_conditional_fp32_both_ways():
    a = x44().abs() + 0.5

    def big_exponent(x, e, **kw):
        return isinstance(e, (int, float)) and abs(e) > 2

    policy = amp.Policy(lower_ops=[torch.pow], conditional_fp32_ops=[(torch.pow, big_exponent)])
    with amp.autocast(policy, "cpu"):
        assert torch.pow(a, 2).dtype == BF16
        assert torch.pow(a, 8).dtype == FP32
        assert (a**8).dtype == FP32
    got = None
    with amp.autocast(policy, "cpu"):
        got = torch.pow(a, 8)
    assert torch.equal(got, torch.pow(a, 8))


def test_python_level_function_is_intercepted():
    a = x44()
    with amp.autocast(amp.Policy(lower_ops=[F.normalize]), "cpu"):
        assert F.normalize(a).dtype == BF16
    with amp.autocast(amp.Policy(), "cpu"):
        assert F.normalize(a).dtype == FP32


def test_override_reaches_ops_inside_other_torch_functions():
    """MultiheadAttention calls linear from Python inside F.multi_head_attention_forward;
    moving linear to fp32 must reach those calls too."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    with amp.autocast(amp.Policy(), "cpu"):
        assert mha(x, x, x)[0].dtype == BF16
    with amp.autocast(amp.Policy(fp32_ops=[F.linear]), "cpu"):
        rep = amp.explain(mha, x, x, x)
    lin = [r for r in rep.records if r.op in ("addmm", "mm", "linear")]
    assert lin and all(r.compute_dtype == FP32 for r in lin)


def test_gradients_reach_parameters_in_their_own_dtype():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with amp.autocast(amp.Policy(fp32_ops=[torch.relu]), "cpu"):
        out = model(torch.randn(3, 4))
    out.float().sum().backward()
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == FP32


# --- module rules --------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


def _dtypes_by_module(model, x, policy):
    seen = {}
    hooks = [
        m.register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, (i[0].dtype, o.dtype)))
        for n, m in model.named_modules()
        if n
    ]
    with amp.autocast(policy, "cpu"):
        model(x)
    for h in hooks:
        h.remove()
    return seen


def test_module_rule_by_class():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 8)
    base = _dtypes_by_module(model, x, amp.Policy())
    assert base["norm"] == (BF16, BF16)
    ruled = _dtypes_by_module(model, x, amp.Policy(module_rules={nn.LayerNorm: FP32}))
    assert ruled["norm"] == (FP32, FP32)  # input cast up, computed in fp32
    assert ruled["body"][1] == BF16 and ruled["head"][1] == BF16


def test_module_rule_by_name_glob():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 8)
    ruled = _dtypes_by_module(model, x, amp.Policy(module_rules={"head": FP32}))
    assert ruled["head"] == (FP32, FP32)
    assert ruled["body"][1] == BF16
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Net(), Net()

        def forward(self, x):
            return self.a(x) + self.b(x)

    outer = Pair()
    seen = _dtypes_by_module(outer, x, amp.Policy(module_rules={"*.head": FP32}))
    assert seen["a.head"][1] == FP32 and seen["b.head"][1] == FP32 and seen["b.body"][1] == BF16


def test_module_rule_lower_dtype_and_exception_safety():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 8)
    seen = _dtypes_by_module(model, x, amp.Policy(module_rules={"head": FP16}))
    assert seen["head"][1] == FP16 and seen["body"][1] == BF16

    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    bad = nn.Sequential(nn.Linear(8, 8), Boom())
    with amp.autocast(amp.Policy(module_rules={Boom: FP32}), "cpu"):
        with pytest.raises(RuntimeError, match="boom"):
            bad(x)
        # the rule's scope was closed: casting is back to the outer policy
        assert torch.mm(x, x.T).dtype == BF16
    assert casting.active_scopes() == 0


def test_module_rules_class_specificity_and_name_precedence():
    class MyNorm(nn.LayerNorm):
        pass

    policy = amp.Policy(module_rules={nn.Module: BF16, nn.LayerNorm: FP32, "special": FP16})
    assert policy.module_dtype(MyNorm(4), "x") == FP32
    assert policy.module_dtype(nn.Linear(2, 2), "x") == BF16
    assert policy.module_dtype(MyNorm(4), "special") == FP16


# --- scopes ----------------------------------------------------------------------
def test_nested_scopes_and_enabled_false():
    a = x44()
    with amp.autocast(amp.Policy(fp32_ops=[torch.mm]), "cpu"):
        assert torch.mm(a, a).dtype == FP32
        with amp.autocast(amp.Policy(), "cpu"):
            assert torch.mm(a, a).dtype == BF16
            with amp.autocast(enabled=False, device_type="cpu"):
                assert torch.mm(a, a).dtype == FP32
                assert torch.matmul(a, a).dtype == FP32
            assert torch.matmul(a, a).dtype == BF16
        assert torch.mm(a, a).dtype == FP32
        assert torch.matmul(a, a).dtype == BF16
    assert torch.mm(a, a).dtype == FP32
    assert casting.active_scopes() == 0


def test_decorator_and_reuse():
    scope = amp.autocast(amp.Policy(lower_ops=[torch.exp]), "cpu")

    @scope
    def f(a):
        return torch.exp(a)

    a = x44()
    assert f(a).dtype == BF16
    assert torch.exp(a).dtype == FP32
    with scope:
        with scope:  # the same object nests
            assert f(a).dtype == BF16
        assert torch.exp(a).dtype == BF16
    assert torch.exp(a).dtype == FP32


def test_init_and_reset_global():
    a = x44()
    policy = amp.init(device_type="cpu", fp32_ops=[torch.mm])
    assert policy.dtype == BF16
    assert torch.mm(a, a).dtype == FP32 and torch.matmul(a, a).dtype == BF16
    assert amp.is_active("cpu") and amp.current_policy() is policy
    amp.init(dtype=BF16, device_type="cpu")  # replaces
    assert torch.mm(a, a).dtype == BF16
    amp.reset()
    assert torch.matmul(a, a).dtype == FP32 and not amp.is_active()
    assert casting.active_scopes() == 0


def test_scopes_are_per_thread():
    a = x44()
    result = {}
    with amp.autocast(amp.Policy(), "cpu"):
        t = threading.Thread(target=lambda: result.setdefault("dtype", torch.mm(a, a).dtype))
        t.start()
        t.join()
        assert torch.mm(a, a).dtype == BF16
    assert result["dtype"] == FP32


# --- the weight-cast cache -------------------------------------------------------
def test_cache_invalidated_by_in_place_weight_update():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, bias=False)
    x = torch.randn(2, 4)
    with amp.autocast(amp.Policy(), "cpu"):
        y1 = lin(x)
        with torch.no_grad():
            lin.weight.mul_(2)
        y2 = lin(x)
    assert torch.allclose(y2.float(), 2 * y1.float(), rtol=1e-2)


def test_native_cache_alone_would_be_stale():
    """What the version check protects against: torch.autocast's own cache keeps the
    old cast after an in-place update."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, bias=False)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=BF16):
        y1 = lin(x)
        with torch.no_grad():
            lin.weight.mul_(2)
        y2 = lin(x)
    assert torch.equal(y1, y2)


def test_cache_invalidated_by_optimizer_step_under_init():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    x = torch.randn(8, 4)
    amp.init(device_type="cpu")
    outs = []
    for _ in range(3):
        out = lin(x)
        outs.append(out.detach().float())
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        last = lin(x)
    amp.reset()
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        fresh = lin(x)  # a new scope: casts of the current weights
    assert torch.equal(last, fresh)


class _TwiceExp(nn.Module):
    """Uses its weight twice in one forward through an op ampkit casts itself."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
        self.cache_sizes = []

    def forward(self, x):
        y = torch.exp(self.w) + torch.exp(self.w)
        self.cache_sizes.append(len(casting.top_frame("cpu").cache))
        return x @ y


def test_own_cache_lives_for_one_outermost_module_call():
    """For ops ampkit casts itself, a parameter is cast once per outermost module
    call; between calls (and outside module calls) nothing is cached."""
    m = _TwiceExp()
    x = torch.randn(2, 4)
    policy = amp.Policy(lower_ops=[torch.exp])
    with amp.autocast(policy, "cpu"):
        y1 = m(x)
        assert m.cache_sizes == [1] and len(casting.top_frame("cpu").cache) == 0
        m.w.data.add_(1.0)  # .data: a version counter of its own, invisible to version checks
        y2 = m(x)
        e1, e2 = torch.exp(m.w), torch.exp(m.w)
        assert len(casting.top_frame("cpu").cache) == 0  # outside module calls: no cache
    assert not torch.equal(y1, y2)
    with torch.no_grad():
        want = x.bfloat16() @ (2 * torch.exp(m.w.bfloat16()))
    assert torch.equal(y2, want) and torch.equal(e1, e2)
    with amp.autocast(policy, "cpu", cache_enabled=False):
        m(x)
    assert m.cache_sizes[-1] == 0


def _fresh(model, x):
    """What torch.autocast around this one call computes: casts of the weights now."""
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        return model(x)


@pytest.mark.parametrize("scope", ["init", "autocast"])
def test_weights_changed_any_way_are_never_computed_stale(scope):
    """``.data`` updates move no version counter the parameter has; copy_,
    load_state_dict, EMA updates, no optimizer: every forward sees the weights as
    they are, under amp.init and inside one long amp.autocast scope."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    updates = [
        lambda: m[0].weight.data.add_(1.0),
        lambda: m[2].weight.data.copy_(torch.randn(2, 8)),
        lambda: [p.data.mul_(0.5).add_(q.data, alpha=0.5) for p, q in zip(m.parameters(), other.parameters())],
        lambda: m.load_state_dict(other.state_dict()),
        lambda: m[0].bias.data.fill_(3.0),
    ]
    with contextlib.ExitStack() as stack:
        if scope == "init":
            amp.init(device_type="cpu")
        else:
            stack.enter_context(amp.autocast(device_type="cpu"))
        before = m(x)
        for update in updates:
            update()
            with torch.no_grad():
                got = m(x)
            want = _fresh(m, x)
            assert not torch.equal(got, before)
            assert torch.equal(got, want)
            before = got
    amp.reset()


def test_manual_sgd_through_data_under_init_trains_as_torch_autocast_per_forward():
    """The classic loop (``p.data.add_(p.grad, alpha=-lr)``, no optimizer) under
    amp.init: bitwise the same as torch.autocast around each forward, and close to
    fp32."""

    def run(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        g = torch.Generator().manual_seed(1)
        w_true = torch.randn(8, 1, generator=g)
        data = [(x, x @ w_true) for x in torch.randn(40, 32, 8, generator=g)]
        if mode == "init":
            amp.init(device_type="cpu")
        losses = []
        for x, y in data:
            if mode == "torch":
                with torch.autocast("cpu", dtype=BF16):
                    out = model(x)
            else:
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            model.zero_grad()
            loss.backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.05)
            losses.append(loss.item())
        amp.reset()
        return losses, [p.detach().clone() for p in model.parameters()]

    fp32, _ = run("fp32")
    init, w_init = run("init")
    ref, w_ref = run("torch")
    assert init == ref
    assert all(torch.equal(a, b) for a, b in zip(w_init, w_ref))
    assert fp32[-1] < 0.5 * fp32[0]  # it learned
    assert abs(init[-1] - fp32[-1]) < 0.05 + 0.1 * fp32[-1]


def test_leaf_tensor_outside_any_module_is_never_cached():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    amp.init(device_type="cpu")
    y1 = x @ w
    w.data.add_(1.0)
    y2 = x @ w
    amp.reset()
    with torch.no_grad():
        assert torch.equal(y2, (x.bfloat16() @ w.bfloat16()))
    assert not torch.equal(y1, y2)


def test_weight_used_twice_in_one_forward_matches_torch_autocast_bitwise():
    """Inside one module call casts are cached as torch.autocast caches them, so a
    weight used twice gets the same gradient, bit for bit."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            return self.lin(torch.tanh(self.lin(x)))

    torch.manual_seed(0)
    m = Tied()
    ref = copy.deepcopy(m)
    x = torch.randn(5, 6)
    with amp.autocast(device_type="cpu"):
        m(x).float().sum().backward()
    with torch.autocast("cpu", dtype=BF16):
        ref(x).float().sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_cache_not_used_under_no_grad_then_grad():
    """train -> eval under no_grad -> train: gradients still flow to the weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    x = torch.randn(5, 4)
    amp.init(device_type="cpu", lower_ops=[torch.tanh])
    model(x).float().sum().backward()
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.no_grad():
        model.eval()
        model(x)
        model.train()
    model(x).float().sum().backward()
    g2 = [p.grad.clone() for p in model.parameters()]
    amp.reset()
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        ref(x).float().sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, r.grad, rtol=2e-2, atol=1e-3)


# --- training ------------------------------------------------------------------
@pytest.mark.slow
def test_training_loop_matches_fp32_within_bf16_tolerance():
    def run(policy):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        w_true = torch.randn(16, 4, generator=g)
        losses = []
        for _ in range(300):
            x = torch.randn(64, 16, generator=g)
            y = (x @ w_true).argmax(-1)
            if policy is None:
                loss = F.cross_entropy(model(x), y)
            else:
                with amp.autocast(policy, "cpu"):
                    loss = F.cross_entropy(model(x), y)
                    assert loss.dtype == FP32
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return sum(losses[-30:]) / 30

    fp32 = run(None)
    bf16 = run(amp.default_policy("cpu"))
    custom = run(amp.Policy(module_rules={nn.LayerNorm: FP32}, fp32_ops=[F.gelu]))
    assert fp32 < 0.35  # it learned
    assert abs(bf16 - fp32) < 0.05 + 0.1 * fp32
    assert abs(custom - fp32) < 0.05 + 0.1 * fp32


# --- errors ----------------------------------------------------------------------
def test_policy_errors_name_the_problem():
    with pytest.raises(amp.PolicyError, match="both"):
        amp.Policy(lower_ops=[torch.mm], fp32_ops=["mm"])
    with pytest.raises(amp.PolicyError, match="not the name of a torch op"):
        amp.Policy(fp32_ops=["not_an_op_at_all"])
    with pytest.raises(amp.PolicyError, match="not a torch function"):
        amp.Policy(fp32_ops=[lambda x: x])
    with pytest.raises(amp.PolicyError, match="fp8"):
        amp.Policy(dtype=torch.float8_e4m3fn)
    with pytest.raises(amp.PolicyError, match="full precision"):
        amp.Policy(dtype=torch.float32)
    with pytest.raises(amp.PolicyError, match=r"init\(policy=my_policy\)"):
        amp.init(amp.Policy(fp32_ops=[F.gelu]))
    assert not amp.is_active()  # nothing was turned on
    with pytest.raises(amp.PolicyError, match="cannot autocast|op lists"):
        amp.autocast(device_type="nosuchdevice")
    with pytest.raises(amp.PolicyError, match="single op"):
        amp.Policy(fp32_ops=torch.mm)
    with pytest.raises(amp.PolicyError, match="module rule"):
        amp.Policy(module_rules={nn.LayerNorm: torch.float64})
    with pytest.raises(amp.PolicyError, match="module rule key"):
        amp.Policy(module_rules={3: FP32})
    with pytest.raises(amp.PolicyError, match="pairs"):
        amp.Policy(conditional_fp32_ops=[torch.pow])
    assert issubclass(amp.PolicyError, amp.AmpError)


def test_fp16_on_cpu_warns_once():
    amp.reset()  # a new ampkit session: the warning comes once again
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        amp.autocast(amp.Policy(dtype=FP16), "cpu")
        amp.autocast(amp.Policy(dtype=FP16), "cpu")
    msgs = [str(w.message) for w in rec if "float16 on CPU" in str(w.message)]
    assert len(msgs) == 1


def test_policy_combination_user_wins_per_op():
    base = amp.default_policy("cpu")
    merged = base.override(amp.Policy(fp32_ops=[torch.mm], lower_ops=[torch.exp]))
    cats = merged.categories()
    assert cats["mm"] == "fp32" and cats["exp"] == "lower" and cats["cat"] == "promote"
    assert cats["conv2d"] == "lower"
    assert base.categories()["mm"] == "lower"  # immutable
    assert amp.canonical_op(torch.Tensor.__matmul__) == "matmul"
    assert amp.canonical_op(F.cross_entropy) == "cross_entropy_loss"
    assert amp.canonical_op("aten::pow.Tensor_Scalar") == "pow"
    assert amp.canonical_op(F.normalize).startswith("py:")


def test_conditional_op_left_alone_keeps_autocast_inside_composite_ops():
    """einsum is not on the CPU lists but decomposes into bmm, which is: when a
    conditional rule on einsum does not fire, bmm must still run in bf16, as under
    torch.autocast (not in fp32 because ampkit's kernel ran with autocast excluded)."""
    a = torch.randn(2, 4, 4, requires_grad=True)

    def fires(eq, tensors, *rest, **kw):  # aten::einsum(equation, tensors, path)
        return tensors[0].shape[0] == 3

    policy = amp.Policy(conditional_fp32_ops=[(torch.einsum, fires)])
    with torch.autocast("cpu", dtype=BF16):
        ref = torch.einsum("bij,bjk->bik", a, a)
    with amp.autocast(policy, "cpu"):
        out = torch.einsum("bij,bjk->bik", a, a)
        assert torch.einsum("bij,bjk->bik", *[torch.randn(3, 4, 4)] * 2).dtype == FP32  # fires
    assert out.dtype == ref.dtype == BF16
    assert torch.equal(out, ref)
    out.float().sum().backward()
    assert a.grad is not None and a.grad.dtype == FP32


def test_module_rules_off_in_a_disabled_scope():
    """``autocast(policy, enabled=False)`` (the ``enabled=args.amp`` pattern) turns the
    policy's module rules off too; inside an fp32 rule, nested rules still apply."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 8)
    policy = amp.Policy(module_rules={nn.Linear: BF16, nn.LayerNorm: FP32})
    with amp.autocast(policy, "cpu", enabled=False):
        assert model(x).dtype == FP32
    half = Net().bfloat16()
    with amp.autocast(policy, "cpu", enabled=False):
        assert half(x.bfloat16()).dtype == BF16  # no fp32 cast of LayerNorm's input
    amp.init(device_type="cpu", policy=policy)
    with amp.autocast(policy, "cpu", enabled=False):
        assert model(x).dtype == FP32
    amp.reset()
    nested = amp.Policy(module_rules={Net: FP32, "head": BF16})
    seen = _dtypes_by_module(model, x, nested)
    assert seen["body"][1] == FP32 and seen["head"][1] == BF16


def test_init_and_reset_from_different_threads():
    """init's scope belongs to its thread: reset or init in another thread neither
    fails nor tears down half of it, and the owning thread can still reset."""
    a = x44()
    amp.init(device_type="cpu")
    errors = []

    def other():
        try:
            amp.reset()
            amp.init(device_type="cpu", fp32_ops=[torch.mm])
            assert torch.mm(a, a).dtype == FP32
            amp.reset()
            assert torch.matmul(a, a).dtype == FP32
        except Exception as exc:  # pragma: no cover - the failure being tested
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors == []
    assert torch.matmul(a, a).dtype == BF16 and casting.active_scopes() == 1
    amp.reset()
    assert torch.matmul(a, a).dtype == FP32 and casting.active_scopes() == 0


def test_python_level_rule_survives_a_nested_scope_for_another_device():
    """A cuda scope nested in a cpu scope must not hide the cpu policy's rules for
    Python-level functions called on cpu tensors (torch.autocast keeps both on)."""
    a = x44()
    with amp.autocast(amp.Policy(lower_ops=[F.normalize]), "cpu"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no GPU here: torch warns and disables its cuda autocast
            with amp.autocast(amp.Policy(dtype=FP16), "cuda"):
                assert F.normalize(a).dtype == BF16
        assert F.normalize(a).dtype == BF16


# --- activation checkpointing ------------------------------------------------------
def test_checkpoint_recomputes_under_the_same_policy():
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(F.gelu(self.fc(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()
            self.head = nn.Linear(8, 2)

        def forward(self, x, ckpt):
            h = checkpoint(self.block, x, use_reentrant=False, context_fn=amp.checkpoint_context) if ckpt else self.block(x)
            return self.head(h)

    policy = amp.Policy(fp32_ops=[F.gelu], module_rules={"block.norm": FP32})
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(4, 8)
    grads = {}
    for ckpt in (False, True):
        model.zero_grad()
        with amp.autocast(policy, "cpu"):
            out = model(x, ckpt)
        out.float().sum().backward()
        grads[ckpt] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)
    assert casting.active_scopes() == 0

    # without the context the recomputation runs under torch's lists only and fails
    model.zero_grad()
    with amp.autocast(policy, "cpu"):
        out = model.head(checkpoint(model.block, x, use_reentrant=False))
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="(?i)metadata|recomput|shape|dtype"):
        out.float().sum().backward()


# --- random streams ----------------------------------------------------------------
def _observable_rng_states():
    import random

    import numpy as np

    states = {"torch": torch.get_rng_state(), "random": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _same_states(a, b) -> bool:
    import numpy as np

    if a.keys() != b.keys():
        return False
    numpy_same = all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a["numpy"], b["numpy"])
    )
    cuda_same = all(torch.equal(x, y) for x, y in zip(a.get("cuda", []), b.get("cuda", [])))
    return torch.equal(a["torch"], b["torch"]) and a["random"] == b["random"] and numpy_same and cuda_same


@pytest.mark.fresh_process
def test_first_scopes_of_a_process_leave_every_random_generator_as_they_found_it():
    """What ampkit sets up on first use (the CPU LSTM probe, kernels, hooks, explain's
    recorder, initialize at each level, a training step) draws from no generator a user
    can observe: a seeded run draws the same numbers with ampkit as without it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2))
    lstm = nn.LSTM(4, 4)
    x = torch.randn(3, 4)
    before = _observable_rng_states()
    policies = [
        None,
        amp.Policy(fp32_ops=[F.linear], lower_ops=["softmax"], promote_ops=["add"]),
        amp.Policy(lower_ops=[F.normalize], module_rules={nn.LayerNorm: FP32}),
    ]
    for policy in policies:
        with amp.autocast(policy, "cpu"):
            model(x).float().sum().backward()
            lstm(x[None])[0].float().sum().backward()
            F.normalize(x).sum()
    amp.explain(model, x, device_type="cpu")
    amp.init(device_type="cpu", fp32_ops=["mm"])
    model(x)
    amp.reset()
    for level in ("O1", "O2", "O3", "O2K"):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m, opt = amp.initialize(m, opt, opt_level=level)
        with amp.scale_loss(m(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        amp.reset()
    assert _same_states(before, _observable_rng_states())


def test_kernels_kept_with_other_threads_alive_differ_only_in_the_cast_cache_until_released():
    """reset() keeps ampkit's kernels while another thread lives; plain torch.autocast then
    gets torch's dtypes and values but a fresh cast at each use (the documented
    difference), and release_kernels() gives torch's own kernels (and cache) back."""
    import threading

    from ampkit.casting import release_kernels

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        torch.manual_seed(0)
        w = torch.randn(4, 4, requires_grad=True)
        x = torch.randn(2, 4)
        with amp.autocast(amp.Policy(fp32_ops=["mm"]), "cpu"):
            assert (torch.mm(x, w)).dtype == torch.float32
        amp.reset()

        def twice() -> tuple[torch.Tensor, torch.Tensor]:
            with torch.autocast("cpu", dtype=BF16):
                y1 = torch.mm(x, w)
                with torch.no_grad():
                    w.mul_(2)
                y2 = torch.mm(x, w)
            with torch.no_grad():
                w.div_(2)
            return y1, y2

        y1, y2 = twice()  # kept kernel: torch's dtype, the in-place update is seen
        assert y1.dtype == y2.dtype == BF16
        assert torch.equal(y1, torch.mm(x.bfloat16(), w.bfloat16()))
        assert torch.equal(y2, 2 * y1)
        with amp.autocast(device_type="cpu"):
            with pytest.raises(amp.StateError, match="scope"):
                release_kernels()
        release_kernels()
        y1, y2 = twice()  # torch's own kernel: its cache keeps the first cast
        assert torch.equal(y1, y2)
    finally:
        stop.set()
        other.join()


def _big_exponent(x, e, **kwargs):
    return isinstance(e, (int, float)) and abs(e) > 4


def test_a_policy_pickles_and_comes_back_equal_and_validated():
    import pickle

    policy = amp.Policy(
        dtype=torch.float16, fp32_ops=[torch.mm, "softmax"], lower_ops=[torch.pow],
        conditional_fp32_ops=[(torch.pow, _big_exponent)],
        module_rules={nn.LayerNorm: torch.float32, "head.*": torch.bfloat16},
    )
    back = pickle.loads(pickle.dumps(policy))
    assert back == policy and back.categories() == policy.categories()
    assert dict(back.module_rules) == dict(policy.module_rules)
    a = torch.randn(4, 4)
    with amp.autocast(back, "cpu"):
        assert torch.mm(a, a).dtype == torch.float32
        assert torch.matmul(a, a).dtype == torch.float16
    with pytest.raises(Exception, match="lambda|local"):
        pickle.dumps(amp.Policy(conditional_fp32_ops=[(torch.pow, lambda x, e, **k: True)]))


def test_a_kernel_registered_over_ampkits_is_found_and_replaced_with_a_warning():
    """Another registration on the same op and key (a library's own autocast kernel)
    wins the dispatch; ampkit.init and explain register ampkit's again and say so."""
    import warnings

    from ampkit._internal import torch_compat as tc
    from ampkit.casting.engine import kernel_registry

    a = torch.randn(4, 4).bfloat16()
    with amp.autocast(amp.Policy(fp32_ops=[torch.relu]), "cpu"):
        assert torch.relu(a).dtype == FP32
    assert kernel_registry.verify() == []  # nothing lost: nothing to do

    def foreign(x):
        with tc.exclude_dispatch_keys(tc.autocast_keyset()):
            return tc.raw_op(torch.ops.aten.relu.default)(x)

    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl("relu", foreign, "AutocastCPU")
        with amp.autocast(amp.Policy(fp32_ops=[torch.relu]), "cpu"):
            assert torch.relu(a).dtype == BF16  # the other kernel ran: the policy did not apply
        with pytest.warns(RuntimeWarning, match="aten::relu on AutocastCPU had been replaced"):
            amp.init(policy=amp.Policy(fp32_ops=[torch.relu]), device_type="cpu")
        assert torch.relu(a).dtype == FP32
        assert "casting/_kernels.py" in tc.kernel_site("aten::relu", "AutocastCPU")
    finally:
        amp.reset()
        amp.casting.release_kernels()
        tc.destroy_library(lib)


def test_reset_leaves_no_global_optimizer_hook():
    """The optimizer step hook that drops cached casts is ampkit's only global optimizer
    hook: ``amp.reset()`` (in a process's only thread) removes it with the module hooks,
    and the next scope installs it again."""
    import threading

    from torch.optim import optimizer as torch_optimizer

    if threading.active_count() != 1:
        pytest.skip("reset keeps global hooks while other threads live")
    amp.reset()
    before = dict(torch_optimizer._global_optimizer_post_hooks)
    model = nn.Linear(4, 4)
    opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1))
    amp.init(torch.bfloat16)
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as loss:
        loss.backward()
    opt.step()
    assert len(torch_optimizer._global_optimizer_post_hooks) == len(before) + 1
    amp.reset()
    assert dict(torch_optimizer._global_optimizer_post_hooks) == before


def test_scopes_given_a_dtype_alone_share_one_policy():
    """A scope entered every step with ``dtype=`` alone builds no policy of its own (its
    resolution is then found, not redone); the shared policy is the one
    ``Policy(dtype=...)`` makes, and each dtype has its own."""
    a, b = amp.autocast(device_type="cpu", dtype=torch.bfloat16), amp.autocast(device_type="cpu", dtype=torch.bfloat16)
    assert a.policy is b.policy and a.policy == amp.Policy(dtype=torch.bfloat16)
    half = amp.autocast(device_type="cpu", dtype=torch.float16).policy
    assert half is not a.policy and half.dtype is torch.float16
    x = torch.randn(4, 4)
    for scope in (a, b, a):
        with scope:
            assert (x @ x).dtype is torch.bfloat16 and torch.softmax(x, -1).dtype is torch.float32
