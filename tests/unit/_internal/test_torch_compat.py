"""Each torch internal ampkit relies on (ampkit._internal.torch_compat), checked against
the installed torch: a release that breaks one fails the test named for it."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from torch import nn

from ampkit._internal import torch_compat as tc

# every test here is a canary of one torch internal: `pytest -m torch_canary` runs them alone
pytestmark = pytest.mark.torch_canary

aten = torch.ops.aten


# --- tensors, ops, the dispatcher ----------------------------------------------------
def test_tensor_methods_have_the_c_tensor_base_as_objclass():
    assert issubclass(torch.Tensor, tc.TENSOR_BASE)
    assert issubclass(torch.Tensor.add.__objclass__, tc.TENSOR_BASE)


def test_torch_dispatch_mode_sees_the_aten_ops_that_ran():
    seen = []

    class Record(tc.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    a = torch.ones(2, 2)
    with Record():
        torch.mm(a, a)
    assert "aten::mm" in [f.name() for f in seen]  # by name: torch may rebuild overload objects


def test_tensor_version_counts_in_place_changes_and_views_are_told():
    t = torch.zeros(3)
    before = tc.tensor_version(t)
    t.add_(1)
    assert tc.tensor_version(t) == before + 1
    t[0] = 5  # an in-place write through indexing counts too
    assert tc.tensor_version(t) == before + 2
    assert tc.tensor_is_view(t[1:]) and not tc.tensor_is_view(t)


def test_excluding_the_autocast_keys_runs_an_op_in_its_inputs_dtype():
    a = torch.ones(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(a, a).dtype is torch.bfloat16
        with tc.exclude_dispatch_keys(tc.autocast_keyset()):
            assert torch.mm(a, a).dtype is torch.float32


def test_overload_schema_and_name():
    assert tc.overload_name(aten.mm.default) == "default"
    assert tc.overload_name(aten.pow.Tensor_Scalar) == "Tensor_Scalar"
    assert any(arg.is_out for arg in tc.overload_schema(aten.mm.out).arguments)
    assert not any(arg.is_out for arg in tc.overload_schema(aten.mm.default).arguments)
    assert any("Tensor" in str(arg.type) for arg in tc.overload_schema(aten.mm.default).arguments)
    assert tc.overload_schema(aten.add_.Tensor).is_mutable
    assert not tc.overload_schema(aten.add.Tensor).is_mutable


def test_dispatch_key_overloads_and_the_schema_helpers():
    overloads = tc.dispatch_key_overloads("AutocastCPU")
    assert ("mm", "default") in overloads and overloads == sorted(overloads)
    assert {base for base, _ in overloads} == tc.dispatch_key_registrations("AutocastCPU")
    cuda = tc.dispatch_key_overloads("AutocastCUDA")  # registered in CPU-only builds too
    assert ("softmax", "int") in cuda and ("mm", "default") in cuda
    args = {a.name: a for a in tc.overload_schema(aten.softmax.int).arguments}
    assert tc.is_optional_type(args["dtype"].type) and not tc.is_optional_type(args["self"].type)


def test_wrapper_tensor_owns_no_memory_and_claims_any_device():
    seen = []

    class Spy(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            if func is tc.aten_to_copy:
                return tc.wrapper_tensor(Spy, tuple(args[0].shape), kwargs["dtype"], args[0].device.type)
            raise NotImplementedError

    t = tc.wrapper_tensor(Spy, (2, 3), torch.bfloat16, "cuda")  # no GPU needed
    assert t.device.type == "cuda" and t.dtype is torch.bfloat16 and t.shape == (2, 3)
    assert t.float().dtype is torch.float32 and seen == [tc.aten_to_copy]


def test_raw_op_computes_the_op():
    a = torch.randn(3, 3)
    torch.testing.assert_close(tc.raw_op(aten.mm.default)(a, a), a @ a)


def test_composite_implicit_kernels_are_found_and_decompose_under_autocast():
    assert tc.has_composite_implicit_kernel(aten.einsum.default)
    assert not tc.has_composite_implicit_kernel(aten.mm.default)
    # an overload the dispatcher does not know by name: False, not an error
    assert tc.has_composite_implicit_kernel(aten.einsum.sublist) is False
    a = torch.randn(2, 2)
    decompose = tc.composite_implicit_call(aten.einsum.default)
    with torch.autocast("cpu", dtype=torch.bfloat16), tc.exclude_dispatch_keys(tc.autocast_keyset()):
        # the ops einsum decomposes to (bmm) meet autocast again, below the excluded key
        out = decompose("ij,jk->ik", [a, a])
    torch.testing.assert_close(out.float(), a @ a, atol=0.05, rtol=0.05)


def test_a_kernel_on_the_autocast_key_runs_and_goes_with_its_library():
    calls = []

    def kernel(x):
        calls.append(x.dtype)
        with tc.exclude_dispatch_keys(tc.autocast_keyset()):
            return tc.raw_op(aten.relu.default)(x)

    lib = torch.library.Library("aten", "IMPL")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("relu", kernel, "AutocastCPU")
    x = torch.randn(4)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.relu(x)
        assert calls == [torch.float32]
    finally:
        tc.destroy_library(lib)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.relu(x)
    assert calls == [torch.float32]  # torch's own kernel is back


def test_torch_function_mode_is_detected():
    from torch.overrides import TorchFunctionMode

    assert not tc.torch_function_mode_active()
    with TorchFunctionMode():
        assert tc.torch_function_mode_active()


def test_cpu_has_an_autocast_device_index():
    assert isinstance(tc.autocast_device_index("cpu"), int)


def test_private_foreach_and_amp_ops():
    dst, src = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
    tc.foreach_copy_(dst, src)
    assert [d.tolist() for d in dst] == [[1, 1], [2, 2, 2]]
    tc.foreach_mul_(dst, 0.5)
    assert [d.tolist() for d in dst] == [[0.5, 0.5], [1, 1, 1]]
    found, inv = torch.zeros(()), torch.full((), 0.5)
    grads = [torch.ones(2), torch.full((2,), 4.0)]
    tc.amp_unscale_and_check_(grads, found, inv)
    assert found.item() == 0.0 and grads[1].tolist() == [2.0, 2.0]
    tc.amp_unscale_and_check_([torch.tensor([float("inf")])], found, inv)
    assert found.item() == 1.0


def test_scaled_mm_is_there():
    assert callable(torch._scaled_mm)
    if not torch.cuda.is_available():
        pytest.skip("fp8 matmul runs on CUDA")
    a = torch.randn(16, 16, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(16, 16, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    out = tc.scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    torch.testing.assert_close(out, a.float() @ b.float(), atol=0.5, rtol=0.1)


# --- autograd ----------------------------------------------------------------------
def test_graph_task_node_and_engine_callbacks_inside_backward():
    assert tc.current_graph_task_id() == -1
    assert tc.current_autograd_node() is None
    seen: dict[str, object] = {}
    ended = []

    def hook(grad):
        seen["task"] = tc.current_graph_task_id()
        seen["node"] = tc.current_autograd_node()
        tc.autograd_engine().queue_callback(lambda: ended.append(tc.current_graph_task_id()))
        return grad

    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    assert seen["task"] != -1 and seen["node"] is not None
    assert len(ended) == 1  # ran once, when the backward pass ended


# --- modules -------------------------------------------------------------------------
def test_global_forward_hook_dicts_are_consulted_by_module_call():
    calls = []

    def pre(module, args):
        calls.append("pre")

    def post(module, args, output):
        calls.append("post")

    reg = nn.modules.module
    handle_pre = reg.register_module_forward_pre_hook(pre)
    handle_post = reg.register_module_forward_hook(post, always_call=True)
    pre_id, post_id = handle_pre.id, handle_post.id
    pres, posts, always = tc.forward_hook_dicts()
    assert pres[pre_id] is pre and posts[post_id] is post
    assert tc.can_reinstall_global_forward_hooks() and always[post_id]
    lin = nn.Linear(2, 2)
    try:
        lin(torch.ones(1, 2))
        assert calls == ["pre", "post"]
        tc.remove_global_forward_hooks(pre_id, post_id)
        lin(torch.ones(1, 2))
        assert calls == ["pre", "post"]  # gone: module calls take the path without them
        tc.reinstall_global_forward_hooks(pre_id, pre, post_id, post)
        with pytest.raises(RuntimeError):
            lin(torch.ones(1, 3))  # a forward that raises still runs the always-called hook
        assert calls == ["pre", "post", "pre", "post"]
    finally:
        tc.remove_global_forward_hooks(pre_id, post_id)
    assert pre_id not in pres and post_id not in posts and post_id not in always


def test_module_hook_dicts_hold_the_registered_hooks():
    lin = nn.Linear(2, 2)
    calls = []
    h1 = lin.register_forward_pre_hook(lambda m, a, k: calls.append("pre") or None, with_kwargs=True)
    h2 = lin.register_forward_hook(lambda m, a, o: calls.append("post"), always_call=True)
    dicts = tc.module_hook_dicts(lin)
    assert h1.id in dicts.pre and dicts.pre_with_kwargs.get(h1.id)
    assert h2.id in dicts.post and dicts.post_always_called.get(h2.id)
    assert tc.forward_pre_hooks_of(lin) is dicts.pre
    assert tc.forward_pre_hooks_with_kwargs(lin) is dicts.pre_with_kwargs
    lin(torch.ones(1, 2))
    assert calls == ["pre", "post"]
    del dicts.pre[h1.id], dicts.post[h2.id]
    dicts.pre_with_kwargs.pop(h1.id)
    dicts.post_always_called.pop(h2.id)
    lin(torch.ones(1, 2))
    assert calls == ["pre", "post"]


def test_submodules_of_lists_direct_children():
    a, b = nn.Linear(1, 1), nn.ReLU()
    seq = nn.Sequential(a, nn.Sequential(b))
    children = tc.submodules_of(seq)
    assert children[0] is a and isinstance(children[1], nn.Sequential) and len(children) == 2


def test_compiled_wrappers_expose_what_they_wrap():
    model = nn.Linear(2, 2)
    assert tc.compiled_module_inner(torch.compile(model)) is model
    assert tc.compiled_module_inner(model) is None

    def fn(x):
        return x + 1

    assert tc.compiled_function_inner(torch.compile(fn)) is fn
    assert tc.compiled_function_inner(fn) is None


def test_class_swap_of_linear_keeps_parameters_and_state_dict_keys():
    class Doubled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    lin = nn.Linear(3, 2)
    params = {n: p for n, p in lin.named_parameters()}
    keys = list(lin.state_dict())
    x = torch.randn(1, 3)
    ref = lin(x)
    tc.swap_module_class(lin, Doubled)
    assert type(lin) is Doubled
    assert {n: p for n, p in lin.named_parameters()} == params
    assert all(p is params[n] for n, p in lin.named_parameters())
    assert list(lin.state_dict()) == keys
    torch.testing.assert_close(lin(x), ref * 2)
    tc.swap_module_class(lin, nn.Linear)
    torch.testing.assert_close(lin(x), ref)


# --- parallel_apply replica threads --------------------------------------------------
def test_parallel_apply_workers_are_recognised(monkeypatch):
    from torch.nn.parallel import parallel_apply

    acc = torch.accelerator
    monkeypatch.setattr(acc, "is_available", lambda: True)
    monkeypatch.setattr(acc, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(acc, "current_stream", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(acc, "device_index", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)  # torch < 2.10 asks CUDA
    found = []

    class Probe(nn.Module):
        def forward(self, x):
            found.append((tc.is_parallel_apply_worker(), tc.parallel_apply_worker_module()))
            return x

    mods = [Probe(), Probe()]
    parallel_apply(mods, [(torch.ones(1),), (torch.ones(1),)], devices=[-1, -1])
    assert sorted(id(m) for _, m in found) == sorted(id(m) for m in mods)
    assert all(worker for worker, _ in found)
    assert not tc.is_parallel_apply_worker() and tc.parallel_apply_worker_module() is None
    other = threading.Thread(target=lambda: found.append((tc.is_parallel_apply_worker(), None)))
    other.start()
    other.join()
    assert found[-1][0] is False


def test_replicate_marks_replicas_that_share_hook_dicts():
    replica = nn.Linear(2, 2)
    assert not tc.is_dataparallel_replica(replica)
    if not torch.cuda.is_available():
        pytest.skip("torch.nn.parallel.replicate needs a CUDA device")
    from torch.nn.parallel import replicate

    model = nn.Linear(2, 2).cuda()
    (copy,) = replicate(model, [0])
    assert tc.is_dataparallel_replica(copy)
    assert tc.forward_pre_hooks_of(copy) is tc.forward_pre_hooks_of(model)


# --- torch.compile (dynamo) ----------------------------------------------------------
class _Counting:
    """A torch.compile backend that counts compiles and keeps the graphs."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm.graph)
        return gm.forward


@pytest.fixture
def dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


def test_a_marked_constant_runs_at_trace_time_only(dynamo):
    runs = []

    def decide():
        runs.append(1)
        return 3

    tc.mark_trace_constant(decide)

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return x * decide()

    assert f(torch.ones(1)).item() == 3 and f(torch.ones(1)).item() == 3
    assert len(runs) == 1


def test_run_outside_dynamo_runs_eagerly_at_a_graph_break(dynamo):
    runs = []
    eager = tc.run_outside_dynamo(lambda: runs.append(torch.compiler.is_compiling()))

    @torch.compile(backend="eager")
    def f(x):
        eager()
        return x + 1

    f(torch.ones(1))
    f(torch.ones(1))
    assert runs == [False, False]


class _Key:
    value = "a"


KEY = _Key()


def test_the_trace_tx_guards_on_a_module_attribute_and_marks_the_graph(dynamo):
    from ampkit.casting import engine  # defines the marker op ampkit uses

    marker = torch.ops.ampkit.casting_decisions.default
    seen = []

    def at_trace():
        tx = tc.current_trace_tx()
        seen.append(tx is not None)
        tc.guard_attr_equals(tx, __name__, "KEY", "value")
        assert tc.add_graph_marker(tx.output, marker, f"key={KEY.value}")
        assert tc.add_graph_marker(tx.output, marker, f"key={KEY.value}")  # once per graph
        return 0

    tc.mark_trace_constant(at_trace)
    backend = _Counting()

    @torch.compile(backend=backend, fullgraph=True)
    def f(x):
        return x + at_trace()

    assert tc.current_trace_tx() is None
    f(torch.ones(1))
    f(torch.ones(1))
    assert seen == [True] and len(backend.graphs) == 1
    KEY.value = "b"
    try:
        f(torch.ones(1))
    finally:
        KEY.value = "a"
    assert len(backend.graphs) == 2  # the guard saw the attribute change
    marks = [[n.args for n in g.nodes if n.target is marker] for g in backend.graphs]
    assert marks == [[("key=a",)], [("key=b",)]]
    assert engine.GRAPH_MARKER is marker


def test_skipped_code_is_never_compiled(dynamo):
    backend = _Counting()

    def f(x):
        return x * 2

    tc.skip_code_in_dynamo(f.__code__)
    assert tc.dynamo_loaded()
    torch.compile(f, backend=backend)(torch.ones(1))
    assert backend.graphs == []


def test_compiled_code_cache_is_readable_and_resettable(dynamo):
    backend = _Counting()

    def f(x):
        return x + 1

    cf = torch.compile(f, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cf(torch.ones(1))
    assert tc.compiled_frames_ok()
    entries = dict(tc.compiled_code_entries())[f.__code__]
    assert len(entries) == 1
    assert tc.global_autocast_enabled_in_guard(entries[0], "cpu") is True
    assert not tc.guards_name(entries[0], "_state.compile_key")
    cf(torch.ones(1))  # autocast off: the global-state guard fails, compiled again
    entries = dict(tc.compiled_code_entries())[f.__code__]
    assert sorted(tc.global_autocast_enabled_in_guard(p, "cpu") for p in entries) == [False, True]
    lock = tc.dynamo_compile_lock()
    with lock:
        tc.reset_compiled_code(f.__code__)
    assert dict(tc.compiled_code_entries()).get(f.__code__, []) == []
    n = len(backend.graphs)
    cf(torch.ones(1))
    assert len(backend.graphs) == n + 1


def test_pytree_helpers():
    leaves, _ = tc.tree_flatten({"a": [1, (2, 3)], "b": 4})
    assert sorted(leaves) == [1, 2, 3, 4]
    assert tc.tree_map(lambda v: v * 2, [1, (2,)]) == [2, (4,)]


def test_own_parameters_buffers_and_children_are_replaced_in_place():
    bn = nn.BatchNorm1d(2)
    assert set(tc.own_parameters(bn)) == {"weight", "bias"}
    lin = nn.Linear(2, 2, bias=False)
    assert tc.own_parameters(lin)["bias"] is None  # kept as None, unlike named_parameters
    keys = list(bn.state_dict())
    half = bn.running_mean.half()
    tc.replace_buffer(bn, "running_mean", half)
    assert bn.running_mean is half and list(bn.state_dict()) == keys
    seq = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
    new = nn.Tanh()
    tc.replace_child(seq, "0", new)
    assert seq[0] is new and list(dict(seq.named_children())) == ["0", "1"]


def test_wrappers_insert_the_path_parts_name_rules_drop():
    from torch.utils.checkpoint import checkpoint  # noqa: F401 - the wrapper's module

    inner = nn.Sequential(nn.Linear(1, 1))
    outer = nn.Sequential()
    outer.add_module("block", torch.compile(inner))
    names = [n for n, _ in outer.named_modules()]
    assert "block._orig_mod" in names and "_orig_mod" in tc.WRAPPER_PATH_PARTS
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = nn.Sequential()
    wrapped.add_module("block", checkpoint_wrapper(nn.Linear(1, 1)))
    assert "block._checkpoint_wrapped_module" in [n for n, _ in wrapped.named_modules()]
    assert "_checkpoint_wrapped_module" in tc.WRAPPER_PATH_PARTS


def test_kernel_site_names_where_the_kernel_of_a_key_was_registered():
    assert "autocast_mode.cpp" in tc.kernel_site("aten::mm", "AutocastCPU")  # torch's own
    assert tc.kernel_site("aten::relu", "AutocastCPU") is None  # the key's fallthrough
    lib = torch.library.Library("aten", "IMPL")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("relu", lambda x: x, "AutocastCPU")
    try:
        assert __file__ in tc.kernel_site("aten::relu", "AutocastCPU")
    finally:
        tc.destroy_library(lib)
    assert tc.kernel_site("aten::relu", "AutocastCPU") is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_the_composite_unscale_and_check_computes_what_the_fused_kernel_does(dtype, bad):
    """CUDA's fused kernel has no bf16 (NotImplementedError at the first O3/O2K bf16 step
    on an H200): those grads take the foreach composite. It must flag exactly what the
    fused kernel flags and leave the same values, inf/NaN in their places."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g).to(dtype), torch.randn(700, generator=g).to(dtype)]
    if bad is not None:
        grads[1][3] = bad
    fused, composite = [t.clone() for t in grads], [t.clone() for t in grads]
    found_f, found_c, inv = torch.zeros(()), torch.zeros(()), torch.full((), 0.25)
    torch._amp_foreach_non_finite_check_and_unscale_(fused, found_f, inv)
    tc.unscale_and_check_composite_(composite, found_c, inv)
    assert found_c.item() == found_f.item() == (0.0 if bad is None else 1.0)
    for a, b in zip(fused, composite):
        assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    found_c.fill_(1.0)  # a flag already set stays set
    tc.unscale_and_check_composite_([torch.ones(3, dtype=dtype)], found_c, inv)
    assert found_c.item() == 1.0


def test_unscale_and_check_sends_dtypes_the_device_kernel_lacks_to_the_composite(monkeypatch):
    """A device whose kernel lacks a dtype (CUDA and bf16, stood in for here by taking
    bf16 off the CPU's list): mixed lists are split, both halves checked and unscaled."""
    monkeypatch.setitem(tc.FUSED_CHECK_DTYPES, "cpu", frozenset({torch.float32}))
    called = []
    real = tc.unscale_and_check_composite_
    # patched where amp_unscale_and_check_ looks it up: its own module of the package
    monkeypatch.setattr(tc.ops, "unscale_and_check_composite_", lambda *a: (called.append(a[0]), real(*a)))
    grads = [torch.full((4,), 2.0), torch.full((4,), 2.0, dtype=torch.bfloat16)]
    grads[1][0] = float("inf")
    found = torch.zeros(())
    tc.amp_unscale_and_check_(grads, found, torch.full((), 0.5))
    assert found.item() == 1.0 and len(called) == 1 and called[0][0].dtype == torch.bfloat16
    assert torch.equal(grads[0], torch.ones(4)) and grads[1][1:].eq(1).all()


def test_private_base_classes_are_the_bases_of_torchs_layers():
    assert all(issubclass(c, tc.BATCH_NORM_BASE) for c in (nn.BatchNorm1d, nn.BatchNorm2d, nn.SyncBatchNorm))
    assert all(issubclass(c, tc.INSTANCE_NORM_BASE) for c in (nn.InstanceNorm1d, nn.InstanceNorm3d))
    assert issubclass(nn.ConvTranspose2d, tc.CONV_TRANSPOSE_BASE) and not issubclass(nn.Conv2d, tc.CONV_TRANSPOSE_BASE)


def test_sparse_values_and_tensor_hooks():
    t = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 3.0]), (4,)).coalesce()
    assert torch.equal(tc.sparse_values(t), torch.tensor([1.0, 3.0]))
    p = nn.Parameter(torch.zeros(2))
    assert tc.tensor_hooks_of(p) == {}
    p.register_hook(lambda g: g)
    assert len(tc.tensor_hooks_of(p)) == 1


def test_optimizer_and_scheduler_markers_are_the_ones_torch_reads():
    """``_opt_called`` silences the scheduler's "step before optimizer.step()" warning;
    ``_wrapped_by_lr_sched`` is what a scheduler leaves on the step it wrapped; fused
    kernels run on CUDA; ``_step_supports_amp_scaling`` is what GradScaler checks."""
    import warnings

    assert "cuda" in tc.fused_optimizer_devices()
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    assert tc.step_wrapped_by_lr_scheduler(opt.step)
    tc.mark_optimizer_stepped(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()  # no "lr_scheduler.step() before optimizer.step()" warning
    def step():
        return None
    assert not tc.step_wrapped_by_lr_scheduler(step)
    tc.mark_step_wrapped_by_lr_scheduler(step)
    assert tc.step_wrapped_by_lr_scheduler(step)
    tc.mark_step_supports_amp_scaling(opt)
    assert getattr(opt, "_step_supports_amp_scaling", False) is True


def test_step_hooks_are_the_dicts_torchs_step_wrapper_runs():
    """The optimizer's own step hooks are listed in order, and suspending them makes
    ``optimizer.step`` run none of them (torch's ``profile_hook_step`` reads those
    dicts); hooks come back afterwards, and one registered meanwhile is kept."""
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=0.1)
    calls: list[str] = []
    first = opt.register_step_pre_hook(lambda o, a, k: calls.append("pre1"))
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre2"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    pre, post = tc.optimizer_step_hooks(opt)
    assert len(pre) == 2 and len(post) == 1
    opt.step()
    assert calls == ["pre1", "pre2", "post"]
    calls.clear()
    with tc.instance_step_hooks_suspended(opt):
        opt.step()
        opt.register_step_post_hook(lambda o, a, k: calls.append("late"))
    assert calls == []
    opt.step()
    assert calls == ["pre1", "pre2", "post", "late"]
    first.remove()  # handles made before the suspension still remove their hook
    calls.clear()
    opt.step()
    assert calls == ["pre2", "post", "late"]


def test_no_ddp_module_is_active_outside_a_ddp_forward_and_the_cpu_answers_for_16_bits():
    assert tc.active_ddp_module() is None
    for dtype in (torch.bfloat16, torch.float16):
        assert tc.cpu_has_native_16bit(dtype) in (True, False, None)


def test_the_release_constant_and_what_is_branched_on_it():
    assert tc.release_of("2.11.0+cu130") == (2, 11) and tc.release_of("2.16.0a0+git1234") == (2, 16)
    assert tc.TORCH_RELEASE == tc.release_of(torch.__version__)
    assert tc.GRAPH_AUTOCAST_SWITCHES == (tc.TORCH_RELEASE >= (2, 12))
    assert tc.tracing_for_compile() is False  # eager
    seen = []

    @torch.compile(backend="eager")
    def f(x):
        seen.append(tc.tracing_for_compile())  # dynamo runs this at trace time
        return x + 1

    f(torch.ones(2))
    assert seen and all(seen)


def test_a_torch_that_cannot_switch_autocast_in_a_graph_is_warned_about_once(monkeypatch, caplog):
    """Before 2.12, dynamo graph-breaks on torch.set_autocast_*: a cast model traced
    inside a compiled function then switches its scope across graph breaks, and ampkit
    says so once (here the older torch is stood in for by the flag)."""
    import logging

    import ampkit as amp

    monkeypatch.setattr(tc, "GRAPH_AUTOCAST_SWITCHES", False)
    tc.warn_no_graph_switches.cache_clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    model, _ = amp.initialize(model, None, opt_level="O2")

    @torch.compile(backend="eager")
    def run(x):
        return model(x)

    with caplog.at_level(logging.WARNING, logger="ampkit"):
        run(torch.randn(3, 4))
        run(torch.randn(3, 4))
    said = [r for r in caplog.records if "cannot switch autocast inside a compiled graph" in r.getMessage()]
    assert len(said) == 1
    tc.warn_no_graph_switches.cache_clear()
    amp.reset()


def test_flatten_dense_joins_in_logical_order_and_unflatten_copies_back():
    """The update kernels' batch path: one flat tensor of several (a channels-last one
    included) in each one's logical order, and views of it shaped as they are, which
    foreach_copy_ writes back into the originals' own layouts."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(3, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g).to(memory_format=torch.channels_last),
          torch.randn(5, generator=g).to(torch.bfloat16).float()]  # fmt: skip
    flat = tc.flatten_dense(ts)
    assert flat.dim() == 1 and torch.equal(flat, torch.cat([t.reshape(-1) for t in ts]))
    views = tc.unflatten_dense(flat * 2, ts)
    assert [v.shape for v in views] == [t.shape for t in ts]
    want = [t * 2 for t in ts]
    tc.foreach_copy_(ts, list(views))
    assert all(torch.equal(t, w) for t, w in zip(ts, want))
    assert ts[1].is_contiguous(memory_format=torch.channels_last)


# --- fake tensors: told apart before their storage is read -------------------------------
FAKE_WALK = r"""
import gc, warnings, torch
torch.set_num_threads(1)
from ampkit._internal import torch_compat as tc
from ampkit.tools.bench.memory import live_tensor_bytes, storage_ptrs

@torch.compile(backend="aot_eager")
def f(x):
    return (x * 2).sin()

f(torch.randn(8))  # a compile leaves fake tensors alive in its caches
from torch._subclasses.fake_tensor import FakeTensorMode

with FakeTensorMode():
    kept = torch.randn(3)  # and one held here, for sure
fakes = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and tc.is_fake_tensor(o)]
assert kept in fakes and not tc.is_fake_tensor(torch.ones(1)), len(fakes)
real = torch.ones(1024)
with warnings.catch_warnings():
    warnings.simplefilter("error")  # any warning, of torch's or ours, fails the walk
    alive = live_tensor_bytes(torch.device("cpu"))
    ptrs = storage_ptrs([kept, real])
assert alive >= real.nbytes and ptrs == {real.untyped_storage().data_ptr()}, (alive, ptrs)
# the warning the walk kept away is live in this process: reading a fake's pointer gives it
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    kept.untyped_storage().data_ptr()
assert any("data pointer of FakeTensor" in str(w.message) for w in seen), [str(w.message) for w in seen]
print("ok")
"""


def test_the_memory_walk_skips_fake_tensors_and_warns_nothing():
    """``ampkit bench``'s memory count walks every live tensor; after a compile some are
    FakeTensors, whose storage pointer warns (torch 2.15: "Accessing the data pointer of
    FakeTensor is deprecated", once per bench worker). ``is_fake_tensor`` tells them apart
    first: the walk runs with warnings as errors. A fresh interpreter, since torch warns
    once per process: the last check proves the fake was there to warn."""
    import os
    import subprocess
    import sys

    from locations import ROOT

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", FAKE_WALK], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout[-2000:] + proc.stderr[-3000:]
