"""Shared test setup: one thread per process (the CI box has 2 cores), a clean
ampkit global state around every test, the `cuda` marker skipped without a GPU, and
``tests/support`` (workers, reference models, ``locations``) importable, and no
compiling ahead in the background (``AMPKIT_COMPILE_AHEAD=0``).

The folders follow the source: ``unit/<subpackage>`` (one per subpackage of
``src/ampkit``, ``package`` for the package root's modules), ``scenarios`` (training
loops as scripts write them, across levels), ``integrations`` (Lightning, HF,
Accelerate), ``tools`` (the CLI, ``ampkit run``, the doctor, bench, tune, apex),
``meta`` (architecture, docs, README, benchmark records) and ``support``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
# No update-kernel compiles in the background from initialize on (the default; set here
# against a developer's environment): a compile thread outliving its test would meet the
# next test's patches of torch.compile. tests/unit/levels/test_compile_ahead.py turns it on.
os.environ["AMPKIT_COMPILE_AHEAD"] = "0"


#: The test files that take longest (measured with ``--durations``, one core), longest
#: first. ``make test`` hands whole files to its two workers in collection order
#: (``--dist loadfile --no-loadscope-reorder``): these start first, so the files left for
#: the end are short and neither worker waits long for the other. Any other file follows
#: them, files with more tests first (pytest-xdist's own order). Only the order changes.
LONGEST_FILES = (
    "meta/test_benchmark_json.py",
    "unit/distributed/test_fsdp.py",
    "meta/test_docs.py",
    "tools/test_run.py",
    "integrations/test_integration_hf.py",
    "unit/levels/test_fp8_compile.py",
    "unit/casting/test_compile.py",
    "tools/test_run_tied_plan.py",
    "tools/test_run_idioms.py",
    "tools/test_warmup.py",
    "tools/test_tune.py",
    "tools/test_memory_bench.py",
    "tools/test_bench.py",
    "tools/test_tune_hardening.py",
    "tools/test_gpu_check.py",
    "unit/casting/test_threads.py",
    "meta/test_benchmark_run_overhead.py",
    "unit/distributed/test_checkpoint_sweep.py",
    "integrations/test_integration_lightning.py",
    "unit/distributed/test_distributed.py",
    "meta/test_architecture.py",
    "unit/casting/test_lists.py",
    "unit/levels/test_levels.py",
    "integrations/test_integration_accelerate.py",
    "tools/test_step_limit.py",
    "unit/inference/test_convert.py",
    "unit/levels/test_compensated.py",
)


def _longest_first(items: list) -> None:
    tests = Path(__file__).resolve().parent
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    counts: dict[Path, int] = {}
    for item in items:
        counts[item.path] = counts.get(item.path, 0) + 1

    def key(item) -> tuple[int, int]:
        try:
            name = item.path.relative_to(tests).as_posix()
        except ValueError:
            name = ""
        return rank.get(name, len(rank)), -counts[item.path]

    items.sort(key=key)  # stable: a file's tests keep their order


def pytest_collection_modifyitems(config, items):
    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Tests marked ``fresh_process`` assert process-wide state (the kernels registered on
    torch's dispatcher, the threads alive): they run alone in a new process, so what
    other tests left behind (a compile worker thread, kernels kept while a thread lives)
    cannot decide their outcome. The process is forked from one that imported torch and
    ampkit and ran nothing (``tests/support/forked.py``: one thread, no ampkit state) and
    runs ``pytest`` on the test there, as ``python -m pytest NODEID`` would."""
    if pyfuncitem.get_closest_marker("fresh_process") is None:
        return None
    if os.environ.get("AMPKIT_FRESH_TEST") == pyfuncitem.nodeid:
        return None  # this is the new process: run the test here
    import forked

    root = Path(__file__).resolve().parents[1]
    args = ["-q", "-p", "no:cacheprovider", pyfuncitem.nodeid]
    proc = forked.shared().run("import sys, pytest\nsys.exit(pytest.main(sys.argv[1:]))", args, cwd=root,
                               env=forked.fork_env(AMPKIT_FRESH_TEST=pyfuncitem.nodeid), timeout=280)  # fmt: skip
    assert proc.returncode == 0, f"{pyfuncitem.nodeid} failed in a fresh process:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    return True


@pytest.fixture(scope="session")
def forked_python():
    """New Python processes without a new ``import torch`` each: forked from one server
    process per test process that imported torch and ampkit (``tests/support/forked.py``)."""
    import forked

    return forked.shared()


@pytest.fixture
def forked_tune_children(forked_python, monkeypatch):
    """``ampkit tune``'s child processes (the capture run, each confirming ``ampkit run``)
    forked from the test process's server instead of started as new interpreters (about
    2 s of ``import torch`` apiece): for tests of what the tuner makes of its children's
    results. Each child still runs its command as ``python -m MODULE ARGS`` would, in a
    fresh process, its output in its log; the time limit covers the whole child (a
    ``then`` marker's extension added up front). The real process handling
    (``ampkit.tools.tune.children.run_bounded``: process groups, stopping, the marker) is
    tested where no test uses this fixture."""
    import subprocess

    import forked

    from ampkit.errors import AmpError
    from ampkit.tools.tune import script

    def run_bounded(cmd, log, timeout, what, then=None, watch=None) -> int:
        limit = timeout + (then[1] if then is not None else 0.0)
        try:
            proc = forked_python.run_argv(list(cmd), env=forked.fork_env(), timeout=limit)
        except subprocess.TimeoutExpired:
            raise AmpError(f"{what} ran past its time limit of {limit:g} s and was stopped") from None
        with open(log, "xb") as out:
            out.write((proc.stdout + proc.stderr).encode())
        if watch is not None:
            watch()
        return proc.returncode

    monkeypatch.setattr(script, "run_bounded", run_bounded)


def pytest_sessionfinish(session, exitstatus):
    import forked

    forked.close_shared()


@pytest.fixture(autouse=True)
def _clean_ampkit_state(_torch_autocast_switches_restored):  # noqa: ARG001 (fixture order)
    """Undo any process-wide ampkit state a test left behind (amp.init, sessions)."""
    yield
    import ampkit

    reset = getattr(ampkit, "reset", None)
    if reset is not None:
        reset()
    # Under pytest-xdist a worker always has more than one thread (execnet's), so reset
    # keeps ampkit's kernels; the next test must find torch.autocast's own kernels, as in
    # a single-threaded process (no other thread of a worker runs torch ops between tests).
    release = getattr(getattr(ampkit, "casting", None), "release_kernels", None)
    if release is not None:
        release()


@pytest.fixture(autouse=True)
def _torch_autocast_switches_restored(request):
    """torch's thread-local autocast switches as each test found them: a test that
    leaves the autocast weight cache off (or autocast on) would change what the next
    test in the same worker measures. Checked after ampkit.reset() (``_clean_ampkit_state``
    depends on this fixture, so it tears down first); restored with a warning naming the test."""
    before = (torch.is_autocast_cache_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    yield
    after = (torch.is_autocast_cache_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    if after != before:
        import warnings

        torch.set_autocast_cache_enabled(before[0])
        torch.set_autocast_enabled("cpu", before[1])
        torch.set_autocast_dtype("cpu", before[2])
        warnings.warn(f"{request.node.nodeid} left torch's autocast switches changed: {before} -> {after}", stacklevel=1)
