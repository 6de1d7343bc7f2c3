"""What ``ampkit.tune`` and ``ampkit tune`` say while they work: a line as each stage
begins and ends, a status line (done so far, an estimate of what is left, what is
measured now) whenever the tuner has been quiet for ``HEARTBEAT_S`` seconds, one long
measurement included; on stderr with ``progress=True`` (and always in the CLI); with
``progress=None`` (the default) to the ``"ampkit"`` logger at INFO where logging is
configured, else on stderr through logging's last-resort handler; nowhere with
``progress=False``.
Time is a stand-in clock where a test needs long measurements, so that each test stays
within a few seconds."""

from __future__ import annotations

import io
import logging
import re
import sys
import threading

import pytest
import torch
from logging_setup import configured_logging, unconfigured_logging
from torch import nn

import ampkit as amp
from ampkit.tools.tune import measure, search
from ampkit.tools.tune import progress as tune_progress
from ampkit.tools.tune.search import Probe

STAGES = ("timing", "sensitivity in bf16", "confirming")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(2)]


def _tune(**kw) -> amp.TunePlan:
    kw = {"candidates": ("bf16",), "include_emulated": True, "probe_steps": 2, "repeats": 1, **kw}
    return amp.tune(_model(), _batches(), nn.functional.mse_loss, **kw)


@pytest.fixture
def quick_probes(monkeypatch):
    """Probe runs that train nothing (every one 1 ms a step, the same loss): the stages
    are what is tested here, not the plan."""
    monkeypatch.setattr(search, "probe", lambda *a, **k: Probe(1.0, 1.0))


def _watchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ampkit-tune-progress"]


def test_each_stage_is_said_with_what_it_measures_and_when_it_is_done(capsys, quick_probes):
    _tune(progress=True)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == ""  # the library prints nothing
    assert lines and all(line.startswith("ampkit.tune: ") for line in lines), lines
    for stage in STAGES:
        begun = [line for line in lines if line.startswith(f"ampkit.tune: {stage}: ") and " done in " not in line]
        assert begun, (stage, lines)
        assert any(re.match(rf"ampkit\.tune: {stage}: done in [\d.]+ s \(\d+", line) for line in lines), (stage, lines)
    assert any("3 modules alone, forward + backward, in fp32, bf16" in line for line in lines), lines
    assert any(re.search(r"confirming: .*2 steps a run: fp32, then .* \(about \d+ runs\)", line) for line in lines)
    assert not _watchers()  # the watcher thread ended with the tuning


class Clock:
    """A stand-in for the progress clock: seconds pass only when the test spends them,
    one at a time, each after the watcher thread has looked at the clock (so that every
    second is seen as it would be in real time)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.owner = threading.get_ident()
        self.looked = threading.Event()

    def __call__(self) -> float:
        if threading.get_ident() != self.owner:
            self.looked.set()
        return self.t

    def spend(self, seconds: int) -> None:
        for _ in range(seconds):
            self.t += 1.0
            self.looked.clear()
            assert self.looked.wait(10), "the watcher thread stopped looking at the clock"


class Recorder(io.StringIO):
    """stderr, each line recorded with the stand-in time it was written at."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock, self.lines = clock, []

    def write(self, text: str) -> int:
        self.lines += [(self.clock.t, line) for line in text.splitlines()]
        return len(text)


def test_a_long_measurement_still_says_what_it_measures_at_least_every_10_s(monkeypatch, quick_probes):
    """The device takes 30 s to finish the first module's first timed run, and each probe
    run takes 25 s (stand-in time): no 10 s pass without a line, the status lines name
    what is measured and estimate what is left."""
    clock = Clock()
    monkeypatch.setattr(tune_progress, "monotonic", clock)
    monkeypatch.setattr(tune_progress, "TICK_S", 0.001)
    syncs = []

    def slow_sync(device_type):  # the wait for the device, around each timed run
        syncs.append(device_type)
        clock.spend(30 if len(syncs) == 1 else 0)

    def slow_probe(*args, **kwargs):
        clock.spend(25)
        return Probe(1.0, 1.0)

    monkeypatch.setattr(measure, "sync", slow_sync)
    monkeypatch.setattr(search, "probe", slow_probe)
    err = Recorder(clock)
    monkeypatch.setattr(sys, "stderr", err)
    _tune(progress=True)
    times = [0.0] + [t for t, _ in err.lines] + [clock.t]
    assert clock.t >= 30 + 4 * 25
    assert max(b - a for a, b in zip(times, times[1:])) <= 10, err.lines
    said = [line for _, line in err.lines]
    assert any("timing: 0/3 modules" in s and "now 0 (Linear) in fp32 (for" in s for s in said), said
    statuses = [s for s in said if s.startswith("ampkit.tune: confirming: ") and " so far" in s]
    assert any("now fp32 (for" in s for s in statuses), statuses
    pattern = r"(\d+)/(\d+) runs, [\d.]+ s so far, about ([\d.]+) s left; now .* \(for ([\d.]+) s\)"
    estimates = [m for m in (re.search(pattern, s) for s in statuses) if m]
    assert len(estimates) > 10, statuses
    for m in estimates:  # every run takes 25 s: the runs left, less the time the one going on has run
        done, total, left, running = int(m[1]), int(m[2]), float(m[3]), float(m[4])
        assert left == pytest.approx(25 * (total - done) - running, abs=1), m[0]


def test_with_progress_off_nothing_is_written_and_by_default_it_is_logged_at_info(capfd, caplog, quick_probes):
    _tune(progress=False)
    _tune()  # None: the "ampkit" logger, at INFO, which pytest's logging (configured, at WARNING) hides
    assert capfd.readouterr() == ("", "")
    assert not [r for r in caplog.records if r.name == "ampkit" and r.levelno == logging.INFO]
    caplog.set_level(logging.INFO, logger="ampkit")
    _tune()
    said = [r.getMessage() for r in caplog.records if r.name == "ampkit" and r.levelno == logging.INFO]
    for stage in STAGES:
        assert any(s.startswith(f"ampkit.tune: {stage}: ") for s in said), (stage, said)
    assert capfd.readouterr() == ("", "")  # logged, not written
    assert not _watchers()


def _each_stage_once(lines: list[str]) -> None:
    """Each stage's first and last line said exactly once, and no line twice."""
    said = [line for line in lines if line.startswith("ampkit.tune: ")]
    for stage in STAGES:
        begun = [s for s in said if s.startswith(f"ampkit.tune: {stage}: ") and " done in " not in s
                 and " so far" not in s]  # fmt: skip
        done = [s for s in said if s.startswith(f"ampkit.tune: {stage}: done in ")]
        assert (len(begun), len(done)) == (1, 1), (stage, lines)
    assert len(said) == len(set(said)), lines


def test_by_default_a_script_without_logging_configured_sees_progress_on_stderr_once(capsys, quick_probes):
    """No handler on the root or the "ampkit" logger (a plain script): the lines reach
    stderr through logging's last-resort handler, each once; ``progress=False`` stays silent."""
    with unconfigured_logging():
        _tune(progress=False)
        assert capsys.readouterr() == ("", "")
        _tune()
    captured = capsys.readouterr()
    assert captured.out == ""
    _each_stage_once(captured.err.splitlines())
    assert not _watchers()


def test_by_default_configured_logging_gets_progress_at_info_and_stderr_nothing(capsys, quick_probes):
    with configured_logging(logging.INFO) as handler:
        _tune()
    said = [r.getMessage() for r in handler.records if r.name == "ampkit" and r.levelno == logging.INFO]
    _each_stage_once(said)
    assert capsys.readouterr() == ("", "")  # not also on stderr
    with configured_logging(logging.INFO) as handler:
        logging.getLogger("ampkit").setLevel(logging.WARNING)  # quietened: nothing anywhere
        _tune()
    assert not [r for r in handler.records if r.getMessage().startswith("ampkit.tune: ")]
    assert capsys.readouterr() == ("", "")
    with unconfigured_logging():
        logging.getLogger("ampkit").setLevel(logging.WARNING)
        _tune()
    assert capsys.readouterr() == ("", "")
    assert not _watchers()


def test_a_progress_that_is_not_a_bool_or_none_is_refused_before_anything_is_measured(monkeypatch):
    monkeypatch.setattr(measure, "module_times", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(amp.AmpError, match="progress 'yes'"):
        _tune(progress="yes")
    assert not _watchers()


def test_the_watcher_stops_and_the_stage_says_it_stopped_when_the_tuning_raises(monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(search, "probe", boom)
    with pytest.raises(RuntimeError, match="boom"):
        _tune(progress=True)
    assert "ampkit.tune: confirming: stopped after" in capsys.readouterr().err
    assert not _watchers()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _stages_on(stream: io.StringIO) -> None:
    with tune_progress.Progress(True, "ampkit.tune", stream=stream) as report:
        with report.stage("timing", "2 modules", 2, "modules"):
            report.now("0 (Linear) in bf16")
            report.advance(2)


def test_a_terminal_gets_a_rich_bar_and_plain_lines_without_rich(monkeypatch):
    pytest.importorskip("rich")
    screen = Terminal()
    _stages_on(screen)
    assert "2/2" in screen.getvalue()  # rich's bar, complete (plain lines never count so)
    assert "ampkit.tune: timing: done in" in screen.getvalue()
    for name in ("rich", "rich.console", "rich.progress"):
        monkeypatch.setitem(sys.modules, name, None)  # as if rich were not installed
    plain = Terminal()
    _stages_on(plain)
    lines = plain.getvalue().splitlines()
    assert lines[0] == "ampkit.tune: timing: 2 modules" and len(lines) == 2, lines
    assert re.fullmatch(r"ampkit\.tune: timing: done in [\d.]+ s \(2 modules\)", lines[1]), lines


SLOW_START_SCRIPT = """
import time
import torch
from torch import nn
time.sleep(1.0)  # a slow start: the capture says it is still going
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(6):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_ampkit_tune_says_each_stage_the_capture_process_measures_and_a_status_meanwhile(tmp_path, monkeypatch,
                                                                                       capsys):  # fmt: skip
    """The capture runs in a child process (real); its measuring stages come through;
    the confirming runs stand in (each a child ``ampkit run`` otherwise, seconds each)."""
    from ampkit.tools.cli.main import main
    from ampkit.tools.tune import script as tune_script

    monkeypatch.setattr(tune_progress, "HEARTBEAT_S", 0.5)  # this process's watcher: the capture takes seconds
    monkeypatch.setattr(tune_script, "confirming_run", lambda *a, **k: (Probe(1.0, 1.0), ""))
    path = tmp_path / "train.py"
    path.write_text(SLOW_START_SCRIPT)
    out = tmp_path / "plan.json"
    assert main(["tune", "--steps", "4", "--include-emulated", "--out", str(out), str(path)]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert all(line.startswith("ampkit tune: ") for line in lines), lines
    stages = ("capture", "measuring", "timing", "sensitivity in", "confirming")
    order = [[i for i, line in enumerate(lines) if line.startswith(f"ampkit tune: {stage}")][:1] for stage in stages]
    assert all(order) and order == sorted(order), lines
    assert any(re.match(r"ampkit tune: capture: [\d.]+ s so far", line) for line in lines), lines
    assert any(line.startswith("ampkit tune: confirming: done in") for line in lines), lines
    assert "ampkit tune:" not in captured.out and "plan:" in captured.out  # the table on stdout, progress apart
    assert out.exists()


@pytest.mark.parametrize(("argv", "shown"), [([], True), (["--no-progress"], False)])
def test_ampkit_tune_shows_progress_unless_told_not_to(argv, shown, tmp_path, monkeypatch, capsys):
    from ampkit.tools.cli.main import main
    from ampkit.tools.tune import script as tune_script

    seen = {}

    def tune(path, args, **kwargs):
        seen.update(kwargs)
        return amp.TunePlan.by_hand(["0"], ["1"])

    monkeypatch.setattr(tune_script, "tune_script", tune)
    (tmp_path / "s.py").write_text("x = 1\n")
    assert main(["tune", *argv, "--out", str(tmp_path / "plan.json"), str(tmp_path / "s.py")]) == 0
    assert seen["progress"] is shown
