"""torch's fastest kernel for optimizers built with defaults (ampkit.fast_step), and the
guarantees that must survive it: bitwise skips, bitwise resume, the user's pins."""

from __future__ import annotations

import io

import pytest
import torch
from checkpoints import load, saved
from torch import nn

import ampkit as amp
from ampkit.trainer.api import managed_state
from ampkit.trainer.fused_step import use_fastest_kernel


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 2))


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return model(torch.randn(4, 8, generator=g)).pow(2).mean()


@pytest.mark.parametrize(
    "cls, kw, expected",
    [
        (torch.optim.AdamW, {}, "fused"),
        (torch.optim.Adam, {"amsgrad": True}, "fused"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "foreach"),  # torch's fused SGD: see module doc
        (torch.optim.Adagrad, {}, "fused"),
        (torch.optim.RMSprop, {}, "foreach"),
        (torch.optim.NAdam, {}, "foreach"),
        (torch.optim.AdamW, {"foreach": False}, "as built"),
        (torch.optim.AdamW, {"fused": False}, "as built"),
        (torch.optim.SGD, {"lr": 0.1, "foreach": True}, "as built"),
        (torch.optim.Adam, {"differentiable": True}, "as built"),
    ],
)
def test_unpinned_groups_get_the_fastest_kernel_pinned_ones_stay(cls, kw, expected):
    model = _model()
    opt = cls(model.parameters(), **kw)
    before = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert use_fastest_kernel(opt) == [expected]
    group = opt.param_groups[0]
    if expected == "fused":
        assert group["fused"] is True and group["foreach"] is None
        assert opt._step_supports_amp_scaling is True
    elif expected == "foreach":
        assert group["foreach"] is True
    else:
        assert {k: v for k, v in group.items() if k != "params"} == before


def test_16_bit_parameters_get_foreach_and_a_disagreeing_fused_kernel_is_not_used(monkeypatch):
    from ampkit.trainer import fused_step as fast_step

    model = _model().to(torch.bfloat16)
    assert use_fastest_kernel(torch.optim.AdamW(model.parameters())) == ["foreach"]
    # A fused kernel that does not compute the loop's result is refused by the probe.
    fast_step.forget_probes()
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *args, **kwargs: None)
    opt = torch.optim.AdamW(_model().parameters(), lr=1e-2)
    assert use_fastest_kernel(opt) == ["foreach"]
    assert not getattr(opt, "_step_supports_amp_scaling", False)
    monkeypatch.undo()
    fast_step.forget_probes()  # the refusal was of the patched kernel


def test_subclasses_and_mixed_groups():
    class MyAdam(torch.optim.AdamW):  # may override step: left as built
        pass

    model = _model()
    assert use_fastest_kernel(MyAdam(model.parameters())) == ["as built"]
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[3].parameters(), "foreach": False}]
    )
    assert use_fastest_kernel(opt) == ["fused", "as built"]
    # Not every group fused: torch's non-fused groups refuse grad_scale/found_inf.
    assert not getattr(opt, "_step_supports_amp_scaling", False)


def test_init_trainer_and_initialize_choose_and_can_opt_out():
    opt = amp.init_trainer(torch.optim.AdamW(_model().parameters()))
    assert managed_state(opt).kernels == ["fused"] and opt.param_groups[0]["fused"] is True
    amp.reset()
    model, opt = amp.initialize(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), "O1", fast_kernels=False)
    assert opt.param_groups[0]["fused"] is None and managed_state(opt).kernels == []
    amp.reset()


def test_load_state_dict_of_a_plain_checkpoint_keeps_the_fast_kernel():
    plain = torch.optim.AdamW(_model().parameters())
    saved = plain.state_dict()
    assert saved["param_groups"][0]["fused"] is None
    opt = amp.init_trainer(torch.optim.AdamW(_model().parameters()))
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["fused"] is True
    amp.trainer.release(opt)
    opt.load_state_dict(saved)  # released: the optimizer is the user's again
    assert opt.param_groups[0]["fused"] is None
    amp.reset()


def _bits(model: nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    out = [p.detach().numpy().tobytes() for p in model.parameters()]
    for state in opt.state.values():
        out += [v.numpy().tobytes() for v in state.values() if torch.is_tensor(v)]
    return out


@pytest.mark.parametrize("cls, kw", [(torch.optim.AdamW, {"lr": 1e-2}), (torch.optim.Adagrad, {"lr": 0.1})])
def test_fused_step_skips_bitwise_and_resumes_bitwise(cls, kw):
    def run(model, opt, steps, start, inf_at=None):
        for i in range(start, start + steps):
            opt.zero_grad()
            with amp.scale_loss(_loss(model, i), opt) as scaled:
                scaled.backward()
            if i == inf_at:
                model[0].weight.grad[0, 0] = float("inf")
                before = _bits(model, opt)
            opt.step()
            if i == inf_at:
                assert amp.step_skipped(opt) and _bits(model, opt) == before

    model = _model()
    opt = amp.init_trainer(cls(model.parameters(), **kw))  # dynamic scale 2**16
    assert managed_state(opt).kernels == ["fused"]
    run(model, opt, 3, 0, inf_at=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, buf)
    run(model, opt, 3, 3)
    expected = _bits(model, opt)
    amp.reset()

    buf.seek(0)
    saved = torch.load(buf)
    model_b = _model(seed=5)
    opt_b = amp.init_trainer(cls(model_b.parameters(), **kw))
    model_b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    amp.load_state_dict(saved["amp"])
    run(model_b, opt_b, 3, 3)
    assert _bits(model_b, opt_b) == expected
    amp.reset()


# --- the read-only overflow check -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [7, "large"])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf"), "huge"])
def test_nonfinite_flag_reads_without_writing(dtype, n, bad):
    """Large tensors are only read (a sum, or min/max); a small one goes through
    torch's fused check, which writes it back times 1 (the same values; in its scalar
    loop, which these 7 elements take, a NaN's bits too). ``"huge"``: finite elements
    at the dtype's maximum, whose sum overflows, are not an overflow."""
    from ampkit.trainer.fused_step import READ_ONLY_NUMEL, nonfinite_flag

    n = READ_ONLY_NUMEL + 101 if n == "large" else n

    g = torch.Generator().manual_seed(n)
    tensors = [torch.randn(n, generator=g).to(dtype), torch.randn(3, generator=g).to(dtype)]
    if bad == "huge":
        tensors[0][: n // 2] = torch.finfo(dtype).max
    elif bad is not None:
        tensors[0][n // 2] = bad
    before = [t.clone() for t in tensors]
    flag = nonfinite_flag({(torch.device("cpu"), dtype): tensors})
    assert flag.dtype == torch.float32 and flag.item() == (0.0 if bad in (None, "huge") else 1.0)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for t, b in zip(tensors, before):
        assert torch.equal(t.view(bits), b.view(bits))
    assert nonfinite_flag({}) is None


def test_nonfinite_flag_confirms_only_where_a_sum_overflowed():
    """Of two large tensors, a finite one whose sum overflows and one holding a NaN,
    the flag is set (by the NaN); with the NaN replaced by a finite value, it is not."""
    from ampkit.trainer.fused_step import READ_ONLY_NUMEL, nonfinite_flag

    huge = torch.full((READ_ONLY_NUMEL,), torch.finfo(torch.float32).max)
    other = torch.zeros(READ_ONLY_NUMEL)
    other[-1] = float("nan")
    key = (torch.device("cpu"), torch.float32)
    assert nonfinite_flag({key: [huge, other]}).item() == 1.0
    other[-1] = 1.0
    assert nonfinite_flag({key: [huge, other]}).item() == 0.0


def test_nonfinite_flag_compiles_without_graph_breaks():
    """Traced by torch.compile (inductor, fullgraph), the large-tensor check takes no
    host sync and still finds a NaN."""
    from ampkit.trainer.fused_step import READ_ONLY_NUMEL, nonfinite_flag

    torch._dynamo.reset()
    check = torch.compile(lambda t: nonfinite_flag({(t.device, t.dtype): [t]}), fullgraph=True)
    t = torch.randn(READ_ONLY_NUMEL + 3)
    assert check(t).item() == 0.0
    t[7] = float("nan")
    assert check(t).item() == 1.0


def test_fused_adamw_against_the_loop_within_two_ulps_and_a_small_fraction_of_elements():
    """What the docs claim of the fused kernel ampkit switches to, on any CPU: within an
    ulp or two of the per-parameter loop everywhere, and the last bits differ in at most
    a small fraction of the elements (measured with torch 2.13: ~0.15% on an AVX-512
    CPU, 0.13% on an AVX2-only AMD EPYC, none on another AVX2 CPU). Not bitwise: which
    elements differ depends on the CPU, so no CPU is promised bitwise equality."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(65536, generator=g)
    grads = [torch.randn(65536, generator=g) for _ in range(3)]
    results = []
    for mode in ({"fused": True}, {"foreach": False}):
        p = torch.nn.Parameter(start.clone())
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, **mode)
        for grad in grads:
            p.grad = grad.clone()
            opt.step()
        results.append(p.detach())
    fused, loop = results
    eps = torch.finfo(torch.float32).eps
    assert bool(((fused - loop).abs() <= 2 * eps * loop.abs().clamp_min(1.0)).all())  # an ulp or two
    differing = float((fused != loop).float().mean())
    assert differing < 0.01, (torch.backends.cpu.get_cpu_capability(), differing)


def _o2k(**opt_kw):
    amp.reset()
    model = _model()
    return amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, **opt_kw), "O2K")


def test_o2k_steps_its_fp32_rest_with_the_fused_kernel_bitwise():
    """O2K's group holds bf16 weights (its compensated kernel steps them) and fp32 norm
    parameters: on the CPU torch's step sees only the latter, fused (no per-parameter
    step-count reads of the foreach kernel), and computes exactly torch's fused AdamW on
    the same grads."""
    model, opt = _o2k()
    assert managed_state(opt).kernels == ["fused"]
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is None
    norm = model[1]
    assert norm.weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    ref = [nn.Parameter(p.detach().clone()) for p in norm.parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for i in range(4):
        opt.zero_grad()
        with amp.scale_loss(_loss(model, i).float(), opt) as loss:
            loss.backward()
        grads = [p.grad.clone() for p in norm.parameters()]
        opt.step()
        for r, g in zip(ref, grads):
            r.grad = g
        ref_opt.step()
        for p, r in zip(norm.parameters(), ref):
            assert torch.equal(p, r)
            assert all(torch.equal(opt.state[p][k], ref_opt.state[r][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert all(bool(torch.isfinite(w).all()) for w in model[0].parameters())
    amp.reset()


def test_o2k_fp32_rest_fused_again_after_a_plain_load_pinned_groups_left_alone():
    model, opt = _o2k()
    plain = torch.optim.AdamW(_model().parameters(), lr=1e-2).state_dict()
    opt.load_state_dict(plain)  # groups saved with foreach and fused unset
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is None
    pinned = torch.optim.AdamW(_model().parameters(), lr=1e-2, foreach=True).state_dict()
    opt.load_state_dict(pinned)
    assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0]["fused"]
    model, opt = _o2k(foreach=True)  # the user's choice
    assert managed_state(opt).kernels == ["as built"] and opt.param_groups[0]["foreach"] is True
    assert not opt.param_groups[0]["fused"]
    amp.reset()


def test_o2k_fused_rest_never_marks_the_optimizer_for_torch_gradscaler():
    """torch.amp.GradScaler hands grad_scale/found_inf to an optimizer marked as taking
    them and unscales nothing itself: O2K's bf16 weights, stepped by its own kernel, would
    train on scaled grads. An O2K group fused for its fp32 rest is never marked, also after
    a load (which runs the kernel choice again); with torch's scaler a reloaded run trains
    bitwise like the run without the reload."""
    import torch.nn.functional as F

    def train(reload: bool) -> list[torch.Tensor]:
        model, opt = _o2k()
        if reload:
            opt.load_state_dict(opt.state_dict())
        assert opt.param_groups[0]["fused"] is True
        assert not getattr(opt, "_step_supports_amp_scaling", False)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        for i in range(4):
            g = torch.Generator().manual_seed(i)
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(torch.randn(4, 8, generator=g)).float(), torch.randn(4, 2, generator=g))).backward()
            scaler.step(opt)
            scaler.update()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(False), train(True), strict=True))
    amp.reset()


@pytest.mark.parametrize("flags", [{"foreach": False}, {}], ids=["foreach=False", "unset"])
def test_a_group_added_later_unmarks_the_optimizer_for_torch_gradscaler_until_it_is_fused(flags):
    """An optimizer ampkit fused entirely is marked as taking grad_scale/found_inf
    (torch's ``_step_supports_amp_scaling``). A group added with ``add_param_group`` takes
    the mark off until its first step chooses its kernel: torch's GradScaler would
    otherwise hand grad_scale/found_inf to a group stepped by torch's for-loop kernel,
    which refuses them. A group left unset is fused at its first step and the mark comes
    back; one built ``foreach=False`` keeps it off. The weights follow the same training
    without ampkit; ``ampkit.reset`` gives ``add_param_group`` back."""
    import torch.nn.functional as F

    def train(managed: bool) -> list[torch.Tensor]:
        amp.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)
        if managed:
            opt = amp.init_trainer(opt, 1.0)
            assert opt._step_supports_amp_scaling is True
        opt.add_param_group({"params": list(model[1].parameters()), **flags})
        assert not getattr(opt, "_step_supports_amp_scaling", False)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 2, generator=g))).backward()
            scaler.step(opt)
            scaler.update()
        if managed:
            assert getattr(opt, "_step_supports_amp_scaling", False) is (not flags)
            amp.reset()
            assert "add_param_group" not in opt.__dict__
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(True), train(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fused and for-loop Adam: last bits


def test_o2k_adagrad_keeps_foreach_for_sparse_grads_and_reset_gives_the_group_back():
    """Adagrad steps sparse grads, which its fused kernel refuses: an O2K Adagrad group
    stays foreach and a sparse embedding trains. ampkit.reset() puts foreach back on a
    group fused for O2K (its bf16 parameters are the optimizer's to step again)."""
    import torch.nn.functional as F

    class Sparse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.norm, self.fc = nn.Embedding(20, 8, sparse=True), nn.LayerNorm(8), nn.Linear(8, 2)

        def forward(self, i: torch.Tensor) -> torch.Tensor:
            return self.fc(self.norm(self.emb(i).mean(1)))

    amp.reset()
    torch.manual_seed(0)
    model = Sparse()
    model, opt = amp.initialize(model, torch.optim.Adagrad(model.parameters(), lr=1e-2), "O2K")
    assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0]["fused"]
    before = model.emb.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(F.mse_loss(model(torch.randint(0, 20, (4, 3))).float(), torch.randn(4, 2)), opt) as loss:
            loss.backward()
        opt.step()
    assert not torch.equal(model.emb.weight, before)
    model, opt = _o2k()
    assert opt.param_groups[0]["fused"] is True
    amp.reset()
    assert opt.param_groups[0]["foreach"] is True and opt.param_groups[0]["fused"] is None


class _SparseRec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).float().pow(2).mean()


def _sparse_run(level: str, fast_kernels: bool = True, steps: int = 4, ckpt: bytes | None = None):
    """Adagrad over an ``nn.Embedding(sparse=True)`` (its own group) and a dense head."""
    torch.manual_seed(0)
    model = _SparseRec()
    # the head's lr 0: its kernel (fused or not) cannot change the embedding's grads
    opt = torch.optim.Adagrad([{"params": model.emb.parameters()}, {"params": model.head.parameters(), "lr": 0.0}],
                              lr=0.1)  # fmt: skip
    if level == "O1":
        amp.init(torch.bfloat16, "cpu")
        opt = amp.init_trainer(opt, fast_kernels=fast_kernels)
    else:
        model, opt = amp.initialize(model, opt, opt_level=level, dtype=torch.bfloat16, fast_kernels=fast_kernels)
    if ckpt is not None:
        load(model, opt, ckpt)
    ids = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        with amp.scale_loss(model(ids), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(model(ids)))
    return model, opt, losses, saved(model, opt)


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O2K"])
def test_adagrad_with_sparse_grads_steps_and_only_the_sparse_group_leaves_the_fused_kernel(level):
    # torch's fused Adagrad refuses sparse grads: the group that shows one goes back to
    # torch's own kernel before the first step; the dense group keeps what ampkit chose
    model, opt, losses, _ = _sparse_run(level)
    assert losses[-1] < losses[0]
    assert opt.param_groups[0].get("fused") is None
    state = managed_state(opt)
    if level in ("O1", "O2"):  # fp32 parameters: fused, the sparse group unfused again
        assert state.kernels == ["as built", "fused"] and opt.param_groups[1].get("fused") is True
    else:  # 16-bit parameters: foreach, which takes sparse grads (torch's loop steps them)
        assert state.kernels == ["foreach", "foreach"]
    amp.reset()
    # the sparse group steps as with fast_kernels=False: torch's loop, bit for bit
    plain, _, plain_losses, _ = _sparse_run(level, fast_kernels=False)
    assert torch.equal(model.emb.weight, plain.emb.weight)


def test_a_loaded_adagrad_checkpoint_unfuses_the_sparse_group_again():
    # a load brings the group back with fused unset, which the load's kernel choice fuses:
    # the next step hands it back to torch's kernel again, and the run resumes bitwise
    straight, _, _, _ = _sparse_run("O2", steps=4)
    amp.reset()
    _, _, _, ckpt = _sparse_run("O2", steps=2)
    amp.reset()
    resumed, opt, _, _ = _sparse_run("O2", steps=2, ckpt=ckpt)
    assert opt.param_groups[0].get("fused") is None
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def _late_sparse_run(level: str, steps: range, ckpt: bytes | None = None) -> tuple[nn.Module, bytes]:
    """A dense head in the optimizer, a sparse embedding added with ``add_param_group``
    after ampkit took the optimizer, used (so given a grad) from step 3 on."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(20, 6, sparse=True), nn.Linear(6, 1)
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.Adagrad(head.parameters(), lr=0.1)
    if level == "O1":
        amp.init(torch.bfloat16, "cpu")
        opt = amp.init_trainer(opt)
    else:
        model, opt = amp.initialize(model, opt, opt_level=level, dtype=torch.bfloat16)
    opt.add_param_group({"params": model["emb"].parameters()})
    if ckpt is not None:
        load(model, opt, ckpt)
    ids = torch.randint(0, 20, (8,), generator=torch.Generator().manual_seed(1))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    for step in steps:
        feats = model["emb"](ids) if step >= 3 else x
        with amp.scale_loss(model["head"](feats).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return model, saved(model, opt)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_sparse_group_added_later_and_first_used_after_a_resume_is_unfused(level):
    # saved fused before its first grad: the resumed run watches it too
    straight, _ = _late_sparse_run(level, range(5))
    amp.reset()
    _, ckpt = _late_sparse_run(level, range(3))
    amp.reset()
    resumed, _ = _late_sparse_run(level, range(3, 5), ckpt)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_reloading_a_checkpoint_saved_fused_unfuses_the_sparse_group_again():
    # in one process: the group unfused at its first sparse grad, then a checkpoint
    # from before brings it back fused; the next step must hand it back again
    model, opt, _, ckpt = _sparse_run("O1", steps=0)  # saved fused (no grad seen yet)
    ids = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        with amp.scale_loss(model(ids), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        assert opt.param_groups[0].get("fused") is None
        opt.load_state_dict(torch.load(io.BytesIO(ckpt))["optimizer"])
        assert opt.param_groups[0].get("fused") is True


def test_a_closure_step_with_sparse_grads_is_unfused_once_the_closure_made_them():
    torch.manual_seed(0)
    model = _SparseRec()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    amp.init(torch.bfloat16, "cpu")
    opt = amp.init_trainer(opt)
    ids = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(1))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(ids)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        return loss

    first = opt.step(closure)
    assert float(opt.step(closure)) < float(first)
    assert opt.param_groups[0].get("fused") is None
