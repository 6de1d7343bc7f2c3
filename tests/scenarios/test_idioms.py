"""The idiom matrix: training loops written the way real scripts write them, run
under every opt level and the three-line ``amp.init`` API, against the same loop
in plain fp32.

Each idiom is one self-contained function ``loop(h) -> Result``. It builds its
model, optimizer(s) and data from fixed seeds, calls ``h.setup(...)`` where a
script adds ``amp.initialize`` (or ``amp.init(); amp.init_trainer(opt)``), and
``h.backward(loss, opt)`` where a script wraps ``loss.backward()`` in
``amp.scale_loss``. Everything else is the idiom itself, unchanged: the way it
zeroes grads, clips, updates weights through ``.data``, saves and reloads, ...
With ``Harness("fp32")`` those calls do nothing, so the fp32 reference is the
same function run without ampkit.

Modes: ``O0``..``O3`` and ``O2K`` through ``amp.initialize`` (``O2v``: O2 with
``model_grads="view"``); ``init`` is the
README's quick start, ``amp.init(); amp.init_trainer(opt)`` (``amp.init()``
alone for a loop without an optimizer).

A case compares the loop's losses (and its logged series: grad norms,
validation losses, ...) with fp32's after N steps; see ``TOLERANCE`` for why
each level's tolerance is what it is. Loops check the idiom's own claims
inline (dtypes, a resumed run replaying bitwise, replicas' dtypes).

Cases known to fail on today's library are listed in ``KNOWN_FAILURES`` with the
issue and the cause, and run as ``xfail(strict=True)``: a fix turns them into
an XPASS error, so the entry must then be removed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import math
import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampkit as amp

torch.set_num_threads(1)

# ---------------------------------------------------------------------------
# Tolerances
# ---------------------------------------------------------------------------
#: Machine epsilon (spacing of numbers in [1, 2)): 2**-7 for bf16, 2**-10 for fp16.
#: Rounding a value to the format changes it by at most eps/2 relative.
EPS = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}

#: Relative tolerance, in units of the compute dtype's eps, on the loss averaged
#: over the last ``TAIL`` steps and on every logged value (grad norms, validation
#: losses, ...). Why these numbers:
#: - O0 runs fp32 exactly as the script does: bitwise equal at every step.
#: - O1 / init, O2, O2K: each step's forward and backward round their operands (and
#:   at O2/O2K the weights) to 16 bits, so a step's loss and update are off by a few
#:   eps/2. The weights themselves are kept in fp32 (O1, O2's masters) or summed to
#:   ~16 bits (O2K's Kahan buffers), so these errors do not compound from step to
#:   step; the trajectories only drift apart as far as training amplifies them.
#:   Over <= 25 steps we allow 16 half-ulps: 8 eps (6.25% in bf16).
#: - O3: the updates are rounded to 16 bits too (up to eps/2 of each weight per
#:   step, uncompensated), on top of O2's errors: 12 eps (9.4% in bf16).
#: The headline is the mean loss of the last ``TAIL`` steps, not the last step's:
#: one batch's loss near the end of a run can be close to 0, where a rounding-sized
#: difference of the logits is a large relative one.
#: Each idiom's fp32 run must lower its loss by more than twice the largest
#: tolerance (checked in ``fp32_reference``), so a loop that stops training, or
#: trains on stale weights or piled-up grads, cannot pass.
TOLERANCE_EPS = {"O0": 0.0, "O1": 8.0, "init": 8.0, "O2": 8.0, "O2v": 8.0, "O2K": 8.0, "O3": 12.0}
TAIL = 5

MODES = ["O0", "O1", "O2", "O2v", "O3", "O2K", "init"]
CAST_LEVELS = ("O2", "O2v", "O3", "O2K")  # levels that store the model in 16 bits
#: ``O2v``: O2 with ``model_grads="view"`` (the model's bf16 grads are views of the fp32
#: grads); bf16 only, so an fp16 idiom must be refused with an AmpError naming bf16.
VIEW_MODE = "O2v"


def tolerance(mode: str, dtype: torch.dtype) -> float:
    return TOLERANCE_EPS[mode] * EPS[dtype]


# ---------------------------------------------------------------------------
# What a script adds to run under ampkit
# ---------------------------------------------------------------------------
class Harness:
    """The lines a script adds for ampkit, per mode; in mode ``"fp32"`` none."""

    def __init__(
        self,
        mode: str,
        dtype: torch.dtype = torch.bfloat16,
        policy: amp.Policy | None = None,
        keep_fp32: list[Any] | None = None,
    ) -> None:
        self.mode = mode
        self.dtype = dtype
        self.policy = policy  # op-level casting policy (O1 and init only)
        self.keep_fp32 = keep_fp32  # initialize(keep_fp32=...) at O2/O3/O2K

    @property
    def active(self) -> bool:
        return self.mode != "fp32"

    @property
    def level(self) -> str:
        """The opt level the mode initializes."""
        return "O2" if self.mode == VIEW_MODE else self.mode

    @property
    def casts_model(self) -> bool:
        return self.mode in CAST_LEVELS

    def setup(self, models: Any, optimizers: Any = None, num_losses: int = 1) -> tuple[Any, Any]:
        if self.mode == "fp32":
            return models, optimizers
        if self.mode == "init":
            amp.init(dtype=self.dtype, device_type="cpu", policy=self.policy)
            if optimizers is not None:
                amp.init_trainer(optimizers, num_losses=num_losses)
            return models, optimizers
        kw: dict[str, Any] = {"dtype": self.dtype}
        if num_losses != 1:
            kw["num_losses"] = num_losses
        if self.policy is not None and self.mode == "O1":
            kw["policy"] = self.policy
        if self.keep_fp32 is not None and self.casts_model:
            kw["keep_fp32"] = self.keep_fp32
        if self.mode == VIEW_MODE:
            kw["model_grads"] = "view"
        return amp.initialize(models, optimizers, opt_level=self.level, **kw)

    def backward(self, loss: torch.Tensor, optimizers: Any = None, loss_id: int = 0, **kw: Any) -> None:
        if self.mode == "fp32" or optimizers is None:
            loss.backward(**kw)
            return
        with amp.scale_loss(loss, optimizers, loss_id=loss_id) as scaled:
            scaled.backward(**kw)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.active:
            amp.unscale(optimizer)

    def master_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        if self.active:
            return list(amp.master_params(optimizer))
        return [p for g in optimizer.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        return amp.state_dict() if self.active else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.active:
            amp.load_state_dict(state)

    def new_process(self) -> None:
        """What starting a new process does to ampkit: no session, no casting on."""
        if self.active:
            amp.reset()

    def checkpoint_context(self) -> dict[str, Any]:
        """``checkpoint(...)`` keyword the README asks for under ampkit."""
        return {"context_fn": amp.checkpoint_context} if self.active else {}


@dataclasses.dataclass
class Result:
    """What a loop reports: per-step losses (compared within tolerance; the last
    one is the headline), further logged series (each value compared within
    tolerance) and values that must be equal at every level (LRs, counts)."""

    losses: list[float]
    series: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    exact: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Idiom:
    name: str
    fn: Callable[[Harness], Result]
    dtype: torch.dtype = torch.bfloat16
    policy: amp.Policy | None = None
    keep_fp32: tuple[Any, ...] | None = None
    #: (mode -> regex) of levels that cannot run the idiom and must say so with an AmpError
    raises: tuple[tuple[str, str], ...] = ()

    def harness(self, mode: str) -> Harness:
        keep = list(self.keep_fp32) if self.keep_fp32 is not None else None
        return Harness(mode, self.dtype, self.policy, keep)


IDIOMS: dict[str, Idiom] = {}


def idiom(**kw: Any) -> Callable[[Callable[[Harness], Result]], Callable[[Harness], Result]]:
    def register(fn: Callable[[Harness], Result]) -> Callable[[Harness], Result]:
        name = fn.__name__.removeprefix("loop_")
        IDIOMS[name] = Idiom(name, fn, **kw)
        return fn

    return register


# ---------------------------------------------------------------------------
# Data and models (tiny: sizes <= 64, <= 30 steps)
# ---------------------------------------------------------------------------
D_IN, HIDDEN, N_CLS = 16, 32, 4


def classification_batches(n: int, batch: int = 32, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of a fixed teacher task (labels = argmax of a random linear map)."""
    teacher = torch.randn(D_IN, N_CLS, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(batch, D_IN, generator=g)
        out.append((x, (x @ teacher).argmax(1)))
    return out


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, N_CLS))


def token_batches(n: int, vocab: int = 32, batch: int = 8, seq: int = 12, seed: int = 1) -> list[torch.Tensor]:
    """Sequences of a learnable pattern: each token is (previous * 5 + 3) mod vocab,
    from a random start, with 10% random tokens mixed in."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(vocab, (batch, 1), generator=g)
        cols = [start]
        for _ in range(seq):
            cols.append((cols[-1] * 5 + 3) % vocab)
        s = torch.cat(cols, 1)
        noise = torch.rand(s.shape, generator=g) < 0.1
        s = torch.where(noise, torch.randint(vocab, s.shape, generator=g), s)
        out.append(s)
    return out


def ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def train_step(h: Harness, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """The usual step, for idioms that are about something else: ``opt.zero_grad()``,
    forward, backward (through ``amp.scale_loss`` under ampkit), ``opt.step()``."""
    opt.zero_grad()
    loss = ce(model, x, y)
    h.backward(loss, opt)
    opt.step()
    return loss.item()


def plain_train(
    h: Harness,
    zero: Callable[[nn.Module, torch.optim.Optimizer], None],
    backward: Callable[[torch.Tensor, torch.optim.Optimizer], None] | None = None,
) -> Result:
    """The basic classifier loop, with grads cleared by ``zero`` (and the backward
    done by ``backward``, default ``h.backward``)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    losses = []
    for x, y in classification_batches(20):
        zero(model, opt)
        loss = ce(model, x, y)
        (backward or h.backward)(loss, opt)
        opt.step()
        losses.append(loss.item())
    return Result(losses)


# ---------------------------------------------------------------------------
# The idioms
# ---------------------------------------------------------------------------
@idiom()
def loop_zero_grad_optimizer(h: Harness) -> Result:
    """``optimizer.zero_grad()`` at the top of each step (set_to_none default)."""
    return plain_train(h, lambda m, o: o.zero_grad())


@idiom()
def loop_zero_grad_model(h: Harness) -> Result:
    """``model.zero_grad()``: the grads are cleared through the model (apex-era scripts)."""
    return plain_train(h, lambda m, o: m.zero_grad())


@idiom()
def loop_grad_none(h: Harness) -> Result:
    """``for p in model.parameters(): p.grad = None`` by hand."""

    def zero(m: nn.Module, o: Any) -> None:
        for p in m.parameters():
            p.grad = None

    return plain_train(h, zero)


@idiom()
def loop_zero_grad_keep_optimizer(h: Harness) -> Result:
    """``optimizer.zero_grad(set_to_none=False)``: zeroed grad tensors kept (old default)."""
    return plain_train(h, lambda m, o: o.zero_grad(set_to_none=False))


@idiom()
def loop_zero_grad_keep_model(h: Harness) -> Result:
    """``model.zero_grad(set_to_none=False)``."""
    return plain_train(h, lambda m, o: m.zero_grad(set_to_none=False))


@idiom()
def loop_plain_backward(h: Harness) -> Result:
    """The script keeps ``loss.backward()``: only the setup lines are added, no
    ``amp.scale_loss`` (issue 16's aim: nothing beyond the three lines)."""
    return plain_train(h, lambda m, o: o.zero_grad(), backward=lambda loss, o: loss.backward())


@idiom(raises=(("O2", "optimi"), ("O2K", "optimi")))
def loop_manual_sgd(h: Harness) -> Result:
    """No optimizer: ``p.data.add_(p.grad, alpha=-lr)`` after backward (PyTorch's
    word-language-model example). O2 keeps fp32 masters in an optimizer and O2K
    compensates an optimizer's updates: without one they must refuse clearly
    (issue 16); O0/O1/O3/init have nothing that needs an optimizer."""
    model = mlp()
    model, _ = h.setup(model, None)
    lr = 1.0
    losses = []
    for x, y in classification_batches(20):
        model.zero_grad()
        loss = ce(model, x, y)
        h.backward(loss)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    return Result(losses)


@idiom()
def loop_grad_accumulation(h: Harness) -> Result:
    """``(loss / k).backward()`` over k=4 micro-batches, one step per k."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    model, opt = h.setup(model, opt)
    k = 4
    losses = []
    opt.zero_grad()
    for i, (x, y) in enumerate(classification_batches(15 * k, batch=8)):
        loss = ce(model, x, y) / k
        h.backward(loss, opt)
        if (i + 1) % k == 0:
            opt.step()
            opt.zero_grad()
        if i % k == 0:
            losses.append(loss.item() * k)
    return Result(losses)


def clipped_train(h: Harness, clip: Callable[[nn.Module, torch.optim.Optimizer], torch.Tensor]) -> Result:
    """Classifier loop with ``opt.zero_grad()`` and a clip between backward and
    step; logs the total norm the clip reports. max_norm is below the fp32 norms,
    so the clip is active (checked)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    model, opt = h.setup(model, opt)
    losses, norms = [], []
    for x, y in classification_batches(20):
        opt.zero_grad()
        loss = ce(model, x, y)
        h.backward(loss, opt)
        norms.append(float(clip(model, opt)))
        opt.step()
        losses.append(loss.item())
    if not h.active:
        assert sum(n > MAX_NORM for n in norms) >= 10, norms  # the clip does clip
    return Result(losses, {"grad_norm": norms})


MAX_NORM = 0.25


@idiom()
def loop_clip_unchanged(h: Harness) -> Result:
    """``clip_grad_norm_(model.parameters(), max_norm)`` exactly as the fp32 script
    has it: no ``amp.unscale`` added (issue 16: grads scripts see are real grads)."""
    return clipped_train(h, lambda m, o: nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))


@idiom()
def loop_clip_after_unscale(h: Harness) -> Result:
    """The README's recipe: ``amp.unscale(opt)`` then clip ``model.parameters()``."""

    def clip(m: nn.Module, o: torch.optim.Optimizer) -> torch.Tensor:
        h.unscale(o)
        return nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)

    return clipped_train(h, clip)


@idiom()
def loop_clip_master_params(h: Harness) -> Result:
    """apex's documented O2 recipe: ``amp.unscale(opt)``, clip ``amp.master_params(opt)``."""

    def clip(m: nn.Module, o: torch.optim.Optimizer) -> torch.Tensor:
        h.unscale(o)
        return nn.utils.clip_grad_norm_(h.master_params(o), MAX_NORM)

    return clipped_train(h, clip)


@idiom()
def loop_clip_value(h: Harness) -> Result:
    """``clip_grad_value_(model.parameters(), v)`` unchanged (an in-place grad edit)."""

    def clip(m: nn.Module, o: torch.optim.Optimizer) -> torch.Tensor:
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))
        nn.utils.clip_grad_value_(m.parameters(), 0.02)
        return norm

    return clipped_train(h, clip)


@idiom()
def loop_grad_edit_weight_decay(h: Harness) -> Result:
    """L2 regularization added to the grads by hand between backward and step
    (``p.grad.add_(p.detach(), alpha=wd)``, older scripts' weight decay), with a
    strong ``wd`` so the edit matters."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    losses = []
    for x, y in classification_batches(20):
        opt.zero_grad()
        loss = ce(model, x, y)
        h.backward(loss, opt)
        for p in model.parameters():
            p.grad.add_(p.detach(), alpha=0.05)
        opt.step()
        losses.append(loss.item())
    weight_norm = sum(p.detach().float().norm().item() for p in model.parameters())
    return Result(losses, {"weight_norm": [weight_norm]})


@idiom()
def loop_autograd_grad_assign(h: Harness) -> Result:
    """Grads computed functionally and assigned: ``grads = torch.autograd.grad(loss,
    params)``, ``p.grad = g``, then ``opt.step()`` (meta-learning and RL code). No
    ``scale_loss``: the loss is not scaled, and what is assigned is a real gradient."""
    model = mlp()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    losses = []
    for x, y in classification_batches(20):
        loss = ce(model, x, y)
        grads = torch.autograd.grad(loss, params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        losses.append(loss.item())
    return Result(losses)


@idiom()
def loop_grad_norm_logging(h: Harness) -> Result:
    """Logs the global grad norm and each layer's grad norm from ``p.grad`` before
    ``opt.step()`` (what wandb/tensorboard loggers read); the logged values must be
    the fp32 run's, within tolerance."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = h.setup(model, opt)
    losses, total, first_layer = [], [], []
    for x, y in classification_batches(20):
        opt.zero_grad()
        loss = ce(model, x, y)
        h.backward(loss, opt)
        norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
        assert len(norms) == 6, "every parameter has a grad between backward and step"
        total.append(torch.linalg.vector_norm(torch.stack(norms)).item())
        first_layer.append(model[0].weight.grad.float().norm().item())
        opt.step()
        losses.append(loss.item())
    return Result(losses, {"grad_norm": total, "layer0_grad_norm": first_layer})


@idiom()
def loop_grad_norm_after_step(h: Harness) -> Result:
    """Grad norms logged after ``opt.step()``, before the ``opt.zero_grad()`` that
    ends the iteration (``optimizer.step(); log(grad_norm); optimizer.zero_grad()``):
    the grads are still the step's grads, as in fp32."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    losses, norms = [], []
    for x, y in classification_batches(20):
        loss = ce(model, x, y)
        h.backward(loss, opt)
        opt.step()
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()])).item())
        opt.zero_grad()
        losses.append(loss.item())
    return Result(losses, {"grad_norm": norms})


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization as its popular reference implementation writes it:
    a wrapper over a base optimizer sharing its ``param_groups``, used through
    ``first_step`` (climb to the worst nearby weights) and ``second_step`` (restore
    them and step the base optimizer with the grads taken there), never ``step``."""

    def __init__(self, params: Any, base_optimizer: type, rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        grads = [p.grad.norm(2) for g in self.param_groups for p in g["params"] if p.grad is not None]
        grad_norm = torch.linalg.vector_norm(torch.stack(grads))
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()


@idiom()
def loop_sam_two_steps(h: Harness) -> Result:
    """SAM: two forward/backward passes per batch, ``optimizer.first_step(zero_grad=True)``
    between them and ``optimizer.second_step(zero_grad=True)`` after; the wrapper's
    own ``step`` is never called."""
    model = mlp()
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    losses = []
    for x, y in classification_batches(20):
        loss = ce(model, x, y)
        h.backward(loss, opt)
        opt.first_step(zero_grad=True)
        h.backward(ce(model, x, y), opt)
        opt.second_step(zero_grad=True)
        losses.append(loss.item())
    return Result(losses)


@idiom()
def loop_two_optimizers(h: Harness) -> Result:
    """Two optimizers over parts of one model (body SGD, head Adam), one loss."""
    model = mlp()
    body = torch.optim.SGD(model[:4].parameters(), lr=0.2, momentum=0.9)
    head = torch.optim.Adam(model[4].parameters(), lr=1e-2)
    model, (body, head) = h.setup(model, [body, head])
    losses = []
    for x, y in classification_batches(20):
        body.zero_grad()
        head.zero_grad()
        loss = ce(model, x, y)
        h.backward(loss, [body, head])
        body.step()
        head.step()
        losses.append(loss.item())
    return Result(losses)


@idiom()
def loop_gan(h: Harness) -> Result:
    """DCGAN-style: generator and discriminator, two optimizers, two losses (loss ids
    0 and 1), ``netD.zero_grad()``/``netG.zero_grad()``, ``fake.detach()`` for D.
    Logged: how far G's sample mean is from the data mean (falls as G learns)."""
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    net_d = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-2, betas=(0.5, 0.999))
    (net_g, net_d), (opt_g, opt_d) = h.setup([net_g, net_d], [opt_g, opt_d], num_losses=2)
    g = torch.Generator().manual_seed(3)
    center = torch.tensor([2.0, -1.0])
    gaps, d_losses = [], []
    for _ in range(22):
        real = center + 0.3 * torch.randn(32, 2, generator=g)
        z = torch.randn(32, 8, generator=g)
        fake = net_g(z)
        net_d.zero_grad()
        err_d = F.binary_cross_entropy_with_logits(net_d(real), torch.ones(32, 1)) + F.binary_cross_entropy_with_logits(
            net_d(fake.detach()), torch.zeros(32, 1)
        )
        h.backward(err_d, opt_d, loss_id=0)
        opt_d.step()
        net_g.zero_grad()
        err_g = F.binary_cross_entropy_with_logits(net_d(fake), torch.ones(32, 1))
        h.backward(err_g, opt_g, loss_id=1)
        opt_g.step()
        gaps.append((fake.detach().float().mean(0) - center).norm().item())
        d_losses.append(err_d.item())
    return Result(gaps, {"d_loss": d_losses[-5:]})


def toy_gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    net_d = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    return net_g, net_d


GAN_CENTER = (2.0, -1.0)


def wgan_generator_step(
    h: Harness, net_g: nn.Module, net_d: nn.Module, opt_g: torch.optim.Optimizer, g: torch.Generator
) -> float:
    """One WGAN generator step (loss id 1); returns how far G's sample mean is from
    the data mean."""
    opt_g.zero_grad()
    fake = net_g(torch.randn(32, 8, generator=g))
    err_g = -net_d(fake).mean()
    h.backward(err_g, opt_g, loss_id=1)
    opt_g.step()
    return (fake.detach().float().mean(0) - torch.tensor(GAN_CENTER)).norm().item()


@idiom()
def loop_wgan_weight_clipping(h: Harness) -> Result:
    """WGAN as in its reference code: RMSprop, 3 critic steps per generator step,
    the critic's weights clipped in place with ``p.data.clamp_(-c, c)`` before each
    critic step, critic params' ``requires_grad`` off during the generator step.
    Logged: how far G's sample mean is from the data mean."""
    net_g, net_d = toy_gan()
    opt_g = torch.optim.RMSprop(net_g.parameters(), lr=5e-3)
    opt_d = torch.optim.RMSprop(net_d.parameters(), lr=5e-3)
    (net_g, net_d), (opt_g, opt_d) = h.setup([net_g, net_d], [opt_g, opt_d], num_losses=2)
    g = torch.Generator().manual_seed(3)
    center = torch.tensor(GAN_CENTER)
    clip = 0.1
    gaps, clipped = [], []
    for _ in range(20):
        for p in net_d.parameters():
            p.requires_grad = True
        for _ in range(3):
            for p in net_d.parameters():
                p.data.clamp_(-clip, clip)
            real = center + 0.3 * torch.randn(32, 2, generator=g)
            fake = net_g(torch.randn(32, 8, generator=g)).detach()
            opt_d.zero_grad()
            err_d = net_d(fake).mean() - net_d(real).mean()
            h.backward(err_d, opt_d, loss_id=0)
            opt_d.step()
        for p in net_d.parameters():
            p.requires_grad = False
        gaps.append(wgan_generator_step(h, net_g, net_d, opt_g, g))
        clipped.append(max(p.detach().abs().max().item() for p in net_d.parameters()))
    return Result(gaps, {"critic_max_abs_weight": clipped[-5:]})


@idiom()
def loop_gradient_penalty(h: Harness) -> Result:
    """WGAN-GP: 5 critic steps per generator step; the critic's loss adds a penalty
    on the norm of ``torch.autograd.grad(D(interp), interp, create_graph=True)``
    (double backward through the critic, not scaled by the loss scale). The
    generator's backward also reaches the critic's params (their grads are cleared
    by ``opt_d.zero_grad()`` before the next critic step). Logged: how far G's
    sample mean is from the data mean."""
    net_g, net_d = toy_gan()
    opt_g = torch.optim.Adam(net_g.parameters(), lr=LR_GP, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=LR_GP, betas=(0.5, 0.9))
    (net_g, net_d), (opt_g, opt_d) = h.setup([net_g, net_d], [opt_g, opt_d], num_losses=2)
    g = torch.Generator().manual_seed(3)
    center = torch.tensor(GAN_CENTER)
    gaps = []
    for _ in range(STEPS_GP):
        for _ in range(5):
            real = center + 0.3 * torch.randn(32, 2, generator=g)
            fake = net_g(torch.randn(32, 8, generator=g)).detach()
            opt_d.zero_grad()
            alpha = torch.rand(32, 1, generator=g)
            interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            (grad,) = torch.autograd.grad(net_d(interp).sum(), interp, create_graph=True)
            penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
            err_d = net_d(fake).mean() - net_d(real).mean() + W_GP * penalty
            h.backward(err_d, opt_d, loss_id=0)
            opt_d.step()
        gaps.append(wgan_generator_step(h, net_g, net_d, opt_g, g))
    return Result(gaps)


LR_GP, STEPS_GP, W_GP = 2e-2, 20, 10


@idiom()
def loop_drop_batch_after_backward(h: Harness) -> Result:
    """A step that fails after backward is dropped: ``opt.zero_grad()`` at the top of
    each iteration, and a check between backward and step (a NaN guard, a metric)
    raising on two batches, caught by the script, which goes on with the next
    batch. The dropped batches' grads must not reach any step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    losses, dropped = [], []
    for i, (x, y) in enumerate(classification_batches(22)):
        opt.zero_grad()
        loss = ce(model, x, y)
        h.backward(loss, opt)
        try:
            if i in (5, 12):
                raise FloatingPointError(f"batch {i}: bad metric")
            opt.step()
        except FloatingPointError:
            dropped.append(i)
            continue
        losses.append(loss.item())
    return Result(losses, exact={"dropped": dropped})


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU())
        self.cls = nn.Linear(HIDDEN, N_CLS)
        self.reg = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.body(x)
        return self.cls(f), self.reg(f)


@idiom()
def loop_two_backward_passes(h: Harness) -> Result:
    """Multi-task: two losses on a shared body, each with its own backward
    (``retain_graph=True`` on the first), grads summed in place, one step."""
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = h.setup(model, opt)
    losses = []
    for x, y in classification_batches(20):
        opt.zero_grad()
        logits, value = model(x)
        loss_cls = F.cross_entropy(logits, y)
        loss_reg = F.mse_loss(value.squeeze(1), x[:, 0])
        h.backward(loss_cls, opt, retain_graph=True)
        h.backward(loss_reg, opt)
        opt.step()
        losses.append(loss_cls.item() + loss_reg.item())
    return Result(losses)


class ApexScript:
    """What a legacy ``apex.amp`` script does, with ``from apex import amp`` changed
    to ``from ampkit.compat.apex import amp``: ``amp.initialize`` at O0..O3 (and
    ampkit's O2K), or in mode ``init`` apex's older handle API
    (``handle = amp.init(enabled=True)``, ``handle.scale_loss(loss, optimizer)``)."""

    def __init__(self, h: Harness) -> None:
        from ampkit.compat.apex import amp as apex_amp

        self.h = h
        self.amp = apex_amp
        self.handle: Any = None

    def initialize(self, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        if not self.h.active:
            return model, opt
        if self.h.mode == "init":
            self.handle = self.amp.init(enabled=True)
            return model, opt
        return self.amp.initialize(model, opt, opt_level=self.h.level)

    def scale_loss(self, loss: torch.Tensor, opt: torch.optim.Optimizer) -> Any:
        if not self.h.active:
            return contextlib.nullcontext(loss)
        return (self.handle or self.amp).scale_loss(loss, opt)

    def master_params(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        if not self.h.active or self.handle is not None:
            return [p for g in opt.param_groups for p in g["params"]]
        return list(self.amp.master_params(opt))

    def state_dict(self) -> dict[str, Any]:
        return self.amp.state_dict() if self.h.active and self.handle is None else {}


@idiom()
def loop_apex_legacy_script(h: Harness) -> Result:
    """A legacy apex.amp training script (apex's ImageNet example, timm's
    ApexScaler) with only the import changed: ``with amp.scale_loss(loss, optimizer)
    as scaled_loss: scaled_loss.backward()`` (apex unscales at exit), then
    ``clip_grad_norm_(amp.master_params(optimizer), 1.0)``, and a checkpoint of
    ``model.state_dict()`` + ``amp.state_dict()`` every 5 steps. As in apex, a cast
    model's ``state_dict()`` holds fp32 tensors (apex's O2StateDictHook, installed
    whenever ``cast_model_type`` is set: O2 and O3)."""
    apex = ApexScript(h)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    model, optimizer = apex.initialize(model, optimizer)
    losses = []
    for i, (x, y) in enumerate(classification_batches(20)):
        optimizer.zero_grad()
        loss = ce(model, x, y)
        with apex.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        nn.utils.clip_grad_norm_(apex.master_params(optimizer), MAX_NORM)
        optimizer.step()
        losses.append(loss.item())
        if i % 5 == 4:
            checkpoint = {"model": model.state_dict(), "amp": apex.state_dict()}
            if h.mode != "O2K":  # not an apex level: its state_dict is ampkit's (16-bit)
                assert {v.dtype for v in checkpoint["model"].values()} == {torch.float32}
    if apex.handle is not None:
        apex.handle._deactivate()
    return Result(losses)


class SegmentationLoss(nn.Module):
    """A parameter-less criterion module, passed to initialize with the model (apex
    segmentation trainers do ``amp.initialize([model, criterion], ...)``)."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, ignore_index=-1)


@idiom()
def loop_models_list_with_loss_module(h: Harness) -> Result:
    """A list of models incl. a parameter-less loss module, two SGD optimizers
    (encoder, decoder), ``model.zero_grad()`` each iteration (issue 9's
    segmentation trainer)."""
    model = mlp()
    crit = SegmentationLoss()
    enc = torch.optim.SGD(model[:4].parameters(), lr=0.2, momentum=0.9)
    dec = torch.optim.SGD(model[4].parameters(), lr=0.2, momentum=0.9)
    (model, crit), (enc, dec) = h.setup([model, crit], [enc, dec])
    losses = []
    for x, y in classification_batches(20):
        y = torch.where(torch.arange(len(y)) % 8 == 0, -1, y)  # some ignored pixels
        model.zero_grad()
        loss = crit(model(x), y)
        h.backward(loss, [enc, dec])
        enc.step()
        dec.step()
        losses.append(loss.item())
    return Result(losses)


@idiom()
def loop_adam_param_groups(h: Harness) -> Result:
    """Adam with param groups: weights with weight decay, biases without, and a
    per-group learning rate (the head 3x the body)."""
    model = mlp()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and not n.startswith("4.")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") and not n.startswith("4.")]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.05},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": model[4].parameters(), "lr": 3e-2, "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    model, opt = h.setup(model, opt)
    losses = []
    for x, y in classification_batches(20):
        losses.append(train_step(h, model, opt, x, y))
    return Result(losses, exact={"lrs": [g["lr"] for g in opt.param_groups]})


@idiom()
def loop_target_network(h: Harness) -> Result:
    """Target network / mean teacher, DDPG-style: a second model with its own
    (trainable-looking) parameters, run with grad on and its output ``.detach()``ed
    as the target, updated after each step with
    ``p_t.data.mul_(d).add_(p.data, alpha=1 - d)`` (no optimizer of its own).
    Logged: the target network's loss on held-out data after each update."""
    student, teacher = mlp(), mlp()
    teacher.load_state_dict(student.state_dict())
    opt = torch.optim.SGD(student.parameters(), lr=0.2, momentum=0.9)
    (student, teacher), opt = h.setup([student, teacher], opt)
    (xv, yv), = classification_batches(1, batch=64, seed=7)
    d = 0.7
    losses, teacher_losses = [], []
    for x, y in classification_batches(20):
        opt.zero_grad()
        target = F.softmax(teacher(x), -1).detach()
        logits = student(x)
        loss = F.cross_entropy(logits, y) + 0.5 * F.kl_div(F.log_softmax(logits, -1), target, reduction="batchmean")
        h.backward(loss, opt)
        opt.step()
        for p_t, p in zip(teacher.parameters(), student.parameters()):
            p_t.data.mul_(d).add_(p.data, alpha=1 - d)
        with torch.no_grad():
            teacher_losses.append(ce(teacher, xv, yv).item())
        losses.append(loss.item())
    return Result(teacher_losses, {"student_loss": losses[-5:]})


@idiom()
def loop_ema_deepcopy(h: Harness) -> Result:
    """timm's ModelEma: ``ema = copy.deepcopy(model)`` after setup, updated with
    ``ema_v.copy_(ema_v * d + (1 - d) * model_v)`` over the state dicts. The copy
    must be an independent working model; logged: the EMA model's eval loss."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    ema = copy.deepcopy(model)
    ema.eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    (xv, yv), = classification_batches(1, batch=64, seed=7)
    d = 0.7
    losses, ema_losses = [], []
    for x, y in classification_batches(20):
        losses.append(train_step(h, model, opt, x, y))
        with torch.no_grad():
            for ema_v, model_v in zip(ema.state_dict().values(), model.state_dict().values()):
                if ema_v.is_floating_point():
                    ema_v.copy_(ema_v * d + (1.0 - d) * model_v)
            ema_losses.append(ce(ema, xv, yv).item())
    for p, q in zip(ema.parameters(), model.parameters()):
        assert p.data_ptr() != q.data_ptr() and p.dtype == q.dtype
    return Result(ema_losses, {"loss": losses[-5:]})


class TiedLM(nn.Module):
    """Embedding and output head sharing one weight (GPT-2 / AWD-LSTM tying)."""

    def __init__(self, vocab: int = 32, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(idx))))


@idiom()
def loop_weight_tying(h: Harness) -> Result:
    """Shared embedding/head weight: one parameter, grads from both uses."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = h.setup(model, opt)
    losses = []
    for s in token_batches(25):
        opt.zero_grad()
        logits = model(s[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), s[:, 1:].reshape(-1))
        h.backward(loss, opt)
        opt.step()
        losses.append(loss.item())
    assert model.head.weight is model.emb.weight
    return Result(losses)


@idiom()
def loop_freeze_unfreeze(h: Harness) -> Result:
    """The first layer frozen with ``requires_grad_(False)`` for 10 steps, then
    unfrozen; the optimizer holds every parameter from the start."""
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    w0 = model[0].weight.detach().clone()
    losses = []
    for i, (x, y) in enumerate(classification_batches(24)):
        if i == 10:
            assert torch.equal(model[0].weight, w0), "a frozen layer moved"
            model[0].requires_grad_(True)
        losses.append(train_step(h, model, opt, x, y))
    assert not torch.equal(model[0].weight, w0), "the unfrozen layer never trained"
    return Result(losses)


@idiom()
def loop_unfreeze_add_param_group(h: Harness) -> Result:
    """Fine-tuning: the optimizer starts with the trainable params only
    (``filter(lambda p: p.requires_grad, ...)``); at step 10 the frozen layer is
    unfrozen and added with ``opt.add_param_group`` at a lower LR."""
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.Adam(filter(lambda p: p.requires_grad, model.parameters()), lr=1e-2)
    model, opt = h.setup(model, opt)
    w0 = model[0].weight.detach().clone()
    losses = []
    for i, (x, y) in enumerate(classification_batches(24)):
        if i == 10:
            model[0].requires_grad_(True)
            opt.add_param_group({"params": model[0].parameters(), "lr": 3e-3})
        losses.append(train_step(h, model, opt, x, y))
    assert not torch.equal(model[0].weight, w0), "the unfrozen layer never trained"
    return Result(losses)


def bn_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, N_CLS))


@idiom()
def loop_eval_validation(h: Harness) -> Result:
    """``model.eval()`` + ``torch.no_grad()`` validation every 4 steps, then
    ``model.train()`` (BatchNorm switches to its running statistics)."""
    model = bn_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    (xv, yv), = classification_batches(1, batch=64, seed=7)
    losses, val = [], []
    for i, (x, y) in enumerate(classification_batches(20)):
        losses.append(train_step(h, model, opt, x, y))
        if i % 4 == 3:
            model.eval()
            with torch.no_grad():
                val.append(ce(model, xv, yv).item())
            model.train()
    return Result(losses, {"val_loss": val})


@idiom()
def loop_no_grad_inference(h: Harness) -> Result:
    """Inference mid-training without ``eval()``: predictions on a probe batch
    under ``torch.no_grad()`` and under ``torch.inference_mode()`` every 3 steps
    (metrics, sample generation), training goes on in between."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = h.setup(model, opt)
    (xv, yv), = classification_batches(1, batch=64, seed=7)
    losses, probe = [], []
    for i, (x, y) in enumerate(classification_batches(21)):
        if i % 3 == 1:
            with torch.no_grad():
                probe.append(ce(model, xv, yv).item())
        if i % 3 == 2:
            with torch.inference_mode():
                probe.append(ce(model, xv, yv).item())
        losses.append(train_step(h, model, opt, x, y))
    return Result(losses, {"probe_loss": probe})


class BagOfWords(nn.Module):
    """A sparse-gradient embedding (``nn.Embedding(..., sparse=True)``), as word2vec
    and recommender scripts use, mean-pooled into a linear classifier."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, sparse=True)
        self.out = nn.Linear(dim, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx).mean(1))


@idiom()
def loop_sparse_embedding(h: Harness) -> Result:
    """Sparse embedding grads: SGD for the embedding (``torch.optim.SGD`` takes sparse
    grads) and Adam for the dense head, two optimizers, one loss. Task: are more
    than 3 of the bag's 6 tokens from the lower half of the vocabulary."""
    torch.manual_seed(0)
    model = BagOfWords()
    sparse = torch.optim.SGD(model.emb.parameters(), lr=20.0)
    dense = torch.optim.Adam(model.out.parameters(), lr=1e-2)
    model, (sparse, dense) = h.setup(model, [sparse, dense])
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(25):
        idx = torch.randint(64, (32, 6), generator=g)
        y = (idx < 32).sum(1).gt(3).long()
        sparse.zero_grad()
        dense.zero_grad()
        loss = F.cross_entropy(model(idx), y)
        h.backward(loss, [sparse, dense])
        assert model.emb.weight.grad is None or model.emb.weight.grad.is_sparse or h.casts_model
        sparse.step()
        dense.step()
        losses.append(loss.item())
    return Result(losses)


class CellRNN(nn.Module):
    """A GRU cell called in a Python loop over time (char-RNN tutorials)."""

    def __init__(self, vocab: int = 32, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.cell = nn.GRUCell(dim, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outs = []
        for t in range(idx.shape[1]):
            hidden = self.cell(self.emb(idx[:, t]), hidden)
            outs.append(self.out(hidden))
        return torch.stack(outs, 1), hidden


@idiom()
def loop_rnn_cell(h: Harness) -> Result:
    """An ``nn.GRUCell`` stepped in a Python loop, hidden state carried across
    batches and detached (truncated BPTT)."""
    torch.manual_seed(0)
    model = CellRNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = h.setup(model, opt)
    hidden = torch.zeros(8, 32)
    losses = []
    for s in token_batches(20):
        hidden = hidden.detach()
        opt.zero_grad()
        logits, hidden = model(s[:, :-1], hidden)
        loss = F.cross_entropy(logits.reshape(-1, 32), s[:, 1:].reshape(-1))
        h.backward(loss, opt)
        opt.step()
        losses.append(loss.item())
    return Result(losses)


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, batch_first=True)
        self.out = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        y, hidden = self.rnn(self.emb(idx), hidden)
        return self.out(y), hidden


@idiom()
def loop_lstm_lm(h: Harness) -> Result:
    """``nn.LSTM`` language model as in PyTorch's word-language-model example:
    ``repackage_hidden`` between batches, ``model.zero_grad()``,
    ``clip_grad_norm_(model.parameters(), 0.25)``, SGD."""
    torch.manual_seed(0)
    model = LSTMLM()
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    model, opt = h.setup(model, opt)
    hidden = (torch.zeros(1, 8, 32), torch.zeros(1, 8, 32))
    losses = []
    for s in token_batches(25):
        hidden = tuple(t.detach() for t in hidden)
        model.zero_grad()
        logits, hidden = model(s[:, :-1], hidden)
        loss = F.cross_entropy(logits.reshape(-1, 32), s[:, 1:].reshape(-1))
        h.backward(loss, opt)
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        losses.append(loss.item())
    return Result(losses)


class CheckpointedMLP(nn.Module):
    """Blocks run through ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, ckpt_kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(2))
        self.out = nn.Linear(HIDDEN, N_CLS)
        self.ckpt_kwargs = ckpt_kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False, **self.ckpt_kwargs)
        return self.out(x)


@idiom(policy=amp.Policy(dtype=torch.bfloat16, fp32_ops=[F.gelu]))
def loop_activation_checkpointing(h: Harness) -> Result:
    """Activation checkpointing, ``use_reentrant=False``, with
    ``context_fn=amp.checkpoint_context`` as the README asks; O1/init run a policy
    that differs from torch's lists (gelu in fp32), so the recomputation must
    re-enter it."""
    torch.manual_seed(0)
    model = CheckpointedMLP(h.checkpoint_context())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = h.setup(model, opt)
    losses = []
    for x, y in classification_batches(20):
        losses.append(train_step(h, model, opt, x, y))
    return Result(losses)


@contextlib.contextmanager
def cpu_as_accelerator() -> Iterator[None]:
    """``torch.nn.parallel.parallel_apply`` (how ``nn.DataParallel`` runs its
    replicas: one thread each, entering ``torch.amp.autocast`` with the caller's
    accelerator autocast state) refuses to run without an accelerator. Let the CPU
    stand in for it, so torch's own replica threads run here: device index 0, no
    streams, and the caller's autocast state read for 'cpu' (as it is read for the
    accelerator on a GPU machine)."""
    pa = sys.modules["torch.nn.parallel.parallel_apply"]
    enabled = torch.is_autocast_enabled
    with (
        mock.patch.object(pa, "_get_device_index", lambda device, optional=False: 0),
        mock.patch.object(torch.accelerator, "is_available", lambda: True),
        mock.patch.object(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu")),
        mock.patch.object(torch.accelerator, "current_stream", lambda *a, **k: contextlib.nullcontext()),
        mock.patch.object(torch.accelerator, "device_index", lambda *a, **k: contextlib.nullcontext()),
        mock.patch.object(torch, "is_autocast_enabled", lambda *a: enabled(*a) if a else enabled("cpu")),
    ):
        yield


class CpuDataParallel(nn.DataParallel):
    """``nn.DataParallel.forward`` over 2 'devices': scatter the batch, run the
    replicas with ``parallel_apply``, gather. On CPU ``replicate`` has nothing to
    broadcast to, so each replica is the module itself (same parameters, as
    broadcast replicas are)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        chunks = x.chunk(2)
        with cpu_as_accelerator():
            outs = torch.nn.parallel.parallel_apply([self.module] * len(chunks), [(c,) for c in chunks])
        return torch.cat(outs)


class GeluHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_IN, HIDDEN)
        self.act = nn.GELU()
        self.head = nn.Linear(HIDDEN, N_CLS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


@idiom(policy=amp.Policy(dtype=torch.bfloat16, fp32_ops=[F.gelu], module_rules={"head": torch.float32}))
def loop_data_parallel(h: Harness) -> Result:
    """``nn.DataParallel`` replicas in ``parallel_apply``'s threads. The dtypes
    seen inside the replicas (gelu output, head output) must be the main thread's,
    here under a custom policy (gelu and the head pinned to fp32 at O1/init)."""
    torch.manual_seed(0)
    model = GeluHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    seen: dict[threading.Thread, list[tuple[str, torch.dtype]]] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            seen.setdefault(threading.current_thread(), []).append((name, out.dtype))

        return hook

    handles = [model.act.register_forward_hook(record("act")), model.head.register_forward_hook(record("head"))]
    dp = CpuDataParallel(model)
    losses = []
    for i, (x, y) in enumerate(classification_batches(20)):
        opt.zero_grad()
        loss = F.cross_entropy(dp(x), y)
        h.backward(loss, opt)
        opt.step()
        losses.append(loss.item())
        if i == 0:
            replicas = dict(seen)
            seen.clear()
            with torch.no_grad():
                model(x)
            (main,) = seen.values()
            assert len(replicas) == 2 and threading.current_thread() not in replicas
            for dtypes in replicas.values():
                assert dtypes == main, f"replica thread saw {dtypes}, main thread {main}"
            for handle in handles:
                handle.remove()
    return Result(losses)


def checkpoint_bytes(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@idiom()
def loop_resume_checkpoint(h: Harness) -> Result:
    """Save ``{model, optimizer, amp}`` state at step 8, train on to step 14, load
    the checkpoint back mid-run and redo steps 8..14 on the same batches: the
    replayed losses must equal the first ones bitwise (at every level), then train
    on to the end."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = h.setup(model, opt)
    batches = classification_batches(22)
    losses, first_pass = [], []
    for x, y in batches[:8]:
        losses.append(train_step(h, model, opt, x, y))
    buf = checkpoint_bytes({"model": model.state_dict(), "opt": opt.state_dict(), "amp": h.state_dict()})
    for x, y in batches[8:14]:
        first_pass.append(train_step(h, model, opt, x, y))
    ckpt = torch.load(buf, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    h.load_state_dict(ckpt["amp"])
    for x, y in batches[8:]:
        losses.append(train_step(h, model, opt, x, y))
    assert losses[8:14] == first_pass, "a resumed run must replay bitwise"
    return Result(losses)


@idiom()
def loop_resume_in_new_run(h: Harness) -> Result:
    """A run saves ``{model, optimizer, amp}`` state at step 10 and stops; a new run
    (fresh process: model and optimizer built again, setup again, then the three
    ``load_state_dict`` calls) goes on from it. Its losses must equal, bitwise, those
    of the run that was never interrupted (README: exact checkpoints)."""
    batches = classification_batches(20)

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return h.setup(model, opt)

    model, opt = build()
    uninterrupted = [train_step(h, model, opt, x, y) for x, y in batches]
    h.new_process()
    model, opt = build()
    for x, y in batches[:10]:
        train_step(h, model, opt, x, y)
    buf = checkpoint_bytes({"model": model.state_dict(), "opt": opt.state_dict(), "amp": h.state_dict()})
    h.new_process()
    model, opt = build()
    ckpt = torch.load(buf, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    h.load_state_dict(ckpt["amp"])
    resumed = [train_step(h, model, opt, x, y) for x, y in batches[10:]]
    assert resumed == uninterrupted[10:], "a resumed run must continue bitwise"
    return Result(uninterrupted)


@idiom()
def loop_save_best_model(h: Harness) -> Result:
    """``torch.save(model, f)`` of the whole model whenever validation improves;
    at the end the best model is reloaded with ``torch.load`` and evaluated."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    (xv, yv), = classification_batches(1, batch=64, seed=7)
    best_val, best_file = math.inf, None
    losses = []
    for i, (x, y) in enumerate(classification_batches(20)):
        losses.append(train_step(h, model, opt, x, y))
        if i % 5 == 4:
            with torch.no_grad():
                val = ce(model, xv, yv).item()
            if val < best_val:
                best_val, best_file = val, checkpoint_bytes(model)
    assert best_file is not None
    best = torch.load(best_file, weights_only=False)
    best.eval()
    with torch.no_grad():
        reloaded_val = ce(best, xv, yv).item()
    assert reloaded_val == best_val, "the reloaded model computes what the saved one did"
    return Result(losses, {"best_val": [reloaded_val]})


@idiom()
def loop_early_stopping_restore(h: Harness) -> Result:
    """Early stopping with the best weights kept in memory
    (``[p.detach().clone() for p in model.parameters()]``) and put back at the end
    with ``p.data.copy_(best)`` (Keras' restore_best_weights, course notebooks), then
    a final evaluation, which must compute what the best weights computed."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = h.setup(model, opt)
    (xv, yv), = classification_batches(1, batch=64, seed=7)
    best_val, best = math.inf, None
    losses, vals = [], []
    for i, (x, y) in enumerate(classification_batches(20)):
        losses.append(train_step(h, model, opt, x, y))
        if i in (3, 7, 11, 15):
            with torch.no_grad():
                vals.append(ce(model, xv, yv).item())
            if vals[-1] < best_val:
                best_val, best = vals[-1], [p.detach().clone() for p in model.parameters()]
    assert best is not None
    with torch.no_grad():
        last_val = ce(model, xv, yv).item()
    for p, b in zip(model.parameters(), best):
        p.data.copy_(b)
    with torch.no_grad():
        restored_val = ce(model, xv, yv).item()
    assert restored_val == best_val, (
        f"the restored best weights give {restored_val}, they gave {best_val} (the last weights: {last_val})"
    )
    return Result(losses, {"val_loss": [*vals, last_val, restored_val]})


@idiom()
def loop_lr_scheduler_per_iteration(h: Harness) -> Result:
    """OneCycleLR built with the optimizer (before setup) and stepped every
    iteration; the LR schedule must be fp32's exactly."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=20)
    model, opt = h.setup(model, opt)
    losses, lrs = [], []
    for x, y in classification_batches(20):
        opt.zero_grad()
        loss = ce(model, x, y)
        h.backward(loss, opt)
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        losses.append(loss.item())
    return Result(losses, exact={"lr": lrs})


class LayerNorm(nn.Module):
    """A hand-written LayerNorm, as GPT codebases define their own (mean and
    variance by hand)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_IN, HIDDEN)
        self.ln = LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.head(F.gelu(self.ln(h + 3.0)))  # an offset mean: 16-bit statistics lose it


@idiom(keep_fp32=(LayerNorm,))
def loop_custom_layernorm(h: Harness) -> Result:
    """A hand-written LayerNorm class kept fp32 with ``initialize(keep_fp32=[LayerNorm])``
    at O2/O3/O2K (issue 16); its parameters must stay fp32 and its statistics be
    computed in fp32."""
    torch.manual_seed(0)
    model = NormedMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = h.setup(model, opt)
    if h.casts_model:
        assert model.fc.weight.dtype == h.dtype
        assert {p.dtype for p in model.ln.parameters()} == {torch.float32}
    seen: list[torch.dtype] = []
    # prepend: see the norm's own output, before a cast hook hands it on in 16 bits
    model.ln.register_forward_hook(lambda m, a, out: seen.append(out.dtype), prepend=True)
    losses = []
    for x, y in classification_batches(20):
        losses.append(train_step(h, model, opt, x, y))
    if h.casts_model:
        assert set(seen) == {torch.float32}, f"custom LayerNorm computed in {set(seen)}"
    return Result(losses)


class GPTHead(nn.Module):
    """nanoGPT's contract: ``forward(idx, targets) -> (logits, loss)``, the
    cross-entropy computed inside ``forward``."""

    def __init__(self, vocab: int = 32, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(F.gelu(self.fc(self.emb(idx))))
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


@idiom()
def loop_cross_entropy_in_forward(h: Harness) -> Result:
    """The model returns ``(logits, loss)``. Every level but O3 (pure 16-bit by
    definition) must compute that loss in fp32 (issue 16): equal, to fp32
    rounding, to fp32 cross-entropy of the logits the model returned."""
    torch.manual_seed(0)
    model = GPTHead()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = h.setup(model, opt)
    losses = []
    for s in token_batches(25):
        opt.zero_grad()
        logits, loss = model(s[:, :-1], s[:, 1:])
        assert loss.dtype == torch.float32
        if h.mode != "O3":
            exact = F.cross_entropy(logits.detach().float().reshape(-1, 32), s[:, 1:].reshape(-1))
            assert abs(loss.item() - exact.item()) <= 1e-5 * exact.item(), (
                f"loss {loss.item()} vs fp32 cross-entropy of the same logits {exact.item()}"
            )
        h.backward(loss, opt)
        opt.step()
        losses.append(loss.item())
    return Result(losses)


@idiom(dtype=torch.float16, raises=(("O2K", "bf16|bfloat16"),))
def loop_clip_fp16(h: Harness) -> Result:
    """fp16 with loss scaling (tiny tensors): ``model.zero_grad()`` and an unchanged
    ``clip_grad_norm_(model.parameters(), max_norm)``; the clip must see unscaled
    grads. O2K is bf16 by definition and refuses fp16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    model, opt = h.setup(model, opt)
    teacher = torch.randn(8, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(20):
        x = torch.randn(8, 8, generator=g)
        y = (x @ teacher > 0).long()
        model.zero_grad()
        loss = ce(model, x, y)
        h.backward(loss, opt)
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 0.2)))
        opt.step()
        losses.append(loss.item())
    return Result(losses, {"grad_norm": norms})


def scaler_train(
    h: Harness, scaler: Any, opt_cls: type[torch.optim.Optimizer], wrap: Callable[[Any], Any] = lambda o: o, **opt_kw: Any
) -> Result:
    """A script that owns a GradScaler (torch.amp's recipe, no autocast):
    ``scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(model.parameters());
    scaler.step(opt); scaler.update()``, ``opt`` the optimizer set up, or ``wrap`` of it
    (a framework's wrapper). Logs the norm the clip saw; the steps the scaler skipped
    must be fp32's (none)."""
    model = mlp()
    opt = opt_cls(model.parameters(), **opt_kw)
    model, opt = h.setup(model, opt)
    opt = wrap(opt)
    losses, norms, skipped = [], [], 0
    for x, y in classification_batches(20):
        opt.zero_grad()
        loss = ce(model, x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        losses.append(loss.item())
    if not h.active:
        assert sum(n > MAX_NORM for n in norms) >= 10, norms  # the clip does clip
    return Result(losses, {"grad_norm": norms}, exact={"skipped": skipped})


#: torch.amp.GradScaler's unscale_ of O2's fp32 masters runs where ampkit cannot see it
#: (its fused kernel leaves version counters alone): refused at the step, naming the fix.
TORCH_SCALER_AT_O2 = "torch.amp.GradScaler.*ampkit.GradScaler"


@idiom(raises=(("O2", TORCH_SCALER_AT_O2),))
def loop_torch_grad_scaler(h: Harness) -> Result:
    """The script keeps its ``torch.amp.GradScaler`` (SGD): right at every level but O2,
    where it is refused (``ampkit run`` handles it: tests/tools/test_run_idioms.py)."""
    return scaler_train(h, torch.amp.GradScaler("cpu"), torch.optim.SGD, lr=0.5, momentum=0.5)


@idiom()
def loop_ampkit_grad_scaler_sgd(h: Harness) -> Result:
    """The same script with ``ampkit.GradScaler`` (one import changed), SGD: its unscale_
    reaches the model's grads at O2, so the clip sees real grads at every level."""
    return scaler_train(h, amp.GradScaler("cpu"), torch.optim.SGD, lr=0.5, momentum=0.5)


@idiom()
def loop_ampkit_grad_scaler_adamw(h: Harness) -> Result:
    """As above with AdamW."""
    return scaler_train(h, amp.GradScaler("cpu"), torch.optim.AdamW, lr=1e-2)


@idiom(dtype=torch.float16, raises=(("O2K", "bf16|bfloat16"), ("O3", "unscale FP16 gradients")))
def loop_ampkit_grad_scaler_fp16(h: Harness) -> Result:
    """``ampkit.GradScaler`` with fp16 models (O2: fp16 grads scaled by 2**16 moved into
    the masters, unscaled there by the scaler's unscale_ and shown on the model). O3's
    fp16 grads are refused by the scaler, as torch.amp's refuses them."""
    return scaler_train(h, amp.GradScaler("cpu"), torch.optim.SGD, lr=0.5, momentum=0.5)


class LightningOptimizerLike:
    """The shape of Lightning's ``LightningOptimizer``: not a torch optimizer, the one
    it wraps exposed as ``.optimizer``; ``step``/``zero_grad`` forward to it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none)


class AcceleratedOptimizerLike(torch.optim.Optimizer):
    """The shape of Accelerate's ``AcceleratedOptimizer``: a ``torch.optim.Optimizer``
    subclass holding the real optimizer as ``.optimizer`` (its ``__init__`` not called)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


class OutDtypes:
    """Forward hook recording the dtype of each output (picklable)."""

    def __init__(self) -> None:
        self.seen: list[torch.dtype] = []

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        self.seen.append(out.dtype)


@idiom()
def loop_accelerate_wrapped_optimizer_with_grad_scaler(h: Harness) -> Result:
    """Accelerate's fp16 shape: the GradScaler (ampkit's) unscales and steps the wrapper
    (an AcceleratedOptimizer-like ``torch.optim.Optimizer`` holding the set-up one)."""
    return scaler_train(h, amp.GradScaler("cpu"), torch.optim.SGD, AcceleratedOptimizerLike, lr=0.5, momentum=0.5)


class LitClassifier(nn.Module):
    """A LightningModule's shape: the network in ``self.net``; ``training_step`` calls
    ``self.net(x)``, not ``self(x)`` (the module set up by ampkit is this one)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.recorder = OutDtypes()
        self.net_out_dtypes = self.recorder.seen
        self.net[0].register_forward_hook(self.recorder)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)


def wrapped_train(h: Harness, model: nn.Module, wrap: Callable[[torch.optim.Optimizer], Any], step: Callable) -> Result:
    """A framework's loop: the optimizer set up by ampkit, then wrapped by the framework;
    every ampkit call takes the wrapper. Clips ``master_params(wrapper)`` after unscale."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    model, opt = h.setup(model, opt)
    wrapper = wrap(opt)
    losses, norms = [], []
    for batch in classification_batches(20):
        wrapper.zero_grad()
        loss = step(model, batch)
        h.backward(loss, wrapper)
        h.unscale(wrapper)
        norms.append(float(nn.utils.clip_grad_norm_(h.master_params(wrapper), MAX_NORM)))
        wrapper.step()
        losses.append(loss.item())
    if h.active:
        assert amp.stats(wrapper).steps == 20 and not amp.step_skipped(wrapper)
    return Result(losses, {"grad_norm": norms})


@idiom()
def loop_lightning_training_step_calls_self_net(h: Harness) -> Result:
    """Lightning's shapes: a LightningOptimizer-like wrapper passed to every ampkit call,
    and a ``training_step`` that enters ``self.net`` directly (at O2/O3/O2K the 16-bit
    net is entered as the set-up module would be: inputs cast, matmuls in 16 bits,
    outputs fp32)."""
    torch.manual_seed(0)
    model = LitClassifier()
    result = wrapped_train(h, model, LightningOptimizerLike, lambda m, b: m.training_step(b))
    assert set(model.net_out_dtypes) == {h.dtype if h.casts_model or h.mode in ("O1", "init") else torch.float32}
    return result


@idiom()
def loop_accelerate_wrapped_optimizer(h: Harness) -> Result:
    """Accelerate's shape: an AcceleratedOptimizer-like ``torch.optim.Optimizer`` subclass
    wrapping the managed optimizer, passed to every ampkit call."""
    return wrapped_train(h, mlp(), AcceleratedOptimizerLike, lambda m, b: ce(m, *b))


# ---------------------------------------------------------------------------
# Known failures on today's library: (idiom, mode) -> "issue N: cause"
# ---------------------------------------------------------------------------

KNOWN_FAILURES: dict[tuple[str, str], str] = {
}


# ---------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------
_REFERENCES: dict[str, Result] = {}


def fp32_reference(name: str) -> Result:
    """The idiom run without ampkit; checked to train far more than the largest
    level tolerance, so a case that does not train cannot pass."""
    if name not in _REFERENCES:
        spec = IDIOMS[name]
        amp.reset()
        ref = spec.fn(Harness("fp32", spec.dtype))
        first, last = ref.losses[0], tail_mean(ref.losses)
        widest = max(tolerance(m, spec.dtype) for m in MODES)
        assert first - last > 2 * widest * abs(last), (
            f"{name}: fp32 goes from {first:.4f} to {last:.4f}; the loop must train by "
            f"more than twice the widest tolerance ({widest:.3f} relative) to tell levels apart"
        )
        _REFERENCES[name] = ref
    return _REFERENCES[name]


def tail_mean(losses: list[float]) -> float:
    return sum(losses[-TAIL:]) / len(losses[-TAIL:])


def assert_close(name: str, got: list[float], ref: list[float], tol: float, mode: str) -> None:
    assert len(got) == len(ref), f"{name}: {len(got)} values, fp32 has {len(ref)}"
    if tol == 0.0:
        assert got == ref, f"{name}: {mode} must be bitwise fp32: {got} vs {ref}"
        return
    for i, (a, b) in enumerate(zip(got, ref)):
        assert math.isfinite(a), f"{name}[{i}] is {a} under {mode}"
        assert abs(a - b) <= tol * abs(b), (
            f"{name}[{i}]: {mode} {a:.6g} vs fp32 {b:.6g} (rel {abs(a - b) / abs(b):.3g} > tol {tol:.3g})"
        )


def _cases() -> list[Any]:
    cases = []
    for name in IDIOMS:
        for mode in MODES:
            marks = []
            if (name, mode) in KNOWN_FAILURES:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[(name, mode)]))
            cases.append(pytest.param(name, mode, id=f"{name}-{mode}", marks=marks))
    return cases


@pytest.mark.parametrize("name", list(IDIOMS))
def test_fp32_reference_trains(name: str) -> None:
    fp32_reference(name)


@pytest.mark.parametrize(("name", "mode"), _cases())
def test_idiom(name: str, mode: str) -> None:
    spec = IDIOMS[name]
    expected_error = dict(spec.raises).get(mode)
    if mode == VIEW_MODE:
        expected_error = "bf16" if spec.dtype != torch.bfloat16 else dict(spec.raises).get("O2")
    if expected_error is not None:
        with pytest.raises(amp.AmpError, match=expected_error):
            spec.fn(spec.harness(mode))
        return
    ref = fp32_reference(name)
    amp.reset()
    got = spec.fn(spec.harness(mode))
    tol = tolerance(mode, spec.dtype)
    assert got.exact == ref.exact
    # The headline: the loss (or the idiom's metric) over the last TAIL steps.
    assert_close(f"mean loss of the last {TAIL} steps", [tail_mean(got.losses)], [tail_mean(ref.losses)], tol, mode)
    for key, values in ref.series.items():
        assert_close(key, got.series[key], values, tol, mode)
    if mode == "O0":
        assert got.losses == ref.losses, "O0 must be bitwise fp32 at every step"


def test_the_matrix_holds_the_idioms_users_write_and_no_stale_known_failure() -> None:
    """The idioms of the real loops ampkit promises to run (grad edits, clipping after
    unscale, accumulation, two optimizers, checkpointing, resumes, DataParallel,
    torch.amp's GradScaler) are registered, and every known failure names an idiom and
    a mode of the matrix (an entry left after a rename would silently mark nothing)."""
    promised = {"grad_edit_weight_decay", "clip_after_unscale", "grad_accumulation", "two_optimizers",
                "activation_checkpointing", "resume_checkpoint", "data_parallel", "torch_grad_scaler",
                "sam_two_steps", "gradient_penalty"}
    assert promised <= set(IDIOMS), sorted(promised - set(IDIOMS))
    assert all(name in IDIOMS and mode in MODES for name, mode in KNOWN_FAILURES), KNOWN_FAILURES


@pytest.mark.parametrize("level", ["O2", "O3", "O2K"])
def test_a_cast_submodule_entered_directly_runs_as_the_model_would(level):
    """``model.net(x)`` instead of ``model(x)`` (a LightningModule's ``training_step``):
    the 16-bit net takes fp32 inputs, computes in 16 bits and hands back fp32, exactly
    what ``model(x)`` computes; a whole-model ``torch.save``/``torch.load`` keeps it so."""
    amp.reset()
    torch.manual_seed(0)
    model = LitClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level)
    x, y = classification_batches(1)[0]
    direct, through = model.net(x), model(x)
    assert direct.dtype == torch.float32 and torch.equal(direct, through)
    assert model.net_out_dtypes == [torch.bfloat16, torch.bfloat16]
    loss = model.training_step((x, y))
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert not amp.step_skipped(opt)
    with torch.serialization.safe_globals([LitClassifier, OutDtypes, nn.Sequential, nn.Linear, nn.ReLU]):
        loaded = torch.load(checkpoint_bytes(model))
    assert torch.equal(loaded.net(x), model.net(x))
    amp.reset()


# ---------------------------------------------------------------------------
# A seeded run is reproducible: ampkit draws from no generator a user can observe
# ---------------------------------------------------------------------------
def rng_states() -> tuple[Any, ...]:
    """The global generators a script can seed and observe: torch's, Python's, numpy's."""
    np_state = np.random.get_state()
    return torch.get_rng_state(), random.getstate(), (np_state[0], np_state[1].tobytes(), *np_state[2:])


def seeded_work(h: Harness) -> tuple[Any, ...]:
    """Seed every generator, build, set up and train a few steps drawing the data from
    the global generators (the first casting scope opens among them); the states after."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = h.setup(model, opt)
    for _ in range(3):
        x = torch.randn(8, D_IN)
        y = torch.tensor([random.randrange(N_CLS) for _ in range(8)])
        x = x + torch.from_numpy(np.random.standard_normal((8, D_IN)).astype(np.float32))
        train_step(h, model, opt, x, y)
    return rng_states()


@pytest.mark.parametrize("mode", MODES)
def test_a_seeded_run_leaves_the_generators_as_fp32_does(mode):
    """After the same seeded work, torch's, Python's and numpy's global generators are
    where the fp32 run leaves them, at every level."""
    amp.reset()
    reference = seeded_work(Harness("fp32"))
    amp.reset()
    got = seeded_work(Harness(mode))
    amp.reset()
    assert torch.equal(got[0], reference[0]), f"{mode}: torch's default generator moved"
    assert got[1] == reference[1] and got[2] == reference[2]
