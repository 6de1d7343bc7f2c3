"""Where a non-finite value or an underflow of one step comes from: :func:`localize`
reads the recorded step (module outputs, parameter grads) and names the first module,
its direction (forward or backward) and dtype."""

from __future__ import annotations

import math
from typing import Any

import torch

from ampkit._internal.dtypes import dtype_name
from ampkit.casting.policy import canonical_op

from ._findings import Finding
from ._record import ResolvedStep


def localize(res: ResolvedStep, step: int, scale: float) -> Finding | None:
    """The first non-finite value in one step's module-level records, or None."""
    events: list[tuple[int, str, Any]] = []
    for seq, name, dt, amax in res.acts:
        if not math.isfinite(amax):
            events.append((seq, "act", (name, dt, amax)))
            break
    for seq, name, parent, dt, amax in res.inputs:
        if not math.isfinite(amax):
            events.append((seq, "input", (name, parent, dt)))
            break
    for seq, tap, dt, amax in res.grads:
        if not math.isfinite(amax):
            events.append((seq, "grad", (tap, dt, amax)))
            break
    bad_params = [p for p in res.params if not math.isfinite(p[5])]
    if bad_params:
        p = bad_params[0]
        events.append((p[0], "param", p))
    if not events:
        return None
    events.sort(key=lambda e: e[0])
    seq, kind, data = events[0]
    params = [p[1] for p in bad_params[:3]]
    if kind == "act":
        name, dt, amax = data
        return Finding(
            step, scale, "overflow", "module", direction="forward", module=name,
            module_type=res.module_type.get(name), dtype=dtype_name(dt),
        )
    if kind == "input":
        name, parent, dt = data
        if parent is None:  # the model's own input
            return Finding(step, scale, "nonfinite_input", "module", direction="forward", module=name,
                           module_type=res.module_type.get(name), dtype=dtype_name(dt))
        # made by the parent's own code (functional ops between its children)
        return Finding(
            step, scale, "overflow", "module", direction="forward", module=parent,
            module_type=res.module_type.get(parent), dtype=dtype_name(dt),
        )
    if kind == "grad":
        tap, dt, amax = data
        # no module took the tensor: the code of the module that received it made its grad
        module = innermost(tap.consumers) if tap.consumers else tap.owner
        return Finding(
            step, scale, "overflow", "module", direction="backward", module=module,
            module_type=res.module_type.get(module or ""), dtype=dtype_name(dt), params=params,
        )
    module = data[2]
    return Finding(
        step, scale, "overflow", "module", direction="backward", module=module,
        module_type=res.module_type.get(module), dtype=dtype_name(data[3]), params=params,
    )


def innermost(names: list[str]) -> str | None:
    """The most deeply nested of the modules that took a tensor as input (the one
    whose backward computed its grad)."""
    if not names:
        return None
    return max(names, key=lambda n: (n.count(".") + (1 if n else 0), len(n)))


def underflow_fraction(res: ResolvedStep, dtype: torch.dtype) -> float | None:
    """Of the parameter-grad elements of modules computing in ``dtype``: the fraction of
    non-zero ones below its smallest normal, or the fraction of zeros when that is
    above 90% (grads that vanished altogether). None without such grads."""
    zeros = sub = n = 0.0
    for _seq, _pn, mname, _dt, numel, _amax, z, below, _sq, _t in res.params:
        if res.module_dtype.get(mname) is dtype:
            zeros += z
            sub += below - z
            n += numel
    if not n:
        return None
    if zeros / n >= 0.9:
        return zeros / n
    return sub / (n - zeros) if n > zeros else 0.0


def policy_op_of(function: Any) -> str | None:
    if function is None:
        return None
    try:
        name = canonical_op(function)
    except Exception:
        return None
    return None if name.startswith("py:") else name


def graph_contains(roots: list[Any], targets: list[Any], limit: int = 256) -> bool:
    wanted = {id(t) for t in targets}
    seen: set[int] = set()
    todo = [r for r in roots if r is not None]
    while todo and len(seen) < limit:
        node = todo.pop()
        if id(node) in seen:
            continue
        if id(node) in wanted:
            return True
        seen.add(id(node))
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return False
