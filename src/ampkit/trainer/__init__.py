"""The managed optimizer step: :func:`init_trainer`, :func:`scale_loss`,
:func:`unscale`, :func:`step_skipped`, :func:`stats`, the skip decision, the session
state dict, scheduler holds and the fused steps. Above :mod:`ampkit.scaling`; below
the levels (:mod:`ampkit.levels`), which extend a step through
:mod:`ampkit.trainer.extensions`.

Names resolve on first use (``ampkit.trainer.init_trainer``), so importing one module
of the package does not import the rest."""

from __future__ import annotations

from ampkit._internal.lazy import lazy_exports

_EXPORTS = {
    "ManagedOptimizer": "api", "StepStats": "api", "init_trainer": "api", "scale_loss": "api",
    "unscale": "api", "step_skipped": "api", "stats": "api", "managed_state": "api", "release": "api",
    "GradScaler": "grad_scaler", "current_session": "session", "register_extra_state": "session",
    "state_dict": "session", "load_state_dict": "session",
    "StepExtension": "extensions", "add_global_extension": "extensions",
    "remove_global_extension": "extensions", "StepStage": "step_grads",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
