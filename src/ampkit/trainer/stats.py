"""What a managed optimizer reports: its counters (:class:`StepStats`) and the log
lines of skipped steps (:class:`SkipReport`)."""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ampkit._internal.dist import is_rank_zero
from ampkit._internal.where import user_stacklevel

if TYPE_CHECKING:
    from .managed import ManagedOptimizer

__all__ = ["StepStats", "SkipReport", "SKIP_SUMMARY_SECONDS", "flush_skip_reports"]


@dataclass(frozen=True)
class StepStats:
    """Counters of one managed optimizer, as returned by :func:`stats`.

    Attributes:
        steps: calls to ``optimizer.step()`` since ``init_trainer`` (taken or skipped).
        skipped: steps skipped because grads were inf/NaN.
        last_skipped: whether the most recent step was skipped.
        scales: current scale of each loss's scaler, by ``loss_id``.
        overflows: overflow events seen by each loss's scaler, by ``loss_id``.
    """

    steps: int
    skipped: int
    last_skipped: bool
    scales: tuple[float, ...]
    overflows: tuple[int, ...]

    @property
    def taken(self) -> int:
        """Steps that updated the parameters."""
        return self.steps - self.skipped


#: Skipped steps after the first are reported at most this often (seconds).
SKIP_SUMMARY_SECONDS = 60.0

_LOG = logging.getLogger("ampkit")
# Module state: reports holding skips no line has told yet, with their optimizer's state
# (both weakly): flush_skip_reports tells them (at interpreter exit).
_UNTOLD: weakref.WeakKeyDictionary[SkipReport, weakref.ref[ManagedOptimizer]] = weakref.WeakKeyDictionary()


def flush_skip_reports() -> None:
    """Log the skipped steps each live report has counted but not told yet (the summary
    line is at most every :data:`SKIP_SUMMARY_SECONDS`: a run that ends sooner would
    never say them)."""
    for report, ref in list(_UNTOLD.items()):
        state = ref()
        if state is not None and report.pending:
            report.summarize(state, "until the end")
        _UNTOLD.pop(report, None)


class SkipReport:
    """Skipped steps on the ``ampkit`` logger at WARNING, rank 0 only (one report per
    ``init_trainer`` call): the first skip at once, later ones as a count at most every
    :data:`SKIP_SUMMARY_SECONDS`, never one line per step. Points at the user's line."""

    def __init__(self) -> None:
        self.first_done = False
        self.pending = 0
        self.last = 0.0

    def note(self, state: ManagedOptimizer, skipped: bool) -> None:
        if skipped and not self.first_done:
            self.first_done = True
            self.last = time.monotonic()
            self._emit(
                "ampkit: optimizer step %d skipped: inf/NaN gradients; loss scale now %s. "
                "Later skips are summarized at most every %g s.",
                state.steps, _scales(state), SKIP_SUMMARY_SECONDS,
            )
            return
        if skipped:
            self.pending += 1
            _UNTOLD[self] = weakref.ref(state)
        if self.pending and time.monotonic() - self.last >= SKIP_SUMMARY_SECONDS:
            self.summarize(state, "in the last %.0f s" % (time.monotonic() - self.last))

    def summarize(self, state: ManagedOptimizer, when: str) -> None:
        """Log the count of skips not told yet (``when``: the span they fall in)."""
        count, self.pending, self.last = self.pending, 0, time.monotonic()
        _UNTOLD.pop(self, None)
        self._emit(
            "ampkit: %d more optimizer step(s) skipped %s (%d of %d steps so far); loss scale now %s.",
            count, when, state.skipped, state.steps, _scales(state),
        )

    @staticmethod
    def _emit(msg: str, *args: Any) -> None:
        if _LOG.isEnabledFor(logging.WARNING) and is_rank_zero():
            _LOG.warning(msg, *args, stacklevel=user_stacklevel())


def _scales(state: ManagedOptimizer) -> str:
    return ", ".join(f"{s.scale:g}" for s in state.scalers)
