"""init_trainer's default scale when the compute dtype shows only in the scopes: fp32
parameters, no amp.init, ``ampkit.autocast(dtype=...)`` around the forward."""

from __future__ import annotations

import warnings

import pytest
import torch

import ampkit as amp
from ampkit.trainer.api import managed_state


def _steps(dtypes, seed: int = 0):
    """A Linear under init_trainer's default, one step per scope dtype in ``dtypes``
    (None: no scope); returns the scaler's (dynamic, scale) after each step and the
    final weight."""
    amp.reset()
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    opt = amp.init_trainer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scaler = managed_state(opt).scalers[0]
    seen = []
    for dtype in dtypes:
        scope = amp.autocast(device_type="cpu", dtype=dtype) if dtype is not None else amp.autocast(enabled=False)
        with scope:
            loss = model(torch.randn(2, 4)).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        seen.append((scaler.dynamic, scaler.scale))
    weight = model.weight.detach().clone()
    amp.reset()
    return seen, weight


def test_bf16_scopes_get_the_static_scale_bf16_parameters_get():
    """The first scale_loss after bf16 scopes settles the default on a static 1, as
    init_trainer picks for bf16 parameters; the run is bitwise the one with scaler=1."""
    seen, weight = _steps([torch.bfloat16] * 3)
    assert seen == [(False, 1.0)] * 3
    amp.reset()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = amp.init_trainer(torch.optim.AdamW(model.parameters(), lr=1e-2), 1.0)
    for _ in range(3):
        with amp.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(2, 4)).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(model.weight, weight)
    amp.reset()


@pytest.mark.filterwarnings("ignore:ampkit. float16 on CPU")
def test_fp16_scopes_or_none_keep_the_dynamic_scale():
    assert [d for d, _ in _steps([torch.float16, torch.bfloat16])[0]] == [True, True]
    assert [d for d, _ in _steps([None, torch.bfloat16])[0]] == [True, True]  # told nothing at the first


@pytest.mark.filterwarnings("ignore:ampkit. float16 on CPU")
def test_an_fp16_scope_after_the_static_choice_turns_it_dynamic_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen, _ = _steps([torch.bfloat16, torch.float16, torch.bfloat16])
    assert seen[0] == (False, 1.0)
    assert seen[1][0] and seen[2][0]  # dynamic from the fp16 scope's scale_loss on
    assert sum("scales dynamically from now on" in str(w.message) for w in caught) == 1


def test_a_scaler_given_or_bf16_parameters_are_not_second_guessed():
    amp.reset()
    model = torch.nn.Linear(4, 4)
    opt = amp.init_trainer(torch.optim.AdamW(model.parameters()), amp.LossScaler(init_scale=8.0))
    with amp.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(2, 4)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    scaler = managed_state(opt).scalers[0]
    assert (scaler.dynamic, scaler.scale) == (True, 8.0)
    amp.reset()
