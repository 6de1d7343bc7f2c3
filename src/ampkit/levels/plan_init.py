""":func:`ampkit.init`: the process-wide casting switch of :mod:`ampkit.casting`, with a
tuning plan (:class:`~ampkit.TunePlan`) applied. The plan knows opt levels and fp8, so it
lives in this layer, and the switch that takes one sits here with it."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ampkit.casting import engine as casting
from ampkit.casting.policy import Policy
from ampkit.errors import PolicyError

from .precision_plan import PlanError, TunePlan

__all__ = ["init"]


def init(
    dtype: torch.dtype | None = None,
    device_type: str | None = None,
    *,
    policy: Policy | None = None,
    cache_enabled: bool = True,
    plan: TunePlan | str | os.PathLike[str] | None = None,
    model: nn.Module | list[nn.Module] | None = None,
    **policy_fields: Any,
) -> Policy:
    """Turn op-level casting on for this thread until :func:`ampkit.reset`.

    Equivalent to entering ``ampkit.autocast(policy, device_type)`` and never leaving.

    Args:
        dtype: compute dtype; default: the policy's, else the ``AMPKIT_DTYPE``
            environment variable (``bf16``/``fp16``) if set, else bf16 on CPU, fp16 on CUDA.
        device_type: ``"cpu"`` or ``"cuda"``; default ``"cuda"`` if available else ``"cpu"``.
        policy: a base policy (default: the device's defaults).
        cache_enabled: as in :class:`ampkit.autocast`.
        plan (ampkit.TunePlan | str | os.PathLike | None): a plan from
            :func:`ampkit.tune` (or the path of a saved one): its module choices as
            op-level casting (kept modules pinned to fp32 by a module rule added to
            ``policy``), in its dtype. Weights are not cast here whatever the plan's level:
            :func:`ampkit.initialize` applies that. Another ``dtype`` than the plan's, or
            a plan with fp8 linears (converting them is ``initialize``'s), raises
            :class:`ampkit.PlanError`. Its names are matched exactly, never as globs.
            Default: ``None``.
        model (nn.Module | list | None): with ``plan``, the model (or models) it
            applies to: one that lacks a module the plan names is refused
            (:class:`ampkit.PlanError`, before anything changes), and the plan's names
            are relative to it, also when a child of it is called first (as with
            :func:`ampkit.initialize`). Without it a name the model lacks pins nothing.
            Default: ``None``.
        **policy_fields: :class:`ampkit.Policy` fields (``lower_ops``, ``fp32_ops``,
            ``promote_ops``, ``conditional_fp32_ops``, ``module_rules``) applied on top.

    Returns the policy in force. Calling ``init`` again in the thread replaces the
    previous one. Per thread, like ``torch.autocast``: see :func:`ampkit.reset` for
    what is per thread and what per process.
    """
    casting.check_init_dtype(dtype)
    models = _plan_models(plan, model)
    if plan is not None:
        dtype, policy = _with_plan(TunePlan.coerce(plan, "ampkit.init(plan=...)"), models, dtype, policy)
    base = casting.init(dtype, device_type, policy=policy, cache_enabled=cache_enabled, **policy_fields)
    for m in models:  # the plan's names are the model's own
        casting.module_hooks.name_rules_relative_to(m)
    return base


def _plan_models(plan: Any, model: Any) -> list[nn.Module]:
    """``init``'s ``model`` as a list (empty: none); :class:`PlanError` for anything else,
    or a model without a plan."""
    if model is None:
        return []
    models = [model] if isinstance(model, nn.Module) else model
    if plan is None or not isinstance(models, (list, tuple)) or not all(isinstance(m, nn.Module) for m in models):
        raise PlanError("ampkit.init(model=...) takes the nn.Module (or a list of them) that plan= is applied to, "
                        "beside plan=.")  # fmt: skip
    return list(models)


def _with_plan(plan: TunePlan, models: list[nn.Module], dtype: torch.dtype | None,
               policy: Policy | None) -> tuple[torch.dtype | None, Policy | None]:  # fmt: skip
    """``init``'s dtype and policy with ``plan`` applied (nothing changed yet); the plan
    checked against ``models`` where given."""
    if plan.fp8:
        raise PlanError(f"ampkit.init(plan=...): the plan runs {len(plan.fp8)} linear(s) in fp8 "
                        f"({', '.join(plan.fp8[:3])}{' ...' if len(plan.fp8) > 3 else ''}), which takes "
                        "converting them: use ampkit.initialize(model, optimizer, plan=...).")  # fmt: skip
    if models:
        plan.check_model(models)
    if not plan.lowered:
        return dtype, policy
    if policy is not None and not isinstance(policy, Policy):
        raise PolicyError(f"policy must be an ampkit.Policy, got {type(policy).__name__}.")
    return plan.compute_dtype(dtype), plan.policy(base=policy)
