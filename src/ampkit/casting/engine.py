"""The casting engine: applies a :class:`~ampkit.Policy` in a scope. The public face of
the private modules that implement it: ``_kernels`` (the scope state and the
autocast kernels), ``_scopes`` (``autocast``, ``init``, ``checkpoint_context``),
``_module_rules`` (module rules, the hooks) and ``_function_mode`` (Python-level
ops). Each of those imports the kernels module; none imports this one. How it works:
docs/concepts/casting.md."""

from __future__ import annotations

from ._function_mode import _PythonOpMode as _PythonOpMode
from ._kernels import (
    GRAPH_MARKER,
    active_scopes,
    current_policy,
    drop_code_of_other_keys,
    is_active,
    kernel_registry,
    logger,
    probe_rnn,
    replica_caller,
    top_frame,
)
from ._module_rules import (
    model_name,
    module_hooks,
    remove_step_hook,
    step_hook_installed,
    unwrap_module,
)
from ._scopes import (
    autocast,
    check_init_dtype,
    checkpoint_context,
    entered_dtypes,
    init,
    open_scope,
    release_kernels,
)

__all__ = [  # the public API: autocast, init, checkpoint_context, is_active, current_policy, active_scopes
    "GRAPH_MARKER",
    "active_scopes",
    "autocast",
    "check_init_dtype",
    "checkpoint_context",
    "current_policy",
    "drop_code_of_other_keys",
    "entered_dtypes",
    "init",
    "is_active",
    "kernel_registry",
    "logger",
    "model_name",
    "module_hooks",
    "open_scope",
    "probe_rnn",
    "release_kernels",
    "remove_step_hook",
    "replica_caller",
    "step_hook_installed",
    "top_frame",
    "unwrap_module",
]
