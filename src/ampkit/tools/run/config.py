"""What ``ampkit run`` is asked to apply (:class:`RunConfig`) and how a run stops
early (:class:`RunRefused`, :class:`ScriptError`, and the two BaseExceptions that carry
a refusal or the step limit out of the script)."""

from __future__ import annotations

import dataclasses

import torch

from ampkit._internal.dtypes import DTYPES_BY_NAME
from ampkit._internal.script import ScriptError
from ampkit.errors import AmpError
from ampkit.levels.opt_level import OPT_LEVELS, checked_plan, level_choices, level_names
from ampkit.levels.precision_plan import TunePlan

__all__ = ["FP32", "RunConfig", "RunRefused", "ScriptError", "run_levels"]

#: The level of ``ampkit run`` that applies nothing, only observes (the ``--compare`` reference).
FP32 = "fp32"


def run_levels() -> tuple[str, ...]:
    """The levels ``ampkit run`` applies: those whose ops run under a casting policy (a
    script's own fp32 code stays fp32 where the policy says), then ``fp32``."""
    return (*level_names(lambda d: d.mixed), FP32)


def casts_model(level: str) -> bool:
    """Whether ``ampkit run`` sets the optimizer up with the models it trains at ``level``
    (the level stores the model in 16 bits)."""
    return level in OPT_LEVELS and OPT_LEVELS[level].casts_model


class RunRefused(AmpError):
    """``ampkit run`` cannot apply the requested precision exactly to this script (e.g.
    fp16 loss scaling for a manual ``p.data`` update): the run stops, one line, exit 2."""


class _Refusal(BaseException):
    """Carries a :class:`RunRefused` out of the script (a BaseException, so a script's
    ``except Exception`` around its loop cannot swallow it)."""

    def __init__(self, error: RunRefused) -> None:
        super().__init__(str(error))
        self.error = error


class _StopScript(BaseException):
    """Raised after the step that reaches ``max_steps`` or the time budget: ends the
    script cleanly (a BaseException, so the script's ``except Exception`` lets it pass)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What :func:`run_script` applies.

    Attributes:
        level: ``"O1"`` (default; casting inside module forwards, fp32 weights),
            ``"O2"`` (16-bit models with fp32 masters), ``"O2K"`` (bf16 models with
            compensated updates) or ``"fp32"`` (nothing applied, observation only).
        dtype: ``"bf16"`` (default) or ``"fp16"``; O2K is bf16 only.
        max_steps: end the script after this many iterations (None: run it whole).
        time_budget: end the script at the first iteration after this many seconds.
        plan: a :class:`ampkit.TunePlan` whose module choices apply (its kept modules
            pinned to fp32; at O2/O2K also by ``keep_fp32``, and its fp8 linears
            converted, which only O2/O2K do); ``dtype`` must be its dtype.
    """

    level: str = "O1"
    dtype: str = "bf16"
    max_steps: int | None = None
    time_budget: float | None = None
    plan: TunePlan | None = None

    def __post_init__(self) -> None:
        if self.level not in run_levels():
            raise AmpError(f"unknown level {self.level!r}; choose one of {FP32} (nothing applied), "
                           f"{level_choices(run_levels()[:-1])}.")  # fmt: skip
        if self.dtype not in ("bf16", "fp16"):
            raise AmpError(f"unknown dtype {self.dtype!r}; choose bf16 or fp16.")
        if self.level != FP32 and OPT_LEVELS[self.level].bf16_only and self.dtype != "bf16":
            raise AmpError(f"{self.level} ({OPT_LEVELS[self.level].description}) is bf16 only; use --dtype bf16 "
                           "or another level.")  # fmt: skip
        if self.max_steps is not None and self.max_steps < 1:
            raise AmpError(f"max_steps must be at least 1, got {self.max_steps}.")
        if self.time_budget is not None and not self.time_budget > 0:
            raise AmpError(f"time_budget must be a positive number of seconds, got {self.time_budget}.")
        if self.plan is not None:
            if not isinstance(self.plan, TunePlan):
                raise AmpError(f"plan must be an ampkit.TunePlan, got {type(self.plan).__name__}.")
            checked_plan(self.plan)
            if self.plan.lowered and self.plan.dtype != self.dtype and self.level != FP32:
                raise AmpError(f"the plan lowers modules to {self.plan.dtype}; run it with dtype {self.plan.dtype}.")
            if self.plan.fp8 and not casts_model(self.level):
                raise AmpError(f"the plan runs {len(self.plan.fp8)} linear(s) in fp8; ampkit run converts them where "
                               f"it sets the optimizer up (--level {' or '.join(filter(casts_model, run_levels()))}), not at "
                               f"{self.level}: run with --level O2, or call ampkit.initialize(model, optimizer, "
                               "plan=...) in the script.")  # fmt: skip

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES_BY_NAME[self.dtype]
