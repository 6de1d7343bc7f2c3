"""The managed optimizer step: :func:`init_trainer`, :func:`scale_loss`,
:func:`unscale`, :func:`step_skipped`, :func:`ampkit.stats`, the skip decision, the session
state dict, scheduler holds and the fused steps. Above :mod:`ampkit.scaling`; below
the levels (:mod:`ampkit.levels`), which extend a step through
:mod:`ampkit.trainer.extensions`.
"""

from __future__ import annotations

from .api import (
    ManagedOptimizer,
    StepStats,
    init_trainer,
    managed_state,
    release,
    scale_loss,
    step_skipped,
    unscale,
)
from .extensions import StepExtension, add_global_extension, remove_global_extension
from .grad_scaler import GradScaler
from .session import current_session, load_state_dict, register_extra_state, state_dict
from .step_grads import StepStage

__all__ = [
    "GradScaler", "ManagedOptimizer", "StepExtension", "StepStage", "StepStats", "add_global_extension",
    "current_session", "init_trainer", "load_state_dict", "managed_state", "register_extra_state", "release",
    "remove_global_extension", "scale_loss", "state_dict", "step_skipped", "unscale",
]  # fmt: skip
# ``ampkit.trainer.stats`` is the module (skip logging, the step counters); the function
# is ``ampkit.stats``
