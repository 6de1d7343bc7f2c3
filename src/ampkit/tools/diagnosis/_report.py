"""The doctor's report: plain text, a rich table, a dict/JSON, and a PNG."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampkit._internal.files import check_target, write_file, write_text

from . import _advice
from ._advice import Advice
from ._findings import Finding, Misuse, ModuleMargin, StepPoint

if TYPE_CHECKING:
    from ._core import Doctor


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    return f"{x:.3g}"


def _bits(x: float) -> str:
    return "-" if math.isinf(x) else f"{x:.1f}"


#: The width of the plain-text report (:meth:`DoctorReport.table`): 160 columns, a
#: terminal filling a 1280-pixel-wide window.
TEXT_WIDTH = 160

#: What the margins table's columns are (printed under it).
MARGIN_LEGEND = (
    "act max, grad max: abs-max of the module's outputs and of the gradients at them; act room, grad room: "
    "headroom below the dtype's largest value, in bits (binary orders of magnitude); subnormal, zero: "
    "fractions of its parameters' gradient elements below the dtype's smallest normal, and exactly zero; "
    "overflows: skipped steps whose first inf/NaN it produced; risk = max(act max / limit, grad max / limit, "
    "subnormal), 1 or more once it overflowed."
)


def _columns_env() -> int:
    """``$COLUMNS`` when it is a number of at least 40, else ``TEXT_WIDTH``."""
    value = os.environ.get("COLUMNS", "").strip()
    return int(value) if value.isdigit() and int(value) >= 40 else TEXT_WIDTH


def _wrap(line: str, width: int, indent: str | None = None) -> list[str]:
    """``line`` wrapped at ``width`` columns; continuation lines keep its indent plus
    two spaces (or take ``indent``). Words longer than a line are split."""
    if len(line) <= width:
        return [line]
    lead = line[: len(line) - len(line.lstrip())]
    more = lead + "  " if indent is None else indent
    return textwrap.wrap(line.lstrip(), width, initial_indent=lead, subsequent_indent=more,
                         break_on_hyphens=False) or [line]  # fmt: skip


def _code_lines(code: str, width: int, prefix: str) -> list[str]:
    """``code``'s lines after ``prefix``; past ``width``, a trailing comment moves to a
    line of its own and a comment line wraps onto more comment lines (code stays
    whole: it must paste as it is)."""
    out = []
    lines = []
    for line in code.splitlines():  # a long line's trailing comment goes on a line of its own
        code_part, sep, comment = line.partition("  # ")
        too_long = len(prefix) + len(line) > width
        lines += [code_part.rstrip(), "# " + comment.strip()] if sep and too_long and code_part.strip() else [line]
    for line in lines:
        body = line.lstrip()
        if len(prefix) + len(line) > width and body.startswith("#"):
            lead = prefix + line[: len(line) - len(body)]
            out += textwrap.wrap(body, width, initial_indent=lead, subsequent_indent=lead + "#   ",
                                 break_on_hyphens=False)  # fmt: skip
        else:
            out.append(prefix + line)
    return out


def _fit_table(header: Sequence[str], rows: list[tuple[str, ...]], width: int, indent: str = "",
               split: int = 7) -> list[str]:  # fmt: skip
    """A fixed-width table (header, rule, rows) no wider than ``width`` when it can be:
    the first two columns (names) fold onto more lines, the wider one first, at dots
    where they can; where that would leave either under 16 columns, the columns from
    ``split`` on go into a second table below, after the first column again."""
    if len(header) > split and _name_room(header, rows, width, 2) < 16:
        second = [(r[0], *r[split:]) for r in rows]
        return [
            *_columns(header[:split], [r[:split] for r in rows], width, indent, 2), "",
            *_columns((header[0], *header[split:]), second, width, indent, 1),
        ]
    return _columns(header, rows, width, indent, 2)


def _name_room(header: Sequence[str], rows: list[tuple[str, ...]], width: int, names: int) -> int:
    """The columns left to the narrower of the ``names`` name columns once the table
    fits ``width`` (folding the wider one first)."""
    widths = [max(len(r[i]) for r in [tuple(header), *rows]) for i in range(len(header))]
    over = sum(widths) + 2 * (len(header) - 1) - width
    while over > 0 and max(widths[:names]) > 1:
        widths[max(range(names), key=lambda i: widths[i])] -= 1
        over -= 1
    return min(widths[:names])


def _columns(header: Sequence[str], rows: list[tuple[str, ...]], width: int, indent: str, names: int) -> list[str]:
    cols = len(header)
    widths = [max(len(r[i]) for r in [tuple(header), *rows]) for i in range(cols)]
    over = sum(widths) + 2 * (cols - 1) - width
    while over > 0 and max(widths[:names]) > 10:  # the wider name column gives a character
        widths[max(range(names), key=lambda i: widths[i])] -= 1
        over -= 1
    out = []
    for n, row in enumerate([tuple(header), *rows]):
        cells = [_fold(c, widths[i]) if i < names else [c] for i, c in enumerate(row)]
        for k in range(max(len(c) for c in cells)):
            parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths)]
            out.append(indent + "  ".join(parts).rstrip())
        if n == 0:
            out.append(indent + "  ".join("-" * w for w in widths))
    return out


def _fold(name: str, width: int) -> list[str]:
    """``name`` cut into pieces of at most ``width`` characters, after a dot where one
    falls in the last two thirds of a piece."""
    pieces = []
    while len(name) > width:
        dot = name.rfind(".", width // 3, width)
        cut = dot + 1 if dot >= 0 else width
        pieces.append(name[:cut])
        name = name[cut:]
    return [*pieces, name]


@dataclasses.dataclass
class DoctorReport:
    """What the doctor saw and what it advises.

    Attributes:
        steps: optimizer steps seen (first optimizer); ``skipped``: of them skipped.
        dtype: the 16-bit compute dtype seen (``"fp16"``/``"bf16"``, None if none).
        scale: the loss scale after the last step seen.
        findings: op-level findings (:class:`Finding`), in order.
        events: the module-level finding of each skipped step / non-finite loss (the
            first 100; ``events_total`` counts them all).
        margins: per module, sorted by risk (highest first).
        advice: :class:`Advice`, most specific first.
        misuse: training-loop mistakes seen (:class:`Misuse`).
        history: one :class:`StepPoint` per optimizer step.
        checks_run: op-level checks run.
        fp8: the fp8 linears of the session (``amp.initialize(..., fp8=...)``) with
            their last scales, abs-maxes and saturated casts
            (:class:`ampkit.fp8.Fp8LayerInfo`); empty without fp8.
    """

    steps: int
    skipped: int
    dtype: str | None
    scale: float | None
    findings: list[Finding]
    events: list[Finding]
    events_total: int
    margins: list[ModuleMargin]
    advice: list[Advice]
    misuse: list[Misuse]
    history: list[StepPoint]
    checks_run: int
    fp8: list[Any] = dataclasses.field(default_factory=list)

    @staticmethod
    def build(doc: Doctor) -> DoctorReport:
        points = [p for p in doc.history if p.optimizer == 0]
        containers = ("Sequential", "ModuleList", "ModuleDict")  # their outputs are a child's
        margins = sorted(
            (m for m in doc.margins.values() if m.module_type not in containers), key=lambda m: (-m.risk, m.module)
        )
        from ampkit._internal.dtypes import dtype_name
        from ampkit.levels.fp8 import layers as fp8_layers

        return DoctorReport(
            steps=len(points),
            skipped=sum(p.skipped for p in points),
            dtype=dtype_name(doc.compute_dtype) if doc.compute_dtype is not None else None,
            scale=(doc._states[0].scalers[0].scale if doc._states else None),
            findings=list(doc.findings),
            events=list(doc.events),
            events_total=doc.events_total,
            margins=margins,
            advice=_advice.build(doc),
            misuse=list(doc.misuse),
            history=list(doc.history),
            checks_run=doc.checks_run,
            fp8=fp8_layers(),
        )

    @property
    def first(self) -> Finding | None:
        """The first op-level finding of an inf/NaN (else of an underflow, else the first
        module-level event), or None."""
        for f in self.findings:
            if f.kind != "underflow":
                return f
        if self.findings:
            return self.findings[0]
        return self.events[0] if self.events else None

    def advice_of(self, kind: str) -> list[Advice]:
        """The advice entries of one kind."""
        return [a for a in self.advice if a.kind == kind]

    # --- plain data -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready: inf/NaN as strings, dtypes as names)."""
        return {
            "steps": self.steps,
            "skipped": self.skipped,
            "dtype": self.dtype,
            "scale": self.scale,
            "checks_run": self.checks_run,
            "fp8": [layer.to_dict() for layer in self.fp8],
            "findings": [f.to_dict() for f in self.findings],
            "events": [f.to_dict() for f in self.events],
            "events_total": self.events_total,
            "margins": [m.to_dict() for m in self.margins],
            "advice": [a.to_dict() for a in self.advice],
            "misuse": [m.to_dict() for m in self.misuse],
            "history": [
                {"optimizer": p.optimizer, "step": p.step, "scale": p.scale, "skipped": p.skipped,
                 "loss": _plain(p.loss), "grad_norm": _plain(p.grad_norm)}
                for p in self.history
            ],
        }

    def to_json(self, path: str | Path | None = None, **kwargs: Any) -> str:
        """The report as JSON; also written to ``path`` when given
        (:class:`~ampkit.OutputPathError` when it cannot be). ``kwargs`` go to
        :func:`json.dumps` (``indent`` defaults to 2)."""
        what = "the doctor's JSON report"
        target = None if path is None else check_target(path, what)
        text = json.dumps(self.to_dict(), indent=kwargs.pop("indent", 2), **kwargs)
        if target is not None:
            write_text(target, text + "\n", what)
        return text

    # --- text -------------------------------------------------------------------------------
    #: The margins table's columns: short, so that the table fits a 160-column terminal
    #: (a 1280-pixel window); :data:`MARGIN_LEGEND` says what each one is.
    _MARGIN_COLUMNS = ("module", "type", "dtype", "act max", "act room", "grad max", "grad room",
                       "subnormal", "zero", "overflows", "risk")

    def _margin_rows(self, limit: int = 12) -> list[tuple[str, ...]]:
        rows = []
        for m in self.margins[:limit]:
            rows.append((
                m.module or "<root>", m.module_type, m.dtype, _fmt(m.act_abs_max),
                _bits(m.headroom(m.act_abs_max, m.act_limit)), _fmt(m.grad_abs_max),
                _bits(m.headroom(m.grad_abs_max, m.grad_limit)), f"{m.underflow:.1%}", f"{m.zeros:.1%}",
                str(m.overflows), f"{m.risk:.3g}",
            ))
        return rows

    def _headline(self) -> str:
        line = f"ampkit doctor: {self.steps} steps, {self.skipped} skipped"
        if self.dtype:
            line += f", compute dtype {self.dtype}"
        if self.scale is not None:
            line += f", loss scale now {self.scale:g}"
        return line + f", {self.checks_run} op-level check(s)"

    def _finding_lines(self, f: Finding) -> list[str]:
        lines = [f.summary()]
        for label, stats in (("inputs", f.inputs), ("outputs", f.outputs)):
            for s in stats[:4]:
                lines.append(
                    f"    {label[:-1]} {s.dtype}{list(s.shape)}: abs-max {_fmt(s.abs_max)}, "
                    f"abs-min {_fmt(s.abs_min)}, {s.nonfinite} inf/NaN"
                )
        if f.consumer:
            lines.append(f"    next op reading it: {f.consumer}" + (f" in {f.consumer_module}" if f.consumer_module else ""))
        if f.params:
            lines.append(f"    parameter grad(s) first non-finite: {', '.join(f.params)}")
        if f.recurred is not None:
            lines.append(f"    recurred in the op-level check: {'yes' if f.recurred else 'no'}")
        return lines

    def _why_no_advice(self) -> str:
        """Why the advice list is empty, in words that agree with the findings."""
        if not (self.findings or self.events or self.misuse):
            return "(nothing overflowed, underflowed or looked misused)"
        if self.events and not self.findings and not self.misuse and all(f.recurred is False for f in self.events):
            return (
                f"needed ({len(self.events)} skipped step(s) did not recur in the op-level check of a "
                "later step: the dynamic loss scale backed off, as it is meant to)"
            )
        return "(no change ampkit knows of addresses the findings above; look at the op they name)"

    def table(self, width: int = TEXT_WIDTH) -> str:
        """The whole report as fixed-width text, no line wider than ``width`` columns
        (default ``TEXT_WIDTH``, 160: a 1280-pixel window): prose wraps onto indented
        lines, the margins table folds its module and type names, and a long comment in
        the advice code goes on as comment lines; a longer statement of advice code stays
        whole, so that it pastes as it is."""
        out = [*_wrap(self._headline(), width), ""]
        if self.findings or self.events:
            out.append("Findings:")
            for f in self.findings:
                for line in self._finding_lines(f):
                    out.extend(_wrap("  " + line, width))
            if self.events:
                shown = self.events[:3]
                more = self.events_total - len(shown)
                for f in shown:
                    out.extend(_wrap("  [module level] " + f.summary(), width))
                if more > 0:
                    out.append(f"  ... {more} more skipped step(s)")
            out.append("")
        if self.margins:
            out.extend(_wrap("Margins, per module, by risk (highest first):", width))
            out.extend(_fit_table(self._MARGIN_COLUMNS, self._margin_rows(), width - 2, indent="  "))
            out.extend(_wrap(MARGIN_LEGEND, width, indent="  "))
            out.append("")
        if self.fp8:
            out.extend(_wrap("fp8 matmuls (last scale per operand; saturated = casts clamped to fp8's range):", width))
            for layer in self.fp8:
                sc, am = layer.scales, layer.amax
                out.extend(_wrap(
                    f"  {layer.name} {layer.shape[0]}x{layer.shape[1]} [{layer.recipe}], {layer.calls} calls: "
                    + ", ".join(f"{r} scale {_fmt(sc[r])} (amax {_fmt(am[r])}, {layer.saturated[r]} saturated)" for r in sc),
                    width,
                ))
            out.append("")
        if self.misuse:
            out.append("Training-loop problems:")
            for m in self.misuse:
                out.extend(_wrap(f"  [{m.kind}] {m.message}", width))
            out.append("")
        if self.advice:
            out.append("Advice:")
            for i, a in enumerate(self.advice, 1):
                out.extend(_wrap(f"  {i}. {a.title}", width, indent="     "))
                out.extend(_wrap(f"     evidence: {a.evidence}", width))
                out.extend(_code_lines(a.code, width, "     | "))
        else:
            out.extend(_wrap(f"Advice: none {self._why_no_advice()}.", width))
        return "\n".join(out).rstrip()

    def __str__(self) -> str:
        return self.table()

    def __rich__(self) -> Any:  # pragma: no cover - rendering only
        from rich.console import Group
        from rich.markup import escape
        from rich.panel import Panel
        from rich.syntax import Syntax
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = [Text(self._headline(), style="bold")]
        if self.findings or self.events:
            lines = [line for f in self.findings for line in self._finding_lines(f)]
            lines += ["[module level] " + f.summary() for f in self.events[:3]]
            if self.events_total > 3:
                lines.append(f"... {self.events_total - 3} more skipped step(s)")
            parts.append(Panel(Text("\n".join(lines)), title="findings", border_style="red"))
        if self.margins:
            table = Table(title="margins, per module, by risk (highest first)", caption=MARGIN_LEGEND,
                          caption_justify="left")  # fmt: skip
            rows = self._margin_rows()
            for i, col in enumerate(self._MARGIN_COLUMNS):  # too narrow a terminal folds names, never cuts
                name = col in ("module", "type")
                table.add_column(col, justify="left" if name or col == "dtype" else "right", overflow="fold",
                                 min_width=None if name else max(len(r[i]) for r in rows))  # fmt: skip
            for row in rows:
                table.add_row(*row)
            parts.append(table)
        for m in self.misuse:
            parts.append(Panel(Text(m.message), title=escape(m.kind), border_style="yellow"))
        for i, a in enumerate(self.advice, 1):
            parts.append(Panel(
                Group(Text(a.evidence, style="dim"), Syntax(a.code, "python", theme="ansi_dark", word_wrap=True)),
                title=escape(f"{i}. {a.title}"), border_style="green",
            ))
        return Group(*parts)

    def print(self, file: Any = None) -> None:
        """Print to ``file`` (default stdout): with rich on a terminal when it is
        installed (``ampkit[cli]``), fitted to the terminal's width; else as plain text
        (:meth:`table`, at most ``$COLUMNS`` columns when that is set to 40 or more, else
        ``TEXT_WIDTH``)."""
        import sys

        stream = file or sys.stdout
        try:
            from rich.console import Console
        except ImportError:
            Console = None  # noqa: N806
        if Console is None or not getattr(stream, "isatty", lambda: False)():
            print(self.table(_columns_env()), file=stream)  # logs and pipes get plain text
            return
        Console(file=stream).print(self)

    # --- picture ------------------------------------------------------------------------
    def save_png(self, path: str | Path) -> Path:
        """Write a PNG: loss scale and skipped steps over time, and each module's
        activation and gradient abs-max against its dtype's limit. Needs matplotlib
        (``pip install -e '.[cli]'``). Raises :class:`~ampkit.OutputPathError`
        before drawing when ``path`` cannot be written (a folder, a symlink, a FIFO or a
        device, a missing or read-only folder)."""
        what = "the doctor's plot"
        path = check_target(path, what)
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        points = [p for p in self.history if p.optimizer == 0]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
        if points:
            steps = [p.step for p in points]
            ax1.step(steps, [p.scale for p in points], where="post", label="loss scale")
            skipped = [p for p in points if p.skipped]
            if skipped:
                ax1.scatter([p.step for p in skipped], [p.scale for p in skipped], color="red", marker="x",
                            zorder=3, label=f"skipped ({len(skipped)})")
            ax1.set_yscale("log", base=2)
            ax1.legend(loc="best")
        ax1.set_xlabel("step")
        ax1.set_ylabel("loss scale")
        ax1.set_title("loss scale and skipped steps")
        margins = [m for m in self.margins if m.act_abs_max > 0 or m.grad_abs_max > 0][:16]
        if margins:
            names = [m.module or "<root>" for m in margins][::-1]
            y = range(len(names))
            act = [max(m.act_abs_max / m.act_limit, 1e-12) for m in margins][::-1]
            grad = [max(m.grad_abs_max / m.grad_limit, 1e-12) for m in margins][::-1]
            ax2.barh([i + 0.2 for i in y], act, height=0.4, label="activation abs-max / dtype max")
            ax2.barh([i - 0.2 for i in y], grad, height=0.4, label="grad abs-max / dtype max")
            ax2.axvline(1.0, color="red", linestyle="--", label="dtype max")
            hit = [i for i, m in enumerate(margins[::-1]) if m.overflows]
            if hit:
                ax2.scatter([1.0] * len(hit), hit, color="red", marker="X", s=60, zorder=3,
                            label="first to produce inf/NaN")
            ax2.set_xscale("log")
            ax2.set_yticks(list(y))
            ax2.set_yticklabels(names, fontsize=8)
            for i in hit:
                ax2.get_yticklabels()[i].set_color("red")
            ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, fontsize=8)
        ax2.set_title("per-module peak vs dtype limit (top by risk)")
        fig.tight_layout()
        try:
            write_file(path, lambda f: fig.savefig(f, dpi=110, format="png"), what)
        finally:
            plt.close(fig)
        return path


def _plain(x: float | None) -> Any:
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
