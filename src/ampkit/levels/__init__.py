"""How weights are stored and stepped: :func:`initialize` and its opt levels, model
casting (:func:`cast_model`), fp32 master weights (:class:`MasterWeights`),
compensated bf16 updates (:class:`CompensatedUpdates`) and fp8 (:mod:`.fp8`).

Names resolve on first use (``ampkit.levels.initialize``), so importing one module of
the package does not import the rest. :mod:`ampkit.distributed` sits above the levels;
what ``initialize`` asks of it goes through ``ampkit.levels.sharding``."""

from __future__ import annotations

from ampkit._internal.lazy import lazy_exports

_EXPORTS = {
    "OptLevel": "opt_level", "OPT_LEVELS": "opt_level", "initialize": "setup", "master_params": "setup",
    "resolve_opt_level": "opt_level", "master_weights_of": "setup", "compensation_of": "setup",
    "ResyncMasters": "setup",  # also 0.2's pickled path ampkit.levels.ResyncMasters
    "cast_model": "model_cast", "MasterWeights": "master", "CompensatedUpdates": "compensated",
    "Fp8Recipe": "fp8",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
