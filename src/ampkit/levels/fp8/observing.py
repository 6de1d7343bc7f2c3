"""What ``ampkit.explain`` sees of fp8: a :class:`Fp8MatmulRecord` per matmul, collected by
:class:`observe`, and the mode (train / frozen / replay) of a forward call."""

from __future__ import annotations

import dataclasses

import torch

from ampkit._internal import observe as _observe_mod
from ampkit._internal import torch_compat
from ampkit._internal.dtypes import dtype_name

from .recipe import E4M3, E5M2
from .scales import LayerState, Mode


@dataclasses.dataclass(frozen=True)
class Fp8MatmulRecord:
    """One fp8 matmul: the layer (``module``), which of its matmuls (``matmul``:
    ``"forward"``, ``"grad_input"``, ``"grad_weight"``), the operands' fp8 dtypes
    (``a_dtype``, ``b_dtype``), their scales' range (``a_scale``, ``b_scale``:
    ``1/scale``, what dequantizes; one value for tensorwise) and the output dtype
    (``out_dtype``)."""

    module: str
    matmul: str
    a_dtype: torch.dtype
    b_dtype: torch.dtype
    a_scale: tuple[float, float]
    b_scale: tuple[float, float]
    out_dtype: torch.dtype

    def describe(self) -> str:
        def rng(s: tuple[float, float]) -> str:
            return f"{s[0]:.3g}" if s[0] == s[1] else f"{s[0]:.3g}..{s[1]:.3g}"

        def short(d: torch.dtype) -> str:
            return dtype_name(d, extra={E4M3: "e4m3", E5M2: "e5m2"})

        return (
            f"{self.module} {self.matmul}: {short(self.a_dtype)} x {short(self.b_dtype)} -> "
            f"{short(self.out_dtype)}, dequant scales {rng(self.a_scale)} / {rng(self.b_scale)}"
        )


def _forward_mode(grad: bool) -> Mode:
    """The :data:`Mode` of a forward call made now with the caller's grad mode ``grad``
    (read outside the autograd Function or op, where grad mode is still the caller's)."""
    if _observe_mod.collecting() or not grad:
        return "frozen"
    if torch_compat.current_graph_task_id() != -1:  # a forward run inside backward: recomputation
        return "replay"
    return "train"


class observe(_observe_mod.collector):
    """``with observe() as records:`` collects an :class:`Fp8MatmulRecord` per fp8 matmul
    run in this thread; scale state is left unchanged meanwhile (a diagnostic run does
    not advance delayed-scaling histories). Records of other kinds reported in the same
    block (``ampkit._internal.observe``) are left out."""

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.records[:] = [r for r in self.records if isinstance(r, Fp8MatmulRecord)]


def _observe(
    state: LayerState,
    matmul: str,
    a: torch.Tensor,
    b: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    out: torch.dtype,
) -> None:
    if not _observe_mod.collecting():
        return

    def rng(s: torch.Tensor) -> tuple[float, float]:
        return float(s.min()), float(s.max())

    _observe_mod.emit(Fp8MatmulRecord(state.name, matmul, a.dtype, b.dtype, rng(sa), rng(sb), out))
