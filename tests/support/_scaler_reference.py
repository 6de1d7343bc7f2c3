"""A pure-Python reference model of ampkit's loss-scale state machine, shared by tests."""

from __future__ import annotations

import math

from ampkit.scaling.loss_scaler import to_fp32


class RefScaler:
    """The rules restated the way DeepSpeed's loss scaler counts: iterations and the
    iteration of the last overflow instead of a growth tracker. Returns "floor" or
    "skips" from ``event`` when the real scaler must raise NumericsError."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.scale = to_fp32(cfg["init_scale"])
        self.it = 0
        self.last_overflow = -1
        self.hyst = cfg["hysteresis"]
        self.in_a_row = 0

    def event(self, overflow: bool) -> str | None:
        c = self.cfg
        outcome = None
        if overflow:
            self.in_a_row += 1
            if c["dynamic"]:
                if self.hyst <= 1:
                    if self.scale <= to_fp32(c["min_scale"]):
                        return "floor"
                    self.scale = max(to_fp32(self.scale * c["backoff_factor"]), to_fp32(c["min_scale"]))
                else:
                    self.hyst -= 1
            self.last_overflow = self.it
            limit = c["max_consecutive_skips"]
            if limit is not None and self.in_a_row > limit:
                outcome = "skips"
        else:
            self.in_a_row = 0
            if c["dynamic"]:
                if c["consecutive_hysteresis"]:
                    self.hyst = c["hysteresis"]
                if (self.it - self.last_overflow) % c["growth_interval"] == 0:
                    self.hyst = c["hysteresis"]
                    grown = to_fp32(self.scale * c["growth_factor"])
                    if math.isfinite(grown):
                        self.scale = min(grown, to_fp32(c["max_scale"]))
        self.it += 1
        return outcome

    def tracker(self) -> int:
        return (self.it - self.last_overflow - 1) % self.cfg["growth_interval"]
