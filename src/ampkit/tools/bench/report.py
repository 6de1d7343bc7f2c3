"""Output of ``ampkit bench``: the rich table, results.json and the PNG plot.

rich and matplotlib (the ``cli`` extra) are imported inside the functions, so
``import ampkit.tools.bench`` needs only torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ampkit._internal.files import check_target, write_file, write_text
from ampkit._internal.tree import map_leaves

__all__ = ["render_tables", "write_json", "write_plot", "fmt_precision_row", "allocator_note"]

DASH = "—"


def _num(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return DASH
    return format(x, spec)


def _scale(x: float | None) -> str:
    if x is None:
        return DASH
    if x >= 1 and float(x).is_integer():
        exp = math.log2(x)
        return f"2^{int(exp)}" if exp.is_integer() and x >= 1024 else f"{int(x)}"
    return f"{x:.3g}"


def fmt_precision_row(name: str, entry: dict[str, Any], lm: bool) -> list[str]:
    """Cells of one table row (also used for plain-text output)."""
    if entry.get("status") != "ok":
        cells = [name] + [DASH] * (13 if lm else 12)
        cells[-1] = f"{entry.get('status')}: {entry.get('note', '')}"
        return cells
    acc = entry.get("accuracy")
    cells = [
        name,
        _num(entry.get("step_ms"), ".1f"),
        _num(entry.get("step_ms_min"), ".1f"),
        _num(entry.get("speedup"), ".2f") + ("×" if entry.get("speedup") is not None else ""),
        _num(entry.get("time_vs_bf16"), ".2f") + ("×" if entry.get("time_vs_bf16") is not None else ""),
        _num(entry.get("peak_mib"), ".1f"),
        _num(entry.get("memory_vs_fp32"), ".2f") + ("×" if entry.get("memory_vs_fp32") is not None else ""),
        _num(entry.get("final_train_loss"), ".4f"),
        _num(entry.get("eval_loss"), ".4f"),
    ]
    if lm:
        cells.append(_num(entry.get("bits_per_char"), ".3f"))
    cells += [
        _num(None if acc is None else 100 * acc, ".2f") + ("%" if acc is not None else ""),
        str(entry.get("skipped_steps", 0)),
        _scale(entry.get("final_loss_scale")),
    ]
    notes = []
    if entry.get("nonfinite_losses"):
        notes.append(f"{entry['nonfinite_losses']} non-finite losses")
    cells.append("; ".join(notes))
    return cells


def render_tables(results: dict[str, Any], console: Any = None) -> None:
    """Print one rich table per workload, then what the columns mean."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze to 80 columns
            console = Console(width=150)
    for name, wl in results["workloads"].items():
        lm = wl.get("metric") == "bits_per_char"
        table = Table(
            title=f"[bold]{name}[/]: {wl.get('description', '')}",
            caption=(
                f"{results['device']} ({results['device_name']}), {results['dtype']}, "
                f"{results['threads']} thread(s), {wl['steps']} steps per precision, "
                f"interleaved in blocks of {wl['block_steps']}"
            ),
            caption_justify="left",
        )
        table.add_column("precision", style="bold", no_wrap=True)
        table.add_column("ms/step", justify="right")
        table.add_column("min ms", justify="right")
        table.add_column("speedup", justify="right")
        table.add_column("time vs bf16", justify="right")
        table.add_column("peak MiB", justify="right")
        table.add_column("mem vs fp32", justify="right")
        table.add_column("train loss", justify="right")
        table.add_column("eval loss", justify="right")
        if lm:
            table.add_column("bits/char", justify="right")
        table.add_column("next-char acc" if lm else "test acc", justify="right")
        table.add_column("skipped", justify="right")
        table.add_column("loss scale", justify="right")
        table.add_column("note", overflow="fold")
        for pname, entry in wl["precisions"].items():
            table.add_row(*fmt_precision_row(pname, entry, lm))
        console.print(table)
    console.print(
        "ms/step: median over interleaved blocks (first block = warm-up, left out); min ms: "
        "fastest block (less sensitive to other load on the machine); speedup (of the median) "
        "and mem vs fp32: ratios to fp32 in this run; time vs bf16: median step time over "
        "the pure-bf16 run's (the speed limit of a 16-bit step); train loss: mean of the last 10% of "
        "steps; eval loss/acc: held-out data after training; skipped: steps skipped for "
        f"inf/NaN gradients. {results['memory_method']}. {allocator_note(results)}",
        style="dim",
        highlight=False,
    )


def allocator_note(results: dict[str, Any]) -> str:
    """The sentence under the tables on the training processes' C allocator."""
    info = results.get("allocator") or {}
    name, freed = info.get("allocator", "unknown allocator"), info.get("freed_memory", "unknown")
    if freed == "held":
        return (
            f"Allocator: {name}, freed memory kept in each process (no step pays page faults "
            "for memory an earlier step gave back; --system-malloc for glibc's defaults)."
        )
    if freed == "returned to the OS":
        return (
            f"Allocator: {name} at its defaults (--system-malloc): step times include page "
            "faults for memory given back to the OS, which vary from process to process."
        )
    return f"Allocator: {name} ({freed})."


def write_json(results: dict[str, Any], path: Path) -> None:
    """Write ``results`` as JSON (non-finite floats become null); replaced whole, regular
    files only (:class:`ampkit.OutputPathError` for a symlink, FIFO or device there)."""

    def clean(x: Any) -> Any:
        return (x if math.isfinite(x) else None) if isinstance(x, float) else x

    text = json.dumps(map_leaves(results, clean, mapping=dict), indent=1, allow_nan=False) + "\n"
    write_text(path, text, "the benchmark results")


def _smooth(values: list[float | None], window: int) -> list[float]:
    """Centered moving average over ``window`` steps (shorter at the ends; missing
    values left out), so the curve does not lag behind the raw losses."""
    half = window // 2
    out: list[float] = []
    for i in range(len(values)):
        near = [v for v in values[max(0, i - half) : i + half + 1] if v is not None]
        out.append(sum(near) / len(near) if near else float("nan"))
    return out


def _scale_varies(wl: dict[str, Any]) -> bool:
    """Whether any precision's loss scale changed over training (fp16's dynamic
    scale does; under bf16 every scale stays at 1 and a plot of it says nothing)."""
    for entry in wl["precisions"].values():
        known = {s for s in entry.get("loss_scales") or [] if s is not None}
        if entry.get("status") == "ok" and len(known) > 1:
            return True
    return False


def _plot_loss(ax: Any, name: str, wl: dict[str, Any], results: dict[str, Any], style_of: Any) -> None:
    for pname, entry in wl["precisions"].items():
        if entry.get("status") != "ok":
            continue
        color, style = style_of(pname)
        losses = entry["losses"]
        steps = list(range(1, len(losses) + 1))
        raw = [float("nan") if v is None else v for v in losses]
        ax.plot(steps, raw, color=color, alpha=0.15, linewidth=0.8)
        ax.plot(steps, _smooth(losses, max(1, len(losses) // 20)), color=color,
                linestyle=style, label=pname, linewidth=1.5)  # fmt: skip
    ax.set_title(f"{name}: training loss ({results['dtype']}, {results['device']})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_scale(ax: Any, name: str, wl: dict[str, Any], style_of: Any) -> None:
    for pname, entry in wl["precisions"].items():
        if entry.get("status") != "ok" or not any(s is not None for s in entry["loss_scales"]):
            continue
        color, style = style_of(pname)
        scales = [float("nan") if s is None else s for s in entry["loss_scales"]]
        ax.step(range(1, len(scales) + 1), scales, where="post", color=color, linestyle=style, label=pname)
    ax.set_title(f"{name}: loss scale")
    ax.set_xlabel("step")
    ax.set_yscale("log", base=2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _plot_cost(ax: Any, name: str, wl: dict[str, Any], style_of: Any) -> None:
    """Median step time (bars, left axis) and peak memory (dots, right axis) per
    precision: what the precisions differ in when no loss scale moves."""
    ok = [(p, e) for p, e in wl["precisions"].items() if e.get("status") == "ok"]
    xs = list(range(len(ok)))
    times = [e.get("step_ms") or float("nan") for _, e in ok]
    peaks = [e.get("peak_mib") or float("nan") for _, e in ok]
    ax.bar(xs, times, color=[style_of(p)[0] for p, _ in ok], alpha=0.8)
    ax.set_xticks(xs, [p for p, _ in ok], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (median)")
    mem = ax.twinx()
    mem.plot(xs, peaks, "ko", label="peak MiB")
    mem.set_ylabel("peak MiB")
    mem.set_ylim(bottom=0)
    mem.legend(fontsize=8, loc="upper right")
    ax.set_title(f"{name}: step time and peak memory")
    ax.grid(alpha=0.3, axis="y")


def write_plot(results: dict[str, Any], path: Path) -> None:
    """One row per workload: training loss per precision (raw, faint, and a
    centered moving average) and, beside it, the loss scale over steps where it
    moved (fp16), else each precision's median step time and peak memory. Written
    like :func:`write_json` (checked before drawing)."""
    what = "the benchmark plot"
    check_target(path, what)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = results["workloads"]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 4.2 * len(workloads)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", "-.", ":", (0, (5, 1))]
    order = list(dict.fromkeys(p for wl in workloads.values() for p in wl["precisions"]))

    def style_of(pname: str) -> tuple[Any, Any]:
        i = order.index(pname)
        return colors[i % len(colors)], styles[i % len(styles)]

    for row, (name, wl) in enumerate(workloads.items()):
        _plot_loss(axes[row][0], name, wl, results, style_of)
        if _scale_varies(wl):
            _plot_scale(axes[row][1], name, wl, style_of)
        else:
            _plot_cost(axes[row][1], name, wl, style_of)
    fig.tight_layout()
    try:
        write_file(path, lambda f: fig.savefig(f, dpi=110, format="png"), what)
    finally:
        plt.close(fig)
