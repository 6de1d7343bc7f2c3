"""Non-reentrant activation checkpointing of a submodule at the levels that cast the
model (O2, O2K, O3): the recomputation during backward must save tensors of the dtypes
the forward saved (torch raises ``CheckpointError`` otherwise). A submodule called
inside the model's call is one of the model's entry points, which cast their inputs
when called from outside the model; the recomputation runs outside the model's call
and must not take that path for a call the forward made inside it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampkit

torch.set_num_threads(1)


class _Block(nn.Module):
    """A pre-norm residual block taking a residual stream of any dtype (it casts its
    branch's input to its weights' dtype, as a block written for O3 does) and saving
    the stream as it came (the gate multiplies by it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.ln(x.to(self.fc.weight.dtype)))
        return x + F.gelu(h) * x


class _Net(nn.Module):
    """An input layer, an fp32 position term added in ``forward`` (so the residual stream
    the block receives is fp32 at every level, as with sinusoidal or rotary terms
    computed on the fly), the block (checkpointed or not), a head."""

    def __init__(self, checkpointed: bool, mode: str) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = _Block()
        self.out = nn.Linear(16, 2)
        self.checkpointed = checkpointed
        self.kwargs = {"use_reentrant": mode == "reentrant"}
        if mode == "checkpoint_context":
            self.kwargs["context_fn"] = ampkit.checkpoint_context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.sin(torch.arange(16, dtype=torch.float32) / math.pi)
        h = self.inp(x) + pos
        assert h.dtype == torch.float32
        if self.checkpointed:
            h = checkpoint(self.block, h, **self.kwargs)
        else:
            h = self.block(h)
        return self.out(h.to(self.out.weight.dtype))


def _train(level: str, dtype: torch.dtype, checkpointed: bool, mode: str, steps: int = 3) -> list[torch.Tensor]:
    """The model's gradients at every step, then its weights."""
    ampkit.reset()
    torch.manual_seed(0)
    model = _Net(checkpointed, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level=level, dtype=dtype)
    seen = []
    for i in range(steps):
        x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float().reshape(-1, 2), torch.tensor([0, 1, 1, 0] * 3))
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        seen += [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
    return seen + [p.detach().clone() for p in model.parameters()]


CASES = [("O2", torch.bfloat16), ("O2K", torch.bfloat16), ("O3", torch.bfloat16), ("O2", torch.float16)]


@pytest.mark.parametrize("mode", ["plain", "checkpoint_context", "reentrant"])
@pytest.mark.parametrize(("level", "dtype"), CASES, ids=[f"{lv}-{str(dt)[6:]}" for lv, dt in CASES])
def test_checkpointed_block_fed_fp32_trains_bitwise_as_without_checkpointing(level, dtype, mode):
    """The block, called inside the model's call with an fp32 residual stream, is
    recomputed in backward with the same dtypes (non-reentrant, with and without
    ``checkpoint_context``; the reentrant kind too): grads at every step and the weights
    after equal (bitwise: the recomputation runs the same kernels on the same values) those
    of the same model without checkpointing; fp16 runs with its dynamic loss scale."""
    with_ckpt = _train(level, dtype, checkpointed=True, mode=mode)
    without = _train(level, dtype, checkpointed=False, mode=mode)
    assert len(with_ckpt) == len(without)
    for a, b in zip(with_ckpt, without):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_checkpointing_an_entry_point_from_outside_the_model_recomputes_its_casts(level):
    """A submodule a script calls directly (outside the model: its inputs are cast and
    its output handed back in fp32) and checkpoints there is recomputed the same way."""

    def run(checkpointed: bool) -> list[torch.Tensor]:
        ampkit.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
        outer = nn.ModuleDict({"body": model})
        opt = torch.optim.SGD(outer.parameters(), lr=0.1)
        outer, opt = ampkit.initialize(outer, opt, opt_level=level, dtype=torch.bfloat16)
        body = outer["body"]
        seen = []
        for i in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            out = checkpoint(body, x, use_reentrant=False) if checkpointed else body(x)
            assert out.dtype == torch.float32
            opt.zero_grad()
            with ampkit.scale_loss(F.cross_entropy(out, torch.tensor([0, 1, 1, 0])), opt) as scaled:
                scaled.backward()
            seen += [p.grad.detach().clone() for p in outer.parameters()]
            opt.step()
        return seen

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
