"""Every opt level under FSDP2 (``ampkit.distributed.fully_shard`` + ``initialize``) on
gloo CPU process groups: training within 1% of FSDP2's own fp32, the compute dtypes the
level promises, one skip decision on every rank, DCP checkpoints that resume bitwise,
reshard onto another world size and are refused whole when corrupt."""

from __future__ import annotations

from pathlib import Path

import _dist_workers as workers  # noqa: E402
import pytest
import torch
from locations import SUPPORT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = SUPPORT / "_fsdp_workers.py"
LEVEL_SETUPS = ("O1", "O2", "O2K", "O3", "O1-fp16", "O2-fp16", "O2-fp8")


def _launch(job: str, outdir: Path, world: int = 2, timeout: float = 400, **env: str) -> list[dict]:
    return workers.launch(job, outdir, world_size=world, timeout=timeout, script=SCRIPT, env=env)


#: The jobs run one after another in a single launch of 2 ranks (``job_several``): one
#: process start, process group and set of compiled update kernels for them all; each test
#: reads its job's part. The resumes (fresh processes, other world sizes) launch their own.
ONE_LAUNCH = ("train", "dcp_save", "unscale", "doctor", "refusals", "skip", "accumulate", "dcp_corrupt",
              "dcp_sweep")


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("fsdp")
    return out, workers.launch_several(ONE_LAUNCH, out, timeout=600, script=SCRIPT)


def _job(launched: tuple[Path, dict[str, list[dict]]], job: str) -> list[dict]:
    return workers.ran(launched[1][job])


@pytest.fixture(scope="module")
def trained(launched: tuple[Path, dict[str, list[dict]]]) -> list[dict]:
    return _job(launched, "train")


@pytest.fixture(scope="module")
def saved(launched: tuple[Path, dict[str, list[dict]]]) -> tuple[Path, list[dict]]:
    return launched[0] / "dcp_save", _job(launched, "dcp_save")


def _mean_last(losses: list[float]) -> float:
    return sum(losses[-10:]) / 10


@pytest.mark.timeout(500)
@pytest.mark.parametrize("setup", LEVEL_SETUPS)
def test_every_level_trains_within_1_percent_of_fsdp2_fp32(trained, setup):
    r0, r1 = trained
    ref = _mean_last(r0["fp32"]["losses"])
    got = r0[setup]
    assert abs(_mean_last(got["losses"]) - ref) / ref < 0.01, (setup, _mean_last(got["losses"]), ref)
    assert got["losses"] == r1[setup]["losses"]  # the all-reduced mean: one run, two ranks
    assert all(torch.equal(a, b) for a, b in zip(got["full"], r1[setup]["full"]))  # one model
    assert got["stats"] == (40, 0)
    assert not all(torch.equal(a, b) for a, b in zip(got["full"], r0["fp32"]["full"]))  # it did run in 16 bits


@pytest.mark.timeout(500)
def test_each_level_stores_and_computes_what_it_promises(trained):
    """Sharded parameter dtypes, the dtypes a block's layers see, O2K's one-pass update
    on every bf16 shard."""
    seen = {s: trained[0][s]["seen"] for s in LEVEL_SETUPS}
    stored = {s: trained[0][s]["param_dtypes"] for s in LEVEL_SETUPS}
    assert stored["O1"] == stored["O2"] == ["torch.float32"]  # O2's shards are its fp32 masters
    assert stored["O2K"] == ["torch.bfloat16", "torch.float32"] and stored["O3"] == ["torch.bfloat16"]
    assert seen["O2"] == {"ln1 out": "bfloat16", "ln1 weight": "float32", "qkv in": "bfloat16",
                          "qkv weight": "bfloat16", "model out": "float32"}  # fmt: skip
    assert seen["O2-fp16"]["qkv weight"] == "float16" and seen["O2-fp16"]["ln1 weight"] == "float32"
    assert seen["O2K"]["qkv weight"] == "bfloat16" and seen["O2K"]["ln1 weight"] == "float32"
    assert seen["O3"]["ln1 weight"] == "bfloat16" and seen["O3"]["model out"] == "float32"
    assert seen["O1"]["qkv weight"] == "float32" and seen["O1"]["model out"] == "bfloat16"  # op-level casting
    o2k = trained[0]["O2K"]
    assert o2k["compensated"] == 19 and o2k["dedicated"] == [19] * 40  # every bf16 shard, every step
    # fp8 (delayed scaling) on the linears between the first and the last, every step
    fp8 = trained[0]["O2-fp8"]["fp8"]
    assert [name for name, _, _ in fp8] == ["blocks.0.proj", "blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.1.qkv",
                                            "blocks.1.proj", "blocks.1.mlp.0", "blocks.1.mlp.2"]  # fmt: skip
    assert all(calls == 40 and scaled for _, calls, scaled in fp8)
    assert trained[0]["O2-fp8"]["fp8"] == trained[1]["O2-fp8"]["fp8"]


@pytest.mark.timeout(400)
def test_a_nan_on_one_rank_is_skipped_on_every_rank(launched):
    r0, r1 = _job(launched, "skip")
    for setup in LEVEL_SETUPS:
        a, b = r0[setup], r1[setup]
        assert a["skipped"] == b["skipped"] == [False, False, False, True, False, False], setup
        assert a["kept"] and b["kept"], setup  # shards, optimizer state, compensation: bitwise
        assert a["scales"] == b["scales"] and a["finite"] and b["finite"], setup
    assert r0["O2-fp16"]["scales"][3] == (32768.0,)  # fp16: the scale backed off, on both ranks


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 1, 4], ids=["same-world", "2-to-1", "2-to-4"])
def test_dcp_checkpoints_resume_and_reshard(saved, tmp_path, world):
    """Saved by 2 ranks after N steps; loaded in fresh processes: the weights and
    ampkit's state are the saved ones; with 2 ranks the run continues bitwise to 2N (a
    skipped step included); with 1 or 4 it trains on."""
    src, before = saved
    res = _launch("dcp_resume", tmp_path, world=world, timeout=550, AMPKIT_TEST_CKPT=str(src))
    for setup, s in before[0].items():
        r = res[0][setup]
        assert all(torch.equal(a, b) for a, b in zip(s["at_n"], r["loaded"])), setup
        assert len(s["amp_n"]) == len(r["amp_loaded"]) and all(
            torch.equal(a, b) for a, b in zip(s["amp_n"], r["amp_loaded"])), setup  # fmt: skip
        assert r["stats"] == (8, 1), setup
        if world == 2:
            assert all(torch.equal(a, b) for a, b in zip(s["at_2n"], r["at_2n"])), setup
            assert all(torch.equal(a, b) for a, b in zip(s["amp_2n"], r["amp_2n"])), setup
        else:
            assert all(loss == loss and loss < 10 for loss in r["losses"]), setup
            assert all(bool(torch.isfinite(t).all()) for t in r["at_2n"]), setup


@pytest.mark.timeout(400)
def test_a_corrupt_checkpoint_is_refused_whole_on_every_rank(launched):
    for r in _job(launched, "dcp_corrupt"):
        assert r["truncated"].startswith("StateError: ") and "entries end at byte" in r["truncated"]
        assert r["nan"].startswith("StateError: compensation buffer")
        assert r["nan_weight"].startswith("StateError: ")  # one rank's shard: every rank refuses
        assert r["other_level"].startswith("StateError: ") and "another" in r["other_level"]
        assert r["payload_lr"].startswith("StateError: ") and "weights only" in r["payload_lr"]
        assert r["negative"].startswith("StateError: ") and "negative" in r["negative"]
        assert r["flipped"].startswith("StateError: ") and "checksum" in r["flipped"]
        assert r["payload_meta"].startswith("StateError: ") and "open" in r["payload_meta"]
        assert not r["payload_ran"]
        for name in ("truncated", "nan", "nan_weight", "other_level", "payload_lr", "negative", "flipped",
                     "payload_meta"):  # fmt: skip
            assert r[f"{name}_kept"] and r[f"{name}_weights_kept"], name
        assert r["good_loaded"] == (2, 0)


@pytest.mark.timeout(600)
def test_a_corruption_sweep_of_a_sharded_checkpoint_is_refused_or_harmless_on_both_ranks(launched):
    """The floating entries of a 2-rank O2K checkpoint corrupted (-1, 1e38, NaN or inf, one
    each; in rank 1's shard alone where sharded) and the non-tensor entries replaced (a
    string, NaN or -1, one drawn per entry: the single-process sweep tries each), rehashed,
    one case of every kind (section, layer type, entry name and, for tensors, bad value;
    drawn with a fixed seed among the layers that repeat a kind): both ranks
    refuse each alike with nothing changed, or accept it and train finite; 0 raw errors."""
    r0, r1 = _job(launched, "dcp_sweep")
    assert r0["cases"] > 40, r0["cases"]
    assert r0["swept"] == r0["kinds"] == r1["swept"], (r0["swept"], r0["kinds"])  # every kind once, on both ranks
    assert r0["entries"] > r0["cases"]
    for r in (r0, r1):
        assert not r["raw"], r["raw"][:5]
        assert not r["changed"], r["changed"][:5]
        assert not r["harmful"], r["harmful"][:5]
    assert (r0["refused"], r0["accepted"]) == (r1["refused"], r1["accepted"])  # every rank decides alike
    assert r0["refused"] > r0["accepted"]


@pytest.mark.timeout(400)
def test_the_doctor_names_the_module_and_the_rank_on_a_sharded_model(launched):
    """fp16 O2 under FSDP2, rank 1's second block overflowing from step 3: both ranks
    skip; each report names blocks.1.mlp and rank 1 (the module check and the op-level
    check), and nothing else (no FSDP2 buffer, no attention mask, no grad that arrived
    through the reduce-scatter)."""
    for r in _job(launched, "doctor"):
        assert r["stats"] == (4, 2)
        events = [(e["step"], e["module"], e["ranks"]) for e in r["report"]["events"]]
        assert events == [(3, "blocks.1.mlp", [1]), (4, "blocks.1.mlp", [1])]
        findings = [(f["module"], f["op"], f["ranks"], f["kind"]) for f in r["report"]["findings"]]
        assert findings == [("blocks.1.mlp", "mul", [1], "overflow")]


@pytest.mark.timeout(400)
def test_what_fsdp2_cannot_do_is_refused_before_anything_changes(launched):
    ranks = _job(launched, "refusals")
    assert ranks[0]["rank0_file"] == "accepted"  # rank 0's own ampkit.state_dict() file
    assert ranks[1]["rank0_file"].startswith("StateError: this compensation state holds the FSDP2 shards of rank 0")
    for r in ranks:
        assert r["stochastic"].startswith("DistributedError: compensation='stochastic'")
        assert r["rmsprop"].startswith("DistributedError: O2K under FSDP2 steps") and "RMSprop" in r["rmsprop"]
        assert "sharded by ampkit.distributed.fully_shard for O2" in r["other_level"]
        assert "ampkit.distributed.fully_shard(model, opt_level='O2')" in r["torch_sharded"]
        assert "takes an fp32 model" in r["fp32_only"]
        assert "built before fully_shard" in r["opt_first_O1"] and "built before fully_shard" in r["opt_first_O2"]
        assert r["differing_state"].startswith("StateError: ampkit's state differs between ranks at ['trainers/0/scalers/0/scale']")


@pytest.mark.timeout(400)
def test_gradient_accumulation_without_sync_trains_like_fp32_and_skips_together(launched):
    """Two micro-batches a step, the first with FSDP2's gradient sync off; a NaN loss in
    rank 1's unsynced micro-batch of step 5 skips that step on both ranks (the fp32
    reference leaves that step out), and every level ends within 1% of fp32."""
    for r in _job(launched, "accumulate"):
        ref = sum(r["fp32"]["losses"][-5:]) / 5
        for setup in ("O1", "O2", "O2K", "O2-fp16"):
            got = r[setup]
            assert [i for i, s in enumerate(got["skipped"]) if s] == [5], setup
            assert got["finite"] and abs(sum(got["losses"][-5:]) / 5 - ref) / ref < 0.01, setup


@pytest.mark.timeout(400)
def test_fp16_sharded_grads_are_scaled_until_unscale_as_the_guide_says(launched):
    """docs/guides/distributed.md: under FSDP2 with fp16 the sharded grads hold
    scale x grad after backward; amp.unscale makes them real (the fp32 run's norm) and
    the step after it is bitwise the step without it."""
    for r in _job(launched, "unscale"):
        assert r["scaled_norm"] == pytest.approx(65536 * r["fp32_norm"], rel=0.01)
        assert r["unscaled_norm"] == pytest.approx(r["fp32_norm"], rel=1e-3)
        assert r["same_steps"]
