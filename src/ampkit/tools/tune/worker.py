"""The capturing process of ``ampkit tune script.py``: ``python -m
ampkit.tools.tune.worker SPEC.json`` runs the script's first steps (:func:`.script.capture`),
touches the spec's ``captured`` file, measures and chooses on the captured model
(:func:`.search.measure_and_choose`) and writes the outcome as JSON to the spec's
``result`` file: ``{"dtype", "device_type", "choices", "skipped"}``, or ``{"error"}``.
Where the spec names a ``progress`` file, the measuring stages' lines are appended to it
(:class:`.progress.Progress`), for the tuner to pass on.
The script runs here, not in the tuning process, so that nothing it does (``os._exit``,
a fork, a hang) reaches the tuner: a result that never comes is the tuner's to explain."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
import traceback
from typing import Any

from ampkit._internal.files import read_json, write_text
from ampkit.errors import AmpError

from . import measure
from .progress import Progress
from .script import capture
from .search import measure_and_choose

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Run the spec at ``argv[0]``; 0 once its result is written."""
    spec = read_json(argv[0], "ampkit tune's capture spec", AmpError)
    start = time.perf_counter()
    try:
        out = _measured(spec, start)
    except AmpError as exc:
        out = {"error": str(exc)}
    write_text(spec["result"], json.dumps(out), "ampkit tune's capture result")
    return 0


def _measured(spec: dict[str, Any], start: float) -> dict[str, Any]:
    model, calls = capture(spec["script"], spec["args"], spec["capture_steps"])
    with open(spec["captured"], "x"):  # the tuner's bound moves on to the measuring
        pass
    device_type = next(p.device.type for p in model.parameters())
    if not measure.candidate_modules(model):
        raise AmpError(f"the script's model ({type(model).__name__}) has no module with parameters of its own below "
                       "its root: nothing to tune.")  # fmt: skip
    lines = spec.get("progress")
    try:
        with contextlib.ExitStack() as stack:
            stream = stack.enter_context(open(lines, "a", encoding="utf-8")) if lines else None
            report = stack.enter_context(Progress(True if lines else False, "", stream=stream))
            dtype, choices, skipped = measure_and_choose(
                model, calls, measure.output_energy, candidates=spec["candidates"], device_type=device_type,
                include_emulated=spec["include_emulated"], repeats=spec["repeats"], budget=spec["budget"],
                grad_limit=spec["grad_limit"], deadline=start + spec["max_seconds"], report=report)  # fmt: skip
    except AmpError:
        raise
    except Exception as exc:  # the model's own code failed on the calls it was given in the script
        traceback.print_exc()
        raise AmpError(f"the script's model ({type(model).__name__}) failed when called again with the arguments "
                       f"the script gave it: {type(exc).__name__}: {exc}") from None  # fmt: skip
    return {"dtype": dtype, "device_type": device_type, "skipped": skipped,
            "choices": [dataclasses.asdict(c) for c in choices]}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
