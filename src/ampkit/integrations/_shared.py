"""What the framework integrations (:mod:`~ampkit.integrations.hf`,
:mod:`~ampkit.integrations.lightning`, :mod:`~ampkit.integrations.accelerate`) use of
ampkit beyond its public face. They import ``ampkit`` (its ``__all__``), ``ampkit.errors``,
``ampkit.distributed``, the integrations' own shared modules and this one: the
import-linter contract "integrations use ampkit's public face" (``pyproject.toml``)
refuses any other import of ampkit. Why each name is needed:

- ``dtype_from_env``, ``level_from_env``, ``DTYPES_BY_NAME``, ``LOW_PRECISION_BY_NAME``,
  ``default_device_type``, ``OPT_LEVELS``, ``resolve_opt_level``, ``level_or_env``,
  ``level_name``, ``level_names``, ``is_fp32_level``, ``checked_plan``: the level and
  dtype an integration runs at, from its arguments (dtype names, a tuning plan),
  ``AMPKIT_LEVEL``/``AMPKIT_DTYPE``, or the device's default, asked of the level data
  (:data:`ampkit.levels.OPT_LEVELS`), never by comparing level names;
- ``master_weights_of``, ``applied_level``: what :func:`ampkit.initialize` set up (an
  optimizer's fp32 masters, the level in force);
- ``managed_state``, ``StepExtension``, ``AfterStep``: a framework's skip signal and
  scaled losses kept by the managed optimizer's step;
- ``unwrap_optimizer``: the optimizer a framework's wrapper holds;
- ``check_target``, ``write_text``, ``ABSURD_MAGNITUDE``: files a framework writes beside
  ampkit's, written and checked as ampkit writes and checks its own;
- ``install_hint``: what to install for a framework release the integration is not
  tested with;
- ``registry`` (``on_reset``), ``torch_compat`` (``compiled_module_inner``): undoing a
  framework hook at :func:`ampkit.reset`; a ``torch.compile``'d model's inner module."""

from __future__ import annotations

from ampkit._internal import registry, torch_compat
from ampkit._internal.dtypes import DTYPES_BY_NAME, LOW_PRECISION_BY_NAME, default_device_type
from ampkit._internal.env import dtype_from_env, level_from_env
from ampkit._internal.files import check_target, write_text
from ampkit._internal.install import install_hint
from ampkit._internal.validate import ABSURD_MAGNITUDE
from ampkit._internal.wrappers import unwrap_optimizer
from ampkit.levels import OPT_LEVELS, master_weights_of, resolve_opt_level
from ampkit.levels.opt_level import (
    checked_plan,
    is_fp32_level,
    level_name,
    level_names,
    level_or_env,
)
from ampkit.levels.setup import applied_level
from ampkit.trainer.api import managed_state
from ampkit.trainer.extensions import AfterStep, StepExtension

__all__ = [
    "ABSURD_MAGNITUDE",
    "DTYPES_BY_NAME",
    "LOW_PRECISION_BY_NAME",
    "OPT_LEVELS",
    "AfterStep",
    "StepExtension",
    "applied_level",
    "check_target",
    "checked_plan",
    "default_device_type",
    "dtype_from_env",
    "install_hint",
    "is_fp32_level",
    "level_from_env",
    "level_name",
    "level_names",
    "level_or_env",
    "managed_state",
    "master_weights_of",
    "registry",
    "resolve_opt_level",
    "torch_compat",
    "unwrap_optimizer",
    "write_text",
]
