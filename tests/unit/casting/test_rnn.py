"""nn.LSTM under CPU casting: torch 2.13's autocast lowers its oneDNN layer to 16 bits,
which oneDNN refuses on some CPUs; ampkit keeps it in fp32 there instead of failing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit.casting import engine as casting


def _lstm_runs_under_torch_autocast() -> bool:
    return casting.probe_rnn(torch.bfloat16)


def _model():
    torch.manual_seed(0)
    return nn.LSTM(8, 16, num_layers=2)


def test_lstm_trains_under_ampkit_casting_whatever_the_cpu():
    model = _model()
    x = torch.randn(5, 3, 8)
    with amp.autocast(device_type="cpu"):
        y, (h, c) = model(x)
        assert (x[0] @ x[0].T).dtype == torch.bfloat16  # the rest of the policy still lowers
    y.float().sum().backward()
    expected = torch.float32 if not _lstm_runs_under_torch_autocast() else torch.bfloat16
    assert y.dtype == expected
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.skipif(_lstm_runs_under_torch_autocast(), reason="this CPU runs 16-bit LSTM")
def test_lstm_in_fp32_matches_fp32_bitwise_where_torch_autocast_fails():
    model = _model()
    x = torch.randn(5, 3, 8)
    with pytest.raises(RuntimeError, match="primitive"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
    ref, _ = model(x)
    amp.init(device_type="cpu")
    try:
        out, _ = model(x)
    finally:
        amp.reset()
    assert torch.equal(out, ref)


def test_a_policy_choosing_promote_for_the_rnn_layer_keeps_its_choice():
    policy = amp.Policy(promote_ops=["mkldnn_rnn_layer"])
    model = _model()
    with amp.autocast(policy, device_type="cpu"):
        y, _ = model(torch.randn(5, 3, 8))
    assert y.dtype == torch.float32  # fp32 inputs and weights: promote keeps fp32
