"""torch's private ops with no public name: the fused kernels torch's own AMP and
optimizers use (foreach, the unscale-and-check), and fp8's scaled matmul."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

foreach_copy_: Callable[..., Any] = torch._foreach_copy_
"""``torch._foreach_copy_(dst, src)``: copies lists of tensors in one kernel."""

foreach_mul_: Callable[..., Any] = torch._foreach_mul_
"""``torch._foreach_mul_(tensors, scalar)``: scales lists of tensors in one kernel."""
foreach_add_: Callable[..., Any] = torch._foreach_add_
"""``torch._foreach_add_(tensors, scalar)``: adds a number to lists of tensors in one kernel."""
foreach_sub_: Callable[..., Any] = torch._foreach_sub_
"""``torch._foreach_sub_(tensors, others)``: subtracts a list of (0-dim) tensors, element by element."""
flatten_dense: Callable[..., Any] = torch._C._nn.flatten_dense_tensors
"""``flatten_dense(tensors)``: one 1-D tensor of their elements, each in logical order (one C++ call)."""
unflatten_dense: Callable[..., Any] = torch._C._nn.unflatten_dense_tensors
"""``unflatten_dense(flat, like)``: views of ``flat`` shaped as ``like`` (its inverse)."""

#: dtypes torch's fused unscale-and-check kernel takes, per device type (the CUDA kernel
#: dispatches float, double and half only: bf16 grads raise NotImplementedError there)
FUSED_CHECK_DTYPES: dict[str, frozenset[torch.dtype]] = {
    "cpu": frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16}),
}
_FUSED_CHECK_DEFAULT = frozenset({torch.float32, torch.float64, torch.float16})


def amp_unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``
    (what ``torch.amp.GradScaler.unscale_`` runs): sets ``found_inf`` (fp32, 0-dim) to
    1.0 if any of ``grads`` holds inf/NaN, then multiplies them by ``inv_scale`` in place.
    Grads of a dtype the device's kernel lacks (bf16 on CUDA) take
    :func:`unscale_and_check_composite_`, which computes the same without a host sync."""
    if not grads:
        return
    fused_dtypes = FUSED_CHECK_DTYPES.get(grads[0].device.type, _FUSED_CHECK_DEFAULT)
    fused = [g for g in grads if g.dtype in fused_dtypes]
    if len(fused) == len(grads):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return
    if fused:
        torch._amp_foreach_non_finite_check_and_unscale_(fused, found_inf, inv_scale)
    unscale_and_check_composite_([g for g in grads if g.dtype not in fused_dtypes], found_inf, inv_scale)


def unscale_and_check_composite_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """The fused unscale-and-check from foreach kernels, for any dtype: the L1 norm of
    each grad (fp32 accumulation) is inf or NaN when the grad holds an inf or a NaN, so
    ``found_inf`` becomes the maximum of itself and "the sum of the norms is not finite";
    then the grads are multiplied by ``inv_scale``. A sum of finite grads beyond fp32's
    range (about 3.4e38) also counts as non-finite: such a step is skipped."""
    norms = torch._foreach_norm(grads, 1)
    bad = torch.logical_not(torch.isfinite(torch.stack(norms).float().sum())).to(found_inf.dtype)
    torch.maximum(found_inf, bad.to(found_inf.device), out=found_inf)
    torch._foreach_mul_(grads, inv_scale.to(grads[0].device))


def scaled_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch._scaled_mm``: the fp8 matmul of ``ampkit``'s fp8 level (a private op; its
    layouts and arguments have changed between releases)."""
    return torch._scaled_mm(*args, **kwargs)
