"""``ampkit run``: mixed precision for an unmodified training script.

:func:`run_script` runs a script as ``__main__`` (``runpy``, with the ``sys.argv`` it
expects) with these pieces installed for the length of the run, and removed after:
casting inside model calls only (the outermost call of a module with parameters, never
data loading; a script's own ``torch.autocast`` region stands); every ``torch.optim``
optimizer put under :func:`ampkit.init_trainer` or :func:`ampkit.initialize` as it is
built (one trainer, one loss scaler for the run); fp16 loss scaling where ``backward()``
is called (refused with :class:`RunRefused` where it cannot be exact; a script's own
enabled ``GradScaler`` scales itself); and the observation of losses, iterations and
model calls for the report. The ``fp32`` level installs the observation only (the
reference run of ``ampkit run --compare``). What each piece does and the limits:
``docs/guides/ampkit-run.md``.

Modules: :mod:`.config` (what is applied), :mod:`.script` (running the script),
:mod:`.runner` (the run's bookkeeping), :mod:`.patches` (the patches of torch),
:mod:`.forward_scope`, :mod:`.scheduler_hold`, :mod:`.optimizers` with
:mod:`.find_models`, :mod:`.steps` (each optimizer's steps, watched per optimizer),
and :mod:`.report` (the report and the exit summary).
"""

from __future__ import annotations

from .config import RunConfig, RunRefused, ScriptError, run_levels
from .report import format_summary, is_rank_zero, write_report
from .script import RunResult, run_script

__all__ = [
    "RunConfig",
    "RunRefused",
    "RunResult",
    "ScriptError",
    "format_summary",
    "is_rank_zero",
    "run_levels",
    "run_script",
    "write_report",
]
