"""The built-in workloads of ``ampkit bench``: models, optimizers, batches, metrics.

- ``cnn``: a VGG-style CNN on scikit-learn's digits, upsampled to 32x32 (conv-bound,
  so lower precision can pay off on CPU and GPU alike); metric: test accuracy.
  Width 16 at batch 128: on a 2-core avx512_bf16 CPU a pure-bf16 step of this
  model measured 2.3x faster than fp32, against 1.8x at width 32 and 1.5x at 48
  (oneDNN's bf16 convolutions gain less on wider layers there).
- ``lm``: a character-level GPT-style transformer on the Python standard library's
  own source; metrics: held-out loss, bits per character and next-character accuracy.
- ``wide``: a wide MLP (1024 -> 4096 -> 4096 -> 4096 -> 10, 38M parameters) on the
  digits at 32x32, flattened; batch 64. Parameters, not activations, dominate its
  step (the shape of large-model training), so the optimizer step and the
  precision's weight handling are what it measures; metric: test accuracy.

Each comes in sizes: ``full`` (the default run), ``quick`` (``--quick``) and
``tiny`` (tests). A workload owns its data, so every precision sees the same
batches in the same order for a given seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .data import (
    DigitsData,
    TextData,
    image_batches,
    load_digits,
    load_stdlib_text,
    text_batches,
)

__all__ = [
    "WORKLOADS",
    "SIZES",
    "CNNConfig",
    "LMConfig",
    "WideConfig",
    "DigitsCNN",
    "WideMLP",
    "CharTransformer",
    "Workload",
    "CNNWorkload",
    "LMWorkload",
    "WideWorkload",
    "make_workload",
    "default_steps",
]

SIZES = ("full", "quick", "tiny")
Scope = Callable[[], ContextManager[Any]]


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------
class DigitsCNN(nn.Module):
    """Five 3x3 convolutions (width w, w, 2w, 2w, 4w) with ReLU and two 2x2 max
    pools, global average pooling and a linear classifier. No normalization
    layers, so every layer can run in the compute dtype."""

    def __init__(self, width: int = 32, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        w = width

        def conv(i: int, o: int) -> list[nn.Module]:
            return [nn.Conv2d(i, o, kernel_size=3, padding=1), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(
            *conv(in_channels, w),
            *conv(w, w),
            nn.MaxPool2d(2),
            *conv(w, 2 * w),
            *conv(2 * w, 2 * w),
            nn.MaxPool2d(2),
            *conv(2 * w, 4 * w),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(4 * w * 16, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class WideMLP(nn.Module):
    """Flatten, then ``layers`` x (Linear(width) + ReLU) and a linear classifier.
    torch's default initialization; no normalization layers."""

    def __init__(self, in_features: int, width: int = 4096, layers: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        dims = [in_features] + [width] * layers
        body: list[nn.Module] = [nn.Flatten()]
        for i, o in zip(dims[:-1], dims[1:]):
            body += [nn.Linear(i, o), nn.ReLU()]
        self.body = nn.Sequential(*body)
        self.classifier = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.body(x))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written with two matmuls and a softmax.

    Written out rather than with ``F.scaled_dot_product_attention``: on CPU the
    fused kernel's bf16 backward is slower than its fp32 one in current torch
    releases, which would measure that kernel rather than mixed precision; the
    explicit form runs the same math in every precision and lets the casting lists
    decide (matmuls low, softmax fp32)."""

    def __init__(self, d_model: int, n_heads: int, max_len: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        mask = torch.ones(max_len, max_len, dtype=torch.bool).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        scores = scores.masked_fill(self.mask[:t, :t], float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4x GELU MLP, both residual."""

    def __init__(self, d_model: int, n_heads: int, max_len: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, max_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharTransformer(nn.Module):
    """A small GPT-style character language model: token and position embeddings,
    ``n_layers`` pre-norm blocks, a final LayerNorm and a linear head over the
    vocabulary. Input ``(B, T)`` ids, output ``(B, T, vocab)`` logits."""

    def __init__(
        self, vocab_size: int, d_model: int = 128, n_layers: int = 4, n_heads: int = 4, max_len: int = 128
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, n_heads, max_len) for _ in range(n_layers)])
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence of {t} exceeds the model's max_len {self.max_len}")
        pos = torch.arange(t, device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        return self.head(self.ln(self.blocks(x)))


# ---------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CNNConfig:
    """Size and training settings of the ``cnn`` workload."""

    image_size: int = 32
    width: int = 16
    batch_size: int = 128
    lr: float = 2e-3
    steps: int = 300


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Size and training settings of the ``lm`` workload."""

    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 30
    steps: int = 600
    corpus_chars: int = 400_000
    eval_windows: int = 128


@dataclasses.dataclass(frozen=True)
class WideConfig:
    """Size and training settings of the ``wide`` workload."""

    image_size: int = 32
    width: int = 4096
    layers: int = 3
    batch_size: int = 64
    lr: float = 1e-4
    steps: int = 60


CNN_SIZES: dict[str, CNNConfig] = {
    "full": CNNConfig(),
    "quick": CNNConfig(steps=60),
    "tiny": CNNConfig(image_size=16, width=8, batch_size=64, lr=3e-3, steps=40),
}
WIDE_SIZES: dict[str, WideConfig] = {
    "full": WideConfig(),
    "quick": WideConfig(width=2048, steps=30),
    "tiny": WideConfig(image_size=8, width=128, lr=1e-3, steps=30),
}
LM_SIZES: dict[str, LMConfig] = {
    "full": LMConfig(),
    "quick": LMConfig(d_model=96, n_layers=2, seq_len=64, steps=100, warmup=10, eval_windows=64),
    "tiny": LMConfig(
        d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=8, steps=30, warmup=5,
        corpus_chars=60_000, eval_windows=32,
    ),
}


class Workload:
    """A model, its optimizer, endless training batches and an evaluation.

    Subclasses set ``name``, ``description``, ``steps`` (the default number of
    training steps) and ``metric`` (the key of ``evaluate``'s headline figure) and
    implement the methods below.
    """

    name: str = ""
    description: str = ""
    steps: int = 0
    metric: str = "accuracy"  # the headline figure of ``evaluate``

    def build_model(self) -> nn.Module:
        """A freshly initialized model on the workload's device (seed first)."""
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer for ``model``'s parameters."""
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.01)

    def build_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler | None:
        """An LR schedule stepped once per training step, or None."""
        return None

    def batches(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless ``(inputs, targets)`` training batches, ordered by ``generator``."""
        raise NotImplementedError

    def example_batch(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The first batch :meth:`batches` yields for a generator seeded with ``seed``
        (default 0): fp32 images ``(B, 1, H, W)`` or int64 ids ``(B, T)``, and int64
        targets, on the workload's device. The ``benchmarks/`` scripts time their steps
        on it."""
        return next(iter(self.batches(torch.Generator().manual_seed(seed))))

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy, computed in fp32 whatever the logits' dtype."""
        return F.cross_entropy(output.float().flatten(0, -2), target.flatten())

    def evaluate(self, model: nn.Module, scope: Scope = contextlib.nullcontext) -> dict[str, float]:
        """Held-out metrics of ``model``, its forward run inside ``scope()``."""
        raise NotImplementedError

    def data_tensors(self) -> list[torch.Tensor]:
        """Tensors of the dataset (left out of the bench's memory figures)."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """The settings, for results.json."""
        raise NotImplementedError

    @property
    def lr(self) -> float:
        return float(self.config()["lr"])


class CNNWorkload(Workload):
    """``cnn``: :class:`DigitsCNN` on the digits, AdamW, constant learning rate."""

    name = "cnn"
    cfg: Any

    def __init__(self, size: str = "full", device: str | torch.device = "cpu", seed: int = 0) -> None:
        self.cfg = self._sizes()[size]
        self.device = torch.device(device)
        self.data: DigitsData = load_digits(self.cfg.image_size, seed=seed, device=self.device)
        self.steps = self.cfg.steps
        self.description = (
            f"{self._model_text()} on sklearn digits {self.cfg.image_size}x"
            f"{self.cfg.image_size}, batch {self.cfg.batch_size}; "
            f"{self.data.train_x.shape[0]} train / {self.data.test_x.shape[0]} test images"
        )

    def _sizes(self) -> dict[str, Any]:
        return CNN_SIZES

    def _model_text(self) -> str:
        return f"CNN (width {self.cfg.width})"

    def build_model(self) -> nn.Module:
        model = DigitsCNN(self.cfg.width, self.data.num_classes).to(self.device)
        return model.to(memory_format=torch.channels_last)

    def batches(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return image_batches(self.data, self.cfg.batch_size, generator)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, scope: Scope = contextlib.nullcontext) -> dict[str, float]:
        was_training = model.training
        model.eval()
        total_loss, correct, n = 0.0, 0, 0
        try:
            for start in range(0, self.data.test_x.shape[0], 512):
                x = self.data.test_x[start : start + 512]
                y = self.data.test_y[start : start + 512]
                with scope():
                    logits = model(x)
                logits = logits.float()
                total_loss += F.cross_entropy(logits, y, reduction="sum").item()
                correct += int((logits.argmax(-1) == y).sum().item())
                n += y.shape[0]
        finally:
            model.train(was_training)
        return {"eval_loss": total_loss / n, "accuracy": correct / n}

    def data_tensors(self) -> list[torch.Tensor]:
        return self.data.tensors()

    def config(self) -> dict[str, Any]:
        return dataclasses.asdict(self.cfg)


class WideWorkload(CNNWorkload):
    """``wide``: :class:`WideMLP` on the flattened digits, AdamW, constant learning
    rate: a parameter-heavy step (38M parameters at the full size)."""

    name = "wide"

    def _sizes(self) -> dict[str, Any]:
        return WIDE_SIZES

    def _model_text(self) -> str:
        c = self.cfg
        n = c.image_size**2 * c.width + (c.layers - 1) * c.width**2 + c.layers * c.width + 10 * c.width + 10
        dims = " -> ".join([str(c.image_size**2)] + [str(c.width)] * c.layers + ["10"])
        return f"MLP {dims} ({n / 1e6:.1f}M params)"

    def build_model(self) -> nn.Module:
        c = self.cfg
        return WideMLP(c.image_size**2, c.width, c.layers, self.data.num_classes).to(self.device)


class LMWorkload(Workload):
    """``lm``: :class:`CharTransformer` on standard-library source, AdamW with
    linear warmup and cosine decay."""

    name = "lm"
    metric = "bits_per_char"

    def __init__(self, size: str = "full", device: str | torch.device = "cpu", seed: int = 0) -> None:
        self.cfg = LM_SIZES[size]
        self.device = torch.device(device)
        self.data: TextData = load_stdlib_text(self.cfg.corpus_chars, device=self.device)
        self.steps = self.cfg.steps
        c = self.cfg
        self.description = (
            f"char transformer ({c.n_layers} layers, d={c.d_model}, {c.n_heads} heads, "
            f"context {c.seq_len}), batch {c.batch_size}; stdlib source ({len(self.data.files)} files), "
            f"{self.data.train.numel() + self.data.valid.numel()} chars, vocab {self.data.vocab_size}"
        )

    def build_model(self) -> nn.Module:
        c = self.cfg
        return CharTransformer(self.data.vocab_size, c.d_model, c.n_layers, c.n_heads, c.seq_len).to(
            self.device
        )

    def build_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler | None:
        warmup = max(1, min(self.cfg.warmup, total_steps // 4))

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def batches(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return text_batches(self.data, self.cfg.batch_size, self.cfg.seq_len, generator)

    def eval_windows(self) -> torch.Tensor:
        """Non-overlapping ``(N, T+1)`` windows of the held-out text (at most
        ``eval_windows`` of them)."""
        t = self.cfg.seq_len + 1
        n = min(self.cfg.eval_windows, self.data.valid.shape[0] // t)
        return self.data.valid[: n * t].view(n, t)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, scope: Scope = contextlib.nullcontext) -> dict[str, float]:
        was_training = model.training
        model.eval()
        windows = self.eval_windows()
        total_loss, correct, n = 0.0, 0, 0
        try:
            for start in range(0, windows.shape[0], 4 * self.cfg.batch_size):
                w = windows[start : start + 4 * self.cfg.batch_size]
                x, y = w[:, :-1], w[:, 1:]
                with scope():
                    logits = model(x)
                logits = logits.float().flatten(0, 1)
                total_loss += F.cross_entropy(logits, y.flatten(), reduction="sum").item()
                correct += int((logits.argmax(-1) == y.flatten()).sum().item())
                n += y.numel()
        finally:
            model.train(was_training)
        loss = total_loss / n
        return {"eval_loss": loss, "bits_per_char": loss / math.log(2), "accuracy": correct / n}

    def data_tensors(self) -> list[torch.Tensor]:
        return self.data.tensors()

    def config(self) -> dict[str, Any]:
        return dataclasses.asdict(self.cfg)


WORKLOADS: dict[str, type[Workload]] = {"cnn": CNNWorkload, "lm": LMWorkload, "wide": WideWorkload}


def default_steps(name: str, size: str = "full") -> int:
    """Training steps a workload runs at ``size`` unless told otherwise."""
    sizes: dict[str, Any] = {"cnn": CNN_SIZES, "lm": LM_SIZES, "wide": WIDE_SIZES}[name]
    return int(sizes[size].steps)


def make_workload(name: str, size: str = "full", device: str | torch.device = "cpu", seed: int = 0) -> Workload:
    """Build the workload ``name`` (``"cnn"``, ``"lm"`` or ``"wide"``) at ``size``
    (``"full"``, ``"quick"`` or ``"tiny"``) with its data on ``device``."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    return WORKLOADS[name](size=size, device=device, seed=seed)
