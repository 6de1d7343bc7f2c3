"""O2 and O2K steps decided on the device: with AdamW and SGD, after the first step
(which creates the optimizer state on the host), backward + step read nothing on the
host, and what anyone reads afterwards -- model weights, fp32 masters, optimizer state
(step counts included), compensation buffers, the skip signal, the counters -- is
bitwise what the same steps decided on the host show (a no-op step post-hook keeps a
step on the host). Non-finite grads are written by index into a 16-bit weight's grad
and into a norm's fp32 grad (kept fp32 and stepped as it is)."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from host_reads import counting_reads

import ampkit as amp
from ampkit.levels import update_kernels

INF, NAN = float("inf"), float("nan")
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, weight_decay=1e-3),
    "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
}
# Decided on the host, one read per step: the fp32 norm steps with torch's foreach SGD,
# whose kernel takes no flag (ampkit does not fuse SGD: see ampkit.trainer.fused_step)
ON_HOST = {("O2", "SGD"), ("O2", "SGD-momentum"), ("O2K", "SGD"), ("O2K", "SGD-momentum")}
# (step, which grad, value written into it after backward) -- None: a clean step
PLAN = [None, None, ("weight", INF), None, ("norm", NAN), ("weight", -INF), None, ("norm", INF), None]


def _run(level: str, opt_name: str, on_host: bool, plan: list = PLAN):
    amp.reset()
    model = _model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, dtype=torch.bfloat16)
    if on_host:
        opt.register_step_post_hook(lambda *args: None)
    comp = amp.levels.compensation_of(opt) if level == "O2K" else None
    seen, reads = [], []
    g = torch.Generator().manual_seed(1)
    for edit in plan:
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        loss = F.cross_entropy(model(x).float(), y)
        counts: collections.Counter = collections.Counter()
        with counting_reads(counts):
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            if edit is not None:
                which, value = edit
                (model[0].weight.grad if which == "weight" else model[1].weight.grad)[1] = value
            opt.step()
        opt.zero_grad()
        reads.append(sum(counts.values()))
        skipped = amp.step_skipped(opt)
        state = {(i, k): v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items() if torch.is_tensor(v)}
        buffers = [] if comp is None else [comp.buffer(p).clone() for p in model.parameters() if comp.buffer(p) is not None]
        seen.append((
            [p.detach().clone() for p in model.parameters()],
            [p.detach().clone() for p in amp.master_params(opt)],
            state, buffers, skipped, amp.stats(opt),
        ))
    amp.reset()
    return seen, reads


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("level", ["O2", "O2K"])
def test_a_step_decided_on_the_device_reads_nothing_and_shows_what_the_host_decided_step_shows(level, opt_name):
    """(``ON_HOST``: decided on the host, one read per step, the same results.)"""
    device, device_reads = _run(level, opt_name, on_host=False)
    host, host_reads = _run(level, opt_name, on_host=True)
    # (the first step creates the optimizer state on the host and may read more)
    # a kernel compiled without the flag's select (not exact on this torch) reads the flag
    if (level, opt_name) in ON_HOST or (level == "O2K" and update_kernels.compiled_without_flag()):
        assert device_reads[1:] == [1] * (len(PLAN) - 1), device_reads
    else:
        assert device_reads[1:] == [0] * (len(PLAN) - 1), device_reads
    assert host_reads[1:] == [1] * (len(PLAN) - 1), host_reads  # the decision, read in step()
    for step, ((wa, ma, sa, ba, ka, ta), (wb, mb, sb, bb, kb, tb)) in enumerate(zip(device, host, strict=True)):
        where = (level, opt_name, step)
        assert all(torch.equal(a, b) for a, b in zip(wa, wb, strict=True)), where
        assert all(torch.equal(a, b) for a, b in zip(ma, mb, strict=True)), where
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), where
        assert all(torch.equal(a, b) for a, b in zip(ba, bb, strict=True)), where
        assert (ka, ta) == (kb, tb), where
    assert [s[4] for s in device] == [edit is not None for edit in PLAN]
    # every skipped step left everything as the step before it
    for step, edit in enumerate(PLAN):
        if edit is not None:
            before, after = device[step - 1], device[step]
            assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1], strict=True))
            assert all(torch.equal(before[2][k], after[2][k]) for k in after[2])
    counted = [v for (_, k), v in device[-1][2].items() if k == "step"]
    taken = sum(edit is None for edit in PLAN)
    assert all(float(v) == taken for v in counted)  # skipped steps counted nothing
    stats = device[-1][5]
    assert (stats.steps, stats.skipped) == (len(PLAN), len(PLAN) - taken)


@pytest.mark.parametrize("case", ["SGD, first step", "AdamW, optimizer state loaded alone"])
def test_a_skip_before_the_compensation_exists_is_decided_on_the_host_and_makes_none(case):
    """O2K: a step that would create a parameter's compensation buffer is decided on the
    host, so a skipped one makes no buffer (on the device it was made before the flag was
    seen: another layout in ``amp.state_dict()``): plain SGD's first step (it has no
    optimizer state to wait for), and AdamW's first step after ``opt.load_state_dict``
    without ampkit's state. 16-bit weights only (no fp32 part stepped by torch)."""
    sgd = case.startswith("SGD")

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = (torch.optim.SGD if sgd else torch.optim.AdamW)(model.parameters(), lr=1e-2)
        return amp.initialize(model, opt, opt_level="O2K", dtype=torch.bfloat16)

    def step(model, opt, bad: bool) -> None:
        with amp.scale_loss(model(torch.randn(4, 8, generator=g)).float().sum(), opt) as scaled:
            scaled.backward()
        if bad:
            model[0].weight.grad[0, 0] = NAN
        opt.step()
        opt.zero_grad()

    g = torch.Generator().manual_seed(1)
    amp.reset()
    model, opt = build()
    step(model, opt, False)
    saved = model.state_dict(), opt.state_dict()
    out = []
    for on_host in (False, True):
        amp.reset()
        g = torch.Generator().manual_seed(2)
        model, opt = build()
        if not sgd:  # copies: the loaded step counters are the saved tensors, advanced in place
            model.load_state_dict(copy.deepcopy(saved[0]))
            opt.load_state_dict(copy.deepcopy(saved[1]))  # no amp.load_state_dict: the compensation starts at zero
        if on_host:
            opt.register_step_post_hook(lambda *args: None)
        comp = amp.levels.compensation_of(opt)
        step(model, opt, True)
        assert amp.step_skipped(opt)
        made = [comp.buffer(p) is not None for p in model.parameters()]
        step(model, opt, False)
        out.append((made, comp.state_dict()["num_buffers"], [p.detach().clone() for p in model.parameters()],
                    [comp.buffer(p).clone() for p in model.parameters()]))  # fmt: skip
    (made, n, weights, buffers), (made_h, n_h, weights_h, buffers_h) = out
    assert made == made_h == [False] * 4 and n == n_h == 4
    assert all(torch.equal(a, b) for a, b in zip(weights + buffers, weights_h + buffers_h, strict=True))
    amp.reset()


@pytest.mark.parametrize("level", ["O1", "O2", "O2K"])
def test_a_compiled_optimizer_step_trains_as_the_step_itself(level):
    """``torch.compile(opt.step)``: ampkit's step runs outside the compiled graph (torch
    2.9's Dynamo failed inside it), so it trains bitwise as the plain step, skips
    included, at every level."""
    import torch._dynamo

    def train(compiled: bool) -> list[torch.Tensor]:
        amp.reset()
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level=level, dtype=torch.bfloat16)
        torch._dynamo.reset()
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        g = torch.Generator().manual_seed(1)
        for edit in PLAN[:6]:
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
            with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
                scaled.backward()
            if edit is not None:
                (model[0].weight.grad if edit[0] == "weight" else model[1].weight.grad)[1] = edit[1]
            step()
            assert amp.step_skipped(opt) == (edit is not None)
            opt.zero_grad()
        out = [p.detach().clone() for p in model.parameters()]
        torch._dynamo.reset()
        amp.reset()
        return out

    assert all(torch.equal(a, b) for a, b in zip(train(True), train(False), strict=True))


def test_a_group_the_one_pass_steps_entirely_needs_no_fused_kernel():
    """SGD with momentum over 16-bit weights only (no fp32 norm): the one pass takes
    every grad with the flag, so the step is decided on the device."""
    amp.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16)
    reads = []
    for value in (None, None, INF, None):
        counts: collections.Counter = collections.Counter()
        with counting_reads(counts):
            with amp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as scaled:
                scaled.backward()
            if value is not None:
                model[0].weight.grad[0] = value
            weights = [p.detach().clone() for p in model.parameters()]
            opt.step()
        reads.append(sum(counts.values()))
        assert amp.step_skipped(opt) == (value is not None)
        if value is not None:
            assert all(torch.equal(a, p.detach()) for a, p in zip(weights, model.parameters()))
        opt.zero_grad()
    assert reads[1:] == [0, 0, 0]
    amp.reset()


def test_the_step_counts_a_reader_sees_right_after_a_skipped_step_are_the_old_ones():
    """A skipped step lowers the counters on the device at once (CPU counters, CPU flag):
    ``optimizer.state`` read right after ``step()``, before anything settles the
    outcome, shows the counts of the taken steps only."""
    amp.reset()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16)
    for value in (None, None, INF):
        loss = model(torch.randn(2, 8)).float().sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if value is not None:
            model[0].weight.grad[0] = value
        opt.step()
        counts = [float(s["step"]) for s in opt.state.values()]
        opt.zero_grad()
    assert counts == [2.0] * len(counts)
    assert amp.step_skipped(opt)
    amp.reset()
