"""``ampkit run`` against more loops as real scripts write them (tests/support/scripts/, which
know nothing of ampkit): a nanoGPT-style model with the loss inside forward, REINFORCE
with the optimizer built after the first rollout, a script's own fp32 island
(``torch.autocast(enabled=False)``), torch.utils.checkpoint around the model, and the
loop variations of loops.py, a script that owns a torch.amp.GradScaler (unscale_, clip,
scaler.step) -- each against its plain fp32 run."""

from __future__ import annotations

import pytest
from test_run import SCRIPTS, _against_fp32, _plain, _run, _site


@pytest.mark.slow
def test_nanogpt_style_loss_inside_forward(capsys, tmp_path):
    """(logits, loss) from forward, tied weights, two AdamW groups, a disabled GradScaler,
    clipping after unscale_, set_to_none, an @torch.no_grad() estimate_loss."""
    out, err, report = _against_fp32([], "nanogpt.py", [], capsys, tmp_path)
    assert report["optimizers"][0]["managed"] == "O1" and report["optimizers"][0]["steps"] == 60
    assert not report["script_grad_scaler"] and report["notes"] == []


@pytest.mark.slow
@pytest.mark.parametrize("options", [["--level", "O2"], ["--dtype", "fp16"]])
def test_nanogpt_style_o2_and_fp16(options, capsys, tmp_path):
    out, err, report = _against_fp32(options, "nanogpt.py", [], capsys, tmp_path)
    assert report["level_applied"] == ("O2" if "O2" in options else "O1") and report["notes"] == []


def test_reinforce_with_the_optimizer_built_after_the_first_rollout(capsys, tmp_path):
    out, err, report = _against_fp32([], "reinforce.py", [], capsys, tmp_path)
    assert report["optimizers"][0]["steps"] == 150


@pytest.mark.slow
def test_o2_optimizer_built_between_forward_and_backward_falls_back(capsys, tmp_path):
    """The first rollout's graph holds the fp32 weights: O2 casting them under it would
    break that backward; the optimizer gets O1, with a note naming its line."""
    out, err, report = _against_fp32(["--level", "O2"], "reinforce.py", [], capsys, tmp_path)
    assert report["level_applied"] == "O1" and report["optimizers"][0]["managed"] == "O1"
    assert f"the optimizer built at {_site('reinforce.py', 'torch.optim.Adam')}" in report["notes"][0]
    assert "whose backward() has not run yet" in report["notes"][0]


@pytest.mark.parametrize("args", [[], ["--island-inside"]])
def test_the_scripts_own_fp32_region_stands(args, capsys, tmp_path):
    """A head the script runs under torch.autocast(enabled=False), from the loop or
    inside forward, stays fp32 (cast to bf16 it trains ~9% worse)."""
    out, err, report = _against_fp32([], "fp32_island.py", args, capsys, tmp_path)
    if not args:
        assert report["forward_calls_kept_fp32"] == 121  # 120 steps and the evaluation
        assert _site("fp32_island.py", "return model.head(h.float())") in report["notes"][0]
    else:
        assert report["forward_calls_kept_fp32"] == 0 and report["notes"] == []
    assert report["forward_scopes"] > 0


def test_the_scripts_amp_switch_off_keeps_fp32_and_says_so(capsys, tmp_path):
    """`torch.autocast(..., enabled=args.amp)` with the switch off is a disabled region
    the script entered: it stands, and the note says how to switch it on."""
    out, err, report = _against_fp32([], "autocast_scaler.py", ["--steps", "30"], capsys, tmp_path)
    # the 30 training calls stay fp32; the evaluation outside the region is cast
    assert report["forward_scopes"] == 1 and report["forward_calls_kept_fp32"] == 30
    assert "the script's own AMP switch" in report["notes"][0]


def test_checkpointed_model_calls(capsys, tmp_path):
    """torch.utils.checkpoint around a model call: recomputed in backward, where the
    non-reentrant kind stops early by raising through the module hooks (with ampkit's
    hooks removed from torch's hook dict there, torch failed iterating it)."""
    code, out, err, report = _run([], "checkpointed.py", [], capsys, tmp_path)
    assert code == 0, err
    assert out.splitlines() == ["out torch.float32"] * 3
    assert report["optimizers"][0]["steps"] == 3 and report["forward_scopes"] >= 3


LOOPS = {
    "opt_first": ["--opt-first"],
    "param_groups": ["--groups"],
    "checkpoint_reload": ["--checkpoint", "{tmp}/ck.pt"],
    "dataloader": ["--loader"],
    "forward_direct": ["--forward-direct"],
    "opt_per_epoch": ["--opt-per-epoch"],
    "opt_after_backward": ["--opt-after-backward"],
}


@pytest.mark.parametrize("case", list(LOOPS))
def test_loop_variations_at_o1(case, capsys, tmp_path):
    args = [a.format(tmp=tmp_path) for a in LOOPS[case]]
    out, err, report = _against_fp32([], "loops.py", args, capsys, tmp_path)
    # the first backward, before any optimizer exists, counts as an iteration of its own
    assert report["iterations"] == 144 + (case == "opt_after_backward")


def test_checkpoint_reload_at_o2(capsys, tmp_path):
    out, err, report = _against_fp32(
        ["--level", "O2"], "loops.py", ["--checkpoint", str(tmp_path / "ck.pt")], capsys, tmp_path
    )
    assert [o["managed"] for o in report["optimizers"]] == ["O2", "O2"]


@pytest.mark.parametrize("level", ["fp32", "O1"])
def test_steps_limit_follows_a_new_optimizer_per_epoch(level, capsys, tmp_path):
    """A new optimizer over the same model supersedes the old one and its steps are the
    iterations from then on: --steps 30 stops 6 steps into the second epoch."""
    code, out, err, report = _run(["--level", level, "--steps", "30"], "loops.py", ["--opt-per-epoch"], capsys, tmp_path)
    assert code == 0 and report["iterations"] == 30
    assert [(o["managed"], o["steps"]) for o in report["optimizers"]] == [("superseded", 24), (level, 6)]


def test_o2_optimizer_per_epoch_is_refused(capsys, tmp_path):
    code, out, err, report = _run(["--level", "O2"], "loops.py", ["--opt-per-epoch"], capsys, tmp_path)
    assert code == 2 and report is None
    assert err.count("\n") == 1 and _site("loops.py", "return torch.optim.SGD(model") in err and "--level O1" in err


def test_fp16_backward_before_any_optimizer_is_refused_saying_so(capsys, tmp_path):
    code, out, err, report = _run(["--dtype", "fp16"], "loops.py", ["--opt-after-backward"], capsys, tmp_path)
    assert code == 2 and err.count("\n") == 1
    assert _site("loops.py", "loss.backward()") in err and "an optimizer built after this backward" in err


def test_exception_in_the_loop_passes_exit_code_1(capsys, tmp_path):
    code, out, err, report = _run(["--dtype", "fp16"], "loops.py", ["--raise-at", "5"], capsys, tmp_path)
    assert code == 1 and "RuntimeError: loader broke at step 5" in err
    # the traceback as Python shows it for the script: from the script's frame on
    trace = err[err.index("Traceback (most recent call last):"):].splitlines()
    assert trace[1].startswith(f'  File "{SCRIPTS / "loops.py"}", line ') and "runpy" not in err
    assert report["optimizers"][0]["steps"] == 5


# --- a script that owns a torch.amp.GradScaler --------------------------------------------

#: Relative tolerance on each step's loss and on the grad norm clip_grad_norm_ saw, against
#: the plain fp32 run: 8 eps of the dtype (as the idiom matrix allows over <= 25 steps).
SCALER_RTOL = {"bf16": 8 * 2.0**-7, "fp16": 8 * 2.0**-10}


def _per_step(out: str) -> tuple[list[float], list[float], list[int]]:
    """(losses, grad norms clip_grad_norm_ saw, skipped flags) of grad_scaler_clip.py."""
    rows = [line.split() for line in out.splitlines() if line.startswith("step ")]
    return [float(r[3]) for r in rows], [float(r[5]) for r in rows], [int(r[7]) for r in rows]


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("level", ["fp32", "O1", "O2", "O2K"])
def test_the_scripts_grad_scaler_unscales_what_clip_and_step_see(level, dtype, opt, capsys, tmp_path):
    """``scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(model.parameters());
    scaler.step(opt); scaler.update()``: at every level the clip sees the fp32 run's grad
    norms and the losses follow fp32's (at O2 the unscale reaches the grads of the model,
    not only the fp32 masters'); the report counts the script's steps, none skipped."""
    args = ["--steps", "20", "--opt", opt]
    ref_losses, ref_norms, _ = _per_step(_plain("grad_scaler_clip.py", args, capsys))
    code, out, err, report = _run(["--level", level, "--dtype", dtype], "grad_scaler_clip.py", args, capsys, tmp_path)
    if level == "O2K" and dtype == "fp16":
        assert code == 2 and report is None and "bf16" in err
        return
    assert code == 0, err
    losses, norms, skipped = _per_step(out)
    if level == "fp32":
        assert (losses, norms) == (ref_losses, ref_norms)
    rtol = SCALER_RTOL[dtype]
    for name, got, ref in (("loss", losses, ref_losses), ("grad norm", norms, ref_norms)):
        bad = [(i, a, b) for i, (a, b) in enumerate(zip(got, ref)) if not abs(a - b) <= rtol * abs(b)]
        assert len(got) == len(ref) and not bad, f"{level} {dtype} {opt}: {name} (step, got, fp32): {bad[:3]}"
    assert skipped == [0] * 20
    assert [(o["managed"], o["steps"], o["skipped"]) for o in report["optimizers"]] == [(level, 20, 0)]
    assert report["script_grad_scaler"] and report["iterations"] == 20


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_steps_the_scripts_grad_scaler_skips_are_reported_as_skipped(level, capsys, tmp_path):
    """fp16 grads times a scale of 1e9 overflow: the script's GradScaler skips every step
    (it does not call optimizer.step()); the report says so and counts the iterations."""
    args = ["--steps", "6", "--init-scale", "1e9"]
    code, out, err, report = _run(["--level", level, "--dtype", "fp16"], "grad_scaler_clip.py", args, capsys, tmp_path)
    assert code == 0, err
    assert "SKIPS 6" in out
    assert [(o["steps"], o["skipped"]) for o in report["optimizers"]] == [(6, 6)]
    assert report["iterations"] == 6


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("level", ["fp32", "O1", "O2", "O2K"])
def test_a_seeded_script_leaves_the_generators_as_plain_python_does(level, dtype, capsys, tmp_path):
    """torch's, Python's and numpy's global generators end where the plain run leaves
    them (ampkit's setup and first casting scope draw from none of them)."""
    reference = [line for line in _plain("seeded.py", [], capsys).splitlines() if line.startswith("RNG ")]
    code, out, err, report = _run(["--level", level, "--dtype", dtype], "seeded.py", [], capsys, tmp_path)
    if level == "O2K" and dtype == "fp16":
        assert code == 2
        return
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith("RNG ")] == reference and len(reference) == 3
