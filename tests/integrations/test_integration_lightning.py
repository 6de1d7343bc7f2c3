"""ampkit inside PyTorch Lightning (``ampkit.integrations.lightning``), run on the real
Trainer (CPU, tiny random-init models): every level trains as Lightning's own fp32 run
does; a checkpoint resumes bitwise; an injected NaN gradient is skipped where Lightning's
``bf16-mixed`` is not; clipping and grad hooks see real gradients; per-step schedulers
are held on skipped steps; manual optimization with two optimizers (a GAN); DDP with two
gloo processes at O1 and O2; Fabric; and ``ampkit run`` on the unmodified script gives
the integration's figures."""

from __future__ import annotations

import json
import math
import os
import pickle
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from locations import ROOT, SCRIPTS
from torch import nn

import ampkit as amp
from ampkit.errors import AmpError, StateError
from ampkit.integrations.lightning import (
    AmpkitDDPStrategy,
    AmpkitFabricPrecision,
    AmpkitPrecision,
    HeldScheduler,
)
from ampkit.tools.cli.main import main as ampkit_main

CLASSIFIER = SCRIPTS / "lightning_classifier.py"
# the unmodified Lightning script's model, data and held-out loss (not run as __main__)
SCRIPT = runpy.run_path(str(CLASSIFIER), run_name="lightning_classifier")

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning",  # Lightning's advice (num_workers, litlogger), fp16-on-CPU speed
    "ignore::DeprecationWarning",
    "ignore:.*LeafSpec.*",  # Lightning 2.6's use of a torch.utils._pytree name torch 2.13 deprecates
)


def _trainer(tmp_path: Path, plugin=None, steps: int = 60, **kwargs) -> pl.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0,
        plugins=[plugin] if plugin is not None else None, **kwargs,
    )


def _fp32_weights(model: nn.Module, trainer: pl.Trainer) -> list[torch.Tensor]:
    """The trained weights in fp32, in ``model.parameters()`` order: O2's masters where
    the model holds 16-bit copies, the model's own weights otherwise."""
    out = []
    opt = trainer.optimizers[0]
    masters = amp.levels.master_weights_of(opt) if isinstance(trainer.precision_plugin, AmpkitPrecision) else None
    for p in model.parameters():
        m = masters.master_of(p) if masters is not None else None
        out.append((m if m is not None else p).detach().float().clone())
    return out


def _rel_distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(((x - y) ** 2).sum() for x, y in zip(a, b))
    den = sum((y**2).sum() for y in b)
    return math.sqrt(float(num / den))


def _fit_classifier(tmp_path: Path, plugin=None, steps: int = 120) -> dict:
    """The script's classifier fitted by Lightning (``plugin``: None for fp32): its
    held-out loss, fp32 weights, the dtypes of two weights and ampkit's counters, read
    right after the fit (the ampkit session ends with the next fit)."""
    model, train, heldout = SCRIPT["build"](total=steps)
    trainer = _trainer(tmp_path, plugin, steps=steps)
    trainer.fit(model, train)
    return {
        "loss": SCRIPT["heldout_loss"](model, heldout),
        "weights": _fp32_weights(model, trainer),
        "dtypes": (model.net[0].weight.dtype, model.net[2].weight.dtype),  # a linear, the LayerNorm
        "stats": amp.stats(trainer.optimizers[0]) if plugin is not None else None,
    }


@pytest.fixture(scope="module")
def classifier_runs(tmp_path_factory):
    """``runs(case)``: :func:`_fit_classifier` for a case of :data:`LEVELS` (or
    ``"fp32"``, Lightning's own fp32 run), each fitted once per module."""
    done: dict[str, dict] = {}

    def runs(case: str) -> dict:
        if case not in done:
            plugin = None if case == "fp32" else AmpkitPrecision(**LEVELS[case])
            done[case] = _fit_classifier(tmp_path_factory.mktemp(case), plugin)
        return done[case]

    return runs


# ---------------------------------------------------------------------------
# 1. every level trains as Lightning's fp32 run does
# ---------------------------------------------------------------------------
LEVELS = {
    "O1": dict(opt_level="O1"),
    "O2": dict(opt_level="O2"),
    "O2K": dict(opt_level="O2K"),
    "O3": dict(opt_level="O3"),
    "O1-fp16": dict(opt_level="O1", dtype=torch.float16),
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c == "O2K" else c for c in LEVELS]  # O2K: compiles its kernels
)
def test_level_trains_within_one_percent_of_lightning_fp32(case, classifier_runs):
    ref, run = classifier_runs("fp32"), classifier_runs(case)
    ref_loss, ref_weights, loss, weights = ref["loss"], ref["weights"], run["loss"], run["weights"]
    level = AmpkitPrecision(**LEVELS[case]).opt_level
    dtype = torch.float16 if case == "O1-fp16" else torch.bfloat16
    assert level.name == case.split("-")[0] and level.dtype == dtype
    # what the level stores: fp32 weights (O1), a 16-bit model with fp32 norms (O2/O2K), all 16-bit (O3)
    first, norm = run["dtypes"]
    assert first == (torch.float32 if level.name == "O1" else dtype)
    assert norm == (dtype if level.name == "O3" else torch.float32)
    stats = run["stats"]
    assert stats.steps == 120
    rel = abs(loss - ref_loss) / ref_loss
    distance = _rel_distance(weights, ref_weights)
    if level.name == "O3":  # pure bf16 updates, no fp32 copy: trains, not as fp32 does
        assert loss < 2 * ref_loss and distance < 0.2, (loss, ref_loss, distance)
    else:
        assert rel < 0.01, f"{case}: held-out loss {loss:.5f} vs fp32 {ref_loss:.5f} ({rel:.2%})"
        assert distance < 0.03, f"{case}: weights {distance:.2%} from fp32's"
    if case == "O1-fp16":
        assert stats.scales[0] > 1  # real fp16 with a dynamic loss scale
    print(f"FIGURE {case}: held-out loss {loss:.5f} vs fp32 {ref_loss:.5f} ({rel:.3%}), "
          f"weights {distance:.3%} apart, {stats.skipped} skipped")


def test_gradient_accumulation_o2(tmp_path):
    """``accumulate_grad_batches=2`` at O2: one ampkit step per two batches (the fp32
    masters sum both), within 1% of Lightning's fp32 run with the same accumulation."""
    results = {}
    for name, plugin in (("fp32", None), ("O2", AmpkitPrecision("O2"))):
        model, train, heldout = SCRIPT["build"](total=30)
        trainer = _trainer(tmp_path, plugin, steps=30, accumulate_grad_batches=2)
        trainer.fit(model, train)
        results[name] = SCRIPT["heldout_loss"](model, heldout)
        if plugin is not None:
            assert amp.stats(trainer.optimizers[0]).steps == 30 and trainer.global_step == 30
    rel = abs(results["O2"] - results["fp32"]) / results["fp32"]
    assert rel < 0.01, results
    print(f"FIGURE accumulation O2: held-out loss {results['O2']:.5f} vs fp32 {results['fp32']:.5f} ({rel:.3%})")


# ---------------------------------------------------------------------------
# a probe: the script's classifier with the hooks the tests need
# ---------------------------------------------------------------------------
Classifier = SCRIPT["Classifier"]


class Probe(Classifier):
    """The classifier with an optional NaN gradient injected in ``on_after_backward`` at
    one step, an optional grad edit there, and a choice of optimizer."""

    def __init__(self, nan_at: int | None = None, zero_grad_of: str | None = None, sgd: bool = False):
        super().__init__(total=40)
        self.nan_at, self.zero_grad_of, self.sgd = nan_at, zero_grad_of, sgd
        self.grad_norms: list[float] = []

    def on_after_backward(self):
        self.grad_norms.append(float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in self.parameters()))))
        if self.global_step == self.nan_at:
            self.net[0].weight.grad[0, 0] = float("nan")
        if self.zero_grad_of is not None:
            self.get_parameter(self.zero_grad_of).grad.zero_()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        # what the optimizer is about to step: the plugin's main params (O2: fp32 masters)
        grads = [p.grad.float() for p in self.trainer.precision_plugin.main_params(optimizer) if p.grad is not None]
        self.clipped = (math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads)), max(float(g.abs().max()) for g in grads))

    def configure_optimizers(self):
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=1.0)
        return super().configure_optimizers()


def _loader(n: int = 256, batch: int = 32):
    return torch.utils.data.DataLoader(SCRIPT["clusters"](n, seed=1), batch_size=batch, shuffle=False)


def _probe(seed: int = 0, **kwargs) -> Probe:
    torch.manual_seed(seed)
    return Probe(**kwargs)


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a (nested) state dict, in a fixed order, cloned."""
    if isinstance(obj, torch.Tensor):
        return [obj.detach().clone()]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


class Snapshots(Callback):
    """After every batch: the parameters, the optimizer state, the scheduler's step
    count and learning rate, and ampkit's skip signal."""

    def __init__(self):
        self.params, self.opt_state, self.sched_steps, self.lrs, self.skipped = [], [], [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        self.params.append(_tensors(list(pl_module.parameters())))
        self.opt_state.append(_tensors(opt.state_dict()["state"]))
        sched = trainer.lr_scheduler_configs[0].scheduler
        self.sched_steps.append(sched.last_epoch)
        self.lrs.append(opt.param_groups[0]["lr"])
        if isinstance(trainer.precision_plugin, AmpkitPrecision):
            self.skipped.append(amp.step_skipped(opt))


# ---------------------------------------------------------------------------
# 2. bitwise resume from a Lightning checkpoint
# ---------------------------------------------------------------------------
def _state_of(model: nn.Module, trainer: pl.Trainer) -> dict[str, list[torch.Tensor]]:
    opt = trainer.optimizers[0]
    return {
        "params": _tensors(list(model.parameters())),
        "fp32": _fp32_weights(model, trainer),
        "optimizer": _tensors(opt.state_dict()["state"]),
        "ampkit": _tensors(amp.state_dict()),
        "lr": [torch.tensor(opt.param_groups[0]["lr"])],
    }


@pytest.mark.parametrize("level", ["O1", "O2", pytest.param("O2K", marks=pytest.mark.slow)])
def test_resume_from_lightning_checkpoint_is_bitwise(level, tmp_path):
    """16 steps straight vs 8 steps, a ModelCheckpoint at the epoch's last batch, and a fresh
    model resumed with ``trainer.fit(ckpt_path=...)`` for the other 8: the same weights,
    fp32 masters, optimizer state, ampkit state and learning rate, bit for bit. Without
    ampkit's entry the resume warns (as HF's and Accelerate's do) and is not exact."""
    ckpts = tmp_path / "ckpts"
    model = _probe()
    # saved at the last batch of the first epoch (Lightning resumes a plain DataLoader
    # exactly from there; an epoch-end save replays a batch, a mid-epoch one restarts the loader)
    saver = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=8, save_top_k=-1)
    trainer = _trainer(tmp_path, AmpkitPrecision(level), steps=16, callbacks=[saver], enable_checkpointing=True)
    trainer.fit(model, _loader())
    straight = _state_of(model, trainer)
    ckpt = ckpts / "epoch=0-step=8.ckpt"
    saved = torch.load(ckpt, weights_only=True)  # plain tensors and containers
    assert saved["AmpkitPrecision"]["format"] == "ampkit.lightning/1"
    assert saved["AmpkitPrecision"]["opt_level"] == level

    resumed_model = _probe(seed=1)  # other initial weights: everything must come from the checkpoint
    trainer = _trainer(tmp_path, AmpkitPrecision(level), steps=16)
    trainer.fit(resumed_model, _loader(), ckpt_path=ckpt)
    resumed = _state_of(resumed_model, trainer)
    for key in straight:
        assert _all_equal(resumed[key], straight[key]), f"{level}: {key} differs after resume"

    if level == "O2":  # without ampkit's state the masters come back from the bf16 weights
        del saved["AmpkitPrecision"]
        torch.save(saved, tmp_path / "no_amp.ckpt")
        lossy_model = _probe(seed=1)
        trainer = _trainer(tmp_path, AmpkitPrecision(level), steps=16)
        with pytest.warns(UserWarning, match="holds no AmpkitPrecision entry.*not exact"):
            trainer.fit(lossy_model, _loader(), ckpt_path=tmp_path / "no_amp.ckpt")
        lossy = _fp32_weights(lossy_model, trainer)
        off = max(float((a - b).abs().max()) for a, b in zip(lossy, straight["fp32"]))
        assert off > 0
        print(f"FIGURE O2 resume without ampkit's state: masters off by up to {off:.2e}")


# ---------------------------------------------------------------------------
# 3. an injected NaN gradient: skipped by ampkit, not by Lightning's bf16-mixed
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_nan_gradient_is_skipped_and_scheduler_held(level, tmp_path):
    snaps = Snapshots()
    model = _probe(nan_at=5)
    plugin = AmpkitPrecision(level)
    trainer = _trainer(tmp_path, plugin, steps=8, callbacks=[snaps])
    trainer.fit(model, _loader())
    assert snaps.skipped == [False] * 5 + [True, False, False]
    # the skipped step left parameters and optimizer state as they were, bit for bit
    assert _all_equal(snaps.params[5], snaps.params[4])
    assert _all_equal(snaps.opt_state[5], snaps.opt_state[4])
    assert not _all_equal(snaps.params[6], snaps.params[5])  # and training went on
    # the per-step schedule was held: 7 real steps, 7 scheduler steps
    assert snaps.sched_steps == [1, 2, 3, 4, 5, 5, 6, 7]
    assert snaps.lrs[5] == snaps.lrs[4]
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, HeldScheduler) and sched.held == 1 and model.lr_schedulers() is sched
    assert isinstance(sched.scheduler, torch.optim.lr_scheduler.LambdaLR)
    stats = amp.stats(trainer.optimizers[0])
    assert (stats.steps, stats.skipped) == (8, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.global_step == 8  # Lightning counts the skipped step, as with its "16-mixed"


def test_lightning_bf16_mixed_does_not_skip_a_nan_gradient(tmp_path):
    """The same injection under Lightning's own ``precision="bf16-mixed"``: the NaN is
    stepped into the weights and the schedule advances."""
    snaps = Snapshots()
    model = _probe(nan_at=5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        precision="bf16-mixed", callbacks=[snaps],
    )
    trainer.fit(model, _loader())
    assert snaps.sched_steps == [1, 2, 3, 4, 5, 6, 7, 8]
    assert not torch.isfinite(model.net[0].weight).all()
    assert all(not torch.isfinite(p).all() for p in model.parameters() if p.dim() == 2)


# ---------------------------------------------------------------------------
# 4. clipping and grad hooks see real gradients, at every level
# ---------------------------------------------------------------------------
def _one_sgd_step(tmp_path, plugin, **trainer_kwargs):
    """One SGD step (lr 1) from the same weights and batch: (fp32 update per parameter,
    grad norm seen in on_after_backward, model)."""
    model = _probe(sgd=True, zero_grad_of="net.3.weight")
    before = [p.detach().float().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, plugin, steps=1, **trainer_kwargs)
    trainer.fit(model, _loader())
    after = _fp32_weights(model, trainer) if plugin is not None else [p.detach().clone() for p in model.parameters()]
    if plugin is not None and not plugin.opt_level.master_weights:  # O3/O2K: bf16 weights from the start
        before = [b.to(p.dtype).float() for b, p in zip(before, model.parameters())]
    return [a - b for a, b in zip(after, before)], model.grad_norms[0], model


CLIP_CASES = {
    "O0": dict(opt_level="O0"),
    "O1": dict(opt_level="O1"),
    "O1-fp16": dict(opt_level="O1", dtype=torch.float16, loss_scale=1024.0),
    "O2-fp16": dict(opt_level="O2", dtype=torch.float16, loss_scale=1024.0),
    "O2": dict(opt_level="O2"),
    "O2K": dict(opt_level="O2K"),
    "O3": dict(opt_level="O3"),
}


@pytest.mark.parametrize("case", list(CLIP_CASES))
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_and_grad_edits_see_real_gradients(case, algorithm, tmp_path):
    clip = 0.05 if algorithm == "norm" else 1e-3
    kw = dict(gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    ref_update, ref_norm, _ = _one_sgd_step(tmp_path, None, **kw)
    plugin = AmpkitPrecision(**CLIP_CASES[case])
    update, norm, model = _one_sgd_step(tmp_path, plugin, **kw)
    # on_after_backward saw the real gradient (not 1024x), within the compute dtype's rounding
    assert abs(norm - ref_norm) / ref_norm < 0.05, (norm, ref_norm)
    # the edit made there reached the step: that layer did not move (O2: its fp32 master)
    names = [n for n, _ in model.named_parameters()]
    assert not update[names.index("net.3.weight")].any()
    # clipping acted on the real, edited gradients of what the optimizer steps
    norm_after, biggest = model.clipped
    level = plugin.opt_level
    fp32_steps = level.cast_model_type is None or level.master_weights  # fp32 weights or masters
    rounding = 1e-6 if fp32_steps else 2**-8  # O3/O2K step bf16 grads
    if algorithm == "norm":
        assert abs(norm_after - clip) / clip < 1e-3 + 2 * rounding, norm_after
    else:
        assert 0.5 * clip < biggest <= clip * (1 + rounding), biggest
    if fp32_steps:  # fp32 updates (weights or masters): fp32's step
        assert _rel_distance(update, ref_update) < 0.03
        if algorithm == "norm":
            total = math.sqrt(sum(float((u.double() ** 2).sum()) for u in update))
            assert abs(total - clip) / clip < 1e-3, total


# ---------------------------------------------------------------------------
# 5. manual optimization: a tiny GAN with two optimizers
# ---------------------------------------------------------------------------
class GAN(pl.LightningModule):
    """A 2-D GAN (target: a Gaussian at (2, -1)), manual optimization with
    ``toggle_optimizer``, optionally a NaN in the discriminator's grad at one step."""

    def __init__(self, nan_d_at: int | None = None):
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        self.nan_d_at = nan_d_at
        self.d_trainable_in_g_step: list[bool] = []
        self.skips: list[tuple[bool, bool]] = []

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 4)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
        self.d_trainable_in_g_step.append(any(p.requires_grad for p in self.discriminator.parameters()))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        d_loss = (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                  + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)) / 2
        self.manual_backward(d_loss)
        if batch_idx == self.nan_d_at:
            self.discriminator[0].weight.grad[0, 0] = float("nan")
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        if isinstance(self.trainer.precision_plugin, AmpkitPrecision):
            self.skips.append((amp.step_skipped(opt_g), amp.step_skipped(opt_d)))

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999)))


def _gan_loader(steps: int):
    g = torch.Generator().manual_seed(3)
    real = torch.randn(steps * 64, 2, generator=g) * 0.5 + torch.tensor([2.0, -1.0])
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(real), batch_size=64)


def _fit_gan(tmp_path, plugin, steps=150, **kwargs):
    torch.manual_seed(0)
    gan = GAN(**kwargs)
    trainer = _trainer(tmp_path, plugin, steps=2 * steps)  # Lightning counts both optimizers' steps
    trainer.fit(gan, _gan_loader(steps))
    torch.manual_seed(5)
    with torch.no_grad():
        sample = gan.generator(torch.randn(4000, 4)).float()
    return gan, trainer, sample.mean(0)


@pytest.fixture(scope="module")
def gan_fp32_mean(tmp_path_factory):
    return _fit_gan(tmp_path_factory.mktemp("gan"), None)[2]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_manual_optimization_gan_two_optimizers(level, gan_fp32_mean, tmp_path):
    ref_mean = gan_fp32_mean
    gan, trainer, mean = _fit_gan(tmp_path, AmpkitPrecision(level), nan_d_at=40)
    opt_g, opt_d = trainer.optimizers
    assert amp.stats(opt_g).steps == amp.stats(opt_d).steps == 150
    # the NaN in the discriminator's grad skipped its step only
    assert (amp.stats(opt_g).skipped, amp.stats(opt_d).skipped) == (0, 1)
    assert gan.skips[40] == (False, True)
    # toggle_optimizer froze the discriminator during the generator's backward (O2: the
    # toggle sets the masters' requires_grad; ampkit mirrors it onto the bf16 weights)
    assert not any(gan.d_trainable_in_g_step)
    assert all(torch.isfinite(p).all() for p in gan.parameters())
    # the generator learned what fp32's did (it starts near (0, 0); the data sit at (2, -1))
    assert (mean - ref_mean).norm() < 0.1 and (ref_mean - torch.tensor([2.0, -1.0])).norm() < 1.0, (mean, ref_mean)
    print(f"FIGURE GAN {level}: generated mean {mean.tolist()} vs fp32 {ref_mean.tolist()} (data at (2, -1))")


# ---------------------------------------------------------------------------
# 6. DDP: two gloo processes on the CPU, O1 (strategy="ddp") and O2 ("ampkit_ddp")
# ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_two_processes_o1_and_o2(tmp_path):
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
               "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT / "src")}
        procs.append(subprocess.Popen(
            [sys.executable, str(SCRIPTS / "lightning_ddp.py"), "--out", str(tmp_path), "--steps", "30"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    logs = [p.communicate(timeout=280)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    ref = ranks[0]["fp32"]["loss"]
    for level in ("O1", "O2"):
        a, b = ranks[0][level], ranks[1][level]
        assert a["wrapper"] == "DistributedDataParallel"
        # both ranks ended with the same weights, and the same fp32 masters (O2), bit for bit
        assert _all_equal(a["weights"], b["weights"]) and _all_equal(a["masters"], b["masters"])
        assert a["steps"] == 30 and a["skipped"] == 0
        # the skip decision is agreed over the ranks (a rank's grads can change after DDP's sums)
        assert a["sync_plan"][0] is True, a["sync_plan"]
        rel = abs(a["loss"] - ref) / ref
        assert rel < 0.01, (level, a["loss"], ref)
        print(f"FIGURE DDP {level}: held-out loss {a['loss']:.5f} vs DDP fp32 {ref:.5f} ({rel:.3%})")
    assert ranks[0]["O2"]["weights"][0].dtype == torch.bfloat16
    assert ranks[0]["O2"]["masters"][0].dtype == torch.float32
    assert "strategy='ampkit_ddp'" in ranks[0]["refused"]


# ---------------------------------------------------------------------------
# 7. `ampkit run` on the unmodified Lightning script: the integration's figures
# ---------------------------------------------------------------------------
def _ampkit_run(level: str, tmp_path: Path, capsys) -> tuple[float, dict]:
    report = tmp_path / f"report_{level}.json"
    code = ampkit_main(["run", "--level", level, "--report", str(report), str(CLASSIFIER),
                        "--steps", "120", "--root", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    metric = [line for line in out.splitlines() if line.startswith("METRIC ")]
    return float(metric[-1].split()[2]), json.loads(report.read_text())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ampkit_run_on_the_unmodified_script_agrees_with_the_integration(level, classifier_runs, tmp_path, capsys):
    run_loss, report = _ampkit_run(level, tmp_path, capsys)
    assert report["level_applied"] == level and report["optimizers"][0]["steps"] == 120
    plugin_loss, ref_loss = classifier_runs(level)["loss"], classifier_runs("fp32")["loss"]
    assert abs(run_loss - plugin_loss) / plugin_loss < 0.01, (run_loss, plugin_loss)
    assert abs(run_loss - ref_loss) / ref_loss < 0.01, (run_loss, ref_loss)
    print(f"FIGURE ampkit run {level}: held-out loss {run_loss:.5f}, AmpkitPrecision {plugin_loss:.5f}, "
          f"fp32 {ref_loss:.5f}")


# ---------------------------------------------------------------------------
# 8. the plugin's contract: arguments, scopes, state, refits
# ---------------------------------------------------------------------------
def test_arguments_are_checked_when_the_plugin_is_built():
    with pytest.raises(AmpError, match="unknown option"):
        AmpkitPrecision("O2", options={"keep_norm": True})
    with pytest.raises(AmpError, match=r"pass AmpkitPrecision\(dtype=\.\.\.\)"):
        AmpkitPrecision("O1", options={"dtype": torch.float16})
    with pytest.raises(AmpError, match="unknown opt_level"):
        AmpkitPrecision("O4")
    with pytest.raises(AmpError, match="bf16"):
        AmpkitPrecision("O2K", dtype=torch.float16)
    with pytest.raises(AmpError, match="policy"):
        AmpkitPrecision("O3", policy=amp.Policy())
    with pytest.raises(AmpError, match="fp8"):
        AmpkitPrecision("O0", fp8=True)
    with pytest.raises(AmpError, match="loss_scale"):
        AmpkitPrecision("O1", loss_scale="static")
    plugin = AmpkitPrecision("O2", options={"keep_fp32": ["net.5"]})
    assert plugin.opt_level.keep_fp32 == ("net.5",)
    # a spawned process gets a pickled copy of the Trainer: the settings travel, no session
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy.opt_level == plugin.opt_level and copy.optimizers == []
    # "ampkit_ddp" is in Lightning's strategy registry
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ampkit_ddp", plugins=[AmpkitPrecision("O2")], logger=False)
    assert type(trainer.strategy) is AmpkitDDPStrategy and isinstance(trainer.precision_plugin, AmpkitPrecision)
    assert trainer.precision == "bf16-mixed"
    # Lightning's precision flag is a fixed list of its own names: no alias can join it
    with pytest.raises(ValueError, match="Precision 'ampkit-O2' is invalid"):
        pl.Trainer(accelerator="cpu", precision="ampkit-O2")


def test_scopes_validation_predict_and_a_second_fit(tmp_path):
    """O2: the step contexts cast (validation and predict too), the model keeps its
    16-bit weights after fit, validate/predict keep the session (save_checkpoint after
    fit still holds it), and a second fit of the same model starts from its fp32 masters."""
    model, train, heldout = SCRIPT["build"](total=20)
    plugin = AmpkitPrecision("O2")
    trainer = _trainer(tmp_path, plugin, steps=20)
    val = torch.utils.data.DataLoader(heldout, batch_size=500)
    trainer.fit(model, train, val)
    opt = trainer.optimizers[0]
    with plugin.forward_context():
        assert amp.is_active("cpu") and (torch.randn(2, 4) @ torch.randn(4, 2)).dtype == torch.bfloat16
    assert not amp.is_active("cpu")  # O1/O2 casting is the scope, never process-wide
    metrics = trainer.validate(model, val, verbose=False)
    assert math.isfinite(metrics[0]["val_loss"])
    preds = trainer.predict(model, torch.utils.data.DataLoader(heldout.tensors[0][:8], batch_size=8))
    assert preds[0].dtype == torch.float32 and preds[0].shape == (8, 8)  # a cast model hands back fp32
    assert amp.stats(opt).steps == 20  # validate/predict did not start a new session
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert "AmpkitPrecision" in torch.load(tmp_path / "after.ckpt", weights_only=True)
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    # a second fit: new optimizers, masters rebuilt from the old ones (exact), not from bf16

    class AtStart(Callback):
        def on_train_start(self, trainer, pl_module):
            self.masters = [m.detach().clone() for m in amp.master_params(trainer.optimizers[0])]

    start = AtStart()
    trainer2 = _trainer(tmp_path, plugin, steps=1, callbacks=[start])
    trainer2.fit(model, train)
    new_opt = trainer2.optimizers[0]
    assert new_opt is not opt and amp.stats(new_opt).steps == 1
    assert _all_equal(start.masters, masters)
    assert model.net[0].weight.dtype == torch.bfloat16
    with pytest.raises(StateError, match="written at O2"):
        AmpkitPrecision("O1").load_state_dict(plugin.state_dict())
    # predict on a model no fit set up: cast as the level says, fp32 out
    fresh, _, _ = SCRIPT["build"]()
    preds = _trainer(tmp_path, AmpkitPrecision("O2")).predict(
        fresh, torch.utils.data.DataLoader(heldout.tensors[0][:8], batch_size=8))
    assert fresh.net[0].weight.dtype == torch.bfloat16 and fresh.net[2].weight.dtype == torch.float32
    assert preds[0].dtype == torch.float32


def test_fp8_recipe_is_passed_through(tmp_path):
    recipe = amp.Fp8Recipe(module_filter=lambda name, m: isinstance(m, nn.Linear) and m.in_features == 64)
    model, train, heldout = SCRIPT["build"](total=10)
    trainer = _trainer(tmp_path, AmpkitPrecision("O1", fp8=recipe), steps=10)
    trainer.fit(model, train)
    layers = {info.name: info.calls for info in amp.fp8.layers()}
    assert set(layers) == {"net.3"} and layers["net.3"] > 0, layers  # net.5 (64 -> 8): not a multiple of 16
    assert "fp8" in amp.state_dict()["extra"]  # its scales go into Lightning's checkpoints
    assert math.isfinite(SCRIPT["heldout_loss"](model, heldout))


def test_held_scheduler_is_the_scheduler_to_everything_else():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    held = HeldScheduler(sched)
    held.step()  # an unmanaged optimizer: never held
    assert sched.last_epoch == 1 and held.get_last_lr() == [0.5] and held.optimizer is opt
    held.base_lrs = [2.0]
    assert sched.base_lrs == [2.0] and held.state_dict() == sched.state_dict()
    amp.init_trainer(opt)
    opt.param_groups[0]["params"][0].grad = torch.full((2, 2), float("nan"))
    opt.step()
    assert amp.step_skipped(opt)
    held.step()
    assert sched.last_epoch == 1 and held.held == 1


# ---------------------------------------------------------------------------
# 9. lightning.fabric
# ---------------------------------------------------------------------------
def _fabric_run(plugin, steps: int, nan_at: int | None = None, state_in=None, state_out=None, start=0):
    from lightning.fabric import Fabric

    model, train, heldout = SCRIPT["build"](total=steps)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin is not None else None)
    if plugin is not None:
        model, opt = plugin.setup(fabric, model, opt)
    else:
        model, opt = fabric.setup(model, opt)
    if state_in is not None:
        fabric.load(state_in, {"model": model, "optimizer": opt, "amp": plugin})
    batches = list(train)
    skipped = []
    for step in range(start, steps):
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        if step == nan_at:
            next(model.parameters()).grad[0, 0] = float("nan")
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
        opt.step()
        if plugin is not None:
            skipped.append(amp.step_skipped(opt))
        if state_out is not None and step + 1 == steps // 2:
            fabric.save(state_out, {"model": model, "optimizer": opt, "amp": plugin})
    return SCRIPT["heldout_loss"](model, heldout), model, opt, skipped


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fabric_trains_resumes_and_skips(level, tmp_path):
    ref_loss, _, _, _ = _fabric_run(None, 80)
    loss, model, opt, skipped = _fabric_run(AmpkitFabricPrecision(level), 80, state_out=tmp_path / "half.ckpt")
    assert abs(loss - ref_loss) / ref_loss < 0.01, (loss, ref_loss)
    straight = _tensors(list(model.parameters())) + _tensors(list(amp.master_params(opt)))
    straight_opt = _tensors(opt.state_dict()["state"])
    _, resumed, ropt, _ = _fabric_run(AmpkitFabricPrecision(level), 80, state_in=tmp_path / "half.ckpt", start=40)
    assert _all_equal(_tensors(list(resumed.parameters())) + _tensors(list(amp.master_params(ropt))), straight)
    assert _all_equal(_tensors(ropt.state_dict()["state"]), straight_opt)
    _, _, _, skipped = _fabric_run(AmpkitFabricPrecision(level), 6, nan_at=3)
    assert skipped == [False, False, False, True, False, False]
    print(f"FIGURE Fabric {level}: held-out loss {loss:.5f} vs Fabric fp32 {ref_loss:.5f}")


def test_fabric_setup_without_the_plugin_is_refused():
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AmpkitFabricPrecision("O2")])
    model = nn.Linear(4, 4)
    with pytest.raises(StateError, match=r"precision.setup\(fabric, model, optimizer\)"):
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


# --- a tuning plan (ampkit.tune) ---------------------------------------------------------------


def _fit_with_plan(tmp_path, plan) -> tuple[Probe, dict[str, torch.dtype]]:
    """Three steps with ``AmpkitPrecision(plan=plan)``; the output dtypes of net.0 and
    net.5 in the last training step (``training_step`` calls ``self.net(x)``: the first
    module called is a child of the LightningModule the plan was written for)."""
    model = _probe()
    seen: dict[str, torch.dtype] = {}
    for name in ("net.0", "net.5"):
        model.get_submodule(name).register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
    _trainer(tmp_path, AmpkitPrecision(plan=plan), steps=3).fit(model, _loader())
    return model, seen


@pytest.mark.parametrize("level", ["O1", "O2K"])
def test_a_tuning_plan_keeps_its_module_fp32_whichever_module_the_step_calls_first(level, tmp_path):
    plan = amp.TunePlan.by_hand(lowered=["net.0", "net.3"], kept_fp32=["net.5"], level=level)
    path = tmp_path / "plan.json"
    plan.save(path)
    model, seen = _fit_with_plan(tmp_path, str(path))
    assert seen == {"net.0": torch.bfloat16, "net.5": torch.float32}
    if level == "O2K":
        assert model.net[5].weight.dtype == torch.float32 and model.net[0].weight.dtype == torch.bfloat16


def test_a_plans_fp8_linear_is_converted_for_the_fit_and_switched_back_after(tmp_path):
    plan = amp.TunePlan.by_hand(lowered=["net.0"], kept_fp32=["net.5"], fp8=["net.3"])
    model = _probe()
    kinds: list[str] = []
    model.net[3].register_forward_hook(lambda m, a, out: kinds.append(f"{type(m).__name__} {out.dtype}"))
    calls = []
    model.net[3].register_forward_hook(lambda m, a, out: calls.extend(layer.calls for layer in amp.fp8.layers()))
    _trainer(tmp_path, AmpkitPrecision(plan=plan), steps=3).fit(model, _loader())
    assert kinds and set(kinds) == {"Float8Linear torch.bfloat16"}, kinds
    assert calls[-1] >= 2  # the fp8 layer's scales were advanced by the steps
    amp.reset()
    assert type(model.net[3]) is nn.Linear


def test_a_plan_for_another_model_or_dtype_is_refused(tmp_path):
    with pytest.raises(amp.PlanError, match="lowers modules to bf16"):
        AmpkitPrecision(plan=amp.TunePlan.by_hand(["net.0"], ["net.5"]), dtype=torch.float16)
    plan = amp.TunePlan.by_hand(lowered=["0"], kept_fp32=["5"])  # names relative to net, not the module
    with pytest.raises(amp.PlanError, match="do not have"):
        _fit_with_plan(tmp_path, plan)
