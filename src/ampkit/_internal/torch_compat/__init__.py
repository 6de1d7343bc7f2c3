"""Every place ampkit relies on torch internals, behind one small name each.

Each function or constant here states what ampkit assumes of torch and what breaks if a
torch release changes it; ``tests/unit/_internal/test_torch_compat.py`` checks each
assumption against the installed torch, so a release that breaks one fails a test named
for it. Code elsewhere reaches torch's private modules, attributes and ops only through
this package (``ampkit run``'s process-wide patches stay with the launcher), and only
through this face: ``from ampkit._internal import torch_compat``, then
``torch_compat.<name>``. Inside, one module per part of torch: :mod:`.release` (the
running release, the CPU's 16-bit instructions), :mod:`.dispatch` (ops, overloads,
dispatch keys), :mod:`.tensors` (a tensor's private state, the autograd engine),
:mod:`.ops` (private fused ops), :mod:`.modules` (``nn.Module``'s hook dicts and
storage), :mod:`.parallel` (DataParallel, DDP), :mod:`.optim` (optimizers' and
schedulers' markers and hooks), :mod:`.dynamo` (torch.compile's tracing) and
:mod:`.compiled_code` (the code dynamo compiled and its guards).
"""

from __future__ import annotations

from .compiled_code import (
    autocast_device_index,
    compiled_code_entries,
    compiled_frames_ok,
    dynamo_compile_lock,
    global_autocast_enabled_in_guard,
    guards_name,
    reset_compiled_code,
)
from .dispatch import (
    TENSOR_BASE,
    TorchDispatchMode,
    aten_to_copy,
    autocast_keyset,
    composite_implicit_call,
    destroy_library,
    dispatch_key_overloads,
    dispatch_key_registrations,
    exclude_dispatch_keys,
    has_composite_implicit_kernel,
    is_optional_type,
    overload_name,
    overload_schema,
    raw_op,
    torch_function_mode_active,
    tree_flatten,
    tree_map,
    wrapper_tensor,
)
from .dispatch import (
    kernel_site as kernel_site,
)
from .dynamo import (
    add_graph_marker,
    compiled_function_inner,
    compiled_module_inner,
    current_trace_tx,
    dynamo_loaded,
    guard_attr_equals,
    mark_trace_constant,
    run_outside_dynamo,
    skip_code_in_dynamo,
    skip_if_traced_alone,
    skip_traced_frame,
    traced_frame_code,
    traced_object,
    tracing_for_compile,
)
from .modules import (
    BATCH_NORM_BASE,
    CONV_TRANSPOSE_BASE,
    INSTANCE_NORM_BASE,
    WRAPPER_PATH_PARTS,
    ModuleHookDicts,
    can_reinstall_global_forward_hooks,
    forward_hook_dicts,
    forward_pre_hooks_of,
    forward_pre_hooks_with_kwargs,
    module_hook_dicts,
    own_parameters,
    reinstall_global_forward_hooks,
    remove_global_forward_hooks,
    replace_buffer,
    replace_child,
    submodules_of,
    swap_module_class,
)
from .ops import (
    FUSED_CHECK_DTYPES,
    amp_unscale_and_check_,
    flatten_dense,
    foreach_add_,
    foreach_copy_,
    foreach_mul_,
    foreach_sub_,
    scaled_mm,
    unflatten_dense,
    unscale_and_check_composite_,
)
from .optim import (
    fused_optimizer_devices,
    instance_step_hooks_suspended,
    mark_optimizer_stepped,
    mark_step_supports_amp_scaling,
    mark_step_wrapped_by_lr_scheduler,
    optimizer_step_hooks,
    step_wrapped_by_lr_scheduler,
)
from .optim import (
    global_optimizer_step_hooks as global_optimizer_step_hooks,
)
from .parallel import (
    active_ddp_module,
    is_dataparallel_replica,
    is_parallel_apply_worker,
    parallel_apply_worker_module,
)
from .release import (
    GRAPH_AUTOCAST_SWITCHES,
    TORCH_RELEASE,
    cpu_has_native_16bit,
    release_of,
    warn_no_graph_switches,
)
from .tensors import (
    autograd_engine,
    current_autograd_node,
    current_graph_task_id,
    is_fake_tensor,
    post_accumulate_hooks_first,
    sparse_values,
    tensor_hooks_of,
    tensor_is_view,
    tensor_version,
    tensor_versions,
)

__all__ = [
    "TENSOR_BASE", "TorchDispatchMode", "add_graph_marker", "amp_unscale_and_check_",
    "FUSED_CHECK_DTYPES", "unscale_and_check_composite_", "autocast_device_index",
    "autograd_engine", "can_reinstall_global_forward_hooks", "compiled_code_entries",
    "compiled_frames_ok", "compiled_function_inner", "compiled_module_inner",
    "current_autograd_node", "current_graph_task_id", "current_trace_tx", "destroy_library",
    "dynamo_compile_lock", "dynamo_loaded", "exclude_dispatch_keys", "autocast_keyset",
    "forward_hook_dicts", "forward_pre_hooks_of", "forward_pre_hooks_with_kwargs", "flatten_dense",
    "unflatten_dense", "foreach_copy_", "foreach_mul_", "foreach_add_", "foreach_sub_",
    "global_autocast_enabled_in_guard", "guard_attr_equals", "guards_name",
    "has_composite_implicit_kernel", "is_dataparallel_replica", "is_fake_tensor",
    "is_parallel_apply_worker", "ModuleHookDicts", "mark_trace_constant", "module_hook_dicts",
    "overload_name", "overload_schema", "parallel_apply_worker_module", "raw_op",
    "composite_implicit_call", "reinstall_global_forward_hooks", "remove_global_forward_hooks",
    "reset_compiled_code", "run_outside_dynamo", "scaled_mm", "skip_code_in_dynamo",
    "WRAPPER_PATH_PARTS", "own_parameters", "replace_buffer", "replace_child", "submodules_of",
    "swap_module_class", "tensor_is_view", "tensor_version", "tensor_versions", "tree_flatten", "tree_map",
    "torch_function_mode_active", "skip_if_traced_alone", "skip_traced_frame", "traced_frame_code",
    "traced_object", "tracing_for_compile", "TORCH_RELEASE", "release_of",
    "GRAPH_AUTOCAST_SWITCHES", "warn_no_graph_switches", "BATCH_NORM_BASE", "INSTANCE_NORM_BASE",
    "CONV_TRANSPOSE_BASE", "dispatch_key_overloads", "wrapper_tensor", "is_optional_type",
    "aten_to_copy", "dispatch_key_registrations", "sparse_values", "tensor_hooks_of",
    "post_accumulate_hooks_first", "fused_optimizer_devices", "mark_step_supports_amp_scaling",
    "mark_optimizer_stepped", "step_wrapped_by_lr_scheduler", "mark_step_wrapped_by_lr_scheduler",
    "optimizer_step_hooks", "instance_step_hooks_suspended", "active_ddp_module",
    "cpu_has_native_16bit",
]  # fmt: skip
