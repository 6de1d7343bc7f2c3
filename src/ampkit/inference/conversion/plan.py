"""Choosing each module's dtype (:func:`_plan`), building the converted model from
that choice (:func:`_build`: weights cast once, boundary hooks installed) and describing
it (:func:`_decisions`)."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from ampkit._internal import torch_compat
from ampkit._internal.dtypes import LOW_PRECISION
from ampkit.casting.policy import Policy
from ampkit.levels.model_cast import is_norm_layer

from .errors import ConversionError
from .hooks import _BoundaryInputs, _BoundaryOutputs, _Fp32Island, _IslandEnter, _IslandExit
from .report import ModuleDecision

ModuleKey = str | type


def _check_keys(keys: Iterable[ModuleKey] | None, what: str, names: Sequence[str]) -> tuple[ModuleKey, ...]:
    if keys is None:
        return ()
    if isinstance(keys, (str, type)):
        keys = [keys]
    out = []
    for key in keys:
        if isinstance(key, str):
            if not key:
                raise ConversionError(f"{what} names must be non-empty module names or globs.")
            if not any(fnmatch.fnmatchcase(n, key) for n in names):
                sample = ", ".join(repr(n) for n in names[1:6])
                raise ConversionError(
                    f"{what} entry {key!r} matches no module of the model; module names look like {sample}."
                )
        elif not (isinstance(key, type) and issubclass(key, nn.Module)):
            raise ConversionError(f"{what} entries are module names/globs or nn.Module subclasses, got {key!r}.")
        out.append(key)
    return tuple(out)


def _matches(keys: Sequence[ModuleKey], name: str, module: nn.Module) -> bool:
    return any(
        fnmatch.fnmatchcase(name, k) if isinstance(k, str) else isinstance(module, k) for k in keys
    )


@dataclasses.dataclass
class _Plan:
    """dtype and reason per module name (every module of the model)."""

    dtype: dict[str, torch.dtype]
    reason: dict[str, str]


def _parent(name: str) -> str | None:
    if name == "":
        return None
    return name.rpartition(".")[0]


def _overflows(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a finite weight of ``module`` itself would round to inf in ``dtype``."""
    own = [t for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
           if t is not None and t.is_floating_point() and t.numel()]
    return any(bool((torch.isinf(t.detach().to(dtype)) & torch.isfinite(t.detach())).any()) for t in own)


def _owns_weights(module: nn.Module) -> bool:
    return any(p.is_floating_point() for p in module.parameters(recurse=False)) or any(
        b is not None and b.is_floating_point() for b in module.buffers(recurse=False)
    )


def _own_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False) if p.is_floating_point()) + sum(
        b.numel() for b in module.buffers(recurse=False) if b is not None and b.is_floating_point()
    )


def _plan(
    model: nn.Module,
    dtype: torch.dtype,
    policy: Policy | None,
    keep_fp32: Sequence[ModuleKey],
    keep_norm_fp32: bool,
    forced: Mapping[str, tuple[torch.dtype, str]] | None = None,
) -> _Plan:
    """Each module's dtype: a forced choice (budget search), ``keep_fp32``, a policy
    module rule, the norm-layer rule, else its parent's dtype (the model: ``dtype``).
    A module whose own weights exceed its 16-bit dtype's range stays fp32 (its
    children still inherit the 16-bit dtype). Modules sharing a parameter are widened
    to the widest dtype among them."""
    forced = forced or {}
    dtypes: dict[str, torch.dtype] = {}
    passed_down: dict[str, torch.dtype] = {}  # what children inherit
    reasons: dict[str, str] = {}
    named = list(model.named_modules())
    for name, m in named:
        parent = _parent(name)
        if name in forced:
            d, why = forced[name]
        elif _matches(keep_fp32, name, m):
            d, why = torch.float32, "keep_fp32"
        elif policy is not None and (rule := policy.module_dtype(m, name)) is not None:
            d, why = rule, "policy rule"
        elif keep_norm_fp32 and is_norm_layer(m):
            d, why = torch.float32, "norm layer"
        elif parent is None:
            d, why = dtype, "default"
        else:
            d, why = passed_down[parent], "inherited" if passed_down[parent] != dtype else "default"
        passed_down[name] = d
        if d in LOW_PRECISION and _overflows(m, d):
            d, why = torch.float32, "range"
        dtypes[name], reasons[name] = d, why
    # A parameter shared by modules of different dtypes: widen them all.
    owners: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    changed = True
    while changed:
        changed = False
        for names in owners.values():
            names = [n for n in names if n in dtypes]
            kinds = {dtypes[n] for n in names}
            if len(kinds) > 1:
                for n in names:
                    if dtypes[n] != torch.float32:
                        dtypes[n], reasons[n] = torch.float32, "shared parameter"
                        changed = True
    return _Plan(dtypes, reasons)


def _build(ref: nn.Module, plan: _Plan, output_dtype: torch.dtype | None) -> nn.Module:
    """A copy of the fp32 ``ref`` with each module's own weights in its planned dtype
    and the boundary cast hooks installed."""
    model = copy.deepcopy(ref)
    names = dict(model.named_modules())
    for name, m in names.items():
        d = plan.dtype[name]
        for p in m.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != d:
                p.data = p.data.to(d)
        for bname, b in m.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dtype != d:
                torch_compat.replace_buffer(m, bname, b.to(d))
    for name, m in names.items():
        d = plan.dtype[name]
        parent = _parent(name)
        parent_d = None if parent is None else plan.dtype[parent]
        boundary = parent_d is not None and d != parent_d
        if boundary and d == torch.float32 and plan.reason[name] == "norm layer":
            # fp32 inside, the dtype it was given outside (a normalized output is bounded)
            island = _Fp32Island()
            m.register_forward_pre_hook(_IslandEnter(island), with_kwargs=True)
            m.register_forward_hook(_IslandExit(island), always_call=True)
            continue
        if _owns_weights(m) or boundary:
            m.register_forward_pre_hook(_BoundaryInputs(d), with_kwargs=True)
        if boundary and d != torch.float32:
            # a 16-bit module inside an fp32 (or other 16-bit) region: widen back
            m.register_forward_hook(_BoundaryOutputs(parent_d, (d,)))
    if output_dtype is not None:
        only = tuple(t for t in LOW_PRECISION if t != output_dtype)
        model.register_forward_hook(_BoundaryOutputs(output_dtype, only))
    model.eval()
    return model


def _decisions(model: nn.Module, plan: _Plan, isolated: Mapping[str, float], details: Mapping[str, str]) -> list[ModuleDecision]:
    out = []
    for name, m in model.named_modules():
        parent = _parent(name)
        boundary = parent is not None and plan.dtype[name] != plan.dtype[parent]
        if not (_owns_weights(m) or boundary or name == ""):
            continue
        out.append(
            ModuleDecision(
                name=name,
                kind=type(m).__name__,
                dtype=plan.dtype[name],
                reason=plan.reason[name],
                params=_own_numel(m),
                isolated_error=isolated.get(name),
                detail=details.get(name, ""),
            )
        )
    return out
