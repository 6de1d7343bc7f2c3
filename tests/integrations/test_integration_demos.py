"""The NaN demo that opens each integration page (docs/integrations/*.md), run exactly as
the page shows it (its first Python block), then checked: one NaN gradient injected by a
hook leaves the framework's own bf16 flag with non-finite weights, while ampkit's run
keeps every weight finite, counts one skipped step and ends bitwise where the same run
without the bad step ends (its ``train`` called again with one step fewer and no NaN).

Also the banner: each integration logs one INFO line on the ``"ampkit"`` logger when
ampkit takes over the framework's precision, once per process and framework (the demo
sets ampkit up twice), never on stdout."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from locations import ROOT

import ampkit as amp
from ampkit.integrations import banner

PAGES = ROOT / "docs" / "integrations"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _demo(page: str) -> dict:
    """Run the first Python block of ``docs/integrations/<page>`` (the NaN demo) as a
    reader would, in the current folder; its names."""
    code = BLOCK.search((PAGES / page).read_text())
    assert code is not None, page
    names: dict = {"__name__": "__main__"}
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
def banners(monkeypatch, caplog):
    """A process that has announced nothing yet; the banners logged from here on."""
    monkeypatch.setattr(banner, "ANNOUNCED", set())
    caplog.set_level(logging.INFO, logger="ampkit")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "ampkit" and "manages precision" in r.getMessage()]

    return lines


def _check_banner(lines: list[str], expected: str, capsys) -> None:
    assert lines == [expected]  # one line although ampkit was set up twice
    assert "manages precision" not in capsys.readouterr().out  # logged, never printed


def test_hf_page_demo(tmp_path, monkeypatch, banners, capsys):
    transformers = pytest.importorskip("transformers")
    from ampkit.integrations.hf import AmpkitTrainer

    monkeypatch.chdir(tmp_path)
    demo = _demo("hf.md")
    flag, run = demo["hf_bf16"], demo["with_ampkit"]
    assert type(flag) is transformers.Trainer and flag.args.bf16
    assert not _finite(flag.model)  # HF's bf16=True stepped on the NaN
    # the stock Trainer with the one enable() line
    assert isinstance(run, AmpkitTrainer) and not run.args.bf16
    assert _finite(run.model)
    stats = amp.stats(run.amp_optimizer)
    assert (stats.steps, stats.skipped) == (6, 1)
    assert run.lr_scheduler.last_epoch == 5  # HF's scheduler not stepped on the skip
    skipped = _weights(run.model, run.amp_optimizer)
    assert run.model.net[0].weight.dtype == torch.bfloat16  # O2: bf16 model, fp32 masters

    clean = demo["train"](ampkit=True, steps=5, nan_at=None)
    assert amp.stats(clean.amp_optimizer).skipped == 0
    assert _same(skipped, _weights(clean.model, clean.amp_optimizer))
    _check_banner(
        banners(),
        "ampkit O2 (bf16) manages precision for this Trainer (Hugging Face); the framework's own mixed precision is off",
        capsys,
    )


def test_accelerate_page_demo(tmp_path, monkeypatch, banners, capsys):
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

        clean_model, clean_opt = demo["train"](ampkit=True, steps=5, nan_at=None)
        assert amp.stats(clean_opt).skipped == 0
        assert _same(skipped, _weights(clean_model, clean_opt))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    _check_banner(
        banners(),
        "ampkit O2 (bf16) manages precision for this Accelerator (Accelerate); the framework's own mixed precision is off",
        capsys,
    )


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore:.*LeafSpec.*")
def test_lightning_page_demo(tmp_path, monkeypatch, banners, capsys):
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

    clean, clean_trainer = demo["train"](plugins=[AmpkitPrecision("O2")], steps=5, nan_at=None)
    assert amp.stats(clean_trainer.optimizers[0]).skipped == 0
    assert _same(skipped, _weights(clean, clean_trainer.optimizers[0]))
    _check_banner(
        banners(),
        "ampkit O2 (bf16) manages precision for this Trainer (Lightning); the framework's own mixed precision is off",
        capsys,
    )


def test_the_banner_names_level_and_dtype():
    assert banner.banner("Accelerate", "Accelerator", "O1", torch.float16).startswith(
        "ampkit O1 (fp16) manages precision for this Accelerator (Accelerate);"
    )
    assert "ampkit O0 (fp32)" in banner.banner("Lightning", "Trainer", "O0", torch.bfloat16)
