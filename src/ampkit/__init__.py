"""ampkit: automatic mixed precision for PyTorch.

Quick start::

    import ampkit as amp
    amp.init()                       # op-level casting, default lists
    amp.init_trainer(opt)            # loss scaler + step skipping on overflow
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
"""

from __future__ import annotations

from ampkit._internal.registry import reset
from ampkit.errors import (
    AmpError,
    DistributedError,
    NumericsError,
    OutputPathError,
    PolicyError,
    ScalerError,
    StateError,
)

__version__ = "0.3.0"

__all__ = [
    "AmpError",
    "DistributedError",
    "NumericsError",
    "OutputPathError",
    "PolicyError",
    "ScalerError",
    "StateError",
    "reset",
]

# --- casting engine (policy, lists, autocast, init/reset, explain) ---
from ampkit.casting.engine import autocast, checkpoint_context, current_policy, init, is_active  # noqa: E402
from ampkit.casting.explanation import ExplainReport, explain  # noqa: E402
from ampkit.casting.policy import Policy, canonical_op, default_policy  # noqa: E402

__all__ += [
    "ExplainReport",
    "Policy",
    "autocast",
    "canonical_op",
    "checkpoint_context",
    "current_policy",
    "default_policy",
    "explain",
    "init",
    "is_active",
]
# --- loss scaling and optimizer integration ---
from ampkit.scaling.loss_scaler import LossScaler  # noqa: E402
from ampkit.trainer.api import (  # noqa: E402
    StepStats,
    init_trainer,
    scale_loss,
    stats,
    step_skipped,
    unscale,
)
from ampkit.trainer.grad_scaler import GradScaler  # noqa: E402
from ampkit.trainer.session import load_state_dict, state_dict  # noqa: E402

__all__ += [
    "GradScaler",
    "LossScaler",
    "StepStats",
    "init_trainer",
    "load_state_dict",
    "scale_loss",
    "state_dict",
    "stats",
    "step_skipped",
    "unscale",
]
# --- opt levels, master weights, compensated updates ---
from ampkit.levels import fp8  # noqa: E402  (fp8 training: Fp8Recipe, layers(), observe())
from ampkit.levels.compensated import CompensatedUpdates  # noqa: E402
from ampkit.levels.fp8 import Fp8Recipe  # noqa: E402
from ampkit.levels.master import MasterWeights  # noqa: E402
from ampkit.levels.model_cast import cast_model  # noqa: E402
from ampkit.levels.setup import OptLevel, initialize, master_params  # noqa: E402

__all__ += [
    "CompensatedUpdates",
    "Fp8Recipe",
    "MasterWeights",
    "fp8",
    "OptLevel",
    "cast_model",
    "initialize",
    "master_params",
]
# --- inference: convert, export (onnx is imported only when exporting) ---
from ampkit.inference.conversion import (  # noqa: E402
    Budget,
    ConversionError,
    ConversionReport,
    convert,
    fp32_weights,
)
from ampkit.inference.export import OnnxExport, export_onnx, export_program  # noqa: E402

__all__ += [
    "Budget",
    "ConversionError",
    "ConversionReport",
    "OnnxExport",
    "convert",
    "export_onnx",
    "export_program",
    "fp32_weights",
]
# --- distributed ---
from ampkit import distributed  # noqa: E402

__all__ += ["distributed"]
# --- diagnosis ---
from ampkit.tools.diagnosis import DoctorReport, doctor  # noqa: E402  (ampkit.doctor is the function)

__all__ += ["DoctorReport", "doctor"]
# --- torch.load(f) (weights_only=True) of a model carrying ampkit's objects ---
from ampkit import legacy, safe_globals  # noqa: E402

legacy.install()  # 0.2's module paths (pickled class paths, ampkit.compat.apex)
safe_globals.register()
