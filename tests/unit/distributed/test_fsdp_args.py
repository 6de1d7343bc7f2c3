"""``ampkit.distributed.fully_shard`` refuses bad arguments before it shards anything (no
process group needed), and AmpState's tensor encoding of ampkit's state round-trips."""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit.levels import opt_level as opt_level_module


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"opt_level": "O4"}, "unknown opt_level 'O4': not an ampkit opt level; choose one of O0 .*O2K"),
        ({"opt_level": "O2", "dtype": torch.float32}, "dtype must be torch.bfloat16 or torch.float16"),
        ({"opt_level": "O2K", "dtype": torch.float16}, "compensated updates need bf16 weights"),
        ({"opt_level": "O2", "keep_fp32": ["nope.*"]}, "keep_fp32 glob 'nope.\\*' matches no module"),
        ({"opt_level": "O2", "units": ["blocks.*"]}, "units glob 'blocks.\\*' matches no module"),
        ({"opt_level": "O2", "units": [3]}, "units takes module classes or qualified-name globs"),
        ({"opt_level": "O2", "keep_fp32": [nn.functional.relu]}, "keep_fp32 takes module classes"),
        ({"opt_level": "O3", "keep_fp32": ["*"]}, "keeps the whole model fp32"),  # "*" matches "" too
        ({"opt_level": "O2K", "keep_fp32": [nn.Sequential]}, "keeps the whole model fp32"),
    ],
)
def test_bad_arguments_are_refused_before_sharding(kwargs, match):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(amp.AmpError, match=match):  # DistributedError; AmpError for keep_fp32 as initialize
        amp.distributed.fully_shard(model, **kwargs)
    assert amp.distributed.shard_plan(model) is None  # nothing applied
    assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in zip(before, model.parameters()))
    assert type(model) is nn.Sequential and not model._forward_pre_hooks and not model._forward_hooks


def test_a_norm_layer_as_the_whole_model_is_refused_at_o2():
    model = nn.LayerNorm(8)  # kept fp32 by O2's rule for norm layers: the whole model
    with pytest.raises(amp.DistributedError, match="keeps the whole model fp32"):
        amp.distributed.fully_shard(model, opt_level="O2")
    assert type(model) is nn.LayerNorm and amp.distributed.shard_plan(model) is None


def test_a_16_bit_model_and_a_non_module_are_refused():
    with pytest.raises(amp.DistributedError, match="takes an fp32 model"):
        amp.distributed.fully_shard(_model().bfloat16(), opt_level="O2")
    with pytest.raises(amp.DistributedError, match="takes an nn.Module"):
        amp.distributed.fully_shard("model", opt_level="O2")  # type: ignore[arg-type]


def test_amp_state_is_tensors_only_and_round_trips_with_type_checks():
    """AmpState saves every value of ampkit's state as a tensor (numbers as 0-dim int64,
    float64 or bool; strings and None are structure), and loads them back as the
    session's types, refusing a mistyped or misshapen entry with nothing changed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2K")
    for _ in range(2):
        with amp.scale_loss(model(torch.randn(4, 16)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    saved = amp.distributed.AmpState().state_dict()
    assert all(isinstance(v, torch.Tensor) for v in saved.values())
    steps_key = next(k for k in saved if k.endswith("/steps"))
    assert saved[steps_key].dtype == torch.int64 and int(saved[steps_key]) == 2
    assert any("compensation/buffers" in k for k in saved)
    with amp.scale_loss(model(torch.randn(4, 16)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()  # the session moved on: 3 steps
    for bad, match in ((torch.tensor(2.0), "expected an integer"), (torch.ones(2, dtype=torch.int64), "has shape")):
        with pytest.raises(amp.StateError, match=match):
            amp.distributed.AmpState().load_state_dict({**saved, steps_key: bad})
        assert amp.stats(opt).steps == 3  # nothing loaded
    with pytest.raises(amp.StateError, match="does not match this session"):
        amp.distributed.AmpState().load_state_dict({k: v for k, v in saved.items() if k != steps_key})
    moved = amp.distributed.AmpState().state_dict()
    assert any(not torch.equal(moved[k], saved[k]) for k in saved if "compensation/buffers" in k)
    amp.distributed.AmpState().load_state_dict(saved)
    after = amp.distributed.AmpState().state_dict()
    assert amp.stats(opt).steps == 2
    assert after.keys() == saved.keys() and all(torch.equal(after[k], saved[k]) for k in saved)  # bitwise
    amp.reset()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.parametrize(("level", "want"), [("O2K", torch.bfloat16), ("O2", torch.float16), ("O3", torch.float16)])
def test_fully_shard_takes_the_dtype_and_norms_initialize_takes(monkeypatch, level, want):
    """Without ``dtype``, ``fully_shard`` asks the level what ``initialize`` would use on
    the model's device: with CUDA's default (fp16, answered here through the function
    both ask), O2K is bf16 (compensation needs its range) and O2/O3 fp16 -- and the
    sharded model then sets up with ``initialize``'s own defaults. ``keep_norm_fp32=False``
    shards no fp32 norm unit, and an ``initialize`` that keeps the norms is refused."""
    import torch.distributed as dist

    import ampkit.distributed.fsdp as fsdp_module

    cuda_default = lambda device_type: torch.float16  # noqa: E731
    monkeypatch.setattr(opt_level_module, "default_dtype", cuda_default)
    monkeypatch.setattr(fsdp_module, "default_dtype", cuda_default, raising=False)  # (a copy of its own, once)
    assert opt_level_module.resolve_opt_level(level, "cpu").dtype == want
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        model = amp.distributed.fully_shard(_model(), opt_level=level)
        plan = amp.distributed.shard_plan(model)
        assert plan.dtype == want and plan.kept == (("1",) if level != "O3" else ())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)  # (O3 fp16: an eps fp16 holds)
        amp.initialize(model, opt, opt_level=level)  # its defaults agree: not refused
        amp.reset()
        if level == "O2":
            bare = amp.distributed.fully_shard(_model(), opt_level=level, keep_norm_fp32=False)
            assert amp.distributed.shard_plan(bare).kept == () and not amp.distributed.shard_plan(bare).keep_norm_fp32
            with pytest.raises(amp.DistributedError, match="keep_norm_fp32 is False in ampkit.distributed.fully_shard"):
                amp.initialize(bare, torch.optim.AdamW(bare.parameters(), lr=1e-2), opt_level=level)
            amp.initialize(bare, torch.optim.AdamW(bare.parameters(), lr=1e-2), opt_level=level, keep_norm_fp32=False)
            amp.reset()
    finally:
        amp.reset()
        dist.destroy_process_group()
