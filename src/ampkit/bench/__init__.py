"""``ampkit bench``: built-in workloads and the interleaved benchmark runner.

This is the benchmark tree users run (installed with ampkit, ``ampkit bench``). The
repository's ``benchmarks/`` scripts are the developers' tree: each prints one
measurement side by side and takes its tensor-memory counts from :mod:`.memory`
here, so both trees count memory the same way.

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
