"""Host time of a training step: ampkit's levels against torch's own AMP.

Where the device is fast and the model small, a step's time is the host's: Python,
kernel launches and the reads that wait for the device. On a CPU with tiny widths the
compute is negligible too, so the process's CPU time per step measures the same host
work; that is what this script times, in one process, on two workloads:

- ``tiny``: a 12-block pre-norm transformer LM (d_model 32, 4 heads, 4x GELU MLP,
  ``nn.LayerNorm``, causal ``F.scaled_dot_product_attention``, learned positions,
  an untied head; vocabulary 64, sequence 16, batch 4; 150 parameter tensors,
  157k parameters): a step is nearly all per-module and per-tensor host work;
- ``lm``: ``ampkit bench``'s char transformer (``make_workload("lm", size)``, size
  ``tiny`` unless ``--lm-size`` says otherwise) on its example batch.

Arms, each a fresh model from the same seed, AdamW, the loss the cross-entropy of the
logits in fp32; compute dtype bf16 on the CPU, fp16 on CUDA:

==============  ======================================================================
arm             what a step runs
==============  ======================================================================
``torch_amp``   ``torch.autocast`` around forward and loss, ``torch.amp.GradScaler``,
                ``AdamW(fused=True)``: the reference of every ratio
``pure16``      the model in bf16 (``model.to(torch.bfloat16)``),
                ``AdamW(fused=True)``, no scaler
``O1_init``     ``amp.init(dtype)``, ``amp.init_trainer(AdamW)``, ``amp.scale_loss``
``O1_scope``    ``amp.autocast(dtype=...)`` around forward and loss,
                ``amp.init_trainer(AdamW)``, ``amp.scale_loss``
``O2``          ``amp.initialize(model, AdamW, opt_level="O2", dtype=...)``
``O2_accel``    O2 on the route an accelerator takes: ``master_grads="always"`` and no
                16-bit grad kept aside (``ampkit.levels.grad_mirror.KEEP_ASIDE_DEVICES``
                emptied for this arm): every grad widened into its master's fp32 grad,
                the fp32 masters stepped by torch's AdamW (on a CPU, a stand-in for the
                host work of O2 on a GPU, where ``O2`` itself takes this route)
``O2K``         the same at ``"O2K"`` (bf16 on every device)
``O3``          the same at ``"O3"``
==============  ======================================================================

The ampkit arms get a plain ``AdamW``, as a user would write it: ampkit chooses its
update kernels itself. Measured per arm:

1. CPU time per step: ``time.process_time()`` over blocks of ``--steps`` steps, the
   arms interleaved round-robin (``--rounds`` rounds), each block on a fresh set-up
   (``amp.reset()`` and ``ampkit.casting.release_kernels()`` first: ampkit's state is
   per process, and its kernels and module hooks would also run under the torch
   arms) warmed up by ``--warmup`` untimed steps, so O2/O2K's compiled update kernels
   are built before any timing; medians over the rounds and the ratio to
   ``torch_amp`` (the targets below apply to it). On CUDA also the wall time per step
   (``torch.cuda.synchronize()`` at the block's ends) and the host time per step
   (until the last step returns, without the final synchronize).
2. Host reads per step: the calls that read a tensor's value into Python
   (``Tensor.item``, ``__bool__``, ``tolist``, ``__float__``, ``__int__``, and
   ``Tensor.cpu`` of a tensor not on the CPU), counted over ``--count-steps`` steps by
   wrapping those methods for that time only, with the code that made each call. On a
   CPU they cost nothing much; on a GPU each one waits for the device. Reads of the
   flag of a step skipped on the device, which ``ampkit.trainer.device_skip.settle``
   makes during a later step (the device has passed it), are counted apart
   (``host_reads_earlier``) and named so among the sites.
3. Profile (``--profile``, the default): ``cProfile`` over ``--profile-steps`` steps
   of each arm; per arm the profiled time per step, the part spent in ampkit's own
   code (its functions' own time; the ``lm`` model's code, which lives in
   ``ampkit.tools.bench``, does not count), and the 12 ampkit functions with the most
   cumulative time, with their calls per step. The profiler slows Python code more than
   torch's C++, so its times say where ampkit's host time goes, not what a step costs.

Targets (host time per step against ``torch_amp``): ampkit O1 (``O1_init`` and
``O1_scope``) <= 1.10x, O2 <= 1.10x, O2K <= 1.20x. ``--json FILE`` also writes the
machine (CPU, its 16-bit flags, torch, date, command), the settings and, per workload,
the rows (``cpu_ms``, ``vs_torch_amp``, ``host_reads``, ``host_reads_earlier``, on CUDA ``host_ms`` and
``wall_ms``; the target and whether it is met), the reads by method and by calling
site, and the profile.

    python benchmarks/host_overhead.py [--workload tiny,lm] [--device cpu] [--steps 10] [--rounds 5]
    python benchmarks/host_overhead.py --arms torch_amp,O2 --no-profile
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp
from ampkit.levels import grad_mirror, update_kernels
from ampkit.tools.bench.machine import write_record
from ampkit.tools.bench.workloads import SIZES, make_workload
from ampkit.trainer import device_skip

ARMS = ("torch_amp", "pure16", "O1_init", "O1_scope", "O2", "O2_accel", "O2K", "O3")
AMPKIT_ARMS = ("O1_init", "O1_scope", "O2", "O2_accel", "O2K", "O3")
# On request only: a level with its update kernels staging every role (as before ampkit laid
# out the state they write in one buffer), to measure that layout side by side.
STAGED_ARMS = ("O2_staged", "O2K_staged")
TARGETS = {"O1_init": 1.10, "O1_scope": 1.10, "O2": 1.10, "O2K": 1.20}
WORKLOADS = ("tiny", "lm")
LR = 1e-3
TOP = 12  # ampkit functions per arm in the profile
READ_METHODS = ("item", "__bool__", "tolist", "__float__", "__int__", "cpu")
AMPKIT_DIR = Path(amp.__file__).resolve().parent
SETTLE_CODE = device_skip.settle.__code__
EARLIER = " [an earlier step's flag]"
TORCH_DIR = Path(torch.__file__).resolve().parent
BENCH_DIR = AMPKIT_DIR / "tools" / "bench"  # the lm workload's model code: not ampkit's step
KEEP_ASIDE = grad_mirror.KEEP_ASIDE_DEVICES  # restored for every arm but O2_accel


def is_ampkit(filename: str) -> bool:
    """Whether ``filename`` is ampkit's code (the bench workloads' models are not)."""
    path = Path(filename).resolve()
    return path.is_relative_to(AMPKIT_DIR) and not path.is_relative_to(BENCH_DIR)


# --- workloads ----------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm block: causal self-attention (SDPA) and a 4x GELU MLP, both residual."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Token and position embeddings, ``layers`` pre-norm blocks, a final LayerNorm and
    an untied linear head."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 12, seq: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.ln(self.blocks(self.tok(ids) + self.pos(pos))))


@dataclass
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    batch: tuple[torch.Tensor, torch.Tensor]


def make(name: str, device: str, lm_size: str) -> Workload:
    if name == "tiny":
        ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0)).to(device)
        return Workload("tiny", "12-block pre-norm transformer LM, d_model 32, 4 heads, MLP 4x, vocab 64, "
                        "sequence 16, batch 4, untied head", lambda: TinyLM().to(device),
                        (ids[:, :-1], ids[:, 1:]))  # fmt: skip
    wl = make_workload(name, lm_size, device=device)
    return Workload(name, f"ampkit bench `{name}` ({lm_size}): {wl.description}", wl.build_model, wl.example_batch())


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), target.flatten())


# --- arms ---------------------------------------------------------------------------------

Step = Callable[[torch.Tensor, torch.Tensor], None]


def setup(arm: str, wl: Workload, device: str, dtype: torch.dtype) -> Step:
    """A fresh model (seed 0), its optimizer and the step of ``arm``; ampkit's state
    reset first, its kernels and global module hooks removed (an ampkit scope installs
    them again), so the torch arms run torch alone."""
    if arm in STAGED_ARMS:
        level_step = setup(arm.removesuffix("_staged"), wl, device, dtype)
        tiled = update_kernels.tiled

        def staged(x: torch.Tensor, y: torch.Tensor) -> None:
            update_kernels.tiled = lambda role: None  # every role staged, for this step only
            try:
                level_step(x, y)
            finally:
                update_kernels.tiled = tiled

        return staged
    amp.reset()
    amp.casting.release_kernels()  # reset keeps them while other threads (inductor's) are alive
    grad_mirror.KEEP_ASIDE_DEVICES = KEEP_ASIDE
    torch.manual_seed(0)
    model = wl.build()
    if arm in ("torch_amp", "pure16"):
        if arm == "pure16":
            model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        if arm == "pure16":
            def pure(x: torch.Tensor, y: torch.Tensor) -> None:
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            return pure
        scaler = torch.amp.GradScaler(device)

        def torch_amp(x: torch.Tensor, y: torch.Tensor) -> None:
            with torch.autocast(device, dtype=dtype):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        return torch_amp
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scope: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if arm == "O1_init":
        amp.init(dtype, device)
        opt = amp.init_trainer(opt)
    elif arm == "O1_scope":
        opt = amp.init_trainer(opt)

        def scope() -> contextlib.AbstractContextManager[Any]:
            return amp.autocast(device_type=device, dtype=dtype)
    elif arm == "O2_accel":
        grad_mirror.KEEP_ASIDE_DEVICES = ()  # until the next arm's set-up
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype, master_grads="always")
    else:
        model, opt = amp.initialize(model, opt, opt_level=arm, dtype=torch.bfloat16 if arm == "O2K" else dtype)

    def ampkit_step(x: torch.Tensor, y: torch.Tensor) -> None:
        with scope():
            loss = loss_fn(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return ampkit_step


def warm(arm: str, wl: Workload, device: str, dtype: torch.dtype, steps: int) -> Step:
    step = setup(arm, wl, device, dtype)
    for _ in range(steps):
        step(*wl.batch)
    if device == "cuda":
        torch.cuda.synchronize()
    gc.collect()
    return step


# --- measurements -------------------------------------------------------------------------


def time_block(step: Step, batch: tuple[torch.Tensor, torch.Tensor], n: int, cuda: bool) -> tuple[float, float, float]:
    """(CPU, host, wall) seconds per step over ``n`` steps; host: until the last step
    returns; wall: after the device has finished too."""
    if cuda:
        torch.cuda.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        step(*batch)
    c1, t1 = time.process_time(), time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (c1 - c0) / n, (t1 - t0) / n, (t2 - t0) / n


def _site(frame: Any) -> str:
    """``package/path.py:line (function)`` of a frame, short."""
    path = Path(frame.f_code.co_filename).resolve()
    for root, label in ((AMPKIT_DIR, "ampkit"), (TORCH_DIR, "torch")):
        if path.is_relative_to(root):
            path_s = f"{label}/{path.relative_to(root).as_posix()}"
            break
    else:
        path_s = path.name
    return f"{path_s}:{frame.f_lineno} ({frame.f_code.co_name})"


def _of_an_earlier_step(frame: Any) -> bool:
    """Whether a read comes from ``ampkit.trainer.device_skip.settle``: the flag of a
    step skipped on the device, recorded during a later one (the device has passed it)."""
    for _ in range(16):
        if frame is None:
            return False
        if frame.f_code is SETTLE_CODE:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def counting_reads(counts: collections.Counter) -> Iterator[None]:
    """While open, every host read (see ``READ_METHODS``) adds 1 to ``counts[(method,
    calling site)]``; the methods are restored on exit."""
    missing = object()
    saved = {name: torch.Tensor.__dict__.get(name, missing) for name in READ_METHODS}

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def reader(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if name != "cpu" or self.device.type != "cpu":
                frame = sys._getframe(1)
                counts[(name, _site(frame) + (EARLIER if _of_an_earlier_step(frame) else ""))] += 1
            return original(self, *args, **kwargs)

        return reader

    for name in READ_METHODS:
        setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is missing:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)


def host_reads(step: Step, batch: tuple[torch.Tensor, torch.Tensor], n: int) -> dict[str, Any]:
    counts: collections.Counter = collections.Counter()
    with counting_reads(counts):
        for _ in range(n):
            step(*batch)
    by_method: collections.Counter = collections.Counter()
    by_site: collections.Counter = collections.Counter()
    for (method, site), c in counts.items():
        by_method[method] += c
        by_site[site] += c
    earlier = sum(c for (_, site), c in counts.items() if site.endswith(EARLIER))
    return {"per_step": (sum(counts.values()) - earlier) / n, "earlier_per_step": earlier / n,
            "by_method": {m: c / n for m, c in by_method.most_common()},
            "by_site": {s: c / n for s, c in by_site.most_common()}}  # fmt: skip


def _function(key: tuple[str, int, str]) -> str:
    filename, line, name = key
    path = Path(filename).resolve()
    return f"{path.relative_to(AMPKIT_DIR.parent).as_posix()}:{line} ({name})"


def profile(step: Step, batch: tuple[torch.Tensor, torch.Tensor], n: int) -> dict[str, Any]:
    """cProfile over ``n`` steps: the profiled and ampkit-own time per step and the
    ``TOP`` ampkit functions by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step(*batch)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(tt for _, _, tt, _, _ in stats.values())
    ours = {k: v for k, v in stats.items() if is_ampkit(k[0])}
    own = sum(v[2] for v in ours.values())
    top = sorted(ours.items(), key=lambda kv: kv[1][3], reverse=True)[:TOP]
    return {
        "steps": n,
        "profiled_ms": total / n * 1e3,
        "ampkit_own_ms": own / n * 1e3,
        "ampkit_share": own / total if total > 0 else float("nan"),
        "top": [{"function": _function(k), "calls_per_step": nc / n, "cum_ms": ct / n * 1e3, "own_ms": tt / n * 1e3}
                for k, (_, nc, tt, ct, _) in top],
    }  # fmt: skip


def measure(wl: Workload, arms: list[str], args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    cuda = args.device == "cuda"
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    host: dict[str, list[float]] = {a: [] for a in arms}
    wall: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(args.rounds):
        for arm in arms:
            step = warm(arm, wl, args.device, dtype, args.warmup)
            c, h, w = time_block(step, wl.batch, args.steps, cuda)
            cpu[arm].append(c)
            host[arm].append(h)
            wall[arm].append(w)
    reads: dict[str, dict[str, Any]] = {}
    profiles: dict[str, dict[str, Any]] = {}
    for arm in arms:
        step = warm(arm, wl, args.device, dtype, 2)
        reads[arm] = host_reads(step, wl.batch, args.count_steps)
        if args.profile:
            profiles[arm] = profile(step, wl.batch, args.profile_steps)
    amp.reset()
    ref = statistics.median(cpu["torch_amp"]) if "torch_amp" in cpu else None
    rows = []
    for arm in arms:
        cpu_ms = statistics.median(cpu[arm]) * 1e3
        ratio = cpu_ms / (ref * 1e3) if ref else float("nan")
        row: dict[str, Any] = {"arm": arm, "cpu_ms": cpu_ms, "vs_torch_amp": ratio,
                               "host_reads": reads[arm]["per_step"],
                               "host_reads_earlier": reads[arm]["earlier_per_step"]}  # fmt: skip
        if cuda:
            row["host_ms"] = statistics.median(host[arm]) * 1e3
            row["wall_ms"] = statistics.median(wall[arm]) * 1e3
        row["target"] = TARGETS.get(arm)
        row["met"] = None if arm not in TARGETS or not ref else bool(ratio <= TARGETS[arm])
        rows.append(row)
    torch.manual_seed(0)
    params = list(wl.build().parameters())
    return {"workload": wl.name, "description": wl.description, "param_tensors": len(params),
            "params": sum(p.numel() for p in params), "rows": rows,
            "reads": {a: {"by_method": r["by_method"], "by_site": r["by_site"]} for a, r in reads.items()},
            "profile": profiles}  # fmt: skip


# --- output -------------------------------------------------------------------------------


def _target(row: dict[str, Any]) -> str:
    if row["target"] is None:
        return "-"
    return f"<={row['target']:.2f}x " + ("met" if row["met"] else "missed" if row["met"] is False else "-")


def print_table(result: dict[str, Any], cuda: bool) -> None:
    print(f"\n{result['workload']}: {result['description']}; {result['param_tensors']} param tensors, "
          f"{result['params']:,} params")  # fmt: skip
    head = f"{'arm':<10} {'cpu ms/step':>12} {'vs torch_amp':>13} {'host reads/step':>16} {'earlier flag':>13}"
    if cuda:
        head += f" {'host ms/step':>13} {'wall ms/step':>13}"
    head += "  target"
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        line = (f"{r['arm']:<10} {r['cpu_ms']:>12.2f} {r['vs_torch_amp']:>12.3f}x {r['host_reads']:>16.1f} "
                f"{r['host_reads_earlier']:>13.1f}")  # fmt: skip
        if cuda:
            line += f" {r['host_ms']:>13.2f} {r['wall_ms']:>13.2f}"
        print(f"{line}  {_target(r)}")
    for arm, p in result["profile"].items():
        print(f"profile {arm}: {p['profiled_ms']:.2f} ms/step profiled, ampkit's own code {p['ampkit_own_ms']:.2f} ms "
              f"({p['ampkit_share']:.0%})")  # fmt: skip
        for t in p["top"]:
            print(f"    {t['cum_ms']:8.3f} ms cum {t['own_ms']:8.3f} ms own {t['calls_per_step']:7.1f} calls  {t['function']}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default=",".join(WORKLOADS), help="comma list of tiny, lm (default both)")
    p.add_argument("--lm-size", default="tiny", choices=SIZES, help="the size of the lm workload (default tiny)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16"],
                   help="compute dtype (default bf16 on the CPU, fp16 on CUDA)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per block (default 10)")
    p.add_argument("--rounds", type=int, default=5, help="interleaving rounds (default 5)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each block (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS + STAGED_ARMS)}")
    p.add_argument("--count-steps", type=int, default=3, help="steps over which host reads are counted (default 3)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="cProfile each arm (default on)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per arm (default 3)")
    p.add_argument("--json", metavar="FILE", help="also write the machine, the settings and the results to FILE")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{p.prog}: --device cuda needs a CUDA GPU, and torch sees none here", file=sys.stderr)
        return 2
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    unknown = [a for a in arms if a not in ARMS + STAGED_ARMS] + [w for w in workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown arm(s) or workload(s) {', '.join(unknown)}")
    if min(args.steps, args.rounds, args.count_steps, args.profile_steps) < 1 or args.warmup < 0:
        p.error("--steps, --rounds, --count-steps and --profile-steps take 1 or more; --warmup 0 or more")
    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.dtype]
    dtype = dtype or (torch.float16 if args.device == "cuda" else torch.bfloat16)
    print(f"device={args.device} dtype={str(dtype).removeprefix('torch.')} threads={torch.get_num_threads()} "
          f"torch={torch.__version__}; {args.rounds} rounds x {args.steps} steps per arm, {args.warmup} warm-up steps "
          "per block; medians of CPU time per step")  # fmt: skip
    results = []
    for name in workloads:
        result = measure(make(name, args.device, args.lm_size), arms, args, dtype)
        print_table(result, args.device == "cuda")
        results.append(result)
    if args.json:
        settings = {"device": args.device, "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                    "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "count_steps": args.count_steps,
                    "profile_steps": args.profile_steps if args.profile else 0, "lm_size": args.lm_size,
                    "arms": arms}  # fmt: skip
        write_record(args.json, {"settings": settings, "targets": TARGETS, "workloads": results},
                     device=args.device, threads=torch.get_num_threads())  # fmt: skip
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
