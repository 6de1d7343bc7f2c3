"""The budget search: the fewest modules kept in fp32 that meet an accuracy
:class:`~.measure.Budget` (rank by isolated error, bisect the ranking, then drop each
kept module that is not needed; see :mod:`ampkit.inference.conversion`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .errors import ConversionError
from .measure import Budget, OutputError, _outputs, output_error
from .plan import _build


class _Search:
    """Runs candidate models on the calibration batches against the fp32 outputs."""

    def __init__(
        self,
        ref: nn.Module,
        make_plan: Any,
        calib: Sequence[Any],
        reference: list[Any],
        output_dtype: torch.dtype | None,
        device_type: str,
    ) -> None:
        self.ref, self.make_plan, self.calib, self.reference = ref, make_plan, calib, reference
        self.output_dtype, self.device_type = output_dtype, device_type
        self.evaluations = 0
        self._cache: dict[frozenset[str], OutputError] = {}

    def error(self, fp32: Iterable[str]) -> OutputError:
        key = frozenset(fp32)
        if key not in self._cache:
            forced = {n: (torch.float32, "budget") for n in fp32}
            plan = self.make_plan(forced)
            model = _build(self.ref, plan, self.output_dtype)
            self.evaluations += 1
            self._cache[key] = output_error(self.reference, _outputs(model, self.calib, self.device_type))
        return self._cache[key]


def _search_budget(
    search: _Search, candidates: list[str], budget: Budget
) -> tuple[list[str], dict[str, float], dict[str, str], OutputError]:
    """The fp32 set (see the module docstring), the isolated error per candidate, a
    sentence per kept module, and the error with nothing kept."""
    base = search.error([])
    if budget.met_by(base) or not candidates:
        if not budget.met_by(base):
            raise ConversionError(
                f"the budget ({budget}) is not met ({base}) and no module is left to keep in fp32; "
                "loosen the budget or widen candidates."
            )
        return [], {}, {}, base
    everything = search.error(candidates)
    if not budget.met_by(everything):
        raise ConversionError(
            f"the budget ({budget}) cannot be met even with every candidate module in fp32 "
            f"({everything}); loosen the budget, turn off fold_bn, or check the calibration data."
        )
    isolated: dict[str, float] = {}
    for c in candidates:
        isolated[c] = search.error([n for n in candidates if n != c]).rel_error
    order = sorted(candidates, key=lambda c: (-_sort_key(isolated[c]), candidates.index(c)))
    lo, hi = 0, len(order)  # budget fails with order[:lo] kept (lo=0 checked), holds with order[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if budget.met_by(search.error(order[:mid])):
            hi = mid
        else:
            lo = mid
    kept = list(order[:hi])
    details: dict[str, str] = {}
    for c in reversed(list(kept)):  # least sensitive first
        trial = [n for n in kept if n != c]
        err = search.error(trial)
        if budget.met_by(err):
            kept = trial
        else:
            details[c] = (
                f"alone in 16 bits: rel error {isolated[c]:.3g}; converting it too would give {err}"
            )
    return kept, isolated, details, base


def _sort_key(x: float) -> float:
    return math.inf if math.isnan(x) else x
