"""Steps skipped on the device (ampkit.trainer.device_skip): with a fused optimizer the
step reads nothing on the host, and what anyone reads afterwards -- parameters, optimizer
state, the skip signal, the counters, the scale, a state dict -- is bitwise what the same
step decided on the host shows."""

from __future__ import annotations

import collections
import sys

import pytest
import torch
import torch.nn.functional as F
from host_reads import counting_reads

import ampkit as amp
from ampkit import LossScaler, NumericsError
from ampkit.trainer.api import managed_state
from ampkit.trainer.extensions import StepExtension

INF = float("inf")
def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),  # ampkit picks fused
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "SGD-fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
}


def _run(opt_name: str, dtype: torch.dtype, on_host: bool, plan: list, scheduler: bool = False):
    """Train with ``plan[i]`` (None or a value written into a grad element) at step i;
    ``on_host``: a no-op step post-hook makes every step decided on the host. Returns
    what a reader sees after each step, and the host reads inside each backward+step."""
    amp.reset()
    model = _model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    if scheduler:  # O1 by amp.init, a scheduler held by ampkit (stepped on taken steps only)
        amp.init(dtype=dtype, device_type="cpu")
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=len(plan) + 1,
                                                    cycle_momentum=opt_name != "Adagrad")
        amp.init_trainer(opt, LossScaler() if dtype == torch.float16 else 1.0, schedulers=[sched])
    else:
        model, opt = amp.initialize(model, opt, opt_level="O1", dtype=dtype)
    if on_host:
        opt.register_step_post_hook(lambda *args: None)
    seen, reads = [], []
    g = torch.Generator().manual_seed(1)
    for value in plan:
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad()
        counts: collections.Counter = collections.Counter()
        with counting_reads(counts):
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            if value is not None:
                model[0].weight.grad[1, 2] = value  # an edit by index, after the hooks ran
            opt.step()
        reads.append(sum(counts.values()))
        skipped = amp.step_skipped(opt)  # read first: a held scheduler is put back on a skip
        seen.append((
            [p.detach().clone() for p in model.parameters()] + [torch.tensor(g["lr"]) for g in opt.param_groups],
            {k: v.clone() for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)},
            skipped,
            amp.stats(opt),
        ))
    amp.reset()
    return seen, reads


def _same(a, b) -> None:
    for (pa, sa, ka, ta), (pb, sb, kb, tb) in zip(a, b, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        assert (ka, ta) == (kb, tb)


@pytest.mark.parametrize("scheduler", [False, True], ids=["", "held-scheduler"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_fused_step_reads_nothing_and_shows_what_the_host_decided_step_shows(opt_name, dtype, scheduler):
    """After the first step (which creates the optimizer state on the host: a skipped
    first step must leave none), no host read in backward + step, skipped steps
    included; params, learning rates (a held OneCycleLR, which also sets betas or
    momentum), state, signal and stats bitwise those of host-decided steps."""
    plan = [None, None, INF, None, float("nan"), -INF, None, None]
    device, device_reads = _run(opt_name, dtype, on_host=False, plan=plan, scheduler=scheduler)
    host, host_reads = _run(opt_name, dtype, on_host=True, plan=plan, scheduler=scheduler)
    _same(device, host)
    assert device_reads[1:] == [0] * (len(plan) - 1), device_reads
    assert host_reads[1:] == [1] * (len(plan) - 1), host_reads  # the decision, read in step()
    assert [s[2] for s in device] == [v is not None for v in plan]
    stats = device[-1][3]
    assert (stats.steps, stats.skipped) == (8, 3)
    if dtype == torch.float16:  # three backoffs of the default dynamic scale
        assert stats.scales == (2.0**16 / 8,)


def test_foreach_groups_and_a_closure_are_decided_on_the_host():
    """SGD (ampkit picks foreach: torch's fused SGD is not the loop's) and a closure
    step read the flag once in step(), as before."""
    _, reads = _run("Adam", torch.bfloat16, on_host=False, plan=[None, None])
    assert reads == [1, 0]
    amp.reset()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1")
    assert [g["fused"] for g in opt.param_groups] == [None]
    assert _reads_per_step(model, opt, 2) == [1, 1]
    amp.reset()


def _reads_per_step(model, opt, steps: int) -> list[int]:
    """Host reads inside each of ``steps`` scale_loss + backward + step."""
    reads = []
    for _ in range(steps):
        counts: collections.Counter = collections.Counter()
        with counting_reads(counts):
            with amp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as s:
                s.backward()
            opt.step()
        reads.append(sum(counts.values()))
    return reads


def _pending(skip: bool = True, scheduler: bool = False):
    """A dynamically scaled AdamW run (fp32 model, the trainer alone; with ``scheduler``
    a StepLR held by ampkit) whose last step was skipped (``skip``) or taken on the
    device, nothing read since. Returns the optimizer and the scheduler (or None)."""
    amp.reset()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1 if scheduler else 1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    amp.init_trainer(opt, LossScaler(init_scale=2.0**10), schedulers=[sched] if scheduler else None)
    for value in (None, INF if skip else None):
        opt.zero_grad()
        with amp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as s:
            s.backward()
        if value is not None:
            model[2].bias.grad[0] = value
        opt.step()
    assert managed_state(opt).pending_outcome is not None  # the outcome is still on the device
    return opt, sched


def test_every_reader_sees_a_pending_skip():
    """The counters, the scaler's scale, amp.stats and a state dict each record the
    pending outcome before they answer."""
    opt, _ = _pending()
    scaler = managed_state(opt).scalers[0]
    assert scaler.scale == 2.0**9  # backed off, read straight from the scaler
    opt, _ = _pending()
    assert amp.state_dict()["trainers"][0]["optimizers"][0]["skipped"] == 1
    opt, _ = _pending()
    assert managed_state(opt).skipped == 1 and amp.step_skipped(opt)
    amp.reset()


def test_a_load_after_a_pending_skip_is_not_undone_by_it():
    """A state dict loaded while the outcome of the step before is pending: the outcome
    is recorded first, so the loaded counters and scale stand."""
    opt, _ = _pending()
    saved = amp.state_dict()
    assert saved["trainers"][0]["optimizers"][0]["skipped"] == 1
    opt, _ = _pending()
    fresh = amp.state_dict()
    fresh["trainers"][0]["optimizers"][0].update(steps=5, skipped=0, last_skipped=False)
    opt, _ = _pending()
    amp.load_state_dict(fresh)
    stats = amp.stats(opt)
    assert (stats.steps, stats.skipped, stats.last_skipped) == (5, 0, False)
    assert stats.scales == (2.0**9,)
    amp.reset()


class _Told(StepExtension):
    device_skip = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def after_step(self, skipped: bool) -> None:
        self.calls.append(("after_step", skipped))


def test_an_extension_that_allows_it_hears_the_outcome_at_the_next_scale_loss():
    amp.reset()
    model = _model()
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters()), opt_level="O1")
    told = managed_state(opt).add_extension(_Told())
    for value in (None, None, INF, None):
        with amp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as s:
            told.calls.append(("scale_loss", False))
            s.backward()
        if value is not None:
            model[0].bias.grad[0] = value
        opt.step()
        opt.zero_grad()
    amp.step_skipped(opt)
    assert told.calls == [
        ("scale_loss", False), ("after_step", False),  # the first step: decided on the host
        ("scale_loss", False), ("after_step", False),  # the second: told at the next scale_loss
        ("scale_loss", False), ("after_step", True),
        ("scale_loss", False), ("after_step", False),  # told when the signal was read
    ]
    amp.reset()


def test_an_extension_that_does_not_allow_it_keeps_the_host_decision():
    class Plain(StepExtension):
        pass

    amp.reset()
    model = _model()
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters()), opt_level="O1")
    managed_state(opt).add_extension(Plain())
    assert _reads_per_step(model, opt, 3) == [1, 1, 1]
    amp.reset()


def test_a_step_that_would_raise_is_decided_on_the_host_and_raises_in_step():
    """At the scale's floor an overflow raises NumericsError: such a step is decided on
    the host, so the error comes from step() itself, as it always did."""
    amp.reset()
    model = _model()
    opt = amp.init_trainer(torch.optim.AdamW(model.parameters()), LossScaler(init_scale=1.0, min_scale=1.0))
    with amp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as s:
        s.backward()
    opt.step()
    with amp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as s:
        s.backward()
    model[0].bias.grad[0] = INF
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NumericsError, match="floor"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert amp.step_skipped(opt)
    amp.reset()


@pytest.mark.parametrize("skip", [True, False], ids=["skipped", "taken"])
def test_a_held_schedulers_own_state_dict_records_the_pending_outcome_first(skip):
    """Saved first thing after the step (before anything of ampkit is read), a held
    scheduler's and the optimizer's state hold the learning rate of the decided step:
    advanced once per taken step, not for the skipped one."""
    opt, sched = _pending(skip, scheduler=True)
    state = sched.state_dict()
    want_epoch, want_lr = (1, 0.05) if skip else (2, 0.025)
    assert (state["last_epoch"], state["_last_lr"]) == (want_epoch, [want_lr])
    assert opt.state_dict()["param_groups"][0]["lr"] == want_lr
    assert "state_dict" not in vars(sched)  # nothing of ampkit's left on the scheduler
    amp.reset()
    opt, sched = _pending(skip, scheduler=True)
    assert opt.state_dict()["param_groups"][0]["lr"] == want_lr  # the optimizer's first
    assert sched.get_last_lr() == [want_lr]
    amp.reset()


def test_a_load_while_a_skip_is_pending_is_not_undone_by_it():
    """Loaded while the skipped step's outcome is pending, the scheduler's and the
    optimizer's states stand: the outcome is recorded before either load."""
    opt, sched = _pending(skip=False, scheduler=True)
    saved_sched, saved_opt = sched.state_dict(), opt.state_dict()
    opt, sched = _pending(skip=True, scheduler=True)
    sched.load_state_dict(saved_sched)
    assert sched.state_dict()["last_epoch"] == 2 and amp.step_skipped(opt)
    opt, sched = _pending(skip=True, scheduler=True)
    opt.load_state_dict(saved_opt)
    assert amp.step_skipped(opt) and opt.param_groups[0]["lr"] == 0.025
    amp.reset()


def _o1_adamw(dtype=torch.float16):
    amp.reset()
    torch.manual_seed(0)
    model = _model()
    return amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level="O1", dtype=dtype)


@pytest.mark.filterwarnings("ignore:ampkit. float16 on CPU")
def test_torch_gradscaler_on_a_managed_fused_optimizer_keeps_its_own_flag():
    """torch's recipe (scale, unscale_, clip, step, update) on an optimizer ampkit made
    fused: GradScaler hands the kernel its own flag and scale, which ampkit leaves alone."""
    model, opt = _o1_adamw()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 8)).float().pow(2).mean()).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    moved = max((a - b).abs().max().item() for a, b in zip(before, model.parameters()))
    assert 0 < moved < 0.1  # three AdamW steps of lr 1e-2 on unscaled grads
    assert not {"found_inf", "grad_scale"} & set(vars(opt))
    amp.reset()


@pytest.mark.filterwarnings("ignore:ampkit. float16 on CPU")
def test_a_compiled_step_is_decided_on_the_host_and_a_skip_leaves_the_weights():
    import torch._dynamo

    model, opt = _o1_adamw()
    torch._dynamo.reset()
    step = torch.compile(opt.step, backend="eager")
    for bad in (False, False, True, False):
        opt.zero_grad()
        with amp.scale_loss(model(torch.randn(4, 8)).float().pow(2).mean() * (INF if bad else 1.0), opt) as s:
            s.backward()
        before = [p.detach().clone() for p in model.parameters()]
        step()
        assert amp.step_skipped(opt) == bad
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) == bad
    torch._dynamo.reset()
    amp.reset()


@pytest.mark.parametrize("name", ["Adam", "SGD-fused"])
def test_an_empty_state_left_by_a_read_is_no_state(name):
    """``opt.state[p]`` read before the first step leaves ``{}``: that step (skipped) is
    still decided on the host and creates no state; the next taken one starts clean."""
    amp.reset()
    model = _model()
    opt = amp.init_trainer(OPTIMIZERS[name](model.parameters()), 1.0)
    for p in model.parameters():
        assert opt.state[p] == {}  # a read (logging, a checkpoint tool) leaves an empty entry
    with amp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as s:
        s.backward()
    model[0].bias.grad[0] = INF
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert amp.step_skipped(opt) and all(not opt.state[p] for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    amp.reset()


def test_a_pickled_or_reloaded_scaler_holds_the_pending_outcome():
    """A copy of an attached scaler taken while a skip is pending, and a state dict
    loaded over it, see the outcome applied under the configuration it happened in."""
    import pickle

    opt, _ = _pending()
    scaler = managed_state(opt).scalers[0]
    copy = pickle.loads(pickle.dumps(scaler))
    assert (copy.scale, copy.num_overflows) == (2.0**9, 1)
    opt, _ = _pending()
    scaler = managed_state(opt).scalers[0]
    loaded = {**LossScaler(init_scale=32.0, backoff_factor=0.25).state_dict()}
    scaler.load_state_dict(loaded)
    assert scaler.state_dict() == loaded
    assert managed_state(opt).skipped == 1
    amp.reset()


def test_global_step_hooks_and_late_extensions_see_taken_steps_only():
    """Process-wide step hooks run on taken steps only, so such a step is decided on
    the host; an extension added while a skip is pending is not told of it."""
    calls = []
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda *a: calls.append("post"))
    try:
        model, opt = _o1_adamw(torch.bfloat16)
        for bad in (False, True, False):
            with amp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as s:
                s.backward()
            if bad:
                model[0].bias.grad[0] = INF
            opt.step()
            opt.zero_grad()
        assert calls == ["post", "post"]
    finally:
        handle.remove()
    opt, _ = _pending()
    late = managed_state(opt).add_extension(_Told())
    assert amp.step_skipped(opt) and late.calls == []
    amp.reset()


_ENDS_WITH_SKIPS = """
import torch, torch.nn.functional as F
import ampkit as amp
from ampkit.trainer.api import managed_state
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level="O1", dtype=torch.bfloat16)
g = torch.Generator().manual_seed(1)
for i in range({steps}):
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
    opt.zero_grad()
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
        scaled.backward()
    if i in {bad}:
        model[0].weight.grad[0, 0] = float("nan")
    opt.step()
assert managed_state(opt).pending_outcome is not None  # the last step: nothing read it
"""


@pytest.mark.parametrize("bad, told", [
    ([3], ["optimizer step 4 skipped"]),  # only the last step: decided on the device, never read
    ([1, 2, 3], ["optimizer step 2 skipped", "2 more optimizer step(s) skipped until the end (3 of 4 steps so far)"]),
])
def test_skips_nobody_read_before_the_process_ends_are_logged_at_exit(tmp_path, bad, told):
    """A run whose last step was skipped on the device (its outcome pending: nothing asked)
    records it at exit and the skip log says it; skips after the first that no summary
    line told yet (one at most every SKIP_SUMMARY_SECONDS) are told at exit too."""
    import subprocess

    script = tmp_path / "ends_with_skips.py"
    script.write_text(_ENDS_WITH_SKIPS.format(steps=4, bad=bad))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "skipped" in line]
    assert len(lines) == len(told), done.stderr
    assert all(want in line for want, line in zip(told, lines)), lines
