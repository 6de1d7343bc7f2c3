"""Threads entering ampkit scopes with different policies, and plain torch.autocast,
all at once, in fresh processes. Run by tests/unit/casting/test_threads.py; also by hand:

    python tests/support/_thread_stress.py --runs 30 --enters 2000

The parent imports torch and ampkit once, then forks ``--runs`` children one after
another; each child starts fresh (no ampkit kernel registered yet) and runs the
threads below, checking the dtype of every op in every thread. A child that crashes
(a signal), hangs, or sees a wrong dtype or an exception fails the run. Prints one
line per failure and a summary; exits 1 if any child failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp

BF16, FP32 = torch.bfloat16, torch.float32


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


def _workers(enters: int) -> dict[str, callable]:
    a = torch.randn(8, 8)
    net = _Net()
    net_ref = _Net()
    net_ref.load_state_dict(net.state_dict())

    def expect(got: torch.dtype, want: torch.dtype, what: str) -> None:
        if got is not want:
            raise AssertionError(f"{what}: {got} (expected {want})")

    def mm_fp32() -> None:  # mm moved to fp32, the rest native
        policy = amp.Policy(fp32_ops=["mm"])
        for _ in range(enters):
            with amp.autocast(policy, "cpu"):
                expect(torch.mm(a, a).dtype, FP32, "mm under fp32_ops=[mm]")
                expect(torch.matmul(a, a).dtype, BF16, "matmul under fp32_ops=[mm]")
                expect(F.softmax(a, -1).dtype, FP32, "softmax under fp32_ops=[mm]")
                expect(F.gelu(a).dtype, FP32, "gelu under fp32_ops=[mm]")

    def softmax_low() -> None:  # softmax moved to bf16
        policy = amp.Policy(lower_ops=["softmax"], fp32_ops=[F.gelu])
        for _ in range(enters):
            with amp.autocast(policy, "cpu"):
                expect(F.softmax(a, -1).dtype, BF16, "softmax under lower_ops=[softmax]")
                expect(torch.mm(a, a).dtype, BF16, "mm under lower_ops=[softmax]")
                expect(F.gelu(a.bfloat16()).dtype, FP32, "gelu under fp32_ops=[gelu]")

    def native() -> None:  # plain torch.autocast, through whatever ampkit registered
        for _ in range(enters):
            with torch.autocast("cpu", dtype=BF16):
                expect(torch.mm(a, a).dtype, BF16, "mm under torch.autocast")
                expect(F.softmax(a, -1).dtype, FP32, "softmax under torch.autocast")
                expect(F.gelu(a.bfloat16()).dtype, BF16, "gelu under torch.autocast")
            expect(torch.mm(a, a).dtype, FP32, "mm with no autocast")

    def rules() -> None:  # module rules and the cast cache (global module hooks)
        policy = amp.Policy(module_rules={nn.LayerNorm: FP32}, fp32_ops=["mm"])
        x = torch.randn(4, 8)
        for i in range(enters // 4):
            with amp.autocast(policy, "cpu"):
                h = net.fc(x)
                expect(h.dtype, BF16, "linear under module rules")
                expect(net(x).dtype, FP32, "LayerNorm under an fp32 module rule")
                expect(torch.mm(a, a).dtype, FP32, "mm under fp32_ops=[mm] with rules")
            if i % 64 == 0:  # module calls with no scope in this thread
                expect(net_ref(x).dtype, FP32, "module call with no scope")

    return {"mm_fp32": mm_fp32, "softmax_low": softmax_low, "native": native, "rules": rules}


def child(enters: int) -> int:
    torch.set_num_threads(1)
    errors: list[str] = []
    workers = _workers(enters)
    barrier = threading.Barrier(len(workers))

    def run(name: str, fn: callable) -> None:
        try:
            barrier.wait()
            fn()
        except BaseException:  # noqa: BLE001 - every failure is reported
            errors.append(f"{name}: {traceback.format_exc(limit=3)}")

    threads = [threading.Thread(target=run, args=(n, f)) for n, f in workers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    amp.reset()
    for e in errors:
        print(e, file=sys.stderr, flush=True)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--enters", type=int, default=2000)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per child")
    args = p.parse_args(argv)
    failures = []
    t0 = time.perf_counter()
    for run in range(args.runs):
        pid = os.fork()
        if pid == 0:  # child: exit without interpreter teardown
            code = 1
            try:
                code = child(args.enters)
            finally:
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + args.timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = -1
                break
            time.sleep(0.01)
        if status == -1:
            failures.append(f"run {run}: hung (killed after {args.timeout:.0f} s)")
        elif os.WIFSIGNALED(status):
            failures.append(f"run {run}: crashed with signal {os.WTERMSIG(status)}")
        elif os.WEXITSTATUS(status) != 0:
            failures.append(f"run {run}: wrong dtype or exception (exit {os.WEXITSTATUS(status)})")
    for f in failures:
        print(f, flush=True)
    print(f"{args.runs - len(failures)}/{args.runs} runs clean in {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
