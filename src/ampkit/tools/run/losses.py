"""The losses of a run: :class:`_LossSeries`."""

from __future__ import annotations

from typing import Any

import torch


class _LossSeries:
    """The value of each one-element tensor ``backward()`` is called on, one series
    per call site (``file:line``) in :attr:`series` (Python floats). A loss the script's
    own GradScaler scaled is recorded unscaled. Values stay on their device until 64
    are pending (one transfer for them all) or :meth:`flush`."""

    def __init__(self) -> None:
        self.series: dict[str, list[float]] = {}
        self._pending: list[tuple[str, torch.Tensor]] = []

    def record(self, site: str, loss: torch.Tensor, scaler: Any = None) -> None:
        """Record ``loss`` for ``site``; ``scaler``: the script's GradScaler, or None."""
        value = loss.detach().reshape(())
        if scaler is not None and scaler.is_enabled():  # the script's GradScaler scaled it
            value = value.float() / scaler.get_scale()
        self._pending.append((site, value))
        if len(self._pending) >= 64:
            self.flush()

    def flush(self) -> None:
        """Move the pending values into :attr:`series`."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        values = torch.stack([t.float().cpu() for _, t in pending]).tolist()
        for (site, _), v in zip(pending, values):
            self.series.setdefault(site, []).append(float(v))
