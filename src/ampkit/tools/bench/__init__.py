"""``ampkit bench``: built-in workloads and the interleaved benchmark runner.

Two benchmark trees share what is defined here:

- users run ``ampkit bench`` (this package, installed with ampkit, data included):
  fp32 vs torch.autocast vs ampkit's levels trained side by side on the workloads;
- developers run the repository's ``benchmarks/*.py`` scripts, each printing one
  measurement side by side (engine or scaler overhead, compiled steps, memory, ...).

Both build their models and batches with :func:`make_workload` (``"cnn"``, ``"lm"``,
``"wide"``; sizes ``full``, ``quick``, ``tiny``; a script times its steps on
:meth:`Workload.example_batch <.workloads.Workload.example_batch>`) and count tensor
memory with :mod:`.memory`, so no model and no memory method is defined twice.

Modules: :mod:`.data` (digits, standard-library text), :mod:`.workloads` (models
and training settings), :mod:`.recipes` (one object per precision),
:mod:`.worker` / :mod:`.runner` (interleaved training in one process per
precision), :mod:`.memory` (tensor-memory counts, shared with ``benchmarks/``), :mod:`.report` (table, JSON, plot).
Importing this package needs only torch; the data loaders, table and plot import
scikit-learn, rich and matplotlib (the ``cli`` extra) when called.
"""

from __future__ import annotations

from .recipes import PRECISIONS, make_recipe
from .runner import BenchConfig, BenchError, run_bench
from .workloads import WORKLOADS, make_workload

__all__ = [
    "PRECISIONS",
    "WORKLOADS",
    "BenchConfig",
    "BenchError",
    "make_recipe",
    "make_workload",
    "run_bench",
]
