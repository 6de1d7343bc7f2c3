"""The fp32 weights of an HF run and the checks of its checkpoint files
(:mod:`ampkit.integrations.hf`): :func:`fp32_state_dict` (the masters under O2, weight +
compensation under O2K) and the ``config.json`` dtype ``save_model`` writes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ampkit import fp32_weights, master_params
from ampkit import state_dict as amp_state_dict

from .. import require
from .._shared import ABSURD_MAGNITUDE, write_text
from .arguments import HfIntegrationError

require("accelerate", "hf")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402

__all__ = ["fp32_state_dict"]


def _raw_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` inside Accelerate's (or another framework's)
    wrappers that hold it as ``.optimizer``."""
    seen = 0
    while not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, AcceleratedOptimizer):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or seen > 8:
            break
        optimizer, seen = inner, seen + 1
    return optimizer


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Per param group, the model's names of the parameters in ``param_groups`` order
    (HF groups parameters by weight decay, not in ``model.parameters()`` order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        missing = [i for i, p in enumerate(group["params"]) if id(p) not in names]
        if missing:
            raise HfIntegrationError(
                f"param group {g} of the optimizer holds {len(missing)} tensor(s) that are not "
                "parameters of trainer.model; build the optimizer over model.parameters()."
            )
        out.append([names[id(p)] for p in group["params"]])
    return out


def _training_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "amp": amp_state_dict(), "optimizer": optimizer.state_dict()}


def fp32_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    param_names: list[list[str]] | None = None,
) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every floating tensor in fp32 and each weight the
    best fp32 value the run holds: its fp32 master (O2), weight + compensation summed
    in fp32 (O2K), the weight widened otherwise (exact). Tied weights (GPT-2's
    ``lm_head.weight`` and ``wte.weight``) stay one tensor, so ``save_pretrained``
    keeps one copy.

    Args:
        model: the trained model (``trainer.model``), set up by :func:`ampkit.initialize`
            or in fp32.
        optimizer: the raw ``torch.optim.Optimizer`` the current ampkit session manages
            (an ``AcceleratedOptimizer`` is unwrapped); None: the model's own weights,
            widened to fp32.
        param_names: per param group, the names of the parameters in the optimizer's
            order (see :func:`ampkit.fp32_weights`); needed when the optimizer was not
            built over ``model.parameters()`` in order and its masters have replaced
            the model's parameters in ``param_groups``.

    Returns:
        ``{name: tensor}``: fp32 floating tensors (integer buffers unchanged), ready for
        ``model.save_pretrained(dir, state_dict=...)`` or ``load_state_dict``.
    """
    if optimizer is None:
        fp32 = fp32_weights(model, model.state_dict())
    else:
        raw = _raw_optimizer(optimizer)
        fp32 = fp32_weights(
            model, _training_checkpoint(model, raw), None if param_names is None else [param_names]
        )
    # tied entries share one tensor again (state_dict lists each tie under every name)
    by_tensor: dict[int, torch.Tensor] = {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if name in fp32:
            by_tensor.setdefault(id(t), fp32[name])
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        out[name] = by_tensor.get(id(t), fp32[name])
    return out


def _write_config_dtype(model: Any, output_dir: str, dtype: torch.dtype) -> None:
    """Rewrite ``config.json`` in ``output_dir`` with ``dtype`` (``save_pretrained``
    writes the dtype of the model's first parameter, bf16 for an O2 model whose saved
    weights are fp32) as ``save_pretrained`` writes it, through ampkit's writer (a link
    at its name is refused, never followed); the model's in-memory config keeps what HF
    set."""
    config = getattr(model, "config", None)
    path = os.path.join(output_dir, "config.json")
    if config is None or not os.path.lexists(path):
        return
    before = config.dtype
    config.dtype = str(dtype).split(".")[1]
    try:
        text = config.to_json_string(use_diff=True)
    finally:
        config.dtype = before
    write_text(path, text, "the model's config.json", HfIntegrationError)


def _stepped16_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names in ``model.state_dict()`` of its 16-bit (fp16/bf16) tensors that no fp32
    master stands behind: weights the optimizer steps as they are (O2K, O3) and 16-bit
    buffers. A checkpoint's fp32 weights need not round back to them, so ampkit's
    checkpoint file holds each (the weights with an fp32 master, O2's, come back from
    the master)."""
    stepped = {id(p) for p in master_params(optimizer)}
    mastered = {id(p) for p in model.parameters()} - stepped
    return [
        name
        for name, t in model.state_dict(keep_vars=True).items()
        if t.dtype in (torch.float16, torch.bfloat16) and id(t) not in mastered
    ]


def _check_weights16(
    path: str,
    weights16: Any,
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None,
    expected: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's exact 16-bit weights, each checked against the model's tensor of
    that name: dense (strided), known, same shape, finite (a training step never writes
    inf/NaN: ampkit skips those steps), no larger in magnitude than
    :data:`~ampkit._internal.validate.ABSURD_MAGNITUDE`, and of the model's dtype -- or,
    before ampkit cast the model (``dtype`` given), of ``dtype``. With ``expected``
    (:func:`_stepped16_names` of the set-up model), exactly those names: one missing
    would resume from a rounded copy."""
    if not isinstance(weights16, Mapping):
        raise HfIntegrationError(f"{path}: 'weights16' is {type(weights16).__name__}, not a dict of tensors.")
    unknown = sorted(str(k) for k in weights16 if k not in state)
    if unknown:
        raise HfIntegrationError(f"{path} holds weights the model does not have: {unknown[:5]}.")
    if expected is not None:
        missing = sorted(set(expected) - set(weights16))
        extra = sorted(str(k) for k in set(weights16) - set(expected))
        if missing or extra:
            raise HfIntegrationError(
                f"{path}: 'weights16' must hold exactly the {len(expected)} 16-bit weight(s) the "
                f"optimizer steps as they are; it lacks {missing[:5]} and has {extra[:5]} beyond "
                "them: not a whole ampkit checkpoint (truncated or edited), or saved from another "
                "setup. Nothing was loaded; resume from an earlier checkpoint or with the run's "
                "arguments (amp_level, amp_dtype, amp_plan)."
            )
    for name, value in weights16.items():
        target = state[name]
        want = dtype if dtype is not None else target.dtype
        if isinstance(value, torch.Tensor) and (value.layout != torch.strided or value.is_meta):
            kind = "on the meta device (no data)" if value.is_meta else f"a {value.layout} tensor"
            raise HfIntegrationError(
                f"{path}: weight {name!r} is {kind}, where ampkit saves a dense (strided) tensor: the "
                "file was edited or not written by ampkit. Nothing was loaded; resume from another checkpoint."
            )
        if not isinstance(value, torch.Tensor) or value.dtype != want or value.shape != target.shape:
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise HfIntegrationError(f"{path}: weight {name!r} is {got} where the model has {want} {tuple(target.shape)}.")
        if not bool(torch.isfinite(value).all()):
            raise HfIntegrationError(f"{path}: weight {name!r} holds inf/NaN, which no training step writes.")
        largest = float(value.abs().amax()) if value.numel() else 0.0
        if largest > ABSURD_MAGNITUDE:
            raise HfIntegrationError(
                f"{path}: weight {name!r} holds values of magnitude {largest:.3g}, beyond {ABSURD_MAGNITUDE:.3g} "
                "(past it a square overflows fp32; no run that trains saves one). Nothing was loaded: the "
                "checkpoint is corrupt; resume from an earlier one."
            )
    return dict(weights16)
