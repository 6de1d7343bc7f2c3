"""ampkit's checkpoint files for the integrations. Reading: ``torch.load`` with
``weights_only=True`` only (tensors, containers and primitives: a file can never run
code), of a regular file no larger than the state it can hold (a FIFO would block,
``/dev/zero`` never ends, a folder is no file), every way a file can be unreadable turned
into the integration's own error; the state read checked against ampkit's session before
anything is loaded (:func:`prepare_state_load`). Writing: through ampkit's safe writer
(:func:`write_checkpoint_file`)."""

from __future__ import annotations

import os
import pickle
import stat
import zipfile
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ampkit._internal.files import write_file
from ampkit.errors import AmpError
from ampkit.trainer.session import prepare_load_state_dict

__all__ = [
    "checkpoint_file_present",
    "checkpoint_read_limit",
    "checkpoint_what",
    "prepare_state_load",
    "read_checkpoint_file",
    "write_checkpoint_file",
]

#: What a checkpoint file of ampkit's may hold beyond its tensors' data: scalers,
#: counters, fp8 histories, the zip's headers.
_SLACK_BYTES = 64 << 20
#: Per element of the tensors the state belongs to: an fp32 master (4 bytes), a 16-bit
#: weight (2) and compensation (2 or 4), twice over.
_BYTES_PER_ELEMENT = 16
#: Per tensor: the zip record's header and alignment padding.
_BYTES_PER_TENSOR = 4096


def checkpoint_read_limit(tensors: Iterable[torch.Tensor]) -> int:
    """The most bytes a checkpoint file of ampkit's state for ``tensors`` (a model's
    parameters and buffers, an optimizer's parameters) can take: a bound on what
    :func:`read_checkpoint_file` reads, generous enough for every level."""
    total = _SLACK_BYTES
    for t in tensors:
        total += _BYTES_PER_ELEMENT * t.numel() + _BYTES_PER_TENSOR
    return total


def checkpoint_file_present(path: str | os.PathLike[str]) -> bool:
    """Whether anything has the name ``path``: a regular file, and also a FIFO, a
    folder, a device or a link (dangling too), which :func:`read_checkpoint_file` then
    refuses; False only where the name is free (a checkpoint saved without the file)."""
    return os.path.lexists(path)


def _not_regular(mode: int) -> str | None:
    """What a file that is not a regular one is (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    for test, kind in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def read_checkpoint_file(
    path: str | os.PathLike[str], error: type[AmpError], map_location: Any = "cpu", limit: int | None = None
) -> Any:
    """``torch.load(weights_only=True)`` of the regular file ``path`` (a link to one is
    followed). A missing file, one that is not a regular file (a FIFO, a device such as
    ``/dev/zero``, a folder, a link to one of those), one larger than ``limit`` bytes
    (:func:`checkpoint_read_limit`), a truncated, empty or not weights-only file: each
    raises ``error`` naming the path and the cause (nothing of the checkpoint has been
    loaded by then)."""
    name = os.fspath(path)
    try:
        kind = _not_regular(os.stat(name).st_mode)
        fd = None if kind is not None else os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        dangling = os.path.islink(name)
        raise error(
            f"{name} does not exist{' (a symbolic link to a missing file)' if dangling else ''}."
        ) from None
    except OSError as exc:
        raise error(f"{name} cannot be opened ({exc.strerror or exc}).") from None
    if fd is None:
        raise _not_regular_error(name, kind, error)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())  # what was opened, not what was looked at
        kind = _not_regular(info.st_mode)
        if kind is not None:
            raise _not_regular_error(name, kind, error)
        if limit is not None and info.st_size > limit:
            raise error(
                f"{name} is {info.st_size} bytes, more than the {limit} bytes ampkit's state of this run "
                "can take: it is not a file ampkit wrote for this model. Nothing was loaded; resume from "
                "another checkpoint."
            )
        return _load(f, name, error, map_location)


def _not_regular_error(name: str, kind: str, error: type[AmpError]) -> AmpError:
    return error(
        f"{name} is {kind}, not a regular file; ampkit writes its checkpoint files as regular files, "
        "so this one was put there by something else. Nothing was loaded; remove it (the resume then "
        "starts ampkit's state afresh, not bit for bit) or resume from another checkpoint."
    )


def _load(f: Any, name: str, error: type[AmpError], map_location: Any) -> Any:
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise error(
            f"{name} cannot be read as weights only (torch.load(weights_only=True)): {first}. "
            "ampkit never unpickles its files fully: a file that needs it was not written by ampkit, "
            "or was tampered with."
        ) from None
    except (OSError, EOFError, RuntimeError, ValueError, zipfile.BadZipFile, KeyError, NotImplementedError) as exc:
        raise error(
            f"{name} is not a readable checkpoint file ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'truncated or empty'}); "
            "it may be truncated (an interrupted save) or another file. Resume from an earlier checkpoint."
        ) from None


def checkpoint_what(path: str | os.PathLike[str]) -> str:
    """How messages name the checkpoint file ``path`` of ampkit's state."""
    return f"ampkit's checkpoint state ({os.path.basename(os.fspath(path))})"


def write_checkpoint_file(path: str | os.PathLike[str], state: Any, error: type[AmpError]) -> None:
    """``torch.save(state)`` to ``path`` through ampkit's safe writer: replaced whole, never
    written through a link; a symlink, FIFO or folder at ``path`` raises ``error``."""
    write_file(path, lambda f: torch.save(state, f), checkpoint_what(path), error)


def prepare_state_load(saved: Any, path: str | os.PathLike[str], error: type[AmpError]) -> Callable[[], None]:
    """:func:`ampkit.state_dict`'s output ``saved`` (read from ``path``) checked against
    the session, nothing changed; the function that loads it. A state that does not fit
    raises ``error`` naming ``path``."""
    try:
        return prepare_load_state_dict(saved)
    except AmpError as exc:
        raise error(f"{os.fspath(path)}: {exc}") from None
