"""Image classification with a data pipeline of nn.Module transforms, as torchvision
writes them: a Gaussian blur (a conv2d with a kernel computed in forward, no
parameters) and a normalization (buffers only) applied in a Dataset's __getitem__,
and a batch-level blur called on its own in the script. Knows nothing of ampkit.

Prints one ``DATA`` line per pass over the data: a digest of the bytes of every image
the pipeline produced and the dtypes its convolutions computed in (a transform tells
them through the sample it returns, so DataLoader worker processes report too).
``--no-train`` runs the pipeline only (a script without an optimizer)."""

import argparse
import hashlib

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--no-train", action="store_true")
parser.add_argument("--encoder", action="store_true", help="a frozen conv layer (with parameters) in __getitem__")
args = parser.parse_args()

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class GaussianBlur(nn.Module):
    """torchvision.transforms.GaussianBlur's computation: a separable Gaussian kernel
    built in forward, reflect padding, a depthwise conv2d."""

    def __init__(self, kernel_size=5, sigma=1.2):
        super().__init__()
        self.kernel_size = kernel_size
        self.sigma = sigma
        self.conv_dtype = None

    def forward(self, img):
        half = (self.kernel_size - 1) * 0.5
        x = torch.linspace(-half, half, steps=self.kernel_size)
        pdf = torch.exp(-0.5 * (x / self.sigma).pow(2))
        k1d = pdf / pdf.sum()
        kernel = torch.mm(k1d[:, None], k1d[None, :]).to(img.dtype)
        channels = img.shape[-3]
        kernel = kernel.expand(channels, 1, self.kernel_size, self.kernel_size)
        batched = img.dim() == 4
        x4 = img if batched else img.unsqueeze(0)
        pad = self.kernel_size // 2
        x4 = F.pad(x4, [pad, pad, pad, pad], mode="reflect")
        out = F.conv2d(x4, kernel, groups=channels)
        self.conv_dtype = out.dtype
        out = out.to(img.dtype)
        return out if batched else out.squeeze(0)


class Normalize(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(-1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(-1, 1, 1))

    def forward(self, img):
        return (img - self.mean) / self.std


class Encoder(nn.Module):
    """A frozen feature layer the Dataset applies (a module with parameters)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.conv_dtype = None

    def forward(self, img):
        out = self.conv(img)
        self.conv_dtype = out.dtype
        return out


class Images(torch.utils.data.Dataset):
    """Deterministic synthetic 3x16x16 images of 4 classes (a bright quadrant)."""

    def __init__(self, n, encoder=None):
        self.n = n
        self.blur = GaussianBlur()
        self.normalize = Normalize([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
        self.encoder = encoder

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        gen = torch.Generator().manual_seed(i)
        label = i % 4
        img = 0.3 * torch.rand(3, 16, 16, generator=gen)
        r, c = divmod(label, 2)
        img[:, r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] += 0.6
        img = self.normalize(self.blur(img))
        codes = [DTYPE_CODES[self.blur.conv_dtype]]
        if self.encoder is not None:
            with torch.no_grad():
                img = self.encoder(img.unsqueeze(0)).squeeze(0)
            codes.append(DTYPE_CODES[self.encoder.conv_dtype])
        return img, label, torch.tensor(codes)


def data_pass(name, loader):
    digest = hashlib.sha256()
    codes = set()
    for img, _label, code in loader:
        digest.update(img.contiguous().numpy().tobytes())
        codes.update(code.flatten().tolist())
    print(f"DATA {name} {digest.hexdigest()[:16]} codes {sorted(codes)}")


torch.manual_seed(0)
encoder = None
if args.encoder:
    encoder = Encoder().requires_grad_(False)
dataset = Images(64, encoder)
early = torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=args.workers)
data_pass("before_optimizer", early)  # built and iterated before any model or optimizer

batch_blur = GaussianBlur(3, 0.8)
sample = torch.stack([dataset[i][0] for i in range(4)])
out = batch_blur(sample)  # a transform module called on its own, outside any model
print(f"DATA batch_blur {hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]} "
      f"codes {[DTYPE_CODES[batch_blur.conv_dtype]]}")


def train():
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 4)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    conv_dtypes = set()
    model[0].register_forward_hook(lambda m, i, o: conv_dtypes.add(str(o.dtype)))
    data_pass("after_optimizer_early_loader", early)
    late = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True, num_workers=args.workers,
                                       generator=torch.Generator().manual_seed(3))
    data_pass("after_optimizer", late)
    step = 0
    while step < args.steps:
        for img, label, _ in late:
            loss = F.cross_entropy(model(img), label)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == args.steps:
                break
    print(f"model_conv {sorted(conv_dtypes)}")
    with torch.no_grad():
        correct = sum((model(img).argmax(1) == label).sum().item() for img, label, _ in early)
    print(f"METRIC accuracy {correct / len(dataset):.5f}")


if not args.no_train:
    train()
