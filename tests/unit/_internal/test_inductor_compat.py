"""``ampkit._internal.inductor_compat``: what ampkit assumes of torch.compile's Inductor
(its cache folder, its compiler lookup, its check of the CPU's instruction sets), checked
against the installed torch; and the recorded instruction-set verdict that spares a warm
process Inductor's build-and-load check, tried with stale, corrupt and rejecting records."""

from __future__ import annotations

import json
import platform
import shutil
import sys

import pytest

from ampkit._internal import inductor_compat as ic

X86_LINUX = sys.platform == "linux" and platform.machine() == "x86_64"


def test_the_inductor_cache_dir_is_a_path_inductor_uses(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert ic.inductor_cache_dir() == str(tmp_path / "cache")


def test_cpp_compiler_probe_answers(monkeypatch):
    """True exactly where inductor's own lookup finds a compiler on PATH (this machine
    or not), False once that lookup fails."""
    from torch._inductor import cpp_builder

    found = cpp_builder.get_cpp_compiler() if any(shutil.which(c) for c in ("g++", "c++", "clang++")) else None
    assert ic.cpp_compiler_available() is (found is not None)

    def missing():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    assert ic.cpp_compiler_available() is False


needs_x86 = pytest.mark.skipif(not X86_LINUX, reason="Inductor's instruction-set check is x86-64 Linux's here")


@pytest.fixture
def isa(monkeypatch, tmp_path):
    """Inductor's build-and-load check replaced by a counted stand-in (answers: True
    unless told otherwise per instruction set), with an empty cache folder."""
    from torch._inductor import cpu_vec_isa

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    state = {"calls": [], "reject": set(), "record": tmp_path / ic.ISA_RECORD}

    def check_build(self, code):
        state["calls"].append(str(self))
        return str(self) not in state["reject"]

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", check_build)
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list", [])  # no side-by-side checks unless a test sets some
    state["real"] = cpu_vec_isa.VecISA.check_build
    state["sets"] = [cpu_vec_isa.VecAVX2(), cpu_vec_isa.VecAVX512()]
    return state


def _checks(state) -> list[bool]:
    """Two checks per instruction set (two probe sources), inside the block."""
    with ic.known_cpu_isa():
        return [isa.check_build(code) for isa in state["sets"] for code in ("int a;", "int b;")]


@needs_x86
def test_inductors_names_are_where_the_shortcut_reads_them():
    """The release's ``cpu_vec_isa`` has ``VecISA.check_build`` and ``x86_isa_checker``
    (else the shortcut is off and every process pays the checks), the instruction-set
    objects have the flags a check is named by, and this CPU's flags name at least
    AVX2 (the CPUs ampkit's figures come from)."""
    cpu_vec_isa = ic.isa_machinery()
    assert cpu_vec_isa is not None
    assert "avx2" in cpu_vec_isa.x86_isa_checker()
    assert "-mavx2" in cpu_vec_isa.VecAVX2()._arch_flags


@needs_x86
def test_the_first_process_checks_and_records_the_next_one_reads_the_answers(isa):
    assert _checks(isa) == [True] * 4
    assert isa["calls"] == ["avx2", "avx2", "avx512", "avx512"]
    saved = json.loads(isa["record"].read_text())
    assert sorted(saved["answers"].values()) == [True] * 4 and saved["key"]["torch"]
    from torch._inductor import cpu_vec_isa

    assert cpu_vec_isa.VecISA.check_build is isa["real"]  # restored after the block
    assert _checks(isa) == [True] * 4 and len(isa["calls"]) == 4  # answered from the record


@needs_x86
def test_a_rejected_set_is_answered_rejected(isa):
    isa["reject"] = {"avx512"}  # the compiler cannot build the widest set
    assert _checks(isa) == [True, True, False, False]
    isa["reject"] = set()
    assert _checks(isa) == [True, True, False, False] and len(isa["calls"]) == 4


@needs_x86
def test_a_new_check_runs_and_joins_the_record(isa):
    _checks(isa)
    with ic.known_cpu_isa():
        assert isa["sets"][0].check_build("int c;") is True
    assert len(isa["calls"]) == 5 and len(json.loads(isa["record"].read_text())["answers"]) == 5


@needs_x86
@pytest.mark.parametrize("stale", ["torch", "cpu", "compiler", "corrupt", "not a dict", "not bools"])
def test_a_record_from_another_setup_or_unreadable_is_checked_again(isa, stale):
    _checks(isa)
    saved = json.loads(isa["record"].read_text())
    if stale == "corrupt":
        isa["record"].write_text(isa["record"].read_text()[:20])
    elif stale == "not a dict":
        isa["record"].write_text("[1, 2]")
    elif stale == "not bools":
        saved["answers"] = {k: "yes" for k in saved["answers"]}
        isa["record"].write_text(json.dumps(saved))
    else:
        saved["key"][stale] = "something else"
        isa["record"].write_text(json.dumps(saved))
    isa["reject"] = {"avx2", "avx512"}  # what the checks say this time
    assert _checks(isa) == [False] * 4
    assert len(isa["calls"]) == 8
    assert sorted(json.loads(isa["record"].read_text())["answers"].values()) == [False] * 4


@needs_x86
def test_an_unusable_cache_folder_leaves_inductor_checking_as_usual(isa, monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocked / "cache"))  # a folder under a file
    assert _checks(isa) == [True] * 4 and _checks(isa) == [True] * 4
    assert len(isa["calls"]) == 8 and blocked.read_text() == ""


@needs_x86
def test_a_cold_process_runs_the_checks_side_by_side(isa, monkeypatch):
    """Without a record, every set the CPU's flags name is checked at once, one thread
    each (a compiler run and a child process per check), before Inductor asks; with a
    record, nothing runs. Flags are fixed so that the test does not depend on this CPU;
    the sets are fresh subclasses so that Inductor's per-set answer caches are empty."""
    import threading

    from torch._inductor import cpu_vec_isa

    threads = []
    stand_in = cpu_vec_isa.VecISA.check_build

    def check_build(self, code):
        threads.append(threading.current_thread().name)
        return stand_in(self, code)

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", check_build)
    fresh = [type("Fresh" + c.__name__, (c,), {}) for c in (cpu_vec_isa.VecAVX512, cpu_vec_isa.VecAVX2)]
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list", [c() for c in fresh])
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx2", "avx512"])
    with ic.known_cpu_isa():
        assert len(threads) >= 2 and all(t.startswith("ampkit-isa") for t in threads), threads
        assert {"avx2", "avx512"} <= set(isa["calls"])
    checked = len(threads)
    assert len(json.loads(isa["record"].read_text())["answers"]) == checked
    with ic.known_cpu_isa():
        pass
    assert len(threads) == checked
