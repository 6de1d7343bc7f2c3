"""Files written by ampkit 0.2 (tests/support/fixtures/v0_2, written by its make_fixtures.py at
0.2's main) still load: whole models saved at O2/O3/O2K, with fp8 layers, converted or
set up through the apex compat layer (their pickles name 0.2's class paths, e.g.
``ampkit.levels.model_cast.CastInputs``), with torch.load's default ``weights_only=True`` and without
it; and a 0.2 training checkpoint resumes bitwise as the same run would continue today."""

from __future__ import annotations

import ampkit.compat.apex  # noqa: F401  (the apex model's script imported it too)
import pytest
import torch
from locations import FIXTURES, load_file
from torch import nn

import ampkit as amp

HERE = FIXTURES / "v0_2"
MODELS = ["model-O2", "model-O3", "model-O2K", "model-fp8-O2-delayed", "model-fp8-O1-current",
          "converted-bf16", "converted-fp16", "apex-O2"]
TORCH_CLASSES = [nn.Sequential, nn.Linear, nn.LayerNorm, nn.ReLU, nn.BatchNorm1d, nn.Identity]




@pytest.fixture(scope="module")
def expected():
    return torch.load(HERE / "expected.pt")


def _hooks(model: nn.Module) -> list[list[str]]:
    return [[f"{type(h).__module__}.{type(h).__qualname__}" for h in d.values()] for sub in model.modules()
            for d in (sub._forward_pre_hooks, sub._forward_hooks, sub._state_dict_hooks)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("name", MODELS)
def test_a_whole_model_written_by_0_2_loads_and_computes_as_it_did(name, expected):
    with torch.serialization.safe_globals(TORCH_CLASSES):
        safe = torch.load(HERE / f"{name}.pt")  # weights_only=True
    full = torch.load(HERE / f"{name}.pt", weights_only=False)
    x = expected["x"]
    with torch.no_grad():
        a, b = safe.eval()(x), full.eval()(x)
    want = expected["outputs"][name]
    assert a.dtype == b.dtype == want.dtype
    assert torch.equal(_bits(a), _bits(b))
    # the same weights on another CPU kind may round a 16-bit matmul differently
    tol = {torch.float32: 2e-2, torch.bfloat16: 3e-2, torch.float16: 5e-3}[a.dtype]
    torch.testing.assert_close(a.float(), want.float(), rtol=tol, atol=tol)
    hooks = _hooks(safe)
    assert hooks == _hooks(full)
    # what came back are today's classes, wherever they now live
    assert all(h.startswith("ampkit.") for hs in hooks for h in hs)
    if name != "model-fp8-O1-current":
        assert sum(map(len, hooks)) > 0
    if name.startswith("model-fp8"):
        assert any(type(m) is amp.fp8.Float8Linear for m in safe.modules())
    if name.startswith("converted"):
        assert type(safe.ampkit_report) is amp.ConversionReport


@pytest.mark.parametrize("level", ["O2", "O2K"])
def test_a_0_2_checkpoint_resumes_bitwise_as_the_same_run_continues_today(level, tmp_path):
    """0.2's checkpoint of 3 steps, loaded into fresh objects and stepped twice, equals
    today's uninterrupted 5 steps of the same run.

    CPU-dependent, and said so: the file was written on the CPU that made the fixtures;
    O2K's update is compiled code whose rounding follows the vector ISA, so today's 3 steps
    reproduce the file bit for bit only on a CPU of the same kind. Where they do not,
    the test still asserts what holds everywhere: the loaded state is the file's bit for
    bit, and resuming is deterministic (two resumes continue identically)."""
    make = load_file(HERE / "make_fixtures.py", "v0_2_make_fixtures")
    dtype = torch.float16 if level == "O2" else torch.bfloat16
    ckpt = torch.load(HERE / f"checkpoint-{level}.pt")  # weights_only=True

    def more(m, opt, seed=4):
        g = torch.Generator().manual_seed(seed)
        for _ in range(2):
            xb = torch.randn(4, 16, generator=g)
            with amp.scale_loss(m(xb).float().square().mean(), opt) as s:
                s.backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in amp.master_params(opt)]

    def resume():
        # read anew: torch's Optimizer.load_state_dict keeps the given state tensors
        # (they are updated in place by the steps that follow)
        ckpt = torch.load(HERE / f"checkpoint-{level}.pt")
        m = make.mlp()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m, opt = amp.initialize(m, opt, opt_level=level, dtype=dtype)
        m.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        amp.load_state_dict(ckpt["amp"])
        loaded = {k: v.clone() for k, v in m.state_dict().items()}
        return loaded, more(m, opt)

    try:
        m, opt = make.trained(level, steps=3, dtype=dtype)
        same_cpu_kind = all(torch.equal(v, ckpt["model"][k]) for k, v in m.state_dict().items())
        today = more(m, opt)
        amp.reset()
        loaded, resumed = resume()
        amp.reset()
        _, again = resume()
    finally:
        amp.reset()
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in loaded.items())
    assert len(today) == len(resumed) == len(again) == 8
    for a, b in zip(resumed, again):
        assert torch.equal(a, b)
    if level == "O2":  # no compiled update: every CPU reproduces the file
        assert same_cpu_kind
    if not same_cpu_kind:
        return  # this CPU's kernels round the 3 steps differently from the fixture's CPU
    for a, b in zip(today, resumed):
        assert a.dtype == b.dtype and (a.dtype == torch.float32 or level == "O2K")
        assert torch.equal(a, b)



def _fresh(code: str) -> str:
    import subprocess
    import sys
    import textwrap

    r = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:ampkit", "-c", textwrap.dedent(code)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_0_2_module_paths_give_todays_modules_and_never_rebind_a_function():
    """``import ampkit.model`` (0.2's path) warns and gives today's module object; the
    documented ``ampkit.compat.apex`` and ``ampkit.bench`` paths do not warn; importing
    0.2's ``ampkit.convert`` leaves ``ampkit.convert`` the function; no module of the
    package is named like a function of ``ampkit``."""
    out = _fresh("""
        import importlib, sys, warnings
        import ampkit
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import ampkit.model as old
        import ampkit.levels.model_cast as new
        print(old is new, [str(x.category.__name__) for x in w], "ampkit.levels.model_cast" in str(w[0].message))
        import ampkit.compat.apex, ampkit.bench.memory  # supported paths: -W error would raise on a warning
        print(ampkit.compat.apex is sys.modules["ampkit.tools.compat.apex"],
              sys.modules["ampkit.bench.memory"] is sys.modules["ampkit.tools.bench.memory"])
        import ampkit.convert as c
        print(callable(c) and c is ampkit.convert and type(ampkit.convert).__name__ == "function")
        print(sorted(n for n in ("convert", "explain", "doctor")
                     if importlib.util.find_spec("ampkit." + n) is not None and n != "convert"))
    """)
    lines = out.split("\n")
    assert lines[0] == "True ['DeprecationWarning'] True", out
    assert lines[1] == "True True", out
    assert lines[2] == "True", out
    assert lines[3] == "[]", out


#: what ampkit 0.2 put into pickled models: module path -> class names (0.2's allowlist)
PICKLED_BY_0_2 = {
    "ampkit.model": ("CastInputs", "CastOutputs", "EntryCasts", "EntryExit", "OpCastingEnter", "OpCastingExit"),
    "ampkit.levels": ("ResyncMasters",),
    "ampkit.grads": ("WatchDDP",),
    "ampkit.distributed": ("FSDPGuard",),
    "ampkit.fp8": ("Float8Linear", "LayerState", "TensorScale", "Fp8Recipe"),
    "ampkit.convert": ("_BoundaryInputs", "_BoundaryOutputs", "_IslandEnter", "_IslandExit", "_Fp32Island",
                       "ConversionReport", "ModuleDecision", "FoldRecord", "Budget", "OutputError"),
    "ampkit.compat.apex": ("Fp32StateDict",),
}
#: what ampkit 0.3 pickled under a module the class has left since
MOVED_SINCE_0_3 = {"ampkit.distributed.core": ("FSDPGuard",)}


def test_a_class_pickled_under_its_0_2_path_unpickles_as_todays_class():
    """Every class 0.2 pickled, named by its 0.2 path (and each class 0.3 pickled under a
    module it has left since): the full unpickler
    (``weights_only=False``) imports that path and gets today's class, and the
    weights-only unpickler allows it under that name."""
    import io
    import pickle
    import warnings

    from torch import _weights_only_unpickler as wou

    for old, names in {**PICKLED_BY_0_2, **MOVED_SINCE_0_3}.items():
        for name in names:
            data = b"\x80\x02c" + f"{old}\n{name}\n".encode() + b"."
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                got = pickle.load(io.BytesIO(data))
            assert got.__name__ == name and got.__module__.startswith("ampkit.") and got.__module__ != old, (old, name)
            assert wou.Unpickler(io.BytesIO(data)).load() is got, (old, name)
