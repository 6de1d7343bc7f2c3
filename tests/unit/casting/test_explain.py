"""ampkit.explain reports each op's dtypes and the casts inserted."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ampkit as amp


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2))


def test_explain_default_policy_counts_ops_and_casts():
    model, x = _model(), torch.randn(3, 8)
    rep = amp.explain(model, x, device_type="cpu")
    assert [r.op for r in rep.records] == ["addmm", "relu", "native_layer_norm", "addmm"]
    assert all(r.compute_dtype == torch.bfloat16 for r in rep.records)
    first = rep.records[0]
    # input, weight and bias of the first linear were cast fp32 -> bf16 for it
    assert [(c.src, c.dst) for c in first.casts] == [(torch.float32, torch.bfloat16)] * 3
    assert rep.records[1].casts == ()
    t = rep.totals
    assert t["ops_bf16"] == 4 and t["ops_fp32"] == 0 and t["casts"] == 5
    text = str(rep)
    assert "addmm" in text and "5 casts" in text
    json.dumps(rep.to_dict())  # plain data


def test_explain_shows_policy_changes_and_module_rules():
    model, x = _model(), torch.randn(3, 8)
    policy = amp.Policy(module_rules={nn.LayerNorm: torch.float32}, fp32_ops=[torch.relu])
    rep = amp.explain(model, x, policy=policy, device_type="cpu")
    dtypes = {r.op: r.compute_dtype for r in rep.records}
    assert dtypes["relu"] == torch.float32
    assert dtypes["native_layer_norm"] == torch.float32
    assert rep.ops_in(torch.bfloat16) == ["addmm", "addmm"]
    # relu's input came from a bf16 addmm: it was cast up
    relu = next(r for r in rep.records if r.op == "relu")
    assert [(c.src, c.dst) for c in relu.casts] == [(torch.bfloat16, torch.float32)]


def test_explain_inside_active_scope_uses_it():
    model, x = _model(), torch.randn(3, 8)
    amp.init(device_type="cpu", fp32_ops=[nn.functional.linear])
    rep = amp.explain(model, x)
    amp.reset()
    assert rep.ops_in(torch.bfloat16) == []
    assert rep.totals["casts"] == 0


@pytest.mark.parametrize("bad", ["x", 3, None])
def test_explain_refuses_a_non_callable_with_an_amp_error(bad):
    with pytest.raises(amp.AmpError, match="function or an nn.Module"):
        amp.explain(bad, torch.randn(2, 2), device_type="cpu")
    assert not amp.is_active()


def test_explain_refuses_a_non_policy_before_running_anything():
    calls = []
    with pytest.raises(amp.PolicyError, match="ampkit.Policy"):
        amp.explain(lambda x: calls.append(x), torch.randn(2), policy="bf16", device_type="cpu")
    assert calls == []
