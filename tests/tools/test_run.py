"""``ampkit run``: unmodified training scripts (tests/support/scripts/, which know nothing of
ampkit) trained in mixed precision, checked against their plain fp32 runs; where casting
happens and where it does not; fp16 scaling or a clear refusal; the undo at exit; bad
input. Runs go through ``ampkit.cli.main.main(["run", ...])`` in this process (the same
code as the command, without a new interpreter's start-up), a few through a subprocess."""

from __future__ import annotations

import json
import os
import runpy
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from locations import ROOT, SCRIPTS
from torch import nn

import ampkit
from ampkit.tools.cli.main import main


def _plain(script: str, args: list[str], capsys) -> str:
    """The script as plain Python runs it (fp32): its stdout."""
    saved = sys.argv[:]
    sys.argv = [str(SCRIPTS / script), *args]
    try:
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    finally:
        sys.argv = saved
    return capsys.readouterr().out


def _run(options: list[str], script: str, args: list[str], capsys, tmp_path: Path):
    """``ampkit run [options] --report R script args``: (exit code, stdout, stderr, report)."""
    report = tmp_path / "report.json"
    code = main(["run", *options, "--report", str(report), str(SCRIPTS / script), *args])
    out, err = capsys.readouterr()
    return code, out, err, (json.loads(report.read_text()) if report.exists() else None)


def _metric(out: str) -> float:
    lines = [line for line in out.splitlines() if line.startswith("METRIC ")]
    assert lines, f"no METRIC line in:\n{out[-2000:]}"
    return float(lines[-1].split()[2])


def _site(script: str, text: str) -> str:
    """``script:line`` of the first line of ``script`` containing ``text``."""
    for number, line in enumerate((SCRIPTS / script).read_text().splitlines(), 1):
        if text in line:
            return f"{script}:{number}"
    raise AssertionError(f"{text!r} not in {script}")


def _close(value: float, reference: float, rel: float) -> bool:
    return abs(value - reference) <= rel * abs(reference)


def _against_fp32(options, script, args, capsys, tmp_path, rel=0.01, ref_args=None):
    """Run ``script`` plainly (fp32) and under ``ampkit run options``; assert a clean
    exit and the metric within ``rel`` of fp32's. Returns (stdout, stderr, report)."""
    reference = _metric(_plain(script, ref_args or args, capsys))
    code, out, err, report = _run(options, script, args, capsys, tmp_path)
    assert code == 0, err
    value = _metric(out)
    assert _close(value, reference, rel), f"{script} {options}: {value} vs fp32 {reference}"
    return out, err, report


# script, its arguments (kept small: bf16 is emulated on CPUs without avx512_bf16),
# and the arguments of its fp32 reference run
CASES = {
    "classifier": ("classifier.py", ["--steps", "150"], None),
    "rnn_lm_manual_sgd": ("rnn_lm.py", ["--steps", "60"], None),
    "autocast_gradscaler": ("autocast_scaler.py", ["--steps", "150", "--amp"], ["--steps", "150"]),
    "gan_two_optimizers": ("gan.py", ["--steps", "300"], None),
    "accumulation_scheduler": ("accum_sched.py", ["--steps", "40"], None),
}
SLOW = {"rnn_lm_manual_sgd", "gan_two_optimizers"}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES]
)
def test_script_reaches_its_fp32_metric_at_o1_bf16(case, capsys, tmp_path):
    script, args, ref_args = CASES[case]
    out, err, report = _against_fp32([], script, args, capsys, tmp_path, ref_args=ref_args)
    assert report["level_applied"] == "O1" and report["dtype"] == "bf16"
    assert report["forward_scopes"] > 0
    assert "ampkit run: O1 bf16, exit code 0" in err  # the summary on stderr
    opts = report["optimizers"]
    if script == "rnn_lm.py":  # manual SGD through p.data: casting only
        assert opts == [] and report["iterations"] == 60
        assert "no torch.optim optimizer" in err
    else:
        assert opts and all(o["managed"] == "O1" and o["skipped"] == 0 for o in opts)
        steps = int(args[args.index("--steps") + 1])
        assert all(o["steps"] == steps for o in opts)
    if case == "autocast_gradscaler":  # the script's autocast + GradScaler: no double scaling
        assert report["script_grad_scaler"] and report["scaled_backward_calls"] == 0
        # the recorded loss is the script's, unscaled: near the fp32 run's first loss
        assert report["losses"][_site("autocast_scaler.py", ".backward()")][0] < 1.0
    if case == "gan_two_optimizers":  # one series per backward() line
        assert set(report["losses"]) == {_site("gan.py", "errD.backward()"), _site("gan.py", "errG.backward()")}


def test_fp32_level_changes_nothing(capsys, tmp_path):
    """`--level fp32` observes only: the script's numbers bit for bit."""
    args = ["--steps", "40"]
    reference = _plain("classifier.py", args, capsys)
    code, out, err, report = _run(["--level", "fp32"], "classifier.py", args, capsys, tmp_path)
    assert code == 0
    assert out == reference
    assert report["forward_scopes"] == 0 and report["optimizers"][0]["managed"] == "fp32"
    assert report["optimizers"][0]["steps"] == 40 and len(report["losses"][_site("classifier.py", "loss.backward()")]) == 40


def test_casting_only_inside_forward_passes(capsys, tmp_path):
    code, out, err, report = _run([], "placement.py", [], capsys, tmp_path)
    assert code == 0, err
    seen: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        seen.setdefault(key, []).append(value)
    assert seen["forward_linear"] == ["torch.bfloat16", "torch.float16"]  # 2nd: the script's autocast
    assert seen["forward_autocast"] == ["True", "True"]
    assert seen["output"] == ["torch.float32"]  # outputs leave the forward in fp32
    assert seen["outside_matmul"] == ["torch.float32"]
    assert seen["outside_autocast"] == ["False"]
    assert seen["backward_autocast"] == ["False"]
    assert seen["step_autocast"] == ["False"]
    assert seen["grad"] == ["torch.float32"]
    assert seen["manual_update"] == ["torch.float32"]
    assert seen["script_autocast_output"] == ["torch.float16"]  # the script's own region stands
    assert seen["weight"] == ["torch.float32"]


def _global_hooks() -> tuple[int, int]:
    reg = nn.modules.module
    return len(reg._global_forward_pre_hooks), len(reg._global_forward_hooks)


def _optimizers_left_managed() -> list[torch.optim.Optimizer]:
    """Optimizers still marked as managed, or fails.py's AdamW with a step of ampkit's
    on the instance (a scheduler's own wrapper, which torch puts there, may stay)."""
    import gc

    return [
        o for o in gc.get_objects()
        if issubclass(type(o), torch.optim.Optimizer)
        and ("_ampkit_managed" in o.__dict__ or (type(o) is torch.optim.AdamW and "step" in o.__dict__))
    ]


@pytest.mark.parametrize("options,args,expected", [
    ([], [], 0),
    (["--level", "O2"], [], 0),
    ([], ["--exit", "3"], 3),
    ([], ["--raise-in-forward"], 1),
])
def test_everything_is_undone_at_exit(options, args, expected, capsys, tmp_path):
    init, backward = torch.optim.Optimizer.__init__, torch.autograd.backward
    lr = torch.optim.lr_scheduler
    sched_steps = [c.__dict__.get("step") for c in (lr.LRScheduler, lr.SequentialLR, lr.CosineAnnealingWarmRestarts)]
    hooks = _global_hooks()
    argv, path0 = sys.argv[:], sys.path[0]
    code, out, err, report = _run(options, "fails.py", args, capsys, tmp_path)
    assert code == expected
    if expected == 1:
        assert "ValueError: bad batch" in err  # the script's traceback, as Python shows it
    assert torch.optim.Optimizer.__init__ is init
    assert torch.autograd.backward is backward
    assert [c.__dict__.get("step") for c in (lr.LRScheduler, lr.SequentialLR, lr.CosineAnnealingWarmRestarts)] == sched_steps
    if threading.active_count() > 1:
        # with another thread alive (pytest-xdist's), reset keeps ampkit's global module
        # hooks (documented: removing them under a running thread is unsafe); they are
        # ampkit's own and nothing else, so releasing them restores the state before
        ampkit.casting.release_kernels()
    assert _global_hooks() == hooks
    assert not torch.is_autocast_enabled("cpu") and not ampkit.is_active()
    assert sys.argv == argv and sys.path[0] == path0
    assert _optimizers_left_managed() == []
    assert report["exit_code"] == expected
    # a model built afterwards trains in plain fp32 again
    model = nn.Linear(4, 4)
    assert model(torch.randn(2, 4)).dtype == torch.float32


def test_objects_the_script_keeps_are_released(capsys, tmp_path):
    """An optimizer and model that outlive the script: their own step() is back, no
    gradient hook of ampkit's is left, and they train as plain torch objects."""
    import builtins

    script = tmp_path / "keeps.py"
    script.write_text(
        "import builtins, torch\n"
        "model = torch.nn.Linear(4, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "sched = torch.optim.lr_scheduler.StepLR(opt, 1)\n"
        "model(torch.randn(3, 4)).sum().backward()\n"
        "opt.step(); sched.step()\n"
        "builtins._ampkit_test_kept = (model, opt)\n"
    )
    try:
        assert main(["run", "--dtype", "fp16", str(script)]) == 0
        model, opt = builtins._ampkit_test_kept
    finally:
        builtins.__dict__.pop("_ampkit_test_kept", None)
    capsys.readouterr()
    assert "_ampkit_managed" not in opt.__dict__
    from ampkit.trainer.grad_hooks import has_grad_path

    assert not any(has_grad_path(p) for p in model.parameters())
    out = model(torch.randn(3, 4))
    assert out.dtype == torch.float32
    before = model.weight.detach().clone()
    opt.zero_grad()
    out.sum().backward()
    grad = model.weight.grad.clone()
    opt.step()  # the scheduler's wrapper of the optimizer's own step: a plain SGD step
    torch.testing.assert_close(model.weight.detach(), before - opt.param_groups[0]["lr"] * grad)


def test_the_scripts_cyclic_garbage_is_freed_before_the_run_returns(capsys, tmp_path):
    """A model in a reference cycle (DDP's are) is freed when the script ends, not at
    the interpreter's teardown: freed there under torchrun, after the process group's
    threads were gone, both ranks aborted with SIGABRT after a successful run."""
    import builtins

    script = tmp_path / "cycle.py"
    script.write_text(
        "import builtins, weakref, torch\n"
        "model = torch.nn.Linear(4, 2)\n"
        "model.me = [model]  # a cycle, as DDP's reducer and hooks make\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.randn(3, 4)).sum().backward()\n"
        "opt.step()\n"
        "builtins._ampkit_test_ref = weakref.ref(model)\n"
    )
    try:
        assert main(["run", str(script)]) == 0
        ref = builtins._ampkit_test_ref
    finally:
        builtins.__dict__.pop("_ampkit_test_ref", None)
    capsys.readouterr()
    assert ref() is None


def test_skipped_step_holds_the_scheduler(capsys, tmp_path, monkeypatch):
    """An inf loss in one micro-batch: that optimizer step is skipped and the LR schedule
    advances only on real steps (StepLR halves every 20: 39 real steps of 40 leave it at
    0.1, not 0.05)."""
    args = ["--steps", "40"]
    reference = _metric(_plain("accum_sched.py", args, capsys))
    monkeypatch.setenv("INJECT_INF_AT", "5")
    code, out, err, report = _run([], "accum_sched.py", args, capsys, tmp_path)
    assert code == 0, err
    assert report["optimizers"][0]["steps"] == 40 and report["optimizers"][0]["skipped"] == 1
    assert "final_lr 0.1\n" in out and report["scheduler_steps_held"] == 1
    assert _close(_metric(out), reference, 0.01)


def test_fp16_loss_scaling_matches_fp32(capsys, tmp_path):
    # a GradScaler alive before the run is not the script's: ampkit still scales
    earlier = torch.amp.GradScaler("cpu")
    assert earlier.is_enabled()
    args = ["--steps", "60"]
    out, err, report = _against_fp32(["--dtype", "fp16"], "classifier.py", args, capsys, tmp_path)
    assert report["scaled_backward_calls"] == 60
    assert report["optimizers"][0]["loss_scale"] == 2.0**16
    # the recorded losses are the script's (unscaled) ones
    assert abs(report["losses"][_site("classifier.py", "loss.backward()")][0] - 2.075) < 0.01


def test_fp16_grads_are_real_when_the_script_clips(capsys, tmp_path):
    """clip_grad_norm_ right after backward sees unscaled gradients (not 65536x)."""
    args = ["--steps", "20", "--clip", "0.5"]
    out, err, report = _against_fp32(["--dtype", "fp16"], "classifier.py", args, capsys, tmp_path)
    reference = _plain("classifier.py", args, capsys)

    def norm(text: str) -> float:
        return float(next(line for line in text.splitlines() if line.startswith("grad_norm")).split()[1])

    assert report["scaled_backward_calls"] == 20
    assert abs(norm(out) - norm(reference)) <= 0.01 * norm(reference)


@pytest.mark.slow
def test_fp16_gan_scales_once_for_both_optimizers(capsys, tmp_path):
    """The generator's loss reaches both models: one scale, shared by the two optimizers."""
    args = ["--steps", "300"]
    out, err, report = _against_fp32(["--dtype", "fp16"], "gan.py", args, capsys, tmp_path, rel=0.02)
    assert report["scaled_backward_calls"] == 600
    scales = {o["loss_scale"] for o in report["optimizers"]}
    assert len(scales) == 1


def test_o2_without_optimizer_is_o1_casting(capsys, tmp_path):
    code, out, err, report = _run(["--level", "O2"], "rnn_lm.py", ["--steps", "2"], capsys, tmp_path)
    assert code == 0 and report["level_applied"] == "O1" and report["forward_scopes"] > 0
    assert "ampkit run: O1 (asked O2) bf16" in err


def test_fp16_refused_for_manual_updates(capsys, tmp_path):
    code, out, err, report = _run(["--dtype", "fp16"], "rnn_lm.py", ["--steps", "3"], capsys, tmp_path)
    assert code == 2 and report is None
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert _site("rnn_lm.py", "loss.backward()") in lines[0] and "--dtype bf16" in lines[0]
    assert torch.autograd.backward.__module__ == "torch.autograd"  # undone before the refusal


def test_fp16_with_the_scripts_gradscaler_does_not_scale_twice(capsys, tmp_path):
    args = ["--steps", "60"]
    out, err, report = _against_fp32(
        ["--dtype", "fp16"], "autocast_scaler.py", [*args, "--amp"], capsys, tmp_path, ref_args=args
    )
    assert report["script_grad_scaler"] and report["scaled_backward_calls"] == 0


@pytest.mark.parametrize("level", ["O2", pytest.param("O2K", marks=pytest.mark.slow)])
def test_o2_levels_cast_the_model_when_the_optimizer_is_built(level, capsys, tmp_path):
    args = ["--steps", "100"]
    out, err, report = _against_fp32(["--level", level], "classifier.py", args, capsys, tmp_path)
    assert report["level_applied"] == level and report["optimizers"][0]["managed"] == level


def test_o2_with_two_optimizers_built_one_after_the_other(capsys, tmp_path):
    """The GAN's second optimizer re-initializes the session with both models."""
    code, out, err, report = _run(["--level", "O2"], "gan.py", ["--steps", "5"], capsys, tmp_path)
    assert code == 0, err
    assert [o["managed"] for o in report["optimizers"]] == ["O2", "O2"]
    assert [o["steps"] for o in report["optimizers"]] == [5, 5]
    assert report["notes"] == []


def test_time_budget_ends_the_script_cleanly(capsys, tmp_path):
    code, out, err, report = _run(["--time", "0.001"], "classifier.py", ["--steps", "50"], capsys, tmp_path)
    assert code == 0 and report["iterations"] == 1
    assert report["stopped_early"] == "time budget of 0.001 s reached"
    assert "METRIC" not in out  # stopped after the first step, before the evaluation


def test_second_optimizer_over_an_o2_model_is_refused(capsys, tmp_path):
    """Its parameters are the model's 16-bit weights: no fp32 masters can be rebuilt.
    The refusal passes through the script's own ``except Exception``."""
    script = tmp_path / "phases.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(4, 2)\n"
        "first = torch.optim.Adam(model.parameters())\n"
        "try:\n"
        "    second = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "except Exception:\n"
        "    print('swallowed')\n"
    )
    assert main(["run", "--level", "O2", str(script)]) == 2
    out, err = capsys.readouterr()
    assert "swallowed" not in out
    assert err.count("\n") == 1 and "phases.py:5" in err and "--level O1" in err
    assert torch.optim.Optimizer.__init__.__module__ == "torch.optim.optimizer"


def test_o2_falls_back_to_o1_naming_the_line(capsys, tmp_path):
    """The optimizer leaves a trainable layer out: O2 would cast it without a master."""
    args = ["--steps", "60", "--freeze-first"]
    out, err, report = _against_fp32(["--level", "O2"], "classifier.py", args, capsys, tmp_path)
    assert report["level_applied"] == "O1"
    assert f"O2 not applied: the optimizer built at {_site('classifier.py', 'optimizer = ')}" in err
    assert "falling back to O1" in err


@pytest.mark.parametrize("argv,needle", [
    (["run", "no_such_script.py"], "no such file"),
    (["run", "--level", "O4", str(SCRIPTS / "fails.py")], "invalid choice: 'O4'"),
    (["run", "--level", "O2K", "--dtype", "fp16", str(SCRIPTS / "fails.py")], "bf16 only"),
    (["run", "--png", "x.png", str(SCRIPTS / "fails.py")], "--png goes with --compare"),
    (["run", "--report", "/no/such/dir/r.json", str(SCRIPTS / "fails.py")], "cannot write"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and needle in err and out == ""


CHDIR_SCRIPT = """
import os, sys
os.makedirs(sys.argv[1], exist_ok=True)
os.chdir(sys.argv[1])
"""


def test_a_relative_report_is_written_where_the_command_was_started(capsys, tmp_path, monkeypatch):
    """The script changes folder; ``--report rel.json`` still lands beside the launch."""
    (tmp_path / "s.py").write_text(CHDIR_SCRIPT)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--report", "rel.json", "s.py", str(tmp_path / "away")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "rel.json").read_text())["exit_code"] == 0
    assert not (tmp_path / "away" / "rel.json").exists()


def test_a_special_report_or_plan_is_refused_before_the_script_runs(capsys, tmp_path):
    """A FIFO or a symlink at ``--report``, a FIFO, ``/dev/zero`` or a binary file as
    ``--plan``: one line, exit 2, the script never started, the special file as it was."""
    script, marker = tmp_path / "s.py", tmp_path / "ran.txt"
    script.write_text("import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('ran')\n")
    fifo, link, victim, binary = (tmp_path / n for n in ("fifo.json", "link.json", "victim.json", "binary.json"))
    os.mkfifo(fifo)
    victim.write_text("mine")
    link.symlink_to(victim)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    binary.write_bytes(b"\x00\xff\xfe")
    for argv, needle in (
        (["--report", str(fifo)], "it is a FIFO"),
        (["--report", str(link)], "it is a symbolic link"),
        (["--plan", str(fifo)], "cannot read the tuning plan"),
        (["--plan", str(zero)], "it is a character device"),
        (["--plan", str(binary)], "is not text"),
    ):
        assert main(["run", *argv, str(script), str(marker)]) == 2
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and err.startswith("ampkit run: ") and needle in err and out == "", err
    assert not marker.exists() and victim.read_text() == "mine" and os.path.islink(link)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def _cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ampkit", "run", *args], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.slow
def test_command_line_passes_exit_codes_through():
    proc = _cli(str(SCRIPTS / "fails.py"), "--exit", "7")
    assert proc.returncode == 7
    assert "ampkit run: O1 bf16, exit code 7" in proc.stderr


@pytest.mark.slow
def test_compare_prints_curves_side_by_side_and_writes_png(tmp_path):
    png = tmp_path / "cmp.png"
    proc = _cli("--compare", "--steps", "20", "--png", str(png), str(SCRIPTS / "classifier.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"loss at {_site('classifier.py', 'loss.backward()')}" in proc.stdout
    assert "fp32 vs O1 bf16" in proc.stdout
    # ten windows of two losses each, the last one calls 19-20, for both runs
    rows = [line for line in proc.stdout.splitlines() if line.split("│")[1:2] and line.split("│")[1].strip() == "19-20"]
    assert len(rows) == 1 and len(rows[0].split("│")) == 6, proc.stdout
    assert png.stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.distributed
def test_under_torchrun(tmp_path):
    """`torchrun -m ampkit run`: each rank runs the script; rank 0 prints the summary.
    O2 on a model wrapped in DDP before its optimizer is built falls back to O1, whose
    ranks keep equal weights."""
    level = "O2"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    port = str(29500 + os.getpid() % 400)
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "--master_port", port, "-m", "ampkit", "run",
         "--level", level, "--report", str(tmp_path / "r.json"), str(SCRIPTS / "ddp.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("weights_agree True") == 2
    assert proc.stderr.count("ampkit run: O1") == 1  # the summary, rank 0 only
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["level_applied"] == "O1" and report["optimizers"][0]["steps"] == 30
    assert "wrapped in DistributedDataParallel" in report["notes"][0]
    assert proc.stderr.count("O2 not applied") == 2  # logged once (rank 0), and in the summary


def test_example_runs_under_ampkit_run(capsys, tmp_path):
    """examples/plain_digits.py, stopped by --steps after 5 iterations."""
    example = ROOT / "examples" / "plain_digits.py"
    report = tmp_path / "r.json"
    assert main(["run", "--steps", "5", "--report", str(report), str(example)]) == 0
    data = json.loads(report.read_text())
    assert data["iterations"] == 5 and data["stopped_early"] == "max_steps=5 reached"
    assert data["optimizers"][0]["managed"] == "O1" and data["optimizers"][0]["steps"] == 5
    assert "test accuracy" not in capsys.readouterr().out  # stopped before the evaluation


def _data_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("DATA ")]


@pytest.mark.parametrize("args", [
    ["--workers", "0"],
    pytest.param(["--workers", "2"], marks=pytest.mark.slow),
    ["--no-train"],
    ["--encoder"],
    pytest.param(["--encoder", "--workers", "2"], marks=pytest.mark.slow),
])
def test_data_transforms_stay_fp32_bit_for_bit(args, capsys, tmp_path):
    """nn.Module transforms (a GaussianBlur's conv2d, a Normalize with buffers) in a
    Dataset's __getitem__, with DataLoader workers 0 and 2, a loader built and iterated
    before the optimizer exists and after, a blur called on its own, a frozen layer
    with parameters in __getitem__: every image bit for bit as in the plain run, every
    conv of the pipeline in fp32; the model's own calls are cast."""
    plain = _plain("data_pipeline.py", args, capsys)
    code, out, err, report = _run([], "data_pipeline.py", args, capsys, tmp_path)
    assert code == 0, err
    assert _data_lines(out) == _data_lines(plain) and len(_data_lines(out)) == (2 if "--no-train" in args else 4)
    assert all(line.endswith("codes [0]") for line in _data_lines(out))  # float32 convs only
    if "--no-train" in args:  # no optimizer: no model either, nothing cast
        assert report["model_calls"] == 0 and report["forward_scopes"] == 0
        assert report["module_calls_left_alone"] > 0
    else:
        assert "model_conv ['torch.bfloat16']" in out
        # 12 training steps and the 4 batches of the evaluation
        assert report["model_calls"] == report["forward_scopes"] == 16
        assert "16 model calls, 16 cast by ampkit" in err


def test_repeated_step_is_no_iteration_and_is_noted(capsys, tmp_path):
    """torchvision's reference classification script (vision@017e9b99) with --amp on a
    CPU: torch disables its autocast and GradScaler, scaler.step(optimizer) steps, and
    the loop's own optimizer.step() steps again on the same gradients. 20 batches: 40
    steps, 20 iterations, a note naming the second step's line; the transforms'
    module calls are no model calls."""
    code, out, err, report = _run([], "reference_classification.py", ["--amp"], capsys, tmp_path)
    assert code == 0, err
    assert report["backward_calls"] == 20 and report["iterations"] == 20
    assert report["optimizers"][0]["steps"] == 40 and report["optimizers"][0]["skipped"] == 0
    assert len(report["notes"]) == 1
    note = report["notes"][0]
    assert "stepped 20 time(s) with no backward()" in note
    assert _site("reference_classification.py", "        optimizer.step()") in note
    assert report["model_calls"] == report["forward_scopes"] == 28  # 20 training, 8 evaluation batches
    assert report["forward_calls_in_script_autocast"] == 0
    # the flip and normalize of 160 training and 64 test images, and the criterion
    assert report["module_calls_left_alone"] == 2 * 160 + 64 + 20
    # without --amp: one step per batch, nothing noted
    code, out, err, report = _run([], "reference_classification.py", [], capsys, tmp_path)
    assert code == 0 and report["iterations"] == 20 and report["optimizers"][0]["steps"] == 20
    assert report["notes"] == []


def test_a_model_called_through_a_parameterless_module_is_cast(capsys, tmp_path):
    """A wrapper without parameters that calls a model it was handed: the model's call
    is the model call (cast); the wrapper's own ops stay fp32."""
    script = tmp_path / "wrapper.py"
    script.write_text(
        "import torch\n"
        "class Apply(torch.nn.Module):\n"
        "    def forward(self, model, x):\n"
        "        y = model(x)\n"
        "        print('inner', y.dtype, (x @ x.T).dtype)\n"
        "        return y\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        "seen = []\n"
        "model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))\n"
        "Apply()(model, torch.randn(3, 4))\n"
        "print('linear', seen)\n"
    )
    report = tmp_path / "r.json"
    assert main(["run", "--report", str(report), str(script)]) == 0
    out = capsys.readouterr().out
    assert "inner torch.float32 torch.float32" in out and "linear [torch.bfloat16]" in out
    data = json.loads(report.read_text())
    assert data["model_calls"] == data["forward_scopes"] == 1 and data["module_calls_left_alone"] == 1


def test_summary_says_who_cast_the_model_calls_ampkit_did_not():
    """A model call the script's own autocast (or an O2 model's own casting) ran is not
    reported as left uncast: the summary names where it ran."""
    from ampkit.tools.run import format_summary

    report = {
        "level": "O1", "level_applied": "O1", "dtype": "bf16", "exit_code": 0, "wall_seconds": 1.0,
        "stopped_early": None, "optimizers": [], "model_calls": 30, "forward_scopes": 0,
        "forward_calls_in_script_autocast": 28, "forward_calls_kept_fp32": 2, "forward_calls_cast_model": 0,
        "module_calls_left_alone": 0, "iteration_ms_median": None, "losses": {}, "notes": [],
        "scheduler_steps_held": 0, "script_grad_scaler": False,
    }  # fmt: skip
    text = format_summary(report)
    line = next(line for line in text.splitlines() if "model calls" in line)
    assert "30 model calls, 0 cast by ampkit, 28 under the script's own torch.autocast, 2 kept fp32" in line
    assert "model's own casting" not in line


def test_an_optimizer_built_in_another_thread_refuses_the_run(capsys, tmp_path):
    """Casting is per thread and ampkit run sets up the script's main thread: a script
    whose threads build and step their own optimizers (left unmanaged, their NaN steps
    taken) is refused in one line, exit 2, instead of a summary that lists one
    optimizer and exits 0; the threads stop quietly, no traceback."""
    script = tmp_path / "threaded.py"
    script.write_text(
        "import threading, torch\n"
        "from torch import nn\n"
        "def train(seed):\n"
        "    torch.manual_seed(seed)\n"
        "    m = nn.Linear(4, 2)\n"
        "    o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "    for _ in range(5):\n"
        "        o.zero_grad(); m(torch.randn(8, 4)).square().mean().backward(); o.step()\n"
        "threads = [threading.Thread(target=train, args=(i,), name=f'worker-{i}') for i in range(3)]\n"
        "for t in threads: t.start()\n"
        "for t in threads: t.join()\n"
        "train(9)\n"
    )
    assert main(["run", str(script)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "not in the script's main thread" in lines[0] and "worker-" in lines[0], err
    assert "Traceback" not in err
    assert getattr(threading.excepthook, "__qualname__", "") != "_Runner._thread_excepthook"  # restored
