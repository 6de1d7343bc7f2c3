"""``ampkit run``: mixed precision for an unmodified training script.

:func:`run_script` runs a script as ``__main__`` (``runpy``, with the ``sys.argv`` it
expects) with these pieces installed for the length of the run, and removed after:

- **Casting inside forward passes only.** A global forward pre-hook opens an
  :class:`ampkit.autocast` scope when a *model call* starts and a global forward hook
  (always called) closes it when that call returns. A model call is the outermost call
  of a module that has parameters (trained or frozen), made outside data loading.
  Modules without parameters -- torchvision's transforms, loss modules -- are not
  models: called on their own they run as written, in fp32 (a module with parameters
  they call is the model call). Nothing that loads data is cast: DataLoader worker
  processes, a DataLoader's batch fetch in the main process (``Dataset.__getitem__``,
  ``collate_fn``) and a Dataset's ``__getitem__``/``__iter__`` the script calls itself.
  The same rule holds with or without an optimizer, before and after it is built.
  Backward, optimizer steps, ``p.data`` updates and evaluation code outside modules
  run as the script wrote them. Inside a ``torch.autocast`` region the script opened itself (enabled)
  ampkit opens nothing: the script's choice stands. A model cast by O2/O2K runs under its
  own op-level scope (:func:`ampkit.levels.model_cast.add_op_casting`) instead.
- **Every torch.optim optimizer is managed.** ``torch.optim.Optimizer.__init__`` is
  wrapped for the run: when a script builds an optimizer, it is put under
  :func:`ampkit.init_trainer` (O1) or :func:`ampkit.initialize` (O2/O2K, the models found
  as the modules that own its parameters) right away, with LR schedulers held on skipped
  steps. All the run's optimizers share one trainer (one loss scaler), so a loss that
  reaches several of them (a GAN's generator loss flows through the discriminator) is
  scaled once. An optimizer built over the parameters of an earlier one supersedes it.
- **Loss scaling where ``backward()`` is called** (fp16 only; bf16 needs none).
  ``torch.autograd.backward`` (what ``Tensor.backward`` calls) is wrapped: a backward
  whose graph reaches managed parameters runs inside :func:`ampkit.scale_loss` for the
  optimizers it reaches, and ampkit's gradient path (:mod:`ampkit.trainer.grad_hooks`) unscales the
  grads as backward produces them, so code between backward and ``step()`` (clipping,
  logging) sees real gradients. Where that cannot be exact -- the backward reaches
  tensors no managed optimizer steps (a manual ``p.data`` update, an input's grad), or
  builds a graph of its grads (``create_graph=True``) -- fp16 is refused with
  :class:`RunRefused` (bf16 proposed). A script with its own enabled ``GradScaler``
  scales itself: ampkit does not scale again.
- **Observation.** Each backward on a one-element tensor records the loss (the value of
  that tensor), in one series per source line of the ``backward()`` call; each step of
  the first optimizer built marks an iteration (a script without optimizer: each
  backward). A step taken with no ``backward()`` since the same optimizer's previous
  step applies the same gradients again: it counts in that optimizer's steps, not as an
  iteration, and a note says so. Module calls are counted: ``model_calls`` (the model
  calls), of which ``forward_scopes`` ampkit cast, ``forward_calls_in_script_autocast``
  ran in the script's own enabled ``torch.autocast``, ``forward_calls_kept_fp32`` in
  its ``torch.autocast(enabled=False)`` and ``forward_calls_cast_model`` in the
  op-level scope of an O2/O2K model; ``module_calls_left_alone`` counts the other
  outermost module calls (no parameters, or data loading) of this process. The step and time limits (``max_steps``, ``time_budget``) end the script
  cleanly after such a step.

The ``fp32`` level installs the observation only (no casting, optimizers left alone):
the reference run of ``ampkit run --compare``.

Modules: :mod:`.config` (what is applied), :mod:`.script` (running the script),
:mod:`.runner` (the run's bookkeeping), :mod:`.patches` (the patches of torch),
:mod:`.forward_scope`, :mod:`.scheduler_hold`, :mod:`.optimizers` with
:mod:`.find_models`, and :mod:`.report` (the report and the exit summary).
"""

from __future__ import annotations

from .config import LEVELS, RunConfig, RunRefused, ScriptError
from .report import format_summary, is_rank_zero, write_report
from .script import RunResult, run_script

__all__ = [
    "LEVELS",
    "RunConfig",
    "RunRefused",
    "RunResult",
    "ScriptError",
    "format_summary",
    "is_rank_zero",
    "run_script",
    "write_report",
]
