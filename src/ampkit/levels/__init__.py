"""How weights are stored and stepped: :func:`initialize` and its opt levels, model
casting (:func:`cast_model`), fp32 master weights (:class:`MasterWeights`),
compensated bf16 updates (:class:`CompensatedUpdates`) and fp8 (:mod:`.fp8`).

:mod:`ampkit.distributed` sits above the levels."""

from __future__ import annotations

from .compensated import CompensatedUpdates
from .fp8 import Fp8Recipe
from .master import MasterWeights
from .model_cast import cast_model
from .opt_level import OPT_LEVELS, OptLevel, resolve_opt_level
from .setup import (
    ResyncMasters,  # also 0.2's pickled path ampkit.levels.ResyncMasters
    compensation_of,
    initialize,
    master_params,
    master_weights_of,
)

__all__ = [
    "CompensatedUpdates", "Fp8Recipe", "MasterWeights", "OPT_LEVELS", "OptLevel", "ResyncMasters", "cast_model",
    "compensation_of", "initialize", "master_params", "master_weights_of", "resolve_opt_level",
]  # fmt: skip
