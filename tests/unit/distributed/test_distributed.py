"""Multi-process training: every rank reaches the same skip decision, scales stay equal,
the replicas stay bitwise equal; checkpoints resume bitwise; FSDP2 works or is refused.

The multi-process checks run in three spawned jobs of 2 gloo processes on 127.0.0.1
(tests/support/_dist_workers.py), each once per module; the tests below assert on what the
ranks saved. Single-process tests cover the event encoding and the error paths.
"""

from __future__ import annotations

import os
import subprocess
import sys

import _dist_workers as workers  # noqa: E402
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from locations import ROOT
from torch import nn

import ampkit
from ampkit.trainer.decision import decide, encode


def spawned(test):
    """Marks of a test that reads a spawned job's results (the first such test of a
    module-scoped job pays for the job: 2 processes, well under the time limit)."""
    for mark in (pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(180)):
        test = mark(test)
    return test


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return workers.bitwise_equal(a, b)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """The jobs one after another in a single launch of 2 ranks: one process start,
    process group and set of compiled kernels for them all."""
    return workers.launch_several(("ddp", "fsdp", "ddp_grads", "checkpoint"), tmp_path_factory.mktemp("dist"),
                                  timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def ddp(launched: dict[str, list[dict]]) -> list[dict]:
    return workers.ran(launched["ddp"])


@pytest.fixture(scope="module")
def checkpoint(launched: dict[str, list[dict]]) -> list[dict]:
    return workers.ran(launched["checkpoint"])


@pytest.fixture(scope="module")
def fsdp(launched: dict[str, list[dict]]) -> list[dict]:
    return workers.ran(launched["fsdp"])


@pytest.fixture(scope="module")
def ddp_grads(launched: dict[str, list[dict]]) -> list[dict]:
    return workers.ran(launched["ddp_grads"])


def _err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest elementwise error relative to the largest reference grad (a grad that is
    ~0 in fp32, like a bias in front of BatchNorm, is bf16 noise in relative terms)."""
    scale = max(w.abs().max().item() for w in want)
    return max((g - w).abs().max().item() for g, w in zip(got, want)) / scale


@spawned
def test_ddp_after_initialize_averages_the_grads_user_code_and_the_optimizer_see(ddp_grads):
    """Each rank trains on its own data: the grads the optimizer steps (fp32 masters
    under O2) and the model's grads that clipping would read are DDP's average of the
    fp32 grads (to bf16 precision), registered or not, with no_sync accumulation too.
    Without the average (one rank's grads alone) they would be far off."""
    for key in ddp_grads[0]:
        for rank in (0, 1):
            r = ddp_grads[rank][key]
            assert _err(r["stepped"], r["expected"]) < 0.02, (key, rank)
            assert _err(r["model"], r["expected"]) < 0.02, (key, rank)
        assert equal(ddp_grads[0][key]["stepped"], ddp_grads[1][key]["stepped"]), key
    # The control: one rank's grads alone are far from the average.
    r = ddp_grads[0]["O1_plain_1"]
    local = workers.make_model(0)
    x, y = workers.batch(0, 0)
    torch.nn.functional.mse_loss(local(x), y).backward()
    assert _err([p.grad for p in local.parameters()], r["expected"]) > 0.2


# --- DDP -------------------------------------------------------------------------------------


@spawned
@pytest.mark.parametrize("level", workers.LEVELS)
def test_inf_on_one_rank_skips_on_both_at_every_level(ddp, level):
    """DDP wrapped after initialize, not registered: rank 1's grads get an inf after the
    all-reduce at step 1; both ranks skip, the scales and parameters stay equal."""
    r0, r1 = ddp[0][f"level_{level}"], ddp[1][f"level_{level}"]
    for r in (r0, r1):
        assert r["skipped"] == [False, True, False, False]
        assert r["scale"] == [65536.0, 32768.0, 32768.0, 32768.0]
        assert r["collectives"] == [1, 1, 1, 1]  # sync="auto" with an unregistered DDP
    assert equal(r0["params"], r1["params"])
    assert equal(r0["masters"], r1["masters"])
    assert workers.fingerprint(r0["state"]) == workers.fingerprint(r1["state"])


@spawned
def test_without_agreement_the_ranks_split(ddp):
    """Control for the test above: sync='never' lets rank 0 step while rank 1 skips, and
    check_ranks_agree reports the difference."""
    r0, r1 = ddp[0]["never"], ddp[1]["never"]
    assert r0["skipped"] == [False, False, False]
    assert r1["skipped"] == [False, True, False]
    assert r0["scale"][-1] != r1["scale"][-1]
    assert not equal(r0["params"], r1["params"])
    for r in (r0, r1):
        assert "differs from group rank 0's" in r["check_error"]
        assert "master_weights" in r["check_error"]


@spawned
def test_registered_ddp_agrees_every_step_and_masters_agree(ddp):
    """register_ddp: an overflow in rank 1's backward reaches rank 0 through DDP's
    all-reduce; the skip decision is agreed (one collective a step). The ranks were
    seeded differently: register_ddp broadcast the O2 masters, which stay bitwise equal."""
    r0, r1 = ddp[0]["registered_o2"], ddp[1]["registered_o2"]
    for r in (r0, r1):
        assert r["skipped"] == [False, False, True, False, False, False]
        assert r["collectives"] == [1] * 6
        assert r["plan"].startswith("the ranks' grads can differ at the step")
        assert r["norm_dtypes"] == ["torch.float32"] * 4 + ["torch.int64"]  # BatchNorm stays fp32
        assert r["always"]["collectives"] == [1, 1]  # sync="always" on the same setup
    assert r0["scale"] == r1["scale"]
    assert equal(r0["masters"], r1["masters"])
    assert equal(r0["params"], r1["params"])
    assert workers.fingerprint(r0["state"]) == workers.fingerprint(r1["state"])
    assert r0["masters"][0].dtype == torch.float32 and r0["params"][0].dtype == torch.bfloat16


@spawned
@pytest.mark.parametrize("route", ["index", "data"])
def test_registered_ddp_grads_changed_on_one_rank_after_the_all_reduce_skip_on_both(ddp, route):
    """An inf written into rank 1's grads after DDP's all-reduce -- by indexing, or
    through ``.data``, which changes no version counter -- skips the step on both ranks
    (sync='auto' agrees on every step); the replicas stay bitwise equal and
    check_ranks_agree finds nothing. Clipping after amp.unscale changes nothing of it."""
    a0, a1 = ddp[0][f"changed_after_allreduce_auto_{route}"], ddp[1][f"changed_after_allreduce_auto_{route}"]
    for r in (a0, a1):
        assert r["skipped"] == [False, True, False, False]
        assert r["collectives"] == [1] * 4
        assert r["check_error"] is None
    assert a0["scale"] == a1["scale"]
    assert equal(a0["params"], a1["params"])


@spawned
def test_sync_never_lets_a_one_rank_data_edit_split_the_replicas(ddp):
    """The control: with sync='never' the same .data edit skips on rank 1 only, and
    check_ranks_agree reports the split on both ranks."""
    n0, n1 = ddp[0]["changed_after_allreduce_never_data"], ddp[1]["changed_after_allreduce_never_data"]
    assert n0["skipped"] == [False, False, False, False]
    assert n1["skipped"] == [False, True, False, False]
    assert n0["collectives"] == n1["collectives"] == [0] * 4
    assert not equal(n0["params"], n1["params"])
    for r in (n0, n1):
        assert "differs from group rank 0's" in r["check_error"]


@spawned
def test_masters_that_differ_from_the_broadcast_model_raise_on_every_rank(ddp):
    assert "master weights do not match" in ddp[1]["unregistered_seeds"]
    assert "rank 1" in ddp[1]["unregistered_seeds"]
    assert "on another rank" in ddp[0]["unregistered_seeds"]  # rank 0's were fine
    assert "register_ddp" in ddp[0]["unregistered_seeds"]


@spawned
def test_no_sync_accumulation_then_synchronized_backward(ddp):
    """Accumulation: an inf in rank 1's grads during a no_sync micro-batch is all-reduced
    by the synchronized backward that ends the step; both skip."""
    r0, r1 = ddp[0]["accumulate"], ddp[1]["accumulate"]
    for r in (r0, r1):
        assert r["skipped"] == [False, False, True, False]
        assert r["scale"] == [65536.0, 65536.0, 32768.0, 32768.0]
        assert r["collectives"] == [1, 1, 1, 1]
    assert equal(r0["params"], r1["params"])
    assert equal(r0["masters"], r1["masters"])


@spawned
def test_a_no_sync_micro_batch_dropped_by_zero_grad_does_not_reach_the_step(ddp):
    """O2: 16-bit grads accumulated under no_sync (not yet in the masters) are cleared
    or zeroed by optimizer.zero_grad() like every other grad; the step after is bitwise
    the step of a run that never had them."""
    for r in ddp:
        assert r["dropped_no_sync"] == {"none": True, "set_to_none": True, "zeros": True}


@spawned
def test_stepping_on_no_sync_grads_agrees(ddp):
    """Every backward under no_sync (nothing all-reduced), the same data on both ranks:
    one collective per step; rank 1's inf makes both skip and the replicas stay equal.
    With sync='never' the same run splits them."""
    r0, r1 = ddp[0]["no_sync_step_auto"], ddp[1]["no_sync_step_auto"]
    for r in (r0, r1):
        assert r["skipped"] == [False, True, False]
        assert r["collectives"] == [1, 1, 1]
        assert all("no_sync" in reason for reason in r["plan"])
    assert r0["scale"] == r1["scale"]
    assert equal(r0["params"], r1["params"])
    assert equal(r0["masters"], r1["masters"])
    n0, n1 = ddp[0]["no_sync_step_never"], ddp[1]["no_sync_step_never"]
    assert n0["skipped"] == [False, False, False] and n1["skipped"] == [False, True, False]
    assert not equal(n0["masters"], n1["masters"])


@spawned
def test_collectives_per_step(ddp, fsdp):
    """What the scaler adds per step: one all-reduce of the step's flags under DDP,
    registered or not, with or without no_sync (a rank can change its grads after
    DDP's all-reduce, through .data unseen), and with per-rank losses; none under FSDP2
    (torch reduces the flag inside the unscale kernel) or with sync='never'."""
    for rank in (0, 1):
        d, f = ddp[rank], fsdp[rank]
        assert set(d["registered_o2"]["collectives"]) == {1}
        assert set(d["accumulate"]["collectives"]) == {1}
        assert set(f["O1"]["collectives"]) == {0}
        assert set(d["no_sync_step_auto"]["collectives"]) == {1}
        assert set(d["level_O2"]["collectives"]) == {1}  # DDP not registered
        assert set(d["multi_loss"]["collectives"]) == {1}  # no DDP, per-rank losses
        assert set(d["changed_after_allreduce_never_data"]["collectives"]) == {0}


@spawned
def test_ranks_agree_on_which_loss_overflowed(ddp):
    """Two losses, per-rank models outside DDP: rank 1 poisons loss 1's grads at step 1
    and loss 0's at step 3. Both ranks skip both steps and update each loss's scaler
    the same way: at step 1 scaler 0 sees a clean step and scaler 1 backs off; at step 3
    scaler 0 backs off and scaler 1 is left alone (its grads were masked)."""
    r0, r1 = ddp[0]["multi_loss"], ddp[1]["multi_loss"]
    for r in (r0, r1):
        assert r["skipped"] == [False, True, False, True, False]
        assert r["scales"] == [
            [65536.0, 65536.0],
            [65536.0, 32768.0],
            [65536.0, 32768.0],
            [32768.0, 32768.0],
            [32768.0, 32768.0],
        ]
        assert r["trackers"] == [[1, 1], [2, 0], [3, 1], [0, 1], [1, 2]]
        assert "scaled on some ranks but not on others" in r["mismatch"]
    assert equal(r0["params"], r1["params"])


@spawned
def test_initialize_refuses_a_ddp_model_at_a_casting_level(ddp):
    for rank in (0, 1):
        message = ddp[rank]["ddp_into_initialize"]
        assert "initialize on the plain model first" in message


# --- checkpoints -------------------------------------------------------------------------------


@spawned
def test_checkpoint_from_rank0_resumes_bitwise_on_every_rank(checkpoint):
    """O2 + registered DDP + AdamW, overflows before and after the checkpoint. Rank 0
    saves model, optimizer and ampkit state; both ranks load it into a differently
    seeded fresh setup; the next 4 steps equal an uninterrupted run bitwise."""
    for r in checkpoint:
        assert r["first"]["skipped"] == [False, True, False, True]
        assert r["first"]["scale"][-1] == 16384.0  # the scaler state differs from a fresh one
        assert r["resumed"] == r["ref"]
        assert r["params_equal"] and r["masters_equal"]
        assert r["state_equal"] and r["opt_state_equal"]
    assert equal(checkpoint[0]["params"], checkpoint[1]["params"])
    assert equal(checkpoint[0]["masters"], checkpoint[1]["masters"])


# --- FSDP2 --------------------------------------------------------------------------------------


@spawned
@pytest.mark.parametrize("setup", ["O0", "O1", "mp_O0"])
def test_fsdp2_skips_together_without_an_extra_collective(fsdp, setup):
    """fully_shard, then the optimizer, then initialize (O0, O1, and O0 over FSDP2's own
    bf16 MixedPrecisionPolicy). Rank 1's shard gets an inf at step 2: both skip (torch's
    DTensor unscale kernel all-reduces the flag), shards untouched, scales equal."""
    r0, r1 = fsdp[0][setup], fsdp[1][setup]
    for r in (r0, r1):
        assert r["grad_types"] == ["DTensor"]
        assert r["skipped"] == [False, False, True, False, False]
        assert r["collectives"] == [0] * 5
        assert r["skip_kept_shards"] and r["trained"]
        assert "DTensors" in r["plan"]
    assert r0["scale"] == r1["scale"]
    assert equal(r0["full"], r1["full"])


@spawned
@pytest.mark.parametrize("level", ["O2", "O3", "O2K"])
def test_fsdp2_refuses_levels_that_cast_weights(fsdp, level):
    for r in fsdp:
        assert "MixedPrecisionPolicy" in r[f"refused_{level}"]
        assert "fully_shard" in r[f"refused_{level}"]


@spawned
def test_fsdp2_after_initialize_fails_at_the_first_forward(fsdp):
    for r in fsdp:
        assert "sharded by fully_shard" in r["shard_after_initialize"]


# --- the example --------------------------------------------------------------------------------


@spawned
def test_train_ddp_example_under_torchrun(tmp_path):
    pytest.importorskip("sklearn")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "examples" / "train_ddp.py"),
        "--amp", "O2", "--steps", "12", "--hidden", "32", "--accum", "2",
        "--inject-inf", "5", "--log-every", "4", "--save", str(tmp_path / "ckpt.pt"),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "2 process(es), backend gloo" in out
    assert "optimizer step skipped" in out  # ampkit's overflow log, rank 0 only
    assert out.count("optimizer step skipped") == 1
    assert "skipped steps 1" in out
    assert "replicas identical: yes" in out
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # tensors and plain data only
    assert saved["amp"]["trainers"][0]["optimizers"][0]["steps"] == 12
    # Resuming loads the checkpoint with weights_only=True on every rank.
    resume = [*cmd[:-2], "--resume", str(tmp_path / "ckpt.pt")]
    resume[resume.index("--steps") + 1] = "2"
    done = subprocess.run(resume, capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "resumed from" in out and "replicas identical: yes" in out


# --- single process ------------------------------------------------------------------------------


class _Alone:
    """An agreement over one rank: MAX over a single value changes nothing."""

    device = torch.device("cpu")

    def reduce(self, tensor: torch.Tensor) -> None:
        pass


segments_strategy = st.lists(
    st.tuples(st.one_of(st.none(), st.integers(0, 2)), st.sampled_from([None, 0.0, 1.0, 2.0])),
    min_size=1,
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(segments_strategy)
def test_agreed_events_mean_what_the_local_path_means(segments):
    """The one rule run on the device and all-reduced over one rank decides exactly
    what it decides on the host for a process alone (overflow, masked, clean per loss
    id; skip), and both match the rule spelled out here."""
    segs = [(loss_id, None if f is None else torch.tensor(f)) for loss_id, f in segments]
    local = decide(list(segs), 3)  # a process alone: the host path
    agreed = decide(list(segs), 3, _Alone())  # ranks that agree: the device path
    assert agreed == local
    events: dict[int, bool | None] = {}
    overflowed = False  # an earlier segment of the step overflowed
    for loss_id, f in segments:
        flag = bool(f)
        if loss_id is not None:
            if overflowed:
                events[loss_id] = True if events.get(loss_id) is True else None
            else:
                events[loss_id] = events.get(loss_id) is True or flag
        overflowed = overflowed or flag
    assert local == (events, overflowed)


def test_agreed_events_combine_by_max():
    """Two ranks' encodings combined by MAX: loss 1 overflowed on one rank -> overflow;
    loss 0 clean everywhere -> clean; skip on both."""
    a = encode([(0, torch.tensor(0.0)), (1, torch.tensor(1.0))], 2, torch.device("cpu"))
    b = encode([(0, torch.tensor(0.0)), (1, torch.tensor(0.0))], 2, torch.device("cpu"))

    class Max:
        device = torch.device("cpu")

        def reduce(self, tensor: torch.Tensor) -> None:
            tensor.copy_(torch.maximum(a, b))

    events, skip = decide([(0, torch.tensor(0.0)), (1, torch.tensor(0.0))], 2, Max())
    assert events == {0: False, 1: True} and skip


def test_single_process_never_agrees():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ampkit.init_trainer(opt)
    plan = ampkit.distributed.sync_plan(opt)
    assert not plan.agree and "not initialized" in plan.reason
    ampkit.distributed.set_sync(opt, "always")
    assert not ampkit.distributed.sync_plan(opt).agree  # still a single process
    with pytest.raises(ampkit.DistributedError, match="sync must be one of"):
        ampkit.distributed.set_sync(opt, "sometimes")  # type: ignore[arg-type]
    with pytest.raises(ampkit.StateError):
        ampkit.distributed.set_sync(torch.optim.SGD(model.parameters(), lr=0.1), "always")


def test_register_ddp_wants_a_ddp_model():
    with pytest.raises(ampkit.DistributedError, match="DistributedDataParallel"):
        ampkit.distributed.register_ddp(nn.Linear(2, 2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_sync_batchnorm_is_refused_without_a_gpu():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ampkit.DistributedError, match="SyncBatchNorm is GPU-only in torch"):
        ampkit.distributed.convert_sync_batchnorm(model)
    assert type(model[1]) is nn.BatchNorm1d  # untouched


def test_sync_batchnorm_conversion_keeps_parameters_and_cast_hooks():
    """The conversion itself (what convert_sync_batchnorm does on a GPU machine), checked
    on CPU in eval mode, where SyncBatchNorm runs plain batch norm: same Parameter
    objects, ampkit's cast hooks moved to the new layer, the same output bitwise."""
    from ampkit.distributed.core import convert_bn as _convert_bn
    from ampkit.levels import model_cast as amp_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level="O2")
    model.eval()
    x = torch.randn(6, 4)
    before = model(x)
    old_bn, weight = model[1], model[1].weight
    hooks = len(amp_model.HANDLES[old_bn])
    model = _convert_bn(model, None)
    assert type(model[1]) is nn.SyncBatchNorm
    assert model[1].weight is weight and weight.dtype == torch.float32
    assert model[1].running_var.dtype == torch.float32
    assert old_bn not in amp_model.HANDLES and len(amp_model.HANDLES[model[1]]) == hooks > 0
    assert torch.equal(model(x), before)


@pytest.mark.cuda
def test_sync_batchnorm_under_o2_stays_fp32_with_its_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level="O2")
    bn_weight = model[1].weight
    model = ampkit.distributed.convert_sync_batchnorm(model)
    assert type(model[1]) is nn.SyncBatchNorm
    assert model[1].weight is bn_weight and bn_weight.dtype == torch.float32
    assert model[1].running_mean.dtype == torch.float32
    out = model(torch.randn(6, 4, device="cuda"))  # no process group: plain batch norm
    assert out.dtype == torch.float32
    with ampkit.scale_loss(out.pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not ampkit.step_skipped(opt)
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
