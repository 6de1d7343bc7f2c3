"""``ampkit warmup`` fills Inductor's on-disk cache with the update kernels a job's first
O2/O2K step compiles: the job's process then loads every graph from the cache (no miss),
and bad input is refused in one line before anything compiles."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest
from forked import Forker, fork_env

from ampkit.tools.cli.main import main

X86_LINUX = sys.platform == "linux" and platform.machine() == "x86_64"

# The AOT and FX graph cache counters of a process and the number of Inductor's checks of
# the CPU's instruction sets (a build and a child process each), printed as its last line.
HEAD = """
import json, os, sys, torch
torch.set_num_threads(int(os.environ.get("JOB_THREADS", "1")))
"""
COUNTED = """
from torch._dynamo.utils import counters
from torch._inductor import cpu_vec_isa
checks = []
if hasattr(cpu_vec_isa.VecISA, "check_build"):
    real = cpu_vec_isa.VecISA.check_build
    cpu_vec_isa.VecISA.check_build = lambda self, code: checks.append(str(self)) or real(self, code)
"""
PRINT_COUNTS = """
out = {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}
print(json.dumps(dict(out, isa_checks=len(checks))))
"""
# A job's first step at each level (the bench lm workload's optimizer: AdamW), counted. Its
# model has a weight large enough for the compiled rounding check and a one-element
# parameter (a gain).
JOB = HEAD + """
import ampkit as amp
from torch import nn
""" + COUNTED + """
class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.ones(1))
    def forward(self, x):
        return x * self.g
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(64, 448), nn.GELU(), nn.LayerNorm(448), nn.Linear(448, 300), Gain(), nn.Linear(300, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
model, opt = amp.initialize(model, opt, opt_level=sys.argv[1])
for _ in range(2):
    loss = model(torch.randn(16, 64)).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as s:
        s.backward()
    opt.step()
    opt.zero_grad()
""" + PRINT_COUNTS
# ``ampkit warmup`` (``python -m ampkit``'s entry point, with ARGS), counted: on an empty
# cache it compiles what a job's first O2/O2K step compiles without it.
WARMUP = HEAD + COUNTED + """
from ampkit.tools.cli.main import main
code = main(sys.argv[1:])
""" + PRINT_COUNTS + "sys.exit(code)\n"


def _env(cache: Path, threads: int = 1) -> dict:
    return fork_env(TORCHINDUCTOR_CACHE_DIR=str(cache), JOB_THREADS=str(threads))


def _job(forker: Forker, level: str, cache: Path, threads: int = 1) -> dict:
    """``JOB`` in a new process (forked from one that imported torch and ampkit and compiled
    nothing: no graph in memory, no verdict on the CPU): its counters."""
    out = forker.run(JOB, [level], cwd=cache.parent, env=_env(cache, threads), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_after_warmup_the_jobs_first_step_compiles_nothing(tmp_path, forked_python):
    """The counters that find no miss in the jobs after the warm-up count the warm-up's
    own misses and checks of the CPU on the empty cache (what each job would pay).
    Inductor keeps a CPU kernel per thread count: a job at 2 threads finds the kernels
    warmed at 2 (and would miss those of 1 thread alone)."""
    cache = tmp_path / "inductor"
    report = tmp_path / "w.json"
    done = forked_python.run(WARMUP, ["warmup", "--json", str(report), "--threads", "1", "--threads", "2"], cwd=tmp_path,
                             env=_env(cache), timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stderr
    cold = json.loads(done.stdout.strip().splitlines()[-1])
    assert cold["inductor"].get("fxgraph_cache_miss", 0) > 0  # a cold cache: the update kernels' graphs miss
    if X86_LINUX:
        assert cold["isa_checks"] > 0  # a cold process pays Inductor's check of the CPU
    doc = json.loads(report.read_text())
    assert doc["cache_dir"] == str(cache)
    assert [(r["level"], r["optimizer"], r["threads"], r["compiled"]) for r in doc["results"]] == [
        ("O2", "adamw", 1, True), ("O2K", "adamw", 1, True), ("O2", "adamw", 2, True), ("O2K", "adamw", 2, True)]  # fmt: skip
    assert "Inductor's cache: " + str(cache) in done.stdout and "O2 bf16 adamw on cpu, 2 threads: " in done.stdout
    for level, threads in (("O2", 1), ("O2K", 1), ("O2", 2)):
        warm = _job(forked_python, level, cache, threads)
        assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0, (level, warm)
        if X86_LINUX:  # the recorded verdict answers for it (about 0.9 s on an AVX-512 CPU)
            assert warm["isa_checks"] == 0, (level, warm)
        assert warm["inductor"].get("fxgraph_cache_hit", 0) > 0 or warm["aot_autograd"].get("autograd_cache_hit", 0) > 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["warmup", "--dtype", "fp16", "--level", "O2K"], "O2K computes in bf16 only"),
        (["warmup", "--level", "O3"], "invalid choice: 'O3'"),
        (["warmup", "--optimizer", "lbfgs"], "invalid choice: 'lbfgs'"),
        (["warmup", "--device", "cuda"], "not available here"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_compiling(argv, needle, capsys, tmp_path, monkeypatch):
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "c"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "c").exists()  # nothing compiled


def test_fp16_at_o2_says_it_compiled_nothing(capsys, tmp_path, monkeypatch):
    """fp16 at O2 steps with torch's kernels (a dynamic loss scale rules out the one-pass
    update): the warm-up says nothing was compiled instead of claiming it was."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "c"))
    report = tmp_path / "w.json"
    assert main(["warmup", "--dtype", "fp16", "--threads", "1", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "O2 fp16 adamw on cpu, 1 thread: " in out and "nothing compiled" in out, out
    assert [(r["level"], r["compiled"]) for r in json.loads(report.read_text())["results"]] == [("O2", False)]


@pytest.mark.parametrize("threads", ["0", "-2"])
def test_a_thread_count_below_one_is_refused(threads, capsys):
    assert main(["warmup", "--threads", threads]) == 2
    assert "thread counts of 1 or more" in capsys.readouterr().err


def test_an_unwritable_json_path_is_refused_first(capsys, tmp_path):
    assert main(["warmup", "--json", str(tmp_path)]) == 2
    assert "it is a folder" in capsys.readouterr().err
