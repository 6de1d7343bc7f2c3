"""State that ampkit makes for its update kernels (the optimizer's moments and momentum,
O2K's compensation) is made as consecutive pieces of one buffer,
and a kernel runs on that buffer in place of copying the pieces in and out
(``update_kernels.tiled``). What must hold: the same values as the staged path, bit for
bit, through skipped steps, swapped and reloaded state; and nothing tiled that is not."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ampkit as amp
from ampkit.levels import update_kernels as uk
from ampkit.trainer.optimizer_rules import zeros_tiled

INF, NAN = float("inf"), float("nan")


def _model() -> torch.nn.Module:
    """Twelve small 16-bit tensors (more than the kernels' ``BATCH_MIN_COUNT``: one
    batched call) and an fp32 norm."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))


OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
}
SETUPS = [("O2", torch.bfloat16), ("O2", torch.float16), ("O2K", torch.bfloat16)]
# per step: None (clean), ("inf", i) an inf written into parameter i's grad (a skipped
# step), "swap" (every state tensor of the sixth parameter replaced through ``.data`` and
# the eighth's by a new tensor), "reload" (the optimizer's own state_dict round trip)
PLAN = [None, None, ("inf", 2), None, "swap", None, ("inf", 0), "reload", None, None]


def _run(level: str, dtype: torch.dtype, opt_name: str) -> list[list[torch.Tensor]]:
    amp.reset()
    model = _model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    seen = []
    for edit in PLAN:
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
            scaled.backward()
        if isinstance(edit, tuple):
            list(model.parameters())[edit[1]].grad.view(-1)[0] = INF
        elif edit == "swap":
            states = list(opt.state.values())
            first, second = states[5], states[7]  # (inside the tiled run: the first two are checked apart)
            for v in first.values():
                if torch.is_tensor(v) and v.dim():
                    v.data = v.data.clone()
            for key, v in second.items():
                if torch.is_tensor(v) and v.dim():
                    second[key] = v.clone()
        elif edit == "reload":
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        opt.step()
        opt.zero_grad()
        state = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        seen.append([p.detach().clone() for p in model.parameters()]
                    + [p.detach().clone() for p in amp.master_params(opt)] + state)  # fmt: skip
    amp.reset()
    return seen


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize(("level", "dtype"), SETUPS, ids=["O2-bf16", "O2-fp16", "O2K"])
def test_kernels_on_tiled_state_equal_the_staged_path_bitwise(level, dtype, opt_name, monkeypatch):
    """Every parameter, master and state tensor after each step, through two skipped
    steps, state swapped through ``.data`` and by a new tensor, and a state_dict round
    trip: the same bits with the kernels on the tiled buffers as with every role staged."""
    calls = {"direct": 0}
    real = uk.tiled

    def counted(role):
        out = real(role)
        calls["direct"] += out is not None
        return out

    monkeypatch.setattr(uk, "tiled", counted)
    tiled_run = _run(level, dtype, opt_name)
    # the tiled path ran (fp16 O2 on a CPU: torch's own step on the tiled masters)
    assert calls["direct"] > 0 or dtype == torch.float16
    monkeypatch.setattr(uk, "tiled", lambda role: None)
    staged_run = _run(level, dtype, opt_name)
    for step, (got, want) in enumerate(zip(tiled_run, staged_run)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (step, a.shape)


def _trained(level: str, model: torch.nn.Module, steps: int = 2, opt_cls=torch.optim.AdamW):
    amp.reset()
    model, opt = amp.initialize(model, opt_cls(model.parameters(), lr=1e-2), opt_level=level, dtype=torch.bfloat16)
    for _ in range(steps):
        with amp.scale_loss(model(torch.randn(4, model[0].in_features)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_the_state_ampkit_makes_is_tiled_and_a_kernel_reads_it_in_place():
    """After the first steps: the moments of the parameters ampkit's kernels step lie one
    after another in one buffer (O2: of the fp32 masters, which are not tiled: each keeps
    a version counter of its own); O2K's compensation buffers too."""
    for level in ("O2", "O2K"):
        model, opt = _trained(level, _model())
        if level == "O2":
            model_ids = {id(p) for p in model.parameters()}
            stepped = [p for p in amp.master_params(opt) if id(p) not in model_ids]  # (the fp32 norm has none)
            assert len(stepped) == 14 and uk.tiled(stepped) is None
        else:
            stepped = [p for p in model.parameters() if p.dtype == torch.bfloat16]
            comp = amp.levels.compensation_of(opt)
            assert len(stepped) == 14 and uk.tiled([comp.buffer(p) for p in stepped]) is not None
        for key in ("exp_avg", "exp_avg_sq"):
            assert uk.tiled([opt.state[p][key] for p in stepped]) is not None
    amp.reset()


def test_small_tensors_are_tiled_apart_from_large_ones_in_one_group(monkeypatch):
    """One param group of large weights between small biases and norms (the usual
    ``AdamW(model.parameters())``): the small ones are tiled (the kernel's batch runs on
    their buffer), the large ones made apart, each with the strides ``zeros_like`` gives."""
    torch.manual_seed(0)
    blocks = []
    for _ in range(5):  # (ten small 16-bit tensors: more than the kernels batch from)
        blocks += [torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64), torch.nn.LayerNorm(64)]
    direct = []
    real = uk.tiled
    monkeypatch.setattr(uk, "tiled", lambda role: direct.append(real(role)) or direct[-1])
    model, opt = _trained("O2K", torch.nn.Sequential(*blocks))
    assert any(t is not None for t in direct)
    low = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    small = [p for p in low if p.numel() < (1 << 14)]
    assert len(small) == 10 and uk.tiled([opt.state[p]["exp_avg"] for p in small]) is not None
    for p in low:
        assert opt.state[p]["exp_avg"].stride() == p.stride()
    amp.reset()


def test_channels_last_state_keeps_the_parameters_strides():
    """A 1x1 channels_last kernel counts as contiguous but has other strides: its state and
    compensation are made with its own strides (the dedicated kernel then steps it)."""
    torch.manual_seed(0)
    convs = torch.nn.Sequential(*[torch.nn.Conv2d(4, 4, 1) for _ in range(6)]).to(memory_format=torch.channels_last)
    amp.reset()
    convs, opt = amp.initialize(convs, torch.optim.AdamW(convs.parameters(), lr=1e-2), opt_level="O2K",
                                dtype=torch.bfloat16)  # fmt: skip
    for _ in range(2):
        x = torch.randn(2, 4, 3, 3).to(memory_format=torch.channels_last)
        with amp.scale_loss(convs(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    comp = amp.levels.compensation_of(opt)
    for p in convs.parameters():
        assert opt.state[p]["exp_avg"].stride() == p.stride() == comp.buffer(p).stride()
    amp.reset()


def test_a_kernel_writing_through_the_buffer_raises_the_version_autograd_checks():
    """Parameters a user laid out in one buffer of their own are written through it at
    O2K: a backward through a graph built before the step must still fail as it does
    for any in-place change (autograd's version check), not use the stepped weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(12)])
    amp.reset()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), opt_level="O2K",
                                dtype=torch.bfloat16)  # fmt: skip
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.bfloat16)
    offset = 0
    for p in params:
        view = flat[offset:offset + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
        offset += p.numel()
    x = torch.randn(4, 8)
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    before = model(x).float().pow(2).mean()
    direct = []
    real = uk.tiled
    uk_tiled = uk.tiled
    try:
        uk.tiled = lambda role: direct.append(real(role)) or direct[-1]
        opt.step()
    finally:
        uk.tiled = uk_tiled
    assert direct and direct[0] is not None  # the weights went through their buffer
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with amp.scale_loss(before, opt) as scaled:
            scaled.backward()
    amp.reset()


def test_tiled_refuses_what_is_not_one_gapless_buffer():
    flat = torch.arange(12.0)
    a, b, c = flat[:4], flat[4:6], flat[6:12].view(2, 3)
    whole = uk.tiled([a, b, c])
    assert whole is not None and whole.data_ptr() == flat.data_ptr() and torch.equal(whole, flat)
    assert uk.tiled([a, flat[5:7]]) is None  # a gap
    assert uk.tiled([b, a]) is None  # out of order
    assert uk.tiled([a, b, flat[6:12].view(3, 2).t()]) is None  # not contiguous
    assert uk.tiled([a, b.view(torch.int32)]) is None  # another dtype
    assert uk.tiled([a, torch.zeros(2)]) is None  # made apart
    neg = torch._neg_view(flat[4:6])
    assert uk.tiled([a, neg]) is None  # a lazily negated view of the next piece
    b.data = torch.zeros(2)  # swapped through .data: the same object, other memory
    assert uk.tiled([a, b]) is None

    class Sub(torch.Tensor):
        pass

    assert uk.tiled([flat[:4].as_subclass(Sub), flat[4:8]]) is None


def _aliasing_kernel() -> uk.Kernel:
    def fn(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> None:
        a.add_(1.0)
        b.mul_(2.0)

    return uk.Kernel("aliasing roles", fn, mutated=(0, 1), example_dtypes=(torch.float32, torch.float32))


@pytest.mark.parametrize("order", ["same", "reversed"])
def test_roles_that_alias_each_other_give_what_the_staged_path_gives(order, monkeypatch):
    """Two roles over the same memory (the same tiled list, or its pieces in reverse
    order, which is staged): written back in role order, as when every role is staged."""
    results = []
    for tiled_on in (True, False):
        if not tiled_on:
            monkeypatch.setattr(uk, "tiled", lambda role: None)
        flat = torch.arange(20.0)
        b = list(flat.split(2))
        a = list(b) if order == "same" else list(reversed(b))
        _aliasing_kernel()([a, b], torch.tensor([0.0]), mode="eager", chunk_numel=1 << 20, batch_numel=1 << 20)
        results.append(flat)
    assert torch.equal(results[0], results[1])


def test_zeros_tiled_tiles_only_small_plain_contiguous_tensors_of_one_kind():
    likes = [torch.ones(3, 2), torch.ones(1 << 14), torch.ones(5), torch.ones(2, 2)]
    out = zeros_tiled(likes)
    assert [t.shape for t in out] == [t.shape for t in likes] and all(t.eq(0).all() for t in out)
    assert uk.tiled([out[0], out[2], out[3]]) is not None  # the small ones, the large one apart
    assert out[1].untyped_storage().data_ptr() != out[0].untyped_storage().data_ptr()
    channels_last = torch.ones(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    one_by_one = torch.ones(4, 4, 1, 1).as_strided((4, 4, 1, 1), (4, 1, 4, 4))  # as .to(channels_last) makes it
    out = zeros_tiled([torch.ones(3), channels_last, one_by_one, torch.ones(2)])
    assert out[1].stride() == channels_last.stride() and out[2].stride() == one_by_one.stride()
    assert uk.tiled([out[0], out[3]]) is not None
    out = zeros_tiled([torch.ones(3), torch.ones(3, dtype=torch.bfloat16)])
    assert [t.dtype for t in out] == [torch.float32, torch.bfloat16]
