"""``ampkit.doctor``: which layer overflowed, why, and what to change.

::

    amp.init_trainer(opt)
    with amp.doctor(opt) as doc:           # or init_trainer(opt, doctor=True), or AMPKIT_DOCTOR=1
        for x, y in data:
            ...                            # the training loop, unchanged
    print(doc.report())                    # findings, margins table, advice with code

What runs while it is on:

- **Module hooks** (global forward pre/post hooks, a tensor hook on every floating
  tensor that crosses a module boundary with grad, a gradient hook on every
  parameter): abs-max of each module's outputs, of the grads at its outputs and of its
  parameters' grads, and the count of gradient elements below the compute dtype's
  smallest subnormal. Read back once per step (one host sync). On a skipped step or a
  non-finite loss these records name the first module whose output (forward) or whose
  input's gradient (backward) went non-finite, and the parameter(s) whose grads first did.
- **Op-level check**, armed by a skipped step, a non-finite loss or heavy underflow
  and run on the *next* forward + backward (at most once every ``every`` steps, at most
  ``max_checks`` times): see :mod:`ampkit.tools.diagnosis._checker` -- every aten op is checked
  for inf/NaN (one host sync per op), 16-bit backward ops are re-run in fp32 to count
  flushed values. When the failure does not recur (a dynamic scale that backed off),
  the report says so and keeps the module-level finding. ``doc.diagnose(fn)`` runs the
  check on demand, e.g. on the batch that failed.
- **Misuse checks** at each step: grads changed while they still held the loss scale
  (``clip_grad_norm_`` before ``amp.unscale``), a loss scaled twice, ``step()`` on grads
  from a backward outside ``scale_loss``, more backward passes than scaled losses, O2
  weights that no longer match their fp32 masters, gradient hooks that see scaled grads.
  Each warns once (:class:`DoctorWarning`) and becomes advice.

Off (the default) nothing is installed: ``init_trainer`` reads one environment
variable, ``scale_loss`` loops over an empty list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ampkit.errors import StateError

from ._advice import Advice
from ._checker import TensorStats
from ._core import ENV, Doctor, DoctorWarning, attach_global, current, env_enabled
from ._findings import Finding, Misuse, ModuleMargin, StepPoint
from ._report import DoctorReport

__all__ = [
    "Advice",
    "Doctor",
    "DoctorReport",
    "DoctorWarning",
    "ENV",
    "Finding",
    "Misuse",
    "ModuleMargin",
    "StepPoint",
    "TensorStats",
    "attach_global",
    "current",
    "doctor",
    "env_enabled",
]


def doctor(
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    every: int = 50,
    max_checks: int = 10,
    underflow_threshold: float = 0.5,
    log: bool = True,
    **unknown: Any,
) -> Doctor:
    """A :class:`Doctor` for ``optimizers`` (default: every optimizer managed in the
    current AMP session), to use as a context manager::

        with amp.doctor(opt, every=50) as doc:
            train()
        doc.report().print()

    Args:
        optimizers: managed optimizers to watch; default every optimizer managed in
            the current AMP session when the doctor starts.
        every: at least this many steps between two op-level checks (default 50).
        max_checks: op-level checks in all (default 10).
        underflow_threshold: fraction in (0, 1] of 16-bit parameter-gradient elements
            below the smallest normal that arms an underflow check (default 0.5).
        log: log findings on the ``ampkit.doctor`` logger, rank 0 only (default True).

    Raises :class:`~ampkit.StateError` for an optimizer ampkit does not manage, an
    option of the wrong type or range, or a keyword that is no option (``**unknown``
    is there only to name it in that error).
    ``ampkit.doctor.current()`` is the process-wide doctor that
    ``init_trainer(..., doctor=True)`` and ``AMPKIT_DOCTOR=1`` start.
    """
    if unknown:
        raise StateError(
            f"doctor: unknown option(s) {', '.join(sorted(map(repr, unknown)))}; the options are "
            "every, max_checks, underflow_threshold and log."
        )
    return Doctor(optimizers, every=every, max_checks=max_checks, underflow_threshold=underflow_threshold, log=log)


doctor.current = current  # type: ignore[attr-defined]
