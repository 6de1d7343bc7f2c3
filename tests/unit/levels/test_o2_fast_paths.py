"""O2's fast gradient and weight paths give the old paths' results bit for bit.

Two paths under test (see ampkit.master and ampkit._kernels):

- the compiled bf16 rounding check (``rounds_to_bf16``) that finds edits made through
  ``.data`` to the model's 16-bit grads and weights, used for tensors of at least
  ``ROUND_CHECK_NUMEL`` elements in place of the chunked comparison;
- the produced 16-bit grad put back on the model when the backward pass ends (no
  rounded copy), where the fp32 master grad is its exact widening (scale 1, first
  backward into the master).

The models here have one weight of exactly ``ROUND_CHECK_NUMEL`` elements, so the
fast paths run on it; each loop runs once as it is and once with both fast paths
switched off, and every master, weight, grad and optimizer state must match bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ampkit as amp
from ampkit.levels import update_kernels as _kernels
from ampkit.levels.grad_mirror import GradMirror
from ampkit.levels.rounding import rounds_to as _rounds_to

BF16 = torch.bfloat16
N = _kernels.ROUND_CHECK_NUMEL


# --- the rounding check ----------------------------------------------------------------------


def _sources() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(N, generator=g) * 1e-2
    bf = normal.to(BF16).float()
    halfway = (bf.view(torch.int32) | 0x8000).view(torch.float32)  # ties: cast picks the even
    special = normal.clone()
    special[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3e38, -1e-38])
    special[6:12] = torch.tensor([1e-39, -2e-40, 1e-45, 2.0**-126, 2.0**113, -(2.0**120)])
    nan = normal.clone()
    nan[N // 3] = float("nan")
    return {
        "normal": normal,
        "wide range": torch.randn(N, generator=g) * torch.logspace(-30, 30, N),
        "bf16 values": bf,
        "halfway": halfway,
        "special": special,
        "nan": nan,  # NaN equals nothing, as torch.equal has it: never "unchanged"
    }


def _one_step_off(low: torch.Tensor, i: int, step: int) -> torch.Tensor:
    bits = low.view(torch.int16).clone()
    bits[i] += step
    return bits.view(BF16)


@pytest.mark.parametrize("kind", list(_sources()))
def test_rounding_check_answers_equal_only_when_the_cast_does(kind):
    g = _sources()[kind]
    low = g.to(BF16)
    assert _rounds_to(low, g) is (kind != "nan")
    fast = _kernels.rounds_to_bf16(low, g)
    if _kernels.resolve_mode("auto") == "compiled":
        assert _kernels.compiled_round_check() is not None
        # inf, huge values and fp32 subnormals go to the exact path
        assert fast is (None if kind in ("special", "nan") else True)
    for i in (0, 7, N // 2, N - 1):
        for step in (1, -1):
            edited = _one_step_off(low, i, step)
            exact = torch.equal(edited, g.to(BF16))
            assert _kernels.rounds_to_bf16(edited, g) in (None, True)
            if not exact:
                assert _kernels.rounds_to_bf16(edited, g) is None
            assert _rounds_to(edited, g) is exact


def test_halfway_values_rounded_to_the_odd_neighbour_count_as_edited():
    g = _sources()["halfway"]
    even = g.to(BF16)
    # The other neighbour of every halfway value: one step (in magnitude) from the
    # even one, on g's side.
    toward = torch.where(g.abs() > even.float().abs(), 1, -1).to(torch.int16)
    odd = (even.view(torch.int16) + toward).view(BF16)
    assert ((odd.float() - g).abs() == (even.float() - g).abs()).all()
    assert (odd.view(torch.int16) & 1).all() and not (even.view(torch.int16) & 1).any()
    assert _kernels.rounds_to_bf16(odd, g) is None
    assert _rounds_to(odd, g) is False


def test_rounding_check_leaves_small_or_other_tensors_to_the_exact_path():
    g = torch.randn(N)
    assert _kernels.rounds_to_bf16(g[: N - 1].to(BF16), g[: N - 1]) is None
    assert _kernels.rounds_to_bf16(g.half(), g) is None
    t = g.view(512, 256)
    assert _kernels.rounds_to_bf16(t.t().to(BF16), t.t()) is None  # not contiguous


# --- whole loops: fast paths against the old ones ---------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 512 * 256 = ROUND_CHECK_NUMEL weights in the first layer; the rest stay small.
    return nn.Sequential(nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 4))


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + i)
    x, y = torch.randn(4, 512, generator=g), torch.randn(4, 4, generator=g)
    return F.mse_loss(model(x).float(), y)


def _backward(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    with amp.scale_loss(_loss(model, i), opt) as scaled:
        scaled.backward()


IDIOMS = [
    "plain",
    "clip model params",
    "grad.data edit",
    "grad.data.zero_",
    "weight.data.clamp_",
    "two micro-batches",
    "model.zero_grad(set_to_none=False)",
    "opt.zero_grad(set_to_none=False)",
    "model.zero_grad()",
    "p.grad = None",
    "read grads after step",
    "optimizer edits grads in place",
]


class _HalvingAdamW(torch.optim.AdamW):
    """Changes the grads it steps in place (as some third-party optimizers do)."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        return super().step(closure)


def _train(idiom: str, steps: int = 3, master_grads: str = "always") -> tuple[list[torch.Tensor], dict]:
    model = _model()
    cls = _HalvingAdamW if idiom == "optimizer edits grads in place" else torch.optim.AdamW
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", master_grads=master_grads)
    big = model[0].weight
    seen: list[torch.Tensor] = []
    for i in range(steps):
        if idiom == "model.zero_grad(set_to_none=False)":
            model.zero_grad(set_to_none=False)
        elif idiom == "opt.zero_grad(set_to_none=False)":
            opt.zero_grad(set_to_none=False)
        elif idiom == "model.zero_grad()":
            model.zero_grad()
        elif idiom == "p.grad = None":
            for p in model.parameters():
                p.grad = None
        else:
            opt.zero_grad()
        _backward(model, opt, i)
        if idiom == "two micro-batches":
            _backward(model, opt, 100 + i)
        seen.append(big.grad.detach().clone())
        if idiom == "clip model params":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif idiom == "grad.data edit":
            big.grad.data[:7].mul_(-3.0)
        elif idiom == "grad.data.zero_":
            big.grad.data.zero_()
        elif idiom == "weight.data.clamp_":
            big.data.clamp_(-0.03, 0.03)
        opt.step()
        if idiom in ("read grads after step", "optimizer edits grads in place"):
            seen.append(big.grad.detach().clone())
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    out = masters + [p.detach().clone() for p in model.parameters()]
    out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    out += [m.grad.clone() for m in amp.master_params(opt) if m.grad is not None]
    out += seen
    return out, opt.state_dict()["state"]


def _old_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernels, "ROUND_CHECK_NUMEL", 1 << 62)
    monkeypatch.setattr("ampkit.levels.grad_mirror.KEEP_ASIDE_DEVICES", ())
    absorb = GradMirror.absorb
    monkeypatch.setattr(GradMirror, "absorb", lambda self, p, unscale, keep=False: absorb(self, p, unscale))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


@pytest.mark.parametrize("idiom", IDIOMS)
def test_o2_fast_paths_give_the_old_paths_results_bitwise(idiom, monkeypatch):
    calls = []
    check = _kernels.rounds_to_bf16
    monkeypatch.setattr(
        "ampkit.levels.rounding.rounds_to_bf16", lambda low, g: calls.append(low.numel()) or check(low, g)
    )
    fast, fast_state = _train(idiom)
    assert N in calls  # the big weight's grad and weight went through the rounding check
    with monkeypatch.context() as m:
        _old_paths(m)
        old, old_state = _train(idiom)
    assert len(fast) == len(old)
    assert all(_same_bits(a, b) for a, b in zip(fast, old))
    assert fast_state.keys() == old_state.keys()
    for k in fast_state:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert _same_bits(fast_state[k][name], old_state[k][name])


def test_o2_data_edits_of_a_large_grad_and_weight_take_effect():
    """The edits of the loop above are not lost: a zeroed grad steps only the weight
    decay, a clamped weight is taken into its master before the step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O2")
    big = model[0].weight
    master = amp.levels.master_weights_of(opt).master_of(big)
    _backward(model, opt, 0)
    before = master.detach().clone()
    big.grad.data.zero_()
    opt.step()
    assert torch.equal(master, before)  # zero grad, no momentum: nothing moves
    _backward(model, opt, 1)
    big.data.clamp_(-0.01, 0.01)
    clamped = big.detach().float().clone()
    opt.step()
    assert master.grad is not None
    assert torch.equal(master.detach(), clamped - 0.5 * master.grad)


def test_o2_model_grad_after_backward_is_the_produced_grad_unrounded():
    """Scale 1, first backward: the model shows the very grad backward produced
    (what a bf16 model without masters would hold), the master its exact widening."""
    model = _model()
    reference = _model().to(BF16)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2")
    _backward(model, opt, 0)
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(4, 512, generator=g), torch.randn(4, 4, generator=g)
    F.mse_loss(reference(x.to(BF16)).float(), y).backward()
    mw = amp.levels.master_weights_of(opt)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == BF16
        assert torch.equal(p.grad, q.grad)
        assert torch.equal(mw.master_of(p).grad, p.grad.float())


def test_o2_on_cpu_the_grad_copies_come_back_after_the_step_as_they_were():
    """Taken off the model while the optimizer steps (a global optimizer pre-hook, which
    runs inside the optimizer's own step, sees none), the same 16-bit tensors come back
    after it (no new allocation on CPU) and still show the master grads; where the step
    changed a master grad, a fresh copy shows it."""
    model = _model()
    opt = _HalvingAdamW(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", master_grads="always")
    at_step = []
    handle = register_optimizer_step_pre_hook(
        lambda o, a, k: at_step.extend(p.grad for p in model.parameters()) if o is opt else None
    )
    _backward(model, opt, 0)
    before = [p.grad for p in model.parameters()]
    try:
        opt.step()
    finally:
        handle.remove()
    assert at_step and all(g is None for g in at_step)
    mw = amp.levels.master_weights_of(opt)
    for p, g in zip(model.parameters(), before):
        assert p.grad is not g  # halved by the step: shown anew
        assert torch.equal(p.grad, mw.master_of(p).grad.to(BF16))
    model2 = _model()
    opt = torch.optim.AdamW(model2.parameters())
    model2, opt = amp.initialize(model2, opt, opt_level="O2", master_grads="always")
    _backward(model2, opt, 0)
    before = [p.grad for p in model2.parameters()]
    values = [g.clone() for g in before]
    opt.step()
    mw = amp.levels.master_weights_of(opt)
    for p, g, v in zip(model2.parameters(), before, values):
        assert p.grad is g and torch.equal(g, v)
        assert torch.equal(p.grad, mw.master_of(p).grad.to(BF16))


@pytest.mark.parametrize("rule", ["cpu", "off"])
def test_o2_produced_grad_is_kept_on_cpu_and_freed_at_once_elsewhere(rule, monkeypatch):
    """On CPU the produced grad is kept aside (it becomes the model's copy); where
    16-bit grads are not kept (devices with a caching allocator; here CPU with the rule
    switched off) it is freed as soon as it moved into the fp32 master. Either way the
    model shows the master grad rounded after backward."""
    if rule == "off":
        monkeypatch.setattr("ampkit.levels.grad_mirror.KEEP_ASIDE_DEVICES", ())
    import weakref

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", master_grads="always")
    weight = model[0].weight
    refs = []
    alive = []
    absorb = GradMirror.absorb

    def spy(self, p, unscale, keep=False):  # the grad AccumulateGrad stored, as ampkit gets it
        if p is weight:
            refs.append(weakref.ref(p.grad))
        absorb(self, p, unscale, keep)

    monkeypatch.setattr(GradMirror, "absorb", spy)
    weight.register_post_accumulate_grad_hook(lambda p: alive.append(refs[-1]() is not None))
    _backward(model, opt, 0)
    assert alive == [rule == "cpu"]  # kept aside, or nothing holds it once ampkit's hook ran
    assert (weight.grad is refs[-1]()) is (rule == "cpu")
    mw = amp.levels.master_weights_of(opt)
    assert torch.equal(weight.grad, mw.master_of(weight).grad.to(BF16))


class _TiedProbe(nn.Module):
    """An fp32 weight used by two children (an embedding kept in fp32, tied to the head,
    which is called twice),
    and a record, taken inside the forward, of whether the global module hooks are on,
    torch's autocast cache is on and autocast is."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.seen: list[tuple[bool, bool, bool]] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from ampkit.casting import engine as casting

        self.seen.append((casting.module_hooks.installed(), torch.is_autocast_cache_enabled(),
                          torch.is_autocast_enabled("cpu")))  # fmt: skip
        h = self.norm(self.emb(idx))
        return self.head(h) + self.head(h * 0.5)  # two calls of one child: two casts of the weight


@pytest.mark.fresh_process  # one thread: the global hooks go when the last scope closes
@pytest.mark.parametrize("level", ["O2", "O2K"])  # (O3 runs no op-level scope)
def test_a_cast_models_scope_puts_the_global_module_hooks_on_only_for_module_rules(level):
    """The global module hooks make every module call take torch's slower path: a cast
    model's own scope puts them on only where its policy has module rules to apply.
    Without them no child call starts a cast cache (fp32 weights are cast at each use, as
    in compiled code); every switch is as it was after the call; a model whose fp32
    weight two children use computes the same bits, grads included, either way."""
    from ampkit.casting import engine as casting

    results = []
    for use_rules in (False, True):
        amp.reset()
        torch.manual_seed(0)
        model = _TiedProbe()
        opt = torch.optim.AdamW(model.parameters())
        policy = amp.Policy(dtype=BF16, module_rules={"head": BF16}) if use_rules else None  # (its dtype anyway)
        model, opt = amp.initialize(model, opt, opt_level=level, dtype=BF16, policy=policy, keep_fp32=["emb"])
        assert model.emb.weight.dtype == torch.float32
        cache_before = torch.is_autocast_cache_enabled()
        idx = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
        out = model(idx)
        hooks_on, cache_on, autocast_on = model.seen[-1]
        assert hooks_on is use_rules and autocast_on
        assert cache_on is False  # (a child's call would start one, with the hooks on)
        assert torch.is_autocast_cache_enabled() is cache_before and not torch.is_autocast_enabled("cpu")
        out.float().square().mean().backward()
        results.append([out] + [p.grad for p in model.parameters()])
        assert not casting.module_hooks.installed()  # one thread, no scope left open
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*results))
