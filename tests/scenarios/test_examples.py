"""The example scripts run for a few steps with every --amp value."""

from __future__ import annotations

import contextlib
import functools
import io
import math
from types import ModuleType

import pytest
from locations import ROOT, load_file

EXAMPLES = ROOT / "examples"
LEVELS = ("O0", "O1", "O2", "O3", "O2K")
TINY_CLASSIFIER = ["--steps", "4", "--width", "4", "--image-size", "16", "--batch-size", "32",
                   "--log-every", "2"]
TINY_LM = ["--steps", "4", "--d-model", "16", "--layers", "1", "--heads", "2", "--seq-len", "16",
           "--batch-size", "4", "--corpus-chars", "20000", "--sample", "8", "--log-every", "2"]


@functools.cache
def _fp32(name: str) -> dict[str, float]:
    """The metrics of the example run without ampkit (``--amp off``), same settings."""
    args = TINY_CLASSIFIER if name == "train_classifier" else TINY_LM
    with contextlib.redirect_stdout(io.StringIO()):
        return _load(name).main(["--amp", "off", *args])


def _like_fp32(name: str, metrics: dict[str, float], loss: str, accuracy: str) -> None:
    """The run trained as fp32 did: its loss within 0.5% of fp32's (measured: O3 differs
    by 0.05%, the other levels by less) and its accuracy within 0.02."""
    want = _fp32(name)
    assert math.isfinite(metrics[loss]) and abs(metrics[loss] - want[loss]) <= 0.005 * want[loss], (metrics, want)
    assert abs(metrics[accuracy] - want[accuracy]) <= 0.02, (metrics, want)


def _load(name: str) -> ModuleType:
    return load_file(EXAMPLES / f"{name}.py", f"example_{name}")


@pytest.mark.parametrize("amp", ("off", "init", *LEVELS))
def test_train_classifier_runs(amp: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = _load("train_classifier")
    metrics = module.main(["--amp", amp, *TINY_CLASSIFIER])
    out = capsys.readouterr().out
    assert f"amp={amp}" in out and "test accuracy" in out
    _like_fp32("train_classifier", metrics, "test_loss", "test_accuracy")
    if amp != "off":
        assert "skipped" in out and "scale" in out


@pytest.mark.parametrize("amp", ("off", "init", *LEVELS))
def test_train_lm_runs(amp: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = _load("train_lm")
    metrics = module.main(["--amp", amp, *TINY_LM])
    out = capsys.readouterr().out
    assert "bits/char" in out and "sample:\ndef " in out
    _like_fp32("train_lm", metrics, "eval_loss", "eval_accuracy")


def test_train_classifier_fp16_dynamic_scaling_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """fp16 on CPU is slow but must work; the loss scaler reports its scale."""
    module = _load("train_classifier")
    with pytest.warns(UserWarning, match="float16 on CPU"):
        metrics = module.main(["--amp", "init", "--dtype", "fp16", *TINY_CLASSIFIER])
    out = capsys.readouterr().out
    assert "dtype=float16" in out and "scale" in out
    assert math.isfinite(metrics["test_loss"])


@pytest.mark.slow  # a new process (forked from one that imported torch and ampkit: tests/support/forked.py)
def test_examples_run_as_scripts(forked_python) -> None:
    proc = forked_python.run_script(EXAMPLES / "train_classifier.py", ["--amp", "off", *TINY_CLASSIFIER], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "test accuracy" in proc.stdout


def test_bad_steps_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    module = _load("train_lm")
    with pytest.raises(SystemExit) as exc:
        module.main(["--steps", "0"])
    assert exc.value.code == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
