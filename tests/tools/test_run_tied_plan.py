"""Tuning plans for a GPT-2-style model whose output layer shares its weight with the
embedding inside a child container (``self.lm_head.weight = self.transformer.wte.weight``):
``ampkit run --plan`` at O2/O2K casts the model the script trains (the parent, not the
container that holds every parameter), so the plan's names match; and ``ampkit tune``
reports each confirming run that failed, with its error, in the plan it writes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ampkit.tools.cli.main import main

torch.set_num_threads(1)

GPT_SCRIPT = """
import json, sys, torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))

class GPT(nn.Module):
    def __init__(self, vocab=32, d=16, n=2):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), h=nn.ModuleList(Block(d) for _ in range(n)), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying

    def forward(self, idx):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

class Trainer(nn.Module):  # a script's own container: the model and a frozen copy of it
    def __init__(self):
        super().__init__()
        self.net = GPT()
        self.frozen = GPT().requires_grad_(False)

wrapped = "--wrapped" in sys.argv
holder = Trainer() if wrapped else None
model = holder.net if wrapped else GPT()
seen = {}
for name in ("transformer.h.0.fc", "transformer.h.1.proj"):
    model.get_submodule(name).register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, str(out.dtype)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.randint(0, 32, (64, 9), generator=torch.Generator().manual_seed(1))
for step in range(6):
    batch = data[(step % 4) * 16:(step % 4) * 16 + 16]
    loss = F.cross_entropy(model(batch[:, :-1]).float().reshape(-1, 32), batch[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
print("DTYPES", json.dumps(seen), str(model.transformer.h[0].fc.weight.dtype),
      str(model.transformer.h[1].proj.weight.dtype), model.lm_head.weight is model.transformer.wte.weight)
"""


def _plan(level: str) -> dict:
    """``transformer.h.0.fc`` lowered to bf16, ``transformer.h.1.proj`` kept fp32."""
    keep = {"name": "transformer.h.1.proj", "kind": "Linear", "dtype": "fp32", "fp32_ms": 1.0, "low_ms": 0.5,
            "loss_deviation": 0.1, "grad_deviation": 0.5, "reason": "test"}  # fmt: skip
    low = dict(keep, name="transformer.h.0.fc", dtype="bf16", loss_deviation=0.0, grad_deviation=0.0)
    return {"format": "ampkit-tune-plan", "version": 1, "dtype": "bf16", "level": level, "device_type": "cpu",
            "budget": 0.01, "modules": [low, keep], "skipped": {}, "predicted_deviation": 0.0, "probe": {},
            "backed_off": [], "seconds": 1.0}  # fmt: skip


@pytest.mark.parametrize("wrapped", [False, True], ids=["model", "model-in-a-container"])
@pytest.mark.parametrize("level", ["O2", "O2K"])
def test_a_plan_applies_to_a_model_whose_head_is_tied_to_its_embedding(level, wrapped, tmp_path, capsys):
    """The plan's modules run in their dtypes (the lowered one in bf16, the kept one in
    fp32, weights too), the tie holds, and the run reports the level asked for. In a
    container of the script's own (beside a frozen copy), the model is still found."""
    script = tmp_path / "train.py"
    script.write_text(GPT_SCRIPT)
    plan, report = tmp_path / "plan.json", tmp_path / "report.json"
    plan.write_text(json.dumps(_plan(level)))
    args = ["--wrapped"] if wrapped else []
    code = main(["run", "--plan", str(plan), "--report", str(report), str(script), *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("DTYPES"))
    seen, low_w, kept_w, tied = line.removeprefix("DTYPES ").rsplit(" ", 3)
    assert json.loads(seen) == {"transformer.h.0.fc": "torch.bfloat16", "transformer.h.1.proj": "torch.float32"}
    assert (low_w, kept_w, tied) == ("torch.bfloat16", "torch.float32", "True")
    doc = json.loads(report.read_text())
    assert doc["level_applied"] == level and doc["optimizers"][0]["managed"] == level


SWITCH_SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
for step in range(1000):
    if step == 2:  # warm up with SGD, then switch to AdamW
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    i = (step % 4) * 16
    loss = nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16])
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


PARTIAL_SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
params = [p for name, p in model.named_parameters() if not name.startswith("0.")]  # the first layer left out
opt = torch.optim.SGD(params, lr=0.05)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
for step in range(1000):
    i = (step % 4) * 16
    loss = nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16])
    loss.backward()
    opt.step()
    opt.zero_grad()
"""

FAILING = {
    # a second optimizer over the cast model: ampkit run refuses (exit 2)
    "optimizer-switch": (SWITCH_SCRIPT, "exited with code 2", "fp32 masters"),
    # a trainable layer left out of the optimizer: the run falls back to O1 (exit 0), whose
    # figures are not O2's
    "layer-left-out": (PARTIAL_SCRIPT, "ran at O1 instead", "trainable parameter"),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(FAILING))
def test_ampkit_tune_reports_each_failed_confirming_run_with_its_error(case, tmp_path, forked_tune_children):
    """The confirming runs at O2/O2K of these scripts fail (refused, or run at O1
    instead): the plan says so for each level, with the run's own words, in its report and
    its file, and is made from the runs that succeeded (fp32 and O1).

    ``max_seconds=0`` measures no module (each stays fp32, "not measured"), so the
    confirming runs are fp32's and everything lowered at O1, O2 and O2K: one run a level,
    each a child ``ampkit run`` whose failure is reported (a module plan would add a
    second run a level, failing alike, and measuring the modules decides nothing here)."""
    from ampkit import TunePlan
    from ampkit.tools.tune.script import tune_script

    text, how, words = FAILING[case]
    script = tmp_path / "train.py"
    script.write_text(text)
    plan = tune_script(script, steps=4, include_emulated=True, repeats=1, max_seconds=0.0, candidates=("bf16",))
    for level in ("O2", "O2K"):
        why = plan.skipped[level]
        assert why.startswith("a confirming run failed") and f"--level {level}" in why, why
        assert how in why and words in why, why
        assert f"not tried: {level}: a confirming run failed" in plan.report()
    assert plan.level in ("O0", "O1")
    assert math.isfinite(plan.probe["fp32_loss"]) and math.isfinite(plan.probe["all_O1_loss"])
    path = tmp_path / "plan.json"
    plan.save(path)
    assert TunePlan.load(path).skipped == plan.skipped
