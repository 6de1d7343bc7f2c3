"""The NaN demo that opens each integration page (docs/integrations/*.md), run exactly as
the page shows it (its first Python block), then checked: one NaN gradient injected by a
hook leaves the framework's own bf16 flag with non-finite weights, while ampkit's run
keeps every weight finite, counts one skipped step and ends bitwise where the same run
without the bad step ends (its ``train`` called again with one step fewer and no NaN).

Also the banner: each integration says one line when ampkit takes over the framework's
precision, once per process and framework (the demo sets ampkit up twice), never on
stdout: run as a reader runs the page (no logging configured), on stderr through
logging's last-resort handler; where logging is configured, at INFO on the ``"ampkit"``
logger and not on stderr."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from locations import ROOT
from logging_setup import configured_logging, unconfigured_logging

import ampkit as amp
from ampkit.integrations import banner

PAGES = ROOT / "docs" / "integrations"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _demo(page: str) -> dict:
    """Run the first Python block of ``docs/integrations/<page>`` (the NaN demo) as a
    reader would, in the current folder, with no logging configured; its names."""
    code = BLOCK.search((PAGES / page).read_text())
    assert code is not None, page
    names: dict = {"__name__": "__main__"}
    with unconfigured_logging():
        exec(compile(code.group(1), str(PAGES / page), "exec"), names)
    return names


def _finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _weights(model: torch.nn.Module, optimizer) -> list[torch.Tensor]:
    """The model's weights and the ones ampkit steps (O2: the fp32 masters), cloned."""
    return [p.detach().clone() for p in model.parameters()] + [
        m.detach().clone() for m in amp.master_params(optimizer)
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def banners(monkeypatch, capsys):
    """A process that has announced nothing yet; the banner lines on stderr from here on
    (and that none is on stdout)."""
    monkeypatch.setattr(banner, "ANNOUNCED", set())

    def lines() -> list[str]:
        captured = capsys.readouterr()
        assert "manages precision" not in captured.out  # never printed
        return [line for line in captured.err.splitlines() if "manages precision" in line]

    return lines


def _check_banner(lines: list[str], expected: str, page: str) -> None:
    assert lines == [expected]  # one line although ampkit was set up twice
    assert f"```text\n{expected}\n```" in (PAGES / page).read_text()  # the line the page quotes


def test_the_banner_goes_to_stderr_once_without_logging_and_to_the_handler_with_it(banners, monkeypatch):
    expected = banner.banner("Accelerate", "Accelerator", "O2", torch.bfloat16)
    with unconfigured_logging():
        assert banner.announce("Accelerate", "Accelerator", "O2", torch.bfloat16)
        assert not banner.announce("Accelerate", "Accelerator", "O2", torch.bfloat16)
    assert banners() == [expected]
    monkeypatch.setattr(banner, "ANNOUNCED", set())
    with configured_logging(logging.INFO) as handler:
        assert banner.announce("Accelerate", "Accelerator", "O2", torch.bfloat16)
        assert not banner.announce("Accelerate", "Accelerator", "O2", torch.bfloat16)
    assert [(r.name, r.levelno, r.getMessage()) for r in handler.records] == [("ampkit", logging.INFO, expected)]
    assert banners() == []  # not also on stderr
    monkeypatch.setattr(banner, "ANNOUNCED", set())
    with configured_logging(logging.WARNING) as handler:  # the application's logging hides INFO
        assert banner.announce("Accelerate", "Accelerator", "O2", torch.bfloat16)
    assert handler.records == [] and banners() == []


def test_hf_page_demo(tmp_path, monkeypatch, banners):
    transformers = pytest.importorskip("transformers")
    from ampkit.integrations.hf import AmpkitTrainer

    monkeypatch.chdir(tmp_path)
    demo = _demo("hf.md")
    flag, run = demo["hf_bf16"], demo["with_ampkit"]
    assert type(flag) is transformers.Trainer and flag.args.bf16
    assert not _finite(flag.model)  # HF's bf16=True stepped on the NaN
    # the stock Trainer with bf16=True and the one enable() line: the flag taken over
    assert isinstance(run, AmpkitTrainer) and run.args.bf16 and not run.accelerator.native_amp
    assert _finite(run.model)
    stats = amp.stats(run.amp_optimizer)
    assert (stats.steps, stats.skipped) == (6, 1)
    assert run.lr_scheduler.last_epoch == 5  # HF's scheduler not stepped on the skip
    skipped = _weights(run.model, run.amp_optimizer)
    assert run.model.net[0].weight.dtype == torch.bfloat16  # O2: bf16 model, fp32 masters

    with unconfigured_logging():  # ampkit set up a second time: no second line
        clean = demo["train"](ampkit=True, steps=5, nan_at=None)  # without the flag
    assert amp.stats(clean.amp_optimizer).skipped == 0
    assert _same(skipped, _weights(clean.model, clean.amp_optimizer))
    _check_banner(
        banners(),
        "ampkit O2 (bf16) manages precision for this Trainer (Hugging Face); the framework's own mixed precision is off",
        "hf.md",
    )


def test_accelerate_page_demo(tmp_path, monkeypatch, banners):
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.chdir(tmp_path)
    try:
        demo = _demo("accelerate.md")
        assert not _finite(demo["bf16_model"])  # Accelerate's mixed_precision="bf16" stepped on the NaN
        model, optimizer = demo["model"], demo["optimizer"]
        assert _finite(model)
        stats = amp.stats(optimizer)
        assert (stats.steps, stats.skipped) == (6, 1)
        skipped = _weights(model, optimizer)

        with unconfigured_logging():  # ampkit set up a second time: no second line
            clean_model, clean_opt = demo["train"](ampkit=True, steps=5, nan_at=None)
        assert amp.stats(clean_opt).skipped == 0
        assert _same(skipped, _weights(clean_model, clean_opt))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    _check_banner(
        banners(),
        "ampkit O2 (bf16) manages precision for this Accelerator (Accelerate); the framework's own mixed precision is off",
        "accelerate.md",
    )


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore:.*LeafSpec.*")
def test_lightning_page_demo(tmp_path, monkeypatch, banners):
    pytest.importorskip("lightning")
    from ampkit.integrations.lightning import AmpkitPrecision

    monkeypatch.chdir(tmp_path)
    demo = _demo("lightning.md")
    assert not _finite(demo["bf16_model"])  # Lightning's bf16-mixed stepped on the NaN
    model, trainer = demo["model"], demo["trainer"]
    assert _finite(model)
    stats = amp.stats(trainer.optimizers[0])
    assert (stats.steps, stats.skipped) == (6, 1)
    skipped = _weights(model, trainer.optimizers[0])

    with unconfigured_logging():  # ampkit set up a second time: no second line
        clean, clean_trainer = demo["train"](plugins=[AmpkitPrecision("O2")], steps=5, nan_at=None)
    assert amp.stats(clean_trainer.optimizers[0]).skipped == 0
    assert _same(skipped, _weights(clean, clean_trainer.optimizers[0]))
    _check_banner(
        banners(),
        "ampkit O2 (bf16) manages precision for this Trainer (Lightning); the framework's own mixed precision is off",
        "lightning.md",
    )


def test_the_banner_names_level_and_dtype():
    assert banner.banner("Accelerate", "Accelerator", "O1", torch.float16).startswith(
        "ampkit O1 (fp16) manages precision for this Accelerator (Accelerate);"
    )
    assert "ampkit O0 (fp32)" in banner.banner("Lightning", "Trainer", "O0", torch.bfloat16)
