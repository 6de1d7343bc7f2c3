"""Two threads running one model through ``parallel_apply`` at once (``nn.DataParallel``'s
replica threads, called from two threads): a replica cannot tell which of them started
it. With the same scopes open in both it does not matter and the replicas run under
them; with different ones a replica refuses (``StateError``, raised again in its caller
by ``parallel_apply``) instead of running under the other thread's policy.

On CPU ``nn.DataParallel`` calls its module in the caller's thread, so the model here does
what ``DataParallel.forward`` does between scatter and gather: replicas made by torch's own
``_replicate_for_data_parallel``, run by torch's ``parallel_apply`` in one thread each (the
accelerator pointed at the CPU)."""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch
from torch import nn

import ampkit as amp

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture
def cpu_parallel_apply(monkeypatch):
    """torch.nn.parallel.parallel_apply as it runs on GPUs (one thread per replica),
    made to run on CPU: torch.accelerator is pointed at the CPU with no-op streams."""
    from torch.nn.parallel import parallel_apply

    acc = torch.accelerator
    monkeypatch.setattr(acc, "is_available", lambda: True)
    monkeypatch.setattr(acc, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(acc, "current_stream", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(acc, "device_index", lambda *a, **k: contextlib.nullcontext())

    def run(modules, inputs):
        return parallel_apply(modules, inputs, devices=[-1] * len(modules))

    return run


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)

    def forward(self, x):
        h = self.body(x)
        return h, torch.tanh(h).dtype


class _Replicating(nn.Module):
    """``DataParallel.forward`` on CPU replicas. Every caller enters the call before any
    replica starts and stays in it until every caller's replicas have run, so each
    replica thread sees all callers running the model."""

    def __init__(self, inner, run, callers):
        super().__init__()
        self.module = inner
        self._run = run
        self._inside = threading.Barrier(callers)
        self._done = threading.Barrier(callers)

    def forward(self, x):
        self._inside.wait(30)
        try:
            replicas = [self.module._replicate_for_data_parallel() for _ in range(2)]
            outs = self._run(replicas, [(x[:2],), (x[2:],)])
        finally:
            self._done.wait(30)
        return torch.cat([o[0] for o in outs]), [o[1] for o in outs]


def _call_from_threads(model, x, policies):
    """``model(x)`` from one thread per policy, each inside ``amp.autocast(policy)``:
    per thread, its output or the exception it raised."""
    results: list = [None] * len(policies)

    def caller(i, policy):
        try:
            with amp.autocast(policy, "cpu"):
                results[i] = model(x)
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            results[i] = exc

    threads = [threading.Thread(target=caller, args=(i, p)) for i, p in enumerate(policies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return results


def test_two_callers_with_different_policies_are_refused_not_run_under_the_wrong_one(cpu_parallel_apply):
    torch.manual_seed(0)
    model = _Replicating(_Inner(), cpu_parallel_apply, callers=2)
    x = torch.randn(4, 8)
    lowered, fp32 = amp.Policy(lower_ops=[torch.tanh]), amp.Policy(fp32_ops=[torch.tanh])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _call_from_threads(model, x, [lowered, fp32])
    assert not [w for w in caught if "ampkit" in str(w.message)]  # an error, said once, not a warning
    for got in results:
        assert isinstance(got, amp.StateError), got
        assert "cannot tell which of them started it" in str(got)
        assert "one at a time" in str(got)  # what to do
    # one caller at a time: each replica runs under its caller's policy
    model = _Replicating(model.module, cpu_parallel_apply, callers=1)
    for policy, tanh_dtype in ((lowered, BF16), (fp32, FP32)):
        with amp.autocast(policy, "cpu"):
            out, dtypes = model(x)
        assert dtypes == [tanh_dtype, tanh_dtype] and out.dtype == BF16


def test_two_callers_with_the_same_policy_run_their_replicas_under_it(cpu_parallel_apply):
    torch.manual_seed(0)
    inner = _Inner()
    model = _Replicating(inner, cpu_parallel_apply, callers=2)
    x = torch.randn(4, 8)
    with amp.autocast(amp.Policy(lower_ops=[torch.tanh]), "cpu"):
        want = inner(x)[0]
    # equal policies built apart (as two threads building the same configuration do)
    results = _call_from_threads(model, x, [amp.Policy(lower_ops=[torch.tanh]) for _ in range(2)])
    for got in results:
        assert not isinstance(got, Exception), got
        out, dtypes = got
        assert dtypes == [BF16, BF16]
        assert out.dtype == want.dtype == BF16 and torch.equal(out, torch.cat([want[:2], want[2:]]))
