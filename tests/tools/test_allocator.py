"""``ampkit.tools.bench.allocator``: freed memory kept in the process, page faults
counted, the allocator named in every benchmark record.

The fault counts are glibc's behaviour on Linux (a block over 32 MiB is mapped on
its own and unmapped when freed unless the mmap threshold is raised); those tests
are skipped, saying so, where the allocator is not glibc's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ampkit.tools.bench import allocator
from ampkit.tools.bench.machine import machine_info
from ampkit.tools.bench.runner import BenchConfig, summarize_precision
from ampkit.tools.cli.main import build_parser

GLIBC = allocator.allocator_info()["allocator"].startswith("glibc")
needs_glibc = pytest.mark.skipif(not GLIBC, reason="the fault counts are glibc malloc's; this process uses another allocator")

# A fresh process: allocate, fill and free a 64 MiB tensor 26 times and report the minor
# page faults of each round after two warm-up rounds. The first round grows the heap; in
# some processes up to eight more do too (seen: 0, 1 and 7 in runs of the same code): the
# tensor's small bookkeeping chunks, freed into glibc's per-thread cache (seven entries
# per size), stay "in use" between two freed blocks, so a freed block cannot merge with
# its neighbour and is a few bytes short of the next aligned 64 MiB request until the
# cache turns over. With GLIBC_TUNABLES=glibc.malloc.tcache_count=0 only round one grows.
_ROUNDS = """
import json, sys, torch
from ampkit.tools.bench.allocator import hold_freed_memory, minor_page_faults, allocator_info
held = hold_freed_memory() if sys.argv[1] == "hold" else False
torch.set_num_threads(1)
faults = []
for i in range(26):
    before = minor_page_faults()
    x = torch.ones(16 * 2**20)  # 64 MiB, every page written
    del x
    faults.append(minor_page_faults() - before)
print(json.dumps({"held": held, "faults": faults[2:], "info": allocator_info()}))
"""


def _rounds(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_glibc
def test_glibc_defaults_fault_a_large_block_in_again_on_every_allocation() -> None:
    out = _rounds("system")
    assert out["held"] is False and out["info"]["freed_memory"] == "returned to the OS"
    pages = 64 * 2**20 // 4096
    assert all(f >= pages // 2 for f in out["faults"]), out["faults"]


@needs_glibc
def test_held_memory_reuses_the_freed_block_without_faults() -> None:
    out = _rounds("hold")
    assert out["held"] is True and out["info"]["freed_memory"] == "held"
    # the heap settles: the last twelve rounds reuse a freed block (glibc's defaults fault
    # every round, above), and at most eight rounds grew it (the cache's seven, plus one)
    assert all(f < 1000 for f in out["faults"][-12:]), out["faults"]
    assert sum(f >= 1000 for f in out["faults"]) <= 8, out["faults"]


def test_a_preloaded_allocator_is_named_and_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    called: list[object] = []
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda *a: called.append(a))
    assert allocator.hold_freed_memory() is False
    assert called == []  # mallopt never reached for
    assert allocator.allocator_info() == {"allocator": "libjemalloc.so.2", "freed_memory": "allocator's own"}


def test_page_faults_are_counted_where_resource_exists() -> None:
    first = allocator.minor_page_faults()
    if first is None:
        pytest.skip("no resource module (Windows): faults are not counted")
    assert first > 0 and allocator.minor_page_faults() >= first


def test_machine_record_names_the_allocator() -> None:
    record = machine_info("cpu", threads=1)
    assert record["malloc"] == allocator.allocator_info()
    json.dumps(record)


def test_summary_reports_the_median_faults_per_step_after_warmup() -> None:
    blocks = [
        {"losses": [1.0, 1.0], "skipped": [False, False], "scales": [None, None], "seconds": 1.0, "steps": 2,
         "page_faults": 9000},
        {"losses": [1.0, 1.0], "skipped": [False, False], "scales": [None, None], "seconds": 0.1, "steps": 2,
         "page_faults": 0},
        {"losses": [1.0, 1.0], "skipped": [False, False], "scales": [None, None], "seconds": 0.1, "steps": 2,
         "page_faults": 4000},
        {"losses": [1.0, 1.0], "skipped": [False, False], "scales": [None, None], "seconds": 0.1, "steps": 2,
         "page_faults": 8000},
    ]  # fmt: skip
    assert summarize_precision(blocks, {})["page_faults_per_step"] == 2000  # median of 0, 2000, 4000
    for b in blocks:
        b["page_faults"] = None
    assert summarize_precision(blocks, {})["page_faults_per_step"] is None


def test_bench_holds_freed_memory_unless_asked_for_the_system_malloc() -> None:
    from ampkit.tools.cli.main import bench_config

    parser = build_parser()
    assert BenchConfig().hold_freed_memory is True
    assert bench_config(parser.parse_args(["bench", "--device", "cpu"])).hold_freed_memory is True
    assert bench_config(parser.parse_args(["bench", "--device", "cpu", "--system-malloc"])).hold_freed_memory is False


def test_allocator_note_says_what_the_step_times_include() -> None:
    from ampkit.tools.bench.report import allocator_note

    held = allocator_note({"allocator": {"allocator": "glibc 2.36", "freed_memory": "held"}})
    system = allocator_note({"allocator": {"allocator": "glibc 2.36", "freed_memory": "returned to the OS"}})
    assert "kept in each process" in held and "--system-malloc" in held
    assert "page faults" in system and "vary" in system
    assert "unknown" in allocator_note({})
