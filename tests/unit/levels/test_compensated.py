"""Compensated bf16 updates: Kahan summation and stochastic rounding against
plain bf16 weights and an fp32 reference."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from ampkit.errors import AmpError, StateError
from ampkit.levels.compensated import CompensatedUpdates, kahan_round, stochastic_round
from ampkit.levels.model_cast import cast_model

BF16 = torch.bfloat16


def test_stochastic_round_is_unbiased_and_lands_on_neighbours():
    lo = torch.tensor(1.0, dtype=BF16)
    hi = torch.tensor(1.0 + 2**-7, dtype=BF16)  # the next bf16 after 1.0
    x = torch.full((20000,), 1.0 + 0.3 * 2**-7)
    g = torch.Generator().manual_seed(0)
    r = stochastic_round(x, BF16, g)
    assert set(r.float().unique().tolist()) == {lo.item(), hi.item()}
    frac_up = (r == hi).float().mean().item()
    assert abs(frac_up - 0.3) < 0.02
    # Negative values round symmetrically; representable values stay put.
    assert abs((stochastic_round(-x, BF16, g) == -hi).float().mean().item() - 0.3) < 0.02
    exact = torch.tensor([0.5, -3.0, 0.0, 2.0**-100])
    assert torch.equal(stochastic_round(exact, BF16, g).float(), exact)
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    out = stochastic_round(special, BF16, g).float()
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan()


def test_kahan_keeps_increments_that_bf16_rounds_away():
    # 1000 increments of ~1e-4 on weights of 1.0: each is below half a bf16 unit
    # (2**-8), so plain bf16 keeps none of them.
    g = torch.Generator().manual_seed(0)
    steps = torch.rand(1000, 4, generator=g) * 2e-4
    exact = 1.0 + steps.double().sum(0)
    w = torch.ones(4, dtype=BF16)
    plain = torch.ones(4, dtype=BF16)
    c = torch.zeros(4, dtype=BF16)
    for inc in steps:
        w = kahan_round(w.float() + inc, c)
        plain = (plain.float() + inc).to(BF16)
    assert torch.equal(plain, torch.ones(4, dtype=BF16))
    total = w.double() + c.double()
    # The bf16 buffer keeps ~16 significant bits of the sum: 0.5% of the growth.
    assert torch.all((total - exact).abs() < 0.005 * (exact - 1.0))
    assert w.dtype == BF16 and c.dtype == BF16


def _model(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))


@pytest.mark.parametrize(
    "opt_cls, kw",
    [
        (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
        (torch.optim.Adam, {"lr": 1e-3}),
        (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
        (torch.optim.RMSprop, {"lr": 1e-3}),
        (torch.optim.Adagrad, {"lr": 1e-2}),
        (torch.optim.NAdam, {"lr": 1e-3}),
    ],
)
def test_any_optimizer_keeps_bf16_params_state_and_grads(opt_cls, kw):
    model = cast_model(_model(), BF16)
    opt = opt_cls(model.parameters(), **kw)
    comp = CompensatedUpdates(opt, "kahan")
    x = torch.randn(8, 16)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    for p, b, g in zip(model.parameters(), before, grads):
        assert p.dtype == b.dtype and not torch.equal(p, b)
        assert p.grad is not None and p.grad.dtype == p.dtype and torch.equal(p.grad, g)
        for k, v in opt.state[p].items():
            if torch.is_tensor(v) and v.dim() > 0:
                assert v.dtype == p.dtype, (k, v.dtype)
    lin = model[0].weight
    assert comp.buffer(lin).dtype == BF16 and comp.buffer(lin).abs().sum() > 0
    assert comp.buffer(model[1].weight) is None  # fp32 LayerNorm: stepped as is


def test_fp32_params_step_exactly_as_without_compensation():
    torch.manual_seed(0)
    a = nn.Linear(4, 4)
    b = nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    low = nn.Parameter(torch.randn(3, dtype=BF16))
    opt_a = torch.optim.Adam([{"params": a.parameters()}, {"params": [low]}], lr=0.1)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.1)
    CompensatedUpdates(opt_a, "kahan", chunk_numel=2)
    for _ in range(3):
        g = [torch.randn_like(p) for p in a.parameters()]
        for pa, pb, gi in zip(a.parameters(), b.parameters(), g):
            pa.grad, pb.grad = gi.clone(), gi.clone()
        low.grad = torch.randn(3, dtype=BF16)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_chunking_does_not_change_the_result():
    results = []
    for chunk in (1, 1 << 20):
        model = cast_model(_model(), BF16)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        CompensatedUpdates(opt, "kahan", chunk_numel=chunk)
        torch.manual_seed(5)
        x = torch.randn(8, 16)
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results):
        assert torch.equal(p, q)


def test_closure_and_lbfgs_are_refused():
    p = nn.Parameter(torch.ones(2, dtype=BF16))
    with pytest.raises(AmpError, match="LBFGS"):
        CompensatedUpdates(torch.optim.LBFGS([p]))
    with pytest.raises(AmpError, match="method"):
        CompensatedUpdates(torch.optim.SGD([p], lr=1.0), "round-half-even")
    opt = torch.optim.SGD([p], lr=1.0)
    CompensatedUpdates(opt)
    p.grad = torch.ones(2, dtype=BF16)
    with pytest.raises(AmpError, match="closure"):
        opt.step(lambda: 0.0)
    assert p.grad is not None  # grads handed back on the error path


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_resume_is_bitwise(method):
    def build():
        model = cast_model(_model(), BF16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, CompensatedUpdates(opt, method, seed=3)

    def train(model, opt, steps, start):
        for i in range(start, start + steps):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(8, 16, generator=g)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    model, opt, comp = build()
    train(model, opt, 6, 0)
    model_a, opt_a, comp_a = build()
    train(model_a, opt_a, 3, 0)
    buf = io.BytesIO()
    torch.save({"m": model_a.state_dict(), "o": opt_a.state_dict(), "c": comp_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    model_b, opt_b, comp_b = build()
    model_b.load_state_dict(saved["m"])
    opt_b.load_state_dict(saved["o"])
    comp_b.load_state_dict(saved["c"])
    train(model_b, opt_b, 3, 3)
    for p, q in zip(model.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
    if method == "kahan":
        assert torch.equal(comp.buffer(model[0].weight), comp_b.buffer(model_b[0].weight))
    bad = dict(saved["c"], method="nearest")
    with pytest.raises(StateError, match="compensation"):
        comp_b.load_state_dict(bad)


# --- dedicated updates (one kernel pass per tensor) ----------------------------------

DEDICATED = [
    (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.Adam, {"lr": 1e-3, "decoupled_weight_decay": True, "weight_decay": 0.05}),
    (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "dampening": 0.1}),
    (torch.optim.SGD, {"lr": 0.01}),
]


def _wide_model() -> nn.Module:
    torch.manual_seed(1)
    # 300x200 = 60000 elements: above the batching threshold, stepped alone
    return nn.Sequential(nn.Linear(16, 300), nn.LayerNorm(300), nn.Tanh(), nn.Linear(300, 200), nn.Linear(200, 1))


def _run_kernel(opt_cls, kw, kernel, steps=5, model_fn=_wide_model):
    model = cast_model(model_fn(), BF16)
    opt = opt_cls(model.parameters(), **kw)
    comp = CompensatedUpdates(opt, "kahan", kernel=kernel)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        opt.zero_grad()
        model(x.to(BF16)).float().pow(2).mean().backward()
        opt.step()
    return model, opt, comp


@pytest.mark.parametrize("opt_cls, kw", DEDICATED)
@pytest.mark.parametrize("kernel", ["eager", "compiled"])
def test_dedicated_update_computes_what_the_generic_path_does(opt_cls, kw, kernel):
    """Same optimizer, same Kahan rounding: the dedicated kernels agree with the generic
    path (the real torch optimizer on fp32 copies) up to fp32 rounding differences."""
    ref_model, ref_opt, ref_comp = _run_kernel(opt_cls, kw, "generic")
    model, opt, comp = _run_kernel(opt_cls, kw, kernel)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert p.dtype == q.dtype
        value = p.double() + (comp.buffer(p).double() if comp.buffer(p) is not None else 0)
        ref = q.double() + (ref_comp.buffer(q).double() if ref_comp.buffer(q) is not None else 0)
        assert (value - ref).abs().max() <= 1e-3 * ref.abs().max(), name
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert state.keys() == ref_state.keys()  # torch's own state layout
        for k, v in state.items():
            assert v.dtype == ref_state[k].dtype and v.shape == ref_state[k].shape, (name, k)
            ref_v = ref_state[k].double()
            assert (v.double() - ref_v).abs().max() <= 2e-2 * ref_v.abs().max(), (name, k)
    lin = model[0].weight
    assert comp.buffer(lin).dtype == BF16 and comp.buffer(lin).abs().sum() > 0


def test_compiled_and_eager_kernels_agree_and_batching_changes_nothing(monkeypatch):
    """Small tensors are concatenated and stepped in one call: bitwise the same as
    one call per tensor."""
    from ampkit.levels import update_kernels as _kernels

    def many_small() -> nn.Module:
        torch.manual_seed(2)
        return nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])

    kw = {"lr": 1e-3, "weight_decay": 0.1}
    batched = _run_kernel(torch.optim.AdamW, kw, "compiled", model_fn=many_small)
    monkeypatch.setattr(_kernels, "DIRECT_NUMEL", 0)
    alone = _run_kernel(torch.optim.AdamW, kw, "compiled", model_fn=many_small)
    eager = _run_kernel(torch.optim.AdamW, kw, "eager", model_fn=many_small)
    for p, q, r in zip(batched[0].parameters(), alone[0].parameters(), eager[0].parameters()):
        assert torch.equal(p, q)
        assert torch.equal(batched[2].buffer(p), alone[2].buffer(q))
        assert (p.double() - r.double()).abs().max() <= 2 ** -7 * r.double().abs().max()


def test_compile_failure_falls_back_to_eager(monkeypatch, caplog):
    from ampkit.levels import update_kernels as _kernels

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    _kernels.forget_compiled()  # the SGD kernel compiles (and fails) at its next use
    monkeypatch.setattr(torch, "compile", broken)
    try:
        with caplog.at_level("WARNING", logger="ampkit"):
            fallback = _run_kernel(torch.optim.SGD, {"lr": 0.01}, "compiled")
    finally:
        _kernels.forget_compiled()  # the fallback is not kept for later tests
    assert "compiling the SGD update kernel failed" in caplog.text
    eager = _run_kernel(torch.optim.SGD, {"lr": 0.01}, "eager")
    for p, q in zip(fallback[0].parameters(), eager[0].parameters()):
        assert torch.equal(p, q)


def test_layouts_the_kernel_cannot_flatten_take_the_generic_path():
    """channels_last conv weights are dense: dedicated. A strided (non-dense)
    parameter, and amsgrad (no dedicated update), go the generic way: bitwise what
    kernel='generic' gives."""
    def build(kernel):
        torch.manual_seed(0)
        conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last).to(BF16)
        strided = nn.Parameter(torch.randn(8, 6, dtype=BF16)[:, ::2])  # not dense
        opt = torch.optim.Adam([{"params": list(conv.parameters()) + [strided]},
                                {"params": [nn.Parameter(torch.randn(5, dtype=BF16))], "amsgrad": True}], lr=1e-2)
        comp = CompensatedUpdates(opt, kernel=kernel)
        return conv, strided, opt, comp

    results = {}
    for kernel in ("generic", "eager"):
        conv, view, opt, comp = build(kernel)
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
        extra = opt.param_groups[1]["params"][0]
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            opt.zero_grad()
            conv(torch.randn(2, 3, 6, 6, generator=g).to(BF16)).float().pow(2).mean().backward()
            view.grad = torch.randn(8, 3, generator=g).to(BF16)
            extra.grad = torch.randn(5, generator=g).to(BF16)
            opt.step()
        plan = comp._plan(opt) if kernel == "eager" else []
        results[kernel] = [conv.weight, view, extra], plan
    (ref, _), (got, plan) = results["generic"], results["eager"]
    assert torch.equal(ref[1], got[1]) and torch.equal(ref[2], got[2])  # generic both times
    assert (ref[0].double() - got[0].double()).abs().max() <= 2 ** -7 * ref[0].double().abs().max()
    planned = {id(p) for _, _, params in plan for p in params}
    assert id(got[0]) in planned and id(got[1]) not in planned and id(got[2]) not in planned


# --- the real task: updates below bf16 resolution ------------------------------------


def _regression_task():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    w = torch.randn(64, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(512, 1, generator=g)
    return x, y


def _net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))


def _train(mode: str, steps: int = 300, lr: float = 1e-2, opt_cls=torch.optim.SGD, kernel="auto") -> float:
    """Full-batch training; returns the final loss of the trained weights evaluated in
    fp32, so every mode is judged on the same arithmetic."""
    x, y = _regression_task()
    model = _net()
    opt = opt_cls(model.parameters(), lr=lr)
    if mode != "fp32":
        cast_model(model, BF16)
        if mode != "plain":
            CompensatedUpdates(opt, mode, kernel=kernel)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    evaluator = _net()
    evaluator.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        return nn.functional.mse_loss(evaluator(x), y).item()


@pytest.mark.slow
def test_compensated_bf16_matches_fp32_where_plain_bf16_stalls():
    fp32 = _train("fp32")
    plain = _train("plain")  # bf16 weights, the optimizer's own bf16 arithmetic
    nearest = _train("nearest")  # fp32 step, rounded to nearest bf16
    kahan = _train("kahan")
    stochastic = _train("stochastic")
    print(
        f"final loss: fp32 {fp32:.4f}  kahan {kahan:.4f}  stochastic {stochastic:.4f}  "
        f"nearest {nearest:.4f}  plain bf16 {plain:.4f}"
    )
    assert abs(kahan - fp32) <= 0.01 * fp32
    # Stochastic rounding is unbiased but noisy: close, not as close as Kahan.
    assert abs(stochastic - fp32) <= 0.03 * fp32
    assert abs(kahan - fp32) <= abs(stochastic - fp32)
    # Without compensation most updates are rounded away and training stalls.
    assert plain > 1.5 * fp32 and nearest > 1.5 * fp32


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["compiled", "generic"])
def test_adamw_with_bf16_moments_matches_fp32(kernel):
    """AdamW keeps its moments in bf16 under O2K (10 bytes per parameter in all): the
    final loss stays within 1% of fp32 AdamW, where plain bf16 AdamW does not."""
    fp32 = _train("fp32", opt_cls=torch.optim.AdamW, lr=1e-3, steps=400)
    kahan = _train("kahan", opt_cls=torch.optim.AdamW, lr=1e-3, steps=400, kernel=kernel)
    plain = _train("plain", opt_cls=torch.optim.AdamW, lr=1e-3, steps=400)
    print(f"AdamW final loss: fp32 {fp32:.5f}  kahan ({kernel}) {kahan:.5f}  plain bf16 {plain:.5f}")
    assert abs(kahan - fp32) <= 0.01 * fp32
    assert plain > 1.5 * fp32


def test_compiling_the_update_kernels_is_announced_once_per_device_type(monkeypatch, caplog):
    """The first compiled step can take a minute (inductor's cache cold): a compile still
    running after ``ANNOUNCE_AFTER_S`` says what it is doing and where the cache is, once
    per process and device type, not once per kernel; every compile is logged with its
    duration when it ends (INFO; WARNING from ``SLOW_COMPILE_S`` and for the announced
    one: no "compiling" line goes without its "compiled"); the probe runs on the
    device the kernel will run on (a CPU probe of a CUDA kernel compiled twice)."""
    from ampkit._internal import inductor_compat
    from ampkit.levels import compensated, update_kernels

    monkeypatch.setattr(update_kernels, "ANNOUNCED_DEVICES", set())
    monkeypatch.setattr(update_kernels, "ANNOUNCE_AFTER_S", 0.0)  # announce at once: no timer to race
    probed = []

    def fake_compile(fn, **kwargs):
        def run(*args, **kw):
            probed.append(args[0].device.type)
            return fn(*args, **kw)

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    def halve_(a: torch.Tensor, scalars: torch.Tensor) -> None:
        a.mul_(0.5)

    kernels = [compensated.Kernel(name, halve_, (0,), (torch.float32,)) for name in ("a", "b")]
    with caplog.at_level("INFO", logger="ampkit"):
        for k in kernels:
            assert k._compiled_fn({}, 1, torch.device("cpu"), torch.device("cpu")) is not None
    announced = [r for r in caplog.records if "compiling the a update kernel for cpu" in r.getMessage()]
    # each kernel's probe runs it twice on the CPU: the update, then a skipped step
    assert len(announced) == 1 and probed == ["cpu"] * 4
    assert inductor_compat.inductor_cache_dir() in announced[0].getMessage()
    done = [r for r in caplog.records if "update kernel for cpu in" in r.getMessage()]
    # the announced compile says it ended as loudly; the next one, instant, at INFO
    assert [r.levelname for r in done] == ["WARNING", "INFO"]
    assert "compiled the a update kernel" in done[0].getMessage()
    # a compile slower than SLOW_COMPILE_S is a WARNING
    monkeypatch.setattr(update_kernels, "SLOW_COMPILE_S", 0.0)
    caplog.clear()
    with caplog.at_level("INFO", logger="ampkit"):
        compensated.Kernel("c", halve_, (0,), (torch.float32,))._compiled_fn({}, 1, torch.device("cpu"), torch.device("cpu"))
    assert [r.levelname for r in caplog.records if "update kernel for cpu in" in r.getMessage()] == ["WARNING"]


def test_a_fast_compile_is_not_announced_before_it_ends(monkeypatch, caplog):
    """With the default delay a compile that ends at once (a warm cache) says nothing
    beforehand: only its INFO line with the duration."""
    from ampkit.levels import compensated, update_kernels

    monkeypatch.setattr(update_kernels, "ANNOUNCED_DEVICES", set())
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)

    def halve_(a: torch.Tensor, scalars: torch.Tensor) -> None:
        a.mul_(0.5)

    with caplog.at_level("INFO", logger="ampkit"):
        compensated.Kernel("d", halve_, (0,), (torch.float32,))._compiled_fn({}, 1, torch.device("cpu"), torch.device("cpu"))
    messages = [r.getMessage() for r in caplog.records]
    assert not any("ampkit: compiling the" in m for m in messages)
    assert any("compiled the d update kernel for cpu in" in m for m in messages)
    assert update_kernels.ANNOUNCED_DEVICES == set()


def test_the_rounding_checks_compile_is_announced_and_its_end_logged(monkeypatch, caplog):
    """O2's first step compiles the bf16 rounding check (weights of 128k elements or more)
    before any update kernel, and on a cold cache that is the long wait (Inductor's
    instruction-set checks run there): it is announced like the update kernels, and
    the announcement is followed by its "compiled" line."""
    from ampkit.levels import update_kernels

    if update_kernels.resolve_mode("auto") != "compiled":
        pytest.skip("no C++ compiler: nothing is compiled")
    monkeypatch.setattr(update_kernels, "ANNOUNCED_DEVICES", set())
    monkeypatch.setattr(update_kernels, "ANNOUNCE_AFTER_S", 0.0)  # announce at once: no timer to race
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    update_kernels.forget_compiled()
    try:
        with caplog.at_level("INFO", logger="ampkit"):
            assert update_kernels.compiled_round_check() is not None
    finally:
        update_kernels.forget_compiled()  # not the eager stand-in for later tests
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [m for _, m in messages if "compiling the bf16 rounding check for cpu" in m]
    assert [lvl for lvl, m in messages if "compiled the bf16 rounding check for cpu in" in m] == ["WARNING"]


def test_an_announcement_under_way_is_made_before_the_compile_says_it_ended(monkeypatch, caplog):
    """The announcement runs in a timer thread; a compile that ends while it is being made
    waits for it, so the end is logged at the announcement's level (a "compiling" line
    is never left without its "compiled" line)."""
    import logging
    import threading
    import time

    from ampkit.levels import compensated, update_kernels

    monkeypatch.setattr(update_kernels, "ANNOUNCED_DEVICES", set())
    monkeypatch.setattr(update_kernels, "ANNOUNCE_AFTER_S", 0.05)
    started = threading.Event()
    log = logging.getLogger("ampkit")  # the logger update_kernels writes to
    real_warning = log.warning

    def slow_warning(*args, **kwargs):  # the timer thread, descheduled while it announces
        started.set()
        time.sleep(0.3)
        real_warning(*args, **kwargs)

    monkeypatch.setattr(log, "warning", slow_warning)

    def compile_until_announcing(fn, **kwargs):
        assert started.wait(5)
        return fn

    monkeypatch.setattr(torch, "compile", compile_until_announcing)

    def halve_(a: torch.Tensor, scalars: torch.Tensor) -> None:
        a.mul_(0.5)

    with caplog.at_level("INFO", logger="ampkit"):
        compensated.Kernel("e", halve_, (0,), (torch.float32,))._compiled_fn({}, 1, torch.device("cpu"), torch.device("cpu"))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "update kernel for cpu" in r.getMessage()]
    assert [lvl for lvl, _ in lines] == ["WARNING", "WARNING"], lines
    assert "compiling the e update kernel" in lines[0][1] and "compiled the e update kernel" in lines[1][1]


def test_a_compile_ahead_failing_as_the_interpreter_exits_warns_nothing(tmp_path):
    """A compile still running when the main thread has ended fails as Python shuts down
    (no new futures, no atexit registrations): that is logged at DEBUG, not as a
    compile failure the user should act on."""
    import subprocess
    import sys

    script = (
        "import logging, threading, torch\n"
        "from ampkit.levels import update_kernels as uk\n"
        "def fail(fn, **kw):\n"
        "    raise RuntimeError('cannot schedule new futures after interpreter shutdown')\n"
        "torch.compile = fail\n"
        "k = uk.Kernel('late', lambda a, s: a.mul_(0.5), (0,), (torch.float32,))\n"
        "main = threading.main_thread()\n"
        "def later():\n"
        "    main.join()\n"
        "    k._compiled_fn({}, 1, torch.device('cpu'), torch.device('cpu'))\n"
        "    print('compiled late', flush=True)\n"
        "threading.Thread(target=later).start()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert out.returncode == 0 and "compiled late" in out.stdout, out.stderr
    assert "failed" not in out.stderr, out.stderr


def test_no_cpp_compiler_is_said_once(tmp_path):
    """Where torch.compile finds no C++ compiler the kernels run op by op; the user is
    told once, with what to install (it used to fall back in silence)."""
    import os
    import subprocess
    import sys

    script = (
        "import torch, ampkit as amp\n"
        "torch.manual_seed(0)\n"
        "for _ in range(2):\n"
        "    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(12)])\n"
        "    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
        "    model, opt = amp.initialize(model, opt, opt_level='O2', dtype=torch.bfloat16)\n"
        "    loss = model(torch.randn(4, 8)).float().pow(2).mean()\n"
        "    with amp.scale_loss(loss, opt) as s:\n"
        "        s.backward()\n"
        "    opt.step()\n"
        "    assert all(p.isfinite().all() for p in model.parameters())\n"
        "    amp.reset()\n"
    )
    env = {**os.environ, "CXX": "/bin/false", "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("finds no C++ compiler") == 1, out.stderr


def _norm_model(setup: str, opt_class: type = torch.optim.AdamW, fused: bool = True):
    """A Linear, an fp32 LayerNorm, a Linear (seed 0) and an optimizer (lr 1e-2), set up
    by ``initialize`` at ``setup`` ("O2", "O2K"), or with ``CompensatedUpdates`` on the
    plain optimizer ("hooks": the Linears cast to bf16). Returns (model, optimizer, the
    CompensatedUpdates or None)."""
    import ampkit as amp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    opt = opt_class(model.parameters(), lr=1e-2, fused=fused)
    if setup != "hooks":
        model, opt = amp.initialize(model, opt, opt_level=setup)
        return model, opt, None
    model[0].to(torch.bfloat16)
    model[2].to(torch.bfloat16)
    return model, opt, CompensatedUpdates(opt)


def _global_step_hook_calls(of: torch.optim.Optimizer) -> tuple[list[str], list]:
    """torch's process-wide optimizer step hooks, recording their calls for ``of``."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    calls: list[str] = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append("pre") if o is of else None),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append("post") if o is of else None)]  # fmt: skip
    return calls, handles


@pytest.mark.parametrize("managed", [True, False])
def test_the_fp32_rest_is_stepped_once_by_the_step_the_user_called(managed):
    """Every bf16 grad through a dedicated kernel: the fp32 rest (a LayerNorm kept in
    fp32) is updated as torch's AdamW steps it alone (bit for bit). Managed (O2K), by the
    optimizer's own step: torch's global step hooks run once per ``step()`` (they ran
    twice when the rest was stepped by a second call of the optimizer's step). On torch's
    step hooks (an optimizer ampkit does not manage) the rest is still stepped inside the
    pre-hook, where a failure puts every grad back (no post-hook runs after a raise)."""
    import ampkit as amp

    model, opt, comp = _norm_model("O2K" if managed else "hooks")
    norm = [model[1].weight, model[1].bias]
    ref = [nn.Parameter(p.detach().clone()) for p in norm]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    calls, handles = _global_step_hook_calls(opt)
    try:
        for i in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            h = model[0](x.to(torch.bfloat16)).float()
            loss = model[2](model[1](h).to(torch.bfloat16)).float().pow(2).mean()
            if managed:
                with amp.scale_loss(loss, opt) as s:
                    s.backward()
            else:
                loss.backward()
            for r, p in zip(ref, norm):
                r.grad = p.grad.clone()
            before = [p.detach().clone() for p in model[0].parameters()]
            opt.step()
            ref_opt.step()
            assert all(torch.equal(p, r) for p, r in zip(norm, ref))
            assert all(p.grad is not None for p in model.parameters())  # set aside and put back
            assert not any(torch.equal(b, p) for b, p in zip(before, model[0].parameters()))  # bf16 stepped too
            opt.zero_grad()
            ref_opt.zero_grad()
    finally:
        for handle in handles:
            handle.remove()
        if not managed:
            comp.remove()
    assert calls == (["pre", "post"] * 3 if managed else ["pre", "pre", "post", "post"] * 3)


def test_a_step_that_raises_after_the_compensated_part_keeps_every_grad():
    """An optimizer ampkit does not manage: a step pre-hook registered after
    ``CompensatedUpdates`` raises; every grad is on its parameter afterwards."""
    model, opt, comp = _norm_model("hooks", fused=False)

    def guard(o, a, k):
        raise RuntimeError("refusing this step")

    opt.register_step_pre_hook(guard)
    h = model[0](torch.randn(4, 8).to(torch.bfloat16)).float()
    model[2](model[1](h).to(torch.bfloat16)).float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    with pytest.raises(RuntimeError, match="refusing"):
        opt.step()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    comp.remove()


def test_torch_grad_scaler_with_a_fused_optimizer_is_refused_before_anything_changes():
    """torch.amp.GradScaler hands a fused optimizer its grads still scaled (with the flag
    and scale for the fused kernel): the compensated bf16 updates would step with them.
    Refused with an AmpError; weights, grads, state and the scaler's scale unchanged."""
    model, opt, comp = _norm_model("hooks")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    h = model[0](torch.randn(4, 8).to(torch.bfloat16)).float()
    scaler.scale(model[2](model[1](h).to(torch.bfloat16)).float().pow(2).mean()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(AmpError, match="GradScaler"):
        scaler.step(opt)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert not opt.state
    buf = comp.buffer(model[0].weight)
    assert buf is None or not buf.any()
    comp.remove()


@pytest.mark.parametrize("ampkit_unscale_first", [False, True])
@pytest.mark.parametrize("level", ["O2", "O2K"])
@pytest.mark.parametrize("opt_class", [torch.optim.SGD, torch.optim.AdamW])
def test_o2_and_o2k_under_torch_grad_scaler_with_a_fused_optimizer_are_refused(opt_class, level,
                                                                               ampkit_unscale_first):
    """``initialize`` then ``torch.amp.GradScaler`` with a fused optimizer: the scaler
    hands the grads over still scaled (pre-existing at O2K: the bf16 weights took SGD
    steps 1024 times too large; O2 refused already). A StateError before anything
    changes, and the scale and flag the scaler set for that call are not left on the
    optimizer (they would reach every later fused step: the fp32 norms' grads divided by
    1024); ampkit's own ``GradScaler`` then trains as on a fresh optimizer. Also where
    ``ampkit.unscale(opt)`` ran first (before clipping: the step's own checks are done
    by then, and O2K's refusal, made there, was skipped)."""
    import ampkit as amp

    def make():
        amp.reset()
        return _norm_model(level, opt_class)[:2]

    def ours(model, opt, x):
        scaler = amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(model(x).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        return [p.detach().clone() for p in model.parameters()]

    x = torch.randn(4, 8)
    want = ours(*make(), x)
    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(x).float().pow(2).mean()).backward()
    if ampkit_unscale_first:
        amp.unscale(opt)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(StateError, match="torch.amp.GradScaler"):
        scaler.step(opt)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert (amp.stats(opt).steps, amp.stats(opt).skipped) == (0, 0) and not any(opt.state.values())
    assert "grad_scale" not in opt.__dict__ and "found_inf" not in opt.__dict__
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ours(model, opt, x), want))


@pytest.mark.parametrize("managed", [True, False])
def test_torch_grad_scaler_after_its_unscale_trains_and_skips(managed):
    """``scaler.unscale_(opt)``, clipping, ``scaler.step(opt)`` with a fused optimizer (the
    migration guide's loop): the scaler hands the inf flag alone, the grads real. A step
    with an inf grad leaves every weight, the optimizer state and the compensation as
    they were (pre-existing, on an optimizer ampkit does not manage: the dedicated
    kernels stepped the bf16 weights with the inf grads); the others train."""
    import ampkit as amp

    amp.reset()
    model, opt, comp = _norm_model("O2K" if managed else "hooks")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    low = [model[0].weight, model[2].weight]
    for i in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        h = model[0](x.to(torch.bfloat16)).float()
        scaler.scale(model[2](model[1](h).to(torch.bfloat16)).float().pow(2).mean()).backward()
        if i == 2:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = [p.detach().clone() for p in model.parameters()]
        state = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
        buffers = [comp.buffer(p).clone() for p in low] if not managed and i == 2 else []
        scaler.step(opt)
        scaler.update()
        same = [torch.equal(b, p) for b, p in zip(before, model.parameters())]
        if i == 2:
            assert all(same), same
            assert all(torch.equal(v, s[k]) for s, t in zip(state, opt.state.values()) for k, v in t.items())
            assert all(torch.equal(b, comp.buffer(p)) for b, p in zip(buffers, low))
            assert scaler.get_scale() == 512.0
        else:
            assert not any(same), (i, same)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        opt.zero_grad()
    if not managed:
        comp.remove()
