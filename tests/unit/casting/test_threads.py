"""The engine under threads: scopes of different policies and plain torch.autocast
at once, kernels and hooks kept while anything may run through them, and teardown
of state left by threads that are gone."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from locations import SUPPORT
from torch import nn

import ampkit as amp
from ampkit.casting import engine as casting

BF16, FP32 = torch.bfloat16, torch.float32
STRESS = SUPPORT / "_thread_stress.py"


def _global_hooks() -> int:
    mod = nn.modules.module
    return len(mod._global_forward_pre_hooks) + len(mod._global_forward_hooks)


def _run_in_thread(fn) -> None:
    errors = []

    def target():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if errors:
        raise errors[0]


@pytest.mark.fresh_process
def test_kernels_stay_after_the_scope_and_act_as_torch_autocast_outside_it():
    a = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=BF16):
        native_mm, native_softmax = torch.mm(a, a), F.softmax(a, -1)
    with amp.autocast(amp.Policy(fp32_ops=["mm"], lower_ops=["softmax"]), "cpu"):
        assert torch.mm(a, a).dtype == FP32 and F.softmax(a, -1).dtype == BF16
    assert {"mm", "softmax"} <= casting.kernel_registry.registered("cpu")  # kept
    assert not casting.module_hooks.installed()  # one thread, no scope: module calls on torch's fast path
    with torch.autocast("cpu", dtype=BF16):  # through ampkit's kernels: torch's categories
        mm, softmax = torch.mm(a, a), F.softmax(a, -1)
    assert torch.equal(mm, native_mm) and mm.dtype == BF16
    assert torch.equal(softmax, native_softmax) and softmax.dtype == FP32
    assert torch.mm(a, a).dtype == FP32  # no autocast at all
    amp.reset()  # the only thread, no scope open: torch's own kernels are back
    assert not casting.kernel_registry.registered("cpu") and not casting.module_hooks.installed()


@pytest.mark.fresh_process
def test_reset_keeps_kernels_and_hooks_while_another_thread_runs():
    started, stop = threading.Event(), threading.Event()
    policy = amp.Policy(fp32_ops=["mm"], module_rules={nn.LayerNorm: FP32})
    seen = []

    def worker():
        with amp.autocast(policy, "cpu"):
            started.set()
            stop.wait(30)
            seen.append(torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype)
            seen.append(nn.LayerNorm(2)(torch.ones(2, 2)).dtype)

    t = threading.Thread(target=worker)
    t.start()
    started.wait(30)
    hooks = _global_hooks()
    amp.reset()
    assert "mm" in casting.kernel_registry.registered("cpu") and casting.module_hooks.installed()
    assert _global_hooks() == hooks
    stop.set()
    t.join()
    assert seen == [FP32, FP32]  # the other thread's scope kept working
    amp.reset()
    assert not casting.kernel_registry.registered("cpu") and not casting.module_hooks.installed()


@pytest.mark.fresh_process
def test_init_in_a_thread_that_exits_leaves_nothing_reset_cannot_remove():
    hooks = _global_hooks()
    a = torch.randn(4, 4)

    def init_and_leave():
        amp.init(device_type="cpu", fp32_ops=["mm"], module_rules={nn.LayerNorm: FP32})
        assert torch.mm(a, a).dtype == FP32

    _run_in_thread(init_and_leave)
    assert casting.active_scopes() == 0  # the main thread has none
    assert torch.mm(a, a).dtype == FP32  # nothing leaked into this thread
    with torch.autocast("cpu", dtype=BF16):
        assert torch.mm(a, a).dtype == BF16
    amp.reset()
    assert not casting.kernel_registry.registered("cpu") and not casting.module_hooks.installed()
    assert _global_hooks() == hooks


def test_threads_with_different_policies_see_their_own_dtypes():
    """One process, no fork: three threads with their own policy, interleaved."""
    a = torch.randn(8, 8)
    barrier = threading.Barrier(3)
    errors = []

    def loop(ctx, want_mm, want_softmax):
        try:
            barrier.wait(30)
            for _ in range(300):
                with ctx():
                    assert torch.mm(a, a).dtype == want_mm
                    assert F.softmax(a, -1).dtype == want_softmax
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [
        threading.Thread(target=loop, args=(lambda: amp.autocast(amp.Policy(fp32_ops=["mm"]), "cpu"), FP32, FP32)),
        threading.Thread(target=loop, args=(lambda: amp.autocast(amp.Policy(lower_ops=["softmax"]), "cpu"), BF16, BF16)),
        threading.Thread(target=loop, args=(lambda: torch.autocast("cpu", dtype=BF16), BF16, FP32)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.slow
def test_concurrent_scopes_stress_in_fresh_processes():
    """Issue 10's crash: 4 threads (fp32_ops=[mm], lower_ops=[softmax], plain
    torch.autocast, module rules) x 1000 scope entries, every op's dtype checked, in
    12 fresh processes. Registering and destroying kernels at every entry crashed
    most runs (segfault, SafePyObject INTERNAL ASSERT, a wrong op's kernel); the
    full-size run is ``python tests/support/_thread_stress.py --runs 30 --enters 2000``."""
    proc = subprocess.run(
        [sys.executable, str(STRESS), "--runs", "12", "--enters", "1000"],
        capture_output=True, text=True, timeout=600,
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(casting.__file__).parents[1]),
             "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "12/12 runs clean" in proc.stdout


# --- replica threads (nn.DataParallel / parallel_apply) ------------------------------
@pytest.fixture
def cpu_parallel_apply(monkeypatch):
    """torch.nn.parallel.parallel_apply as it runs on GPUs (one thread per replica),
    made to run on CPU: torch.accelerator is pointed at the CPU with no-op streams."""
    import contextlib

    from torch.nn.parallel import parallel_apply

    acc = torch.accelerator
    monkeypatch.setattr(acc, "is_available", lambda: True)
    monkeypatch.setattr(acc, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(acc, "current_stream", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(acc, "device_index", lambda *a, **k: contextlib.nullcontext())

    def run(modules, inputs):
        return parallel_apply(modules, inputs, devices=[-1] * len(modules))

    return run


class _Recorder(nn.Module):
    """Records, per submodule call, the thread and the dtypes in and out."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.norm(self.body(x))
        return self.head(h), torch.tanh(x).dtype, h.dtype


def _replicas(model, n):
    import copy

    return [copy.deepcopy(model) for _ in range(n)]


def test_replica_threads_run_under_the_callers_policy(cpu_parallel_apply):
    torch.manual_seed(0)
    model = _Recorder()
    x = torch.randn(3, 8)
    policy = amp.Policy(lower_ops=[torch.tanh], module_rules={nn.LayerNorm: FP32, "head": FP32})
    with amp.autocast(policy, "cpu"):
        want = model(x)
        got = cpu_parallel_apply(_replicas(model, 3), [(x,)] * 3)
    # torch's lists would give bf16, fp32, bf16: the rules, the op override
    assert (want[0].dtype, want[1], want[2]) == (FP32, BF16, FP32)
    for out in got:
        assert (out[0].dtype, out[1], out[2]) == (want[0].dtype, want[1], want[2])
        assert torch.equal(out[0], want[0])
    # and under amp.init (the replicas of a DataParallel model under the 3-line API)
    amp.init(device_type="cpu", policy=policy)
    got = cpu_parallel_apply(_replicas(model, 2), [(x,)] * 2)
    amp.reset()
    assert all(torch.equal(out[0], want[0]) and out[1] == BF16 for out in got)


def test_replica_threads_without_a_scope_stay_native(cpu_parallel_apply):
    torch.manual_seed(0)
    model = _Recorder()
    x = torch.randn(3, 8)
    with amp.autocast(amp.Policy(lower_ops=[torch.tanh]), "cpu"):
        pass  # kernels and hooks are installed
    got = cpu_parallel_apply(_replicas(model, 2), [(x,)] * 2)
    assert all(out[0].dtype == FP32 and out[1] == FP32 for out in got)


def test_name_rules_are_written_against_the_model_inside_wrappers(cpu_parallel_apply):
    """A name-glob rule names modules as the user's model does ("head"), also when
    the model is called through nn.DataParallel (in the caller's thread or in replica
    threads) or torch.compile's wrapper, which add "module." / "_orig_mod." to the
    qualified names."""

    class ThreadedDP(nn.DataParallel):
        """DataParallel's forward with CPU replicas (torch runs CPU inputs unsplit)."""

        def forward(self, x):
            outs = cpu_parallel_apply(_replicas(self.module, 2), [(x[:2],), (x[2:],)])
            return torch.cat([o[0] for o in outs])

    torch.manual_seed(0)
    inner = _Recorder()
    x = torch.randn(4, 8)
    policy = amp.Policy(module_rules={"head": FP32})
    with amp.autocast(policy, "cpu"):
        direct = inner(x)[0]
        threaded = ThreadedDP(inner)(x)
        caller_side = nn.DataParallel(inner)(x)[0]  # on CPU torch runs it in this thread
    assert direct.dtype == threaded.dtype == caller_side.dtype == FP32
    assert torch.equal(threaded, direct) and torch.equal(caller_side, direct)
    with amp.autocast(amp.Policy(), "cpu"):
        assert inner(x)[0].dtype == BF16  # without the rule


def test_casting_is_per_thread_and_the_session_per_process():
    """The one rule of init/reset (ampkit.reset's docstring, README "Threads and
    processes"): init and reset act on the calling thread's casting only; reset drops
    the process's session and managed optimizers from any thread."""
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    seen = {}
    amp.init(device_type="cpu")
    try:
        assert (a @ b).dtype == torch.bfloat16

        def other_thread():
            seen["before"] = ((a @ b).dtype, amp.is_active())
            amp.init(device_type="cpu")
            seen["own init"] = (a @ b).dtype

        _run_in_thread(other_thread)
        assert seen["before"] == (torch.float32, False)  # main's init does not reach it
        assert seen["own init"] == torch.bfloat16
        assert (a @ b).dtype == torch.bfloat16  # its init (and exit) leave main's alone

        model = nn.Linear(4, 4)
        opt = amp.init_trainer(torch.optim.SGD(model.parameters(), lr=0.1))
        assert len(amp.state_dict()["trainers"]) == 1

        def reset_elsewhere():
            amp.reset()
            seen["after reset"] = (a @ b).dtype

        _run_in_thread(reset_elsewhere)
        assert seen["after reset"] == torch.float32
        assert amp.state_dict()["trainers"] == []  # the session: process-wide
        with pytest.raises(amp.StateError, match="not managed by ampkit"):
            amp.stats(opt)  # the optimizer was released
        assert "step" not in opt.__dict__
        assert (a @ b).dtype == torch.bfloat16  # main's casting: its own thread's
        assert amp.is_active()
    finally:
        amp.reset()
    assert (a @ b).dtype == torch.float32 and not amp.is_active()


def _fake_parallel_apply(inside: threading.Barrier, release: threading.Event):
    """Stands in for torch's parallel_apply: blocks like a caller joining its replicas."""

    def _worker(found: list) -> None:
        from ampkit.casting import engine as casting

        try:
            found.append(casting.replica_caller())
        except amp.StateError as exc:
            found.append(exc)

    inside.wait()
    release.wait(10)
    return _worker


@pytest.mark.parametrize(("callers", "same_scopes"), [(1, True), (2, True), (2, False)])
def test_a_replica_finds_its_caller_without_reading_other_threads_frames(monkeypatch, callers, same_scopes):
    """parallel_apply called outside any module call: one thread with scopes is the
    caller. Two: the replica cannot tell them apart (other threads' frames are not read:
    that races with the threads and crashed the interpreter); with the same scopes open
    it takes them, with different ones it refuses (StateError) rather than run under the
    other thread's policy."""
    import types
    import warnings

    import torch.nn.parallel  # noqa: F401 - loads the parallel_apply module

    pa = sys.modules["torch.nn.parallel.parallel_apply"]
    monkeypatch.setattr(pa, "parallel_apply", _fake_parallel_apply)
    worker_code = next(c for c in _fake_parallel_apply.__code__.co_consts if isinstance(c, types.CodeType))
    inside, release = threading.Barrier(callers + 1), threading.Event()

    def caller(policy) -> None:
        with amp.autocast(policy, "cpu"):  # gives this thread an engine record
            pa.parallel_apply(inside, release)

    policies = [amp.Policy(fp32_ops=[torch.tanh] if i and not same_scopes else []) for i in range(callers)]
    threads = [threading.Thread(target=caller, args=(policy,)) for policy in policies]
    for t in threads:
        t.start()
    inside.wait()
    found: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replica = threading.Thread(target=types.FunctionType(worker_code, globals()), args=(found,))
        replica.start()
        replica.join()
    release.set()
    for t in threads:
        t.join()
    assert not [w for w in caught if "parallel_apply" in str(w.message)]  # no warning: an answer
    if same_scopes:
        assert len(found) == 1 and found[0] is not None and not isinstance(found[0], Exception)
    else:
        assert len(found) == 1 and isinstance(found[0], amp.StateError)
        assert "cannot tell which of them started it" in str(found[0]) and "one at a time" in str(found[0])


def test_the_thread_running_the_wrapper_is_the_caller_while_another_thread_has_scopes(cpu_parallel_apply):
    """Two threads with open scopes: a DataParallel-style replica (made by torch's
    ``_replicate_for_data_parallel``) takes the scopes of the thread whose module call
    holds it, not the other thread's."""
    import warnings

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

        def forward(self, x):
            replicas = [self.module._replicate_for_data_parallel() for _ in range(2)]
            outs = cpu_parallel_apply(replicas, [(x[:2],), (x[2:],)])
            return torch.cat([o[0] for o in outs]), outs[0][1]

    torch.manual_seed(0)
    inner = _Recorder()
    x = torch.randn(4, 8)
    entered, done = threading.Event(), threading.Event()

    def other() -> None:
        with amp.autocast(amp.Policy(fp32_ops=[torch.tanh]), "cpu"):
            entered.set()
            done.wait(30)

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(30)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "cannot tell which caller" warning
            with amp.autocast(amp.Policy(lower_ops=[torch.tanh], module_rules={"head": FP32}), "cpu"):
                out, tanh_dtype = Wrapper(inner)(x)
                want = inner(x)[0]
    finally:
        done.set()
        t.join()
    assert tanh_dtype == BF16  # this thread's lower_ops, not the other thread's fp32_ops
    assert out.dtype == FP32 and torch.equal(out, want)


def test_release_kernels_refuses_while_another_thread_has_a_scope_open():
    """Releasing the kernels while another thread is inside an ampkit scope would run
    that scope's ops with torch's own kernels (fp32-list ops in bf16) or crash it: the
    release is refused, naming the thread, and succeeds once the thread has left."""
    from ampkit.casting import release_kernels
    from ampkit.errors import StateError

    inside, leave = threading.Event(), threading.Event()
    dtypes: list[torch.dtype] = []

    def worker() -> None:
        with amp.autocast(dtype=torch.bfloat16):
            inside.set()
            leave.wait(30)
            dtypes.append(F.softmax(torch.randn(4, 4), -1).dtype)  # an fp32-list op, still ampkit's

    t = threading.Thread(target=worker, name="scoped-worker")
    t.start()
    assert inside.wait(30)
    try:
        with pytest.raises(StateError, match="other thread.*scoped-worker"):
            release_kernels()
    finally:
        leave.set()
        t.join(30)
    assert dtypes == [torch.float32]
    release_kernels()  # the thread left its scope: nothing in the way


def test_replicas_find_their_caller_while_other_threads_come_and_go(cpu_parallel_apply):
    """Replica threads list the threads with engine state while others register (new
    threads calling a module) and finished threads' records go (weakref callbacks, run
    by a garbage collection that may fall in the middle of the listing, collections made
    frequent here): every parallel_apply runs under its caller's policy, none fails.
    The failure seen once in a loaded make test ("dictionary changed size during
    iteration", replica 1 listing while replica 0 registered) did not reproduce here
    against the old listing in 1,500 runs; the lock and the dictionary's guarded
    ``items()`` rule it out by construction, and this test keeps the listing exercised
    under churn."""
    import gc
    import threading

    torch.manual_seed(0)
    model = _Recorder()
    x = torch.randn(3, 8)
    policy = amp.Policy(lower_ops=[torch.tanh], module_rules={nn.LayerNorm: FP32, "head": FP32})
    stop = threading.Event()

    other = _Recorder()

    def churn():  # short-lived threads whose module calls give them engine state, no scope
        while not stop.is_set():
            t = threading.Thread(target=other, args=(x,))
            t.start()
            t.join()

    threshold = gc.get_threshold()
    workers = [threading.Thread(target=churn) for _ in range(2)]
    gc.set_threshold(5, 1, 1)
    try:
        for w in workers:
            w.start()
        for _ in range(150):
            with amp.autocast(policy, "cpu"):
                got = cpu_parallel_apply(_replicas(model, 4), [(x,)] * 4)
            assert all(out[0].dtype == FP32 and out[1] == BF16 for out in got)
    finally:
        stop.set()
        gc.set_threshold(*threshold)
        for w in workers:
            w.join()
