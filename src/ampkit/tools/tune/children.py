"""The child processes of ``ampkit tune script.py``: each run of the script in a process
group of its own, its output in a log file, bounded in time (:class:`ampkit.AmpError`
naming the run when it goes past its bound), and nothing of it left running when it
ends (processes the script forked included)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ampkit.errors import AmpError

__all__ = ["run_bounded", "last_words"]

#: How often a running child is looked at, in seconds.
POLL_S = 0.05
#: The most of a child's log read back for a message, in bytes.
TAIL_BYTES = 4096


def run_bounded(cmd: Sequence[str], log: Path, timeout: float, what: str, then: tuple[Path, float, str] | None = None,
                watch: Callable[[], None] | None = None) -> int:  # fmt: skip
    """Run ``cmd`` (stdin empty, stdout and stderr to ``log``) and return its exit code.
    Past ``timeout`` seconds it is stopped, with every process it started, and
    :class:`ampkit.AmpError` says that ``what`` ran too long. With ``then``
    ``(marker, seconds, what next)``, once the file ``marker`` exists the bound becomes
    ``seconds`` from then, for ``what next``. ``watch`` is called every ``POLL_S``
    seconds while the child runs, and once after it ends."""
    with open(log, "xb") as out:  # a new file in the tuner's own folder
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=os.name == "posix")  # fmt: skip
    try:
        deadline, bound = time.monotonic() + timeout, timeout
        while proc.poll() is None:
            if then is not None and then[0].exists():
                bound, what = then[1], then[2]
                deadline, then = time.monotonic() + bound, None
            if time.monotonic() > deadline:
                raise AmpError(f"{what} ran past its time limit of {bound:g} s and was stopped; give it longer "
                               "with --timeout (timeout= in Python) if it needs it.")  # fmt: skip
            if watch is not None:
                watch()
            time.sleep(POLL_S)
        if watch is not None:
            watch()
        return proc.returncode
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """End ``proc`` and its process group (what the script forked or left running)."""
    if os.name == "posix":
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone already
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def last_words(log: Path) -> str:
    """What a child said last in ``log``: the exception of its last traceback, else its
    last line (``""`` for none)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            lines = [line.rstrip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    after = lines[starts[-1] + 1:] if starts else []
    words = next((line for line in after if not line[:1].isspace()), lines[-1] if lines else "")
    return words if len(words) <= 300 else f"{words[:297]}..."
