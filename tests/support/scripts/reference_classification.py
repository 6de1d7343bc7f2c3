"""The structure of torchvision's reference classification script
(references/classification/train.py, as of vision@017e9b99) on synthetic images:
nn.Module transforms in the Dataset, ``scaler = torch.cuda.amp.GradScaler() if
args.amp else None``, the loss under ``torch.cuda.amp.autocast()``, and, with
``--amp``, ``scaler.step(optimizer)`` followed by the loop's own ``optimizer.step()``.
On a CPU torch disables that autocast and GradScaler. Knows nothing of ampkit."""

import argparse

import torch
from torch import nn


class RandomHorizontalFlip(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.p = p

    def forward(self, img):
        return img.flip(-1) if torch.rand(1).item() < self.p else img


class Normalize(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, img):
        return (img - self.mean) / self.std


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, img):
        for t in self.transforms:
            img = t(img)
        return img


class FakeImages(torch.utils.data.Dataset):
    def __init__(self, n, transform):
        self.n, self.transform = n, transform

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        gen = torch.Generator().manual_seed(i)
        label = i % 3
        img = 0.2 * torch.rand(3, 12, 12, generator=gen)
        img[label] += 0.5
        return self.transform(img), label


def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, scaler=None):
    model.train()
    for image, target in data_loader:
        image, target = image.to(device), target.to(device)
        output = model(image)

        optimizer.zero_grad()
        if args.amp:
            with torch.cuda.amp.autocast():
                loss = criterion(output, target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss = criterion(output, target)
            loss.backward()

        if args.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)

        optimizer.step()


def evaluate(model, criterion, data_loader, device):
    model.eval()
    correct = total = 0
    with torch.inference_mode():
        for image, target in data_loader:
            output = model(image.to(device))
            correct += (output.argmax(1) == target).sum().item()
            total += target.numel()
    return correct / total


def main(args):
    torch.manual_seed(0)
    device = torch.device(args.device)
    train = FakeImages(20 * args.batch_size, Compose([RandomHorizontalFlip(), Normalize(0.3, 0.2)]))
    test = FakeImages(64, Compose([Normalize(0.3, 0.2)]))
    data_loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    data_loader_test = torch.utils.data.DataLoader(test, batch_size=args.batch_size, num_workers=args.workers)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)
    ).to(device)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, scaler)
        lr_scheduler.step()
        accuracy = evaluate(model, criterion, data_loader_test, device=device)
    print(f"METRIC accuracy {accuracy:.5f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("-b", "--batch-size", default=8, type=int)
    parser.add_argument("--epochs", default=1, type=int)
    parser.add_argument("-j", "--workers", default=0, type=int)
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--clip-grad-norm", default=None, type=float)
    parser.add_argument("--amp", action="store_true")
    main(parser.parse_args())
