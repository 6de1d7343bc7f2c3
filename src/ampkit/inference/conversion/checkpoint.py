"""Reading training checkpoints: a model ``state_dict`` (O0/O1/O3), or the
``{"model", "amp", "optimizer"}`` dict of an O2 run (fp32 master weights) or an O2K run
(weight + Kahan compensation), turned into fp32 weights (:func:`fp32_weights`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ampkit._internal.dtypes import LOW_PRECISION

from .errors import ConversionError

__all__ = ["fp32_weights", "load_fp32_checkpoint"]


_MODEL_KEYS = ("model", "model_state_dict", "state_dict")
_OPT_KEYS = ("optimizer", "optimizer_state_dict", "opt", "optimizers")


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    )


def _split_checkpoint(checkpoint: Any) -> tuple[Mapping[str, torch.Tensor], Any, list[Any]]:
    """(model state dict, amp state dict or None, optimizer state dicts)."""
    if _is_state_dict(checkpoint):
        return checkpoint, None, []
    if not isinstance(checkpoint, Mapping):
        raise ConversionError(
            f"checkpoint must be a model state_dict or a dict with a 'model' entry, got {type(checkpoint).__name__}."
        )
    model_sd = next((checkpoint[k] for k in _MODEL_KEYS if k in checkpoint), None)
    if not _is_state_dict(model_sd):
        raise ConversionError(
            "the checkpoint has no model weights: expected a state_dict, or a dict with one of "
            f"{list(_MODEL_KEYS)} holding model.state_dict() (it has {sorted(map(str, checkpoint))[:8]})."
        )
    amp_sd = checkpoint.get("amp")
    opts = next((checkpoint[k] for k in _OPT_KEYS if k in checkpoint), None)
    opt_list = [] if opts is None else list(opts) if isinstance(opts, (list, tuple)) else [opts]
    return model_sd, amp_sd, opt_list


Entry = tuple[int, int, torch.Tensor]


def _saved_weights(amp_sd: Any) -> list[tuple[list[Entry], list[Entry]]]:
    """Per optimizer of an ``ampkit.state_dict()`` (in session order): its master
    weights and compensation buffers as ``(group, index, tensor)`` entries."""
    what = "checkpoint['amp'] is not an ampkit.state_dict()"
    if not isinstance(amp_sd, Mapping) or not isinstance(amp_sd.get("trainers"), (list, tuple)):
        raise ConversionError(f"{what}; save amp.state_dict() under 'amp'.")
    out = []
    try:
        for trainer in amp_sd["trainers"]:
            for opt in trainer.get("optimizers", []):
                extra = opt.get("extra") or {}
                masters = (extra.get("master_weights") or {}).get("masters", [])
                comps = (extra.get("compensation") or {}).get("buffers", [])
                out.append(([_entry(e) for e in masters], [_entry(e) for e in comps]))
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConversionError(f"{what}: {exc}") from None
    return out


def _entry(e: Any) -> Entry:
    gi, pi, t = e
    if not (isinstance(gi, int) and isinstance(pi, int) and isinstance(t, torch.Tensor)):
        raise ValueError(f"expected [group, index, tensor] entries, got {e!r:.80}")
    return gi, pi, t


def _position_names(
    model_params: list[str], opt_sd: Any, names: Sequence[Sequence[str]] | None, which: int
) -> Any:
    """A function (group, index) -> parameter name for optimizer ``which``."""
    if names is not None:
        table = [list(g) for g in names]
        return lambda gi, pi: table[gi][pi]
    groups = opt_sd.get("param_groups") if isinstance(opt_sd, Mapping) else None
    if not (isinstance(groups, (list, tuple)) and all(isinstance(g, Mapping) for g in groups)):
        groups = None
    if groups and all("param_names" in g for g in groups):
        return lambda gi, pi: groups[gi]["param_names"][pi]
    if groups:
        # torch numbers parameters 0, 1, ... across the groups in order; with an
        # optimizer built over model.parameters() that is named_parameters() order.
        return lambda gi, pi: model_params[groups[gi]["params"][pi]]

    def first_group_only(gi: int, pi: int) -> str:
        if gi != 0:
            raise ConversionError(
                f"optimizer {which} has several param groups; put its state_dict in the "
                "checkpoint under 'optimizer' so master weights can be matched to parameters."
            )
        return model_params[pi]

    return first_group_only


def fp32_weights(
    model: nn.Module,
    checkpoint: Mapping[str, Any],
    param_names: Sequence[Sequence[Sequence[str]]] | None = None,
) -> dict[str, torch.Tensor]:
    """``model``'s state dict from a training checkpoint of any opt level, with every
    floating tensor in fp32 and each 16-bit weight replaced by the best fp32 value
    the checkpoint holds.

    Args:
        model: a module of the trained architecture (used for its parameter names
            and order; its values are not read).
        checkpoint: either ``model.state_dict()`` (O0/O1/O3: the weights as stored),
            or a dict ``{"model": model.state_dict(), "amp": ampkit.state_dict(),
            "optimizer": opt.state_dict()}`` (``"optimizer"`` may be a list, one per
            optimizer in the order given to ``initialize``). With O2 the fp32 master
            weights replace the 16-bit ones; with O2K each weight becomes
            ``weight + compensation`` summed in fp32.
        param_names: per optimizer, per param group, the parameter names in
            ``param_groups`` order. Needed only when the optimizer was built neither
            from ``model.named_parameters()`` (torch then saves the names) nor from
            ``model.parameters()`` in order.

    Returns:
        ``{name: tensor}`` ready for ``model.load_state_dict``, fp32 for floating
        entries, integer buffers unchanged.

    Raises:
        ConversionError: the checkpoint has no model weights, or master weights do not
            line up with the model's parameters (wrong order, shape or value).
    """
    model_sd, amp_sd, opt_sds = _split_checkpoint(checkpoint)
    out = {k: v.detach().float() if v.is_floating_point() else v for k, v in model_sd.items()}
    if amp_sd is None:
        return out
    params = [n for n, _ in model.named_parameters()]
    for j, (masters, comps) in enumerate(_saved_weights(amp_sd)):
        if not masters and not comps:
            continue
        if param_names is not None and j >= len(param_names):
            raise ConversionError(
                f"param_names has {len(param_names)} entries, but the checkpoint has master "
                f"weights or compensation for optimizer {j}: give one list per optimizer."
            )
        names = _position_names(
            params,
            opt_sds[j] if j < len(opt_sds) else None,
            None if param_names is None else param_names[j],
            j,
        )
        for gi, pi, value in masters:
            name = _checked_name(names, gi, pi, model_sd, value, j, "master weight")
            out[name] = value.detach().float()
        for gi, pi, comp in comps:
            name = _checked_name(names, gi, pi, model_sd, comp, j, "compensation buffer")
            out[name] = model_sd[name].detach().float() + comp.detach().float()
    return out


def load_fp32_checkpoint(
    model: nn.Module,
    checkpoint: Mapping[str, Any],
    param_names: Sequence[Sequence[Sequence[str]]] | None = None,
) -> nn.Module:
    """Load :func:`fp32_weights` of ``checkpoint`` into the fp32 ``model`` (strictly)
    and return it; a checkpoint that does not fit raises :class:`ConversionError`
    naming the first mismatches."""
    weights = fp32_weights(model, checkpoint, param_names)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        lines = [ln.strip() for ln in str(exc).strip().splitlines()[1:] if ln.strip()]
        detail = "; ".join(lines)[:300] or str(exc).strip()[:300]
        raise ConversionError(f"the checkpoint's model weights do not fit this model: {detail}") from None
    return model


def _checked_name(
    names: Any, gi: int, pi: int, model_sd: Mapping[str, torch.Tensor], value: torch.Tensor, j: int, what: str
) -> str:
    advice = (
        "build the optimizer from model.named_parameters() (torch saves the names), or pass "
        "param_names= to fp32_weights / convert."
    )
    try:
        name = names(gi, pi)
    except (IndexError, KeyError, TypeError):
        raise ConversionError(
            f"optimizer {j} has a {what} at group {gi}, index {pi}, which matches no model "
            f"parameter; {advice}"
        ) from None
    weight = model_sd.get(name)
    if weight is None or weight.shape != value.shape:
        raise ConversionError(
            f"the {what} at optimizer {j}, group {gi}, index {pi} has shape {tuple(value.shape)} "
            f"but it lines up with parameter {name!r} of shape "
            f"{None if weight is None else tuple(weight.shape)}; {advice}"
        )
    if what == "master weight" and weight.dtype in LOW_PRECISION and not torch.equal(value.to(weight.dtype), weight):
        raise ConversionError(
            f"the master weight at optimizer {j}, group {gi}, index {pi} does not round to the "
            f"saved 16-bit weight {name!r}: the optimizer's order is not the model's; {advice}"
        )
    return name
