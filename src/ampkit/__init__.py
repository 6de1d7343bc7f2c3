"""ampkit: automatic mixed precision for PyTorch.

Quick start::

    import ampkit as amp
    amp.init()                       # op-level casting, default lists
    amp.init_trainer(opt)            # loss scaler + step skipping on overflow
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()

The public API is the names below; the guides and the reference say what each does.
"""

from __future__ import annotations

from ampkit import distributed, legacy, safe_globals
from ampkit._internal.registry import reset
from ampkit.casting.engine import autocast, checkpoint_context, current_policy, is_active
from ampkit.casting.explanation import ExplainReport, explain
from ampkit.casting.policy import Policy, canonical_op, default_policy
from ampkit.errors import (
    AmpError,
    DistributedError,
    NumericsError,
    OutputPathError,
    PolicyError,
    ScalerError,
    StateError,
)
from ampkit.inference.conversion import (
    Budget,
    ConversionError,
    ConversionReport,
    convert,
    fp32_weights,
)
from ampkit.inference.export import OnnxExport, export_onnx, export_program
from ampkit.levels import fp8  # fp8 training: Fp8Recipe, layers(), observe()
from ampkit.levels.compensated import CompensatedUpdates
from ampkit.levels.fp8 import Fp8Recipe
from ampkit.levels.master import MasterWeights
from ampkit.levels.model_cast import cast_model
from ampkit.levels.plan_init import init
from ampkit.levels.precision_plan import PlanError, TunePlan
from ampkit.levels.setup import OptLevel, initialize, master_params
from ampkit.scaling.loss_scaler import LossScaler
from ampkit.tools.diagnosis import DoctorReport, doctor  # ampkit.doctor is the function
from ampkit.tools.tune import tune
from ampkit.trainer.api import StepStats, init_trainer, scale_loss, stats, step_skipped, unscale
from ampkit.trainer.grad_scaler import GradScaler
from ampkit.trainer.session import load_state_dict, state_dict

__version__ = "0.3.0"

__all__ = [
    # errors
    "AmpError",
    "DistributedError",
    "NumericsError",
    "OutputPathError",
    "PolicyError",
    "ScalerError",
    "StateError",
    # casting: policies, op lists, scopes, explain
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
    "reset",
    # loss scaling and the optimizer step
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
    # opt levels, master weights, compensated updates, fp8
    "CompensatedUpdates",
    "Fp8Recipe",
    "MasterWeights",
    "OptLevel",
    "cast_model",
    "fp8",
    "initialize",
    "master_params",
    # inference: convert, export (onnx is imported only when exporting)
    "Budget",
    "ConversionError",
    "ConversionReport",
    "OnnxExport",
    "convert",
    "export_onnx",
    "export_program",
    "fp32_weights",
    # distributed, diagnosis
    "distributed",
    "DoctorReport",
    "doctor",
    # per-module precision tuning
    "PlanError",
    "TunePlan",
    "tune",
]

legacy.install()  # 0.2's module paths (pickled class paths, ampkit.compat.apex)
safe_globals.register()  # torch.load(f) (weights_only=True) of a model carrying ampkit's objects
