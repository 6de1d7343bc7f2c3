"""Train a small CNN on scikit-learn's digits, with or without ampkit.

    python examples/train_classifier.py                  # --amp O2, bf16 on CPU / fp16 on GPU
    python examples/train_classifier.py --amp off        # plain fp32
    python examples/train_classifier.py --amp init       # the three-line integration below
    python examples/train_classifier.py --amp O2K --steps 300

What ampkit adds to an ordinary training loop (lines marked ``# ampkit``):

    # either an opt level (casting, model dtype, master weights, loss scaler) ...
    model, opt = amp.initialize(model, opt, opt_level="O2")
    # ... or op-level casting plus a loss scaler, as two separate calls:
    amp.init()
    amp.init_trainer(opt)

    # and in the loop, instead of loss.backward():
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()                      # skips itself if the gradients overflowed

Needs scikit-learn for the data (pip install scikit-learn, or ampkit's cli extra:
pip install -e '.[cli]' in ampkit's clone).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import ampkit as amp
from ampkit.tools.bench.data import image_batches, load_digits
from ampkit.tools.bench.workloads import DigitsCNN

AMP_CHOICES = ("off", "init", "O0", "O1", "O2", "O3", "O2K")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--amp", choices=AMP_CHOICES, default="O2",
                   help="off: fp32; init: amp.init + amp.init_trainer; O0-O3, O2K: amp.initialize")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="16-bit dtype (default: bf16 on CPU, fp16 on CUDA)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--width", type=int, default=32, help="channels of the first convolution")
    p.add_argument("--image-size", type=int, default=32, help="digits are upsampled from 8x8 to this")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    return args


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Test loss and accuracy."""
    model.eval()
    logits = torch.cat([model(x[i : i + 512]).float() for i in range(0, x.shape[0], 512)])
    model.train()
    return F.cross_entropy(logits, y).item(), (logits.argmax(-1) == y).float().mean().item()


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    # O2K is bf16 by design; elsewhere torch.autocast's defaults: fp16 on CUDA, bf16 on CPU
    dtype = DTYPES[args.dtype or ("fp16" if device == "cuda" and args.amp != "O2K" else "bf16")]
    torch.manual_seed(args.seed)

    data = load_digits(args.image_size, seed=args.seed, device=device)
    model = DigitsCNN(args.width).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    if args.amp == "init":
        amp.init(dtype=dtype)                                   # ampkit: op-level casting
        amp.init_trainer(opt)                                   # ampkit: loss scaler, step skipping
    elif args.amp != "off":
        model, opt = amp.initialize(model, opt, opt_level=args.amp, dtype=dtype)  # ampkit

    batches = image_batches(data, args.batch_size, torch.Generator().manual_seed(args.seed))
    print(f"digits {tuple(data.train_x.shape)} on {device}, amp={args.amp}"
          + ("" if args.amp == "off" else f", dtype={str(dtype).removeprefix('torch.')}"))
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float(), y)
        if args.amp == "off":
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:           # ampkit
                scaled.backward()
        opt.step()
        if step % args.log_every == 0 or step == args.steps:
            ms = 1000 * (time.perf_counter() - start) / step
            extra = ""
            if args.amp != "off":
                s = amp.stats(opt)
                extra = f"  skipped {s.skipped}  scale {s.scales[0]:g}"
            print(f"step {step:5d}  loss {loss.item():.4f}  {ms:.1f} ms/step{extra}", flush=True)

    test_loss, test_acc = evaluate(model, data.test_x, data.test_y)
    print(f"test loss {test_loss:.4f}  test accuracy {100 * test_acc:.2f}%")
    amp.reset()  # turn process-wide casting off (only needed when more code follows)
    return {"test_loss": test_loss, "test_accuracy": test_acc}


if __name__ == "__main__":
    main()
