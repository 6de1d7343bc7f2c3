"""A whole training checkpoint in tests: the model's, the optimizer's and ampkit's state
saved together with ``torch.save`` (as the README's resume recipe does) and loaded back
in that order."""

from __future__ import annotations

import io

import torch
from torch import nn

import ampkit


def saved(model: nn.Module, opt: torch.optim.Optimizer) -> bytes:
    """``model``, ``opt`` and ampkit's state as ``torch.save`` writes them."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": ampkit.state_dict()}, buf)
    return buf.getvalue()


def load(model: nn.Module, opt: torch.optim.Optimizer, ckpt: bytes) -> None:
    """Load :func:`saved`'s bytes: the model, then the optimizer, then ampkit."""
    state = torch.load(io.BytesIO(ckpt))
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    ampkit.load_state_dict(state["amp"])
