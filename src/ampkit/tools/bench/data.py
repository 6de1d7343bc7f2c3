"""Data for the built-in workloads: real data that ships with the install.

- :func:`load_digits` -- scikit-learn's 8x8 handwritten digits (1797 images, 10
  classes), split into train and test sets, upsampled so a small CNN does real
  convolution work.
- :func:`load_stdlib_text` -- a fixed list of the Python standard library's own
  source files, as one character corpus with a held-out tail.

Both return tensors already on the requested device, so a training loop only
indexes into them.
"""

from __future__ import annotations

import dataclasses
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from ampkit._internal.files import read_file
from ampkit._internal.install import install_hint
from ampkit.errors import AmpError

__all__ = [
    "DigitsData",
    "TextData",
    "STDLIB_FILES",
    "load_digits",
    "load_stdlib_text",
    "image_batches",
    "text_batches",
]


@dataclasses.dataclass
class DigitsData:
    """The digits images as float tensors ``(N, 1, S, S)`` (normalized with the
    training set's mean and std) and int64 labels."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int = 10

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[-1])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the dataset holds (the bench leaves them out of memory figures)."""
        return [self.train_x, self.train_y, self.test_x, self.test_y]


def load_digits(
    image_size: int = 32,
    test_fraction: float = 0.2,
    seed: int = 0,
    device: str | torch.device = "cpu",
    channels_last: bool = True,
) -> DigitsData:
    """Load scikit-learn's digits, split them (stratified, fixed ``seed``) and
    upsample the 8x8 images to ``image_size`` x ``image_size`` (bilinear).

    Needs scikit-learn (the ``cli`` extra). ``channels_last`` stores images in
    NHWC order, which oneDNN's convolutions on CPU prefer, in every precision alike.
    """
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            f"the digits workload needs scikit-learn: {install_hint('cli')}"
        ) from exc

    digits = _sk_load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        list(range(len(y))), test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    idx_train_t = torch.tensor(sorted(idx_train))
    idx_test_t = torch.tensor(sorted(idx_test))
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    train_x, test_x = x[idx_train_t], x[idx_test_t]
    mean, std = train_x.mean(), train_x.std()
    train_x = (train_x - mean) / std
    test_x = (test_x - mean) / std
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return DigitsData(
        train_x=train_x.to(device).contiguous(memory_format=fmt),
        train_y=y[idx_train_t].to(device),
        test_x=test_x.to(device).contiguous(memory_format=fmt),
        test_y=y[idx_test_t].to(device),
    )


def image_batches(
    data: DigitsData, batch_size: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled training batches of full size (the last partial batch of
    each epoch is dropped). The order depends only on ``generator``."""
    n = data.train_x.shape[0]
    if batch_size > n:
        raise ValueError(f"batch size {batch_size} exceeds the {n} training images")
    while True:
        perm = torch.randperm(n, generator=generator).to(data.train_x.device)
        for start in range(0, n - batch_size + 1, batch_size):
            idx = perm[start : start + batch_size]
            yield data.train_x[idx], data.train_y[idx]


# Standard-library modules present as single files on every CPython >= 3.10, read
# in this order. A missing one (a future release may turn it into a package) is
# skipped; the corpus is then still deterministic for a given Python install.
STDLIB_FILES: tuple[str, ...] = (
    "argparse.py",
    "dataclasses.py",
    "functools.py",
    "inspect.py",
    "typing.py",
    "textwrap.py",
    "shutil.py",
    "subprocess.py",
    "tarfile.py",
    "threading.py",
    "enum.py",
    "random.py",
    "statistics.py",
    "difflib.py",
    "fractions.py",
    "contextlib.py",
    "configparser.py",
    "calendar.py",
    "pprint.py",
    "heapq.py",
    "bisect.py",
    "string.py",
    "copy.py",
)


@dataclasses.dataclass
class TextData:
    """A character corpus encoded as int64 ids, split into a training part and a
    held-out tail, with its vocabulary (``vocab[i]`` is the character of id ``i``)."""

    train: torch.Tensor
    valid: torch.Tensor
    vocab: str
    files: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the dataset holds (the bench leaves them out of memory figures)."""
        return [self.train, self.valid]

    def decode(self, ids: torch.Tensor) -> str:
        """Characters of a 1-D tensor of ids."""
        return "".join(self.vocab[i] for i in ids.tolist())


def load_stdlib_text(
    max_chars: int = 400_000,
    valid_fraction: float = 0.1,
    device: str | torch.device = "cpu",
    stdlib_dir: str | Path | None = None,
) -> TextData:
    """Read :data:`STDLIB_FILES` from the standard library folder (in order, up to
    ``max_chars`` characters) and encode them character by character.

    The vocabulary is every distinct character of the corpus, sorted; the last
    ``valid_fraction`` of the text is held out for evaluation.
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    used: list[str] = []
    total = 0
    for name in STDLIB_FILES:
        path = root / name
        try:  # regular files only, bounded (a FIFO or /dev/zero under that name is skipped)
            text = read_file(path, "a standard-library source", AmpError, 4 * max_chars + (1 << 20)).decode("utf-8")
        except (AmpError, UnicodeDecodeError):
            continue
        text = text[: max_chars - total]
        parts.append(text)
        used.append(name)
        total += len(text)
        if total >= max_chars:
            break
    corpus = "".join(parts)
    if len(corpus) < 10_000:
        raise FileNotFoundError(
            f"found only {len(corpus)} characters of Python source under {root}; "
            "the language-model workload reads the standard library's .py files "
            "(is this a Python install without its library sources?)"
        )
    vocab = "".join(sorted(set(corpus)))
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([index[ch] for ch in corpus], dtype=torch.int64)
    split = int(len(ids) * (1.0 - valid_fraction))
    return TextData(
        train=ids[:split].to(device),
        valid=ids[split:].to(device),
        vocab=vocab,
        files=tuple(used),
    )


def text_batches(
    data: TextData, batch_size: int, seq_len: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of random windows ``(inputs, targets)``, each ``(B, T)``:
    targets are the inputs shifted by one character. Positions depend only on
    ``generator``."""
    n = data.train.shape[0] - seq_len - 1
    if n <= 0:
        raise ValueError(f"sequence length {seq_len} exceeds the training text")
    offsets = torch.arange(seq_len + 1, device=data.train.device)
    while True:
        starts = torch.randint(0, n, (batch_size, 1), generator=generator).to(data.train.device)
        windows = data.train[starts + offsets]
        yield windows[:, :-1], windows[:, 1:]
