"""Unscaling gradients: grouped by (device, dtype) (:func:`group_grads`), multiplied by
``1/S`` in place and checked for inf/NaN in one fused kernel per group
(:func:`unscale_and_check_`), with no host sync."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ampkit._internal import torch_compat
from ampkit.errors import ScalerError

__all__ = ["group_grads", "unscale_and_check_"]


def group_grads(
    params: Iterable[torch.Tensor], *, allow_fp16: bool = True
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The gradients of ``params`` (those that have one), grouped by (device, dtype).

    Sparse gradients contribute their values (an fp16 sparse gradient is coalesced
    first so that duplicate indices are summed before the check); complex gradients
    their real view (``torch.view_as_real``), which shares their storage. With
    ``allow_fp16=False`` an fp16 gradient raises :class:`~ampkit.ScalerError`."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        if grad.dtype == torch.float16 and not allow_fp16:
            raise ScalerError(
                "Attempting to unscale FP16 gradients: a parameter is float16, so its "
                "unscaled gradient would underflow. Keep the parameters in float32 (cast "
                "in the forward pass with autocast) or use fp32 master weights."
            )
        if grad.is_sparse:
            if grad.dtype == torch.float16:
                p.grad = grad = grad.coalesce()
            grad = torch_compat.sparse_values(grad)
        if grad.is_complex():
            # Unscale and check the real and imaginary parts in place, as floats.
            grad = torch.view_as_real(grad)
        key = (grad.device, grad.dtype)
        bucket = groups.get(key)
        if bucket is None:
            groups[key] = [grad]
        else:
            bucket.append(grad)
    return groups


def unscale_and_check_(
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]],
    factor: float,
    factor_tensors: dict[torch.device, torch.Tensor] | None = None,
    *,
    check_result: bool | None = None,
) -> torch.Tensor | None:
    """Multiply every tensor in ``groups`` in place by ``factor`` (an fp32 value) and
    check them for inf/NaN, one fused kernel per (device, dtype) group.

    Returns a float32 0-dim tensor, 1.0 if any tensor held a non-finite value and 0.0
    otherwise, or ``None`` when ``groups`` is empty. No host sync. The fused kernel
    checks the values before the multiply; a factor above 1 (a loss scale below 1) can
    overflow finite values, so by default (``check_result=None``) the products are then
    checked too, in a second pass (``True``/``False`` force it on/off).
    ``factor_tensors`` (device -> fp32 0-dim tensor holding ``factor``) lets a caller
    reuse cached tensors."""
    if not groups:
        return None
    if check_result is None:
        check_result = factor > 1.0
    found_per_device: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _dtype), grads in groups.items():
            found = found_per_device.get(device)
            if found is None:
                found = found_per_device[device] = torch.zeros((), dtype=torch.float32, device=device)
            factor_t = factor_tensors.get(device) if factor_tensors is not None else None
            if factor_t is None:
                factor_t = torch.full((), factor, dtype=torch.float32, device=device)
            torch_compat.amp_unscale_and_check_(grads, found, factor_t)
            if check_result:
                one = torch.ones((), dtype=torch.float32, device=device)
                torch_compat.amp_unscale_and_check_(grads, found, one)
    founds = iter(found_per_device.values())
    total = next(founds)
    for other in founds:
        total = total + other.to(total.device, non_blocking=True)
    return total
