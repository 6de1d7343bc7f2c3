"""Which dtype each op runs in: the policy (:class:`Policy`), the op lists, the engine
that applies them (:func:`autocast`, :func:`init`) and :func:`explain`.

The lowest layer of ampkit above :mod:`ampkit._internal`: it knows nothing of loss
scaling, optimizers or how weights are stored."""

from __future__ import annotations

from .engine import (
    active_scopes,
    autocast,
    checkpoint_context,
    current_policy,
    init,
    is_active,
    release_kernels,
)
from .explanation import ExplainError, ExplainReport, explain
from .policy import Policy, canonical_op, default_policy

__all__ = [
    "ExplainError",
    "ExplainReport",
    "Policy",
    "active_scopes",
    "autocast",
    "canonical_op",
    "checkpoint_context",
    "current_policy",
    "default_policy",
    "explain",
    "init",
    "is_active",
    "release_kernels",
]
