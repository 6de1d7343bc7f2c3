"""A user's ``Tensor.register_post_accumulate_grad_hook`` at O2: ampkit's own hook moves
each 16-bit grad into its fp32 master, and runs first (also before hooks registered
before ``initialize``). A parameter with hooks of its own gets its 16-bit copy of the
real (unscaled) gradient at once, so they read ``p.grad`` as after backward: grad
logging sees the gradient, an edit reaches the step, and torch's "optimizer step in
backward" recipe (one optimizer per parameter, stepped and cleared in the hook) trains
exactly as stepping after backward, once those optimizers are the ones given to
``initialize``. The parameters stepped as they are (O1, O3, O2's fp32 norm layers) are
unscaled at once for such hooks too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp

torch.set_num_threads(1)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    return F.mse_loss(model(x).float(), y)


def _log_into(logged: dict[str, list[torch.Tensor]], model: nn.Module) -> None:
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: logged.setdefault(name, []).append(None if p.grad is None else p.grad.clone())
        )


def _memory_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """"cpu": CPU's own path (16-bit grads held or kept aside); "freed": the path of
    devices with a caching allocator, where each 16-bit grad is freed as it moves."""
    if path == "freed":
        monkeypatch.setattr("ampkit.levels.grad_mirror.KEEP_ASIDE_DEVICES", ())
        monkeypatch.setattr("ampkit.levels.grad_mirror.ON_DEMAND_DEVICES", ())


@pytest.mark.parametrize("registered", ["after", "before"], ids=["hooks-after-initialize", "hooks-before-initialize"])
@pytest.mark.parametrize("path", ["cpu", "freed"])
@pytest.mark.parametrize("master_grads", ["on_demand", "always"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_a_hook_reads_the_real_gradient_in_16_bits(dtype, master_grads, path, registered, monkeypatch):
    """Logged in the hook: exactly what ``p.grad`` holds after backward (the real,
    unscaled gradient in the model's dtype; fp16 runs with its loss scale of 2**16), for
    one backward and for the sum of two; and the fp32 model's gradient to within 16-bit
    precision (3% of its largest element at bf16, 0.5% at fp16)."""
    _memory_path(path, monkeypatch)
    reference = _model()
    for i in range(2):
        _loss(reference, i).backward()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged: dict[str, list[torch.Tensor]] = {}
    if registered == "before":
        _log_into(logged, model)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=DTYPES[dtype], master_grads=master_grads)
    if registered == "after":
        _log_into(logged, model)
    for i in range(2):
        with amp.scale_loss(_loss(model, i), opt) as scaled:
            scaled.backward()
        assert amp.stats(opt).scales == ((2.0**16,) if dtype == "fp16" else (1.0,))
        for name, p in model.named_parameters():
            seen = logged[name][i]
            assert seen is not None and seen.dtype == p.dtype and torch.equal(seen, p.grad), name
    for (name, _), ref in zip(model.named_parameters(), reference.parameters()):
        err = (logged[name][1].float() - ref.grad).abs().max() / ref.grad.abs().max()
        assert err < (0.03 if dtype == "bf16" else 0.005), name


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_a_hook_reads_the_real_gradient_where_parameters_are_stepped_as_they_are(level):
    """The same where the optimizer steps the parameters themselves (fp32 at O1, fp16 at
    O3), at a loss scale of 2**16: the hook reads ``p.grad`` unscaled, as after backward,
    for one backward and for the sum of two."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, dtype=torch.float16, loss_scale="dynamic")
    logged: dict[str, list[torch.Tensor]] = {}
    _log_into(logged, model)
    for i in range(2):
        with amp.scale_loss(_loss(model, i), opt) as scaled:
            scaled.backward()
        assert amp.stats(opt).scales == (2.0**16,)
        for name, p in model.named_parameters():
            assert torch.equal(logged[name][i], p.grad), name


def test_torch_runs_post_accumulate_hooks_in_the_dict_order_ampkit_sets():
    """``post_accumulate_hooks_first``: the hook it names runs first, the others keep
    their order, hooks added later run last, and every handle still removes its hook."""
    from ampkit._internal import torch_compat

    p = nn.Parameter(torch.ones(2))
    order: list[int] = []
    first = p.register_post_accumulate_grad_hook(lambda t: order.append(1))
    p.register_post_accumulate_grad_hook(lambda t: order.append(2))
    ours = p.register_post_accumulate_grad_hook(lambda t: order.append(0))
    hooks = torch_compat.post_accumulate_hooks_first(p, ours.id)
    p.register_post_accumulate_grad_hook(lambda t: order.append(3))
    p.sum().backward()
    assert order == [0, 1, 2, 3] and len(hooks) == 4
    first.remove()
    order.clear()
    p.sum().backward()
    assert order == [0, 2, 3]


def test_a_hook_that_edits_the_gradient_edits_what_the_step_uses():
    """Halving ``p.grad`` in the hook (per-parameter clipping, say) halves the fp32
    gradient the optimizer steps (a master's; the fp32 norm layer's own)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, master_grads="always")
    masters = amp.levels.master_weights_of(opt)

    def halve(p: torch.Tensor) -> None:
        p.grad.mul_(0.5)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(halve)
    with amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()
    reference = _model()
    _loss(reference, 0).backward()
    amp.unscale(opt)  # merges the model's edits into the masters
    for p, ref in zip(model.parameters(), reference.parameters()):
        master = masters.master_of(p)
        g = (p if master is None else master).grad  # the norm layer's fp32 params: their own
        assert torch.allclose(g, ref.grad * 0.5, rtol=2e-3, atol=2e-3 * ref.grad.abs().max())


def _train(dtype: torch.dtype | None, make_opt, mode: str, scaled: bool, steps: int = 6) -> list[torch.Tensor]:
    """One optimizer per parameter, ``mode``: "after" / "before" (torch's recipe: each
    stepped and cleared in a post-accumulate hook registered after or before
    ``initialize``, no step in the loop) or "loop" (all stepped after backward).
    ``dtype`` None: fp32, without ampkit."""
    model = _model()
    optimizers = {p: make_opt(p) for p in model.parameters()}

    def step_in_backward(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    def hook_all() -> None:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_in_backward)

    if mode == "before":
        hook_all()
    if dtype is not None:
        model, _ = amp.initialize(model, list(optimizers.values()), opt_level="O2", dtype=dtype)
    if mode == "after":
        hook_all()
    for i in range(steps):
        loss = _loss(model, i)
        if scaled:
            with amp.scale_loss(loss, list(optimizers.values())) as s:
                s.backward()
        else:
            loss.backward()
        if mode == "loop":
            for opt in optimizers.values():
                opt.step()
                opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    weights = [p.detach().float().clone() for p in model.parameters()]
    amp.reset()
    return weights


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD([p], lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW([p], lr=1e-2, foreach=False),
}
#: how far six steps at O2 may end from the fp32 run (the weights' 16-bit rounding and
#: the 16-bit forward and backward, which AdamW's normalized steps amplify in bf16: 0.02
#: measured; the same for the loop stepping after backward)
FP32_GAP = {"fp16": 2e-3, "bf16": 5e-2}


@pytest.mark.parametrize("registered", ["after", "before"], ids=["hooks-after-initialize", "hooks-before-initialize"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_optimizer_step_in_backward_trains_as_stepping_after_backward(dtype, opt_name, registered):
    """The recipe with the per-parameter optimizers given to ``initialize`` and the loss
    scaled for all of them: each hook steps the fp32 master with the real gradient (fp16
    at a loss scale of 2**16: SGD would move 65536 times too far on scaled grads) and
    publishes the 16-bit weight. After six steps the weights equal, bitwise, those of
    the same O2 run stepping after backward (a parameter's update in its hook changes
    nothing backward still computes), and are the fp32 run's to within ``FP32_GAP``."""
    make = OPTIMIZERS[opt_name]
    fp32 = _train(None, make, registered, scaled=False)
    loop = _train(DTYPES[dtype], make, "loop", scaled=True)
    got = _train(DTYPES[dtype], make, registered, scaled=True)
    for a, b, ref in zip(got, loop, fp32):
        assert torch.equal(a, b), (a - b).abs().max()
        assert (a - ref).abs().max() < FP32_GAP[dtype]


def test_optimizer_step_in_backward_with_a_plain_backward_at_bf16():
    """The recipe unchanged (``loss.backward()``, no ``scale_loss``) at bf16, where no
    loss scale is needed."""
    make = OPTIMIZERS["adamw"]
    loop = _train(torch.bfloat16, make, "loop", scaled=False)
    got = _train(torch.bfloat16, make, "after", scaled=False)
    for a, b in zip(got, loop):
        assert torch.equal(a, b)
