"""Which modules of a model :func:`~ampkit.levels.model_cast.cast_model` keeps in fp32
(normalization layers, hand-written ones included, and the ``keep_fp32`` rules: classes
or qualified-name globs, each keeping its whole subtree) and which parameters it casts;
nothing here changes a model."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from torch import nn

from ampkit._internal import torch_compat
from ampkit.errors import AmpError

__all__ = [
    "KeepRule",
    "NORM_LAYER_TYPES",
    "check_keep_fp32",
    "is_norm_layer",
    "kept_fp32_modules",
    "kept_fp32_roots",
    "kept_with_roots",
    "looks_like_norm",
    "matches_rule",
    "params_to_cast",
    "takes_low_precision_input",
]

#: Normalization layers kept in fp32 by :func:`cast_model` (subclasses included):
#: every BatchNorm (1d/2d/3d, lazy, SyncBatchNorm), InstanceNorm (1d/2d/3d, lazy),
#: LayerNorm, GroupNorm, RMSNorm and LocalResponseNorm.
NORM_LAYER_TYPES: tuple[type[nn.Module], ...] = tuple(
    t
    for t in (
        torch_compat.BATCH_NORM_BASE,
        torch_compat.INSTANCE_NORM_BASE,
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),
        nn.LocalResponseNorm,
        nn.CrossMapLRN2d,
    )
    if t is not None
)


def is_norm_layer(module: nn.Module, extra_types: tuple[type[nn.Module], ...] = ()) -> bool:
    """True if ``module`` is a normalization layer: :data:`NORM_LAYER_TYPES`, one of
    ``extra_types``, or a hand-written one (see :func:`looks_like_norm`)."""
    return isinstance(module, NORM_LAYER_TYPES + tuple(extra_types)) or looks_like_norm(module)


def looks_like_norm(module: nn.Module) -> bool:
    """A hand-written normalization layer, as many codebases define their own
    (nanoGPT's ``LayerNorm``, LLaMA's ``RMSNorm``, T5's ``LayerNorm``): a module whose
    class name contains "norm" (any case), that holds parameters, all of them vectors
    (at most 1-D: scale, shift), and no submodule with parameters of its own."""
    if "norm" not in type(module).__name__.lower():
        return False
    own = list(module.parameters(recurse=False))
    if not own or any(p.dim() > 1 for p in own):
        return False
    return not any(any(True for _ in child.parameters()) for child in module.children())


KeepRule = type[nn.Module] | str


def matches_rule(module: nn.Module, name: str, rules: Sequence[KeepRule]) -> bool:
    """Whether ``module`` (qualified ``name``) matches one of ``rules``: a module class it
    is an instance of, or a glob its name matches (``"blocks.*.attn"``)."""
    return any(fnmatch.fnmatchcase(name, r) if isinstance(r, str) else isinstance(module, r) for r in rules)


def kept_fp32_modules(
    model: nn.Module,
    keep_norm_fp32: bool = True,
    extra_fp32_types: Iterable[type[nn.Module]] = (),
    keep_fp32: Iterable[KeepRule] = (),
) -> list[nn.Module]:
    """The modules :func:`cast_model` keeps in fp32, in ``model.modules()`` order:
    normalization layers (with ``keep_norm_fp32``; :func:`is_norm_layer` with
    ``extra_fp32_types``) and the modules matching ``keep_fp32`` (classes, or globs of
    qualified names such as ``"encoder.*.norm"``; kept whatever ``keep_norm_fp32``),
    each with its whole subtree: a kept block keeps every layer inside it fp32."""
    return [m for m, _ in kept_with_roots(model, keep_norm_fp32, tuple(extra_fp32_types), tuple(keep_fp32))]


def kept_fp32_roots(
    model: nn.Module, keep_norm_fp32: bool = True, keep_fp32: Iterable[KeepRule] = ()
) -> list[nn.Module]:
    """The outermost of :func:`kept_fp32_modules`: kept modules with no kept ancestor
    (each keeps its whole subtree fp32), in ``model.modules()`` order."""
    return [m for m, root in kept_with_roots(model, keep_norm_fp32, (), tuple(keep_fp32)) if root]


def kept_with_roots(
    model: nn.Module,
    keep_norm_fp32: bool,
    extra: tuple[type[nn.Module], ...],
    rules: tuple[KeepRule, ...],
) -> list[tuple[nn.Module, bool]]:
    """(module, is_root) for every kept module; a root is a kept module with no kept
    ancestor (it gets the cast hooks; the modules under it run inside it in fp32)."""
    out: list[tuple[nn.Module, bool]] = []
    seen: set[int] = set()

    def visit(module: nn.Module, name: str, under_kept: bool) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        kept = under_kept or (keep_norm_fp32 and is_norm_layer(module, extra)) or matches_rule(module, name, rules)
        if kept:
            out.append((module, not under_kept))
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, kept)

    visit(model, "", False)
    return out


def check_keep_fp32(models: Iterable[nn.Module], keep_fp32: Iterable[KeepRule]) -> None:
    """Raise :class:`AmpError` if a qualified-name glob of ``keep_fp32`` matches no
    module of ``models`` (a typo would otherwise keep nothing fp32, silently). Classes
    need not occur: a list like ``[MyLayerNorm]`` may serve several models."""
    model_list = list(models)
    names = [name for m in model_list for name, _ in m.named_modules()]  # "" (the model itself) too
    for rule in keep_fp32:
        if isinstance(rule, str) and not any(fnmatch.fnmatchcase(n, rule) for n in names):
            named = [n for n in names if n]
            sample = ", ".join(repr(n) for n in named[:8]) + (", ..." if len(named) > 8 else "")
            raise AmpError(
                f"keep_fp32 glob {rule!r} matches no module name of the model (its names "
                f"are qualified like {sample or 'none: the model has no submodules'}); fix the "
                "pattern, or pass the module class instead."
            )


def params_to_cast(
    model: nn.Module,
    keep_norm_fp32: bool = True,
    extra_fp32_types: tuple[type[nn.Module], ...] = (),
    keep_fp32: Iterable[KeepRule] = (),
) -> list[nn.Parameter]:
    """The floating parameters :func:`cast_model` would convert, in
    ``model.modules()`` order, each once (shared parameters are listed once; one
    shared with a module kept fp32 stays fp32)."""
    kept = kept_fp32_modules(model, keep_norm_fp32, extra_fp32_types, keep_fp32)
    kept_ids = {id(m) for m in kept}
    kept_params = {id(p) for m in kept for p in m.parameters(recurse=False)}
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for module in model.modules():
        if id(module) in kept_ids:
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and id(p) not in kept_params and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def takes_low_precision_input(module: nn.Module) -> bool:
    """Norm layers whose torch kernels take a 16-bit input with fp32 weights and
    compute statistics and weight grads in fp32 (checked against fp64: weight grads
    as accurate as with an fp32 input). BatchNorm and InstanceNorm (cudnn and CPU
    kernels), GroupNorm on CPU. LayerNorm is not among them: its CPU kernel
    accumulates the weight grads of a bf16 input in bf16 (4% off on a 64x16x256
    input), so it gets an fp32 input, as do RMSNorm and LocalResponseNorm."""
    if isinstance(module, (torch_compat.BATCH_NORM_BASE, torch_compat.INSTANCE_NORM_BASE)):
        return True
    if isinstance(module, nn.GroupNorm):
        devices = {t.device.type for t in module.parameters()} or {"cpu"}
        return devices == {"cpu"}
    return False
