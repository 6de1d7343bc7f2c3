"""The optimizer-rule table (``ampkit.trainer.optimizer_rules``): every optimizer maps to
the rule, kernels, scalars and fused kernel it had, and a family added in the table alone
is stepped by O2's one-pass update and O2K's compensated update (and read by the fused
kernel choice)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp
from ampkit.levels import one_pass
from ampkit.levels import update_kernels as uk
from ampkit.levels.compensated import CompensatedUpdates
from ampkit.trainer import fused_step
from ampkit.trainer import optimizer_rules as rules

BF16 = torch.bfloat16


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]


# (optimizer, rule name or None, the kernels' (scalar count, static args) per update)
MAPPING = [
    (lambda ps: torch.optim.Adam(ps, lr=1e-3), "adam", [(9, {})]),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), "adam", [(9, {})]),
    (lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-3), maximize=True), "adam", [(9, {})]),
    (lambda ps: torch.optim.Adam(ps, weight_decay=0.1, decoupled_weight_decay=True), "adam", [(9, {})]),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "sgd", [(3, {})]),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1, maximize=True), "sgd", [(3, {})]),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "sgd", [(6, {"nesterov": False})]),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), "sgd", [(6, {"nesterov": True})]),
    # stepped by the optimizer itself
    (lambda ps: torch.optim.Adam(ps, amsgrad=True), None, []),
    (lambda ps: torch.optim.Adam(ps, capturable=True), None, []),
    (lambda ps: torch.optim.Adam(ps, differentiable=True), None, []),
    (lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-3, requires_grad=True)), None, []),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=torch.tensor(0.9, requires_grad=True)), None, []),
    (lambda ps: type("MyAdam", (torch.optim.Adam,), {})(ps), None, []),
    (lambda ps: torch.optim.RMSprop(ps), None, []),
    (lambda ps: torch.optim.Adagrad(ps), None, []),
]


@pytest.mark.parametrize("make, name, kernels", MAPPING)
def test_every_optimizer_maps_to_the_rule_and_kernels_it_had(make, name, kernels):
    opt = make(_params())
    group = opt.param_groups[0]
    rule = one_pass.rule_for(opt, group)
    assert (rule.name if rule is not None else None) == name
    jobs = one_pass.kernels_ahead(opt, BF16)
    assert [(count, static) for _, static, count, _ in jobs] == kernels
    assert all(device == torch.device("cpu") for *_, device in jobs)
    comp_jobs = CompensatedUpdates(opt, kernel="compiled").kernels_ahead()
    assert [(count, static) for _, static, count, _ in comp_jobs] == kernels
    for (kernel, *_), (comp_kernel, *_) in zip(jobs, comp_jobs):
        assert kernel.name == "O2 " + comp_kernel.name and kernel.name in ("O2 Adam/AdamW", "O2 SGD")
        assert not kernel.exact and comp_kernel.exact
        count = len(kernel.example_dtypes)  # weight, grad, master (fp32), state (fp32)
        assert kernel.example_dtypes == (BF16, BF16) + (torch.float32,) * (count - 2)
        assert kernel.mutated == (0, *range(2, count))
        assert comp_kernel.example_dtypes == (BF16,) * count and comp_kernel.mutated == (0, 1, *range(3, count))


def test_the_state_and_fused_kernels_of_each_family():
    by_class = {cls: rules.rule_of(cls) for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD,
                                                    torch.optim.Adagrad, torch.optim.RMSprop)}  # fmt: skip
    adam, sgd, adagrad = by_class[torch.optim.Adam], by_class[torch.optim.SGD], by_class[torch.optim.Adagrad]
    assert by_class[torch.optim.AdamW] is adam and by_class[torch.optim.RMSprop] is None
    assert (adam.state_keys, adam.counted) == (("exp_avg", "exp_avg_sq"), True)
    assert (sgd.state_keys, sgd.counted) == (("momentum_buffer",), False)
    assert [(r.fused, r.fused_wide_part) for r in (adam, sgd, adagrad)] == [(True, True), (False, False), (True, False)]
    assert rules.rule_of(type("MyAdam", (torch.optim.Adam,), {})) is None  # exactly the classes


def test_fused_step_reads_the_table(monkeypatch):
    """Adagrad's fp32 groups get torch's fused kernel through its rule; without the rule,
    foreach."""
    assert fused_step.use_fastest_kernel(torch.optim.Adagrad(_params())) == ["fused"]
    monkeypatch.setattr(rules, "RULES", tuple(r for r in rules.RULES if r.name != "adagrad"))
    assert fused_step.use_fastest_kernel(torch.optim.Adagrad(_params())) == ["foreach"]


# --- a family added in the table alone ---------------------------------------------------


class SignMomentum(torch.optim.Optimizer):
    """``buf = beta * buf + g; p -= lr * sign(buf)``: an optimizer ampkit has no rule for."""

    def __init__(self, params, lr: float = 1e-2, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "sign_buf" not in state:
                    state["sign_buf"] = torch.zeros_like(p)
                buf = state["sign_buf"]
                buf.mul_(group["beta"]).add_(p.grad)
                p.sub_(buf.sign() * group["lr"])


CALLS: list[tuple[str, tuple[torch.dtype, ...]]] = []


def _sign_one_pass(w, g, p, buf, s):
    CALLS.append(("one_pass", (w.dtype, g.dtype, p.dtype, buf.dtype)))
    bf = buf * s[1] + g.float()
    pf = p - bf.sign() * s[0]
    p.copy_(pf)
    buf.copy_(bf)
    w.copy_(pf)


def _sign_compensated(w, c, g, buf, s):
    CALLS.append(("compensated", (w.dtype, c.dtype, g.dtype, buf.dtype)))
    bf = buf.float() * s[1] + g.float()
    total = w.float() - bf.sign() * s[0] + c.float()
    rounded = total.to(BF16)
    c.copy_(total - rounded.float())
    w.copy_(rounded)
    buf.copy_(bf)


SIGN = rules.Update("SignMomentum", _sign_one_pass, _sign_compensated, ("sign_buf",), 2)


def _sign_plan(optimizer, group, params):
    states = [optimizer.state[p] for p in params]
    for p, state in zip(params, states):
        if "sign_buf" not in state:
            state["sign_buf"] = torch.zeros_like(p)
    return states, [(SIGN, None, torch.tensor([group["lr"], group["beta"]], dtype=torch.float32))]


SIGN_RULE = rules.OptimizerRule(
    "sign", (SignMomentum,), ("sign_buf",), updates_for=lambda group: (SIGN,), plan=_sign_plan,
)


def _train(level: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    amp.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    opt = SignMomentum(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        with amp.scale_loss(F.mse_loss(model(x.to(BF16)).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    # in parameter order (list.__iter__: read as bookkeeping, no fp32 grads derived)
    bufs = [opt.state[p]["sign_buf"].clone() for g in opt.param_groups for p in list.__iter__(g["params"])]
    amp.reset()
    return weights, bufs


@pytest.mark.parametrize("level", ["O2", "O2K"])
def test_a_family_added_in_the_table_is_stepped_by_its_kernels(monkeypatch, level):
    """One rule appended to ``RULES``: O2 steps the family's fp32 masters from the 16-bit
    grads with its one-pass kernel, O2K its bf16 weights with its compensated kernel,
    bitwise as the optimizer's own step (O2: on fp32 grads; O2K: on fp32 copies,
    Kahan-rounded); without the rule the optimizer steps them itself."""
    monkeypatch.setattr(uk, "resolve_mode", lambda mode: "eager")  # the kernels as written (no compile)
    CALLS.clear()
    own = _train(level)
    assert CALLS == []
    monkeypatch.setattr(rules, "RULES", (*rules.RULES, SIGN_RULE))
    opt = SignMomentum(_params())
    jobs = one_pass.kernels_ahead(opt, BF16)
    assert [(kernel.name, count) for kernel, _, count, _ in jobs] == [("O2 SignMomentum", 2)]
    by_rule = _train(level)
    kind, dtypes = ("one_pass", (BF16, BF16, torch.float32, torch.float32)) if level == "O2" else (
        "compensated", (BF16,) * 4)  # fmt: skip
    # bf16 weights and grads of both Linear layers (the LayerNorm's stay fp32 and step as before)
    assert CALLS and all(call == (kind, dtypes) for call in CALLS)
    assert len(CALLS) == 3 * 4
    for a, b in zip(own[0] + own[1], by_rule[0] + by_rule[1]):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _counters_run(level: str, how: str) -> tuple[list[torch.Tensor], list[float]]:
    """Three AdamW steps at ``level``, the step counters set to 100 (``how``: "edit" in
    place, "load" through the optimizer's state dict, "replace" one counter by a new tensor
    and edit the rest, "swap" each through ``.data``), two more steps: the parameters and
    the counts."""
    amp.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(6)])
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level=level, dtype=BF16)
    g = torch.Generator().manual_seed(3)

    def step() -> None:
        with amp.scale_loss(model(torch.randn(4, 6, generator=g)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    if how == "load":
        sd = opt.state_dict()
        for s in sd["state"].values():
            s["step"] = torch.tensor(100.0)
        opt.load_state_dict(sd)
    else:
        for i, s in enumerate(opt.state.values()):
            if how == "replace" and i == 3:
                s["step"] = torch.tensor(100.0)
            elif how == "swap":  # through .data: the same object and version, other memory
                s["step"].data = torch.tensor(100.0)
            else:
                s["step"].fill_(100.0)
    for _ in range(2):
        step()
    out = [p.detach().clone() for p in model.parameters()], [float(s["step"]) for s in opt.state.values()]
    amp.reset()
    return out


@pytest.mark.parametrize("level", ["O2", "O2K"])
def test_step_counters_changed_by_the_user_are_read_again(level):
    """The host's knowledge of the counters it advanced (kept per list of counters, step
    after step) is dropped for a counter edited in place or replaced: the next steps use
    101 and 102, as after loading the same counts. The edit falls between a step skipped
    or taken on the device and the moment its outcome is settled (the next scale_loss):
    the settling must not take the edited counters for the ones the step left."""
    loaded = _counters_run(level, "load")
    assert set(loaded[1]) == {102.0}
    for how in ("edit", "replace", "swap"):
        params, counts = _counters_run(level, how)
        assert counts == loaded[1]
        assert all(torch.equal(a, b) for a, b in zip(params, loaded[0])), how
