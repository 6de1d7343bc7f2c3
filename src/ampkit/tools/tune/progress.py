"""What the tuner is doing while it works: a line when each stage begins (what it
measures, how many, and how it goes about it), a status line whenever the tuner has been
quiet for ``HEARTBEAT_S`` seconds while a stage goes on (how many done, the time so far,
an estimate of what is left, and what is being measured now, for how long), and a line
when the stage ends. A watcher thread writes the status lines, so that one long
measurement (a large module, a probe run, a child process) is not a silent wait.

Where the lines go (``progress=`` of :func:`ampkit.tune`):

- ``None`` (the default; ``ampkit._internal.inform``): the ``"ampkit"``
  logger at INFO where the application configured logging (shown where that shows
  INFO), else on stderr through logging's last-resort handler; where neither shows
  them, nothing at all (no thread is started).
- ``True``: the stream (stderr by default): a ``rich`` progress bar where rich is
  installed and the stream is a terminal, plain lines otherwise; nothing is logged.
- ``False``: nowhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

from ampkit._internal.inform import inform, shows
from ampkit.errors import AmpError

__all__ = ["HEARTBEAT_S", "TICK_S", "Progress", "check_progress", "count", "monotonic"]

#: The most seconds without a progress line while a stage goes on.
HEARTBEAT_S = 5.0
#: How often, in seconds, the watcher thread looks at the clock.
TICK_S = 0.25
#: The clock of the stage times and of the watcher (a module name: tests stand in for it).
monotonic = time.monotonic


def check_progress(progress: Any) -> None:
    """Raise :class:`ampkit.AmpError` unless ``progress`` is True, False or None."""
    if progress is not None and not isinstance(progress, bool):
        raise AmpError(f"progress {progress!r}: True (lines on stderr), False (none) or None (the 'ampkit' "
                       "logger at INFO, on stderr where logging is not configured).")  # fmt: skip


def count(n: int, unit: str) -> str:
    """``"3 modules"``, ``"1 module"``, ``"1 batch"`` (``unit`` a plural)."""
    if n == 1:
        unit = unit[:-2] if unit.endswith("ches") else unit[:-1] if unit.endswith("s") else unit
    return f"{n} {unit}"


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


@dataclasses.dataclass
class _Stage:
    label: str
    total: int | None
    unit: str
    start: float
    done: int = 0
    last: float = 0.0  # when the last unit was done
    now: str = ""
    since: float = 0.0
    task: Any = None  # rich's task id

    def left(self, total: int, at: float) -> float:
        """The seconds left: the units not done at the mean time of those done, less the
        time the one going on has run (at least the units after it, at that mean)."""
        mean = (self.last - self.start) / self.done
        return max(mean * (total - self.done) - (at - self.last), mean * (total - self.done - 1))

    def shown_total(self) -> int | None:
        """The total, or more where more have run or started (an estimate fell short)."""
        return None if self.total is None else max(self.total, self.done + (1 if self.now else 0))

    def status(self, at: float) -> str:
        """``label: 3/7 runs, 12 s so far, about 16 s left; now X (for 4.0 s)``."""
        took = at - self.start
        parts = []
        total = self.shown_total()
        if total is not None:
            parts.append(f"{self.done}/{total} {self.unit}")
        elif self.unit:
            parts.append(f"{count(self.done, self.unit)} done")
        parts.append(f"{_seconds(took)} so far")
        if total is not None:
            parts.append(f"about {_seconds(self.left(total, at))} left" if self.done
                         else "no estimate before the first is done")  # fmt: skip
        now = f"; now {self.now} (for {_seconds(at - self.since)})" if self.now else ""
        return f"{self.label}: {', '.join(parts)}{now}"


class Progress:
    """Progress lines of one tuning (see the module docstring); a context manager that
    starts and stops the watcher thread (and rich's bar). ``name`` prefixes each line
    (``"ampkit.tune"``); ``stream`` stands in for stderr where ``show`` is True."""

    def __init__(self, show: bool | None, name: str = "ampkit.tune", stream: IO[str] | None = None) -> None:
        check_progress(show)
        self.name = name
        self.on = show is True or (show is None and shows())
        self._log = show is None
        self._stream = (stream if stream is not None else sys.stderr) if show else None
        self._lock = threading.RLock()
        self._stage: _Stage | None = None
        self._last = 0.0
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._bar: Any = None
        if show and getattr(self._stream, "isatty", lambda: False)():
            self._bar = _rich_bar(self._stream)

    def __enter__(self) -> Progress:
        if self.on:
            self._last = monotonic()
            if self._bar is not None:
                self._bar.start()
            self._watcher = threading.Thread(target=self._watch, name="ampkit-tune-progress", daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        try:
            if self._stage is not None:
                self.end(failed=exc)
        finally:
            self._stop.set()
            if self._watcher is not None:
                self._watcher.join()
            if self._bar is not None:
                self._bar.stop()

    # --- what the tuner says ---------------------------------------------------------------
    def begin(self, label: str, detail: str, total: int | None = None, unit: str = "") -> None:
        """A stage begins (the one going on ends first): says ``label: detail``."""
        if not self.on:
            return
        with self._lock:
            if self._stage is not None:
                self.end()
            at = monotonic()
            self._stage = _Stage(label, total, unit, at, last=at)
            if self._bar is not None:
                self._stage.task = self._bar.add_task(label, total=total, now="")
            self._say(f"{label}: {detail}")

    def end(self, failed: BaseException | None = None) -> None:
        """The stage going on ends: says how long it took (and how many were done)."""
        if not self.on or self._stage is None:
            return
        with self._lock:
            stage, self._stage = self._stage, None
            took = _seconds(monotonic() - stage.start)
            done = "" if stage.total is None else f" ({stage.done} of {count(stage.total, stage.unit)})"
            if stage.total is not None and stage.done >= stage.total:
                done = f" ({count(stage.done, stage.unit)})"
            if failed is not None:
                self._say(f"{stage.label}: stopped after {took}{done}: {type(failed).__name__}")
            else:
                self._say(f"{stage.label}: done in {took}{done}")
            if self._bar is not None:
                self._bar.update(stage.task, completed=stage.done, total=stage.done if failed is None else stage.total,
                                 now="")  # fmt: skip

    @contextlib.contextmanager
    def stage(self, label: str, detail: str, total: int | None = None, unit: str = "") -> Iterator[Progress]:
        """:meth:`begin` on entry, :meth:`end` on exit (saying so where it raised)."""
        self.begin(label, detail, total, unit)
        try:
            yield self
        except BaseException as exc:
            self.end(failed=exc)
            raise
        self.end()

    def now(self, what: str) -> None:
        """What the stage measures from now on (named by the status lines)."""
        if self.on and self._stage is not None:
            with self._lock:
                self._stage.now, self._stage.since = what, monotonic()
                if self._bar is not None:
                    self._bar.update(self._stage.task, total=self._stage.shown_total(), now=what)

    def advance(self, n: int = 1) -> None:
        """``n`` more of the stage's units are done."""
        if self.on and self._stage is not None:
            with self._lock:
                self._stage.done += n
                self._stage.last = monotonic()
                self._stage.now = ""
                if self._bar is not None:
                    self._bar.update(self._stage.task, completed=self._stage.done, total=self._stage.shown_total(),
                                     now="")  # fmt: skip

    def relay(self, line: str) -> None:
        """A line said by another process (``ampkit tune script.py``'s capture), as is."""
        if self.on and line.strip():
            self._say(line.rstrip())

    # --- where it goes ---------------------------------------------------------------------
    def _say(self, text: str) -> None:
        with self._lock:
            self._last = monotonic()
            line = f"{self.name}: {text}" if self.name else text
            if self._log:
                inform("%s", line)
            elif self._bar is not None:
                self._bar.console.print(line, markup=False, highlight=False)
            else:
                try:
                    self._stream.write(line + "\n")
                    self._stream.flush()
                except (OSError, ValueError):  # a closed stream: the tuning goes on
                    pass

    def _watch(self) -> None:
        while not self._stop.wait(TICK_S):
            self._beat()

    def _beat(self) -> None:
        with self._lock:
            at = monotonic()
            if self._stage is not None and at - self._last >= HEARTBEAT_S:
                if self._bar is None:
                    self._say(self._stage.status(at))
                else:  # the bar shows the counts and times; its refresh is the heartbeat
                    self._last = at


def _rich_bar(stream: IO[str]) -> Any:
    """A rich progress bar on ``stream``; None where rich is not installed."""
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
    except ImportError:
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("elapsed,"), TimeRemainingColumn(), TextColumn("left"), TextColumn("{task.fields[now]}"),
                    console=Console(file=stream), refresh_per_second=4, transient=False)  # fmt: skip
