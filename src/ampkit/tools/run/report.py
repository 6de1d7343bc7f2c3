"""The run's report (a JSON-ready dict, :func:`run_report`) and its exit summary
(:func:`format_summary`, a few plain lines for stderr)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampkit._internal.files import write_text

from .config import FP32, casts_model

if TYPE_CHECKING:
    from .forward_scope import _ForwardScope
    from .optimizers import _OptRecord
    from .runner import _Runner

__all__ = ["format_summary", "is_rank_zero", "run_report", "write_report"]


def run_report(runner: _Runner, code: int, script: str, args: list[str], wall: float) -> dict[str, Any]:
    """The report of a finished run: the script's exit code, the level applied, the
    iterations and their times, the optimizers with steps/skipped/scale, the module-call
    counts, the loss series by ``backward()`` call site and the notes."""
    config, fwd, opts = runner.config, runner.forward, runner.optimizers
    notes = [*runner.notes, *_repeated_step_notes(opts.records)]
    if fwd is not None and fwd.kept_fp32:
        notes.append(
            f"{fwd.kept_fp32} module call(s) ran inside the script's own "
            f"torch.autocast(enabled=False) (the first at {fwd.kept_fp32_site}): kept in "
            "fp32 as written (if that is the script's own AMP switch, switch it on instead)"
        )
    times = runner.iter_times
    level_applied = opts.level_applied
    if casts_model(level_applied) and not any(r.level == level_applied for r in opts.records):
        level_applied = "O1"  # no optimizer: casting in forward passes only
    return {
        "script": script,
        "args": args,
        "exit_code": code,
        "level": config.level,
        "level_applied": level_applied,
        "dtype": config.dtype if config.level != FP32 else "fp32",
        "wall_seconds": wall,
        "stopped_early": runner.stopped_early,
        "iterations": runner.iterations,
        "iteration_ms_median": statistics.median(times) * 1e3 if times else None,
        "iteration_seconds_total": sum(times),
        "optimizer_step_seconds": runner.step_seconds,
        "backward_calls": runner.backwards,
        "scaled_backward_calls": runner.scaled_backwards,
        **_forward_counts(fwd),
        "script_grad_scaler": bool(runner.script_scales),
        "scheduler_steps_held": runner.schedulers.held if runner.schedulers is not None else 0,
        "optimizers": [
            {
                "index": r.index, "type": r.kind, "created_at": r.site, "managed": r.level,
                "steps": r.steps, "skipped": r.skipped,
                "loss_scale": None if runner.script_scales else r.scale,
            }
            for r in opts.records
        ],
        "losses": runner.losses.series,
        "notes": notes,
    }


def _forward_counts(fwd: _ForwardScope | None) -> dict[str, Any]:
    """The report's module-call counts (see :class:`~.forward_scope._ForwardScope`);
    None where the fp32 level installed no module hooks."""
    return {
        "model_calls": fwd.model_calls if fwd is not None else None,
        "forward_scopes": fwd.scopes_opened if fwd is not None else 0,
        "forward_calls_in_script_autocast": fwd.in_script_autocast if fwd is not None else 0,
        "forward_calls_kept_fp32": fwd.kept_fp32 if fwd is not None else 0,
        "forward_calls_cast_model": fwd.own_scope if fwd is not None else 0,
        "module_calls_left_alone": fwd.left_alone if fwd is not None else None,
    }


def _repeated_step_notes(records: list[_OptRecord]) -> list[str]:
    return [
        f"optimizer {r.index} ({r.kind}) stepped {r.repeated} time(s) with no backward() since "
        f"its previous step (the first at {r.repeated_site}): each such step applies the same "
        "gradients again; they count in its steps, not in the iterations"
        for r in records
        if r.repeated
    ]


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def format_summary(report: dict[str, Any]) -> str:
    """Plain lines: level and dtype, steps and skips per optimizer, loss scale,
    iteration time, first/last loss per backward() call site, notes."""
    level = report["level_applied"]
    if level != report["level"]:
        level = f"{level} (asked {report['level']})"
    head = f"ampkit run: {level} {report['dtype']}, exit code {report['exit_code']}, {report['wall_seconds']:.1f} s"
    if report["stopped_early"]:
        head += f" (stopped: {report['stopped_early']})"
    lines = [head]
    for o in report["optimizers"]:
        scale = "" if o["loss_scale"] is None else f", loss scale {o['loss_scale']:g}"
        lines.append(
            f"  optimizer {o['index']} {o['type']} ({o['created_at']}): {o['managed']}, "
            f"{o['steps']} steps, {o['skipped']} skipped{scale}"
        )
    if not report["optimizers"]:
        lines.append("  no torch.optim optimizer: casting in forward passes only")
    if report["model_calls"] is not None:
        other = [
            (report["forward_calls_in_script_autocast"], "under the script's own torch.autocast"),
            (report["forward_calls_kept_fp32"], "kept fp32 by the script's torch.autocast(enabled=False)"),
            (report["forward_calls_cast_model"], "in the 16-bit model's own casting"),
        ]
        also = "".join(f", {n} {where}" for n, where in other if n)
        lines.append(
            f"  {report['model_calls']} model calls, {report['forward_scopes']} cast by ampkit{also}; "
            f"{report['module_calls_left_alone']} other module calls (no parameters, or data loading) left as written"
        )
    if report["iteration_ms_median"] is not None:
        lines.append(
            f"  {report['iterations']} iterations, median {report['iteration_ms_median']:.2f} ms, "
            f"{report['iteration_seconds_total']:.2f} s in iterations, "
            f"{report['optimizer_step_seconds']:.2f} s in optimizer updates"
        )
    for site, values in report["losses"].items():
        lines.append(f"  loss at {site}: {len(values)} values, first {_fmt(values[0])}, last {_fmt(values[-1])}")
    if report["scheduler_steps_held"]:
        lines.append(f"  {report['scheduler_steps_held']} LR scheduler step(s) held after skipped steps")
    if report["script_grad_scaler"]:
        lines.append("  the script's GradScaler scales the loss (ampkit does not)")
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def write_report(report: dict[str, Any], path: str | Path) -> None:
    """Write a :class:`RunResult` report as JSON (replaced whole);
    :class:`ampkit.OutputPathError` where ``path`` is a folder, a symlink, a FIFO or a
    device, or its folder is missing or read-only."""
    write_text(path, json.dumps(report, indent=1) + "\n", "the JSON report")


def is_rank_zero() -> bool:
    """Rank 0 of a torchrun launch, or no launch at all (the summary is printed once)."""
    return os.environ.get("RANK", "0") == "0"
