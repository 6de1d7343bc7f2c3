"""The opt levels are data (``ampkit.levels.OPT_LEVELS``): a level added there, in one
place, is taken by every entry point -- ``initialize``, ``fully_shard``, the Hugging Face
arguments and Trainer, Lightning's plugins, tuning plans, ``ampkit run`` and ``ampkit
warmup`` -- and behaves as its data says; a name that is no level is refused by each with
an :class:`ampkit.AmpError` naming the ones it takes."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit.levels.opt_level import OPT_LEVELS, checked_plan, resolve_opt_level

NEW = "O2X"  # O2's settings under another name


@pytest.fixture
def o2x(monkeypatch):
    """``O2X`` added to :data:`OPT_LEVELS`: O2's settings, its own description."""
    monkeypatch.setitem(OPT_LEVELS, NEW, dataclasses.replace(OPT_LEVELS["O2"], description="O2 by another name"))
    yield NEW
    amp.reset()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _train(level: str, steps: int = 3, **kw) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        with amp.scale_loss(model(torch.randn(4, 8, generator=g)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_level_added_in_one_place_resolves_and_trains_as_its_data_says(o2x):
    """``resolve_opt_level`` and ``initialize`` take the new name (any case) and set up
    exactly what O2 sets up: bf16 weights, fp32 norms and masters, op-level casting in the
    model, the same weights bit for bit after three steps."""
    assert resolve_opt_level("o2x", "cuda") == dataclasses.replace(resolve_opt_level("O2", "cuda"), name=NEW)
    reference, ref_opt = _train("O2")
    ref_weights = [p.detach().clone() for p in reference.parameters()]
    ref_masters = [p.detach().clone() for p in amp.master_params(ref_opt)]
    amp.reset()
    model, opt = _train("o2x")
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2 + [torch.bfloat16] * 2
    assert all(p.dtype == torch.float32 for p in amp.master_params(opt))
    assert all(torch.equal(a, b) for a, b in zip(ref_weights, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ref_masters, amp.master_params(opt), strict=True))


def test_the_new_level_s_facts_are_asked_not_its_name(o2x, monkeypatch):
    """O2X made bf16-only: bf16 on CUDA too (O2: fp16), fp16 refused by the integrations,
    ``ampkit run`` and ``ampkit warmup``. Made without op-level casting in the model: its
    cast model runs pure 16-bit, which Lightning names ``-true`` and ``ampkit run`` (which
    relies on the policy inside the model) does not offer."""
    from ampkit.integrations.hf.arguments import check_arguments, resolve_options
    from ampkit.tools.run import RunConfig, run_levels
    from ampkit.tools.warmup import compiled_levels, warm

    o2 = OPT_LEVELS[NEW]
    monkeypatch.setitem(OPT_LEVELS, NEW, dataclasses.replace(o2, bf16_only=True))
    level = resolve_opt_level(NEW, "cuda")
    assert level.dtype == torch.bfloat16 and level.model_op_casting and level.master_weights
    assert resolve_opt_level("O2", "cuda").dtype == torch.float16
    with pytest.raises(amp.AmpError, match="bf16 only"):
        check_arguments(object(), resolve_options(NEW, torch.float16, False, "fp32", None))
    with pytest.raises(amp.AmpError, match="bf16 only"):
        RunConfig(level=NEW, dtype="fp16")
    with pytest.raises(amp.AmpError, match=f"{NEW} computes in bf16 only"):
        warm([NEW], dtype="fp16")
    assert RunConfig(level="O2", dtype="fp16").level == "O2" and compiled_levels("fp16") == ("O2",)
    monkeypatch.setitem(OPT_LEVELS, NEW, dataclasses.replace(o2, model_op_casting=False))
    assert not resolve_opt_level(NEW).model_op_casting and resolve_opt_level(NEW).cast_model_type == torch.bfloat16
    assert NEW not in run_levels() and "O2" in run_levels()
    pytest.importorskip("lightning")
    from ampkit.integrations.lightning import AmpkitPrecision

    assert (AmpkitPrecision(NEW).precision, AmpkitPrecision("O2").precision) == ("bf16-true", "bf16-mixed")


@pytest.mark.distributed
def test_fully_shard_takes_the_new_level_and_initialize_sets_it_up(o2x):
    """``fully_shard(opt_level="O2X")`` shards as O2 does (fp32 norm unit, fp32 shards as
    masters) and the sharded model sets up with ``initialize`` at O2X."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        model = amp.distributed.fully_shard(_model(), opt_level="o2x")
        plan = amp.distributed.shard_plan(model)
        assert (plan.level, plan.dtype, plan.kept, plan.master_weights) == (NEW, torch.bfloat16, ("1",), True)
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the shards are the masters
        amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level=NEW)
    finally:
        amp.reset()
        dist.destroy_process_group()


@pytest.mark.distributed
def test_fully_shard_takes_initialize_s_storage_overrides_and_initialize_must_agree():
    """``master_weights=False`` at O2 stores 16-bit shards; ``initialize`` at O2 with its
    default masters refuses that model, and with the same override sets it up."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        model = amp.distributed.fully_shard(_model(), opt_level="O2", master_weights=False)
        plan = amp.distributed.shard_plan(model)
        assert (plan.cast_model_type, plan.master_weights) == (torch.bfloat16, False)
        assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
        with pytest.raises(amp.DistributedError, match="master_weights=False; initialize asked for"):
            amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level="O2")
        amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level="O2", master_weights=False)
        amp.reset()
        with pytest.raises(amp.DistributedError, match="master_weights=True needs a 16-bit model"):
            amp.distributed.fully_shard(_model(), opt_level="O1", master_weights=True)  # checked as initialize checks
    finally:
        amp.reset()
        dist.destroy_process_group()


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x, labels):
        return {"loss": (self.net(x).float() - labels).pow(2).mean()}


def test_hugging_face_takes_the_new_level(o2x, tmp_path):
    """The arguments take ``amp_level="O2X"``, and the Trainer sets it up: bf16 weights
    with fp32 masters after two steps."""
    pytest.importorskip("transformers")
    from ampkit.integrations.hf import AmpkitTrainer, AmpkitTrainingArguments

    args = AmpkitTrainingArguments(
        output_dir=str(tmp_path), amp_level="o2x", max_steps=2, per_device_train_batch_size=4, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no",
    )  # fmt: skip
    assert args.amp_level == NEW
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(4, generator=g)} for _ in range(8)]
    trainer = AmpkitTrainer(model=_Regression(), args=args, train_dataset=data)
    trainer.train()
    assert trainer.amp_level == NEW and trainer.amp_dtype == torch.bfloat16
    assert trainer.model.net[0].weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in amp.master_params(trainer.amp_optimizer))
    assert amp.stats(trainer.amp_optimizer).steps == 2


def test_lightning_takes_the_new_level(o2x):
    """``AmpkitFabricPrecision("O2X")`` is built, named as O2 is (``bf16-mixed``) and sets
    the model up through Fabric."""
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric

    from ampkit.integrations.lightning import AmpkitFabricPrecision, AmpkitPrecision

    assert AmpkitPrecision("O2X").precision == AmpkitPrecision("O2").precision == "bf16-mixed"
    plugin = AmpkitFabricPrecision("o2x")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _model()
    plugin.setup(fabric, net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert plugin.opt_level.name == NEW and plugin.opt_level.master_weights
    assert (net[0].weight.dtype, net[1].weight.dtype) == (torch.bfloat16, torch.float32)  # cast in place


def test_tuning_plans_ampkit_run_and_warmup_take_the_new_level(o2x):
    """A plan at O2X is accepted and applied as at O2 (its kept module's weights fp32);
    ``ampkit run`` and ``ampkit warmup`` offer it."""
    from ampkit.tools.cli.main import build_parser
    from ampkit.tools.run import RunConfig, run_levels
    from ampkit.tools.warmup import compiled_levels

    plan = checked_plan(amp.TunePlan.by_hand(["0"], ["2"], level=NEW))
    model, _ = amp.initialize(_model(), None, plan=plan)
    assert (model[0].weight.dtype, model[2].weight.dtype) == (torch.bfloat16, torch.float32)
    amp.reset()
    assert NEW in run_levels() and RunConfig(level=NEW, plan=plan).level == NEW
    assert NEW in compiled_levels("fp16")
    assert build_parser().parse_args(["warmup", "--level", NEW]).level == [NEW]
    assert build_parser().parse_args(["run", "--level", NEW, "script.py"]).level == NEW


def _unknown_refusals():
    """(entry point, a call with the unknown level ``O9``, the levels it must name)."""
    from ampkit.tools.run import RunConfig, run_levels
    from ampkit.tools.warmup import compiled_levels, warm

    def every():
        return list(OPT_LEVELS)

    def hf():
        pytest.importorskip("transformers")
        from ampkit.integrations.hf import AmpkitTrainingArguments

        AmpkitTrainingArguments(output_dir="unused", amp_level="O9", use_cpu=True, report_to=[])

    def lightning():
        pytest.importorskip("lightning")
        from ampkit.integrations.lightning import AmpkitPrecision

        AmpkitPrecision("O9")

    return [
        ("resolve_opt_level", lambda: resolve_opt_level("O9"), every),
        ("initialize", lambda: amp.initialize(_model(), None, opt_level="O9"), every),
        ("fully_shard", lambda: amp.distributed.fully_shard(_model(), opt_level="O9"), every),
        ("hf", hf, every),
        ("lightning", lightning, every),
        ("plan", lambda: checked_plan(amp.TunePlan.by_hand(["0"], [], level="O9")),
         lambda: [n for n, d in OPT_LEVELS.items() if d.mixed or d.fp32]),
        ("initialize(plan=)", lambda: amp.initialize(_model(), None, plan=amp.TunePlan.by_hand(["0"], [], level="O9")),
         lambda: [n for n, d in OPT_LEVELS.items() if d.mixed or d.fp32]),
        ("ampkit run", lambda: RunConfig(level="O9"), run_levels),
        ("ampkit warmup", lambda: warm(["O9"]), compiled_levels),
    ]  # fmt: skip


@pytest.mark.parametrize("added", [False, True], ids=["levels", "with O2X"])
@pytest.mark.parametrize("entry", range(9), ids=[e[0] for e in _unknown_refusals()])
def test_an_unknown_level_is_refused_everywhere_naming_the_valid_ones(request, added, entry):
    """Nothing is set up, and the message lists what each entry point takes -- O2X too
    once it is added."""
    if added:
        request.getfixturevalue("o2x")
    _, call, valid = _unknown_refusals()[entry]
    with pytest.raises(amp.AmpError, match="O9") as err:
        call()
    names = valid()
    assert names and all(name in str(err.value) for name in names), (names, str(err.value))
    assert (NEW in str(err.value)) == (added and NEW in names)
    amp.reset()
