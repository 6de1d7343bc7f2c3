"""Train a character-level transformer on the Python standard library's own
source code, with or without ampkit, then print a sample.

    python examples/train_lm.py                          # --amp O2, bf16 on CPU / fp16 on GPU
    python examples/train_lm.py --amp off                # plain fp32
    python examples/train_lm.py --amp init               # amp.init + amp.init_trainer
    python examples/train_lm.py --amp O1 --steps 1000

The ampkit lines are marked ``# ampkit``; see examples/train_classifier.py for the
pattern. An LR schedule works unchanged: a skipped step (inf/NaN gradients) is a
no-op for the optimizer, and the scheduler is created after ``amp.initialize``
like any other.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

import ampkit as amp
from ampkit.tools.bench.data import TextData, load_stdlib_text, text_batches
from ampkit.tools.bench.workloads import CharTransformer

AMP_CHOICES = ("off", "init", "O0", "O1", "O2", "O3", "O2K")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--amp", choices=AMP_CHOICES, default="O2",
                   help="off: fp32; init: amp.init + amp.init_trainer; O0-O3, O2K: amp.initialize")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="16-bit dtype (default: bf16 on CPU, fp16 on CUDA)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--corpus-chars", type=int, default=400_000)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--sample", type=int, default=200, help="characters to generate at the end")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    return args


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: TextData, seq_len: int, windows: int = 128) -> tuple[float, float]:
    """Held-out loss (nats/char) and next-character accuracy."""
    model.eval()
    n = min(windows, data.valid.shape[0] // (seq_len + 1))
    w = data.valid[: n * (seq_len + 1)].view(n, seq_len + 1)
    logits = model(w[:, :-1]).float()
    model.train()
    target = w[:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten()).item()
    return loss, (logits.argmax(-1) == target).float().mean().item()


@torch.no_grad()
def sample(model: torch.nn.Module, data: TextData, prompt: str, n: int, seq_len: int) -> str:
    """Greedy continuation of ``prompt`` (characters outside the vocabulary dropped)."""
    model.eval()
    index = {ch: i for i, ch in enumerate(data.vocab)}
    ids = torch.tensor([[index[c] for c in prompt if c in index]], device=data.train.device)
    for _ in range(n):
        logits = model(ids[:, -seq_len:])[:, -1].float()
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    model.train()
    return data.decode(ids[0])


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    # O2K is bf16 by design; elsewhere torch.autocast's defaults: fp16 on CUDA, bf16 on CPU
    dtype = DTYPES[args.dtype or ("fp16" if device == "cuda" and args.amp != "O2K" else "bf16")]
    torch.manual_seed(args.seed)

    data = load_stdlib_text(args.corpus_chars, device=device)
    model = CharTransformer(data.vocab_size, args.d_model, args.layers, args.heads, args.seq_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    if args.amp == "init":
        amp.init(dtype=dtype)                                   # ampkit: op-level casting
        amp.init_trainer(opt)                                   # ampkit: loss scaler, step skipping
    elif args.amp != "off":
        model, opt = amp.initialize(model, opt, opt_level=args.amp, dtype=dtype)  # ampkit

    warmup = max(1, min(args.warmup, args.steps // 4))

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, args.steps - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    batches = text_batches(data, args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed))
    print(f"{data.train.numel() + data.valid.numel()} characters from {len(data.files)} stdlib files, "
          f"vocab {data.vocab_size}, {sum(p.numel() for p in model.parameters())} parameters, "
          f"on {device}, amp={args.amp}"
          + ("" if args.amp == "off" else f", dtype={str(dtype).removeprefix('torch.')}"))
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        if args.amp == "off":
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:           # ampkit
                scaled.backward()
        opt.step()
        sched.step()
        if step % args.log_every == 0 or step == args.steps:
            ms = 1000 * (time.perf_counter() - start) / step
            extra = ""
            if args.amp != "off":
                s = amp.stats(opt)
                extra = f"  skipped {s.skipped}  scale {s.scales[0]:g}"
            print(f"step {step:5d}  loss {loss.item():.4f}  {ms:.1f} ms/step{extra}", flush=True)

    eval_loss, eval_acc = evaluate(model, data, args.seq_len)
    print(f"held-out loss {eval_loss:.4f} ({eval_loss / math.log(2):.3f} bits/char), "
          f"next-char accuracy {100 * eval_acc:.2f}%")
    if args.sample > 0:
        print("sample:\n" + sample(model, data, "def ", args.sample, args.seq_len))
    amp.reset()  # turn process-wide casting off (only needed when more code follows)
    return {"eval_loss": eval_loss, "eval_accuracy": eval_acc}


if __name__ == "__main__":
    main()
