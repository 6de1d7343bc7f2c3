"""``ampkit.levels.rounding.unrounded``: which 16-bit tensors no longer hold their fp32
partner rounded (how O2 finds weights edited through ``.data`` before every step). The
small CPU pairs are compared all at once through buffers kept between calls; the answer
must be :func:`~ampkit.levels.rounding.rounds_to`'s, pair by pair, on every call."""

from __future__ import annotations

import random

import pytest
import torch

from ampkit.levels.rounding import rounds_to, unrounded

BF16, FP16 = torch.bfloat16, torch.float16
SHAPES = [(3,), (4, 5), (1,), (7, 1, 3), (0,), (2, 300), (17,), (256, 300)]  # the last one large: compared alone


def _pairs(low_dtype: torch.dtype, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in SHAPES:
        high = torch.randn(shape, generator=g)
        out.append((high.to(low_dtype), high))
    return out


def _reference(pairs):
    return [i for i, (low, high) in enumerate(pairs) if not rounds_to(low, high)]


@pytest.mark.parametrize("low_dtype", [BF16, FP16])
def test_every_call_finds_exactly_the_pairs_rounds_to_finds(low_dtype):
    """Edits of one element at the first, a middle and the last place of a tensor, in
    several tensors at once, undone again: each call sees the values of now (the kept
    buffers hold nothing over from an earlier call)."""
    pairs = _pairs(low_dtype, 0)
    rng = random.Random(1)
    assert unrounded(pairs) == [] == _reference(pairs)
    for _ in range(40):
        edited = []
        for i in rng.sample(range(len(pairs)), rng.randint(0, 3)):
            low = pairs[i][0]
            if low.numel() == 0:
                continue
            at = rng.choice([0, low.numel() // 2, low.numel() - 1])
            old = low.view(-1)[at].clone()
            low.view(-1)[at] = old * 2 + 1
            edited.append((low, at, old))
        assert unrounded(pairs) == _reference(pairs) == sorted({i for i, (lo, _) in enumerate(pairs)
                                                                  if any(lo is e[0] for e in edited)})  # fmt: skip
        for low, at, old in edited:
            low.view(-1)[at] = old
    assert unrounded(pairs) == []


def test_a_changed_master_and_other_layouts_are_seen():
    """The fp32 side changed (not the 16-bit one); a transposed 16-bit tensor against a
    contiguous master; a model of another dtype mixed in (compared apart)."""
    pairs = _pairs(BF16, 2)
    pairs[1][1].view(-1)[3] += 1.0
    high = torch.randn(6, 5)
    low = torch.empty(5, 6, dtype=BF16).t()  # (6, 5), transposed strides
    low.copy_(high)
    pairs.append((low, high))
    pairs.append((torch.randn(6, 5).t().to(BF16), torch.randn(5, 6)))
    half = torch.randn(9)
    pairs.append((half.to(FP16), half))
    pairs.append((half.to(FP16) + 1, half))
    assert not pairs[-4][0].is_contiguous() and pairs[-4][1].is_contiguous()
    assert unrounded(pairs) == _reference(pairs) == [1, len(pairs) - 3, len(pairs) - 1]


def test_signed_zeros_and_nans():
    """-0.0 against 0.0 rounds to it (as ``torch.equal`` has it); a NaN written into the
    16-bit side is seen; a NaN on both sides with the same bits counts as rounding to it
    (the master already holds it: nothing to take in)."""
    high = torch.tensor([0.0, 1.0, -0.0, 2.0])
    low = high.to(BF16)
    low[0] = -0.0
    low[2] = 0.0
    pairs = [(low, high), (torch.ones(3, dtype=BF16), torch.ones(3))]
    assert unrounded(pairs) == [] == _reference(pairs)
    pairs[1][0][1] = float("nan")
    assert unrounded(pairs) == [1] == _reference(pairs)
    pairs[1][1][1] = float("nan")
    assert unrounded(pairs) == [1]  # (torch rounds an fp32 NaN to other bits than a NaN written in bf16)
    pairs[1][0].copy_(pairs[1][1])  # the master's NaN rounded: the same bits
    assert unrounded(pairs) == []


def test_the_kept_buffers_follow_the_shapes():
    """Two lists of other shapes in turn (a second model), then the first again."""
    a, b = _pairs(BF16, 3), _pairs(BF16, 4)[:3]
    b[2][0].view(-1)[0] += 1
    for _ in range(3):
        assert unrounded(a) == []
        assert unrounded(b) == [2]


@pytest.mark.parametrize("first_under", ["inference_mode", "meta_device"])
def test_the_kept_buffers_do_not_depend_on_the_first_callers_mode(first_under):
    """The first call for a list of shapes made inside ``torch.inference_mode()`` (a load
    of weights in an eval block) or under a default device (``torch.device("meta")``):
    that call and every later one, in or out of the mode, answer as ``rounds_to``."""
    pairs = [(h.to(BF16), h) for h in (torch.randn(3), torch.randn(4), torch.randn(2, 2))]
    old = pairs[1][0][0].clone()
    pairs[1][0][0] = old * 2 + 1
    mode = torch.inference_mode() if first_under == "inference_mode" else torch.device("meta")
    with mode:
        assert unrounded(pairs) == [1]
    assert unrounded(pairs) == [1]
    with torch.inference_mode():
        assert unrounded(pairs) == [1]
    pairs[1][0][0] = old
    assert unrounded(pairs) == []


def test_o2_weights_loaded_in_inference_mode_then_trained():
    """O2's load hook checks the model's weights against the masters inside the caller's
    ``torch.inference_mode()``; the steps after it (outside) check them again."""
    import ampkit as amp

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2")
    with torch.inference_mode():
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(model(torch.randn(4, 8)).float().pow(2).mean(), opt) as s:
            s.backward()
        opt.step()
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(model.parameters(), amp.master_params(opt)))
