"""``ampkit.tune``: the fastest per-module precision plan within an accuracy budget,
measured on the user's hardware (:mod:`.search`: measure, choose, confirm), and the plan
as data (:mod:`ampkit.levels.precision_plan`: JSON, report, the :class:`ampkit.Policy`
that applies it; in ``levels``, where :func:`ampkit.initialize` and :func:`ampkit.init`
read it)."""

from ampkit.levels.precision_plan import ModuleChoice, PlanError, TunePlan

from .search import tune

__all__ = ["ModuleChoice", "PlanError", "TunePlan", "tune"]
