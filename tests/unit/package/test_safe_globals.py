"""A model saved whole (``torch.save(model)``) after ampkit touched it loads with plain
``torch.load(f)`` (torch's default ``weights_only=True``) wherever the same model
would at fp32: at O2, O3, O2K, with fp8 layers, converted, and through the apex
compat layer. The loads run in fresh interpreters, as a user's would."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import ampkit as amp

# the model's own classes: torch allows no nn.Module by default, at fp32 either
TORCH_CLASSES = "[nn.Sequential, nn.Linear, nn.LayerNorm, nn.ReLU, nn.BatchNorm1d, nn.Identity]"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 16)
    )


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 16))
    m[1].running_mean.uniform_(-1, 1)
    m[1].running_var.uniform_(0.5, 2)
    return m.eval()


def _trained(level: str, **kwargs) -> nn.Module:
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = amp.initialize(m, opt, opt_level=level, **kwargs)
    x = torch.randn(4, 16)
    with amp.scale_loss(m(x).float().square().mean(), opt) as s:
        s.backward()
    opt.step()
    return m


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whole-models")
    files = {}

    def save(name, model):
        files[name] = folder / f"{name}.pt"
        torch.save(model, files[name])

    save("fp32", _mlp())
    for level in ("O2", "O3", "O2K"):
        save(level, _trained(level))
        amp.reset()
    for level in ("O1", "O2"):
        for scaling in ("current", "delayed"):
            m = _trained(level, fp8=amp.Fp8Recipe(min_features=16, scaling=scaling))
            assert type(m[3]).__name__ == "Float8Linear"
            save(f"fp8-{level}-{scaling}", m)
            amp.reset()
    # a file written by 0.3, where fp8 was one module: its classes pickled as
    # ampkit.levels.fp8.<name>, today a package exporting them from its modules
    m = _trained("O2", fp8=amp.Fp8Recipe(min_features=16, scaling="delayed"))
    classes = (amp.fp8.Float8Linear, amp.fp8.LayerState, amp.fp8.TensorScale, amp.Fp8Recipe)
    homes = [c.__module__ for c in classes]
    try:
        for c in classes:
            c.__module__ = "ampkit.levels.fp8"
        save("fp8-O2-delayed-0.3", m)
    finally:
        for c, home in zip(classes, homes):
            c.__module__ = home
    amp.reset()
    assert b"ampkit.levels.fp8\nFloat8Linear" in files["fp8-O2-delayed-0.3"].read_bytes()
    assert b"ampkit.levels.fp8.layer\nFloat8Linear" in files["fp8-O2-delayed"].read_bytes()
    calib = [torch.randn(8, 16, generator=torch.Generator().manual_seed(1))]
    converted = amp.convert(_bn_model(), calib=calib, budget=0.5)
    assert converted.ampkit_report.folds and converted.ampkit_report.budget is not None
    save("converted-bf16", converted)
    save("converted-fp16", amp.convert(_mlp().eval(), dtype=torch.float16, keep_fp32=["3"]))
    from ampkit.compat.apex import amp as apex_amp

    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = apex_amp.initialize(m, opt, opt_level="O2", verbosity=0)
    save("apex-O2", m)
    amp.reset()
    return files


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240)


def test_every_ampkit_global_in_a_whole_model_pickle_is_allowed(saved):
    """The only globals torch.load refuses are the model's own torch classes, the same
    as for the fp32 model: no ampkit class, no function, nothing from builtins or
    functools (a converted model's hooks are objects, not partials or bound methods)."""
    fp32 = set(torch.serialization.get_unsafe_globals_in_checkpoint(saved["fp32"]))
    assert fp32 and all(g.startswith("torch.nn.modules.") for g in fp32)
    for name, path in saved.items():
        left = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        assert not {g for g in left if not g.startswith("torch.nn.modules.")}, (name, left)


def test_plain_torch_load_in_a_fresh_process_equals_the_unrestricted_load(saved):
    paths = {k: str(v) for k, v in saved.items()}
    result = _fresh(f"""
        import json, torch
        from torch import nn
        import ampkit
        import ampkit.compat.apex  # the apex model's script imported it too
        torch.serialization.add_safe_globals({TORCH_CLASSES})
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
        out = {{}}
        for name, path in {paths!r}.items():
            safe = torch.load(path)  # weights_only=True, torch's default
            full = torch.load(path, weights_only=False)
            hooks = lambda m: [[type(h).__name__ for h in d.values()] for sub in m.modules()
                               for d in (sub._forward_pre_hooks, sub._forward_hooks, sub._state_dict_hooks)]
            with torch.no_grad():
                a, b = safe.eval()(x), full.eval()(x)
            out[name] = {{
                "bitwise": a.dtype == b.dtype and torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                                                              b.view(torch.int16 if b.element_size() == 2 else torch.int32)),
                "dtype": str(a.dtype),
                "hooks": hooks(safe) == hooks(full),
                "n_hooks": sum(map(len, hooks(safe))),
                "params": [str(p.dtype) for p in safe.parameters()] == [str(p.dtype) for p in full.parameters()],
                "classes": [type(m).__name__ for m in safe.modules()],
                "report": type(getattr(safe, "ampkit_report", None)).__name__,
            }}
        print(json.dumps(out))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(out) == set(saved)
    for name, r in out.items():
        assert r["bitwise"] and r["hooks"] and r["params"], (name, r)
        if name != "fp32" and not name.startswith("fp8-O1"):
            assert r["n_hooks"] > 0, name  # the casts came back with the model
    assert out["O2"]["dtype"] == "torch.float32"  # the cast hooks run: fp32 out of a bf16 model
    assert "Float8Linear" in out["fp8-O2-delayed"]["classes"]
    assert "Float8Linear" in out["fp8-O2-delayed-0.3"]["classes"]
    assert out["converted-bf16"]["report"] == "ConversionReport"


def test_without_importing_ampkit_the_load_names_the_ampkit_class(saved):
    """The weights-only unpickler never imports a module: a process that did not
    import ampkit is told which class is missing, and ampkit is not imported behind
    its back."""
    result = _fresh(f"""
        import sys, torch
        from torch import nn
        torch.serialization.add_safe_globals({TORCH_CLASSES})
        try:
            torch.load({str(saved["O2"])!r})
        except Exception as exc:
            print(type(exc).__name__, "ampkit" in sys.modules)
            print(str(exc))
    """)
    first, rest = result.stdout.split("\n", 1)
    assert first == "UnpicklingError False", result.stdout + result.stderr
    assert "Unsupported global: GLOBAL ampkit." in rest


def test_only_ampkit_classes_are_allowed_and_nothing_callable_beyond_them():
    from ampkit import safe_globals

    classes = safe_globals.safe_classes(list(safe_globals.SAFE_GLOBALS))
    assert len(classes) == sum(map(len, safe_globals.SAFE_GLOBALS.values()))
    for cls in classes:
        assert isinstance(cls, type) and cls.__module__ in safe_globals.SAFE_GLOBALS, cls
    allowed = set(torch.serialization.get_safe_globals())
    assert set(safe_globals.safe_classes()) <= allowed
    from torch import _weights_only_unpickler as wou

    def load(data: bytes):
        return wou.Unpickler(io.BytesIO(data)).load()

    # functions of the same modules (and attributes of allowed classes) stay refused
    for path in (b"ampkit.levels.model_cast\ncast_tensors", b"ampkit.levels.model_cast\nCastInputs.__call__",
                 b"ampkit.levels.model_cast\ntorch", b"ampkit.inference.conversion\n_cast_inputs",
                 # 0.2's paths of the same (its classes are allowed under them too)
                 b"ampkit.model\ncast_tensors", b"ampkit.model\nCastInputs.__call__", b"ampkit.convert\n_cast_inputs",
                 b"functools\npartial"):
        with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
            load(b"\x80\x02c" + path + b"\n.")
    # an allowed class rebuilt with hostile state is inert data: its hook raises, runs nothing
    hook = load(pickle.dumps(amp.levels.model_cast.CastInputs(torch.bfloat16), protocol=2))
    assert isinstance(hook, amp.levels.model_cast.CastInputs) and hook.dtype is torch.bfloat16
    hostile = amp.levels.model_cast.CastInputs(torch.bfloat16)
    hostile.dtype = "os.system('touch /tmp/pwned')"
    loaded = load(pickle.dumps(hostile, protocol=2))
    with pytest.raises((TypeError, RuntimeError)):
        loaded(nn.Identity(), (torch.ones(2),), {})
