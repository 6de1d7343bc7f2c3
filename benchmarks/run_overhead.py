"""``ampkit run --level O2`` against the same script edited to call ``amp.initialize``.

``ampkit run`` stands for code a user could write: ``amp.initialize(model, opt,
opt_level="O2")`` where the optimizer is built and ``amp.scale_loss`` around the
backward. What it adds besides (the forward scopes, the patches of torch, the per-step
bookkeeping of its report) should cost next to nothing, and the training should be
the same. This script measures both on a small nanoGPT-like training script it writes
to a temporary folder in two variants:

- ``plain.py``: a GPT-like character model (``--layers`` pre-norm blocks, d_model
  ``--d-model``, 4 heads, causal ``F.scaled_dot_product_attention``, 4x GELU MLP,
  learned positions, the head tied to the token embedding, the loss computed in
  ``forward``; sequence ``--seq``, batch ``--batch``, vocabulary 65), AdamW over two
  parameter groups (weight decay on the matrices only), nanoGPT's loop around a
  ``torch.amp.GradScaler`` that is off (``scaler.scale(loss).backward()``,
  ``scaler.unscale_(opt)``, ``clip_grad_norm_(model.parameters(), 1.0)``,
  ``scaler.step(opt)``, ``scaler.update()``), a warm-up + cosine ``LambdaLR``,
  ``--steps`` steps, ``torch.set_num_threads(1)``; run as ``ampkit run --level O2
  plain.py``;
- ``edited.py``: the same with ``model, opt = amp.initialize(model, opt,
  opt_level="O2")`` after the optimizer is built and ``with amp.scale_loss(loss, opt)
  as scaled: scaled.backward()`` for the backward; the rest (the scaler's calls, the
  clipping of ``model.parameters()``) as in ``plain.py``; run as ``python edited.py``.

Each script times itself: process CPU time (``time.process_time``) over its steps after
``--warmup`` untimed ones, and prints ``{"variant", "cpu_ms_per_step", "steps_timed",
"final_loss"}`` as JSON on its last line. The two arms (``run``, ``initialize``) run as
whole processes, interleaved (run, initialize, initialize, run, ...; ``--rounds``
rounds, one process of each arm per round), and the medians per arm are compared:
``run_over_initialize`` is ``run``'s time per step over ``initialize``'s (the target is
``<= 1.03``), ``speed`` its inverse; ``same_final_loss`` says whether the two arms
ended on the same loss, bit for bit (they train the same). ``--profile DIR`` runs each
arm once more with ``cProfile`` over its timed steps (``ARM.prof`` kept in ``DIR``) and
prints, per arm, the functions of ampkit and of the script with the most cumulative
time per step, and the functions whose own time per step differs most between the arms:
where ``ampkit run``'s extra time goes (the profiler slows Python more than torch's
C++: its times say where the time goes, not what a step costs). ``--json FILE`` writes
the machine record (CPU, its 16-bit flags, torch), ``cpu_kind`` (which of ``avx2``,
``avx512_bf16``, ``amx_bf16`` the CPU has), the settings, every process's figures, the
medians and the profile.

    python benchmarks/run_overhead.py [--rounds 4] [--steps 60] [--warmup 10] [--json out.json]
    python benchmarks/run_overhead.py --rounds 1 --profile /tmp/prof
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ampkit.tools.bench.machine import cpu_flags, write_record

ARMS = ("run", "initialize")
CPU_KINDS = ("amx_bf16", "avx2", "avx512_bf16")  # what decides a CPU's bf16 speed
TARGET = 1.03  # run's time per step over initialize's
TOP = 15  # functions per arm in a profile

SCRIPT = '''\
"""A nanoGPT-like character LM ({variant}): timed by process CPU time per step."""
import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
{imports}
torch.set_num_threads(1)
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--d-model", type=int, default=128)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--batch", type=int, default=8)
args = p.parse_args()
VOCAB, HEADS = 65, 4


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), Attention(d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers, d, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as nanoGPT
        for param in self.parameters():
            if param.dim() >= 2:
                nn.init.normal_(param, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB).float(), targets.view(-1))


torch.manual_seed(0)
words = ["the", "model", "trains", "in", "mixed", "precision", "and", "a", "step", "is", "fast"]
order = torch.randint(0, len(words), (4000,)).tolist()
text = " ".join(words[i] for i in order)
data = torch.tensor([ord(c) % VOCAB for c in text])
model = GPT(args.layers, args.d_model, args.seq)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{{"params": decay, "weight_decay": 0.1}}, {{"params": no_decay, "weight_decay": 0.0}}],
                        lr=3e-3, betas=(0.9, 0.95))
{setup}scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT's: on only for fp16
warm = max(1, args.steps // 10)
sched = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda i: (i + 1) / warm if i < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * (i - warm) / args.steps)))
gen = torch.Generator().manual_seed(1)
profiler = None
for step in range(args.steps):
    if step == args.warmup:
        if os.environ.get("RUN_OVERHEAD_PROFILE"):
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        start = time.process_time()
    ix = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
    x = torch.stack([data[i:i + args.seq] for i in ix.tolist()])
    y = torch.stack([data[i + 1:i + 1 + args.seq] for i in ix.tolist()])
    logits, loss = model(x, y)
{backward}    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    sched.step()
    opt.zero_grad(set_to_none=True)
timed = args.steps - args.warmup
cpu = time.process_time() - start
if profiler is not None:
    profiler.disable()
    profiler.dump_stats(os.environ["RUN_OVERHEAD_PROFILE"])
print(json.dumps({{"variant": "{variant}", "cpu_ms_per_step": cpu / timed * 1e3, "steps_timed": timed,
                  "final_loss": loss.item()}}))
'''

VARIANTS = {
    "plain": {"imports": "", "setup": "", "backward": "    scaler.scale(loss).backward()\n"},
    "edited": {
        "imports": "\nimport ampkit as amp\n",
        "setup": 'model, opt = amp.initialize(model, opt, opt_level="O2")\n',
        "backward": "    with amp.scale_loss(loss, opt) as scaled:\n        scaled.backward()\n",
    },
}


def write_scripts(folder: Path) -> dict[str, Path]:
    """Write ``plain.py`` and ``edited.py`` into ``folder``; returns their paths by variant."""
    paths = {}
    for variant, parts in VARIANTS.items():
        paths[variant] = folder / f"{variant}.py"
        paths[variant].write_text(SCRIPT.format(variant=variant, **parts))
    return paths


def command(arm: str, scripts: dict[str, Path], script_args: list[str]) -> list[str]:
    """The command line of one process of ``arm``."""
    if arm == "run":
        return [sys.executable, "-m", "ampkit", "run", "--level", "O2", str(scripts["plain"]), *script_args]
    return [sys.executable, str(scripts["edited"]), *script_args]


def run_arm(arm: str, scripts: dict[str, Path], script_args: list[str], profile: Path | None = None) -> dict[str, Any]:
    """One process of ``arm``: the figures its script printed on its last line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RUN_OVERHEAD_PROFILE", None)
    if profile is not None:
        env["RUN_OVERHEAD_PROFILE"] = str(profile)
    proc = subprocess.run(command(arm, scripts, script_args), capture_output=True, text=True, env=env, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"arm {arm} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def load_profile(path: Path, steps: int) -> dict[str, dict[str, float]]:
    """A ``cProfile`` dump as ``{function: {"calls", "own_ms", "cum_ms"}}`` per timed step;
    a function is named by its file (below ``site-packages``/``src`` where it lies
    there; the script's as ``SCRIPT``) and name, so both arms' profiles line up."""
    out: dict[str, dict[str, float]] = {}
    for (filename, _, name), (_, calls, own, cum, _) in pstats.Stats(str(path)).stats.items():  # type: ignore[attr-defined]
        where = filename.split("site-packages/")[-1].split("src/")[-1]
        if where.endswith(("plain.py", "edited.py")):
            where = "SCRIPT"
        row = out.setdefault(f"{where}({name})", {"calls": 0.0, "own_ms": 0.0, "cum_ms": 0.0})
        row["calls"] += calls / steps
        row["own_ms"] += own / steps * 1e3
        row["cum_ms"] = max(row["cum_ms"], cum / steps * 1e3)
    return out


def profile_rows(profiles: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Per arm its profiled time per step and the :data:`TOP` functions of ampkit and of
    the script by cumulative time; and the :data:`TOP` functions whose own time per step
    differs most between the arms (``run`` minus ``initialize``): where ``ampkit run``'s
    extra time goes."""
    out: dict[str, Any] = {}
    for arm, prof in profiles.items():
        mine = [{"function": f, **v} for f, v in prof.items() if "ampkit" in f or f.startswith("SCRIPT")]
        out[arm] = {"profiled_ms": sum(v["own_ms"] for v in prof.values()),
                    "top": sorted(mine, key=lambda r: -r["cum_ms"])[:TOP]}  # fmt: skip
    if set(ARMS) <= set(profiles):
        run, init = profiles["run"], profiles["initialize"]
        zero = {"calls": 0.0, "own_ms": 0.0, "cum_ms": 0.0}
        diff = [{"function": f, "own_ms": run.get(f, zero)["own_ms"] - init.get(f, zero)["own_ms"],
                 "calls_run": run.get(f, zero)["calls"], "calls_initialize": init.get(f, zero)["calls"]}
                for f in set(run) | set(init)]  # fmt: skip
        out["difference"] = sorted(diff, key=lambda r: -abs(r["own_ms"]))[:TOP]
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The interleaved rounds (and the profiles): every process's figures and the medians."""
    script_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--layers", str(args.layers),
                   "--d-model", str(args.d_model), "--seq", str(args.seq), "--batch", str(args.batch)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="run-overhead-") as tmp:
        scripts = write_scripts(Path(tmp))
        runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
        for r in range(args.rounds):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                runs[arm].append(run_arm(arm, scripts, script_args))
                print(f"round {r + 1} {arm:<10} {runs[arm][-1]['cpu_ms_per_step']:8.2f} ms/step", flush=True)
        profiles = {}
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            for arm in ARMS:
                path = args.profile / f"{arm}.prof"
                run_arm(arm, scripts, script_args, profile=path)
                profiles[arm] = load_profile(path, args.steps - args.warmup)
    medians = {arm: statistics.median(r["cpu_ms_per_step"] for r in runs[arm]) for arm in ARMS}
    ratio = medians["run"] / medians["initialize"]
    losses = {r["final_loss"] for arm in ARMS for r in runs[arm]}
    return {
        "cpu_kind": [f for f in CPU_KINDS if f in cpu_flags()],
        "arms": {arm: {"cpu_ms_per_step": medians[arm], "runs": runs[arm],
                       "final_loss": runs[arm][-1]["final_loss"]} for arm in ARMS},  # fmt: skip
        "run_over_initialize": ratio,
        "speed": 1 / ratio,
        "target": TARGET,
        "met": ratio <= TARGET,
        "same_final_loss": len(losses) == 1,
        "profile": profile_rows(profiles) if profiles else {},
    }


def print_profile(profile: dict[str, Any]) -> None:
    """The profile part of the result, as lines."""
    for arm in ARMS:
        if arm in profile:
            print(f"profile {arm}: {profile[arm]['profiled_ms']:.2f} ms/step profiled")
            for r in profile[arm]["top"]:
                print(f"  {r['cum_ms']:8.3f} ms cum {r['own_ms']:8.3f} ms own {r['calls']:7.1f} calls  {r['function']}")
    if "difference" in profile:
        print("profile run - initialize (own time per step):")
        for r in profile["difference"]:
            print(f"  {r['own_ms']:+8.3f} ms  calls {r['calls_run']:7.1f} vs {r['calls_initialize']:7.1f}  {r['function']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds, one process per arm each (default 4)")
    p.add_argument("--steps", type=int, default=60, help="training steps per process (default 60)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="also run each arm once under cProfile, keeping ARM.prof in DIR")
    p.add_argument("--json", metavar="FILE", help="also write the machine, the settings and the results to FILE")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.steps <= args.warmup:
        p.error("--rounds takes 1 or more, --warmup 0 or more, --steps more than --warmup")
    kind = ",".join(f for f in CPU_KINDS if f in cpu_flags()) or "-"
    print(f"torch={torch.__version__} cpu={kind}; {args.rounds} rounds of run (ampkit run "
          f"--level O2 plain.py) and initialize (edited.py), {args.steps} steps, {args.warmup} warm-up; "
          "process CPU time per step", flush=True)  # fmt: skip
    result = measure(args)
    for arm in ARMS:
        a = result["arms"][arm]
        print(f"{arm:<10} median {a['cpu_ms_per_step']:8.2f} ms/step   final loss {a['final_loss']:.6g}")
    print(f"run / initialize: {result['run_over_initialize']:.3f}x time per step ({result['speed']:.3f}x the speed); "
          f"target <= {TARGET:.2f}x {'met' if result['met'] else 'missed'}; "
          f"same final loss: {'yes' if result['same_final_loss'] else 'no'}")  # fmt: skip
    print_profile(result["profile"])
    if args.json:
        settings = {k: getattr(args, k) for k in ("rounds", "steps", "warmup", "layers", "d_model", "seq", "batch")}
        write_record(args.json, {"settings": settings, **result}, threads=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
