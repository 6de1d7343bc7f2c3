"""ampkit: automatic mixed precision for PyTorch.

Quick start::

    import ampkit as amp
    amp.init()                       # op-level casting, default lists
    amp.init_trainer(opt)            # loss scaler + step skipping on overflow
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
"""

from __future__ import annotations

from ._reset import reset
from .errors import (
    AmpError,
    DistributedError,
    NumericsError,
    PolicyError,
    ScalerError,
    StateError,
)

__version__ = "0.1.0"

__all__ = [
    "AmpError",
    "DistributedError",
    "NumericsError",
    "PolicyError",
    "ScalerError",
    "StateError",
    "reset",
]

# --- casting engine (policy, lists, autocast, init/reset, explain) ---
from .casting import autocast, current_policy, init, is_active  # noqa: E402
from .explain import ExplainReport, explain  # noqa: E402
from .policy import Policy, canonical_op, default_policy  # noqa: E402

__all__ += [
    "ExplainReport",
    "Policy",
    "autocast",
    "canonical_op",
    "current_policy",
    "default_policy",
    "explain",
    "init",
    "is_active",
]
# --- loss scaling and optimizer integration ---
# --- opt levels, master weights, compensated updates ---
