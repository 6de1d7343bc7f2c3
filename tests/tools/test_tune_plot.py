"""The tuning plan's picture (``TunePlan.figure``/``save_png``, ``ampkit tune --png``),
read from the figure's artists: the legend below the axes over no bar, each 16-bit
bar labelled by what the plan did (lowered or kept fp32), a deviation of 0 written
"0" at the floor the axis states instead of a bar down to 1e-12."""

from __future__ import annotations

import math

import pytest

from ampkit import TunePlan
from ampkit.levels.precision_plan import ModuleChoice

matplotlib = pytest.importorskip("matplotlib")
import matplotlib.pyplot as plt  # noqa: E402


def _plan() -> TunePlan:
    modules = (
        ModuleChoice("embed", "Embedding", "bf16", 1.0, 0.6, 0.0, 0.0, "lowered: no loss change"),
        ModuleChoice("blocks.0.attn", "Attention", "fp32", 3.0, 1.5, 0.2, 0.1, "kept: over the budget alone"),
        ModuleChoice("blocks.0.mlp", "Sequential", "bf16", 4.0, 1.8, 3e-4, 1e-3, "lowered"),
        ModuleChoice("head", "Linear", "fp8", 2.0, 0.9, 2e-3, 1e-3, "lowered to fp8"),
        ModuleChoice("norm", "LayerNorm", "fp32", 0.5, 0.4, math.inf, math.inf, "kept: non-finite alone"),
    )
    return TunePlan(dtype="bf16", level="O2", device_type="cpu", budget=0.01, modules=modules, skipped={},
                    predicted_deviation=2.3e-3, probe={"plan_ms": 5.0, "fp32_ms": 9.0}, backed_off=(),
                    seconds=12.0)  # fmt: skip


@pytest.fixture
def figure():
    fig = _plan().figure()
    yield fig
    plt.close(fig)


def test_the_legend_sits_below_the_axes_over_no_bar(figure):
    [legend] = figure.legends
    box = legend.get_window_extent()
    for ax in figure.axes:
        assert not box.overlaps(ax.get_window_extent()), "the legend covers an axes' data area"
        assert box.y1 <= ax.get_window_extent().y0  # below, not beside
        assert ax.get_legend() is None  # no legend inside an axes
    assert box.y0 >= 0 and box.x0 >= 0 and box.x1 <= figure.bbox.width  # on the picture


def test_each_16_bit_bar_says_what_the_plan_did(figure):
    left = figure.axes[0]
    texts = [t.get_text() for t in figure.legends[0].get_texts()]
    assert texts[:4] == ["fp32 time", "bf16 time: lowered to bf16", "fp8 time: lowered to fp8",
                         "bf16 time (measured): kept fp32"]  # fmt: skip
    assert "loss budget 1.0e-02" in texts
    bars = {c.get_label(): len(c) for c in left.containers}
    assert bars == {"fp32 time": 5, "bf16 time: lowered to bf16": 2, "fp8 time: lowered to fp8": 1,
                    "bf16 time (measured): kept fp32": 2}  # fmt: skip
    # the kept modules' bars are those of the "kept fp32" entry (rows: modules bottom up)
    kept = next(c for c in left.containers if "kept" in c.get_label())
    names = [t.get_text() for t in left.get_yticklabels()]
    rows = sorted(round(p.get_y() + p.get_height() / 2 + 0.2) for p in kept.patches)
    assert [names[i] for i in rows] == ["norm (LayerNorm)", "blocks.0.attn (Attention)"]


def test_a_zero_deviation_is_written_0_at_the_floor_the_axis_states(figure):
    right = figure.axes[1]
    floor, top = right.get_xlim()
    assert floor == pytest.approx(1e-5)  # a decade below the smallest positive deviation's decade
    assert f"from {floor:.0e}" in right.get_xlabel() and '"0": none' in right.get_xlabel()
    # no bar reaches below the floor (none drawn down to 1e-12)
    assert all(p.get_x() >= floor * (1 - 1e-9) for p in right.patches)
    names = [t.get_text() for t in figure.axes[0].get_yticklabels()]  # the axes share their rows
    marks = {names[round(t.get_position()[1])]: t.get_text() for t in right.texts}
    assert marks == {"embed (Embedding)": "0", "norm (LayerNorm)": "inf"}
    widths = sorted(p.get_width() + p.get_x() for p in right.patches)
    assert widths[:3] == pytest.approx([3e-4, 2e-3, 0.2])  # the positive deviations end at their values


def test_save_png_writes_the_figure(tmp_path):
    out = _plan().save_png(tmp_path / "plan.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plan_by_hand_draws_without_a_budget_or_a_deviation():
    """``TunePlan.by_hand``: budget 0, no deviation measured: the axis keeps a floor."""
    fig = TunePlan.by_hand(["0"], ["1"]).figure()
    try:
        low, high = fig.axes[1].get_xlim()
        assert 0 < low < high and "budget" not in " ".join(t.get_text() for t in fig.legends[0].get_texts())
        assert [t.get_text() for t in fig.axes[1].texts] == ["not measured"] * 2
    finally:
        plt.close(fig)
