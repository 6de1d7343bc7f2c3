"""Every file ampkit writes or reads, through two doors.

Writing (:func:`write_file`): the target is a regular file or absent -- a symlink, a FIFO,
a device node or a folder is refused in one line *before* any work fills it
(:func:`check_target`, called up front by the commands, which also creates and removes
an empty file in the folder: ``os.access`` says yes to root where nothing can be
created, in ``/proc``) and again just before the write; the content goes to a temp
file created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``, so a planted symlink at
the temp name is never followed), then ``os.replace`` puts it in place (which replaces
a name, never writes through a link). A name ending in a separator (``"out/"``), ``.``
or ``..`` is a folder's and refused; a regular file replaced keeps its permission bits.

Reading (:func:`read_file`): regular files only (a FIFO would block, ``/dev/zero`` never
ends), at most ``limit`` bytes, every failure -- missing, special, too large, not UTF-8,
not JSON, nested past Python's recursion limit -- one :class:`~ampkit.AmpError` naming
the file and what to do.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ampkit.errors import AmpError, OutputPathError

__all__ = ["DEFAULT_READ_LIMIT", "check_target", "read_file", "read_json", "target_problem", "write_file", "write_text"]

DEFAULT_READ_LIMIT = 16 << 20
"""The size bound of :func:`read_file` unless a caller says otherwise: 16 MiB (a plan
or report of ampkit's is kilobytes)."""

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def _kind(mode: int) -> str | None:
    """What a non-regular file is (None for a regular file)."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def target_problem(path: Path, probe: bool = True) -> str | None:
    """Why ampkit will not write a file at ``path`` (None when it will): the name is
    taken by something that is not a regular file, or its folder is missing or
    read-only, or (``probe``, the default) no file can be created in it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except ValueError:  # a NUL character in the name (os.lstat raises nothing else)
        return "the name holds a NUL character"
    except OSError as exc:
        return exc.strerror or str(exc)
    if mode is not None and not stat.S_ISREG(mode):
        kind = _kind(mode)
        if kind == "a folder":
            return "it is a folder; give a file name"
        return f"it is {kind}; ampkit writes regular files only (give another name, or remove it first)"
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return f"folder {str(parent)!r} does not exist"
    if not os.access(parent, os.W_OK):
        return f"folder {str(parent)!r} is not writable"
    return _create_problem(parent) if probe else None


def _create_problem(parent: Path) -> str | None:
    """Why no file can be created in the folder ``parent`` (None when one can): tried
    with an empty file of a random name, created exclusively and removed at once
    (``os.access`` says yes to root in ``/proc`` or on a full or read-only mount)."""
    try:
        fd, probe = _create_temp(parent, "ampkit-write-test")
    except OSError as exc:
        return f"no file can be created in folder {str(parent)!r} ({exc.strerror or exc})"
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass
    return None


_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _create_temp(parent: Path, name: str, tries: int = 3) -> tuple[int, Path]:
    """A new empty file ``parent/.NAME.RANDOM.tmp``, opened for writing: created
    exclusively, so a name already taken (a planted symlink included) is never
    opened; another random name is tried when one is taken. ``OSError`` when none
    can be made."""
    for attempt in range(tries):
        tmp = parent / f".{name[:200]}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(tmp, _TEMP_FLAGS, 0o644), tmp
        except FileExistsError:
            if attempt == tries - 1:
                raise
    raise FileExistsError(f"no free temp name in {str(parent)!r}")  # tries < 1


def check_target(path: Any, what: str, error: type[AmpError] = OutputPathError) -> Path:
    """``path`` (``str`` or ``os.PathLike``) as a :class:`~pathlib.Path` that
    :func:`write_file` will write, else raise ``error`` saying why (call it before the
    work that fills the file); ``what`` names the file in the message."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise error(f"{what}: expected a file path (str or os.PathLike), got {type(path).__name__} {path!r:.60}.")
    name = os.fsdecode(os.fspath(path))
    if not name:
        raise error(f"cannot write {what} to '': the name is empty; give a file name.")
    if name.replace(os.altsep or os.sep, os.sep).rsplit(os.sep, 1)[-1] in ("", ".", ".."):
        # Path("new/") is Path("new"): a name ending in a separator, "." or ".." is a folder's
        if os.path.isdir(name):
            raise error(f"cannot write {what} to {name!r}: it is a folder; give a file name.")
        raise error(f"cannot write {what} to {name!r}: it ends in {name[-1]!r}, which names a folder; give a file name.")
    out = Path(path)
    problem = target_problem(out)
    if problem is not None:
        raise error(f"cannot write {what} to {str(out)!r}: {problem}.")
    return out


def write_file(
    path: Any, fill: Callable[[IO[bytes]], Any], what: str, error: type[AmpError] = OutputPathError
) -> Path:
    """Write ``path`` by calling ``fill(f)`` on a temp file opened for binary writing,
    then moving it into place. Refuses (``error``) a target that is not a regular file;
    never follows a symlink; an OS error while writing raises ``error`` and leaves the
    target as it was. A regular file replaced keeps its permission bits (``rwx`` for
    owner, group and others); a new file gets ``0o644`` less the umask."""
    out = check_target(path, what, error)
    parent = out.parent if str(out.parent) else Path(".")
    try:
        fd, tmp = _create_temp(parent, out.name)
    except OSError as exc:
        raise error(f"cannot write {what} to {str(out)!r}: {exc.strerror or exc}.") from None
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
            old = _regular_mode(out)
            if old is not None:
                os.fchmod(f.fileno(), stat.S_IMODE(old) & 0o777)
        problem = target_problem(out, probe=False)  # still a regular file or absent
        if problem is not None:
            raise error(f"cannot write {what} to {str(out)!r}: {problem}.")
        os.replace(tmp, out)
    except OSError as exc:
        raise error(f"cannot write {what} to {str(out)!r}: {exc.strerror or exc}.") from None
    finally:
        try:
            os.unlink(tmp)  # gone after the rename; left after a failure
        except OSError:
            pass
    return out


def _regular_mode(path: Path) -> int | None:
    """The mode of the regular file at ``path``; None when there is none (absent, or
    something else: refused by the check that follows)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return mode if stat.S_ISREG(mode) else None


def write_text(path: Any, text: str, what: str, error: type[AmpError] = OutputPathError) -> Path:
    """:func:`write_file` of ``text`` encoded as UTF-8."""
    data = text.encode("utf-8")
    return write_file(path, lambda f: f.write(data), what, error)


def read_file(path: Any, what: str, error: type[AmpError], limit: int = DEFAULT_READ_LIMIT) -> bytes:
    """The bytes of the regular file ``path`` (symlinks to one are followed), at most
    ``limit`` bytes; ``error`` for a missing, special (FIFO, device, folder), larger or
    unreadable file. Never blocks on a FIFO."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise error(f"{what}: expected a file path (str or os.PathLike), got {type(path).__name__} {path!r:.60}.")
    name = os.fsdecode(os.fspath(path))
    if "\0" in name:
        raise error(f"cannot read {what} {name!r}: the name holds a NUL character.")
    try:
        kind = _kind(os.stat(name).st_mode)
    except FileNotFoundError:
        raise error(f"cannot read {what} {name!r}: no such file.") from None
    except OSError as exc:
        raise error(f"cannot read {what} {name!r}: {exc.strerror or exc}.") from None
    if kind is not None:
        raise error(f"cannot read {what} {name!r}: it is {kind}, not a regular file.")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"cannot read {what} {name!r}: no such file.") from None
    except OSError as exc:
        raise error(f"cannot read {what} {name!r}: {exc.strerror or exc}.") from None
    try:
        kind = _kind(os.fstat(fd).st_mode)  # what was opened, not what was looked at
        if kind is not None:
            raise error(f"cannot read {what} {name!r}: it is {kind}, not a regular file.")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise error(f"cannot read {what} {name!r}: it is larger than {limit} bytes; it is not a file ampkit wrote.")
    except OSError as exc:
        raise error(f"cannot read {what} {name!r}: {exc.strerror or exc}.") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_json(path: Any, what: str, error: type[AmpError], limit: int = DEFAULT_READ_LIMIT) -> Any:
    """:func:`read_file`, decoded as UTF-8 JSON; ``error`` for anything that is not
    (binary data, truncated or nested past the recursion limit)."""
    data = read_file(path, what, error, limit)
    name = os.fspath(path)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise error(f"{what} {name!r} is not text (not UTF-8); it is not a file ampkit wrote.") from None
    except RecursionError:
        raise error(f"{what} {name!r} is nested too deeply to be a file ampkit wrote.") from None
    except ValueError as exc:
        raise error(f"{what} {name!r} is not JSON ({exc}); is it truncated? Write it again.") from None
