"""``ampkit._internal.files``: the one writer and the one reader every file of ampkit's goes
through, tried in a temp folder against what a hostile folder may hold at the name: a
FIFO, a symlink to a victim file, a symlink planted at the writer's temp name, a copy of
``/dev/null``'s device node, a symlink to ``/dev/zero``, an oversize, binary, nested or
truncated file. Each write is refused (or leaves the victim as it was) and the special
file is still special afterwards; each read is one error, at once, never a hang."""

from __future__ import annotations

import json
import os
import platform
import secrets
import stat
import sys
import threading
from pathlib import Path

import pytest

from ampkit._internal import files
from ampkit._internal import inductor_compat as ic
from ampkit._internal.paths import output_path, unwritable_reason
from ampkit.errors import OutputPathError, StateError

VICTIM_TEXT = "the victim's own content\n"


ReadError = StateError  # an AmpError the reader raises (any subclass does)


def _within(seconds: float, fn, fifo: Path | None = None):
    """``fn()``'s result (or the exception it raised), failing the test if it takes more
    than ``seconds``; a reader stuck on ``fifo`` is let go by opening it for writing."""
    box: dict = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            with open(fifo, "w"):
                pass
        pytest.fail(f"{fn} still running after {seconds} s (blocked?)")
    if "error" in box:
        return box["error"]
    return box["value"]


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    return path


@pytest.fixture
def device(tmp_path) -> Path:
    """A copy of ``/dev/null``'s node (character device 1:3), made with ``os.mknod``."""
    path = tmp_path / "null.json"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, AttributeError):
        pytest.skip("making a device node needs root on Linux")
    return path


def _is(path: Path, test) -> bool:
    return test(os.lstat(path).st_mode)


# --- writing --------------------------------------------------------------------------
def test_a_regular_file_is_written_and_replaced_whole(tmp_path):
    path = tmp_path / "out.json"
    assert files.write_text(path, "one", "the file") == path
    files.write_text(str(path), "two", "the file")
    assert path.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temp file left


def test_a_name_ending_in_a_separator_dot_or_dot_dot_is_a_folder_and_refused(tmp_path, monkeypatch):
    """``Path("new/")`` is ``Path("new")``: the writer sees the name as given, and a name
    ending in ``/``, ``/.`` or ``/..`` names a folder, so nothing is written."""
    monkeypatch.chdir(tmp_path)
    for name in ("new/", str(tmp_path / "new") + "/", "new/.", "new/..", ".", "..", ""):
        for write in (lambda n: files.write_text(n, "x", "the file"), lambda n: files.check_target(n, "the file")):
            with pytest.raises(OutputPathError, match="(names a folder|is a folder|the name is empty); give a file name") as info:
                write(name)
            assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []
    files.write_text("new", "x", "the file")  # the same name without the slash is a file's
    assert (tmp_path / "new").read_text() == "x"


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755, 0o444])
def test_a_replaced_file_keeps_its_permission_bits(tmp_path, mode):
    path = tmp_path / "out.json"
    path.write_text("old")
    os.chmod(path, mode)
    files.write_text(path, "new", "the file")
    assert path.read_text() == "new" and stat.S_IMODE(os.lstat(path).st_mode) == mode
    fresh = tmp_path / "fresh.json"
    files.write_text(fresh, "x", "the file")  # a new file: 0o644 less the umask, as before
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o644 & ~umask


def test_a_fifo_is_refused_and_stays_a_fifo(fifo):
    error = _within(5, lambda: files.write_text(fifo, "x", "the file"), fifo)
    assert isinstance(error, OutputPathError) and "it is a FIFO (named pipe)" in str(error)
    assert _is(fifo, stat.S_ISFIFO)


def test_a_device_node_is_refused_and_stays_a_device(device):
    with pytest.raises(OutputPathError, match="it is a character device; ampkit writes regular files only"):
        files.write_text(device, "{}", "the plan")
    with pytest.raises(OutputPathError, match="character device"):
        files.check_target(device, "the plan")
    assert _is(device, stat.S_ISCHR)


def test_a_symlink_to_a_victim_is_refused_and_the_victim_kept(tmp_path, victim):
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    with pytest.raises(OutputPathError, match="symbolic link"):
        files.write_text(link, "{}", "the plan")
    assert _is(link, stat.S_ISLNK) and victim.read_text() == VICTIM_TEXT


def test_a_symlink_planted_at_the_temp_name_is_not_followed(tmp_path, victim, monkeypatch):
    """The temp name predicted (``secrets.token_hex`` fixed) and taken by a symlink to the
    victim: the write fails (every try finds the name taken) and the victim is intact."""
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: "0" * 16)
    out = tmp_path / "out.json"
    planted = tmp_path / f".out.json.{'0' * 16}.tmp"
    planted.symlink_to(victim)
    with pytest.raises(OutputPathError, match="File exists"):
        files.write_text(out, "{}", "the plan")
    assert victim.read_text() == VICTIM_TEXT and _is(planted, stat.S_ISLNK) and not out.exists()


def test_a_taken_temp_name_is_passed_over(tmp_path, victim, monkeypatch):
    names = iter(["a" * 16, "b" * 16])
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: next(names, "c" * 16))
    (tmp_path / f".out.json.{'b' * 16}.tmp").symlink_to(victim)  # the writer's first temp name
    files.write_text(tmp_path / "out.json", "{}", "the plan")  # the probe took "a...", the write "c..."
    assert (tmp_path / "out.json").read_text() == "{}" and victim.read_text() == VICTIM_TEXT


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc")
def test_a_folder_that_takes_no_new_file_is_refused_up_front():
    """``os.access`` says yes to root in ``/proc``; creating a file there fails."""
    with pytest.raises(OutputPathError, match="no file can be created in folder '/proc'"):
        files.check_target("/proc/ampkit-plan.png", "the plot")


def test_folders_missing_folders_and_non_paths_are_refused(tmp_path):
    for path, needle in ((tmp_path, "it is a folder"), (tmp_path / "no" / "x.json", "does not exist"),
                         (3, "expected a file path"), (str(tmp_path / "a\0b"), "NUL")):  # fmt: skip
        with pytest.raises(OutputPathError, match=needle):
            files.check_target(path, "the file")


def test_the_output_path_helpers_refuse_what_the_writer_refuses(tmp_path, fifo, victim):
    link = tmp_path / "link.json"
    link.symlink_to(victim)
    for special in (fifo, link):
        assert unwritable_reason(special) is not None
        with pytest.raises(OutputPathError, match="regular files only"):
            output_path(special, "the report")
    assert unwritable_reason(tmp_path / "fresh.json") is None
    assert {p.name for p in tmp_path.iterdir()} == {"pipe.json", "victim.txt", "link.json"}  # no probe left


def test_a_failing_fill_leaves_the_target_and_no_temp_file(tmp_path, victim):
    def fill(f):
        f.write(b"half")
        raise RuntimeError("drawing failed")

    with pytest.raises(RuntimeError, match="drawing failed"):
        files.write_file(victim, fill, "the plot")
    assert victim.read_text() == VICTIM_TEXT and [p.name for p in tmp_path.iterdir()] == ["victim.txt"]


# --- reading --------------------------------------------------------------------------
def test_reads_return_the_bytes_up_to_the_limit(tmp_path):
    path = tmp_path / "r.json"
    path.write_bytes(b"0123456789")
    assert files.read_file(path, "the record", ReadError, limit=10) == b"0123456789"
    with pytest.raises(ReadError, match="larger than 9 bytes"):
        files.read_file(path, "the record", ReadError, limit=9)


def test_a_fifo_read_is_an_error_at_once(fifo):
    error = _within(5, lambda: files.read_file(fifo, "the plan", ReadError), fifo)
    assert isinstance(error, ReadError) and "FIFO" in str(error)


def test_a_symlink_to_dev_zero_and_a_device_are_refused_unread(tmp_path, device):
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    for path in (zero, device):
        error = _within(5, lambda path=path: files.read_json(path, "the plan", ReadError))
        assert isinstance(error, ReadError) and "character device" in str(error)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "not text"),
        (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
        (b'{"format": "ampkit-tune-plan", "vers', "not JSON"),
        (b"", "not JSON"),
    ],
)
def test_binary_nested_and_truncated_json_are_one_error(tmp_path, content, needle):
    path = tmp_path / "doc.json"
    path.write_bytes(content)
    with pytest.raises(ReadError, match=needle) as info:
        files.read_json(path, "the plan", ReadError)
    assert "\n" not in str(info.value)


def test_missing_files_folders_and_bad_names_are_one_error(tmp_path):
    for path, needle in ((tmp_path / "none.json", "no such file"), (tmp_path, "a folder"),
                         (str(tmp_path / "a\0b"), "NUL"), (None, "expected a file path")):  # fmt: skip
        with pytest.raises(ReadError, match=needle):
            files.read_file(path, "the plan", ReadError)


# --- the instruction-set record (Inductor's cache folder) ------------------------------
needs_x86 = pytest.mark.skipif(
    not (sys.platform == "linux" and platform.machine() == "x86_64"), reason="x86-64 Linux's instruction-set check"
)


@pytest.fixture
def isa_cache(monkeypatch, tmp_path):
    """An empty Inductor cache folder, the build-and-load check replaced by a stand-in
    that answers True (as in test_inductor_compat)."""
    from torch._inductor import cpu_vec_isa

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda self, code: True)
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list", [])
    return cache


def _check_once() -> bool:
    from torch._inductor import cpu_vec_isa

    with ic.known_cpu_isa():
        return cpu_vec_isa.VecAVX2().check_build("int a;")


@needs_x86
def test_the_isa_record_is_no_fifo_read_nor_replaced(isa_cache):
    record = isa_cache / ic.ISA_RECORD
    os.mkfifo(record)
    assert _within(10, _check_once, record) is True
    assert _is(record, stat.S_ISFIFO)


@needs_x86
def test_the_isa_record_behind_a_dev_zero_link_is_not_read_nor_replaced(isa_cache):
    record = isa_cache / ic.ISA_RECORD
    record.symlink_to("/dev/zero")
    assert _within(10, _check_once) is True
    assert _is(record, stat.S_ISLNK) and os.readlink(record) == "/dev/zero"


@needs_x86
@pytest.mark.parametrize("content", [b"[" * 100_000, b"\xff\xfe" * 10, b"x" * (ic.ISA_RECORD_LIMIT + 1)])
def test_a_nested_binary_or_oversize_isa_record_is_checked_again_and_rewritten(isa_cache, content):
    record = isa_cache / ic.ISA_RECORD
    record.write_bytes(content)
    assert _check_once() is True
    assert list(json.loads(record.read_text())["answers"].values()) == [True]


@needs_x86
def test_the_isa_record_writer_does_not_follow_a_planted_temp_symlink(isa_cache, victim, monkeypatch):
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: "0" * 16)
    planted = isa_cache / f".{ic.ISA_RECORD}.{'0' * 16}.tmp"
    planted.symlink_to(victim)
    assert _check_once() is True  # the record cannot be written: the check still answers
    assert victim.read_text() == VICTIM_TEXT and _is(planted, stat.S_ISLNK)
    assert not (isa_cache / ic.ISA_RECORD).exists()
