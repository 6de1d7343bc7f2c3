"""O2's op-level casting inside the cast model (``model_op_casting``): what it costs and
what it buys, on ``ampkit bench``'s ``lm`` workload (a GPT-style char transformer on
standard-library source; ``--size tiny`` by default: d=32, 1 layer, context 32, so that
CPUs without native bf16 finish; bf16), with its cross-entropy moved inside ``forward``.

Speed: forward + backward of the same bf16 model with and without the scope, and O3
(pure bf16) for reference, interleaved in one process (round-robin blocks) so machine
noise hits them alike; medians and ratios. The optimizer step is left out: the scope
does not touch it.

Accuracy: each of fp32, O2 (scope on), O2 (scope off) and O3 trains the same model on
the same batches for ``--steps`` steps with AdamW; the table gives the mean training
loss of the last 20 steps and the fp32-computed loss on held-out batches, and both
relative to fp32.

``--json FILE`` also writes the machine (CPU, its 16-bit flags, torch, date, command),
the settings and both tables' rows: ``speed`` (per model ``forward_backward_ms``,
``vs_o2_without_scope``) and ``accuracy`` (per mode ``train_loss``, ``eval_loss`` and
their relative changes against fp32, ``train_change_vs_fp32`` and
``eval_change_vs_fp32``: 0.01 is 1% higher).

    python benchmarks/o2_op_casting.py [--size tiny] [--steps 120] [--rounds 6] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import ampkit as amp
from ampkit.levels.model_cast import add_op_casting, cast_model
from ampkit.tools.bench.machine import write_record
from ampkit.tools.bench.workloads import SIZES, Workload, make_workload

BF16 = torch.bfloat16


class WithLoss(torch.nn.Module):
    """nanoGPT's contract: the cross-entropy is computed inside ``forward``, so it runs
    in fp32 under O2 only with the scope (it is on the CPU and CUDA fp32 lists)."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(wl: Workload, seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = wl.batches(torch.Generator().manual_seed(seed))
    return [next(batches) for _ in range(n)]


def _held_out(wl: Workload) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The workload's held-out text, as (input, next-character) batches."""
    windows = wl.eval_windows().split(wl.config()["batch_size"])
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def speed(wl: Workload, rounds: int, per_block: int) -> dict[str, float]:
    torch.manual_seed(0)
    base = WithLoss(wl.build_model())
    models = {
        "O2 (fp32 ops in fp32)": cast_model(copy.deepcopy(base), BF16),
        "O2 without the scope": cast_model(copy.deepcopy(base), BF16),
        "O3 (pure bf16)": cast_model(copy.deepcopy(base), BF16, keep_norm_fp32=False),
    }
    add_op_casting(models["O2 (fp32 ops in fp32)"], BF16, "cpu")
    x, y = wl.example_batch(1)
    samples: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            for i in range(per_block + 1):
                t0 = time.perf_counter()
                model(x, y).float().backward()
                model.zero_grad()
                if i:  # the first of a block warms up
                    samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e3 for name, v in samples.items()}


def train(wl: Workload, mode: str, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = WithLoss(wl.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode != "fp32":
        level, kw = {"O2": ("O2", {}), "O2-noscope": ("O2", {"model_op_casting": False}), "O3": ("O3", {})}[mode]
        model, opt = amp.initialize(model, opt, opt_level=level, **kw)
    losses = []
    for x, y in _batches(wl, 2, steps):
        opt.zero_grad()
        loss = model(x, y).float()
        if mode == "fp32":
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        losses.append(loss.item())
    amp.reset()
    with torch.no_grad():
        fp32_model = WithLoss(wl.build_model())
        fp32_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        held_out = statistics.mean(fp32_model(x, y).item() for x, y in _held_out(wl))
    return statistics.mean(losses[-20:]), held_out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-block", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--size", default="tiny", choices=SIZES, help="the lm workload's size")
    parser.add_argument("--json", metavar="FILE", help="also write the machine, the settings and both tables' rows to FILE")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    wl = make_workload("lm", args.size)
    print(f"lm {args.size}: {wl.description}")

    times = speed(wl, args.rounds, args.per_block)
    ref = times["O2 without the scope"]
    print("forward+backward, lm, bf16 (median ms, ratio to O2 without the scope)")
    speed_rows = [{"mode": name, "forward_backward_ms": ms, "vs_o2_without_scope": ms / ref} for name, ms in times.items()]
    for row in speed_rows:
        print(f"  {row['mode']:24s} {row['forward_backward_ms']:8.2f} ms  {row['vs_o2_without_scope']:5.3f}x")

    results = {mode: train(wl, mode, args.steps) for mode in ("fp32", "O2", "O2-noscope", "O3")}
    f_train, f_eval = results["fp32"]
    print(f"\naccuracy after {args.steps} AdamW steps (train: mean of the last 20; eval: held-out, fp32)")
    accuracy_rows = [{"mode": mode, "train_loss": tr, "train_change_vs_fp32": tr / f_train - 1, "eval_loss": ev,
                      "eval_change_vs_fp32": ev / f_eval - 1} for mode, (tr, ev) in results.items()]  # fmt: skip
    for row in accuracy_rows:
        print(f"  {row['mode']:12s} train {row['train_loss']:.4f} ({row['train_change_vs_fp32']:+.2%})   "
              f"eval {row['eval_loss']:.4f} ({row['eval_change_vs_fp32']:+.2%})")
    if args.json:
        settings = {"workload": "lm", "size": args.size, "description": wl.description, "dtype": "bf16",
                    "threads": args.threads, "rounds": args.rounds, "per_block": args.per_block,
                    "train_steps": args.steps}  # fmt: skip
        write_record(args.json, {"settings": settings, "speed": speed_rows, "accuracy": accuracy_rows},
                     threads=args.threads)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
