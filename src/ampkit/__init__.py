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

from .errors import (
    AmpError,
    DistributedError,
    NumericsError,
    PolicyError,
    ScalerError,
    StateError,
)

from ._reset import reset

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
# --- loss scaling and optimizer integration ---
# --- opt levels, master weights, compensated updates ---
