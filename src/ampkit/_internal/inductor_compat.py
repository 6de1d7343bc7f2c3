"""Where ampkit relies on the internals of torch.compile's Inductor backend, behind one
small name each: its on-disk cache folder, its C++ compiler lookup, and its check of the
CPU's vector instruction sets.

Like :mod:`ampkit._internal.torch_compat` (the other module allowed to reach torch's
private names), each function states what it assumes and falls back to torch's own
behaviour where a release moved something; ``tests/unit/_internal/test_inductor_compat.py`` checks each
assumption against the installed torch (on every release of the CI's torch matrix). Nothing here imports Inductor until called.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from ampkit._internal.files import read_json, write_text
from ampkit.errors import AmpError

__all__ = ["cpp_compiler_available", "inductor_cache_dir", "isa_machinery", "known_cpu_isa", "ISA_RECORD"]

#: The file, in Inductor's cache folder, that keeps the answers of Inductor's checks of
#: the CPU's vector instruction sets on this machine (see :func:`known_cpu_isa`).
ISA_RECORD = "ampkit-cpu-isa.json"
#: The largest instruction-set record read (a real one is under a kilobyte).
ISA_RECORD_LIMIT = 1 << 20


def inductor_cache_dir() -> str:
    """Where inductor keeps its on-disk cache of compiled kernels
    (``torch._inductor.runtime.cache_dir_utils.cache_dir()``: ``TORCHINDUCTOR_CACHE_DIR``,
    else a folder under the temp dir); named in ampkit's compile messages. "unknown" if
    torch moved it."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return "unknown"
    return str(cache_dir())


def cpp_compiler_available() -> bool:
    """Whether inductor finds a C++ compiler here (``torch._inductor.cpp_builder``);
    False if that module moved or no compiler is found."""
    try:
        from torch._inductor import cpp_builder

        cpp_builder.get_cpp_compiler()
        return True
    except Exception:  # noqa: BLE001 - any failure means: no compiled update kernels
        return False


def isa_machinery() -> object | None:
    """``torch._inductor.cpu_vec_isa`` where it has the names :func:`known_cpu_isa` relies
    on (``VecISA.check_build(self, code) -> bool``, ``x86_isa_checker``), on x86-64
    Linux; else None (another platform or release: no shortcut)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return None
    vec_isa = getattr(cpu_vec_isa, "VecISA", None)
    if not callable(getattr(vec_isa, "check_build", None)) or not hasattr(cpu_vec_isa, "x86_isa_checker"):
        return None
    return cpu_vec_isa


def _record_key(cpu_vec_isa: object) -> dict[str, object]:
    """What the checks' answers depend on: torch, the CPU's flags, the compiler."""
    from torch._inductor import config

    flags = list(cpu_vec_isa.x86_isa_checker())  # type: ignore[attr-defined]
    flags += [name for name in ("_is_avx512_bf16_supported", "_is_amx_fp16_supported")
              if getattr(torch.cpu, name, lambda: False)()]  # fmt: skip
    cxx = config.cpp.cxx
    names = [c for c in (cxx if isinstance(cxx, (tuple, list)) else (cxx,)) if c]
    found = next(filter(None, map(shutil.which, names)), None)
    return {"torch": torch.__version__, "cpu": flags, "cxx": os.environ.get("CXX"),
            "compiler": found and os.path.realpath(found)}  # fmt: skip


def _check_name(isa: object, code: str) -> str:
    """One check: the instruction set, the flags it is built with, the probe's source."""
    flags = getattr(isa, "_arch_flags", "")
    return f"{isa}|{flags}|{hashlib.sha256(code.encode()).hexdigest()[:16]}"


def _check_side_by_side(cpu_vec_isa: object) -> None:
    """Run Inductor's checks of the instruction sets this CPU's flags name, one thread
    per set, instead of one after the other when Inductor first asks: each check is a
    compiler run and a child process (about 0.9 s each, 5.5 s for the six of an AVX-512
    CPU), so a cold first compile waits for the slowest chain, not their sum. The
    answers land in Inductor's own per-set caches; a check that fails answers False
    there, as it would have."""
    flags = cpu_vec_isa.x86_isa_checker()  # type: ignore[attr-defined]
    sets = [isa for isa in cpu_vec_isa.supported_vec_isa_list  # type: ignore[attr-defined]
            if str(isa).split() and all(f in flags for f in str(isa).split())]  # fmt: skip
    if len(sets) < 2:
        return

    def check(isa: object) -> None:
        with contextlib.suppress(Exception):
            bool(isa)

    with concurrent.futures.ThreadPoolExecutor(len(sets), thread_name_prefix="ampkit-isa") as pool:
        list(pool.map(check, sets))


@contextlib.contextmanager
def known_cpu_isa() -> Iterator[None]:
    """Within the block, Inductor's checks of this CPU's vector instruction sets are
    answered from an earlier process's answers on this machine where there are any.

    Inductor checks each instruction set it may use (AVX2, AVX-512 and its bf16 and
    VNNI parts, AMX, ...) by building a small library with its flags and loading it in
    a child Python (``VecISA.check_build``), once per process: about 0.9 s of a warm
    first compile on an AVX-512 CPU, more than loading the cached kernel. Inside the
    block each check's answer is looked up in :data:`ISA_RECORD` in Inductor's cache
    folder, kept per torch release, CPU flags and compiler; a check not found there
    runs as usual and its answer is added. The answers are the checks' own, so the
    compiled code and Inductor's cache keys are what they would be without the record.
    Another platform, a release without these names, an unreadable record or no usable
    cache folder: every check runs as usual."""
    cpu_vec_isa = isa_machinery()
    if cpu_vec_isa is None:
        yield
        return
    try:
        key = _record_key(cpu_vec_isa)
        record = Path(inductor_cache_dir()) / ISA_RECORD  # (creates the folder)
    except Exception:  # noqa: BLE001 - a release that changed these helpers, no cache folder: no shortcut
        yield
        return
    answers: dict[str, bool] = {}
    try:  # regular files only, bounded: a FIFO or a link to /dev/zero is no record
        saved = read_json(record, "the instruction-set record", AmpError, ISA_RECORD_LIMIT)
    except AmpError:
        saved = None
    if isinstance(saved, dict) and saved.get("key") == key and isinstance(saved.get("answers"), dict):
        answers = {k: v for k, v in saved["answers"].items() if isinstance(k, str) and isinstance(v, bool)}
    known = dict(answers)
    vec_isa = cpu_vec_isa.VecISA  # type: ignore[attr-defined]
    real = vec_isa.check_build

    def check_build(self: object, code: str) -> bool:
        name = _check_name(self, code)
        if name not in answers:
            answers[name] = bool(real(self, code))
        return answers[name]

    vec_isa.check_build = check_build
    try:
        if not answers:
            _check_side_by_side(cpu_vec_isa)
        yield
    finally:
        vec_isa.check_build = real
        if answers != known:  # an exclusive temp file, then a rename; a special file there is left alone
            with contextlib.suppress(AmpError):
                write_text(record, json.dumps({"key": key, "answers": answers}, indent=1), "the instruction-set record")
