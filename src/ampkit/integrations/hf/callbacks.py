"""The Trainer callbacks of the HF integration (:mod:`ampkit.integrations.hf`): ampkit's
skipped steps reported to Accelerate, and a DDP model announced to
:func:`ampkit.distributed.register_ddp` once Accelerate wrapped it."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

from ampkit import step_skipped
from ampkit.distributed import register_ddp
from ampkit.errors import AmpError

from .. import require
from .arguments import HfIntegrationError
from .weights import _raw_optimizer

require("transformers", "hf")
accelerate = require("accelerate", "hf")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

if TYPE_CHECKING:
    from .trainer import AmpkitTrainerMixin

__all__ = ["AmpkitSkipSignal"]


class AmpkitSkipSignal(TrainerCallback):
    """After each optimizer step, tells Accelerate whether ampkit skipped it: the
    ``AcceleratedOptimizer``'s ``step_was_skipped`` (which HF reads through
    ``accelerator.optimizer_step_was_skipped`` before stepping its LR scheduler) is set
    to :func:`ampkit.step_skipped` of the optimizer inside. Added by
    :class:`AmpkitTrainerMixin` when it sets ampkit up; keep it in the callbacks."""

    def on_optimizer_step(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        _report_skip(kwargs.get("optimizer"))


def _report_skip(optimizer: Any) -> bool | None:
    """Set ``optimizer``'s (an ``AcceleratedOptimizer``) skip flag to ampkit's verdict on
    the step just taken; returns that verdict (None when ampkit does not manage it)."""
    if not isinstance(optimizer, AcceleratedOptimizer):
        return None
    raw = _raw_optimizer(optimizer)
    try:
        skipped = step_skipped(raw)
    except AmpError:
        return None  # not an optimizer of the current ampkit session
    optimizer._is_overflow = skipped  # the flag Accelerate's own GradScaler path sets
    if optimizer.step_was_skipped is not skipped:
        raise HfIntegrationError(
            f"accelerate {accelerate.__version__}'s AcceleratedOptimizer no longer reports its "
            "skip flag through _is_overflow, so HF would step its LR scheduler on steps ampkit "
            "skipped; use the accelerate version ampkit[hf] pins."
        )
    return skipped


class _RegisterDDP(TrainerCallback):
    """At ``on_train_begin`` (after Accelerate has wrapped the model): a
    ``DistributedDataParallel`` model is announced with
    :func:`ampkit.distributed.register_ddp` (rank 0's O2 masters broadcast)."""

    def __init__(self, trainer: AmpkitTrainerMixin) -> None:
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        wrapped = getattr(trainer, "model_wrapped", None)
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            register_ddp(wrapped)
